//! The subscriber that wakes a node's running workflows when events are about the node.

use better_compute_runtime::{work_queue, Event, RunError, Sink};
use tokio_postgres::Transaction;

use crate::jobs::workflow::WORKFLOW;

/// Wakes the running workflows of the nodes events are about (a drain ended, a node came back),
/// so a wait notices at once rather than at its next look.
pub struct WorkflowWaker;

#[async_trait::async_trait]
impl Sink for WorkflowWaker {
    fn name(&self) -> &str {
        "workflows.waker"
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let mut nodes: Vec<&str> = events.iter().filter(|e| e.event_type.starts_with("node.") || e.event_type.starts_with("command.")).map(|e| {
            // A command's event is about the command; its node is in the data.
            e.data.get("nodeId").and_then(|v| v.as_str()).unwrap_or(e.subject.as_str())
        }).collect();
        nodes.sort_unstable();
        nodes.dedup();
        if nodes.is_empty() {
            return Ok(());
        }
        let rows = tx.query("SELECT id FROM workflows WHERE node_id = ANY($1) AND state = 'running' ORDER BY id", &[&nodes]).await?;
        let keys: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        work_queue::enqueue_many(tx, &WORKFLOW, &keys).await?;
        Ok(())
    }
}
