//! Capacity's part of a node's desired state: `allocations`, which atoms are exposed to which
//! reservation, with its scalars and range.

use std::collections::HashMap;

use better_compute_proto::v1::{Allocation, AllocationsSection, NodeSpec};
use better_compute_runtime::nodespec::NodeSpecPart;
use better_compute_runtime::RunError;
use tokio_postgres::Transaction;

use better_compute_db::clock::rfc3339_sql;

/// `allocations`: the node's placed and active reservations.
pub struct AllocationsPart;

#[async_trait::async_trait]
impl NodeSpecPart for AllocationsPart {
    fn name(&self) -> &'static str {
        "capacity.allocations"
    }

    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError> {
        let rows = tx
            .query(
                &format!(
                    "SELECT r.node_id, r.id, r.tenant_id, r.vcpu, r.memory_mib, r.disk_gib, {}, {},
                            (SELECT coalesce(array_agg(DISTINCT b.device_id ORDER BY b.device_id), '{{}}')
                               FROM device_bookings b WHERE b.allocation_id = r.id AND upper(b.during) > compute_now())
                       FROM reservations r WHERE r.node_id = ANY($1) AND r.state IN ('placed', 'active') ORDER BY r.node_id, r.id",
                    rfc3339_sql("lower(r.during)"),
                    rfc3339_sql("upper(r.during)")
                ),
                &[&node_ids],
            )
            .await?;
        let mut by_node: HashMap<String, Vec<Allocation>> = HashMap::new();
        for r in &rows {
            by_node.entry(r.get(0)).or_default().push(Allocation {
                allocation_id: r.get(1),
                tenant_id: r.get(2),
                vcpu: r.get::<_, i32>(3) as u32,
                memory_mib: r.get::<_, i64>(4) as u64,
                disk_gib: r.get::<_, i64>(5) as u64,
                starts_at: r.get(6),
                ends_at: r.get(7),
                atoms: r.get(8),
            });
        }
        Ok(node_ids
            .iter()
            .map(|id| NodeSpec {
                allocations: Some(AllocationsSection { allocations: by_node.remove(id).unwrap_or_default() }),
                ..Default::default()
            })
            .collect())
    }
}
