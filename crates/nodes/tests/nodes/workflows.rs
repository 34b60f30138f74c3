//! Workflows in simulated time, driven by `tick()`: `node.maintenance` end to end, a crash at every
//! point of a run, cancel, hold and resume, retries with new command keys, a compensation, a
//! fleet-wide run that pauses on its first failure, and `node.recover` started by the health job.
//! (The engine is the runtime's, the definitions the nodes module's; the drains they wait on need
//! capacity's occupants, so the tests live with the fleet fixture.)


use better_compute_audit::Actor;
use std::sync::Arc;
use std::time::Duration;

use better_compute_capacity::reservations;
use better_compute_nodes::drain::{self, DrainMode, DrainRequest};
use better_compute_nodes::sessions::{self, Hello};
use better_compute_nodes::{commands, health};
use better_compute_proto::v1::{GpuHealth, Health};
use better_compute_runtime::harness::Harness;
use better_compute_runtime::signing::CommandSigner;
use better_compute_workflows::{self as workflow, NewWorkflow, Target, WorkflowView};
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn signed_harness() -> Harness {
    let h = harness().await;
    assert!(h.registry().install_command_signer(Arc::new(CommandSigner::generate())));
    h
}

/// The node's daemon connects with `boot`.
async fn connect(h: &Harness, node: &str, boot: &str) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    sessions::open(&*tx, &Hello { node_id: node, gateway_id: "gw_t", boot_id: boot, journal_id: "j1", daemon_version: "t" }).await.unwrap();
    tx.commit().await.unwrap();
}

async fn start(h: &Harness, target: Target, params: serde_json::Value) -> String {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let w = NewWorkflow { definition: "node.maintenance", target: &target, params: &params, requested_by: "ten_ops/idn_ops" };
    let v = workflow::start(&tx, h.registry(), &w).await.unwrap();
    tx.commit().await.unwrap();
    v.id
}

fn on(node: &str) -> Target {
    Target { node_id: Some(node.to_owned()), ..Target::default() }
}

async fn get(h: &Harness, id: &str) -> WorkflowView {
    workflow::get(&**h.db().client().await, id).await.unwrap()
}

fn step_states(w: &WorkflowView) -> Vec<(String, String)> {
    w.steps.iter().map(|s| (s.name.clone(), s.state.clone())).collect()
}

/// Runs the workflow and drain jobs until neither has work, then lets 11 s pass (a wait looks
/// again every 10 s) and runs them again, twice.
async fn run(h: &Harness) {
    for round in 0..3 {
        if round > 0 {
            h.db().advance(Duration::from_secs(11)).await;
        }
        for _ in 0..10 {
            let a = h.job("workflow").drain(20).await;
            let b = h.job("drain").drain(5).await;
            if a + b == 0 {
                break;
            }
        }
    }
}

