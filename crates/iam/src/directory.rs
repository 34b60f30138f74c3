//! Tenants and identities.

use better_compute_core::id::{IdentityId, TenantId};
use better_compute_core::page::{Page, PageRequest};
use better_compute_core::Error;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

/// A tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantView {
    /// `ten_…`.
    pub id: String,
    /// Lowercase letters, digits and dashes.
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
}

/// An identity: a person or a service account of one tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdentityView {
    /// `idn_…`.
    pub id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Unique within the tenant.
    pub name: String,
    /// `person` or `service`.
    pub kind: String,
    /// RFC 3339.
    pub created_at: String,
}

/// `created_at` as RFC 3339.
fn created_at() -> String {
    better_compute_db::clock::rfc3339_sql("created_at")
}

fn check_name(field: &str, name: &str, extra: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || extra.as_bytes().contains(&b));
    if !ok {
        return Err(Error::invalid_argument(format!(
            "{field} must be 1 to 63 lowercase letters, digits{} or dashes, starting with a letter or digit",
            if extra.is_empty() { String::new() } else { format!(", '{extra}'") }
        )));
    }
    Ok(())
}

fn unique_violation(e: DbError, what: String) -> Error {
    if e.sqlstate() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
        Error::conflict(what)
    } else {
        e.into()
    }
}

/// Creates a tenant.
pub async fn create_tenant(tx: &impl GenericClient, name: &str) -> Result<TenantView, Error> {
    check_name("name", name, "")?;
    let id = TenantId::generate().to_string();
    tx.execute("INSERT INTO tenants (id, name) VALUES ($1, $2)", &[&id, &name])
        .await
        .map_err(|e| unique_violation(e.into(), format!("a tenant named {name:?} exists already")))?;
    get_tenant(tx, &id).await
}

/// One tenant.
pub async fn get_tenant(db: &impl GenericClient, id: &str) -> Result<TenantView, Error> {
    let row = db
        .query_opt(&format!("SELECT id, name, {} FROM tenants WHERE id = $1", created_at()), &[&id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("tenant", id))?;
    Ok(TenantView { id: row.get(0), name: row.get(1), created_at: row.get(2) })
}

/// Every tenant, a page at a time.
pub async fn list_tenants(db: &impl GenericClient, page: &PageRequest) -> Result<Page<TenantView>, Error> {
    let select = format!("SELECT id, name, {} FROM tenants", created_at());
    read_page(db, &select, "true", &[], page, |r| TenantView { id: r.get(0), name: r.get(1), created_at: r.get(2) }, |t: &TenantView| t.id.clone()).await
}

/// Creates an identity in a tenant.
pub async fn create_identity(tx: &impl GenericClient, tenant_id: &str, name: &str, kind: &str) -> Result<IdentityView, Error> {
    check_name("name", name, "._@")?;
    if !matches!(kind, "person" | "service") {
        return Err(Error::invalid_argument("kind must be person or service"));
    }
    let id = IdentityId::generate().to_string();
    tx.execute("INSERT INTO identities (id, tenant_id, name, kind) VALUES ($1, $2, $3, $4)", &[&id, &tenant_id, &name, &kind])
        .await
        .map_err(|e| unique_violation(e.into(), format!("an identity named {name:?} exists already in this tenant")))?;
    get_identity(tx, tenant_id, &id).await
}

fn identity(r: &tokio_postgres::Row) -> IdentityView {
    IdentityView { id: r.get(0), tenant_id: r.get(1), name: r.get(2), kind: r.get(3), created_at: r.get(4) }
}

/// One identity of the tenant; another tenant's is NOT_FOUND.
pub async fn get_identity(db: &impl GenericClient, tenant_id: &str, id: &str) -> Result<IdentityView, Error> {
    let row = db
        .query_opt(&format!("SELECT id, tenant_id, name, kind, {} FROM identities WHERE id = $1 AND tenant_id = $2", created_at()), &[&id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("identity", id))?;
    Ok(identity(&row))
}

/// The tenant's identities, a page at a time.
pub async fn list_identities(db: &impl GenericClient, tenant_id: &str, page: &PageRequest) -> Result<Page<IdentityView>, Error> {
    let select = format!("SELECT id, tenant_id, name, kind, {} FROM identities", created_at());
    read_page(db, &select, "tenant_id = $1", &[&tenant_id], page, identity, |i: &IdentityView| i.id.clone()).await
}
