//! Node sessions, the database side of a gateway: opening a session supersedes any older one by
//! `session_epoch`; every later write for the node carries `AND session_epoch = $epoch`, so a
//! gateway whose session was superseded (a zombie) can neither route commands nor mark liveness.
//! Lock order: nodes, node_sessions, commands.

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_proto::v1::{Health, Inventory, SpecStatus};
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
}

/// Opens (or takes over) the node's session. A new boot id settles in-flight self-terminating
/// commands as succeeded; a new journal id fails in-flight commands that are not retry-safe with
/// `journal-lost`. The node becomes connected.
pub async fn open(tx: &impl GenericClient, h: &Hello<'_>) -> Result<Opened, DbError> {
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
    Ok(Opened { session_epoch: epoch, generation, reconnect })
}

/// Locks the node's session row if `epoch` still holds it through `gateway_id`: the fence of every
/// write a gateway makes for a node. `false` means the session was superseded or closed.
pub async fn fence(tx: &impl GenericClient, node_id: &str, gateway_id: &str, epoch: i64) -> Result<bool, DbError> {
    // FOR SHARE: a takeover's upsert waits for this transaction, and then supersedes it.
    Ok(tx
        .query_opt(
            "SELECT 1 FROM node_sessions WHERE node_id = $1 AND gateway_id = $2 AND session_epoch = $3 AND closed_at IS NULL FOR SHARE",
            &[&node_id, &gateway_id, &epoch],
        )
        .await?
        .is_some())
}

