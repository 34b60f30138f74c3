//! GPU health: what daemons report becomes signals, and the `health` job (one key per node) moves
//! each GPU along `GPU_HEALTH_STATE_TABLE` from them.
//!
//! - An XID is classified by the catalogue (`better_compute_core::xid`): informational ones are
//!   recorded; a transient one makes the GPU `suspect` (out of placement) and runs `diag.nvml` on
//!   it; a fatal one makes it `unhealthy` and quarantines it (with every atom of it) at once.
//! - A suspect GPU's first check resets it first when nothing holds it (a reset clears a transient
//!   fault and applies a pending row remap or page retirement; the daemon refuses it under an
//!   allocation anyway).
//! - Counters a daemon reports (`GpuHealth`) become signals when they rise: a row remap or page
//!   retirement waiting for a reset is transient, a failed remap fatal, new uncorrectable ECC
//!   errors transient, and remapped rows, retired pages and NVLink errors informational.
//! - A passed check makes a suspect GPU `recovering`; [`CLEAN_CHECKS`] passed checks in a row,
//!   [`CHECK_INTERVAL_S`] apart, make it `healthy` again. A failed check makes it `unhealthy`.
//!   A check that could not run (the node was away, the command expired) is tried again later and
//!   condemns nothing.
//! - [`REPEATED_TRANSIENTS`] transient errors of one GPU within [`REPEAT_WINDOW_S`] count as fatal.
//! - The circuit breaker: when more than a pool's share (`health_breaker_percent`, default 10%,
//!   at least one GPU) of its GPUs left placement for health within its window (default 10 min),
//!   the next would open the pool's circuit instead: automatic actions stop for the pool, signals
//!   wait, `health.circuitOpen` is raised, and an operator decides (`pools.closeHealthCircuit`). A
//!   bad driver rollout must not take a fleet out of placement.
//! - Reservations keep a GPU that turned unhealthy: nothing here releases anything. Their tenants
//!   are told (capacity's subscriber turns `device.unhealthy` into `reservation.deviceUnhealthy`).
//!
//! Lock order: the pool's row first (its circuit), then the node's (a check takes the node's next
//! command seq), then its GPUs in id order.

use std::time::Duration;

use better_compute_core::state::{GpuHealthState, State, GPU_HEALTH_STATE_TABLE};
use better_compute_core::xid::{self, XidClass};
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_proto::v1::Health;
use better_compute_runtime::outbox::{self, NewEvent};
use better_compute_runtime::work_queue;
use tokio_postgres::{GenericClient, Transaction};

use crate::commands::{self, NewCommand};
use crate::jobs::health::HEALTH_KIND;

/// Passed checks in a row that make a recovering GPU healthy.
pub const CLEAN_CHECKS: i32 = 3;
/// Between two checks of a suspect or recovering GPU.
pub const CHECK_INTERVAL_S: f64 = 60.0;
/// Transient errors of one GPU within [`REPEAT_WINDOW_S`] that count as a fatal one.
pub const REPEATED_TRANSIENTS: i64 = 3;
/// See [`REPEATED_TRANSIENTS`].
pub const REPEAT_WINDOW_S: f64 = 600.0;
/// NVML's throttle reasons that mean heat or power (software and hardware thermal slowdown,
/// hardware slowdown, power brake).
const SLOWDOWNS: u64 = 0x08 | 0x20 | 0x40 | 0x80;
/// Signals one run acts on; more makes it run again.
const SIGNALS_PER_RUN: i64 = 256;
/// How long acted-on signals are kept, as the GPUs' recent history.
const SIGNALS_KEPT_S: f64 = 7.0 * 86_400.0;

