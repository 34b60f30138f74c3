//! Node sessions, the database side of a gateway: opening a session supersedes any older one by
//! `session_epoch`; every later write for the node carries `AND session_epoch = $epoch`, so a
//! gateway whose session was superseded (a zombie) can neither route commands nor mark liveness.
//! Lock order: nodes, node_sessions, commands.

pub mod consoles;
pub mod liveness;
pub mod site_boot;

use std::collections::{HashMap, HashSet};

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_proto::v1::Inventory;
use tokio_postgres::GenericClient;

use crate::actions;
use crate::commands::{self, ReconnectOutcome, Rejection};

/// The lease a gateway holds while it serves sessions (20 s, renewed every 5 s).
pub fn gateway_lease_name(gateway_id: &str) -> String {
    format!("gateway:{gateway_id}")
}

/// What a daemon says of itself in `Hello`.
#[derive(Debug, Clone)]
pub struct Hello<'a> {
    /// The node, as its certificate proved it.
    pub node_id: &'a str,
    /// The gateway opening the session.
    pub gateway_id: &'a str,
    /// The machine's boot.
    pub boot_id: &'a str,
    /// The daemon's journal.
    pub journal_id: &'a str,
    /// The daemon's version.
    pub daemon_version: &'a str,
}

/// A session just opened.
#[derive(Debug, Clone)]
pub struct Opened {
    /// Its epoch.
    pub session_epoch: i64,
    /// The node's desired-state generation.
    pub generation: i64,
    /// What the reconnect settled (a reboot done, commands whose journal was lost).
    pub reconnect: ReconnectOutcome,
    /// Whether the node's site is booting (see [`crate::sessions::site_boot`]): the daemon gets its full
    /// desired state whatever it says it has.
    pub site_booting: bool,
}

/// Opens (or takes over) the node's session. A new boot id settles in-flight self-terminating
/// commands as succeeded; a new journal id fails in-flight commands that are not retry-safe with
/// `journal-lost`. The node becomes connected. While its site boots, the open needs a token from
/// the site's bucket, else it fails with `UNAVAILABLE`.
pub async fn open(tx: &impl GenericClient, h: &Hello<'_>) -> Result<Opened, DbError> {
    // A booting site admits sessions at its pace (UNAVAILABLE: retry later); its row comes first.
    let site_booting = crate::sessions::site_boot::admit(tx, h.node_id).await?;
    // Lock order: nodes, then node_sessions.
    let node = tx
        .query_opt("SELECT generation, liveness FROM nodes WHERE id = $1 FOR UPDATE", &[&h.node_id])
        .await?
        .ok_or_else(|| Error::not_found("node", h.node_id))?;
    let (generation, liveness): (i64, String) = (node.get(0), node.get(1));
    let previous = tx.query_opt("SELECT boot_id, journal_id FROM node_sessions WHERE node_id = $1 FOR UPDATE", &[&h.node_id]).await?;
    let epoch: i64 = tx
        .query_one(
            "INSERT INTO node_sessions AS s (node_id, session_epoch, gateway_id, boot_id, journal_id, daemon_version, opened_at, last_seen_at)
             VALUES ($1, 1, $2, $3, $4, $5, compute_now(), compute_now())
             ON CONFLICT (node_id) DO UPDATE
                SET session_epoch = s.session_epoch + 1, gateway_id = EXCLUDED.gateway_id, boot_id = EXCLUDED.boot_id,
                    journal_id = EXCLUDED.journal_id, daemon_version = EXCLUDED.daemon_version, opened_at = compute_now(),
                    last_seen_at = compute_now(), closed_at = NULL, close_reason = NULL
             RETURNING session_epoch",
            &[&h.node_id, &h.gateway_id, &h.boot_id, &h.journal_id, &h.daemon_version],
        )
        .await?
        .get(0);
    let reconnect = match previous {
        Some(p) => {
            let (boot, journal): (String, String) = (p.get(0), p.get(1));
            commands::on_reconnect(tx, h.node_id, boot != h.boot_id, journal != h.journal_id).await?
        }
        None => ReconnectOutcome::default(),
    };
    if liveness != "connected" {
        actions::set_liveness(tx, h.node_id, "connected").await?;
    }
    Ok(Opened { session_epoch: epoch, generation, reconnect, site_booting })
}

