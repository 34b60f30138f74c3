//! Keeping the inventory honest: the inventory job flags what a daemon's report contradicts (never
//! deleting a GPU) and resolves it when the report agrees again; the hygiene job finds expired join
//! tokens, certificates about to expire, nodes that never converged and retired nodes still held.


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_nodes::inventory::findings;
use better_compute_nodes::jobs::inventory_hygiene::HYGIENE_KIND;
use better_compute_nodes::{listing, sessions};
use better_compute_proto::v1::{GpuInfo, Inventory};
use better_compute_runtime::harness::Harness;
use better_compute_capacity::reservations::CreateReservation;
use better_compute_runtime::work_queue;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn report(h: &Harness, node: &str, gpus: &[&str]) {
    report_host(h, node, gpus, 128, 8_000).await;
}

/// The daemon of `node` reports `gpus` on a host of `vcpu` vCPUs, 1 TiB and `disk_gib`.
async fn report_host(h: &Harness, node: &str, gpus: &[&str], vcpu: u32, disk_gib: u64) {
    let inv = Inventory {
        gpus: gpus.iter().enumerate().map(|(i, u)| GpuInfo { uuid: (*u).into(), index: i as u32, model: MODEL.into(), memory_mib: 81_920, ..Default::default() }).collect(),
        vcpu,
        memory_mib: 1_048_576,
        disk_gib,
        backend: "fake".into(),
    };
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    sessions::report_inventory(&*tx, node, &inv).await.unwrap();
    tx.commit().await.unwrap();
}

async fn open_findings(h: &Harness, pool: &str) -> Vec<(String, String)> {
    let page = better_compute_core::page::PageRequest { page_size: Some(100), page_token: None };
    let c = h.db().client().await;
    findings::list(&**c, Some(pool), None, false, &page).await.unwrap().items.into_iter().map(|f| (f.kind, f.item)).collect()
}

#[tokio::test]
async fn a_vanished_gpu_is_flagged_never_deleted_and_resolved_when_its_daemon_reports_it_again() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, g0, g1) = (f.nodes[0].clone(), f.gpus[0][0].clone(), f.gpus[0][1].clone());
    report(&h, &node, &[&g0, &g1]).await;
    h.job("inventory").drain(5).await;
    assert_eq!(open_findings(&h, &f.pool_id).await, vec![]);

    report(&h, &node, &[&g0, "GPU-stranger"]).await;
    h.job("inventory").drain(5).await;
    let mut found = open_findings(&h, &f.pool_id).await;
    found.sort();
    assert_eq!(found, [("gpu-missing".to_owned(), g1.clone()), ("gpu-unknown".to_owned(), "GPU-stranger".to_owned())]);
    let c = h.db().client().await;
    let kept: i64 = c.query_one("SELECT count(*) FROM devices WHERE id = $1", &[&g1]).await.unwrap().get(0);
    assert_eq!(kept, 1, "a vanished GPU is flagged, never deleted");
    let conditions = better_compute_nodes::inventory::get_node(&**c, &node).await.unwrap().conditions;
    assert!(conditions.iter().any(|x| x.kind == "InventoryFindings" && x.message.starts_with("2 open finding(s)")), "{conditions:?}");
    // Seen again: one finding each, not a second.
    report(&h, &node, &[&g0, "GPU-stranger"]).await;
    h.job("inventory").drain(5).await;
    let opened: i64 = c.query_one("SELECT count(*) FROM outbox WHERE type = 'inventory.finding'", &[]).await.unwrap().get(0);
    assert_eq!(opened, 2);

    report(&h, &node, &[&g0, &g1]).await;
    h.job("inventory").drain(5).await;
    assert_eq!(open_findings(&h, &f.pool_id).await, vec![]);
    let resolved: i64 = c.query_one("SELECT count(*) FROM outbox WHERE type = 'inventory.findingResolved'", &[]).await.unwrap().get(0);
    assert_eq!(resolved, 2);
}

