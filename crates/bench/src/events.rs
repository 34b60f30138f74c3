//! `better-compute bench events`: events per second from commit to Server-Sent Events clients
//! with 100 subscribers, and commit-to-delivery p50/p99, beside pgbench on the same database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use better_compute_runtime::outbox::{self, NewEvent};

use crate::Scratch;
use crate::report::pct_ms;

/// Options of `better-compute bench events`.
#[derive(Debug, clap::Args)]
pub struct EventsBench {
    /// Watch-stream subscribers.
    #[arg(long, default_value_t = 100)]
    subscribers: usize,
    /// Events written, one per transaction.
    #[arg(long, default_value_t = 2000)]
    events: usize,
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    writers: usize,
}

/// Runs the benchmark.
#[allow(clippy::too_many_lines, reason = "the benchmark's script: each phase and its printed figures in the order of the report")]
pub async fn run(b: EventsBench) -> anyhow::Result<()> {
    let scratch = Scratch::start(b.subscribers as u32 + 60).await?;
    let conn = scratch.conn();
    let mut db = better_compute_db::pool::connect(&conn).await?;
    let registry = better_compute_server::registry()?;
    better_compute_db::migrate(&mut db, &registry.migrations()).await?;
    let tpcb = scratch.tpcb(b.writers, 5)?;
    let admin = better_compute_server::bootstrap_db(&mut db, "bench", "admin").await?;
    let tenant = admin.tenant.id.clone();
    let pool = better_compute_db::pool::connect_pool(&conn, 32)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (addr, _server) = better_compute_server::start_api(pool, registry, "127.0.0.1:0", better_compute_api::rate_limit::RateLimits::NONE, stopped).await?;
    let url = format!("http://{addr}/v1/watch");
    let http = better_compute_client::http().build()?;
    let received: Arc<Mutex<Vec<HashMap<String, Instant>>>> = Arc::new(Mutex::new(vec![HashMap::new(); b.subscribers]));
    let mut subs = Vec::new();
    for i in 0..b.subscribers {
        let mut resp = http.get(&url).bearer_auth(&admin.token.secret).query(&[("types", "bench.event")]).send().await?;
        anyhow::ensure!(resp.status().is_success(), "watch answered {}", resp.status());
        let (received, want) = (received.clone(), b.events);
        subs.push(tokio::spawn(async move {
            let mut buf = String::new();
            let mut got = 0;
            while got < want {
                let Ok(Some(chunk)) = resp.chunk().await else { return };
                let at = Instant::now();
                buf.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = buf.find("\n\n") {
                    let block: String = buf.drain(..end + 2).collect();
                    if let Some(data) = block.lines().find_map(|l| l.strip_prefix("data:")) {
                        let v: serde_json::Value = serde_json::from_str(data.trim()).unwrap_or_default();
                        if let Some(id) = v["id"].as_str() {
                            received.lock().unwrap()[i].insert(id.to_owned(), at);
                            got += 1;
                        }
                    }
                }
            }
        }));
    }
    println!("{} subscribers connected; writing {} events from {} writers…", b.subscribers, b.events, b.writers);
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let start = Instant::now();
    let mut writers = Vec::new();
    for w in 0..b.writers {
        let (conn, tenant, committed, n) = (conn.clone(), tenant.clone(), committed.clone(), b.events / b.writers);
        writers.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await.expect("connect");
            for i in 0..n {
                let tx = c.transaction().await.expect("begin");
                let subject = format!("w{w}-{i}");
                let id = outbox::emit(&tx, NewEvent { event_type: "bench.event", tenant_id: Some(&tenant), subject: &subject, data: serde_json::json!({}) })
                    .await
                    .expect("emit");
                tx.commit().await.expect("commit");
                committed.lock().unwrap().insert(id, Instant::now());
            }
        }));
    }
    for w in writers {
        w.await?;
    }
    let written = committed.lock().unwrap().len();
    let wrote_s = start.elapsed().as_secs_f64();
    for s in subs {
        tokio::time::timeout(Duration::from_secs(120), s).await.map_err(|_| anyhow::anyhow!("a subscriber fell behind"))??;
    }
    let all_s = start.elapsed().as_secs_f64();
    let committed = committed.lock().unwrap();
    let mut lat: Vec<Duration> = Vec::new();
    for per in received.lock().unwrap().iter() {
        for (id, at) in per {
            if let Some(c) = committed.get(id) {
                lat.push(at.saturating_duration_since(*c));
            }
        }
    }
    lat.sort();
    println!(
        "{written} events committed in {wrote_s:.1} s ({:.0}/s, {:.2}x pgbench TPC-B); every one reached all {} subscribers in {all_s:.1} s",
        written as f64 / wrote_s,
        written as f64 / wrote_s / tpcb,
        b.subscribers
    );
    println!(
        "delivered {} events to watch streams: {:.0} events/s in all; commit to SSE client p50 {:.1} ms, p99 {:.1} ms",
        lat.len(),
        lat.len() as f64 / all_s,
        pct_ms(&lat, 0.5),
        pct_ms(&lat, 0.99)
    );
    crate::report::figure(
        "events",
        format!("events committed and delivered to {} watch streams", b.subscribers),
        written as f64 / wrote_s,
        "/s",
        Some((&format!("pgbench TPC-B, {} clients", b.writers), tpcb)),
    );
    crate::report::figure("events", "commit to SSE client, p99", pct_ms(&lat, 0.99), "ms", None);
    crate::report::latencies("event: commit to SSE client", &lat);
    stop.send(true)?;
    Ok(())
}
