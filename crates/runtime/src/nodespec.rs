//! The NodeSpec controller: merges every module's part of a node's desired state in registration
//! order, stores it in `nodes.spec` as the proto3 JSON of `NodeSpec`, and moves `nodes.generation`
//! only when that JSON changes. `nodes` is the one table of another module the runtime touches: the
//! spec says desired state lives there.

use std::sync::Arc;

use better_compute_proto::v1::{NodeSpec, SiteSection};
use tokio_postgres::Transaction;

use crate::desired::NODESPEC;
use crate::reconciler::{Kind, Outcome, ReconcileContext, Reconciler, RunError};
use crate::work_queue;

/// The channel a gateway listens on for "this node's desired state changed"; the payload is the
/// node id. Sent after commit; gateways also poll.
pub const NODESPEC_CHANNEL: &str = "better_compute_nodespec";

/// A module's contribution to a node's desired state: the sections (or, for `site`, the fields)
/// it owns.
#[async_trait::async_trait]
pub trait NodeSpecPart: Send + Sync + 'static {
    /// A name for errors and logs.
    fn name(&self) -> &'static str;

    /// This part of each of `node_ids`' desired state, in `node_ids`' order, read inside the
    /// controller's transaction (set-based: one statement for the whole batch).
    async fn node_specs(&self, tx: &Transaction<'_>, node_ids: &[String]) -> Result<Vec<NodeSpec>, RunError>;
}

fn merge_site(into: &mut SiteSection, from: SiteSection) {
    for (to, value) in [
        (&mut into.site_id, from.site_id),
        (&mut into.site_name, from.site_name),
        (&mut into.pool_id, from.pool_id),
        (&mut into.pool_name, from.pool_name),
        (&mut into.node_name, from.node_name),
    ] {
        if !value.is_empty() {
            *to = value;
        }
    }
    into.labels.extend(from.labels);
}

/// Merges parts in registration order: `site` field by field (a later part's non-empty field wins,
/// labels key by key); every other section whole, from the last part that sets it.
pub fn merge(parts: impl IntoIterator<Item = NodeSpec>) -> NodeSpec {
    let mut spec = NodeSpec::default();
    for p in parts {
        if let Some(site) = p.site {
            merge_site(spec.site.get_or_insert_with(SiteSection::default), site);
        }
        if p.agent.is_some() {
            spec.agent = p.agent;
        }
        if p.gpus.is_some() {
            spec.gpus = p.gpus;
        }
        if p.allocations.is_some() {
            spec.allocations = p.allocations;
        }
        if p.instances.is_some() {
            spec.instances = p.instances;
        }
    }
    spec
}

/// Nodes of one shard the controller recomputes in one transaction.
pub const NODESPEC_BATCH: usize = 64;

/// The `nodespec` reconciler; the registry adds it with the parts of every module. It recomputes
/// up to [`NODESPEC_BATCH`] nodes of a shard in one fenced transaction: one locking read, one
/// statement per part, one write of the specs that changed; the wake-ups follow the commit.
pub struct NodeSpecController {
    pub(crate) parts: Vec<Arc<dyn NodeSpecPart>>,
}

/// What one recomputation did.
#[derive(Debug, Default, PartialEq, Eq)]
struct Recomputed {
    changed: u64,
    unchanged: u64,
}

