//! Instances as the tenant sees them: create (on a reservation, or with a new one in the same
//! transaction), get, list, and the power actions, each a change of desired state that the
//! `vps.instances` job and the host carry out.

use better_compute_audit::Actor;
use better_compute_capacity::reservations::{self, CreateReservation, GpuRequest};
use better_compute_core::id::InstanceId;
use better_compute_core::state::{InstanceState, State, INSTANCE_STATE_TABLE};
use better_compute_core::{Caller, Error};
use better_compute_db::idempotency::{self, Claim, IdempotencyScope};
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use better_compute_runtime::work_queue;
use serde::{Deserialize, Serialize};
use tokio_postgres::{Client, GenericClient, Transaction};

use crate::INSTANCES_KIND;

/// SSH keys an instance takes at most.
pub const MAX_SSH_KEYS: usize = 16;
/// The longest SSH public key line.
pub const MAX_SSH_KEY_BYTES: usize = 8192;
/// The largest cloud-init user data.
pub const MAX_USER_DATA_BYTES: usize = 64 * 1024;

/// `instances.create`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateInstance {
    /// The caller's tenant; when given it must be the token's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Run on this reservation of yours (placed or pending, in a vps-host pool, with no live
    /// instance). Or leave it out and give `poolId`, `gpu`, … to reserve in the same transaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    /// A vps-host pool, for a new reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    /// The GPUs of a new reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRequest>,
    /// vCPUs of a new reservation.
    #[serde(default)]
    pub vcpu: i32,
    /// Memory of a new reservation.
    #[serde(default)]
    pub memory_mib: i64,
    /// Disk of a new reservation.
    #[serde(default)]
    pub disk_gib: i64,
    /// Length of a new reservation in seconds from now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<i64>,
    /// The base image: a name of the host's image cache, like `debian-12`.
    pub image: String,
    /// OpenSSH public keys (`ssh-ed25519 AAAA… comment`), 1 to 16, for the guest's default user.
    pub ssh_public_keys: Vec<String>,
    /// cloud-init user data, up to 64 KiB.
    #[serde(default)]
    pub user_data: String,
    /// Makes a retry return the first result instead of creating twice (scoped to your tenant
    /// and identity).
    pub idempotency_key: String,
}

/// An instance as its tenant sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceView {
    /// `ins_…`.
    pub id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// The reservation whose GPUs, vCPUs, memory and disk it runs on.
    pub reservation_id: String,
    /// The reservation's pool.
    pub pool_id: String,
    /// Its host, once its reservation is placed.
    pub node_id: Option<String>,
    /// requested, provisioning, running, stopping, stopped, deleting, deleted or failed.
    pub state: String,
    /// The base image.
    pub image: String,
    /// How many reboots were asked for.
    pub reboot_count: i32,
    /// Where to SSH to, once running: the address its host reported.
    pub address: Option<String>,
    /// The guest's SSH host key fingerprint, read from its console by the host.
    pub host_key_fingerprint: Option<String>,
    /// Why it failed or is being deleted.
    pub reason: Option<String>,
    /// Bumped by every change.
    pub version: i64,
    /// RFC 3339.
    pub created_at: String,
    /// What it is metered as (`vps.usage`): its reservation's GPUs, vCPUs, memory and disk, as
    /// `2xgpu:H100-80GB,16vcpu,65536mib,100gib`.
    pub flavour: String,
}

const VIEW_COLUMNS: &str = "id, tenant_id, allocation_id, pool_id, node_id, state, image, reboot_count, address, host_key_fingerprint, reason, version,
                            to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), flavour";

fn view_of(r: &tokio_postgres::Row) -> InstanceView {
    InstanceView {
        id: r.get(0),
        tenant_id: r.get(1),
        reservation_id: r.get(2),
        pool_id: r.get(3),
        node_id: r.get(4),
        state: r.get(5),
        image: r.get(6),
        reboot_count: r.get(7),
        address: r.get(8),
        host_key_fingerprint: r.get(9),
        reason: r.get(10),
        version: r.get(11),
        created_at: r.get(12),
        flavour: r.get(13),
    }
}

/// An image name: 1 to 64 lowercase letters, digits, `.`, `_` and `-`, starting with a letter or
/// digit (a folder in each host's image cache).
pub(crate) fn check_image_name(image: &str) -> Result<(), Error> {
    let ok = !image.is_empty()
        && image.len() <= 64
        && image.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && image.as_bytes()[0].is_ascii_alphanumeric();
    if !ok {
        return Err(Error::invalid_argument("image must be an image name like debian-12 (lowercase letters, digits, '.', '_', '-'; at most 64)"));
    }
    Ok(())
}

