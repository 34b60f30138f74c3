//! `workflow`: one key per workflow; each run locks its workflow, reads its current step and lets
//! the step read the world and act, all in one fenced transaction, then takes the step's outcome
//! through one function each ([`Run::done`], [`Run::wait`], [`Run::retry`], [`Run::fail`]). A
//! crash anywhere rolls the run back, so the next run repeats at most the read and the enqueue.

use std::collections::BTreeMap;

use better_compute_audit::Actor;
use better_compute_core::state::{State, WorkflowState, WorkflowStepState, WORKFLOW_STATE_TABLE, WORKFLOW_STEP_STATE_TABLE};
use better_compute_runtime::workflow::{OnFailure, StepDef, StepOutcome, WorkflowDefinition};
use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, Registry, RunError, ShardBy};
use tokio_postgres::Transaction;

use crate::crash::crash_point;
use crate::events::emit;
use crate::fleet::fleet_steps;
use crate::lifecycle::move_workflow;
use crate::steps::{context, ended, load, load_steps, move_step, secs, step_event, wake_parent, Loaded, StepRow};

/// The `workflow` job: one key per workflow.
pub const WORKFLOW: Kind = Kind { name: "workflow", shard_by: ShardBy::Key };

/// Steps one run may finish before it lets the queue run the key again.
const STEPS_PER_RUN: usize = 8;

/// The `workflow` job: advances one workflow per key.
pub struct WorkflowJob;

#[async_trait::async_trait]
impl Reconciler for WorkflowJob {
    fn kind(&self) -> Kind {
        WORKFLOW
    }

    async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError> {
        let mut client = ctx.client().await?;
        let after_commit = work_queue::AfterCommit::default();
        // Every path commits before it returns Ok; an error rolled back, and asks for no poke.
        let outcome = advance(ctx, &mut client, key, &after_commit).await?;
        after_commit.send(&client).await;
        Ok(outcome)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // Every open workflow of these shards: a lost wake-up delays it by one resync at most.
        let client = ctx.read().await?;
        let rows = client.query("SELECT id FROM workflows WHERE ended_at IS NULL AND state <> 'held' ORDER BY id", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|k| shards.contains(&WORKFLOW.shard_of(k))).collect())
    }
}

/// One run of a workflow, in a fenced transaction it commits; the run's counts are the job's
/// status once it committed.
async fn advance(ctx: &ReconcileContext, client: &mut deadpool_postgres::Client, key: &str, after_commit: &work_queue::AfterCommit) -> Result<Outcome, RunError> {
    let tx = ctx.begin_fenced(client).await?;
    let Some(w) = load(&tx, key).await? else {
        tx.commit().await?;
        return Ok(Outcome::Done);
    };
    crash_point("locked")?;
    if WORKFLOW_STATE_TABLE.is_terminal(w.state) || w.state == WorkflowState::Held {
        tx.commit().await?;
        return Ok(Outcome::Done);
    }
    let registry = ctx.registry();
    let def = registry.workflow(&w.definition).ok_or_else(|| format!("workflow {key}: definition {} is not registered in this worker", w.definition))?;
    let fleet = fleet_steps();
    let defs: &[StepDef] = if w.node_id.is_none() { &fleet } else { def.steps() };
    let steps = load_steps(&tx, key).await?;
    let earlier = steps.iter().take(w.current).map(|s| (s.name.clone(), s.memory.clone())).collect();
    let node_id = w.node_id.clone().unwrap_or_default();
    let run = Run { tx: &tx, registry, key, def: def.as_ref(), defs, w, steps, earlier, node_id, shard: WORKFLOW.shard_of(key), after_commit, counts: Vec::new(), steps_succeeded: 0 };
    let counts = run.go().await?;
    tx.commit().await?;
    for (what, n) in counts {
        ctx.count(what, n);
    }
    Ok(Outcome::Done)
}

/// What a run does after a step's outcome: take the next step, or commit what it wrote.
enum Next {
    Continue,
    Commit,
}

