//! instances.*: VMs on the tenant's reservations in vps-host pools; vpsHosts.list: the hosts, for
//! operators.

use better_compute_core::page::Page;
use better_compute_runtime::authz::Resource;
use better_compute_vps::instances::{self, Action, CreateInstance, InstanceView};
use serde::Deserialize;

use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct InstanceRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `ins_…`.
    instance_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConsoleRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `ins_…`.
    instance_id: String,
    /// The byte to start from (a previous answer's `nextOffset`); all that is kept when absent.
    #[serde(default)]
    offset: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListInstances {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Deleted instances too.
    #[serde(default)]
    include_deleted: bool,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ImageRef {
    /// The image's name.
    name: String,
}

#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct ImageList {
    /// The catalogue, by name.
    items: Vec<better_compute_vps::images::ImageView>,
}

#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct Deleted {
    /// The image's name.
    name: String,
}

#[derive(Debug, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct HostList {
    /// The hosts, by node.
    items: Vec<better_compute_vps::hosts::HostView>,
}

fn action(summary: &'static str, a: Action) -> Method {
    change(a.method(), summary, "compute:instances:write at tenant scope", move |ctx: Ctx, r: InstanceRef| async move {
        ctx.in_tenant(r.tenant_id.as_deref(), "compute:instances:write").await?;
        let mut db = ctx.db().await?;
        instances::act(&mut db, &ctx.actor, ctx.caller(), &r.instance_id, a).await
    })
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change(
            "instances.create",
            "Create a VM on a reservation of yours in a vps-host pool (reservationId), or on a new one reserved in the same transaction (poolId, gpu, vcpu, memoryMib, diskGib, durationS): its GPUs passed through, your SSH keys in the guest. Once per idempotency key; one live instance per reservation (CONFLICT).",
            "compute:instances:create at tenant scope (and compute:reservations:create for a new reservation)",
            |ctx: Ctx, r: CreateInstance| async move {
                ctx.in_tenant(r.tenant_id.as_deref(), "compute:instances:create").await?;
                if r.reservation_id.is_none() {
                    ctx.check("compute:reservations:create", Resource::Tenant).await?;
                }
                let mut db = ctx.db().await?;
                instances::create(&mut db, &ctx.actor, ctx.caller(), &r).await
            },
        ),
        read("instances.get", "Read an instance of your tenant: its state, and once running the address to SSH to and the guest's host key fingerprint.", "compute:instances:read at tenant scope", |ctx: Ctx, r: InstanceRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:instances:read").await?;
            instances::get(&*ctx.read().await?, ctx.caller(), &r.instance_id).await
        }),
        read("instances.list", "List your tenant's instances (deleted ones with includeDeleted).", "compute:instances:read at tenant scope", |ctx: Ctx, r: ListInstances| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), "compute:instances:read").await?;
            let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
            let items = instances::list(&*ctx.read().await?, ctx.caller(), &after, size, r.include_deleted).await?;
            Ok(Page::from_rows(items, size, |v: &InstanceView| v.id.clone()))
        }),
        read(
            "instances.console",
            "Read an instance's serial console: what is kept of it (the last 64 KiB its host sent) from offset, or all of it. GET /v1/instances.console?instanceId=… streams it as Server-Sent Events.",
            "compute:instances:console at tenant scope",
            |ctx: Ctx, r: ConsoleRef| async move {
                ctx.in_tenant(r.tenant_id.as_deref(), crate::console::CONSOLE).await?;
                instances::console(&*ctx.read().await?, ctx.caller(), &r.instance_id, r.offset).await
            },
        ),
        action("Stop an instance, keeping its disk (a stopped one stays stopped).", Action::Stop),
        action("Start a stopped instance (a running one stays running).", Action::Start),
        action("Restart a running instance once.", Action::Reboot),
        action("Delete an instance and its disk; its reservation stays yours.", Action::Delete),
        read(
            "vpsImages.list",
            "List the base image catalogue: the images instances may boot, with where hosts fetch them and their sha256.",
            "compute:instances:create at tenant scope, or compute:pools:read at fleet scope",
            |ctx: Ctx, _r: super::Empty| async move {
                if ctx.check("compute:pools:read", Resource::Fleet).await.is_err() {
                    ctx.check("compute:instances:create", Resource::Tenant).await?;
                }
                Ok(ImageList { items: better_compute_vps::images::list(&*ctx.read().await?).await? })
            },
        ),
        change(
            "vpsImages.set",
            "Add an image to the base image catalogue, or change its url or sha256: every vps host fetches it (used only if its bytes hash to sha256) and is degraded until it has it. Setting what is there changes nothing.",
            "compute:pools:write at fleet scope",
            |ctx: Ctx, r: better_compute_vps::images::SetImage| async move {
                ctx.check("compute:pools:write", Resource::Fleet).await?;
                ctx.in_tx(async |tx| better_compute_vps::images::set(tx, &r).await).await
            },
        ),
        change(
            "vpsImages.delete",
            "Take an image out of the catalogue: hosts are no longer held to have it (their cached copy stays, for the VMs made from it).",
            "compute:pools:write at fleet scope",
            |ctx: Ctx, r: ImageRef| async move {
                ctx.check("compute:pools:write", Resource::Fleet).await?;
                ctx.in_tx(async |tx| better_compute_vps::images::delete(tx, &r.name).await).await?;
                Ok(Deleted { name: r.name })
            },
        ),
        read(
            "vpsHosts.list",
            "List the vps hosts: each one's state (bootstrapping, ready, degraded, draining) with the reasons, its last vps.bootstrap report and what it has left for new instances.",
            "compute:nodes:read at fleet scope",
            |ctx: Ctx, _r: super::Empty| async move {
                ctx.check("compute:nodes:read", Resource::Fleet).await?;
                Ok(HostList { items: better_compute_vps::hosts::list(&*ctx.read().await?).await? })
            },
        ),
    ]
}
