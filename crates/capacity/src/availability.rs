//! What fits and when: for a pool, a GPU class and a count, how many atoms of the class are
//! placeable, how many one node has free from now for the duration, and the earliest start (now, or
//! the end of a booking, within [`HORIZON`]) at which one node has `count` of them free for the
//! whole duration. It reads the bookings as the placer does but takes no lock and books nothing,
//! so it is advice: a create decides. It counts atoms only (vCPU, memory and disk are checked when
//! the reservation is made), on the nodes that take a request tolerating no taint.

use std::time::Duration;

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::reservations::GpuRequest;

/// How far ahead a start is looked for.
pub const HORIZON: Duration = Duration::from_secs(30 * 86_400);
/// The most candidate starts weighed (now and the earliest booking ends after it).
pub const MAX_CANDIDATES: i64 = 256;

/// What fits and when.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Availability {
    /// Atoms of the class in the pool that placement may use now (healthy, not quarantined, on
    /// nodes that take new placements and carry no taint).
    pub placeable_atoms: i64,
    /// The most atoms of the class one node has free from now for the whole duration.
    pub most_free_on_one_node_now: i64,
    /// Whether one node has `count` of them free from now for the duration.
    pub fits_now: bool,
    /// RFC 3339: the earliest start within 30 days at which one node has `count` of them free for
    /// the whole duration (now when it fits now); null when none does.
    pub earliest_start: Option<String>,
}

/// What fits and when for `gpu` over `duration_s` in `pool_id` (see the module's doc).
pub async fn of(db: &impl GenericClient, pool_id: &str, gpu: &GpuRequest, duration_s: i64) -> Result<Availability, DbError> {
    if !(1..=366 * 86_400).contains(&duration_s) {
        return Err(Error::invalid_argument("durationS must be between 1 and 31622400 (366 days)").into());
    }
    let profile = crate::reservations::gpu_class(gpu)?;
    if !(1..=64).contains(&gpu.count) {
        return Err(Error::invalid_argument("gpu.count must be between 1 and 64").into());
    }
    if db.query_opt("SELECT 1 FROM pools WHERE id = $1", &[&pool_id]).await?.is_none() {
        return Err(Error::not_found("pool", pool_id).into());
    }
    let row = db
        .query_one(
            "WITH atoms AS (
               SELECT a.id, a.node_id FROM devices a
                 JOIN devices g ON g.id = coalesce(a.parent_id, a.id)
                 JOIN nodes n ON n.id = a.node_id
                WHERE n.pool_id = $1 AND a.bookable AND a.kind = $2 AND a.model = $3 AND coalesce(a.profile, '') = $4
                  AND g.healthy AND NOT g.quarantined AND capacity_node_open(n.observed_generation, n.no_schedule_reasons, n.taints)
             ), starts AS (
               SELECT compute_now() AS t
               UNION
               (SELECT DISTINCT upper(b.during) FROM device_bookings b JOIN atoms a ON a.id = b.device_id
                 WHERE upper(b.during) > compute_now() AND upper(b.during) < compute_now() + make_interval(secs => $6)
                 ORDER BY 1 LIMIT $7)
             ), free AS (
               SELECT s.t, a.node_id, count(*) AS n FROM starts s CROSS JOIN atoms a
                WHERE NOT EXISTS (SELECT 1 FROM device_bookings b
                                   WHERE b.device_id = a.id AND b.during && tstzrange(s.t, s.t + make_interval(secs => $5), '[)'))
                GROUP BY s.t, a.node_id
             )
             SELECT (SELECT count(*) FROM atoms),
                    coalesce((SELECT max(f.n) FROM free f WHERE f.t = compute_now()), 0),
                    (SELECT min(f.t) FROM free f WHERE f.n >= $8)",
            &[&pool_id, &gpu.kind, &gpu.model, &profile, &(duration_s as f64), &HORIZON.as_secs_f64(), &MAX_CANDIDATES, &i64::from(gpu.count)],
        )
        .await?;
    let most_now: i64 = row.get(1);
    let earliest: Option<std::time::SystemTime> = row.get(2);
    Ok(Availability {
        placeable_atoms: row.get(0),
        most_free_on_one_node_now: most_now,
        fits_now: most_now >= i64::from(gpu.count),
        earliest_start: earliest.map(better_compute_core::time::rfc3339),
    })
}
