//! `better-compute sim`: a fleet of simulated daemons against real gateways and workers in
//! separate OS processes, a seeded workload and seeded faults, and a check of every invariant
//! while it runs and after the faults heal. It stops at the first violation with the seed and the
//! command that replays it.
//!
//! A seed fixes the workload's operations and the fault schedule; the interleaving is the
//! machine's, so a replay runs the same operations and faults, not the same instants.
//!
//! An application crate, as the binary's other parts: its functions return `anyhow` errors.

mod args;
mod checks;
mod clock;
mod convergence;
mod faults;
pub mod fleet;
pub mod procs;
mod workload;

pub use args::{Broken, Fault, SimArgs};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use better_compute_capacity::quota;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_core::seeded::Rng;
use better_compute_db::launcher::{Cluster, ClusterOptions};
use better_compute_db::pgbouncer::PgBouncer;
use tokio::sync::watch;

use crate::args::{parse_seeds, replay_tail, value_names};
use crate::checks::STALE_EPOCH_AUDIT;
use crate::clock::tick_clock;
use crate::procs::{start_node, NodeSetup, Proxy, RebootLog, ServerProc, SimNode};
use crate::workload::{AskedOp, TENANTS};

/// Runs the seeds; the first violation ends the run with an error naming the seed and the replay.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    if args.broken.is_some() && !better_compute_daemon::FAULT_INJECTION {
        anyhow::bail!("--broken needs a test build (the tests build one with feature fault-injection); this build always honours its fence and journal");
    }
    let seeds = parse_seeds(&args.seeds)?;
    let (first, last) = (*seeds.start(), *seeds.end());
    for seed in seeds {
        println!("seed {seed} of {first}-{last}: {} nodes, {} gateways, {} workers, {:?} of faults{}",
            args.nodes, args.gateways, args.workers, args.duration, if args.pgbouncer { ", through PgBouncer" } else { "" });
        let started = Instant::now();
        let report = run_seed(&args, seed).await.with_context(|| format!("seed {seed} could not run"))?;
        if !report.violations.is_empty() {
            anyhow::bail!(
                "seed {seed}: {} invariant violation(s):\n  {}\nreplay: better-compute sim --seeds {seed} --duration {}s --nodes {} --gateways {} --workers {} --fault-interval-s {} --ops-per-s {} --clients {} --reboot-crash-percent {}{}{}{}{}",
                report.violations.len(),
                report.violations.join("\n  "),
                args.duration.as_secs(),
                args.nodes,
                args.gateways,
                args.workers,
                args.fault_interval_s,
                args.ops_per_s,
                args.clients,
                args.reboot_crash_percent,
                if args.pgbouncer { " --pgbouncer" } else { "" },
                if args.liveness { " --liveness" } else { "" },
                if args.faults.is_empty() { String::new() } else { format!(" --faults {}", value_names(&args.faults).join(",")) },
                replay_tail(&args),
            );
        }
        println!("seed {seed}: passed in {:.0} s: {}", started.elapsed().as_secs_f64(), report.summary);
    }
    Ok(())
}

/// What one seed found.
struct SeedReport {
    violations: Vec<String>,
    summary: String,
}

/// Counts of what happened, for the summary line.
#[derive(Default)]
struct Tally {
    ops: AtomicU64,
    placed: AtomicU64,
    refused: AtomicU64,
    unavailable: AtomicU64,
    /// Creates asked again with their key after the database went away under them.
    asked_again: AtomicU64,
    commands: AtomicU64,
    /// Creates and releases the batch placer did in a batch.
    batched: AtomicU64,
    faults: Mutex<HashMap<&'static str, u32>>,
    /// Placements in the current fault interval (intervals without one are counted in the summary).
    interval_placed: AtomicU64,
    /// `node.maintenance` workflows started.
    workflows: AtomicU64,
    /// Of them, those that held after the faults and were cancelled (as an operator would).
    workflows_held: AtomicU64,
    /// Instances created.
    instances: AtomicU64,
    /// Requests answered INTERNAL (a bug: the database being away is UNAVAILABLE), and the first
    /// one's message.
    internal: AtomicU64,
    first_internal: Mutex<Option<String>>,
    /// Operations ended since the last check, for the audit check.
    asked: Mutex<std::collections::VecDeque<AskedOp>>,
    /// Operations the audit check compared with the log.
    asked_checked: AtomicU64,
}

