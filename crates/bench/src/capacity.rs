//! `better-compute bench capacity`: placements per second under contention, at two fleet sizes,
//! beside pgbench's TPC-B on the same database: in a steady state (each placement followed by a
//! release) and in a burst (placements with no release in the window, then the releases alone).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use better_compute_capacity::batch::{BatchPlacer, BatchSettings};
use better_compute_capacity::service::Reservations;
use better_compute_capacity::Caller;

use crate::Scratch;

/// Options of `better-compute bench capacity`.
#[derive(Debug, clap::Args)]
pub struct CapacityBench {
    /// Concurrent clients, each a tenant of its own (at most 1,024).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Reservations created per fleet size in the steady state, each with the release that follows
    /// it. About 6 s at 2,000 a second, against TPC-B's 10 s: over 4,000 (2 s), the same fleet
    /// measured twice in one run differed by up to a quarter on the 2-core machine.
    #[arg(long, default_value_t = 12000)]
    steady_placements: usize,
    /// Reservations created per fleet size in the burst (4,000 leave 1,000 nodes about 75% full).
    #[arg(long, default_value_t = 4000)]
    placements: usize,
    /// Live reservations whose usage windows are closed at the end, on the largest fleet (0: skip).
    #[arg(long, default_value_t = 10_000)]
    metered: usize,
    /// Fleet sizes, in nodes of 8 GPUs.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    nodes: Vec<usize>,
    /// Percent of requests aimed at the few hot nodes (by node selector).
    #[arg(long, default_value_t = 20)]
    hot_percent: u64,
    /// Seconds pgbench runs.
    #[arg(long, default_value_t = 10)]
    pgbench_seconds: u32,
    /// Batchers of the batch placer (capacity::batch); 0 places every request alone.
    #[arg(long, default_value_t = better_compute_capacity::batch::BatchSettings::default().batchers)]
    batchers: usize,
    /// Most requests in one batch.
    #[arg(long, default_value_t = better_compute_capacity::batch::BatchSettings::default().max_batch)]
    max_batch: usize,
    /// Further batches a request the batch did not do tries before it runs alone.
    #[arg(long, default_value_t = better_compute_capacity::batch::BatchSettings::default().retries)]
    batch_retries: u8,
    /// Leave the throwaway PostgreSQL running afterwards (its socket is printed), to inspect it.
    #[arg(long)]
    keep: bool,
}

const HOT_NODES: usize = 8;

#[derive(Default)]
struct Outcomes {
    placed: AtomicUsize,
    pending: AtomicUsize,
    pending_on_conflicts: AtomicUsize,
    failed: AtomicUsize,
    release_failed: AtomicUsize,
}

pub(crate) async fn seed(db: &tokio_postgres::Client, nodes: usize) -> anyhow::Result<()> {
    db.batch_execute(
        "TRUNCATE reservations, device_bookings, device_booking_history, node_atom_counts, pool_capacity_rollup, node_resources, devices, nodes,
                  pools, sites, quota_usage, outbox, work_queue, idempotency_keys CASCADE",
    )
    .await?;
    let n = nodes as i32;
    db.batch_execute("INSERT INTO sites (id, name) VALUES ('site_bench', 'bench');
                      INSERT INTO pools (id, site_id, name, kind) VALUES ('pool_bench', 'site_bench', 'bench', 'bare-metal');")
        .await?;
    db.execute(
        "INSERT INTO nodes (id, pool_id, name, shard, labels, generation, observed_generation, vcpu, memory_mib, disk_gib)
         SELECT 'node_b' || g, 'pool_bench', 'n' || g, (g % 256)::int2,
                CASE WHEN g <= $2 THEN '{\"hot\": \"yes\"}' ELSE '{}' END::jsonb, 1, 1, 128, 1048576, 8000
           FROM generate_series(1, $1) g",
        &[&n, &(HOT_NODES as i32)],
    )
    .await?;
    db.execute(
        "INSERT INTO devices (id, node_id, kind, index, model, memory_mib, mode)
         SELECT 'GPU-b' || g || '-' || i, 'node_b' || g, 'gpu', i, 'H100-80GB', 81920, 'exclusive'
           FROM generate_series(1, $1) g, generate_series(0, 7) i",
        &[&n],
    )
    .await?;
    db.batch_execute(
        "SELECT capacity_refresh_node_counts(id) FROM nodes;
         INSERT INTO quota_usage (tenant_id, resource, max)
         SELECT 'ten_bench' || t, r, 1000000000000
           FROM unnest(ARRAY['gpus', 'vcpu', 'memory_mib', 'disk_gib']) r, generate_series(0, 1023) t;",
    )
    .await?;
    // VACUUM also merges the GIN index's pending list, as autovacuum would on a live system.
    db.batch_execute("VACUUM ANALYZE").await?;
    Ok(())
}

/// CPU time spent by the whole machine so far (user, nice, system, irq, softirq; not idle, iowait or
/// steal), from Linux's /proc/stat; None elsewhere. Under saturation the throughput swings with the
/// machine's other load, the CPU spent per placement much less: the figure to compare changes by.
fn machine_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).map(|t| t.parse().unwrap_or(0)).collect();
    let busy: u64 = [0, 1, 2, 5, 6].iter().filter_map(|i| ticks.get(*i)).sum();
    // USER_HZ is 100 on every Linux this runs on.
    Some(busy as f64 / 100.0)
}

