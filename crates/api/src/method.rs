//! A method of the API: its name, what it does, the permission it checks, its request and response
//! types (their JSON Schemas feed the OpenAPI document, so the document cannot drift from the
//! handlers), and the handler.

use std::future::Future;
use std::sync::Arc;

use better_compute_audit::entry::Request;
use better_compute_audit::Actor;
use better_compute_core::{Caller, Error};
use better_compute_db::DbError;
use better_compute_iam::Principal;
use better_compute_runtime::authz::{Authorizer, Resource};
use futures_util::future::BoxFuture;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::ApiState;

/// What a handler gets: the server's state, who is calling, and the request it makes.
pub struct Ctx {
    /// Shared state.
    pub state: Arc<ApiState>,
    /// The authenticated caller.
    pub principal: Principal,
    /// The request, as the actor of the changes it makes: a changing method passes it to every
    /// module function that records one, and [`Ctx::in_tx`] records the others.
    pub actor: Actor,
    /// Whether the method changes anything ([`Method::changes`]).
    pub(crate) changes: bool,
}

/// The fields a request's target is taken from, in order.
const TARGET_FIELDS: &[&str] = &[
    "instanceId", "reservationId", "commandId", "workflowId", "nodeId", "deviceId", "webhookId", "deliveryId", "tokenId", "roleBindingId", "identityId",
    "poolId", "siteId", "entryId", "name", "tenantId",
];

/// A request's target: the first of [`TARGET_FIELDS`] its body has.
pub fn target_of(body: &[u8]) -> String {
    let Ok(serde_json::Value::Object(m)) = serde_json::from_slice::<serde_json::Value>(body) else { return String::new() };
    TARGET_FIELDS.iter().find_map(|f| m.get(*f).and_then(|v| v.as_str()).map(str::to_owned)).unwrap_or_default()
}

/// What the audit log records of a request to `method` with `body`.
pub(crate) fn request_of(principal: &Principal, method: &str, body: &[u8], request_id: &str, source: Option<String>) -> Request {
    Request {
        identity_id: principal.identity_id.clone(),
        token_id: principal.token_id.clone(),
        tenant_id: principal.tenant_id.clone(),
        action: method.to_owned(),
        target: target_of(body),
        request_id: request_id.to_owned(),
        source,
        request_digest: better_compute_audit::entry::digest(body),
    }
}

impl Ctx {
    /// The caller, as the modules take it.
    pub fn caller(&self) -> Caller<'_> {
        self.principal.caller()
    }

    /// A pooled connection, for a handler that opens its own transaction (every statement runs
    /// in one: `better_compute_db::pool`).
    pub async fn db(&self) -> Result<deadpool_postgres::Object, Error> {
        Ok(self.state.pool.get().await.map_err(DbError::from)?)
    }

    /// A pooled connection in a read-only transaction of its own, for a handler that only reads.
    pub async fn read(&self) -> Result<better_compute_db::pool::ReadTx, Error> {
        Ok(better_compute_db::pool::read_tx(&self.state.pool).await?)
    }

    /// Runs `f` in a transaction on a pooled connection, committing when it succeeds with the
    /// request's audit entry ([`Actor::record`]): how a change that is one transaction is served.
    pub async fn in_tx<T>(&self, f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, Error>) -> Result<T, Error> {
        let mut db = self.db().await?;
        let tx = (**db).transaction().await.map_err(DbError::from)?;
        let v = f(&tx).await?;
        if self.changes {
            let request = self.actor.request().expect("an API call's actor is its request");
            self.actor.record(&tx, &request.action, &request.target, None).await?;
        }
        tx.commit().await.map_err(DbError::from)?;
        Ok(v)
    }

    /// Asks IAM; NOT_FOUND or PERMISSION_DENIED as the resolver decides.
    pub async fn check(&self, permission: &str, resource: Resource<'_>) -> Result<(), Error> {
        self.state.iam.check(self.caller(), permission, resource).await
    }

    /// The check of every tenant-scoped method: the tenant asked for is the caller's
    /// ([`Ctx::own_tenant`]) and the caller holds `permission` there.
    pub async fn in_tenant(&self, asked: Option<&str>, permission: &str) -> Result<(), Error> {
        self.own_tenant(asked)?;
        self.check(permission, Resource::Tenant).await
    }

    /// A tenant-scoped request may name its tenant (`tenantId`, as `BETTER_COMPUTE_TENANT` sets
    /// it); any other tenant than the token's is NOT_FOUND, so nobody learns another exists.
    pub fn own_tenant(&self, asked: Option<&str>) -> Result<(), Error> {
        match asked {
            Some(t) if t != self.principal.tenant_id => Err(Error::not_found("tenant", t)),
            _ => Ok(()),
        }
    }
}

type Call = Arc<dyn Fn(Ctx, &[u8]) -> BoxFuture<'static, Result<serde_json::Value, Error>> + Send + Sync>;

