//! Reservations: create, get, list, extend, release; and the moves through time that the
//! `capacity.reservations` reconciler makes. Every change is version-guarded, follows
//! `RESERVATION_STATE_TABLE`, writes an outbox event and invalidates the desired state of the node
//! it touches.

use std::time::Duration;

use better_compute_core::id::ReservationId;
use better_compute_core::state::{ReservationState, State, RESERVATION_STATE_TABLE};
use better_compute_core::Error;
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use better_compute_runtime::{desired, work_queue};
use serde::{Deserialize, Serialize};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::placer::{self, Demand, Placement};
use crate::quota::{self, Charge};
use crate::time::{check_rfc3339, rfc3339_sql};
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
    /// End.
    pub ends_at: String,
    /// The node, once placed.
    pub node_id: Option<String>,
    /// The atoms booked.
    pub atoms: Vec<String>,
    /// Conditions: `Unschedulable` with its reason and message while pending.
    pub conditions: Vec<serde_json::Value>,
}

fn view_sql(filter: &str) -> String {
    format!(
        "SELECT r.id, r.state, r.version, r.pool_id, r.gpu_kind, r.gpu_model, r.mig_profile, r.gpu_count, r.vcpu,
                r.memory_mib, r.disk_gib, {}, {}, r.node_id, r.unschedulable,
                (SELECT coalesce(array_agg(DISTINCT b.device_id ORDER BY b.device_id), '{{}}')
                   FROM device_bookings b WHERE b.allocation_id = r.id)
           FROM reservations r WHERE {filter}",
        rfc3339_sql("lower(r.during)"),
        rfc3339_sql("upper(r.during)")
    )
}

fn to_view(r: &tokio_postgres::Row) -> ReservationView {
    let unschedulable: Option<serde_json::Value> = r.get(14);
    ReservationView {
        id: r.get(0),
        state: r.get(1),
        version: r.get(2),
        pool_id: r.get(3),
        gpu: GpuRequest { kind: r.get(4), model: r.get(5), profile: r.get(6), count: r.get(7) },
        vcpu: r.get(8),
        memory_mib: r.get(9),
        disk_gib: r.get(10),
        starts_at: r.get(11),
        ends_at: r.get(12),
        node_id: r.get(13),
        atoms: r.get(15),
        conditions: unschedulable
            .map(|u| {
                let mut c = serde_json::json!({"type": "Unschedulable"});
                if let (Some(o), Some(u)) = (c.as_object_mut(), u.as_object()) {
                    o.extend(u.clone());
                }
                vec![c]
            })
            .unwrap_or_default(),
    }
}

async fn view(db: &impl GenericClient, tenant_id: &str, id: &str) -> Result<ReservationView, DbError> {
    let row = db
        .query_opt(&view_sql("r.id = $1 AND r.tenant_id = $2"), &[&id, &tenant_id])
        .await?
        .ok_or_else(|| Error::not_found("reservation", id))?;
    Ok(to_view(&row))
}

fn demand(req: &CreateReservation) -> Result<Demand, Error> {
    let g = &req.gpu;
    if !["gpu", "mig", "slot"].contains(&g.kind.as_str()) {
        return Err(Error::invalid_argument("gpu.kind must be gpu, mig or slot"));
    }
    if g.model.trim().is_empty() {
        return Err(Error::invalid_argument("gpu.model is required"));
    }
    let profile = match (g.kind.as_str(), &g.profile) {
        ("mig", Some(p)) if better_compute_nodes::layout::parse_mig_profile(p).is_some() => p.clone(),
        ("mig", _) => return Err(Error::invalid_argument("gpu.profile must be a MIG profile like \"3g.40gb\" for kind mig")),
        (_, Some(_)) => return Err(Error::invalid_argument("gpu.profile is only for kind mig")),
        (_, None) => String::new(),
    };
    if !(0..=MAX_GPUS).contains(&g.count) {
        return Err(Error::invalid_argument(format!("gpu.count must be between 0 and {MAX_GPUS}")));
    }
    if req.vcpu < 0 || req.memory_mib < 0 || req.disk_gib < 0 {
        return Err(Error::invalid_argument("vcpu, memoryMib and diskGib must not be negative"));
    }
    if g.count == 0 && req.vcpu == 0 && req.memory_mib == 0 && req.disk_gib == 0 {
        return Err(Error::invalid_argument("a reservation must ask for something: gpu.count, vcpu, memoryMib or diskGib"));
    }
    if let Some((k, _)) = req.node_selector.iter().find(|(_, v)| !v.is_string()) {
        return Err(Error::invalid_argument(format!("nodeSelector.{k} must be a string")));
    }
    if req.tolerations.iter().any(|t| t.key.is_empty()) {
        return Err(Error::invalid_argument("every toleration needs a key"));
    }
    Ok(Demand {
        pool_id: req.pool_id.clone(),
        kind: g.kind.clone(),
        model: g.model.clone(),
        profile,
        count: g.count,
        vcpu: req.vcpu,
        memory_mib: req.memory_mib,
        disk_gib: req.disk_gib,
        node_selector: serde_json::Value::Object(req.node_selector.clone()),
        tolerations: serde_json::to_value(&req.tolerations).expect("tolerations serialize"),
    })
}