fn rand_below(n: u64) -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    u64::from_le_bytes(b) % n
}

/// Placements (each with its churn of releases) every client makes before the clock starts, and
/// releases again. A fresh backend loads its catalogs, compiles the functions and plans their
/// statements: about 70 ms of CPU each, measured as the CPU per placement falling from 7.3 to 5.4 ms
/// between runs of 2,000 and 12,000 placements. A server's pooled connections pay that once, so the
/// timed part starts warm.
const WARM_UP_PER_CLIENT: usize = 8;

/// One client's reservations: it creates one, then releases all but its two newest.
struct BenchClient {
    /// Shared by every client, as a server's API process shares one.
    reservations: Arc<Reservations>,
    tenant: String,
    held: std::collections::VecDeque<String>,
    /// Each create and release as an API request's (else as a job's); either records its audit
    /// entry.
    audited: bool,
}

impl BenchClient {
    /// Who makes this client's changes: an API request of its tenant's, or a job.
    fn actor(&self, action: &str, target: &str) -> better_compute_audit::Actor {
        if !self.audited {
            return better_compute_audit::Actor::job("bench");
        }
        better_compute_audit::Actor::Request(Arc::new(better_compute_audit::entry::Request {
            identity_id: "idn_bench".into(),
            token_id: "tok_bench".into(),
            tenant_id: self.tenant.clone(),
            action: action.into(),
            target: target.into(),
            request_id: "req_bench".into(),
            source: Some("127.0.0.1".into()),
            request_digest: "0".repeat(64),
        }))
    }

    /// Creates one reservation (a fifth of them, by default, aimed at the hot nodes), then releases
    /// down to two held.
    async fn churn(&mut self, hot_percent: u64, outcomes: &Outcomes) {
        self.place(hot_percent, outcomes).await;
        self.release_down_to(2, outcomes).await;
    }

    /// Creates one reservation, a fifth of them (by default) aimed at the hot nodes, and holds it.
    async fn place(&mut self, hot_percent: u64, outcomes: &Outcomes) {
        let mut req = better_compute_testing::reservation("pool_bench", better_compute_testing::atoms("gpu", None, 1 + rand_below(2) as i32), 4, 16_384, 50, 3600);
        if rand_below(100) < hot_percent {
            req.node_selector.insert("hot".into(), serde_json::json!("yes"));
        }
        let me = Caller { tenant_id: &self.tenant, identity_id: "idn_bench" };
        match self.reservations.create(&self.actor("reservations.create", ""), me, &req).await {
            Ok(r) => {
                if r.state == "pending" {
                    outcomes.pending.fetch_add(1, Ordering::Relaxed);
                    if r.conditions.first().is_some_and(|c| c["reason"] == "Conflicts") {
                        outcomes.pending_on_conflicts.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    outcomes.placed.fetch_add(1, Ordering::Relaxed);
                }
                self.held.push_back(r.id);
            }
            Err(e) => {
                outcomes.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "placement failed");
            }
        }
    }

