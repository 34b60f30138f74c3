//! Reservations: create, get, list, extend, release; and the moves through time that the
//! `capacity.reservations` reconciler makes. Every change follows `RESERVATION_STATE_TABLE` (which a
//! trigger enforces in the database), writes an outbox event and invalidates the desired state of
//! the node it touches.
//!
//! Create, release and the moves through time run in the database, one statement each
//! (`src/sql/reservation.sql`): one round trip, with the plans kept by the
//! backend. This side checks the request's shape, makes the ids, and reads back the view.

use std::time::Duration;

use better_compute_audit::Actor;
use better_compute_core::bounds;
use better_compute_core::id::{EventId, ReservationId};
use better_compute_core::state::{ReservationState, State, RESERVATION_STATE_TABLE};
use better_compute_core::Error;
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::DbError;
use better_compute_runtime::work_queue;
use serde::{Deserialize, Serialize};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::batch::{self, BatchPlacer, Outcome};
use crate::placer::MAX_REPLANS;
use better_compute_core::time::check_rfc3339;
use crate::{Caller, RESERVATIONS_KIND};

/// How often a pending reservation is retried.
pub const PENDING_RETRY: Duration = Duration::from_secs(30);
/// The longest a reservation may last.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);
/// Most atoms in one reservation.
pub const MAX_GPUS: i32 = 64;

/// The GPUs a reservation asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuRequest {
    /// `gpu` (whole GPUs), `mig` (MIG instances of `profile`) or `slot` (shared slots).
    #[schemars(extend("enum" = ["gpu", "mig", "slot"]))]
    pub kind: String,
    /// The GPU model, e.g. `H100-80GB`.
    pub model: String,
    /// The MIG profile, for `kind: mig`.
    #[serde(default)]
    pub profile: Option<String>,
    /// How many atoms (0 for a CPU-only reservation).
    pub count: i32,
}

/// A taint a reservation tolerates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Toleration {
    /// The taint's key.
    pub key: String,
    /// Its value; absent tolerates any value.
    #[serde(default)]
    pub value: Option<String>,
}

/// `reservations.create`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateReservation {
    /// The caller's tenant (`BETTER_COMPUTE_TENANT`); when given it must be the token's tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// The pool to place in.
    pub pool_id: String,
    /// The GPUs.
    pub gpu: GpuRequest,
    /// vCPUs.
    #[serde(default)]
    pub vcpu: i32,
    /// Memory.
    #[serde(default)]
    pub memory_mib: i64,
    /// Disk.
    #[serde(default)]
    pub disk_gib: i64,
    /// Start (RFC 3339); absent or past means now.
    #[serde(default)]
    pub starts_at: Option<String>,
    /// End (RFC 3339); or give `durationS`.
    #[serde(default)]
    pub ends_at: Option<String>,
    /// Length in seconds from the start; or give `endsAt`.
    #[serde(default)]
    pub duration_s: Option<i64>,
    /// Labels the node must carry.
    #[serde(default)]
    pub node_selector: serde_json::Map<String, serde_json::Value>,
    /// Taints tolerated.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Makes a retry return the first result instead of booking twice. Required by
    /// `reservations.create` in the API (scoped to the caller's tenant and identity).
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

/// A reservation as its tenant sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReservationView {
    /// `res_…`.
    pub id: String,
    /// pending, placed, active, released, expired or failed.
    #[schemars(extend("enum" = ["pending", "placed", "active", "released", "expired", "failed"]))]
    pub state: String,
    /// For version-guarded changes.
    pub version: i64,
    /// Its pool.
    pub pool_id: String,
    /// The GPUs asked for.
    pub gpu: GpuRequest,
    /// vCPUs.
    pub vcpu: i32,
    /// Memory.
    pub memory_mib: i64,
    /// Disk.
    pub disk_gib: i64,
    /// Start.
    pub starts_at: String,
    /// End, as booked (or extended).
    pub ends_at: String,
    /// RFC 3339, once it has ended: when it actually ended (its end, or the instant of a release,
    /// an eviction or a failure before it); metering bills up to here.
    #[serde(default)]
    pub ended_at: Option<String>,
    /// The node, once placed.
    pub node_id: Option<String>,
    /// The atoms booked; once ended, those it held (none if it ended before its start).
    pub atoms: Vec<String>,
    /// Conditions: `Unschedulable` with its reason and message while pending.
    pub conditions: Vec<serde_json::Value>,
    /// Why it ended when neither its tenant nor its end ended it: `drained` (its node's drain
    /// evicted it at the deadline).
    #[serde(default)]
    pub end_reason: Option<String>,
}

