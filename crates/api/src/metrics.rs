//! Request counters and latency histograms per method and code, through the `metrics` facade and
//! the process's Prometheus recorder (`better_compute_runtime::metrics`).

use std::time::Duration;

use better_compute_runtime::metrics::MetricKind::{Counter, Histogram};
use better_compute_runtime::metrics::{m, Metric};

/// The metrics the API writes (`reservations.create`'s placements are capacity's).
pub const METRICS: &[Metric] = &[
    m("better_compute_api_requests_total", Counter, &["method", "code"], "api", "API requests by method and answer code (OK, NOT_FOUND, RATE_LIMITED, …)."),
    m("better_compute_api_request_seconds", Histogram, &["method", "code"], "api", "API request latency, from the request's arrival to its answer."),
];

/// Counts one request of `method` that ended with `code`, taking `elapsed`.
pub(crate) fn observe(method: &str, code: &'static str, elapsed: Duration) {
    let labels = [("method", method.to_owned()), ("code", code.to_owned())];
    metrics::counter!("better_compute_api_requests_total", &labels).increment(1);
    metrics::histogram!("better_compute_api_request_seconds", &labels).record(elapsed.as_secs_f64());
}
