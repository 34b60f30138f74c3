//! commands.*: one-shot work on a node, through the node's command queue.

use better_compute_core::Error;
use better_compute_nodes::commands::{self, CommandView, RunCommand, EXEC, READ};
use better_compute_nodes::listing;
use better_compute_runtime::authz::Resource;
use serde::Deserialize;

use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CommandRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `node_…`.
    node_id: String,
    /// `cmd_…`.
    command_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListCommands {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `node_…`.
    node_id: String,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

/// A command is its requesting tenant's: anyone else gets NOT_FOUND, as for a command that does
/// not exist.
async fn own_command(ctx: &Ctx, node_id: &str, command_id: &str) -> Result<(), Error> {
    if !listing::command_is_tenants(&*ctx.read().await?, node_id, command_id, &ctx.principal.tenant_id).await? {
        return Err(Error::not_found("command", command_id));
    }
    Ok(())
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change("commands.run", "Run diag.nvml, inventory.refresh, logs.collect or node.reboot on a node.", "compute:nodes:exec on the node", |ctx: Ctx, mut r: RunCommand| async move {
            ctx.own_tenant(r.tenant_id.take().as_deref())?;
            // Before anything else: a caller who may not run commands learns nothing of the input.
            ctx.check(EXEC, Resource::Node(&r.node_id)).await?;
            let mut db = ctx.db().await?;
            let registry = ctx.state.registry.clone();
            commands::run(&mut db, &registry, &ctx.actor, ctx.caller(), &r).await
        }),
        read("commands.get", "Read a command your tenant ran.", "compute:nodes:read on the node", |ctx: Ctx, r: CommandRef| async move {
            ctx.own_tenant(r.tenant_id.as_deref())?;
            ctx.check(READ, Resource::Node(&r.node_id)).await?;
            own_command(&ctx, &r.node_id, &r.command_id).await?;
            Ok(commands::get(&*ctx.read().await?, &r.node_id, &r.command_id).await?)
        }),
        read("commands.list", "List the commands your tenant ran on a node.", "compute:nodes:read on the node", |ctx: Ctx, r: ListCommands| async move {
            ctx.own_tenant(r.tenant_id.as_deref())?;
            ctx.check(READ, Resource::Node(&r.node_id)).await?;
            let page = super::page(r.page_size, r.page_token);
            listing::list_commands(&*ctx.read().await?, &r.node_id, &ctx.principal.tenant_id, &page).await
        }),
        change("commands.cancel", "Cancel a command your tenant ran: pending ones never run, in-flight ones are told to stop.", "compute:nodes:exec on the node", |ctx: Ctx, r: CommandRef| async move {
            ctx.own_tenant(r.tenant_id.as_deref())?;
            ctx.check(EXEC, Resource::Node(&r.node_id)).await?;
            own_command(&ctx, &r.node_id, &r.command_id).await?;
            let mut db = ctx.db().await?;
            let v: CommandView = commands::cancel_by(&mut db, &ctx.actor, ctx.caller(), &r.node_id, &r.command_id).await?;
            Ok(v)
        }),
    ]
}