/// The view of a reservation from `capacity_view` (`src/sql/reservation.sql`).
fn from_json(v: serde_json::Value) -> Result<ReservationView, DbError> {
    serde_json::from_value(v).map_err(|e| Error::internal(format!("reservation view: {e}")).into())
}

async fn view(db: &impl GenericClient, tenant_id: &str, id: &str) -> Result<ReservationView, DbError> {
    let row = db
        .query_opt("SELECT capacity_view(r) FROM reservations r WHERE r.id = $1 AND r.tenant_id = $2", &[&id, &tenant_id])
        .await?
        .ok_or_else(|| Error::not_found("reservation", id))?;
    from_json(row.get(0))
}

/// A create request that passed the shape checks, in the terms `capacity_reserve` takes.
#[derive(Debug)]
struct Demand {
    kind: String,
    model: String,
    /// The MIG profile, or empty.
    profile: String,
    count: i32,
    node_selector: serde_json::Value,
    tolerations: serde_json::Value,
    /// Exactly one of `ends_at` and `duration_s` is given; the database computes the range.
    ends_at: Option<String>,
    duration_s: Option<f64>,
}

/// The class a GPU request names (kind, model, profile), checked as every request that names one
/// is; returns its profile (empty unless kind mig).
pub(crate) fn gpu_class(g: &GpuRequest) -> Result<String, Error> {
    if !["gpu", "mig", "slot"].contains(&g.kind.as_str()) {
        return Err(Error::invalid_argument("gpu.kind must be gpu, mig or slot"));
    }
    if g.model.trim().is_empty() {
        return Err(Error::invalid_argument("gpu.model is required"));
    }
    bounds::check_text("gpu.model", &g.model, bounds::VALUE_CHARS)?;
    Ok(match (g.kind.as_str(), &g.profile) {
        ("mig", Some(p)) if better_compute_core::gpu_mode::parse_mig_profile(p).is_some() => p.clone(),
        ("mig", _) => return Err(Error::invalid_argument("gpu.profile must be a MIG profile like \"3g.40gb\" for kind mig")),
        (_, Some(_)) => return Err(Error::invalid_argument("gpu.profile is only for kind mig")),
        (_, None) => String::new(),
    })
}

