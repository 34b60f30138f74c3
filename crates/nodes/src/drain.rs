//! Drains: emptying a node for maintenance, within its pool's disruption budget.
//!
//! `nodes.drain` cordons the node at once (the `draining` reason in `noScheduleReasons`) and queues
//! a drain. The `drain` job, one key per pool, admits the pool's queued drains in request order
//! while the budget allows (a drain that does not fit holds up the ones behind it), then brings each
//! admitted drain to `drained`: in mode `wait` once the node's reservations have ended by
//! themselves, in mode `evict` by telling their tenants at once and ending them at the deadline
//! with reason `drained`. What holds a node is asked of every module's occupants
//! ([`better_compute_runtime::occupancy`]), so this module knows nothing of reservations.
//!
//! Disconnected is not dead: nothing here releases anything because a node is unreachable. An
//! unreachable node counts against the budget (it is unavailable already), and draining it follows
//! the same rules as any other.
//!
//! Lifecycle per `DRAIN_STATE_TABLE`: queued → draining → drained → retired, and cancelled (undrain)
//! from any open state. Lock order: a drain's own row is taken first, as the row being changed; the
//! admission pass takes the pool's row before its drains (docs/architecture.md).

use better_compute_core::id::DrainId;
use better_compute_core::state::{DrainState, State, DRAIN_STATE_TABLE};
use better_compute_core::Error;
use better_compute_db::clock::rfc3339_sql as ts;
use better_compute_db::DbError;
use better_compute_runtime::occupancy::Occupancy;

use better_compute_runtime::work_queue;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::actions::{self, node_event};
use crate::conditions::Condition;
use crate::jobs::drain::DRAIN_KIND;

/// An evicting drain's deadline when the request names none.
pub const DEFAULT_EVICT_AFTER_S: i64 = 3600;
/// After the first reservation is due to end, the drain looks again this much later, once the
/// reservation's own job has ended it.
const AFTER_END_S: f64 = 1.0;

/// How a drain treats the reservations on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DrainMode {
    /// They end by themselves.
    Wait,
    /// Their tenants are told at once, and they end at the deadline with reason `drained`.
    Evict,
}

impl DrainMode {
    /// `wait` or `evict`.
    pub fn as_str(self) -> &'static str {
        match self {
            DrainMode::Wait => "wait",
            DrainMode::Evict => "evict",
        }
    }
}

/// A request to drain a node.
#[derive(Debug, Clone)]
pub struct DrainRequest<'a> {
    /// The node.
    pub node_id: &'a str,
    /// Why (required; shown to operators and, for an eviction, to tenants).
    pub reason: &'a str,
    /// Wait or evict.
    pub mode: DrainMode,
    /// RFC 3339; evict only (default: an hour from now).
    pub deadline: Option<&'a str>,
    /// Who asked, `tenant/identity`.
    pub requested_by: &'a str,
}

/// A drain as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DrainView {
    /// `drn_…`.
    pub id: String,
    /// Its node.
    pub node_id: String,
    /// The node's pool, whose budget it counts against.
    pub pool_id: String,
    /// `wait` or `evict`.
    pub mode: DrainMode,
    /// Why.
    pub reason: String,
    /// When an evicting drain ends what still holds the node.
    pub deadline: Option<String>,
    /// queued, draining, drained, cancelled or retired.
    #[schemars(extend("enum" = ["queued", "draining", "drained", "cancelled", "retired"]))]
    pub state: String,
    /// Who asked.
    pub requested_by: String,
    /// RFC 3339.
    pub requested_at: String,
    /// When the budget admitted it.
    pub admitted_at: Option<String>,
    /// When nothing held the node any more.
    pub drained_at: Option<String>,
    /// The node's `Draining` condition.
    pub condition: Condition,
    /// The record's version.
    pub version: i64,
}

fn view_sql(alias: &str) -> String {
    let c = |col: &str| format!("{alias}.{col}");
    format!(
        "{a}.id, {a}.node_id, {a}.pool_id, {a}.mode, {a}.reason, {}, {a}.state, {a}.requested_by, {}, {}, {}, {a}.condition_reason, {a}.condition_message, {}, {a}.version",
        ts(&c("deadline")),
        ts(&c("requested_at")),
        ts(&c("admitted_at")),
        ts(&c("drained_at")),
        ts(&c("condition_since")),
        a = alias
    )
}

