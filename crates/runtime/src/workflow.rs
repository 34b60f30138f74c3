//! Workflows: multi-step operations (drain → reboot → wait → check → uncordon) that survive worker
//! crashes, gateway restarts and partitions. A workflow is a row with its steps as rows; the
//! `workflow` job advances one workflow per key, level-triggered: it locks the workflow, reads its
//! current step and lets the step read the world and act, all in one fenced transaction. A crash
//! anywhere rolls everything back, so the next run repeats at most the read and the enqueue, and a
//! step's command is keyed `wf:<workflowId>:<step>.<attempt>` (`UNIQUE (node_id, idempotency_key)`),
//! so a step never sends it twice.
//!
//! Modules register definitions ([`crate::Module::workflows`]): an ordered list of [`StepDef`]s,
//! each a [`Step`] with a retry policy, a timeout per attempt and what a failure does
//! ([`OnFailure`]). A workflow whose target is a pool or a label selector is fleet-wide: it runs
//! one child workflow per node, `parallel` at a time, and holds on the first child that fails.
//!
//! Lock order: the workflow's row comes first of all (position 1 of docs/architecture.md), a
//! fleet-wide run's row before its children's, children in id order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use better_compute_core::id::WorkflowId;
use better_compute_core::state::{State, WorkflowState, WorkflowStepState, WORKFLOW_STATE_TABLE, WORKFLOW_STEP_STATE_TABLE};
use better_compute_core::{Error, ErrorCode};
use better_compute_db::clock::rfc3339_sql as ts;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use tokio_postgres::{GenericClient, Transaction};

use crate::decisions::Decision;
use crate::jobs::workflow::{WorkflowJob, WORKFLOW};
use crate::reconciler::{Outcome, ReconcileContext, RunError};
use crate::{outbox, work_queue, NewEvent, Registry};

/// Starting, cancelling and resuming workflows.
pub const WRITE: &str = "compute:workflows:write";
/// Reading workflows.
pub const READ: &str = "compute:workflows:read";
/// The most nodes a fleet-wide run works on at once.
pub const MAX_PARALLEL: i64 = 64;
/// The most nodes one fleet-wide run covers.
pub const MAX_FLEET_NODES: usize = 10_000;
/// Steps one run may finish before it lets the queue run the key again.
const STEPS_PER_RUN: usize = 8;
/// A fleet-wide run's own step.
const FLEET_STEP: &str = "nodes";

/// What a workflow runs on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Target {
    /// One node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// Every node of a pool (fleet-wide), or the selector's nodes within it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    /// Every node with these labels (fleet-wide).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

impl Target {
    /// Checks the shape: a node alone, or a pool and/or labels.
    pub fn check(&self) -> Result<(), Error> {
        match (&self.node_id, &self.pool_id, &self.labels) {
            (Some(_), None, None) => Ok(()),
            (Some(_), _, _) => Err(Error::invalid_argument("target is one node (nodeId) or a fleet (poolId and/or labels), not both")),
            (None, None, None) => Err(Error::invalid_argument("target needs nodeId, poolId or labels")),
            (None, _, Some(l)) if l.is_empty() || l.len() > 32 => Err(Error::invalid_argument("target.labels needs 1 to 32 labels")),
            _ => Ok(()),
        }
    }

    /// Whether it names more than one node.
    pub fn is_fleet(&self) -> bool {
        self.node_id.is_none()
    }
}

/// What a step's run asks for next.
#[derive(Debug, Clone, PartialEq)]
pub enum StepOutcome {
    /// The step is done; `memory` is kept for later steps ([`StepContext::earlier`]).
    Done(serde_json::Value),
    /// Not yet: look again after `recheck_s` (sooner when the step's command ends or an event
    /// wakes the workflow). `memory` is what the step remembers until then.
    Wait {
        /// Kept for the next run of this attempt.
        memory: serde_json::Value,
        /// What it waits on, for operators.
        message: String,
        /// When to look again at the latest.
        recheck_s: f64,
    },
    /// This attempt failed: the retry policy, then [`OnFailure`], decide.
    Fail {
        /// A stable code, e.g. `COMMAND_FAILED`.
        reason: String,
        /// For operators.
        message: String,
    },
    /// Stop for an operator now, whatever the retry policy (`workflows.resume` goes on).
    Hold {
        /// A stable code, e.g. `UNHEALTHY`.
        reason: String,
        /// For operators.
        message: String,
    },
}