fn demand(req: &CreateReservation) -> Result<Demand, Error> {
    let g = &req.gpu;
    let profile = gpu_class(g)?;
    if !(0..=MAX_GPUS).contains(&g.count) {
        return Err(Error::invalid_argument(format!("gpu.count must be between 0 and {MAX_GPUS}")));
    }
    bounds::check_amount("vcpu", req.vcpu, bounds::MAX_VCPU)?;
    bounds::check_amount("memoryMib", req.memory_mib, bounds::MAX_MEMORY_MIB)?;
    bounds::check_amount("diskGib", req.disk_gib, bounds::MAX_DISK_GIB)?;
    if g.count == 0 && req.vcpu == 0 && req.memory_mib == 0 && req.disk_gib == 0 {
        return Err(Error::invalid_argument("a reservation must ask for something: gpu.count, vcpu, memoryMib or diskGib"));
    }
    if req.node_selector.len() > bounds::SELECTOR_ENTRIES || req.tolerations.len() > bounds::SELECTOR_ENTRIES {
        return Err(Error::invalid_argument(format!("nodeSelector and tolerations take at most {} entries each", bounds::SELECTOR_ENTRIES)));
    }
    for (k, v) in &req.node_selector {
        bounds::check_text("a nodeSelector key", k, bounds::KEY_CHARS)?;
        let Some(v) = v.as_str() else {
            return Err(Error::invalid_argument(format!("nodeSelector.{} must be a string", bounds::echo(k))));
        };
        bounds::check_text("a nodeSelector value", v, bounds::VALUE_CHARS)?;
    }
    for t in &req.tolerations {
        if t.key.is_empty() {
            return Err(Error::invalid_argument("every toleration needs a key"));
        }
        bounds::check_text("a toleration's key", &t.key, bounds::KEY_CHARS)?;
        bounds::check_text("a toleration's value", t.value.as_deref().unwrap_or(""), bounds::VALUE_CHARS)?;
    }
    // Timestamps are checked for shape here: PostgreSQL would also take words like `now`, which
    // read the real clock behind compute_now()'s back. The range itself is computed in the
    // database's time.
    if let Some(s) = &req.starts_at {
        check_rfc3339("startsAt", s)?;
    }
    let (ends_at, duration_s) = match (&req.ends_at, req.duration_s) {
        (Some(e), None) => {
            check_rfc3339("endsAt", e)?;
            (Some(e.clone()), None)
        }
        (None, Some(d)) if d > 0 && d <= MAX_DURATION.as_secs() as i64 => (None, Some(d as f64)),
        (None, Some(_)) => return Err(Error::invalid_argument(format!("durationS must be between 1 and {}", MAX_DURATION.as_secs()))),
        _ => return Err(Error::invalid_argument("give exactly one of endsAt and durationS")),
    };
    Ok(Demand {
        kind: g.kind.clone(),
        model: g.model.clone(),
        profile,
        count: g.count,
        node_selector: serde_json::Value::Object(req.node_selector.clone()),
        tolerations: serde_json::to_value(&req.tolerations).expect("tolerations serialize"),
        ends_at,
        duration_s,
    })
}

/// The ids and shard every change in the database takes: a fresh event id, and the reservation's
/// key's shard.
pub(crate) fn change_ids(id: &str) -> (String, i16) {
    (EventId::generate().to_string(), RESERVATIONS_KIND.shard_of(id))
}

/// Runs `capacity_reserve` for a checked request: one statement.
async fn reserve(db: &impl GenericClient, caller: Caller<'_>, req: &CreateReservation, d: &Demand, id: &str) -> Result<ReservationView, DbError> {
    let (event_id, shard) = change_ids(id);
    let (retry_s, max_duration_s) = (PENDING_RETRY.as_secs_f64(), MAX_DURATION.as_secs_f64());
    let params: [(&(dyn ToSql + Sync), Type); 21] = [
        (&id, Type::TEXT),
        (&caller.tenant_id, Type::TEXT),
        (&caller.identity_id, Type::TEXT),
        (&req.pool_id, Type::TEXT),
        (&d.kind, Type::TEXT),
        (&d.model, Type::TEXT),
        (&d.profile, Type::TEXT),
        (&d.count, Type::INT4),
        (&req.vcpu, Type::INT4),
        (&req.memory_mib, Type::INT8),
        (&req.disk_gib, Type::INT8),
        (&req.starts_at, Type::TEXT),
        (&d.ends_at, Type::TEXT),
        (&d.duration_s, Type::FLOAT8),
        (&d.node_selector, Type::JSONB),
        (&d.tolerations, Type::JSONB),
        (&MAX_REPLANS, Type::INT4),
        (&retry_s, Type::FLOAT8),
        (&max_duration_s, Type::FLOAT8),
        (&event_id, Type::TEXT),
        (&shard, Type::INT2),
    ];
    // query_typed: the parameters' types are given, so the statement goes out with its execution
    // in one round trip instead of being prepared first.
    let row = db
        .query_typed_one(
            "SELECT capacity_reserve($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::timestamptz, $13::timestamptz,
                                     $14, $15, $16, $17, $18, $19, $20, $21)",
            &params,
        )
        .await?;
    let mut view: serde_json::Value = row.get(0);
    if let Some(replans) = view.as_object_mut().and_then(|o| o.remove("placerReplans")) {
        for reason in ["conflict", "stale"] {
            let n = replans.get(reason).and_then(|n| n.as_u64()).unwrap_or(0);
            if n > 0 {
                metrics::counter!("better_compute_placer_replans_total", "reason" => reason).increment(n);
            }
        }
    }
    from_json(view)
}