/// One run over a locked workflow.
struct Run<'a> {
    tx: &'a Transaction<'a>,
    registry: &'a Registry,
    key: &'a str,
    def: &'a dyn WorkflowDefinition,
    /// The definition's steps (a fleet-wide run's own one step).
    defs: &'a [StepDef],
    w: Loaded,
    steps: Vec<StepRow>,
    /// What the steps before the current one kept, by name.
    earlier: BTreeMap<String, serde_json::Value>,
    node_id: String,
    shard: i16,
    after_commit: &'a work_queue::AfterCommit,
    /// The job's counts of this run, reported once it committed.
    counts: Vec<(&'static str, u64)>,
    steps_succeeded: u64,
}

impl Run<'_> {
    /// Runs the workflow as far as one run goes; the counts to report after the commit.
    async fn go(mut self) -> Result<Vec<(&'static str, u64)>, RunError> {
        if self.w.state == WorkflowState::Cancelling {
            self.cancel().await?;
            return Ok(self.counts);
        }
        for _ in 0..STEPS_PER_RUN {
            if let Next::Commit = self.step().await? {
                return Ok(self.counts);
            }
        }
        // More steps finished than one run takes: go on in the next run.
        work_queue::enqueue(self.tx, &WORKFLOW, self.key).await?;
        crash_point("before-commit")?;
        self.counts.push(("steps succeeded", self.steps_succeeded));
        Ok(self.counts)
    }

    /// Stops the current step (a fleet-wide run's children too) and ends the workflow cancelled.
    async fn cancel(&mut self) -> Result<(), RunError> {
        let (tx, key, current) = (self.tx, self.key, self.w.current);
        if let (Some(sd), Some(s)) = (self.defs.get(current), self.steps.get(current)) {
            let command_key = format!("wf:{key}:{}.{}", s.name, s.attempts);
            let cx = context(tx, self.registry, key, self.def, &self.node_id, &self.w, &s.memory, &self.earlier, &command_key, s.elapsed_s, self.shard, self.after_commit);
            // Held (failed) or retrying too: a fleet-wide run's children are still open.
            if matches!(s.state, WorkflowStepState::Running | WorkflowStepState::Retrying | WorkflowStepState::Failed) {
                sd.step.cancel(&cx).await?;
            }
        }
        for (i, s) in self.steps.iter().enumerate().skip(current) {
            if matches!(s.state, WorkflowStepState::Pending | WorkflowStepState::Running | WorkflowStepState::Retrying) {
                move_step(tx, key, i, s, WorkflowStepState::Cancelled, Some("CANCELLED"), Some("the workflow was cancelled")).await?;
            }
        }
        move_workflow(tx, key, WorkflowState::Cancelling, WorkflowState::Cancelled, Some("CANCELLED"), None).await?;
        ended(tx, key, &self.w, "cancelled", Some("CANCELLED"), None).await?;
        crash_point("before-commit")?;
        self.counts.push(("cancelled", 1));
        Ok(())
    }

    /// Advances the current step once and takes its outcome.
    async fn step(&mut self) -> Result<Next, RunError> {
        let defs = self.defs;
        let Some(sd) = defs.get(self.w.current) else { return self.finish().await };
        if let Some(next) = self.begin_attempt().await? {
            return Ok(next);
        }
        let s = &self.steps[self.w.current];
        let command_key = format!("wf:{}:{}.{}", self.key, s.name, s.attempts);
        let cx = context(self.tx, self.registry, self.key, self.def, &self.node_id, &self.w, &s.memory, &self.earlier, &command_key, s.elapsed_s, self.shard, self.after_commit);
        let mut outcome = sd.step.advance(&cx).await?;
        crash_point("advanced")?;
        if let StepOutcome::Wait { message, .. } = &outcome
            && s.elapsed_s > sd.timeout_s as f64
        {
            sd.step.cancel(&cx).await?;
            outcome = StepOutcome::Fail { reason: "TIMEOUT".into(), message: format!("{} s passed: {message}", sd.timeout_s) };
        }
        let retries_left = s.attempts_this_run < sd.attempts as i32;
        match outcome {
            StepOutcome::Done(memory) => self.done(memory).await,
            StepOutcome::Wait { memory, message, recheck_s } => self.wait(sd, memory, message, recheck_s).await,
            StepOutcome::Fail { reason, message } if retries_left => self.retry(sd, reason, message).await,
            StepOutcome::Fail { reason, message } => self.fail(sd, reason, message, false).await,
            StepOutcome::Hold { reason, message } => self.fail(sd, reason, message, true).await,
        }
    }

    /// Every step ended: the workflow succeeded, or failed with the failure a compensation ran for.
    async fn finish(&mut self) -> Result<Next, RunError> {
        let (to, reason, message) = match &self.w.failure {
            None => (WorkflowState::Succeeded, None, None),
            Some(f) => (WorkflowState::Failed, f["reason"].as_str().map(String::from), f["message"].as_str().map(String::from)),
        };
        move_workflow(self.tx, self.key, WorkflowState::Running, to, reason.as_deref(), message.as_deref()).await?;
        ended(self.tx, self.key, &self.w, to.as_str(), reason.as_deref(), message.as_deref()).await?;
        crash_point("before-commit")?;
        self.counts.push((if to == WorkflowState::Succeeded { "succeeded" } else { "failed" }, 1));
        self.counts.push(("steps succeeded", self.steps_succeeded));
        Ok(Next::Commit)
    }

    /// A step waiting out its back-off commits a wake-up for then; a pending or retrying step
    /// starts a new attempt (a new number, so a new command key).
    async fn begin_attempt(&mut self) -> Result<Option<Next>, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        let s = &mut self.steps[i];
        match s.state {
            WorkflowStepState::Retrying if s.retry_in_s.unwrap_or(0.0) > 0.0 => {
                work_queue::enqueue_after(tx, &WORKFLOW, key, secs(s.retry_in_s.unwrap_or(1.0))).await?;
                return Ok(Some(Next::Commit));
            }
            WorkflowStepState::Pending | WorkflowStepState::Retrying => {
                WORKFLOW_STEP_STATE_TABLE.check(s.state, WorkflowStepState::Running)?;
                tx.execute(
                    "UPDATE workflow_steps SET state = 'running', attempts = attempts + 1, attempts_this_run = attempts_this_run + 1,
                            attempt_started_at = compute_now(), started_at = coalesce(started_at, compute_now()), retry_at = NULL,
                            memory = '{}', reason = NULL, message = NULL, ended_at = NULL
                      WHERE workflow_id = $1 AND idx = $2",
                    &[&key, &(i as i32)],
                )
                .await?;
                s.state = WorkflowStepState::Running;
                s.attempts += 1;
                s.attempts_this_run += 1;
                s.memory = serde_json::json!({});
                s.elapsed_s = 0.0;
                step_event(tx, key, &self.w, &s.name, "running", s.attempts, None, None).await?;
            }
            WorkflowStepState::Running => {}
            other => return Err(format!("workflow {key}: its current step {} is {}", s.name, other.as_str()).into()),
        }
        Ok(None)
    }

    /// The step succeeded: what it kept is the later steps', and the next step is current.
    async fn done(&mut self, memory: serde_json::Value) -> Result<Next, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        tx.execute(
            "UPDATE workflow_steps SET state = 'succeeded', memory = $3, message = NULL, ended_at = compute_now() WHERE workflow_id = $1 AND idx = $2",
            &[&key, &(i as i32), &memory],
        )
        .await?;
        crash_point("step-written")?;
        let s = &self.steps[i];
        step_event(tx, key, &self.w, &s.name, "succeeded", s.attempts, None, None).await?;
        crash_point("events-emitted")?;
        self.earlier.insert(s.name.clone(), memory);
        self.w.current += 1;
        tx.execute("UPDATE workflows SET current_step = $2, updated_at = compute_now(), version = version + 1 WHERE id = $1", &[&key, &(self.w.current as i32)]).await?;
        self.steps_succeeded += 1;
        Ok(Next::Continue)
    }

    /// Not yet: what the step remembers, and a look again by its recheck or its timeout.
    async fn wait(&mut self, sd: &StepDef, memory: serde_json::Value, message: String, recheck_s: f64) -> Result<Next, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        tx.execute("UPDATE workflow_steps SET memory = $3, message = $4 WHERE workflow_id = $1 AND idx = $2", &[&key, &(i as i32), &memory, &message]).await?;
        crash_point("step-written")?;
        let left = (sd.timeout_s as f64 - self.steps[i].elapsed_s).max(0.0) + 0.001;
        work_queue::enqueue_after(tx, &WORKFLOW, key, secs(recheck_s.min(left))).await?;
        crash_point("before-commit")?;
        self.counts.push(("steps succeeded", self.steps_succeeded));
        Ok(Next::Commit)
    }

    /// The attempt failed with attempts left: the next one after the back-off, doubling.
    async fn retry(&mut self, sd: &StepDef, reason: String, message: String) -> Result<Next, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        let s = &self.steps[i];
        let backoff = sd.backoff_s as f64 * 2f64.powi(s.attempts_this_run - 1);
        tx.execute(
            "UPDATE workflow_steps SET state = 'retrying', reason = $3, message = $4, retry_at = compute_now() + make_interval(secs => $5)
              WHERE workflow_id = $1 AND idx = $2",
            &[&key, &(i as i32), &reason, &message, &backoff],
        )
        .await?;
        WORKFLOW_STEP_STATE_TABLE.check(WorkflowStepState::Running, WorkflowStepState::Retrying)?;
        crash_point("step-written")?;
        step_event(tx, key, &self.w, &s.name, "retrying", s.attempts, Some(&reason), Some(&message)).await?;
        work_queue::enqueue_after(tx, &WORKFLOW, key, secs(backoff)).await?;
        crash_point("before-commit")?;
        self.counts.push(("retries", 1));
        Ok(Next::Commit)
    }

    /// The step failed (its retries spent) or asked to hold: the definition's policy holds, fails
    /// or compensates; a hold the step asked for, or a failed compensation, waits for an operator.
    async fn fail(&mut self, sd: &StepDef, reason: String, message: String, asked_hold: bool) -> Result<Next, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        let s = &self.steps[i];
        move_step(tx, key, i, s, WorkflowStepState::Failed, Some(&reason), Some(&message)).await?;
        crash_point("step-written")?;
        step_event(tx, key, &self.w, &s.name, "failed", s.attempts, Some(&reason), Some(&message)).await?;
        let policy = if asked_hold || self.w.failure.is_some() { OnFailure::Hold } else { sd.on_failure };
        match policy {
            OnFailure::Hold => {
                move_workflow(tx, key, WorkflowState::Running, WorkflowState::Held, Some(&reason), Some(&message)).await?;
                Actor::job(WORKFLOW.name).record(tx, "workflows.held", key, None).await?;
                let data = serde_json::json!({"definition": self.w.definition, "nodeId": self.w.node_id, "step": s.name, "reason": reason, "message": message});
                emit(tx, "workflow.held", key, data).await?;
                wake_parent(tx, &self.w).await?;
                self.counts.push(("held", 1));
            }
            OnFailure::Fail => {
                move_workflow(tx, key, WorkflowState::Running, WorkflowState::Failed, Some(&reason), Some(&message)).await?;
                ended(tx, key, &self.w, "failed", Some(&reason), Some(&message)).await?;
                self.counts.push(("failed", 1));
            }
            OnFailure::Compensate(to) => return self.compensate(to, reason, message).await,
        }
        crash_point("before-commit")?;
        Ok(Next::Commit)
    }

    /// Skips ahead to the compensation `to` (uncordon, say), which runs with the steps after it;
    /// the workflow then fails with this failure.
    async fn compensate(&mut self, to: &str, reason: String, message: String) -> Result<Next, RunError> {
        let (tx, key, i) = (self.tx, self.key, self.w.current);
        let to_idx = self.defs.iter().position(|d| d.name == to).expect("a definition's compensation names one of its steps");
        for (j, st) in self.steps.iter().enumerate().take(to_idx).skip(i + 1) {
            move_step(tx, key, j, st, WorkflowStepState::Skipped, None, Some("skipped: a compensation ran")).await?;
        }
        let failure = serde_json::json!({"step": self.steps[i].name, "reason": reason, "message": message});
        tx.execute("UPDATE workflows SET current_step = $2, failure = $3, updated_at = compute_now(), version = version + 1 WHERE id = $1", &[&key, &(to_idx as i32), &failure])
            .await?;
        self.w.current = to_idx;
        self.w.failure = Some(failure);
        Ok(Next::Continue)
    }
}
