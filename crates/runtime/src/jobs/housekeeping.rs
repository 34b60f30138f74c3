//! `housekeeping`: a singleton job, every minute, that deletes expired idempotency keys and the
//! rows of workers dead for long, in bounded batches.

use std::time::Duration;

use crate::reconciler::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

/// Its kind: one key, `all`.
pub const HOUSEKEEPING: Kind = Kind { name: "housekeeping", shard_by: ShardBy::None };
const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: Duration::from_secs(60) }];
/// Keys deleted per run; more makes the run return SyncAgain.
const BATCH: i64 = 5_000;

/// The job.
pub struct Housekeeping;

#[async_trait::async_trait]
impl Reconciler for Housekeeping {
    fn kind(&self) -> Kind {
        HOUSEKEEPING
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let keys = ctx
            .in_fenced_tx(async |tx| {
                let keys = better_compute_db::idempotency::prune_expired(tx, BATCH).await?;
                better_compute_db::workers::prune_dead(tx).await?;
                Ok(keys)
            })
            .await?;
        Ok(if keys as i64 == BATCH { Outcome::SyncAgain } else { Outcome::Done })
    }
}
