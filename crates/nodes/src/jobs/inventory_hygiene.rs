//! `inventory.hygiene`: one key per pool, at every resync (every 5 to 10 minutes); finds what
//! should have happened by now (an expired join token, a certificate near its end, a node that
//! never converged) and keeps the pool's findings ([`crate::inventory::findings`]).

use better_compute_runtime::{Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::inventory::findings::reconcile;

/// The per-pool job's kind.
pub const HYGIENE_KIND: Kind = Kind { name: "inventory.hygiene", shard_by: ShardBy::Pool };

/// The `inventory.hygiene` job: every pool, at every resync (every 5 to 10 minutes).
pub struct HygieneJob;

#[async_trait::async_trait]
impl Reconciler for HygieneJob {
    fn kind(&self) -> Kind {
        HYGIENE_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, pool_id: &str) -> Result<Outcome, RunError> {
        let r = ctx.in_fenced_tx(async |tx| Ok(reconcile(tx, ctx.occupants(), pool_id, None).await?)).await?;
        ctx.count("findings opened", r.opened);
        ctx.count("findings resolved", r.resolved);
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let c = ctx.read().await?;
        let rows = c.query("SELECT id FROM pools ORDER BY id", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|p| shards.contains(&HYGIENE_KIND.shard_of(p))).collect())
    }
}
