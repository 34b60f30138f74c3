//! Instances against a real PostgreSQL: created with their reservation in one transaction, once per
//! idempotency key and once per reservation; carried to the host's desired state; moved by what the
//! host reports (through the nodes module's report path, which wakes `vps.instances`); stopped and
//! deleted as desired state; and deleted when their reservation ends.

use crate::common;

use better_compute_audit::Actor;
use std::sync::Arc;

use better_compute_capacity::reservations::{self, GpuRequest};
use better_compute_capacity::CapacityModule;
use better_compute_core::{Caller, ErrorCode};
use better_compute_nodes::inventory::reports::Report;
use better_compute_nodes::NodesModule;
use better_compute_proto::v1::{InstanceObserved, SpecStatus};
use better_compute_runtime::harness::Harness;
use better_compute_vps::instances::{self, Action, CreateInstance};
use better_compute_vps::VpsModule;
use common::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

fn request(pool: &str, key: &str) -> CreateInstance {
    CreateInstance {
        tenant_id: None,
        reservation_id: None,
        pool_id: Some(pool.to_owned()),
        gpu: Some(GpuRequest { kind: "gpu".into(), model: "H100-80GB".into(), profile: None, count: 1 }),
        vcpu: 8,
        memory_mib: 16_384,
        disk_gib: 50,
        duration_s: Some(3600),
        image: "debian-12".into(),
        ssh_public_keys: vec!["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB7 me@laptop".into()],
        user_data: String::new(),
        idempotency_key: key.into(),
    }
}

/// The host's daemon reports its applied generation and these instances (id, state, address).
async fn report(h: &Harness, node: &str, observed: &[(&str, &str)]) {
    let generation: i64 = h.db().client().await.query_one("SELECT generation FROM nodes WHERE id = $1", &[&node]).await.unwrap().get(0);
    let instances = observed
        .iter()
        .map(|(id, state)| InstanceObserved {
            instance_id: id.to_string(),
            state: state.to_string(),
            address: "10.0.0.2".into(),
            host_key_fingerprint: "SHA256:abc".into(),
            ..Default::default()
        })
        .collect();
    apply(h, node, vec![Report::SpecStatus(SpecStatus { generation, observed_generation: generation, instances, ..Default::default() })]).await;
}

async fn state(h: &Harness, id: &str) -> String {
    instances::get(&**h.db().client().await, ME, id).await.unwrap().state
}

async fn spec_instances(h: &Harness, node: &str) -> serde_json::Value {
    h.db().client().await.query_one("SELECT coalesce(spec->'instances'->'instances', '[]') FROM nodes WHERE id = $1", &[&node]).await.unwrap().get(0)
}

#[tokio::test]
async fn an_instance_runs_stops_and_is_deleted_as_desired_state_moved_by_its_hosts_reports() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, node) = host(&h).await;
    let mut c = h.db().client().await;
    let v = instances::create(&mut c, &TEST_ACTOR, ME, &request(&pool, "i-1")).await.unwrap();
    assert_eq!((v.state.as_str(), v.node_id.as_deref()), ("requested", Some(node.as_str())), "{v:?}");
    // The same key answers the same instance; another instance on the same reservation is refused.
    let again = instances::create(&mut c, &TEST_ACTOR, ME, &request(&pool, "i-1")).await.unwrap();
    assert_eq!(again.id, v.id);
    let second = CreateInstance { reservation_id: Some(v.reservation_id.clone()), pool_id: None, gpu: None, duration_s: None, ..request(&pool, "i-2") };
    assert_eq!(instances::create(&mut c, &TEST_ACTOR, ME, &second).await.unwrap_err().code, ErrorCode::Conflict);
    // Placed: it goes into the host's desired state, to run.
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "provisioning");
    h.job("nodespec").drain(10).await;
    let spec = spec_instances(&h, &node).await;
    assert_eq!(spec.as_array().map(Vec::len), Some(1), "{spec}");
    assert_eq!((spec[0]["instanceId"].as_str(), spec[0]["running"].as_bool()), (Some(v.id.as_str()), Some(true)), "{spec}");
    // The host reports it running: the report path wakes the job, which moves it.
    report(&h, &node, &[(&v.id, "running")]).await;
    h.job("vps.instances").drain(10).await;
    let running = instances::get(&**c, ME, &v.id).await.unwrap();
    assert_eq!((running.state.as_str(), running.address.as_deref(), running.host_key_fingerprint.as_deref()), ("running", Some("10.0.0.2"), Some("SHA256:abc")));
    // Stop: desired state first, then the host's word.
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Stop).await.unwrap().state, "stopping");
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Stop).await.unwrap().state, "stopping", "a repeat changes nothing");
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Reboot).await.unwrap_err().code, ErrorCode::FailedPrecondition);
    h.job("nodespec").drain(10).await;
    assert_eq!(spec_instances(&h, &node).await[0]["running"].as_bool(), None, "running false is proto3's default, left out");
    report(&h, &node, &[(&v.id, "stopped")]).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "stopped");
    // Another tenant sees none of it.
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    assert_eq!(instances::get(&**c, other, &v.id).await.unwrap_err().code, ErrorCode::NotFound);
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, other, &v.id, Action::Delete).await.unwrap_err().code, ErrorCode::NotFound);
    // The reservation ends: the instance is deleted with it, once the host has applied the spec
    // without it and no longer reports it.
    reservations::release(&mut c, &TEST_ACTOR, ME, &v.reservation_id).await.unwrap();
    settle(&h).await;
    h.job("event-subscribers").drain(20).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "deleting");
    h.job("nodespec").drain(10).await;
    assert_eq!(spec_instances(&h, &node).await, serde_json::json!([]));
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "deleting", "the host still reports it");
    report(&h, &node, &[]).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "deleted");
    // Every transition was an event, in order.
    settle(&h).await;
    let types: Vec<String> = c
        .query("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq", &[&v.id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        types,
        ["instance.requested", "instance.provisioning", "instance.running", "instance.stopping", "instance.stopped", "instance.deleting", "instance.deleted"]
    );
}

