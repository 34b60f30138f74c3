//! The workflow contract: what a module implements to define a workflow (a [`WorkflowDefinition`]
//! of [`StepDef`]s, each a [`Step`] that reads the world and acts in the workflow's transaction),
//! what a step sees ([`StepContext`]) and answers ([`StepOutcome`]), and the reference page of the
//! registered definitions. The engine that stores and advances workflows is the `workflows`
//! module (`better-compute-workflows`); modules register definitions ([`crate::Module::workflows`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use better_compute_core::Error;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use tokio_postgres::Transaction;

use crate::{work_queue, Registry};

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
