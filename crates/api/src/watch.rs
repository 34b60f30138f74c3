//! `GET /v1/watch`: the caller's events as Server-Sent Events.
//!
//! Each event's SSE `id` is its outbox cursor (`txid-seq`), and the stream reads the outbox with
//! the outbox's own rule (only rows older than every running transaction, in cursor order), so a
//! client that reconnects with `Last-Event-ID` resumes exactly after the last event it saw: no gap,
//! no duplicate. A tenant sees its own events, and the fleet's (events with no tenant) only with
//! `compute:nodes:read` at fleet scope. `?types=a,b` and `?subject=x` filter. One poller per API
//! process publishes the outbox's visible head; streams read when it moves. A client that does not
//! take what is sent for [`SLOW_CLIENT_TIMEOUT`] is dropped instead of buffered.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::authz::{Authorizer, Resource};
use better_compute_runtime::outbox::{self, Cursor, EventFilter};
use serde::Deserialize;

use crate::ApiState;

/// Events sent ahead of a client at most.
pub const WATCH_BUFFER: usize = 256;
/// How long a client may leave a full buffer untaken before it is dropped.
pub const SLOW_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The interval of the keep-alive comment.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How often the process's poller reads the outbox's visible head.
pub const HEAD_POLL: Duration = Duration::from_millis(100);
/// Events read per query.
const BATCH: i64 = 500;

/// The query of `/v1/watch`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct WatchQuery {
    /// Comma-separated event types (default: all).
    #[serde(default)]
    types: Option<String>,
    /// Only events about this subject.
    #[serde(default)]
    subject: Option<String>,
    /// Resume after this event id (also the `Last-Event-ID` header, which wins).
    #[serde(default)]
    last_event_id: Option<String>,
}

/// Publishes the outbox's visible head every [`HEAD_POLL`] until the state is dropped.
pub(crate) async fn poll_head(state: std::sync::Weak<ApiState>) {
    loop {
        let Some(s) = state.upgrade() else { return };
        if let Ok(db) = s.pool.get().await {
            if let Ok(head) = outbox::visible_head(&**db).await {
                s.head.send_if_modified(|h| std::mem::replace(h, head) != head);
            }
        }
        drop(s);
        tokio::time::sleep(HEAD_POLL).await;
    }
}

pub(crate) async fn watch(State(state): State<Arc<ApiState>>, headers: HeaderMap, query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let request_id = crate::new_request_id();
    match open(&state, &headers, query).await {
        Ok(stream) => stream.into_response(),
        Err(e) => crate::error_response(&e, &request_id),
    }
}

async fn open(
    state: &Arc<ApiState>,
    headers: &HeaderMap,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>> + use<>>, Error> {
    let principal = state.iam.authenticate(crate::bearer(headers)?).await?;
    let Query(q) = query.map_err(|e| Error::invalid_argument(format!("bad watch query: {e}")))?;
    let include_fleet = state.iam.check(principal.caller(), "compute:nodes:read", Resource::Fleet).await.is_ok();
    let filter = EventFilter {
        tenant_id: Some(principal.tenant_id.clone()),
        include_fleet,
        types: q.types.iter().flat_map(|t| t.split(',')).map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect(),
        subject: q.subject.clone(),
    };
    let last = headers.get("last-event-id").and_then(|v| v.to_str().ok()).map(String::from).or(q.last_event_id);
    let mut head = state.head.subscribe();
    let start = match last {
        Some(id) => id.parse::<Cursor>()?,
        // From now on: everything visible already is history.
        None => outbox::visible_head(&**state.pool.get().await.map_err(DbError::from)?).await?,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(WATCH_BUFFER);
    let pool = state.pool.clone();
    tokio::spawn(async move {
        let mut cursor = start;
        loop {
            head.borrow_and_update();
            let events = match pool.get().await {
                Ok(db) => outbox::read_matching(&**db, cursor, BATCH, &filter).await,
                Err(e) => Err(e.into()),
            };
            let Ok(events) = events else {
                // The client reconnects with its Last-Event-ID and loses nothing.
                return;
            };
            if events.is_empty() {
                tokio::select! {
                    _ = head.changed() => {}
                    _ = tokio::time::sleep(KEEP_ALIVE) => {}
                    _ = tx.closed() => return,
                }
                continue;
            }
            for e in events {
                let ev = SseEvent::default().id(e.cursor.to_string()).event(&e.event_type).data(e.envelope().to_string());
                if tx.send_timeout(Ok(ev), SLOW_CLIENT_TIMEOUT).await.is_err() {
                    tracing::info!("watch client gone or too slow; dropped");
                    return;
                }
                cursor = e.cursor;
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive")))
}