/// [`fence`] for a batch of a daemon's reports. When the batch writes the node's own row (spec
/// status, inventory, health), the node's row is locked first, as session open and close and the
/// liveness job lock it, so every transaction takes the node and then its session: a report racing
/// a takeover or a liveness pass waits instead of deadlocking.
pub async fn fence_reports(tx: &impl GenericClient, node_id: &str, gateway_id: &str, epoch: i64, writes_node: bool) -> Result<bool, DbError> {
    if writes_node {
        tx.query_opt("SELECT 1 FROM nodes WHERE id = $1 FOR NO KEY UPDATE", &[&node_id]).await?;
    }
    fence(tx, node_id, gateway_id, epoch).await
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

/// Writes when the gateway last heard from each node, as ages ("3.2 s ago"), which the database
/// turns into `compute_now() - age`: one statement for a whole batch, and no gateway clock in it.
/// Entries whose epoch no longer holds the session change nothing. Returns the nodes whose
/// session still holds; for the others the gateway must end its stream (the liveness job closed
/// the session as silent, or another gateway took it over), so the daemon reconnects.
pub async fn flush_last_seen(
    db: &impl GenericClient,
    gateway_id: &str,
    node_ids: &[String],
    epochs: &[i64],
    ages_s: &[f64],
) -> Result<Vec<String>, DbError> {
    if node_ids.is_empty() {
        return Ok(Vec::new());
    }
    Ok(db
        .query(
            "UPDATE node_sessions s SET last_seen_at = GREATEST(s.last_seen_at, compute_now() - make_interval(secs => u.age))
               FROM unnest($2::text[], $3::bigint[], $4::float8[]) AS u(node_id, epoch, age)
              WHERE s.node_id = u.node_id AND s.session_epoch = u.epoch AND s.gateway_id = $1 AND s.closed_at IS NULL
             RETURNING s.node_id",
            &[&gateway_id, &node_ids, &epochs, &ages_s],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
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
}

const DISPATCH_COLUMNS: &str = "id, seq, kind, lane, body, min_generation,
    (extract(epoch FROM not_after - compute_now()) * 1000)::bigint, retry_safe";

fn dispatch_of(r: &tokio_postgres::Row) -> Dispatch {
    Dispatch {
        id: r.get(0),
        seq: r.get(1),
        kind: r.get(2),
        lane: r.get(3),
        body: r.get(4),
        min_generation: r.get(5),
        expires_in_ms: r.get(6),
        retry_safe: r.get(7),
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
/// session through `gateway_id`: the session row is locked first, so routing is decided by a join
/// at dispatch time and a zombie gateway routes nothing. A lane gets no more than its free credits
/// ([`LANES`](crate::spec::LANES) less its commands in flight): the rest wait here, in seq order,
/// and go the moment a result frees a credit, instead of being sent to be refused BUSY.
pub async fn dispatch(tx: &impl GenericClient, node_id: &str, gateway_id: &str, epoch: i64, limit: i64) -> Result<Option<Dispatched>, DbError> {
    if !fence(tx, node_id, gateway_id, epoch).await? {
        return Ok(None);
    }
    // pending → sent (COMMAND_STATE_TABLE allows it); not yet past notAfter (the sweeper expires those).
    let rows = tx
        .query(
            &format!(
                "WITH credits AS (SELECT * FROM unnest($3::text[], $4::int8[]) AS l(lane, n)),
                      busy AS (SELECT lane, count(*) AS n FROM commands WHERE node_id = $1 AND state IN ('sent', 'running') GROUP BY lane),
                      due AS (SELECT id, seq, lane, row_number() OVER (PARTITION BY lane ORDER BY seq) AS k FROM commands
                               WHERE node_id = $1 AND state = 'pending' AND not_before <= compute_now() AND not_after > compute_now()),
                      room AS (SELECT d.id, d.seq FROM due d LEFT JOIN credits c ON c.lane = d.lane LEFT JOIN busy b ON b.lane = d.lane
                                WHERE d.k <= coalesce(c.n, 1) - coalesce(b.n, 0) ORDER BY d.seq LIMIT $2)
                 UPDATE commands SET state = 'sent', sent_at = compute_now(), version = version + 1
                  WHERE id IN (SELECT id FROM commands WHERE id IN (SELECT id FROM room) AND state = 'pending' ORDER BY seq FOR UPDATE)
                 RETURNING {DISPATCH_COLUMNS}"
            ),
            &[&node_id, &limit, &lane_names(), &lane_credits()],
        )
        .await?;
    let mut commands: Vec<Dispatch> = rows.iter().map(dispatch_of).collect();
    commands.sort_by_key(|c| c.seq);
    let cancels = tx
        .query("SELECT id FROM commands WHERE node_id = $1 AND state IN ('sent', 'running') AND cancel_requested ORDER BY seq", &[&node_id])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(Some(Dispatched { commands, cancels }))
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
    Ok(rows.iter().map(dispatch_of).collect())
}

/// The nodes of this gateway's open sessions that have due pending commands or cancels, for the
/// poll that backs up lost pokes.
pub async fn nodes_with_work(db: &impl GenericClient, gateway_id: &str) -> Result<Vec<String>, DbError> {
    Ok(db
        .query(
            "SELECT s.node_id FROM node_sessions s
              WHERE s.gateway_id = $1 AND s.closed_at IS NULL
                AND EXISTS (SELECT 1 FROM commands c WHERE c.node_id = s.node_id
                               AND ((c.state = 'pending' AND c.not_before <= compute_now() AND c.not_after > compute_now())
                                    OR (c.state IN ('sent', 'running') AND c.cancel_requested)))",
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

/// A report a daemon made about a command.
#[derive(Debug, Clone)]
pub enum CommandReport<'a> {
    /// It accepted the command and runs it.
    Ack,
    /// It refused it.
    Reject(Rejection),
    /// It finished it.
    Result {
        /// Whether it succeeded.
        succeeded: bool,
        /// Why not.
        reason: Option<&'a str>,
        /// The kind's report.
        result: &'a serde_json::Value,
    },
}

/// Applies a daemon's report about one of its node's commands. Delivery is at least once, so a
/// report that no longer fits (a repeat of a result already recorded, an ack of a command that
/// already ended, another node's command) changes nothing and returns `false`.
pub async fn report_command(tx: &impl GenericClient, node_id: &str, command_id: &str, report: CommandReport<'_>) -> Result<bool, DbError> {
    use better_compute_core::state::{CommandState, State, COMMAND_STATE_TABLE};
    match report {
        // The two reports every command gets are one guarded statement each: the WHERE is the
        // state table's edge (sent → running; sent or running → succeeded or failed), so a repeat
        // or a report about another node's command matches no row and changes nothing.
        CommandReport::Ack => {
            debug_assert!(COMMAND_STATE_TABLE.check(CommandState::Sent, CommandState::Running).is_ok());
            let n = tx
                .execute(
                    "UPDATE commands SET state = 'running', version = version + 1 WHERE id = $1 AND node_id = $2 AND state = 'sent'",
                    &[&command_id, &node_id],
                )
                .await?;
            Ok(n == 1)
        }
        CommandReport::Result { succeeded, reason, result } => {
            let (to, reason) = if succeeded {
                (CommandState::Succeeded, None)
            } else {
                (CommandState::Failed, Some(reason.filter(|r| !r.is_empty()).unwrap_or("failed")))
            };
            debug_assert!(COMMAND_STATE_TABLE.check(CommandState::Running, to).is_ok());
            let ended = tx
                .query_opt(
                    "UPDATE commands SET state = $3, reason = coalesce($4, reason), result = $5, finished_at = compute_now(),
                            version = version + 1
                      WHERE id = $1 AND node_id = $2 AND state IN ('sent', 'running')
                     RETURNING id",
                    &[&command_id, &node_id, &to.as_str(), &reason, result],
                )
                .await?;
            match ended {
                Some(r) => {
                    commands::settled(tx, &[r.get(0)]).await?;
                    Ok(true)
                }
                None => Ok(false),
            }
        }
        CommandReport::Reject(why) => {
            let Some(row) = tx.query_opt("SELECT state FROM commands WHERE id = $1 AND node_id = $2 FOR UPDATE", &[&command_id, &node_id]).await? else {
                return Ok(false);
            };
            if row.get::<_, String>(0) != "sent" {
                return Ok(false);
            }
            commands::reject(tx, command_id, why).await?;
            Ok(true)
        }
    }
}

/// Records a daemon's spec status: each section's outcome, and the generation it has applied
/// (which only moves up).
pub async fn report_spec_status(tx: &impl GenericClient, node_id: &str, status: &SpecStatus) -> Result<i64, DbError> {
    let json = serde_json::to_value(status).map_err(|e| Error::internal(e.to_string()))?;
    tx.execute("UPDATE nodes SET spec_status = $2 WHERE id = $1", &[&node_id, &json]).await?;
    crate::inventory::report_observed_generation(tx, node_id, status.observed_generation).await
}

/// Records a daemon's inventory report.
pub async fn report_inventory(tx: &impl GenericClient, node_id: &str, inv: &Inventory) -> Result<(), DbError> {
    let json = serde_json::to_value(inv).map_err(|e| Error::internal(e.to_string()))?;
    tx.execute("UPDATE nodes SET reported_inventory = $2 WHERE id = $1", &[&node_id, &json]).await?;
    Ok(())
}

/// Records a daemon's health report: a GPU's health changes only when it differs, and only the
/// node's own GPUs count. Returns how many changed.
pub async fn report_health(tx: &impl GenericClient, node_id: &str, health: &Health) -> Result<u64, DbError> {
    let mut changed = 0;
    for g in &health.gpus {
        let differs = tx
            .query_opt("SELECT 1 FROM devices WHERE id = $1 AND node_id = $2 AND parent_id IS NULL AND healthy <> $3", &[&g.uuid, &node_id, &g.healthy])
            .await?
            .is_some();
        if differs {
            actions::set_gpu_health(tx, &g.uuid, g.healthy).await?;
            changed += 1;
        }
    }
    Ok(changed)
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
