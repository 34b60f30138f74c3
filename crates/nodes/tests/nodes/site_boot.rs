//! Site boot in simulated time: an outage of most of a site starts a boot, sessions are admitted at
//! the site's pace (the rest told to retry), each admitted daemon gets its full desired state, and
//! placement on the site waits until enough nodes converged.


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations;
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_nodes::sessions::{self, site_boot};
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn open(h: &Harness, node: &str) -> Result<sessions::Opened, better_compute_core::Error> {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let hello = sessions::Hello { node_id: node, gateway_id: "gw_1", boot_id: "b2", journal_id: "j", daemon_version: "t" };
    match sessions::open(&*tx, &hello).await {
        Ok(o) => {
            tx.commit().await.unwrap();
            Ok(o)
        }
        Err(e) => Err(e.into()),
    }
}

async fn evaluate(h: &Harness) -> site_boot::SiteBootReport {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let r = site_boot::evaluate(&*tx).await.unwrap();
    tx.commit().await.unwrap();
    r
}

#[tokio::test]
async fn a_site_back_from_an_outage_admits_sessions_at_its_pace_and_holds_placement_until_enough_converged() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 1).await;
    let mut c = h.db().client().await;
    let site: String = c.query_one("SELECT site_id FROM pools WHERE id = $1", &[&f.pool_id]).await.unwrap().get(0);
    {
        let tx = c.transaction().await.unwrap();
        site_boot::configure(&*tx, &site, site_boot::BootSettings { admit_per_s: Some(2), converged_percent: Some(100), outage_percent: None }).await.unwrap();
        tx.execute("UPDATE nodes SET joined_at = compute_now()", &[]).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(evaluate(&h).await, site_boot::SiteBootReport::default(), "all well: no boot");
    assert!(!open(&h, &f.nodes[3]).await.unwrap().site_booting);

    // Three of four nodes go away at once: an outage.
    for n in &f.nodes[..3] {
        let tx = c.transaction().await.unwrap();
        actions::set_liveness(&*tx, n, "unreachable").await.unwrap();
        tx.commit().await.unwrap();
    }
    assert_eq!(evaluate(&h).await.started, 1);
    let reasons: Vec<Vec<String>> =
        c.query("SELECT no_schedule_reasons FROM nodes ORDER BY id", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(reasons.len(), 4);
    assert!(reasons.iter().all(|r| r.contains(&"site-boot".to_owned())), "placement on the whole site waits: {reasons:?}");
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    let held = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(held.state, "pending");

    // Sessions come back at two a second; the others are told to retry.
    h.db().advance(Duration::from_secs(1)).await;
    assert!(open(&h, &f.nodes[0]).await.unwrap().site_booting, "full desired state while booting");
    open(&h, &f.nodes[1]).await.unwrap();
    let refused = open(&h, &f.nodes[2]).await.unwrap_err();
    assert_eq!(refused.code, ErrorCode::Unavailable, "{refused}");
    assert!(refused.message.contains("retry"), "{refused}");
    assert_eq!(evaluate(&h).await.ended, 0, "3 of 4 converged: not yet");
    h.db().advance(Duration::from_secs(1)).await;
    open(&h, &f.nodes[2]).await.unwrap();

    // All four connected and converged: the boot ends and placement resumes.
    assert_eq!(evaluate(&h).await.ended, 1);
    let held_back: i64 = c.query_one("SELECT count(*) FROM nodes WHERE 'site-boot' = ANY(no_schedule_reasons)", &[]).await.unwrap().get(0);
    assert_eq!(held_back, 0);
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    h.db().advance(Duration::from_secs(31)).await;
    h.job("capacity.reservations").drain(20).await;
    let placed = reservations::get(&**c, ME, &held.id).await.unwrap();
    assert!(placed.state == "placed" || placed.state == "active", "{placed:?}");
    assert!(placed.node_id.is_some());
    let events: Vec<String> = c
        .query("SELECT type FROM outbox WHERE subject = $1 AND type LIKE 'site.%' ORDER BY txid, seq", &[&site])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(events, ["site.bootStarted", "site.bootEnded"]);
    let entries: Vec<(String, String)> = job_entries(&h, &site).await.into_iter().map(|(job, action, ..)| (job, action)).collect();
    assert_eq!(entries, [("site-boot".into(), "sites.bootStart".into()), ("site-boot".into(), "sites.bootEnd".into())]);
    // The pending reservation was placed by its job, in its tenant's log.
    let moved = job_entries(&h, &held.id).await;
    assert_eq!(moved.first(), Some(&("capacity.reservations".into(), "reservations.place".into(), held.id.clone(), Some(TENANT.into()))), "{moved:?}");
}
