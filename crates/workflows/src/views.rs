//! Reading workflows: a workflow with its steps (and a fleet-wide run's children) as the API shows
//! it, by id, by what is open on a node, and in pages.

use better_compute_core::state::{State, WorkflowState};
use better_compute_core::Error;
use better_compute_db::clock::rfc3339_sql as ts;
use better_compute_db::DbError;
use better_compute_runtime::workflow::Target;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

/// A step as `workflows.get` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepView {
    /// Its name.
    pub name: String,
    /// Its state.
    #[schemars(extend("enum" = ["pending", "running", "retrying", "succeeded", "failed", "skipped", "cancelled"]))]
    pub state: String,
    /// Attempts ever started.
    pub attempts: i32,
    /// Why it failed (a stable code).
    pub reason: Option<String>,
    /// What it waits on, or why it failed.
    pub message: Option<String>,
    /// What it remembered (a command id, the boot id before a reboot, a check's verdict).
    pub memory: serde_json::Value,
    /// RFC 3339.
    pub started_at: Option<String>,
    /// RFC 3339.
    pub ended_at: Option<String>,
    /// When its next attempt starts, while retrying.
    pub retry_at: Option<String>,
}

/// How a fleet-wide run's children stand.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChildCounts {
    /// Children started.
    pub started: i64,
    /// Of them, running or cancelling.
    pub running: i64,
    /// Held.
    pub held: i64,
    /// Succeeded.
    pub succeeded: i64,
    /// Failed.
    pub failed: i64,
    /// Cancelled.
    pub cancelled: i64,
}

/// A workflow as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowView {
    /// `wf_…`.
    pub id: String,
    /// Its definition.
    pub definition: String,
    /// What it runs on.
    pub target: Target,
    /// Its node (one-node workflows).
    pub node_id: Option<String>,
    /// The pool it is authorized at.
    pub pool_id: Option<String>,
    /// Its parameters.
    pub params: serde_json::Value,
    /// The fleet-wide run it belongs to.
    pub parent_id: Option<String>,
    /// Its state.
    #[schemars(extend("enum" = ["running", "held", "cancelling", "succeeded", "failed", "cancelled"]))]
    pub state: String,
    /// The step it is on (absent once every step ended).
    pub current_step: Option<String>,
    /// Why it holds or ended badly (a stable code).
    pub reason: Option<String>,
    /// For operators.
    pub message: Option<String>,
    /// Who started it: `tenant/identity`, or `job:<name>`.
    pub requested_by: String,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339.
    pub updated_at: String,
    /// RFC 3339.
    pub ended_at: Option<String>,
    /// Its steps, in order.
    pub steps: Vec<StepView>,
    /// A fleet-wide run's children.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub children: Option<ChildCounts>,
    /// The record's version.
    pub version: i64,
}


fn workflow_columns() -> String {
    format!(
        "w.id, w.definition, w.target, w.node_id, w.pool_id, w.params, w.parent_id, w.state, w.current_step, w.reason, w.message, w.requested_by, {}, {}, {}, w.version",
        ts("w.created_at"),
        ts("w.updated_at"),
        ts("w.ended_at")
    )
}

