//! `liveness`: whether a joined node's daemon is there. Level-triggered over every joined node,
//! every 5 seconds:
//!
//! - connected → disconnected when its session closed, its gateway's lease expired (then with
//!   [`GATEWAY_LOSS_GRACE_S`] more grace), or its gateway has not heard from it for
//!   [`SILENT_SESSION_S`];
//! - disconnected → unreachable after [`UNREACHABLE_AFTER_S`] without a session plus the grace,
//!   counted from the join for a node that never opened one. Unreachable joins
//!   `noScheduleReasons` and raises `node.unreachable` (NodeUnreachable); nothing is released;
//! - unreachable → lost only in `provider` and `vps-host` pools with `lostAfter`, never bare metal;
//! - a session silent for [`SILENT_SESSION_S`] counts as closed when the node was last heard, so
//!   its node is unreachable 40 s after it was last heard (plus any grace);
//! - a gap in this job's own runs longer than [`OUTAGE_GAP_S`] (the database or the controllers
//!   were down) ends an outage; every node disconnected then, and every node that disconnects in
//!   the [`OUTAGE_GRACE_S`] after, becomes unreachable 40 s + 5 min after the later of its own
//!   disconnection and the outage's end.
//!
//! A new session makes the node connected again (see [`crate::sessions::open`]).

use better_compute_db::DbError;
use tokio_postgres::GenericClient;

use crate::actions;
use crate::jobs::liveness::LIVENESS;

/// Disconnected this long (plus any grace) is unreachable. Longer than the transport's own
/// detection of a dead peer: HTTP/2 keepalive pings every 10 s, dead after 10 s more.
pub const UNREACHABLE_AFTER_S: i32 = 40;
/// Extra grace after the node's gateway was lost: its daemon needs time to find another.
pub const GATEWAY_LOSS_GRACE_S: i32 = 120;
/// Grace for every node after a database or controller outage.
pub const OUTAGE_GRACE_S: i32 = 300;
/// A gap this long between two runs of this job counts as an outage.
pub const OUTAGE_GAP_S: i32 = 30;
/// A session its gateway has not heard from this long is treated as closed.
pub const SILENT_SESSION_S: i32 = 40;
/// Nodes moved per transition per run; more makes the run return SyncAgain. Small, because each
/// node moved stays locked until the run commits, and a daemon reconnecting to one of them waits
/// for that: a fleet coming back while thousands of its nodes turn unreachable waits for short
/// runs one after another, not for one long one.
pub(crate) const BATCH: i64 = 64;

/// What one pass moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LivenessReport {
    /// Sessions whose gateway's lease expired.
    pub gateway_lost: u64,
    /// Sessions gone silent (or connected nodes without a session).
    pub silent: u64,
    /// Nodes now unreachable.
    pub unreachable: u64,
    /// Nodes now lost.
    pub lost: u64,
    /// Whether this pass is inside an outage's grace (nodes disconnecting now get its 5 minutes).
    pub outage_grace: bool,
}

async fn ids(tx: &impl GenericClient, sql: &str) -> Result<Vec<String>, DbError> {
    Ok(tx.query(sql, &[&BATCH]).await?.iter().map(|r| r.get(0)).collect())
}

