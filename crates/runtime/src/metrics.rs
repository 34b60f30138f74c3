//! The process's metrics. One Prometheus recorder per process behind the `metrics` facade, which
//! every crate writes through; [`CATALOGUE`], every metric the control plane writes (what the
//! dashboards and alert rules in `deploy/` may name, and `docs/metrics.md` lists); and
//! [`sample_database`], the gauges read from the database at each scrape (queue depths, outbox
//! lag, lease holders), so they say the same whichever process is scraped.

use std::sync::OnceLock;

use better_compute_db::DbError;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_postgres::GenericClient;

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up (`…_total`).
    Counter,
    /// A value now.
    Gauge,
    /// Observations in buckets (`…_seconds`, sizes): `_bucket`, `_sum`, `_count`.
    Histogram,
}

impl MetricKind {
    fn as_str(self) -> &'static str {
        match self {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
        }
    }
}

/// One metric of the catalogue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    /// Its name (`better_compute_…`, units last, `_total` on counters).
    pub name: &'static str,
    /// Its type.
    pub kind: MetricKind,
    /// Its labels.
    pub labels: &'static [&'static str],
    /// Which processes write it.
    pub role: &'static str,
    /// What it counts.
    pub help: &'static str,
}

/// A metric of the catalogue (for the `const` lists of each crate).
pub const fn m(name: &'static str, kind: MetricKind, labels: &'static [&'static str], role: &'static str, help: &'static str) -> Metric {
    Metric { name, kind, labels, role, help }
}

use MetricKind::{Counter, Gauge, Histogram};

/// The metrics the runtime itself writes (its workers, leases, work queue and outbox); each module
/// adds its own (`Module::metrics`), the API and the gateway theirs.
pub const RUNTIME_METRICS: &[Metric] = &[
    m("better_compute_build_info", Gauge, &["version"], "every", "1, labelled with the running version."),
    m("better_compute_job_runs_total", Counter, &["job", "outcome"], "worker", "Reconciler runs by job and outcome (done, sync_again, error)."),
    m("better_compute_job_run_seconds", Histogram, &["job"], "worker", "How long one run (or one batch of keys) of a job took."),
    m("better_compute_job_fence_lost_total", Counter, &["job"], "worker", "Runs whose fenced transaction found the lease gone (another worker took the shard): their work was not committed."),
    m("better_compute_job_queue_depth", Gauge, &["job"], "scrape", "Keys queued for a job."),
    m("better_compute_job_queue_due", Gauge, &["job"], "scrape", "Keys due now and not claimed."),
    m("better_compute_job_queue_failing", Gauge, &["job"], "scrape", "Keys backing off after errors."),
    m("better_compute_job_oldest_due_seconds", Gauge, &["job"], "scrape", "How long the oldest due key has waited (0 when none is due)."),
    m("better_compute_leases_held", Gauge, &["kind"], "scrape", "Unexpired leases by kind: shard, singleton (a singleton job's or an outbox sink's), gateway."),
    m("better_compute_workers_live", Gauge, &[], "scrape", "Worker processes whose heartbeat is fresh."),
    m("better_compute_lease_takeovers_total", Counter, &["kind"], "worker", "Leases this worker took that another holder had before (after a crash, or a clean handover)."),
    m("better_compute_outbox_lag_events", Gauge, &["sink"], "scrape", "Events written that a sink has not delivered yet."),
    m("better_compute_outbox_lag_seconds", Gauge, &["sink"], "scrape", "Age of the oldest event a sink has not delivered (0 when caught up)."),
    m("better_compute_outbox_delivered_total", Counter, &["sink"], "worker", "Events delivered to a sink by this worker."),
];

/// Latency buckets, in seconds (and sizes, for the flush histogram).
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// The process's recorder; `None` when another recorder was installed first.
fn handle() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let h = PrometheusBuilder::new()
                .set_buckets(&BUCKETS)
                .ok()?
                .install_recorder()
                .inspect_err(|e| tracing::warn!(error = %e, "metrics recorder not installed"))
                .ok()?;
            metrics::gauge!("better_compute_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            Some(h)
        })
        .as_ref()
}

/// Installs the process's recorder (idempotent; the first call in a process wins) and describes
/// `catalogue`'s metrics to it (their `# HELP`), each call adding its own.
pub fn install(catalogue: &[Metric]) {
    if handle().is_none() {
        return;
    }
    for c in catalogue {
        match c.kind {
            Counter => metrics::describe_counter!(c.name, c.help),
            Gauge => metrics::describe_gauge!(c.name, c.help),
            Histogram => metrics::describe_histogram!(c.name, c.help),
        }
    }
}

/// The text exposition of everything written so far; also drains the histograms' pending
/// samples (the recorder's upkeep).
pub fn render() -> String {
    match handle() {
        Some(h) => {
            h.run_upkeep();
            h.render()
        }
        None => String::new(),
    }
}