fn view(r: &tokio_postgres::Row) -> DrainView {
    DrainView {
        id: r.get(0),
        node_id: r.get(1),
        pool_id: r.get(2),
        mode: if r.get::<_, &str>(3) == "evict" { DrainMode::Evict } else { DrainMode::Wait },
        reason: r.get(4),
        deadline: r.get(5),
        state: r.get(6),
        requested_by: r.get(7),
        requested_at: r.get(8),
        admitted_at: r.get(9),
        drained_at: r.get(10),
        condition: Condition { kind: "Draining".into(), reason: r.get(11), message: r.get(12), since: r.get(13) },
        version: r.get(14),
    }
}

/// The node's open drain (queued, draining or drained), if any.
pub async fn open_drain(db: &impl GenericClient, node_id: &str) -> Result<Option<DrainView>, DbError> {
    let sql = format!("SELECT {} FROM node_drains d WHERE d.node_id = $1 AND d.state IN ('queued', 'draining', 'drained')", view_sql("d"));
    Ok(db.query_opt(&sql, &[&node_id]).await?.map(|r| view(&r)))
}

/// The drains of a pool that are open, in request order (the order the budget admits them in).
pub async fn pool_drains(db: &impl GenericClient, pool_id: &str) -> Result<Vec<DrainView>, DbError> {
    let sql = format!(
        "SELECT {} FROM node_drains d WHERE d.pool_id = $1 AND d.state IN ('queued', 'draining', 'drained') ORDER BY d.requested_at, d.id",
        view_sql("d")
    );
    Ok(db.query(&sql, &[&pool_id]).await?.iter().map(view).collect())
}

/// `nodes.drain`: cordons the node at once and queues its drain for the pool's budget. Asking again
/// for the same mode and reason while a drain is open returns it unchanged; asking for another is a
/// `CONFLICT` (undrain first).
pub async fn request(tx: &impl GenericClient, r: &DrainRequest<'_>) -> Result<DrainView, DbError> {
    if r.reason.trim().is_empty() {
        return Err(Error::invalid_argument("a drain needs a reason (shown to operators, and to tenants when it evicts)").into());
    }
    better_compute_core::bounds::check_text("reason", r.reason, better_compute_core::bounds::NOTE_CHARS)?;
    match (r.mode, r.deadline) {
        (DrainMode::Wait, Some(_)) => {
            return Err(Error::invalid_argument("a wait drain has no deadline: reservations end by themselves; use mode evict to end them at a deadline").into());
        }
        (_, Some(d)) => better_compute_core::time::check_rfc3339("deadline", d)?,
        _ => {}
    }
    // The node's row first (its reason is added below), then the drain's.
    let node = tx
        .query_opt("SELECT pool_id, retired_at IS NOT NULL FROM nodes WHERE id = $1 FOR UPDATE", &[&r.node_id])
        .await?
        .ok_or_else(|| Error::not_found("node", r.node_id))?;
    let (pool_id, retired): (String, bool) = (node.get(0), node.get(1));
    if retired {
        return Err(Error::failed_precondition(format!("node {} is retired", r.node_id)).into());
    }
    if let Some(open) = open_drain(tx, r.node_id).await? {
        if open.mode == r.mode && open.reason == r.reason {
            return match (r.deadline, &open.deadline) {
                (Some(asked), Some(_)) => move_deadline_earlier(tx, &open, &pool_id, asked).await,
                _ => Ok(open),
            };
        }
        return Err(Error::conflict(format!(
            "node {} already has a {} drain ({}); undrain it first to change it",
            r.node_id,
            open.mode.as_str(),
            open.state
        ))
        .into());
    }
    let id = DrainId::generate().to_string();
    tx.execute(
        "INSERT INTO node_drains (id, node_id, pool_id, mode, reason, deadline, state, requested_by, condition_reason, condition_message)
         VALUES ($1, $2, $3, $4, $5,
                 CASE WHEN $4 = 'evict' THEN coalesce($6::text::timestamptz, compute_now() + make_interval(secs => $7)) END,
                 'queued', $8, 'Queued', 'waiting for the drain job to weigh it against the pool''s disruption budget')",
        &[&id, &r.node_id, &pool_id, &r.mode.as_str(), &r.reason, &r.deadline, &(DEFAULT_EVICT_AFTER_S as f64), &r.requested_by],
    )
    .await?;
    actions::set_reason(tx, r.node_id, actions::DRAINING, true).await?;
    let drain = open_drain(tx, r.node_id).await?.ok_or_else(|| Error::internal("the drain just written is missing"))?;
    node_event(
        tx,
        r.node_id,
        "node.drainRequested",
        serde_json::json!({"drainId": drain.id, "mode": drain.mode, "reason": drain.reason, "deadline": drain.deadline}),
    )
    .await?;
    work_queue::enqueue(tx, &DRAIN_KIND, &pool_id).await?;
    Ok(drain)
}

