//! The `node` job in simulated time: it records since when each of a node's conditions has held
//! (where the owning rows do not say), announces those that begin, change or end, and is woken by
//! the events about a node.


use std::time::Duration;

use better_compute_nodes::jobs::node::NODE_KIND;
use better_compute_nodes::{actions, inventory};
use better_compute_runtime::harness::Harness;
use better_compute_runtime::work_queue;
use better_compute_testing::*;

/// Delivers the outbox to the waker and runs the `node` job until it is idle.
async fn settle(h: &Harness) {
    settle_outbox(h).await;
    h.job("event-subscribers").drain(20).await;
    h.job("node").drain(20).await;
}

async fn now(c: &tokio_postgres::Client) -> String {
    c.query_one("SELECT nodes_ts(compute_now())", &[]).await.unwrap().get(0)
}

async fn since(c: &tokio_postgres::Client, node: &str, kind: &str) -> Option<String> {
    let n = inventory::get_node(c, node).await.unwrap();
    let found: Vec<_> = n.conditions.iter().filter(|x| x.kind == kind).collect();
    assert!(found.len() <= 1, "{:?}", n.conditions);
    found.first().map(|x| x.since.clone().unwrap_or_else(|| panic!("{kind} has no since: {:?}", n.conditions)))
}

/// `(type, holds)` of each `node.conditionChanged` about `node`, oldest first.
async fn announced(c: &tokio_postgres::Client, node: &str) -> Vec<(String, bool)> {
    c.query(
        "SELECT data->>'type', (data->>'holds')::bool FROM outbox WHERE type = 'node.conditionChanged' AND subject = $1 ORDER BY txid, seq",
        &[&node],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test]
async fn a_cordon_shows_since_when_it_began_and_its_start_and_end_are_announced() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 1).await;
    let node = &f.nodes[0];
    let mut c = h.db().client().await;
    settle(&h).await;
    assert_eq!(announced(&c, node).await, vec![("Disconnected".to_owned(), true)], "the first pass records what holds");

    h.db().advance(Duration::from_secs(10)).await;
    let cordoned_at = now(&c).await;
    {
        let tx = c.transaction().await.unwrap();
        assert!(actions::cordon(&*tx, node).await.unwrap());
        tx.commit().await.unwrap();
    }
    settle(&h).await;
    h.db().advance(Duration::from_secs(60)).await;
    assert_eq!(since(&c, node, "Cordoned").await.as_deref(), Some(cordoned_at.as_str()), "since the cordon, not since the read");
    let recorded: i64 = c.query_one("SELECT count(*) FROM node_conditions WHERE node_id = $1", &[node]).await.unwrap().get(0);
    assert_eq!(recorded, 2, "Disconnected and Cordoned");

    // A later pass keeps the since; the other node was never touched.
    work_queue::enqueue_many(&**c, &NODE_KIND, &f.nodes).await.unwrap();
    h.job("node").drain(5).await;
    assert_eq!(since(&c, node, "Cordoned").await.as_deref(), Some(cordoned_at.as_str()));
    assert_eq!(since(&c, &f.nodes[1], "Cordoned").await, None);

    {
        let tx = c.transaction().await.unwrap();
        assert!(actions::uncordon(&*tx, node).await.unwrap());
        tx.commit().await.unwrap();
    }
    settle(&h).await;
    assert_eq!(since(&c, node, "Cordoned").await, None);
    assert_eq!(
        announced(&c, node).await,
        vec![("Disconnected".to_owned(), true), ("Cordoned".to_owned(), true), ("Cordoned".to_owned(), false)]
    );
    let recorded: i64 = c.query_one("SELECT count(*) FROM node_conditions WHERE node_id = $1 AND type = 'Cordoned'", &[node]).await.unwrap().get(0);
    assert_eq!(recorded, 0, "an ended condition is forgotten");
}

