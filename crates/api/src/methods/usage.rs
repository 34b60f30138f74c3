//! usage.*: metered usage, read by tenants (their own) and operators (every tenant's).

use better_compute_capacity::usage::{self, GroupBy, UsageSum, UsageWindowView};
use better_compute_vps::usage::{self as instance_usage, InstanceGroupBy, InstanceUsageSum, InstanceUsageWindowView};
use better_compute_core::page::Page;
use better_compute_core::Error;
use serde::{Deserialize, Serialize};

use crate::method::{read, Ctx};
use crate::Method;

/// Reading usage.
const READ: &str = "compute:usage:read";

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListUsage {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Every tenant's usage (needs compute:usage:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// RFC 3339: windows starting at or after it.
    from: String,
    /// RFC 3339: windows starting before it.
    to: String,
    /// How to sum: per reservation, pool, model (atom class) or UTC day.
    group_by: GroupBy,
    /// The most groups to answer, 1 to 10000 (default 1000).
    #[serde(default)]
    limit: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ExportUsage {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Every tenant's usage (needs compute:usage:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// RFC 3339: windows starting at or after it.
    from: String,
    /// RFC 3339: windows starting before it.
    to: String,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListInstanceUsage {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Every tenant's usage (needs compute:usage:read at fleet scope).
    #[serde(default)]
    all_tenants: bool,
    /// RFC 3339: windows starting at or after it.
    from: String,
    /// RFC 3339: windows starting before it.
    to: String,
    /// How to sum: per instance, pool, flavour or UTC day.
    group_by: InstanceGroupBy,
    /// The most groups to answer, 1 to 10000 (default 1000).
    #[serde(default)]
    limit: Option<i64>,
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct InstanceUsageList {
    /// The sums, by tenant then group.
    items: Vec<InstanceUsageSum>,
    /// The fleet's window size in seconds.
    window_s: i32,
}

fn limit_of(limit: Option<i64>) -> Result<i64, Error> {
    let limit = limit.unwrap_or(1000);
    if !(1..=10_000).contains(&limit) {
        return Err(Error::invalid_argument("limit must be between 1 and 10000"));
    }
    Ok(limit)
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
struct UsageList {
    /// The sums, by tenant then group.
    items: Vec<UsageSum>,
    /// The fleet's window size in seconds.
    window_s: i32,
}

/// The tenant whose usage the caller may read: its own, or every tenant's (`None`) at fleet scope.
pub(crate) async fn scope(ctx: &Ctx, asked: Option<&str>, all_tenants: bool) -> Result<Option<String>, Error> {
    super::tenant_or_fleet(ctx, asked, all_tenants, READ).await
}

pub(super) fn methods() -> Vec<Method> {
    vec![read(
        "usage.list",
        "Sum usage windows (reserved atom-, vCPU-, memory- and disk-seconds) of your tenant, or of every tenant, by reservation, pool, model or day.",
        "compute:usage:read at the tenant (at fleet scope with allTenants)",
        |ctx: Ctx, r: ListUsage| async move {
            let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
            let limit = limit_of(r.limit)?;
            let db = ctx.read().await?;
            let items = usage::list(&*db, tenant.as_deref(), &r.from, &r.to, r.group_by, limit).await?;
            Ok(UsageList { items, window_s: usage::window_s(&*db).await? })
        },
    ),
    read(
        "usage.export",
        "Export usage windows and adjustments one by one, in billing-key order, a page at a time as JSON (`GET /v1/usage.export` streams the whole period as CSV or JSON lines).",
        "compute:usage:read at the tenant (at fleet scope with allTenants)",
        |ctx: Ctx, r: ExportUsage| async move {
            let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
            let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
            let items = usage::export_page(&*ctx.read().await?, tenant.as_deref(), &r.from, &r.to, &after, size).await?;
            Ok(Page::from_rows(items, size, |w: &UsageWindowView| w.key.clone()))
        },
    ),
    read(
        "instanceUsage.list",
        "Sum instance usage windows (the seconds instances' VMs were up) of your tenant, or of every tenant, by instance, pool, flavour or day.",
        "compute:usage:read at the tenant (at fleet scope with allTenants)",
        |ctx: Ctx, r: ListInstanceUsage| async move {
            let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
            let limit = limit_of(r.limit)?;
            let db = ctx.read().await?;
            let items = instance_usage::list(&*db, tenant.as_deref(), &r.from, &r.to, r.group_by, limit).await?;
            Ok(InstanceUsageList { items, window_s: usage::window_s(&*db).await? })
        },
    ),
    read(
        "instanceUsage.export",
        "Export instance usage windows one by one (`cmp:<instanceId>:<windowStart>`, with the instance's flavour and its seconds up), in billing-key order, a page at a time.",
        "compute:usage:read at the tenant (at fleet scope with allTenants)",
        |ctx: Ctx, r: ExportUsage| async move {
            let tenant = scope(&ctx, r.tenant_id.as_deref(), r.all_tenants).await?;
            let (size, after) = super::page(r.page_size, r.page_token.clone()).bounds()?;
            let items = instance_usage::export_page(&*ctx.read().await?, tenant.as_deref(), &r.from, &r.to, &after, size).await?;
            Ok(Page::from_rows(items, size, |w: &InstanceUsageWindowView| w.key.clone()))
        },
    )]
}
