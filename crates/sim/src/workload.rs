//! The seeded workload: `--clients` clients, each with its own connection and seeded operations
//! drawn from a weighted table ([`OPS`]), one function per kind: tenants reserve, extend and
//! release, and make instances; operators cordon, drain, taint, quarantine, change modes, start
//! maintenance and run commands. Each is made as the API request it stands for, so the checks can
//! hold the audit log to it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use better_compute_audit::Actor;
use better_compute_capacity::batch::BatchSettings;
use better_compute_capacity::reservations::{self, CreateReservation};
use better_compute_capacity::service::Reservations;
use better_compute_capacity::{mode, Caller};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_core::seeded::Rng;
use better_compute_core::{Error, ErrorCode};
use better_compute_nodes::actions;
use better_compute_nodes::commands::{self, NewCommand};
use better_compute_nodes::drain;
use better_compute_workflows as workflow;
use better_compute_testing::{atoms, reservation};
use better_compute_vps::instances::{self, Action, CreateInstance};

use crate::args::Broken;
use crate::Sim;

pub(crate) const TENANTS: [&str; 3] = ["ten_sim_a", "ten_sim_b", "ten_sim_c"];

/// One workload operation's context: the client's connection and reservations, the reservations
/// service, a tag unique to the operation (its client and number, for idempotency keys and reboot
/// reasons), the fleet and the node (and one of its GPUs) the operation acts on.
pub(crate) struct Op<'a> {
    c: &'a mut tokio_postgres::Client,
    reservations: &'a Reservations,
    tag: String,
    nodes: &'a [String],
    n: usize,
    gpu: String,
    /// The client's reservations that it has not released, with their tenant (an index of
    /// [`TENANTS`]).
    live: &'a mut Vec<(usize, String)>,
    /// Set by the operation: the API method it stands for, and whether each commit of it writes
    /// exactly one audit entry (else at most one: an instance action that changes nothing writes
    /// none).
    asked: Option<(&'static str, bool)>,
}

/// The kinds of workload operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum OpKind {
    Create,
    Extend,
    Release,
    Cordon,
    Drain,
    Taint,
    Quarantine,
    SetMode,
    Maintenance,
    Instance,
    Command,
}

/// Each kind's share of 100 rolls, in roll order. A kind that does not apply (it needs one of the
/// client's reservations and there is none, or maintenance in three of its four rolls) runs a
/// command instead.
const OPS: [(OpKind, u64); 11] = [
    (OpKind::Create, 40),
    (OpKind::Extend, 8),
    (OpKind::Release, 15),
    (OpKind::Cordon, 3),
    (OpKind::Drain, 3),
    (OpKind::Taint, 5),
    (OpKind::Quarantine, 5),
    (OpKind::SetMode, 4),
    (OpKind::Maintenance, 1),
    (OpKind::Instance, 6),
    (OpKind::Command, 10),
];

impl OpKind {
    /// The next operation's kind, for a client that has reservations (`has_live`) or not.
    fn pick(rng: &mut Rng, has_live: bool) -> OpKind {
        let mut roll = rng.below(100);
        for (kind, share) in OPS {
            if roll < share {
                let applies = match kind {
                    OpKind::Extend | OpKind::Release | OpKind::Instance => has_live,
                    OpKind::Maintenance => rng.below(4) == 0,
                    _ => true,
                };
                return if applies { kind } else { OpKind::Command };
            }
            roll -= share;
        }
        OpKind::Command
    }
}

