//! Bearer tokens: `bct_` and 43 characters of base64url (256 random bits). The secret is returned
//! once, when issued; only its SHA-256 is stored, so neither the database nor a log holds it.

use base64::Engine;
use better_compute_core::id::TokenId;
use better_compute_core::page::{Page, PageRequest};
use better_compute_core::{Error, ErrorCode};
use better_compute_db::clock::rfc3339_sql as rfc3339;
use better_compute_db::paging::read_page;
use better_compute_db::DbError;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio_postgres::GenericClient;

/// Every secret starts with this, so secret scanners and people can recognise one.
pub const SECRET_PREFIX: &str = "bct_";
/// The default lifetime of a token.
pub const DEFAULT_TTL_S: i64 = 90 * 24 * 3600;
/// The longest lifetime of a token.
pub const MAX_TTL_S: i64 = 366 * 24 * 3600;

/// A token as listed: never its secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TokenView {
    /// `tok_…`.
    pub id: String,
    /// Whose.
    pub identity_id: String,
    /// A label.
    pub name: String,
    /// RFC 3339.
    pub expires_at: String,
    /// RFC 3339, once revoked.
    pub revoked_at: Option<String>,
    /// RFC 3339.
    pub created_at: String,
}

/// A token just issued: the only time its secret is seen.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IssuedToken {
    /// The token's metadata.
    pub token: TokenView,
    /// The bearer secret (`bct_…`). Shown once; store it now.
    pub secret: String,
}

/// The SHA-256 of a secret, as stored.
pub fn secret_sha256(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn new_secret() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source works");
    format!("{SECRET_PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

fn select() -> String {
    format!(
        "SELECT id, identity_id, name, {}, {}, {} FROM tokens",
        rfc3339("expires_at"),
        rfc3339("revoked_at"),
        rfc3339("created_at")
    )
}

fn view(r: &tokio_postgres::Row) -> TokenView {
    TokenView { id: r.get(0), identity_id: r.get(1), name: r.get(2), expires_at: r.get(3), revoked_at: r.get(4), created_at: r.get(5) }
}

/// Issues a token for an identity of `tenant_id` (NOT_FOUND for another tenant's identity), by
/// `actor_id`, who must be able to act on that identity
/// ([`lock_identity_for`](crate::bindings::lock_identity_for)): a token is the identity's whole
/// power. `None` is someone with direct access to the database (bootstrap, `dev`).
pub async fn issue(tx: &impl GenericClient, tenant_id: &str, actor_id: Option<&str>, identity_id: &str, name: &str, ttl_s: Option<i64>) -> Result<IssuedToken, Error> {
    let ttl_s = ttl_s.unwrap_or(DEFAULT_TTL_S);
    if !(60..=MAX_TTL_S).contains(&ttl_s) {
        return Err(Error::invalid_argument(format!("ttlS must be between 60 and {MAX_TTL_S}")));
    }
    if name.len() > 100 || name.chars().any(char::is_control) {
        return Err(Error::invalid_argument("name must be at most 100 printable characters"));
    }
    if let Some(actor_id) = actor_id {
        crate::bindings::lock_identity_for(tx, tenant_id, actor_id, identity_id).await?;
    }
    let secret = new_secret();
    let id = TokenId::generate().to_string();
    let inserted = tx
        .execute(
            "INSERT INTO tokens (id, tenant_id, identity_id, name, secret_sha256, expires_at)
             SELECT $1, i.tenant_id, i.id, $4, $5, compute_now() + make_interval(secs => $6)
               FROM identities i WHERE i.id = $2 AND i.tenant_id = $3",
            &[&id, &identity_id, &tenant_id, &name, &secret_sha256(&secret).as_slice(), &(ttl_s as f64)],
        )
        .await
        .map_err(DbError::from)?;
    if inserted == 0 {
        return Err(Error::not_found("identity", identity_id));
    }
    let row = tx.query_one(&format!("{} WHERE id = $1", select()), &[&id]).await.map_err(DbError::from)?;
    Ok(IssuedToken { token: view(&row), secret })
}

/// Who a valid token speaks for.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOwner {
    /// The token.
    pub token_id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its identity.
    pub identity_id: String,
    /// Seconds until it expires (on the database's clock).
    pub expires_in_s: f64,
}

/// Looks a secret up (uncached): UNAUTHENTICATED unless it exists, is not revoked and has not expired.
pub async fn authenticate(db: &impl GenericClient, secret: &str) -> Result<TokenOwner, Error> {
    let unauthenticated = || Error::new(ErrorCode::Unauthenticated, "the bearer token is unknown, expired or revoked; ask for a new one");
    if !secret.starts_with(SECRET_PREFIX) || secret.len() > 100 {
        return Err(unauthenticated());
    }
    let row = db
        .query_opt(
            "SELECT id, tenant_id, identity_id, extract(epoch FROM expires_at - compute_now())::float8 FROM tokens
              WHERE secret_sha256 = $1 AND revoked_at IS NULL AND expires_at > compute_now()",
            &[&secret_sha256(secret).as_slice()],
        )
        .await
        .map_err(DbError::from)?
        .ok_or_else(unauthenticated)?;
    Ok(TokenOwner { token_id: row.get(0), tenant_id: row.get(1), identity_id: row.get(2), expires_in_s: row.get(3) })
}

/// Seconds a token has left on the database's clock (uncached): UNAUTHENTICATED once it is
/// revoked, expired or gone.
pub async fn time_left(db: &impl GenericClient, token_id: &str) -> Result<f64, Error> {
    let row = db
        .query_opt(
            "SELECT extract(epoch FROM expires_at - compute_now())::float8 FROM tokens
              WHERE id = $1 AND revoked_at IS NULL AND expires_at > compute_now()",
            &[&token_id],
        )
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::new(ErrorCode::Unauthenticated, "the bearer token was revoked or has expired; ask for a new one"))?;
    Ok(row.get(0))
}