/// Computes the booked range from the request, in the database's time: a past or absent start is
/// now. Returns the `tstzrange` literal.
async fn range(tx: &impl GenericClient, req: &CreateReservation) -> Result<String, DbError> {
    if let Some(s) = &req.starts_at {
        check_rfc3339("startsAt", s)?;
    }
    let (ends_at, duration_s) = match (&req.ends_at, req.duration_s) {
        (Some(e), None) => {
            check_rfc3339("endsAt", e)?;
            (Some(e.clone()), None)
        }
        (None, Some(d)) if d > 0 && d <= MAX_DURATION.as_secs() as i64 => (None, Some(d as f64)),
        (None, Some(_)) => return Err(Error::invalid_argument(format!("durationS must be between 1 and {}", MAX_DURATION.as_secs())).into()),
        _ => return Err(Error::invalid_argument("give exactly one of endsAt and durationS").into()),
    };
    let row = tx
        .query_one(
            "WITH s AS (SELECT GREATEST(coalesce($1::text::timestamptz, compute_now()), compute_now()) AS start),
                  e AS (SELECT coalesce($2::text::timestamptz, s.start + make_interval(secs => $3)) AS stop FROM s)
             SELECT s.start < e.stop, e.stop - s.start <= make_interval(secs => $4),
                    s.start <= compute_now() + make_interval(secs => $4),
                    tstzrange(s.start, GREATEST(e.stop, s.start), '[)')::text
               FROM s, e",
            &[&req.starts_at, &ends_at, &duration_s, &(MAX_DURATION.as_secs() as f64)],
        )
        .await?;
    if !row.get::<_, bool>(0) {
        return Err(Error::invalid_argument("endsAt must be after startsAt and in the future").into());
    }
    if !row.get::<_, bool>(1) || !row.get::<_, bool>(2) {
        return Err(Error::invalid_argument("a reservation may last at most 366 days and start within 366 days").into());
    }
    Ok(row.get(3))
}

/// Checks that the pool exists and that some node of it has enough atoms of the class at all.
async fn check_pool_can_fit(tx: &impl GenericClient, d: &Demand) -> Result<(), DbError> {
    // Lock order: pools after quota_usage. FOR SHARE keeps the pool from going away under us.
    if tx.query_opt("SELECT 1 FROM pools WHERE id = $1 FOR SHARE", &[&d.pool_id]).await?.is_none() {
        return Err(Error::not_found("pool", &d.pool_id).into());
    }
    if d.count == 0 {
        return Ok(());
    }
    let row = tx
        .query_one(
            "SELECT max(total) FROM node_atom_counts
              WHERE pool_id = $1 AND kind = $2 AND model = $3 AND profile = $4 AND total > 0",
            &[&d.pool_id, &d.kind, &d.model, &d.profile],
        )
        .await?;
    let most: Option<i32> = row.get(0);
    let class = if d.profile.is_empty() { format!("{} {}", d.kind, d.model) } else { format!("{} {} {}", d.kind, d.model, d.profile) };
    match most {
        None => Err(Error::invalid_argument(format!("pool {} has no {class} atoms; check gpu.model, gpu.kind and gpu.profile", d.pool_id)).into()),
        Some(n) if n < d.count => Err(Error::failed_precondition(format!(
            "no node in pool {} has {} {class} atoms (the most on one node is {n}); ask for fewer",
            d.pool_id, d.count
        ))
        .into()),
        Some(_) => Ok(()),
    }
}

