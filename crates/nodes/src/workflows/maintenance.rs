//! `node.maintenance`: drain within the pool's budget → signed reboot → wait for a new boot and
//! convergence → `diag.nvml` → uncordon if healthy, else quarantine the failed GPUs and hold.

use super::*;

/// Drains the node within its pool's budget and waits until nothing holds it.
struct DrainStep;

#[async_trait::async_trait]
impl Step for DrainStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let reason = format!("maintenance: {}", text(cx.params, "reason").unwrap_or("node.maintenance"));
        let mode = if text(cx.params, "drainMode") == Some("wait") { DrainMode::Wait } else { DrainMode::Evict };
        let requested_by = format!("workflow:{}", cx.workflow_id);
        // An evicting drain's deadline: `drainDeadlineS` from the drain's first request. Later
        // runs ask without one, which returns the drain as it is (a later deadline would be
        // refused: a drain's deadline only moves earlier).
        let first = cx.memory.get("drainId").is_none();
        let deadline: Option<String> = match (mode, cx.params.get("drainDeadlineS").and_then(|v| v.as_f64())) {
            (DrainMode::Evict, Some(s)) if first => Some(
                cx.tx
                    .query_one(&format!("SELECT {}", better_compute_db::clock::rfc3339_sql("compute_now() + make_interval(secs => $1)")), &[&s])
                    .await?
                    .get(0),
            ),
            _ => None,
        };
        let d = match drain::request(cx.tx, &DrainRequest { node_id: cx.node_id, reason: &reason, mode, deadline: deadline.as_deref(), requested_by: &requested_by }).await {
            Ok(d) => d,
            Err(DbError::Domain(e)) if e.code == ErrorCode::Conflict => {
                return Ok(StepOutcome::Fail { reason: "DRAIN_CONFLICT".into(), message: e.message });
            }
            Err(e) => return Err(e),
        };
        if let Some(before) = cx.memory.get("drainId").and_then(|v| v.as_str())
            && before != d.id {
                return Ok(StepOutcome::Fail { reason: "DRAIN_CANCELLED".into(), message: format!("drain {before} was undrained by someone else") });
            }
        if d.state == "drained" {
            return Ok(StepOutcome::Done(serde_json::json!({"drainId": d.id})));
        }
        let message = format!("drain {} {}: {}", d.id, d.state, d.condition.message);
        Ok(StepOutcome::Wait { memory: serde_json::json!({"drainId": d.id}), message, recheck_s: RECHECK_S })
    }
}

/// Reboots the node with a signed `node.reboot`, remembering the boot it had.
struct RebootStep;

#[async_trait::async_trait]
impl Step for RebootStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let mut memory = cx.memory.clone();
        if memory.get("bootIdBefore").is_none() {
            let boot: Option<String> = cx.tx.query_opt("SELECT boot_id FROM node_sessions WHERE node_id = $1", &[&cx.node_id]).await?.map(|r| r.get(0));
            memory["bootIdBefore"] = boot.into();
        }
        let cx2 = StepContext { memory: &memory, ..*cx };
        // The reason names the attempt (its command key): each attempt is its own reboot.
        Ok(match command_step(&cx2, "node.reboot", serde_json::json!({"reason": cx.command_key})).await? {
            Ok(c) => {
                memory["commandId"] = c.id.into();
                StepOutcome::Done(memory)
            }
            Err(StepOutcome::Wait { memory: m, message, recheck_s }) => {
                let mut m = m;
                m["bootIdBefore"] = memory["bootIdBefore"].clone();
                StepOutcome::Wait { memory: m, message, recheck_s }
            }
            Err(other) => other,
        })
    }

    async fn cancel(&self, cx: &StepContext<'_>) -> Result<(), DbError> {
        cancel_command(cx).await
    }
}

/// Waits until the node is connected with a new boot and has applied its desired state.
struct WaitReadyStep;

