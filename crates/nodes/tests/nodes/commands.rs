//! The command queue against a real PostgreSQL in simulated time: enqueue, seq, lifecycle, BUSY
//! back-off, cancel, the sweeper, reconnect rules, commands.run, and the generated reference page.

use better_compute_audit::Actor;
use std::sync::Arc;
use std::time::Duration;

use better_compute_core::{Caller, ErrorCode};
use better_compute_nodes::commands::{self, NewCommand, Rejection, RunCommand};
use better_compute_nodes::inventory::{self, NewGpu, NewNode, NewPool};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_nodes::NodesModule;
use better_compute_runtime::harness::Harness;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn setup() -> (Harness, String) {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let site = inventory::create_site(&*tx, "s").await.unwrap();
    let pool = inventory::create_pool(
        &*tx,
        &NewPool { site_id: site, name: "p".into(), kind: "bare-metal".into(), vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
    )
    .await
    .unwrap();
    let node = inventory::register_node(
        &*tx,
        &NewNode {
            pool_id: pool,
            name: "n".into(),
            labels: Default::default(),
            vcpu: 8,
            memory_mib: 1024,
            disk_gib: 10,
            gpus: vec![NewGpu { uuid: "GPU-1".into(), model: "H100".into(), memory_mib: 81_920, mode: GpuMode::Exclusive }],
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert!(h.registry().install_command_signer(std::sync::Arc::new(better_compute_runtime::signing::CommandSigner::generate())));
    (h, node)
}

fn cmd<'a>(node: &'a str, kind: &'a str, payload: &'a serde_json::Value, key: &'a str) -> NewCommand<'a> {
    NewCommand {
        node_id: node,
        kind,
        payload,
        idempotency_key: key,
        not_after: Some(Duration::from_secs(600)),
        min_generation: 0,
        owner: None,
        actor: &TEST_ACTOR,
    }
}

async fn count(h: &Harness, sql: &str) -> i64 {
    h.db().client().await.query_one(sql, &[]).await.unwrap().get(0)
}

fn code(e: better_compute_db::DbError) -> ErrorCode {
    better_compute_core::Error::from(e).code
}

#[tokio::test]
async fn enqueue_is_idempotent_needs_not_after_and_refuses_unknown_kinds_and_bad_payloads() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let c = h.db().client().await;
    let p = serde_json::json!({"sections": ["gpus"], "rescan": true});
    let a = commands::enqueue(&**c, &r, cmd(&node, "inventory.refresh", &p, "refresh-1")).await.unwrap();
    assert_eq!((a.seq, a.state.as_str()), (1, "pending"));
    assert_eq!(a.payload, p);
    let again = commands::enqueue(&**c, &r, cmd(&node, "inventory.refresh", &p, "refresh-1")).await.unwrap();
    assert_eq!(again, a);
    let mut no_deadline = cmd(&node, "inventory.refresh", &p, "refresh-2");
    no_deadline.not_after = None;
    assert_eq!(code(commands::enqueue(&**c, &r, no_deadline).await.unwrap_err()), ErrorCode::InvalidArgument);
    assert_eq!(code(commands::enqueue(&**c, &r, cmd(&node, "disk.wipe", &p, "x")).await.unwrap_err()), ErrorCode::Unsupported);
    let bad = serde_json::json!({"sections": ["gpus"], "rescn": true});
    assert_eq!(code(commands::enqueue(&**c, &r, cmd(&node, "inventory.refresh", &bad, "y")).await.unwrap_err()), ErrorCode::InvalidArgument);
    let bad = serde_json::json!({"sections": ["kernels"]});
    assert_eq!(code(commands::enqueue(&**c, &r, cmd(&node, "inventory.refresh", &bad, "z")).await.unwrap_err()), ErrorCode::InvalidArgument);
    assert_eq!(code(commands::enqueue(&**c, &r, cmd(&node, "node.reboot", &serde_json::Value::Null, "w")).await.unwrap_err()), ErrorCode::InvalidArgument);
    assert_eq!(count(&h, "SELECT count(*) FROM commands").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seq_strictly_increases_per_node_under_concurrent_enqueues() {
    let (h, node) = setup().await;
    let mut tasks = Vec::new();
    for i in 0..30 {
        let (pool, r, node) = (h.db().pool.clone(), h.registry().clone(), node.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = pool.get().await.unwrap();
            let tx = c.transaction().await.unwrap();
            let p = serde_json::json!({});
            let v = commands::enqueue(&*tx, &r, cmd(&node, "diag.nvml", &p, &format!("k{i}"))).await.unwrap();
            tx.commit().await.unwrap();
            v.seq
        }));
    }
    let mut seqs = Vec::new();
    for t in tasks {
        seqs.push(tokio::time::timeout(Duration::from_secs(30), t).await.expect("hung").unwrap());
    }
    seqs.sort();
    assert_eq!(seqs, (1..=30).collect::<Vec<i64>>());
}

#[tokio::test]
async fn busy_sends_the_command_back_with_a_jittered_back_off_from_one_to_thirty_seconds() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let c = h.db().client().await;
    let v = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &serde_json::json!({}), "d")).await.unwrap();
    let mut waits = Vec::new();
    for _ in 0..7 {
        commands::mark_sent(&**c, &v.id).await.unwrap();
        let back = commands::reject(&**c, &v.id, Rejection::Busy).await.unwrap();
        assert_eq!(back.state, "pending");
        let secs: f64 = c
            .query_one("SELECT extract(epoch FROM not_before - compute_now())::float8 FROM commands WHERE id = $1", &[&v.id])
            .await
            .unwrap()
            .get(0);
        waits.push(secs);
    }
    // Each wait is a random point between 1, 2, 4 … s and twice that, never under 1 s nor over 30 s.
    for (wait, base) in waits.iter().zip([1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]) {
        assert!(*wait >= base && *wait <= f64::min(2.0 * base, 30.0), "{waits:?}");
    }
    assert_eq!(waits.len(), 7);
    // Twenty commands refused at the same instant come back at different instants.
    let mut at = std::collections::BTreeSet::new();
    for i in 0..20 {
        let b = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &serde_json::json!({}), &format!("busy-{i}"))).await.unwrap();
        commands::mark_sent(&**c, &b.id).await.unwrap();
        commands::reject(&**c, &b.id, Rejection::Busy).await.unwrap();
        let us: i64 = c.query_one("SELECT (extract(epoch FROM not_before) * 1e6)::int8 FROM commands WHERE id = $1", &[&b.id]).await.unwrap().get(0);
        at.insert(us);
    }
    assert!(at.len() >= 15, "{} distinct retry instants of 20", at.len());
    // Final rejections.
    commands::mark_sent(&**c, &v.id).await.unwrap();
    let failed = commands::reject(&**c, &v.id, Rejection::StaleGeneration).await.unwrap();
    assert_eq!((failed.state.as_str(), failed.reason.as_deref()), ("failed", Some("STALE_GENERATION")));
    let e = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &serde_json::json!({}), "e")).await.unwrap();
    commands::mark_sent(&**c, &e.id).await.unwrap();
    assert_eq!(commands::reject(&**c, &e.id, Rejection::Expired).await.unwrap().state, "expired");
}