/// Records a daemon's health report as signals for the `health` job and wakes it. Runs in the
/// report's transaction, under its session fence. Returns how many signals it recorded.
pub async fn record(tx: &impl GenericClient, node_id: &str, health: &Health) -> Result<u64, DbError> {
    let (mut gpus, mut kinds, mut classes, mut details) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let before = save_counters(tx, node_id, health).await?;
    for g in &health.gpus {
        let old = before.get(&g.uuid);
        let rose = old.map(|old| counter_signals(old, &counters(g))).unwrap_or_default();
        // Unhealthy is a level the daemon repeats in every report while it holds: its onset is
        // the signal.
        let became_unhealthy = !g.healthy && old.is_none_or(|o| o.get("unhealthy").is_none());
        let counted = rose.iter().any(|(class, _)| *class != XidClass::Informational);
        for (class, detail) in rose {
            gpus.push(g.uuid.as_str());
            kinds.push("counter");
            classes.push(class.as_str());
            details.push(detail);
        }
        for x in &g.xid_errors {
            gpus.push(g.uuid.as_str());
            kinds.push("xid");
            classes.push(xid::classify(*x).as_str());
            details.push(format!("XID {x}: {}", xid::describe(*x)));
        }
        // Facts worth an operator's eye that take nothing out of placement by themselves.
        let degraded = (g.pcie_link_width_max > 0 && g.pcie_link_width < g.pcie_link_width_max) || (g.pcie_link_gen_max > 0 && g.pcie_link_gen < g.pcie_link_gen_max);
        if degraded {
            gpus.push(g.uuid.as_str());
            kinds.push("pcie");
            classes.push(XidClass::Informational.as_str());
            details.push(format!("PCIe link x{} gen {} of x{} gen {}", g.pcie_link_width, g.pcie_link_gen, g.pcie_link_width_max, g.pcie_link_gen_max));
        }
        if g.throttle_reasons & SLOWDOWNS != 0 {
            gpus.push(g.uuid.as_str());
            kinds.push("throttle");
            classes.push(XidClass::Informational.as_str());
            details.push(format!("clocks throttled for heat or power (NVML reasons {:#x})", g.throttle_reasons));
        }
        // (Unless a counter said why already: one fault is one signal.)
        if became_unhealthy && g.xid_errors.is_empty() && !counted {
            gpus.push(g.uuid.as_str());
            kinds.push("unhealthy");
            classes.push(XidClass::Transient.as_str());
            details.push(if g.reason.is_empty() { "the daemon reported it unhealthy".to_owned() } else { g.reason.clone() });
        }
    }
    if gpus.is_empty() {
        return Ok(0);
    }
    let n = tx
        .execute(
            "INSERT INTO gpu_health_signals (node_id, device_id, kind, class, detail)
             SELECT $1, u.g, u.k, u.c, left(u.d, 500) FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) AS u(g, k, c, d)",
            &[&node_id, &gpus, &kinds, &classes, &details],
        )
        .await?;
    work_queue::enqueue(tx, &HEALTH_KIND, node_id).await?;
    Ok(n)
}

/// A GPU's counters and flags (the daemon's own verdict among them) as stored: only what is not
/// zero or false, so a GPU with nothing to say stores `{}` and its reports write nothing.
fn counters(g: &better_compute_proto::v1::GpuHealth) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for (k, v) in [
        ("eccUncorrected", g.ecc_uncorrected),
        ("retiredPages", u64::from(g.retired_pages)),
        ("remappedRows", u64::from(g.remapped_rows)),
        ("nvlinkErrors", g.nvlink_errors),
    ] {
        if v > 0 {
            m.insert(k.into(), v.into());
        }
    }
    for (k, v) in [("retiredPagesPending", g.retired_pages_pending), ("remapPending", g.remap_pending), ("remapFailed", g.remap_failed), ("unhealthy", !g.healthy)] {
        if v {
            m.insert(k.into(), true.into());
        }
    }
    serde_json::Value::Object(m)
}

