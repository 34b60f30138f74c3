//! The command queue: one-shot actions with a deadline, written as durable rows in the caller's
//! transaction. Lifecycle per `COMMAND_STATE_TABLE`: pending → sent → running → succeeded | failed,
//! plus expired and cancelled. Lock order: nodes (for the seq), then commands.

pub mod keys;
pub mod kinds;

use std::time::Duration;

use better_compute_audit::Actor;
use better_compute_core::id::CommandId;
use better_compute_core::state::{CommandState, State, COMMAND_STATE_TABLE};
use better_compute_core::{Caller, Error, ErrorCode};
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::DbError;
use better_compute_runtime::{work_queue, Registry};
use prost::Message;
use serde::Serialize;
use tokio_postgres::{Client, GenericClient};

/// The channel a gateway listens on for "this node has commands"; the payload is the node id.
pub const COMMANDS_CHANNEL: &str = "better_compute_commands";
/// The longest back-off after BUSY.
pub const BUSY_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// A command to enqueue.
#[derive(Debug, Clone)]
pub struct NewCommand<'a> {
    /// The target node. Routing data never goes in the payload.
    pub node_id: &'a str,
    /// A registered kind.
    pub kind: &'a str,
    /// The kind's payload message as proto3 JSON (`null` for its defaults).
    pub payload: &'a serde_json::Value,
    /// Unique per node: a repeat returns the existing command.
    pub idempotency_key: &'a str,
    /// Mandatory: how long from now the daemon may still accept it.
    pub not_after: Option<Duration>,
    /// The generation the node must have applied first (0: none).
    pub min_generation: i64,
    /// The controller to wake when it ends: (kind, key, shard).
    pub owner: Option<(&'a str, &'a str, i16)>,
    /// Who asks for it: a job's command is recorded as the job's decision; a request's is
    /// recorded by the request (`commands.run`), and its tenant's events tell of it.
    pub actor: &'a Actor,
}

/// A command as operators see it.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommandView {
    /// `cmd_…`.
    pub id: String,
    /// Its node.
    pub node_id: String,
    /// Its place in the node's order.
    pub seq: i64,
    /// Its kind (every module's kinds: docs/command-kinds.md).
    pub kind: String,
    /// Its payload, proto3 JSON.
    pub payload: serde_json::Value,
    /// Its state.
    #[schemars(extend("enum" = ["pending", "sent", "running", "succeeded", "failed", "expired", "cancelled"]))]
    pub state: String,
    /// Why it failed or expired.
    pub reason: Option<String>,
    /// What the daemon reported.
    pub result: Option<serde_json::Value>,
    /// Whether a cancel was asked for while it was in flight.
    pub cancel_requested: bool,
    /// The generation the node must have applied first.
    pub min_generation: i64,
    /// The record's version.
    pub version: i64,
}

pub(crate) const VIEW: &str = "SELECT id, node_id, seq, kind, payload, state, reason, result, cancel_requested, min_generation, version FROM commands";

pub(crate) fn to_view(r: &tokio_postgres::Row) -> CommandView {
    CommandView {
        id: r.get(0),
        node_id: r.get(1),
        seq: r.get(2),
        kind: r.get(3),
        payload: r.get(4),
        state: r.get(5),
        reason: r.get(6),
        result: r.get(7),
        cancel_requested: r.get(8),
        min_generation: r.get(9),
        version: r.get(10),
    }
}

/// Reads a command of a node.
pub async fn get(db: &impl GenericClient, node_id: &str, command_id: &str) -> Result<CommandView, DbError> {
    let r = db
        .query_opt(&format!("{VIEW} WHERE id = $1 AND node_id = $2"), &[&command_id, &node_id])
        .await?
        .ok_or_else(|| Error::not_found("command", command_id))?;
    Ok(to_view(&r))
}