/// An evicting drain asked again with a deadline: an earlier one moves the deadline (its tenants
/// are told again, with the new one), the same one changes nothing, a later one is refused.
async fn move_deadline_earlier(tx: &impl GenericClient, open: &DrainView, pool_id: &str, asked: &str) -> Result<DrainView, DbError> {
    let row = tx
        .query_one(
            "WITH old AS (SELECT deadline FROM node_drains WHERE id = $1 FOR UPDATE)
             UPDATE node_drains d SET deadline = least(d.deadline, $2::text::timestamptz),
                    eviction_requested_at = CASE WHEN $2::text::timestamptz < d.deadline THEN NULL ELSE d.eviction_requested_at END,
                    version = d.version + CASE WHEN $2::text::timestamptz < d.deadline THEN 1 ELSE 0 END
               FROM old WHERE d.id = $1
             RETURNING $2::text::timestamptz > old.deadline",
            &[&open.id, &asked],
        )
        .await?;
    if row.get::<_, bool>(0) {
        let deadline = open.deadline.as_deref().unwrap_or_default();
        return Err(Error::conflict(format!(
            "node {}'s evicting drain ends what holds the node at {deadline}; a drain's deadline only moves earlier (undrain it first to set a later one)",
            open.node_id
        ))
        .into());
    }
    let moved = open_drain(tx, &open.node_id).await?.ok_or_else(|| Error::internal("the drain just changed is missing"))?;
    if moved.deadline != open.deadline {
        work_queue::enqueue(tx, &DRAIN_KIND, pool_id).await?;
    }
    Ok(moved)
}

async fn move_drain(tx: &impl GenericClient, id: &str, from: DrainState, to: DrainState, set: &str) -> Result<(), DbError> {
    DRAIN_STATE_TABLE.check(from, to)?;
    let sql = format!("UPDATE node_drains SET state = $3, {set}, version = version + 1 WHERE id = $1 AND state = $2");
    let n = tx.execute(&sql, &[&id, &from.as_str(), &to.as_str()]).await?;
    assert_eq!(n, 1, "drain {id} was locked in state {} by its caller", from.as_str());
    Ok(())
}

/// The node's open drain, locked, with its state.
async fn lock_open(tx: &impl GenericClient, node_id: &str) -> Result<Option<(String, String, DrainState)>, DbError> {
    let row = tx
        .query_opt("SELECT id, pool_id, state FROM node_drains WHERE node_id = $1 AND state IN ('queued', 'draining', 'drained') FOR UPDATE", &[&node_id])
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1), DrainState::parse(r.get(2)).expect("a drain state of the table's CHECK"))))
}

/// `nodes.undrain`: ends the node's open drain and lifts its `draining` reason; reservations it
/// already ended stay ended. Returns whether there was one (undraining twice is harmless).
pub async fn undrain(tx: &impl GenericClient, node_id: &str) -> Result<bool, DbError> {
    let Some((id, pool_id, state)) = lock_open(tx, node_id).await? else {
        tx.query_opt("SELECT 1 FROM nodes WHERE id = $1", &[&node_id]).await?.ok_or_else(|| Error::not_found("node", node_id))?;
        return Ok(false);
    };
    move_drain(tx, &id, state, DrainState::Cancelled, "ended_at = compute_now()").await?;
    actions::set_reason(tx, node_id, actions::DRAINING, false).await?;
    node_event(tx, node_id, "node.undrained", serde_json::json!({"drainId": id})).await?;
    // Its place in the budget is free: a queued drain behind it may go now.
    work_queue::enqueue(tx, &DRAIN_KIND, &pool_id).await?;
    Ok(true)
}

/// `nodes.retire`: a drained node leaves placement forever. Its certificates are revoked, so its
/// daemon can never open a session again; its rows and history are kept.
pub async fn retire(tx: &impl GenericClient, node_id: &str) -> Result<(), DbError> {
    let open = lock_open(tx, node_id).await?;
    let Some((id, _, DrainState::Drained)) = open else {
        let retired = tx.query_opt("SELECT retired_at IS NOT NULL FROM nodes WHERE id = $1", &[&node_id]).await?;
        return Err(match retired {
            None => Error::not_found("node", node_id),
            Some(r) if r.get::<_, bool>(0) => return Ok(()),
            Some(_) => Error::failed_precondition(format!(
                "node {node_id} is not drained; drain it (nodes.drain) and wait for state drained before retiring it"
            )),
        }
        .into());
    };
    move_drain(tx, &id, DrainState::Drained, DrainState::Retired, "ended_at = compute_now()").await?;
    tx.execute("UPDATE nodes SET retired_at = compute_now(), version = version + 1 WHERE id = $1", &[&node_id]).await?;
    actions::set_reason(tx, node_id, actions::RETIRED, true).await?;
    actions::set_reason(tx, node_id, actions::DRAINING, false).await?;
    let revoked = tx.execute("UPDATE node_certificates SET revoked_at = compute_now() WHERE node_id = $1 AND revoked_at IS NULL", &[&node_id]).await?;
    node_event(tx, node_id, "node.retired", serde_json::json!({"certificatesRevoked": revoked})).await
}

