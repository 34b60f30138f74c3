//! The engine's own step of a fleet-wide run (a pool or a label selector): one child workflow per
//! node, `parallel` at a time, holding on the first child that fails.

use std::sync::Arc;

use better_compute_core::id::WorkflowId;
use better_compute_db::DbError;
use better_compute_runtime::workflow::{OnFailure, Step, StepContext, StepDef, StepOutcome, Target};

use crate::lifecycle::{cancel, insert, NewWorkflow};
use crate::MAX_FLEET_NODES;

/// A fleet-wide run's own step.
pub(crate) const FLEET_STEP: &str = "nodes";

/// The engine's own step of a fleet-wide run: one child per node, `parallel` at a time.
struct FleetStep;

/// The one step of a fleet-wide run.
pub(crate) fn fleet_steps() -> Vec<StepDef> {
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