/// Stores each reported GPU's counters and returns what was stored before, by uuid (GPUs the
/// node does not have are left out). The GPUs' rows are taken in id order, as the health job takes
/// them (architecture.md, the lock order).
async fn save_counters(tx: &impl GenericClient, node_id: &str, health: &Health) -> Result<std::collections::HashMap<String, serde_json::Value>, DbError> {
    let uuids: Vec<&str> = health.gpus.iter().map(|g| g.uuid.as_str()).collect();
    let now: Vec<serde_json::Value> = health.gpus.iter().map(counters).collect();
    let rows = tx
        .query(
            "WITH r AS (SELECT * FROM unnest($2::text[], $3::jsonb[]) u(id, c)),
                  old AS (SELECT d.id, coalesce(d.health_counters, '{}'::jsonb) AS c FROM devices d JOIN r ON r.id = d.id
                           WHERE d.node_id = $1 AND d.parent_id IS NULL ORDER BY d.id FOR NO KEY UPDATE OF d),
                  saved AS (UPDATE devices d SET health_counters = r.c FROM r JOIN old ON old.id = r.id
                             WHERE d.id = r.id AND old.c IS DISTINCT FROM r.c)
             SELECT id, c FROM old",
            &[&node_id, &uuids, &now],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// What rose between two of a GPU's counters (a count below the last is a reset, so all of it is
/// new), as signals: a pending page retirement or row remap needs a reset (transient), a failed
/// remap needs service (fatal), new uncorrectable errors are transient, the rest informational.
/// See NVIDIA's "GPU Memory Error Management" guide.
fn counter_signals(old: &serde_json::Value, new: &serde_json::Value) -> Vec<(XidClass, String)> {
    let count = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    let flag = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
    let rose = |k: &str| {
        let (o, n) = (count(old, k), count(new, k));
        if n >= o { n - o } else { n }
    };
    let began = |k: &str| flag(new, k) && !flag(old, k);
    let mut out = Vec::new();
    if began("remapFailed") {
        out.push((XidClass::Fatal, "row remapping failed: the GPU's memory needs service".to_owned()));
    }
    if began("remapPending") {
        out.push((XidClass::Transient, "a row remap waits for a GPU reset".to_owned()));
    }
    if began("retiredPagesPending") {
        out.push((XidClass::Transient, "a page waits for a GPU reset to be retired".to_owned()));
    }
    let ecc = rose("eccUncorrected");
    if ecc > 0 && out.is_empty() {
        out.push((XidClass::Transient, format!("{ecc} new uncorrectable ECC error(s)")));
    }
    for (k, what) in [("remappedRows", "row(s) remapped"), ("retiredPages", "page(s) retired"), ("nvlinkErrors", "NVLink error(s)")] {
        let n = rose(k);
        if n > 0 {
            out.push((XidClass::Informational, format!("{n} {what}")));
        }
    }
    out
}

/// A GPU of the node, locked for the run.
struct Gpu {
    id: String,
    state: GpuHealthState,
    clean_checks: i32,
    check_command_id: Option<String>,
    check_due: bool,
    quarantined: bool,
}

/// What one run did for its node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HealthReport {
    /// Signals acted on.
    pub signals: u64,
    /// GPUs moved to another health state.
    pub transitions: u64,
    /// Checks (`diag.nvml`) enqueued.
    pub checks: u64,
    /// Of them, those that reset the GPU first (it was free).
    pub resets: u64,
    /// `node.recover` workflows started for GPUs a reset had to wait for.
    pub recoveries: u64,
    /// Signals held because the pool's circuit is open.
    pub held: u64,
    /// Whether this run opened the pool's circuit.
    pub circuit_opened: bool,
}

struct Run<'a> {
    tx: &'a Transaction<'a>,
    node_id: &'a str,
    pool_id: String,
    report: HealthReport,
    circuit_open: bool,
}

