//! The nodes module's parts of a node's desired state: `site` (where it is, its labels), `gpus`
//! (the mode and layout of every GPU) and `agent` (daemon settings and command lanes).

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

    async fn node_spec(&self, tx: &Transaction<'_>, node_id: &str) -> Result<NodeSpec, RunError> {
        let r = tx
            .query_one(
                "SELECT s.id, s.name, p.id, p.name, n.name, n.labels FROM nodes n
                   JOIN pools p ON p.id = n.pool_id JOIN sites s ON s.id = p.site_id WHERE n.id = $1",
                &[&node_id],
            )
            .await?;
        let labels: serde_json::Value = r.get(5);
        let labels = labels
            .as_object()
            .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
            .unwrap_or_default();
        Ok(NodeSpec {
            site: Some(SiteSection {
                site_id: r.get(0),
                site_name: r.get(1),
                pool_id: r.get(2),
                pool_name: r.get(3),
                node_name: r.get(4),
                labels,
            }),
            ..Default::default()
        })
    }
}

/// `gpus`: every GPU's mode and layout.
pub struct GpusPart;

#[async_trait::async_trait]
impl NodeSpecPart for GpusPart {
    fn name(&self) -> &'static str {
        "nodes.gpus"
    }

    async fn node_spec(&self, tx: &Transaction<'_>, node_id: &str) -> Result<NodeSpec, RunError> {
        let rows = tx
            .query(
                "SELECT id, index, mode, mig_layout, slots FROM devices WHERE node_id = $1 AND parent_id IS NULL ORDER BY index",
                &[&node_id],
            )
            .await?;
        let gpus = rows
            .iter()
            .map(|r| {
                let mode = match r.get::<_, String>(2).as_str() {
                    "exclusive" => GpuMode::Exclusive,
                    "mig" => GpuMode::Mig,
                    "time-slice" => GpuMode::TimeSlice,
                    "mps" => GpuMode::Mps,
                    _ => GpuMode::Unspecified,
                };
                Gpu {
                    uuid: r.get(0),
                    index: r.get::<_, i16>(1) as u32,
                    mode: mode as i32,
                    mig_layout: r.get(3),
                    slots: r.get::<_, i16>(4) as u32,
                }
            })
            .collect();
        Ok(NodeSpec { gpus: Some(GpusSection { gpus }), ..Default::default() })
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

    async fn node_spec(&self, _tx: &Transaction<'_>, _node_id: &str) -> Result<NodeSpec, RunError> {
        Ok(NodeSpec {
            agent: Some(AgentSection {
                heartbeat_interval_ms: HEARTBEAT_INTERVAL_MS,
                lanes: LANES.iter().map(|(name, credits)| CommandLane { name: (*name).to_owned(), credits: *credits }).collect(),
            }),
            ..Default::default()
        })
    }
}
