//! Quotas: per tenant and resource, `used` moves only through guarded updates in the transaction
//! that reserves or releases, with a `CHECK (used <= max)` backstop.

use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

/// The resources a quota limits.
pub const RESOURCES: [&str; 6] = ["gpus", "mig_instances", "gpu_slots", "vcpu", "memory_mib", "disk_gib"];

/// A charge: amounts per resource.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Charge(pub Vec<(&'static str, i64)>);

impl Charge {
    /// The charge of a reservation of `count` atoms of `kind` plus scalars.
    pub fn of(kind: &str, count: i64, vcpu: i64, memory_mib: i64, disk_gib: i64) -> Charge {
        let atoms = match kind {
            "gpu" => "gpus",
            "mig" => "mig_instances",
            _ => "gpu_slots",
        };
        Charge(
            [(atoms, count), ("vcpu", vcpu), ("memory_mib", memory_mib), ("disk_gib", disk_gib)]
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .collect(),
        )
    }
}

/// Charges the tenant in one guarded statement: the rows are locked in resource order (so two
/// charges never wait on each other in opposite orders), and each is updated only if its charge fits
/// under max. A resource that did not fit (or has no quota line) is `QUOTA_EXCEEDED`, final for the
/// request: the caller rolls its transaction back.
pub async fn charge(tx: &impl GenericClient, tenant_id: &str, charge: &Charge) -> Result<(), DbError> {
    if charge.0.is_empty() {
        return Ok(());
    }
    let resources: Vec<&str> = charge.0.iter().map(|(r, _)| *r).collect();
    let amounts: Vec<i64> = charge.0.iter().map(|(_, n)| *n).collect();
    let charged: Vec<String> = tx
        .query(
            "UPDATE quota_usage q SET used = q.used + c.n
               FROM (SELECT l.resource, c.n
                       FROM (SELECT resource FROM quota_usage WHERE tenant_id = $1 AND resource = ANY($2)
                              ORDER BY resource FOR UPDATE) l
                       JOIN unnest($2::text[], $3::int8[]) AS c(resource, n) ON c.resource = l.resource) c
              WHERE q.tenant_id = $1 AND q.resource = c.resource AND q.used + c.n <= q.max
             RETURNING q.resource",
            &[&tenant_id, &resources, &amounts],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if let Some((resource, n)) = charge.0.iter().find(|(r, _)| !charged.iter().any(|c| c == r)) {
        let q = tx
            .query_opt("SELECT used, max FROM quota_usage WHERE tenant_id = $1 AND resource = $2", &[&tenant_id, resource])
            .await?;
        let message = match q {
            Some(q) => format!(
                "quota for {resource} exceeded: {} of {} used, {n} more asked; release reservations or ask an operator for more",
                q.get::<_, i64>(0),
                q.get::<_, i64>(1)
            ),
            None => format!("the tenant has no quota for {resource}; ask an operator to set one"),
        };
        return Err(Error::new(ErrorCode::QuotaExceeded, message)
            .with_details(serde_json::json!({"resource": resource, "asked": n}))
            .into());
    }
    Ok(())
}

/// Refunds a charge (releasing refunds quota first, before anything else is touched), locking the
/// rows in the same resource order as [`charge`].
pub async fn refund(tx: &impl GenericClient, tenant_id: &str, charge: &Charge) -> Result<(), DbError> {
    if charge.0.is_empty() {
        return Ok(());
    }
    let resources: Vec<&str> = charge.0.iter().map(|(r, _)| *r).collect();
    let amounts: Vec<i64> = charge.0.iter().map(|(_, n)| *n).collect();
    tx.execute(
        "UPDATE quota_usage q SET used = q.used - c.n
           FROM (SELECT l.resource, c.n
                   FROM (SELECT resource FROM quota_usage WHERE tenant_id = $1 AND resource = ANY($2)
                          ORDER BY resource FOR UPDATE) l
                   JOIN unnest($2::text[], $3::int8[]) AS c(resource, n) ON c.resource = l.resource) c
          WHERE q.tenant_id = $1 AND q.resource = c.resource",
        &[&tenant_id, &resources, &amounts],
    )
    .await?;
    Ok(())
}

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
    if max < 0 {
        return Err(Error::invalid_argument("max must not be negative").into());
    }
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
