//! The nodes module's parts of a node's desired state: `site` (where it is, its labels), `gpus`
//! (the mode and layout of every GPU) and `agent` (daemon settings and command lanes).

use std::collections::HashMap;

use better_compute_proto::v1::{AgentSection, CommandLane, Gpu, GpuMode, GpusSection, NodeSpec, SiteSection};
use better_compute_runtime::nodespec::NodeSpecPart;
use better_compute_runtime::RunError;
use tokio_postgres::Transaction;

/// How often the daemon reports in.
pub const HEARTBEAT_INTERVAL_MS: u32 = 5_000;

/// `site`: site, pool and node names and the node's labels.
pub struct SitePart;

#[async_trait::async_trait]
impl NodeSpecPart for SitePart {
    fn name(&self) -> &'static str {
        "nodes.site"
    }

    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError> {
        let rows = tx
            .query(
                "SELECT n.id, s.id, s.name, p.id, p.name, n.name, n.labels FROM nodes n
                   JOIN pools p ON p.id = n.pool_id JOIN sites s ON s.id = p.site_id WHERE n.id = ANY($1)",
                &[&node_ids],
            )
            .await?;
        let mut by_node: HashMap<String, NodeSpec> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let labels: serde_json::Value = r.get(6);
            let labels = labels
                .as_object()
                .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
                .unwrap_or_default();
            let site = SiteSection { site_id: r.get(1), site_name: r.get(2), pool_id: r.get(3), pool_name: r.get(4), node_name: r.get(5), labels };
            by_node.insert(r.get(0), NodeSpec { site: Some(site), ..Default::default() });
        }
        node_ids.iter().map(|id| by_node.remove(id).ok_or_else(|| format!("node {id} has no row").into())).collect()
    }
}

/// `gpus`: every GPU's mode and layout.
pub struct GpusPart;

#[async_trait::async_trait]
impl NodeSpecPart for GpusPart {
    fn name(&self) -> &'static str {
        "nodes.gpus"
    }

    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError> {
        let rows = tx
            .query(
                "SELECT node_id, id, index, mode, mig_layout, slots FROM devices
                  WHERE node_id = ANY($1) AND parent_id IS NULL ORDER BY node_id, index",
                &[&node_ids],
            )
            .await?;
        let mut by_node: HashMap<String, Vec<Gpu>> = HashMap::new();
        for r in &rows {
            let mode = match r.get::<_, String>(3).as_str() {
                "exclusive" => GpuMode::Exclusive,
                "mig" => GpuMode::Mig,
                "time-slice" => GpuMode::TimeSlice,
                "mps" => GpuMode::Mps,
                _ => GpuMode::Unspecified,
            };
            by_node.entry(r.get(0)).or_default().push(Gpu {
                uuid: r.get(1),
                index: r.get::<_, i16>(2) as u32,
                mode: mode as i32,
                mig_layout: r.get(4),
                slots: r.get::<_, i16>(5) as u32,
            });
        }
        Ok(node_ids
            .iter()
            .map(|id| NodeSpec { gpus: Some(GpusSection { gpus: by_node.remove(id).unwrap_or_default() }), ..Default::default() })
            .collect())
    }
}

/// The command lanes every daemon is given, with their credits (commands in flight at once): the
/// `agent` section sends them, and the gateway sends a node no more of a lane than it has credits.
pub const LANES: &[(&str, u32)] = &[("default", 4), ("diag", 1), ("power", 1)];

/// `agent`: the daemon's settings and command lanes with their credits.
pub struct AgentPart;

#[async_trait::async_trait]
impl NodeSpecPart for AgentPart {
    fn name(&self) -> &'static str {
        "nodes.agent"
    }

    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError> {
        let keys = crate::commands::keys::announced(tx).await?;
        let spec = NodeSpec {
            agent: Some(AgentSection {
                heartbeat_interval_ms: HEARTBEAT_INTERVAL_MS,
                lanes: LANES.iter().map(|(name, credits)| CommandLane { name: (*name).to_owned(), credits: *credits }).collect(),
                command_keys: keys
                    .into_iter()
                    .map(|k| better_compute_proto::v1::CommandKey { public_key: k.public_key, endorsement: k.endorsement })
                    .collect(),
            }),
            ..Default::default()
        };
        Ok(vec![spec; node_ids.len()])
    }
}