/// The commands of a workflow's steps on `node`, by idempotency key.
async fn commands_of(h: &Harness, node: &str, id: &str) -> Vec<(String, String, String, bool)> {
    let c = h.db().client().await;
    c.query(
        "SELECT idempotency_key, kind, state, signature IS NOT NULL FROM commands WHERE node_id = $1 AND idempotency_key LIKE $2 ORDER BY seq",
        &[&node, &format!("wf:{id}:%")],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// The daemon finishes the command with this key.
async fn finish(h: &Harness, node: &str, key: &str, ok: bool, result: serde_json::Value) {
    let mut c = h.db().client().await;
    let id: String = c.query_one("SELECT id FROM commands WHERE node_id = $1 AND idempotency_key = $2", &[&node, &key]).await.unwrap().get(0);
    let tx = c.transaction().await.unwrap();
    // As a daemon would have it: sent, then running (the state table's edges).
    tx.execute("UPDATE commands SET state = 'sent' WHERE id = $1 AND state = 'pending'", &[&id]).await.unwrap();
    tx.execute("UPDATE commands SET state = 'running' WHERE id = $1 AND state = 'sent'", &[&id]).await.unwrap();
    commands::finish(&*tx, &id, ok, (!ok).then_some("exit 1"), &result).await.unwrap();
    tx.commit().await.unwrap();
}

/// The reboot with this key was sent, and the node comes back with a new boot.
async fn reboot_lands(h: &Harness, node: &str, key: &str, boot: &str) {
    let c = h.db().client().await;
    assert_eq!(c.execute("UPDATE commands SET state = 'sent' WHERE node_id = $1 AND idempotency_key = $2 AND state = 'pending'", &[&node, &key]).await.unwrap(), 1);
    connect(h, node, boot).await;
}

fn diag_result(gpus: &[String], failed: Option<&str>) -> serde_json::Value {
    serde_json::json!({"backend": "fake", "gpus": gpus.iter().map(|g| serde_json::json!({"uuid": g, "passed": Some(g.as_str()) != failed})).collect::<Vec<_>>()})
}

async fn no_schedule_reasons(h: &Harness, node: &str) -> Vec<String> {
    h.db().client().await.query_one("SELECT no_schedule_reasons FROM nodes WHERE id = $1", &[&node]).await.unwrap().get(0)
}

/// Drives one node's maintenance to its end with a healthy check.
async fn drive_healthy(h: &Harness, node: &str, gpus: &[String], id: &str, boot: &str) {
    run(h).await;
    reboot_lands(h, node, &format!("wf:{id}:reboot.1"), boot).await;
    run(h).await;
    finish(h, node, &format!("wf:{id}:diag.1"), true, diag_result(gpus, None)).await;
    run(h).await;
}

#[tokio::test]
async fn node_maintenance_keeps_its_drains_first_deadline_while_the_drain_waits_for_it() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = &f.nodes[0];
    connect(&h, node, "boot-1").await;
    let mut c = h.db().client().await;
    let held = better_compute_capacity::reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(held.node_id.as_deref(), Some(node.as_str()));
    let id = start(&h, on(node), serde_json::json!({"reason": "bios", "drainDeadlineS": 300})).await;
    // The drain step runs every 10 s while the drain waits for its deadline; each run would
    // compute a later one.
    for _ in 0..5 {
        run(&h).await;
    }
    let w = get(&h, &id).await;
    assert_eq!((w.state.as_str(), w.current_step.as_deref()), ("running", Some("drain")), "{:?}", step_states(&w));
    h.db().advance(Duration::from_secs(300)).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.current_step.as_deref(), Some("reboot"), "drained at the first deadline: {:?}", step_states(&w));
}

#[tokio::test]
async fn node_maintenance_drains_reboots_waits_for_the_new_boot_checks_and_uncordons() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = &f.nodes[0];
    connect(&h, node, "boot-1").await;
    let id = start(&h, on(node), serde_json::json!({"reason": "kernel upgrade"})).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.current_step.as_deref(), Some("reboot"), "{:?}", step_states(&w));
    assert_eq!(no_schedule_reasons(&h, node).await, vec!["draining".to_owned()]);
    let sent = commands_of(&h, node, &id).await;
    assert_eq!(sent, vec![(format!("wf:{id}:reboot.1"), "node.reboot".into(), "pending".into(), true)], "one signed reboot");
    // Runs while the reboot is out send nothing more.
    h.db().advance(Duration::from_secs(60)).await;
    run(&h).await;
    assert_eq!(commands_of(&h, node, &id).await.len(), 1);

    reboot_lands(&h, node, &format!("wf:{id}:reboot.1"), "boot-2").await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.current_step.as_deref(), Some("diag"), "{:?}", step_states(&w));
    assert_eq!(w.steps[1].memory["bootIdBefore"], "boot-1");
    assert_eq!(w.steps[2].memory["bootId"], "boot-2");
    finish(&h, node, &format!("wf:{id}:diag.1"), true, diag_result(&f.gpus[0], None)).await;
    run(&h).await;

    let w = get(&h, &id).await;
    assert_eq!(w.state, "succeeded", "{w:?}");
    assert_eq!(w.steps.len(), 6);
    assert!(w.steps.iter().all(|s| s.state == "succeeded" && s.attempts == 1), "{:?}", step_states(&w));
    assert!(no_schedule_reasons(&h, node).await.is_empty(), "uncordoned");
    let sent = commands_of(&h, node, &id).await;
    assert_eq!(sent.iter().map(|c| (c.1.as_str(), c.2.as_str())).collect::<Vec<_>>(), [("node.reboot", "succeeded"), ("diag.nvml", "succeeded")]);
    // Every step transition is an event: running and succeeded for each of six steps.
    settle_outbox(&h).await;
    let c = h.db().client().await;
    let n: i64 = c.query_one("SELECT count(*) FROM outbox WHERE type = 'workflow.stepChanged' AND subject = $1", &[&id]).await.unwrap().get(0);
    assert_eq!(n, 12);
    let ended: Vec<serde_json::Value> = c.query("SELECT data FROM outbox WHERE type = 'workflow.ended' AND subject = $1", &[&id]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0]["state"], "succeeded");
    // Each step's end and the workflow's are the workflow job's decisions in the audit log.
    let entries = job_entries(&h, &id).await;
    let mut want: Vec<(String, String, String, Option<String>)> =
        w.steps.iter().map(|s| ("workflow".into(), "workflows.stepSucceeded".into(), format!("{id}/{}", s.name), None)).collect();
    want.push(("workflow".into(), "workflows.succeeded".into(), id.clone(), None));
    assert_eq!(entries, want);
}

