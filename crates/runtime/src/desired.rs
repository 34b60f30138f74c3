//! Desired-state invalidation: whatever changes a node's desired state calls [`invalidate`] in the
//! same transaction, which wakes the NodeSpec controller for that node. Nothing is pushed yet.

use better_compute_db::DbError;
use tokio_postgres::GenericClient;

use crate::reconciler::{Kind, ShardBy};

/// The NodeSpec controller's kind: one key per node.
pub const NODESPEC: Kind = Kind { name: "nodespec", shard_by: ShardBy::Node };

/// Enqueues `nodespec` work for `node_id` in the caller's transaction.
pub async fn invalidate(tx: &impl GenericClient, node_id: &str) -> Result<(), DbError> {
    crate::work_queue::enqueue(tx, &NODESPEC, node_id).await
}

/// The same for many nodes in one statement.
pub async fn invalidate_many(tx: &impl GenericClient, node_ids: &[String]) -> Result<(), DbError> {
    crate::work_queue::enqueue_many(tx, &NODESPEC, node_ids).await
}