/// A reservation made inside the caller's transaction, for a module that creates one with
/// something of its own (an instance): quota, placement and the reservation's event commit or
/// roll back with the caller's rows. The caller handles idempotency. Errors: as [`create`].
pub async fn create_in(tx: &Transaction<'_>, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
    let d = demand(req)?;
    Ok(reserve(tx, caller, req, &d, &ReservationId::generate().to_string()).await?)
}

/// `reservations.create`: charges quota (final if it does not fit), then places or leaves the
/// reservation pending with an `Unschedulable` condition, retried every 30 s. Without an
/// idempotency key it is one statement; with one, the key's claim and its stored response share
/// the statement's transaction.
pub async fn create(client: &mut Client, actor: &Actor, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
    let d = demand(req)?;
    create_alone(client, actor, caller, req, &d, &ReservationId::generate().to_string()).await
}

/// `reservations.create` through the batch placer (batch.rs): a request of the kind it batches goes
/// into the next batch, and runs alone as [`create`] does if the batch did not place it.
pub async fn create_batched(placer: &BatchPlacer, client: &mut Client, actor: &Actor, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
    match create_in_batch(placer, actor, caller, req).await? {
        Ok(v) => Ok(v),
        Err(alone) => create_run_alone(client, actor, caller, req, alone).await,
    }
}

/// A create the batch did not place: run it alone with [`create_run_alone`], which keeps its
/// reservation id (so a batch whose commit was in doubt can never place it a second time).
#[derive(Debug)]
pub struct RunAlone {
    id: String,
    demand: Demand,
}

impl RunAlone {
    /// A create that goes straight to running alone (no batch placer). Errors: the request's shape
    /// (INVALID_ARGUMENT), as [`create`].
    pub fn new(req: &CreateReservation) -> Result<RunAlone, Error> {
        Ok(RunAlone { id: ReservationId::generate().to_string(), demand: demand(req)? })
    }
}

/// The first half of [`create_batched`], for callers that take a connection only when they need
/// one (the API: a request holding a pooled connection while it waits for a batcher could starve
/// the batchers of theirs): the view if the batch placed the request, else what to run alone.
/// Errors: the request's shape (INVALID_ARGUMENT), as [`create`].
pub async fn create_in_batch(placer: &BatchPlacer, actor: &Actor, caller: Caller<'_>, req: &CreateReservation) -> Result<Result<ReservationView, RunAlone>, Error> {
    let demand = demand(req)?;
    let id = ReservationId::generate().to_string();
    if batch::batchable(req) {
        let (event_id, shard) = change_ids(&id);
        match placer.place(actor, caller, req, &id, event_id, shard).await {
            Outcome::Done(v) => return Ok(Ok(*v)),
            Outcome::Failed(e) => return Err(e),
            Outcome::RunAlone => {}
        }
    }
    Ok(Err(RunAlone { id, demand }))
}

/// The second half of [`create_batched`]: `reservations.create` alone, as [`create`].
pub async fn create_run_alone(client: &mut Client, actor: &Actor, caller: Caller<'_>, req: &CreateReservation, alone: RunAlone) -> Result<ReservationView, Error> {
    create_alone(client, actor, caller, req, &alone.demand, &alone.id).await
}