#[tokio::test]
async fn an_instance_the_host_never_ran_is_deleted_once_the_host_applies_the_spec_without_it() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, node) = host(&h).await;
    let mut c = h.db().client().await;
    let v = instances::create(&mut c, &TEST_ACTOR, ME, &request(&pool, "i-1")).await.unwrap();
    h.job("vps.instances").drain(10).await;
    h.job("nodespec").drain(10).await;
    // The host applied the spec but has not started the VM yet: it reports no instances.
    report(&h, &node, &[]).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "provisioning");
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Delete).await.unwrap().state, "deleting");
    h.job("nodespec").drain(10).await;
    assert_eq!(spec_instances(&h, &node).await, serde_json::json!([]));
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "deleting", "the host has not applied the spec without it yet");
    // Its next report reads as its last one (no instances), but of the newer generation: that
    // alone wakes the job, which ends the instance.
    report(&h, &node, &[]).await;
    let woken: i64 = c.query_one("SELECT count(*) FROM work_queue WHERE kind = 'vps.instances' AND key = $1", &[&node]).await.unwrap().get(0);
    assert_eq!(woken, 1, "the report of a newer generation wakes the node's vps.instances");
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "deleted");
}

#[tokio::test]
async fn bad_instance_requests_are_refused_with_stable_codes_and_change_nothing() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, _) = host(&h).await;
    let mut c = h.db().client().await;
    let cases: Vec<(CreateInstance, ErrorCode)> = vec![
        (CreateInstance { image: "Debian 12".into(), ..request(&pool, "b-1") }, ErrorCode::InvalidArgument),
        (CreateInstance { ssh_public_keys: vec![], ..request(&pool, "b-2") }, ErrorCode::InvalidArgument),
        (CreateInstance { ssh_public_keys: vec!["not a key".into()], ..request(&pool, "b-3") }, ErrorCode::InvalidArgument),
        (CreateInstance { reservation_id: Some("res_x".into()), ..request(&pool, "b-4") }, ErrorCode::InvalidArgument),
        (CreateInstance { duration_s: None, ..request(&pool, "b-5") }, ErrorCode::InvalidArgument),
        (CreateInstance { reservation_id: Some("res_x".into()), pool_id: None, gpu: None, duration_s: None, ..request(&pool, "b-6") }, ErrorCode::NotFound),
        (CreateInstance { user_data: "x".repeat(instances::MAX_USER_DATA_BYTES + 1), ..request(&pool, "b-7") }, ErrorCode::InvalidArgument),
    ];
    let n = cases.len();
    for (req, code) in cases {
        assert_eq!(instances::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap_err().code, code, "{req:?}");
    }
    assert_eq!(n, 7);
    let rows: i64 = c.query_one("SELECT (SELECT count(*) FROM instances) + (SELECT count(*) FROM reservations)", &[]).await.unwrap().get(0);
    assert_eq!(rows, 0, "nothing was written");
}

