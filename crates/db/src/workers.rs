//! The `workers` table: one row per live server process, kept fresh by heartbeats. Shards are
//! divided among the rows that heartbeat within [`WORKER_TTL`].

use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::DbError;

/// A worker that has not heartbeat for this long is dead.
pub const WORKER_TTL: Duration = Duration::from_secs(15);
/// How often a worker heartbeats.
pub const WORKER_HEARTBEAT_EVERY: Duration = Duration::from_secs(5);

/// Who a process is, as written to `workers`.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// The worker id (`wrk_…`).
    pub id: String,
    /// The host it runs on.
    pub hostname: String,
    /// Its process id.
    pub pid: i32,
    /// The server roles it runs (`api`, `gateway`, `worker`).
    pub roles: Vec<String>,
    /// The build version.
    pub version: String,
}

/// Registers the process (or refreshes its row after a restart with the same id).
pub async fn register(db: &impl GenericClient, w: &WorkerInfo) -> Result<(), DbError> {
    db.execute(
        "INSERT INTO workers (id, hostname, pid, roles, version) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (id) DO UPDATE SET hostname = EXCLUDED.hostname, pid = EXCLUDED.pid,
           roles = EXCLUDED.roles, version = EXCLUDED.version, heartbeat_at = compute_now()",
        &[&w.id, &w.hostname, &w.pid, &w.roles, &w.version],
    )
    .await?;
    Ok(())
}

/// Heartbeats, with the worker's self-checks (`[{name, ok, detail}]`, as `jobs` shows them).
/// `false` when the row is gone (pruned as dead): register again.
pub async fn heartbeat(db: &impl GenericClient, id: &str, checks: &serde_json::Value) -> Result<bool, DbError> {
    Ok(db.execute("UPDATE workers SET heartbeat_at = compute_now(), checks = $2 WHERE id = $1", &[&id, checks]).await? == 1)
}

/// Removes the row on a clean shutdown, so shards move at once.
pub async fn deregister(db: &impl GenericClient, id: &str) -> Result<(), DbError> {
    db.execute("DELETE FROM workers WHERE id = $1", &[&id]).await?;
    Ok(())
}

/// Ids of the workers that heartbeat within [`WORKER_TTL`], sorted.
pub async fn live(db: &impl GenericClient) -> Result<Vec<String>, DbError> {
    let rows = db
        .query(
            "SELECT id FROM workers WHERE heartbeat_at > compute_now() - make_interval(secs => $1) ORDER BY id",
            &[&WORKER_TTL.as_secs_f64()],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Deletes workers dead for ten times [`WORKER_TTL`]; returns how many.
pub async fn prune_dead(db: &impl GenericClient) -> Result<u64, DbError> {
    Ok(db
        .execute(
            "DELETE FROM workers WHERE heartbeat_at < compute_now() - make_interval(secs => $1)",
            &[&(WORKER_TTL.as_secs_f64() * 10.0)],
        )
        .await?)
}