/// What a crash must leave unchanged: the workflow's row and steps, its commands and its events.
async fn snapshot(h: &Harness, node: &str, id: &str) -> (String, usize, i64) {
    let w = get(h, id).await;
    let events: i64 = h.db().client().await.query_one("SELECT count(*) FROM outbox WHERE subject = $1", &[&id]).await.unwrap().get(0);
    (format!("{} {:?} {:?}", w.version, w.current_step, w.steps), commands_of(h, node, id).await.len(), events)
}

/// Crashes the next run of the workflow at `point`, if the run passes it: nothing changes. Then
/// the jobs run as usual.
async fn crash_then_run(h: &Harness, node: &str, id: &str, point: &'static str) -> bool {
    let before = snapshot(h, node, id).await;
    workflow::crash::arm(point);
    h.job("workflow").tick().await;
    let crashed = !workflow::crash::armed(point);
    if crashed {
        assert_eq!(snapshot(h, node, id).await, before, "{point}: the crashed run changed nothing");
        h.db().advance(Duration::from_secs(2)).await;
    } else {
        // Not passed in this run: disarm it.
        while workflow::crash::armed(point) {
            workflow::crash::arm_clear(point);
        }
    }
    run(h).await;
    crashed
}

#[tokio::test]
async fn a_crash_at_any_point_of_a_run_never_sends_a_steps_command_twice_nor_skips_one() {
    let h = signed_harness().await;
    let points = workflow::crash::POINTS;
    let f = fleet(&h, &exclusive(points.len()), 2).await;
    let mut crashes = Vec::new();
    for (i, point) in points.iter().enumerate() {
        let mut crashed = 0;
        let (node, gpus) = (&f.nodes[i], &f.gpus[i]);
        connect(&h, node, "boot-1").await;
        let id = start(&h, on(node), serde_json::json!({"reason": "r"})).await;
        // A crash in each run: starting the drain, finishing it and sending the reboot, …
        crashed += u32::from(crash_then_run(&h, node, &id, point).await);
        crashed += u32::from(crash_then_run(&h, node, &id, point).await);
        let sent = commands_of(&h, node, &id).await;
        assert_eq!(sent.iter().map(|c| c.0.clone()).collect::<Vec<_>>(), [format!("wf:{id}:reboot.1")], "{point}");
        reboot_lands(&h, node, &format!("wf:{id}:reboot.1"), "boot-2").await;
        // … waiting for the node and sending the check, …
        crashed += u32::from(crash_then_run(&h, node, &id, point).await);
        assert_eq!(commands_of(&h, node, &id).await.len(), 2, "{point}");
        finish(&h, node, &format!("wf:{id}:diag.1"), true, diag_result(gpus, None)).await;
        // … and the verdict and the uncordon.
        crashed += u32::from(crash_then_run(&h, node, &id, point).await);
        run(&h).await;
        let w = get(&h, &id).await;
        assert_eq!(w.state, "succeeded", "{point}: {:?}", step_states(&w));
        assert!(w.steps.iter().all(|s| s.attempts == 1), "{point}: no step ran twice: {:?}", w.steps);
        let sent = commands_of(&h, node, &id).await;
        assert_eq!(sent.iter().map(|c| c.0.clone()).collect::<Vec<_>>(), [format!("wf:{id}:reboot.1"), format!("wf:{id}:diag.1")], "{point}");
        assert!(no_schedule_reasons(&h, node).await.is_empty(), "{point}");
        crashes.push((*point, crashed));
    }
    // Every point was passed, and crashed, by at least two of the four runs.
    assert!(crashes.iter().all(|(_, n)| *n >= 2), "{crashes:?}");
}

