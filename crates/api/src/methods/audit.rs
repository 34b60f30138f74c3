//! audit.*: reading the audit log (a tenant's own entries, or every entry at fleet scope), its
//! checkpoints, and proofs of an entry's inclusion.

use better_compute_audit::checkpoint::CheckpointView;
use better_compute_audit::entry::Entry;
use better_compute_audit::log::{self, Filter, Proof};
use better_compute_core::page::Page;
use better_compute_core::Error;
use better_compute_runtime::authz::Resource;
use serde::Deserialize;

use crate::method::{read, Ctx};
use crate::Method;

/// Reading the audit log.
const READ: &str = "compute:audit:read";

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListEntries {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Every tenant's entries and the fleet's (needs compute:audit:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// Only this actor: an identity, or a job's kind.
    #[serde(default)]
    actor_id: Option<String>,
    /// Only this action (a method, or a job's decision).
    #[serde(default)]
    action: Option<String>,
    /// Only this target.
    #[serde(default)]
    target: Option<String>,
    /// RFC 3339: entries at or after it.
    #[serde(default)]
    from: Option<String>,
    /// RFC 3339: entries before it.
    #[serde(default)]
    to: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EntryRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Any tenant's entry, or the fleet's (needs compute:audit:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// `aud_…`.
    entry_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ProveEntry {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Any tenant's entry, or the fleet's (needs compute:audit:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// `aud_…`.
    entry_id: String,
    /// The checkpoint (its tree size) to prove the entry in.
    tree_size: i64,
    /// An earlier checkpoint (its tree size) to prove that one consistent with.
    #[serde(default)]
    consistent_with: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListCheckpoints {
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

/// The tenant whose entries the caller may read: its own, or every one (`None`) at fleet scope.
async fn scope(ctx: &Ctx, asked: Option<&str>, all_tenants: bool) -> Result<Option<String>, Error> {
    super::tenant_or_fleet(ctx, asked, all_tenants, READ).await
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        read(
            "audit.list",
            "List audit entries, oldest first: your tenant's (who did what, with which token, from where, and how it ended), or every entry with allTenants; filter by actor, action, target and time.",
            "compute:audit:read at the tenant (at fleet scope with allTenants)",
            |ctx: Ctx, r: ListEntries| async move {
                let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
                let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
                let f = Filter {
                    tenant_id: tenant.as_deref(),
                    actor_id: r.actor_id.as_deref(),
                    action: r.action.as_deref(),
                    target: r.target.as_deref(),
                    from: r.from.as_deref(),
                    to: r.to.as_deref(),
                };
                let items = log::list(&*ctx.read().await?, &f, &after, size).await?;
                Ok(Page::from_rows(items, size, |e: &Entry| e.id.clone()))
            },
        ),
        read("audit.get", "Read an audit entry: with its log index and chain hash once audit.checkpoint placed it.", "compute:audit:read at the tenant (at fleet scope with allTenants)", |ctx: Ctx, r: EntryRef| async move {
            let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
            log::get(&*ctx.read().await?, &r.entry_id, tenant.as_deref()).await
        }),
        read(
            "audit.checkpoints.list",
            "List the audit log's checkpoints, smallest first: each one's size, Merkle root, last chain hash and Ed25519 signature by the control plane's key.",
            "compute:audit:read at the tenant or at fleet scope",
            |ctx: Ctx, r: ListCheckpoints| async move {
                if ctx.check(READ, Resource::Fleet).await.is_err() {
                    ctx.check(READ, Resource::Tenant).await?;
                }
                let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
                let after: i64 = if after.is_empty() { 0 } else { after.parse().map_err(|_| Error::invalid_argument("pageToken is not one this method gave"))? };
                let items = log::checkpoints(&*ctx.read().await?, after, size).await?;
                Ok(Page::from_rows(items, size, |c: &CheckpointView| c.tree_size.to_string()))
            },
        ),
        read(
            "audit.proof",
            "Prove an audit entry is in a checkpoint (its RFC 6962 inclusion path), and that checkpoint consistent with an earlier one (consistentWith): check them against the checkpoints' signed roots.",
            "compute:audit:read at the tenant (at fleet scope with allTenants)",
            |ctx: Ctx, r: ProveEntry| async move {
                let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
                let p: Proof = log::proof(&*ctx.read().await?, &r.entry_id, tenant.as_deref(), r.tree_size, r.consistent_with).await?;
                Ok(p)
            },
        ),
    ]
}
