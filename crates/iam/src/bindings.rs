//! Roles, role bindings and the projection of effective permissions.
//!
//! A role is a set of permission names. A binding gives an identity a role at a scope: `fleet`
//! (every site), `tenant` (its own tenant's reservations, quotas, identities and bindings), or one
//! `site`, `pool` or `node` (and what lies within). `authz_projection` flattens bindings into
//! `(identity, permission, scope)` rows, rewritten in the transaction that changes the bindings, so
//! a decision is one indexed lookup.

use better_compute_core::id::RoleBindingId;
use better_compute_core::page::{Page, PageRequest};
use better_compute_core::{Error, ErrorCode};
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use better_compute_runtime::authz::Permission;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

/// A built-in role: its name, what it is for, and which permissions of the catalog it holds.
pub struct BuiltinRole {
    /// Its name.
    pub name: &'static str,
    /// What it is for.
    pub description: &'static str,
    /// Whether it holds a permission of the catalog.
    pub holds: fn(&str) -> bool,
}

/// The built-in roles, kept equal to the permission catalog by [`sync_roles`].
pub const BUILTIN_ROLES: &[BuiltinRole] = &[
    BuiltinRole { name: "fleet-admin", description: "Everything, at the scope bound (bind at fleet scope for operators).", holds: |_| true },
    BuiltinRole {
        name: "operator",
        description: "Run the fleet: sites, pools, nodes, devices, commands, workflows, jobs, quotas, usage, the audit log and tenants.",
        holds: |p| {
            ["compute:sites:", "compute:pools:", "compute:nodes:", "compute:devices:", "compute:workflows:", "compute:jobs:", "compute:quotas:", "compute:usage:", "compute:audit:", "iam:tenants:"]
                .iter()
                .any(|prefix| p.starts_with(prefix))
        },
    },
    BuiltinRole {
        name: "admin",
        description: "Administer a tenant: its reservations, instances, webhooks, usage, audit log, identities, tokens and role bindings.",
        holds: |p| {
            p.starts_with("compute:reservations:")
                || p.starts_with("compute:instances:")
                || p.starts_with("compute:webhooks:")
                || p == "compute:quotas:read"
                || p == "compute:usage:read"
                || p == "compute:audit:read"
                || p.starts_with("iam:identities:")
                || p.starts_with("iam:bindings:")
        },
    },
    BuiltinRole {
        name: "member",
        description: "Use a tenant: create, read, extend and release reservations; run instances on them; read quotas.",
        holds: |p| p.starts_with("compute:reservations:") || p.starts_with("compute:instances:") || p == "compute:quotas:read",
    },
    BuiltinRole { name: "viewer", description: "Read everything at the scope bound.", holds: |p| p.ends_with(":read") },
    BuiltinRole {
        name: "tenant-viewer",
        description: "Read a tenant's own things: reservations, webhooks, quotas, identities and bindings (what a tenant admin can grant).",
        holds: |p| p.ends_with(":read") && tenant_permission(p),
    },
];

/// Whether a permission is one of a tenant's own (reservations, webhooks, quotas read, identities,
/// bindings): what a tenant binding confers. The same rule as [`applies_sql`] at tenant scope.
pub fn tenant_permission(p: &str) -> bool {
    ["compute:reservations:", "compute:instances:", "compute:webhooks:", "iam:identities:", "iam:bindings:"].iter().any(|prefix| p.starts_with(prefix))
        || p == "compute:quotas:read"
        || p == "compute:usage:read"
        || p == "compute:audit:read"
}

/// Makes the `roles` table hold the built-in roles over `catalog`, and re-projects every identity
/// bound to a role whose permissions changed. Run at start-up; cheap when nothing changed.
pub async fn sync_roles(tx: &impl GenericClient, catalog: &[Permission]) -> Result<u64, DbError> {
    // One process at a time, so two servers starting together do not interleave projections.
    tx.execute("SELECT pg_advisory_xact_lock(hashtext('better-compute:iam:roles'))", &[]).await?;
    let mut changed = 0;
    for role in BUILTIN_ROLES {
        let mut perms: Vec<&str> = catalog.iter().map(|p| p.name).filter(|p| (role.holds)(p)).collect();
        perms.sort_unstable();
        perms.dedup();
        let n = tx
            .execute(
                "INSERT INTO roles (name, description, permissions) VALUES ($1, $2, $3)
                   ON CONFLICT (name) DO UPDATE SET description = EXCLUDED.description, permissions = EXCLUDED.permissions
                    WHERE roles.permissions IS DISTINCT FROM EXCLUDED.permissions OR roles.description <> EXCLUDED.description",
                &[&role.name, &role.description, &perms],
            )
            .await?;
        if n > 0 {
            changed += 1;
            let ids: Vec<String> = tx
                .query("SELECT DISTINCT identity_id FROM role_bindings WHERE role = $1 ORDER BY 1", &[&role.name])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            for id in ids {
                project(tx, &id).await?;
            }
        }
    }
    Ok(changed)
}

