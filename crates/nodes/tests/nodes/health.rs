//! GPU health in simulated time: XIDs classified by the catalogue, a fatal one quarantining at
//! once, a transient one checked with diag.nvml until clean checks bring the GPU back, repeated
//! transients counting as fatal, the pool's circuit breaker, and reservations that keep their GPU
//! (their tenants told) on a node that is unreachable too. (The health job lives in the nodes
//! module; the tenants' events come from capacity.)


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations;
use better_compute_core::state::{GpuHealthState, State, GPU_HEALTH_STATE_TABLE};
use better_compute_nodes::{actions, commands, health};
use better_compute_proto::v1::{GpuHealth, Health};
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn report(h: &Harness, node: &str, gpu: &str, xids: &[u32], healthy: bool) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let g = GpuHealth { uuid: gpu.into(), healthy, xid_errors: xids.to_vec(), reason: if healthy { String::new() } else { "ECC".into() }, ..Default::default() };
    health::record(&*tx, node, &Health { gpus: vec![g] }).await.unwrap();
    tx.commit().await.unwrap();
}

async fn state_of(h: &Harness, gpu: &str) -> (String, bool, bool) {
    let r = h.db().client().await.query_one("SELECT health_state, healthy, quarantined FROM devices WHERE id = $1", &[&gpu]).await.unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// The check in flight on `gpu` finishes: passed or not.
async fn finish_check(h: &Harness, gpu: &str, passed: bool) {
    let mut c = h.db().client().await;
    let id: String = c.query_one("SELECT check_command_id FROM devices WHERE id = $1", &[&gpu]).await.unwrap().get(0);
    let tx = c.transaction().await.unwrap();
    // As a daemon would have it: sent, then running (the state table's edges).
    tx.execute("UPDATE commands SET state = 'sent' WHERE id = $1 AND state = 'pending'", &[&id]).await.unwrap();
    tx.execute("UPDATE commands SET state = 'running' WHERE id = $1 AND state = 'sent'", &[&id]).await.unwrap();
    let result = serde_json::json!({"backend": "fake", "gpus": [{"uuid": gpu, "passed": passed}]});
    commands::finish(&*tx, &id, true, None, &result).await.unwrap();
    tx.commit().await.unwrap();
}

async fn tick(h: &Harness) {
    h.job("health").drain(5).await;
}

#[tokio::test]
async fn a_fatal_xid_quarantines_the_gpu_at_once_and_the_reservation_on_it_keeps_it() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 2);
    req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r0"))]);
    let held = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    assert_eq!(held.node_id.as_deref(), Some(f.nodes[0].as_str()));
    // The node is unreachable as well: still nothing is released.
    {
        let tx = c.transaction().await.unwrap();
        actions::set_liveness(&*tx, &f.nodes[0], "unreachable").await.unwrap();
        tx.commit().await.unwrap();
    }
    let gpu = f.gpus[0][1].clone();
    report(&h, &f.nodes[0], &gpu, &[13], true).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await, ("healthy".into(), true, false), "XID 13 is the application's");
    report(&h, &f.nodes[0], &gpu, &[79], false).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await, ("unhealthy".into(), false, true), "fallen off the bus: quarantined at once");
    let reason: String = c.query_one("SELECT quarantine_reason FROM devices WHERE id = $1", &[&gpu]).await.unwrap().get(0);
    assert!(reason.contains("XID 79"), "{reason}");
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().state, "placed", "the reservation keeps its GPU");
    // Its tenant is told.
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    settle_outbox(&h).await;
    let told = c
        .query("SELECT tenant_id, data FROM outbox WHERE type = 'reservation.deviceUnhealthy' AND subject = $1", &[&held.id])
        .await
        .unwrap();
    assert_eq!(told.len(), 1);
    assert_eq!(told[0].get::<_, Option<String>>(0).as_deref(), Some(TENANT));
    assert_eq!(told[0].get::<_, serde_json::Value>(1)["deviceId"], gpu.as_str());
    // Every signal was acted on and recorded.
    let outcomes: Vec<String> = c.query("SELECT outcome FROM gpu_health_signals WHERE device_id = $1 ORDER BY id", &[&gpu]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(outcomes, ["recorded", "moved → unhealthy"]);
    // The health job's move and its quarantine are its decisions in the audit log.
    let entries: Vec<(String, String)> = job_entries(&h, &gpu).await.into_iter().map(|(job, action, ..)| (job, action)).collect();
    assert_eq!(entries, [("health".into(), "devices.markUnhealthy".into()), ("health".into(), "devices.quarantine".into())]);
}