async fn views(db: &impl GenericClient, rows: Vec<tokio_postgres::Row>) -> Result<Vec<WorkflowView>, DbError> {
    let ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let steps = db
        .query(
            &format!(
                "SELECT workflow_id, idx, name, state, attempts, reason, message, memory, {}, {}, {} FROM workflow_steps WHERE workflow_id = ANY($1) ORDER BY workflow_id, idx",
                ts("started_at"),
                ts("ended_at"),
                ts("retry_at")
            ),
            &[&ids],
        )
        .await?;
    let children = db
        .query("SELECT parent_id, state, count(*) FROM workflows WHERE parent_id = ANY($1) GROUP BY 1, 2", &[&ids])
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let id: String = r.get(0);
        let mine: Vec<&tokio_postgres::Row> = steps.iter().filter(|s| s.get::<_, &str>(0) == id).collect();
        let current: i32 = r.get(8);
        let node_id: Option<String> = r.get(3);
        let kids: Vec<&tokio_postgres::Row> = children.iter().filter(|c| c.get::<_, &str>(0) == id).collect();
        let child_counts = node_id.is_none().then(|| {
            let mut c = ChildCounts::default();
            for k in kids {
                let n: i64 = k.get(2);
                c.started += n;
                match k.get::<_, &str>(1) {
                    "held" => c.held += n,
                    "succeeded" => c.succeeded += n,
                    "failed" => c.failed += n,
                    "cancelled" => c.cancelled += n,
                    _ => c.running += n,
                }
            }
            c
        });
        out.push(WorkflowView {
            definition: r.get(1),
            target: serde_json::from_value(r.get(2)).unwrap_or_default(),
            node_id,
            pool_id: r.get(4),
            params: r.get(5),
            parent_id: r.get(6),
            state: r.get(7),
            current_step: mine.iter().find(|s| s.get::<_, i32>(1) == current).map(|s| s.get(2)),
            reason: r.get(9),
            message: r.get(10),
            requested_by: r.get(11),
            created_at: r.get(12),
            updated_at: r.get(13),
            ended_at: r.get(14),
            version: r.get(15),
            steps: mine
                .iter()
                .map(|s| StepView {
                    name: s.get(2),
                    state: s.get(3),
                    attempts: s.get(4),
                    reason: s.get(5),
                    message: s.get(6),
                    memory: s.get(7),
                    started_at: s.get(8),
                    ended_at: s.get(9),
                    retry_at: s.get(10),
                })
                .collect(),
            children: child_counts,
            id,
        });
    }
    Ok(out)
}

/// Reads a workflow.
pub async fn get(db: &impl GenericClient, id: &str) -> Result<WorkflowView, DbError> {
    let rows = db.query(&format!("SELECT {} FROM workflows w WHERE w.id = $1", workflow_columns()), &[&id]).await?;
    views(db, rows).await?.pop().ok_or_else(|| Error::not_found("workflow", id).into())
}

/// The open workflow (running, held or cancelling) of `definition` on `node_id` whose params
/// contain `params`, if any: for a job that starts one per thing.
pub async fn open_with(db: &impl GenericClient, definition: &str, node_id: &str, params: &serde_json::Value) -> Result<Option<String>, DbError> {
    let row = db
        .query_opt("SELECT id FROM workflows WHERE node_id = $1 AND definition = $2 AND ended_at IS NULL AND params @> $3 LIMIT 1", &[&node_id, &definition, params])
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// What `workflows.list` filters on (`None`: any).
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this node's workflows.
    pub node_id: Option<String>,
    /// Only workflows authorized at this pool (its nodes' and fleet-wide runs over it).
    pub pool_id: Option<String>,
    /// Only this fleet-wide run's children.
    pub parent_id: Option<String>,
    /// Only these states.
    pub states: Option<Vec<String>>,
    /// Only this definition.
    pub definition: Option<String>,
}

/// Lists workflows in id order (oldest first), a page at a time.
pub async fn list(db: &impl GenericClient, f: &ListFilter, after: &str, size: i64) -> Result<Vec<WorkflowView>, DbError> {
    if let Some(states) = &f.states
        && let Some(bad) = states.iter().find(|s| WorkflowState::parse(s).is_none()) {
            return Err(Error::invalid_argument(format!("unknown workflow state {:?}", better_compute_core::bounds::echo(bad))).into());
        }
    let rows = db
        .query(
            &format!(
                "SELECT {} FROM workflows w
                  WHERE w.id > $1 AND ($2::text IS NULL OR w.node_id = $2) AND ($3::text IS NULL OR w.pool_id = $3)
                    AND ($4::text IS NULL OR w.parent_id = $4) AND ($5::text[] IS NULL OR w.state = ANY($5))
                    AND ($6::text IS NULL OR w.definition = $6)
                  ORDER BY w.id LIMIT $7",
                workflow_columns()
            ),
            &[&after, &f.node_id, &f.pool_id, &f.parent_id, &f.states, &f.definition, &(size + 1)],
        )
        .await?;
    views(db, rows).await
}