/// Which permissions a binding at a scope kind confers, in SQL over `$perm` and `$kind`: a tenant
/// binding confers the tenant's own permissions (reservations, webhooks, quotas, usage and audit read,
/// identities, bindings);
/// a fleet, site, pool or node binding confers the others (quotas read at fleet scope too).
fn applies_sql(perm: &str, kind: &str) -> String {
    format!(
        "(CASE WHEN {kind} = 'tenant'
               THEN {perm} LIKE 'compute:reservations:%' OR {perm} LIKE 'compute:instances:%' OR {perm} LIKE 'compute:webhooks:%'
                    OR {perm} = 'compute:quotas:read'
                    OR {perm} = 'compute:usage:read'
                    OR {perm} = 'compute:audit:read'
                    OR {perm} LIKE 'iam:identities:%' OR {perm} LIKE 'iam:bindings:%'
               ELSE NOT ({perm} LIKE 'compute:reservations:%' OR {perm} LIKE 'compute:instances:%' OR {perm} LIKE 'compute:webhooks:%'
                         OR {perm} LIKE 'iam:identities:%'
                         OR {perm} LIKE 'iam:bindings:%') END)"
    )
}

/// Rewrites an identity's projection from its bindings, and records the change for the caches.
/// Callers hold the identity's row lock (taken by [`bind`] and [`unbind`]).
pub async fn project(tx: &impl GenericClient, identity_id: &str) -> Result<(), DbError> {
    tx.execute("DELETE FROM authz_projection WHERE identity_id = $1", &[&identity_id]).await?;
    tx.execute(
        &format!(
            "INSERT INTO authz_projection (identity_id, permission, scope_kind, scope_id)
             SELECT DISTINCT b.identity_id, p, b.scope_kind, b.scope_id
               FROM role_bindings b JOIN roles r ON r.name = b.role, unnest(r.permissions) p
              WHERE b.identity_id = $1 AND {}",
            applies_sql("p", "b.scope_kind")
        ),
        &[&identity_id],
    )
    .await?;
    tx.execute("INSERT INTO authz_changes (identity_id) VALUES ($1)", &[&identity_id]).await?;
    Ok(())
}

/// The scopes that cover `(kind, id)` for a tenant, as a subquery of `(scope_kind, scope_id)` over
/// the parameters `$k`, `$i` and `$t` (numbers given). The inventory provides the site/pool/node
/// hierarchy through `inventory_scope_path`, so IAM never reads its tables.
pub(crate) fn scope_path_sql(k: usize, i: usize, t: usize) -> String {
    format!(
        "(SELECT 'tenant'::text AS scope_kind, ${t}::text AS scope_id WHERE ${k}::text = 'tenant'
          UNION ALL
          SELECT s.scope_kind, s.scope_id FROM inventory_scope_path(${k}::text, ${i}::text) s WHERE ${k}::text <> 'tenant')"
    )
}

/// A role binding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleBindingView {
    /// `rb_…`.
    pub id: String,
    /// The identity bound.
    pub identity_id: String,
    /// The role.
    pub role: String,
    /// `fleet`, `tenant`, `site`, `pool` or `node`.
    pub scope_kind: String,
    /// The site, pool or node id; the tenant id for `tenant`; empty for `fleet`.
    pub scope_id: String,
    /// RFC 3339.
    pub created_at: String,
}

/// A role as the catalog shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoleView {
    /// Its name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// The permissions it holds.
    pub permissions: Vec<String>,
}

/// Every role.
pub async fn list_roles(db: &impl GenericClient) -> Result<Vec<RoleView>, Error> {
    let rows = db.query("SELECT name, description, permissions FROM roles ORDER BY name", &[]).await.map_err(DbError::from)?;
    Ok(rows.iter().map(|r| RoleView { name: r.get(0), description: r.get(1), permissions: r.get(2) }).collect())
}

fn select() -> String {
    format!("SELECT id, identity_id, role, scope_kind, scope_id, {} FROM role_bindings", better_compute_db::clock::rfc3339_sql("created_at"))
}