/// The node's newest commands, whoever asked, newest first (at most `limit`): for operators'
/// `nodes.describe`.
pub async fn recent(db: &impl GenericClient, node_id: &str, limit: i64) -> Result<Vec<CommandView>, DbError> {
    Ok(db.query(&format!("{VIEW} WHERE node_id = $1 ORDER BY seq DESC LIMIT $2"), &[&node_id, &limit]).await?.iter().map(to_view).collect())
}

/// Writes a command in the caller's transaction. After commit, call [`poke_gateway`].
pub async fn enqueue(tx: &impl GenericClient, registry: &Registry, c: NewCommand<'_>) -> Result<CommandView, DbError> {
    let kind = registry
        .command_kind(c.kind)
        .ok_or_else(|| Error::new(ErrorCode::Unsupported, format!("unknown command kind {:?}", c.kind)))?;
    enqueue_signed(tx, kind, registry.command_signer(), c).await
}

/// [`enqueue`] of a kind the caller holds: a module's job enqueuing its own module's kind (the
/// `health` job's `diag.nvml`), with no registry at hand. A destructive kind needs [`enqueue`]
/// (the registry carries the signing key).
pub async fn enqueue_kind(tx: &impl GenericClient, kind: &better_compute_runtime::commands::CommandKind, c: NewCommand<'_>) -> Result<CommandView, DbError> {
    enqueue_signed(tx, kind, None, c).await
}

