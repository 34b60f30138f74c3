//! Quotas: per tenant and resource, `used` moves only through guarded updates in the transaction
//! that reserves or releases, with a `CHECK (used <= max)` backstop. The charge and the refund run
//! in the database (`capacity_charge` and `capacity_refund`, src/sql/quota.sql),
//! inside `capacity_reserve` and `capacity_end`.

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

/// The resources a quota limits.
pub const RESOURCES: [&str; 6] = ["gpus", "mig_instances", "gpu_slots", "vcpu", "memory_mib", "disk_gib"];

/// One quota line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Quota {
    /// The resource.
    pub resource: String,
    /// Charged by non-terminal reservations.
    pub used: i64,
    /// The limit.
    pub max: i64,
}

/// Sets a tenant's limit for a resource. Lowering it below what is in use is refused: release
/// reservations first.
pub async fn set(tx: &impl GenericClient, tenant_id: &str, resource: &str, max: i64) -> Result<Quota, DbError> {
    if !RESOURCES.contains(&resource) {
        return Err(Error::invalid_argument(format!("resource must be one of {}", RESOURCES.join(", "))).into());
    }
    better_compute_core::bounds::check_amount("max", max, better_compute_core::bounds::MAX_QUOTA)?;
    let row = tx
        .query_opt(
            "INSERT INTO quota_usage AS q (tenant_id, resource, max) VALUES ($1, $2, $3)
             ON CONFLICT (tenant_id, resource) DO UPDATE SET max = EXCLUDED.max WHERE q.used <= EXCLUDED.max
             RETURNING used, max",
            &[&tenant_id, &resource, &max],
        )
        .await?;
    match row {
        Some(r) => Ok(Quota { resource: resource.to_owned(), used: r.get(0), max: r.get(1) }),
        None => Err(Error::failed_precondition(format!(
            "cannot lower the {resource} quota to {max}: more is in use; release reservations first"
        ))
        .into()),
    }
}

/// A tenant's quotas.
pub async fn get(db: &impl GenericClient, tenant_id: &str) -> Result<Vec<Quota>, DbError> {
    let rows = db
        .query("SELECT resource, used, max FROM quota_usage WHERE tenant_id = $1 ORDER BY resource", &[&tenant_id])
        .await?;
    Ok(rows.iter().map(|r| Quota { resource: r.get(0), used: r.get(1), max: r.get(2) }).collect())
}