fn view(r: &tokio_postgres::Row) -> RoleBindingView {
    RoleBindingView { id: r.get(0), identity_id: r.get(1), role: r.get(2), scope_kind: r.get(3), scope_id: r.get(4), created_at: r.get(5) }
}

/// A new binding's fields.
#[derive(Debug, Clone)]
pub struct NewBinding<'a> {
    /// The tenant of the identity bound (and of the granter).
    pub tenant_id: &'a str,
    /// Who grants it: they must hold every permission of the role at the scope themselves.
    pub granter_id: &'a str,
    /// Who is bound.
    pub identity_id: &'a str,
    /// The role.
    pub role: &'a str,
    /// `fleet`, `tenant`, `site`, `pool` or `node`.
    pub scope_kind: &'a str,
    /// The scope's id (ignored for `fleet` and `tenant`).
    pub scope_id: &'a str,
}

/// The first column of every row a query answers, as text.
async fn texts(tx: &impl GenericClient, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> Result<Vec<String>, Error> {
    Ok(tx.query(sql, params).await.map_err(DbError::from)?.iter().map(|r| r.get(0)).collect())
}

/// Locks an identity of the tenant for an action by `actor_id` on it (issuing or revoking its
/// tokens, binding or unbinding its roles), and checks the rule that keeps anyone from acting as
/// someone mightier: the actor must hold every permission the identity holds, at every scope it
/// holds it (at that scope or one covering it). NOT_FOUND for an identity of another tenant,
/// PERMISSION_DENIED naming what the actor lacks. The row lock holds the identity's bindings still
/// until the caller's transaction ends, so the decision cannot be outrun by a concurrent binding.
pub async fn lock_identity_for(tx: &impl GenericClient, tenant_id: &str, actor_id: &str, identity_id: &str) -> Result<(), Error> {
    if tx
        .query_opt("SELECT 1 FROM identities WHERE id = $1 AND tenant_id = $2 FOR UPDATE", &[&identity_id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .is_none()
    {
        return Err(Error::not_found("identity", identity_id));
    }
    if actor_id == identity_id {
        return Ok(());
    }
    let missing = texts(
        tx,
        "SELECT t.permission || ' at ' || t.scope_kind || CASE WHEN t.scope_kind = 'fleet' THEN '' ELSE ' ' || t.scope_id END
               FROM authz_projection t
              WHERE t.identity_id = $2
                AND NOT EXISTS (
                  SELECT 1 FROM authz_projection c
                   WHERE c.identity_id = $1 AND c.permission = t.permission
                     AND CASE WHEN t.scope_kind = 'tenant' THEN (c.scope_kind, c.scope_id) = ('tenant', t.scope_id)
                              ELSE (c.scope_kind, c.scope_id) IN (SELECT s.scope_kind, s.scope_id FROM inventory_scope_path(t.scope_kind, t.scope_id) s) END)
              ORDER BY t.permission, t.scope_kind, t.scope_id
              LIMIT 6",
        &[&actor_id, &identity_id],
    )
    .await?;
    if !missing.is_empty() {
        let shown = missing.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        let more = if missing.len() > 5 { ", …" } else { "" };
        return Err(Error::new(
            ErrorCode::PermissionDenied,
            format!("you cannot act on identity {identity_id}: it holds what you do not ({shown}{more}); ask someone who holds all of it"),
        ));
    }
    Ok(())
}

/// Binds a role. Nobody grants more than they hold: the granter must act on the identity
/// ([`lock_identity_for`]) and hold every permission of the role: those the binding confers at a
/// scope covering the binding's, the tenant's own permissions at the tenant, and the fleet's
/// permissions a tenant binding cannot confer at fleet scope. So a tenant admin can neither make
/// anyone an operator nor bind `fleet-admin` at tenant scope (PERMISSION_DENIED).
pub async fn bind(tx: &impl GenericClient, b: &NewBinding<'_>) -> Result<RoleBindingView, Error> {
    let scope_id = match b.scope_kind {
        "fleet" | "tenant" if !b.scope_id.is_empty() && (b.scope_kind == "fleet" || b.scope_id != b.tenant_id) => {
            return Err(Error::invalid_argument(format!(
                "scopeId is for site, pool and node scopes; a {} binding names none (it is your tenant's)",
                b.scope_kind
            )));
        }
        "fleet" => "",
        "tenant" => b.tenant_id,
        "site" | "pool" | "node" => {
            better_compute_core::bounds::check_text("scopeId", b.scope_id, better_compute_core::bounds::KEY_CHARS)?;
            b.scope_id
        }
        _ => return Err(Error::invalid_argument("scopeKind must be fleet, tenant, site, pool or node")),
    };
    // Lock order: the identity row first, so concurrent bindings of one identity project in turn.
    lock_identity_for(tx, b.tenant_id, b.granter_id, b.identity_id).await?;
    let perms: Vec<String> = tx
        .query_opt("SELECT permissions FROM roles WHERE name = $1", &[&b.role])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("role", b.role))?
        .get(0);
    let path = scope_path_sql(1, 2, 3);
    if matches!(b.scope_kind, "site" | "pool" | "node") {
        let found: i64 = tx
            .query_one(&format!("SELECT count(*) FROM {path} p WHERE p.scope_kind = $1 AND p.scope_id = $2"), &[&b.scope_kind, &scope_id, &b.tenant_id])
            .await
            .map_err(DbError::from)?
            .get(0);
        if found == 0 {
            return Err(Error::not_found(b.scope_kind, scope_id));
        }
    }
    let missing = texts(
        tx,
        &format!(
            "SELECT p FROM unnest($4::text[]) p
                  WHERE NOT EXISTS (
                    SELECT 1 FROM authz_projection a
                     WHERE a.identity_id = $5 AND a.permission = p
                       AND CASE WHEN {applies} THEN (a.scope_kind, a.scope_id) IN (SELECT s.scope_kind, s.scope_id FROM {path} s)
                                WHEN {tenant_perm} THEN (a.scope_kind, a.scope_id) = ('tenant', $3::text)
                                ELSE (a.scope_kind, a.scope_id) = ('fleet', '') END)
                  ORDER BY p",
            applies = applies_sql("p", "$1::text"),
            tenant_perm = applies_sql("p", "'tenant'"),
        ),
        &[&b.scope_kind, &scope_id, &b.tenant_id, &perms, &b.granter_id],
    )
    .await?;
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorCode::PermissionDenied,
            format!("you cannot grant {} at {} scope: you do not hold {}", b.role, b.scope_kind, missing.join(", ")),
        ));
    }
    let id = RoleBindingId::generate().to_string();
    tx.execute(
        "INSERT INTO role_bindings (id, tenant_id, identity_id, role, scope_kind, scope_id) VALUES ($1, $2, $3, $4, $5, $6)
           ON CONFLICT (identity_id, role, scope_kind, scope_id) DO NOTHING",
        &[&id, &b.tenant_id, &b.identity_id, &b.role, &b.scope_kind, &scope_id],
    )
    .await
    .map_err(DbError::from)?;
    project(tx, b.identity_id).await?;
    let row = tx
        .query_one(
            &format!("{} WHERE identity_id = $1 AND role = $2 AND scope_kind = $3 AND scope_id = $4", select()),
            &[&b.identity_id, &b.role, &b.scope_kind, &scope_id],
        )
        .await
        .map_err(DbError::from)?;
    Ok(view(&row))
}

