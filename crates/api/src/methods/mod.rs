//! Every method, one module per resource. Each handler checks the caller's permission, then calls
//! the module that owns the logic; none holds business rules of its own.

mod audit;
mod capacity;
mod commands;
mod iam;
mod instances;
mod inventory;
mod jobs;
mod nodes;
mod usage;
mod webhooks;
mod workflows;

use better_compute_core::page::PageRequest;
use serde::Deserialize;

use crate::Method;

pub(crate) use usage::scope as usage_scope;

/// Every method.
pub(crate) fn all() -> Vec<Method> {
    let mut v = Vec::new();
    v.extend(iam::methods());
    v.extend(inventory::methods());
    v.extend(nodes::methods());
    v.extend(capacity::methods());
    v.extend(instances::methods());
    v.extend(commands::methods());
    v.extend(usage::methods());
    v.extend(webhooks::methods());
    v.extend(workflows::methods());
    v.extend(audit::methods());
    v.extend(jobs::methods());
    v
}

/// A request with no fields.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Empty {}

/// A request with only the optional tenant and a page.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct TenantPage {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    pub page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    pub page_token: Option<String>,
}

impl TenantPage {
    pub(crate) fn page(&self) -> PageRequest {
        page(self.page_size, self.page_token.clone())
    }
}

/// The key a method requires (`reservations.create`, `reservations.extend`), checked after the
/// caller's permission and before anything is read or written.
pub(crate) fn required_key<'a>(key: Option<&'a str>, method: &str) -> Result<&'a str, better_compute_core::Error> {
    let key = key.ok_or_else(|| {
        better_compute_core::Error::invalid_argument(format!(
            "idempotencyKey is required on {method}: a retry with the same key returns the first result instead of acting twice"
        ))
    })?;
    better_compute_db::idempotency::validate_key(key)?;
    Ok(key)
}

/// A page request from a method's `pageSize` and `pageToken`.
pub(crate) fn page(size: Option<i64>, token: Option<String>) -> PageRequest {
    PageRequest { page_size: size, page_token: token }
}

/// The tenant whose records (usage, audit entries) the caller may read with `permission`: its own,
/// or every tenant's (`None`) with `allTenants` at fleet scope.
pub(crate) async fn tenant_or_fleet(ctx: &crate::method::Ctx, asked: Option<&str>, all_tenants: bool, permission: &str) -> Result<Option<String>, better_compute_core::Error> {
    if all_tenants {
        ctx.own_tenant(asked)?;
        ctx.check(permission, better_compute_runtime::authz::Resource::Fleet).await?;
        Ok(None)
    } else {
        ctx.in_tenant(asked, permission).await?;
        Ok(Some(ctx.principal.tenant_id.clone()))
    }
}