fn check(req: &CreateInstance) -> Result<(), Error> {
    check_image_name(&req.image)?;
    if req.ssh_public_keys.is_empty() || req.ssh_public_keys.len() > MAX_SSH_KEYS {
        return Err(Error::invalid_argument(format!("sshPublicKeys must hold 1 to {MAX_SSH_KEYS} OpenSSH public keys")));
    }
    for k in &req.ssh_public_keys {
        let kind = k.split(' ').next().unwrap_or("");
        let known = kind.starts_with("ssh-") || kind.starts_with("ecdsa-sha2-") || kind.starts_with("sk-");
        if !known || k.split(' ').nth(1).is_none_or(str::is_empty) || k.len() > MAX_SSH_KEY_BYTES || k.contains(['\n', '\r']) {
            return Err(Error::invalid_argument("each of sshPublicKeys must be one OpenSSH public key line, like `ssh-ed25519 AAAA… you@laptop`"));
        }
    }
    if req.user_data.len() > MAX_USER_DATA_BYTES {
        return Err(Error::invalid_argument(format!("userData is larger than {MAX_USER_DATA_BYTES} bytes")));
    }
    let new_reservation = req.pool_id.is_some() || req.gpu.is_some() || req.duration_s.is_some();
    match (&req.reservation_id, new_reservation) {
        (Some(_), true) => Err(Error::invalid_argument("give reservationId, or poolId, gpu and durationS for a new reservation, not both")),
        (None, false) => Err(Error::invalid_argument("give reservationId, or poolId, gpu and durationS for a new reservation")),
        (None, true) if req.pool_id.is_none() || req.gpu.is_none() || req.duration_s.is_none() => {
            Err(Error::invalid_argument("a new reservation needs poolId, gpu and durationS"))
        }
        _ => Ok(()),
    }
}

/// `instances.create`: idempotent on the key; the reservation (given, or made here) and the
/// instance commit together.
pub async fn create(client: &mut Client, actor: &Actor, caller: Caller<'_>, req: &CreateInstance) -> Result<InstanceView, Error> {
    check(req)?;
    idempotency::validate_key(&req.idempotency_key)?;
    let tx = client.transaction().await.map_err(DbError::from)?;
    let scope = IdempotencyScope { tenant_id: caller.tenant_id, identity_id: caller.identity_id, key: &req.idempotency_key };
    let request = serde_json::to_value(req).map_err(|e| Error::internal(e.to_string()))?;
    if let Claim::Replay(v) = idempotency::claim(&tx, scope, "instances.create", &request).await? {
        tx.commit().await.map_err(DbError::from)?;
        return serde_json::from_value(idempotency::replayed(v)?).map_err(|e| Error::internal(e.to_string()));
    }
    let mut tx = tx;
    let attempt = tx.savepoint("instance").await.map_err(DbError::from)?;
    match insert(&attempt, caller, req).await {
        Ok(v) => {
            attempt.commit().await.map_err(DbError::from)?;
            idempotency::complete(&tx, scope, &serde_json::to_value(&v).map_err(|e| Error::internal(e.to_string()))?).await?;
            actor.record(&tx, "instances.create", &v.id, Some(caller.tenant_id)).await?;
            tx.commit().await.map_err(DbError::from)?;
            work_queue::poke(&*client).await;
            Ok(v)
        }
        // A final refusal is the key's answer too, so a repeat cannot succeed where this failed.
        Err(e) if idempotency::is_final(&e) => {
            attempt.rollback().await.map_err(DbError::from)?;
            idempotency::complete_with_error(&tx, scope, &e).await?;
            tx.commit().await.map_err(DbError::from)?;
            Err(e)
        }
        Err(e) => Err(e),
    }
}

