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
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let Some(pool) = tx.query_opt("SELECT pool_id FROM nodes WHERE id = $1", &[&node_id]).await? else { return Ok(Outcome::Done) };
        let pool_id: String = pool.get(0);
        let r = reconcile(&tx, ctx.occupants(), &pool_id, Some(node_id)).await?;
        tx.commit().await?;
        ctx.count("findings opened", r.opened);
        ctx.count("findings resolved", r.resolved);
        Ok(Outcome::Done)
    }
}