#[tokio::test]
async fn converging_and_ready_say_since_when_the_node_last_flipped_and_are_not_announced() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = &f.nodes[0];
    let mut c = h.db().client().await;
    {
        let tx = c.transaction().await.unwrap();
        actions::set_liveness(&*tx, node, "connected").await.unwrap();
        tx.commit().await.unwrap();
    }
    h.db().advance(Duration::from_secs(5)).await;
    let bumped_at = now(&c).await;
    c.execute("UPDATE nodes SET generation = generation + 1 WHERE id = $1", &[node]).await.unwrap();
    h.db().advance(Duration::from_secs(5)).await;
    // Another desired-state change while converging does not move the since.
    c.execute("UPDATE nodes SET generation = generation + 1 WHERE id = $1", &[node]).await.unwrap();
    h.db().advance(Duration::from_secs(20)).await;
    assert_eq!(since(&c, node, "Converging").await.as_deref(), Some(bumped_at.as_str()));
    assert_eq!(since(&c, node, "Ready").await, None);

    let converged_at = now(&c).await;
    let generation: i64 = c.query_one("SELECT generation FROM nodes WHERE id = $1", &[node]).await.unwrap().get(0);
    {
        let tx = c.transaction().await.unwrap();
        inventory::report_observed_generation(&*tx, node, generation).await.unwrap();
        tx.commit().await.unwrap();
    }
    h.db().advance(Duration::from_secs(30)).await;
    assert_eq!(since(&c, node, "Ready").await.as_deref(), Some(converged_at.as_str()));
    assert_eq!(since(&c, node, "Converging").await, None);

    // The job records both, but announces neither: they follow every desired-state change.
    work_queue::enqueue(&**c, &NODE_KIND, node).await.unwrap();
    settle(&h).await;
    let recorded: Vec<String> =
        c.query("SELECT type FROM node_conditions WHERE node_id = $1 ORDER BY type", &[node]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(recorded, vec!["Ready"]);
    assert_eq!(announced(&c, node).await, Vec::<(String, bool)>::new());
}

#[tokio::test]
async fn a_gpus_quarantine_wakes_the_node_job_and_its_since_is_the_quarantines() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = &f.nodes[0];
    let mut c = h.db().client().await;
    settle(&h).await;
    h.db().advance(Duration::from_secs(7)).await;
    let at = now(&c).await;
    {
        let tx = c.transaction().await.unwrap();
        actions::quarantine(&*tx, &f.gpus[0][1], "fan noise").await.unwrap();
        tx.commit().await.unwrap();
    }
    settle(&h).await;
    h.db().advance(Duration::from_secs(100)).await;
    assert_eq!(since(&c, node, "QuarantinedGpus").await.as_deref(), Some(at.as_str()));
    assert_eq!(announced(&c, node).await.last(), Some(&("QuarantinedGpus".to_owned(), true)));
}

#[tokio::test]
async fn a_resync_wakes_only_the_nodes_whose_record_may_be_behind() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 1).await;
    let mut c = h.db().client().await;
    {
        let tx = c.transaction().await.unwrap();
        for n in &f.nodes {
            actions::set_liveness(&*tx, n, "connected").await.unwrap();
        }
        assert!(actions::cordon(&*tx, &f.nodes[1]).await.unwrap());
        actions::quarantine(&*tx, &f.gpus[2][0], "fan").await.unwrap();
        tx.commit().await.unwrap();
    }
    settle(&h).await;
    c.execute("DELETE FROM work_queue WHERE kind = 'node'", &[]).await.unwrap();
    h.job("node").tick().await;
    h.db().advance(Duration::from_secs(11 * 60)).await;
    h.worker().maintain().await.unwrap();
    let mut queued: Vec<String> =
        c.query("SELECT key FROM work_queue WHERE kind = 'node'", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    queued.sort();
    let mut want = vec![f.nodes[1].clone(), f.nodes[2].clone()];
    want.sort();
    assert_eq!(queued, want, "the cordoned node and the one with a quarantined GPU; not the healthy one");
}
