//! `audit.checkpoint`: a singleton job, run every [`EVERY`]; places new entries in the log, signs
//! a checkpoint of it, then prunes what is past the retention ([`crate::checkpoint`]).

use better_compute_runtime::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::checkpoint::*;

/// The job's kind: one singleton key, `all`.
pub const CHECKPOINT_KIND: Kind = Kind { name: "audit.checkpoint", shard_by: ShardBy::None };

const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: EVERY }];

/// `audit.checkpoint`.
pub struct CheckpointJob;

#[async_trait::async_trait]
impl Reconciler for CheckpointJob {
    fn kind(&self) -> Kind {
        CHECKPOINT_KIND
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let signer = ctx.registry().command_signer();
        let (placed, pruned) = ctx.in_fenced_tx(async |tx| Ok((place(tx, BATCH, signer).await?, crate::prune::prune(tx).await?))).await?;
        ctx.count("entries placed", placed.entries as u64);
        ctx.count("entries pruned", pruned);
        ctx.count("checkpoints", u64::from(placed.entries > 0));
        Ok(if placed.entries as i64 == BATCH { Outcome::SyncAgain } else { Outcome::Done })
    }
}
