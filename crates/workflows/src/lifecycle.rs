//! Starting, cancelling and resuming workflows, in the caller's transaction: the rows, their
//! events and the workflow's key in the `workflow` job.

use better_compute_core::id::WorkflowId;
use better_compute_core::state::{State, WorkflowState, WorkflowStepState, WORKFLOW_STATE_TABLE, WORKFLOW_STEP_STATE_TABLE};
use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use better_compute_runtime::workflow::{Target, WorkflowDefinition};
use better_compute_runtime::{work_queue, Registry};
use tokio_postgres::Transaction;

use crate::events::emit;
use crate::fleet::FLEET_STEP;
use crate::jobs::workflow::WORKFLOW;
use crate::views::{get, WorkflowView};
use crate::MAX_PARALLEL;

/// A workflow to start.
#[derive(Debug, Clone)]
pub struct NewWorkflow<'a> {
    /// A registered definition.
    pub definition: &'a str,
    /// What it runs on.
    pub target: &'a Target,
    /// Its parameters (an object; `parallel` for fleet-wide runs).
    pub params: &'a serde_json::Value,
    /// Who asked: `tenant/identity`, or `job:<name>`.
    pub requested_by: &'a str,
}

/// Starts a workflow in the caller's transaction: its row, its steps (pending) and its key.
pub async fn start(tx: &Transaction<'_>, registry: &Registry, w: &NewWorkflow<'_>) -> Result<WorkflowView, DbError> {
    let def = registry
        .workflow(w.definition)
        .ok_or_else(|| Error::new(ErrorCode::Unsupported, format!("unknown workflow definition {:?}", better_compute_core::bounds::echo(w.definition))))?;
    w.target.check()?;
    if !w.params.is_object() {
        return Err(Error::invalid_argument("params must be an object").into());
    }
    let mut params = w.params.clone();
    let parallel = params.as_object_mut().and_then(|o| o.remove("parallel"));
    if let Some(p) = &parallel {
        if !w.target.is_fleet() {
            return Err(Error::invalid_argument("params.parallel is for fleet-wide runs (target poolId or labels)").into());
        }
        if !p.as_i64().is_some_and(|n| (1..=MAX_PARALLEL).contains(&n)) {
            return Err(Error::invalid_argument(format!("params.parallel must be between 1 and {MAX_PARALLEL}")).into());
        }
    }
    def.check_params(&params)?;
    let pool_id = match (&w.target.node_id, &w.target.pool_id) {
        (Some(n), _) => Some(def.node_pool(tx, n).await?),
        (None, p) => p.clone(),
    };
    def.check_target(tx, w.target, &params).await?;
    let id = WorkflowId::generate().to_string();
    insert(tx, &id, def.as_ref(), w, pool_id.as_deref(), None, w.params).await?;
    get(tx, &id).await
}

pub(crate) async fn insert(
    tx: &Transaction<'_>,
    id: &str,
    def: &dyn WorkflowDefinition,
    w: &NewWorkflow<'_>,
    pool_id: Option<&str>,
    parent_id: Option<&str>,
    params: &serde_json::Value,
) -> Result<(), DbError> {
    let target = serde_json::to_value(w.target).expect("a target serializes");
    tx.execute(
        "INSERT INTO workflows (id, definition, target, node_id, pool_id, params, parent_id, state, requested_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'running', $8)",
        &[&id, &def.name(), &target, &w.target.node_id, &pool_id, params, &parent_id, &w.requested_by],
    )
    .await?;
    let names: Vec<&str> = if w.target.is_fleet() { vec![FLEET_STEP] } else { def.steps().iter().map(|s| s.name).collect() };
    let idx: Vec<i32> = (0..names.len() as i32).collect();
    tx.execute(
        "INSERT INTO workflow_steps (workflow_id, idx, name, state) SELECT $1, i, n, 'pending' FROM unnest($2::int[], $3::text[]) AS s(i, n)",
        &[&id, &idx, &names],
    )
    .await?;
    emit(
        tx,
        "workflow.started",
        id,
        serde_json::json!({"definition": def.name(), "target": w.target, "parentId": parent_id, "requestedBy": w.requested_by}),
    )
    .await?;
    work_queue::enqueue(tx, &WORKFLOW, id).await
}

pub(crate) async fn lock(tx: &Transaction<'_>, id: &str) -> Result<WorkflowState, DbError> {
    let row = tx.query_opt("SELECT state FROM workflows WHERE id = $1 FOR UPDATE", &[&id]).await?.ok_or_else(|| Error::not_found("workflow", id))?;
    Ok(WorkflowState::parse(row.get(0)).expect("a workflow state of the table's CHECK"))
}