/// Enqueues, signing a destructive kind's command with `signer` over its node, seq, kind, body,
/// notAfter and minGeneration (`better_compute_proto::command_signing_message`).
async fn enqueue_signed(
    tx: &impl GenericClient,
    kind: &better_compute_runtime::commands::CommandKind,
    signer: Option<&better_compute_runtime::signing::CommandSigner>,
    c: NewCommand<'_>,
) -> Result<CommandView, DbError> {
    debug_assert_eq!(kind.name, c.kind);
    let not_after = c.not_after.ok_or_else(|| Error::invalid_argument("notAfter is mandatory for every command"))?;
    if c.idempotency_key.is_empty() || c.idempotency_key.len() > 255 {
        return Err(Error::invalid_argument("a command's idempotency key must be 1 to 255 characters").into());
    }
    if c.min_generation < 0 {
        return Err(Error::invalid_argument("minGeneration must not be negative").into());
    }
    let body = (kind.encode)(c.payload)?;
    if kind.destructive && signer.is_none() {
        return Err(Error::failed_precondition(format!(
            "{} is destructive and must be signed, but this process holds no command-signing key; start the api and worker roles with the fleet's --ca-dir",
            kind.name
        ))
        .into());
    }
    let payload = match &body.payload {
        Some(p) => serde_json::to_value(CommandBodyJson(p)).map_err(|e| Error::internal(e.to_string()))?,
        None => serde_json::Value::Null,
    };
    if let Some(r) = tx
        .query_opt(&format!("{VIEW} WHERE node_id = $1 AND idempotency_key = $2"), &[&c.node_id, &c.idempotency_key])
        .await?
    {
        return Ok(to_view(&r));
    }
    // The node's next seq: the row lock orders concurrent enqueues, so seq strictly increases.
    let seq: i64 = tx
        .query_opt("UPDATE nodes SET next_cmd_seq = next_cmd_seq + 1 WHERE id = $1 RETURNING next_cmd_seq - 1", &[&c.node_id])
        .await?
        .ok_or_else(|| Error::not_found("node", c.node_id))?
        .get(0);
    let body_bytes = body.encode_to_vec();
    // A signed command's notAfter is fixed to the millisecond first, so the signature and the row
    // hold the same instant (other kinds spare the round trip).
    let (not_after_ms, signature) = match signer {
        Some(s) if kind.destructive => {
            let ms: i64 = tx
                .query_one("SELECT (extract(epoch FROM compute_now() + make_interval(secs => $1)) * 1000)::int8", &[&not_after.as_secs_f64()])
                .await?
                .get(0);
            (Some(ms), Some(s.sign(&better_compute_proto::command_signing_message(c.node_id, seq, kind.name, &body_bytes, ms, c.min_generation))))
        }
        _ => (None, None),
    };
    let id = CommandId::generate().to_string();
    // The enqueuer's trace (an API request's, a job run's): the daemon's run of it joins that trace.
    let trace_parent = better_compute_trace::current_traceparent();
    // A request's command is its tenant's (its events go to that tenant); a job's is the fleet's.
    let requested_by = c.actor.request().map(|r| format!("{}/{}", r.tenant_id, r.identity_id));
    let (owner_kind, owner_key, owner_shard) = match c.owner {
        Some((k, key, shard)) => (Some(k), Some(key), Some(shard)),
        None => (None, None, None),
    };
    let inserted = tx
        .query_opt(
            &format!(
                "WITH c AS (
                   INSERT INTO commands (id, node_id, seq, kind, lane, body, payload, idempotency_key, min_generation,
                                         not_after, timeout_s, retry_safe, self_terminating, state, owner_kind, owner_key,
                                         owner_shard, requested_by, signature, trace_parent)
                   VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9,
                           coalesce(to_timestamp($19::int8 / 1000.0), compute_now() + make_interval(secs => $10)), $11, $12, $13,
                           'pending', $14, $15, $16, $17, $18, $20)
                   ON CONFLICT (node_id, idempotency_key) DO NOTHING
                   RETURNING *)
                 {}",
                VIEW.replace("FROM commands", "FROM c")
            ),
            &[
                &id, &c.node_id, &seq, &kind.name, &kind.lane, &body_bytes, &payload, &c.idempotency_key,
                &c.min_generation, &not_after.as_secs_f64(), &(kind.timeout.as_secs() as i32), &kind.retry_safe,
                &kind.self_terminating, &owner_kind, &owner_key, &owner_shard, &requested_by, &signature, &not_after_ms,
                &trace_parent,
            ],
        )
        .await?;
    match inserted {
        Some(r) => {
            // A job's command is its own decision (an API caller's is recorded as its request).
            if let Actor::Job(_) = c.actor {
                c.actor.record(tx, "commands.enqueue", &id, None).await?;
            }
            Ok(to_view(&r))
        }
        // A concurrent enqueue with the same key won; return its command.
        None => Ok(to_view(
            &tx.query_one(&format!("{VIEW} WHERE node_id = $1 AND idempotency_key = $2"), &[&c.node_id, &c.idempotency_key]).await?,
        )),
    }
}

/// The payload alone, serialised as its message's proto3 JSON.
struct CommandBodyJson<'a>(&'a better_compute_proto::v1::command_body::Payload);

impl Serialize for CommandBodyJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use better_compute_proto::v1::command_body::Payload::*;
        match self.0 {
            DiagNvml(m) => m.serialize(s),
            InventoryRefresh(m) => m.serialize(s),
            LogsCollect(m) => m.serialize(s),
            NodeReboot(m) => m.serialize(s),
            VpsBootstrap(m) => m.serialize(s),
        }
    }
}

/// Wakes the gateway holding the node's session, after commit; best effort (gateways also poll).
pub async fn poke_gateway(db: &tokio_postgres::Client, node_id: &str) {
    work_queue::notify(db, COMMANDS_CHANNEL, node_id).await;
}

