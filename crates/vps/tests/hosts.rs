//! vps hosts against a real PostgreSQL: a new vps-host node is bootstrapped by a `vps.bootstrap`
//! command and kept out of placement (tainted `vps/not-ready`) until its report says it can run
//! VMs; a report with problems leaves it degraded with them; bootstraps that keep failing give up
//! after three attempts, degraded.

mod common;

use std::sync::Arc;

use better_compute_capacity::CapacityModule;
use better_compute_nodes::commands;
use better_compute_nodes::reports::Report;
use better_compute_nodes::NodesModule;
use better_compute_runtime::harness::Harness;
use better_compute_vps::hosts::{self, NOT_READY_TAINT};
use better_compute_vps::VpsModule;
use common::*;
use serde_json::json;

async fn harness() -> Harness {
    Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule)]).await
}

/// The node's bootstrap command now: its id, kind and payload.
async fn bootstrap_command(h: &Harness, node: &str) -> (String, String, serde_json::Value) {
    let r = h
        .db()
        .client()
        .await
        .query_one("SELECT c.id, c.kind, c.payload FROM vps_hosts v JOIN commands c ON c.id = v.bootstrap_command_id WHERE v.node_id = $1", &[&node])
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// The daemon runs the command and reports its end.
async fn finish(h: &Harness, node: &str, id: &str, succeeded: bool, result: serde_json::Value) {
    commands::mark_sent(&**h.db().client().await, id).await.unwrap();
    let reason = (!succeeded).then(|| "no hypervisor answered".to_owned());
    apply(h, node, vec![Report::Ack { command_id: id.into() }, Report::Result { command_id: id.into(), succeeded, reason, result }]).await;
}

async fn host_state(h: &Harness, node: &str) -> (String, Vec<String>, bool) {
    let hosts = hosts::list(&**h.db().client().await).await.unwrap();
    let v = hosts.iter().find(|v| v.node_id == node).unwrap_or_else(|| panic!("no vps host {node}: {hosts:?}"));
    let taints: serde_json::Value = h.db().client().await.query_one("SELECT taints FROM nodes WHERE id = $1", &[&node]).await.unwrap().get(0);
    let tainted = taints.as_array().unwrap().iter().any(|t| t["key"] == NOT_READY_TAINT);
    (v.state.clone(), v.reasons.clone(), tainted)
}

/// Runs the host jobs, and what their events wake, until nothing is due.
async fn run_jobs(h: &Harness) {
    for _ in 0..3 {
        settle(h).await;
        h.job("event-subscribers").drain(20).await;
        h.job("vps.bootstraps").drain(10).await;
        h.job("vps.hosts").drain(10).await;
    }
}

#[tokio::test]
async fn a_new_host_stays_out_of_placement_until_its_bootstrap_says_it_can_run_vms() {
    let h = harness().await;
    hosts::set_required_images(&**h.db().client().await, &["debian-12".to_owned()]).await.unwrap();
    let (pool, node) = host(&h).await;
    run_jobs(&h).await;
    let (id, kind, payload) = bootstrap_command(&h, &node).await;
    assert_eq!((kind.as_str(), &payload), ("vps.bootstrap", &json!({"images": ["debian-12"]})));
    assert_eq!(host_state(&h, &node).await, ("bootstrapping".into(), vec!["waiting for vps.bootstrap's report".into()], true));
    // Nothing is placed on it meanwhile.
    let req = one_gpu(&pool);
    let mut c = h.db().client().await;
    let res = better_compute_capacity::reservations::create(&mut c, ME, &req).await.unwrap();
    assert_eq!(res.state, "pending", "{res:?}");
    // Its report: the image is there, nothing wrong.
    finish(&h, &node, &id, true, json!({"hypervisor": "qemu", "kvm": true, "problems": [], "images": {"debian-12": {"present": true}}})).await;
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await, ("ready".into(), vec![], false));
    // Ready: the pending reservation is placed at its next try.
    h.db().advance(std::time::Duration::from_secs(31)).await;
    h.job("capacity.reservations").drain(10).await;
    let placed = better_compute_capacity::reservations::get(&**h.db().client().await, ME, &res.id).await.unwrap();
    assert_eq!((placed.state.as_str(), placed.node_id.as_deref()), ("active", Some(node.as_str())), "placed, and its start has come");
    let hosts = hosts::list(&**h.db().client().await).await.unwrap();
    assert_eq!(hosts.len(), 1);
    // What it has left, its reservation's share taken (the rollup of free capacity follows the
    // placement at the host's next run).
    run_jobs(&h).await;
    let hosts = hosts::list(&**h.db().client().await).await.unwrap();
    assert_eq!(hosts[0].free["vcpu"], 60, "{:?}", hosts[0].free);
    assert_eq!(hosts[0].free["atoms"]["gpu/H100-80GB"], 1, "{:?}", hosts[0].free);
    // A cordon makes it draining, without the taint (the cordon keeps placement off).
    better_compute_nodes::actions::cordon(&**c, &node).await.unwrap();
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await.0, "draining");
    settle(&h).await;
    let events: Vec<String> = c.query("SELECT type FROM outbox WHERE type LIKE 'vps.host.%' AND subject = $1 ORDER BY txid, seq", &[&node]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(events, ["vps.host.bootstrapping", "vps.host.ready", "vps.host.draining"]);
}

#[tokio::test]
async fn a_host_whose_report_names_problems_is_degraded_with_them_and_failing_bootstraps_give_up_after_three() {
    let h = harness().await;
    let (_, node) = host(&h).await;
    run_jobs(&h).await;
    let (id, _, _) = bootstrap_command(&h, &node).await;
    finish(&h, &node, &id, true, json!({"problems": ["/dev/kvm: No such file or directory"]})).await;
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await, ("degraded".into(), vec!["/dev/kvm: No such file or directory".into()], true));

    // Another host whose bootstraps fail every time.
    let h = harness().await;
    let (_, node) = host(&h).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        run_jobs(&h).await;
        let (id, _, _) = bootstrap_command(&h, &node).await;
        assert!(!seen.contains(&id), "a new command for each attempt");
        seen.push(id.clone());
        finish(&h, &node, &id, false, serde_json::Value::Null).await;
    }
    run_jobs(&h).await;
    let (state, reasons, tainted) = host_state(&h, &node).await;
    assert_eq!((state.as_str(), reasons.len(), tainted), ("degraded", 1, true));
    assert!(reasons[0].contains("after 3 attempts") && reasons[0].contains("no hypervisor answered"), "{reasons:?}");
    assert_eq!(seen.len(), 3);
}
