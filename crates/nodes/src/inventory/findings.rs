//! Keeping the inventory honest: the `inventory` job (`jobs/inventory.rs`, one key per node, woken
//! by each inventory a daemon reports) and the `inventory.hygiene` job (`jobs/inventory_hygiene.rs`,
//! one key per pool, every resync) compare what is registered with what daemons report and
//! with what should have happened by now, and keep one open finding per thing wrong, with an event
//! when it opens and when it resolves:
//!
//! - `gpu-missing`: a registered GPU its daemon no longer reports (flagged, never deleted: a
//!   reservation may hold it);
//! - `gpu-unknown`, `gpu-changed`, `resources-changed`, `duplicate-gpu`: the daemon reports a GPU
//!   not registered, another model, less CPU, memory or disk, or a uuid another node reports too;
//! - `held-retired-node`: a retired node that reservations still hold;
//! - `join-token-expired`, `certificate-expiring` (within 7 days: rotation is failing),
//!   `never-converged` (joined 10 minutes ago and never applied its desired state).
//!
//! What is wrong is computed in one SQL function, `nodes_inventory_findings` (`sql/findings.sql`);
//! `inventory.findings` lists the open findings, and each node shows its count as a condition.

use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use better_compute_db::clock::rfc3339_sql as ts;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use serde::Serialize;
use tokio_postgres::{GenericClient, Transaction};

/// The kinds a node's own inventory report can change (what the `inventory` job reconciles).
const NODE_KINDS: &[&str] = &["gpu-missing", "gpu-unknown", "gpu-changed", "resources-changed"];

/// What one pass opened and resolved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FindingsReport {
    /// Findings seen for the first time.
    pub opened: u64,
    /// Findings no longer seen.
    pub resolved: u64,
    /// Findings still open.
    pub open: u64,
}

/// Reconciles the open findings of `pool_id` (or of one node of it, the kinds its inventory report
/// changes) with what is wrong now.
pub async fn reconcile(tx: &Transaction<'_>, occupants: &[std::sync::Arc<dyn better_compute_runtime::occupancy::NodeOccupant>], pool_id: &str, node_id: Option<&str>) -> Result<FindingsReport, DbError> {
    let mut now: Vec<(String, Option<String>, String, String)> = tx
        .query("SELECT kind, node_id, item, message FROM nodes_inventory_findings($1, $2)", &[&pool_id, &node_id])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    if node_id.is_none() {
        // Retired nodes that something still holds.
        let retired: Vec<String> = tx
            .query("SELECT id FROM nodes WHERE pool_id = $1 AND retired_at IS NOT NULL ORDER BY id", &[&pool_id])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for n in retired {
            let mut holding = 0;
            for o in occupants {
                holding += o.occupancy(tx, &n).await?.holding;
            }
            if holding > 0 {
                now.push(("held-retired-node".into(), Some(n), String::new(), format!("the node is retired but {holding} reservation(s) still hold it")));
            }
        }
    }
    let mut report = FindingsReport::default();
    for (kind, node, item, message) in &now {
        let opened: bool = tx
            .query_one(
                "INSERT INTO inventory_findings (pool_id, node_id, item, kind, message) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (pool_id, kind, coalesce(node_id, ''), item) WHERE resolved_at IS NULL
                 DO UPDATE SET last_seen_at = compute_now(), message = EXCLUDED.message
                 RETURNING xmax = 0",
                &[&pool_id, node, item, kind, message],
            )
            .await?
            .get(0);
        if opened {
            let subject = node.as_deref().unwrap_or(pool_id);
            let data = serde_json::json!({"kind": kind, "poolId": pool_id, "nodeId": node, "item": item, "message": message});
            outbox::emit(tx, NewEvent { event_type: "inventory.finding", tenant_id: None, subject, data }).await?;
            report.opened += 1;
        }
    }
    report.open = now.len() as u64;
    // What is no longer seen is resolved, within this pass's scope.
    let kinds: Vec<&str> = match node_id {
        Some(_) => NODE_KINDS.to_vec(),
        None => vec![],
    };
    let seen_keys: Vec<String> = now.iter().map(|(k, n, i, _)| format!("{k}\u{1f}{}\u{1f}{i}", n.as_deref().unwrap_or(""))).collect();
    let resolved = tx
        .query(
            "UPDATE inventory_findings SET resolved_at = compute_now()
              WHERE pool_id = $1 AND resolved_at IS NULL AND ($2::text IS NULL OR node_id = $2)
                AND (cardinality($3::text[]) = 0 OR kind = ANY($3))
                AND NOT (kind || chr(31) || coalesce(node_id, '') || chr(31) || item = ANY($4))
              RETURNING kind, node_id, item, message",
            &[&pool_id, &node_id, &kinds, &seen_keys],
        )
        .await?;
    for r in &resolved {
        let (kind, node, item, message): (String, Option<String>, String, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
        let subject = node.clone().unwrap_or_else(|| pool_id.to_owned());
        let data = serde_json::json!({"kind": kind, "poolId": pool_id, "nodeId": node, "item": item, "message": message});
        outbox::emit(tx, NewEvent { event_type: "inventory.findingResolved", tenant_id: None, subject: &subject, data }).await?;
    }
    report.resolved = resolved.len() as u64;
    Ok(report)
}

/// An open or resolved finding.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FindingView {
    /// Its number.
    pub id: String,
    /// `gpu-missing`, `gpu-unknown`, `gpu-changed`, `resources-changed`, `duplicate-gpu`,
    /// `held-retired-node`, `join-token-expired`, `certificate-expiring` or `never-converged`.
    pub kind: String,
    /// Its pool.
    pub pool_id: String,
    /// Its node, if it is about one.
    pub node_id: Option<String>,
    /// What below the node: a GPU uuid, a join token, a certificate serial.
    pub item: String,
    /// What is wrong, and what to do.
    pub message: String,
    /// RFC 3339.
    pub first_seen_at: String,
    /// RFC 3339: the last pass that saw it.
    pub last_seen_at: String,
    /// RFC 3339, once no pass sees it any more.
    pub resolved_at: Option<String>,
}

/// The findings of a pool or of a node (open ones only unless `include_resolved`), a page at a
/// time, oldest first.
pub async fn list(db: &impl GenericClient, pool_id: Option<&str>, node_id: Option<&str>, include_resolved: bool, page: &PageRequest) -> Result<Page<FindingView>, Error> {
    let select = format!(
        "SELECT * FROM (SELECT lpad(id::text, 20, '0') AS id, kind, pool_id, node_id, item, message, {} AS first_seen, {} AS last_seen,
                               {} AS resolved, resolved_at FROM inventory_findings) f",
        ts("first_seen_at"),
        ts("last_seen_at"),
        ts("resolved_at")
    );
    let filter = "($1::text IS NULL OR f.pool_id = $1) AND ($2::text IS NULL OR f.node_id = $2) AND ($3 OR f.resolved_at IS NULL)";
    read_page(
        db,
        &select,
        filter,
        &[&pool_id, &node_id, &include_resolved],
        page,
        |r| FindingView {
            id: r.get::<_, String>(0).trim_start_matches('0').to_owned(),
            kind: r.get(1),
            pool_id: r.get(2),
            node_id: r.get(3),
            item: r.get(4),
            message: r.get(5),
            first_seen_at: r.get(6),
            last_seen_at: r.get(7),
            resolved_at: r.get(8),
        },
        |f: &FindingView| format!("{:0>20}", f.id),
    )
    .await
}