/// Moves a command to `to` if the state table allows it, waking its owner when it ends.
async fn move_to(
    tx: &impl GenericClient,
    id: &str,
    to: CommandState,
    reason: Option<&str>,
    result: Option<&serde_json::Value>,
) -> Result<CommandView, DbError> {
    let r = tx
        .query_opt("SELECT state, version FROM commands WHERE id = $1 FOR UPDATE", &[&id])
        .await?
        .ok_or_else(|| Error::not_found("command", id))?;
    let from = CommandState::parse(r.get(0)).ok_or_else(|| Error::internal("unknown command state"))?;
    COMMAND_STATE_TABLE.check(from, to)?;
    let terminal = COMMAND_STATE_TABLE.is_terminal(to);
    tx.execute(
        "UPDATE commands SET state = $3, reason = coalesce($4, reason), result = coalesce($5, result), version = version + 1,
                sent_at = CASE WHEN $3 = 'sent' THEN compute_now() ELSE sent_at END,
                finished_at = CASE WHEN $6 THEN compute_now() ELSE finished_at END
          WHERE id = $1 AND version = $2",
        &[&id, &r.get::<_, i64>(1), &to.as_str(), &reason, &result, &terminal],
    )
    .await?;
    if terminal {
        settled(tx, &[id.to_owned()]).await?;
    }
    let node: String = tx.query_one("SELECT node_id FROM commands WHERE id = $1", &[&id]).await?.get(0);
    get(tx, &node, id).await
}

/// Every end of a command: wakes its owner (the controller that enqueued it) and writes
/// `command.<state>` to the outbox for the tenant that ran it (a fleet event for the system's own).
pub(crate) async fn settled(tx: &impl GenericClient, ids: &[String]) -> Result<(), DbError> {
    if ids.is_empty() {
        return Ok(());
    }
    let ended = tx
        .query(
            "SELECT id, node_id, kind, state, reason, nullif(split_part(requested_by, '/', 1), ''), owner_kind, owner_key, owner_shard
               FROM commands WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )
        .await?;
    let types: Vec<String> = ended.iter().map(|r| format!("command.{}", r.get::<_, &str>(3))).collect();
    let events: Vec<better_compute_runtime::NewEvent<'_>> = ended
        .iter()
        .zip(&types)
        .map(|(r, t)| better_compute_runtime::NewEvent {
            event_type: t,
            tenant_id: r.get(5),
            subject: r.get(0),
            data: serde_json::json!({"nodeId": r.get::<_, &str>(1), "kind": r.get::<_, &str>(2), "reason": r.get::<_, Option<&str>>(4)}),
        })
        .collect();
    better_compute_runtime::outbox::emit_many(tx, &events).await?;
    // Owners by kind, each key once (a key may not appear twice in one enqueue): one enqueue per
    // kind of controller.
    let mut owners: std::collections::BTreeMap<String, std::collections::BTreeMap<String, i16>> = Default::default();
    for r in &ended {
        if let (Some(kind), Some(key), Some(shard)) = (r.get::<_, Option<String>>(6), r.get::<_, Option<String>>(7), r.get::<_, Option<i16>>(8)) {
            owners.entry(kind).or_default().insert(key, shard);
        }
    }
    for (kind, keys) in owners {
        let (keys, shards): (Vec<String>, Vec<i16>) = keys.into_iter().unzip();
        work_queue::enqueue_stored(tx, &kind, &keys, &shards, Duration::ZERO).await?;
    }
    Ok(())
}

/// The gateway delivered the command to the node's session.
pub async fn mark_sent(tx: &impl GenericClient, id: &str) -> Result<CommandView, DbError> {
    move_to(tx, id, CommandState::Sent, None, None).await
}

/// The daemon accepted it and runs it.
pub async fn acknowledge(tx: &impl GenericClient, id: &str) -> Result<CommandView, DbError> {
    move_to(tx, id, CommandState::Running, None, None).await
}

/// Why a daemon refused a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Another node's, or an unknown or disallowed kind. Final.
    Unsupported,
    /// Its `minGeneration` is ahead of the applied spec (after waiting until `notAfter`). Final.
    StaleGeneration,
    /// Past `notAfter`. Final.
    Expired,
    /// No credits in its lane: back to pending, retried after 1 s doubling to 30 s, jittered.
    Busy,
    /// A destructive kind without a valid signature (v0.2). Final.
    BadSignature,
}