#[async_trait::async_trait]
impl Step for WaitReadyStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let before = cx.earlier.get("reboot").and_then(|m| m.get("bootIdBefore")).and_then(|v| v.as_str()).map(String::from);
        let r = cx
            .tx
            .query_one(
                "SELECT n.liveness, s.boot_id, n.observed_generation, n.generation, s.closed_at IS NULL
                   FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id WHERE n.id = $1",
                &[&cx.node_id],
            )
            .await?;
        let (liveness, boot, observed, generation, open): (String, Option<String>, i64, i64, Option<bool>) = (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let new_boot = boot.is_some() && boot != before;
        if liveness == "connected" && open == Some(true) && new_boot && observed >= generation {
            return Ok(StepOutcome::Done(serde_json::json!({"bootId": boot, "generation": generation})));
        }
        let message = if liveness != "connected" || open != Some(true) {
            format!("waiting for the node to reconnect (liveness {liveness})")
        } else if !new_boot {
            "waiting for a new boot (the session still has the boot from before the reboot)".to_owned()
        } else {
            format!("waiting for convergence: observed generation {observed} of {generation}")
        };
        Ok(StepOutcome::Wait { memory: serde_json::json!({}), message, recheck_s: RECHECK_S })
    }
}

/// Runs `diag.nvml` on every GPU and keeps the verdict.
struct DiagStep;

#[async_trait::async_trait]
impl Step for DiagStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let level = cx.params.get("diagLevel").and_then(|v| v.as_i64()).unwrap_or(1);
        Ok(match command_step(cx, "diag.nvml", serde_json::json!({"level": level})).await? {
            Ok(c) => {
                let gpus = c.result.as_ref().and_then(|r| r["gpus"].as_array()).cloned().unwrap_or_default();
                let failed: Vec<String> = gpus.iter().filter(|g| g["passed"] != true).filter_map(|g| g["uuid"].as_str().map(String::from)).collect();
                StepOutcome::Done(serde_json::json!({"commandId": c.id, "gpus": gpus.len(), "failedGpus": failed}))
            }
            Err(o) => o,
        })
    }

    async fn cancel(&self, cx: &StepContext<'_>) -> Result<(), DbError> {
        cancel_command(cx).await
    }
}

/// A healthy node goes on; GPUs that failed the check are quarantined and the workflow holds with
/// the node still drained.
struct VerdictStep;

#[async_trait::async_trait]
impl Step for VerdictStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let failed: Vec<String> = cx.earlier.get("diag").and_then(|m| serde_json::from_value(m["failedGpus"].clone()).ok()).unwrap_or_default();
        if failed.is_empty() {
            return Ok(StepOutcome::Done(serde_json::json!({"healthy": true})));
        }
        for uuid in &failed {
            let quarantined: Option<bool> = cx.tx.query_opt("SELECT quarantined FROM devices WHERE id = $1 AND node_id = $2", &[uuid, &cx.node_id]).await?.map(|r| r.get(0));
            if quarantined == Some(false) {
                crate::actions::quarantine(cx.tx, uuid, &format!("failed diag.nvml in workflow {}", cx.workflow_id)).await?;
                better_compute_audit::Actor::job("workflow").record(cx.tx, "devices.quarantine", uuid, None).await?;
            }
        }
        Ok(StepOutcome::Hold {
            reason: "UNHEALTHY".into(),
            message: format!(
                "GPUs {} failed diag.nvml and are quarantined; the node stays drained. Replace or repair them, then resume from diag (or from uncordon)",
                failed.join(", ")
            ),
        })
    }
}

/// Ends the workflow's drain: the node is schedulable again.
struct UncordonStep;

#[async_trait::async_trait]
impl Step for UncordonStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let ours = cx.earlier.get("drain").and_then(|m| m.get("drainId")).and_then(|v| v.as_str()).map(String::from);
        let open = drain::open_drain(cx.tx, cx.node_id).await?;
        // Only the drain this workflow asked for: an operator's later drain is theirs to end.
        let undrained = match (&open, &ours) {
            (Some(d), Some(o)) if &d.id == o => drain::undrain(cx.tx, cx.node_id).await?,
            (Some(d), None) if d.requested_by == format!("workflow:{}", cx.workflow_id) => drain::undrain(cx.tx, cx.node_id).await?,
            _ => false,
        };
        Ok(StepOutcome::Done(serde_json::json!({"undrained": undrained})))
    }
}