/// Closes the session if `epoch` still holds it; the node becomes disconnected. Returns whether it
/// did (a superseded session closes nothing).
pub async fn close(tx: &impl GenericClient, node_id: &str, epoch: i64, reason: &str) -> Result<bool, DbError> {
    // Lock order: nodes, then node_sessions.
    tx.query_opt("SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE", &[&node_id]).await?;
    let closed = tx
        .execute(
            "UPDATE node_sessions SET closed_at = compute_now(), close_reason = $3
              WHERE node_id = $1 AND session_epoch = $2 AND closed_at IS NULL",
            &[&node_id, &epoch, &reason],
        )
        .await?;
    if closed == 1 {
        mark_disconnected(tx, node_id, 0).await?;
    }
    Ok(closed == 1)
}

/// connected → disconnected, with `grace_s` more before it can become unreachable.
pub(crate) async fn mark_disconnected(tx: &impl GenericClient, node_id: &str, grace_s: i32) -> Result<(), DbError> {
    actions::set_liveness(tx, node_id, "disconnected").await?;
    if grace_s > 0 {
        tx.execute("UPDATE nodes SET disconnect_grace_s = $2 WHERE id = $1", &[&node_id, &grace_s]).await?;
    }
    Ok(())
}

/// What a flush of `last seen` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flushed {
    /// Sessions whose `last seen` was written.
    pub written: Vec<String>,
    /// Sessions that still hold but whose row another transaction held at that moment (a report
    /// or a dispatch of the node): flush them again next time.
    pub busy: Vec<String>,
}