/// `reservations.create` as one `capacity_reserve` run, with the idempotency key's claim in its
/// transaction when there is one.
async fn create_alone(client: &mut Client, actor: &Actor, caller: Caller<'_>, req: &CreateReservation, d: &Demand, id: &str) -> Result<ReservationView, Error> {
    let Some(key) = req.idempotency_key.as_deref() else {
        // The audit entry commits with the reservation.
        let tx = client.transaction().await.map_err(DbError::from)?;
        let v = reserve(&tx, caller, req, d, id).await?;
        actor.record(&tx, "reservations.create", id, Some(caller.tenant_id)).await?;
        tx.commit().await.map_err(DbError::from)?;
        work_queue::poke(&*client).await;
        return Ok(v);
    };
    let tx = client.transaction().await.map_err(DbError::from)?;
    let request = serde_json::to_value(req).expect("request serializes");
    let scope = IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key };
    if let Claim::Replay(v) = idempotency::claim(&tx, scope, "reservations.create", &request).await? {
        tx.commit().await.map_err(DbError::from)?;
        return serde_json::from_value(idempotency::replayed(v)?).map_err(|e| Error::internal(e.to_string()));
    }
    // A final refusal (the quota, the pool) is the key's answer too: every repeat gets it, so a
    // repeat judged later can neither succeed where the first was refused nor the other way round.
    let mut tx = tx;
    let attempt = tx.savepoint("reserve").await.map_err(DbError::from)?;
    let v = match reserve(&attempt, caller, req, d, id).await.map_err(Error::from) {
        Ok(v) => {
            attempt.commit().await.map_err(DbError::from)?;
            v
        }
        Err(e) if idempotency::is_final(&e) => {
            attempt.rollback().await.map_err(DbError::from)?;
            idempotency::complete_with_error(&tx, scope, &e).await?;
            tx.commit().await.map_err(DbError::from)?;
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("view serializes")).await?;
    actor.record(&tx, "reservations.create", id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(v)
}

/// The shared tail of a change made from this side (extend): the outbox event, the node's desired
/// state and a wake-up of the reservation's own reconciler key; returns the view.
async fn after_change(tx: &impl GenericClient, id: &str, event_type: &str) -> Result<ReservationView, DbError> {
    let (event_id, shard) = change_ids(id);
    let row = tx
        .query_typed_one(
            "SELECT capacity_after_change(r, $2, $3, $4) FROM reservations r WHERE r.id = $1",
            &[(&id, Type::TEXT), (&event_type, Type::TEXT), (&event_id, Type::TEXT), (&shard, Type::INT2)],
        )
        .await?;
    from_json(row.get(0))
}

/// `reservations.get`: only the caller's tenant's reservations exist for it.
pub async fn get(db: &impl GenericClient, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
    Ok(view(db, caller.tenant_id, id).await?)
}

/// A page of reservations.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReservationPage {
    /// The reservations, by id.
    pub items: Vec<ReservationView>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<String>,
}

/// `reservations.list`: the caller's tenant's reservations by id, optionally in one state, a page
/// of at most `limit` (1 to 500) after `cursor`.
pub async fn list(
    db: &impl GenericClient,
    caller: Caller<'_>,
    state: Option<&str>,
    cursor: Option<&str>,
    limit: i64,
) -> Result<ReservationPage, Error> {
    if !(1..=500).contains(&limit) {
        return Err(Error::invalid_argument("limit must be between 1 and 500"));
    }
    if let Some(s) = state && ReservationState::parse(s).is_none() {
        return Err(Error::invalid_argument("state must be pending, placed, active, released, expired or failed"));
    }
    let rows = db
        .query(
            "SELECT capacity_view(r) FROM reservations r
              WHERE r.tenant_id = $1 AND ($2::text IS NULL OR r.state = $2) AND r.id > coalesce($3, '')
              ORDER BY r.id LIMIT $4",
            &[&caller.tenant_id, &state, &cursor, &(limit + 1)],
        )
        .await
        .map_err(DbError::from)?;
    let mut items = rows.into_iter().map(|r| from_json(r.get(0))).collect::<Result<Vec<_>, _>>()?;
    let next_cursor = if items.len() as i64 > limit {
        items.truncate(limit as usize);
        items.last().map(|v| v.id.clone())
    } else {
        None
    };
    Ok(ReservationPage { items, next_cursor })
}

