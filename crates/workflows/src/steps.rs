//! A run's view of a workflow and its steps: the rows it reads under the workflow's lock, the
//! step edges it writes, the step and end events with their audit entries, and what a step sees.

use std::collections::BTreeMap;
use std::time::Duration;

use better_compute_audit::Actor;
use better_compute_core::state::{State, WorkflowState, WorkflowStepState, WORKFLOW_STEP_STATE_TABLE};
use better_compute_db::DbError;
use better_compute_runtime::workflow::{StepContext, Target, WorkflowDefinition};
use better_compute_runtime::{work_queue, Registry, RunError};
use tokio_postgres::Transaction;

use crate::events::emit;
use crate::jobs::workflow::WORKFLOW;

/// A workflow's row as a run reads it.
pub(crate) struct Loaded {
    pub(crate) definition: String,
    pub(crate) target: Target,
    pub(crate) node_id: Option<String>,
    pub(crate) params: serde_json::Value,
    pub(crate) parent_id: Option<String>,
    pub(crate) state: WorkflowState,
    pub(crate) current: usize,
    pub(crate) failure: Option<serde_json::Value>,
}

/// Locks the workflow's row and reads it; `None` when it is gone.
pub(crate) async fn load(tx: &Transaction<'_>, key: &str) -> Result<Option<Loaded>, RunError> {
    let row = tx
        .query_opt(
            "SELECT definition, target, node_id, params, parent_id, state, current_step, failure FROM workflows WHERE id = $1 FOR UPDATE",
            &[&key],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    Ok(Some(Loaded {
        definition: row.get(0),
        target: serde_json::from_value(row.get(1)).map_err(|e| format!("workflow {key}: bad target: {e}"))?,
        node_id: row.get(2),
        params: row.get(3),
        parent_id: row.get(4),
        state: WorkflowState::parse(row.get(5)).expect("a workflow state of the table's CHECK"),
        current: row.get::<_, i32>(6) as usize,
        failure: row.get(7),
    }))
}

/// A step's row.
pub(crate) struct StepRow {
    pub(crate) name: String,
    pub(crate) state: WorkflowStepState,
    pub(crate) attempts: i32,
    pub(crate) attempts_this_run: i32,
    pub(crate) memory: serde_json::Value,
    pub(crate) elapsed_s: f64,
    pub(crate) retry_in_s: Option<f64>,
}

/// The workflow's steps in order.
pub(crate) async fn load_steps(tx: &Transaction<'_>, id: &str) -> Result<Vec<StepRow>, DbError> {
    let rows = tx
        .query(
            "SELECT name, state, attempts, attempts_this_run, memory,
                    coalesce(extract(epoch FROM compute_now() - attempt_started_at)::float8, 0),
                    extract(epoch FROM retry_at - compute_now())::float8
               FROM workflow_steps WHERE workflow_id = $1 ORDER BY idx",
            &[&id],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| StepRow {
            name: r.get(0),
            state: WorkflowStepState::parse(r.get(1)).expect("a step state of the table's CHECK"),
            attempts: r.get(2),
            attempts_this_run: r.get(3),
            memory: r.get(4),
            elapsed_s: r.get(5),
            retry_in_s: r.get(6),
        })
        .collect())
}

/// Seconds as a queue delay, within a year.
pub(crate) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 365.0 * 24.0 * 3600.0))
}

#[allow(clippy::too_many_arguments)] // every field a step sees
/// What a step sees of its run.
pub(crate) fn context<'a>(
    tx: &'a Transaction<'a>,
    registry: &'a Registry,
    key: &'a str,
    def: &'a dyn WorkflowDefinition,
    node_id: &'a str,
    w: &'a Loaded,
    memory: &'a serde_json::Value,
    earlier: &'a BTreeMap<String, serde_json::Value>,
    command_key: &'a str,
    attempt_elapsed_s: f64,
    shard: i16,
    after_commit: &'a work_queue::AfterCommit,
) -> StepContext<'a> {
    StepContext {
        tx,
        registry,
        workflow_id: key,
        definition: def,
        node_id,
        target: &w.target,
        params: &w.params,
        memory,
        earlier,
        command_key,
        attempt_elapsed_s,
        owner: (WORKFLOW.name, key, shard),
        after_commit,
    }
}

/// Moves a step along an edge of its state table, under the workflow's lock.
pub(crate) async fn move_step(tx: &Transaction<'_>, id: &str, idx: usize, s: &StepRow, to: WorkflowStepState, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    WORKFLOW_STEP_STATE_TABLE.check(s.state, to)?;
    let n = tx
        .execute(
            "UPDATE workflow_steps SET state = $4, reason = coalesce($5, reason), message = coalesce($6, message), retry_at = NULL, ended_at = compute_now()
              WHERE workflow_id = $1 AND idx = $2 AND state = $3",
            &[&id, &(idx as i32), &s.state.as_str(), &to.as_str(), &reason, &message],
        )
        .await?;
    assert_eq!(n, 1, "step {idx} of workflow {id} was read in state {} under the workflow's lock", s.state.as_str());
    Ok(())
}

#[allow(clippy::too_many_arguments)] // the event's fields, each its own
pub(crate) async fn step_event(tx: &Transaction<'_>, id: &str, w: &Loaded, step: &str, state: &str, attempt: i32, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    // A step's end is the workflow's decision, recorded as the job's.
    let action = match state {
        "succeeded" => Some("workflows.stepSucceeded"),
        "failed" => Some("workflows.stepFailed"),
        _ => None,
    };
    if let Some(action) = action {
        let target = format!("{id}/{step}");
        Actor::job(WORKFLOW.name).record(tx, action, &target, None).await?;
    }
    emit(
        tx,
        "workflow.stepChanged",
        id,
        serde_json::json!({"definition": w.definition, "nodeId": w.node_id, "step": step, "state": state, "attempt": attempt, "reason": reason, "message": message}),
    )
    .await?;
    Ok(())
}

/// A child's end or hold wakes its fleet-wide run.
pub(crate) async fn wake_parent(tx: &Transaction<'_>, w: &Loaded) -> Result<(), DbError> {
    match &w.parent_id {
        Some(p) => work_queue::enqueue(tx, &WORKFLOW, p).await,
        None => Ok(()),
    }
}

/// The workflow ended: its audit entry, its event, and its fleet-wide run woken.
pub(crate) async fn ended(tx: &Transaction<'_>, id: &str, w: &Loaded, state: &str, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    let action = match state {
        "succeeded" => "workflows.succeeded",
        "cancelled" => "workflows.cancelled",
        _ => "workflows.failed",
    };
    Actor::job(WORKFLOW.name).record(tx, action, id, None).await?;
    emit(
        tx,
        "workflow.ended",
        id,
        serde_json::json!({"definition": w.definition, "nodeId": w.node_id, "parentId": w.parent_id, "state": state, "reason": reason, "message": message}),
    )
    .await?;
    wake_parent(tx, w).await
}
