//! `node`: one key per node; records the node's conditions in `node_conditions` with an event
//! for each that begins, changes its reason or ends ([`crate::conditions`]). Woken by
//! [`crate::conditions::ConditionWaker`]; its resync visits only the nodes whose record may be
//! behind.

use better_compute_runtime::{Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::conditions::record;

/// The `node` job's kind.
pub const NODE_KIND: Kind = Kind { name: "node", shard_by: ShardBy::Node };

/// Nodes one run of the `node` job records at most (one statement over all of them).
pub const NODE_BATCH: usize = 64;

/// The `node` job.
pub struct NodeJob;

#[async_trait::async_trait]
impl Reconciler for NodeJob {
    fn kind(&self) -> Kind {
        NODE_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node_id: &str) -> Result<Outcome, RunError> {
        self.run_many(ctx, &[node_id.to_owned()]).await.pop().expect("one outcome per key")
    }

    fn batch_size(&self) -> usize {
        NODE_BATCH
    }

    async fn run_many(&self, ctx: &ReconcileContext, keys: &[String]) -> Vec<Result<Outcome, RunError>> {
        let once = async {
            let r = ctx.in_fenced_tx(async |tx| Ok(record(tx, keys).await?)).await?;
            ctx.count("conditions began", r.began);
            ctx.count("conditions changed", r.changed);
            ctx.count("conditions ended", r.ended);
            Ok::<_, RunError>(())
        };
        match once.await {
            Ok(()) => keys.iter().map(|_| Ok(Outcome::Done)).collect(),
            Err(e) => {
                let message = e.to_string();
                keys.iter().map(|_| Err(message.clone().into())).collect()
            }
        }
    }

    /// The nodes whose record may be behind: those with a condition recorded beyond Ready (one
    /// may have ended), and those something holds out of the ordinary (not connected, cordoned or
    /// otherwise unschedulable, a GPU out of placement, a certificate near its end). A healthy
    /// fleet's nodes are none of these, so a resync of 10,000 nodes does not fill the work queue
    /// (that slowed every claim while a fleet converged: `bench gateway`).
    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let c = ctx.read().await?;
        let rows = c
            .query(
                "SELECT n.id FROM nodes n
                  WHERE n.shard = ANY($1)
                    AND (n.liveness <> 'connected' OR cardinality(n.no_schedule_reasons) > 0
                         OR EXISTS (SELECT 1 FROM node_conditions o WHERE o.node_id = n.id AND o.type NOT IN ('Ready', 'Converging'))
                         OR EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.parent_id IS NULL AND (NOT d.healthy OR d.quarantined))
                         OR EXISTS (SELECT 1 FROM node_certificates x WHERE x.node_id = n.id AND x.revoked_at IS NULL
                                       AND x.not_after < compute_now() + interval '7 days'))
                  ORDER BY n.id",
                &[&shards],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
