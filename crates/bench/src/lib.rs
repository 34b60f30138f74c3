//! `better-compute bench`: benchmarks that print their figures beside a baseline measured on the
//! same database in the same run. They never fail on time. Each bench is a file of its own;
//! `report` writes what `bench all` prints and saves.
//!
//! An application crate, as the binary's other parts: its functions return `anyhow` errors.

mod api;
mod capacity;
mod commands;
mod events;
mod gateway;
mod report;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use better_compute_db::launcher::{Cluster, ClusterOptions, PgBinaries};
use better_compute_db::workers::{self, WorkerInfo};
use better_compute_runtime::outbox::Event;
use better_compute_runtime::{
    work_queue, Kind, Module, NewEvent, Outcome, ReconcileContext, Reconciler, Registry, RunError, ShardBy, Sink, Worker,
    WorkerConfig,
};

/// Options of `better-compute bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Debug, clap::Subcommand)]
enum Which {
    /// No-op reconciles per second with one and two worker processes, and outbox events per second
    /// from commit to an in-process subscriber, beside pgbench's claim-and-delete rate. Starts its
    /// own throwaway PostgreSQL.
    Runtime(RuntimeBench),
    /// One worker process of `bench runtime` (started by it).
    #[command(hide = true)]
    RuntimeWorker(RuntimeWorker),
    /// Placements per second with 64 concurrent clients on 1,000 and 10,000 nodes of 8 GPUs, 20% of
    /// requests aimed at a few hot nodes, beside pgbench's TPC-B on the same database: in a steady
    /// state (each placement followed by a release) and in a burst (placements, then releases).
    Capacity(crate::capacity::CapacityBench),
    /// Commands enqueued per second (one per transaction) and desired-state recomputations per
    /// second for 10,000 nodes after a site-wide change, beside pgbench's TPC-B.
    Commands(crate::commands::CommandsBench),
    /// nodes.get and reservations.create over HTTP with 64 concurrent clients, requests/s and
    /// p50/p99, beside the same operations called in-process.
    Api(crate::api::ApiBench),
    /// One gateway process holding many simulated daemon sessions (default 10,000) over mTLS:
    /// memory per session, command enqueue-to-daemon p50/p99 at 1,000 commands/s, and the time for
    /// every node to converge after one change to every node's desired state.
    Gateway(crate::gateway::GatewayBench),
    /// Events per second from commit to watch-stream (SSE) clients with 100 subscribers, and
    /// commit-to-delivery p50/p99, beside pgbench's TPC-B.
    Events(crate::events::EventsBench),
    /// Every benchmark above, one after another, with a progress bar; writes one report (Markdown,
    /// JSON and an SVG of the latency distributions) with the machine, the versions and the ratios.
    All(crate::report::AllBench),
}

#[derive(Debug, clap::Args)]
pub(crate) struct RuntimeBench {
    /// Keys enqueued for each reconcile run.
    #[arg(long, default_value_t = 50_000)]
    keys: usize,
    /// Events written for each outbox run.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Seconds pgbench runs.
    #[arg(long, default_value_t = 5)]
    pgbench_seconds: u32,
}

#[derive(Debug, clap::Args)]
struct RuntimeWorker {
    #[arg(long)]
    conn: String,
    #[arg(long)]
    id: String,
}

const NOOP: Kind = Kind { name: "bench.noop", shard_by: ShardBy::Node };

struct Noop;

#[async_trait::async_trait]
impl Reconciler for Noop {
    fn kind(&self) -> Kind {
        NOOP
    }
    async fn run(&self, _ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        Ok(Outcome::Done)
    }
}

struct Counter {
    seen: AtomicU64,
}

#[async_trait::async_trait]
impl Sink for Counter {
    fn name(&self) -> &str {
        "bench.counter"
    }
    async fn deliver(&self, _tx: &tokio_postgres::Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        self.seen.fetch_add(events.len() as u64, Ordering::SeqCst);
        Ok(())
    }
}

struct BenchModule {
    counter: Arc<Counter>,
}

impl Module for BenchModule {
    fn name(&self) -> &'static str {
        "bench"
    }
    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![Arc::new(Noop)]
    }
    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        vec![self.counter.clone()]
    }
}

fn bench_registry(counter: Arc<Counter>) -> anyhow::Result<Arc<Registry>> {
    Ok(Arc::new(Registry::new(vec![Arc::new(BenchModule { counter })])?))
}

