//! The HTTP API: `POST /v1/<method>` with a JSON body, camelCase fields, errors as
//! `{ code, message, details }` with the core's stable codes and their HTTP statuses. Every
//! response carries an `x-request-id`, and every log line of the request names it.
//!
//! Also: `GET /v1/watch` (the caller's events as Server-Sent Events, see [`watch`]),
//! `GET /v1/usage.export` (a period's usage windows streamed as CSV or JSON lines),
//! `GET /v1/openapi.json` (generated from the handlers' own types), `GET /healthz`
//! (the process is up), `GET /readyz` (the database answers) and `GET /metrics` (Prometheus).

pub mod describe;
pub mod http;
pub mod method;
mod methods;
pub mod metrics;
pub mod tls;
pub mod openapi;
pub mod rate_limit;
pub mod usage_export;
pub mod watch;
pub mod console;
pub mod audit_export;
pub mod web;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use better_compute_core::{Error, ErrorCode};
use better_compute_db::Pool;
use better_compute_iam::Iam;
use better_compute_runtime::Registry;
use tracing::Instrument;

pub use method::{Ctx, Method};

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// The longest a method may run before the request is answered UNAVAILABLE.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest a request's body may take to arrive once its headers have (the default of
/// [`ApiState::body_read_timeout`]).
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What every handler shares.
pub struct ApiState {
    /// The database.
    pub pool: Pool,
    /// Authentication and decisions.
    pub iam: Arc<Iam>,
    /// The modules' registry (command kinds, permissions).
    pub registry: Arc<Registry>,
    methods: BTreeMap<&'static str, Method>,
    /// How long a watch client may leave a full buffer untaken before it is dropped
    /// ([`watch::SLOW_CLIENT_TIMEOUT`]; tests shorten it).
    pub watch_slow_client_timeout: std::time::Duration,
    /// How long a request's body may take to arrive ([`BODY_READ_TIMEOUT`]; tests shorten it).
    pub body_read_timeout: std::time::Duration,
    /// How often a watch stream revalidates its token and grant ([`watch::REVALIDATE_INTERVAL`];
    /// tests shorten it).
    pub watch_revalidate_interval: std::time::Duration,
    /// Usage windows `GET /v1/usage.export` reads per page ([`usage_export::PAGE_ROWS`]; tests
    /// shrink it to walk many pages).
    pub usage_export_page_rows: i64,
    /// Every event [`watch::tail_outbox`] reads, for the watch streams.
    feed: tokio::sync::broadcast::Sender<Arc<watch::FeedItem>>,
    /// Business time, anchored at the first `/readyz` and sampled at every one after: its
    /// `clock.skew` check is part of readiness.
    clock: tokio::sync::OnceCell<better_compute_db::Clock>,
    /// Per-token and per-tenant request rates ([`rate_limit::RateLimits::default`]; set them with
    /// [`ApiState::set_rate_limiter`]).
    pub rate_limiter: rate_limit::RateLimiter,
    /// Capacity's reservations service (batching creates and releases), over connections from
    /// `pool`: every `reservations.*` method goes through it.
    pub reservations: better_compute_capacity::service::Reservations,
}

impl ApiState {
    /// The state over a pool, a resolver and a registry, with every method, and the reservations
    /// service's batchers started (call it inside the server's runtime).
    pub fn new(pool: Pool, iam: Arc<Iam>, registry: Arc<Registry>) -> Arc<ApiState> {
        let methods = methods::all().into_iter().map(|m| (m.name, m)).collect();
        better_compute_runtime::metrics::install(&registry.metrics());
        better_compute_runtime::metrics::install(metrics::METRICS);
        let (feed, _) = tokio::sync::broadcast::channel(watch::FEED_CAPACITY);
        let reservations = better_compute_capacity::service::Reservations::start(pool.clone(), Default::default());
        Arc::new(ApiState { pool, iam, registry, methods, watch_slow_client_timeout: watch::SLOW_CLIENT_TIMEOUT, watch_revalidate_interval: watch::REVALIDATE_INTERVAL, body_read_timeout: BODY_READ_TIMEOUT, usage_export_page_rows: usage_export::PAGE_ROWS, rate_limiter: rate_limit::RateLimiter::new(Default::default()), clock: tokio::sync::OnceCell::new(), feed, reservations })
    }

