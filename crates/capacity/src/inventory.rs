//! The inventory subscriber: a node's or device's change refreshes the node's atom counts and wakes
//! its pool's rollup.

use better_compute_db::DbError;
use better_compute_runtime::outbox::Event;
use better_compute_runtime::{work_queue, RunError, Sink};
use tokio_postgres::Transaction;

use crate::ROLLUP_KIND;

/// Inventory events one delivery handles at most.
pub const INVENTORY_BATCH: i64 = 32;

/// Watches inventory events: refreshes the node's atom counts and wakes its pool's rollup.
pub struct InventoryWatcher;

#[async_trait::async_trait]
impl Sink for InventoryWatcher {
    fn name(&self) -> &str {
        "capacity.inventory"
    }

    /// Each event's node has its count rows locked until commit, and a session opening on one of
    /// them waits for that: short transactions keep a fleet reconnecting at once from queueing
    /// behind one long batch.
    fn batch_limit(&self) -> Option<i64> {
        Some(INVENTORY_BATCH)
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let mut nodes: Vec<String> = Vec::new();
        for e in events {
            let node = match e.event_type.as_str() {
                t if t.starts_with("node.") => Some(e.subject.clone()),
                t if t.starts_with("device.") => e.data.get("nodeId").and_then(|v| v.as_str()).map(String::from),
                _ => None,
            };
            if let Some(n) = node && !nodes.contains(&n) {
                nodes.push(n);
            }
        }
        refresh_nodes(tx, &nodes).await?;
        tell_tenants_of_unhealthy_gpus(tx, events).await?;
        wake_usage(tx, events).await?;
        Ok(())
    }
}

/// A placement wakes its pool's `capacity.usage` key, which then arms itself for each window's
/// end: a pool's first reservation is metered from its first window on, not from the next resync.
async fn wake_usage(tx: &Transaction<'_>, events: &[Event]) -> Result<(), DbError> {
    let placed: Vec<&str> = events.iter().filter(|e| e.event_type == "reservation.placed").map(|e| e.subject.as_str()).collect();
    if placed.is_empty() {
        return Ok(());
    }
    let pools: Vec<String> = tx
        .query("SELECT DISTINCT pool_id FROM reservations WHERE id = ANY($1) ORDER BY 1", &[&placed])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    better_compute_runtime::work_queue::enqueue_many(tx, &crate::USAGE_KIND, &pools).await
}

/// A GPU that left placement for health stays with the reservations that hold it (they are never
/// released for it); each of their tenants is told, with `reservation.deviceUnhealthy`.
async fn tell_tenants_of_unhealthy_gpus(tx: &Transaction<'_>, events: &[Event]) -> Result<(), DbError> {
    for e in events.iter().filter(|e| matches!(e.event_type.as_str(), "device.unhealthy" | "device.suspect")) {
        let state = e.event_type.trim_start_matches("device.");
        let reason = e.data.get("reason").and_then(|v| v.as_str()).unwrap_or("");
        let held = tx
            .query(
                "SELECT DISTINCT r.id, r.tenant_id FROM device_bookings b JOIN devices a ON a.id = b.device_id
                   JOIN reservations r ON r.id = b.allocation_id
                  WHERE (a.id = $1 OR a.parent_id = $1) AND r.state IN ('placed', 'active') ORDER BY r.id",
                &[&e.subject],
            )
            .await?;
        let data = serde_json::json!({"deviceId": e.subject, "state": state, "reason": reason});
        let told: Vec<better_compute_runtime::NewEvent<'_>> = held
            .iter()
            .map(|r| better_compute_runtime::NewEvent { event_type: "reservation.deviceUnhealthy", tenant_id: Some(r.get(1)), subject: r.get(0), data: data.clone() })
            .collect();
        better_compute_runtime::outbox::emit_many(tx, &told).await?;
    }
    Ok(())
}

/// Refreshes the atom counts of `nodes` and wakes their pools' rollups.
pub async fn refresh_nodes(tx: &impl tokio_postgres::GenericClient, nodes: &[String]) -> Result<(), DbError> {
    // In id order (bytes, as the rollup's repair of open flags orders them, in the "C" collation):
    // each refresh locks its node's count rows.
    let mut nodes = nodes.to_vec();
    nodes.sort();
    for n in &nodes {
        tx.execute("SELECT capacity_refresh_node_counts($1)", &[n]).await?;
    }
    let pools: Vec<String> = tx
        .query("SELECT DISTINCT pool_id FROM nodes WHERE id = ANY($1)", &[&nodes])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    work_queue::enqueue_many(tx, &ROLLUP_KIND, &pools).await?;
    Ok(())
}