#[tokio::test]
async fn a_cancelled_workflow_cancels_its_steps_command_and_stops() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = &f.nodes[0];
    connect(&h, node, "boot-1").await;
    let id = start(&h, on(node), serde_json::json!({"reason": "r"})).await;
    run(&h).await;
    assert_eq!(commands_of(&h, node, &id).await.len(), 1);
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        assert_eq!(workflow::cancel(&tx, &id, "ten_ops/idn_ops").await.unwrap().state, "cancelling");
        // Twice is harmless.
        assert_eq!(workflow::cancel(&tx, &id, "ten_ops/idn_ops").await.unwrap().state, "cancelling");
        tx.commit().await.unwrap();
    }
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.state, "cancelled");
    assert_eq!(step_states(&w)[1..3], [("reboot".to_owned(), "cancelled".to_owned()), ("wait-ready".to_owned(), "cancelled".to_owned())]);
    assert_eq!(commands_of(&h, node, &id).await[0].2, "cancelled", "the pending reboot is never sent");
    // Nothing runs after a cancel; the node stays drained for the operator to decide.
    h.db().advance(Duration::from_secs(600)).await;
    run(&h).await;
    assert_eq!(commands_of(&h, node, &id).await.len(), 1);
    assert_eq!(no_schedule_reasons(&h, node).await, vec!["draining".to_owned()]);
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let e = workflow::cancel(&tx, &id, "x").await.unwrap_err();
    assert!(e.to_string().contains("cannot become cancelling"), "{e}");
    // The workflow job's cancel of its step's command and its end are in the audit log.
    let reboot = tx.query_one("SELECT id FROM commands WHERE idempotency_key = $1", &[&format!("wf:{id}:reboot.1")]).await.unwrap().get::<_, String>(0);
    let cancelled = job_entries(&h, &reboot).await;
    assert_eq!(cancelled.iter().map(|e| e.1.as_str()).collect::<Vec<_>>(), ["commands.enqueue", "commands.cancel"], "{cancelled:?}");
    let ended: Vec<String> = job_entries(&h, &id).await.into_iter().map(|e| e.1).collect();
    assert_eq!(ended, ["workflows.stepSucceeded", "workflows.cancelled"]);
}

#[tokio::test]
async fn a_failed_check_quarantines_the_gpu_and_holds_and_a_resume_goes_on() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = &f.nodes[0];
    connect(&h, node, "boot-1").await;
    let id = start(&h, on(node), serde_json::json!({"reason": "r"})).await;
    run(&h).await;
    reboot_lands(&h, node, &format!("wf:{id}:reboot.1"), "boot-2").await;
    run(&h).await;
    let bad = f.gpus[0][1].clone();
    finish(&h, node, &format!("wf:{id}:diag.1"), true, diag_result(&f.gpus[0], Some(&bad))).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!((w.state.as_str(), w.reason.as_deref(), w.current_step.as_deref()), ("held", Some("UNHEALTHY"), Some("verdict")));
    let q: Vec<(String, bool)> = h.db().client().await.query("SELECT id, quarantined FROM devices WHERE node_id = $1 AND parent_id IS NULL ORDER BY id", &[&node]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(q.len(), 2);
    assert!(q.iter().all(|(g, quarantined)| *quarantined == (*g == bad)), "{q:?}");
    assert_eq!(no_schedule_reasons(&h, node).await, vec!["draining".to_owned()], "held with the node drained");
    // Held: runs change nothing.
    h.db().advance(Duration::from_secs(3600)).await;
    run(&h).await;
    assert_eq!(get(&h, &id).await.state, "held");

    // The operator repaired it: resume from diag, which checks again with a new command key.
    let mut c = h.db().client().await;
    {
        let tx = c.transaction().await.unwrap();
        let e = workflow::resume(&tx, h.registry(), &id, Some("nope"), "ops").await.unwrap_err();
        assert!(e.to_string().contains("has no step"), "{e}");
    }
    let tx = c.transaction().await.unwrap();
    let w = workflow::resume(&tx, h.registry(), &id, Some("diag"), "ops").await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((w.state.as_str(), w.current_step.as_deref()), ("running", Some("diag")));
    run(&h).await;
    finish(&h, node, &format!("wf:{id}:diag.2"), true, diag_result(&f.gpus[0], None)).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.state, "succeeded", "{:?}", step_states(&w));
    assert!(no_schedule_reasons(&h, node).await.is_empty());
    let keys: Vec<String> = commands_of(&h, node, &id).await.into_iter().map(|c| c.0).collect();
    assert_eq!(keys, [format!("wf:{id}:reboot.1"), format!("wf:{id}:diag.1"), format!("wf:{id}:diag.2")]);
}