impl Run<'_> {
    /// Moves `gpu` to `to` for `reason`: the state table's edge, `healthy` as its shadow, the
    /// history and the event. Leaving placement is subject to the pool's circuit breaker; returns
    /// false when the breaker held the move.
    async fn transition(&mut self, gpu: &mut Gpu, to: GpuHealthState, reason: &str) -> Result<bool, DbError> {
        use GpuHealthState::*;
        if gpu.state == to {
            return Ok(true);
        }
        GPU_HEALTH_STATE_TABLE.check(gpu.state, to)?;
        if gpu.state == Healthy && !self.breaker_allows().await? {
            return Ok(false);
        }
        let quarantine = to == Unhealthy;
        self.tx
            .execute(
                "UPDATE devices SET health_state = $2, healthy = ($2 = 'healthy'), health_since = compute_now(), health_reason = $3,
                        clean_checks = CASE WHEN $2 IN ('suspect', 'unhealthy') THEN 0 ELSE clean_checks END,
                        next_check_at = CASE WHEN $2 = 'suspect' THEN compute_now()
                                             WHEN $2 = 'recovering' THEN coalesce(next_check_at, compute_now()) END,
                        quarantined = quarantined OR $4, quarantine_reason = CASE WHEN $4 AND NOT quarantined THEN 'health: ' || $3 ELSE quarantine_reason END,
                        version = version + 1
                  WHERE id = $1",
                &[&gpu.id, &to.as_str(), &reason, &quarantine],
            )
            .await?;
        self.tx
            .execute(
                "INSERT INTO gpu_health_history (device_id, pool_id, from_state, to_state, reason) VALUES ($1, $2, $3, $4, $5)",
                &[&gpu.id, &self.pool_id, &gpu.state.as_str(), &to.as_str(), &reason],
            )
            .await?;
        let event = match to {
            Healthy => "device.healthy",
            Suspect => "device.suspect",
            Unhealthy => "device.unhealthy",
            Recovering => "device.recovering",
        };
        outbox::emit(self.tx, NewEvent { event_type: event, tenant_id: None, subject: &gpu.id, data: serde_json::json!({"nodeId": self.node_id, "reason": reason}) })
            .await?;
        // The job's decision, in the audit log: the move, and a quarantine it makes.
        let action = match to {
            Healthy => "devices.markHealthy",
            Suspect => "devices.markSuspect",
            Unhealthy => "devices.markUnhealthy",
            Recovering => "devices.markRecovering",
        };
        better_compute_audit::Actor::job(HEALTH_KIND.name).record(self.tx, action, &gpu.id, None).await?;
        if quarantine && !gpu.quarantined {
            better_compute_audit::Actor::job(HEALTH_KIND.name).record(self.tx, "devices.quarantine", &gpu.id, None).await?;
            outbox::emit(
                self.tx,
                NewEvent { event_type: "device.quarantined", tenant_id: None, subject: &gpu.id, data: serde_json::json!({"nodeId": self.node_id, "reason": format!("health: {reason}")}) },
            )
            .await?;
            gpu.quarantined = true;
        }
        // A new suspect is checked in this same run (unless a check is already in flight).
        if to == Suspect {
            gpu.check_due = true;
        }
        gpu.state = to;
        self.report.transitions += 1;
        Ok(true)
    }

    /// Whether one more GPU may leave placement: else the circuit opens (once) and the move is held.
    async fn breaker_allows(&mut self) -> Result<bool, DbError> {
        if self.circuit_open {
            return Ok(false);
        }
        let r = self
            .tx
            .query_one(
                "SELECT (SELECT count(DISTINCT h.device_id) FROM gpu_health_history h
                          WHERE h.pool_id = p.id AND h.from_state = 'healthy'
                            AND h.at > compute_now() - make_interval(secs => p.health_breaker_window_s)),
                        greatest(1, floor(p.health_breaker_percent * (SELECT count(*) FROM devices d JOIN nodes n ON n.id = d.node_id
                                                                       WHERE n.pool_id = p.id AND d.parent_id IS NULL AND n.retired_at IS NULL) / 100.0))::int8,
                        p.health_breaker_percent, p.health_breaker_window_s
                   FROM pools p WHERE p.id = $1",
                &[&self.pool_id],
            )
            .await?;
        let (left, allowed, percent, window_s): (i64, i64, i32, i32) = (r.get(0), r.get(1), r.get(2), r.get(3));
        if left < allowed {
            return Ok(true);
        }
        self.tx
            .execute("UPDATE pool_health_circuits SET open_since = compute_now() WHERE pool_id = $1 AND open_since IS NULL", &[&self.pool_id])
            .await?;
        let message = format!(
            "{left} GPU(s) of the pool left placement for health within {window_s} s (the breaker allows {allowed}, {percent}%): automatic health actions stop until an operator closes the circuit (pools.closeHealthCircuit)"
        );
        outbox::emit(self.tx, NewEvent { event_type: "health.circuitOpen", tenant_id: None, subject: &self.pool_id, data: serde_json::json!({"message": message}) }).await?;
        self.circuit_open = true;
        self.report.circuit_opened = true;
        Ok(false)
    }
}