/// Runs a benchmark.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.which {
        Which::Runtime(b) => runtime_bench(b).await,
        Which::RuntimeWorker(w) => runtime_worker(w).await,
        Which::Capacity(b) => crate::capacity::run(b).await,
        Which::Commands(b) => crate::commands::run(b).await,
        Which::Api(b) => crate::api::run(b).await,
        Which::Events(b) => crate::events::run(b).await,
        Which::Gateway(b) => crate::gateway::run(b).await,
        Which::All(b) => crate::report::run(b).await,
    }
}

/// Loads pg_stat_statements in a throwaway cluster when this PostgreSQL has it (Debian's
/// `postgresql` package does): what [`top_statements`] reads. Returns whether it did.
fn enable_pg_stat_statements(data_dir: &std::path::Path) -> anyhow::Result<bool> {
    let Ok(bins) = better_compute_db::launcher::PgBinaries::find() else { return Ok(false) };
    let lib = bins.bindir().join("../lib/pg_stat_statements.so");
    if !lib.exists() {
        return Ok(false);
    }
    use std::io::Write as _;
    let mut conf = std::fs::OpenOptions::new().append(true).open(data_dir.join("postgresql.conf"))?;
    writeln!(conf, "shared_preload_libraries = 'pg_stat_statements'\npg_stat_statements.track = all")?;
    Ok(true)
}

/// Forgets what pg_stat_statements counted so far (nothing when it is not loaded).
pub(crate) async fn reset_statements(db: &tokio_postgres::Client) {
    let _ = db.execute("SELECT pg_stat_statements_reset()", &[]).await;
}

/// Where the database's time went since the last [`reset_statements`]: the `n` statements with the
/// most execution time (lock waits included), printed and recorded for the report under `phase`.
pub(crate) async fn top_statements(db: &tokio_postgres::Client, phase: &str, n: i64) {
    let Ok(rows) = db
        .query(
            "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 160), calls, total_exec_time, mean_exec_time,
                    100 * total_exec_time / nullif(sum(total_exec_time) OVER (), 0)
               FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
              ORDER BY total_exec_time DESC LIMIT $1",
            &[&n],
        )
        .await
    else {
        return;
    };
    println!("where the database's time went, {phase}:");
    let mut top = Vec::new();
    for r in &rows {
        let s = report::Statement { query: r.get(0), calls: r.get(1), total_ms: r.get(2), mean_ms: r.get(3), share_pct: r.get::<_, Option<f64>>(4).unwrap_or(0.0) };
        println!("  {:>5.1}%  {:>8} calls  {:>9.1} ms  {:>7.2} ms each  {}", s.share_pct, s.calls, s.total_ms, s.mean_ms, s.query);
        top.push(s);
    }
    report::profile(phase, top);
}

/// Stops the throwaway cluster and removes its folder, also on errors.
pub(crate) struct Scratch {
    pub(crate) cluster: Cluster,
    root: PathBuf,
}

impl Scratch {
    /// Starts a throwaway PostgreSQL (fsync on, as in production) with a database `bench`.
    pub(crate) async fn start(max_connections: u32) -> anyhow::Result<Scratch> {
        let root = std::env::temp_dir().join(format!("better-compute-bench-{}", std::process::id()));
        std::fs::create_dir_all(&root)?;
        let cluster = Cluster::new(ClusterOptions {
            data_dir: root.join("data"),
            socket_dir: root.join("sock"),
            durable: true,
            max_connections,
        })?;
        // A bench killed outright (no Drop) still leaves no cluster behind.
        better_compute_db::testing::spawn_reaper(std::process::id() as i32, &root)?;
        let scratch = Scratch { cluster: cluster.clone(), root };
        println!("starting a throwaway PostgreSQL (fsync and synchronous_commit on, as in production)…");
        cluster.init_if_needed()?;
        let statements = enable_pg_stat_statements(&scratch.root.join("data"))?;
        cluster.start()?;
        let admin = better_compute_db::pool::connect(&cluster.connection_string("postgres")).await?;
        admin.batch_execute("CREATE DATABASE bench").await?;
        if statements {
            let bench = better_compute_db::pool::connect(&cluster.connection_string("bench")).await?;
            bench.batch_execute("CREATE EXTENSION pg_stat_statements").await?;
        }
        Ok(scratch)
    }

    /// The throwaway folder (removed with the cluster).
    pub(crate) fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// The bench database's connection string.
    pub(crate) fn conn(&self) -> String {
        self.cluster.connection_string("bench")
    }

