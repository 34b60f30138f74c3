//! `command-sweeper`: expires pending commands past `notAfter` and fails in-flight ones past
//! `notAfter` plus their kind's timeout, every 10 seconds.

use std::time::Duration;

use better_compute_runtime::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

/// The sweeper's kind: one singleton key, `all`.
pub const COMMAND_SWEEPER: Kind = Kind { name: "command-sweeper", shard_by: ShardBy::None };
/// Commands settled per run; more makes the run return SyncAgain.
const SWEEP_BATCH: i64 = 500;

/// The sweeper.
pub struct CommandSweeper;

const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: Duration::from_secs(10) }];

#[async_trait::async_trait]
impl Reconciler for CommandSweeper {
    fn kind(&self) -> Kind {
        COMMAND_SWEEPER
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let swept = ctx.in_fenced_tx(async |tx| Ok(crate::commands::sweep(tx, SWEEP_BATCH).await?)).await?;
        ctx.count("expired", swept.expired);
        ctx.count("timed out", swept.timed_out);
        Ok(if swept.expired as i64 == SWEEP_BATCH || swept.timed_out as i64 == SWEEP_BATCH { Outcome::SyncAgain } else { Outcome::Done })
    }
}
