//! Liveness in simulated time: each transition and each grace, and that an unreachable node keeps
//! its bookings. (The liveness job lives in the nodes module; bookings need capacity.)


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations;
use better_compute_db::Lease;
use better_compute_nodes::sessions::liveness::{self, GATEWAY_LOSS_GRACE_S, OUTAGE_GRACE_S, UNREACHABLE_AFTER_S};
use better_compute_nodes::sessions;
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn evaluate(h: &Harness) -> liveness::LivenessReport {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let r = liveness::evaluate(&*tx).await.unwrap();
    tx.commit().await.unwrap();
    r
}

async fn liveness_of(h: &Harness, node: &str) -> (String, Vec<String>) {
    let r = h.db().client().await.query_one("SELECT liveness, no_schedule_reasons FROM nodes WHERE id = $1", &[&node]).await.unwrap();
    (r.get(0), r.get(1))
}

/// Advances simulated time in steps of 5 s (as often as the job runs), evaluating after each.
async fn run_for(h: &Harness, secs: u64) {
    for _ in 0..secs / 5 {
        h.db().advance(Duration::from_secs(5)).await;
        evaluate(h).await;
    }
}

async fn open_session(h: &Harness, node: &str, gateway: &str) -> i64 {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let o = sessions::open(
        &*tx,
        &sessions::Hello { node_id: node, gateway_id: gateway, boot_id: "b", journal_id: "j", daemon_version: "t" },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    o.session_epoch
}

#[tokio::test]
async fn liveness_moves_through_each_grace_in_simulated_time_and_an_unreachable_node_keeps_its_bookings() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = f.nodes[0].clone();
    let mut rc = h.db().client().await;
    let reservation = reservations::create(&mut rc, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(reservation.state, "placed");
    let c = h.db().client().await;
    evaluate(&h).await; // the job's first run: no outage grace

    // Registered by hand (not joined): the job leaves it alone.
    run_for(&h, 60).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected");
    assert!(liveness_of(&h, &node).await.1.is_empty());

    // Joined but never opened a session: counted from the join.
    c.execute("UPDATE nodes SET joined_at = compute_now(), liveness_since = compute_now() WHERE id = $1", &[&node]).await.unwrap();
    run_for(&h, (UNREACHABLE_AFTER_S - 5) as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected");
    run_for(&h, 5).await;
    let (l, reasons) = liveness_of(&h, &node).await;
    assert_eq!((l.as_str(), reasons), ("unreachable", vec!["unreachable".to_owned()]));
    // Nothing is released: the reservation and its bookings stay.
    let still = reservations::get(&**c, ME, &reservation.id).await.unwrap();
    assert_eq!(still.state, "placed");
    let bookings: i64 = c.query_one("SELECT count(*) FROM device_bookings b JOIN devices d ON d.id = b.device_id WHERE d.node_id = $1", &[&node]).await.unwrap().get(0);
    assert!(bookings >= 1);
    // Bare metal is never lost, however long.
    run_for(&h, 3600).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable");

    // A session makes it connected again; then its gateway's lease lapses: disconnected with the
    // gateway-loss grace on top of the 40 s.
    let lease = Lease::acquire(&**c, &sessions::gateway_lease_name("gw_1"), "gw_1", Duration::from_secs(20), None).await.unwrap().unwrap();
    open_session(&h, &node, "gw_1").await;
    assert_eq!(liveness_of(&h, &node).await, ("connected".to_owned(), vec![]));
    sessions::flush_last_seen(&**c, "gw_1", std::slice::from_ref(&node), &[1], &[0.0]).await.unwrap();
    run_for(&h, 15).await;
    assert_eq!(liveness_of(&h, &node).await.0, "connected", "the lease still holds");
    run_for(&h, 10).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected", "the gateway's lease expired");
    drop(lease);
    // It went at the lease's expiry, 20 s after the session opened, 5 s ago.
    run_for(&h, (UNREACHABLE_AFTER_S + GATEWAY_LOSS_GRACE_S - 10) as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected", "inside the gateway-loss grace");
    run_for(&h, 5).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable");
    let marked: Vec<String> = h
        .db()
        .client()
        .await
        .query("SELECT actor_id FROM audit_entries WHERE action = 'nodes.markUnreachable' AND target = $1", &[&node])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(marked, ["liveness", "liveness"], "each time the job found it unreachable, recorded as the job's");

    // A session that closes normally: 40 s, no extra grace.
    let epoch = open_session(&h, &node, "gw_1").await;
    Lease::acquire(&**c, &sessions::gateway_lease_name("gw_1"), "gw_1", Duration::from_secs(3600), None).await.unwrap().unwrap();
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        assert!(sessions::close(&*tx, &node, epoch, "daemon-closed").await.unwrap());
        tx.commit().await.unwrap();
    }
    run_for(&h, (UNREACHABLE_AFTER_S - 5) as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected");
    // An outage: the job does not run for a minute. A node disconnected across it (35 s before the
    // outage) gets 40 s + 5 min counted from the outage's end, never less than the grace the job
    // records.
    h.db().advance(Duration::from_secs(60)).await;
    assert!(evaluate(&h).await.outage_grace);
    let grace_until: std::time::SystemTime = c.query_one("SELECT outage_grace_until FROM liveness_runs", &[]).await.unwrap().get(0);
    assert_eq!(grace_until, h.db().now().await + Duration::from_secs(OUTAGE_GRACE_S as u64));
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected", "outage grace");
    run_for(&h, (UNREACHABLE_AFTER_S + OUTAGE_GRACE_S - 5) as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "disconnected", "still inside its outage grace");
    assert!(h.db().now().await > grace_until);
    run_for(&h, 5).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable", "40 s + 5 min after the outage ended");
    assert_eq!(reservations::get(&**c, ME, &reservation.id).await.unwrap().state, "placed");
}

#[tokio::test]
async fn only_provider_and_vps_host_pools_lose_unreachable_nodes_after_lost_after() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let c = h.db().client().await;
    // Turn the fleet's pool into a provider pool with lostAfter 10 minutes.
    c.execute("UPDATE pools SET kind = 'provider', lost_after_s = 600 WHERE id = $1", &[&f.pool_id]).await.unwrap();
    let node = f.nodes[0].clone();
    c.execute("UPDATE nodes SET joined_at = compute_now(), liveness_since = compute_now() WHERE id = $1", &[&node]).await.unwrap();
    evaluate(&h).await;
    run_for(&h, UNREACHABLE_AFTER_S as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable");
    run_for(&h, 595).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable");
    run_for(&h, 5).await;
    let (l, reasons) = liveness_of(&h, &node).await;
    assert_eq!((l.as_str(), reasons), ("lost", vec!["lost".to_owned()]));
    // The job is registered and runs under the harness.
    assert!(h.registry().job_names().contains(&"liveness"));
}

#[tokio::test]
async fn a_silent_sessions_node_is_unreachable_40_s_after_it_was_last_heard() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = f.nodes[0].clone();
    let c = h.db().client().await;
    c.execute("UPDATE nodes SET joined_at = compute_now() WHERE id = $1", &[&node]).await.unwrap();
    Lease::acquire(&**c, &sessions::gateway_lease_name("gw_1"), "gw_1", Duration::from_secs(3600), None).await.unwrap().unwrap();
    let epoch = open_session(&h, &node, "gw_1").await;
    evaluate(&h).await; // the job's first run: no outage grace
    // Last heard 10 s from now; the gateway keeps its lease but hears nothing more.
    run_for(&h, 10).await;
    sessions::flush_last_seen(&**c, "gw_1", std::slice::from_ref(&node), &[epoch], &[0.0]).await.unwrap();
    run_for(&h, (UNREACHABLE_AFTER_S - 5) as u64).await;
    assert_eq!(liveness_of(&h, &node).await.0, "connected", "35 s silent");
    run_for(&h, 5).await;
    assert_eq!(liveness_of(&h, &node).await.0, "unreachable", "40 s after it was last heard, not 40 s after the silence was noticed");
}