#[tokio::test]
async fn cancel_never_sends_a_pending_command_marks_an_in_flight_one_and_leaves_a_finished_one() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let c = h.db().client().await;
    let p = serde_json::json!({});
    let pending = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &p, "a")).await.unwrap();
    assert_eq!(commands::cancel(&**c, &node, &pending.id).await.unwrap().state, "cancelled");
    assert_eq!(code(commands::mark_sent(&**c, &pending.id).await.unwrap_err()), ErrorCode::FailedPrecondition);
    let running = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &p, "b")).await.unwrap();
    commands::mark_sent(&**c, &running.id).await.unwrap();
    commands::acknowledge(&**c, &running.id).await.unwrap();
    let marked = commands::cancel(&**c, &node, &running.id).await.unwrap();
    assert_eq!((marked.state.as_str(), marked.cancel_requested), ("running", true));
    let done = commands::finish(&**c, &running.id, true, None, &serde_json::json!({"ok": true})).await.unwrap();
    assert_eq!(commands::cancel(&**c, &node, &done.id).await.unwrap(), done);
    // Each end was written to the outbox once, about its command.
    let ends: Vec<(String, String)> = c
        .query("SELECT type, subject FROM outbox WHERE type LIKE 'command.%' ORDER BY txid, seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(ends, [("command.cancelled".to_owned(), pending.id.clone()), ("command.succeeded".to_owned(), running.id.clone())]);
}

