//! `GET /v1/watch`: the caller's events as Server-Sent Events.
//!
//! Each event's SSE `id` is its outbox cursor (`txid-seq`), and the stream reads the outbox with
//! the outbox's own rule (only rows older than every running transaction, in cursor order), so a
//! client that reconnects with `Last-Event-ID` resumes exactly after the last event it saw: no gap,
//! no duplicate. A tenant sees its own events, and the fleet's (events with no tenant) only with
//! `compute:nodes:read` at fleet scope. `?types=a,b` and `?subject=x` filter. One reader per API
//! process tails the outbox and broadcasts each event to every stream, which filters in memory; a
//! stream that resumes from further back, or falls behind the broadcast, catches up from the
//! outbox with its own query and then rejoins. A client that does not take what is sent for
//! [`SLOW_CLIENT_TIMEOUT`] is dropped instead of buffered.

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
/// How often the process's reader polls the outbox.
pub const TAIL_POLL: Duration = Duration::from_millis(50);
/// Events the broadcast holds for streams that are behind; further behind, they catch up from
/// the outbox.
pub const FEED_CAPACITY: usize = 4096;
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

/// One event of the process's reader, with the reader's position before it: a stream that is
/// not at `prev` has missed something and catches up from the outbox first.
pub(crate) struct FeedItem {
    prev: Cursor,
    event: outbox::Event,
}

/// The process's outbox reader: broadcasts every event after its start, in order, each with the
/// position before it, until the state is dropped.
pub(crate) async fn tail_outbox(state: std::sync::Weak<ApiState>) {
    let mut cursor = None;
    loop {
        let Some(s) = state.upgrade() else { return };
        let mut more = false;
        if s.feed.receiver_count() == 0 {
            // Nobody watches: read nothing, and start from the present when someone does (a new
            // stream catches up from its own position, so nothing is lost).
            cursor = None;
        } else if let Ok(db) = s.pool.get().await {
            let start = match cursor {
                Some(c) => Ok(c),
                None => outbox::visible_head(&**db).await,
            };
            if let Ok(at) = start {
                cursor = Some(at);
                if let Ok(events) = outbox::read_after(&**db, at, BATCH).await {
                    more = events.len() as i64 == BATCH;
                    let mut prev = at;
                    for event in events {
                        let at = event.cursor;
                        // No receivers is fine: nobody is watching.
                        let _ = s.feed.send(Arc::new(FeedItem { prev, event }));
                        prev = at;
                    }
                    cursor = Some(prev);
                }
            }
        }
        drop(s);
        if !more {
            tokio::time::sleep(TAIL_POLL).await;
        }
    }
}

fn matches(f: &EventFilter, e: &outbox::Event) -> bool {
    let tenant_ok = match (&f.tenant_id, &e.tenant_id) {
        (None, _) => true,
        (Some(t), Some(et)) => t == et,
        (Some(_), None) => f.include_fleet,
    };
    tenant_ok && (f.types.is_empty() || f.types.contains(&e.event_type)) && f.subject.as_ref().is_none_or(|s| *s == e.subject)
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
    let mut feed = state.feed.subscribe();
    let start = match last {
        Some(id) => id.parse::<Cursor>()?,
        // From now on: everything visible already is history.
        None => outbox::visible_head(&**state.pool.get().await.map_err(DbError::from)?).await?,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(WATCH_BUFFER);
    let (pool, patience) = (state.pool.clone(), state.watch_slow_client_timeout);
    tokio::spawn(async move {
        let send = |e: &outbox::Event| {
            let ev = SseEvent::default().id(e.cursor.to_string()).event(&e.event_type).data(e.envelope().to_string());
            let tx = tx.clone();
            async move { tx.send_timeout(Ok(ev), patience).await.is_ok() }
        };
        // Everything after `cursor` that matches has yet to be sent; `upto` is a position the
        // outbox has been read to (rows up to it can no longer appear).
        let catch_up = async |cursor: &mut Cursor, upto: Cursor| -> bool {
            loop {
                let events = match pool.get().await {
                    Ok(db) => outbox::read_matching(&**db, *cursor, BATCH, &filter).await,
                    Err(e) => Err(e.into()),
                };
                // On a failure the client reconnects with its Last-Event-ID and loses nothing.
                let Ok(events) = events else { return false };
                for e in &events {
                    if !send(e).await {
                        tracing::info!("watch client gone or too slow; dropped");
                        return false;
                    }
                    *cursor = e.cursor;
                }
                if (events.len() as i64) < BATCH {
                    *cursor = (*cursor).max(upto);
                    return true;
                }
            }
        };
        let mut cursor = start;
        if !catch_up(&mut cursor, start).await {
            return;
        }
        loop {
            let item = tokio::select! {
                item = feed.recv() => item,
                _ = tx.closed() => return,
            };
            let item = match item {
                Ok(item) => item,
                // Behind the broadcast: the next item's `prev` shows the gap, filled below.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            if item.prev > cursor && !catch_up(&mut cursor, item.prev).await {
                return;
            }
            let e = &item.event;
            if e.cursor > cursor {
                if matches(&filter, e) && !send(e).await {
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
