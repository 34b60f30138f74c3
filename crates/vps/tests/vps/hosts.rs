//! vps hosts against a real PostgreSQL: a new vps-host node is bootstrapped by a `vps.bootstrap`
//! command and kept out of placement (tainted `vps/not-ready`) until its report says it can run
//! VMs; a report with problems leaves it degraded with them; bootstraps that keep failing give up
//! after three attempts, degraded.

use crate::common;

use better_compute_audit::Actor;
use std::sync::Arc;

use better_compute_capacity::CapacityModule;
use better_compute_nodes::commands;
use better_compute_nodes::inventory::reports::Report;
use better_compute_nodes::NodesModule;
use better_compute_runtime::harness::Harness;
use better_compute_vps::hosts::{self, NOT_READY_TAINT};
use better_compute_vps::VpsModule;
use common::*;
use serde_json::json;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

const DIGEST_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const DIGEST_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// Sets a catalogue image (from images.example) in a transaction of its own.
async fn set_image(h: &Harness, name: &str, sha256: &str) -> better_compute_vps::images::ImageView {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let req = better_compute_vps::images::SetImage { name: name.into(), url: format!("https://images.example/{name}.qcow2"), sha256: sha256.into() };
    let v = better_compute_vps::images::set(&*tx, &req).await.unwrap();
    tx.commit().await.unwrap();
    v
}

async fn harness() -> Harness {
    Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await
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
    set_image(&h, "debian-12", DIGEST_A).await;
    let (pool, node) = host(&h).await;
    run_jobs(&h).await;
    let (id, kind, payload) = bootstrap_command(&h, &node).await;
    assert_eq!((kind.as_str(), &payload), ("vps.bootstrap", &json!({"sources": [{"name": "debian-12", "url": "https://images.example/debian-12.qcow2", "sha256": DIGEST_A}]})));
    assert_eq!(host_state(&h, &node).await, ("bootstrapping".into(), vec!["waiting for vps.bootstrap's report".into()], true));
    // Nothing is placed on it meanwhile.
    let req = one_gpu(&pool);
    let mut c = h.db().client().await;
    let res = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
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

#[tokio::test]
async fn a_change_of_the_image_catalogue_bootstraps_every_host_again_and_each_keeps_its_state_until_it_reports() {
    let h = harness().await;
    let (_, node) = host(&h).await;
    run_jobs(&h).await;
    let (first, _, payload) = bootstrap_command(&h, &node).await;
    assert_eq!(payload, json!({}), "an empty catalogue (the payload as the proto has it: no sources)");
    finish(&h, &node, &first, true, json!({"problems": [], "images": {}})).await;
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await.0, "ready");
    // An image joins the catalogue: the host is asked again, with it, and stays ready meanwhile.
    let v = set_image(&h, "debian-12", DIGEST_A).await;
    assert_eq!(v.version, 1);
    run_jobs(&h).await;
    let (second, _, payload) = bootstrap_command(&h, &node).await;
    assert_ne!(second, first);
    assert_eq!(payload["sources"][0]["sha256"], DIGEST_A);
    let sent: Vec<String> = h.db().client().await.query("SELECT actor_id FROM audit_entries WHERE action = 'commands.enqueue' ORDER BY position", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(sent, ["vps.bootstraps", "vps.bootstraps"], "each bootstrap command is the job's decision");
    assert_eq!(host_state(&h, &node).await, ("ready".into(), vec![], false), "no disruption before the new report");
    // Setting the same again changes nothing: no new generation, no new command.
    assert_eq!(set_image(&h, "debian-12", DIGEST_A).await.version, 1);
    run_jobs(&h).await;
    assert_eq!(bootstrap_command(&h, &node).await.0, second);
    // A new digest while the second runs: the second's report no longer counts, a third goes.
    set_image(&h, "debian-12", DIGEST_B).await;
    run_jobs(&h).await;
    let (third, _, payload) = bootstrap_command(&h, &node).await;
    assert!(third != second && payload["sources"][0]["sha256"] == DIGEST_B, "{payload}");
    finish(&h, &node, &second, true, json!({"problems": []})).await;
    run_jobs(&h).await;
    assert_eq!(bootstrap_command(&h, &node).await.0, third, "the old report is not taken for the new catalogue");
    // The host cannot fetch it: degraded, with the reason, out of placement.
    let why = "image debian-12: https://images.example/debian-12.qcow2 answered 404 Not Found";
    finish(&h, &node, &third, true, json!({"problems": [why]})).await;
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await, ("degraded".into(), vec![why.to_owned()], true));
    // Taken out of the catalogue: asked again, and ready once it says so.
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    better_compute_vps::images::delete(&*tx, "debian-12").await.unwrap();
    assert_eq!(better_compute_vps::images::delete(&*tx, "debian-12").await.unwrap_err().code, better_compute_core::ErrorCode::NotFound);
    tx.commit().await.unwrap();
    run_jobs(&h).await;
    let (fourth, _, payload) = bootstrap_command(&h, &node).await;
    assert_eq!(payload, json!({}));
    finish(&h, &node, &fourth, true, json!({"problems": []})).await;
    run_jobs(&h).await;
    assert_eq!(host_state(&h, &node).await, ("ready".into(), vec![], false));
    settle(&h).await;
    let events: Vec<String> = c.query("SELECT type FROM outbox WHERE type LIKE 'vps.image.%' ORDER BY txid, seq", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(events, ["vps.image.set", "vps.image.set", "vps.image.deleted"]);
    // Bad input is refused with a clear code and writes nothing.
    let tx = c.transaction().await.unwrap();
    for (name, url, sha) in [("Debian 12", "https://x/y", DIGEST_A), ("d", "ftp://x/y", DIGEST_A), ("d", "https://x/y", "ABC")] {
        let req = better_compute_vps::images::SetImage { name: name.into(), url: url.into(), sha256: sha.into() };
        assert_eq!(better_compute_vps::images::set(&*tx, &req).await.unwrap_err().code, better_compute_core::ErrorCode::InvalidArgument, "{name} {url} {sha}");
    }
    drop(tx);
    assert_eq!(better_compute_vps::images::list(&**c).await.unwrap().len(), 0);
}
