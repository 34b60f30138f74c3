//! `--metrics-listen`: a listener of its own, whatever roles the process runs, serving `GET
//! /metrics` (Prometheus text: this process's counters and histograms, and the fleet's gauges
//! sampled from the database at each scrape, `better_compute_runtime::metrics`) and `GET /healthz`.

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
}

/// Serves `/metrics` on `listen` (port 0 picks one) until `shutdown` turns true.
pub async fn start(
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    listen: &str,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    better_compute_runtime::metrics::install();
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("the metrics listener cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(Arc::new(Scrape { pool, registry }));
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