    /// The baseline every benchmark is compared with: initialises pgbench's TPC-B (scale 10) and
    /// runs it with `clients` for `seconds`; prints and returns its tps.
    pub(crate) fn tpcb(&self, clients: usize, seconds: u32) -> anyhow::Result<f64> {
        println!("pgbench: initialising TPC-B (scale 10)…");
        self.pgbench(&["-i", "-q", "-s", "10"]).ok();
        let tps = self.pgbench(&["-n", "-c", &clients.to_string(), "-j", "2", "-T", &seconds.to_string()])?;
        println!("pgbench TPC-B, {clients} clients: {tps:.0} tps");
        Ok(tps)
    }

    /// Runs pgbench with `args` on the bench database and returns its tps.
    pub(crate) fn pgbench(&self, args: &[&str]) -> anyhow::Result<f64> {
        let bins = PgBinaries::find()?;
        let pgbench = [bins.bindir().join("pgbench"), PathBuf::from("/usr/bin/pgbench")]
            .into_iter()
            .find(|p| p.is_file())
            .context("pgbench not found; install Debian's postgresql-client package")?;
        let out = Command::new(pgbench)
            .args(args)
            .args(["-U", "postgres", "-h"])
            .arg(&self.cluster.options().socket_dir)
            .arg("bench")
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.trim().strip_prefix("tps = ")?.split_whitespace().next()?.parse::<f64>().ok())
            .with_context(|| format!("pgbench printed no tps: {text}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = self.cluster.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

pub(crate) async fn runtime_bench(b: RuntimeBench) -> anyhow::Result<()> {
    let scratch = Scratch::start(100).await?;
    let conn = scratch.conn();
    let counter = Arc::new(Counter { seen: AtomicU64::new(0) });
    let registry = bench_registry(counter.clone())?;
    let mut db = better_compute_db::pool::connect(&conn).await?;
    better_compute_db::migrate(&mut db, &registry.migrations()).await?;

    let pgbench_tps = pgbench_claim_and_delete(&scratch, &db, b.pgbench_seconds).await?;
    println!("pgbench claim-and-delete (one key per transaction, 2 clients): {pgbench_tps:.0} tx/s");
    let baseline = Some(("pgbench claim-and-delete", pgbench_tps));

    for processes in [1usize, 2] {
        let rate = reconciles_per_second(&db, &conn, b.keys, processes).await?;
        println!(
            "no-op reconciles, {processes} worker process{}: {rate:.0}/s ({:.2}x pgbench)",
            if processes == 1 { "" } else { "es" },
            rate / pgbench_tps
        );
        crate::report::figure("runtime", format!("no-op reconciles, {processes} worker process(es)"), rate, "/s", baseline);
    }

    for per_tx in [1usize, 100] {
        let total = if per_tx == 1 { b.events } else { b.events * 5 };
        let rate = outbox_events_per_second(&conn, registry.clone(), counter.clone(), total, per_tx).await?;
        println!("outbox events, {per_tx} per transaction, commit to in-process subscriber: {rate:.0}/s");
        crate::report::figure("runtime", format!("outbox events to a subscriber, {per_tx} per transaction"), rate, "/s", baseline);
    }
    drop(db);
    drop(scratch);
    Ok(())
}

async fn pgbench_claim_and_delete(scratch: &Scratch, db: &tokio_postgres::Client, seconds: u32) -> anyhow::Result<f64> {
    db.batch_execute(
        "CREATE TABLE pgbench_work (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, shard smallint NOT NULL);
         INSERT INTO pgbench_work (shard) SELECT g % 256 FROM generate_series(1, 2000000) g;",
    )
    .await?;
    db.batch_execute("VACUUM ANALYZE pgbench_work").await?;
    let script = std::env::temp_dir().join(format!("better-compute-pgbench-{}.sql", std::process::id()));
    std::fs::write(
        &script,
        "DELETE FROM pgbench_work WHERE id = (SELECT id FROM pgbench_work ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED);\n",
    )?;
    let tps = scratch.pgbench(&["-n", "-c", "2", "-j", "2", "-T", &seconds.to_string(), "-f", &script.to_string_lossy()]);
    let _ = std::fs::remove_file(&script);
    db.batch_execute("DROP TABLE pgbench_work").await?;
    tps
}

async fn reconciles_per_second(db: &tokio_postgres::Client, conn: &str, keys: usize, processes: usize) -> anyhow::Result<f64> {
    db.batch_execute("DELETE FROM work_queue; DELETE FROM workers; DELETE FROM leases;").await?;
    let all: Vec<String> = (0..keys).map(|i| format!("node_bench_{i}")).collect();
    for chunk in all.chunks(5_000) {
        work_queue::enqueue_many(db, &NOOP, chunk).await?;
    }
    let ids: Vec<String> = (0..processes).map(|i| format!("wrk_bench_{i}")).collect();
    for id in &ids {
        // Registered up front, so every worker's first look divides the shards the same way.
        let info = WorkerInfo { id: id.clone(), hostname: "bench".into(), pid: 0, roles: vec!["worker".into()], version: "bench".into() };
        workers::register(db, &info).await?;
    }
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for id in &ids {
        let mut child = Command::new(&exe)
            .args(["bench", "runtime-worker", "--conn", conn, "--id", id])
            .env("BETTER_COMPUTE_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        children.push((child, lines));
    }
    for (_, lines) in &mut children {
        let line = lines.next().context("worker exited before it was ready")??;
        if line != "ready" {
            bail!("worker said {line:?} instead of ready");
        }
    }
    let start = Instant::now();
    for (child, _) in &mut children {
        writeln!(child.stdin.as_mut().expect("piped"), "go")?;
    }
    let mut ran = 0u64;
    for (child, lines) in &mut children {
        let line = lines.next().context("worker exited before it was done")??;
        ran += line.strip_prefix("done ").and_then(|n| n.parse::<u64>().ok()).context("bad worker report")?;
        child.wait()?;
    }
    let elapsed = start.elapsed();
    let left: i64 = db.query_one("SELECT count(*) FROM work_queue WHERE kind = $1", &[&NOOP.name]).await?.get(0);
    if left != 0 || ran != keys as u64 {
        bail!("reconcile benchmark incomplete: ran {ran} of {keys}, {left} left in the queue");
    }
    Ok(keys as f64 / elapsed.as_secs_f64())
}

async fn runtime_worker(w: RuntimeWorker) -> anyhow::Result<()> {
    let counter = Arc::new(Counter { seen: AtomicU64::new(0) });
    let pool = better_compute_db::pool::connect_pool(&w.conn, 8)?;
    let mut cfg = WorkerConfig::new(w.id);
    cfg.claim_batch = 512;
    let worker = Worker::start(pool, bench_registry(counter)?, cfg).await?;
    worker.maintain().await?;
    println!("ready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go)?;
    let mut ran = 0;
    loop {
        let r = worker.tick(NOOP.name).await?;
        ran += r.done;
        if r.claimed == 0 {
            break;
        }
    }
    println!("done {ran}");
    Ok(())
}

async fn outbox_events_per_second(
    conn: &str,
    registry: Arc<Registry>,
    counter: Arc<Counter>,
    total: usize,
    per_tx: usize,
) -> anyhow::Result<f64> {
    let pool = better_compute_db::pool::connect_pool(conn, 8)?;
    {
        let c = pool.get().await?;
        c.batch_execute("DELETE FROM workers; DELETE FROM leases; DELETE FROM outbox_cursors; DELETE FROM outbox;").await?;
    }
    let mut cfg = WorkerConfig::new(format!("wrk_outbox_{per_tx}"));
    cfg.poll_interval = Duration::from_millis(20);
    let worker = Arc::new(Worker::start(pool.clone(), registry, cfg).await?);
    worker.maintain().await?;
    counter.seen.store(0, Ordering::SeqCst);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(worker.clone().run(stopped));
    let start = Instant::now();
    let writers = 4;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let pool = pool.clone();
        let share = total / writers;
        tasks.push(tokio::spawn(async move {
            let mut c = pool.get().await?;
            for batch in 0..share / per_tx {
                let tx = c.transaction().await?;
                for i in 0..per_tx {
                    let subject = format!("w{w}-{batch}-{i}");
                    better_compute_runtime::outbox::emit(
                        &*tx,
                        NewEvent { event_type: "bench.event", tenant_id: None, subject: &subject, data: serde_json::json!({}) },
                    )
                    .await?;
                }
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let expected = (total / writers / per_tx * per_tx * writers) as u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    while counter.seen.load(Ordering::SeqCst) < expected {
        if Instant::now() > deadline {
            bail!("subscriber saw {} of {expected} events", counter.seen.load(Ordering::SeqCst));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    stop.send(true)?;
    running.await??;
    Ok(expected as f64 / elapsed.as_secs_f64())
}
