//! `better-compute bench gateway`: one gateway process (a child `server --roles gateway`) holding
//! many simulated daemon sessions over mTLS: sessions held and the gateway's memory per session,
//! command enqueue-to-daemon latency at a steady rate, and the time for every node to converge
//! after one change to every node's desired state; beside pgbench's TPC-B on the same database.

use std::collections::HashMap;
use std::io::BufRead;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use better_compute_daemon::sim::{SimNode, SimObserver};
use better_compute_nodes::commands::{self, NewCommand};

use crate::Scratch;

/// Options of `better-compute bench gateway`.
#[derive(Debug, clap::Args)]
pub struct GatewayBench {
    /// Simulated daemon sessions held by the one gateway process; a list runs the whole benchmark
    /// once per size (each on a fresh database) and adds a scaling table.
    #[arg(long, value_delimiter = ',', default_value = "10000")]
    sessions: Vec<usize>,
    /// Commands enqueued per second for the latency run.
    #[arg(long, default_value_t = 1_000)]
    commands_per_s: u64,
    /// Seconds the latency run lasts.
    #[arg(long, default_value_t = 10)]
    command_seconds: u64,
    /// TLS handshakes in flight while the sessions open.
    #[arg(long, default_value_t = 128)]
    connect_concurrency: usize,
}

#[derive(Default)]
struct Observer {
    received: Mutex<HashMap<String, Instant>>,
}

