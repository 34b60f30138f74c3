//! A simulated node session: the daemon's protocol without hardware, journal or disk, light
//! enough to hold tens of thousands at once in one process. It applies every desired state at
//! once (reporting its generation), acknowledges and succeeds every command, and heartbeats. For
//! benchmarks and the fleet simulator; tests of the real daemon use [`crate::Daemon`].

use std::sync::Arc;
use std::time::Duration;

use better_compute_proto::v1::gateway_client::GatewayClient;
use better_compute_proto::v1::{
    daemon_message, gateway_message, CommandAck, CommandResult, Heartbeat, Hello, SectionState, SectionStatus, SpecStatus,
};
use tokio::sync::{mpsc, watch};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::daemon_msg;

/// What a simulated node tells its observer.
pub trait SimObserver: Send + Sync + 'static {
    /// A command reached the node.
    fn command(&self, _node_id: &str, _command_id: &str) {}
    /// The node applied a generation.
    fn applied(&self, _node_id: &str, _generation: i64) {}
}

/// One simulated node's credentials and where to connect.
#[derive(Clone)]
pub struct SimNode {
    /// Its node id.
    pub node_id: String,
    /// Its certificate, PEM.
    pub cert_pem: String,
    /// Its key, PEM.
    pub key_pem: String,
    /// The CA, PEM.
    pub ca_pem: String,
    /// The gateway, https://host:port.
    pub gateway_url: String,
    /// Heartbeat interval.
    pub heartbeat: Duration,
}

impl SimNode {
    /// Opens the session and holds it until `stop` turns true or the gateway ends it. `ready` is
    /// told once the gateway said Welcome.
    pub async fn run(self, observer: Arc<dyn SimObserver>, ready: Option<tokio::sync::oneshot::Sender<()>>, mut stop: watch::Receiver<bool>) -> Result<(), String> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name("localhost");
        let channel = Endpoint::from_shared(self.gateway_url.clone())
            .map_err(|e| e.to_string())?
            .tls_config(tls)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(30))
            .connect()
            .await
            .map_err(|e| format!("{e:?}"))?;
        let mut client = GatewayClient::new(channel);
        let (tx, rx) = mpsc::channel(64);
        let hello = Hello {
            node_id: self.node_id.clone(),
            boot_id: "sim-boot".into(),
            journal_id: "sim-journal".into(),
            observed_generation: 0,
            daemon_version: "sim".into(),
            inventory_digest: String::new(),
        };
        tx.send(daemon_msg(daemon_message::Msg::Hello(hello))).await.map_err(|e| e.to_string())?;
        let mut inbound = client.session(tokio_stream::wrappers::ReceiverStream::new(rx)).await.map_err(|s| s.to_string())?.into_inner();
        let mut ready = ready;
        let mut beat = tokio::time::interval(self.heartbeat);
        beat.tick().await;
        loop {
            tokio::select! {
                _ = async { let _ = stop.wait_for(|s| *s).await; } => return Ok(()),
                _ = beat.tick() => { let _ = tx.send(daemon_msg(daemon_message::Msg::Heartbeat(Heartbeat {}))).await; }
                m = inbound.message() => {
                    let Some(m) = m.map_err(|s| s.to_string())? else { return Ok(()) };
                    match m.msg {
                        Some(gateway_message::Msg::Welcome(_)) => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(());
                            }
                        }
                        Some(gateway_message::Msg::DesiredState(d)) => {
                            let sections = ["site", "agent", "allocations", "gpus"]
                                .iter()
                                .map(|s| SectionStatus { section: s.to_string(), state: SectionState::Converged as i32, message: String::new() })
                                .collect();
                            let status = SpecStatus { generation: d.generation, sections, observed_generation: d.generation, instances: Vec::new() };
                            let _ = tx.send(daemon_msg(daemon_message::Msg::SpecStatus(status))).await;
                            observer.applied(&self.node_id, d.generation);
                        }
                        Some(gateway_message::Msg::Command(c)) => {
                            observer.command(&self.node_id, &c.command_id);
                            let _ = tx.send(daemon_msg(daemon_message::Msg::CommandAck(CommandAck { command_id: c.command_id.clone() }))).await;
                            let result = CommandResult { command_id: c.command_id, succeeded: true, reason: String::new(), result_json: "{}".into() };
                            let _ = tx.send(daemon_msg(daemon_message::Msg::CommandResult(result))).await;
                        }
                        Some(gateway_message::Msg::Cancel(_)) | None => {}
                    }
                }
            }
        }
    }
}
