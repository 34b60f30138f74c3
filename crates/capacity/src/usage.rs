//! Usage metering: the fleet's window size, and reading the usage windows the `capacity.usage` job
//! closes (`jobs/usage.rs`, `src/sql/usage.sql`).

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

/// Runs a metering function of the shape `f(pool text, limit int) RETURNS TABLE (id text,
/// tenant_id text, data jsonb)` (`capacity_usage_close`, the vps module's `vps_usage_close`) in a
/// metering job's fenced transaction, and writes each closed window's `event_type` event, subject
/// its billing key, in the same transaction. Returns how many windows it wrote.
pub async fn close_windows(
    ctx: &better_compute_runtime::ReconcileContext,
    tx: &tokio_postgres::Transaction<'_>,
    function: &'static str,
    pool: &str,
    limit: i32,
    event_type: &'static str,
) -> Result<u64, DbError> {
    let rows = tx.query(&format!("SELECT id, tenant_id, data FROM {function}($1, $2)"), &[&pool, &limit]).await?;
    for r in &rows {
        let (key, tenant, data): (String, String, serde_json::Value) = (r.get(0), r.get(1), r.get(2));
        ctx.emit(tx, better_compute_runtime::NewEvent { event_type, tenant_id: Some(&tenant), subject: &key, data }).await?;
    }
    Ok(rows.len() as u64)
}

/// The fleet's usage window in seconds (default 3600).
pub async fn window_s(db: &impl GenericClient) -> Result<i32, DbError> {
    Ok(db.query_one("SELECT window_s FROM usage_settings", &[]).await?.get(0))
}

/// Sets the fleet's usage window: from 60 s to a day, a divisor of a day, so windows align in UTC.
/// Windows already closed keep their size; change it between billing periods.
pub async fn set_window_s(db: &impl GenericClient, window_s: i32) -> Result<(), DbError> {
    if !(60..=86_400).contains(&window_s) || 86_400 % window_s != 0 {
        return Err(Error::invalid_argument("the usage window must be 60 to 86400 seconds and divide a day").into());
    }
    db.execute("UPDATE usage_settings SET window_s = $1", &[&window_s]).await?;
    Ok(())
}

/// Usage summed over a group (a reservation, a pool, a GPU model or a day), for `usage.list`.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageSum {
    /// The group: a reservation id, a pool id, `kind/model[/profile]`, or a day (`YYYY-MM-DD`).
    pub group: String,
    /// The tenant.
    pub tenant_id: String,
    /// Windows and adjustments summed.
    pub windows: i64,
    /// Atoms held times seconds.
    pub atom_seconds: f64,
    /// vCPUs times seconds.
    pub vcpu_seconds: f64,
    /// MiB times seconds.
    pub memory_mib_seconds: f64,
    /// GiB times seconds.
    pub disk_gib_seconds: f64,
}

/// How `usage.list` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum GroupBy {
    /// Per reservation.
    Reservation,
    /// Per pool.
    Pool,
    /// Per atom class: kind, GPU model and MIG profile.
    Model,
    /// Per UTC day of the window's start.
    Day,
}

/// Sums the windows that start in `[from, to)` (RFC 3339), of one tenant or of every tenant
/// (`None`), grouped; at most `limit` groups, in group order.
pub async fn list(db: &impl GenericClient, tenant: Option<&str>, from: &str, to: &str, group_by: GroupBy, limit: i64) -> Result<Vec<UsageSum>, DbError> {
    better_compute_core::time::check_rfc3339("from", from)?;
    better_compute_core::time::check_rfc3339("to", to)?;
    let group = match group_by {
        GroupBy::Reservation => "allocation_id",
        GroupBy::Pool => "pool_id",
        GroupBy::Model => "gpu_kind || '/' || gpu_model || coalesce('/' || mig_profile, '')",
        GroupBy::Day => "to_char(window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    };
    let rows = db
        .query(
            &format!(
                "SELECT {group} AS g, tenant_id, count(*), sum(atom_seconds)::float8, sum(vcpu_seconds)::float8, sum(memory_mib_seconds)::float8,
                        sum(disk_gib_seconds)::float8
                   FROM usage_windows
                  WHERE ($1::text IS NULL OR tenant_id = $1) AND window_start >= $2::text::timestamptz AND window_start < $3::text::timestamptz
                  GROUP BY 1, 2 ORDER BY 2, 1 LIMIT $4"
            ),
            &[&tenant, &from, &to, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| UsageSum {
            group: r.get(0),
            tenant_id: r.get(1),
            windows: r.get(2),
            atom_seconds: r.get(3),
            vcpu_seconds: r.get(4),
            memory_mib_seconds: r.get(5),
            disk_gib_seconds: r.get(6),
        })
        .collect())
}

/// One usage window (or adjustment) as exported.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageWindowView {
    /// The billing key, unique: `cmp:<reservationId>:<windowStart>[:<adjustment>]`.
    pub key: String,
    /// The reservation (allocation).
    pub reservation_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its pool.
    pub pool_id: String,
    /// Its node.
    pub node_id: Option<String>,
    /// RFC 3339.
    pub window_start: String,
    /// RFC 3339.
    pub window_end: String,
    /// 0 for the window, n for its n-th adjustment (a difference to add).
    pub adjustment: i32,
    /// gpu, mig or slot.
    pub gpu_kind: String,
    /// The GPU model.
    pub gpu_model: String,
    /// The MIG profile.
    pub mig_profile: Option<String>,
    /// Atoms held times seconds.
    pub atom_seconds: f64,
    /// vCPUs times seconds.
    pub vcpu_seconds: f64,
    /// MiB times seconds.
    pub memory_mib_seconds: f64,
    /// GiB times seconds.
    pub disk_gib_seconds: f64,
}

/// The windows that start in `[from, to)`, of one tenant or every tenant, in key order after
/// `after`: one page of an export (at most `size + 1` rows read, for [`Page::from_rows`]).
///
/// [`Page::from_rows`]: better_compute_core::page::Page::from_rows
pub async fn export_page(db: &impl GenericClient, tenant: Option<&str>, from: &str, to: &str, after: &str, size: i64) -> Result<Vec<UsageWindowView>, DbError> {
    better_compute_core::time::check_rfc3339("from", from)?;
    better_compute_core::time::check_rfc3339("to", to)?;
    let ts = |c: &str| format!("to_char({c} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')");
    let rows = db
        .query(
            &format!(
                "SELECT id, allocation_id, tenant_id, pool_id, node_id, {}, {}, adjustment, gpu_kind, gpu_model, mig_profile,
                        atom_seconds::float8, vcpu_seconds::float8, memory_mib_seconds::float8, disk_gib_seconds::float8
                   FROM usage_windows
                  WHERE ($1::text IS NULL OR tenant_id = $1) AND window_start >= $2::text::timestamptz AND window_start < $3::text::timestamptz
                    AND id > $4
                  ORDER BY id LIMIT $5",
                ts("window_start"),
                ts("window_end")
            ),
            &[&tenant, &from, &to, &after, &(size + 1)],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| UsageWindowView {
            key: r.get(0),
            reservation_id: r.get(1),
            tenant_id: r.get(2),
            pool_id: r.get(3),
            node_id: r.get(4),
            window_start: r.get(5),
            window_end: r.get(6),
            adjustment: r.get(7),
            gpu_kind: r.get(8),
            gpu_model: r.get(9),
            mig_profile: r.get(10),
            atom_seconds: r.get(11),
            vcpu_seconds: r.get(12),
            memory_mib_seconds: r.get(13),
            disk_gib_seconds: r.get(14),
        })
        .collect())
}
