//! The operator's view of the runtime: queue depth per job, the oldest due key, the last errors,
//! each job's last tick per worker, and who holds which shard and singleton.

use std::time::SystemTime;

use better_compute_db::DbError;

/// Reading the jobs' state (fleet scope): `jobs.list`.
pub const JOBS_READ: &str = "compute:jobs:read";

/// The runtime's own permissions.
pub fn permissions() -> Vec<crate::authz::Permission> {
    vec![crate::authz::Permission { name: JOBS_READ, description: "Read the jobs: queues, failing keys, lease holders and each worker's last ticks (fleet scope)." }]
}
use serde::Serialize;
use tokio_postgres::GenericClient;

/// One job's queue.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QueueStatus {
    /// The job (work-queue kind).
    pub job: String,
    /// Rows queued.
    pub depth: i64,
    /// Rows due now and not claimed.
    pub due: i64,
    /// Rows claimed by a worker.
    pub claimed: i64,
    /// Rows backing off after errors.
    pub failing: i64,
    /// Seconds the oldest due row has waited.
    pub oldest_due_s: Option<f64>,
    /// The key of the oldest due row.
    pub oldest_due_key: Option<String>,
    /// The newest error on any row, with its key.
    pub last_error: Option<String>,
}

/// A job's last tick on one worker.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobRun {
    /// The job.
    pub job: String,
    /// The worker.
    pub worker_id: String,
    /// Ticks since the worker started.
    pub ticks: i64,
    /// When it last ticked.
    #[serde(skip)]
    pub last_tick_at: SystemTime,
    /// What the last tick did.
    pub last_report: serde_json::Value,
    /// The last error it saw.
    pub last_error: Option<String>,
}

/// Leases held by one worker.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    /// The worker.
    pub worker_id: String,
    /// Whether its row heartbeats.
    pub live: bool,
    /// Shard numbers it holds unexpired.
    pub shards: Vec<i32>,
    /// Other leases it holds unexpired (`singleton:…`).
    pub singletons: Vec<String>,
    /// Its self-checks at its last heartbeat (`clock.skew`), `[{name, ok, detail}]`.
    pub checks: serde_json::Value,
}

/// Queue status of every job with rows, plus `jobs` with none.
pub async fn queues(db: &impl GenericClient, jobs: &[&str]) -> Result<Vec<QueueStatus>, DbError> {
    let rows = db
        .query(
            "SELECT kind, count(*),
                    count(*) FILTER (WHERE not_before <= compute_now() AND claimed_by IS NULL),
                    count(*) FILTER (WHERE claimed_by IS NOT NULL AND claimed_until > compute_now()),
                    count(*) FILTER (WHERE attempts > 0),
                    extract(epoch FROM compute_now() - min(not_before) FILTER (WHERE not_before <= compute_now()))::float8,
                    (array_agg(key ORDER BY not_before) FILTER (WHERE not_before <= compute_now()))[1],
                    (array_agg(key || ': ' || last_error ORDER BY last_error_at DESC)
                       FILTER (WHERE last_error IS NOT NULL))[1]
               FROM work_queue GROUP BY kind ORDER BY kind",
            &[],
        )
        .await?;
    let mut out: Vec<QueueStatus> = rows
        .iter()
        .map(|r| QueueStatus {
            job: r.get(0),
            depth: r.get(1),
            due: r.get(2),
            claimed: r.get(3),
            failing: r.get(4),
            oldest_due_s: r.get(5),
            oldest_due_key: r.get(6),
            last_error: r.get(7),
        })
        .collect();
    for job in jobs {
        if !out.iter().any(|q| q.job == *job) {
            out.push(QueueStatus {
                job: (*job).to_owned(),
                depth: 0,
                due: 0,
                claimed: 0,
                failing: 0,
                oldest_due_s: None,
                oldest_due_key: None,
                last_error: None,
            });
        }
    }
    out.sort_by(|a, b| a.job.cmp(&b.job));
    Ok(out)
}

/// Each job's last tick on each worker.
pub async fn job_runs(db: &impl GenericClient) -> Result<Vec<JobRun>, DbError> {
    let rows = db
        .query("SELECT job, worker_id, ticks, last_tick_at, last_report, last_error FROM job_runs ORDER BY job, worker_id", &[])
        .await?;
    Ok(rows
        .iter()
        .map(|r| JobRun {
            job: r.get(0),
            worker_id: r.get(1),
            ticks: r.get(2),
            last_tick_at: r.get(3),
            last_report: r.get(4),
            last_error: r.get(5),
        })
        .collect())
}

/// Who holds which unexpired lease, by worker.
pub async fn holders(db: &impl GenericClient) -> Result<Vec<Holder>, DbError> {
    let rows = db
        .query(
            "SELECT l.owner,
                    EXISTS (SELECT 1 FROM workers w WHERE w.id = l.owner
                             AND w.heartbeat_at > compute_now() - make_interval(secs => $1)),
                    coalesce(array_agg(substr(l.name, 7)::int ORDER BY substr(l.name, 7)::int)
                               FILTER (WHERE l.name LIKE 'shard:%'), '{}'),
                    coalesce(array_agg(l.name ORDER BY l.name) FILTER (WHERE l.name NOT LIKE 'shard:%'), '{}'),
                    coalesce((SELECT w.checks FROM workers w WHERE w.id = l.owner), '[]')
               FROM leases l WHERE l.expires_at > compute_now() AND l.name NOT LIKE 'gateway:%'
              GROUP BY l.owner ORDER BY l.owner",
            &[&better_compute_db::workers::WORKER_TTL.as_secs_f64()],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Holder { worker_id: r.get(0), live: r.get(1), shards: r.get(2), singletons: r.get(3), checks: r.get(4) })
        .collect())
}
