//! `better-compute bench api`: `nodes.get` and `reservations.create` over HTTP with concurrent
//! clients, beside the same operations called in-process, in the same run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use better_compute_capacity::reservations::{CreateReservation, GpuRequest};
use better_compute_client::types;
use better_compute_core::Caller;

use crate::Scratch;
use crate::report::pct_ms;

/// Options of `better-compute bench api`.
#[derive(Debug, clap::Args)]
pub struct ApiBench {
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Requests per figure.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Nodes of 8 GPUs in the fleet.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
}

/// Runs `total` calls of `op` over `clients` tasks; returns requests/s and sorted latencies.
async fn measure<F, Fut>(clients: usize, total: usize, op: F) -> (f64, Vec<Duration>)
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (op, next) = (op.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= total {
                    return lat;
                }
                let t = Instant::now();
                assert!(op(c, i).await, "request {i} failed");
                lat.push(t.elapsed());
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client task"));
    }
    let rate = total as f64 / start.elapsed().as_secs_f64();
    all.sort();
    (rate, all)
}

fn line(what: &str, (rate, l): &(f64, Vec<Duration>)) {
    println!("{what:<40} {rate:>8.0} req/s   p50 {:>6.2} ms   p99 {:>6.2} ms", pct_ms(l, 0.5), pct_ms(l, 0.99));
    crate::report::latencies(format!("api: {what}"), l);
}

/// Records an HTTP figure beside the same operation in-process.
fn record(what: &str, http: &(f64, Vec<Duration>), in_process: &(f64, Vec<Duration>)) {
    println!("  HTTP/in-process: {:.2}x", http.0 / in_process.0);
    crate::report::figure("api", format!("{what} over HTTP"), http.0, "req/s", Some((&format!("{what} in-process"), in_process.0)));
    crate::report::figure("api", format!("{what} over HTTP, p99"), pct_ms(&http.1, 0.99), "ms", Some((&format!("{what} in-process, p99"), pct_ms(&in_process.1, 0.99))));
}

/// A reservation request; both paths carry an idempotency key, as the API requires.
fn request(tenant: &str, key: String) -> CreateReservation {
    CreateReservation {
        tenant_id: Some(tenant.to_owned()),
        pool_id: "pool_bench".into(),
        gpu: GpuRequest { kind: "gpu".into(), model: "H100-80GB".into(), profile: None, count: 1 },
        vcpu: 1,
        memory_mib: 1024,
        disk_gib: 1,
        starts_at: None,
        ends_at: None,
        duration_s: Some(3600),
        node_selector: Default::default(),
        tolerations: vec![],
        idempotency_key: Some(key),
    }
}

/// Runs the benchmark.
pub async fn run(b: ApiBench) -> anyhow::Result<()> {
    let scratch = Scratch::start(b.clients as u32 * 2 + 40).await?;
    let conn = scratch.conn();
    let mut db = better_compute_db::pool::connect(&conn).await?;
    let registry = better_compute_server::registry()?;
    better_compute_db::migrate(&mut db, &registry.migrations()).await?;
    println!("seeding {} nodes x 8 GPUs…", b.nodes);
    crate::capacity::seed(&db, b.nodes).await?;
    let admin = better_compute_server::bootstrap_db(&mut db, "bench", "admin").await?;
    let tenant = admin.tenant.id.clone();
    for r in ["gpus", "vcpu", "memory_mib", "disk_gib"] {
        db.execute("INSERT INTO quota_usage (tenant_id, resource, max) VALUES ($1, $2, 1000000000)", &[&tenant, &r]).await?;
    }
    let identity = admin.identity.id.clone();
    let pool = better_compute_db::pool::connect_pool(&conn, b.clients)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (addr, _server) = better_compute_server::start_api(pool.clone(), registry, "127.0.0.1:0", better_compute_api::rate_limit::RateLimits::NONE, stopped).await?;
    let url = format!("http://{addr}");
    let http = better_compute_client::Client::with_token_on(&url, &admin.token.secret, better_compute_client::http().pool_max_idle_per_host(b.clients))?;
    let fleet = b.nodes;
    let node = move |i: usize| format!("node_b{}", 1 + i % fleet);

    println!("{} clients, {} requests per figure (in-process: the module's function or service on the same pool)", b.clients, b.requests);
    let p = pool.clone();
    let nodes = b.nodes;
    let in_get = measure(b.clients, b.requests, move |_, i| {
        let p = p.clone();
        async move {
            let db = p.get().await.expect("pool");
            better_compute_nodes::inventory::get_node(&**db, &format!("node_b{}", 1 + i % nodes)).await.is_ok()
        }
    })
    .await;
    line("nodes.get in-process", &in_get);
    let h = http.clone();
    let http_get = measure(b.clients, b.requests, move |_, i| {
        let (h, n) = (h.clone(), node(i));
        async move { h.nodes_get(&types::NodeRef { node_id: n }).await.is_ok() }
    })
    .await;
    line("nodes.get over HTTP", &http_get);
    record("nodes.get", &http_get, &in_get);

    // In-process: capacity's reservations service over the same pool, as the API method calls it.
    let service = std::sync::Arc::new(better_compute_capacity::service::Reservations::start(pool.clone(), Default::default()));
    let (s, tn, idn) = (service.clone(), tenant.clone(), identity.clone());
    let in_create = measure(b.clients, b.requests / 4, move |_, i| {
        let (s, tn, idn) = (s.clone(), tn.clone(), idn.clone());
        async move { s.create(&better_compute_audit::Actor::job("bench"), Caller { tenant_id: &tn, identity_id: &idn }, &request(&tn, format!("in-{i}"))).await.is_ok() }
    })
    .await;
    line("reservations.create in-process", &in_create);
    // The same request as the typed client's type: one conversion, then a new key per call.
    let template: types::CreateReservation = serde_json::from_value(serde_json::to_value(request(&tenant, String::new()))?)?;
    let h = http.clone();
    let http_create = measure(b.clients, b.requests / 4, move |_, i| {
        let (h, body) = (h.clone(), types::CreateReservation { idempotency_key: Some(format!("http-{i}")), ..template.clone() });
        async move { h.reservations_create(&body).await.is_ok() }
    })
    .await;
    line("reservations.create over HTTP", &http_create);
    record("reservations.create", &http_create, &in_create);
    stop.send(true)?;
    Ok(())
}
