//! Request counters and latency histograms per method and code, through the `metrics` facade and
//! the process's Prometheus recorder (`better_compute_runtime::metrics`).

use std::time::Duration;

/// Counts one request of `method` that ended with `code`, taking `elapsed`.
pub(crate) fn observe(method: &str, code: &'static str, elapsed: Duration) {
    let labels = [("method", method.to_owned()), ("code", code.to_owned())];
    metrics::counter!("better_compute_api_requests_total", &labels).increment(1);
    metrics::histogram!("better_compute_api_request_seconds", &labels).record(elapsed.as_secs_f64());
}