impl NodeSpecController {
    async fn recompute(&self, ctx: &ReconcileContext, keys: &[String]) -> Result<Recomputed, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        // Lock order: nodes, in id order. The node rows FOR UPDATE: one computation per node at a
        // time. Nodes not adopted (generation 0) have no desired state yet.
        let rows = tx
            .query("SELECT id, generation, spec FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE", &[&keys])
            .await?;
        let adopted: Vec<(String, Option<serde_json::Value>)> =
            rows.iter().filter(|r| r.get::<_, i64>(1) > 0).map(|r| (r.get(0), r.get(2))).collect();
        let ids: Vec<String> = adopted.iter().map(|(id, _)| id.clone()).collect();
        let mut merged: Vec<Vec<NodeSpec>> = ids.iter().map(|_| Vec::with_capacity(self.parts.len())).collect();
        for p in &self.parts {
            let specs = p.node_specs(&tx, &ids).await.map_err(|e| format!("part {}: {e}", p.name()))?;
            if specs.len() != ids.len() {
                return Err(format!("part {} answered {} specs for {} nodes", p.name(), specs.len(), ids.len()).into());
            }
            for (m, s) in merged.iter_mut().zip(specs) {
                m.push(s);
            }
        }
        let mut changed_ids = Vec::new();
        let mut changed_specs = Vec::new();
        for ((id, stored), parts) in adopted.into_iter().zip(merged) {
            let spec = serde_json::to_value(merge(parts))?;
            if stored.as_ref() != Some(&spec) {
                changed_ids.push(id);
                changed_specs.push(spec);
            }
        }
        let done = Recomputed { changed: changed_ids.len() as u64, unchanged: (ids.len() - changed_ids.len()) as u64 };
        if !changed_ids.is_empty() {
            // The first spec stored is generation 1 (written by adoption); each change after moves it by one.
            tx.execute(
                "UPDATE nodes n SET spec = u.spec, version = n.version + 1,
                        generation = CASE WHEN n.spec IS NULL THEN n.generation ELSE n.generation + 1 END
                   FROM unnest($1::text[], $2::jsonb[]) AS u(id, spec)
                  WHERE n.id = u.id",
                &[&changed_ids, &changed_specs],
            )
            .await?;
        }
        tx.commit().await?;
        // After the commit, so a gateway never reads a spec older than its wake-up.
        work_queue::notify_many(&**c, NODESPEC_CHANNEL, &changed_ids).await;
        ctx.count("changed", done.changed);
        ctx.count("unchanged", done.unchanged);
        Ok(done)
    }
}

#[async_trait::async_trait]
impl Reconciler for NodeSpecController {
    fn kind(&self) -> Kind {
        NODESPEC
    }

    fn batch_size(&self) -> usize {
        NODESPEC_BATCH
    }

    async fn run(&self, ctx: &ReconcileContext, node_id: &str) -> Result<Outcome, RunError> {
        self.recompute(ctx, &[node_id.to_owned()]).await.map(|_| Outcome::Done)
    }

    async fn run_many(&self, ctx: &ReconcileContext, keys: &[String]) -> Vec<Result<Outcome, RunError>> {
        match self.recompute(ctx, keys).await {
            Ok(_) => keys.iter().map(|_| Ok(Outcome::Done)).collect(),
            // One node's failing part must not hold its batch-mates back: each runs alone, and
            // only the failing ones keep the error.
            Err(_) => {
                let mut out = Vec::with_capacity(keys.len());
                for k in keys {
                    out.push(self.run(ctx, k).await);
                }
                out
            }
        }
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let mut c = ctx.client().await?;
        // In a transaction, as every statement of the runtime: safe behind PgBouncer.
        let tx = c.transaction().await?;
        let rows = tx.query("SELECT id FROM nodes WHERE generation > 0 AND shard = ANY($1)", &[&shards]).await?;
        tx.commit().await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use better_compute_proto::v1::{AgentSection, GpusSection};

    fn site(f: impl FnOnce(&mut SiteSection)) -> NodeSpec {
        let mut s = SiteSection::default();
        f(&mut s);
        NodeSpec { site: Some(s), ..Default::default() }
    }

    #[test]
    fn site_merges_field_by_field_in_registration_order_and_other_sections_whole() {
        let a = site(|s| {
            s.site_id = "site_a".into();
            s.node_name = "n1".into();
            s.labels.insert("rack".into(), "r1".into());
            s.labels.insert("zone".into(), "z1".into());
        });
        let b = site(|s| {
            s.pool_id = "pool_b".into();
            s.node_name = "n1-renamed".into();
            s.labels.insert("zone".into(), "z2".into());
        });
        let gpus = NodeSpec { gpus: Some(GpusSection::default()), agent: Some(AgentSection { heartbeat_interval_ms: 5, lanes: vec![], command_keys: vec![] }), ..Default::default() };
        let merged = merge([a, b, gpus]);
        let s = merged.site.unwrap();
        assert_eq!((s.site_id.as_str(), s.pool_id.as_str(), s.node_name.as_str()), ("site_a", "pool_b", "n1-renamed"));
        assert_eq!(s.labels.get("rack").map(String::as_str), Some("r1"));
        assert_eq!(s.labels.get("zone").map(String::as_str), Some("z2"));
        assert_eq!(merged.agent.unwrap().heartbeat_interval_ms, 5);
    }

    #[test]
    fn the_stored_json_is_proto3_json_and_omits_defaults() {
        let spec = merge([site(|s| s.site_id = "site_a".into())]);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json, serde_json::json!({"site": {"siteId": "site_a"}}));
        let back: NodeSpec = serde_json::from_value(json).unwrap();
        assert_eq!(back, spec);
    }
}