#[tokio::test]
async fn a_transient_xid_is_checked_and_the_gpu_returns_to_placement_after_clean_checks() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, gpu) = (f.nodes[0].clone(), f.gpus[0][0].clone());
    report(&h, &node, &gpu, &[119], true).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await, ("suspect".into(), false, false), "out of placement, not quarantined");
    let c = h.db().client().await;
    let check: (String, serde_json::Value, Option<String>) = {
        let r = c
            .query_one("SELECT c.kind, c.payload, c.owner_kind FROM commands c JOIN devices d ON d.check_command_id = c.id WHERE d.id = $1", &[&gpu])
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!((check.0.as_str(), check.2.as_deref()), ("diag.nvml", Some("health")));
    assert_eq!(check.1["gpuUuids"], serde_json::json!([gpu]));
    // A second transient while suspect changes nothing: its check decides.
    finish_check(&h, &gpu, true).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await.0, "recovering");
    for n in 2..=health::CLEAN_CHECKS {
        h.db().advance(Duration::from_secs(health::CHECK_INTERVAL_S as u64)).await;
        tick(&h).await;
        assert_eq!(state_of(&h, &gpu).await.0, "recovering", "check {n} started");
        finish_check(&h, &gpu, true).await;
        tick(&h).await;
    }
    assert_eq!(state_of(&h, &gpu).await, ("healthy".into(), true, false));
    let history: Vec<(String, String)> = c
        .query("SELECT from_state, to_state FROM gpu_health_history WHERE device_id = $1 ORDER BY id", &[&gpu])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let s = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(history, [s("healthy", "suspect"), s("suspect", "recovering"), s("recovering", "healthy")]);
    let checks: i64 = c.query_one("SELECT count(*) FROM commands WHERE node_id = $1 AND kind = 'diag.nvml' AND state = 'succeeded'", &[&node]).await.unwrap().get(0);
    assert_eq!(checks, health::CLEAN_CHECKS as i64);
}

#[tokio::test]
async fn a_failed_check_quarantines_and_an_operators_release_starts_the_checks_again() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, gpu) = (f.nodes[0].clone(), f.gpus[0][0].clone());
    report(&h, &node, &gpu, &[], false).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await.0, "suspect");
    finish_check(&h, &gpu, false).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &gpu).await, ("unhealthy".into(), false, true));
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    actions::release_quarantine(&*tx, &gpu).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(state_of(&h, &gpu).await, ("recovering".into(), false, false), "released, but checked before it takes work");
    tick(&h).await;
    let started: Option<String> = c.query_one("SELECT check_command_id FROM devices WHERE id = $1", &[&gpu]).await.unwrap().get(0);
    assert!(started.is_some());
}

#[tokio::test]
async fn transient_errors_repeating_within_the_window_count_as_fatal() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, gpu) = (f.nodes[0].clone(), f.gpus[0][0].clone());
    for i in 0..health::REPEATED_TRANSIENTS {
        report(&h, &node, &gpu, &[62], true).await;
        tick(&h).await;
        if i + 1 < health::REPEATED_TRANSIENTS {
            assert_eq!(state_of(&h, &gpu).await.0, "suspect");
        }
        h.db().advance(Duration::from_secs(30)).await;
    }
    assert_eq!(state_of(&h, &gpu).await, ("unhealthy".into(), false, true));
    let reason: String = h.db().client().await.query_one("SELECT health_reason FROM devices WHERE id = $1", &[&gpu]).await.unwrap().get(0);
    assert!(reason.contains("transient errors within"), "{reason}");
}