/// `reservations.release`: ends the reservation now and returns its quota, devices and scalars, in
/// one statement (`capacity_end`). Releasing a finished reservation returns it unchanged.
pub async fn release(client: &mut Client, actor: &Actor, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
    release_alone(client, actor, caller, id).await
}

/// `reservations.release` through the batch placer (batch.rs): in the next batch of releases, and
/// alone as [`release`] if the batch did not release it (not found, already ended, or the batch
/// failed).
pub async fn release_batched(placer: &BatchPlacer, client: &mut Client, actor: &Actor, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
    match release_in_batch(placer, actor, caller, id).await? {
        Some(v) => Ok(v),
        None => release_alone(client, actor, caller, id).await,
    }
}

/// The first half of [`release_batched`] (see [`create_in_batch`]): the view if the batch released
/// it; `None`: run [`release`].
pub async fn release_in_batch(placer: &BatchPlacer, actor: &Actor, caller: Caller<'_>, id: &str) -> Result<Option<ReservationView>, Error> {
    let (event_id, shard) = change_ids(id);
    match placer.release(actor, caller, id, event_id, shard).await {
        Outcome::Done(v) => Ok(Some(*v)),
        Outcome::Failed(e) => Err(e),
        Outcome::RunAlone => Ok(None),
    }
}

