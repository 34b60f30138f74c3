//! The gateway: a tonic gRPC server daemons hold their sessions with, over mTLS. It is a thin skin
//! over the nodes module's session, join and command functions: it holds sessions in memory
//! ([`hub`]), supersedes older ones by session epoch, sends desired state and commands, applies the
//! daemons' reports, flushes liveness as ages in batches, holds a 20 s gateway lease, and wakes on
//! pokes (LISTEN/NOTIFY on a direct connection) as well as polling.

pub mod ca;
mod dispatch;
pub mod hub;
mod lease;
mod liveness;
mod reports;
mod service;

use dispatch::{listen_for_pokes, Poke};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use better_compute_core::lease::GATEWAY_LEASE_RENEW_EVERY_S;
use better_compute_db::{DbError, Lease, Pool};
use better_compute_nodes::sessions;
use better_compute_proto::v1::{gateway_message, Cancel, Command, CommandBody, DesiredState, GatewayMessage, NodeSpec};
use prost::Message;
use tokio::sync::{watch, Semaphore};

pub use ca::Ca;

/// The metrics the gateway writes.
pub const METRICS: &[better_compute_runtime::metrics::Metric] = {
    use better_compute_runtime::metrics::m;
    use better_compute_runtime::metrics::MetricKind::{Counter, Gauge, Histogram};
    &[
        m("better_compute_gateway_sessions", Gauge, &[], "gateway", "Daemon sessions this gateway holds open."),
        m("better_compute_gateway_commands_sent_total", Counter, &[], "gateway", "Commands sent to daemons."),
        m("better_compute_gateway_commands_settled_total", Counter, &[], "gateway", "Command results the gateway settled."),
        m("better_compute_gateway_dispatch_seconds", Histogram, &[], "gateway", "From a command's enqueue to its sending to the daemon."),
        m("better_compute_gateway_report_flush_sessions", Histogram, &[], "gateway", "Sessions whose reports one flush wrote together."),
    ]
};

/// How a gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Its id (`gw_…`): its lease is `gateway:<id>`.
    pub id: String,
    /// Where it listens (port 0 picks one).
    pub listen: String,
    /// The names and addresses daemons reach it by: its server certificate's subject names.
    pub hostnames: Vec<String>,
    /// A direct (not pooled) connection string for LISTEN; `None` polls only.
    pub listen_url: Option<String>,
    /// How often it polls for commands and desired state that a lost poke did not announce.
    pub poll_interval: Duration,
    /// How often it writes `last seen` for its sessions.
    pub flush_interval: Duration,
    /// Messages queued per session before the gateway stops dispatching to it.
    pub session_queue: usize,
    /// Dispatches and pushes in flight at once.
    pub dispatch_concurrency: usize,
    /// How long a node certificate is valid.
    pub node_cert_lifetime: Duration,
    /// How long a daemon has to say Hello.
    pub hello_timeout: Duration,
    /// The command-signing key's public half, handed to each daemon that joins (empty: none, and
    /// those daemons refuse every destructive command).
    pub command_key: Vec<u8>,
    /// An operator's server certificate chain and key (PEM) instead of one the gateway signs for
    /// itself from the CA for `hostnames`; daemons must then trust its issuer (`--ca-cert`).
    pub server_identity: Option<(String, String)>,
    /// The modules' watches of what nodes report (`Registry::status_watches`): the report path
    /// wakes their jobs.
    pub status_watches: Vec<better_compute_runtime::nodespec::StatusWatch>,
}