    /// Releases the oldest reservations until `keep` are held.
    async fn release_down_to(&mut self, keep: usize, outcomes: &Outcomes) {
        while self.held.len() > keep {
            let id = self.held.pop_front().expect("non-empty");
            let me = Caller { tenant_id: &self.tenant, identity_id: "idn_bench" };
            if let Err(e) = self.reservations.release(&self.actor("reservations.release", &id), me, &id).await {
                outcomes.release_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "release failed");
            }
        }
    }
}

/// One connected client per tenant, warmed up (see WARM_UP_PER_CLIENT) and holding nothing.
async fn warm_clients(conn: &str, clients: usize, hot_percent: u64, batch: BatchSettings, audited: bool) -> anyhow::Result<Vec<BenchClient>> {
    // One service over one pool, as in a server's API process: a connection for each client's runs
    // alone and two for each batcher.
    let pool = better_compute_db::pool::connect_pool(conn, clients + 2 * batch.batchers)?;
    let reservations = Arc::new(Reservations::start(pool, batch));
    // One tenant per client: a tenant's reservations serialize on its quota rows (the guarded quota
    // update holds them to commit), so one tenant measures that row, not the placer.
    let mut cold = Vec::new();
    for i in 0..clients {
        cold.push(BenchClient { reservations: reservations.clone(), tenant: format!("ten_bench{i}"), held: Default::default(), audited });
    }
    let warm_up = |clients| {
        timed(clients, |mut c: BenchClient| async move {
            let scratch = Outcomes::default();
            for _ in 0..WARM_UP_PER_CLIENT {
                c.churn(hot_percent, &scratch).await;
            }
            c.release_down_to(0, &scratch).await;
            c
        })
    };
    let (warm, _, _) = warm_up(cold).await?;
    // Statistics as autovacuum keeps them on a running system: the fleet was analyzed before it had
    // a booking. Analyzing also invalidates every plan made from those statistics, so the clients
    // warm up again: each backend plans each statement five or six times before it settles on a
    // generic plan, which a server's long-lived connections do once, not in the timed window.
    better_compute_db::pool::connect(conn).await?.batch_execute("ANALYZE").await?;
    let (warm, _, _) = warm_up(warm).await?;
    Ok(warm)
}

/// The batch placer's counters: batches, requests done in them, tried again in a later batch,
/// handed back, batches failed.
fn batch_counts(p: &BatchPlacer) -> [u64; 5] {
    let c = p.counters();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    [get(&c.batches), get(&c.done), get(&c.retried), get(&c.run_alone), get(&c.failed_batches)]
}

/// Runs `work` on every client at once until each returns; the clients come back with the seconds
/// it took and the CPU the machine spent (seconds, where known).
async fn timed<F, Fut>(clients: Vec<BenchClient>, work: F) -> anyhow::Result<(Vec<BenchClient>, f64, Option<f64>)>
where
    F: Fn(BenchClient) -> Fut,
    Fut: std::future::Future<Output = BenchClient> + Send + 'static,
{
    let start = Instant::now();
    let cpu_start = machine_cpu_s();
    let tasks: Vec<_> = clients.into_iter().map(|c| tokio::spawn(work(c))).collect();
    let mut back = Vec::new();
    for t in tasks {
        back.push(t.await?);
    }
    let cpu_s = cpu_start.zip(machine_cpu_s()).map(|(a, b)| b - a);
    Ok((back, start.elapsed().as_secs_f64(), cpu_s))
}

/// `total` creates shared out among the clients, timed (see `timed`), each followed by releases down
/// to two held when `churn`; also returns their outcomes.
async fn timed_creates(
    clients: Vec<BenchClient>,
    total: usize,
    hot_percent: u64,
    churn: bool,
) -> anyhow::Result<(Vec<BenchClient>, f64, Option<f64>, Arc<Outcomes>)> {
    let next = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(Outcomes::default());
    let placer = clients.first().and_then(|c| c.reservations.placer().cloned());
    let before = placer.as_ref().map(batch_counts);
    let (clients, elapsed_s, cpu_s) = timed(clients, |mut c| {
        let (next, outcomes) = (next.clone(), outcomes.clone());
        async move {
            while next.fetch_add(1, Ordering::SeqCst) < total {
                if churn {
                    c.churn(hot_percent, &outcomes).await;
                } else {
                    c.place(hot_percent, &outcomes).await;
                }
            }
            c
        }
    })
    .await?;
    if let (Some(p), Some(before)) = (&placer, before) {
        let after = batch_counts(p);
        let [b, d, r, a, f] = std::array::from_fn(|i| after[i] - before[i]);
        println!(
            "  batch placer: {b} batches, {d} requests done in them ({:.1} a batch), {r} tried again in the next batch, {a} handed back to run alone, {f} batches failed whole",
            d as f64 / b.max(1) as f64
        );
    }
    Ok((clients, elapsed_s, cpu_s, outcomes))
}