/// One workload operation as the API request it stands for, and how it ended, until the next
/// check compares it with the audit log.
pub(crate) struct AskedOp {
    pub(crate) request_id: String,
    pub(crate) action: &'static str,
    pub(crate) exact: bool,
    pub(crate) ended: OpEnd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpEnd {
    Committed,
    Refused,
    /// The database went away mid-request: it may or may not have committed.
    InDoubt,
}

/// The most operations held for the next check; beyond, the oldest go unchecked.
pub(crate) const MAX_ASKED_OPS: usize = 100_000;

/// How often a client asks again for a create whose outcome the database's absence left in doubt,
/// and how long it waits between (real time: the database restarting).
pub(crate) const IN_DOUBT_RETRIES: u32 = 40;
pub(crate) const IN_DOUBT_RETRY_AFTER: Duration = Duration::from_millis(250);

impl Sim {
    /// The seeded workload: tenants reserve, extend and release; operators cordon, drain,
    /// undrain, taint, quarantine and change modes; commands of every kind the API runs. `--clients` clients run
    /// it concurrently, their reservations through one reservations service (batching creates and
    /// releases), as the API's are.
    pub(crate) async fn workload(self: Arc<Self>, nodes: Vec<String>, gpus: Vec<Vec<String>>, stop: Arc<AtomicBool>) {
        let clients = self.args.clients.max(1);
        let reservations = match better_compute_db::pool::connect_pool(&self.db_conn, 4 + clients as usize) {
            Ok(pool) => Arc::new(Reservations::start(pool, BatchSettings::default())),
            Err(e) => {
                eprintln!("  the workload could not start its reservations service: {e}");
                return;
            }
        };
        let tasks: Vec<_> = (0..clients)
            .map(|k| tokio::spawn(self.clone().client(k, reservations.clone(), nodes.clone(), gpus.clone(), stop.clone())))
            .collect();
        for c in tasks {
            let _ = c.await;
        }
        let batched = reservations.placer().map(|p| p.counters().done.load(Ordering::SeqCst)).unwrap_or(0);
        self.tally.batched.store(batched, Ordering::SeqCst);
    }

