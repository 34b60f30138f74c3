//! `GET /v1/instances.console`: an instance's serial console as Server-Sent Events
//! (`POST /v1/instances.console` answers what is kept as one JSON page).
//!
//! The console is what the instance's host sent of it, kept in the database (the last 64 KiB), so
//! any API process serves any instance. A stream sends what is kept from `offset` (all of it when
//! none is given), then polls for more: every [`POLL_BUSY`] while output flows, backing off to
//! [`POLL_IDLE`] when it does not. Each `output` event's `id` is the offset after it, so a client
//! that reconnects with `Last-Event-ID` resumes there; its data is `{offset, nextOffset, text,
//! truncated}` (truncated: bytes before `offset` are no longer kept). The stream needs
//! `compute:instances:console` in the instance's tenant, is checked again every
//! [`crate::watch::REVALIDATE_INTERVAL`] and at its token's expiry, and ends with an `end` event
//! when the grant ends or the instance is deleted. At most [`MAX_STREAMS`] run per process.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use better_compute_core::{Error, ErrorCode};
use better_compute_iam::Principal;
use better_compute_runtime::authz::{Authorizer, Resource};
use better_compute_vps::instances;
use serde::Deserialize;

use crate::ApiState;

/// The permission a console needs.
pub const CONSOLE: &str = "compute:instances:console";
/// The poll interval while the console writes.
pub const POLL_BUSY: Duration = Duration::from_millis(250);
/// The longest poll interval of a quiet console.
pub const POLL_IDLE: Duration = Duration::from_secs(2);
/// Console streams one API process serves at once.
pub const MAX_STREAMS: usize = 256;

/// The query of `GET /v1/instances.console`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ConsoleQuery {
    instance_id: String,
    #[serde(default)]
    tenant_id: Option<String>,
    /// Where to start (the `Last-Event-ID` header wins); all that is kept when absent.
    #[serde(default)]
    offset: Option<i64>,
}

static STREAMS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_STREAMS);

pub(crate) async fn console(State(state): State<Arc<ApiState>>, headers: HeaderMap, query: Result<Query<ConsoleQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let request_id = crate::new_request_id();
    match open(&state, &headers, query).await {
        Ok(stream) => stream.into_response(),
        Err(e) => crate::error_response(&e, &request_id),
    }
}

/// Whether the principal may still read consoles in its tenant, and for how long its token lasts.
async fn grant(state: &ApiState, principal: &Principal) -> Result<Duration, Error> {
    let left = state.iam.token_time_left(&principal.token_id).await?;
    state.iam.check(principal.caller(), CONSOLE, Resource::Tenant).await?;
    Ok(left)
}

async fn open(
    state: &Arc<ApiState>,
    headers: &HeaderMap,
    query: Result<Query<ConsoleQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>> + use<>>, Error> {
    let principal = state.iam.authenticate(crate::bearer(headers)?).await?;
    state.rate_limiter.take(&principal.token_id, &principal.tenant_id)?;
    let Query(q) = query.map_err(|e| Error::invalid_argument(format!("bad instances.console query: {e}")))?;
    if q.tenant_id.as_deref().is_some_and(|t| t != principal.tenant_id) {
        return Err(Error::not_found("tenant", q.tenant_id.as_deref().unwrap_or_default()));
    }
    let left = grant(state, &principal).await?;
    let from = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().ok().and_then(|s| s.parse::<i64>().ok()).ok_or_else(|| Error::invalid_argument("Last-Event-ID must be a console offset this stream sent"))?),
        None => q.offset,
    };
    // The first read answers errors (an instance not found, a bad offset) before the stream starts.
    let first = instances::console(&*better_compute_db::pool::read_tx(&state.pool).await?, principal.caller(), &q.instance_id, from).await?;
    let permit = STREAMS
        .try_acquire()
        .map_err(|_| Error::new(ErrorCode::Unavailable, format!("this API process serves {MAX_STREAMS} console streams already; try again shortly")))?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(4);
    let (pool, patience, every) = (state.pool.clone(), state.watch_slow_client_timeout, state.watch_revalidate_interval);
    let state = Arc::downgrade(state);
    let id = q.instance_id;
    tokio::spawn(async move {
        let _permit = permit;
        let end = async |why: serde_json::Value| {
            let _ = tx.send_timeout(Ok(SseEvent::default().event("end").data(why.to_string())), patience).await;
        };
        let mut tail = first;
        let mut wait = POLL_BUSY;
        let mut expiry = std::pin::pin!(tokio::time::sleep(left));
        let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            if !tail.text.is_empty() || tail.truncated {
                let ev = SseEvent::default().id(tail.next_offset.to_string()).event("output").data(serde_json::json!(tail).to_string());
                if tx.send_timeout(Ok(ev), patience).await.is_err() {
                    return;
                }
                wait = POLL_BUSY;
            } else {
                wait = (wait * 2).min(POLL_IDLE);
            }
            let from = tail.next_offset;
            tokio::select! {
                _ = tx.closed() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = &mut expiry => {
                    end(serde_json::json!(Error::new(ErrorCode::Unauthenticated, "the token expired"))).await;
                    return;
                }
                _ = recheck.tick() => {
                    let Some(state) = state.upgrade() else { return };
                    match grant(&state, &principal).await {
                        Ok(left) => expiry.as_mut().reset(tokio::time::Instant::now() + left.max(Duration::from_millis(100))),
                        Err(e) if e.code == ErrorCode::Unavailable || e.code == ErrorCode::Internal => {}
                        Err(e) => {
                            end(serde_json::json!(e)).await;
                            return;
                        }
                    }
                }
            }
            let read = match better_compute_db::pool::read_tx(&pool).await {
                Ok(db) => match instances::get(&*db, principal.caller(), &id).await {
                    Ok(v) if v.state == "deleted" => {
                        end(serde_json::json!({"code": "OK", "message": format!("instance {id} was deleted")})).await;
                        return;
                    }
                    Ok(_) => instances::console(&*db, principal.caller(), &id, Some(from)).await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(e.into()),
            };
            match read {
                Ok(t) => tail = t,
                // The database did not answer: try again at the next poll.
                Err(e) if e.code == ErrorCode::Unavailable || e.code == ErrorCode::Internal => {
                    tail.text.clear();
                    tail.truncated = false;
                }
                Err(e) => {
                    end(serde_json::json!(e)).await;
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(crate::watch::KEEP_ALIVE).text("keep-alive")))
}