/// Waits (bounded) until some transaction of this database waits for a row lock.
async fn until_a_transaction_waits_for_a_lock(h: &Harness, what: &str) {
    let observer = h.db().client().await;
    tokio::time::timeout(Duration::from_secs(30), async {
        while observer
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'", &[])
            .await
            .unwrap()
            .is_none()
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} never waited for a lock"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The cancel helper hands back the cancel's task, spawned once it has its connection, for the
// round to await after the dispatch commits.
#[allow(clippy::async_yields_async)]
async fn a_cancel_racing_a_dispatch_never_reports_cancelled_for_a_command_that_was_sent() {
    use better_compute_nodes::sessions::{self, DispatchFor};
    let (h, _) = setup().await;
    let r = h.registry().clone();
    let nodes = nodes_with_sessions(&h, 1, "gw_a").await;
    let (node, epoch) = (nodes[0].0.clone(), nodes[0].1);
    let mut c = h.db().client().await;
    for (round, dispatch_first) in [(0, true), (1, false)] {
        let cmd_id = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &serde_json::json!({}), &format!("race{round}"))).await.unwrap().id;
        let cancel_in_tx = |node: String, id: String| {
            let h = &h;
            async move {
                let mut db = h.db().client().await;
                tokio::spawn(async move {
                    let tx = db.transaction().await.unwrap();
                    let v = commands::cancel(&*tx, &node, &id).await.unwrap();
                    tx.commit().await.unwrap();
                    v
                })
            }
        };
        let want = [DispatchFor { node_id: &node, epoch, limit: 64 }];
        let (view, dispatched) = if dispatch_first {
            // The dispatch has moved it to sent and not committed; the cancel comes in beside it.
            let tx = c.transaction().await.unwrap();
            let d = sessions::dispatch_many(&*tx, "gw_a", &want).await.unwrap();
            let cancel = cancel_in_tx(node.clone(), cmd_id.clone()).await;
            until_a_transaction_waits_for_a_lock(&h, "the cancel").await;
            tx.commit().await.unwrap();
            (tokio::time::timeout(Duration::from_secs(30), cancel).await.unwrap().unwrap(), d[&node].commands.len())
        } else {
            // The cancel holds the pending row; the dispatch waits for it, then skips it.
            let mut cc = h.db().client().await;
            let ctx = cc.transaction().await.unwrap();
            let v = commands::cancel(&*ctx, &node, &cmd_id).await.unwrap();
            let dispatch = {
                let db = h.db().client().await;
                let node = node.clone();
                tokio::spawn(async move {
                    let mut db = db;
                    let tx = db.transaction().await.unwrap();
                    let want = [DispatchFor { node_id: &node, epoch, limit: 64 }];
                    let d = sessions::dispatch_many(&*tx, "gw_a", &want).await.unwrap();
                    tx.commit().await.unwrap();
                    d[&node].commands.len()
                })
            };
            until_a_transaction_waits_for_a_lock(&h, "the dispatch").await;
            ctx.commit().await.unwrap();
            (v, tokio::time::timeout(Duration::from_secs(30), dispatch).await.unwrap().unwrap())
        };
        let (state, sent_at): (String, Option<std::time::SystemTime>) = {
            let row = c.query_one("SELECT state, sent_at FROM commands WHERE id = $1", &[&cmd_id]).await.unwrap();
            (row.get(0), row.get(1))
        };
        if dispatch_first {
            assert_eq!(dispatched, 1, "round {round}");
            assert_eq!((view.state.as_str(), view.cancel_requested), ("sent", true), "round {round}: a sent command is in flight, marked");
            assert_eq!(state, "sent", "round {round}");
        } else {
            assert_eq!(dispatched, 0, "round {round}: a cancelled command is never sent");
            assert_eq!(view.state, "cancelled", "round {round}");
            assert_eq!((state.as_str(), sent_at), ("cancelled", None), "round {round}");
        }
        c.execute("UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE id = $1 AND state = 'sent'", &[&cmd_id]).await.unwrap();
    }
    let cancelled_events = count(&h, "SELECT count(*) FROM outbox WHERE type = 'command.cancelled'").await;
    assert_eq!(cancelled_events, 1, "only the command that was never sent ended cancelled");
}

#[tokio::test]
async fn the_sweeper_expires_pending_and_times_out_in_flight_commands_and_wakes_their_owners() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let c = h.db().client().await;
    let p = serde_json::json!({});
    let mut owned = cmd(&node, "diag.nvml", &p, "pending-one");
    owned.owner = Some(("workflow", "wf_1", 7));
    let pending = commands::enqueue(&**c, &r, owned).await.unwrap();
    let in_flight = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &p, "in-flight")).await.unwrap();
    commands::mark_sent(&**c, &in_flight.id).await.unwrap();
    // Not yet.
    h.job("command-sweeper").drain(5).await;
    assert_eq!(commands::get(&**c, &node, &pending.id).await.unwrap().state, "pending");
    h.db().advance(Duration::from_secs(601)).await;
    h.job("command-sweeper").drain(5).await;
    let p2 = commands::get(&**c, &node, &pending.id).await.unwrap();
    assert_eq!(p2.state, "expired");
    assert_eq!(commands::get(&**c, &node, &in_flight.id).await.unwrap().state, "sent", "in flight until notAfter + its 600 s timeout");
    assert_eq!(count(&h, "SELECT count(*) FROM work_queue WHERE kind = 'workflow' AND key = 'wf_1' AND shard = 7").await, 1);
    h.db().advance(Duration::from_secs(600)).await;
    h.job("command-sweeper").drain(5).await;
    let t = commands::get(&**c, &node, &in_flight.id).await.unwrap();
    assert_eq!((t.state.as_str(), t.reason.as_deref()), ("failed", Some("timeout")));
}