/// Writes when the gateway last heard from each node, as ages ("3.2 s ago"), which the database
/// turns into `compute_now() - age`: one statement for a whole batch, and no gateway clock in it.
/// Entries whose epoch no longer holds the session change nothing. A session row another
/// transaction holds is skipped, not waited for (a fence holds it while the daemon's reports are
/// applied, which is news of its own that the daemon lives). Sessions neither written nor busy no
/// longer hold: the gateway must end their streams (the liveness job closed the session as
/// silent, or another gateway took it over), so their daemons reconnect.
pub async fn flush_last_seen(
    db: &impl GenericClient,
    gateway_id: &str,
    node_ids: &[String],
    epochs: &[i64],
    ages_s: &[f64],
) -> Result<Flushed, DbError> {
    if node_ids.is_empty() {
        return Ok(Flushed::default());
    }
    let written: Vec<String> = db
        .query(
            // Rows taken in node order, as every fence takes them.
            "UPDATE node_sessions s SET last_seen_at = GREATEST(s.last_seen_at, compute_now() - make_interval(secs => h.age))
               FROM (SELECT t.node_id, u.age FROM node_sessions t
                       JOIN unnest($2::text[], $3::bigint[], $4::float8[]) AS u(node_id, epoch, age)
                         ON t.node_id = u.node_id AND t.session_epoch = u.epoch
                      WHERE t.gateway_id = $1 AND t.closed_at IS NULL
                      ORDER BY t.node_id FOR NO KEY UPDATE OF t SKIP LOCKED) AS h
              WHERE s.node_id = h.node_id
             RETURNING s.node_id",
            &[&gateway_id, &node_ids, &epochs, &ages_s],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let busy = if written.len() == node_ids.len() {
        Vec::new()
    } else {
        db.query(
            "SELECT t.node_id FROM node_sessions t JOIN unnest($2::text[], $3::bigint[]) AS u(node_id, epoch)
                 ON t.node_id = u.node_id AND t.session_epoch = u.epoch
              WHERE t.gateway_id = $1 AND t.closed_at IS NULL AND t.node_id <> ALL($4)",
            &[&gateway_id, &node_ids, &epochs, &written],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect()
    };
    Ok(Flushed { written, busy })
}

/// A command on its way to a daemon.
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// `cmd_…`.
    pub id: String,
    /// Its place in the node's order.
    pub seq: i64,
    /// Its kind.
    pub kind: String,
    /// Its lane.
    pub lane: String,
    /// The protobuf `CommandBody`.
    pub body: Vec<u8>,
    /// The generation the node must have applied first.
    pub min_generation: i64,
    /// Time left until `notAfter`, by the database's clock.
    pub expires_in_ms: i64,
    /// Safe to run twice.
    pub retry_safe: bool,
    /// `notAfter`, Unix milliseconds (what the signature covers).
    pub not_after_unix_ms: i64,
    /// A destructive kind's signature; empty for other kinds.
    pub signature: Vec<u8>,
    /// Milliseconds since it was enqueued, by the database's clock.
    pub waited_ms: i64,
    /// The enqueuer's W3C trace context; empty when it had none.
    pub trace_parent: String,
}

const DISPATCH_COLUMNS: &str = "id, seq, kind, lane, body, min_generation,
    (extract(epoch FROM not_after - compute_now()) * 1000)::bigint, retry_safe,
    round(extract(epoch FROM not_after) * 1000)::bigint, coalesce(signature, ''),
    (extract(epoch FROM compute_now() - created_at) * 1000)::bigint, coalesce(trace_parent, '')";

/// A [`Dispatch`] from [`DISPATCH_COLUMNS`] starting at column `at`.
fn dispatch_of(r: &tokio_postgres::Row, at: usize) -> Dispatch {
    Dispatch {
        id: r.get(at),
        seq: r.get(at + 1),
        kind: r.get(at + 2),
        lane: r.get(at + 3),
        body: r.get(at + 4),
        min_generation: r.get(at + 5),
        expires_in_ms: r.get(at + 6),
        retry_safe: r.get(at + 7),
        not_after_unix_ms: r.get(at + 8),
        signature: r.get(at + 9),
        waited_ms: r.get(at + 10),
        trace_parent: r.get(at + 11),
    }
}

/// What a dispatch pass found for one node.
#[derive(Debug, Clone, Default)]
pub struct Dispatched {
    /// Commands now `sent` (at most the limit), in seq order.
    pub commands: Vec<Dispatch>,
    /// In-flight commands someone asked to cancel.
    pub cancels: Vec<String>,
}

/// Moves the node's due pending commands to `sent`, at most `limit`, if `epoch` still holds the
/// session through `gateway_id`: [`dispatch_many`] for one node. `None`: the session was
/// superseded or closed.
pub async fn dispatch(tx: &impl GenericClient, node_id: &str, gateway_id: &str, epoch: i64, limit: i64) -> Result<Option<Dispatched>, DbError> {
    let mut d = dispatch_many(tx, gateway_id, &[DispatchFor { node_id, epoch, limit }]).await?;
    Ok(d.remove(node_id))
}

/// One node's part of [`dispatch_many`].
#[derive(Debug, Clone, Copy)]
pub struct DispatchFor<'a> {
    /// The node.
    pub node_id: &'a str,
    /// The epoch of the session the gateway holds for it.
    pub epoch: i64,
    /// At most this many commands (the room in its session's queue).
    pub limit: i64,
}

