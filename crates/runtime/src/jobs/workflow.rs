//! `workflow`: one key per workflow; each run advances its workflow by the engine's rules
//! ([`crate::workflow`]). Registered by the registry when some module contributes a definition.

use crate::reconciler::{Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};
use crate::work_queue;

/// The `workflow` job: one key per workflow.
pub const WORKFLOW: Kind = Kind { name: "workflow", shard_by: ShardBy::Key };

/// The `workflow` job: advances one workflow per key. Registered by the registry when some
/// module contributes a definition.
pub struct WorkflowJob;

#[async_trait::async_trait]
impl Reconciler for WorkflowJob {
    fn kind(&self) -> Kind {
        WORKFLOW
    }

    async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError> {
        let mut client = ctx.client().await?;
        let after_commit = work_queue::AfterCommit::default();
        // Every path commits before it returns Ok; an error rolled back, and asks for no poke.
        let outcome = self.advance(ctx, &mut client, key, &after_commit).await?;
        after_commit.send(&**client).await;
        Ok(outcome)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // Every open workflow of these shards: a lost wake-up delays it by one resync at most.
        let client = ctx.read().await?;
        let rows = client.query("SELECT id FROM workflows WHERE ended_at IS NULL AND state <> 'held' ORDER BY id", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|k| shards.contains(&WORKFLOW.shard_of(k))).collect())
    }
}
