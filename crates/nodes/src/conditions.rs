//! A node's conditions, as `nodes.get` and `nodes.list` show them: each that holds (Ready,
//! Converging, Disconnected, Unreachable, Lost, Cordoned, Draining, Unhealthy, HealthCircuitOpen,
//! QuarantinedGpus, InventoryFindings, SiteBooting, CertificateExpiring, Retired) with a stable
//! reason, a message and since when. They are computed in one place, `nodes_conditions`
//! (`sql/conditions.sql`), from the rows that own them, so what the API shows can never disagree
//! with those rows; `noScheduleReasons` beside them says why the placer skips the node.
//!
//! The `node` job (`jobs/node.rs`, one key per node) records them in `node_conditions`: since when each has held
//! with its reason, where the owning rows do not say (a cordon, a quarantine), and an event
//! `node.conditionChanged` for each that begins, changes its reason or ends. It is woken by the
//! events about a node (but `node.connected` and `node.disconnected`: a reconnect wave would wake
//! every node at once, and liveness has its since in the rows and its own events), its GPUs, its
//! pool's health circuit or its site's boot ([`ConditionWaker`]), and resyncs every node besides.

use better_compute_runtime::outbox::{self, Event, NewEvent};
use better_compute_runtime::{work_queue, RunError, Sink};

use crate::jobs::node::NODE_KIND;
use serde::Serialize;
use tokio_postgres::{GenericClient, Transaction};

/// One condition of a node.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Draining`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// A stable word: `Converged`, `WaitingForBudget`, `Evicting`, …
    pub reason: String,
    /// For people.
    pub message: String,
    /// RFC 3339: since when this reason holds (none only before the `node` job first saw it).
    pub since: Option<String>,
}

/// Conditions that follow every desired-state change (a new generation makes a node Converging,
/// then Ready again): recorded, but not announced, so a busy fleet does not flood the event stream.
const QUIET: &[&str] = &["Ready", "Converging"];

/// What one pass of the `node` job changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConditionsReport {
    /// Conditions that began to hold.
    pub began: u64,
    /// Conditions whose reason changed.
    pub changed: u64,
    /// Conditions that no longer hold.
    pub ended: u64,
}

/// Records the conditions of `nodes` (see the module's doc) and emits `node.conditionChanged` for
/// each that began, changed its reason or ended.
pub async fn record(tx: &impl GenericClient, nodes: &[String]) -> Result<ConditionsReport, better_compute_db::DbError> {
    let rows = tx.query("SELECT node_id, type, reason, message, change FROM nodes_conditions_record($1)", &[&nodes]).await?;
    let mut report = ConditionsReport::default();
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        let (node_id, kind, reason, message, change): (&str, &str, &str, &str, &str) = (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        match change {
            "began" => report.began += 1,
            "changed" => report.changed += 1,
            "ended" => report.ended += 1,
            other => unreachable!("nodes_conditions_record returns began, changed or ended, not {other}"),
        }
        if !QUIET.contains(&kind) {
            let data = serde_json::json!({"type": kind, "reason": reason, "message": message, "holds": change != "ended"});
            events.push(NewEvent { event_type: "node.conditionChanged", tenant_id: None, subject: node_id, data });
        }
    }
    outbox::emit_many(tx, &events).await?;
    Ok(report)
}

/// Wakes the `node` job for every node an event is about: a node's own events (but its sessions'
/// coming and going), its GPUs', its findings', and every node of a pool whose health circuit or
/// of a site whose boot changed.
pub struct ConditionWaker;

/// Events one delivery handles at most: a site's event wakes every node of it.
pub const WAKER_BATCH: i64 = 256;

#[async_trait::async_trait]
impl Sink for ConditionWaker {
    fn name(&self) -> &str {
        "nodes.conditions"
    }

    fn batch_limit(&self) -> Option<i64> {
        Some(WAKER_BATCH)
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let (mut nodes, mut pools, mut sites) = (Vec::new(), Vec::new(), Vec::new());
        for e in events {
            let t = e.event_type.as_str();
            let node_of_data = || e.data.get("nodeId").and_then(|v| v.as_str()).map(String::from);
            match t {
                // Its own, and the liveness churn of a reconnect wave: a session's coming and
                // going has its since in the rows and its own events, and waking 10,000 keys for
                // it slowed every session open (`bench gateway`); the resync records it.
                "node.conditionChanged" | "node.connected" | "node.disconnected" | "node.labelsChanged" => {}
                _ if t.starts_with("node.") => nodes.push(e.subject.clone()),
                _ if t.starts_with("device.") || t.starts_with("inventory.") => nodes.extend(node_of_data()),
                _ if t.starts_with("health.circuit") => pools.push(e.subject.clone()),
                _ if t.starts_with("site.") => sites.push(e.subject.clone()),
                _ => {}
            }
        }
        if !pools.is_empty() || !sites.is_empty() {
            let rows = tx
                .query(
                    "SELECT n.id FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.pool_id = ANY($1) OR p.site_id = ANY($2)",
                    &[&pools, &sites],
                )
                .await?;
            nodes.extend(rows.iter().map(|r| r.get::<_, String>(0)));
        }
        nodes.sort();
        nodes.dedup();
        work_queue::enqueue_many(tx, &NODE_KIND, &nodes).await?;
        Ok(())
    }
}