async fn insert(tx: &Transaction<'_>, caller: Caller<'_>, req: &CreateInstance) -> Result<InstanceView, Error> {
    let reservation_id = match &req.reservation_id {
        Some(id) => id.clone(),
        None => {
            let pool = req.pool_id.clone().unwrap_or_default();
            if better_compute_nodes::inventory::pool_kind(tx, &pool).await? != "vps-host" {
                return Err(Error::failed_precondition(format!("pool {pool} is not a vps-host pool: instances run only there")));
            }
            let Some(gpu) = req.gpu.clone() else { return Err(Error::invalid_argument("a new reservation needs gpu")) };
            let r = CreateReservation {
                tenant_id: None,
                pool_id: pool,
                gpu,
                vcpu: req.vcpu,
                memory_mib: req.memory_mib,
                disk_gib: req.disk_gib,
                starts_at: None,
                ends_at: None,
                duration_s: req.duration_s,
                node_selector: Default::default(),
                tolerations: Vec::new(),
                idempotency_key: None,
            };
            reservations::create_in(tx, caller, &r).await?.id
        }
    };
    // Locked so the reservation cannot end before the instance is written: an end then finds it.
    let facts = reservations::facts(tx, std::slice::from_ref(&reservation_id), true).await?;
    let Some(r) = facts.into_iter().find(|r| r.tenant_id == caller.tenant_id) else {
        return Err(Error::not_found("reservation", &reservation_id));
    };
    if !r.is_live() {
        return Err(Error::failed_precondition(format!("reservation {} has ended ({}): an instance needs a live reservation", r.id, r.state.as_str())));
    }
    if better_compute_nodes::inventory::pool_kind(tx, &r.pool_id).await? != "vps-host" {
        return Err(Error::failed_precondition(format!("reservation {} is in pool {}, which is not a vps-host pool: instances run only there", r.id, r.pool_id)));
    }
    let id = InstanceId::generate().to_string();
    let row = tx
        .query_opt(
            &format!(
                "INSERT INTO instances (id, tenant_id, allocation_id, pool_id, node_id, state, image, ssh_public_keys, user_data, created_by, flavour)
                 VALUES ($1, $2, $3, $4, $5, 'requested', $6, $7, $8, $9, $10)
                 ON CONFLICT (allocation_id) WHERE state <> 'deleted' DO NOTHING
                 RETURNING {VIEW_COLUMNS}"
            ),
            &[&id, &r.tenant_id, &r.id, &r.pool_id, &r.node_id, &req.image, &req.ssh_public_keys, &req.user_data, &caller.identity_id, &r.flavour],
        )
        .await
        .map_err(DbError::from)?;
    let Some(row) = row else {
        return Err(Error::conflict(format!("reservation {} already has an instance; delete it first", r.id)));
    };
    let v = view_of(&row);
    event(tx, &v).await?;
    if let Some(node) = &v.node_id {
        work_queue::enqueue(tx, &INSTANCES_KIND, node).await?;
    }
    Ok(v)
}

/// The instance's event for its state (`instance.<state>`).
pub(crate) async fn event(tx: &impl GenericClient, v: &InstanceView) -> Result<(), DbError> {
    let data = serde_json::json!({"state": v.state, "reservationId": v.reservation_id, "nodeId": v.node_id, "reason": v.reason, "version": v.version});
    outbox::emit(tx, NewEvent { event_type: &format!("instance.{}", v.state), tenant_id: Some(&v.tenant_id), subject: &v.id, data }).await?;
    Ok(())
}

/// `instances.get`: only the caller's tenant's instances exist for it.
pub async fn get(db: &impl GenericClient, caller: Caller<'_>, id: &str) -> Result<InstanceView, Error> {
    let row = db.query_opt(&format!("SELECT {VIEW_COLUMNS} FROM instances WHERE id = $1 AND tenant_id = $2"), &[&id, &caller.tenant_id]).await.map_err(DbError::from)?;
    row.as_ref().map(view_of).ok_or_else(|| Error::not_found("instance", id))
}

/// Console bytes one `instances.console` answer carries at most.
pub const CONSOLE_PAGE_BYTES: usize = 64 << 10;

/// `instances.console`: what is kept of the instance's serial console (the last 64 KiB its host
/// sent) from byte `from`, or all of it. An instance with nothing kept (not yet on a host, or
/// deleted) answers an empty tail at `from`.
pub async fn console(db: &impl GenericClient, caller: Caller<'_>, id: &str, from: Option<i64>) -> Result<better_compute_nodes::sessions::consoles::ConsoleTail, Error> {
    if from.is_some_and(|f| f < 0) {
        return Err(Error::invalid_argument("offset must not be negative"));
    }
    let v = get(db, caller, id).await?;
    let kept = match &v.node_id {
        Some(node) => better_compute_nodes::sessions::consoles::read(db, node, id, from, CONSOLE_PAGE_BYTES).await?,
        None => None,
    };
    // An offset this console's stream sent is never past what it has written (with nothing kept,
    // the end is unknown and the tail is empty wherever it is asked).
    if let (Some(f), Some(end)) = (from, kept.as_ref().map(|t| t.next_offset))
        && f > end
    {
        return Err(Error::invalid_argument(format!("offset {f} is past the console's end ({end} bytes written so far)")));
    }
    let at = from.unwrap_or(0);
    Ok(kept.unwrap_or(better_compute_nodes::sessions::consoles::ConsoleTail { offset: at, next_offset: at, text: String::new(), truncated: false }))
}

