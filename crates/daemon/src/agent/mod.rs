//! The daemon: its session loop here (one session at a time, reconnecting with exponential back-off
//! and jitter; desired state applied as it comes), command admission in `admission.rs` (checked in
//! the spec's order: UNSUPPORTED, STALE_GENERATION after waiting until notAfter, EXPIRED, BUSY;
//! journaled before it is acknowledged; run in its lane; its outcome journaled before it is
//! reported), and each kind's execution in `execution.rs`.

mod admission;
mod execution;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use better_compute_proto::v1::gateway_client::GatewayClient;
use better_compute_proto::v1::{
    command_body::Payload, daemon_message, gateway_message, Command, CommandAck, CommandReject, CommandResult, ConsoleOutput, DaemonMessage, GatewayMessage, GpusSection,
    Health, Heartbeat, Hello, JoinRequest, NodeSpec, RejectReason, RotateCertificateRequest, SpecStatus,
};
use prost::Message;
use tracing::Instrument;
use tokio::sync::{mpsc, watch};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::backend::GpuBackend;
use crate::converge::{self, Applied};
use crate::identity::{self, Identity};
use crate::journal::{Journal, Outcome};
use crate::logs::LogRing;
use crate::{daemon_msg, DaemonConfig, DaemonError, RebootHook};

/// The kinds this daemon runs.
pub const KINDS: &[&str] = &["diag.nvml", "inventory.refresh", "logs.collect", "node.reboot", "vps.bootstrap"];
/// Messages queued to the gateway.
const OUTBOUND_QUEUE: usize = 256;
/// Heartbeats between two convergences of a vps host's VMs on the spec it applied.
pub const RECHECK_BEATS: u64 = 6;
/// How often a vps host sends what its VMs wrote to their consoles.
pub const CONSOLE_INTERVAL: Duration = Duration::from_secs(1);
/// Console bytes sent per VM per [`CONSOLE_INTERVAL`] at most.
pub const CONSOLE_CHUNK_BYTES: usize = 16 << 10;
/// How far back a new session starts each VM's console: what the control plane keeps of it.
pub const CONSOLE_CATCH_UP_BYTES: u64 = 64 << 10;

struct Waiting {
    cmd: Command,
    deadline: Instant,
}

/// What of a GPU's health, when it changes, makes a report go out: not its temperature or its
/// corrected ECC count, which move all the time and are sent along with the next report.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HealthSummary {
    uuid: String,
    healthy: bool,
    pcie_degraded: bool,
    throttle_reasons: u64,
    ecc_uncorrected: u64,
    retired_pages: (u32, bool),
    remapped_rows: (u32, bool, bool),
    nvlink_errors: u64,
}

impl HealthSummary {
    fn of(g: &better_compute_proto::v1::GpuHealth) -> HealthSummary {
        HealthSummary {
            uuid: g.uuid.clone(),
            healthy: g.healthy,
            pcie_degraded: g.pcie_link_width < g.pcie_link_width_max || g.pcie_link_gen < g.pcie_link_gen_max,
            throttle_reasons: g.throttle_reasons,
            ecc_uncorrected: g.ecc_uncorrected,
            retired_pages: (g.retired_pages, g.retired_pages_pending),
            remapped_rows: (g.remapped_rows, g.remap_pending, g.remap_failed),
            nvlink_errors: g.nvlink_errors,
        }
    }
}

