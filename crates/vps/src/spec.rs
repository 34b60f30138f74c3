//! The vps module's part of a node's desired state: `instances`, only on vps-host nodes (other
//! nodes' specs stay as they were), naming every instance the host should have and whether it
//! should run. An instance absent from it is deleted on the host.

use std::collections::HashMap;

use better_compute_proto::v1::{Instance, InstancesSection, NodeSpec};
use better_compute_runtime::nodespec::NodeSpecPart;
use better_compute_runtime::RunError;
use tokio_postgres::Transaction;

/// `instances`: the node's instances that are not requested, deleting or deleted.
pub struct InstancesPart;

#[async_trait::async_trait]
impl NodeSpecPart for InstancesPart {
    fn name(&self) -> &'static str {
        "vps.instances"
    }

    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError> {
        let hosts = better_compute_nodes::inventory::vps_hosts(tx, node_ids).await?;
        let mut by_node: HashMap<String, Vec<Instance>> = hosts.iter().map(|h| (h.clone(), Vec::new())).collect();
        if !hosts.is_empty() {
            let rows = tx
                .query(
                    "SELECT node_id, id, allocation_id, tenant_id, state IN ('provisioning', 'running'), image, ssh_public_keys, user_data, reboot_count
                       FROM instances WHERE node_id = ANY($1) AND state IN ('provisioning', 'running', 'stopping', 'stopped', 'failed')
                      ORDER BY node_id, id",
                    &[&hosts],
                )
                .await?;
            for r in &rows {
                by_node.entry(r.get(0)).or_default().push(Instance {
                    instance_id: r.get(1),
                    allocation_id: r.get(2),
                    tenant_id: r.get(3),
                    running: r.get(4),
                    image: r.get(5),
                    ssh_public_keys: r.get(6),
                    user_data: r.get(7),
                    reboot_count: r.get::<_, i32>(8) as u32,
                });
            }
        }
        Ok(node_ids
            .iter()
            .map(|id| NodeSpec { instances: by_node.remove(id).map(|instances| InstancesSection { instances }), ..Default::default() })
            .collect())
    }
}