struct Sim {
    args: SimArgs,
    seed: u64,
    root: PathBuf,
    cluster: Cluster,
    /// Where servers and the workload connect (PgBouncer or PostgreSQL).
    db_conn: String,
    /// PostgreSQL itself, for LISTEN and the checks.
    direct_conn: String,
    pool_id: String,
    /// The registry the workload enqueues through, holding the fleet's command-signing key (the
    /// one in the CA's folder the gateways hand out), so its reboots are signed.
    registry: Arc<better_compute_runtime::Registry>,
    reboots: RebootLog,
    tally: Tally,
    started: Instant,
}

async fn run_seed(args: &SimArgs, seed: u64) -> anyhow::Result<SeedReport> {
    let root = std::env::temp_dir().join(format!("better-compute-sim-{}-{seed}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    // The reaper stops the cluster and removes its folder when this process ends, however it
    // ends; the logs and daemon state beside it stay for inspection.
    better_compute_db::testing::spawn_reaper(std::process::id() as i32, &root.join("pg"))?;
    let cluster = Cluster::new(ClusterOptions {
        data_dir: root.join("pg/data"),
        socket_dir: root.join("pg/sock"),
        durable: false,
        max_connections: 300,
    })?;
    cluster.init_if_needed()?;
    cluster.start()?;
    let admin = better_compute_db::pool::connect(&cluster.connection_string("postgres")).await?;
    // A failing statement is logged with its text, for whoever reads postgres.log after a violation.
    admin.batch_execute("CREATE DATABASE sim").await?;
    admin.batch_execute("ALTER SYSTEM SET log_min_error_statement = 'error'").await?;
    admin.batch_execute("SELECT pg_reload_conf()").await?;
    let direct_conn = cluster.connection_string("sim");
    let mut db = better_compute_db::pool::connect(&direct_conn).await?;
    better_compute_db::migrate(&mut db, &better_compute_server::registry()?.migrations()).await?;
    better_compute_db::clock::use_sim_clock(&db, std::time::SystemTime::now()).await?;
    db.batch_execute(STALE_EPOCH_AUDIT).await?;
    let bouncer = if args.pgbouncer { Some(PgBouncer::start_on_own_thread(&cluster, &root.join("bouncer"), 8)?) } else { None };
    let db_conn = bouncer.as_ref().map(|b| b.connection_string("sim")).unwrap_or_else(|| direct_conn.clone());
    let pool_id = seed_inventory(&mut db).await?;
    let registry = better_compute_server::registry()?;
    registry.install_command_signer(Arc::new(better_compute_runtime::signing::CommandSigner::load_or_create(&root.join("ca"))?));
    let sim = Arc::new(Sim {
        args: args.clone(),
        seed,
        root: root.clone(),
        cluster,
        db_conn,
        direct_conn,
        pool_id,
        registry,
        reboots: Default::default(),
        tally: Tally::default(),
        started: Instant::now(),
    });
    let result = sim.clone().go(&mut db).await;
    drop(bouncer);
    let _ = sim.cluster.stop();
    let _ = std::fs::copy(root.join("pg/data/server.log"), root.join("postgres.log"));
    if result.as_ref().is_ok_and(|r| r.violations.is_empty()) {
        let _ = std::fs::remove_dir_all(&root);
    } else {
        println!("kept for inspection: {} (server logs, daemon state)", root.display());
    }
    result
}


/// The sim pool's disruption budget (`maxUnavailable`), which the checker holds drains to.
const SIM_DRAIN_BUDGET: i32 = 1;

/// A site, a vps-host pool (reservations, and instances on some of them) with a disruption
/// budget, and quotas for the tenants.
async fn seed_inventory(db: &mut tokio_postgres::Client) -> anyhow::Result<String> {
    use better_compute_nodes::inventory::{self, NewPool};
    let tx = db.transaction().await?;
    let site = inventory::create_site(&tx, "sim").await?;
    let pool = inventory::create_pool(
        &tx,
        &NewPool { site_id: site, name: "sim".into(), kind: "vps-host".into(), vcpu_ratio: 2.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
    )
    .await?;
    // Usage windows of a minute, so that runs of seconds close some and check their sums.
    better_compute_capacity::usage::set_window_s(&tx, 60).await?;
    // A disruption budget of one node: the workload's drains queue behind each other.
    better_compute_nodes::drain::set_budget(&tx, &pool, better_compute_nodes::drain::Budget::Nodes(SIM_DRAIN_BUDGET)).await?;
    for t in TENANTS {
        for (r, max) in [("gpus", 40), ("mig_instances", 16), ("gpu_slots", 16), ("vcpu", 400), ("memory_mib", 4_000_000), ("disk_gib", 40_000)] {
            quota::set(&tx, t, r, max).await?;
        }
    }
    tx.commit().await?;
    Ok(pool)
}

/// The fleet while it runs.
struct Fleet {
    gateways: Vec<ServerProc>,
    workers: Vec<ServerProc>,
    proxies: Vec<Proxy>,
    nodes: Vec<SimNode>,
    gpus: Vec<Vec<String>>,
}

impl Sim {
    #[allow(clippy::too_many_lines, reason = "a seed's run in order (start, fault intervals with checks, heal, converge, summary)")]
    async fn go(self: Arc<Self>, db: &mut tokio_postgres::Client) -> anyhow::Result<SeedReport> {
        let (shutdown_tx, shutdown) = watch::channel(false);
        // The simulated clock follows real time; faults make it jump.
        let clock_stop = Arc::new(AtomicBool::new(false));
        let clock = tokio::spawn(tick_clock(self.direct_conn.clone(), clock_stop.clone()));
        let mut fleet = self.start_fleet(db, shutdown.clone()).await?;
        let initial_modes: HashMap<String, GpuMode> =
            fleet.gpus.iter().flatten().map(|g| (g.clone(), GpuMode::Exclusive)).collect();
        println!("  {} nodes joined and converged; running the workload with faults", fleet.nodes.len());

        let fleet_nodes: Vec<String> = fleet.nodes.iter().map(|n| n.node_id.clone()).collect();
        let workload_stop = Arc::new(AtomicBool::new(false));
        let workload = tokio::spawn(self.clone().workload(fleet_nodes.clone(), fleet.gpus.clone(), workload_stop.clone()));
        let mut violations = Vec::new();
        let end = Instant::now() + self.args.duration;
        let mut rng = Rng(self.seed.wrapping_mul(0x5851_f42d_4c95_7f2d));
        let interval = Duration::from_secs(self.args.fault_interval_s.max(2));
        let mut idle_intervals = 0;
        let mut finished_before = 0;
        let mut away: HashMap<String, u32> = HashMap::new();
        while Instant::now() < end {
            self.tally.interval_placed.store(0, Ordering::SeqCst);
            self.fault(&mut fleet, &mut rng, interval).await?;
            self.supervise(&mut fleet).await?;
            if self.tally.interval_placed.load(Ordering::SeqCst) == 0 {
                idle_intervals += 1;
            }
            // The invariants hold at every moment, not only at the end: stop at the first violation.
            self.reconnect(db).await?;
            match self.check(db, &initial_modes).await {
                Ok(found) => violations.extend(found),
                Err(e) => tracing::debug!(error = %e, "a check during the run could not read the database (a fault); next interval"),
            }
            if self.args.liveness && violations.is_empty() {
                match self.liveness(db, &fleet_nodes, &mut away, &mut finished_before).await {
                    Ok(found) => violations.extend(found),
                    Err(e) => tracing::debug!(error = %e, "the liveness check could not read the database (a fault); next interval"),
                }
            }
            if !violations.is_empty() {
                break;
            }
        }
        workload_stop.store(true, Ordering::SeqCst);
        let _ = workload.await;
        // Heal: everything running, every link up; then the fleet must converge.
        for p in fleet.gateways.iter_mut().chain(fleet.workers.iter_mut()) {
            if p.paused {
                p.resume();
            }
        }
        self.supervise(&mut fleet).await?;
        for p in &fleet.proxies {
            p.set_cut(false);
        }
        if violations.is_empty() {
            self.reconnect(db).await?;
            violations.extend(self.converge(db, &fleet_nodes).await?);
            if self.args.broken == Some(Broken::KeepDeletedVms) {
                // Whatever the run's timing left, instances whose VMs run are deleted now, so the
                // broken hosts surely have VMs to leak.
                self.delete_running_instances(db).await?;
            }
            // Whatever the fleet's convergence found, the instances are checked too (it only reads).
            violations.extend(self.settle_instances(db).await?);
        }
        if violations.is_empty() {
            violations.extend(self.check(db, &initial_modes).await?);
        }
        let internal = self.tally.internal.load(Ordering::SeqCst);
        if internal > 0 {
            let first = self.tally.first_internal.lock().expect("tally").clone().unwrap_or_default();
            violations.push(format!("{internal} workload request(s) failed with INTERNAL (the first: {first}); see postgres.log"));
        }
        if !violations.is_empty() {
            self.dump_activity(db).await;
        }
        let _ = shutdown_tx.send(true);
        for p in fleet.gateways.iter_mut().chain(fleet.workers.iter_mut()) {
            p.kill().await;
        }
        clock_stop.store(true, Ordering::SeqCst);
        let _ = clock.await;
        let t = &self.tally;
        let ended: Vec<String> = match db.query("SELECT state || coalesce(' ' || reason, '') || ' ' || count(*) FROM workflows GROUP BY state, reason ORDER BY 1", &[]).await {
            Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
            Err(_) => vec!["unknown".into()],
        };
        let count = async |sql: &str| match db.query_one(sql, &[]).await {
            Ok(r) => r.get::<_, i64>(0),
            Err(_) => -1,
        };
        let metered = count("SELECT count(*) FROM usage_windows").await;
        let instances_metered = count("SELECT count(*) FROM instance_usage_windows").await;
        let audited = count("SELECT count(*) FROM audit_entries WHERE log_index IS NOT NULL").await;
        let creates_audited = count("SELECT count(*) FROM audit_entries WHERE action = 'reservations.create'").await;
        let faults = t.faults.lock().expect("faults");
        let mut faults: Vec<String> = faults.iter().map(|(k, n)| format!("{k} {n}")).collect();
        faults.sort();
        Ok(SeedReport {
            violations,
            summary: format!(
                "{} operations ({} placed, {} creates and releases in batches, {} commands, {} refused, {} failed while the database was away, {} creates asked again with their key); faults: {}; {} reboots; {} maintenance workflows ({}; {} held and cancelled at the end); {} usage windows metered; {} instances created, {} of their usage windows metered; {audited} audit entries placed and verified ({creates_audited} reservation creates, {} requests checked against their entries); {idle_intervals} intervals without a placement",
                t.ops.load(Ordering::SeqCst),
                t.placed.load(Ordering::SeqCst),
                t.batched.load(Ordering::SeqCst),
                t.commands.load(Ordering::SeqCst),
                t.refused.load(Ordering::SeqCst),
                t.unavailable.load(Ordering::SeqCst),
                t.asked_again.load(Ordering::SeqCst),
                if faults.is_empty() { "none".into() } else { faults.join(", ") },
                self.reboots.lock().expect("reboots").len(),
                t.workflows.load(Ordering::SeqCst),
                ended.join(", "),
                t.workflows_held.load(Ordering::SeqCst),
                metered,
                t.instances.load(Ordering::SeqCst),
                instances_metered,
                t.asked_checked.load(Ordering::SeqCst),
            ),
        })
    }


    /// A new direct connection for the checks when a fault (PostgreSQL restarted) closed the old one.
    async fn reconnect(&self, db: &mut tokio_postgres::Client) -> anyhow::Result<()> {
        if db.is_closed() {
            *db = better_compute_db::pool::connect(&self.direct_conn).await?;
        }
        Ok(())
    }

    /// What every connection was doing when the violation was found, for whoever reads the logs:
    /// a stuck lock or an idle transaction shows here.
    async fn dump_activity(&self, db: &tokio_postgres::Client) {
        let Ok(rows) = db
            .query(
                "SELECT format('%s pid %s %s wait %s/%s blocked by %s: %s; in its transaction for %s', coalesce(client_port::text, 'local'),
                               pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), left(query, 300),
                               now() - xact_start) -- check-sql-now: allow (pg_stat_activity runs on the real clock)
                   FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() ORDER BY xact_start NULLS LAST",
                &[],
            )
            .await
        else {
            return;
        };
        let text: String = rows.iter().map(|r| r.get::<_, String>(0) + "\n").collect();
        let _ = std::fs::write(self.root.join("pg_stat_activity.txt"), text);
    }

    fn server_env(&self) -> Vec<(String, String)> {
        let mut env = vec![("DATABASE_URL".into(), self.db_conn.clone()), ("BETTER_COMPUTE_DIRECT_URL".into(), self.direct_conn.clone())];
        if self.args.broken == Some(Broken::SkipFence) {
            env.push(("BETTER_COMPUTE_TEST_BROKEN_FENCE".into(), "1".into()));
        }
        env
    }

    async fn start_fleet(&self, db: &mut tokio_postgres::Client, shutdown: watch::Receiver<bool>) -> anyhow::Result<Fleet> {
        let ca_dir = self.root.join("ca");
        let ca = better_compute_gateway::Ca::load_or_create(&ca_dir)?;
        let mut gateways = Vec::new();
        let mut proxies = Vec::new();
        for i in 0..self.args.gateways.max(1) {
            let args = vec![
                "--gateway-listen".into(), "127.0.0.1:0".into(), "--ca-dir".into(), ca_dir.display().to_string(),
                "--pool-size".into(), "8".into(),
            ];
            let g = ServerProc::start("gateway", i, args, self.server_env(), &self.root).await?;
            proxies.push(Proxy::start(g.addr.context("the gateway printed no address")?).await?);
            gateways.push(g);
        }
        let mut workers = Vec::new();
        for i in 0..self.args.workers.max(1) {
            let args = vec!["--ca-dir".into(), ca_dir.display().to_string(), "--pool-size".into(), "8".into()];
            workers.push(ServerProc::start("worker", i, args, self.server_env(), &self.root).await?);
        }
        let setup = NodeSetup {
            ca_pem: ca.cert_pem().to_owned(),
            reboots: self.reboots.clone(),
            reboot_crash_percent: self.args.reboot_crash_percent,
            broken_rerun_journaled_commands: self.args.broken == Some(Broken::RerunJournaledCommands),
            broken_keep_deleted_vms: self.args.broken == Some(Broken::KeepDeletedVms),
        };
        let mut nodes = Vec::new();
        for i in 0..self.args.nodes {
            let tx = db.transaction().await?;
            let token = better_compute_nodes::listing::create_join_token(&tx, &self.pool_id, Some(600), "sim").await?;
            tx.commit().await?;
            let name = format!("sim-node-{i}");
            let url = format!("https://127.0.0.1:{}", proxies[i % proxies.len()].addr.port());
            nodes.push(start_node(name.clone(), self.root.join("daemons").join(&name), url, token.secret, &setup, self.seed ^ i as u64, shutdown.clone()).await?);
        }
        // Every node converged once (observedGeneration ≥ 1), so it is eligible.
        let ids: Vec<String> = nodes.iter().map(|n| n.node_id.clone()).collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready: i64 = db
                .query_one("SELECT count(*) FROM nodes WHERE id = ANY($1) AND observed_generation >= 1 AND observed_generation = generation", &[&ids])
                .await?
                .get(0);
            if ready as usize == ids.len() {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "only {ready} of {} nodes converged within 60 s; see the logs in {}", ids.len(), self.root.display());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let mut gpus = Vec::new();
        for id in &ids {
            let rows = db.query("SELECT id FROM devices WHERE node_id = $1 AND parent_id IS NULL ORDER BY index", &[id]).await?;
            gpus.push(rows.iter().map(|r| r.get::<_, String>(0)).collect());
        }
        Ok(Fleet { gateways, workers, proxies, nodes, gpus })
    }
}