/// One pass over every joined node. Runs in the caller's (fenced) transaction.
pub async fn evaluate(tx: &impl GenericClient) -> Result<LivenessReport, DbError> {
    // The job's own heartbeat; a long gap since the last run ends an outage, and its grace runs
    // from now.
    let run = tx
        .query_one(
            &format!(
                "INSERT INTO liveness_runs AS l (singleton, last_run_at, outage_grace_until) VALUES (true, compute_now(), compute_now())
                 ON CONFLICT (singleton) DO UPDATE SET
                    outage_grace_until = CASE WHEN l.last_run_at < compute_now() - make_interval(secs => {OUTAGE_GAP_S})
                                              THEN compute_now() + make_interval(secs => {OUTAGE_GRACE_S}) ELSE l.outage_grace_until END,
                    last_run_at = compute_now()
                 RETURNING outage_grace_until > compute_now()"
            ),
            &[],
        )
        .await?;
    let mut report = LivenessReport { outage_grace: run.get(0), ..Default::default() };

    // Lock order: nodes, then node_sessions. Each pass skips the nodes another transaction holds
    // (a session opening or closing, a daemon's report): their state is changing under them, and
    // the next pass, a few seconds later, sees where it went. Waiting for them instead queues this
    // job behind every report and session of the fleet, and a pass that outlives its lease and
    // fails leaves a gap that looks like an outage of the job itself.
    let gateway_lost = ids(
        tx,
        "SELECT n.id FROM nodes n JOIN node_sessions s ON s.node_id = n.id
          WHERE n.liveness = 'connected' AND s.closed_at IS NULL
            AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.name = 'gateway:' || s.gateway_id AND l.expires_at > compute_now())
          ORDER BY n.id LIMIT $1 FOR UPDATE OF n SKIP LOCKED",
    )
    .await?;
    for id in &gateway_lost {
        close_session(tx, id, "gateway-lost").await?;
        crate::sessions::mark_disconnected(tx, id, GATEWAY_LOSS_GRACE_S).await?;
    }
    report.gateway_lost = gateway_lost.len() as u64;

    let silent = ids(
        tx,
        &format!(
            "SELECT n.id FROM nodes n LEFT JOIN node_sessions s ON s.node_id = n.id AND s.closed_at IS NULL
              WHERE n.liveness = 'connected' AND n.joined_at IS NOT NULL
                AND (s.node_id IS NULL OR s.last_seen_at <= compute_now() - make_interval(secs => {SILENT_SESSION_S}))
              ORDER BY n.id LIMIT $1 FOR UPDATE OF n SKIP LOCKED"
        ),
    )
    .await?;
    for id in &silent {
        close_session(tx, id, "silent").await?;
        crate::sessions::mark_disconnected(tx, id, 0).await?;
        // Without a session since it was last heard, not since the silence was noticed.
        tx.execute(
            "UPDATE nodes n SET liveness_since = LEAST(n.liveness_since, s.last_seen_at) FROM node_sessions s WHERE n.id = $1 AND s.node_id = n.id",
            &[id],
        )
        .await?;
    }
    report.silent = silent.len() as u64;

    if report.outage_grace {
        outage_grace(tx).await?;
    }

    let unreachable = ids(
        tx,
        &format!(
            "SELECT id FROM nodes
              WHERE liveness = 'disconnected' AND joined_at IS NOT NULL
                AND liveness_since + make_interval(secs => {UNREACHABLE_AFTER_S} + disconnect_grace_s) <= compute_now()
              ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
        ),
    )
    .await?;
    for id in &unreachable {
        actions::set_liveness(tx, id, "unreachable").await?;
        better_compute_audit::Actor::job(LIVENESS.name).record(tx, "nodes.markUnreachable", id, None).await?;
    }
    report.unreachable = unreachable.len() as u64;

    // Never bare metal: the pool's CHECK allows lost_after_s only for provider and vps-host pools.
    let lost = ids(
        tx,
        "SELECT n.id FROM nodes n JOIN pools p ON p.id = n.pool_id
          WHERE n.liveness = 'unreachable' AND p.kind IN ('provider', 'vps-host') AND p.lost_after_s IS NOT NULL
            AND n.liveness_since + make_interval(secs => p.lost_after_s) <= compute_now()
          ORDER BY n.id LIMIT $1 FOR UPDATE OF n SKIP LOCKED",
    )
    .await?;
    for id in &lost {
        actions::set_liveness(tx, id, "lost").await?;
        better_compute_audit::Actor::job(LIVENESS.name).record(tx, "nodes.markLost", id, None).await?;
    }
    report.lost = lost.len() as u64;
    Ok(report)
}

/// An outage's grace counts from its end: every node disconnected before the outage ended, or
/// while its grace lasts (a session closed, gone silent, its gateway lost), becomes unreachable no
/// earlier than 40 s + 5 min after the later of its own disconnection and the outage's end, so
/// never before `liveness_runs.outage_grace_until`.
async fn outage_grace(tx: &impl GenericClient) -> Result<(), DbError> {
    tx.execute(
        &format!(
            "WITH ended AS (SELECT outage_grace_until - make_interval(secs => {OUTAGE_GRACE_S}) AS at FROM liveness_runs WHERE singleton),
                  owed AS (SELECT n.id, {OUTAGE_GRACE_S} + greatest(0, ceil(extract(epoch FROM e.at - n.liveness_since)))::int AS grace_s
                             FROM nodes n, ended e WHERE n.liveness = 'disconnected' AND n.joined_at IS NOT NULL),
                  raised AS (SELECT n.id, o.grace_s FROM nodes n JOIN owed o ON o.id = n.id WHERE n.disconnect_grace_s < o.grace_s
                              ORDER BY n.id FOR UPDATE OF n SKIP LOCKED)
             UPDATE nodes n SET disconnect_grace_s = r.grace_s FROM raised r WHERE n.id = r.id"
        ),
        &[],
    )
    .await?;
    Ok(())
}

async fn close_session(tx: &impl GenericClient, node_id: &str, reason: &str) -> Result<(), DbError> {
    tx.execute(
        "UPDATE node_sessions SET closed_at = compute_now(), close_reason = $2 WHERE node_id = $1 AND closed_at IS NULL",
        &[&node_id, &reason],
    )
    .await?;
    Ok(())
}
