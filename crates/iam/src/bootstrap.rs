//! The first tenant and admin: `better-compute admin bootstrap` (and `dev`, which does it for you).

use better_compute_core::id::RoleBindingId;
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::authz::Permission;
use tokio_postgres::GenericClient;

use crate::bindings::{project, sync_roles};
use crate::directory::{create_identity, create_tenant, IdentityView, TenantView};
use crate::tokens::{issue, IssuedToken};

/// What bootstrap (or `tenants.create`) made.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bootstrapped {
    /// The operators' tenant.
    pub tenant: TenantView,
    /// Its first admin.
    pub identity: IdentityView,
    /// The admin's token: its secret is shown this once.
    pub token: IssuedToken,
}

/// Creates the first tenant, an admin identity bound to `fleet-admin` at fleet scope and `admin`
/// at tenant scope, and a token for it. FAILED_PRECONDITION once anyone holds a fleet binding:
/// after that, admins issue tokens and bindings through the API.
pub async fn bootstrap(tx: &impl GenericClient, catalog: &[Permission], tenant_name: &str, admin_name: &str) -> Result<Bootstrapped, Error> {
    sync_roles(tx, catalog).await?;
    // Serialized with other bootstraps by sync_roles' advisory lock.
    let done: bool = tx
        .query_one("SELECT EXISTS (SELECT 1 FROM role_bindings WHERE scope_kind = 'fleet')", &[])
        .await
        .map_err(DbError::from)?
        .get(0);
    if done {
        return Err(Error::failed_precondition(
            "already bootstrapped; an admin issues new tokens with `better-compute api tokens.create`",
        ));
    }
    tenant_with_admin(tx, tenant_name, admin_name, true).await
}

/// Creates a tenant with its first admin (`admin` at tenant scope, and `fleet-admin` at fleet scope
/// when `fleet`) and a token for it: how an operator hands a new tenant its keys
/// (`tenants.create`). Only bootstrap passes `fleet`.
pub async fn tenant_with_admin(tx: &impl GenericClient, tenant_name: &str, admin_name: &str, fleet: bool) -> Result<Bootstrapped, Error> {
    let tenant = create_tenant(tx, tenant_name).await?;
    let identity = create_identity(tx, &tenant.id, admin_name, "person").await?;
    let mut roles = vec![("admin", "tenant", tenant.id.as_str())];
    if fleet {
        roles.push(("fleet-admin", "fleet", ""));
    }
    for (role, kind, scope) in roles {
        tx.execute(
            "INSERT INTO role_bindings (id, tenant_id, identity_id, role, scope_kind, scope_id) VALUES ($1, $2, $3, $4, $5, $6)",
            &[&RoleBindingId::generate().to_string(), &tenant.id, &identity.id, &role, &kind, &scope],
        )
        .await
        .map_err(DbError::from)?;
    }
    project(tx, &identity.id).await?;
    let token = issue(tx, &tenant.id, None, &identity.id, "first admin", Some(crate::tokens::MAX_TTL_S)).await?;
    Ok(Bootstrapped { tenant, identity, token })
}

/// The first fleet admin bootstrap made, as (tenant, identity), if bootstrap ran: the oldest
/// fleet-scope binding.
pub async fn first_fleet_admin(db: &impl GenericClient) -> Result<Option<(String, String)>, DbError> {
    Ok(db
        .query_opt("SELECT b.tenant_id, b.identity_id FROM role_bindings b WHERE b.scope_kind = 'fleet' ORDER BY b.created_at LIMIT 1", &[])
        .await?
        .map(|r| (r.get(0), r.get(1))))
}