/// Revokes a token of the tenant, by `actor_id`, who must be able to act on its identity
/// ([`lock_identity_for`](crate::bindings::lock_identity_for)); a revoked one is returned
/// unchanged. Written to `authz_changes` so every API process drops it from its cache at once.
pub async fn revoke(tx: &impl GenericClient, tenant_id: &str, actor_id: &str, token_id: &str) -> Result<TokenView, Error> {
    let owner: String = tx
        .query_opt("SELECT identity_id FROM tokens WHERE id = $1 AND tenant_id = $2", &[&token_id, &tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("token", token_id))?
        .get(0);
    crate::bindings::lock_identity_for(tx, tenant_id, actor_id, &owner).await?;
    let row = tx
        .query_opt(
            "UPDATE tokens SET revoked_at = coalesce(revoked_at, compute_now()) WHERE id = $1 AND tenant_id = $2
             RETURNING identity_id",
            &[&token_id, &tenant_id],
        )
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("token", token_id))?;
    let identity_id: String = row.get(0);
    tx.execute("INSERT INTO authz_changes (identity_id, token_id) VALUES ($1, $2)", &[&identity_id, &token_id])
        .await
        .map_err(DbError::from)?;
    let row = tx.query_one(&format!("{} WHERE id = $1", select()), &[&token_id]).await.map_err(DbError::from)?;
    Ok(view(&row))
}

/// The tenant's tokens (metadata only), optionally of one identity, a page at a time.
pub async fn list(db: &impl GenericClient, tenant_id: &str, identity_id: Option<&str>, page: &PageRequest) -> Result<Page<TokenView>, Error> {
    let filter = "tenant_id = $1 AND ($2::text IS NULL OR identity_id = $2)";
    read_page(db, &select(), filter, &[&tenant_id, &identity_id], page, view, |t: &TokenView| t.id.clone()).await
}