async fn release_alone(client: &mut Client, actor: &Actor, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
    let (event_id, shard) = change_ids(id);
    let params: [(&(dyn ToSql + Sync), Type); 4] =
        [(&id, Type::TEXT), (&caller.tenant_id, Type::TEXT), (&event_id, Type::TEXT), (&shard, Type::INT2)];
    // The audit entry commits with the release.
    let tx = client.transaction().await.map_err(DbError::from)?;
    let row = tx.query_typed_one("SELECT capacity_end($1, $2, 'released', $3, $4)", &params).await.map_err(DbError::from)?;
    actor.record(&tx, "reservations.release", id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(from_json(row.get(0))?)
}


/// `reservations.extend`: moves the end later. The added range is booked on the same atoms with
/// `ON CONFLICT DO NOTHING`; if another reservation holds any of them then, nothing changes and the
/// answer is `CONFLICT`.
#[allow(clippy::too_many_lines, reason = "one guarded transaction (lock, check, book the added range, charge, record, emit); its steps share the row locks it takes")]
pub async fn extend(
    client: &mut Client,
    actor: &Actor,
    caller: Caller<'_>,
    id: &str,
    ends_at: &str,
    idempotency_key: Option<&str>,
) -> Result<ReservationView, Error> {
    check_rfc3339("endsAt", ends_at)?;
    let mut tx = client.transaction().await.map_err(DbError::from)?;
    let request = serde_json::json!({"reservationId": id, "endsAt": ends_at});
    let scope = idempotency_key.map(|key| IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key });
    if let Some(scope) = scope && let Claim::Replay(v) = idempotency::claim(&tx, scope, "reservations.extend", &request).await? {
        tx.commit().await.map_err(DbError::from)?;
        return serde_json::from_value(v).map_err(|e| Error::internal(e.to_string()));
    }
    // The reservation's row first, before the rest of the lock order.
    let r = tx
        .query_opt("SELECT state, version FROM reservations WHERE id = $1 AND tenant_id = $2 FOR UPDATE", &[&id, &caller.tenant_id])
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("reservation", id))?;
    let state = ReservationState::parse(r.get(0)).ok_or_else(|| Error::internal("unknown reservation state"))?;
    let version: i64 = r.get(1);
    if RESERVATION_STATE_TABLE.is_terminal(state) {
        return Err(Error::failed_precondition(format!("reservation {id} is {} and cannot be extended", state.as_str())));
    }
    // A reservation on a draining node is not extended: a wait drain would otherwise be held for
    // ever. Its node's row FOR SHARE (the lock order: reservation, then nodes), so a drain
    // requested meanwhile sees this extension or this extension sees the drain.
    let draining = tx
        .query_opt(
            "SELECT n.id FROM reservations r JOIN nodes n ON n.id = r.node_id
              WHERE r.id = $1 AND 'draining' = ANY(n.no_schedule_reasons) FOR SHARE OF n",
            &[&id],
        )
        .await
        .map_err(DbError::from)?;
    if let Some(node) = draining {
        return Err(Error::failed_precondition(format!(
            "reservation {id} cannot be extended: its node {} is being drained; reserve again to run longer",
            node.get::<_, String>(0)
        )));
    }
    let row = tx
        .query_one(
            &format!(
                "SELECT $2::text::timestamptz > upper(during), $2::text::timestamptz - lower(during) <= make_interval(secs => $3),
                        CASE WHEN $2::text::timestamptz > upper(during)
                             THEN tstzrange(upper(during), $2::text::timestamptz, '[)')::text END,
                        upper(during) <= compute_now(), {}
                   FROM reservations WHERE id = $1",
                better_compute_db::clock::rfc3339_sql("upper(during)")
            ),
            &[&id, &ends_at, &(MAX_DURATION.as_secs() as f64)],
        )
        .await
        .map_err(DbError::from)?;
    // Its end has come: it is over, though capacity.reservations may not have marked it expired
    // yet. Extending it would book from the past, and would succeed or not with the job's latency.
    if row.get::<_, bool>(3) {
        return Err(Error::failed_precondition(format!(
            "reservation {id} ended at {}; reserve again instead",
            row.get::<_, String>(4)
        )));
    }
    if !row.get::<_, bool>(0) {
        return Err(Error::invalid_argument("endsAt must be later than the reservation's current end"));
    }
    if !row.get::<_, bool>(1) {
        return Err(Error::invalid_argument("a reservation may last at most 366 days"));
    }
    let added: String = row.get::<_, Option<String>>(2).expect("checked: endsAt is later");
    let sp = tx.savepoint("extend").await.map_err(DbError::from)?;
    // The reservation's atoms, locked before their bookings in id order (the lock order: devices,
    // then device_bookings): the bookings' foreign key would lock each atom only after its booking
    // is in, and a mode change holding the GPU and booking its change window over ours then waited
    // for us as we waited for it.
    let atoms: Vec<String> = sp
        .query(
            "SELECT id FROM devices WHERE id IN (SELECT device_id FROM device_bookings WHERE allocation_id = $1)
              ORDER BY id FOR KEY SHARE",
            &[&id],
        )
        .await
        .map_err(DbError::from)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let booked = sp
        .execute(
            "INSERT INTO device_bookings (device_id, allocation_id, during)
             SELECT a, $2, $3::text::tstzrange FROM unnest($1::text[]) a ORDER BY a ON CONFLICT DO NOTHING",
            &[&atoms, &id, &added],
        )
        .await
        .map_err(DbError::from)?;
    if booked < atoms.len() as u64 {
        sp.rollback().await.map_err(DbError::from)?;
        return Err(Error::conflict(format!(
            "reservation {id} cannot be extended to {ends_at}: its devices are booked by another reservation in that time"
        )));
    }
    sp.commit().await.map_err(DbError::from)?;
    let n = tx
        .execute(
            "UPDATE reservations SET during = tstzrange(lower(during), $3::text::timestamptz, '[)'), version = version + 1,
                    updated_at = compute_now()
              WHERE id = $1 AND version = $2",
            &[&id, &version, &ends_at],
        )
        .await
        .map_err(DbError::from)?;
    if n == 0 {
        return Err(Error::conflict(format!("reservation {id} changed concurrently; retry")));
    }
    let v = after_change(&tx, id, "reservation.extended").await?;
    if let Some(scope) = scope {
        idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("view serializes")).await?;
    }
    actor.record(&tx, "reservations.extend", id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(v)
}