/// Locks the session rows of the (node, epoch) pairs that still hold through `gateway_id`, in node
/// order, and returns their nodes: the fence of every write a gateway makes for a node. A node
/// absent from the answer had its session superseded or closed. FOR SHARE: a takeover's upsert
/// waits for this transaction, and then supersedes it.
pub async fn fence(tx: &impl GenericClient, gateway_id: &str, node_ids: &[&str], epochs: &[i64]) -> Result<HashSet<String>, DbError> {
    if node_ids.is_empty() {
        return Ok(HashSet::new());
    }
    Ok(tx
        .query(
            "SELECT s.node_id FROM node_sessions s JOIN unnest($2::text[], $3::int8[]) AS u(node_id, epoch)
                 ON s.node_id = u.node_id AND s.session_epoch = u.epoch
              WHERE s.gateway_id = $1 AND s.closed_at IS NULL
              ORDER BY s.node_id FOR SHARE OF s",
            &[&gateway_id, &node_ids, &epochs],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Moves the due pending commands of many nodes to `sent` in one statement, at most each node's
/// `limit`, for the nodes whose session `gateway_id` still holds at its `epoch`: the session rows
/// are locked first ([`fence`]), so routing is decided by a join at dispatch time and a
/// zombie gateway routes nothing. A lane gets no more than its free credits
/// ([`LANES`](crate::spec::LANES) less its commands in flight): the rest wait here, in seq order,
/// and go the moment a result frees a credit, instead of being sent to be refused BUSY. Nodes
/// whose session no longer holds are absent from the answer.
pub async fn dispatch_many(tx: &impl GenericClient, gateway_id: &str, want: &[DispatchFor<'_>]) -> Result<HashMap<String, Dispatched>, DbError> {
    let nodes: Vec<&str> = want.iter().map(|w| w.node_id).collect();
    let epochs: Vec<i64> = want.iter().map(|w| w.epoch).collect();
    let held = fence(tx, gateway_id, &nodes, &epochs).await?;
    let want: Vec<&DispatchFor<'_>> = want.iter().filter(|w| held.contains(w.node_id)).collect();
    let mut out: HashMap<String, Dispatched> = want.iter().map(|w| (w.node_id.to_owned(), Dispatched::default())).collect();
    if want.is_empty() {
        return Ok(out);
    }
    let nodes: Vec<&str> = want.iter().map(|w| w.node_id).collect();
    let limits: Vec<i64> = want.iter().map(|w| w.limit).collect();
    // pending → sent (COMMAND_STATE_TABLE allows it); not yet past notAfter (the sweeper expires those).
    let rows = tx
        .query(
            &format!(
                "WITH want AS (SELECT * FROM unnest($1::text[], $2::int8[]) AS w(node_id, room)),
                      credits AS (SELECT * FROM unnest($3::text[], $4::int8[]) AS l(lane, n)),
                      busy AS (SELECT c.node_id, c.lane, count(*) AS n FROM commands c JOIN want w ON w.node_id = c.node_id
                                WHERE c.state IN ('sent', 'running') GROUP BY c.node_id, c.lane),
                      due AS (SELECT c.id, c.node_id, c.seq, c.lane,
                                     row_number() OVER (PARTITION BY c.node_id, c.lane ORDER BY c.seq) AS k
                                FROM commands c JOIN want w ON w.node_id = c.node_id
                               WHERE c.state = 'pending' AND c.not_before <= compute_now() AND c.not_after > compute_now()),
                      fits AS (SELECT d.id, d.node_id, row_number() OVER (PARTITION BY d.node_id ORDER BY d.seq) AS r
                                 FROM due d LEFT JOIN credits c ON c.lane = d.lane
                                 LEFT JOIN busy b ON b.node_id = d.node_id AND b.lane = d.lane
                                WHERE d.k <= coalesce(c.n, 1) - coalesce(b.n, 0)),
                      room AS (SELECT f.id FROM fits f JOIN want w ON w.node_id = f.node_id WHERE f.r <= w.room)
                 UPDATE commands SET state = 'sent', sent_at = compute_now(), version = version + 1
                  WHERE id IN (SELECT id FROM commands WHERE id IN (SELECT id FROM room) AND state = 'pending'
                                ORDER BY node_id, seq FOR UPDATE)
                 RETURNING node_id, {DISPATCH_COLUMNS}"
            ),
            &[&nodes, &limits, &lane_names(), &lane_credits()],
        )
        .await?;
    for r in &rows {
        let node: String = r.get(0);
        if let Some(d) = out.get_mut(&node) {
            d.commands.push(dispatch_of(r, 1));
        }
    }
    for d in out.values_mut() {
        d.commands.sort_by_key(|c| c.seq);
    }
    let cancels = tx
        .query(
            "SELECT node_id, id FROM commands WHERE node_id = ANY($1) AND state IN ('sent', 'running') AND cancel_requested
              ORDER BY node_id, seq",
            &[&nodes],
        )
        .await?;
    for r in &cancels {
        if let Some(d) = out.get_mut(r.get::<_, &str>(0)) {
            d.cancels.push(r.get(1));
        }
    }
    Ok(out)
}

fn lane_names() -> Vec<&'static str> {
    crate::spec::LANES.iter().map(|(n, _)| *n).collect()
}

fn lane_credits() -> Vec<i64> {
    crate::spec::LANES.iter().map(|(_, c)| i64::from(*c)).collect()
}

/// The node's in-flight commands, sent again after a reconnect: the daemon's journal makes a
/// repeat safe (it reports the outcome it has, or runs a retry-safe command again).
pub async fn in_flight(db: &impl GenericClient, node_id: &str) -> Result<Vec<Dispatch>, DbError> {
    let rows = db
        .query(&format!("SELECT {DISPATCH_COLUMNS} FROM commands WHERE node_id = $1 AND state IN ('sent', 'running') ORDER BY seq"), &[&node_id])
        .await?;
    Ok(rows.iter().map(|r| dispatch_of(r, 0)).collect())
}

/// The nodes of this gateway's open sessions that have due pending commands or cancels, for the
/// poll that backs up lost pokes.
pub async fn nodes_with_work(db: &impl GenericClient, gateway_id: &str) -> Result<Vec<String>, DbError> {
    Ok(db
        .query(
            // From the open commands (the partial index `commands_open`), not from each session:
            // the cost follows the commands in flight, not every command a node ever ran.
            "SELECT DISTINCT c.node_id FROM commands c JOIN node_sessions s ON s.node_id = c.node_id
              WHERE c.state IN ('pending', 'sent', 'running') AND s.gateway_id = $1 AND s.closed_at IS NULL
                AND ((c.state = 'pending' AND c.not_before <= compute_now() AND c.not_after > compute_now())
                     OR (c.state IN ('sent', 'running') AND c.cancel_requested))",
            &[&gateway_id],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The nodes of this gateway's open sessions whose daemon has not reported the current generation,
/// with that generation, for the poll that backs up lost desired-state pokes.
pub async fn nodes_behind(db: &impl GenericClient, gateway_id: &str) -> Result<Vec<(String, i64)>, DbError> {
    Ok(db
        .query(
            "SELECT n.id, n.generation FROM node_sessions s JOIN nodes n ON n.id = s.node_id
              WHERE s.gateway_id = $1 AND s.closed_at IS NULL AND n.generation > n.observed_generation AND n.spec IS NOT NULL",
            &[&gateway_id],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// The node's stored desired state: (generation, proto3 JSON), if it has any yet.
pub async fn desired_state(db: &impl GenericClient, node_id: &str) -> Result<Option<(i64, serde_json::Value)>, DbError> {
    Ok(desired_states(db, &[node_id]).await?.remove(node_id))
}

/// [`desired_state`] of many nodes in one statement, by node id; nodes without one are absent.
pub async fn desired_states(
    db: &impl GenericClient,
    node_ids: &[&str],
) -> Result<std::collections::HashMap<String, (i64, serde_json::Value)>, DbError> {
    Ok(db
        .query("SELECT id, generation, spec FROM nodes WHERE id = ANY($1) AND spec IS NOT NULL", &[&node_ids])
        .await?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect())
}

/// Applies a daemon's refusal of one of its node's commands; `false` when it no longer fits
/// (delivery is at least once: a repeat, a command that moved on, another node's command) and
/// changed nothing.
pub async fn report_reject(tx: &impl GenericClient, node_id: &str, command_id: &str, why: Rejection) -> Result<bool, DbError> {
    let Some(row) = tx.query_opt("SELECT state FROM commands WHERE id = $1 AND node_id = $2 FOR UPDATE", &[&command_id, &node_id]).await? else {
        return Ok(false);
    };
    if row.get::<_, String>(0) != "sent" {
        return Ok(false);
    }
    commands::reject(tx, command_id, why).await?;
    Ok(true)
}

/// Records a daemon's inventory report.
pub async fn report_inventory(tx: &impl GenericClient, node_id: &str, inv: &Inventory) -> Result<(), DbError> {
    let json = serde_json::to_value(inv).map_err(|e| Error::internal(e.to_string()))?;
    tx.execute("UPDATE nodes SET reported_inventory = $2 WHERE id = $1", &[&node_id, &json]).await?;
    // The inventory job compares it with the registration.
    better_compute_runtime::work_queue::enqueue(tx, &crate::jobs::inventory::INVENTORY_KIND, node_id).await
}

/// A gateway as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayStatus {
    /// Its id.
    pub id: String,
    /// Seconds until its lease expires if it stops renewing.
    pub lease_left_s: f64,
    /// Sessions open through it.
    pub sessions: i64,
}

/// The live gateways (holding an unexpired lease) and their open sessions, by id.
pub async fn live_gateways(db: &impl GenericClient) -> Result<Vec<GatewayStatus>, DbError> {
    let rows = db
        .query(
            "SELECT l.owner, extract(epoch FROM l.expires_at - compute_now())::float8,
                    (SELECT count(*) FROM node_sessions s WHERE s.gateway_id = l.owner AND s.closed_at IS NULL)
               FROM leases l WHERE l.name LIKE 'gateway:%' AND l.expires_at > compute_now() ORDER BY l.owner",
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| GatewayStatus { id: r.get(0), lease_left_s: r.get(1), sessions: r.get(2) }).collect())
}

/// A node's session as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionView {
    /// The session's epoch: every write of its gateway carries it.
    pub epoch: i64,
    /// The gateway holding it.
    pub gateway_id: String,
    /// The daemon's boot.
    pub boot_id: String,
    /// The daemon's journal.
    pub journal_id: String,
    /// The daemon's version.
    pub daemon_version: String,
    /// RFC 3339.
    pub opened_at: String,
    /// RFC 3339: when its gateway last heard from the daemon, as last flushed.
    pub last_seen_at: String,
    /// RFC 3339, once closed.
    pub closed_at: Option<String>,
    /// Why it closed: daemon-closed, silent, gateway-lost, superseded, …
    pub close_reason: Option<String>,
}

/// The node's latest session, open or closed, if it ever had one.
pub async fn latest(db: &impl GenericClient, node_id: &str) -> Result<Option<SessionView>, DbError> {
    use better_compute_db::clock::rfc3339_sql as ts;
    let sql = format!(
        "SELECT session_epoch, gateway_id, boot_id, journal_id, daemon_version, {}, {}, {}, close_reason FROM node_sessions WHERE node_id = $1",
        ts("opened_at"),
        ts("last_seen_at"),
        ts("closed_at")
    );
    Ok(db.query_opt(&sql, &[&node_id]).await?.map(|r| SessionView {
        epoch: r.get(0),
        gateway_id: r.get(1),
        boot_id: r.get(2),
        journal_id: r.get(3),
        daemon_version: r.get(4),
        opened_at: r.get(5),
        last_seen_at: r.get(6),
        closed_at: r.get(7),
        close_reason: r.get(8),
    }))
}