/// What a step sees.
pub struct StepContext<'a> {
    /// The workflow's transaction (fenced by the job's lease). Everything the step writes commits
    /// with the step's new state, or not at all.
    pub tx: &'a Transaction<'a>,
    /// Every module (command kinds, the signing key, occupants).
    pub registry: &'a Registry,
    /// The workflow.
    pub workflow_id: &'a str,
    /// Its definition.
    pub definition: &'a dyn WorkflowDefinition,
    /// Its node (empty for a fleet-wide run).
    pub node_id: &'a str,
    /// Its target.
    pub target: &'a Target,
    /// Its parameters.
    pub params: &'a serde_json::Value,
    /// What this attempt remembered (`{}` on its first run).
    pub memory: &'a serde_json::Value,
    /// What earlier steps kept, by step name.
    pub earlier: &'a BTreeMap<String, serde_json::Value>,
    /// The idempotency key of this attempt's command: `wf:<workflowId>:<step>.<attempt>`.
    pub command_key: &'a str,
    /// Seconds since this attempt started.
    pub attempt_elapsed_s: f64,
    /// The workflow's key in the `workflow` job, to be woken when its command ends:
    /// (kind, key, shard), as commands take their owner.
    pub owner: (&'static str, &'a str, i16),
    /// Pokes sent once the step's transaction has committed (a command enqueued or cancelled
    /// wakes its gateway).
    pub after_commit: &'a work_queue::AfterCommit,
}

/// One kind of step: a command of a registered kind, a wait on a condition, or a call into a
/// module. Runs are level-triggered: each reads what the attempt remembered and the world, and acts
/// on the difference.
#[async_trait::async_trait]
pub trait Step: Send + Sync + 'static {
    /// Advances the step.
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError>;

    /// Stops what the current attempt started (cancels its command through the command queue).
    /// Called when the workflow is cancelled and when an attempt times out.
    async fn cancel(&self, _cx: &StepContext<'_>) -> Result<(), DbError> {
        Ok(())
    }
}

/// What a step's failure (after its retries) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Stop and hold for an operator.
    Hold,
    /// End the workflow as failed.
    Fail,
    /// Skip ahead to the named step (a compensation such as uncordon), run it and the steps after
    /// it, then fail with the original failure.
    Compensate(&'static str),
}

/// One step of a definition.
#[derive(Clone)]
pub struct StepDef {
    /// Its name, unique in the definition (part of its command key).
    pub name: &'static str,
    /// What it does, for the reference and `workflows.get`.
    pub summary: &'static str,
    /// Its implementation.
    pub step: Arc<dyn Step>,
    /// Attempts before [`StepDef::on_failure`] (at least 1).
    pub attempts: u32,
    /// The first retry's back-off; it doubles per attempt.
    pub backoff_s: u32,
    /// How long one attempt may wait before it fails with `TIMEOUT`.
    pub timeout_s: u64,
    /// What a failure does after the retries.
    pub on_failure: OnFailure,
}

