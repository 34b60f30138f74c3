//! Request counters and latency histograms per method and code, in Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Duration;

/// Latency buckets, in seconds.
const BUCKETS_S: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

#[derive(Default)]
struct Series {
    count: u64,
    sum_s: f64,
    buckets: [u64; BUCKETS_S.len()],
}

/// The API's metrics.
#[derive(Default)]
pub(crate) struct Metrics {
    series: Mutex<BTreeMap<(String, &'static str), Series>>,
}

impl Metrics {
    /// Counts one request of `method` that ended with `code`, taking `elapsed`.
    pub(crate) fn observe(&self, method: &str, code: &'static str, elapsed: Duration) {
        let mut m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let s = m.entry((method.to_owned(), code)).or_default();
        let secs = elapsed.as_secs_f64();
        s.count += 1;
        s.sum_s += secs;
        for (i, b) in BUCKETS_S.iter().enumerate() {
            if secs <= *b {
                s.buckets[i] += 1;
            }
        }
    }

    /// The text exposition.
    pub(crate) fn render(&self) -> String {
        let m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::from(
            "# HELP better_compute_api_requests_total API requests by method and code.\n# TYPE better_compute_api_requests_total counter\n",
        );
        for ((method, code), s) in m.iter() {
            let _ = writeln!(out, "better_compute_api_requests_total{{method=\"{method}\",code=\"{code}\"}} {}", s.count);
        }
        out.push_str("# HELP better_compute_api_request_seconds API request latency.\n# TYPE better_compute_api_request_seconds histogram\n");
        for ((method, code), s) in m.iter() {
            for (i, b) in BUCKETS_S.iter().enumerate() {
                let _ = writeln!(out, "better_compute_api_request_seconds_bucket{{method=\"{method}\",code=\"{code}\",le=\"{b}\"}} {}", s.buckets[i]);
            }
            let _ = writeln!(out, "better_compute_api_request_seconds_bucket{{method=\"{method}\",code=\"{code}\",le=\"+Inf\"}} {}", s.count);
            let _ = writeln!(out, "better_compute_api_request_seconds_sum{{method=\"{method}\",code=\"{code}\"}} {}", s.sum_s);
            let _ = writeln!(out, "better_compute_api_request_seconds_count{{method=\"{method}\",code=\"{code}\"}} {}", s.count);
        }
        out
    }
}