impl Rejection {
    fn as_str(self) -> &'static str {
        match self {
            Rejection::Unsupported => "UNSUPPORTED",
            Rejection::StaleGeneration => "STALE_GENERATION",
            Rejection::Expired => "EXPIRED",
            Rejection::Busy => "BUSY",
            Rejection::BadSignature => "BAD_SIGNATURE",
        }
    }
}

/// The daemon refused the command.
pub async fn reject(tx: &impl GenericClient, id: &str, why: Rejection) -> Result<CommandView, DbError> {
    match why {
        Rejection::Busy => {
            let view = move_to(tx, id, CommandState::Pending, None, None).await?;
            // From 1-2 s, then 2-4 s, 4-8 s … up to 30 s (the spec's 1 to 30 s), each a random
            // point: commands refused together do not all come back at the same instant to be
            // refused together again.
            tx.execute(
                "UPDATE commands SET busy_count = busy_count + 1,
                        not_before = compute_now() + make_interval(secs => LEAST($2::float8, power(2, least(busy_count, 16)) * (1 + random())))
                  WHERE id = $1",
                &[&id, &BUSY_BACKOFF_MAX.as_secs_f64()],
            )
            .await?;
            get(tx, &view.node_id, id).await
        }
        Rejection::Expired => move_to(tx, id, CommandState::Expired, Some(why.as_str()), None).await,
        Rejection::BadSignature => {
            let v = move_to(tx, id, CommandState::Failed, Some(why.as_str()), None).await?;
            // Someone wrote a destructive command the control plane did not sign, or a daemon
            // lost its pinned key: either way operators must see it, whoever asked.
            let data = serde_json::json!({"nodeId": v.node_id, "kind": v.kind});
            better_compute_runtime::outbox::emit(tx, better_compute_runtime::NewEvent { event_type: "command.badSignature", tenant_id: None, subject: id, data }).await?;
            Ok(v)
        }
        _ => move_to(tx, id, CommandState::Failed, Some(why.as_str()), None).await,
    }
}

/// The daemon finished the command.
pub async fn finish(
    tx: &impl GenericClient,
    id: &str,
    succeeded: bool,
    reason: Option<&str>,
    result: &serde_json::Value,
) -> Result<CommandView, DbError> {
    if !succeeded && reason.is_none_or(str::is_empty) {
        return Err(Error::invalid_argument("a failed command needs a reason").into());
    }
    let to = if succeeded { CommandState::Succeeded } else { CommandState::Failed };
    move_to(tx, id, to, reason, Some(result)).await
}

/// Cancels: a pending command becomes cancelled and is never sent; an in-flight one is marked, and
/// the gateway sends Cancel until the daemon settles it; a finished one is returned unchanged.
///
/// The row is locked before its state is read: a dispatch that moves it to `sent` commits either
/// before (the cancel then finds it in flight) or after (the dispatch then skips it, no longer
/// pending), never between the read and the write.
pub async fn cancel(tx: &impl GenericClient, node_id: &str, id: &str) -> Result<CommandView, DbError> {
    tx.query_opt("SELECT 1 FROM commands WHERE id = $1 AND node_id = $2 FOR UPDATE", &[&id, &node_id])
        .await?
        .ok_or_else(|| Error::not_found("command", id))?;
    let v = get(tx, node_id, id).await?;
    match v.state.as_str() {
        "pending" => move_to(tx, id, CommandState::Cancelled, Some("cancelled"), None).await,
        "sent" | "running" => {
            tx.execute("UPDATE commands SET cancel_requested = true, version = version + 1 WHERE id = $1 AND NOT cancel_requested", &[&id])
                .await?;
            get(tx, node_id, id).await
        }
        _ => Ok(v),
    }
}