/// Steady state: each client creates and releases all but its two newest, `total` creates in all.
/// Placements per second, the CPU the machine spent per placement and its release (milliseconds,
/// where known), and the outcomes.
async fn placements_per_second(conn: &str, clients: usize, total: usize, hot_percent: u64, batch: BatchSettings, audited: bool) -> anyhow::Result<(f64, Option<f64>, Arc<Outcomes>)> {
    let warm = warm_clients(conn, clients, hot_percent, batch, audited).await?;
    let (_, elapsed_s, cpu_s, outcomes) = timed_creates(warm, total, hot_percent, true).await?;
    Ok((total as f64 / elapsed_s, cpu_s.map(|s| 1000.0 * s / total as f64), outcomes))
}

/// A burst: `total` creates with no release in the timed window, then every reservation released
/// in a second timed window. Placed reservations per second and the CPU per create, releases per
/// second and the CPU per release, and the creates' outcomes.
async fn burst(conn: &str, clients: usize, total: usize, hot_percent: u64, batch: BatchSettings) -> anyhow::Result<(f64, Option<f64>, f64, Option<f64>, Arc<Outcomes>)> {
    let warm = warm_clients(conn, clients, hot_percent, batch, false).await?;
    let (held, place_s, place_cpu_s, outcomes) = timed_creates(warm, total, hot_percent, false).await?;
    let releases = held.iter().map(|c| c.held.len()).sum::<usize>().max(1);
    let (_, release_s, release_cpu_s) = timed(held, |mut c| {
        let outcomes = outcomes.clone();
        async move {
            c.release_down_to(0, &outcomes).await;
            c
        }
    })
    .await?;
    Ok((
        outcomes.placed.load(Ordering::Relaxed) as f64 / place_s,
        place_cpu_s.map(|s| 1000.0 * s / total as f64),
        releases as f64 / release_s,
        release_cpu_s.map(|s| 1000.0 * s / releases as f64),
        outcomes,
    ))
}

/// What closing the live reservations' usage windows took.
struct Metering {
    live: i64,
    windows: u64,
    seconds: f64,
}

/// Moves the clock three hours on (the simulated clock, for this measurement only), then closes
/// every live reservation's windows with four connections at once, as `capacity.usage` runs do
/// (256 reservations a call, `FOR UPDATE SKIP LOCKED` sharing them out), and puts the real clock back.
async fn metering(conn: &str) -> anyhow::Result<Metering> {
    let c = better_compute_db::pool::connect(conn).await?;
    let now = better_compute_db::clock::db_now(&c).await?;
    better_compute_db::clock::use_sim_clock(&c, now + std::time::Duration::from_secs(3 * 3600)).await?;
    let live: i64 = c.query_one("SELECT count(*) FROM reservations WHERE state IN ('placed', 'active')", &[]).await?.get(0);
    let pools: Vec<String> = c.query("SELECT DISTINCT pool_id FROM reservations WHERE state IN ('placed', 'active')", &[]).await?.iter().map(|r| r.get(0)).collect();
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (conn, pools) = (conn.to_owned(), pools.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await?;
            let mut written = 0u64;
            for pool in &pools {
                loop {
                    let tx = c.transaction().await?;
                    let n = tx.query("SELECT id FROM capacity_usage_close($1, 256)", &[pool]).await?.len();
                    tx.commit().await?;
                    written += n as u64;
                    if n == 0
                        && !c
                            .query_one("SELECT EXISTS (SELECT 1 FROM reservations r WHERE r.pool_id = $1 AND capacity_usage_is_due(r, capacity_usage_closed_until()))", &[pool])
                            .await?
                            .get::<_, bool>(0)
                    {
                        break;
                    }
                }
            }
            anyhow::Ok(written)
        }));
    }
    let mut windows = 0;
    for t in tasks {
        windows += t.await??;
    }
    let seconds = started.elapsed().as_secs_f64();
    better_compute_db::clock::use_real_clock(&c).await?;
    Ok(Metering { live, windows, seconds })
}

