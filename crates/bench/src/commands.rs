//! `better-compute bench commands`: commands enqueued per second through the queue, one per
//! transaction, and desired-state recomputations per second for 10,000 nodes after a site-wide
//! change, beside pgbench's TPC-B on the same database.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use better_compute_nodes::commands::{self, NewCommand};
use better_compute_runtime::{desired, Worker, WorkerConfig};

use crate::Scratch;

/// Options of `better-compute bench commands`.
#[derive(Debug, clap::Args)]
pub struct CommandsBench {
    /// Nodes in the fleet.
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Commands enqueued.
    #[arg(long, default_value_t = 20_000)]
    commands: usize,
    /// Concurrent clients, for the enqueues and for pgbench.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seconds pgbench runs.
    #[arg(long, default_value_t = 10)]
    pgbench_seconds: u32,
}

/// Ticks `nodespec` until the queue is empty, renewing the worker's leases as its run loop would.
async fn drain_nodespec(worker: &Worker) -> anyhow::Result<u64> {
    let mut done = 0;
    let mut maintained = Instant::now();
    worker.maintain().await?;
    loop {
        if maintained.elapsed() >= Duration::from_secs(4) {
            worker.maintain().await?;
            maintained = Instant::now();
        }
        let r = worker.tick(desired::NODESPEC.name).await?;
        done += r.done;
        if r.claimed == 0 {
            return Ok(done);
        }
    }
}

/// Runs the benchmark.
pub async fn run(b: CommandsBench) -> anyhow::Result<()> {
    let scratch = Scratch::start(b.clients as u32 + 40).await?;
    let conn = scratch.conn();
    let registry = better_compute_server::registry()?;
    let mut db = better_compute_db::pool::connect(&conn).await?;
    better_compute_db::migrate(&mut db, &registry.migrations()).await?;
    let tpcb = scratch.tpcb(b.clients, b.pgbench_seconds)?;
    println!("seeding {} nodes…", b.nodes);
    crate::capacity::seed(&db, b.nodes).await?;
    let nodes: Vec<String> = db.query("SELECT id FROM nodes ORDER BY id", &[]).await?.iter().map(|r| r.get(0)).collect();

    // Commands: one per transaction, spread over the nodes.
    let next = Arc::new(AtomicUsize::new(0));
    let nodes = Arc::new(nodes);
    let mut tasks = Vec::new();
    crate::reset_statements(&db).await;
    let start = Instant::now();
    for _ in 0..b.clients {
        let (next, nodes, registry, conn, total) = (next.clone(), nodes.clone(), registry.clone(), conn.clone(), b.commands);
        tasks.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await?;
            let payload = serde_json::json!({"sections": ["gpus"]});
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return anyhow::Ok(());
                }
                let node = &nodes[i % nodes.len()];
                let tx = c.transaction().await?;
                commands::enqueue(
                    &tx,
                    &registry,
                    NewCommand {
                        node_id: node,
                        kind: "inventory.refresh",
                        payload: &payload,
                        idempotency_key: &format!("bench-{i}"),
                        not_after: Some(Duration::from_secs(600)),
                        min_generation: 0,
                        owner: None,
                        actor: &better_compute_audit::Actor::job("bench"),
                    },
                )
                .await
                .map_err(better_compute_core::Error::from)?;
                tx.commit().await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let rate = b.commands as f64 / start.elapsed().as_secs_f64();
    println!("commands enqueued, one per transaction, {} clients: {rate:.0}/s ({:.2}x pgbench TPC-B)", b.clients, rate / tpcb);
    let tpcb_name = format!("pgbench TPC-B, {} clients", b.clients);
    crate::report::figure("commands", format!("commands enqueued, one per transaction, {} clients", b.clients), rate, "/s", Some((&tpcb_name, tpcb)));
    crate::top_statements(&db, &format!("commands: enqueue, {} clients", b.clients), 4).await;

    // Desired state: compute every node's spec once, then change the site and time the recomputation.
    let pool = better_compute_db::pool::connect_pool(&conn, 40)?;
    let worker = Worker::start(pool, registry.clone(), WorkerConfig::new("wrk_bench_nodespec")).await?;
    worker.maintain().await?;
    let ids: Vec<String> = nodes.to_vec();
    for chunk in ids.chunks(5_000) {
        desired::invalidate_many(&db, chunk).await?;
    }
    drain_nodespec(&worker).await?;
    let tx = db.transaction().await?;
    tx.execute("UPDATE sites SET name = 'bench-renamed', version = version + 1", &[]).await?;
    for chunk in ids.chunks(5_000) {
        desired::invalidate_many(&tx, chunk).await?;
    }
    tx.commit().await?;
    crate::reset_statements(&db).await;
    let start = Instant::now();
    let recomputed = drain_nodespec(&worker).await?;
    let rate = recomputed as f64 / start.elapsed().as_secs_f64();
    let moved: i64 = db.query_one("SELECT count(*) FROM nodes WHERE generation = 2", &[]).await?.get(0);
    println!(
        "desired-state recomputations after a site-wide change, {} nodes, one worker: {rate:.0}/s ({:.2}x pgbench TPC-B); {moved} nodes moved to generation 2",
        b.nodes,
        rate / tpcb
    );
    crate::report::figure("commands", format!("desired-state recomputations, {} nodes, one worker", b.nodes), rate, "/s", Some((&tpcb_name, tpcb)));
    crate::top_statements(&db, &format!("commands: desired state of {} nodes recomputed", b.nodes), 4).await;
    worker.shutdown().await?;
    drop(db);
    drop(scratch);
    Ok(())
}