async fn emit(tx: &impl GenericClient, v: &ReservationView, tenant_id: &str, event_type: &str) -> Result<(), DbError> {
    outbox::emit(
        tx,
        NewEvent {
            event_type,
            tenant_id: Some(tenant_id),
            subject: &v.id,
            data: serde_json::json!({"state": v.state, "nodeId": v.node_id, "atoms": v.atoms, "version": v.version}),
        },
    )
    .await?;
    Ok(())
}

/// `reservations.create`: charges quota (final if it does not fit), then places or leaves the
/// reservation pending with an `Unschedulable` condition, retried every 30 s.
pub async fn create(client: &mut Client, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
    let d = demand(req)?;
    let tx = client.transaction().await.map_err(DbError::from)?;
    let request = serde_json::to_value(req).expect("request serializes");
    let scope = req.idempotency_key.as_deref().map(|key| IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key });
    if let Some(scope) = scope {
        if let Claim::Replay(v) = idempotency::claim(&tx, scope, "reservations.create", &request).await? {
            tx.commit().await.map_err(DbError::from)?;
            return serde_json::from_value(v).map_err(|e| Error::internal(e.to_string()));
        }
    }
    let during = range(&tx, req).await?;
    // Lock order: quota_usage first.
    let charge = Charge::of(&d.kind, d.count as i64, d.vcpu as i64, d.memory_mib, d.disk_gib);
    quota::charge(&tx, caller.tenant_id, &charge).await?;
    check_pool_can_fit(&tx, &d).await?;
    let id = ReservationId::generate().to_string();
    let placement = placer::place(&tx, &d, &id, &during).await?;
    let (state, node_id, unschedulable) = match &placement {
        Placement::Placed { node_id, .. } => ("placed", Some(node_id.clone()), None),
        Placement::Unschedulable { reason, message } => {
            ("pending", None, Some(serde_json::json!({"reason": reason, "message": message})))
        }
    };
    let profile = if d.profile.is_empty() { None } else { Some(d.profile.clone()) };
    tx.execute(
        "INSERT INTO reservations (id, tenant_id, pool_id, state, gpu_kind, gpu_model, mig_profile, gpu_count, vcpu,
                                   memory_mib, disk_gib, during, node_selector, tolerations, node_id, unschedulable,
                                   next_attempt_at, created_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::text::tstzrange, $13, $14, $15,
                 $16::jsonb || jsonb_build_object('since', compute_now()),
                 CASE WHEN $4 = 'pending' THEN compute_now() + make_interval(secs => $17) END, $18)",
        &[
            &id, &caller.tenant_id, &d.pool_id, &state, &d.kind, &d.model, &profile, &d.count, &d.vcpu, &d.memory_mib,
            &d.disk_gib, &during, &d.node_selector, &d.tolerations, &node_id, &unschedulable,
            &PENDING_RETRY.as_secs_f64(), &caller.identity_id,
        ],
    )
    .await
    .map_err(DbError::from)?;
    let event = if state == "placed" { "reservation.placed" } else { "reservation.pending" };
    let v = after_change(&tx, caller.tenant_id, &id, node_id.as_deref(), event, None).await?;
    if let Some(scope) = scope {
        idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("view serializes")).await?;
    }
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(v)
}

/// The shared tail of every change: for a reservation that `ended`, its scalars and idle atoms
/// given back; then the outbox event, the node's desired state and a wake-up of the reservation's
/// own reconciler key (which arms its timers). Callers poke after commit. It comes last because the
/// node's rows it locks (counters, the node's desired-state key) are the placer's hottest, held to
/// commit. The last three writes go out pipelined, in one round trip: they need nothing from each
/// other, and only one of them (the node's key) is a row other transactions lock, so the order
/// they go out in cannot matter.
async fn after_change(
    tx: &Transaction<'_>,
    tenant_id: &str,
    id: &str,
    node_id: Option<&str>,
    event_type: &str,
    ended: Option<&Locked>,
) -> Result<ReservationView, DbError> {
    let v = view(tx, tenant_id, id).await?;
    if let Some(l) = ended {
        give_back_scalars(tx, id, l).await?;
    }
    tokio::try_join!(
        emit(tx, &v, tenant_id, event_type),
        async {
            match node_id {
                Some(node) => desired::invalidate(tx, node).await,
                None => Ok(()),
            }
        },
        work_queue::enqueue(tx, &RESERVATIONS_KIND, id),
    )?;
    Ok(v)
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
    if let Some(s) = state {
        if ReservationState::parse(s).is_none() {
            return Err(Error::invalid_argument("state must be pending, placed, active, released, expired or failed"));
        }
    }
    let rows = db
        .query(
            &format!(
                "{} ORDER BY r.id LIMIT $4",
                view_sql("r.tenant_id = $1 AND ($2::text IS NULL OR r.state = $2) AND r.id > coalesce($3, '')")
            ),
            &[&caller.tenant_id, &state, &cursor, &(limit + 1)],
        )
        .await
        .map_err(DbError::from)?;
    let mut items: Vec<ReservationView> = rows.iter().map(to_view).collect();
    let next_cursor = if items.len() as i64 > limit {
        items.truncate(limit as usize);
        items.last().map(|v| v.id.clone())
    } else {
        None
    };
    Ok(ReservationPage { items, next_cursor })
}