#[derive(Default)]
struct State {
    applied_generation: i64,
    applied: Option<Applied>,
    /// A spec not yet fully converged, retried every heartbeat.
    pending: Option<(i64, NodeSpec)>,
    in_lane: HashMap<String, u32>,
    /// Each running command: its lane, its task, and whether a cancel may still stop it (taken
    /// back with a compare-and-swap by whichever comes first, the cancel or the command's point of
    /// no return).
    running: HashMap<String, (String, tokio::task::AbortHandle, Arc<AtomicBool>)>,
    waiting: Vec<Waiting>,
    /// What the last health report said of each GPU: a report goes out when this changes or new
    /// XIDs arrived.
    last_health: Vec<HealthSummary>,
    /// XIDs taken from the backend while no session was open, for the next report.
    unsent_xids: HashMap<String, Vec<u32>>,
    inventory_sent: bool,
    /// What the hypervisor last said of the instances (vps-host nodes), sent with every spec status.
    instances: Vec<better_compute_proto::v1::InstanceObserved>,
    /// The spec last applied in full, converged again every [`RECHECK_BEATS`] heartbeats on a
    /// vps host (a VM that died is started again, one nobody asked for is deleted).
    last_spec: Option<(i64, NodeSpec)>,
    /// Heartbeats this daemon has sent.
    beats: u64,
    /// How much of each VM's console this session has sent.
    console_sent: HashMap<String, u64>,
}

/// The node agent.
pub struct Daemon {
    cfg: DaemonConfig,
    backend: Arc<dyn GpuBackend>,
    journal: Arc<Journal>,
    logs: Arc<LogRing>,
    identity: Mutex<Identity>,
    run_id: String,
    state: Mutex<State>,
    out: Mutex<Option<mpsc::Sender<DaemonMessage>>>,
    /// Woken by the backend as each health event (an XID) arrives.
    health_events: Arc<tokio::sync::Notify>,
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    hex::encode(b)
}

fn kind_of(p: &Payload) -> &'static str {
    match p {
        Payload::DiagNvml(_) => "diag.nvml",
        Payload::InventoryRefresh(_) => "inventory.refresh",
        Payload::LogsCollect(_) => "logs.collect",
        Payload::NodeReboot(_) => "node.reboot",
        Payload::VpsBootstrap(_) => "vps.bootstrap",
    }
}

