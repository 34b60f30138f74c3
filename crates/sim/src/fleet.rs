//! `dev`'s simulated fleet: real daemons (in this process) with fake GPUs that join through the
//! real protocol, converge and run commands. A node.reboot restarts its daemon with a new boot id.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use better_compute_daemon::backend::GpuBackend;
use better_compute_daemon::{Daemon, DaemonConfig, HostResources, RebootHook};
use tokio::sync::{mpsc, watch};

/// When the health demo's GPU throws its XID.
const FLAKY_AFTER: Duration = Duration::from_secs(60);

/// The running simulated nodes.
pub struct DevFleet {
    /// Their node ids, in name order (the vps host last).
    pub node_ids: Vec<String>,
    /// The fake GPU that throws a transient XID a minute after start (the health demo): its
    /// node's id and its uuid.
    pub flaky_gpu: Option<(String, String)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl DevFleet {
    /// Waits for every daemon to stop (after shutdown turned true).
    pub async fn stop(self) {
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).expect("random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Starts `count` daemons `dev-node-<i>`; those without an identity join with a fresh token, the
/// first half in pool `gpus`, the rest in pool `burst`.
pub async fn start(
    db: &mut tokio_postgres::Client,
    root: &Path,
    gateway_url: &str,
    ca_path: &Path,
    count: usize,
    gpus: &str,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<DevFleet> {
    let ca_pem = std::fs::read_to_string(ca_path)?;
    let pool_id = |name: &'static str| {
        let db = &*db;
        async move {
            db.query_opt("SELECT p.id FROM pools p JOIN sites s ON s.id = p.site_id WHERE s.name = 'dev' AND p.name = $1", &[&name])
                .await
                .map(|r| r.map(|r| r.get::<_, String>(0)))
        }
    };
    let gpus_pool = pool_id("gpus").await?.context("dev's pool gpus is gone")?;
    // The first half of the nodes join `gpus`, the rest `burst` (a data folder from before
    // `burst` existed puts them all in `gpus`).
    let burst_pool = pool_id("burst").await?.unwrap_or_else(|| gpus_pool.clone());
    // One more node, `dev-vps-0`, hosts instances in `vms` (a vps-host pool), where there is one.
    let vms_pool = pool_id("vms").await?;
    let vps_hosts = usize::from(vms_pool.is_some());
    let boot = random_hex(4);
    let mut node_ids = Vec::new();
    let mut tasks = Vec::new();
    let mut flaky: Option<String> = None;
    for i in 0..count + vps_hosts {
        let vps = i >= count;
        let name = if vps { format!("dev-vps-{}", i - count) } else { format!("dev-node-{i}") };
        let state = root.join("daemons").join(&name);
        let mut cfg = DaemonConfig::new(gateway_url, &state, &name);
        cfg.ca_pem = Some(ca_pem.clone());
        cfg.host = HostResources { vcpu: 96, memory_mib: 1_048_576, disk_gib: 7_000 };
        cfg.labels = [("rack".to_owned(), format!("r{}", i / 2))].into();
        cfg.boot_id = format!("dev-{boot}-1");
        if !state.join("node.json").exists() {
            let tx = db.transaction().await?;
            let pool = match &vms_pool {
                Some(vms) if vps => vms,
                _ if i < count.div_ceil(2) => &gpus_pool,
                _ => &burst_pool,
            };
            let t = better_compute_nodes::listing::create_join_token(&tx, pool, Some(600), "dev").await?;
            tx.commit().await?;
            cfg.join_token = Some(t.secret);
        }
        let backend: Arc<dyn GpuBackend> = if i == 0 && gpus.starts_with("fake:") {
            // The health demo: the first node's first GPU throws XID 119 (a GSP RPC timeout,
            // transient) a minute after start; the control plane checks it and brings it back.
            let fake = Arc::new(better_compute_daemon::fake::FakeGpus::parse(gpus, &name)?);
            flaky = fake.uuids().first().cloned();
            let (f, mut down) = (fake.clone(), shutdown.clone());
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(FLAKY_AFTER) => f.inject_xid(0, 119),
                    _ = down.wait_for(|s| *s) => {}
                }
            });
            fake
        } else {
            better_compute_daemon::backend::open(gpus, &name)?
        };
        if vps {
            // Fake VMs (kept in the node's state folder): dev needs no KVM and no images.
            cfg.hypervisor = Some(Arc::new(better_compute_daemon::hypervisor::FakeHypervisor::new(Some(state.join("fake-vms.tsv")))));
        }
        let (reboot_tx, reboot_rx) = mpsc::channel(1);
        cfg.reboot = RebootHook::Callback(Arc::new(move |_| {
            let _ = reboot_tx.try_send(Crash::Reboot);
        }));
        let d = Daemon::start(cfg.clone(), backend.clone()).await.with_context(|| format!("{name} could not start"))?;
        node_ids.push(d.node_id());
        cfg.join_token = None;
        // The machine goes down with the daemon and comes back two seconds later with a new boot id.
        tasks.push(tokio::spawn(supervise(d, cfg, backend, reboot_rx, format!("dev-{boot}"), Duration::from_secs(2), shutdown.clone())));
    }
    let flaky_gpu = flaky.and_then(|uuid| Some((node_ids.first()?.clone(), uuid)));
    Ok(DevFleet { node_ids, flaky_gpu, tasks })
}

