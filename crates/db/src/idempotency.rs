//! Idempotency keys scoped to `(tenant, identity, key)`.
//!
//! An API method calls [`claim`] first thing in its transaction. The claim is an `INSERT` of the key
//! row, so a concurrent request with the same key blocks on the unique index until the first one
//! commits (then sees its result) or rolls back (then takes the key itself). When the method is
//! done it calls [`complete`] with its response, in the same transaction. If the method fails, its
//! transaction rolls back with the key row, so a retry runs it again: only a committed result is
//! ever replayed.

use std::time::Duration;

use better_compute_core::Error;
use sha2::{Digest, Sha256};
use tokio_postgres::Transaction;

use crate::DbError;

/// How long a key remembers its result.
pub const IDEMPOTENCY_KEY_TTL: Duration = Duration::from_secs(24 * 3600);

/// Who is asking, and with which key.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyScope<'a> {
    /// The caller's tenant.
    pub tenant_id: &'a str,
    /// The caller's identity.
    pub identity_id: &'a str,
    /// The key the client chose.
    pub key: &'a str,
}

/// The outcome of a claim.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The key is new (or expired): run the method, then [`complete`].
    New,
    /// The same request ran before: return this response and do nothing else.
    Replay(serde_json::Value),
}

/// SHA-256 over the method and the canonical JSON of the request (object keys sorted), as a claim
/// stores it.
pub fn request_sha256(method: &str, request: &serde_json::Value) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(method.as_bytes());
    h.update([0]);
    // serde_json's maps are ordered by key, so this text is canonical.
    h.update(request.to_string().as_bytes());
    h.finalize().to_vec()
}

/// Checks a client-chosen key: 1 to 255 printable ASCII characters.
pub fn validate_key(key: &str) -> Result<(), Error> {
    if key.is_empty() || key.len() > 255 || !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(Error::invalid_argument(
            "idempotencyKey must be 1 to 255 printable ASCII characters without spaces",
        ));
    }
    Ok(())
}

/// Claims the key for this request inside the caller's transaction.
///
/// Errors: `INVALID_ARGUMENT` for a malformed key; `CONFLICT` (reason `IDEMPOTENCY_KEY_REUSED`)
/// when the key was used for a different request.
pub async fn claim(
    tx: &Transaction<'_>,
    scope: IdempotencyScope<'_>,
    method: &str,
    request: &serde_json::Value,
) -> Result<Claim, DbError> {
    validate_key(scope.key)?;
    let hash = request_sha256(method, request);
    // idempotency_claim (sql/idempotency.sql), as the batch placer claims a batch's keys: a live
    // key row from another transaction makes it wait; an expired one is taken over as if absent.
    let inserted = tx
        .query_opt(
            "SELECT 1 FROM idempotency_claim(ARRAY[$1::text], ARRAY[$2::text], ARRAY[$3::text], $4, ARRAY[$5::bytea], $6)",
            &[&scope.tenant_id, &scope.identity_id, &scope.key, &method, &hash, &IDEMPOTENCY_KEY_TTL.as_secs_f64()],
        )
        .await?;
    if inserted.is_some() {
        return Ok(Claim::New);
    }
    let row = tx
        .query_one(
            "SELECT method, request_sha256, response FROM idempotency_keys
              WHERE tenant_id = $1 AND identity_id = $2 AND key = $3",
            &[&scope.tenant_id, &scope.identity_id, &scope.key],
        )
        .await?;
    let stored_hash: Vec<u8> = row.get(1);
    if stored_hash != hash {
        let stored_method: String = row.get(0);
        return Err(Error::conflict(format!(
            "idempotencyKey {:?} was already used for a different {stored_method} request; use a new key",
            scope.key
        ))
        .with_details(serde_json::json!({"reason": "IDEMPOTENCY_KEY_REUSED"}))
        .into());
    }
    let response: Option<serde_json::Value> = row.get(2);
    // A committed key row always has its response: claim and complete share one transaction.
    response
        .map(Claim::Replay)
        .ok_or_else(|| Error::internal("idempotency key committed without a response").into())
}

/// Whether a method's refusal is its final answer for the key, stored with
/// [`complete_with_error`] and replayed, rather than a passing failure (the database away, a race
/// lost, a rate) that a retry with the same key may get past.
pub fn is_final(e: &Error) -> bool {
    use better_compute_core::ErrorCode::*;
    !matches!(e.code, Unavailable | Internal | Conflict | RateLimited | Unauthenticated)
}

/// Stores a final refusal as the key's response, so every repeat of the key answers that refusal
/// too, whatever the interleaving (a repeat that ran later would otherwise be judged afresh, and
/// could succeed where the first was refused). Call in the transaction that claimed the key, after
/// rolling the method's own work back to a savepoint.
pub async fn complete_with_error(tx: &Transaction<'_>, scope: IdempotencyScope<'_>, e: &Error) -> Result<(), DbError> {
    complete(tx, scope, &serde_json::json!({ "error": e })).await
}

/// A replayed response as the method answers it: the stored value, or the stored refusal as the
/// error.
pub fn replayed(stored: serde_json::Value) -> Result<serde_json::Value, Error> {
    match stored.get("error") {
        Some(e) => Err(serde_json::from_value(e.clone()).unwrap_or_else(|_| Error::internal("a stored refusal did not parse"))),
        None => Ok(stored),
    }
}

/// Stores the method's response for replays. Call in the transaction that claimed the key.
pub async fn complete(
    tx: &Transaction<'_>,
    scope: IdempotencyScope<'_>,
    response: &serde_json::Value,
) -> Result<(), DbError> {
    let n: i32 = tx
        .query_one(
            "SELECT idempotency_answer(ARRAY[$1::text], ARRAY[$2::text], ARRAY[$3::text], ARRAY[$4::jsonb])",
            &[&scope.tenant_id, &scope.identity_id, &scope.key, response],
        )
        .await?
        .get(0);
    if n != 1 {
        return Err(Error::internal("idempotency key completed without a claim").into());
    }
    Ok(())
}

/// Deletes expired keys, at most `limit` at a time; returns how many.
pub async fn prune_expired(db: &impl tokio_postgres::GenericClient, limit: i64) -> Result<u64, DbError> {
    Ok(db
        .execute(
            "DELETE FROM idempotency_keys WHERE ctid IN (
               SELECT ctid FROM idempotency_keys WHERE expires_at <= compute_now() LIMIT $1)",
            &[&limit],
        )
        .await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_hash_ignores_key_order_but_not_values_or_method() {
        let a = serde_json::json!({"a": 1, "b": [1, 2]});
        let b: serde_json::Value = serde_json::from_str(r#"{"b": [1, 2], "a": 1}"#).unwrap();
        assert_eq!(request_sha256("m", &a), request_sha256("m", &b));
        assert_ne!(request_sha256("m", &a), request_sha256("n", &a));
        assert_ne!(request_sha256("m", &a), request_sha256("m", &serde_json::json!({"a": 2, "b": [1, 2]})));
    }

    #[test]
    fn keys_must_be_printable_and_short() {
        assert!(validate_key("refresh-1").is_ok());
        for bad in ["", "has space", "tab\t", &"x".repeat(256), "é"] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
    }
}