impl GatewayConfig {
    /// Defaults for a gateway with this id listening on `listen`.
    pub fn new(id: impl Into<String>, listen: impl Into<String>) -> GatewayConfig {
        GatewayConfig {
            id: id.into(),
            listen: listen.into(),
            hostnames: vec!["localhost".into(), "127.0.0.1".into()],
            listen_url: None,
            poll_interval: Duration::from_secs(1),
            flush_interval: Duration::from_secs(2),
            session_queue: 256,
            dispatch_concurrency: 32,
            node_cert_lifetime: ca::NODE_CERT_LIFETIME,
            hello_timeout: Duration::from_secs(10),
            command_key: Vec::new(),
            server_identity: None,
            status_watches: Vec::new(),
        }
    }
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The database.
    #[error(transparent)]
    Db(#[from] DbError),
    /// The CA.
    #[error(transparent)]
    Ca(#[from] ca::CaError),
    /// Listening or TLS.
    #[error("gateway transport: {0}")]
    Transport(String),
    /// Another process holds this gateway id's lease.
    #[error("another process holds the lease of gateway {0}")]
    LeaseHeld(String),
}

/// The daemon-facing service, as the health service names it.
pub(crate) type GatewayServer = better_compute_proto::v1::gateway_server::GatewayServer<service::GatewayService>;

pub(crate) struct Inner {
    /// The gRPC health service's state (`grpc.health.v1`): SERVING while the gateway holds its
    /// lease and is not stopping.
    pub(crate) health: tonic_health::server::HealthReporter,
    pub(crate) cfg: GatewayConfig,
    pub(crate) pool: Pool,
    pub(crate) ca: Arc<Ca>,
    pub(crate) hub: hub::Hub,
    dispatching: Arc<Semaphore>,
    /// Where session readers hand their daemons' reports to the group appliers.
    reports: reports::Queue,
    /// Business time, sampled at start and at every lease renewal (`clock.skew`).
    clock: better_compute_db::Clock,
    /// Set once a clean stop began: new sessions are refused.
    pub(crate) stopping: std::sync::atomic::AtomicBool,
}

/// A running gateway.
pub struct Gateway {
    inner: Arc<Inner>,
    addr: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Gateway {
    /// Takes the gateway lease, binds, and serves until `shutdown` turns true.
    pub async fn start(pool: Pool, ca: Arc<Ca>, cfg: GatewayConfig, shutdown: watch::Receiver<bool>) -> Result<Gateway, GatewayError> {
        let lease_name = sessions::gateway_lease_name(&cfg.id);
        let lease = {
            // Every statement in a transaction: safe behind PgBouncer in transaction pooling.
            let mut c = pool.get().await.map_err(DbError::from)?;
            let tx = c.transaction().await.map_err(DbError::from)?;
            let clock = better_compute_db::Clock::start(&*tx).await?;
            let lease = Lease::acquire(&*tx, &lease_name, &cfg.id, better_compute_db::lease::GATEWAY_LEASE_TTL, Some(&clock)).await?;
            tx.commit().await.map_err(DbError::from)?;
            (lease.ok_or_else(|| GatewayError::LeaseHeld(cfg.id.clone()))?, clock)
        };
        let (lease, clock) = lease;
        let (cert, key) = match &cfg.server_identity {
            Some(given) => given.clone(),
            None => ca.server_identity(&cfg.hostnames)?,
        };
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(cert, key))
            .client_ca_root(tonic::transport::Certificate::from_pem(ca.cert_pem()))
            // Join comes without a client certificate; Session and RotateCertificate demand one.
            .client_auth_optional(true);
        let listener = tokio::net::TcpListener::bind(&cfg.listen).await.map_err(|e| GatewayError::Transport(format!("listen on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr().map_err(|e| GatewayError::Transport(e.to_string()))?;
        let (report_tx, report_rx) = tokio::sync::mpsc::channel(reports::REPORT_QUEUE);
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<GatewayServer>().await;
        let inner = Arc::new(Inner {
            health,
            dispatching: Arc::new(Semaphore::new(cfg.dispatch_concurrency.max(1))),
            reports: report_tx,
            cfg,
            pool,
            ca,
            hub: hub::Hub::new(),
            clock,
            stopping: Default::default(),
        });
        let server = tonic::transport::Server::builder()
            .tls_config(tls)
            .map_err(|e| GatewayError::Transport(e.to_string()))?
            // A dead peer is noticed within 20 s: well inside the 40 s before a node is unreachable.
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .tcp_nodelay(true)
            .add_service(health_service)
            .add_service(GatewayServer::new(service::GatewayService { inner: inner.clone() }));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let mut stop = shutdown.clone();
        let mut tasks = vec![tokio::spawn({
            let inner = inner.clone();
            async move {
                let stopping = inner.clone();
                let r = server
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = stop.wait_for(|s| *s).await;
                        // Closes every session and ends every stream, so the graceful shutdown has
                        // nothing to wait for.
                        stopping.close_all().await;
                    })
                    .await;
                if let Err(e) = r {
                    tracing::error!(error = %e, "gateway server stopped");
                }
                inner.hub.clear("this gateway stopped");
            }
        })];
        tasks.push(tokio::spawn(inner.clone().keep_lease(lease, shutdown.clone())));
        tasks.push(tokio::spawn(inner.clone().flush_loop(shutdown.clone())));
        let report_rx = Arc::new(tokio::sync::Mutex::new(report_rx));
        for _ in 0..reports::REPORT_APPLIERS {
            tasks.push(tokio::spawn(inner.clone().report_loop(report_rx.clone(), shutdown.clone())));
        }
        let (poke_tx, poke_rx) = tokio::sync::mpsc::channel::<Poke>(4096);
        tasks.push(tokio::spawn(inner.clone().poke_loop(poke_rx, shutdown.clone())));
        if let Some(url) = inner.cfg.listen_url.clone() {
            tasks.push(tokio::spawn(listen_for_pokes(url, poke_tx.clone(), shutdown.clone())));
        }
        tasks.push(tokio::spawn(inner.clone().poll_loop(shutdown)));
        Ok(Gateway { inner, addr, tasks })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its id.
    pub fn id(&self) -> &str {
        &self.inner.cfg.id
    }

    /// Sessions held now.
    pub fn sessions(&self) -> usize {
        self.inner.hub.len()
    }

    /// Its self-checks: `clock.skew`, from the samples its lease renewals take.
    pub fn self_check(&self) -> Vec<better_compute_db::clock::SelfCheck> {
        self.inner.clock.self_check()
    }

    /// Waits for its tasks after shutdown turned true.
    pub async fn join(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Slots reserved in a session's queue for the commands of one dispatch.
pub(crate) type Reserved<'s> = tokio::sync::mpsc::PermitIterator<'s, Result<GatewayMessage, tonic::Status>>;

/// Where the CA lives when nothing else is said: `<data>/ca`.
pub fn default_ca_dir(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("ca")
}