/// What the reservations reconciler did to one reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing was due.
    Nothing,
    /// placed → active.
    Activated,
    /// → expired.
    Expired,
    /// pending → placed.
    Placed,
    /// Still pending; retried again in 30 s.
    StillPending,
}

/// Moves one reservation through time, in the caller's (fenced) transaction (`capacity_step`): a
/// placed one whose start has come becomes active; one whose end has passed expires and gives back
/// what it holds; a pending one due for a retry is placed again.
pub async fn step(tx: &mut Transaction<'_>, id: &str) -> Result<Step, DbError> {
    let (event_id, shard) = change_ids(id);
    let retry_s = PENDING_RETRY.as_secs_f64();
    let row = tx
        .query_typed_one(
            "SELECT capacity_step($1, $2, $3, $4, $5)",
            &[(&id, Type::TEXT), (&MAX_REPLANS, Type::INT4), (&retry_s, Type::FLOAT8), (&event_id, Type::TEXT), (&shard, Type::INT2)],
        )
        .await?;
    let (step, action) = match row.get::<_, &str>(0) {
        "nothing" => (Step::Nothing, None),
        "activated" => (Step::Activated, Some("reservations.activate")),
        "expired" => (Step::Expired, Some("reservations.expire")),
        "placed" => (Step::Placed, Some("reservations.place")),
        "still_pending" => (Step::StillPending, None),
        other => return Err(Error::internal(format!("capacity_step returned {other:?}")).into()),
    };
    // The job's move of a reservation through time is its decision, in the tenant's audit log.
    if let Some(action) = action {
        let tenant: String = tx.query_one("SELECT tenant_id FROM reservations WHERE id = $1", &[&id]).await?.get(0);
        Actor::job(crate::RESERVATIONS_KIND.name).record(&*tx, action, id, Some(&tenant)).await?;
    }
    Ok(step)
}

/// What a module that hangs something on a reservation (an instance) needs to know of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReservationFacts {
    /// `res_…`.
    pub id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// Its pool.
    pub pool_id: String,
    /// Its state.
    pub state: ReservationState,
    /// Its node, once placed.
    pub node_id: Option<String>,
    /// Seconds from now until its end (negative once past).
    pub ends_in_s: f64,
    /// What it holds, as one stable name: `<count>x<kind>:<model>[/<profile>],<vcpu>vcpu,<MiB>mib,<GiB>gib`
    /// (`2xgpu:H100-80GB,16vcpu,65536mib,100gib`): what an instance on it is metered as.
    pub flavour: String,
}

impl ReservationFacts {
    /// Whether it still holds, or will hold, its atoms.
    pub fn is_live(&self) -> bool {
        !RESERVATION_STATE_TABLE.is_terminal(self.state)
    }
}

/// [`ReservationFacts`] of `ids`, in id order; with `lock`, each row is locked `FOR SHARE`, so it
/// cannot end before the caller commits (an end locks it for update).
pub async fn facts(db: &impl GenericClient, ids: &[String], lock: bool) -> Result<Vec<ReservationFacts>, DbError> {
    let rows = db
        .query(
            &format!(
                "SELECT id, tenant_id, pool_id, state, node_id, extract(epoch FROM upper(during) - compute_now())::float8,
                        format('%sx%s:%s%s,%svcpu,%smib,%sgib', gpu_count, gpu_kind, gpu_model, '/' || mig_profile, vcpu, memory_mib, disk_gib)
                   FROM reservations WHERE id = ANY($1) ORDER BY id{}",
                if lock { " FOR SHARE" } else { "" }
            ),
            &[&ids],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let state: String = r.get(3);
            Ok(ReservationFacts {
                id: r.get(0),
                tenant_id: r.get(1),
                pool_id: r.get(2),
                state: ReservationState::parse(&state).ok_or_else(|| Error::internal(format!("unknown reservation state {state}")))?,
                node_id: r.get(4),
                ends_in_s: r.get(5),
                flavour: r.get(6),
            })
        })
        .collect()
}