/// What a reconnect settled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReconnectOutcome {
    /// Self-terminating commands settled as succeeded (new boot).
    pub succeeded: u64,
    /// Commands that are not retry-safe failed with `journal-lost` (new journal).
    pub journal_lost: u64,
}

/// The database side of a node reconnecting: with a new boot id, its in-flight self-terminating
/// commands (a reboot) succeeded; with a new journal id, its in-flight commands that are not
/// retry-safe fail with `journal-lost` rather than run twice.
pub async fn on_reconnect(tx: &impl GenericClient, node_id: &str, new_boot: bool, new_journal: bool) -> Result<ReconnectOutcome, DbError> {
    let mut out = ReconnectOutcome::default();
    let settle = |cond: &'static str, to: &'static str, reason: Option<&'static str>| {
        format!(
            "UPDATE commands SET state = '{to}', reason = {}, finished_at = compute_now(), version = version + 1
              WHERE node_id = $1 AND state IN ('sent', 'running') AND {cond} RETURNING id",
            reason.map(|r| format!("'{r}'")).unwrap_or_else(|| "reason".into())
        )
    };
    if new_boot {
        let ids: Vec<String> = tx.query(&settle("self_terminating", "succeeded", None), &[&node_id]).await?.iter().map(|r| r.get(0)).collect();
        out.succeeded = ids.len() as u64;
        settled(tx, &ids).await?;
    }
    if new_journal {
        let ids: Vec<String> =
            tx.query(&settle("NOT retry_safe", "failed", Some("journal-lost")), &[&node_id]).await?.iter().map(|r| r.get(0)).collect();
        out.journal_lost = ids.len() as u64;
        settled(tx, &ids).await?;
    }
    Ok(out)
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepOutcome {
    /// Pending commands past `notAfter`, now expired.
    pub expired: u64,
    /// In-flight commands past `notAfter` plus their timeout, now failed with `timeout`.
    pub timed_out: u64,
}

/// Expires pending commands past `notAfter` and fails in-flight ones past `notAfter` plus their
/// kind's timeout, at most `limit` of each; wakes their owners.
pub async fn sweep(tx: &impl GenericClient, limit: i64) -> Result<SweepOutcome, DbError> {
    let ids = async |sql: &str| -> Result<Vec<String>, DbError> { Ok(tx.query(sql, &[&limit]).await?.iter().map(|r| r.get(0)).collect()) };
    let expired = ids(
        "UPDATE commands SET state = 'expired', reason = 'not_after passed before it was sent', finished_at = compute_now(),
                version = version + 1
          WHERE id IN (SELECT id FROM commands WHERE state = 'pending' AND not_after < compute_now()
                        ORDER BY not_after LIMIT $1 FOR UPDATE SKIP LOCKED)
         RETURNING id",
    )
    .await?;
    let timed_out = ids(
        "UPDATE commands SET state = 'failed', reason = 'timeout', finished_at = compute_now(), version = version + 1
          WHERE id IN (SELECT id FROM commands WHERE state IN ('sent', 'running')
                          AND not_after + make_interval(secs => timeout_s) < compute_now()
                        ORDER BY not_after LIMIT $1 FOR UPDATE SKIP LOCKED)
         RETURNING id",
    )
    .await?;
    settled(tx, &expired).await?;
    settled(tx, &timed_out).await?;
    Ok(SweepOutcome { expired: expired.len() as u64, timed_out: timed_out.len() as u64 })
}

/// `commands.run`: one of the kinds allowed through the API, keyed by the caller's idempotency key.
#[derive(Debug, Clone, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunCommand {
    /// The caller's tenant (`BETTER_COMPUTE_TENANT`); when given it must be the token's tenant.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// The node.
    pub node_id: String,
    /// The kind.
    #[schemars(extend("enum" = ["diag.nvml", "inventory.refresh", "logs.collect", "node.reboot"]))]
    pub kind: String,
    /// Its payload.
    #[serde(default)]
    pub payload: serde_json::Value,
    /// Required; scoped to the caller's tenant and identity.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Seconds the daemon may still accept it: default 600, from 10 to 3600; `notAfterSeconds` is
    /// accepted too.
    #[serde(default, alias = "notAfterSeconds")]
    pub not_after_s: Option<i64>,
}