impl SimObserver for Observer {
    fn command(&self, _node: &str, id: &str) {
        self.received.lock().expect("observer").entry(id.to_owned()).or_insert_with(Instant::now);
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Lets this process (and the gateway it starts) hold one descriptor per session and more.
fn raise_fd_limit() {
    // SAFETY: plain getrlimit/setrlimit on our own process.
    unsafe {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

async fn count(db: &tokio_postgres::Client, sql: &str) -> anyhow::Result<i64> {
    Ok(db.query_one(sql, &[]).await?.get(0))
}

async fn wait_for_zero(db: &tokio_postgres::Client, sql: &str, patience: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while count(db, sql).await? > 0 {
        anyhow::ensure!(start.elapsed() < patience, "not done after {patience:?}: {sql}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(start.elapsed())
}

/// Statements listed per phase in the profile.
const PROFILE_TOP: i64 = 6;

/// Runs the benchmark once per size in `--sessions`.
pub async fn run(b: GatewayBench) -> anyhow::Result<()> {
    raise_fd_limit();
    for &n in &b.sessions {
        run_one(&b, n).await?;
    }
    Ok(())
}

#[allow(clippy::too_many_lines, reason = "the benchmark's script for one fleet size: each phase and its printed figures in the order of the report")]
async fn run_one(b: &GatewayBench, n: usize) -> anyhow::Result<()> {
    let scratch = Scratch::start(250).await?;
    let conn = scratch.conn();
    let registry = better_compute_server::registry()?;
    let mut db = better_compute_db::pool::connect(&conn).await?;
    better_compute_db::migrate(&mut db, &registry.migrations()).await?;
    let tpcb = scratch.tpcb(8, 5)?;
    let baseline = Some(("pgbench TPC-B, 8 clients", tpcb));

    println!("seeding {n} nodes and signing {n} node certificates…");
    let seeding = Instant::now();
    crate::capacity::seed(&db, n).await?;
    db.execute("UPDATE nodes SET joined_at = compute_now(), observed_generation = 0", &[]).await?;
    let ca_dir = scratch.root().join("ca");
    let ca = Arc::new(better_compute_gateway::Ca::load_or_create(&ca_dir)?);
    let node_ids: Vec<String> = db.query("SELECT id FROM nodes ORDER BY id", &[]).await?.iter().map(|r| r.get(0)).collect();
    let mut nodes = Vec::with_capacity(n);
    for chunk in node_ids.chunks(2_000) {
        let (ca, chunk) = (ca.clone(), chunk.to_vec());
        let signed = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(String, String, better_compute_gateway::ca::Signed)>> {
            chunk
                .into_iter()
                .map(|id| {
                    let req = better_compute_daemon::identity::request(&id)?;
                    let cert = ca.sign_node(&req.csr_pem, &id, Duration::from_secs(86_400))?;
                    Ok((id, req.key_pem().to_owned(), cert))
                })
                .collect()
        })
        .await??;
        let ids: Vec<&String> = signed.iter().map(|(id, _, _)| id).collect();
        let fps: Vec<&[u8]> = signed.iter().map(|(_, _, c)| c.fingerprint.as_slice()).collect();
        let serials: Vec<&String> = signed.iter().map(|(_, _, c)| &c.serial).collect();
        db.execute(
            "INSERT INTO node_certificates (fingerprint_sha256, node_id, serial, not_before, not_after)
             SELECT fp, id, serial, compute_now(), compute_now() + interval '1 day' FROM unnest($1::bytea[], $2::text[], $3::text[]) u(fp, id, serial)",
            &[&fps, &ids, &serials],
        )
        .await?;
        nodes.extend(signed.into_iter().map(|(id, key, cert)| (id, cert.pem, key)));
    }

    // A worker in this process computes desired state; the gateway runs in a child process so its
    // memory can be read on its own.
    let pool = better_compute_db::pool::connect_pool(&conn, 32)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    {
        let tx = db.transaction().await?;
        better_compute_runtime::desired::invalidate_many(&tx, &node_ids).await?;
        tx.commit().await?;
    }
    let (_worker, worker_task) = better_compute_server::start_worker(pool, registry.clone(), Some(conn.clone()), stopped.clone()).await?;
    wait_for_zero(&db, "SELECT count(*) FROM nodes WHERE spec IS NULL", Duration::from_secs(600)).await?;
    println!("seeded, signed and computed every node's desired state in {:.1} s", seeding.elapsed().as_secs_f64());
    let mut gateway = std::process::Command::new(std::env::current_exe()?);
    gateway
        .args(["server", "--roles", "gateway", "--gateway-listen", "127.0.0.1:0", "--pool-size", "64", "--ca-dir"])
        .arg(&ca_dir)
        .env("DATABASE_URL", &conn)
        .env("BETTER_COMPUTE_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit());
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; the gateway gets SIGTERM if this bench dies.
        unsafe {
            gateway.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
    let mut child = gateway.spawn()?;
    let gw_pid = child.id();
    let mut out = std::io::BufReader::new(child.stdout.take().context("gateway stdout")?);
    let mut line = String::new();
    let url = loop {
        line.clear();
        anyhow::ensure!(out.read_line(&mut line)? > 0, "the gateway process exited");
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.split_whitespace().next().context("gateway address")?.to_owned();
        }
    };
    std::thread::spawn(move || for _ in out.lines() {});
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = rss_kib(gw_pid);
    let own_idle = rss_kib(std::process::id());

    println!("opening {n} sessions to {url} (mTLS, {} handshakes at a time)…", b.connect_concurrency);
    crate::reset_statements(&db).await;
    let observer = Arc::new(Observer::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(b.connect_concurrency));
    let start = Instant::now();
    let mut readies = Vec::with_capacity(n);
    let mut sessions = Vec::with_capacity(n);
    for (id, cert, key) in nodes {
        let sim = SimNode { node_id: id, cert_pem: cert, key_pem: key, ca_pem: ca.cert_pem().to_owned(), gateway_url: url.clone(), heartbeat: Duration::from_secs(5) };
        let (ready, welcomed) = tokio::sync::oneshot::channel();
        let (gate, observer, stopped) = (gate.clone(), observer.clone(), stopped.clone());
        sessions.push(tokio::spawn(async move {
            let permit = gate.acquire_owned().await;
            let (relay, relayed) = tokio::sync::oneshot::channel();
            let run = tokio::spawn(sim.run(observer, Some(relay), stopped));
            let _ = relayed.await;
            drop(permit);
            let _ = ready.send(());
            run.await
        }));
        readies.push(welcomed);
    }
    let mut open = 0;
    for r in readies {
        if tokio::time::timeout(Duration::from_secs(300), r).await.is_ok_and(|r| r.is_ok()) {
            open += 1;
        }
    }
    let opened = start.elapsed();
    let converge_initial = wait_for_zero(&db, "SELECT count(*) FROM nodes WHERE observed_generation < generation", Duration::from_secs(600)).await?;
    crate::top_statements(&db, &format!("gateway, {n} sessions: opening every session"), PROFILE_TOP).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_full = rss_kib(gw_pid);
    let own_full = rss_kib(std::process::id());
    let held = count(&db, "SELECT count(*) FROM node_sessions WHERE closed_at IS NULL").await?;
    println!(
        "sessions: {open} of {n} welcomed in {:.1} s ({:.0}/s); {held} open in node_sessions; every node applied its first spec {:.1} s later",
        opened.as_secs_f64(),
        open as f64 / opened.as_secs_f64(),
        converge_initial.as_secs_f64()
    );
    println!(
        "gateway process memory: {:.1} MiB idle, {:.1} MiB with {open} sessions: {:.1} KiB per session (the simulated daemons' side: {:.1} KiB each)",
        rss_idle as f64 / 1024.0,
        rss_full as f64 / 1024.0,
        (rss_full.saturating_sub(rss_idle)) as f64 / open.max(1) as f64,
        (own_full.saturating_sub(own_idle)) as f64 / open.max(1) as f64
    );

    let per_session_kib = (rss_full.saturating_sub(rss_idle)) as f64 / open.max(1) as f64;
    let opened_per_s = open as f64 / opened.as_secs_f64();
    crate::report::figure("gateway", format!("sessions held by one gateway process, of {n}"), open as f64, "sessions", None);
    crate::report::figure("gateway", format!("gateway memory per session, {n} sessions"), per_session_kib, "KiB", None);
    crate::report::figure("gateway", format!("sessions opened (mTLS handshake to Welcome), {n} sessions"), opened_per_s, "/s", baseline);
    crate::report::scaled("gateway memory per session", n, per_session_kib, "KiB");
    crate::report::scaled("sessions opened (mTLS handshake to Welcome)", n, opened_per_s, "/s");

    // Latency: commands at a steady rate (a fifth of the target first, then the target), each to
    // a node chosen round-robin; from the enqueue's commit to the simulated daemon receiving it.
    let node_ids = Arc::new(node_ids);
    let low = (b.commands_per_s / 5).max(1);
    latency_run(&conn, &registry, &node_ids, &observer, Pace { per_s: low, seconds: b.command_seconds, first_key: 0 }, n).await?;
    wait_for_zero(&db, "SELECT count(*) FROM commands WHERE state IN ('pending', 'sent', 'running')", Duration::from_secs(300)).await.ok();
    crate::reset_statements(&db).await;
    let pace = Pace { per_s: b.commands_per_s, seconds: b.command_seconds, first_key: 10_000_000 };
    latency_run(&conn, &registry, &node_ids, &observer, pace, n).await?;
    wait_for_zero(&db, "SELECT count(*) FROM commands WHERE state IN ('pending', 'sent', 'running')", Duration::from_secs(300)).await.ok();
    crate::top_statements(&db, &format!("gateway, {n} sessions: commands at {}/s", b.commands_per_s), PROFILE_TOP).await;

    // Convergence: one change to every node's desired state.
    println!("changing every node's desired state…");
    crate::reset_statements(&db).await;
    let start = Instant::now();
    {
        let tx = db.transaction().await?;
        tx.execute("UPDATE nodes SET labels = labels || '{\"bench\": \"changed\"}'", &[]).await?;
        better_compute_runtime::desired::invalidate_many(&tx, &node_ids).await?;
        tx.commit().await?;
        better_compute_runtime::work_queue::poke(&db).await;
    }
    let recomputed = wait_for_zero(&db, "SELECT count(*) FROM work_queue WHERE kind = 'nodespec'", Duration::from_secs(900)).await?;
    wait_for_zero(&db, "SELECT count(*) FROM nodes WHERE observed_generation < generation", Duration::from_secs(900)).await?;
    println!(
        "convergence: {n} nodes applied the change {:.1} s after it committed (desired state recomputed in {:.1} s: {:.0} nodes/s)",
        start.elapsed().as_secs_f64(),
        recomputed.as_secs_f64(),
        n as f64 / recomputed.as_secs_f64()
    );
    let took_s = start.elapsed().as_secs_f64();
    crate::top_statements(&db, &format!("gateway, {n} nodes: convergence after one change to every node"), PROFILE_TOP).await;
    crate::report::figure("gateway", format!("convergence: {n} nodes apply one change to every node"), took_s, "s", None);
    crate::report::figure("gateway", format!("convergence: nodes applied per second, {n} nodes"), n as f64 / took_s, "/s", baseline);
    crate::report::scaled("convergence: one change to every node", n, took_s, "s");
    crate::report::scaled("convergence: desired state recomputed per second", n, n as f64 / recomputed.as_secs_f64(), "/s");
    stop.send(true)?;
    for s in sessions {
        let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(gw_pid as i32, libc::SIGTERM) };
    let _ = child.wait();
    let _ = worker_task.await;
    Ok(())
}

/// How fast a latency run enqueues, for how long, and its first idempotency key's number (each
/// run its own keys).
struct Pace {
    per_s: u64,
    seconds: u64,
    first_key: usize,
}

/// Enqueues commands at the pace's rate per second for its seconds, round-robin over the nodes, and prints
/// the latency from each enqueue's commit to the simulated daemon receiving it.
async fn latency_run(
    conn: &str,
    registry: &Arc<better_compute_runtime::Registry>,
    node_ids: &Arc<Vec<String>>,
    observer: &Arc<Observer>,
    pace: Pace,
    sessions: usize,
) -> anyhow::Result<()> {
    let Pace { per_s: rate, seconds, first_key: offset } = pace;
    let total = (rate * seconds) as usize;
    println!("enqueuing {total} commands at {rate}/s…");
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let (jobs_tx, jobs_rx) = tokio::sync::mpsc::channel::<usize>(1024);
    let jobs_rx = Arc::new(tokio::sync::Mutex::new(jobs_rx));
    let mut enqueuers = Vec::new();
    for _ in 0..32 {
        let (jobs, nodes, committed, registry, conn) = (jobs_rx.clone(), node_ids.clone(), committed.clone(), registry.clone(), conn.to_owned());
        enqueuers.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await?;
            let payload = serde_json::json!({"level": 1});
            loop {
                let Some(i) = jobs.lock().await.recv().await else { return anyhow::Ok(()) };
                let node = &nodes[i % nodes.len()];
                let tx = c.transaction().await?;
                let key = format!("bench-{i}");
                let v = commands::enqueue(
                    &tx,
                    &registry,
                    NewCommand { node_id: node, kind: "diag.nvml", payload: &payload, idempotency_key: &key, not_after: Some(Duration::from_secs(600)), min_generation: 0, owner: None, actor: &better_compute_audit::Actor::job("bench") },
                )
                .await?;
                tx.commit().await?;
                committed.lock().expect("committed").insert(v.id, Instant::now());
                // After commit, in a transaction of its own: NOTIFY holds a database-wide lock to commit.
                commands::poke_gateway(&c, node).await;
            }
        }));
    }
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    for i in offset..offset + total {
        tick.tick().await;
        jobs_tx.send(i).await?;
    }
    drop(jobs_tx);
    for e in enqueuers {
        e.await??;
    }
    let enqueue_s = started.elapsed().as_secs_f64();
    let ids: Vec<String> = committed.lock().expect("committed").keys().cloned().collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let got = { let r = observer.received.lock().expect("observer"); ids.iter().filter(|id| r.contains_key(*id)).count() };
        if got == ids.len() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut lat: Vec<Duration> = {
        let got = observer.received.lock().expect("observer");
        committed.lock().expect("committed").iter().filter_map(|(id, c)| got.get(id).map(|r| r.saturating_duration_since(*c))).collect()
    };
    lat.sort();
    println!(
        "commands at {rate}/s: {total} enqueued in {enqueue_s:.1} s ({:.0}/s), {} reached their daemon; enqueue-to-daemon p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        total as f64 / enqueue_s,
        lat.len(),
        percentile(&lat, 0.5).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    let (p50_ms, p99_ms) = (percentile(&lat, 0.5).as_secs_f64() * 1e3, percentile(&lat, 0.99).as_secs_f64() * 1e3);
    let enqueued_per_s = total as f64 / enqueue_s;
    crate::report::figure("gateway", format!("commands enqueued at {rate}/s asked, {sessions} sessions"), enqueued_per_s, "/s", None);
    crate::report::figure("gateway", format!("command enqueue to daemon at {rate}/s, {sessions} sessions, p50"), p50_ms, "ms", None);
    crate::report::figure("gateway", format!("command enqueue to daemon at {rate}/s, {sessions} sessions, p99"), p99_ms, "ms", None);
    crate::report::scaled(&format!("command enqueue to daemon at {rate}/s, p50"), sessions, p50_ms, "ms");
    crate::report::scaled(&format!("command enqueue to daemon at {rate}/s, p99"), sessions, p99_ms, "ms");
    crate::report::latencies(format!("command: enqueue to daemon at {rate}/s, {sessions} sessions"), &lat);
    Ok(())
}