#[tokio::test]
async fn a_reconnect_settles_a_reboot_on_a_new_boot_and_fails_unsafe_work_on_a_new_journal() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let c = h.db().client().await;
    let reboot = commands::enqueue(&**c, &r, cmd(&node, "node.reboot", &serde_json::json!({"reason": "kernel"}), "r")).await.unwrap();
    let diag = commands::enqueue(&**c, &r, cmd(&node, "diag.nvml", &serde_json::json!({}), "d")).await.unwrap();
    for id in [&reboot.id, &diag.id] {
        commands::mark_sent(&**c, id).await.unwrap();
        commands::acknowledge(&**c, id).await.unwrap();
    }
    // Same boot, same journal: nothing settles.
    assert_eq!(commands::on_reconnect(&**c, &node, false, false).await.unwrap(), Default::default());
    // A new journal: the reboot (not retry-safe) fails rather than run twice; diag is retry-safe.
    let out = commands::on_reconnect(&**c, &node, false, true).await.unwrap();
    assert_eq!((out.succeeded, out.journal_lost), (0, 1));
    let r1 = commands::get(&**c, &node, &reboot.id).await.unwrap();
    assert_eq!((r1.state.as_str(), r1.reason.as_deref()), ("failed", Some("journal-lost")));
    assert_eq!(commands::get(&**c, &node, &diag.id).await.unwrap().state, "running");
    // A new boot settles an in-flight reboot as succeeded.
    let reboot2 = commands::enqueue(&**c, &r, cmd(&node, "node.reboot", &serde_json::json!({"reason": "again"}), "r2")).await.unwrap();
    commands::mark_sent(&**c, &reboot2.id).await.unwrap();
    let out = commands::on_reconnect(&**c, &node, true, false).await.unwrap();
    assert_eq!(out.succeeded, 1);
    assert_eq!(commands::get(&**c, &node, &reboot2.id).await.unwrap().state, "succeeded");
}

#[tokio::test]
async fn commands_run_refuses_other_kinds_bad_deadlines_and_missing_keys_and_replays_a_retry() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let mut c = h.db().connect().await;
    let me = Caller { tenant_id: "ten_ops", identity_id: "idn_ops" };
    let req = |kind: &str, key: Option<&str>, not_after: Option<i64>| RunCommand { tenant_id: None,
        node_id: node.clone(),
        kind: kind.into(),
        payload: serde_json::json!({"sections": ["gpus"]}),
        idempotency_key: key.map(String::from),
        not_after_s: not_after,
    };
    assert_eq!(commands::run(&mut c, &r, &TEST_ACTOR, me, &req("disk.wipe", Some("k"), None)).await.unwrap_err().code, ErrorCode::Unsupported);
    for bad in [Some(9), Some(3601)] {
        let e = commands::run(&mut c, &r, &TEST_ACTOR, me, &req("inventory.refresh", Some("k"), bad)).await.unwrap_err();
        assert!(e.code == ErrorCode::InvalidArgument && e.message.contains("notAfterS"), "{e:?}");
    }
    let e = commands::run(&mut c, &r, &TEST_ACTOR, me, &req("inventory.refresh", None, None)).await.unwrap_err();
    assert!(e.message.contains("idempotencyKey"), "{e:?}");
    assert_eq!(count(&h, "SELECT count(*) FROM commands").await, 0);
    let a = commands::run(&mut c, &r, &TEST_ACTOR, me, &req("inventory.refresh", Some("k"), None)).await.unwrap();
    let b = commands::run(&mut c, &r, &TEST_ACTOR, me, &req("inventory.refresh", Some("k"), None)).await.unwrap();
    assert_eq!(a, b);
    let other = Caller { tenant_id: "ten_ops", identity_id: "idn_other" };
    let c2 = commands::run(&mut c, &r, &TEST_ACTOR, other, &req("inventory.refresh", Some("k"), None)).await.unwrap();
    assert_ne!(c2.id, a.id);
    assert_eq!(count(&h, "SELECT count(*) FROM commands").await, 2);
}