async fn endpoint(cfg: &DaemonConfig, ca_pem: &str, identity: Option<&Identity>) -> Result<Channel, DaemonError> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem)).domain_name(cfg.server_name.clone());
    // The CA given at start (`--ca-cert`) is trusted for the gateway besides the fleet's CA pinned
    // at join: a gateway serving an operator's certificate is reached through it.
    if let Some(given) = cfg.ca_pem.as_deref().filter(|g| *g != ca_pem) {
        tls = tls.ca_certificate(Certificate::from_pem(given));
    }
    if let Some(id) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(&id.cert_pem, &id.key_pem));
    }
    let ep = Endpoint::from_shared(cfg.gateway_url.clone())
        .map_err(|e| DaemonError::Config(format!("gateway URL {:?}: {e}", cfg.gateway_url)))?
        .tls_config(tls)
        .map_err(|e| DaemonError::Config(format!("TLS: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        // With the gateway's own pings, a dead link is noticed within 20 s.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    ep.connect().await.map_err(|e| DaemonError::Transport(format!("connect to {}: {e:?}", cfg.gateway_url)))
}

impl Daemon {
    /// Opens the journal, joins if the node has no identity yet, and converges the desired state
    /// the journal holds (a node that restarted must expose exactly what it did).
    pub async fn start(cfg: DaemonConfig, backend: Arc<dyn GpuBackend>) -> Result<Arc<Daemon>, DaemonError> {
        std::fs::create_dir_all(&cfg.state_dir).map_err(|e| DaemonError::Config(format!("state folder {}: {e}", cfg.state_dir.display())))?;
        let journal = Arc::new(Journal::open(&cfg.state_dir.join("journal.redb")).map_err(|e| DaemonError::Journal(e.to_string()))?);
        let identity = match Identity::load(&cfg.state_dir).map_err(|e| DaemonError::Config(e.to_string()))? {
            Some(id) => id,
            None => Self::join(&cfg, backend.as_ref()).await?,
        };
        let d = Arc::new(Daemon {
            cfg,
            backend,
            journal,
            logs: Arc::new(LogRing::default()),
            identity: Mutex::new(identity),
            run_id: random_hex(8),
            state: Mutex::new(State::default()),
            out: Mutex::new(None),
            health_events: Arc::new(tokio::sync::Notify::new()),
        });
        let wake = d.health_events.clone();
        d.backend.watch_health(Arc::new(move || wake.notify_one()));
        // The layouts last applied: what the allocations the spec below holds were placed on.
        if let Some(bytes) = d.journal.gpu_layouts().map_err(|e| DaemonError::Journal(e.to_string()))?
            && let Ok(section) = GpusSection::decode(bytes.as_slice())
        {
            let mut applied = Applied::initial();
            applied.layouts = section.gpus.into_iter().map(|g| (g.uuid.clone(), g)).collect();
            d.state.lock().expect("state").applied = Some(applied);
        }
        if let Some((generation, bytes)) = d.journal.applied_spec().map_err(|e| DaemonError::Journal(e.to_string()))?
            && let Ok(spec) = NodeSpec::decode(bytes.as_slice()) {
                d.apply_spec(generation, spec).await;
            }
        d.logs.line(format!("daemon started: node {}, journal {}, boot {}", d.node_id(), d.journal.id(), d.cfg.boot_id));
        Ok(d)
    }

    /// The kinds this daemon runs: every kind, less `node.reboot` when no reboot is configured
    /// (admission answers UNSUPPORTED for it rather than accepting it and failing after the grace).
    fn kinds_run(&self) -> Vec<&'static str> {
        let can_reboot = !matches!(self.cfg.reboot, RebootHook::Disabled);
        KINDS.iter().copied().filter(|k| can_reboot || *k != "node.reboot").collect()
    }

    /// The deliberately broken daemon of the checker's test: only a test build can be one.
    fn reruns_journaled_commands(&self) -> bool {
        cfg!(feature = "fault-injection") && self.cfg.broken_rerun_journaled_commands
    }

    async fn join(cfg: &DaemonConfig, backend: &dyn GpuBackend) -> Result<Identity, DaemonError> {
        let token = cfg.join_token.clone().ok_or_else(|| {
            DaemonError::Config(format!("{} holds no node identity: pass --join-token (and --ca-cert) to join", cfg.state_dir.display()))
        })?;
        let ca = cfg.ca_pem.clone().ok_or_else(|| DaemonError::Config("joining needs the control plane's CA certificate (--ca-cert)".into()))?;
        let req = identity::request(&cfg.node_name).map_err(|e| DaemonError::Config(e.to_string()))?;
        let mut inv = backend.inventory().map_err(|e| DaemonError::Backend(e.to_string()))?;
        cfg.host.fill(&mut inv);
        let mut client = GatewayClient::new(endpoint(cfg, &ca, None).await?);
        let r = client
            .join(JoinRequest { join_token: token, csr_pem: req.csr_pem.clone(), node_name: cfg.node_name.clone(), labels: cfg.labels.clone(), inventory: Some(inv) })
            .await
            .map_err(|s| DaemonError::Refused(s.message().to_owned()))?
            .into_inner();
        let grant = r.certificate.ok_or_else(|| DaemonError::Transport("join answered without a certificate".into()))?;
        let keys = if r.command_key.is_empty() { Vec::new() } else { vec![r.command_key] };
        let id = Identity::from_grant(&r.node_id, req, grant, keys);
        id.save(&cfg.state_dir).map_err(|e| DaemonError::Config(e.to_string()))?;
        Ok(id)
    }

    /// Pins or forgets command-signing keys as the spec's `agent` section announces them (a key
    /// rotation), keeping the state folder in step.
    fn follow_command_keys(&self, spec: &NodeSpec) {
        let announced = spec.agent.as_ref().map(|a| a.command_keys.as_slice()).unwrap_or_default();
        let mut id = self.identity.lock().expect("identity");
        let keys = identity::follow_command_keys(&id.command_keys, announced);
        if keys == id.command_keys {
            return;
        }
        if let Err(e) = identity::save_command_keys(&self.cfg.state_dir, &keys) {
            // Not pinned on disk: keep the old keys, and try again with the next spec.
            self.logs.line(format!("cannot pin the rotated command-signing keys: {e}"));
            return;
        }
        self.logs.line(format!("command-signing keys rotated: {} accepted", keys.len()));
        id.command_keys = keys;
    }

    /// The node's id.
    pub fn node_id(&self) -> String {
        self.identity.lock().expect("identity").node_id.clone()
    }

    /// The journal's id.
    pub fn journal_id(&self) -> &str {
        self.journal.id()
    }

    /// The generation this daemon has applied.
    pub fn applied_generation(&self) -> i64 {
        self.state.lock().expect("state").applied_generation
    }


    /// Holds sessions until `shutdown` turns true, reconnecting with back-off and jitter.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut attempt = 0u32;
        while !*shutdown.borrow() {
            let welcomed = match self.session(&mut shutdown).await {
                Ok(w) => w,
                Err(e) => {
                    self.logs.line(format!("session ended: {e}"));
                    false
                }
            };
            attempt = if welcomed { 0 } else { attempt.saturating_add(1) };
            let wait = backoff(self.cfg.backoff_min, self.cfg.backoff_max, attempt);
            tokio::select! {
                _ = stopped(&mut shutdown) => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Rotates the certificate now: a new key and CSR over the current mTLS identity.
    pub async fn rotate_certificate(&self) -> Result<(), DaemonError> {
        let current = self.identity.lock().expect("identity").clone();
        let mut client = GatewayClient::new(endpoint(&self.cfg, &current.ca_pem, Some(&current)).await?);
        let req = identity::request(&self.cfg.node_name).map_err(|e| DaemonError::Config(e.to_string()))?;
        let grant = client
            .rotate_certificate(RotateCertificateRequest { csr_pem: req.csr_pem.clone() })
            .await
            .map_err(|s| DaemonError::Refused(s.message().to_owned()))?
            .into_inner();
        let id = Identity::from_grant(&current.node_id, req, grant, current.command_keys.clone());
        id.save(&self.cfg.state_dir).map_err(|e| DaemonError::Config(e.to_string()))?;
        *self.identity.lock().expect("identity") = id;
        self.logs.line("certificate rotated");
        Ok(())
    }

    /// One session; `Ok(true)` when the gateway welcomed it.
    async fn session(self: &Arc<Self>, shutdown: &mut watch::Receiver<bool>) -> Result<bool, DaemonError> {
        if self.identity.lock().expect("identity").rotation_due(unix_now())
            && let Err(e) = self.rotate_certificate().await {
                self.logs.line(format!("certificate rotation failed (trying again later): {e}"));
            }
        let id = self.identity.lock().expect("identity").clone();
        let mut client = GatewayClient::new(endpoint(&self.cfg, &id.ca_pem, Some(&id)).await?);
        let (tx, rx) = mpsc::channel(OUTBOUND_QUEUE);
        let hello = Hello {
            node_id: id.node_id.clone(),
            boot_id: self.cfg.boot_id.clone(),
            journal_id: self.journal.id().to_owned(),
            observed_generation: self.applied_generation(),
            daemon_version: env!("CARGO_PKG_VERSION").to_owned(),
            inventory_digest: String::new(),
        };
        tx.send(daemon_msg(daemon_message::Msg::Hello(hello))).await.map_err(|_| DaemonError::Transport("session closed".into()))?;
        let mut inbound = client
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| DaemonError::Refused(format!("{}: {}", s.code(), s.message())))?
            .into_inner();
        *self.out.lock().expect("out") = Some(tx.clone());
        let mut welcomed = false;
        let heartbeat_ms = self.state.lock().expect("state").applied.as_ref().map(|a| a.heartbeat_ms).unwrap_or(5_000);
        let mut beat = tokio::time::interval(Duration::from_millis(heartbeat_ms as u64));
        beat.tick().await;
        let mut console = tokio::time::interval(CONSOLE_INTERVAL);
        console.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let hypervisor = self.cfg.hypervisor.is_some();
        let result = loop {
            tokio::select! {
                _ = stopped(shutdown) => break Ok(welcomed),
                m = inbound.message() => match m {
                    Ok(Some(m)) => {
                        if matches!(m.msg, Some(gateway_message::Msg::Welcome(_))) {
                            welcomed = true;
                        }
                        self.handle(m).await;
                    }
                    Ok(None) => break Ok(welcomed),
                    Err(s) => break Err(DaemonError::Transport(format!("{}: {}", s.code(), s.message()))),
                },
                _ = beat.tick() => self.tick(&tx).await,
                _ = console.tick(), if welcomed && hypervisor => self.send_consoles().await,
                // An XID is reported as it happens, not at the next heartbeat.
                _ = self.health_events.notified(), if welcomed => self.report_health(false).await,
            }
        };
        *self.out.lock().expect("out") = None;
        result
    }

    /// Sends on the open session; false when there is none (or it just closed).
    async fn send(&self, m: daemon_message::Msg) -> bool {
        let out = self.out.lock().expect("out").clone();
        match out {
            // A closed session loses nothing: outcomes are in the journal and the gateway sends
            // in-flight commands again on the next session.
            Some(out) => out.send(daemon_msg(m)).await.is_ok(),
            None => false,
        }
    }

    /// Every heartbeat: say so, report health changes, retry a pending spec, expire waiting commands.
    async fn tick(self: &Arc<Self>, tx: &mpsc::Sender<DaemonMessage>) {
        let _ = tx.send(daemon_msg(daemon_message::Msg::Heartbeat(Heartbeat {}))).await;
        self.report_health(false).await;
        let (pending, recheck) = {
            let mut st = self.state.lock().expect("state");
            st.beats += 1;
            let recheck = if st.beats.is_multiple_of(RECHECK_BEATS) && self.cfg.hypervisor.is_some() { st.last_spec.clone() } else { None };
            (st.pending.clone(), recheck)
        };
        if let Some((generation, spec)) = pending {
            self.apply_spec(generation, spec).await;
        } else if let Some((_, spec)) = recheck {
            self.recheck_instances(spec).await;
        }
        let now = Instant::now();
        let expired: Vec<Command> = {
            let mut st = self.state.lock().expect("state");
            let (gone, keep) = std::mem::take(&mut st.waiting).into_iter().partition(|w| w.deadline <= now);
            st.waiting = keep;
            gone.into_iter().map(|w: Waiting| w.cmd).collect()
        };
        for c in expired {
            self.reject(&c.command_id, RejectReason::StaleGeneration, "its minGeneration was not applied before notAfter").await;
        }
    }

    async fn report_health(&self, always: bool) {
        let backend = self.backend.clone();
        let Ok(Ok(mut gpus)) = tokio::task::spawn_blocking(move || backend.health()).await else { return };
        let (changed, any_xid) = {
            let mut st = self.state.lock().expect("state");
            // XIDs taken while no session was open go first, in order.
            for g in &mut gpus {
                if let Some(mut earlier) = st.unsent_xids.remove(&g.uuid) {
                    earlier.append(&mut g.xid_errors);
                    g.xid_errors = earlier;
                }
            }
            let summary: Vec<HealthSummary> = gpus.iter().map(HealthSummary::of).collect();
            let changed = st.last_health != summary;
            st.last_health = summary;
            (changed, gpus.iter().any(|g| !g.xid_errors.is_empty()))
        };
        if changed || any_xid || always {
            for g in gpus.iter().filter(|g| !g.healthy) {
                self.logs.line(format!("GPU {} unhealthy: {}", g.uuid, g.reason));
            }
            for g in gpus.iter().filter(|g| !g.xid_errors.is_empty()) {
                self.logs.line(format!("GPU {} XIDs {:?}", g.uuid, g.xid_errors));
            }
            let xids: Vec<(String, Vec<u32>)> = gpus.iter().filter(|g| !g.xid_errors.is_empty()).map(|g| (g.uuid.clone(), g.xid_errors.clone())).collect();
            if !self.send(daemon_message::Msg::Health(Health { gpus })).await {
                // No session: keep the XIDs for the next one (bounded per GPU, as the backend's).
                let mut st = self.state.lock().expect("state");
                for (uuid, x) in xids {
                    let q = st.unsent_xids.entry(uuid).or_default();
                    q.extend(x);
                    let over = q.len().saturating_sub(256);
                    q.drain(..over);
                }
            }
        }
    }

    async fn handle(self: &Arc<Self>, m: GatewayMessage) {
        let Some(m) = m.msg else { return };
        match m {
            gateway_message::Msg::Welcome(w) => {
                self.logs.line(format!("session {} open; generation {}", w.session_epoch, w.generation));
                // The last session's console bytes may not have reached the database.
                self.state.lock().expect("state").console_sent.clear();
                let first = !std::mem::replace(&mut self.state.lock().expect("state").inventory_sent, true);
                if first {
                    self.send_inventory().await;
                    self.report_health(true).await;
                }
                // The database may have missed our last report: say again what is applied.
                self.report_spec_status(None).await;
            }
            gateway_message::Msg::DesiredState(d) => {
                if let Some(spec) = d.spec {
                    self.apply_spec(d.generation, spec).await;
                }
            }
            gateway_message::Msg::Command(c) => self.clone().command(c).await,
            gateway_message::Msg::Cancel(c) => self.cancel(&c.command_id).await,
        }
    }

    async fn send_inventory(&self) {
        let backend = self.backend.clone();
        if let Ok(Ok(mut inv)) = tokio::task::spawn_blocking(move || backend.inventory()).await {
            self.cfg.host.fill(&mut inv);
            self.send(daemon_message::Msg::Inventory(inv)).await;
        }
    }

    async fn report_spec_status(&self, sections: Option<(i64, Vec<better_compute_proto::v1::SectionStatus>)>) {
        let applied = self.applied_generation();
        if applied == 0 && sections.is_none() {
            return;
        }
        let (generation, sections) = sections.unwrap_or((applied, Vec::new()));
        let instances = self.state.lock().expect("state").instances.clone();
        self.send(daemon_message::Msg::SpecStatus(SpecStatus { generation, sections, observed_generation: applied, instances })).await;
    }

    /// Converges `spec`; the generation counts as applied only when no section is pending.
    async fn apply_spec(self: &Arc<Self>, generation: i64, spec: NodeSpec) {
        let held = {
            let st = self.state.lock().expect("state");
            if generation < st.applied_generation {
                return; // an older spec, delivered late
            }
            st.applied.clone().unwrap_or_else(Applied::initial)
        };
        self.follow_command_keys(&spec);
        let backend = self.backend.clone();
        let s = spec.clone();
        let layouts_before = held.layouts.clone();
        let hv = self.cfg.hypervisor.clone();
        let Ok((c, instances)) = tokio::task::spawn_blocking(move || {
            let mut c = converge::converge(&s, backend.as_ref(), &held);
            // Instances after allocations: a VM runs only on an allocation now held.
            let instances = crate::instances::converge(&s, hv.as_deref(), &c.applied);
            if let Some((section, _)) = &instances {
                c.done &= section.state != better_compute_proto::v1::SectionState::Pending as i32;
                c.sections.push(section.clone());
            }
            (c, instances.map(|(_, observed)| observed))
        })
        .await
        else {
            return;
        };
        if c.applied.layouts != layouts_before {
            let section = GpusSection { gpus: c.applied.layouts.values().cloned().collect() };
            if let Err(e) = self.journal.set_gpu_layouts(&section.encode_to_vec()) {
                self.logs.line(format!("cannot journal the GPUs' layouts: {e}"));
            }
        }
        {
            let mut st = self.state.lock().expect("state");
            st.applied = Some(c.applied.clone());
            if let Some(observed) = instances {
                st.instances = observed;
            }
            if c.done {
                st.applied_generation = st.applied_generation.max(generation);
                st.pending = None;
                if st.last_spec.as_ref().is_none_or(|(g, _)| *g <= generation) {
                    st.last_spec = Some((generation, spec.clone()));
                }
            } else {
                st.pending = Some((generation, spec.clone()));
            }
        }
        if c.done
            && let Err(e) = self.journal.set_applied_spec(generation, &spec.encode_to_vec()) {
                self.logs.line(format!("cannot journal the applied spec: {e}"));
            }
        self.report_spec_status(Some((generation, c.sections))).await;
        // Commands waiting for this generation may go now.
        let ready: Vec<Command> = {
            let mut st = self.state.lock().expect("state");
            let applied = st.applied_generation;
            let (ready, keep) = std::mem::take(&mut st.waiting).into_iter().partition(|w| w.cmd.min_generation <= applied);
            st.waiting = keep;
            ready
                .into_iter()
                .map(|w: Waiting| {
                    let mut c = w.cmd;
                    c.expires_in_ms = w.deadline.saturating_duration_since(Instant::now()).as_millis() as i64;
                    c
                })
                .collect()
        };
        for c in ready {
            Box::pin(self.clone().command(c)).await;
        }
    }

    /// Converges the VMs on the spec applied last, as the kubelet re-syncs its pods: a VM that
    /// died is started again, one nobody asked for is deleted. What the host then has is reported
    /// when it differs from what was.
    async fn recheck_instances(&self, spec: NodeSpec) {
        let Some(held) = self.state.lock().expect("state").applied.clone() else { return };
        let hv = self.cfg.hypervisor.clone();
        let Ok(Some((_, observed))) = tokio::task::spawn_blocking(move || crate::instances::converge(&spec, hv.as_deref(), &held)).await else { return };
        let changed = {
            let mut st = self.state.lock().expect("state");
            let changed = st.instances != observed;
            st.instances = observed;
            changed
        };
        if changed {
            self.report_spec_status(None).await;
        }
    }

    /// Sends what each VM wrote to its console since the last send (a new session starts
    /// [`CONSOLE_CATCH_UP_BYTES`] back), at most [`CONSOLE_CHUNK_BYTES`] per VM.
    async fn send_consoles(&self) {
        let Some(hv) = self.cfg.hypervisor.clone() else { return };
        let wanted: Vec<(String, Option<u64>)> = {
            let mut st = self.state.lock().expect("state");
            let ids: Vec<String> = st.instances.iter().filter(|i| i.state != "failed").map(|i| i.instance_id.clone()).collect();
            st.console_sent.retain(|id, _| ids.contains(id));
            ids.into_iter().map(|id| (id.clone(), st.console_sent.get(&id).copied())).collect()
        };
        if wanted.is_empty() {
            return;
        }
        let Ok(reads) = tokio::task::spawn_blocking(move || {
            wanted
                .into_iter()
                .filter_map(|(id, sent)| {
                    let from = match sent {
                        Some(n) => n,
                        None => hv.console(&id, u64::MAX, 0).ok()?.size.saturating_sub(CONSOLE_CATCH_UP_BYTES),
                    };
                    Some((id.clone(), hv.console(&id, from, CONSOLE_CHUNK_BYTES).ok()?))
                })
                .collect::<Vec<_>>()
        })
        .await
        else {
            return;
        };
        for (id, read) in reads {
            let end = read.offset + read.data.len() as u64;
            let sent = read.data.is_empty()
                || self.send(daemon_message::Msg::ConsoleOutput(ConsoleOutput { instance_id: id.clone(), offset: read.offset, data: read.data })).await;
            if sent {
                self.state.lock().expect("state").console_sent.insert(id, end);
            }
        }
    }
}

async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|s| *s).await;
}