/// One pass over a node's GPUs. Runs in the caller's (fenced) transaction; returns what it did and
/// when the node should be looked at again.
#[allow(clippy::too_many_lines, reason = "one pass over a GPU's signals in the order the state table moves (signals, counters, quarantine, reset, recovery), in the caller's transaction")]
pub async fn evaluate(
    tx: &Transaction<'_>,
    registry: &better_compute_runtime::Registry,
    node_id: &str,
    diag: &better_compute_runtime::commands::CommandKind,
) -> Result<(HealthReport, Option<f64>, bool), DbError> {
    let occupants = registry.node_occupants();
    use GpuHealthState::*;
    let Some(node) = tx.query_opt("SELECT pool_id, shard FROM nodes WHERE id = $1", &[&node_id]).await? else {
        return Ok((HealthReport::default(), None, false));
    };
    let (pool_id, shard): (String, i16) = (node.get(0), node.get(1));
    // The lock order: the pool's circuit (it may open; the pool's runs go one at a time, and its
    // own row leaves the pool's, which placements share, alone), the node's row (a check takes its
    // next command seq), then the GPUs in id order.
    let circuit_open: bool = tx
        .query_one("SELECT open_since IS NOT NULL FROM pool_health_circuits WHERE pool_id = $1 FOR NO KEY UPDATE", &[&pool_id])
        .await?
        .get(0);
    tx.execute("SELECT 1 FROM nodes WHERE id = $1 FOR NO KEY UPDATE", &[&node_id]).await?;
    let rows = tx
        .query(
            "SELECT id, health_state, clean_checks, check_command_id, next_check_at <= compute_now(), quarantined
               FROM devices WHERE node_id = $1 AND parent_id IS NULL ORDER BY id FOR UPDATE",
            &[&node_id],
        )
        .await?;
    let mut gpus: Vec<Gpu> = rows
        .iter()
        .map(|r| Gpu {
            id: r.get(0),
            state: GpuHealthState::parse(r.get(1)).expect("a health state of the table's CHECK"),
            clean_checks: r.get(2),
            check_command_id: r.get(3),
            check_due: r.get::<_, Option<bool>>(4).unwrap_or(false),
            quarantined: r.get(5),
        })
        .collect();
    let mut run = Run { tx, node_id, pool_id, report: HealthReport::default(), circuit_open };

    // Signals, oldest first. While the circuit is open they wait for the operator.
    let signals = tx
        .query(
            "SELECT id, device_id, class, detail FROM gpu_health_signals WHERE node_id = $1 AND processed_at IS NULL ORDER BY id LIMIT $2",
            &[&node_id, &SIGNALS_PER_RUN],
        )
        .await?;
    // A full batch means more may wait, unless the circuit holds them: then the operator decides,
    // and running again would only spin.
    let more = signals.len() as i64 == SIGNALS_PER_RUN && !circuit_open;
    for s in &signals {
        let (id, device, class, detail): (i64, String, String, String) = (s.get(0), s.get(1), s.get(2), s.get(3));
        let Some(gpu) = gpus.iter_mut().find(|g| g.id == device) else {
            mark(tx, id, "ignored: no such GPU on the node").await?;
            continue;
        };
        if run.circuit_open && class != "informational" {
            run.report.held += 1;
            continue;
        }
        let repeated = class == "transient" && {
            let n: i64 = tx
                .query_one(
                    "SELECT count(*) FROM gpu_health_signals WHERE device_id = $1 AND class = 'transient'
                        AND observed_at > compute_now() - make_interval(secs => $2) AND id <= $3",
                    &[&device, &REPEAT_WINDOW_S, &id],
                )
                .await?
                .get(0);
            n >= REPEATED_TRANSIENTS
        };
        let outcome = match (class.as_str(), gpu.state) {
            ("informational", _) => "recorded".to_owned(),
            (_, Unhealthy) => "recorded: already unhealthy".to_owned(),
            ("fatal", _) => move_to(&mut run, gpu, Unhealthy, &detail).await?,
            (_, _) if repeated => move_to(&mut run, gpu, Unhealthy, &format!("{REPEATED_TRANSIENTS} transient errors within {REPEAT_WINDOW_S} s, the last {detail}")).await?,
            (_, Suspect) => "recorded: already suspect, its check decides".to_owned(),
            _ => move_to(&mut run, gpu, Suspect, &detail).await?,
        };
        if outcome.starts_with("held") {
            run.report.held += 1;
            continue;
        }
        mark(tx, id, &outcome).await?;
        run.report.signals += 1;
    }

    // Checks: read the finished ones, start the due ones.
    let mut next: Option<f64> = None;
    for gpu in gpus.iter_mut().filter(|g| matches!(g.state, Suspect | Recovering)) {
        if let Some(cmd) = gpu.check_command_id.clone() {
            let r = tx.query_opt("SELECT state, result FROM commands WHERE id = $1 AND node_id = $2", &[&cmd, &node_id]).await?;
            let Some(r) = r else { continue };
            let (state, result): (String, Option<serde_json::Value>) = (r.get(0), r.get(1));
            if matches!(state.as_str(), "pending" | "sent" | "running") {
                continue;
            }
            let passed = (state == "succeeded").then(|| {
                result.as_ref().and_then(|v| v["gpus"].as_array()).and_then(|g| g.iter().find(|g| g["uuid"] == gpu.id.as_str())).map(|g| g["passed"] == true)
            });
            tx.execute(
                "UPDATE devices SET check_command_id = NULL, next_check_at = compute_now() + make_interval(secs => $2), version = version + 1 WHERE id = $1",
                &[&gpu.id, &CHECK_INTERVAL_S],
            )
            .await?;
            gpu.check_command_id = None;
            gpu.check_due = false;
            match passed {
                Some(Some(true)) => {
                    let clean = gpu.clean_checks + 1;
                    tx.execute("UPDATE devices SET clean_checks = $2 WHERE id = $1", &[&gpu.id, &clean]).await?;
                    gpu.clean_checks = clean;
                    if gpu.state == Suspect {
                        move_to(&mut run, gpu, Recovering, "diag.nvml passed").await?;
                    }
                    if clean >= CLEAN_CHECKS {
                        move_to(&mut run, gpu, Healthy, &format!("{clean} clean checks in a row")).await?;
                        continue;
                    }
                }
                Some(_) => {
                    move_to(&mut run, gpu, Unhealthy, "diag.nvml failed").await?;
                    continue;
                }
                // The check could not run (the node was away, say): try again later.
                None => {}
            }
            next = Some(next.map_or(CHECK_INTERVAL_S, |n: f64| n.min(CHECK_INTERVAL_S)));
        } else if gpu.check_due {
            // The device row is locked and the command's id stored on it in this transaction, so
            // a fresh key never starts a second check.
            let key = format!("health-{}-{}", gpu.id, better_compute_core::id::CommandId::generate());
            // A suspect GPU's first check resets it first where nothing holds it: a reset clears a
            // transient fault and applies a pending row remap or page retirement.
            let mut reset = gpu.state == Suspect && gpu.clean_checks == 0;
            for o in occupants.iter() {
                if reset && o.holds_device(tx, &gpu.id).await? {
                    reset = false;
                    // Held: `node.recover` resets it once it is free; this check runs without.
                    run.report.recoveries += u64::from(start_recovery(tx, registry, node_id, &gpu.id).await?);
                }
            }
            let payload = serde_json::json!({"level": 1, "gpuUuids": [gpu.id], "reset": reset});
            run.report.resets += u64::from(reset);
            let owner = Some((HEALTH_KIND.name, node_id, shard));
            let c = commands::enqueue_kind(
                tx,
                diag,
                NewCommand {
                    node_id,
                    kind: diag.name,
                    payload: &payload,
                    idempotency_key: &key,
                    not_after: Some(Duration::from_secs(300)),
                    min_generation: 0,
                    owner,
                    actor: &better_compute_audit::Actor::job(HEALTH_KIND.name),
                },
            )
            .await?;
            tx.execute("UPDATE devices SET check_command_id = $2, version = version + 1 WHERE id = $1", &[&gpu.id, &c.id]).await?;
            run.report.checks += 1;
        } else {
            let due: Option<f64> = tx
                .query_one("SELECT extract(epoch FROM next_check_at - compute_now())::float8 FROM devices WHERE id = $1", &[&gpu.id])
                .await?
                .get(0);
            if let Some(d) = due {
                next = Some(next.map_or(d, |n: f64| n.min(d)));
            }
        }
    }
    tx.execute(
        "DELETE FROM gpu_health_signals WHERE node_id = $1 AND processed_at < compute_now() - make_interval(secs => $2)",
        &[&node_id, &SIGNALS_KEPT_S],
    )
    .await?;
    Ok((run.report, next, more))
}

