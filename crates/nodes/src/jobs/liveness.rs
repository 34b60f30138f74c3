//! `liveness`: moves joined nodes between connected, disconnected, unreachable and lost, every
//! 5 seconds ([`crate::sessions::liveness`] says when each edge is taken).

use std::time::Duration;

use better_compute_runtime::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::sessions::liveness::{evaluate, BATCH};

/// The job's kind: one singleton key, `all`.
pub const LIVENESS: Kind = Kind { name: "liveness", shard_by: ShardBy::None };

const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: Duration::from_secs(5) }];

/// The liveness job.
pub struct LivenessJob;

#[async_trait::async_trait]
impl Reconciler for LivenessJob {
    fn kind(&self) -> Kind {
        LIVENESS
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let r = ctx.in_fenced_tx(async |tx| Ok(evaluate(tx).await?)).await?;
        ctx.count("sessions of lost gateways closed", r.gateway_lost);
        ctx.count("silent sessions closed", r.silent);
        ctx.count("nodes now unreachable", r.unreachable);
        ctx.count("nodes now lost", r.lost);
        let full = [r.gateway_lost, r.silent, r.unreachable, r.lost].iter().any(|n| *n as i64 == BATCH);
        Ok(if full { Outcome::SyncAgain } else { Outcome::Done })
    }

    async fn keys(&self, _ctx: &ReconcileContext, _shards: &[i16]) -> Result<Vec<String>, RunError> {
        Ok(vec!["all".into()])
    }
}
