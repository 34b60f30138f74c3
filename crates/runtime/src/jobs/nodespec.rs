//! `nodespec`: one key per node; merges every module's part of the node's desired state
//! ([`crate::nodespec`]) and stores it when it changed.

use std::sync::Arc;

use better_compute_proto::v1::NodeSpec;

use crate::desired::NODESPEC;
use crate::nodespec::*;
use crate::reconciler::{Kind, Outcome, ReconcileContext, Reconciler, RunError};
use crate::work_queue;

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
        work_queue::notify_many(&c, NODESPEC_CHANNEL, &changed_ids).await;
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