#[tokio::test]
async fn the_circuit_opens_when_too_many_gpus_leave_placement_and_waits_for_an_operator() {
    let h = harness().await;
    // 8 GPUs: the breaker allows one (10%, at least one) within its window.
    let f = fleet(&h, &exclusive(2), 4).await;
    report(&h, &f.nodes[0], &f.gpus[0][0], &[79], false).await;
    tick(&h).await;
    assert_eq!(state_of(&h, &f.gpus[0][0]).await.0, "unhealthy");
    report(&h, &f.nodes[1], &f.gpus[1][0], &[79], false).await;
    report(&h, &f.nodes[1], &f.gpus[1][1], &[119], true).await;
    tick(&h).await;
    // Held: both stay in placement, their signals wait, and the circuit is open.
    assert_eq!(state_of(&h, &f.gpus[1][0]).await, ("healthy".into(), true, false));
    assert_eq!(state_of(&h, &f.gpus[1][1]).await, ("healthy".into(), true, false));
    let c = h.db().client().await;
    let waiting: i64 = c.query_one("SELECT count(*) FROM gpu_health_signals WHERE node_id = $1 AND processed_at IS NULL", &[&f.nodes[1]]).await.unwrap().get(0);
    assert_eq!(waiting, 2);
    let open: bool = c.query_one("SELECT open_since IS NOT NULL FROM pool_health_circuits WHERE pool_id = $1", &[&f.pool_id]).await.unwrap().get(0);
    assert!(open);
    let events: i64 = c.query_one("SELECT count(*) FROM outbox WHERE type = 'health.circuitOpen' AND subject = $1", &[&f.pool_id]).await.unwrap().get(0);
    assert_eq!(events, 1, "raised once");
    // The operator decides: the waiting signals are set aside, and health actions resume.
    let mut cc = h.db().client().await;
    let tx = cc.transaction().await.unwrap();
    assert_eq!(health::close_circuit(&*tx, &f.pool_id).await.unwrap(), 2);
    tx.commit().await.unwrap();
    tick(&h).await;
    assert_eq!(state_of(&h, &f.gpus[1][0]).await.0, "healthy");
    let waiting: i64 = c.query_one("SELECT count(*) FROM gpu_health_signals WHERE processed_at IS NULL", &[]).await.unwrap().get(0);
    assert_eq!(waiting, 0);
}

#[tokio::test]
async fn the_database_holds_healthy_to_the_health_state_and_the_table_is_consistent() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let c = h.db().client().await;
    let e = c.execute("UPDATE devices SET health_state = 'suspect' WHERE id = $1", &[&f.gpus[0][0]]).await.unwrap_err();
    assert_eq!(e.as_db_error().and_then(|d| d.constraint()), Some("devices_healthy_is_the_health_state"), "{e:?}");
    assert!(GPU_HEALTH_STATE_TABLE.allows(GpuHealthState::Healthy, GpuHealthState::Suspect));
    assert!(!GPU_HEALTH_STATE_TABLE.allows(GpuHealthState::Unhealthy, GpuHealthState::Healthy), "back only through checks");
    assert_eq!(GpuHealthState::parse("recovering"), Some(GpuHealthState::Recovering));
}

async fn report_counters(h: &Harness, node: &str, g: GpuHealth) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    health::record(&*tx, node, &Health { gpus: vec![g] }).await.unwrap();
    tx.commit().await.unwrap();
}

