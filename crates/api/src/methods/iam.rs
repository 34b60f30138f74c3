//! tenants.*, identities.*, tokens.*, roleBindings.*, roles.list.

use better_compute_core::Error;
use better_compute_iam::bindings::{self, NewBinding, RoleBindingView, RoleView};
use better_compute_iam::bootstrap::tenant_with_admin;
use better_compute_iam::directory;
use better_compute_iam::tokens::{self, IssuedToken, TokenView};
use better_compute_iam::{BINDINGS_READ, BINDINGS_WRITE, IDENTITIES_READ, IDENTITIES_WRITE, TENANTS_READ, TENANTS_WRITE};
use better_compute_runtime::authz::Resource;
use serde::{Deserialize, Serialize};

use super::{page, Empty, TenantPage};
use crate::method::{change, read, Ctx};
use crate::Method;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateTenant {
    /// Lowercase letters, digits and dashes.
    name: String,
    /// The name of the tenant's first admin identity (default `admin`).
    #[serde(default)]
    admin_name: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TenantRef {
    /// `ten_…`.
    tenant_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PageOnly {
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateIdentity {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Unique in the tenant: lowercase letters, digits, `-`, `.`, `_`, `@`.
    name: String,
    /// `person` or `service`.
    kind: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IdentityRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `idn_…`.
    identity_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateToken {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Whose token.
    identity_id: String,
    /// A label.
    #[serde(default)]
    name: String,
    /// Lifetime in seconds, 60 s to 366 days (default 90 days); `ttlSeconds` is accepted too.
    #[serde(default, alias = "ttlSeconds")]
    ttl_s: Option<i64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListByIdentity {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Only this identity's.
    #[serde(default)]
    identity_id: Option<String>,
    /// Items per page, 1 to 500 (default 100).
    #[serde(default)]
    page_size: Option<i64>,
    /// `nextPageToken` of the previous page.
    #[serde(default)]
    page_token: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TokenRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `tok_…`.
    token_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateBinding {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// Who is bound (an identity of the caller's tenant).
    identity_id: String,
    /// A role of `roles.list`.
    role: String,
    /// `fleet`, `tenant`, `site`, `pool` or `node`.
    scope_kind: String,
    /// The site, pool or node id (absent for fleet and tenant).
    #[serde(default)]
    scope_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BindingRef {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default)]
    tenant_id: Option<String>,
    /// `rb_…`.
    role_binding_id: String,
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
struct Roles {
    /// Every role.
    items: Vec<RoleView>,
}

pub(super) fn methods() -> Vec<Method> {
    vec![
        change("tenants.create", "Create a tenant with its first admin and a token for it (the secret is in this response only).", "iam:tenants:write at fleet scope", |ctx: Ctx, r: CreateTenant| async move {
            ctx.check(TENANTS_WRITE, Resource::Fleet).await?;
            let admin = r.admin_name.clone().unwrap_or_else(|| "admin".into());
            ctx.in_tx(async |tx| tenant_with_admin(tx, &r.name, &admin, false).await).await
        }),
        read("tenants.get", "Read a tenant: your own, or any with iam:tenants:read at fleet scope.", "none for your own tenant; iam:tenants:read at fleet scope for others", |ctx: Ctx, r: TenantRef| async move {
            if r.tenant_id != ctx.principal.tenant_id && ctx.check(TENANTS_READ, Resource::Fleet).await.is_err() {
                return Err(Error::not_found("tenant", &r.tenant_id));
            }
            directory::get_tenant(&*ctx.read().await?, &r.tenant_id).await
        }),
        read("tenants.list", "List every tenant.", "iam:tenants:read at fleet scope", |ctx: Ctx, r: PageOnly| async move {
            ctx.check(TENANTS_READ, Resource::Fleet).await?;
            directory::list_tenants(&*ctx.read().await?, &page(r.page_size, r.page_token)).await
        }),
        change("identities.create", "Create a person or service account in your tenant.", "iam:identities:write at tenant scope", |ctx: Ctx, r: CreateIdentity| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_WRITE).await?;
            ctx.in_tx(async |tx| directory::create_identity(tx, &ctx.principal.tenant_id, &r.name, &r.kind).await).await
        }),
        read("identities.get", "Read an identity of your tenant.", "iam:identities:read at tenant scope", |ctx: Ctx, r: IdentityRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_READ).await?;
            directory::get_identity(&*ctx.read().await?, &ctx.principal.tenant_id, &r.identity_id).await
        }),
        read("identities.list", "List your tenant's identities.", "iam:identities:read at tenant scope", |ctx: Ctx, r: TenantPage| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_READ).await?;
            directory::list_identities(&*ctx.read().await?, &ctx.principal.tenant_id, &r.page()).await
        }),
        change("tokens.create", "Issue a bearer token for an identity of your tenant. The secret is in this response only.", "iam:identities:write at tenant scope, and every permission the identity holds, at every scope it holds it", |ctx: Ctx, r: CreateToken| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_WRITE).await?;
            ctx.in_tx(async |tx| -> Result<IssuedToken, Error> { tokens::issue(tx, &ctx.principal.tenant_id, Some(&ctx.principal.identity_id), &r.identity_id, &r.name, r.ttl_s).await }).await
        }),
        read("tokens.list", "List your tenant's tokens (never their secrets).", "iam:identities:read at tenant scope", |ctx: Ctx, r: ListByIdentity| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_READ).await?;
            tokens::list(&*ctx.read().await?, &ctx.principal.tenant_id, r.identity_id.as_deref(), &page(r.page_size, r.page_token)).await
        }),
        change("tokens.revoke", "Revoke a token of your tenant; it stops working within a second (30 s at most), and its watch streams end.", "iam:identities:write at tenant scope, and every permission its identity holds, at every scope it holds it", |ctx: Ctx, r: TokenRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), IDENTITIES_WRITE).await?;
            let v: TokenView = ctx.in_tx(async |tx| tokens::revoke(tx, &ctx.principal.tenant_id, &ctx.principal.identity_id, &r.token_id).await).await?;
            // This process drops it at once; the others on their next tail.
            ctx.state.iam.forget(&v.identity_id, Some(&v.id));
            Ok(v)
        }),
        change("roleBindings.create", "Bind a role to an identity of your tenant at a scope; you cannot grant what you do not hold there.", "iam:bindings:write at tenant scope, every permission the identity holds at every scope it holds it, and every permission of the role at the scope", |ctx: Ctx, r: CreateBinding| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), BINDINGS_WRITE).await?;
            let scope_id = r.scope_id.clone().unwrap_or_default();
            let v = ctx.in_tx(async |tx| -> Result<RoleBindingView, Error> {
                bindings::bind(
                    tx,
                    &NewBinding {
                        tenant_id: &ctx.principal.tenant_id,
                        granter_id: &ctx.principal.identity_id,
                        identity_id: &r.identity_id,
                        role: &r.role,
                        scope_kind: &r.scope_kind,
                        scope_id: &scope_id,
                    },
                )
                .await
            })
            .await?;
            ctx.state.iam.forget(&v.identity_id, None);
            Ok(v)
        }),
        read("roleBindings.list", "List your tenant's role bindings.", "iam:bindings:read at tenant scope", |ctx: Ctx, r: ListByIdentity| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), BINDINGS_READ).await?;
            bindings::list(&*ctx.read().await?, &ctx.principal.tenant_id, r.identity_id.as_deref(), &page(r.page_size, r.page_token)).await
        }),
        change("roleBindings.delete", "Remove a role binding of your tenant.", "iam:bindings:write at tenant scope, and every permission the identity bound holds, at every scope it holds it", |ctx: Ctx, r: BindingRef| async move {
            ctx.in_tenant(r.tenant_id.as_deref(), BINDINGS_WRITE).await?;
            let v = ctx.in_tx(async |tx| bindings::unbind(tx, &ctx.principal.tenant_id, &ctx.principal.identity_id, &r.role_binding_id).await).await?;
            ctx.state.iam.forget(&v.identity_id, None);
            Ok(v)
        }),
        read("roles.list", "List the roles and their permissions.", "any authenticated identity", |ctx: Ctx, _r: Empty| async move {
            Ok(Roles { items: bindings::list_roles(&*ctx.read().await?).await? })
        }),
    ]
}