/// A pool's disruption budget: how many of its nodes may be unavailable at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// At most this many nodes.
    Nodes(i32),
    /// At most this share of the pool's nodes (not retired), rounded up; 100 is no limit.
    Percent(i32),
}

impl Budget {
    /// Parses `3` or `10%`.
    pub fn parse(s: &str) -> Result<Budget, Error> {
        let bad = || Error::invalid_argument(format!("maxUnavailable must be a count of nodes (0 or more) or a share like 10% (0% to 100%), got {s:?}"));
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            let p: i32 = p.trim().parse().map_err(|_| bad())?;
            if !(0..=100).contains(&p) {
                return Err(bad());
            }
            return Ok(Budget::Percent(p));
        }
        let n: i32 = s.parse().map_err(|_| bad())?;
        if n < 0 {
            return Err(bad());
        }
        Ok(Budget::Nodes(n))
    }
}

/// `pools.update maxUnavailable`: sets a pool's disruption budget. Queued drains are weighed
/// against the new budget at once.
pub async fn set_budget(tx: &impl GenericClient, pool_id: &str, budget: Budget) -> Result<(), DbError> {
    let (nodes, percent) = match budget {
        Budget::Nodes(n) => (Some(n), None),
        Budget::Percent(p) => (None, Some(p)),
    };
    let n = tx
        .execute(
            "UPDATE pools SET max_unavailable = $2, max_unavailable_percent = $3, version = version + 1 WHERE id = $1",
            &[&pool_id, &nodes, &percent],
        )
        .await?;
    if n == 0 {
        return Err(Error::not_found("pool", pool_id).into());
    }
    work_queue::enqueue(tx, &DRAIN_KIND, pool_id).await
}

/// Sets a drain's condition; `since` moves only when the reason changes.
async fn set_condition(tx: &impl GenericClient, id: &str, reason: &str, message: &str) -> Result<(), DbError> {
    tx.execute(
        "UPDATE node_drains SET condition_since = CASE WHEN condition_reason <> $2 THEN compute_now() ELSE condition_since END,
                condition_reason = $2, condition_message = $3, version = version + 1
          WHERE id = $1 AND (condition_reason <> $2 OR condition_message <> $3)",
        &[&id, &reason, &message],
    )
    .await?;
    Ok(())
}

/// What one run of the drain job did for its pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Drains the budget admitted.
    pub admitted: u64,
    /// Drains left queued, waiting for the budget.
    pub waiting: u64,
    /// Drains that reached `drained`.
    pub drained: u64,
    /// Tenants' things told of an eviction.
    pub eviction_requested: u64,
    /// Things ended at a deadline.
    pub evicted: u64,
    /// Whether admitted drains were left for the next run.
    pub more: bool,
}

