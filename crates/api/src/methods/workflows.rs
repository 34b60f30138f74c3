//! workflows.*: multi-step operations on nodes (maintenance, recovery), advanced by the `workflow`
//! job. Authorized at what they target: the node, the pool, or the fleet for a label selector.

use better_compute_core::page::Page;
use better_compute_core::Error;
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::DbError;
use better_compute_runtime::authz::Resource;
use better_compute_workflows::{self as workflow, ListFilter, NewWorkflow, Target, WorkflowView, READ, WRITE};
use serde::Deserialize;

use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct StartWorkflow {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// A registered definition: `node.maintenance` or `node.recover`.
    #[schemars(extend("enum" = ["node.maintenance", "node.recover"]))]
    definition: String,
    /// `{nodeId}` for one node; `{poolId}` and/or `{labels}` for a fleet-wide run, one node after
    /// another (`params.parallel` at a time), holding on the first node that fails.
    target: Target,
    /// The definition's parameters, and `parallel` (1-64) for a fleet-wide run.
    #[serde(default)]
    params: Option<serde_json::Value>,
    /// Required; scoped to the caller's tenant and identity.
    #[serde(default)]
    idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WorkflowRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `wf_…`.
    workflow_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ResumeWorkflow {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `wf_…`.
    workflow_id: String,
    /// The step to run again from (an earlier one repeats, a later one skips those between);
    /// default the step it holds at.
    #[serde(default)]
    from_step: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListWorkflows {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Only this node's workflows.
    #[serde(default)]
    node_id: Option<String>,
    /// Only workflows authorized at this pool (its nodes' and fleet-wide runs over it).
    #[serde(default)]
    pool_id: Option<String>,
    /// Only this fleet-wide run's children.
    #[serde(default)]
    parent_id: Option<String>,
    /// Only these states.
    #[serde(default)]
    #[schemars(extend("items" = {"enum": ["running", "held", "cancelling", "succeeded", "failed", "cancelled"]}))]
    states: Option<Vec<String>>,
    /// Only this definition.
    #[serde(default)]
    definition: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

/// Reads the workflow and checks `permission` where it is authorized; a caller without it learns
/// nothing (NOT_FOUND or PERMISSION_DENIED, as IAM decides).
async fn visible(ctx: &Ctx, id: &str, permission: &str) -> Result<WorkflowView, Error> {
    let w = workflow::get(&*ctx.read().await?, id).await?;
    let (n, p) = (w.node_id.clone(), w.pool_id.clone());
    check_at(ctx, permission, n.as_deref(), p.as_deref()).await?;
    Ok(w)
}

async fn check_at(ctx: &Ctx, permission: &str, node_id: Option<&str>, pool_id: Option<&str>) -> Result<(), Error> {
    let r = match (node_id, pool_id) {
        (Some(n), _) => Resource::Node(n),
        (None, Some(p)) => Resource::Pool(p),
        _ => Resource::Fleet,
    };
    ctx.check(permission, r).await
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change(
            "workflows.start",
            "Start a workflow (node.maintenance, node.recover) on a node, or fleet-wide on a pool or label selector.",
            "compute:workflows:write on the node, pool or fleet it targets",
            |ctx: Ctx, r: StartWorkflow| async move {
                ctx.own_tenant(r.tenant_id.as_deref())?;
                check_at(&ctx, WRITE, r.target.node_id.as_deref(), r.target.pool_id.as_deref()).await?;
                let key = super::required_key(r.idempotency_key.as_deref(), "workflows.start")?;
                let registry = ctx.state.registry.clone();
                if registry.workflow(&r.definition).is_some_and(|d| !d.api_allowed()) {
                    return Err(Error::new(better_compute_core::ErrorCode::Unsupported, format!("{} is started by its job only", r.definition)));
                }
                let params = r.params.clone().unwrap_or_else(|| serde_json::json!({}));
                let by = format!("{}/{}", ctx.principal.tenant_id, ctx.principal.identity_id);
                let caller = ctx.caller();
                let scope = IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key };
                let request = serde_json::json!({"definition": r.definition, "target": r.target, "params": params});
                let mut db = ctx.db().await?;
                let tx = (**db).transaction().await.map_err(DbError::from)?;
                if let Claim::Replay(v) = idempotency::claim(&tx, scope, "workflows.start", &request).await? {
                    let w = workflow::get(&tx, v["id"].as_str().unwrap_or_default()).await?;
                    tx.commit().await.map_err(DbError::from)?;
                    return Ok(w);
                }
                let w = NewWorkflow { definition: &r.definition, target: &r.target, params: &params, requested_by: &by };
                let v = workflow::start(&tx, &registry, &w).await?;
                idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("a view serializes")).await?;
                ctx.actor.record(&tx, "workflows.start", &v.id, None).await?;
                tx.commit().await.map_err(DbError::from)?;
                better_compute_runtime::work_queue::poke(&db).await;
                Ok(v)
            },
        ),
        read("workflows.get", "Read a workflow and its steps.", "compute:workflows:read on its node, pool or the fleet", |ctx: Ctx, r: WorkflowRef| async move {
            ctx.own_tenant(r.tenant_id.as_deref())?;
            visible(&ctx, &r.workflow_id, READ).await
        }),
        read(
            "workflows.list",
            "List workflows of a node, a pool or the fleet, oldest first; filter by state, definition or fleet-wide run.",
            "compute:workflows:read on the node or pool (the fleet without either)",
            |ctx: Ctx, r: ListWorkflows| async move {
                ctx.own_tenant(r.tenant_id.as_deref())?;
                check_at(&ctx, READ, r.node_id.as_deref(), r.pool_id.as_deref()).await?;
                let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
                let filter = ListFilter { node_id: r.node_id, pool_id: r.pool_id, parent_id: r.parent_id, states: r.states, definition: r.definition };
                let items = workflow::list(&*ctx.read().await?, &filter, &after, size).await?;
                Ok(Page::from_rows(items, size, |w: &WorkflowView| w.id.clone()))
            },
        ),
        change(
            "workflows.cancel",
            "Cancel a running or held workflow: the current step's command is cancelled through the command queue; what earlier steps did stays (a drained node stays drained).",
            "compute:workflows:write on its node, pool or the fleet",
            |ctx: Ctx, r: WorkflowRef| async move {
                ctx.own_tenant(r.tenant_id.as_deref())?;
                visible(&ctx, &r.workflow_id, WRITE).await?;
                let by = format!("{}/{}", ctx.principal.tenant_id, ctx.principal.identity_id);
                let v = ctx.in_tx(async |tx| -> Result<WorkflowView, Error> { Ok(workflow::cancel(tx, &r.workflow_id, &by).await?) }).await?;
                better_compute_runtime::work_queue::poke(&**ctx.db().await?).await;
                Ok(v)
            },
        ),
        change(
            "workflows.resume",
            "Resume a held workflow from the step it holds at, or from fromStep.",
            "compute:workflows:write on its node, pool or the fleet",
            |ctx: Ctx, r: ResumeWorkflow| async move {
                ctx.own_tenant(r.tenant_id.as_deref())?;
                visible(&ctx, &r.workflow_id, WRITE).await?;
                let by = format!("{}/{}", ctx.principal.tenant_id, ctx.principal.identity_id);
                let registry = ctx.state.registry.clone();
                let v = ctx
                    .in_tx(async |tx| -> Result<WorkflowView, Error> { Ok(workflow::resume(tx, &registry, &r.workflow_id, r.from_step.as_deref(), &by).await?) })
                    .await?;
                better_compute_runtime::work_queue::poke(&**ctx.db().await?).await;
                Ok(v)
            },
        ),
    ]
}