/// `instances.list`: the caller's tenant's instances after `after` in id order, at most `limit + 1`
/// (for the page's next token); deleted ones only with `include_deleted`.
pub async fn list(db: &impl GenericClient, caller: Caller<'_>, after: &str, limit: i64, include_deleted: bool) -> Result<Vec<InstanceView>, Error> {
    let rows = db
        .query(
            &format!("SELECT {VIEW_COLUMNS} FROM instances WHERE tenant_id = $1 AND id > $2 AND ($3 OR state <> 'deleted') ORDER BY id LIMIT $4"),
            &[&caller.tenant_id, &after, &include_deleted, &(limit + 1)],
        )
        .await
        .map_err(DbError::from)?;
    Ok(rows.iter().map(view_of).collect())
}

/// A tenant's power action on an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stop the VM, keeping its disk.
    Stop,
    /// Start a stopped VM.
    Start,
    /// Restart a running VM once.
    Reboot,
    /// Delete the VM and its disk (the reservation stays).
    Delete,
}

impl Action {
    /// The API method that asks for it.
    pub fn method(self) -> &'static str {
        match self {
            Action::Stop => "instances.stop",
            Action::Start => "instances.start",
            Action::Reboot => "instances.reboot",
            Action::Delete => "instances.delete",
        }
    }
}

/// Carries out `action` on the caller's instance `id`: a guarded change of its desired state, or
/// nothing when it already is as asked (a retry); FAILED_PRECONDITION when the state does not allow it.
pub async fn act(client: &mut Client, actor: &Actor, caller: Caller<'_>, id: &str, action: Action) -> Result<InstanceView, Error> {
    let tx = client.transaction().await.map_err(DbError::from)?;
    let row = tx
        .query_opt(&format!("SELECT {VIEW_COLUMNS} FROM instances WHERE id = $1 AND tenant_id = $2 FOR UPDATE"), &[&id, &caller.tenant_id])
        .await
        .map_err(DbError::from)?;
    let v = row.as_ref().map(view_of).ok_or_else(|| Error::not_found("instance", id))?;
    let from = InstanceState::parse(&v.state).ok_or_else(|| Error::internal(format!("unknown instance state {}", v.state)))?;
    use InstanceState::*;
    let (to, reboot) = match (action, from) {
        (Action::Stop, Stopping | Stopped) | (Action::Start, Provisioning | Running) | (Action::Delete, Deleting | Deleted) => return Ok(v),
        (Action::Stop, Provisioning | Running) => (Stopping, false),
        (Action::Start, Stopped) => (Provisioning, false),
        (Action::Reboot, Running) => (Running, true),
        // Never placed: nothing is on any host, so it is gone at once.
        (Action::Delete, Requested) if v.node_id.is_none() => (Deleted, false),
        (Action::Delete, _) => (Deleting, false),
        (a, s) => {
            return Err(Error::failed_precondition(format!("instance {id} is {}: it cannot {}", s.as_str(), format!("{a:?}").to_lowercase())));
        }
    };
    if to != from {
        INSTANCE_STATE_TABLE.check(from, to)?;
    }
    let reason = (action == Action::Delete).then_some("deleted by its tenant");
    let row = tx
        .query_one(
            &format!(
                "UPDATE instances SET state = $2, reboot_count = reboot_count + $3, reason = coalesce($4, reason), version = version + 1, updated_at = compute_now()
                  WHERE id = $1 RETURNING {VIEW_COLUMNS}"
            ),
            &[&id, &to.as_str(), &i32::from(reboot), &reason],
        )
        .await
        .map_err(DbError::from)?;
    let v = view_of(&row);
    if to != from {
        event(&tx, &v).await?;
        crate::usage::follow(&tx, id, &v.pool_id, from, to).await?;
    }
    if let Some(node) = &v.node_id {
        better_compute_runtime::desired::invalidate(&tx, node).await?;
        work_queue::enqueue(&tx, &INSTANCES_KIND, node).await?;
    }
    actor.record(&tx, action.method(), id, Some(caller.tenant_id)).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(v)
}
