//! `--metrics-listen`: a listener of its own, whatever roles the process runs, serving `GET
//! /metrics` (Prometheus text: this process's counters and histograms, and the fleet's gauges
//! sampled from the database at each scrape, `better_compute_runtime::metrics`), `GET /healthz`
//! (the process is up) and `GET /readyz`: the database's checks (`db::readiness`) and each role's
//! own, `worker` (its heartbeat is fresh: it holds and renews its leases) and `gateway` (it holds
//! its lease, so its sessions' writes are accepted), 503 when one fails.

use std::sync::Arc;

use anyhow::Context;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use better_compute_runtime::Registry;

struct Scrape {
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    roles: Roles,
    clock: tokio::sync::OnceCell<better_compute_db::Clock>,
}

/// The roles this process runs, for `/readyz`.
#[derive(Debug, Clone, Default)]
pub struct Roles {
    /// The worker's id (`wrk_…`), when it runs one.
    pub worker_id: Option<String>,
    /// The gateway's id (`gw_…`), when it runs one.
    pub gateway_id: Option<String>,
}

/// Serves `/metrics` on `listen` (port 0 picks one) until `shutdown` turns true.
pub async fn start(
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    roles: Roles,
    listen: &str,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    better_compute_runtime::metrics::install(&crate::metric_catalogue(&registry));
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("the metrics listener cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Arc::new(Scrape { pool, registry, roles, clock: tokio::sync::OnceCell::new() }));
    let handle = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = shutdown.wait_for(|s| *s).await;
            })
            .await
    });
    Ok((addr, handle))
}

async fn metrics_text(State(s): State<Arc<Scrape>>) -> axum::response::Response {
    let text = better_compute_runtime::metrics::scrape(&s.pool, &s.registry).await;
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn readyz(State(s): State<Arc<Scrape>>) -> axum::response::Response {
    use better_compute_db::clock::SelfCheck;
    let checks = async {
        let db = better_compute_db::pool::read_tx(&s.pool).await?;
        let clock = s.clock.get_or_try_init(|| better_compute_db::Clock::start(&*db)).await?;
        let mut checks = better_compute_db::readiness::checks(&*db, clock, &s.registry.migrations()).await?;
        if let Some(w) = &s.roles.worker_id {
            let live = better_compute_db::workers::live(&*db).await?.contains(w);
            let detail = if live { format!("{w} heartbeats") } else { format!("{w} has no fresh heartbeat: it is not renewing its leases") };
            checks.push(SelfCheck { name: "worker", ok: live, detail });
        }
        if let Some(g) = &s.roles.gateway_id {
            let held: bool = db
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM leases WHERE name = $1 AND owner = $2 AND expires_at > compute_now())",
                    &[&better_compute_nodes::sessions::gateway_lease_name(g), g],
                )
                .await
                .map_err(better_compute_db::DbError::from)?
                .get(0);
            let detail = if held { format!("{g} holds its lease") } else { format!("{g} lost its lease: its sessions are refused") };
            checks.push(SelfCheck { name: "gateway", ok: held, detail });
        }
        Ok::<_, better_compute_db::DbError>(checks)
    }
    .await
    .map_err(|e| e.to_string());
    let (ready, body) = better_compute_db::readiness::answer(checks);
    let status = if ready { axum::http::StatusCode::OK } else { axum::http::StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}