#[tokio::test]
async fn a_cancel_by_its_caller_ends_a_pending_command_with_its_audit_entry() {
    let (h, node) = setup().await;
    let r = h.registry().clone();
    let mut c = h.db().connect().await;
    let me = Caller { tenant_id: "ten_x", identity_id: "idn_x" };
    let req = RunCommand { tenant_id: None, node_id: node.clone(), kind: "inventory.refresh".into(), payload: serde_json::json!({}), idempotency_key: Some("k".into()), not_after_s: None };
    let queued = commands::run(&mut c, &r, &TEST_ACTOR, me, &req).await.unwrap();
    assert_eq!(commands::get(&c, &node, &queued.id).await.unwrap().state, "pending");
    assert_eq!(commands::cancel_by(&mut c, &TEST_ACTOR, me, &node, &queued.id).await.unwrap().state, "cancelled");
    assert_eq!(count(&h, "SELECT count(*) FROM audit_entries WHERE action IN ('commands.run', 'commands.cancel')").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemons_report_racing_a_takeover_and_a_session_close_waits_instead_of_deadlocking() {
    use better_compute_nodes::inventory::reports::{NodeLocks, Report, SessionReports};
    use better_compute_nodes::sessions::{self, Hello};
    let (h, node) = setup().await;
    let hello = |gw: &'static str| Hello { node_id: "", gateway_id: gw, boot_id: "b1", journal_id: "j1", daemon_version: "t" };
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let mut epoch = sessions::open(&*tx, &Hello { node_id: &node, ..hello("gw_a") }).await.unwrap().session_epoch;
    tx.commit().await.unwrap();
    let status = better_compute_proto::v1::SpecStatus { generation: 1, observed_generation: 1, ..Default::default() };
    let mut finished = 0;
    for round in 0..3 {
        // A report of gw_a's session, applied, not yet committed…
        let mut rc = h.db().client().await;
        let report = rc.transaction().await.unwrap();
        let reports = SessionReports { node_id: node.clone(), epoch, reports: vec![Report::SpecStatus(status.clone())] };
        let applied = better_compute_nodes::inventory::reports::apply(&*report, "gw_a", &[&reports], NodeLocks::Wait, &[]).await.unwrap();
        assert_eq!(applied.held.len(), 1, "round {round}");
        // …while another gateway takes the session over (round 0 and 2) or gw_a's close (round 1)
        // runs beside it: it waits for the report's node lock, and neither fails.
        let other = {
            let db = h.db().client().await;
            let node = node.clone();
            tokio::spawn(async move {
                let mut db = db;
                let tx = db.transaction().await.unwrap();
                if round == 1 {
                    sessions::close(&*tx, &node, epoch, "test").await.unwrap();
                } else {
                    sessions::open(&*tx, &Hello { node_id: &node, gateway_id: "gw_b", boot_id: "b1", journal_id: "j1", daemon_version: "t" }).await.unwrap();
                }
                tx.commit().await.unwrap();
            })
        };
        until_a_transaction_waits_for_a_lock(&h, &format!("round {round}: the other transaction")).await;
        assert!(!other.is_finished(), "round {round}");
        report.commit().await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), other).await.expect("deadlocked").unwrap();
        finished += 1;
        // The next round reports under a session gw_a holds again.
        let tx = c.transaction().await.unwrap();
        epoch = sessions::open(&*tx, &Hello { node_id: &node, ..hello("gw_a") }).await.unwrap().session_epoch;
        tx.commit().await.unwrap();
    }
    assert_eq!(finished, 3);
}

/// `n` more nodes in the first node's pool, each with a session opened by `gateway`; returns
/// (node, epoch) for each.
async fn nodes_with_sessions(h: &Harness, n: usize, gateway: &str) -> Vec<(String, i64)> {
    use better_compute_nodes::sessions::{self, Hello};
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let pool: String = tx.query_one("SELECT pool_id FROM nodes LIMIT 1", &[]).await.unwrap().get(0);
    let mut out = Vec::new();
    for i in 0..n {
        let node = inventory::register_node(
            &*tx,
            &NewNode { pool_id: pool.clone(), name: format!("g{i}"), labels: Default::default(), vcpu: 8, memory_mib: 1024, disk_gib: 10, gpus: vec![] },
        )
        .await
        .unwrap();
        let hello = Hello { node_id: &node, gateway_id: gateway, boot_id: "b1", journal_id: "j1", daemon_version: "t" };
        let epoch = sessions::open(&*tx, &hello).await.unwrap().session_epoch;
        out.push((node, epoch));
    }
    tx.commit().await.unwrap();
    out
}