async fn move_to(run: &mut Run<'_>, gpu: &mut Gpu, to: GpuHealthState, reason: &str) -> Result<String, DbError> {
    Ok(if run.transition(gpu, to, reason).await? { format!("{} → {}", "moved", to.as_str()) } else { "held: the pool's circuit is open".to_owned() })
}

async fn mark(tx: &impl GenericClient, id: i64, outcome: &str) -> Result<(), DbError> {
    tx.execute("UPDATE gpu_health_signals SET processed_at = compute_now(), outcome = $2 WHERE id = $1", &[&id, &outcome]).await?;
    Ok(())
}

/// An operator releases an unhealthy GPU's quarantine: it is checked again, and comes back after
/// clean checks. Called by [`crate::actions::release_quarantine`] in its transaction.
pub(crate) async fn on_release(tx: &impl GenericClient, uuid: &str) -> Result<(), DbError> {
    let row = tx
        .query_opt("SELECT node_id, health_state FROM devices WHERE id = $1 AND parent_id IS NULL FOR UPDATE", &[&uuid])
        .await?
        .ok_or_else(|| Error::not_found("gpu", uuid))?;
    let (node_id, state): (String, String) = (row.get(0), row.get(1));
    if state != "unhealthy" {
        return Ok(());
    }
    GPU_HEALTH_STATE_TABLE.check(GpuHealthState::Unhealthy, GpuHealthState::Recovering)?;
    tx.execute(
        "UPDATE devices SET health_state = 'recovering', health_since = compute_now(), health_reason = 'an operator released it: checking it',
                clean_checks = 0, next_check_at = compute_now(), version = version + 1 WHERE id = $1",
        &[&uuid],
    )
    .await?;
    tx.execute(
        "INSERT INTO gpu_health_history (device_id, pool_id, from_state, to_state, reason)
         SELECT $1, n.pool_id, 'unhealthy', 'recovering', 'an operator released its quarantine' FROM nodes n WHERE n.id = $2",
        &[&uuid, &node_id],
    )
    .await?;
    work_queue::enqueue(tx, &HEALTH_KIND, &node_id).await
}