/// Exponential back-off with jitter: `min·2^attempt`, capped at `max`, then a random point in
/// its upper half, so a fleet that lost its gateway does not come back in one wave.
pub fn backoff(min: Duration, max: Duration, attempt: u32) -> Duration {
    let base = min.saturating_mul(1u32 << attempt.min(16)).min(max);
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).expect("the operating system's random source works");
    let frac = u32::from_le_bytes(b) as f64 / u32::MAX as f64;
    base.mul_f64(0.5 + 0.5 * frac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hypervisor::{FakeHypervisor, Hypervisor, VmPower};
    use better_compute_proto::v1::{Allocation, AllocationsSection, Instance, InstancesSection};

    /// A daemon with no session (what it sends goes nowhere) over fake GPUs and a fake hypervisor.
    fn offline_daemon(dir: &std::path::Path, hv: Arc<FakeHypervisor>) -> Arc<Daemon> {
        let mut cfg = DaemonConfig::new("https://127.0.0.1:1", dir, "n1");
        cfg.hypervisor = Some(hv);
        let identity = Identity {
            node_id: "node_1".into(),
            cert_pem: String::new(),
            key_pem: String::new(),
            ca_pem: String::new(),
            not_before_unix_s: 0,
            not_after_unix_s: i64::MAX,
            command_keys: Vec::new(),
        };
        Arc::new(Daemon {
            cfg,
            backend: Arc::new(crate::fake::FakeGpus::parse("fake:1xH100-80GB", "n1").unwrap()),
            journal: Arc::new(Journal::open(&dir.join("journal.redb")).unwrap()),
            logs: Arc::new(LogRing::default()),
            identity: Mutex::new(identity),
            run_id: "r".into(),
            state: Mutex::new(State::default()),
            out: Mutex::new(None),
            health_events: Arc::new(tokio::sync::Notify::new()),
        })
    }

    #[tokio::test]
    async fn a_vm_that_died_is_started_again_within_the_recheck_interval_of_heartbeats() {
        let dir = tempfile::tempdir().unwrap();
        let hv = Arc::new(FakeHypervisor::new(None));
        let d = offline_daemon(dir.path(), hv.clone());
        let gpu = d.backend.inventory().unwrap().gpus[0].uuid.clone();
        let spec = NodeSpec {
            allocations: Some(AllocationsSection {
                allocations: vec![Allocation { allocation_id: "res_a".into(), atoms: vec![gpu], vcpu: 4, memory_mib: 4096, disk_gib: 20, ..Default::default() }],
            }),
            instances: Some(InstancesSection {
                instances: vec![Instance { instance_id: "ins_1".into(), allocation_id: "res_a".into(), running: true, image: "debian-12".into(), ..Default::default() }],
            }),
            ..Default::default()
        };
        d.apply_spec(1, spec).await;
        let power = || hv.list().unwrap().iter().map(|v| v.power.clone()).collect::<Vec<_>>();
        assert_eq!((d.applied_generation(), power()), (1, vec![VmPower::Running]));
        hv.crash("ins_1");
        let (tx, _rx) = mpsc::channel(64);
        for _ in 1..RECHECK_BEATS {
            d.tick(&tx).await;
        }
        assert_eq!(power(), [VmPower::Stopped], "not before the recheck's heartbeat");
        d.tick(&tx).await;
        assert_eq!(power(), [VmPower::Running], "the recheck started it again");
        // What it then has is what the next spec status says; a VM nobody asked for goes.
        assert_eq!(d.state.lock().unwrap().instances.iter().map(|i| i.state.as_str()).collect::<Vec<_>>(), ["running"]);
        hv.ensure(&crate::hypervisor::VmSpec { instance_id: "ins_stray".into(), image: "debian-12".into(), ..Default::default() }, true, 0).unwrap();
        for _ in 0..RECHECK_BEATS {
            d.tick(&tx).await;
        }
        assert_eq!(hv.list().unwrap().iter().map(|v| v.instance_id.as_str()).collect::<Vec<_>>(), ["ins_1"]);
    }

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter_in_the_upper_half() {
        let (min, max) = (Duration::from_millis(500), Duration::from_secs(30));
        for attempt in 0..20 {
            let d = backoff(min, max, attempt);
            let base = min.saturating_mul(1 << attempt.min(16)).min(max);
            assert!(d >= base / 2 && d <= base, "attempt {attempt}: {d:?}");
        }
    }
}