/// How a simulated node's daemon goes down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {
    /// The daemon process dies and comes back: same journal, same boot.
    Restart,
    /// The daemon comes back with its journal gone (a reinstalled node).
    WipedJournal,
    /// The machine reboots: a new boot id (`<boot_prefix>-<n>`).
    Reboot,
}

/// Runs one simulated machine's daemon; after a crash, starts it again `down` later the way the
/// crash says, until `shutdown`.
pub(crate) async fn supervise(
    mut daemon: Arc<Daemon>,
    mut cfg: DaemonConfig,
    backend: Arc<dyn GpuBackend>,
    mut crashes: mpsc::Receiver<Crash>,
    boot_prefix: String,
    down: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut boot = 1;
    loop {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(daemon.clone().run(stopped));
        tokio::select! {
            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => {
                let _ = stop.send(true);
                let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
                return;
            }
            how = crashes.recv() => {
                let Some(how) = how else { return };
                task.abort();
                let _ = task.await;
                drop(daemon);
                tokio::time::sleep(down).await;
                if how == Crash::WipedJournal {
                    let _ = std::fs::remove_file(cfg.state_dir.join("journal.redb"));
                }
                if how == Crash::Reboot {
                    boot += 1;
                    cfg.boot_id = format!("{boot_prefix}-{boot}");
                }
                loop {
                    match Daemon::start(cfg.clone(), backend.clone()).await {
                        Ok(d) => { daemon = d; break; }
                        // The old daemon's journal may still be closing.
                        Err(e) => {
                            tracing::debug!(error = %e, "simulated node could not start again yet");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                    if *shutdown.borrow() { return; }
                }
            }
        }
    }
}

/// The demo's variety on a first start: GPU 7 of dev-node-0 in MIG (two 3g.40gb instances), GPU 7
/// of dev-node-1 time-sliced (4 slots). Desired state carries the change to the daemons.
pub async fn demo_modes(db: &mut tokio_postgres::Client, nodes: &[String]) -> anyhow::Result<()> {
    use better_compute_core::gpu_mode::GpuMode;
    let modes = [GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }, GpuMode::TimeSlice { slots: 4 }];
    let tx = db.transaction().await?;
    let mut changed = Vec::new();
    for (node, mode) in nodes.iter().zip(modes) {
        let Some(r) = tx.query_opt("SELECT id FROM devices WHERE node_id = $1 AND parent_id IS NULL AND index = 7", &[node]).await? else { continue };
        let uuid: String = r.get(0);
        better_compute_nodes::inventory::replace_mode(&tx, &uuid, &mode).await?;
        better_compute_runtime::desired::invalidate(&tx, node).await?;
        changed.push(node.clone());
    }
    better_compute_capacity::inventory::refresh_nodes(&tx, &changed).await?;
    tx.commit().await?;
    better_compute_runtime::work_queue::poke(&*db).await;
    Ok(())
}

/// Waits (at most `patience`) until every node has applied its current desired state.
pub async fn wait_converged(db: &tokio_postgres::Client, nodes: &[String], patience: Duration) {
    let deadline = tokio::time::Instant::now() + patience;
    while tokio::time::Instant::now() < deadline {
        let behind: i64 = match db
            .query_one(
                "SELECT count(*) FROM nodes n WHERE n.id = ANY($1)
                    AND (n.spec IS NULL OR n.observed_generation < n.generation
                         OR EXISTS (SELECT 1 FROM work_queue q WHERE q.kind = $2 AND q.key = n.id))",
                &[&nodes, &better_compute_runtime::desired::NODESPEC.name],
            )
            .await
        {
            Ok(r) => r.get(0),
            Err(_) => return,
        };
        if behind == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("some nodes are still converging; `nodes list` shows them");
}

/// On a terminal, one status line kept current every 2 s: nodes by liveness and how many are
/// converging, reservations by state, commands in flight.
pub async fn live_status(conn: String, mut stopped: watch::Receiver<bool>) {
    use std::io::Write;
    let Ok(db) = better_compute_db::pool::connect(&conn).await else { return };
    loop {
        let row = db
            .query_one(
                "SELECT (SELECT coalesce(string_agg(l || ' ' || n, ', ' ORDER BY l), 'none')
                           FROM (SELECT liveness l, count(*) n FROM nodes GROUP BY 1) x),
                        (SELECT count(*) FROM nodes WHERE generation > observed_generation),
                        (SELECT coalesce(string_agg(st || ' ' || n, ', ' ORDER BY st), 'none')
                           FROM (SELECT state st, count(*) n FROM reservations WHERE state IN ('pending', 'placed', 'active') GROUP BY 1) y),
                        (SELECT count(*) FROM commands WHERE state IN ('pending', 'sent', 'running'))",
                &[],
            )
            .await;
        if let Ok(r) = row {
            let (nodes, converging, reservations, commands): (String, i64, String, i64) = (r.get(0), r.get(1), r.get(2), r.get(3));
            print!("\r\x1b[Knodes: {nodes} ({converging} converging) | reservations: {reservations} | commands in flight: {commands}");
            let _ = std::io::stdout().flush();
        }
        tokio::select! {
            _ = async { let _ = stopped.wait_for(|s| *s).await; } => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}