/// `pools.closeHealthCircuit`: an operator has decided. The pool's waiting signals are set aside
/// (recorded as such, not acted on) and automatic health actions resume.
pub async fn close_circuit(tx: &impl GenericClient, pool_id: &str) -> Result<u64, DbError> {
    let open = tx
        .query_opt("SELECT open_since IS NOT NULL FROM pool_health_circuits WHERE pool_id = $1 FOR NO KEY UPDATE", &[&pool_id])
        .await?
        .ok_or_else(|| Error::not_found("pool", pool_id))?;
    if !open.get::<_, bool>(0) {
        return Ok(0);
    }
    tx.execute("UPDATE pool_health_circuits SET open_since = NULL WHERE pool_id = $1", &[&pool_id]).await?;
    let set_aside = tx
        .execute(
            "UPDATE gpu_health_signals s SET processed_at = compute_now(), outcome = 'set aside: an operator closed the circuit'
               FROM nodes n WHERE n.id = s.node_id AND n.pool_id = $1 AND s.processed_at IS NULL AND s.class <> 'informational'",
            &[&pool_id],
        )
        .await?;
    outbox::emit(tx, NewEvent { event_type: "health.circuitClosed", tenant_id: None, subject: pool_id, data: serde_json::json!({"signalsSetAside": set_aside}) }).await?;
    Ok(set_aside)
}