/// Removes a binding of the tenant, by `actor_id`, who must be able to act on the identity bound
/// ([`lock_identity_for`]); the change reaches every cache through `authz_changes`.
pub async fn unbind(tx: &impl GenericClient, tenant_id: &str, actor_id: &str, binding_id: &str) -> Result<RoleBindingView, Error> {
    let row = tx
        .query_opt(&format!("{} WHERE id = $1 AND tenant_id = $2", select()), &[&binding_id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("role binding", binding_id))?;
    let v = view(&row);
    lock_identity_for(tx, tenant_id, actor_id, &v.identity_id).await?;
    if tx.execute("DELETE FROM role_bindings WHERE id = $1", &[&binding_id]).await.map_err(DbError::from)? == 0 {
        // Removed by a concurrent unbind while this one waited for the identity's lock.
        return Err(Error::not_found("role binding", binding_id));
    }
    project(tx, &v.identity_id).await?;
    Ok(v)
}

/// The tenant's bindings, optionally of one identity, a page at a time.
pub async fn list(db: &impl GenericClient, tenant_id: &str, identity_id: Option<&str>, page: &PageRequest) -> Result<Page<RoleBindingView>, Error> {
    let filter = "tenant_id = $1 AND ($2::text IS NULL OR identity_id = $2)";
    read_page(db, &select(), filter, &[&tenant_id, &identity_id], page, view, |b: &RoleBindingView| b.id.clone()).await
}