pub(crate) async fn move_workflow(tx: &Transaction<'_>, id: &str, from: WorkflowState, to: WorkflowState, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    WORKFLOW_STATE_TABLE.check(from, to)?;
    let n = tx
        .execute(
            "UPDATE workflows SET state = $3, reason = $4, message = $5, updated_at = compute_now(), version = version + 1,
                    ended_at = CASE WHEN $3 IN ('succeeded', 'failed', 'cancelled') THEN compute_now() END
              WHERE id = $1 AND state = $2",
            &[&id, &from.as_str(), &to.as_str(), &reason, &message],
        )
        .await?;
    assert_eq!(n, 1, "workflow {id} was locked in state {} by its caller", from.as_str());
    Ok(())
}

/// `workflows.cancel`: a running or held workflow becomes `cancelling`; its job cancels the
/// current step's command through the command queue and ends it (and a fleet-wide run's
/// children). What the steps already did stays done: a drained node stays drained. Cancelling an
/// ended workflow is `FAILED_PRECONDITION`; cancelling twice returns it unchanged.
pub async fn cancel(tx: &Transaction<'_>, id: &str, requested_by: &str) -> Result<WorkflowView, DbError> {
    let state = lock(tx, id).await?;
    if state != WorkflowState::Cancelling {
        move_workflow(tx, id, state, WorkflowState::Cancelling, Some("CANCELLED"), Some(&format!("cancelled by {requested_by}"))).await?;
        emit(tx, "workflow.cancelRequested", id, serde_json::json!({"requestedBy": requested_by})).await?;
        work_queue::enqueue(tx, &WORKFLOW, id).await?;
    }
    get(tx, id).await
}

/// `workflows.resume`: a held workflow runs again from its current step (a new attempt), or from
/// `from_step` (an earlier step to repeat, or a later one to skip to; the steps between are
/// skipped). A fleet-wide run goes on with the next nodes.
pub async fn resume(tx: &Transaction<'_>, registry: &Registry, id: &str, from_step: Option<&str>, requested_by: &str) -> Result<WorkflowView, DbError> {
    let state = lock(tx, id).await?;
    if state != WorkflowState::Held {
        return Err(Error::failed_precondition(format!("workflow {id} is {}; only a held workflow resumes", state.as_str())).into());
    }
    let row = tx.query_one("SELECT definition, current_step, node_id IS NULL FROM workflows WHERE id = $1", &[&id]).await?;
    let (def_name, current, fleet): (String, i32, bool) = (row.get(0), row.get(1), row.get(2));
    let names: Vec<String> = if fleet {
        vec![FLEET_STEP.to_owned()]
    } else {
        registry.workflow(&def_name).ok_or_else(|| Error::internal(format!("definition {def_name} is not registered")))?.steps().iter().map(|s| s.name.to_owned()).collect()
    };
    let to = match from_step {
        None => current,
        Some(n) => names.iter().position(|s| s == n).ok_or_else(|| {
            Error::invalid_argument(format!("{def_name} has no step {:?}; its steps are {}", better_compute_core::bounds::echo(n), names.join(", ")))
        })? as i32,
    };
    // The steps from `to` on run again; a skip forward marks the steps in between skipped.
    let steps = tx.query("SELECT idx, state FROM workflow_steps WHERE workflow_id = $1 ORDER BY idx", &[&id]).await?;
    for s in &steps {
        let (idx, st): (i32, WorkflowStepState) = (s.get(0), WorkflowStepState::parse(s.get(1)).expect("a step state"));
        let next = if idx >= current && idx < to && st != WorkflowStepState::Skipped {
            WorkflowStepState::Skipped
        } else if idx >= to && st != WorkflowStepState::Pending {
            WorkflowStepState::Pending
        } else {
            continue;
        };
        WORKFLOW_STEP_STATE_TABLE.check(st, next)?;
        if next == WorkflowStepState::Pending {
            // Back to pending for its next attempt: a new attempt number, a fresh retry budget.
            tx.execute(
                "UPDATE workflow_steps SET state = 'pending', attempts_this_run = 0, retry_at = NULL, memory = '{}', reason = NULL, message = NULL, ended_at = NULL
                  WHERE workflow_id = $1 AND idx = $2",
                &[&id, &idx],
            )
            .await?;
        } else {
            tx.execute("UPDATE workflow_steps SET state = 'skipped', ended_at = compute_now(), retry_at = NULL WHERE workflow_id = $1 AND idx = $2", &[&id, &idx]).await?;
        }
    }
    tx.execute("UPDATE workflows SET current_step = $2, failure = NULL WHERE id = $1", &[&id, &to]).await?;
    move_workflow(tx, id, WorkflowState::Held, WorkflowState::Running, None, None).await?;
    emit(tx, "workflow.resumed", id, serde_json::json!({"fromStep": names.get(to as usize), "requestedBy": requested_by})).await?;
    work_queue::enqueue(tx, &WORKFLOW, id).await?;
    get(tx, id).await
}