/// One entry of a GPU's health history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthChange {
    /// The state before.
    pub from: String,
    /// The state after.
    pub to: String,
    /// Why.
    pub reason: String,
    /// RFC 3339.
    pub at: String,
}

/// A signal a daemon reported, as operators see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Signal {
    /// `xid`, `unhealthy`, `pcie` or `throttle`.
    pub kind: String,
    /// `informational`, `transient` or `fatal`.
    pub class: String,
    /// What it said (`XID 79: GPU has fallen off the bus`).
    pub detail: String,
    /// RFC 3339.
    pub observed_at: String,
    /// What the health job made of it; none while it waits.
    pub outcome: Option<String>,
}

/// Starts `node.recover` for a GPU whose reset waits for what holds it, unless one is open for it
/// already (held ones included: an operator looks at those). Returns whether it started one.
async fn start_recovery(tx: &Transaction<'_>, registry: &better_compute_runtime::Registry, node_id: &str, uuid: &str) -> Result<bool, DbError> {
    use better_compute_workflows as workflow;
    let params = serde_json::json!({"gpuUuid": uuid});
    if registry.workflow(crate::workflows::RECOVER).is_none() || workflow::open_with(tx, crate::workflows::RECOVER, node_id, &params).await?.is_some() {
        return Ok(false);
    }
    let target = workflow::Target { node_id: Some(node_id.to_owned()), ..Default::default() };
    let w = workflow::NewWorkflow { definition: crate::workflows::RECOVER, target: &target, params: &params, requested_by: "job:health" };
    workflow::start(tx, registry, &w).await?;
    Ok(true)
}

/// Makes the GPU's next check due now and wakes the node's `health` key (after `node.recover`
/// reset it). Returns whether the GPU is one the job checks (suspect or recovering).
pub async fn check_now(tx: &impl GenericClient, node_id: &str, uuid: &str) -> Result<bool, DbError> {
    let n = tx
        .execute(
            "UPDATE devices SET next_check_at = compute_now(), version = version + 1
              WHERE id = $1 AND node_id = $2 AND health_state IN ('suspect', 'recovering') AND check_command_id IS NULL",
            &[&uuid, &node_id],
        )
        .await?;
    work_queue::enqueue(tx, &HEALTH_KIND, node_id).await?;
    Ok(n == 1)
}