#[tokio::test]
async fn a_failed_reboot_is_retried_after_its_backoff_with_a_new_key_then_holds() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = &f.nodes[0];
    connect(&h, node, "boot-1").await;
    let id = start(&h, on(node), serde_json::json!({"reason": "r"})).await;
    run(&h).await;
    finish(&h, node, &format!("wf:{id}:reboot.1"), false, serde_json::json!({})).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!((w.steps[1].state.as_str(), w.steps[1].reason.as_deref()), ("retrying", Some("COMMAND_FAILED")));
    assert_eq!(commands_of(&h, node, &id).await.len(), 1, "no second reboot before the back-off");
    h.db().advance(Duration::from_secs(61)).await;
    run(&h).await;
    let sent = commands_of(&h, node, &id).await;
    assert_eq!(sent.iter().map(|c| c.0.clone()).collect::<Vec<_>>(), [format!("wf:{id}:reboot.1"), format!("wf:{id}:reboot.2")]);
    finish(&h, node, &format!("wf:{id}:reboot.2"), false, serde_json::json!({})).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!((w.state.as_str(), w.steps[1].state.as_str(), w.steps[1].attempts), ("held", "failed", 2));
    assert_eq!(no_schedule_reasons(&h, node).await, vec!["draining".to_owned()]);
}

#[tokio::test]
async fn a_drain_that_cannot_start_runs_the_uncordon_compensation_and_fails_leaving_the_operators_drain() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = &f.nodes[0];
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        drain::request(&*tx, &DrainRequest { node_id: node, reason: "rack move", mode: DrainMode::Wait, deadline: None, requested_by: "ops" }).await.unwrap();
        tx.commit().await.unwrap();
    }
    let id = start(&h, on(node), serde_json::json!({"reason": "r"})).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!((w.state.as_str(), w.reason.as_deref()), ("failed", Some("DRAIN_CONFLICT")), "{w:?}");
    assert_eq!(step_states(&w).iter().map(|s| s.1.as_str()).collect::<Vec<_>>(), ["failed", "skipped", "skipped", "skipped", "skipped", "succeeded"]);
    assert_eq!(w.steps[5].memory["undrained"], false, "not its drain to end");
    let open = drain::open_drain(&**h.db().client().await, node).await.unwrap().unwrap();
    assert_eq!(open.reason, "rack move");
}

async fn kids(h: &Harness, id: &str) -> Vec<WorkflowView> {
    let f = workflow::ListFilter { parent_id: Some(id.to_owned()), ..Default::default() };
    workflow::list(&**h.db().client().await, &f, "", 100).await.unwrap()
}