    /// The state with another rate limiter: other rates, or (tests) another clock. Before the
    /// state is shared.
    pub fn set_rate_limiter(&mut self, limiter: rate_limit::RateLimiter) {
        self.rate_limiter = limiter;
    }

    /// Every method, by name.
    pub fn methods(&self) -> impl Iterator<Item = &Method> {
        self.methods.values()
    }
}

/// Every method, by name (for the OpenAPI document without a server).
pub fn all_methods() -> Vec<Method> {
    methods::all()
}

/// The router.
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/watch", get(watch::watch))
        .route("/v1/audit.export", get(audit_export::export))
        .route("/v1/instances.console", get(console::console).post(|s, c, h, b| call(s, Path("instances.console".to_owned()), c, h, b)))
        .route("/v1/usage.export", get(usage_export::export).post(|s, c, h, b| call(s, Path("usage.export".to_owned()), c, h, b)))
        .route("/v1/{method}", post(call))
        .route("/console", get(web::index))
        .route("/console/", get(web::index))
        .route("/console/app.js", get(web::script))
        .route("/console/app.css", get(web::style))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { error_response(&Error::not_found("path", "this path; methods are POST /v1/<method>, see /v1/openapi.json"), &new_request_id()) })
        .method_not_allowed_fallback(|| async {
            let e = Error::new(ErrorCode::Unsupported, "this HTTP method is not allowed here: methods are POST /v1/<method>; GET serves /v1/watch, /v1/usage.export, /v1/audit.export, /v1/openapi.json, /console, /healthz, /readyz and /metrics");
            let mut r = error_response(&e, &new_request_id());
            *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
            r
        })
        .with_state(state)
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(panic_response))
}

/// Serves the API on `listener` until `shutdown` resolves, with the default connection limits.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<ApiState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, http::HttpSettings::default(), shutdown).await
}

/// [`serve`] with other connection limits (tests shorten the timeouts).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: Arc<ApiState>,
    settings: http::HttpSettings,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tokio::spawn(watch::tail_outbox(Arc::downgrade(&state)));
    http::serve(listener, router(state), settings, shutdown).await
}

/// The request's id: the caller's `x-request-id` when it sends a sane one (1 to 64 of
/// `A-Za-z0-9._-`, so a proxy's id joins its logs with ours), else a new one.
fn request_id_of(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| (1..=64).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)))
        .map_or_else(new_request_id, str::to_owned)
}

