//! `inventory`: one key per node, woken by each inventory its daemon reports; compares the
//! report with the node's registration and keeps its findings ([`crate::inventory::findings`]).

use better_compute_runtime::{Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::inventory::findings::reconcile;

/// The per-node job's kind.
pub const INVENTORY_KIND: Kind = Kind { name: "inventory", shard_by: ShardBy::Node };

/// The `inventory` job: a node's inventory report against its registration.
pub struct InventoryJob;

#[async_trait::async_trait]
impl Reconciler for InventoryJob {
    fn kind(&self) -> Kind {
        INVENTORY_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node_id: &str) -> Result<Outcome, RunError> {
        let r = ctx
            .in_fenced_tx(async |tx| {
                let Some(pool) = tx.query_opt("SELECT pool_id FROM nodes WHERE id = $1", &[&node_id]).await? else { return Ok(None) };
                Ok(Some(reconcile(tx, ctx.occupants(), &pool.get::<_, String>(0), Some(node_id)).await?))
            })
            .await?;
        let Some(r) = r else { return Ok(Outcome::Done) };
        ctx.count("findings opened", r.opened);
        ctx.count("findings resolved", r.resolved);
        Ok(Outcome::Done)
    }
}