#[tokio::test]
async fn a_fleet_wide_run_goes_node_by_node_and_pauses_on_the_first_failure() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(3), 1).await;
    for n in &f.nodes {
        connect(&h, n, "boot-1").await;
    }
    let target = Target { pool_id: Some(f.pool_id.clone()), ..Target::default() };
    let id = start(&h, target, serde_json::json!({"reason": "r", "parallel": 1})).await;
    run(&h).await;
    let k = kids(&h, &id).await;
    assert_eq!(k.len(), 1, "one node at a time");
    assert_eq!(k[0].node_id.as_deref(), Some(f.nodes[0].as_str()));
    drive_healthy(&h, &f.nodes[0], &f.gpus[0], &k[0].id, "boot-2").await;
    let k = kids(&h, &id).await;
    assert_eq!(k.iter().map(|w| w.state.as_str()).collect::<Vec<_>>(), ["succeeded", "running"]);
    assert_eq!(k[1].node_id.as_deref(), Some(f.nodes[1].as_str()));
    // The second node's reboot fails twice: it holds, and so does the run, before the third.
    for attempt in 1..=2 {
        finish(&h, &f.nodes[1], &format!("wf:{}:reboot.{attempt}", k[1].id), false, serde_json::json!({})).await;
        run(&h).await;
        h.db().advance(Duration::from_secs(61)).await;
        run(&h).await;
    }
    let parent = get(&h, &id).await;
    assert_eq!((parent.state.as_str(), parent.reason.as_deref()), ("held", Some("NODE_HELD")), "{parent:?}");
    let counts = parent.children.clone().unwrap();
    assert_eq!((counts.started, counts.succeeded, counts.held), (2, 1, 1));
    assert_eq!(kids(&h, &id).await.len(), 2, "paused before the third node");
    // Cancelling the run cancels the held child.
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        workflow::cancel(&tx, &id, "ops").await.unwrap();
        tx.commit().await.unwrap();
    }
    run(&h).await;
    assert_eq!(get(&h, &id).await.state, "cancelled");
    assert_eq!(kids(&h, &id).await.iter().map(|w| w.state.as_str()).collect::<Vec<_>>(), ["succeeded", "cancelled"]);
    // Each node was rebooted at most once per attempt its step made.
    let reboots: i64 = h.db().client().await.query_one("SELECT count(*) FROM commands WHERE kind = 'node.reboot'", &[]).await.unwrap().get(0);
    assert_eq!(reboots, 3);
}

#[tokio::test]
async fn the_health_job_starts_node_recover_for_a_held_gpu_which_resets_it_once_it_is_free() {
    let h = signed_harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let (node, gpu) = (&f.nodes[0], f.gpus[0][0].clone());
    let mut c = h.db().client().await;
    c.execute("UPDATE pools SET health_breaker_percent = 100 WHERE id = $1", &[&f.pool_id]).await.unwrap();
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    {
        let tx = c.transaction().await.unwrap();
        let g = GpuHealth { uuid: gpu.clone(), healthy: false, reason: "ECC".into(), ecc_uncorrected: 1, remapped_rows: 1, remap_pending: true, ..Default::default() };
        health::record(&*tx, node, &Health { gpus: vec![g] }).await.unwrap();
        tx.commit().await.unwrap();
    }
    h.job("health").drain(5).await;
    let open = workflow::list(&**c, &workflow::ListFilter { node_id: Some(node.clone()), ..Default::default() }, "", 10).await.unwrap();
    assert_eq!(open.len(), 1);
    let id = open[0].id.clone();
    assert_eq!((open[0].definition.as_str(), open[0].params["gpuUuid"].as_str()), ("node.recover", Some(gpu.as_str())));
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.current_step.as_deref(), Some("wait-free"));
    assert!(w.steps[0].message.as_deref().unwrap_or("").contains("held"), "{w:?}");
    // The health job's next pass starts no second one.
    health::check_now(&**c, node, &gpu).await.unwrap();
    h.job("health").drain(5).await;
    assert_eq!(workflow::list(&**c, &workflow::ListFilter { node_id: Some(node.clone()), ..Default::default() }, "", 10).await.unwrap().len(), 1);

    reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    h.db().advance(Duration::from_secs(61)).await;
    run(&h).await;
    let sent = commands_of(&h, node, &id).await;
    assert_eq!(sent.len(), 1);
    let payload: serde_json::Value = c.query_one("SELECT payload FROM commands WHERE idempotency_key = $1", &[&sent[0].0]).await.unwrap().get(0);
    assert_eq!((payload["reset"].as_bool(), payload["gpuUuids"][0].as_str()), (Some(true), Some(gpu.as_str())));
    finish(&h, node, &sent[0].0, true, diag_result(std::slice::from_ref(&gpu), None)).await;
    run(&h).await;
    let w = get(&h, &id).await;
    assert_eq!(w.state, "succeeded", "{:?}", step_states(&w));
    assert_eq!(w.steps[1].memory["passed"], true);
}