/// One API method.
#[derive(Clone)]
pub struct Method {
    /// `resource.verb`, e.g. `reservations.create`.
    pub name: &'static str,
    /// What it does, for the document and `better-compute api METHOD --help`.
    pub summary: &'static str,
    /// The permission it checks, and where.
    pub permission: &'static str,
    /// Whether it changes anything: a change's request is its actor, recorded in the audit log
    /// with what it changed; a read records nothing.
    pub changes: bool,
    /// The request body's schema.
    pub request: fn(&mut SchemaGenerator) -> Schema,
    /// The response body's schema.
    pub response: fn(&mut SchemaGenerator) -> Schema,
    pub(crate) call: Call,
}

/// Whether a JSON text has a `\u0000` escape (a NUL in a string), which PostgreSQL's text cannot hold.
fn has_nul_escape(body: &[u8]) -> bool {
    body.windows(6).enumerate().any(|(i, w)| {
        w == b"\\u0000" && body[..i].iter().rev().take_while(|b| **b == b'\\').count() % 2 == 0
    })
}

/// Parses a request body into `T`, naming the field at fault.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    // Only an object: serde would read an array as positional fields, and an empty body is easy to
    // send by mistake.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(Error::invalid_argument("the body must be a JSON object of the method's fields (`{}` for none)"));
    }
    if has_nul_escape(body) {
        return Err(Error::invalid_argument("strings may not contain NUL (\\u0000)"));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            Error::invalid_argument(format!("the body is not valid JSON: {inner}"))
        } else if path == "." {
            Error::invalid_argument(format!("the body must be a JSON object of the method's fields: {inner}"))
        } else {
            Error::invalid_argument(format!("{path}: {inner}")).with_details(serde_json::json!({"field": path}))
        }
    })?;
    de.end().map_err(|e| Error::invalid_argument(format!("the body is not valid JSON: {e}")))?;
    Ok(value)
}

/// Declares a method that only reads.
pub fn read<Req, Resp, F, Fut>(name: &'static str, summary: &'static str, permission: &'static str, handler: F) -> Method
where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    F: Fn(Ctx, Req) -> Fut + Send + Sync + Copy + 'static,
    Fut: Future<Output = Result<Resp, Error>> + Send + 'static,
{
    method(name, summary, permission, false, handler)
}

/// Declares a method that changes something, recorded in the audit log as its request's.
pub fn change<Req, Resp, F, Fut>(name: &'static str, summary: &'static str, permission: &'static str, handler: F) -> Method
where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    F: Fn(Ctx, Req) -> Fut + Send + Sync + Copy + 'static,
    Fut: Future<Output = Result<Resp, Error>> + Send + 'static,
{
    method(name, summary, permission, true, handler)
}

fn method<Req, Resp, F, Fut>(name: &'static str, summary: &'static str, permission: &'static str, changes: bool, handler: F) -> Method
where
    Req: DeserializeOwned + JsonSchema + Send + 'static,
    Resp: Serialize + JsonSchema + 'static,
    F: Fn(Ctx, Req) -> Fut + Send + Sync + Copy + 'static,
    Fut: Future<Output = Result<Resp, Error>> + Send + 'static,
{
    Method {
        name,
        summary,
        permission,
        changes,
        request: |g| g.subschema_for::<Req>(),
        response: |g| g.subschema_for::<Resp>(),
        call: Arc::new(move |ctx, body| {
            let req = parse::<Req>(body);
            Box::pin(async move {
                let resp = handler(ctx, req?).await?;
                serde_json::to_value(resp).map_err(|e| Error::internal(format!("response did not serialize: {e}")))
            })
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nul_in_a_string_is_refused_but_an_escaped_backslash_before_u0000_is_not() {
        assert!(has_nul_escape(br#"{"a": "x\u0000"}"#));
        assert!(has_nul_escape(br#"{"a": "\\\u0000"}"#));
        assert!(!has_nul_escape(br#"{"a": "\\u0000"}"#));
        assert_eq!(parse::<serde_json::Value>(br#"{"a": "\u0000"}"#).unwrap_err().code, better_compute_core::ErrorCode::InvalidArgument);
        assert_eq!(parse::<serde_json::Value>(br#"{"a": "\\u0000"}"#).unwrap()["a"], "\\u0000");
    }

    #[test]
    fn only_a_json_object_is_a_body() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Two {
            a: i64,
            b: i64,
        }
        let mut refused = 0;
        for body in [&b""[..], b"  ", b"[1, 2]", b"null", b"1", b"\"x\"", b"true"] {
            let e = parse::<Two>(body).unwrap_err();
            assert_eq!(e.code, better_compute_core::ErrorCode::InvalidArgument, "{body:?}");
            refused += 1;
        }
        assert_eq!(refused, 7);
        assert_eq!(parse::<Two>(b" {\"a\": 1, \"b\": 2}").unwrap().b, 2);
    }
}
