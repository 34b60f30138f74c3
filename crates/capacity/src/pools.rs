//! Each pool's capacity as operators see it (`better-compute capacity`): its rollup (atoms per
//! class, nodes, free scalars; absent until the rollup job has run) and its reservations by state.

use std::collections::BTreeMap;

use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

/// One pool's capacity.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolCapacity {
    /// `site/pool`.
    pub pool: String,
    /// `pool_…`.
    pub pool_id: String,
    /// Per GPU class: kind, model, profile, total and idle atoms; `None` before the first rollup.
    pub atoms: Option<serde_json::Value>,
    /// Its nodes, per the rollup.
    pub nodes: Option<i32>,
    /// Those that take placements, per the rollup.
    pub schedulable_nodes: Option<i32>,
    /// Free vCPU, per the rollup.
    pub vcpu_free: Option<i64>,
    /// Free memory, per the rollup.
    pub memory_mib_free: Option<i64>,
    /// How many of its reservations are in each state.
    pub reservations: BTreeMap<String, i64>,
}

/// Every pool, by `site/pool`.
pub async fn pool_capacities(db: &impl GenericClient) -> Result<Vec<PoolCapacity>, DbError> {
    let rows = db
        .query(
            "SELECT s.name || '/' || p.name, p.id, r.atoms, r.nodes, r.schedulable_nodes, r.vcpu_free, r.memory_mib_free,
                    (SELECT coalesce(jsonb_object_agg(x.state, x.n), '{}') FROM
                       (SELECT state, count(*) AS n FROM reservations WHERE pool_id = p.id GROUP BY state) x)
               FROM pools p JOIN sites s ON s.id = p.site_id LEFT JOIN pool_capacity_rollup r ON r.pool_id = p.id
              ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let by_state: serde_json::Value = r.get(7);
            PoolCapacity {
                pool: r.get(0),
                pool_id: r.get(1),
                atoms: r.get(2),
                nodes: r.get(3),
                schedulable_nodes: r.get(4),
                vcpu_free: r.get(5),
                memory_mib_free: r.get(6),
                reservations: serde_json::from_value(by_state).expect("jsonb_object_agg of counts by state"),
            }
        })
        .collect())
}