/// `(kind, class, detail)` of every signal of `gpu`, oldest first.
async fn signals_of(h: &Harness, gpu: &str) -> Vec<(String, String, String)> {
    let c = h.db().client().await;
    c.query("SELECT kind, class, detail FROM gpu_health_signals WHERE device_id = $1 ORDER BY id", &[&gpu])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// The payload of the check in flight on `gpu`.
async fn check_payload(h: &Harness, gpu: &str) -> serde_json::Value {
    let c = h.db().client().await;
    c.query_one("SELECT c.payload FROM commands c JOIN devices d ON d.check_command_id = c.id WHERE d.id = $1", &[&gpu]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_pending_row_remap_resets_a_free_gpu_before_its_check_and_counters_signal_once_per_rise() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, free, held_gpu) = (&f.nodes[0], f.gpus[0][0].clone(), f.gpus[0][1].clone());
    let mut c = h.db().client().await;
    // A reservation holds the second GPU.
    let mut one = whole(&f.pool_id, 1);
    one.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r0"))]);
    let first = reservations::create(&mut c, &TEST_ACTOR, ME, &one).await.unwrap();
    let held_atoms: Vec<String> = c.query("SELECT device_id FROM device_bookings WHERE allocation_id = $1", &[&first.id]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(held_atoms.len(), 1);
    let (free, held_gpu) = if held_atoms[0] == free { (held_gpu, free) } else { (free, held_gpu) };
    // Both GPUs of this small pool will leave placement: let the breaker allow it.
    c.execute("UPDATE pools SET health_breaker_percent = 100 WHERE id = $1", &[&f.pool_id]).await.unwrap();

    // NVLink errors are recorded, and take nothing out of placement.
    report_counters(&h, node, GpuHealth { uuid: free.clone(), healthy: true, nvlink_errors: 7, ..Default::default() }).await;
    report_counters(&h, node, GpuHealth { uuid: free.clone(), healthy: true, nvlink_errors: 7, ..Default::default() }).await;
    tick(&h).await;
    assert_eq!(signals_of(&h, &free).await, vec![("counter".to_owned(), "informational".to_owned(), "7 NVLink error(s)".to_owned())], "once per rise, not per report");
    assert_eq!(state_of(&h, &free).await.0, "healthy");

    // An uncorrectable error whose row remap waits for a reset, on each GPU.
    let remap = |uuid: &str| GpuHealth { uuid: uuid.into(), healthy: false, reason: "ECC".into(), ecc_uncorrected: 1, remapped_rows: 1, remap_pending: true, nvlink_errors: 7, ..Default::default() };
    report_counters(&h, node, remap(&free)).await;
    report_counters(&h, node, remap(&held_gpu)).await;
    report_counters(&h, node, remap(&free)).await;
    tick(&h).await;
    let seen = signals_of(&h, &free).await;
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!((seen[1].1.as_str(), seen[1].2.as_str()), ("transient", "a row remap waits for a GPU reset"));
    assert_eq!(seen[2].2, "1 row(s) remapped");
    assert_eq!(state_of(&h, &free).await.0, "suspect");
    assert_eq!(check_payload(&h, &free).await["reset"], true, "nothing holds it: reset, then check");
    // (false is the field's default, which the stored payload leaves out)
    assert_eq!(check_payload(&h, &held_gpu).await.get("reset"), None, "a reservation holds it: never reset under a workload");

    // The reset applied the remap and cleared the volatile count: a report of zero is no signal,
    // and a failed remap later is fatal.
    report_counters(&h, node, GpuHealth { uuid: free.clone(), healthy: true, remapped_rows: 1, nvlink_errors: 7, ..Default::default() }).await;
    assert_eq!(signals_of(&h, &free).await.len(), 3);
    report_counters(&h, node, GpuHealth { uuid: free.clone(), healthy: false, remapped_rows: 1, remap_failed: true, nvlink_errors: 7, ..Default::default() }).await;
    tick(&h).await;
    assert_eq!(signals_of(&h, &free).await.last().map(|s| s.1.clone()), Some("fatal".to_owned()));
    assert_eq!(state_of(&h, &free).await, ("unhealthy".into(), false, true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_run_never_holds_up_placements_in_its_pool() {
    // A health run serialises with the pool's other runs (its circuit breaker counts the pool's
    // GPUs), and placements take the pool's row FOR SHARE. A run that locked the pool's row for
    // that stopped every placement in the pool until it committed: an XID storm would queue them.
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    report(&h, &f.nodes[0], &f.gpus[0][0], &[79], false).await;
    // The run waits, mid-way, for its node's row: held here.
    let mut z = h.db().connect().await;
    let node_row = z.transaction().await.unwrap();
    node_row.execute("SELECT 1 FROM nodes WHERE id = $1 FOR NO KEY UPDATE", &[&f.nodes[0]]).await.unwrap();
    let mut c = h.db().connect().await;
    let mut req = whole(&f.pool_id, 1);
    req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r1"))]);
    let placement = async {
        waits_for_a_lock(&h, "FROM nodes WHERE id = $1 FOR NO KEY UPDATE", "the health run never reached its node").await;
        let v = tokio::select! {
            v = reservations::create(&mut c, &TEST_ACTOR, ME, &req) => v.unwrap(),
            _ = waits_for_a_lock(&h, "capacity_reserve", "") => panic!("the placement waited for the health run"),
        };
        node_row.commit().await.unwrap();
        v
    };
    let (_, v) = tokio::join!(tick(&h), placement);
    assert_eq!((v.state.as_str(), v.node_id.as_deref()), ("placed", Some(f.nodes[1].as_str())));
    assert_eq!(state_of(&h, &f.gpus[0][0]).await.0, "unhealthy");
}
