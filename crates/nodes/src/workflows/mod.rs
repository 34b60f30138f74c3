//! The nodes module's workflows: `node.maintenance` (drain within the pool's budget → signed
//! reboot → wait for a new boot and convergence → `diag.nvml` → uncordon if healthy, else
//! quarantine the failed GPUs and hold) and `node.recover` (the `health` job's: reset a suspect GPU
//! once nothing holds it, then check it again). The engine is the runtime's
//! ([`better_compute_runtime::workflow`]); the steps here read and change nodes' rows through this
//! module's functions.

pub mod maintenance;
pub mod recover;

use std::sync::Arc;
use std::time::Duration;

use better_compute_audit::Actor;
use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use better_compute_runtime::workflow::{OnFailure, Step, StepContext, StepDef, StepOutcome, Target, WorkflowDefinition};
use tokio_postgres::Transaction;

use crate::commands::{self, NewCommand};
use crate::drain::{self, DrainMode, DrainRequest};

pub use recover::RECOVER;

/// How long a step's command may wait for the node before the daemon refuses it.
pub(super) const COMMAND_NOT_AFTER: Duration = Duration::from_secs(600);
/// How often a wait looks again when nothing wakes it.
pub(super) const RECHECK_S: f64 = 10.0;

pub(super) fn text<'a>(params: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    params.get(key).and_then(|v| v.as_str())
}

pub(super) async fn node_pool(tx: &Transaction<'_>, node_id: &str) -> Result<String, DbError> {
    let row = tx
        .query_opt("SELECT pool_id, retired_at IS NOT NULL FROM nodes WHERE id = $1", &[&node_id])
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    if row.get::<_, bool>(1) {
        return Err(Error::failed_precondition(format!("node {node_id} is retired")).into());
    }
    Ok(row.get(0))
}

/// The nodes of a fleet target: not retired, in the pool and with the labels asked for, in id order.
pub(super) async fn expand(tx: &Transaction<'_>, target: &Target) -> Result<Vec<String>, DbError> {
    let labels = serde_json::to_value(target.labels.clone().unwrap_or_default()).expect("labels serialize");
    if let Some(p) = &target.pool_id {
        tx.query_opt("SELECT 1 FROM pools WHERE id = $1", &[p]).await?.ok_or_else(|| Error::not_found("pool", p))?;
    }
    let rows = tx
        .query(
            "SELECT id FROM nodes WHERE retired_at IS NULL AND ($1::text IS NULL OR pool_id = $1) AND labels @> $2 ORDER BY id",
            &[&target.pool_id, &labels],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Enqueues this attempt's command (keyed `wf:<workflowId>:<step>.<attempt>`, so a repeat finds
/// it), or reads how the one it enqueued ended. `Ok(Err(outcome))` while it has not succeeded.
pub(super) async fn command_step(cx: &StepContext<'_>, kind: &str, payload: serde_json::Value) -> Result<Result<commands::CommandView, StepOutcome>, DbError> {
    let id = cx.memory.get("commandId").and_then(|v| v.as_str());
    let c = match id {
        Some(id) => commands::get(cx.tx, cx.node_id, id).await?,
        None => {
            let actor = Actor::Job(format!("workflow:{}", cx.workflow_id).into());
            let c = commands::enqueue(
                cx.tx,
                cx.registry,
                NewCommand {
                    node_id: cx.node_id,
                    kind,
                    payload: &payload,
                    idempotency_key: cx.command_key,
                    not_after: Some(COMMAND_NOT_AFTER),
                    min_generation: 0,
                    owner: Some(cx.owner),
                    actor: &actor,
                },
            )
            .await?;
            cx.after_commit.poke(commands::COMMANDS_CHANNEL, cx.node_id);
            c
        }
    };
    let mut memory = cx.memory.clone();
    memory["commandId"] = c.id.clone().into();
    Ok(match c.state.as_str() {
        "succeeded" => Ok(c),
        "failed" | "expired" | "cancelled" => Err(StepOutcome::Fail {
            reason: format!("COMMAND_{}", c.state.to_uppercase()),
            message: format!("{kind} {} {}{}", c.id, c.state, c.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default()),
        }),
        s => Err(StepOutcome::Wait { memory, message: format!("{kind} {} is {s}", c.id), recheck_s: 60.0 }),
    })
}

pub(super) async fn cancel_command(cx: &StepContext<'_>) -> Result<(), DbError> {
    let Some(id) = cx.memory.get("commandId").and_then(|v| v.as_str()) else { return Ok(()) };
    let c = commands::get(cx.tx, cx.node_id, id).await?;
    if matches!(c.state.as_str(), "pending" | "sent" | "running") {
        commands::cancel(cx.tx, cx.node_id, id).await?;
        better_compute_audit::Actor::job("workflow").record(cx.tx, "commands.cancel", id, None).await?;
        cx.after_commit.poke(commands::COMMANDS_CHANNEL, cx.node_id);
    }
    Ok(())
}


pub(super) fn step(name: &'static str, summary: &'static str, s: impl Step, attempts: u32, backoff_s: u32, timeout_s: u64, on_failure: OnFailure) -> StepDef {
    StepDef { name, summary, step: Arc::new(s), attempts, backoff_s, timeout_s, on_failure }
}


pub(super) fn check_params(params: &serde_json::Value, allowed: &[&str]) -> Result<(), Error> {
    let obj = params.as_object().ok_or_else(|| Error::invalid_argument("params must be an object"))?;
    if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(Error::invalid_argument(format!("unknown param {:?}; this workflow takes {}", better_compute_core::bounds::echo(k), allowed.join(", "))));
    }
    Ok(())
}


/// The workflows the nodes module registers.
pub fn definitions() -> Vec<Arc<dyn WorkflowDefinition>> {
    vec![Arc::new(maintenance::Maintenance::new()), Arc::new(recover::Recover::new())]
}