/// Runs the benchmark.
#[allow(clippy::too_many_lines, reason = "the benchmark's script: each phase and its printed figures in the order of the report")]
pub async fn run(b: CapacityBench) -> anyhow::Result<()> {
    let scratch = Scratch::start((b.clients + b.batchers) as u32 + 40).await?;
    let conn = scratch.conn();
    let mut db = better_compute_db::pool::connect(&conn).await?;
    better_compute_db::migrate(&mut db, &better_compute_server::registry()?.migrations()).await?;
    // The clients' pokes folded together, as in a server (work_queue::Poker).
    better_compute_runtime::work_queue::Poker::install(better_compute_db::pool::connect_pool(&conn, 1)?);
    let cpu_start = machine_cpu_s();
    let tpcb = scratch.tpcb(b.clients, b.pgbench_seconds)?;
    let tpcb_cpu_ms = cpu_start.zip(machine_cpu_s()).map(|(a, c)| 1000.0 * (c - a) / (tpcb * b.pgbench_seconds as f64));
    if let Some(ms) = tpcb_cpu_ms {
        println!("pgbench TPC-B: {ms:.2} ms of CPU per transaction (the whole machine's, pgbench included)");
    }
    let batch = BatchSettings { batchers: b.batchers, max_batch: b.max_batch, retries: b.batch_retries, ..BatchSettings::default() };
    let mut first: Option<f64> = None;
    for nodes in &b.nodes {
        println!("seeding {nodes} nodes x 8 GPUs…");
        seed(&db, *nodes).await?;
        let (rate, cpu_ms, o) = placements_per_second(&conn, b.clients, b.steady_placements, b.hot_percent, batch, false).await?;
        let failed = o.failed.load(Ordering::Relaxed);
        let lost = o.pending_on_conflicts.load(Ordering::Relaxed);
        println!(
            "{nodes} nodes x 8 GPUs, {} clients, {}% aimed at {HOT_NODES} hot nodes: {rate:.0} placements/s ({:.2}x pgbench TPC-B){}; \
             placed {}, pending {} ({} of them after losing every race), errors {} (releases: {}); conflicts ending without a placement: {:.2}%{}",
            b.clients,
            b.hot_percent,
            rate / tpcb,
            cpu_ms.map(|ms| format!(", {ms:.2} ms of CPU per placement and its release")).unwrap_or_default(),
            o.placed.load(Ordering::Relaxed),
            o.pending.load(Ordering::Relaxed),
            lost,
            failed,
            o.release_failed.load(Ordering::Relaxed),
            100.0 * (failed + lost) as f64 / b.steady_placements as f64,
            match first {
                Some(f) => format!("; {:.2}x the {}-node figure", rate / f, b.nodes[0]),
                None => String::new(),
            }
        );
        let tpcb_name = format!("pgbench TPC-B, {} clients", b.clients);
        crate::report::figure("capacity", format!("placements, {nodes} nodes x 8 GPUs, {} clients", b.clients), rate, "/s", Some((&tpcb_name, tpcb)));
        crate::report::figure(
            "capacity",
            format!("conflicts ending without a placement, {nodes} nodes"),
            100.0 * (failed + lost) as f64 / b.steady_placements as f64,
            "%",
            None,
        );
        if let Some(f) = first {
            crate::report::figure("capacity", format!("placements at {nodes} nodes"), rate, "/s", Some((&format!("placements at {} nodes", b.nodes[0]), f)));
        }
        if first.is_none() {
            // The same again as API requests (each create and release records its audit entry with
            // it either way: the request's here, a job's above).
            seed(&db, *nodes).await?;
            let (audited, audited_cpu_ms, _) = placements_per_second(&conn, b.clients, b.steady_placements, b.hot_percent, batch, true).await?;
            println!(
                "{nodes} nodes, as API requests: {audited:.0} placements/s ({:.2}x as a job's in this run){}",
                audited / rate,
                audited_cpu_ms.map(|ms| format!(", {ms:.2} ms of CPU per placement and its release")).unwrap_or_default()
            );
            crate::report::figure("capacity", format!("placements as API requests, {nodes} nodes x 8 GPUs"), audited, "/s", Some(("placements as a job's", rate)));
            // What audit.checkpoint then does with those entries: placed, chained and checkpointed.
            let signer = better_compute_runtime::signing::CommandSigner::generate();
            let (started, mut placed) = (Instant::now(), 0usize);
            loop {
                let tx = db.transaction().await?;
                let p = better_compute_audit::checkpoint::place(&tx, better_compute_audit::checkpoint::BATCH, Some(&signer)).await?;
                tx.commit().await?;
                placed += p.entries;
                if p.entries == 0 {
                    break;
                }
            }
            let per_s = placed as f64 / started.elapsed().as_secs_f64();
            println!("audit.checkpoint: {placed} entries placed, chained and checkpointed at {per_s:.0} entries/s ({:.1}x the audited writes)", per_s / (2.0 * audited));
            crate::report::figure("capacity", "audit entries placed by audit.checkpoint".to_owned(), per_s, "/s", Some(("audited writes", 2.0 * audited)));
        }
        first.get_or_insert(rate);

        seed(&db, *nodes).await?;
        let (placed_rate, create_cpu_ms, release_rate, release_cpu_ms, o) = burst(&conn, b.clients, b.placements, b.hot_percent, batch).await?;
        let ms = |cpu: Option<f64>, what: &str| cpu.map(|ms| format!(", {ms:.2} ms of CPU per {what}")).unwrap_or_default();
        println!(
            "{nodes} nodes, a burst with no release in the window: {placed_rate:.0} placements/s ({:.2}x pgbench TPC-B){}; placed {}, pending {} ({} after losing every race), errors {}; \
             then every reservation released: {release_rate:.0} releases/s ({:.2}x){}{}",
            placed_rate / tpcb,
            ms(create_cpu_ms, "create"),
            o.placed.load(Ordering::Relaxed),
            o.pending.load(Ordering::Relaxed),
            o.pending_on_conflicts.load(Ordering::Relaxed),
            o.failed.load(Ordering::Relaxed),
            release_rate / tpcb,
            ms(release_cpu_ms, "release"),
            match o.release_failed.load(Ordering::Relaxed) {
                0 => String::new(),
                n => format!(", {n} failed"),
            }
        );
        crate::report::figure("capacity", format!("placements in a burst with no release, {nodes} nodes"), placed_rate, "/s", Some((&tpcb_name, tpcb)));
        crate::report::figure("capacity", format!("releases after the burst, {nodes} nodes"), release_rate, "/s", Some((&tpcb_name, tpcb)));
    }
    // Metering: live reservations placed on the largest fleet, then three hours on, their windows closed.
    if b.metered > 0 {
        let nodes = *b.nodes.last().unwrap_or(&1000);
        println!("seeding {nodes} nodes x 8 GPUs and placing {} reservations for metering…", b.metered);
        seed(&db, nodes).await?;
        let warm = warm_clients(&conn, b.clients, 0, batch, false).await?;
        let _held = timed_creates(warm, b.metered, 0, false).await?;
        let m = metering(&conn).await?;
        let rate = m.windows as f64 / m.seconds;
        println!(
            "usage metering, {} live reservations on {nodes} nodes, 3 h on: {} windows closed in {:.1} s, {rate:.0} windows/s ({:.2}x pgbench TPC-B)",
            m.live,
            m.windows,
            m.seconds,
            rate / tpcb
        );
        crate::report::figure("capacity", format!("usage windows closed, {} live reservations", m.live), rate, "/s", Some((&format!("pgbench TPC-B, {} clients", b.clients), tpcb)));
    }
    drop(db);
    if b.keep {
        println!("kept: psql -h {} -U postgres bench", scratch.cluster.options().socket_dir.display());
        std::fs::write(scratch.root().join("keep"), b"")?;
        std::mem::forget(scratch);
    }
    Ok(())
}
