//! `vps.usage`: instance-seconds, per flavour and usage window. An instance is metered while its
//! VM is up (running, or stopping until the host reports it stopped), from the stretches recorded
//! as it moves (`instance_runs`); each closed window it was up in gets one row,
//! `cmp:<instanceId>:<windowStart>`, with its `instance.usageWindow` event, in capacity's windows
//! (`usage_settings`). One key per pool; SQL in `src/sql/usage.sql`.

use better_compute_core::state::InstanceState;
use better_compute_db::DbError;
use better_compute_runtime::work_queue;
use tokio_postgres::GenericClient;

use crate::jobs::usage::USAGE_KIND;

/// Instances metered per run; more makes it run again.
pub(crate) const INSTANCES_PER_RUN: i32 = 256;

/// Whether an instance's VM is up in `state`, and so metered.
fn up(state: InstanceState) -> bool {
    matches!(state, InstanceState::Running | InstanceState::Stopping)
}

/// Records an instance's move from `from` to `to` in its runs, in the caller's transaction (the one
/// that moves it): a VM coming up opens a run and wakes its pool's metering, one going down
/// closes it.
pub(crate) async fn follow(tx: &impl GenericClient, id: &str, pool_id: &str, from: InstanceState, to: InstanceState) -> Result<(), DbError> {
    match (up(from), up(to)) {
        (false, true) => {
            tx.execute("INSERT INTO instance_runs (instance_id, during) VALUES ($1, tstzrange(compute_now(), NULL))", &[&id]).await?;
            work_queue::enqueue(tx, &USAGE_KIND, pool_id).await?;
        }
        (true, false) => {
            // A run that began this very instant was never up: it goes rather than being empty.
            tx.execute(
                "WITH closed AS (UPDATE instance_runs SET during = tstzrange(lower(during), compute_now())
                                  WHERE instance_id = $1 AND upper_inf(during) AND lower(during) < compute_now() RETURNING 1)
                 DELETE FROM instance_runs WHERE instance_id = $1 AND upper_inf(during) AND lower(during) >= compute_now()",
                &[&id],
            )
            .await?;
        }
        _ => {}
    }
    Ok(())
}

/// Instance-seconds summed over a group, for `instanceUsage.list`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceUsageSum {
    /// The group: an instance id, a pool id, a flavour, or a day (`YYYY-MM-DD`).
    pub group: String,
    /// The tenant.
    pub tenant_id: String,
    /// Windows summed.
    pub windows: i64,
    /// Seconds the VMs were up.
    pub instance_seconds: f64,
}

/// How `instanceUsage.list` groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum InstanceGroupBy {
    /// Per instance.
    Instance,
    /// Per pool.
    Pool,
    /// Per flavour (`2xgpu:H100-80GB,16vcpu,65536mib,100gib`).
    Flavour,
    /// Per UTC day of the window's start.
    Day,
}

/// Sums the instance windows that start in `[from, to)` (RFC 3339), of one tenant or of every
/// tenant (`None`), grouped; at most `limit` groups, in tenant then group order.
pub async fn list(db: &impl GenericClient, tenant: Option<&str>, from: &str, to: &str, group_by: InstanceGroupBy, limit: i64) -> Result<Vec<InstanceUsageSum>, DbError> {
    better_compute_core::time::check_rfc3339("from", from)?;
    better_compute_core::time::check_rfc3339("to", to)?;
    let group = match group_by {
        InstanceGroupBy::Instance => "instance_id",
        InstanceGroupBy::Pool => "pool_id",
        InstanceGroupBy::Flavour => "flavour",
        InstanceGroupBy::Day => "to_char(window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    };
    let rows = db
        .query(
            &format!(
                "SELECT {group}, tenant_id, count(*), sum(instance_seconds)::float8 FROM instance_usage_windows
                  WHERE ($1::text IS NULL OR tenant_id = $1) AND window_start >= $2::text::timestamptz AND window_start < $3::text::timestamptz
                  GROUP BY 1, 2 ORDER BY 2, 1 LIMIT $4"
            ),
            &[&tenant, &from, &to, &limit],
        )
        .await?;
    Ok(rows.iter().map(|r| InstanceUsageSum { group: r.get(0), tenant_id: r.get(1), windows: r.get(2), instance_seconds: r.get(3) }).collect())
}

/// One instance's usage window as exported.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceUsageWindowView {
    /// The billing key, unique: `cmp:<instanceId>:<windowStart>`.
    pub key: String,
    /// The instance.
    pub instance_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its pool.
    pub pool_id: String,
    /// Its host.
    pub node_id: Option<String>,
    /// What it is metered as: its reservation's GPUs, vCPUs, memory and disk.
    pub flavour: String,
    /// RFC 3339.
    pub window_start: String,
    /// RFC 3339.
    pub window_end: String,
    /// Seconds its VM was up in the window.
    pub instance_seconds: f64,
}

/// The instance windows that start in `[from, to)`, of one tenant or every tenant, in key order
/// after `after`: one page of an export (at most `size + 1` rows, for `Page::from_rows`).
pub async fn export_page(db: &impl GenericClient, tenant: Option<&str>, from: &str, to: &str, after: &str, size: i64) -> Result<Vec<InstanceUsageWindowView>, DbError> {
    better_compute_core::time::check_rfc3339("from", from)?;
    better_compute_core::time::check_rfc3339("to", to)?;
    let rows = db
        .query(
            "SELECT id, instance_id, tenant_id, pool_id, node_id, flavour,
                    to_char(window_start AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),
                    to_char(window_end AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), instance_seconds::float8
               FROM instance_usage_windows
              WHERE ($1::text IS NULL OR tenant_id = $1) AND window_start >= $2::text::timestamptz AND window_start < $3::text::timestamptz AND id > $4
              ORDER BY id LIMIT $5",
            &[&tenant, &from, &to, &after, &(size + 1)],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| InstanceUsageWindowView {
            key: r.get(0),
            instance_id: r.get(1),
            tenant_id: r.get(2),
            pool_id: r.get(3),
            node_id: r.get(4),
            flavour: r.get(5),
            window_start: r.get(6),
            window_end: r.get(7),
            instance_seconds: r.get(8),
        })
        .collect())
}