/// Sets the gauges read from the database: each of `jobs`' queue, the leases held by kind, the
/// live workers and each sink's lag. Called at each scrape, in one read-only transaction.
pub async fn sample_database(db: &impl GenericClient, jobs: &[&str], sinks: &[&str]) -> Result<(), DbError> {
    for q in crate::status::queues(db, jobs).await? {
        let job = q.job.clone();
        metrics::gauge!("better_compute_job_queue_depth", "job" => job.clone()).set(q.depth as f64);
        metrics::gauge!("better_compute_job_queue_due", "job" => job.clone()).set(q.due as f64);
        metrics::gauge!("better_compute_job_queue_failing", "job" => job.clone()).set(q.failing as f64);
        metrics::gauge!("better_compute_job_oldest_due_seconds", "job" => job).set(q.oldest_due_s.unwrap_or(0.0));
    }
    let leases = db
        .query(
            "SELECT k, count(l.name) FROM unnest(ARRAY['shard', 'singleton', 'gateway']) k
               LEFT JOIN leases l ON split_part(l.name, ':', 1) = k AND l.expires_at > compute_now()
              GROUP BY k",
            &[],
        )
        .await?;
    for r in leases {
        metrics::gauge!("better_compute_leases_held", "kind" => r.get::<_, String>(0)).set(r.get::<_, i64>(1) as f64);
    }
    let live = better_compute_db::workers::live(db).await?.len();
    metrics::gauge!("better_compute_workers_live").set(live as f64);
    let lag = db
        .query(
            "SELECT s, count(o.seq), coalesce(extract(epoch FROM compute_now() - min(o.time)), 0)::float8
               FROM unnest($1::text[]) s
               LEFT JOIN outbox_cursors c ON c.sink = s
               LEFT JOIN outbox o ON (o.txid, o.seq) > (coalesce(c.txid, '0'::xid8), coalesce(c.seq, 0))
              GROUP BY s",
            &[&sinks],
        )
        .await?;
    for r in lag {
        let sink: String = r.get(0);
        metrics::gauge!("better_compute_outbox_lag_events", "sink" => sink.clone()).set(r.get::<_, i64>(1) as f64);
        metrics::gauge!("better_compute_outbox_lag_seconds", "sink" => sink).set(r.get::<_, f64>(2).max(0.0));
    }
    Ok(())
}

/// What `/metrics` answers: the database's gauges sampled for `registry`'s jobs and sinks (when the
/// database does not answer, the gauges keep their last values and the rest is still served),
/// then the exposition.
pub async fn scrape(pool: &better_compute_db::Pool, registry: &crate::Registry) -> String {
    let jobs = registry.job_names();
    let sinks: Vec<&str> = registry.subscribers().iter().chain(registry.outbox_sinks()).map(|s| s.name()).collect();
    let sampled = async {
        let db = better_compute_db::pool::read_tx(pool).await?;
        sample_database(&*db, &jobs, &sinks).await
    };
    if let Err(e) = sampled.await {
        tracing::warn!(error = %e, "metrics: the database's gauges were not sampled");
    }
    render()
}

/// `docs/metrics.md`: the catalogue as a reference page.
pub fn reference_page(catalogue: &[Metric]) -> String {
    let mut s = String::from(
        "# Metrics\n\nGenerated by `better-compute docs metrics` from the catalogue of the runtime, every module (`Module::metrics`), the API and the gateway; every metric the control plane writes. \
         Each server process serves them at `/metrics` on `--metrics-listen` (and the API role at `/metrics` on its own listener too). \
         Role `scrape`: read from the database at each scrape, so every process answers the same fleet-wide figure.\n\n\
         | metric | type | labels | role | meaning |\n|---|---|---|---|---|\n",
    );
    for c in catalogue {
        s.push_str(&format!("| `{}` | {} | {} | {} | {} |\n", c.name, c.kind.as_str(), c.labels.join(", "), c.role, c.help));
    }
    s
}

/// Whether `series` (a name in an exposition, a dashboard or an alert rule) is a metric of
/// `catalogue`, or a histogram's `_bucket`, `_sum` or `_count` series.
pub fn in_catalogue(catalogue: &[Metric], series: &str) -> bool {
    catalogue.iter().any(|c| {
        c.name == series
            || (c.kind == Histogram && ["_bucket", "_sum", "_count"].iter().any(|sfx| series.strip_suffix(sfx) == Some(c.name)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histograms_series_are_in_the_catalogue_and_a_counters_are_not() {
        assert!(in_catalogue(RUNTIME_METRICS, "better_compute_job_run_seconds_bucket"));
        assert!(in_catalogue(RUNTIME_METRICS, "better_compute_job_runs_total"));
        assert!(!in_catalogue(RUNTIME_METRICS, "better_compute_job_runs_total_bucket"));
    }
}