fn new_request_id() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    format!("req_{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

/// The longest message an error answer carries: whatever a message repeats of the request, the
/// answer stays small.
pub const MAX_ERROR_MESSAGE_CHARS: usize = 1024;

fn error_response(e: &Error, request_id: &str) -> Response {
    let status = StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = match e.message.char_indices().nth(MAX_ERROR_MESSAGE_CHARS) {
        None => (status, axum::Json(e)).into_response(),
        Some((cut, _)) => {
            let short = Error { message: format!("{}…", &e.message[..cut]), ..e.clone() };
            (status, axum::Json(short)).into_response()
        }
    };
    if let Ok(v) = HeaderValue::from_str(request_id) {
        r.headers_mut().insert("x-request-id", v);
    }
    if let Some(s) = e.details.get("retryAfterS").and_then(|s| s.as_u64()) {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

/// A handler that panicked: 500 with a request id that the log line names, never the panic's text.
fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let request_id = new_request_id();
    let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned()).unwrap_or_default();
    tracing::error!(request_id = %request_id, panic = %what, "a request's handler panicked");
    error_response(&Error::internal(format!("the server failed on this request; report request id {request_id}")), &request_id)
}

fn bearer(headers: &HeaderMap) -> Result<&str, Error> {
    let unauthenticated = || {
        Error::new(ErrorCode::Unauthenticated, "send `Authorization: Bearer <token>` (BETTER_COMPUTE_TOKEN for the CLI)")
    };
    if headers.get_all(header::AUTHORIZATION).iter().nth(1).is_some() {
        return Err(Error::invalid_argument("send one Authorization header, not several"));
    }
    let v = headers.get(header::AUTHORIZATION).ok_or_else(unauthenticated)?.to_str().map_err(|_| unauthenticated())?;
    v.strip_prefix("Bearer ").map(str::trim).filter(|t| !t.is_empty()).ok_or_else(unauthenticated)
}

async fn call(State(state): State<Arc<ApiState>>, Path(name): Path<String>, client: Option<axum::Extension<http::ClientAddr>>, headers: HeaderMap, body: Body) -> Response {
    let request_id = request_id_of(&headers);
    let source = client.map(|c| c.0 .0.ip().to_string());
    let source_for_log = source.clone();
    let span = tracing::info_span!("request", otel.name = %format!("api {name}"), otel.kind = "server", otel.status_code = tracing::field::Empty,
                                   request_id = %request_id, method = %name, code = tracing::field::Empty);
    // A caller's W3C trace context makes this request's span (and every command it enqueues) part
    // of the caller's trace.
    better_compute_trace::follow(&span, headers.get("traceparent").and_then(|v| v.to_str().ok()));
    let started = Instant::now();
    let (code, response) = async {
        let result = handle(&state, &name, &request_id, source, &headers, body).await;
        match result {
            Ok(v) => {
                let mut r = (StatusCode::OK, axum::Json(v)).into_response();
                r.headers_mut().insert("x-request-id", HeaderValue::from_str(&request_id).expect("ascii id"));
                ("OK", r)
            }
            Err(e) => {
                if e.code == ErrorCode::Internal {
                    tracing::error!(error = %e, "request failed");
                }
                (e.code.as_str(), error_response(&e, &request_id))
            }
        }
    }
    .instrument(span.clone())
    .await;
    span.record("code", code);
    // As OpenTelemetry's HTTP conventions have it: a server span fails on a 5xx, not on the
    // caller's mistakes.
    if response.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    let known = state.methods.contains_key(name.as_str());
    let elapsed = started.elapsed();
    metrics::observe(if known { &name } else { "unknown" }, code, elapsed);
    // The access log: one line per request (target `access`; BETTER_COMPUTE_LOG=access=off mutes it).
    tracing::info!(target: "access", request_id = %request_id, method = %name, code, status = response.status().as_u16(),
                   ms = elapsed.as_secs_f64() * 1000.0, source = source_for_log.as_deref().unwrap_or("-"), "request");
    response
}

async fn handle(state: &Arc<ApiState>, name: &str, request_id: &str, source: Option<String>, headers: &HeaderMap, body: Body) -> Result<serde_json::Value, Error> {
    let m = state
        .methods
        .get(name)
        .ok_or_else(|| Error::not_found("method", name).with_details(serde_json::json!({"see": "/v1/openapi.json"})))?
        .clone();
    let secret = bearer(headers)?;
    let principal = state.iam.authenticate(secret).await?;
    state.rate_limiter.take(&principal.token_id, &principal.tenant_id)?;
    if let Some(ct) = headers.get(header::CONTENT_TYPE) && !is_json(ct) {
        return Err(Error::invalid_argument("Content-Type must be application/json"));
    }
    let too_large = || Error::invalid_argument(format!("the body is larger than {MAX_BODY_BYTES} bytes"));
    // A declared length over the limit is refused before a byte of the body is read.
    if let Some(len) = headers.get(header::CONTENT_LENGTH) && len.to_str().ok().and_then(|l| l.parse::<u64>().ok()).is_none_or(|l| l > MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let bytes = tokio::time::timeout(state.body_read_timeout, axum::body::to_bytes(body, MAX_BODY_BYTES))
        .await
        .map_err(|_| Error::invalid_argument(format!("the body did not arrive within {} ms", state.body_read_timeout.as_millis())))?
        // A declared length passed the check above, so a body that fails to arrive in full is
        // shorter than it said; without one, the limit is what stopped it.
        .map_err(|_| match headers.get(header::CONTENT_LENGTH) {
            Some(_) => Error::invalid_argument("the body ended before its Content-Length"),
            None => too_large(),
        })?;
    // The request is the actor of what a changing method changes, and of a refusal.
    let request = Arc::new(method::request_of(&principal, m.name, &bytes, request_id, source));
    let ctx = Ctx { state: state.clone(), principal, actor: better_compute_audit::Actor::Request(request.clone()), changes: m.changes };
    let r = tokio::time::timeout(REQUEST_TIMEOUT, (m.call)(ctx, &bytes)).await;
    let r = r.unwrap_or_else(|_| Err(Error::new(ErrorCode::Unavailable, format!("{name} took longer than {}s; retry (with the same idempotency key)", REQUEST_TIMEOUT.as_secs()))));
    // A refusal changed nothing; its entry is written on its own.
    if let Err(e) = &r
        && e.code == ErrorCode::PermissionDenied
        && let Err(failed) = record_refusal(state, &request).await
    {
        tracing::warn!(error = %failed, "the refusal's audit entry could not be written");
    }
    r
}

/// Writes a refused request's audit entry in a transaction of its own.
async fn record_refusal(state: &ApiState, request: &better_compute_audit::entry::Request) -> Result<(), Error> {
    let mut db = state.pool.get().await.map_err(better_compute_db::DbError::from)?;
    let tx = (**db).transaction().await.map_err(better_compute_db::DbError::from)?;
    better_compute_audit::entry::record(&tx, &request.entry(better_compute_audit::entry::Outcome::Denied)).await?;
    tx.commit().await.map_err(better_compute_db::DbError::from)?;
    Ok(())
}

/// `application/json`, with parameters (`; charset=utf-8`) or without, in any case.
fn is_json(ct: &HeaderValue) -> bool {
    ct.to_str().ok().and_then(|v| v.split(';').next()).is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

async fn openapi_json(State(state): State<Arc<ApiState>>) -> Response {
    axum::Json(openapi::document(state.methods.values())).into_response()
}

/// Ready when the database answers, this process's clock agrees with the database's
/// (`clock.skew`) and the database has every migration of this version (`migrations`):
/// `{ready, checks: [{name, ok, detail}]}`, 503 when not.
async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    let checks = async {
        let db = better_compute_db::pool::read_tx(&state.pool).await.map_err(|e| e.to_string())?;
        let clock = state.clock.get_or_try_init(|| better_compute_db::Clock::start(&*db)).await.map_err(|e| e.to_string())?;
        better_compute_db::readiness::checks(&*db, clock, &state.registry.migrations()).await.map_err(|e| e.to_string())
    }
    .await;
    let (ready, body) = better_compute_db::readiness::answer(checks);
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

async fn metrics_text(State(state): State<Arc<ApiState>>) -> Response {
    let text = better_compute_runtime::metrics::scrape(&state.pool, &state.registry).await;
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    /// A handler with a bug: it panics on what it was given.
    fn broken_handler(found: Option<&'static str>) -> &'static str {
        found.expect("a bug, not a secret")
    }

    #[tokio::test]
    async fn a_panicking_handler_is_answered_500_as_json_with_the_request_id_its_log_line_names() {
        let app: Router = Router::new()
            .route("/p", get(|| async { broken_handler(None) }))
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(panic_response));
        let r = app.oneshot(axum::http::Request::get("/p").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert!(id.starts_with("req_"), "{id}");
        let body: serde_json::Value = serde_json::from_slice(&axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap()).unwrap();
        assert_eq!(body["code"], "INTERNAL");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(&id) && !message.contains("a bug"), "{message}");
    }
}