/// The permission `commands.run` and `commands.cancel` check on the node.
pub const EXEC: &str = "compute:nodes:exec";

/// Runs `commands.run` for a caller the API found to hold [`EXEC`] on the node: the checks, then
/// the queue, with the request's audit entry.
pub async fn run(client: &mut Client, registry: &Registry, actor: &Actor, caller: Caller<'_>, req: &RunCommand) -> Result<CommandView, Error> {
    match registry.command_kind(&req.kind) {
        Some(k) if k.api_allowed => {}
        _ => {
            return Err(Error::new(
                ErrorCode::Unsupported,
                format!("commands.run does not run {:?}; it runs diag.nvml, inventory.refresh, logs.collect and node.reboot", better_compute_core::bounds::echo(&req.kind)),
            ))
        }
    }
    // Only after the permission check (the API's): a caller who may not run commands learns
    // nothing of the input.
    let key = req.idempotency_key.as_deref().ok_or_else(|| {
        Error::invalid_argument("idempotencyKey is required on commands.run: a retry with the same key returns the same command")
    })?;
    idempotency::validate_key(key)?;
    if serde_json::to_vec(&req.payload).map_or(true, |p| p.len() > better_compute_core::bounds::COMMAND_PAYLOAD_BYTES) {
        return Err(Error::invalid_argument(format!("payload must be at most {} bytes of JSON", better_compute_core::bounds::COMMAND_PAYLOAD_BYTES)));
    }
    let not_after_s = req.not_after_s.unwrap_or(600);
    if !(10..=3600).contains(&not_after_s) {
        return Err(Error::invalid_argument("notAfterS must be between 10 and 3600"));
    }
    let tx = client.transaction().await.map_err(DbError::from)?;
    let scope = IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key };
    // The stored request keeps its first field names, so a retry across an upgrade still matches.
    let request = serde_json::json!({"nodeId": req.node_id, "kind": req.kind, "payload": req.payload, "notAfterSeconds": not_after_s});
    if let Claim::Replay(v) = idempotency::claim(&tx, scope, "commands.run", &request).await? {
        let view = get(&tx, v["nodeId"].as_str().unwrap_or_default(), v["id"].as_str().unwrap_or_default()).await?;
        tx.commit().await.map_err(DbError::from)?;
        return Ok(view);
    }
    let command_key = format!("api:{}:{}:{key}", caller.tenant_id, caller.identity_id);
    let v = enqueue(
        &tx,
        registry,
        NewCommand {
            node_id: &req.node_id,
            kind: &req.kind,
            payload: &req.payload,
            idempotency_key: &command_key,
            not_after: Some(Duration::from_secs(not_after_s as u64)),
            min_generation: 0,
            owner: None,
            actor,
        },
    )
    .await?;
    idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("view serializes")).await?;
    actor.record(&tx, "commands.run", &req.node_id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    poke_gateway(&*client, &req.node_id).await;
    Ok(v)
}

/// `commands.cancel` for a caller the API found to hold [`EXEC`] on the node: [`cancel`] with the
/// actor's audit entry, then a poke.
pub async fn cancel_by(client: &mut Client, actor: &Actor, caller: Caller<'_>, node_id: &str, command_id: &str) -> Result<CommandView, Error> {
    let tx = client.transaction().await.map_err(DbError::from)?;
    let v = cancel(&tx, node_id, command_id).await?;
    actor.record(&tx, "commands.cancel", command_id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    poke_gateway(&*client, node_id).await;
    Ok(v)
}

/// The permission reading nodes and their commands needs.
pub const READ: &str = "compute:nodes:read";
