//! nodes.*, devices.*.

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_nodes::inventory::{self, NodeView};
use better_compute_nodes::listing::{self, IssuedJoinToken, NodeFilter};
use better_compute_nodes::actions;
use better_compute_nodes::inventory::devices;
use better_compute_nodes::drain::{self, DrainMode, DrainRequest, DrainView};
use better_compute_nodes::inventory::labels::{self, LabelSelector};
use better_compute_runtime::authz::Resource;
use serde::{Deserialize, Serialize};

use super::inventory::PoolRef;
use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeRef {
    /// `node_…`.
    node_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListNodes {
    /// Only this pool's nodes (needed unless you hold compute:nodes:read at fleet scope).
    #[serde(default)]
    pool_id: Option<String>,
    /// Only cordoned (true) or uncordoned (false) nodes.
    #[serde(default)]
    cordoned: Option<bool>,
    /// Only nodes in this liveness: connected, disconnected, unreachable or lost.
    #[serde(default)]
    liveness: Option<String>,
    /// Only nodes whose labels match, e.g. `rack=r1,gpu!=L4,ssd,!spot` (`key`: present, `!key`:
    /// absent, `key!=value`: absent or another value).
    #[serde(default)]
    label_selector: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Drain {
    /// `node_…`.
    node_id: String,
    /// Why (required; tenants see it when their reservations are evicted).
    reason: String,
    /// `wait` (default): reservations end by themselves. `evict`: their tenants are told now, and
    /// they are released at the deadline with endReason `drained`.
    #[serde(default)]
    mode: Option<DrainMode>,
    /// RFC 3339, mode `evict` only (default: an hour from now).
    #[serde(default)]
    deadline: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct UpdateNode {
    /// `node_…`.
    node_id: String,
    /// Labels to set (a string value) or remove (`null`); the others stay.
    labels: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListDevices {
    /// The GPUs of this node (give nodeId or poolId).
    #[serde(default)]
    node_id: Option<String>,
    /// The GPUs of this pool's nodes.
    #[serde(default)]
    pool_id: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListFindings {
    /// This pool's findings (give poolId or nodeId).
    #[serde(default)]
    pool_id: Option<String>,
    /// This node's findings.
    #[serde(default)]
    node_id: Option<String>,
    /// Also those no longer seen.
    #[serde(default)]
    include_resolved: bool,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

/// A pool's open drains in the order its budget admits them.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct DrainList {
    /// queued, draining and drained drains, oldest request first.
    items: Vec<DrainView>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Taint {
    /// `node_…`.
    node_id: String,
    /// The taint's key.
    key: String,
    /// Its value.
    #[serde(default)]
    value: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Untaint {
    /// `node_…`.
    node_id: String,
    /// The taint's key.
    key: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateJoinToken {
    /// The pool the daemon joins.
    pool_id: String,
    /// Lifetime in seconds, 60 s to 7 days (default 1 hour); `ttlSeconds` is accepted too.
    #[serde(default, alias = "ttlSeconds")]
    ttl_s: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Quarantine {
    /// The GPU's uuid.
    device_id: String,
    /// Why (required).
    reason: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DeviceRef {
    /// The GPU's uuid.
    device_id: String,
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct DeviceChanged {
    /// The GPU's uuid.
    device_id: String,
    /// Its node.
    node_id: String,
    /// Whether it is quarantined now.
    quarantined: bool,
}

/// Runs a change of one node in a transaction, then answers with the node.
async fn change_node(ctx: &Ctx, node_id: &str, f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<(), DbError>) -> Result<NodeView, Error> {
    ctx.check("compute:nodes:write", Resource::Node(node_id)).await?;
    ctx.in_tx(async |tx| {
        inventory::get_node(tx, node_id).await?;
        f(tx).await?;
        Ok(inventory::get_node(tx, node_id).await?)
    })
    .await
}

/// Someone who cannot see a GPU's node learns nothing of the GPU either, not even its node.
fn hide_device(e: Error, device_id: &str) -> Error {
    if e.code == better_compute_core::ErrorCode::NotFound { Error::not_found("device", device_id) } else { e }
}

async fn change_device(ctx: &Ctx, device_id: &str, quarantined: bool, reason: &str) -> Result<DeviceChanged, Error> {
    let node_id = listing::node_of_device(&*ctx.read().await?, device_id).await?;
    ctx.check("compute:devices:write", Resource::Node(&node_id)).await.map_err(|e| hide_device(e, device_id))?;
    ctx.in_tx(async |tx| {
        if quarantined {
            actions::quarantine(tx, device_id, reason).await?;
        } else {
            actions::release_quarantine(tx, device_id).await?;
        }
        Ok(())
    })
    .await?;
    Ok(DeviceChanged { device_id: device_id.to_owned(), node_id, quarantined })
}

#[allow(clippy::too_many_lines, reason = "the module's method table: one short registration per method, read as a list")]
pub(super) fn methods() -> Vec<Method> {
    vec![
        read("nodes.get", "Read a node.", "compute:nodes:read on the node", |ctx: Ctx, r: NodeRef| async move {
            ctx.check("compute:nodes:read", Resource::Node(&r.node_id)).await?;
            Ok(inventory::get_node(&*ctx.read().await?, &r.node_id).await?)
        }),
        read(
            "nodes.describe",
            "Describe a node: its conditions, GPUs and atoms, the reservations holding it now and next, its drain, its daemon's session, and its newest commands and fleet events.",
            "compute:nodes:read on the node",
            |ctx: Ctx, r: NodeRef| async move {
                ctx.check("compute:nodes:read", Resource::Node(&r.node_id)).await?;
                crate::describe::node(&*ctx.read().await?, &r.node_id).await
            },
        ),
        read("nodes.list", "List nodes, of one pool or of the fleet, filtered.", "compute:nodes:read on the pool, or at fleet scope without poolId", |ctx: Ctx, r: ListNodes| async move {
            match &r.pool_id {
                Some(p) => ctx.check("compute:nodes:read", Resource::Pool(p)).await?,
                None => ctx.check("compute:nodes:read", Resource::Fleet).await?,
            }
            if let Some(l) = &r.liveness && !["connected", "disconnected", "unreachable", "lost"].contains(&l.as_str()) {
                return Err(Error::invalid_argument("liveness must be connected, disconnected, unreachable or lost"));
            }
            let labels = r.label_selector.as_deref().map(LabelSelector::parse).transpose()?;
            let f = NodeFilter { pool_id: r.pool_id.as_deref(), cordoned: r.cordoned, liveness: r.liveness.as_deref(), labels };
            listing::list_nodes(&*ctx.read().await?, &f, &super::page(r.page_size, r.page_token)).await
        }),
        change("nodes.cordon", "Cordon a node: nothing new is placed there.", "compute:nodes:write on the node", |ctx: Ctx, r: NodeRef| async move {
            change_node(&ctx, &r.node_id, async |tx| actions::cordon(tx, &r.node_id).await.map(|_| ())).await
        }),
        change("nodes.uncordon", "Uncordon a node.", "compute:nodes:write on the node", |ctx: Ctx, r: NodeRef| async move {
            change_node(&ctx, &r.node_id, async |tx| actions::uncordon(tx, &r.node_id).await.map(|_| ())).await
        }),
        change("nodes.taint", "Taint a node: only reservations that tolerate key=value are placed there.", "compute:nodes:write on the node", |ctx: Ctx, r: Taint| async move {
            change_node(&ctx, &r.node_id, async |tx| actions::taint(tx, &r.node_id, &r.key, &r.value).await).await
        }),
        change("nodes.untaint", "Remove a node's taint.", "compute:nodes:write on the node", |ctx: Ctx, r: Untaint| async move {
            change_node(&ctx, &r.node_id, async |tx| actions::untaint(tx, &r.node_id, &r.key).await).await
        }),
        change("nodes.update", "Set or remove a node's labels.", "compute:nodes:write on the node", |ctx: Ctx, r: UpdateNode| async move {
            change_node(&ctx, &r.node_id, async |tx| labels::update_labels(tx, &r.node_id, &r.labels).await.map(|_| ())).await
        }),
        change(
            "nodes.drain",
            "Drain a node: cordon it now, then (within its pool's disruption budget, in request order) wait for its reservations to end, or evict them at the deadline.",
            "compute:nodes:write on the node",
            |ctx: Ctx, r: Drain| async move {
                ctx.check("compute:nodes:write", Resource::Node(&r.node_id)).await?;
                let by = format!("{}/{}", ctx.principal.tenant_id, ctx.principal.identity_id);
                let req = DrainRequest { node_id: &r.node_id, reason: &r.reason, mode: r.mode.unwrap_or(DrainMode::Wait), deadline: r.deadline.as_deref(), requested_by: &by };
                ctx.in_tx(async |tx| -> Result<DrainView, Error> { Ok(drain::request(tx, &req).await?) }).await
            },
        ),
        change("nodes.undrain", "End a node's drain: it is schedulable again unless cordoned otherwise. Reservations already evicted stay ended.", "compute:nodes:write on the node", |ctx: Ctx, r: NodeRef| async move {
            change_node(&ctx, &r.node_id, async |tx| drain::undrain(tx, &r.node_id).await.map(|_| ())).await
        }),
        change("nodes.retire", "Retire a drained node: out of placement for ever, its certificates revoked, its history kept.", "compute:nodes:write on the node", |ctx: Ctx, r: NodeRef| async move {
            change_node(&ctx, &r.node_id, async |tx| drain::retire(tx, &r.node_id).await).await
        }),
        read("drains.list", "List a pool's open drains, in the order its disruption budget admits them.", "compute:nodes:read on the pool", |ctx: Ctx, r: PoolRef| async move {
            ctx.check("compute:nodes:read", Resource::Pool(&r.pool_id)).await?;
            let db = ctx.read().await?;
            listing::get_pool(&*db, &r.pool_id).await?;
            Ok(DrainList { items: drain::pool_drains(&*db, &r.pool_id).await? })
        }),
        read("devices.get", "Read a GPU: its mode, layout, atoms, health and quarantine.", "compute:nodes:read on its node", |ctx: Ctx, r: DeviceRef| async move {
            let node_id = listing::node_of_device(&*ctx.read().await?, &r.device_id).await?;
            ctx.check("compute:nodes:read", Resource::Node(&node_id)).await.map_err(|e| hide_device(e, &r.device_id))?;
            devices::get_device(&*ctx.read().await?, &r.device_id).await
        }),
        read("devices.list", "List the GPUs of a node or of a pool.", "compute:nodes:read on the node or pool", |ctx: Ctx, r: ListDevices| async move {
            match (&r.node_id, &r.pool_id) {
                (Some(n), None) => ctx.check("compute:nodes:read", Resource::Node(n)).await?,
                (None, Some(p)) => ctx.check("compute:nodes:read", Resource::Pool(p)).await?,
                _ => return Err(Error::invalid_argument("give exactly one of nodeId and poolId")),
            }
            let page = super::page(r.page_size, r.page_token);
            devices::list_devices(&*ctx.read().await?, r.node_id.as_deref(), r.pool_id.as_deref(), &page).await
        }),
        read(
            "inventory.findings",
            "List what the inventory jobs found wrong in a pool or on a node: GPUs gone, unknown or changed, resources below registration, duplicate GPUs, retired nodes still held, expired join tokens, certificates about to expire, nodes that never converged.",
            "compute:nodes:read on the pool or node",
            |ctx: Ctx, r: ListFindings| async move {
                match (&r.pool_id, &r.node_id) {
                    (Some(p), None) => ctx.check("compute:nodes:read", Resource::Pool(p)).await?,
                    (None, Some(n)) => ctx.check("compute:nodes:read", Resource::Node(n)).await?,
                    _ => return Err(Error::invalid_argument("give exactly one of poolId and nodeId")),
                }
                let page = super::page(r.page_size, r.page_token);
                better_compute_nodes::inventory::findings::list(&*ctx.read().await?, r.pool_id.as_deref(), r.node_id.as_deref(), r.include_resolved, &page).await
            },
        ),
        change("nodes.createJoinToken", "Issue a single-use join token for a pool. The secret is in this response only.", "compute:nodes:write on the pool", |ctx: Ctx, r: CreateJoinToken| async move {
            ctx.check("compute:nodes:write", Resource::Pool(&r.pool_id)).await?;
            let by = format!("{}/{}", ctx.principal.tenant_id, ctx.principal.identity_id);
            ctx.in_tx(async |tx| -> Result<IssuedJoinToken, Error> { listing::create_join_token(tx, &r.pool_id, r.ttl_s, &by).await }).await
        }),
        change("devices.quarantine", "Quarantine a GPU: nothing new is placed on it; existing reservations keep it.", "compute:devices:write on its node", |ctx: Ctx, r: Quarantine| async move {
            change_device(&ctx, &r.device_id, true, &r.reason).await
        }),
        change("devices.releaseQuarantine", "Release a GPU from quarantine.", "compute:devices:write on its node", |ctx: Ctx, r: DeviceRef| async move {
            change_device(&ctx, &r.device_id, false, "").await
        }),
    ]
}
