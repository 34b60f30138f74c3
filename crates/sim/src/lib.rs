//! `better-compute sim`: a fleet of simulated daemons against real gateways and workers in
//! separate OS processes, a seeded workload and seeded faults, and a check of every invariant
//! while it runs and after the faults heal. It stops at the first violation with the seed and the
//! command that replays it.
//!
//! A seed fixes the workload's operations and the fault schedule; the interleaving is the
//! machine's, so a replay runs the same operations and faults, not the same instants.
//!
//! An application crate, as the binary's other parts: its functions return `anyhow` errors.

pub mod fleet;
pub mod procs;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use better_compute_capacity::batch::BatchSettings;
use better_compute_capacity::service::Reservations;
use better_compute_capacity::reservations::{self, CreateReservation, GpuRequest};
use better_compute_capacity::{invariants, mode, quota, Caller};
use better_compute_audit::Actor;
use better_compute_core::ErrorCode;
use better_compute_db::launcher::{Cluster, ClusterOptions};
use better_compute_db::pgbouncer::PgBouncer;
use better_compute_core::seeded::Rng;
use better_compute_nodes::actions;
use better_compute_nodes::commands::{self, NewCommand};
use better_compute_nodes::drain;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::workflow;
use better_compute_vps::instances::{self, Action, CreateInstance};
use tokio::sync::watch;

use crate::procs::{start_node, Crash, NodeSetup, Proxy, RebootLog, ServerProc, SimNode};

/// Options of `better-compute sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Seeds to run, one after another: `7`, or a range such as `1-100`.
    #[arg(long, default_value = "1")]
    seeds: String,
    /// How long each seed runs with faults (`90s`, `10m`); then faults stop and the fleet must heal.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Simulated nodes: real daemons with fake GPUs (8 x H100-80GB each), in this process.
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Gateway processes; the nodes are spread over them.
    #[arg(long, default_value_t = 2)]
    gateways: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Seconds in a fault interval: at most one fault starts in each, and heals within it, so the
    /// fleet can stay live.
    #[arg(long, default_value_t = 8)]
    fault_interval_s: u64,
    /// Workload operations per second, over all its clients.
    #[arg(long, default_value_t = 40)]
    ops_per_s: u64,
    /// Concurrent workload clients, each with its own connection and its own seeded operations.
    /// Their reservations go through one reservations service, as the API's do, so concurrent
    /// creates and releases are done in batches.
    #[arg(long, default_value_t = 8)]
    clients: u64,
    /// Send every server connection (and the workload's) through PgBouncer in transaction pooling
    /// mode (Debian's `pgbouncer`); LISTEN goes straight to PostgreSQL.
    #[arg(long)]
    pgbouncer: bool,
    /// Also check liveness: no node stays away for more than two fault intervals, and some command
    /// reaches an end in every interval.
    #[arg(long)]
    liveness: bool,
    /// Seconds the fleet has after the last fault to converge (every node's observedGeneration at
    /// its generation, no due work left, every sink caught up).
    #[arg(long, default_value_t = 120)]
    heal_timeout_s: u64,
    /// Percent of reboots where the daemon dies mid-reboot and comes back with the same journal and
    /// boot id, so the gateway sends the in-flight reboot again.
    #[arg(long, default_value_t = 50)]
    reboot_crash_percent: u64,
    /// Inject only these faults (comma-separated); all of them when not given.
    #[arg(long, value_enum, value_delimiter = ',')]
    faults: Vec<Fault>,
    /// Test only: run a deliberately broken variant, to prove the checker catches it.
    #[arg(long, hide = true, value_enum)]
    broken: Option<Broken>,
}

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// SIGKILL a gateway and restart it.
    GatewayKill,
    /// SIGKILL a worker and restart it.
    WorkerKill,
    /// Crash a daemon: same journal, wiped journal, or a new boot id.
    DaemonCrash,
    /// Cut the streams between a gateway and its daemons for a while.
    Partition,
    /// Crash PostgreSQL under load and start it again.
    PostgresCrash,
    /// Jump the simulated clock 5 to 45 s.
    ClockJump,
    /// Pause a worker past its leases until others take them over, then let it wake up.
    Zombie,
    /// A GPU throws an XID (informational, transient or fatal), or has an uncorrectable memory
    /// error whose row remap waits for a reset or failed.
    GpuXid,
    /// Every daemon loses its gateway until the site counts as down, then all come back at once
    /// through the site boot. Only with `--faults`: it takes longer than an interval.
    SiteOutage,
}

/// Deliberately broken variants (test only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Broken {
    /// Daemons run a not-retry-safe command again after a restart, ignoring their journal.
    RerunJournaledCommands,
    /// Workers skip the lease fence of their transactions (`BETTER_COMPUTE_TEST_BROKEN_FENCE`).
    SkipFence,
    /// The hosts' fake hypervisor never deletes a VM: deleted instances leak.
    KeepDeletedVms,
    /// The workload's cordons and uncordons commit without their audit entry.
    UnauditedCordons,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration; write it like 90s, 10m or 1h");
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| bad())?;
    Ok(Duration::from_secs(match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(bad()),
    }))
}

fn parse_seeds(s: &str) -> anyhow::Result<std::ops::RangeInclusive<u64>> {
    let bad = || anyhow::anyhow!("--seeds {s:?}: give a seed (7) or a range (1-100)");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b): (u64, u64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a > b {
        return Err(bad());
    }
    Ok(a..=b)
}


const TENANTS: [&str; 3] = ["ten_sim_a", "ten_sim_b", "ten_sim_c"];
const MODEL: &str = "H100-80GB";

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

/// The `--broken` part of a replay command.
fn replay_tail(args: &SimArgs) -> String {
    args.broken.map(|b| format!(" --broken {}", value_names(&[b])[0])).unwrap_or_default()
}

/// Values as they are written on the command line.
fn value_names<T: clap::ValueEnum>(vs: &[T]) -> Vec<String> {
    vs.iter().filter_map(|v| v.to_possible_value()).map(|p| p.get_name().to_owned()).collect()
}

/// What one seed found.
struct SeedReport {
    violations: Vec<String>,
    summary: String,
}

/// One workload operation's context: the reservations service, a tag unique to the operation (its
/// client and number, for idempotency keys and reboot reasons), and the fleet.
struct Op<'a> {
    reservations: &'a Reservations,
    tag: String,
    nodes: &'a [String],
    gpus: &'a [Vec<String>],
    /// Set by the operation: the API method it stands for, and whether each commit of it writes
    /// exactly one audit entry (else at most one: an instance action that changes nothing writes
    /// none).
    asked: &'a mut Option<(&'static str, bool)>,
}