struct Locked {
    state: ReservationState,
    version: i64,
    node_id: Option<String>,
    charge: Charge,
    /// vCPU, memory and disk, given back to the node when it ends.
    scalars: (i32, i64, i64),
}

/// Locks the reservation row first (before quota and the rest of the lock order).
async fn lock(tx: &impl GenericClient, tenant_id: &str, id: &str) -> Result<Locked, DbError> {
    let r = tx
        .query_opt(
            "SELECT state, version, node_id, gpu_kind, gpu_count, vcpu, memory_mib, disk_gib
               FROM reservations WHERE id = $1 AND tenant_id = $2 FOR UPDATE",
            &[&id, &tenant_id],
        )
        .await?
        .ok_or_else(|| Error::not_found("reservation", id))?;
    let kind: String = r.get(3);
    Ok(Locked {
        state: ReservationState::parse(r.get(0)).ok_or_else(|| Error::internal("unknown reservation state"))?,
        version: r.get(1),
        node_id: r.get(2),
        charge: Charge::of(&kind, r.get::<_, i32>(4) as i64, r.get::<_, i32>(5) as i64, r.get(6), r.get(7)),
        scalars: (r.get(5), r.get(6), r.get(7)),
    })
}

async fn set_state(tx: &impl GenericClient, id: &str, l: &Locked, to: ReservationState) -> Result<(), DbError> {
    RESERVATION_STATE_TABLE.check(l.state, to)?;
    let n = tx
        .execute(
            "UPDATE reservations SET state = $3, version = version + 1, updated_at = compute_now(),
                    unschedulable = CASE WHEN $3 = 'pending' THEN unschedulable END,
                    next_attempt_at = CASE WHEN $3 = 'pending' THEN next_attempt_at END
              WHERE id = $1 AND version = $2",
            &[&id, &l.version, &to.as_str()],
        )
        .await?;
    if n == 0 {
        return Err(Error::conflict(format!("reservation {id} changed concurrently; retry")).into());
    }
    Ok(())
}

/// Gives back what a reservation holds from now on, first part: quota first, then the future
/// part of its bookings (deleted) and the current one (cut at now), in one statement. Its scalars
/// and idle atoms go back in [`after_change`], last, as they lock the node's hottest rows.
async fn give_back_quota_and_bookings(tx: &impl GenericClient, id: &str, tenant_id: &str, l: &Locked) -> Result<(), DbError> {
    // Quota first, as every release: the lock order's first table.
    quota::refund(tx, tenant_id, &l.charge).await?;
    // The two touch disjoint rows: those starting from now on, and those started before.
    tx.execute(
        "WITH future AS (DELETE FROM device_bookings WHERE allocation_id = $1 AND lower(during) >= compute_now())
         UPDATE device_bookings SET during = tstzrange(lower(during), compute_now(), '[)')
          WHERE allocation_id = $1 AND during @> compute_now() AND lower(during) < compute_now()",
        &[&id],
    )
    .await?;
    Ok(())
}