#[tokio::test]
async fn hygiene_finds_expired_tokens_expiring_certificates_nodes_that_never_converged_and_retired_nodes_still_held() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 1).await;
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let token = listing::create_join_token(&*tx, &f.pool_id, Some(60), "test").await.unwrap();
    tx.execute(
        "INSERT INTO node_certificates (fingerprint_sha256, node_id, serial, not_before, not_after)
         VALUES (sha256('a'), $1, 'serial-soon', compute_now(), compute_now() + interval '2 days')",
        &[&f.nodes[0]],
    )
    .await
    .unwrap();
    // Joined but never applied anything.
    tx.execute("UPDATE nodes SET joined_at = compute_now(), observed_generation = 0 WHERE id = $1", &[&f.nodes[1]]).await.unwrap();
    tx.commit().await.unwrap();
    // A retired node a reservation still holds (no drain emptied it first).
    let mut req = whole(&f.pool_id, 1);
    req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r2"))]);
    better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    c.execute("UPDATE nodes SET retired_at = compute_now() WHERE id = $1", &[&f.nodes[2]]).await.unwrap();

    h.db().advance(Duration::from_secs(11 * 60)).await;
    let hygiene = async || {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        work_queue::enqueue(&*tx, &HYGIENE_KIND, &f.pool_id).await.unwrap();
        tx.commit().await.unwrap();
        h.job("inventory.hygiene").drain(5).await;
    };
    hygiene().await;
    let mut found = open_findings(&h, &f.pool_id).await;
    found.sort();
    assert_eq!(
        found,
        [
            ("certificate-expiring".to_owned(), "serial-soon".to_owned()),
            ("held-retired-node".to_owned(), String::new()),
            ("join-token-expired".to_owned(), token.id.clone()),
            ("never-converged".to_owned(), String::new()),
        ]
    );
    // Fixed: the node converges; the rest stay.
    c.execute("UPDATE nodes SET observed_generation = generation WHERE id = $1", &[&f.nodes[1]]).await.unwrap();
    hygiene().await;
    assert_eq!(open_findings(&h, &f.pool_id).await.len(), 3);
}

async fn report_vcpu(h: &Harness, node: &str, gpus: &[String], vcpu: u32) {
    let gpus: Vec<&str> = gpus.iter().map(String::as_str).collect();
    report_host(h, node, &gpus, vcpu, 0).await;
}

/// `(vcpu usable, vcpu allocatable, disk allocatable)` of `node`.
async fn vcpu_of(h: &Harness, node: &str) -> (i32, i32, i64) {
    let c = h.db().client().await;
    let r = c.query_one("SELECT vcpu_usable, vcpu_allocatable, disk_gib_allocatable FROM node_resources WHERE node_id = $1", &[&node]).await.unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[tokio::test]
async fn allocatable_follows_the_reported_cpus_down_but_never_below_what_reservations_hold() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let (node, gpus) = (&f.nodes[0], &f.gpus[0]);
    let mut c = h.db().client().await;
    assert_eq!(vcpu_of(&h, node).await, (128, 128, 8_000), "the registration");
    let held = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &CreateReservation { vcpu: 100, ..whole(&f.pool_id, 1) }).await.unwrap();
    assert_eq!(held.state, "placed");

    // The node now has 64 vCPUs: nothing held is released, and nothing more fits.
    report_vcpu(&h, node, gpus, 64).await;
    assert_eq!(vcpu_of(&h, node).await, (64, 100, 8_000), "held up at what the reservation holds; a disk of 0 is no report");
    let waits = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &CreateReservation { vcpu: 1, ..whole(&f.pool_id, 1) }).await.unwrap();
    assert_eq!(waits.state, "pending", "no vCPU left above what is held");
    assert_eq!(better_compute_capacity::invariants::check(&**c, &Default::default()).await.unwrap().violations, Vec::<String>::new());

    // It ends: allocatable comes down to what the node has, and the waiting one fits.
    better_compute_capacity::reservations::release(&mut c, &TEST_ACTOR, ME, &held.id).await.unwrap();
    assert_eq!(vcpu_of(&h, node).await, (64, 64, 8_000));
    let fits = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &CreateReservation { vcpu: 64, ..whole(&f.pool_id, 1) }).await.unwrap();
    assert_eq!(fits.state, "placed");
    let too_much = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &CreateReservation { vcpu: 65, ..whole(&f.pool_id, 1) }).await.unwrap_err();
    assert_eq!(too_much.code, better_compute_core::ErrorCode::FailedPrecondition, "no node has 65 vCPUs now: {too_much}");

    // Back to 128, then more than it was registered with: the registration is the ceiling.
    report_vcpu(&h, node, gpus, 512).await;
    assert_eq!(vcpu_of(&h, node).await, (128, 128, 8_000));
    // A report of nothing leaves it.
    report_vcpu(&h, node, gpus, 0).await;
    assert_eq!(vcpu_of(&h, node).await, (128, 128, 8_000));
    assert_eq!(better_compute_capacity::invariants::check(&**c, &Default::default()).await.unwrap().violations, Vec::<String>::new());
}