/// One workload operation as the API request it stands for, and how it ended, until the next
/// check compares it with the audit log.
struct AskedOp {
    request_id: String,
    action: &'static str,
    exact: bool,
    ended: OpEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpEnd {
    Committed,
    Refused,
    /// The database went away mid-request: it may or may not have committed.
    InDoubt,
}

/// The most operations held for the next check; beyond, the oldest go unchecked.
const MAX_ASKED_OPS: usize = 100_000;

/// How often a client asks again for a create whose outcome the database's absence left in doubt,
/// and how long it waits between (real time: the database restarting).
const IN_DOUBT_RETRIES: u32 = 40;
const IN_DOUBT_RETRY_AFTER: Duration = Duration::from_millis(250);

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

/// The stale-epoch audit, installed in the simulator's throwaway database only: every row a
/// fenced transaction writes is checked against the lease it was fenced by (the fence names it in
/// `better_compute.fence`); a write made after the lease moved to a newer epoch is recorded, and
/// recorded only if it commits, which is exactly a stale-epoch write accepted.
const STALE_EPOCH_AUDIT: &str = "
CREATE TABLE sim_stale_writes (tbl text NOT NULL, op text NOT NULL, fence text NOT NULL, epoch_now bigint);
CREATE FUNCTION sim_audit_fence() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  f text := current_setting('better_compute.fence', true);
  held bigint;
BEGIN
  IF coalesce(f, '') <> '' THEN
    SELECT epoch INTO held FROM leases WHERE name = split_part(f, '@', 1);
    IF held IS DISTINCT FROM split_part(f, '@', 2)::bigint THEN
      INSERT INTO sim_stale_writes (tbl, op, fence, epoch_now) VALUES (TG_TABLE_NAME, TG_OP, f, held);
    END IF;
  END IF;
  RETURN NULL;
END $$;
DO $$
DECLARE t text;
BEGIN
  FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename NOT IN ('sim_stale_writes', 'compute_sim_clock') LOOP
    EXECUTE format('CREATE TRIGGER sim_audit_fence AFTER INSERT OR UPDATE OR DELETE ON %I FOR EACH ROW EXECUTE FUNCTION sim_audit_fence()', t);
  END LOOP;
END $$;";

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