/// Gives back what a reservation holds from now on, last part: the scalars it took on its node and
/// its atoms that now have nothing booked from now on (idle again). Lock order: node_resources,
/// then node_atom_counts.
async fn give_back_scalars(tx: &impl GenericClient, id: &str, l: &Locked) -> Result<(), DbError> {
    let (Some(node), true) = (&l.node_id, matches!(l.state, ReservationState::Placed | ReservationState::Active)) else {
        return Ok(());
    };
    let (vcpu, memory_mib, disk_gib) = l.scalars;
    // One after the other, never pipelined: pipelined statements may go out in either order, and
    // these two rows are locked by every placement and release on the node, in this order.
    tx.execute(
        "UPDATE node_resources SET vcpu_allocated = vcpu_allocated - $2, memory_mib_allocated = memory_mib_allocated - $3,
                disk_gib_allocated = disk_gib_allocated - $4
          WHERE node_id = $1",
        &[node, &vcpu, &memory_mib, &disk_gib],
    )
    .await?;
    tx.execute(
        "UPDATE node_atom_counts c SET idle = LEAST(c.total, c.idle + (
            SELECT count(DISTINCT b.device_id) FROM device_bookings b
             WHERE b.allocation_id = $2
               AND NOT EXISTS (SELECT 1 FROM device_bookings o WHERE o.device_id = b.device_id AND upper(o.during) > compute_now())))
           FROM reservations r
          WHERE r.id = $2 AND c.node_id = $1 AND c.kind = r.gpu_kind AND c.model = r.gpu_model
            AND c.profile = coalesce(r.mig_profile, '')",
        &[node, &id],
    )
    .await?;
    Ok(())
}

/// `reservations.release`: ends the reservation now and returns its quota, devices and scalars.
/// Releasing a finished reservation returns it unchanged.
pub async fn release(client: &mut Client, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
    let tx = client.transaction().await.map_err(DbError::from)?;
    let l = lock(&tx, caller.tenant_id, id).await?;
    if RESERVATION_STATE_TABLE.is_terminal(l.state) {
        let v = view(&tx, caller.tenant_id, id).await?;
        tx.commit().await.map_err(DbError::from)?;
        return Ok(v);
    }
    give_back_quota_and_bookings(&tx, id, caller.tenant_id, &l).await?;
    set_state(&tx, id, &l, ReservationState::Released).await?;
    let v = after_change(&tx, caller.tenant_id, id, l.node_id.as_deref(), "reservation.released", Some(&l)).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(v)
}

/// `reservations.extend`: moves the end later. The added range is booked on the same atoms with
/// `ON CONFLICT DO NOTHING`; if another reservation holds any of them then, nothing changes and the
/// answer is `CONFLICT`.
pub async fn extend(
    client: &mut Client,
    caller: Caller<'_>,
    id: &str,
    ends_at: &str,
    idempotency_key: Option<&str>,
) -> Result<ReservationView, Error> {
    check_rfc3339("endsAt", ends_at)?;
    let mut tx = client.transaction().await.map_err(DbError::from)?;
    let request = serde_json::json!({"reservationId": id, "endsAt": ends_at});
    let scope = idempotency_key.map(|key| IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key });
    if let Some(scope) = scope {
        if let Claim::Replay(v) = idempotency::claim(&tx, scope, "reservations.extend", &request).await? {
            tx.commit().await.map_err(DbError::from)?;
            return serde_json::from_value(v).map_err(|e| Error::internal(e.to_string()));
        }
    }
    let l = lock(&tx, caller.tenant_id, id).await?;
    if RESERVATION_STATE_TABLE.is_terminal(l.state) {
        return Err(Error::failed_precondition(format!("reservation {id} is {} and cannot be extended", l.state.as_str())));
    }
    let row = tx
        .query_one(
            "SELECT $2::text::timestamptz > upper(during), $2::text::timestamptz - lower(during) <= make_interval(secs => $3),
                    CASE WHEN $2::text::timestamptz > upper(during)
                         THEN tstzrange(upper(during), $2::text::timestamptz, '[)')::text END
               FROM reservations WHERE id = $1",
            &[&id, &ends_at, &(MAX_DURATION.as_secs() as f64)],
        )
        .await
        .map_err(DbError::from)?;
    if !row.get::<_, bool>(0) {
        return Err(Error::invalid_argument("endsAt must be later than the reservation's current end"));
    }
    if !row.get::<_, bool>(1) {
        return Err(Error::invalid_argument("a reservation may last at most 366 days"));
    }
    let added: String = row.get::<_, Option<String>>(2).expect("checked: endsAt is later");
    let sp = tx.savepoint("extend").await.map_err(DbError::from)?;
    let atoms: Vec<String> = sp
        .query("SELECT DISTINCT device_id FROM device_bookings WHERE allocation_id = $1", &[&id])
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
            &[&id, &l.version, &ends_at],
        )
        .await
        .map_err(DbError::from)?;
    if n == 0 {
        return Err(Error::conflict(format!("reservation {id} changed concurrently; retry")));
    }
    let v = after_change(&tx, caller.tenant_id, id, l.node_id.as_deref(), "reservation.extended", None).await?;
    if let Some(scope) = scope {
        idempotency::complete(&tx, scope, &serde_json::to_value(&v).expect("view serializes")).await?;
    }
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