/// Admits the pool's queued drains in request order while the budget allows. Takes the pool's row
/// first, so two admissions of one pool never run at once.
pub async fn admit(tx: &impl GenericClient, pool_id: &str, report: &mut DrainReport) -> Result<(), DbError> {
    let Some(pool) = tx.query_opt("SELECT nodes_pool_budget(id) FROM pools WHERE id = $1 FOR UPDATE", &[&pool_id]).await? else {
        return Ok(());
    };
    let budget: Option<i32> = pool.get(0);
    // Unavailable now: admitted drains, and nodes that are down anyway.
    let mut unavailable: i64 = tx
        .query_one(
            "SELECT count(*) FROM nodes n WHERE n.pool_id = $1 AND n.retired_at IS NULL
                AND (n.liveness IN ('unreachable', 'lost')
                     OR EXISTS (SELECT 1 FROM node_drains d WHERE d.node_id = n.id AND d.state IN ('draining', 'drained')))",
            &[&pool_id],
        )
        .await?
        .get(0);
    let queued = tx
        .query(
            "SELECT d.id, d.node_id, n.liveness IN ('unreachable', 'lost') FROM node_drains d JOIN nodes n ON n.id = d.node_id
              WHERE d.pool_id = $1 AND d.state = 'queued' ORDER BY d.requested_at, d.id FOR UPDATE OF d",
            &[&pool_id],
        )
        .await?;
    let mut ahead = 0;
    for q in &queued {
        let (id, node_id, down): (String, String, bool) = (q.get(0), q.get(1), q.get(2));
        // A node that is down already counts among the unavailable; its drain needs room for
        // the others only. So admitted drains never outnumber the budget.
        let others = unavailable - i64::from(down);
        let fits = budget.is_none_or(|b| others < i64::from(b));
        if fits && ahead == 0 {
            move_drain(tx, &id, DrainState::Queued, DrainState::Draining, "admitted_at = compute_now()").await?;
            set_condition(tx, &id, "Admitted", "admitted within the pool's disruption budget").await?;
            node_event(tx, &node_id, "node.drainAdmitted", serde_json::json!({"drainId": id})).await?;
            unavailable += i64::from(!down);
            report.admitted += 1;
        } else {
            let budget = budget.unwrap_or_default();
            let message = if ahead == 0 {
                format!("the pool allows {budget} unavailable node(s) and {unavailable} are unavailable (draining, drained, unreachable or lost); waiting for one to come back")
            } else {
                format!("{ahead} drain(s) of this pool asked earlier wait for the budget first (the pool allows {budget} unavailable node(s))")
            };
            set_condition(tx, &id, "WaitingForBudget", &message).await?;
            ahead += 1;
            report.waiting += 1;
        }
    }
    Ok(())
}

/// Brings one admitted drain forward: tells tenants of an eviction once, ends what still holds the
/// node at the deadline, and marks the drain drained when nothing holds the node. Returns the
/// seconds after which it should be looked at again, if it is not drained.
pub async fn progress(
    tx: &tokio_postgres::Transaction<'_>,
    ctx_occupants: &[std::sync::Arc<dyn better_compute_runtime::occupancy::NodeOccupant>],
    drain_id: &str,
    report: &mut DrainReport,
) -> Result<Option<f64>, DbError> {
    let row = tx
        .query_opt(
            &format!(
                "SELECT node_id, mode, reason, {}, eviction_requested_at IS NULL, deadline <= compute_now(),
                        extract(epoch FROM deadline - compute_now())::float8
                   FROM node_drains WHERE id = $1 AND state = 'draining' FOR UPDATE",
                ts("deadline")
            ),
            &[&drain_id],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let (node_id, mode, reason, deadline): (String, String, String, Option<String>) = (row.get(0), row.get(1), row.get(2), row.get(3));
    let (not_told, due, deadline_in_s): (bool, Option<bool>, Option<f64>) = (row.get(4), row.get(5), row.get(6));
    if let Some(deadline) = &deadline {
        if not_told {
            for o in ctx_occupants {
                report.eviction_requested += o.request_eviction(tx, &node_id, deadline, &reason).await?;
            }
            tx.execute("UPDATE node_drains SET eviction_requested_at = compute_now(), version = version + 1 WHERE id = $1", &[&drain_id]).await?;
        }
        if due == Some(true) {
            for o in ctx_occupants {
                report.evicted += o.evict(tx, &node_id, "drained").await?;
            }
        }
    }
    let mut occupancy = Occupancy::default();
    for o in ctx_occupants {
        occupancy = occupancy.and(o.occupancy(tx, &node_id).await?);
    }
    if occupancy.holding == 0 {
        move_drain(tx, drain_id, DrainState::Draining, DrainState::Drained, "drained_at = compute_now()").await?;
        set_condition(tx, drain_id, "Drained", "nothing holds the node; it may be maintained, undrained or retired").await?;
        node_event(tx, &node_id, "node.drained", serde_json::json!({"drainId": drain_id})).await?;
        report.drained += 1;
        return Ok(None);
    }
    let n = occupancy.holding;
    let (reason, message) = match (mode.as_str(), &deadline) {
        ("evict", Some(d)) => ("Evicting", format!("{n} reservation(s) hold the node; their tenants were told, and they end at {d}")),
        _ => ("WaitingForReservations", format!("{n} reservation(s) hold the node; the drain waits for them to end by themselves")),
    };
    set_condition(tx, drain_id, reason, &message).await?;
    let next = [occupancy.next_end_s.map(|s| s + AFTER_END_S), deadline_in_s].into_iter().flatten().fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.min(b))));
    Ok(Some(next.unwrap_or(AFTER_END_S).max(AFTER_END_S)))
}