#[tokio::test]
async fn the_tenant_hears_once_that_its_instances_reservation_ends_in_fifteen_minutes() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, _) = host(&h).await;
    let mut c = h.db().client().await;
    let v = instances::create(&mut c, &TEST_ACTOR, ME, &request(&pool, "e-1")).await.unwrap();
    h.job("vps.instances").drain(10).await;
    let expiring = async || -> i64 {
        settle(&h).await;
        h.db().client().await.query_one("SELECT count(*) FROM outbox WHERE type = 'instance.expiring' AND subject = $1", &[&v.id]).await.unwrap().get(0)
    };
    assert_eq!(expiring().await, 0, "an hour left");
    // 44 minutes in: 16 left, still quiet; 46 minutes in: 14 left, told once.
    h.db().advance(std::time::Duration::from_secs(44 * 60)).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(expiring().await, 0);
    h.db().advance(std::time::Duration::from_secs(2 * 60)).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(expiring().await, 1);
    h.db().advance(std::time::Duration::from_secs(60)).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(expiring().await, 1, "once");
    let data: serde_json::Value = c.query_one("SELECT data FROM outbox WHERE type = 'instance.expiring'", &[]).await.unwrap().get(0);
    assert_eq!(data["reservationId"], v.reservation_id.as_str(), "{data}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_creates_on_one_reservation_make_exactly_one_instance() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, _) = host(&h).await;
    let mut c = h.db().client().await;
    let r = one_gpu(&pool);
    let res = reservations::create(&mut c, &TEST_ACTOR, ME, &r).await.unwrap();
    // Eight creates with eight keys on the same reservation, at once.
    let on_it = |k: usize| CreateInstance { reservation_id: Some(res.id.clone()), pool_id: None, gpu: None, duration_s: None, ..request(&pool, &format!("r-{}", k + 1)) };
    let tasks: Vec<_> = (0..8)
        .map(|k| {
            let (conn, req) = (h.db().connection_string().to_owned(), on_it(k));
            tokio::spawn(async move {
                let mut c = better_compute_db::pool::connect(&conn).await.unwrap();
                instances::create(&mut c, &TEST_ACTOR, ME, &req).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.push(tokio::time::timeout(std::time::Duration::from_secs(30), t).await.expect("no deadlock").unwrap());
    }
    assert_eq!(outcomes.len(), 8);
    let made = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(made, 1, "{outcomes:?}");
    assert!(outcomes.iter().filter_map(|o| o.as_ref().err()).all(|e| e.code == ErrorCode::Conflict), "{outcomes:?}");
    let live: i64 = h.db().client().await.query_one("SELECT count(*) FROM instances WHERE allocation_id = $1 AND state <> 'deleted'", &[&res.id]).await.unwrap().get(0);
    assert_eq!(live, 1);
}

/// The instance usage windows of an instance, as (window start, instance-seconds).
async fn usage_windows(h: &Harness, id: &str) -> Vec<(String, f64)> {
    h.db()
        .client()
        .await
        .query(
            "SELECT to_char(window_start AT TIME ZONE 'UTC', 'HH24:MI'), instance_seconds::float8 FROM instance_usage_windows
              WHERE instance_id = $1 ORDER BY window_start",
            &[&id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_instance_is_metered_once_per_closed_window_for_the_seconds_its_vm_was_up() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, node) = host(&h).await;
    let mut c = h.db().client().await;
    let min = |m: u64| std::time::Duration::from_secs(m * 60);
    let v = instances::create(&mut c, &TEST_ACTOR, ME, &CreateInstance { duration_s: Some(6 * 3600), ..request(&pool, "u-1") }).await.unwrap();
    assert_eq!(v.flavour, "1xgpu:H100-80GB,8vcpu,16384mib,50gib");
    h.job("vps.instances").drain(10).await;
    h.job("nodespec").drain(10).await;
    // Up from 00:10 (the host's report) to 01:35 (stopping counts: the VM runs until it stops).
    h.db().advance(min(10)).await;
    report(&h, &node, &[(&v.id, "running")]).await;
    h.job("vps.instances").drain(10).await;
    h.db().advance(min(80)).await;
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Stop).await.unwrap().state, "stopping");
    h.db().advance(min(5)).await;
    h.job("nodespec").drain(10).await;
    report(&h, &node, &[(&v.id, "stopped")]).await;
    h.job("vps.instances").drain(10).await;
    assert_eq!(state(&h, &v.id).await, "stopped");
    // Up again from 02:10, and still up at 03:01.
    h.db().advance(min(35)).await;
    assert_eq!(instances::act(&mut c, &TEST_ACTOR, ME, &v.id, Action::Start).await.unwrap().state, "provisioning");
    h.job("nodespec").drain(10).await;
    report(&h, &node, &[(&v.id, "running")]).await;
    h.job("vps.instances").drain(10).await;
    h.db().advance(min(51)).await;
    // Four meterings of the pool at once, as a zombie worker and its successor would run them:
    // each closed window is written once.
    let mut racers = Vec::new();
    for _ in 0..4 {
        let pool_id = pool.clone();
        let conn = h.db().pool.clone();
        racers.push(tokio::spawn(async move {
            let mut c = conn.get().await.unwrap();
            let tx = c.transaction().await.unwrap();
            let n = tx.query("SELECT id FROM vps_usage_close($1, 256)", &[&pool_id]).await.unwrap().len();
            tx.commit().await.unwrap();
            n
        }));
    }
    let mut written = 0;
    for r in racers {
        written += tokio::time::timeout(std::time::Duration::from_secs(30), r).await.expect("a metering hung").unwrap();
    }
    assert_eq!(written, 3, "three closed windows, each written by exactly one metering");
    assert_eq!(usage_windows(&h, &v.id).await, [("00:00".to_owned(), 3000.0), ("01:00".to_owned(), 2100.0), ("02:00".to_owned(), 3000.0)]);
    // The job finds nothing more, and is armed for the end of the window the VM is up in.
    h.job("vps.usage").drain(10).await;
    assert_eq!(usage_windows(&h, &v.id).await.len(), 3);
    let armed: f64 = c
        .query_one("SELECT extract(epoch FROM not_before - compute_now())::float8 FROM work_queue WHERE kind = 'vps.usage' AND key = $1", &[&pool])
        .await
        .unwrap()
        .get(0);
    assert!((59.0 * 60.0..=59.0 * 60.0 + 2.0).contains(&armed), "armed {armed} s ahead");
    // At 04:01 the job writes 03:00 whole, with its event under the billing key.
    h.db().advance(min(60)).await;
    h.job("vps.usage").drain(10).await;
    assert_eq!(usage_windows(&h, &v.id).await.last(), Some(&("03:00".to_owned(), 3600.0)));
    settle(&h).await;
    let key = format!("cmp:{}:2030-01-01T03:00:00Z", v.id);
    let data: serde_json::Value =
        c.query_one("SELECT data FROM outbox WHERE type = 'instance.usageWindow' AND subject = $1", &[&key]).await.unwrap().get(0);
    assert_eq!((data["flavour"].as_str(), data["instanceSeconds"].as_f64()), (Some(v.flavour.as_str()), Some(3600.0)), "{data}");
    assert_eq!(better_compute_vps::invariants::violations(&**c).await.unwrap(), Vec::<String>::new());
    // What instanceUsage.list and instanceUsage.export answer: the same windows, summed and one by one.
    use better_compute_vps::usage::{export_page, list, InstanceGroupBy};
    let (from, to) = ("2030-01-01T00:00:00Z", "2030-01-02T00:00:00Z");
    let sums = list(&**c, Some(ME.tenant_id), from, to, InstanceGroupBy::Flavour, 10).await.unwrap();
    assert_eq!(sums.len(), 1, "{sums:?}");
    assert_eq!((sums[0].group.as_str(), sums[0].windows, sums[0].instance_seconds), (v.flavour.as_str(), 4, 11_700.0));
    assert_eq!(list(&**c, Some("ten_other"), from, to, InstanceGroupBy::Day, 10).await.unwrap().len(), 0, "another tenant has none");
    let first = export_page(&**c, None, from, to, "", 2).await.unwrap();
    assert_eq!(first.len(), 3, "a page of two, and one more to say there is a next page");
    let rest = export_page(&**c, None, from, to, &first[1].key, 2).await.unwrap();
    assert_eq!(rest.iter().map(|w| w.window_start.as_str()).collect::<Vec<_>>(), ["2030-01-01T02:00:00Z", "2030-01-01T03:00:00Z"]);
    assert_eq!((rest[1].key.as_str(), rest[1].instance_seconds, rest[1].window_end.as_str()), (key.as_str(), 3600.0, "2030-01-01T04:00:00Z"));
    assert!(export_page(&**c, None, "yesterday", to, "", 2).await.is_err(), "a bad period is refused");
    // The check can fail: a window billed twice over is caught.
    c.execute("UPDATE instance_usage_windows SET instance_seconds = instance_seconds * 2 WHERE id = $1", &[&key]).await.unwrap();
    let wrong = better_compute_vps::invariants::violations(&**c).await.unwrap();
    assert_eq!(wrong.len(), 1, "{wrong:?}");
    assert!(wrong[0].contains("billed 15300.000000 s but was up 11700.000000 s"), "{wrong:?}");
}

fn console(id: &str, offset: u64, data: &[u8]) -> Report {
    Report::Console { instance_id: id.into(), offset, data: data.to_vec() }
}

#[tokio::test]
async fn an_instances_console_keeps_each_byte_once_and_the_last_64_kib_while_its_host_reports_the_vm() {
    let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(VpsModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
    let (pool, node) = host(&h).await;
    let mut c = h.db().client().await;
    let v = instances::create(&mut c, &TEST_ACTOR, ME, &request(&pool, "c-1")).await.unwrap();
    h.job("vps.instances").drain(10).await;
    h.job("nodespec").drain(10).await;
    let read = async |from: Option<i64>| instances::console(&**h.db().client().await, ME, &v.id, from).await.unwrap();
    // Nothing before the host reports the VM: a console of a VM the host does not report is not kept.
    apply(&h, &node, vec![console(&v.id, 0, b"early")]).await;
    assert_eq!((read(None).await.text, read(None).await.next_offset), (String::new(), 0));
    report(&h, &node, &[(&v.id, "running")]).await;
    // Repeats and overlaps keep each byte once; a chunk in the same report as others applies in order.
    apply(&h, &node, vec![console(&v.id, 0, b"boot 1\n"), console(&v.id, 0, b"boot 1\n"), console(&v.id, 3, b"t 1\nlogin: ")]).await;
    let t = read(None).await;
    assert_eq!((t.offset, t.next_offset, t.text.as_str(), t.truncated), (0, 14, "boot 1\nlogin: ", false));
    let t = read(Some(7)).await;
    assert_eq!((t.offset, t.text.as_str()), (7, "login: "));
    assert_eq!((read(Some(14)).await.offset, read(Some(14)).await.text.as_str()), (14, ""), "its end is an offset it sent");
    // Another tenant sees no such instance.
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    assert_eq!(instances::console(&**c, other, &v.id, None).await.unwrap_err().code, ErrorCode::NotFound);
    assert_eq!(instances::console(&**c, ME, &v.id, Some(-1)).await.unwrap_err().code, ErrorCode::InvalidArgument);
    assert_eq!(instances::console(&**c, ME, &v.id, Some(i64::MAX)).await.unwrap_err().code, ErrorCode::InvalidArgument, "past the console's end");
    // Past 64 KiB the oldest bytes go; a reader from before them is told so.
    let big = vec![b'x'; 35_000];
    apply(&h, &node, vec![console(&v.id, 14, &big), console(&v.id, 35_014, &big)]).await;
    let t = read(Some(0)).await;
    assert_eq!((t.offset, t.next_offset, t.truncated, t.text.len()), (70_014 - 65_536, 70_014, true, 65_536));
    // Bytes that never came (a gap) start the tail again where the host now is.
    apply(&h, &node, vec![console(&v.id, 80_000, b"after a gap")]).await;
    let t = read(Some(70_014)).await;
    assert_eq!((t.offset, t.text.as_str(), t.truncated), (80_000, "after a gap", true));
    // A host may not write a console of an instance that is not its VM.
    let kept: i64 = c.query_one("SELECT count(*) FROM vm_consoles", &[]).await.unwrap().get(0);
    apply(&h, &node, vec![console("ins_not_there", 0, b"x")]).await;
    assert_eq!(c.query_one("SELECT count(*) FROM vm_consoles", &[]).await.unwrap().get::<_, i64>(0), kept);
    assert_eq!(kept, 1);
    // Once the host no longer reports the VM, its console is gone.
    report(&h, &node, &[]).await;
    assert_eq!(c.query_one("SELECT count(*) FROM vm_consoles", &[]).await.unwrap().get::<_, i64>(0), 0);
    assert_eq!(read(Some(5)).await, better_compute_nodes::sessions::consoles::ConsoleTail { offset: 5, next_offset: 5, text: String::new(), truncated: false });
}
