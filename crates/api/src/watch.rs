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
//!
//! A stream lives only as long as its grant: it ends (with a last `end` event holding the error)
//! when its token is revoked or expires, at once on the process that served the revocation and on
//! the `authz_changes` tail elsewhere, and every [`REVALIDATE_INTERVAL`] at the latest. A removed
//! binding narrows it (fleet events need `compute:nodes:read` at fleet scope) or, when the identity
//! holds nothing any more, ends it.

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
use better_compute_runtime::outbox::{self, Cursor, EventFilter};
use serde::Deserialize;

use crate::ApiState;

/// Events sent ahead of a client at most.
pub const WATCH_BUFFER: usize = 256;
/// How long a client may leave a full buffer untaken before it is dropped.
pub const SLOW_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// The interval of the keep-alive comment.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How long the process's reader waits before it reads the outbox again after a read that found
/// nothing.
pub const TAIL_POLL: Duration = Duration::from_millis(50);
/// How long it waits after a read that found events: while events flow it reads again soon, so an
/// event reaches the streams a few milliseconds after it becomes readable, and an idle process
/// still reads only every [`TAIL_POLL`]. (A NOTIFY from every transaction that writes an event
/// would wake it sooner, but NOTIFY holds a database-wide lock from the statement to the end of
/// its transaction, which would serialise every such commit.)
pub const TAIL_POLL_BUSY: Duration = Duration::from_millis(5);
/// Events the broadcast holds for streams that are behind; further behind, they catch up from
/// the outbox.
pub const FEED_CAPACITY: usize = 4096;
/// How often a stream asks the database again whether its token is live and what its bindings
/// let it see, besides at once on a revocation or binding change this process learns of and at
/// its token's expiry: the bound on how long a stream outlives a change whose tail stalled.
pub const REVALIDATE_INTERVAL: Duration = Duration::from_secs(30);
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
/// not at `prev` has missed something and catches up from the outbox first. An item without an
/// event is the reader's starting position, sent when it starts reading: a stream that began
/// before it catches up to it at once instead of at the next event.
pub(crate) struct FeedItem {
    prev: Cursor,
    event: Option<outbox::Event>,
}