/// `node.maintenance`.
pub struct Maintenance {
    steps: Vec<StepDef>,
}

impl Maintenance {
    /// The definition with its steps.
    pub fn new() -> Maintenance {
        Maintenance {
            steps: vec![
                step(
                    "drain",
                    "drains the node (mode `evict` by default, or `params.drainMode: wait`) within its pool's disruption budget and waits until nothing holds it",
                    DrainStep,
                    1,
                    0,
                    24 * 3600,
                    OnFailure::Compensate("uncordon"),
                ),
                step("reboot", "sends a signed `node.reboot` and waits for it to settle (a reconnect with a new boot)", RebootStep, 2, 30, 1800, OnFailure::Hold),
                step("wait-ready", "waits until the node is connected with a new boot id and has applied its desired state", WaitReadyStep, 1, 0, 1800, OnFailure::Hold),
                step("diag", "runs `diag.nvml` (`params.diagLevel`, default 1) on every GPU", DiagStep, 3, 30, 900, OnFailure::Hold),
                step("verdict", "goes on when every GPU passed; else quarantines those that failed and holds, the node still drained", VerdictStep, 1, 0, 60, OnFailure::Hold),
                step("uncordon", "ends the workflow's drain: the node takes reservations again", UncordonStep, 3, 10, 300, OnFailure::Hold),
            ],
        }
    }
}

impl Default for Maintenance {
    fn default() -> Self {
        Maintenance::new()
    }
}


#[async_trait::async_trait]
impl WorkflowDefinition for Maintenance {
    fn name(&self) -> &'static str {
        "node.maintenance"
    }

    fn summary(&self) -> &'static str {
        "Takes a node out for maintenance and brings it back: drain within the pool's budget, a signed reboot, \
         wait for the new boot and convergence, check every GPU, uncordon if healthy (else quarantine and hold). \
         A failed drain undrains the node and fails. Params: `reason` (required), `drainMode` (`evict`, the default, or `wait`), \
         `drainDeadlineS` (when an evicting drain ends what still holds the node; default an hour), `diagLevel` (1-3)."
    }

    fn steps(&self) -> &[StepDef] {
        &self.steps
    }

    fn check_params(&self, params: &serde_json::Value) -> Result<(), Error> {
        check_params(params, &["reason", "drainMode", "drainDeadlineS", "diagLevel"])?;
        // The drain's reason: shown to operators and, when it evicts, to tenants.
        let r = params
            .get("reason")
            .and_then(|r| r.as_str())
            .filter(|r| !r.trim().is_empty())
            .ok_or_else(|| Error::invalid_argument("params.reason is required: why the node is maintained (shown to operators, and to tenants when its drain evicts)"))?;
        better_compute_core::bounds::check_text("params.reason", r, better_compute_core::bounds::NOTE_CHARS)?;
        if !params.get("drainMode").is_none_or(|m| m == "wait" || m == "evict") {
            return Err(Error::invalid_argument("params.drainMode must be evict or wait"));
        }
        if !params.get("drainDeadlineS").is_none_or(|d| d.as_i64().is_some_and(|d| (5..=7 * 24 * 3600).contains(&d)) && params.get("drainMode") != Some(&"wait".into())) {
            return Err(Error::invalid_argument("params.drainDeadlineS is for an evicting drain, from 5 to 604800 seconds"));
        }
        if !params.get("diagLevel").is_none_or(|l| l.as_i64().is_some_and(|l| (1..=3).contains(&l))) {
            return Err(Error::invalid_argument("params.diagLevel must be 1, 2 or 3"));
        }
        Ok(())
    }

    async fn node_pool(&self, tx: &Transaction<'_>, node_id: &str) -> Result<String, DbError> {
        node_pool(tx, node_id).await
    }

    async fn expand(&self, tx: &Transaction<'_>, target: &Target) -> Result<Vec<String>, DbError> {
        expand(tx, target).await
    }
}