    /// Deletes every running instance, as its tenant would (`--broken keep-deleted-vms`).
    async fn delete_running_instances(&self, db: &mut tokio_postgres::Client) -> anyhow::Result<()> {
        let running: Vec<(String, String)> = {
            let tx = db.transaction().await?;
            let rows = tx.query("SELECT id, tenant_id FROM instances WHERE state = 'running' ORDER BY id", &[]).await?;
            tx.commit().await?;
            rows.iter().map(|r| (r.get(0), r.get(1))).collect()
        };
        for (id, tenant) in &running {
            instances::act(db, &Actor::job("sim"), Caller { tenant_id: tenant, identity_id: "idn_sim" }, id, Action::Delete).await?;
        }
        println!("  [{:>5.1} s] {} running instances deleted at the heal", self.started.elapsed().as_secs_f64(), running.len());
        Ok(())
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

    /// Restarts server processes that exited on their own (as systemd would) and points proxies at
    /// restarted gateways.
    async fn supervise(&self, fleet: &mut Fleet) -> anyhow::Result<()> {
        for (i, g) in fleet.gateways.iter_mut().enumerate() {
            if g.exited() {
                self.count("gateway exited by itself", format!("(gateway {i})"));
                g.restart().await?;
                fleet.proxies[i].retarget(g.addr.context("the gateway printed no address")?);
            }
        }
        for w in fleet.workers.iter_mut() {
            if w.exited() {
                self.count("worker exited by itself", format!("(worker {})", w.index));
                w.restart().await?;
            }
        }
        Ok(())
    }

    fn count(&self, fault: &'static str, detail: String) {
        *self.tally.faults.lock().expect("faults").entry(fault).or_default() += 1;
        println!("  [{:>5.1} s] {fault} {detail}", self.started.elapsed().as_secs_f64());
    }

    /// At most one fault in this interval, healed before it ends.
    async fn fault(&self, fleet: &mut Fleet, rng: &mut Rng, interval: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        let pause = |d: Duration| tokio::time::sleep(d);
        let at = Duration::from_millis(rng.below(interval.as_millis() as u64 / 3) + 200);
        pause(at).await;
        // Twelve slots: the eight kinds (daemon crashes and clock jumps take more than one) and a
        // quiet one. With --faults, every interval has one of the kinds given.
        let kind = if self.args.faults.is_empty() {
            rng.below(12)
        } else {
            match self.args.faults[rng.below(self.args.faults.len() as u64) as usize] {
                Fault::GatewayKill => 0,
                Fault::WorkerKill => 1,
                Fault::DaemonCrash => 2 + rng.below(3),
                Fault::Partition => 5,
                Fault::PostgresCrash => 6,
                Fault::ClockJump => 7,
                Fault::Zombie => 9,
                Fault::GpuXid => 10,
                Fault::SiteOutage => 12,
            }
        };
        match kind {
            0 => {
                let i = rng.below(fleet.gateways.len() as u64) as usize;
                self.count("gateway SIGKILL", format!("(gateway {i})"));
                fleet.gateways[i].kill().await;
                pause(Duration::from_millis(500 + rng.below(1500))).await;
                fleet.gateways[i].restart().await?;
                fleet.proxies[i].retarget(fleet.gateways[i].addr.context("no address")?);
            }
            1 => {
                let i = rng.below(fleet.workers.len() as u64) as usize;
                self.count("worker SIGKILL", format!("(worker {i})"));
                fleet.workers[i].kill().await;
                pause(Duration::from_millis(500 + rng.below(1500))).await;
                fleet.workers[i].restart().await?;
            }
            2..=4 => {
                let n = &fleet.nodes[rng.below(fleet.nodes.len() as u64) as usize];
                let how = match kind {
                    2 => Crash::Restart,
                    3 => Crash::WipedJournal,
                    _ => Crash::Reboot,
                };
                self.count(
                    match how {
                        Crash::Restart => "daemon crash (same journal)",
                        Crash::WipedJournal => "daemon crash (wiped journal)",
                        Crash::Reboot => "daemon crash (new boot id)",
                    },
                    format!("({})", n.node_id),
                );
                n.crash(how);
            }
            5 => {
                let i = rng.below(fleet.proxies.len() as u64) as usize;
                self.count("partition daemons | gateway", format!("(gateway {i})"));
                fleet.proxies[i].set_cut(true);
                pause(Duration::from_millis(1000 + rng.below(interval.as_millis() as u64 / 3))).await;
                fleet.proxies[i].set_cut(false);
            }
            6 => {
                self.count("PostgreSQL crash and restart", String::new());
                let c = self.cluster.clone();
                tokio::task::spawn_blocking(move || c.crash_and_restart()).await??;
            }
            7 | 8 => {
                let jump = Duration::from_secs(5 + rng.below(40));
                self.count("clock jump", format!("(+{} s)", jump.as_secs()));
                advance_clock(&self.direct_conn, jump).await;
            }
            9 => {
                // A worker stops without knowing; its leases expire (the clock jumps past their
                // 15 s), others take its shards (or wait for its open fenced transactions), and
                // then it wakes up as a zombie.
                let i = rng.below(fleet.workers.len() as u64) as usize;
                self.count("worker paused past its leases (zombie)", format!("(worker {i})"));
                fleet.workers[i].pause();
                advance_clock(&self.direct_conn, Duration::from_secs(20)).await;
                self.wait_for_takeover(Duration::from_secs(interval.as_secs() / 2)).await;
                pause(Duration::from_millis(200 + rng.below(800))).await;
                fleet.workers[i].resume();
            }
            10 => {
                let n = &fleet.nodes[rng.below(fleet.nodes.len() as u64) as usize];
                match rng.below(6) {
                    // A memory error whose row remap waits for a reset (or failed): the health
                    // job's counters, and a reset where the GPU is free.
                    5 => {
                        let failed = rng.below(4) == 0;
                        self.count("GPU memory error", format!("({} on {})", if failed { "remap failed" } else { "remap pending" }, n.node_id));
                        n.inject_memory_error(rng.below(8) as usize, failed);
                    }
                    _ => {
                        let xid = [13, 119, 62, 79][rng.below(4) as usize];
                        self.count("GPU XID", format!("(XID {xid} on {})", n.node_id));
                        n.inject_xid(rng.below(8) as usize, xid);
                    }
                }
            }
            12 => {
                // Every stream cut; simulated time moves past the 40 s after which a disconnected
                // node is unreachable, 10 s at a time so that the liveness job (every 5 s) does not take
                // them for an outage of its own; the site boot starts; then everything comes back
                // at once, paced by the boot.
                self.count("site-wide outage", format!("({} nodes)", fleet.nodes.len()));
                for p in &fleet.proxies {
                    p.set_cut(true);
                }
                for _ in 0..5 {
                    pause(Duration::from_secs(5)).await;
                    advance_clock(&self.direct_conn, Duration::from_secs(10)).await;
                }
                // The liveness job marks them unreachable and the site-boot job starts the boot
                // within a few seconds of each other; wait for it (bounded), then let them back.
                let booting = self.wait_for_site_boot(Duration::from_secs(30)).await;
                println!("  [{:>5.1} s] the site boot {}", self.started.elapsed().as_secs_f64(), if booting { "started" } else { "did not start within 30 s" });
                for p in &fleet.proxies {
                    p.set_cut(false);
                }
            }
            _ => {} // a quiet interval
        }
        if let Some(rest) = interval.checked_sub(start.elapsed()) {
            pause(rest).await;
        }
        Ok(())
    }

    /// Waits (at most `patience`) until a site boots; whether one did.
    async fn wait_for_site_boot(&self, patience: Duration) -> bool {
        let Ok(db) = better_compute_db::pool::connect(&self.direct_conn).await else { return false };
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if let Ok(r) = db.query_one("SELECT count(*) FROM sites WHERE boot_state = 'booting'", &[]).await
                && r.get::<_, i64>(0) > 0
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        false
    }

    /// Waits (at most `patience`) until no worker lease is left expired: the awake workers took
    /// over what the paused one held.
    async fn wait_for_takeover(&self, patience: Duration) {
        let Ok(db) = better_compute_db::pool::connect(&self.direct_conn).await else { return };
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            let expired = db
                .query_one(
                    "SELECT count(*) FROM leases WHERE (name LIKE 'shard:%' OR name LIKE 'singleton:%') AND expires_at <= compute_now()",
                    &[],
                )
                .await
                .map(|r| r.get::<_, i64>(0));
            if matches!(expired, Ok(0)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The seeded workload: tenants reserve, extend and release; operators cordon, drain,
    /// undrain, taint, quarantine and change modes; commands of every kind the API runs. `--clients` clients run
    /// it concurrently, their reservations through one reservations service (batching creates and
    /// releases), as the API's are.
    async fn workload(self: Arc<Self>, nodes: Vec<String>, gpus: Vec<Vec<String>>, stop: Arc<AtomicBool>) {
        let clients = self.args.clients.max(1);
        let reservations = match better_compute_db::pool::connect_pool(&self.db_conn, 4 + clients as usize) {
            Ok(pool) => Arc::new(Reservations::start(pool, BatchSettings::default())),
            Err(e) => {
                eprintln!("  the workload could not start its reservations service: {e}");
                return;
            }
        };
        let tasks: Vec<_> = (0..clients)
            .map(|k| tokio::spawn(self.clone().client(k, reservations.clone(), nodes.clone(), gpus.clone(), stop.clone())))
            .collect();
        for c in tasks {
            let _ = c.await;
        }
        let batched = reservations.placer().map(|p| p.counters().done.load(Ordering::SeqCst)).unwrap_or(0);
        self.tally.batched.store(batched, Ordering::SeqCst);
    }

    /// One workload client: its own connection, its own seeded operations, at its share of
    /// `--ops-per-s`.
    async fn client(
        self: Arc<Self>,
        k: u64,
        reservations: Arc<Reservations>,
        nodes: Vec<String>,
        gpus: Vec<Vec<String>>,
        stop: Arc<AtomicBool>,
    ) {
        let mut rng = Rng(self.seed.wrapping_mul(1_000_003).wrapping_add(k));
        let mut live: Vec<(usize, String)> = Vec::new();
        let mut client: Option<tokio_postgres::Client> = None;
        let period = Duration::from_micros(1_000_000 * self.args.clients.max(1) / self.args.ops_per_s.max(1));
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(period).await;
            i += 1;
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = better_compute_db::pool::connect(&self.db_conn).await.ok();
            }
            let Some(c) = client.as_mut() else {
                self.tally.unavailable.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            self.tally.ops.fetch_add(1, Ordering::Relaxed);
            let tag = format!("{k}-{i}");
            let mut asked = None;
            let op = Op { reservations: &reservations, tag: tag.clone(), nodes: &nodes, gpus: &gpus, asked: &mut asked };
            let result = self.one_op(c, &mut rng, op, &mut live).await;
            if let Some((action, exact)) = asked {
                let ended = match &result {
                    Ok(()) => OpEnd::Committed,
                    Err(e) if matches!(e.code, ErrorCode::Unavailable | ErrorCode::Internal) => OpEnd::InDoubt,
                    Err(_) => OpEnd::Refused,
                };
                let mut q = self.tally.asked.lock().expect("asked");
                if q.len() == MAX_ASKED_OPS {
                    q.pop_front();
                }
                q.push_back(AskedOp { request_id: sim_request_id(&tag), action, exact, ended });
            }
            match result {
                Ok(()) => {}
                Err(e) if e.code == ErrorCode::Unavailable => {
                    // The database went away mid-request (a fault): the outcome is in doubt, and the
                    // checks afterwards hold whichever way it went.
                    self.tally.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.code == ErrorCode::Internal => {
                    self.tally.internal.fetch_add(1, Ordering::Relaxed);
                    self.tally.first_internal.lock().expect("tally").get_or_insert_with(|| e.message.clone());
                }
                Err(_) => {
                    self.tally.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    async fn one_op(
        &self,
        c: &mut tokio_postgres::Client,
        rng: &mut Rng,
        op: Op<'_>,
        live: &mut Vec<(usize, String)>,
    ) -> Result<(), better_compute_core::Error> {
        let Op { reservations: service, tag, nodes, gpus, asked } = op;
        let db = |e: tokio_postgres::Error| better_compute_core::Error::from(better_compute_db::DbError::from(e));
        let n = rng.below(nodes.len() as u64) as usize;
        let gpu = gpus[n][rng.below(gpus[n].len() as u64) as usize].clone();
        match rng.below(100) {
            0..=39 => {
                let t = rng.below(TENANTS.len() as u64) as usize;
                let (kind, profile, count) = match rng.below(10) {
                    0..=6 => ("gpu", None, 1 + rng.below(3) as i32),
                    7 | 8 => ("mig", Some("3g.40gb".to_owned()), 1),
                    _ => ("slot", None, 1 + rng.below(2) as i32),
                };
                let req = CreateReservation {
                    tenant_id: None,
                    pool_id: self.pool_id.clone(),
                    gpu: GpuRequest { kind: kind.into(), model: MODEL.into(), profile, count },
                    vcpu: 1 + rng.below(16) as i32,
                    memory_mib: 1024 * (1 + rng.below(64) as i64),
                    disk_gib: rng.below(200) as i64,
                    starts_at: None,
                    ends_at: None,
                    duration_s: Some(60 + rng.below(1800) as i64),
                    node_selector: Default::default(),
                    tolerations: vec![],
                    idempotency_key: Some(format!("sim-{}-{tag}", self.seed)),
                };
                // As an API request: its audit entry commits with it (checked in `check`).
                *asked = Some(("reservations.create", true));
                // A create the database went away under is in doubt: the client asks again with the
                // same key (and request), and the key answers what the first one did, or it runs.
                let mut tries = 0;
                let r = loop {
                    let actor = sim_request(TENANTS[t], "reservations.create", &tag);
                    match service.create(&actor, Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" }, &req).await {
                        Err(e) if e.code == ErrorCode::Unavailable && tries < IN_DOUBT_RETRIES => {
                            tries += 1;
                            self.tally.asked_again.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(IN_DOUBT_RETRY_AFTER).await;
                        }
                        r => break r?,
                    }
                };
                if r.state == "placed" || r.state == "active" {
                    self.tally.placed.fetch_add(1, Ordering::Relaxed);
                    self.tally.interval_placed.fetch_add(1, Ordering::Relaxed);
                }
                live.push((t, r.id));
            }
            40..=47 if !live.is_empty() => {
                let (t, id) = live[rng.below(live.len() as u64) as usize].clone();
                let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" };
                let tx = c.transaction().await.map_err(db)?;
                let cur = reservations::get(&tx, caller, &id).await?;
                tx.commit().await.map_err(db)?;
                let end = better_compute_core::time::parse_rfc3339(&cur.ends_at).unwrap_or_else(std::time::SystemTime::now)
                    + Duration::from_secs(60 + rng.below(600));
                *asked = Some(("reservations.extend", true));
                let end = better_compute_core::time::rfc3339(end);
                service.extend(&sim_request(TENANTS[t], "reservations.extend", &tag), caller, &id, &end, None).await?;
            }
            48..=62 if !live.is_empty() => {
                let (t, id) = live.swap_remove(rng.below(live.len() as u64) as usize);
                *asked = Some(("reservations.release", true));
                let actor = sim_request(TENANTS[t], "reservations.release", &tag);
                service.release(&actor, Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" }, &id).await?;
            }
            63..=65 => {
                let on = rng.below(2) == 0;
                let action = *asked.insert((if on { "nodes.cordon" } else { "nodes.uncordon" }, true));
                let unaudited = self.args.broken == Some(Broken::UnauditedCordons);
                let change = async |tx: &tokio_postgres::Transaction<'_>| Ok(if on { actions::cordon(tx, &nodes[n]).await } else { actions::uncordon(tx, &nodes[n]).await }?);
                if unaudited {
                    let tx = c.transaction().await.map_err(db)?;
                    change(&tx).await?;
                    tx.commit().await.map_err(db)?;
                } else {
                    operator_request(c, &tag, action.0, change).await?;
                }
            }
            66..=68 => {
                // Drains, waiting or evicting within seconds, and undrains; the drain job admits
                // them within the pool's budget.
                let k = rng.below(3);
                let secs = 5.0 + rng.below(30) as f64;
                let action = *asked.insert((if k == 0 { "nodes.undrain" } else { "nodes.drain" }, true));
                operator_request(c, &tag, action.0, async |tx| match k {
                    0 => {
                        // Its own drains: a maintenance workflow's drain is the workflow's to end.
                        if drain::open_drain(tx, &nodes[n]).await?.is_some_and(|d| d.requested_by == "sim/op") {
                            drain::undrain(tx, &nodes[n]).await?;
                        }
                        Ok(())
                    }
                    k => {
                        let deadline: Option<String> = if k == 1 {
                            None
                        } else {
                            let row = tx
                                .query_one(&format!("SELECT {}", better_compute_db::clock::rfc3339_sql("compute_now() + make_interval(secs => $1)")), &[&secs])
                                .await
                                .map_err(db)?;
                            Some(row.get(0))
                        };
                        let mode = if deadline.is_some() { drain::DrainMode::Evict } else { drain::DrainMode::Wait };
                        let req = drain::DrainRequest { node_id: &nodes[n], reason: "sim", mode, deadline: deadline.as_deref(), requested_by: "sim/op" };
                        // Another mode while one is open is a refusal (CONFLICT), counted as such.
                        drain::request(tx, &req).await?;
                        Ok(())
                    }
                })
                .await?;
            }
            69..=73 => {
                let on = rng.below(2) == 0;
                let action = *asked.insert((if on { "nodes.taint" } else { "nodes.untaint" }, true));
                operator_request(c, &tag, action.0, async |tx| {
                    Ok(if on { actions::taint(tx, &nodes[n], "maint", "yes").await } else { actions::untaint(tx, &nodes[n], "maint").await }?)
                })
                .await?;
            }
            74..=78 => {
                let on = rng.below(2) == 0;
                let action = *asked.insert((if on { "devices.quarantine" } else { "devices.releaseQuarantine" }, true));
                operator_request(c, &tag, action.0, async |tx| {
                    Ok(if on { actions::quarantine(tx, &gpu, "sim").await } else { actions::release_quarantine(tx, &gpu).await }?)
                })
                .await?;
            }
            79..=82 => {
                let m = match rng.below(3) {
                    0 => GpuMode::Exclusive,
                    1 => GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] },
                    _ => GpuMode::TimeSlice { slots: 4 },
                };
                // The capacity module records it when it serves a request.
                *asked = Some(("devices.setMode", true));
                mode::change_gpu_mode(c, &sim_request(OPERATOR_TENANT, "devices.setMode", &tag), &gpu, &m).await?;
            }
            83 if rng.below(4) == 0 => {
                // Maintenance of a node (drain evicting within seconds, a signed reboot, a check,
                // uncordon), unless a workflow or a drain is open on it.
                let params = serde_json::json!({"reason": format!("sim {tag}"), "drainDeadlineS": 5 + rng.below(20)});
                *asked = Some(("workflows.start", true));
                let started = operator_request(c, &tag, "workflows.start", async |tx| {
                    let busy = workflow::open_with(tx, "node.maintenance", &nodes[n], &serde_json::json!({})).await?.is_some()
                        || drain::open_drain(tx, &nodes[n]).await?.is_some();
                    if busy {
                        // Nothing to start: refused, as the API refuses a second open workflow.
                        return Err(better_compute_core::Error::failed_precondition("a workflow or a drain is open on the node"));
                    }
                    let target = workflow::Target { node_id: Some(nodes[n].clone()), ..Default::default() };
                    let w = workflow::NewWorkflow { definition: "node.maintenance", target: &target, params: &params, requested_by: "sim/op" };
                    workflow::start(tx, &self.registry, &w).await?;
                    Ok(())
                })
                .await;
                match started {
                    Ok(()) => {
                        self.tally.workflows.fetch_add(1, Ordering::Relaxed);
                    }
                    // Not asked after all.
                    Err(e) if e.code == ErrorCode::FailedPrecondition => *asked = None,
                    Err(e) => return Err(e),
                }
            }
            84..=89 if !live.is_empty() => {
                // An instance on one of this client's reservations: created, or stopped, started,
                // rebooted or deleted.
                let (t, res) = live[rng.below(live.len() as u64) as usize].clone();
                let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" };
                let existing: Option<String> = {
                    let tx = c.transaction().await.map_err(db)?;
                    let found = tx.query_opt("SELECT id FROM instances WHERE allocation_id = $1 AND state <> 'deleted'", &[&res]).await.map_err(db)?;
                    tx.commit().await.map_err(db)?;
                    found.map(|r| r.get(0))
                };
                match (existing, rng.below(4)) {
                    (None, _) => {
                        let req = CreateInstance {
                            tenant_id: None,
                            reservation_id: Some(res),
                            pool_id: None,
                            gpu: None,
                            vcpu: 0,
                            memory_mib: 0,
                            disk_gib: 0,
                            duration_s: None,
                            image: "sim".into(),
                            ssh_public_keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 sim@sim".into()],
                            user_data: String::new(),
                            idempotency_key: format!("sim-{}-{tag}", self.seed),
                        };
                        *asked = Some(("instances.create", true));
                        instances::create(c, &sim_request(TENANTS[t], "instances.create", &tag), caller, &req).await?;
                        self.tally.instances.fetch_add(1, Ordering::Relaxed);
                    }
                    (Some(id), k) => {
                        let (action, method) = [
                            (Action::Stop, "instances.stop"),
                            (Action::Start, "instances.start"),
                            (Action::Reboot, "instances.reboot"),
                            (Action::Delete, "instances.delete"),
                        ][k as usize];
                        // One that changes nothing (a stop of a stopped instance) writes no entry.
                        *asked = Some((method, false));
                        instances::act(c, &sim_request(TENANTS[t], method, &tag), caller, &id, action).await?;
                    }
                }
            }
            _ => {
                let (kind, payload) = match rng.below(8) {
                    0 | 1 => ("diag.nvml", serde_json::json!({"level": 1})),
                    2 | 3 => ("inventory.refresh", serde_json::json!({"sections": ["gpus"]})),
                    4 | 5 => ("logs.collect", serde_json::json!({"sinceSeconds": 60})),
                    _ => ("node.reboot", serde_json::json!({"reason": format!("sim seed {} op {tag}", self.seed), "graceSeconds": 0})),
                };
                let key = format!("sim-{}-{tag}", self.seed);
                *asked = Some(("commands.run", true));
                operator_request(c, &tag, "commands.run", async |tx| {
                commands::enqueue(
                    tx,
                    &self.registry,
                    NewCommand {
                        node_id: &nodes[n],
                        kind,
                        payload: &payload,
                        idempotency_key: &key,
                        not_after: Some(Duration::from_secs(120)),
                        min_generation: 0,
                        owner: None,
                        actor: &better_compute_audit::Actor::job("sim"),
                    },
                )
                .await?;
                Ok(())
                })
                .await?;
                commands::poke_gateway(&*c, &nodes[n]).await;
                self.tally.commands.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// After the faults: waits (advancing nothing but real time) until every node's
    /// observedGeneration reaches its generation, no work is due, and every outbox sink has caught
    /// up; what is still wrong at the deadline is a violation.
    async fn converge(&self, db: &mut tokio_postgres::Client, nodes: &[String]) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + Duration::from_secs(self.args.heal_timeout_s);
        // The workload's own drains end, as an operator's would: a waiting one may hold the pool's
        // budget for the length of a reservation, and the maintenance workflows wait for it.
        {
            let tx = db.transaction().await?;
            for r in tx.query("SELECT node_id FROM node_drains WHERE requested_by = 'sim/op' AND state IN ('queued', 'draining', 'drained') ORDER BY node_id", &[]).await? {
                drain::undrain(&tx, &r.get::<_, String>(0)).await?;
            }
            tx.commit().await?;
        }
        loop {
            let mut wrong = Vec::new();
            self.reconnect(db).await?;
            for r in db
                .query(
                    "SELECT n.id, n.generation, n.observed_generation, n.liveness,
                            coalesce(format('epoch %s on %s, %s', s.session_epoch, s.gateway_id,
                                            coalesce('closed (' || s.close_reason || ')', 'open, last seen ' || (compute_now() - s.last_seen_at) || ' ago')),
                                     'none')
                       FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id
                      WHERE n.id = ANY($1) AND (n.observed_generation IS DISTINCT FROM n.generation OR n.liveness <> 'connected')",
                    &[&nodes],
                )
                .await?
            {
                wrong.push(format!(
                    "node {} has not converged after the faults stopped: generation {}, observedGeneration {:?}, liveness {}, session {}",
                    r.get::<_, String>(0),
                    r.get::<_, i64>(1),
                    r.get::<_, Option<i64>>(2),
                    r.get::<_, String>(3),
                    r.get::<_, String>(4)
                ));
            }
            // Every site boot ended once its nodes converged.
            for r in db.query("SELECT name FROM sites WHERE boot_state = 'booting'", &[]).await? {
                wrong.push(format!("site {} is still booting after its nodes came back", r.get::<_, String>(0)));
            }
            // Every reboot the workload asked for was signed with the key each daemon pinned at
            // join, through crashes, wiped journals and restarts: none was refused for it.
            for r in db.query("SELECT id, node_id FROM commands WHERE reason = 'BAD_SIGNATURE'", &[]).await? {
                wrong.push(format!("command {} on node {} was refused as not signed", r.get::<_, String>(0), r.get::<_, String>(1)));
            }
            // The operator's part: a held maintenance keeps its node drained, and so its place in
            // the pool's budget, which the others' drains wait for. Cancel it and undrain its node.
            {
                let tx = db.transaction().await?;
                let held: Vec<(String, Option<String>)> =
                    tx.query("SELECT id, node_id FROM workflows WHERE state = 'held' ORDER BY id", &[]).await?.iter().map(|r| (r.get(0), r.get(1))).collect();
                for (id, node) in &held {
                    workflow::cancel(&tx, id, "sim/operator").await?;
                    if let Some(node) = node
                        && drain::open_drain(&tx, node).await?.is_some_and(|d| d.requested_by == format!("workflow:{id}"))
                    {
                        drain::undrain(&tx, node).await?;
                    }
                }
                tx.commit().await?;
                self.tally.workflows_held.fetch_add(held.len() as u64, Ordering::Relaxed);
            }
            // Every workflow ended (succeeded, failed, cancelled) or holds for an operator; a
            // node.recover may still wait for its GPU to be free while a reservation holds it (a
            // suspect GPU takes no new reservations, and the ones it has run to their end).
            for r in db
                .query(
                    "SELECT w.id, w.node_id, w.state, s.name, s.message FROM workflows w
                       LEFT JOIN workflow_steps s ON s.workflow_id = w.id AND s.idx = w.current_step
                      WHERE w.state IN ('running', 'cancelling')
                        AND NOT (w.definition = 'node.recover' AND w.state = 'running' AND s.name = 'wait-free'
                                 AND EXISTS (SELECT 1 FROM devices a JOIN device_bookings b ON b.device_id = a.id
                                              WHERE (a.id = w.params->>'gpuUuid' OR a.parent_id = w.params->>'gpuUuid')
                                                AND b.during @> compute_now()))",
                    &[],
                )
                .await?
            {
                wrong.push(format!(
                    "workflow {} on node {:?} is still {} at step {:?} ({:?}) after the faults stopped",
                    r.get::<_, String>(0),
                    r.get::<_, Option<String>>(1),
                    r.get::<_, String>(2),
                    r.get::<_, Option<String>>(3),
                    r.get::<_, Option<String>>(4)
                ));
            }
            // A key due for a minute and still not run: left unprocessed.
            for r in db
                .query(
                    "SELECT kind, key FROM work_queue
                      WHERE not_before < compute_now() - interval '60 seconds'
                        AND (claimed_until IS NULL OR claimed_until < compute_now())",
                    &[],
                )
                .await?
            {
                wrong.push(format!("work key {}/{} left unprocessed", r.get::<_, String>(0), r.get::<_, String>(1)));
            }
            // Every committed event reached every outbox sink (subscriber) at least once.
            let registry = better_compute_server::registry()?;
            for sink in registry.outbox_sinks() {
                let behind: i64 = db
                    .query_one(
                        "SELECT count(*) FROM outbox o
                          WHERE NOT EXISTS (SELECT 1 FROM outbox_cursors c WHERE c.sink = $1 AND (c.txid, c.seq) >= (o.txid, o.seq))",
                        &[&sink.name()],
                    )
                    .await?
                    .get(0);
                if behind > 0 {
                    wrong.push(format!("outbox sink {} has not received {behind} committed event(s)", sink.name()));
                }
            }
            if wrong.is_empty() {
                return Ok(wrong);
            }
            if Instant::now() > deadline {
                return Ok(wrong);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Liveness: every node is back within two fault intervals of losing its session, and commands
    /// keep finishing (some command reaches an end in every interval).
    async fn liveness(
        &self,
        db: &tokio_postgres::Client,
        nodes: &[String],
        away: &mut HashMap<String, u32>,
        finished_before: &mut i64,
    ) -> anyhow::Result<Vec<String>> {
        let mut v = Vec::new();
        let rows = db.query("SELECT id, liveness FROM nodes WHERE id = ANY($1)", &[&nodes]).await?;
        for r in rows {
            let (id, liveness): (String, String) = (r.get(0), r.get(1));
            if liveness == "connected" {
                away.remove(&id);
                continue;
            }
            let n = away.entry(id.clone()).or_default();
            *n += 1;
            if *n > 2 {
                v.push(format!("liveness: node {id} has been {liveness} for {n} fault intervals"));
            }
        }
        let finished: i64 = db
            .query_one("SELECT count(*) FROM commands WHERE state IN ('succeeded', 'failed', 'expired', 'cancelled')", &[])
            .await?
            .get(0);
        if finished == *finished_before && self.tally.commands.load(Ordering::SeqCst) > 0 {
            v.push("liveness: no command reached an end during a fault interval".into());
        }
        *finished_before = finished;
        Ok(v)
    }

    /// The invariants, at any moment: the capacity invariants (in one snapshot) and no command
    /// that is not retry-safe run twice.
    async fn check(&self, db: &mut tokio_postgres::Client, initial_modes: &HashMap<String, GpuMode>) -> anyhow::Result<Vec<String>> {
        // The operations that ended before the snapshot below: their commits are in it.
        let asked: Vec<(String, &'static str, bool, OpEnd)> =
            self.tally.asked.lock().expect("asked").iter().map(|o| (o.request_id.clone(), o.action, o.exact, o.ended)).collect();
        let tx = db.build_transaction().isolation_level(tokio_postgres::IsolationLevel::RepeatableRead).read_only(true).start().await?;
        let mut v = invariants::check(&tx, initial_modes).await?.violations;
        // No stale-epoch write was accepted (see STALE_EPOCH_AUDIT).
        for r in tx
            .query("SELECT tbl, op, fence, epoch_now, count(*) FROM sim_stale_writes GROUP BY 1, 2, 3, 4 ORDER BY 5 DESC LIMIT 5", &[])
            .await?
        {
            v.push(format!(
                "stale-epoch write accepted: {} row(s) of {} ({}) written under lease {} after the lease moved to epoch {:?}",
                r.get::<_, i64>(4),
                r.get::<_, String>(0),
                r.get::<_, String>(1),
                r.get::<_, String>(2),
                r.get::<_, Option<i64>>(3)
            ));
        }
        // Admitted drains never outnumber the pool's disruption budget.
        for r in tx
            .query(
                "SELECT pool_id, count(*) FROM node_drains WHERE state IN ('draining', 'drained') GROUP BY pool_id HAVING count(*) > $1",
                &[&i64::from(SIM_DRAIN_BUDGET)],
            )
            .await?
        {
            v.push(format!("pool {} has {} drains admitted, over its budget of {SIM_DRAIN_BUDGET}", r.get::<_, String>(0), r.get::<_, i64>(1)));
        }
        // No workflow rebooted its node twice: at most one of its reboots succeeded, and a second
        // attempt only followed a failed first.
        for r in tx
            .query(
                "SELECT w.id, count(*) FILTER (WHERE c.state = 'succeeded'), count(*) FROM workflows w
                   JOIN commands c ON c.node_id = w.node_id AND c.idempotency_key LIKE 'wf:' || w.id || ':reboot.%'
                  GROUP BY w.id HAVING count(*) FILTER (WHERE c.state = 'succeeded') > 1",
                &[],
            )
            .await?
        {
            v.push(format!("workflow {} rebooted its node {} times ({} reboots sent)", r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, i64>(2)));
        }
        v.extend(instance_violations(&tx).await?);
        v.extend(audit_violations(&tx).await?);
        v.extend(asked_violations(&tx, &asked).await?);
        tx.commit().await?;
        // Checked: gone from the queue (those it dropped meanwhile went unchecked).
        let mut q = self.tally.asked.lock().expect("asked");
        let n = asked.len().min(q.len());
        q.drain(..n);
        self.tally.asked_checked.fetch_add(asked.len() as u64, Ordering::Relaxed);
        // No command that is not retry-safe ran twice.
        for (reason, runs) in self.reboots.lock().expect("reboots").iter() {
            if *runs > 1 {
                v.push(format!("node.reboot ({reason}) is not retry-safe but ran {runs} times"));
            }
        }
        Ok(v)
    }
}

/// The tenant the workload's operator requests are made in.
const OPERATOR_TENANT: &str = "ten_operator";

/// The request id of the workload's operation `tag`.
fn sim_request_id(tag: &str) -> String {
    format!("req_sim{tag}")
}

/// The API request the workload's operation `tag` stands for: the actor of its change.
fn sim_request(tenant: &str, action: &str, tag: &str) -> Actor {
    Actor::Request(std::sync::Arc::new(better_compute_audit::entry::Request {
        identity_id: "idn_sim".into(),
        token_id: "tok_sim".into(),
        tenant_id: tenant.into(),
        action: action.into(),
        target: String::new(),
        request_id: sim_request_id(tag),
        source: None,
        request_digest: better_compute_audit::entry::digest(tag.as_bytes()),
    }))
}

/// An operator's request `action` that the API serves in one transaction (`Ctx::in_tx`): `f`'s
/// change and its audit entry commit together.
async fn operator_request<T>(
    c: &mut tokio_postgres::Client,
    tag: &str,
    action: &str,
    f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, better_compute_core::Error>,
) -> Result<T, better_compute_core::Error> {
    let db = |e: tokio_postgres::Error| better_compute_core::Error::from(better_compute_db::DbError::from(e));
    let tx = c.transaction().await.map_err(db)?;
    let v = f(&tx).await?;
    sim_request(OPERATOR_TENANT, action, tag).record(&tx, action, "", None).await?;
    tx.commit().await.map_err(db)?;
    Ok(v)
}

/// What must hold of the audit log at every moment: its placed entries chain and match every
/// checkpoint (as `better-compute audit verify` checks an export); a reservation the workload
/// created has exactly one `reservations.create` entry, written with it (one made by
/// `instances.create` has none of its own), and no such entry names a reservation that does not
/// exist (its create rolled back).
async fn audit_violations(tx: &impl tokio_postgres::GenericClient) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    let lines = better_compute_audit::log::export_all(tx).await?;
    if let Some(problem) = better_compute_audit::verify::verify(&lines, None).problem {
        v.push(format!("the audit log does not verify: {problem}"));
    }
    for r in tx
        .query(
            "SELECT r.id, (SELECT count(*) FROM audit_entries a WHERE a.action = 'reservations.create' AND a.target = r.id) AS n
               FROM reservations r
              WHERE NOT EXISTS (SELECT 1 FROM instances i WHERE i.allocation_id = r.id)
                AND (SELECT count(*) FROM audit_entries a WHERE a.action = 'reservations.create' AND a.target = r.id) <> 1
             UNION ALL
             SELECT a.target, 0 FROM audit_entries a WHERE a.action = 'reservations.create' AND NOT EXISTS (SELECT 1 FROM reservations r WHERE r.id = a.target)
             LIMIT 10",
            &[],
        )
        .await?
    {
        v.push(format!("reservation {} has {} reservations.create audit entries (one is written with it)", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    Ok(v)
}

/// Each operation of the workload, made as an API request, has its entries in the audit log: one
/// if it committed (at most one where a commit may change nothing), none if it was refused, at most
/// one if the database went away mid-request.
async fn asked_violations(tx: &impl tokio_postgres::GenericClient, asked: &[(String, &'static str, bool, OpEnd)]) -> anyhow::Result<Vec<String>> {
    let ids: Vec<&str> = asked.iter().map(|(id, ..)| id.as_str()).collect();
    let counts: HashMap<String, i64> = tx
        .query("SELECT request_id, count(*) FROM audit_entries WHERE request_id = ANY($1) GROUP BY 1", &[&ids])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut v = Vec::new();
    for (id, action, exact, ended) in asked {
        let n = counts.get(id).copied().unwrap_or(0);
        let allowed = match ended {
            OpEnd::Committed if *exact => n == 1,
            OpEnd::Committed | OpEnd::InDoubt => n <= 1,
            OpEnd::Refused => n == 0,
        };
        if !allowed && v.len() < 10 {
            v.push(format!("{action} request {id} ({ended:?}) has {n} audit entries"));
        }
    }
    Ok(v)
}

/// What must hold of instances at every moment: one live instance per reservation; an instance
/// on a host is on its reservation's node; no reservation runs in two VMs, whatever the hosts say.
async fn instance_violations(tx: &impl tokio_postgres::GenericClient) -> anyhow::Result<Vec<String>> {
    let mut v = Vec::new();
    for r in tx.query("SELECT allocation_id, count(*) FROM instances WHERE state <> 'deleted' GROUP BY 1 HAVING count(*) > 1", &[]).await? {
        v.push(format!("reservation {} has {} live instances", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    for r in tx
        .query(
            "SELECT i.id, i.node_id, r.node_id FROM instances i JOIN reservations r ON r.id = i.allocation_id
              WHERE i.state NOT IN ('requested', 'deleted') AND i.node_id IS DISTINCT FROM r.node_id",
            &[],
        )
        .await?
    {
        v.push(format!("instance {} is on node {:?}, its reservation on {:?}", r.get::<_, String>(0), r.get::<_, Option<String>>(1), r.get::<_, Option<String>>(2)));
    }
    for r in tx
        .query(
            "SELECT i.allocation_id, count(*) FROM nodes n, jsonb_array_elements(coalesce(n.spec_status->'instances', '[]')) o
               JOIN instances i ON i.id = o->>'instanceId' WHERE o->>'state' = 'running' GROUP BY 1 HAVING count(*) > 1",
            &[],
        )
        .await?
    {
        v.push(format!("reservation {} runs in {} VMs", r.get::<_, String>(0), r.get::<_, i64>(1)));
    }
    v.extend(better_compute_vps::usage::violations(tx).await?);
    Ok(v)
}

/// Ways the instances differ from what the hosts have, once everything healed (empty: settled).
async fn instance_differences(db: &tokio_postgres::Client) -> anyhow::Result<Vec<String>> {
    let rows = db
        .query(
            "WITH vms AS (SELECT n.id AS node_id, o->>'instanceId' AS id, o->>'state' AS state FROM nodes n,
                            jsonb_array_elements(coalesce(n.spec_status->'instances', '[]')) o WHERE o->>'state' IN ('running', 'stopped'))
             SELECT format('VM %s on %s leaked: its instance is %s', v.id, v.node_id, coalesce(i.state, 'unknown'))
               FROM vms v LEFT JOIN instances i ON i.id = v.id WHERE i.id IS NULL OR i.state IN ('deleted', 'requested') OR i.node_id <> v.node_id
             UNION ALL
             SELECT format('instance %s is %s but its host %s has no VM for it', i.id, i.state, i.node_id)
               FROM instances i WHERE i.state IN ('running', 'stopping', 'stopped') AND NOT EXISTS (SELECT 1 FROM vms v WHERE v.id = i.id AND v.node_id = i.node_id)
             UNION ALL
             SELECT format('instance %s is still %s although its host reports it %s', i.id, i.state, v.state)
               FROM instances i JOIN vms v ON v.id = i.id
              WHERE (i.state = 'provisioning' AND v.state = 'running') OR (i.state = 'stopping' AND v.state = 'stopped')
             UNION ALL
             SELECT CASE WHEN EXISTS (SELECT 1 FROM vms v WHERE v.id = i.id)
                         THEN format('VM %s on %s leaked: its instance is still deleting', i.id, i.node_id)
                         ELSE format('instance %s is still deleting although its host %s has no VM for it', i.id, i.node_id) END
               FROM instances i WHERE i.state = 'deleting'
             UNION ALL
             SELECT format('instance %s is %s although its reservation %s is %s', i.id, i.state, r.id, r.state)
               FROM instances i JOIN reservations r ON r.id = i.allocation_id
              WHERE (i.state <> 'deleted' AND r.state NOT IN ('pending', 'placed', 'active')) OR (i.state = 'requested' AND r.state IN ('placed', 'active'))
             ORDER BY 1 LIMIT 10",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

impl Sim {
    /// After the heal: the instances settle on what the hosts have (nothing leaked, nothing
    /// missing, none outliving its reservation), within the heal timeout.
    async fn settle_instances(&self, db: &mut tokio_postgres::Client) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + Duration::from_secs(self.args.heal_timeout_s);
        loop {
            self.reconnect(db).await?;
            let found = instance_differences(db).await?;
            if found.is_empty() {
                return Ok(found);
            }
            if Instant::now() > deadline {
                return Ok(found.into_iter().map(|d| format!("after the heal, {d}")).collect());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Moves the simulated clock with real time, 200 ms at a time, until `stop`. While the database is
/// away, time waits for it.
async fn tick_clock(conn: String, stop: Arc<AtomicBool>) {
    let mut last = Instant::now();
    let mut client: Option<tokio_postgres::Client> = None;
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = better_compute_db::pool::connect(&conn).await.ok();
        }
        let Some(c) = &client else { continue };
        let now = Instant::now();
        if better_compute_db::clock::advance_sim_clock(c, now - last).await.is_ok() {
            last = now;
        }
    }
}

/// Advances the simulated clock; a failure (the database is restarting) only delays time.
async fn advance_clock(conn: &str, by: Duration) {
    if let Ok(c) = better_compute_db::pool::connect(conn).await {
        let _ = better_compute_db::clock::advance_sim_clock(&c, by).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_seed_ranges_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("ten").unwrap_err().contains("like 90s"));
        assert_eq!(parse_seeds("3").unwrap(), 3..=3);
        assert_eq!(parse_seeds("1-100").unwrap(), 1..=100);
        assert!(parse_seeds("9-1").is_err());
    }
}