/// A workflow definition a module registers.
#[async_trait::async_trait]
pub trait WorkflowDefinition: Send + Sync + 'static {
    /// Its name, e.g. `node.maintenance`.
    fn name(&self) -> &'static str;

    /// What it does, for the reference.
    fn summary(&self) -> &'static str;

    /// Its steps, in order.
    fn steps(&self) -> &[StepDef];

    /// Whether `workflows.start` may start it (some are started by jobs only).
    fn api_allowed(&self) -> bool {
        true
    }

    /// Checks `params` (INVALID_ARGUMENT when bad). `parallel` is the engine's, for fleet runs.
    fn check_params(&self, params: &serde_json::Value) -> Result<(), Error>;

    /// The pool of `node_id`, checking that the node exists and can run it.
    async fn node_pool(&self, tx: &Transaction<'_>, node_id: &str) -> Result<String, DbError>;

    /// Checks `params` against the target in the database (a device the params name belongs to
    /// the target's node); INVALID_ARGUMENT or NOT_FOUND when not. Runs after [`Self::node_pool`].
    async fn check_target(&self, _tx: &Transaction<'_>, _target: &Target, _params: &serde_json::Value) -> Result<(), DbError> {
        Ok(())
    }

    /// The nodes of a fleet target, in the order a fleet-wide run works through them.
    async fn expand(&self, tx: &Transaction<'_>, target: &Target) -> Result<Vec<String>, DbError>;
}

/// The reference page of the registered definitions (docs/workflow-definitions.md is this text).
pub fn reference_page(defs: &[Arc<dyn WorkflowDefinition>]) -> String {
    let mut s = String::from(
        "# Workflow definitions\n\nGenerated from the registry by `better-compute docs workflows`; a test fails when this page\n\
         and the registry differ. How workflows run: [workflows.md](workflows.md).\n\n\
         Each step's attempts run one after another after the back-off (doubling per attempt); an attempt that\n\
         waits longer than its timeout fails with `TIMEOUT`. A step's command is keyed\n\
         `wf:<workflowId>:<step>.<attempt>`.\n\n",
    );
    for d in defs {
        s.push_str(&format!("## `{}`\n\n{}\n\n| step | attempts | back-off | timeout | on failure | what it does |\n| --- | --- | --- | --- | --- | --- |\n", d.name(), d.summary()));
        for st in d.steps() {
            let on = match st.on_failure {
                OnFailure::Hold => "hold".to_owned(),
                OnFailure::Fail => "fail".to_owned(),
                OnFailure::Compensate(n) => format!("run `{n}`, then fail"),
            };
            s.push_str(&format!("| `{}` | {} | {} s | {} s | {on} | {} |\n", st.name, st.attempts, st.backoff_s, st.timeout_s, st.summary));
        }
        s.push('\n');
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Views

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

// ---------------------------------------------------------------------------------------------
// Starting, cancelling, resuming

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

fn emit<'a>(tx: &'a Transaction<'_>, event_type: &'a str, workflow_id: &'a str, data: serde_json::Value) -> impl std::future::Future<Output = Result<String, DbError>> + 'a {
    outbox::emit(tx, NewEvent { event_type, tenant_id: None, subject: workflow_id, data })
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

async fn insert(
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

async fn lock(tx: &Transaction<'_>, id: &str) -> Result<WorkflowState, DbError> {
    let row = tx.query_opt("SELECT state FROM workflows WHERE id = $1 FOR UPDATE", &[&id]).await?.ok_or_else(|| Error::not_found("workflow", id))?;
    Ok(WorkflowState::parse(row.get(0)).expect("a workflow state of the table's CHECK"))
}

async fn move_workflow(tx: &Transaction<'_>, id: &str, from: WorkflowState, to: WorkflowState, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
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

// ---------------------------------------------------------------------------------------------
// The job

/// Test hooks: make the next run fail at a named point, as a crash there would, so tests show that
/// a crash between any two statements repeats at most the read and the enqueue.
#[cfg(feature = "testing")]
pub mod crash {
    use std::sync::Mutex;

    static ARMED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

    /// The points a run passes, in order: after it locked the workflow, after the step acted,
    /// after the step's row was written, after its events, just before commit.
    pub const POINTS: &[&str] = &["locked", "advanced", "step-written", "events-emitted", "before-commit"];

    /// The next run that passes `point` fails there (once).
    pub fn arm(point: &'static str) {
        ARMED.lock().expect("crash points").push(point);
    }

    /// Disarms `point` once.
    pub fn arm_clear(point: &'static str) {
        hit(point);
    }

    /// Whether `point` is still armed (no run passed it yet).
    pub fn armed(point: &'static str) -> bool {
        ARMED.lock().expect("crash points").contains(&point)
    }

    pub(super) fn hit(point: &'static str) -> bool {
        let mut armed = ARMED.lock().expect("crash points");
        match armed.iter().position(|p| *p == point) {
            Some(i) => {
                armed.remove(i);
                true
            }
            None => false,
        }
    }
}

fn crash_point(_point: &'static str) -> Result<(), RunError> {
    #[cfg(feature = "testing")]
    if crash::hit(_point) {
        return Err(format!("test crash at {_point}").into());
    }
    Ok(())
}

/// A workflow's row as a run reads it.
struct Loaded {
    definition: String,
    target: Target,
    node_id: Option<String>,
    params: serde_json::Value,
    parent_id: Option<String>,
    state: WorkflowState,
    current: usize,
    failure: Option<serde_json::Value>,
}

/// A step's row.
struct StepRow {
    name: String,
    state: WorkflowStepState,
    attempts: i32,
    attempts_this_run: i32,
    memory: serde_json::Value,
    elapsed_s: f64,
    retry_in_s: Option<f64>,
}

async fn load_steps(tx: &Transaction<'_>, id: &str) -> Result<Vec<StepRow>, DbError> {
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

/// The engine's own step of a fleet-wide run: one child per node, `parallel` at a time.
struct FleetStep;

/// The one step of a fleet-wide run.
fn fleet_steps() -> Vec<StepDef> {
    vec![StepDef {
        name: FLEET_STEP,
        summary: "runs the definition on each node of the target, `parallel` at a time, holding on the first node that fails",
        step: Arc::new(FleetStep),
        attempts: 1,
        backoff_s: 0,
        timeout_s: 30 * 24 * 3600,
        on_failure: OnFailure::Hold,
    }]
}

#[async_trait::async_trait]
impl Step for FleetStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let mut memory = cx.memory.clone();
        if memory.get("nodes").is_none() {
            let nodes = cx.definition.expand(cx.tx, cx.target).await?;
            if nodes.is_empty() {
                return Ok(StepOutcome::Fail { reason: "NO_NODES".into(), message: "the target selects no node".into() });
            }
            if nodes.len() > MAX_FLEET_NODES {
                return Ok(StepOutcome::Fail { reason: "TOO_MANY_NODES".into(), message: format!("the target selects {} nodes; at most {MAX_FLEET_NODES} per run", nodes.len()) });
            }
            memory = serde_json::json!({"nodes": nodes});
        }
        let nodes: Vec<String> = serde_json::from_value(memory["nodes"].clone()).unwrap_or_default();
        let parallel = cx.params.get("parallel").and_then(|p| p.as_i64()).unwrap_or(1);
        // Children, and whether each ended badly during this attempt (a failure before a resume
        // was the operator's to look at, and does not hold the run again).
        let kids = cx
            .tx
            .query(
                "SELECT node_id, state, message, ended_at > compute_now() - make_interval(secs => $2) FROM workflows WHERE parent_id = $1 ORDER BY id",
                &[&cx.workflow_id, &cx.attempt_elapsed_s],
            )
            .await?;
        let mut started: std::collections::HashSet<String> = std::collections::HashSet::new();
        let (mut running, mut succeeded) = (0i64, 0usize);
        for k in &kids {
            let (node, state, message, recent): (String, &str, Option<String>, Option<bool>) = (k.get(0), k.get(1), k.get(2), k.get(3));
            match state {
                "held" => {
                    return Ok(StepOutcome::Hold {
                        reason: "NODE_HELD".into(),
                        message: format!("paused: node {node} holds ({}); resume or cancel its workflow, then resume this run", message.unwrap_or_default()),
                    })
                }
                "failed" | "cancelled" if recent == Some(true) => {
                    return Ok(StepOutcome::Hold {
                        reason: "NODE_FAILED".into(),
                        message: format!("paused: node {node} {state} ({}); resume to go on with the next nodes", message.unwrap_or_default()),
                    })
                }
                "running" | "cancelling" => running += 1,
                "succeeded" => succeeded += 1,
                _ => {}
            }
            started.insert(node);
        }
        let mut pool_ids = Vec::new();
        let waiting: Vec<String> = nodes.iter().filter(|n| !started.contains(*n)).cloned().collect();
        for node in &waiting {
            if running >= parallel {
                break;
            }
            let pool_id = cx.definition.node_pool(cx.tx, node).await?;
            pool_ids.push(pool_id);
            let child_target = Target { node_id: Some(node.clone()), ..Target::default() };
            let mut child_params = cx.params.clone();
            if let Some(o) = child_params.as_object_mut() {
                o.remove("parallel");
            }
            let requested_by = format!("workflow:{}", cx.workflow_id);
            let w = NewWorkflow { definition: cx.definition.name(), target: &child_target, params: &child_params, requested_by: &requested_by };
            insert(cx.tx, &WorkflowId::generate().to_string(), cx.definition, &w, pool_ids.last().map(|s| s.as_str()), Some(cx.workflow_id), &child_params).await?;
            running += 1;
            started.insert(node.clone());
        }
        if started.len() == nodes.len() && running == 0 {
            return Ok(StepOutcome::Done(serde_json::json!({"nodes": nodes.len(), "succeeded": succeeded})));
        }
        Ok(StepOutcome::Wait {
            message: format!("{} of {} nodes done, {running} running", started.len() as i64 - running, nodes.len()),
            memory,
            recheck_s: 60.0,
        })
    }

    async fn cancel(&self, cx: &StepContext<'_>) -> Result<(), DbError> {
        let kids: Vec<String> = cx
            .tx
            .query("SELECT id FROM workflows WHERE parent_id = $1 AND state IN ('running', 'held') ORDER BY id FOR UPDATE", &[&cx.workflow_id])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        for k in kids {
            cancel(cx.tx, &k, &format!("workflow:{}", cx.workflow_id)).await?;
        }
        Ok(())
    }
}

impl WorkflowJob {
    /// One run of a workflow, in fenced transactions it commits.
    pub(crate) async fn advance(
        &self,
        ctx: &ReconcileContext,
        client: &mut deadpool_postgres::Client,
        key: &str,
        after_commit: &work_queue::AfterCommit,
    ) -> Result<Outcome, RunError> {
        let tx = ctx.begin_fenced(client).await?;
        let row = tx
            .query_opt(
                "SELECT definition, target, node_id, params, parent_id, state, current_step, failure FROM workflows WHERE id = $1 FOR UPDATE",
                &[&key],
            )
            .await?;
        let Some(row) = row else {
            tx.commit().await?;
            return Ok(Outcome::Done);
        };
        crash_point("locked")?;
        let mut w = Loaded {
            definition: row.get(0),
            target: serde_json::from_value(row.get(1)).map_err(|e| format!("workflow {key}: bad target: {e}"))?,
            node_id: row.get(2),
            params: row.get(3),
            parent_id: row.get(4),
            state: WorkflowState::parse(row.get(5)).expect("a workflow state of the table's CHECK"),
            current: row.get::<_, i32>(6) as usize,
            failure: row.get(7),
        };
        if WORKFLOW_STATE_TABLE.is_terminal(w.state) || w.state == WorkflowState::Held {
            tx.commit().await?;
            return Ok(Outcome::Done);
        }
        let registry = ctx.registry();
        let def = registry.workflow(&w.definition).ok_or_else(|| format!("workflow {key}: definition {} is not registered in this worker", w.definition))?;
        let fleet = fleet_steps();
        let defs: &[StepDef] = if w.node_id.is_none() { &fleet } else { def.steps() };
        let mut steps = load_steps(&tx, key).await?;
        let mut earlier: BTreeMap<String, serde_json::Value> = BTreeMap::new();
        for s in steps.iter().take(w.current) {
            earlier.insert(s.name.clone(), s.memory.clone());
        }
        let shard = WORKFLOW.shard_of(key);
        let node_id = w.node_id.clone().unwrap_or_default();
        let mut counts = (0u64, 0u64);

        if w.state == WorkflowState::Cancelling {
            if let (Some(sd), Some(s)) = (defs.get(w.current), steps.get(w.current)) {
                let command_key = format!("wf:{key}:{}.{}", s.name, s.attempts);
                let cx = context(&tx, registry, key, def.as_ref(), &node_id, &w, &s.memory, &earlier, &command_key, s.elapsed_s, shard, after_commit);
                // Held (failed) or retrying too: a fleet-wide run's children are still open.
                if matches!(s.state, WorkflowStepState::Running | WorkflowStepState::Retrying | WorkflowStepState::Failed) {
                    sd.step.cancel(&cx).await?;
                }
            }
            for (i, s) in steps.iter().enumerate().skip(w.current) {
                if matches!(s.state, WorkflowStepState::Pending | WorkflowStepState::Running | WorkflowStepState::Retrying) {
                    move_step(&tx, key, i, s, WorkflowStepState::Cancelled, Some("CANCELLED"), Some("the workflow was cancelled")).await?;
                }
            }
            move_workflow(&tx, key, WorkflowState::Cancelling, WorkflowState::Cancelled, Some("CANCELLED"), None).await?;
            ended(&tx, registry, key, &w, "cancelled", Some("CANCELLED"), None).await?;
            crash_point("before-commit")?;
            tx.commit().await?;
            ctx.count("cancelled", 1);
            return Ok(Outcome::Done);
        }

        for _ in 0..STEPS_PER_RUN {
            let Some(sd) = defs.get(w.current) else {
                // Every step ended: succeeded, unless a compensation ran for a failure.
                let (to, reason, message) = match &w.failure {
                    None => (WorkflowState::Succeeded, None, None),
                    Some(f) => (WorkflowState::Failed, f["reason"].as_str().map(String::from), f["message"].as_str().map(String::from)),
                };
                move_workflow(&tx, key, WorkflowState::Running, to, reason.as_deref(), message.as_deref()).await?;
                ended(&tx, registry, key, &w, to.as_str(), reason.as_deref(), message.as_deref()).await?;
                crash_point("before-commit")?;
                tx.commit().await?;
                ctx.count(if to == WorkflowState::Succeeded { "succeeded" } else { "failed" }, 1);
                ctx.count("steps succeeded", counts.0);
                return Ok(Outcome::Done);
            };
            let s = &mut steps[w.current];
            match s.state {
                WorkflowStepState::Retrying if s.retry_in_s.unwrap_or(0.0) > 0.0 => {
                    work_queue::enqueue_after(&*tx, &WORKFLOW, key, secs(s.retry_in_s.unwrap_or(1.0))).await?;
                    tx.commit().await?;
                    return Ok(Outcome::Done);
                }
                WorkflowStepState::Pending | WorkflowStepState::Retrying => {
                    // A new attempt: a new number, so a new command key.
                    WORKFLOW_STEP_STATE_TABLE.check(s.state, WorkflowStepState::Running)?;
                    tx.execute(
                        "UPDATE workflow_steps SET state = 'running', attempts = attempts + 1, attempts_this_run = attempts_this_run + 1,
                                attempt_started_at = compute_now(), started_at = coalesce(started_at, compute_now()), retry_at = NULL,
                                memory = '{}', reason = NULL, message = NULL, ended_at = NULL
                          WHERE workflow_id = $1 AND idx = $2",
                        &[&key, &(w.current as i32)],
                    )
                    .await?;
                    s.state = WorkflowStepState::Running;
                    s.attempts += 1;
                    s.attempts_this_run += 1;
                    s.memory = serde_json::json!({});
                    s.elapsed_s = 0.0;
                    step_event(&tx, registry, key, &w, &s.name, "running", s.attempts, None, None).await?;
                }
                WorkflowStepState::Running => {}
                other => return Err(format!("workflow {key}: its current step {} is {}", s.name, other.as_str()).into()),
            }
            let command_key = format!("wf:{key}:{}.{}", s.name, s.attempts);
            let cx = context(&tx, registry, key, def.as_ref(), &node_id, &w, &s.memory, &earlier, &command_key, s.elapsed_s, shard, after_commit);
            let mut outcome = sd.step.advance(&cx).await?;
            crash_point("advanced")?;
            if let StepOutcome::Wait { message, .. } = &outcome
                && s.elapsed_s > sd.timeout_s as f64 {
                    sd.step.cancel(&cx).await?;
                    outcome = StepOutcome::Fail { reason: "TIMEOUT".into(), message: format!("{} s passed: {message}", sd.timeout_s) };
                }
            let asked_hold = matches!(outcome, StepOutcome::Hold { .. });
            match outcome {
                StepOutcome::Done(memory) => {
                    tx.execute(
                        "UPDATE workflow_steps SET state = 'succeeded', memory = $3, message = NULL, ended_at = compute_now() WHERE workflow_id = $1 AND idx = $2",
                        &[&key, &(w.current as i32), &memory],
                    )
                    .await?;
                    crash_point("step-written")?;
                    step_event(&tx, registry, key, &w, &s.name, "succeeded", s.attempts, None, None).await?;
                    crash_point("events-emitted")?;
                    earlier.insert(s.name.clone(), memory);
                    w.current += 1;
                    tx.execute("UPDATE workflows SET current_step = $2, updated_at = compute_now(), version = version + 1 WHERE id = $1", &[&key, &(w.current as i32)]).await?;
                    counts.0 += 1;
                }
                StepOutcome::Wait { memory, message, recheck_s } => {
                    tx.execute("UPDATE workflow_steps SET memory = $3, message = $4 WHERE workflow_id = $1 AND idx = $2", &[&key, &(w.current as i32), &memory, &message]).await?;
                    crash_point("step-written")?;
                    let left = (sd.timeout_s as f64 - s.elapsed_s).max(0.0) + 0.001;
                    work_queue::enqueue_after(&*tx, &WORKFLOW, key, secs(recheck_s.min(left))).await?;
                    crash_point("before-commit")?;
                    tx.commit().await?;
                    ctx.count("steps succeeded", counts.0);
                    return Ok(Outcome::Done);
                }
                StepOutcome::Fail { reason, message } if s.attempts_this_run < sd.attempts as i32 => {
                    let backoff = sd.backoff_s as f64 * 2f64.powi(s.attempts_this_run - 1);
                    tx.execute(
                        "UPDATE workflow_steps SET state = 'retrying', reason = $3, message = $4, retry_at = compute_now() + make_interval(secs => $5)
                          WHERE workflow_id = $1 AND idx = $2",
                        &[&key, &(w.current as i32), &reason, &message, &backoff],
                    )
                    .await?;
                    WORKFLOW_STEP_STATE_TABLE.check(WorkflowStepState::Running, WorkflowStepState::Retrying)?;
                    crash_point("step-written")?;
                    step_event(&tx, registry, key, &w, &s.name, "retrying", s.attempts, Some(&reason), Some(&message)).await?;
                    work_queue::enqueue_after(&*tx, &WORKFLOW, key, secs(backoff)).await?;
                    crash_point("before-commit")?;
                    tx.commit().await?;
                    ctx.count("retries", 1);
                    return Ok(Outcome::Done);
                }
                StepOutcome::Fail { reason, message } | StepOutcome::Hold { reason, message } => {
                    let s = &steps[w.current];
                    move_step(&tx, key, w.current, s, WorkflowStepState::Failed, Some(&reason), Some(&message)).await?;
                    crash_point("step-written")?;
                    step_event(&tx, registry, key, &w, &s.name, "failed", s.attempts, Some(&reason), Some(&message)).await?;
                    // A hold the step asked for, the policy's, or a failed compensation: wait
                    // for an operator.
                    let policy = if asked_hold || w.failure.is_some() { OnFailure::Hold } else { sd.on_failure };
                    match policy {
                        OnFailure::Hold => {
                            move_workflow(&tx, key, WorkflowState::Running, WorkflowState::Held, Some(&reason), Some(&message)).await?;
                            registry.record_decision(&tx, &Decision { job: WORKFLOW.name, action: "workflows.held", target: key, tenant_id: None }).await?;
                            emit(&tx, "workflow.held", key, serde_json::json!({"definition": w.definition, "nodeId": w.node_id, "step": s.name, "reason": reason, "message": message})).await?;
                            wake_parent(&tx, &w).await?;
                            ctx.count("held", 1);
                        }
                        OnFailure::Fail => {
                            move_workflow(&tx, key, WorkflowState::Running, WorkflowState::Failed, Some(&reason), Some(&message)).await?;
                            ended(&tx, registry, key, &w, "failed", Some(&reason), Some(&message)).await?;
                            ctx.count("failed", 1);
                        }
                        OnFailure::Compensate(to) => {
                            let to_idx = defs.iter().position(|d| d.name == to).expect("a definition's compensation names one of its steps");
                            for (i, st) in steps.iter().enumerate().take(to_idx).skip(w.current + 1) {
                                move_step(&tx, key, i, st, WorkflowStepState::Skipped, None, Some("skipped: a compensation ran")).await?;
                            }
                            let failure = serde_json::json!({"step": steps[w.current].name, "reason": reason, "message": message});
                            tx.execute("UPDATE workflows SET current_step = $2, failure = $3, updated_at = compute_now(), version = version + 1 WHERE id = $1", &[&key, &(to_idx as i32), &failure])
                                .await?;
                            w.current = to_idx;
                            w.failure = Some(failure);
                            counts.1 += 1;
                            continue;
                        }
                    }
                    crash_point("before-commit")?;
                    tx.commit().await?;
                    return Ok(Outcome::Done);
                }
            }
        }
        // More steps finished than one run takes: go on in the next run.
        work_queue::enqueue(&*tx, &WORKFLOW, key).await?;
        crash_point("before-commit")?;
        tx.commit().await?;
        ctx.count("steps succeeded", counts.0);
        Ok(Outcome::Done)
    }
}

/// Wakes the running workflows of the nodes events are about (a drain ended, a node came back),
/// so a wait notices at once rather than at its next look.
pub struct WorkflowWaker;

#[async_trait::async_trait]
impl crate::Sink for WorkflowWaker {
    fn name(&self) -> &str {
        "workflows.waker"
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[crate::Event]) -> Result<(), RunError> {
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

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 365.0 * 24.0 * 3600.0))
}

#[allow(clippy::too_many_arguments)]
fn context<'a>(
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

async fn move_step(tx: &Transaction<'_>, id: &str, idx: usize, s: &StepRow, to: WorkflowStepState, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
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

#[allow(clippy::too_many_arguments)]
async fn step_event(tx: &Transaction<'_>, registry: &Registry, id: &str, w: &Loaded, step: &str, state: &str, attempt: i32, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    // A step's end is the workflow's decision, recorded as the job's.
    let action = match state {
        "succeeded" => Some("workflows.stepSucceeded"),
        "failed" => Some("workflows.stepFailed"),
        _ => None,
    };
    if let Some(action) = action {
        let target = format!("{id}/{step}");
        registry.record_decision(tx, &Decision { job: WORKFLOW.name, action, target: &target, tenant_id: None }).await?;
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
async fn wake_parent(tx: &Transaction<'_>, w: &Loaded) -> Result<(), DbError> {
    match &w.parent_id {
        Some(p) => work_queue::enqueue(tx, &WORKFLOW, p).await,
        None => Ok(()),
    }
}

async fn ended(tx: &Transaction<'_>, registry: &Registry, id: &str, w: &Loaded, state: &str, reason: Option<&str>, message: Option<&str>) -> Result<(), DbError> {
    let action = match state {
        "succeeded" => "workflows.succeeded",
        "cancelled" => "workflows.cancelled",
        _ => "workflows.failed",
    };
    registry.record_decision(tx, &Decision { job: WORKFLOW.name, action, target: id, tenant_id: None }).await?;
    emit(
        tx,
        "workflow.ended",
        id,
        serde_json::json!({"definition": w.definition, "nodeId": w.node_id, "parentId": w.parent_id, "state": state, "reason": reason, "message": message}),
    )
    .await?;
    wake_parent(tx, w).await
}

/// The event types workflows write (fleet events).
pub fn event_types() -> Vec<crate::events::EventType> {
    use crate::events::EventType;
    vec![
        EventType {
            name: "workflow.started",
            version: 1,
            audience: "fleet",
            description: "A workflow was started (by `workflows.start`, a job, or a fleet-wide run for one of its nodes).",
            data: &[("definition", "its definition"), ("target", "what it runs on"), ("parentId", "the fleet-wide run it belongs to, if any"), ("requestedBy", "who started it")],
        },
        EventType {
            name: "workflow.stepChanged",
            version: 1,
            audience: "fleet",
            description: "A step started an attempt (`running`), succeeded, failed an attempt (`retrying`) or failed.",
            data: &[
                ("definition", "the workflow's definition"),
                ("nodeId", "its node (null for a fleet-wide run)"),
                ("step", "the step"),
                ("state", "running, retrying, succeeded or failed"),
                ("attempt", "the attempt's number"),
                ("reason", "why it failed (a stable code)"),
                ("message", "for operators"),
            ],
        },
        EventType {
            name: "workflow.held",
            version: 1,
            audience: "fleet",
            description: "A workflow stopped for an operator: `workflows.resume` goes on, `workflows.cancel` ends it.",
            data: &[("definition", "its definition"), ("nodeId", "its node"), ("step", "the step it holds at"), ("reason", "why"), ("message", "for operators")],
        },
        EventType {
            name: "workflow.resumed",
            version: 1,
            audience: "fleet",
            description: "A held workflow was resumed.",
            data: &[("fromStep", "the step it runs again from"), ("requestedBy", "who resumed it")],
        },
        EventType {
            name: "workflow.cancelRequested",
            version: 1,
            audience: "fleet",
            description: "A cancel was asked for; the job stops the current step's command and ends the workflow.",
            data: &[("requestedBy", "who cancelled it")],
        },
        EventType {
            name: "workflow.ended",
            version: 1,
            audience: "fleet",
            description: "A workflow ended: succeeded, failed or cancelled.",
            data: &[
                ("definition", "its definition"),
                ("nodeId", "its node"),
                ("parentId", "its fleet-wide run"),
                ("state", "succeeded, failed or cancelled"),
                ("reason", "why it failed"),
                ("message", "for operators"),
            ],
        },
    ]
}

/// The permissions the workflow methods check.
pub fn permissions() -> Vec<crate::authz::Permission> {
    use crate::authz::Permission;
    vec![
        Permission { name: WRITE, description: "Start, cancel and resume workflows (at the node, pool or fleet they target)." },
        Permission { name: READ, description: "Read workflows and their steps." },
    ]
}