/// The process's outbox reader: broadcasts every event after its start, in order, each with the
/// position before it, until the state is dropped.
pub(crate) async fn tail_outbox(state: std::sync::Weak<ApiState>) {
    let mut cursor = None;
    loop {
        let Some(s) = state.upgrade() else { return };
        let (mut more, mut found) = (false, false);
        if s.feed.receiver_count() == 0 {
            // Nobody watches: read nothing, and start from the present when someone does (a new
            // stream catches up from its own position, so nothing is lost).
            cursor = None;
        } else if let Ok(db) = better_compute_db::pool::read_tx(&s.pool).await {
            let start = match cursor {
                Some(c) => Ok(c),
                None => outbox::visible_head(&*db).await.inspect(|&at| {
                    let _ = s.feed.send(Arc::new(FeedItem { prev: at, event: None }));
                }),
            };
            if let Ok(at) = start {
                cursor = Some(at);
                if let Ok(events) = outbox::read_after(&*db, at, BATCH).await {
                    more = events.len() as i64 == BATCH;
                    found = !events.is_empty();
                    if found {
                        // Revocations committed before these events reach the streams first, so a
                        // revoked token is not shown an event that came after its revocation.
                        if let Err(e) = s.iam.apply_changes().await {
                            tracing::warn!(error = %e, "authz_changes tail failed before broadcasting events");
                        }
                    }
                    let mut prev = at;
                    for event in events {
                        let at = event.cursor;
                        // No receivers is fine: nobody is watching.
                        let _ = s.feed.send(Arc::new(FeedItem { prev, event: Some(event) }));
                        prev = at;
                    }
                    cursor = Some(prev);
                }
            }
        }
        drop(s);
        if !more {
            tokio::time::sleep(if found { TAIL_POLL_BUSY } else { TAIL_POLL }).await;
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

/// What a stream may see (whether fleet events too) and how long its token has left, decided
/// again whenever its identity or token changes; an error once it may see nothing (its token
/// revoked or expired, or no binding left).
async fn grant(state: &ApiState, principal: &Principal) -> Result<(bool, Duration), Error> {
    let left = state.iam.token_time_left(&principal.token_id).await?;
    let include_fleet = state.iam.check(principal.caller(), "compute:nodes:read", Resource::Fleet).await.is_ok();
    if !include_fleet && !state.iam.holds_anything(&principal.identity_id).await? {
        return Err(Error::new(ErrorCode::PermissionDenied, "you hold no role: a watch stream shows what your bindings let you see"));
    }
    Ok((include_fleet, left))
}

#[allow(clippy::too_many_lines, reason = "the stream's whole life in order (authenticate, subscribe before the grant is read, replay, follow, end when the grant does); split, the order that keeps a change from being missed is harder to see")]
async fn open(
    state: &Arc<ApiState>,
    headers: &HeaderMap,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>> + use<>>, Error> {
    let principal = state.iam.authenticate(crate::bearer(headers)?).await?;
    state.rate_limiter.take(&principal.token_id, &principal.tenant_id)?;
    let Query(q) = query.map_err(|e| Error::invalid_argument(format!("bad watch query: {e}")))?;
    // Subscribed before the grant is read, so no change after it is missed.
    let mut changes = state.iam.subscribe_changes();
    let (include_fleet, left) = grant(state, &principal).await?;
    let mut filter = EventFilter {
        tenant_id: Some(principal.tenant_id.clone()),
        include_fleet,
        types: q.types.iter().flat_map(|t| t.split(',')).map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect(),
        subject: q.subject.clone(),
    };
    let header = match headers.get("last-event-id") {
        Some(v) => Some(v.to_str().map_err(|_| Error::invalid_argument("Last-Event-ID must be an event id of this stream, like 1234-5"))?.to_owned()),
        None => None,
    };
    let last = header.or(q.last_event_id);
    let mut feed = state.feed.subscribe();
    let head = outbox::visible_head(&*better_compute_db::pool::read_tx(&state.pool).await?).await?;
    let start = match last {
        Some(id) => {
            let at = id.parse::<Cursor>()?;
            // No event this stream sent is past the head: a cursor beyond it is not ours.
            if at > head {
                return Err(Error::invalid_argument(format!(
                    "Last-Event-ID {at} is ahead of every event; resume from an id this stream sent, or leave it out to start from now"
                )));
            }
            at
        }
        // From now on: everything visible already is history.
        None => head,
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(WATCH_BUFFER);
    let (pool, patience, every) = (state.pool.clone(), state.watch_slow_client_timeout, state.watch_revalidate_interval);
    let state = Arc::downgrade(state);
    tokio::spawn(async move {
        let send = |e: &outbox::Event| {
            let ev = SseEvent::default().id(e.cursor.to_string()).event(&e.event_type).data(e.envelope().to_string());
            let tx = tx.clone();
            async move { tx.send_timeout(Ok(ev), patience).await.is_ok() }
        };
        // Everything after `cursor` that matches has yet to be sent; `upto` is a position the
        // outbox has been read to (rows up to it can no longer appear).
        let catch_up = async |cursor: &mut Cursor, upto: Cursor, filter: &EventFilter| -> bool {
            loop {
                let events = match better_compute_db::pool::read_tx(&pool).await {
                    Ok(db) => outbox::read_matching(&*db, *cursor, BATCH, filter).await,
                    Err(e) => Err(e),
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
        if !catch_up(&mut cursor, start, &filter).await {
            return;
        }
        let mut expiry = std::pin::pin!(tokio::time::sleep(left));
        let mut recheck = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            // Biased: a change this process learnt of before an event arrived is decided first.
            let item = tokio::select! {
                biased;
                _ = tx.closed() => return,
                change = changes.recv() => {
                    let mine = match &change {
                        Ok(c) => c.identity_id == principal.identity_id || c.token_id.as_deref() == Some(principal.token_id.as_str()),
                        // Behind the changes: any of them may have been ours.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => true,
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    };
                    if !mine {
                        continue;
                    }
                    None
                }
                _ = &mut expiry => None,
                _ = recheck.tick() => None,
                item = feed.recv() => Some(item),
            };
            let Some(item) = item else {
                // Decide again what this stream may see; end it when nothing.
                let Some(state) = state.upgrade() else { return };
                match grant(&state, &principal).await {
                    Ok((include_fleet, left)) => {
                        filter.include_fleet = include_fleet;
                        // Not sooner than 100 ms: a token a hair from its expiry is not asked about in a spin.
                        expiry.as_mut().reset(tokio::time::Instant::now() + left.max(Duration::from_millis(100)));
                    }
                    Err(e) if e.code == ErrorCode::Unavailable || e.code == ErrorCode::Internal => {
                        // The database did not answer: the next check decides.
                        tracing::warn!(error = %e, "watch stream could not revalidate its token");
                    }
                    Err(e) => {
                        tracing::info!(code = %e.code, "watch stream ended: its token or bindings no longer allow it");
                        let end = SseEvent::default().event("end").data(serde_json::json!(e).to_string());
                        let _ = tx.send_timeout(Ok(end), patience).await;
                        return;
                    }
                }
                continue;
            };
            let item = match item {
                Ok(item) => item,
                // Behind the broadcast: the next item's `prev` shows the gap, filled below.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            };
            if item.prev > cursor && !catch_up(&mut cursor, item.prev, &filter).await {
                return;
            }
            let Some(e) = &item.event else { continue };
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