#[tokio::test]
async fn a_report_group_writes_only_for_sessions_that_still_hold_and_keeps_each_guard_inside_the_batch() {
    use better_compute_nodes::inventory::reports::{self, NodeLocks, Report, SessionReports};
    use better_compute_nodes::sessions::{self, Hello};
    let (h, _) = setup().await;
    let r = h.registry().clone();
    let nodes = nodes_with_sessions(&h, 3, "gw_a").await;
    let mut c = h.db().client().await;
    // Each node has two commands sent and a spec at generation 5.
    let mut sent = Vec::new();
    for (node, _) in &nodes {
        let mut ids = Vec::new();
        for k in ["x", "y"] {
            let v = commands::enqueue(&**c, &r, cmd(node, "diag.nvml", &serde_json::json!({}), k)).await.unwrap();
            commands::mark_sent(&**c, &v.id).await.unwrap();
            ids.push(v.id);
        }
        c.execute("UPDATE nodes SET generation = 5, observed_generation = 4 WHERE id = $1", &[node]).await.unwrap();
        sent.push(ids);
    }
    // gw_b takes the third node's session over: gw_a's session of it is now a zombie.
    {
        let tx = c.transaction().await.unwrap();
        sessions::open(&*tx, &Hello { node_id: &nodes[2].0, gateway_id: "gw_b", boot_id: "b1", journal_id: "j1", daemon_version: "t" }).await.unwrap();
        tx.commit().await.unwrap();
    }
    let status = |observed: i64| Report::SpecStatus(better_compute_proto::v1::SpecStatus { generation: 5, observed_generation: observed, ..Default::default() });
    let result = |id: &str| Report::Result { command_id: id.to_owned(), succeeded: true, reason: None, result: serde_json::json!({"ok": true}) };
    let ack = |id: &str| Report::Ack { command_id: id.to_owned() };
    let group: Vec<SessionReports> = nodes
        .iter()
        .zip(&sent)
        .enumerate()
        .map(|(i, ((node, epoch), ids))| SessionReports {
            node_id: node.clone(),
            epoch: *epoch,
            reports: match i {
                // An ack and the result of one command, the ack of the other, and a spec status.
                0 => vec![ack(&ids[0]), result(&ids[0]), ack(&ids[1]), status(5)],
                // The result of one command twice (at least once delivery), a result of the
                // first node's command (not this node's), and a spec status going backwards.
                1 => vec![result(&ids[0]), result(&ids[0]), result(&sent[0][1]), status(3)],
                // The zombie's reports: none may land.
                _ => vec![ack(&ids[0]), result(&ids[1]), status(5)],
            },
        })
        .collect();
    let tx = c.transaction().await.unwrap();
    let refs: Vec<&SessionReports> = group.iter().collect();
    let applied = reports::apply(&*tx, "gw_a", &refs, NodeLocks::SkipBusy, &[]).await.unwrap();
    tx.commit().await.unwrap();
    let held: std::collections::BTreeSet<&str> = applied.held.iter().map(String::as_str).collect();
    assert_eq!(held, [nodes[0].0.as_str(), nodes[1].0.as_str()].into_iter().collect());
    assert_eq!(applied.settled, 2, "one result on each holding node; the repeat and the foreign one change nothing");
    assert_eq!(applied.freed.len(), 2);
    let states = |ids: &[String]| {
        let ids = ids.to_vec();
        let c = &c;
        async move {
            let mut out = Vec::new();
            for id in &ids {
                out.push(c.query_one("SELECT state FROM commands WHERE id = $1", &[id]).await.unwrap().get::<_, String>(0));
            }
            out
        }
    };
    assert_eq!(states(&sent[0]).await, ["succeeded", "running"]);
    assert_eq!(states(&sent[1]).await, ["succeeded", "sent"]);
    assert_eq!(states(&sent[2]).await, ["sent", "sent"], "the zombie's ack and result changed nothing");
    let observed = |node: &str| {
        let (c, node) = (&c, node.to_owned());
        async move { c.query_one("SELECT observed_generation FROM nodes WHERE id = $1", &[&node]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(observed(&nodes[0].0).await, 5);
    assert_eq!(observed(&nodes[1].0).await, 4, "observedGeneration only moves up");
    assert_eq!(observed(&nodes[2].0).await, 4, "the zombie's spec status changed nothing");
    assert_eq!(count(&h, "SELECT count(*) FROM outbox WHERE type = 'command.succeeded'").await, 2);
    // The same group again (a retry after a lost answer) changes nothing.
    let tx = c.transaction().await.unwrap();
    let again = reports::apply(&*tx, "gw_a", &refs, NodeLocks::SkipBusy, &[]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((again.held.len(), again.settled), (2, 0));
    assert_eq!(count(&h, "SELECT count(*) FROM outbox WHERE type = 'command.succeeded'").await, 2);
}

#[tokio::test]
async fn a_dispatch_for_many_nodes_routes_nothing_for_a_superseded_session_and_keeps_each_nodes_lane_credits() {
    use better_compute_nodes::sessions::{self, DispatchFor, Hello};
    let (h, _) = setup().await;
    let r = h.registry().clone();
    let nodes = nodes_with_sessions(&h, 3, "gw_a").await;
    let mut c = h.db().client().await;
    // Five diag commands per node: the diag lane has fewer credits than that.
    for (node, _) in &nodes {
        for k in 0..5 {
            commands::enqueue(&**c, &r, cmd(node, "diag.nvml", &serde_json::json!({}), &format!("k{k}"))).await.unwrap();
        }
    }
    {
        let tx = c.transaction().await.unwrap();
        sessions::open(&*tx, &Hello { node_id: &nodes[1].0, gateway_id: "gw_b", boot_id: "b1", journal_id: "j1", daemon_version: "t" }).await.unwrap();
        tx.commit().await.unwrap();
    }
    let want: Vec<DispatchFor<'_>> = nodes.iter().map(|(n, e)| DispatchFor { node_id: n, epoch: *e, limit: 64 }).collect();
    let tx = c.transaction().await.unwrap();
    let d = sessions::dispatch_many(&*tx, "gw_a", &want).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(d.len(), 2, "the superseded session is absent");
    assert!(!d.contains_key(&nodes[1].0));
    let credits = i64::from(better_compute_nodes::spec::LANES.iter().find(|(l, _)| *l == "diag").map(|(_, c)| *c).unwrap_or(1));
    assert!(credits < 5);
    for (node, _) in [&nodes[0], &nodes[2]] {
        let seqs: Vec<i64> = d[node].commands.iter().map(|x| x.seq).collect();
        assert_eq!(seqs, (1..=credits).collect::<Vec<_>>(), "in seq order, no more than the lane's credits");
    }
    let sent_of = |node: &str| format!("SELECT count(*) FROM commands WHERE node_id = '{node}' AND state = 'sent'");
    assert_eq!(count(&h, &sent_of(&nodes[0].0)).await, credits);
    assert_eq!(count(&h, &sent_of(&nodes[1].0)).await, 0, "a zombie routes nothing");
    // A node's limit (the room in its session's queue) caps it below its credits.
    let tx = c.transaction().await.unwrap();
    for (node, _) in &nodes {
        tx.execute("UPDATE commands SET state = 'succeeded', finished_at = compute_now() WHERE node_id = $1 AND state = 'sent'", &[node]).await.unwrap();
    }
    let one = [DispatchFor { node_id: &nodes[0].0, epoch: nodes[0].1, limit: 1 }];
    let d = sessions::dispatch_many(&*tx, "gw_a", &one).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(d[&nodes[0].0].commands.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_groups_racing_takeovers_write_exactly_for_the_sessions_they_found_holding() {
    use better_compute_nodes::inventory::reports::{self, NodeLocks, Report, SessionReports};
    use better_compute_nodes::sessions::{self, Hello};
    let (h, _) = setup().await;
    let nodes = nodes_with_sessions(&h, 24, "gw_a").await;
    let mut c = h.db().client().await;
    c.execute("UPDATE nodes SET generation = 7", &[]).await.unwrap();
    let group: Vec<SessionReports> = nodes
        .iter()
        .map(|(node, epoch)| SessionReports {
            node_id: node.clone(),
            epoch: *epoch,
            reports: vec![Report::SpecStatus(better_compute_proto::v1::SpecStatus { generation: 7, observed_generation: 7, ..Default::default() })],
        })
        .collect();
    // Takeovers of every other node, in reverse order, while gw_a's group applies (in node order).
    let takeovers = {
        let victims: Vec<String> = nodes.iter().step_by(2).rev().map(|(n, _)| n.clone()).collect();
        let mut db = h.db().client().await;
        tokio::spawn(async move {
            for n in victims {
                let tx = db.transaction().await.unwrap();
                sessions::open(&*tx, &Hello { node_id: &n, gateway_id: "gw_b", boot_id: "b1", journal_id: "j1", daemon_version: "t" }).await.unwrap();
                tx.commit().await.unwrap();
            }
        })
    };
    let tx = c.transaction().await.unwrap();
    let refs: Vec<&SessionReports> = group.iter().collect();
    let applied = tokio::time::timeout(Duration::from_secs(30), reports::apply(&*tx, "gw_a", &refs, NodeLocks::Wait, &[])).await.expect("deadlocked").unwrap();
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), takeovers).await.expect("deadlocked").unwrap();
    let moved: std::collections::HashSet<String> =
        c.query("SELECT id FROM nodes WHERE observed_generation = 7", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(moved, applied.held, "a write landed exactly where the group's fence held");
    assert!(applied.held.len() >= 12, "the nodes nobody took over always held: {}", applied.held.len());
    let open_b = count(&h, "SELECT count(*) FROM node_sessions WHERE gateway_id = 'gw_b' AND closed_at IS NULL").await;
    assert_eq!(open_b, 12);
}

#[tokio::test]
async fn a_last_seen_flush_skips_a_session_a_report_is_fencing_and_reports_it_busy_instead_of_waiting() {
    use better_compute_nodes::sessions;
    let (h, _) = setup().await;
    let nodes = nodes_with_sessions(&h, 2, "gw_a").await;
    let (ids, epochs): (Vec<String>, Vec<i64>) = nodes.iter().cloned().unzip();
    // A report group of gw_a holds the first node's session row (its fence) and has not committed.
    let mut rc = h.db().client().await;
    let report = rc.transaction().await.unwrap();
    let held = sessions::fence(&*report, "gw_a", &[ids[0].as_str()], &[epochs[0]]).await.unwrap();
    assert_eq!(held.len(), 1);
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let flushed = tokio::time::timeout(Duration::from_secs(10), sessions::flush_last_seen(&*tx, "gw_a", &ids, &epochs, &[0.5, 0.5]))
        .await
        .expect("the flush waited for the report")
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(flushed.written, vec![ids[1].clone()]);
    assert_eq!(flushed.busy, vec![ids[0].clone()], "busy, not lost: the gateway keeps the session and flushes it next time");
    report.commit().await.unwrap();
    // A stale epoch is neither written nor busy.
    let tx = c.transaction().await.unwrap();
    let stale = sessions::flush_last_seen(&*tx, "gw_a", &ids, &[epochs[0] + 1, epochs[1]], &[0.5, 0.5]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((stale.written.len(), stale.busy.len()), (1, 0));
}

#[tokio::test]
async fn a_report_group_leaves_out_a_session_whose_node_row_is_busy_and_writes_nothing_of_it() {
    use better_compute_nodes::inventory::reports::{self, NodeLocks, Report, SessionReports};
    let (h, _) = setup().await;
    let nodes = nodes_with_sessions(&h, 2, "gw_a").await;
    let mut c = h.db().client().await;
    c.execute("UPDATE nodes SET generation = 3", &[]).await.unwrap();
    // A session opening on the first node holds its row.
    let mut oc = h.db().client().await;
    let opening = oc.transaction().await.unwrap();
    opening.execute("SELECT 1 FROM nodes WHERE id = $1 FOR UPDATE", &[&nodes[0].0]).await.unwrap();
    let status = Report::SpecStatus(better_compute_proto::v1::SpecStatus { generation: 3, observed_generation: 3, ..Default::default() });
    let group: Vec<SessionReports> =
        nodes.iter().map(|(n, e)| SessionReports { node_id: n.clone(), epoch: *e, reports: vec![status.clone()] }).collect();
    let refs: Vec<&SessionReports> = group.iter().collect();
    let tx = c.transaction().await.unwrap();
    let applied = tokio::time::timeout(Duration::from_secs(10), reports::apply(&*tx, "gw_a", &refs, NodeLocks::SkipBusy, &[]))
        .await
        .expect("the group waited for a busy node")
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(applied.deferred, vec![nodes[0].0.clone()]);
    assert_eq!(applied.held.len(), 1);
    assert!(applied.held.contains(&nodes[1].0));
    opening.commit().await.unwrap();
    assert_eq!(count(&h, "SELECT count(*) FROM nodes WHERE observed_generation = 3").await, 1, "only the node that was not busy");
}

#[tokio::test]
async fn a_destructive_command_is_signed_at_enqueue_over_its_node_seq_kind_body_deadline_and_generation() {
    let (h, node) = setup().await;
    let r = h.registry();
    let c = h.db().client().await;
    let reboot = serde_json::json!({"reason": "kernel"});
    let v = commands::enqueue(&**c, r, NewCommand { min_generation: 3, ..cmd(&node, "node.reboot", &reboot, "r1") }).await.unwrap();
    let row = c
        .query_one(
            "SELECT seq, body, round(extract(epoch FROM not_after) * 1000)::int8, min_generation, signature FROM commands WHERE id = $1",
            &[&v.id],
        )
        .await
        .unwrap();
    let (seq, body, not_after_ms, min_generation, signature): (i64, Vec<u8>, i64, i64, Vec<u8>) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let key = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, r.command_signer().unwrap().public_key());
    let message = |node: &str, seq: i64| better_compute_proto::command_signing_message(node, seq, "node.reboot", &body, not_after_ms, min_generation);
    assert!(key.verify(&message(&node, seq), &signature).is_ok());
    assert!(key.verify(&message(&node, seq + 1), &signature).is_err(), "bound to its seq");
    assert!(key.verify(&message("node_other", seq), &signature).is_err(), "bound to its node");
    // Other kinds carry none.
    let diag = commands::enqueue(&**c, r, cmd(&node, "diag.nvml", &serde_json::Value::Null, "d1")).await.unwrap();
    let none: Option<Vec<u8>> = c.query_one("SELECT signature FROM commands WHERE id = $1", &[&diag.id]).await.unwrap().get(0);
    assert_eq!(none, None);

    // A process without the key cannot enqueue one at all, and writes nothing.
    let unsigned = a_registry_without_a_key();
    let e = commands::enqueue(&**c, &unsigned, cmd(&node, "node.reboot", &reboot, "r2")).await.unwrap_err();
    assert_eq!(code(e), ErrorCode::FailedPrecondition);
    assert_eq!(count(&h, "SELECT count(*) FROM commands").await, 2);
}

fn a_registry_without_a_key() -> better_compute_runtime::Registry {
    better_compute_runtime::Registry::new(vec![std::sync::Arc::new(better_compute_nodes::NodesModule), std::sync::Arc::new(better_compute_workflows::WorkflowsModule)]).unwrap()
}
