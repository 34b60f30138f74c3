//! Request counters and latency histograms per method and code, through the `metrics` facade and
//! its Prometheus recorder (installed once per process).

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Latency buckets, in seconds.
const BUCKETS_S: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

/// The process's recorder; `None` when another recorder was installed first.
fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets(&BUCKETS_S)
                .ok()?
                .install_recorder()
                .inspect_err(|e| tracing::warn!(error = %e, "metrics recorder not installed"))
                .ok()
        })
        .as_ref()
}

/// Installs the recorder (idempotent).
pub(crate) fn install() {
    handle();
}

/// Counts one request of `method` that ended with `code`, taking `elapsed`.
pub(crate) fn observe(method: &str, code: &'static str, elapsed: Duration) {
    let labels = [("method", method.to_owned()), ("code", code.to_owned())];
    metrics::counter!("better_compute_api_requests_total", &labels).increment(1);
    metrics::histogram!("better_compute_api_request_seconds", &labels).record(elapsed.as_secs_f64());
}

/// The text exposition; also drains the histograms' pending samples (the recorder's upkeep).
pub(crate) fn render() -> String {
    match handle() {
        Some(h) => {
            h.run_upkeep();
            h.render()
        }
        None => String::new(),
    }
}
