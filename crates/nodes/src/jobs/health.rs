//! `health`: one key per node with unprocessed GPU health signals or GPUs under check; moves
//! each GPU through its health states and starts the checks and recoveries ([`crate::health`]).

use std::time::Duration;

use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::commands;
use crate::health::evaluate;

/// The job's kind: one key per node.
pub const HEALTH_KIND: Kind = Kind { name: "health", shard_by: ShardBy::Node };

/// The `health` job.
pub struct HealthJob;

#[async_trait::async_trait]
impl Reconciler for HealthJob {
    fn kind(&self) -> Kind {
        HEALTH_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node_id: &str) -> Result<Outcome, RunError> {
        let kinds = crate::commands::kinds::command_kinds();
        let diag = kinds.iter().find(|k| k.name == "diag.nvml").expect("the nodes module defines diag.nvml");
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let (r, next, more) = evaluate(&tx, ctx.registry(), node_id, diag).await?;
        if let Some(s) = next {
            work_queue::enqueue_after(&*tx, &HEALTH_KIND, node_id, Duration::from_secs_f64(s.max(1.0))).await?;
        }
        tx.commit().await?;
        if r.checks > 0 {
            commands::poke_gateway(&c, node_id).await;
        }
        ctx.count("signals acted on", r.signals);
        ctx.count("GPU health transitions", r.transitions);
        ctx.count("checks started", r.checks);
        ctx.count("checks with a GPU reset", r.resets);
        ctx.count("recoveries started", r.recoveries);
        ctx.count("signals held by an open circuit", r.held);
        ctx.count("circuits opened", u64::from(r.circuit_opened));
        Ok(if more { Outcome::SyncAgain } else { Outcome::Done })
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let c = ctx.read().await?;
        let rows = c
            .query(
                "SELECT DISTINCT n.id, n.shard FROM nodes n
                  WHERE EXISTS (SELECT 1 FROM gpu_health_signals s WHERE s.node_id = n.id AND s.processed_at IS NULL)
                     OR EXISTS (SELECT 1 FROM devices d WHERE d.node_id = n.id AND d.parent_id IS NULL AND d.health_state IN ('suspect', 'recovering'))",
                &[],
            )
            .await?;
        Ok(rows.iter().filter(|r| shards.contains(&r.get::<_, i16>(1))).map(|r| r.get(0)).collect())
    }
}
