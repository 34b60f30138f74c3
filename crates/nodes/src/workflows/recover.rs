//! `node.recover`, the `health` job's workflow: reset a suspect GPU once nothing holds it, then
//! check it again.

use super::*;

/// Waits until nothing holds the GPU (it is out of placement while suspect, so what holds it ends).
struct WaitGpuFreeStep;

fn gpu(cx: &StepContext<'_>) -> String {
    text(cx.params, "gpuUuid").unwrap_or_default().to_owned()
}

#[async_trait::async_trait]
impl Step for WaitGpuFreeStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let uuid = gpu(cx);
        if cx.tx.query_opt("SELECT 1 FROM devices WHERE id = $1 AND node_id = $2 AND parent_id IS NULL", &[&uuid, &cx.node_id]).await?.is_none() {
            return Ok(StepOutcome::Fail { reason: "UNKNOWN_GPU".into(), message: format!("node {} has no GPU {uuid}", cx.node_id) });
        }
        for o in cx.registry.node_occupants().iter() {
            if o.holds_device(cx.tx, &uuid).await? {
                return Ok(StepOutcome::Wait { memory: serde_json::json!({}), message: format!("GPU {uuid} is held ({})", o.name()), recheck_s: 60.0 });
            }
        }
        Ok(StepOutcome::Done(serde_json::json!({})))
    }
}

/// Resets the GPU (`diag.nvml` with `reset`); the daemon refuses it under an allocation.
struct ResetStep;

#[async_trait::async_trait]
impl Step for ResetStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let uuid = gpu(cx);
        Ok(match command_step(cx, "diag.nvml", serde_json::json!({"level": 1, "gpuUuids": [uuid], "reset": true})).await? {
            Ok(c) => {
                let passed = c.result.as_ref().and_then(|r| r["gpus"].as_array()).and_then(|g| g.iter().find(|g| g["uuid"] == uuid.as_str())).map(|g| g["passed"] == true);
                StepOutcome::Done(serde_json::json!({"commandId": c.id, "passed": passed}))
            }
            Err(o) => o,
        })
    }

    async fn cancel(&self, cx: &StepContext<'_>) -> Result<(), DbError> {
        cancel_command(cx).await
    }
}

/// Hands the GPU back to the `health` job: its next check is due now.
struct RecheckStep;

#[async_trait::async_trait]
impl Step for RecheckStep {
    async fn advance(&self, cx: &StepContext<'_>) -> Result<StepOutcome, DbError> {
        let due = crate::health::check_now(cx.tx, cx.node_id, &gpu(cx)).await?;
        Ok(StepOutcome::Done(serde_json::json!({"checkDue": due})))
    }
}


/// `node.recover`.
pub struct Recover {
    steps: Vec<StepDef>,
}

/// The definition's name, for the `health` job.
pub const RECOVER: &str = "node.recover";

impl Recover {
    /// The definition with its steps.
    pub fn new() -> Recover {
        Recover {
            steps: vec![
                step("wait-free", "waits until nothing holds the GPU (a suspect GPU takes no new reservations)", WaitGpuFreeStep, 1, 0, 7 * 24 * 3600, OnFailure::Hold),
                step("reset", "resets the GPU and checks it (`diag.nvml` with `reset`)", ResetStep, 2, 60, 900, OnFailure::Hold),
                step("recheck", "makes the GPU's next health check due now: the `health` job decides from it", RecheckStep, 3, 10, 300, OnFailure::Hold),
            ],
        }
    }
}

impl Default for Recover {
    fn default() -> Self {
        Recover::new()
    }
}

#[async_trait::async_trait]
impl WorkflowDefinition for Recover {
    fn name(&self) -> &'static str {
        RECOVER
    }

    fn summary(&self) -> &'static str {
        "Resets a suspect GPU that something held when the `health` job wanted to reset it: waits until it is free, \
         resets and checks it, and hands it back to the `health` job. Targets one node; params: `gpuUuid` (required, a GPU of that node)."
    }

    fn steps(&self) -> &[StepDef] {
        &self.steps
    }

    fn check_params(&self, params: &serde_json::Value) -> Result<(), Error> {
        check_params(params, &["gpuUuid"])?;
        if text(params, "gpuUuid").is_none_or(|g| g.is_empty() || g.len() > 128) {
            return Err(Error::invalid_argument("params.gpuUuid is required: the GPU to reset"));
        }
        Ok(())
    }

    async fn check_target(&self, tx: &Transaction<'_>, target: &Target, params: &serde_json::Value) -> Result<(), DbError> {
        let Some(node_id) = target.node_id.as_deref() else {
            return Err(Error::invalid_argument("node.recover resets one GPU: target its node (target.nodeId)").into());
        };
        let gpu = text(params, "gpuUuid").unwrap_or_default();
        let found = tx.query_opt("SELECT 1 FROM devices WHERE id = $1 AND node_id = $2 AND parent_id IS NULL", &[&gpu, &node_id]).await?;
        if found.is_none() {
            return Err(Error::not_found("GPU", &format!("{gpu} on node {node_id}")).into());
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