/// Moves one reservation through time, in the caller's (fenced) transaction: a placed one whose
/// start has come becomes active; one whose end has passed expires and gives back what it holds; a
/// pending one due for a retry is placed again.
pub async fn step(tx: &mut Transaction<'_>, id: &str) -> Result<Step, DbError> {
    let row = tx
        .query_opt(
            "SELECT tenant_id, state, upper(during) <= compute_now(), lower(during) <= compute_now(),
                    coalesce(next_attempt_at <= compute_now(), false), during::text,
                    pool_id, gpu_kind, gpu_model, coalesce(mig_profile, ''), gpu_count, vcpu, memory_mib, disk_gib,
                    node_selector, tolerations, version, node_id
               FROM reservations WHERE id = $1 FOR UPDATE",
            &[&id],
        )
        .await?;
    let Some(r) = row else { return Ok(Step::Nothing) };
    let tenant_id: String = r.get(0);
    let kind: String = r.get(7);
    let l = Locked {
        state: ReservationState::parse(r.get(1)).ok_or_else(|| Error::internal("unknown reservation state"))?,
        version: r.get(16),
        node_id: r.get(17),
        charge: Charge::of(&kind, r.get::<_, i32>(10) as i64, r.get::<_, i32>(11) as i64, r.get(12), r.get(13)),
        scalars: (r.get(11), r.get(12), r.get(13)),
    };
    let (ended, started, retry_due): (bool, bool, bool) = (r.get(2), r.get(3), r.get(4));
    match l.state {
        ReservationState::Placed | ReservationState::Active | ReservationState::Pending if ended => {
            give_back_quota_and_bookings(&*tx, id, &tenant_id, &l).await?;
            set_state(&*tx, id, &l, ReservationState::Expired).await?;
            after_change(tx, &tenant_id, id, l.node_id.as_deref(), "reservation.expired", Some(&l)).await?;
            Ok(Step::Expired)
        }
        ReservationState::Placed if started => {
            set_state(&*tx, id, &l, ReservationState::Active).await?;
            after_change(tx, &tenant_id, id, l.node_id.as_deref(), "reservation.active", None).await?;
            Ok(Step::Activated)
        }
        ReservationState::Pending if retry_due => {
            let d = Demand {
                pool_id: r.get(6),
                kind: r.get(7),
                model: r.get(8),
                profile: r.get(9),
                count: r.get(10),
                vcpu: r.get(11),
                memory_mib: r.get(12),
                disk_gib: r.get(13),
                node_selector: r.get(14),
                tolerations: r.get(15),
            };
            // A pending reservation never booked from the past: its range starts now at the earliest.
            let during: String = tx
                .query_one(
                    "SELECT tstzrange(GREATEST(lower(during), compute_now()), upper(during), '[)')::text FROM reservations WHERE id = $1",
                    &[&id],
                )
                .await?
                .get(0);
            match placer::place(tx, &d, id, &during).await? {
                Placement::Placed { node_id, .. } => {
                    RESERVATION_STATE_TABLE.check(l.state, ReservationState::Placed)?;
                    tx.execute(
                        "UPDATE reservations SET state = 'placed', node_id = $3, during = $4::text::tstzrange,
                                unschedulable = NULL, next_attempt_at = NULL, version = version + 1, updated_at = compute_now()
                          WHERE id = $1 AND version = $2",
                        &[&id, &l.version, &node_id, &during],
                    )
                    .await?;
                    after_change(tx, &tenant_id, id, Some(&node_id), "reservation.placed", None).await?;
                    Ok(Step::Placed)
                }
                Placement::Unschedulable { reason, message } => {
                    tx.execute(
                        "UPDATE reservations SET unschedulable = jsonb_build_object('reason', $2::text, 'message', $3::text,
                                  'since', unschedulable->'since'),
                                next_attempt_at = compute_now() + make_interval(secs => $4)
                          WHERE id = $1",
                        &[&id, &reason, &message, &PENDING_RETRY.as_secs_f64()],
                    )
                    .await?;
                    Ok(Step::StillPending)
                }
            }
        }
        _ => Ok(Step::Nothing),
    }
}