    /// One workload client: its own connection, its own seeded operations, at its share of
    /// `--ops-per-s`.
    pub(crate) async fn client(
        self: Arc<Self>,
        k: u64,
        reservations: Arc<Reservations>,
        nodes: Vec<String>,
        gpus: Vec<Vec<String>>,
        stop: Arc<AtomicBool>,
    ) {
        let mut rng = Rng(self.seed.wrapping_mul(1_000_003).wrapping_add(k));
        let mut live: Vec<(usize, String)> = Vec::new();
        let mut client: Option<tokio_postgres::Client> = None;
        let period = Duration::from_micros(1_000_000 * self.args.clients.max(1) / self.args.ops_per_s.max(1));
        let mut i = 0u64;
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(period).await;
            i += 1;
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = better_compute_db::pool::connect(&self.db_conn).await.ok();
            }
            let Some(c) = client.as_mut() else {
                self.tally.unavailable.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            self.tally.ops.fetch_add(1, Ordering::Relaxed);
            let tag = format!("{k}-{i}");
            let n = rng.below(nodes.len() as u64) as usize;
            let gpu = gpus[n][rng.below(gpus[n].len() as u64) as usize].clone();
            let mut op = Op { c, reservations: &reservations, tag: tag.clone(), nodes: &nodes, n, gpu, live: &mut live, asked: None };
            let kind = OpKind::pick(&mut rng, !op.live.is_empty());
            let result = self.one_op(kind, &mut op, &mut rng).await;
            if let Some((action, exact)) = op.asked {
                let ended = match &result {
                    Ok(()) => OpEnd::Committed,
                    Err(e) if matches!(e.code, ErrorCode::Unavailable | ErrorCode::Internal) => OpEnd::InDoubt,
                    Err(_) => OpEnd::Refused,
                };
                let mut q = self.tally.asked.lock().expect("asked");
                if q.len() == MAX_ASKED_OPS {
                    q.pop_front();
                }
                q.push_back(AskedOp { request_id: sim_request_id(&tag), action, exact, ended });
            }
            match result {
                Ok(()) => {}
                Err(e) if e.code == ErrorCode::Unavailable => {
                    // The database went away mid-request (a fault): the outcome is in doubt, and the
                    // checks afterwards hold whichever way it went.
                    self.tally.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.code == ErrorCode::Internal => {
                    self.tally.internal.fetch_add(1, Ordering::Relaxed);
                    self.tally.first_internal.lock().expect("tally").get_or_insert_with(|| e.message.clone());
                }
                Err(_) => {
                    self.tally.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Makes one operation of `kind`.
    async fn one_op(&self, kind: OpKind, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        match kind {
            OpKind::Create => self.create(op, rng).await,
            OpKind::Extend => extend(op, rng).await,
            OpKind::Release => release(op, rng).await,
            OpKind::Cordon => self.cordon(op, rng).await,
            OpKind::Drain => drain_or_undrain(op, rng).await,
            OpKind::Taint => taint(op, rng).await,
            OpKind::Quarantine => quarantine(op, rng).await,
            OpKind::SetMode => set_mode(op, rng).await,
            OpKind::Maintenance => self.maintenance(op, rng).await,
            OpKind::Instance => self.instance(op, rng).await,
            OpKind::Command => self.command(op, rng).await,
        }
    }

    /// A tenant's reservation, through the reservations service (batched with the other clients').
    async fn create(&self, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        let t = rng.below(TENANTS.len() as u64) as usize;
        let (kind, profile, count) = match rng.below(10) {
            0..=6 => ("gpu", None, 1 + rng.below(3) as i32),
            7 | 8 => ("mig", Some("3g.40gb".to_owned()), 1),
            _ => ("slot", None, 1 + rng.below(2) as i32),
        };
        let (vcpu, memory_mib, disk_gib) = (1 + rng.below(16) as i32, 1024 * (1 + rng.below(64) as i64), rng.below(200) as i64);
        let req = CreateReservation {
            idempotency_key: Some(format!("sim-{}-{}", self.seed, op.tag)),
            ..reservation(&self.pool_id, atoms(kind, profile, count), vcpu, memory_mib, disk_gib, 60 + rng.below(1800) as i64)
        };
        // As an API request: its audit entry commits with it (checked in `check`).
        op.asked = Some(("reservations.create", true));
        // A create the database went away under is in doubt: the client asks again with the same
        // key (and request), and the key answers what the first one did, or it runs.
        let mut tries = 0;
        let r = loop {
            let actor = sim_request(TENANTS[t], "reservations.create", &op.tag);
            match op.reservations.create(&actor, Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" }, &req).await {
                Err(e) if e.code == ErrorCode::Unavailable && tries < IN_DOUBT_RETRIES => {
                    tries += 1;
                    self.tally.asked_again.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(IN_DOUBT_RETRY_AFTER).await;
                }
                r => break r?,
            }
        };
        if r.state == "placed" || r.state == "active" {
            self.tally.placed.fetch_add(1, Ordering::Relaxed);
            self.tally.interval_placed.fetch_add(1, Ordering::Relaxed);
        }
        op.live.push((t, r.id));
        Ok(())
    }

    /// An operator's cordon or uncordon (`--broken unaudited-cordons`: without its audit entry).
    async fn cordon(&self, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        let on = rng.below(2) == 0;
        let action = *op.asked.insert((if on { "nodes.cordon" } else { "nodes.uncordon" }, true));
        let node = &op.nodes[op.n];
        let change = async |tx: &tokio_postgres::Transaction<'_>| Ok(if on { actions::cordon(tx, node).await } else { actions::uncordon(tx, node).await }.map(|_| ())?);
        if self.args.broken == Some(Broken::UnauditedCordons) {
            let tx = op.c.transaction().await.map_err(db)?;
            change(&tx).await?;
            tx.commit().await.map_err(db)
        } else {
            operator_request(op.c, &op.tag, action.0, change).await
        }
    }

    /// An operator's maintenance of a node (drain evicting within seconds, a signed reboot, a
    /// check, uncordon), unless a workflow or a drain is open on it.
    async fn maintenance(&self, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        let params = serde_json::json!({"reason": format!("sim {}", op.tag), "drainDeadlineS": 5 + rng.below(20)});
        op.asked = Some(("workflows.start", true));
        let node = &op.nodes[op.n];
        let started = operator_request(op.c, &op.tag, "workflows.start", async |tx| {
            let busy = workflow::open_with(tx, "node.maintenance", node, &serde_json::json!({})).await?.is_some()
                || drain::open_drain(tx, node).await?.is_some();
            if busy {
                // Nothing to start: refused, as the API refuses a second open workflow.
                return Err(Error::failed_precondition("a workflow or a drain is open on the node"));
            }
            let target = workflow::Target { node_id: Some(node.clone()), ..Default::default() };
            let w = workflow::NewWorkflow { definition: "node.maintenance", target: &target, params: &params, requested_by: "sim/op" };
            workflow::start(tx, &self.registry, &w).await?;
            Ok(())
        })
        .await;
        match started {
            Ok(()) => {
                self.tally.workflows.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            // Not asked after all.
            Err(e) if e.code == ErrorCode::FailedPrecondition => {
                op.asked = None;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// An instance on one of the client's reservations: created, or stopped, started, rebooted or
    /// deleted.
    async fn instance(&self, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        let (t, res) = op.live[rng.below(op.live.len() as u64) as usize].clone();
        let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" };
        let existing: Option<String> = {
            let tx = op.c.transaction().await.map_err(db)?;
            let found = tx.query_opt("SELECT id FROM instances WHERE allocation_id = $1 AND state <> 'deleted'", &[&res]).await.map_err(db)?;
            tx.commit().await.map_err(db)?;
            found.map(|r| r.get(0))
        };
        match (existing, rng.below(4)) {
            (None, _) => {
                let req = CreateInstance {
                    tenant_id: None,
                    reservation_id: Some(res),
                    pool_id: None,
                    gpu: None,
                    vcpu: 0,
                    memory_mib: 0,
                    disk_gib: 0,
                    duration_s: None,
                    image: "sim".into(),
                    ssh_public_keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 sim@sim".into()],
                    user_data: String::new(),
                    idempotency_key: format!("sim-{}-{}", self.seed, op.tag),
                };
                op.asked = Some(("instances.create", true));
                instances::create(op.c, &sim_request(TENANTS[t], "instances.create", &op.tag), caller, &req).await?;
                self.tally.instances.fetch_add(1, Ordering::Relaxed);
            }
            (Some(id), k) => {
                let (action, method) = [
                    (Action::Stop, "instances.stop"),
                    (Action::Start, "instances.start"),
                    (Action::Reboot, "instances.reboot"),
                    (Action::Delete, "instances.delete"),
                ][k as usize];
                // One that changes nothing (a stop of a stopped instance) writes no entry.
                op.asked = Some((method, false));
                instances::act(op.c, &sim_request(TENANTS[t], method, &op.tag), caller, &id, action).await?;
            }
        }
        Ok(())
    }

    /// A command of a kind the API runs (a signed reboot among them), and the gateway poked.
    async fn command(&self, op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
        let (kind, payload) = match rng.below(8) {
            0 | 1 => ("diag.nvml", serde_json::json!({"level": 1})),
            2 | 3 => ("inventory.refresh", serde_json::json!({"sections": ["gpus"]})),
            4 | 5 => ("logs.collect", serde_json::json!({"sinceSeconds": 60})),
            _ => ("node.reboot", serde_json::json!({"reason": format!("sim seed {} op {}", self.seed, op.tag), "graceSeconds": 0})),
        };
        let key = format!("sim-{}-{}", self.seed, op.tag);
        op.asked = Some(("commands.run", true));
        let node = &op.nodes[op.n];
        operator_request(op.c, &op.tag, "commands.run", async |tx| {
            let new = NewCommand {
                node_id: node,
                kind,
                payload: &payload,
                idempotency_key: &key,
                not_after: Some(Duration::from_secs(120)),
                min_generation: 0,
                owner: None,
                actor: &Actor::job("sim"),
            };
            commands::enqueue(tx, &self.registry, new).await?;
            Ok(())
        })
        .await?;
        commands::poke_gateway(&*op.c, node).await;
        self.tally.commands.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn db(e: tokio_postgres::Error) -> Error {
    Error::from(better_compute_db::DbError::from(e))
}

/// A tenant extends one of the client's reservations by one to eleven minutes.
async fn extend(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let (t, id) = op.live[rng.below(op.live.len() as u64) as usize].clone();
    let caller = Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" };
    let tx = op.c.transaction().await.map_err(db)?;
    let cur = reservations::get(&tx, caller, &id).await?;
    tx.commit().await.map_err(db)?;
    let end = better_compute_core::time::parse_rfc3339(&cur.ends_at).unwrap_or_else(std::time::SystemTime::now)
        + Duration::from_secs(60 + rng.below(600));
    op.asked = Some(("reservations.extend", true));
    let end = better_compute_core::time::rfc3339(end);
    op.reservations.extend(&sim_request(TENANTS[t], "reservations.extend", &op.tag), caller, &id, &end, None).await?;
    Ok(())
}

/// A tenant releases one of the client's reservations.
async fn release(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let (t, id) = op.live.swap_remove(rng.below(op.live.len() as u64) as usize);
    op.asked = Some(("reservations.release", true));
    let actor = sim_request(TENANTS[t], "reservations.release", &op.tag);
    op.reservations.release(&actor, Caller { tenant_id: TENANTS[t], identity_id: "idn_sim" }, &id).await?;
    Ok(())
}

/// An operator's drain, waiting or evicting within seconds, or the undrain of the workload's own
/// drain; the drain job admits them within the pool's budget.
async fn drain_or_undrain(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let k = rng.below(3);
    let secs = 5.0 + rng.below(30) as f64;
    let action = *op.asked.insert((if k == 0 { "nodes.undrain" } else { "nodes.drain" }, true));
    let node = &op.nodes[op.n];
    operator_request(op.c, &op.tag, action.0, async |tx| {
        if k == 0 {
            // Its own drains: a maintenance workflow's drain is the workflow's to end.
            if drain::open_drain(tx, node).await?.is_some_and(|d| d.requested_by == "sim/op") {
                drain::undrain(tx, node).await?;
            }
            return Ok(());
        }
        let deadline: Option<String> = if k == 1 {
            None
        } else {
            let sql = format!("SELECT {}", better_compute_db::clock::rfc3339_sql("compute_now() + make_interval(secs => $1)"));
            Some(tx.query_one(&sql, &[&secs]).await.map_err(db)?.get(0))
        };
        let mode = if deadline.is_some() { drain::DrainMode::Evict } else { drain::DrainMode::Wait };
        let req = drain::DrainRequest { node_id: node, reason: "sim", mode, deadline: deadline.as_deref(), requested_by: "sim/op" };
        // Another mode while one is open is a refusal (CONFLICT), counted as such.
        drain::request(tx, &req).await?;
        Ok(())
    })
    .await
}

/// An operator's taint or untaint of the node.
async fn taint(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let on = rng.below(2) == 0;
    let action = *op.asked.insert((if on { "nodes.taint" } else { "nodes.untaint" }, true));
    let node = &op.nodes[op.n];
    operator_request(op.c, &op.tag, action.0, async |tx| {
        Ok(if on { actions::taint(tx, node, "maint", "yes").await } else { actions::untaint(tx, node, "maint").await }?)
    })
    .await
}

/// An operator's quarantine of the GPU, or its release.
async fn quarantine(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let on = rng.below(2) == 0;
    let action = *op.asked.insert((if on { "devices.quarantine" } else { "devices.releaseQuarantine" }, true));
    let gpu = &op.gpu;
    operator_request(op.c, &op.tag, action.0, async |tx| {
        Ok(if on { actions::quarantine(tx, gpu, "sim").await } else { actions::release_quarantine(tx, gpu).await }?)
    })
    .await
}

/// An operator's change of the GPU's mode (the capacity module records it when it serves it).
async fn set_mode(op: &mut Op<'_>, rng: &mut Rng) -> Result<(), Error> {
    let m = match rng.below(3) {
        0 => GpuMode::Exclusive,
        1 => GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] },
        _ => GpuMode::TimeSlice { slots: 4 },
    };
    op.asked = Some(("devices.setMode", true));
    mode::change_gpu_mode(op.c, &sim_request(OPERATOR_TENANT, "devices.setMode", &op.tag), &op.gpu, &m).await?;
    Ok(())
}

/// The tenant the workload's operator requests are made in.
pub(crate) const OPERATOR_TENANT: &str = "ten_operator";

/// The request id of the workload's operation `tag`.
pub(crate) fn sim_request_id(tag: &str) -> String {
    format!("req_sim{tag}")
}

/// The API request the workload's operation `tag` stands for: the actor of its change.
pub(crate) fn sim_request(tenant: &str, action: &str, tag: &str) -> Actor {
    Actor::Request(std::sync::Arc::new(better_compute_audit::entry::Request {
        identity_id: "idn_sim".into(),
        token_id: "tok_sim".into(),
        tenant_id: tenant.into(),
        action: action.into(),
        target: String::new(),
        request_id: sim_request_id(tag),
        source: None,
        request_digest: better_compute_audit::entry::digest(tag.as_bytes()),
    }))
}

/// An operator's request `action` that the API serves in one transaction (`Ctx::in_tx`): `f`'s
/// change and its audit entry commit together.
pub(crate) async fn operator_request<T>(
    c: &mut tokio_postgres::Client,
    tag: &str,
    action: &str,
    f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, better_compute_core::Error>,
) -> Result<T, better_compute_core::Error> {
    let db = |e: tokio_postgres::Error| better_compute_core::Error::from(better_compute_db::DbError::from(e));
    let tx = c.transaction().await.map_err(db)?;
    let v = f(&tx).await?;
    sim_request(OPERATOR_TENANT, action, tag).record(&tx, action, "", None).await?;
    tx.commit().await.map_err(db)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds by roll as the workload drew them before its table: the table keeps every seed's
    /// operations.
    fn by_ranges(rng: &mut Rng, has_live: bool) -> OpKind {
        match rng.below(100) {
            0..=39 => OpKind::Create,
            40..=47 if has_live => OpKind::Extend,
            48..=62 if has_live => OpKind::Release,
            63..=65 => OpKind::Cordon,
            66..=68 => OpKind::Drain,
            69..=73 => OpKind::Taint,
            74..=78 => OpKind::Quarantine,
            79..=82 => OpKind::SetMode,
            83 if rng.below(4) == 0 => OpKind::Maintenance,
            84..=89 if has_live => OpKind::Instance,
            _ => OpKind::Command,
        }
    }

    #[test]
    fn the_weighted_table_draws_the_same_operations_and_randomness_as_the_roll_ranges() {
        assert_eq!(OPS.iter().map(|(_, share)| share).sum::<u64>(), 100);
        let mut seen = std::collections::HashSet::new();
        for seed in 0..20_000u64 {
            let has_live = seed % 3 != 0;
            let (mut a, mut b) = (Rng(seed), Rng(seed));
            let kind = OpKind::pick(&mut a, has_live);
            assert_eq!(kind, by_ranges(&mut b, has_live), "seed {seed}");
            // Both consumed the same draws: the operation's own draws that follow match too.
            assert_eq!(a.below(1_000_000), b.below(1_000_000), "seed {seed}");
            seen.insert(kind);
        }
        assert_eq!(seen.len(), OPS.len(), "every kind was drawn: {seen:?}");
    }
}
