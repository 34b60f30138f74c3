//! Capacity against a real PostgreSQL in simulated time: placing, quotas, eligibility, pending and
//! retries, extend and release, time, idempotency, MIG and shared GPUs, mode changes, bad input.


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations::{self, GpuRequest, Toleration};
use better_compute_capacity::{mode, quota};
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn count(h: &better_compute_runtime::harness::Harness, sql: &str) -> i64 {
    h.db().client().await.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_reservation_books_whole_gpus_scalars_and_quota_on_one_node() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 8).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    assert_eq!(r.state, "placed");
    assert_eq!(r.atoms.len(), 4);
    let node = r.node_id.clone().unwrap();
    assert!(r.atoms.iter().all(|a| f.gpus[f.nodes.iter().position(|n| *n == node).unwrap()].contains(a)));
    let q = quota::get(&c, TENANT).await.unwrap();
    let used = |res: &str| q.iter().find(|x| x.resource == res).unwrap().used;
    assert_eq!((used("gpus"), used("vcpu"), used("memory_mib"), used("disk_gib")), (4, 8, 65_536, 100));
    let vcpu: i32 = c.query_one("SELECT vcpu_allocated FROM node_resources WHERE node_id = $1", &[&node]).await.unwrap().get(0);
    assert_eq!(vcpu, 8);
    // Packing: the next reservation goes to the same, busier node while it fits.
    let r2 = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    assert_eq!(r2.node_id, r.node_id);
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap(), r);
}

#[tokio::test]
async fn another_tenant_cannot_see_or_release_a_reservation() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    let other = better_compute_capacity::Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    assert_eq!(reservations::get(&c, other, &r.id).await.unwrap_err().code, ErrorCode::NotFound);
    assert_eq!(reservations::release(&mut c, &TEST_ACTOR, other, &r.id).await.unwrap_err().code, ErrorCode::NotFound);
    assert!(reservations::list(&c, other, None, None, 10).await.unwrap().items.is_empty());
}

#[tokio::test]
async fn quota_exceeded_is_final_and_writes_nothing() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 8).await;
    let mut c = h.db().connect().await;
    quota::set(&c, TENANT, "gpus", 3).await.unwrap();
    reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::QuotaExceeded);
    assert!(err.message.contains("2 of 3 used"), "{}", err.message);
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 1);
    assert_eq!(count(&h, "SELECT used FROM quota_usage WHERE resource = 'gpus'").await, 2);
    assert_eq!(count(&h, "SELECT used FROM quota_usage WHERE resource = 'vcpu'").await, 8);
    // A tenant without a quota line gets a message that says what to do.
    let stranger = better_compute_capacity::Caller { tenant_id: "ten_new", identity_id: "idn_new" };
    let err = reservations::create(&mut c, &TEST_ACTOR, stranger, &whole(&f.pool_id, 1)).await.unwrap_err();
    assert!(err.message.contains("ask an operator"), "{}", err.message);
    // Lowering a quota below what is in use is refused.
    assert_eq!(
        better_compute_core::Error::from(quota::set(&c, TENANT, "gpus", 1).await.unwrap_err()).code,
        ErrorCode::FailedPrecondition
    );
}

#[tokio::test]
async fn bad_input_is_refused_with_the_field_named_and_nothing_written() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let cases: Vec<(reservations::CreateReservation, ErrorCode, &str)> = vec![
        ({ let mut r = whole(&f.pool_id, 1); r.duration_s = None; r.ends_at = Some("2029-01-01T00:00:00Z".into()); r }, ErrorCode::InvalidArgument, "endsAt"),
        ({ let mut r = whole(&f.pool_id, 1); r.duration_s = None; r.starts_at = Some("2030-02-01T00:00:00Z".into()); r.ends_at = Some("2030-01-15T00:00:00Z".into()); r }, ErrorCode::InvalidArgument, "endsAt"),
        ({ let mut r = whole(&f.pool_id, 1); r.duration_s = None; r.ends_at = Some("now".into()); r }, ErrorCode::InvalidArgument, "RFC 3339"),
        ({ let mut r = whole(&f.pool_id, 1); r.duration_s = Some(0); r }, ErrorCode::InvalidArgument, "durationS"),
        ({ let mut r = whole(&f.pool_id, 0); r.vcpu = 0; r.memory_mib = 0; r.disk_gib = 0; r }, ErrorCode::InvalidArgument, "ask for something"),
        ({ let mut r = whole(&f.pool_id, 1); r.vcpu = -1; r }, ErrorCode::InvalidArgument, "vcpu"),
        ({ let mut r = whole(&f.pool_id, -2); r.vcpu = 1; r }, ErrorCode::InvalidArgument, "gpu.count"),
        (whole("pool_nope", 1), ErrorCode::NotFound, "pool"),
        ({ let mut r = whole(&f.pool_id, 1); r.gpu.model = "B200".into(); r }, ErrorCode::InvalidArgument, "gpu.model"),
        ({ let mut r = whole(&f.pool_id, 1); r.gpu.kind = "tpu".into(); r }, ErrorCode::InvalidArgument, "gpu.kind"),
        ({ let mut r = whole(&f.pool_id, 1); r.gpu.profile = Some("3g.40gb".into()); r }, ErrorCode::InvalidArgument, "gpu.profile"),
        (whole(&f.pool_id, 9), ErrorCode::FailedPrecondition, "most on one node is 8"),
    ];
    for (req, code, needle) in cases {
        let err = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap_err();
        assert_eq!(err.code, code, "{needle}: {}", err.message);
        assert!(err.message.contains(needle), "expected {needle:?} in {:?}", err.message);
    }
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 0);
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 0);
    assert_eq!(count(&h, "SELECT coalesce(sum(used), 0)::bigint FROM quota_usage").await, 0);
}

#[tokio::test]
async fn ineligible_nodes_and_gpus_are_skipped() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 2).await;
    let mut c = h.db().connect().await;
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &f.nodes[0]).await.unwrap();
        actions::taint(&tx, &f.nodes[1], "dedicated", "team-x").await.unwrap();
        actions::quarantine(&tx, &f.gpus[2][0], "xid 79").await.unwrap();
        actions::set_gpu_health(&tx, &f.gpus[2][1], false).await.unwrap();
        tx.commit().await.unwrap();
    }
    // Node 3 has not converged yet.
    c.execute("UPDATE nodes SET observed_generation = 0 WHERE id = $1", &[&f.nodes[3]]).await.unwrap();
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "pending", "{r:?}");
    assert_eq!(r.conditions[0]["type"], "Unschedulable");
    // Tolerating the taint opens node 1.
    let mut tolerant = whole(&f.pool_id, 2);
    tolerant.tolerations = vec![Toleration { key: "dedicated".into(), value: Some("team-x".into()) }];
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &tolerant).await.unwrap();
    assert_eq!(r.node_id.as_deref(), Some(f.nodes[1].as_str()));
    // A node selector that no node matches.
    let mut picky = whole(&f.pool_id, 1);
    picky.node_selector.insert("rack".into(), serde_json::json!("r9"));
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &picky).await.unwrap().state, "pending");
}

/// Whether a node's atom counts say it is open (all its rows agree, or this fails).
async fn counts_open(h: &better_compute_runtime::harness::Harness, node: &str) -> bool {
    let rows = h.db().client().await.query("SELECT open FROM node_atom_counts WHERE node_id = $1", &[&node]).await.unwrap();
    let flags: Vec<bool> = rows.iter().map(|r| r.get(0)).collect();
    assert!(!flags.is_empty() && flags.iter().all(|o| *o == flags[0]), "{node}: {flags:?}");
    flags[0]
}

#[tokio::test]
async fn a_nodes_counts_close_in_the_transaction_that_makes_it_ineligible_and_reopen_with_it() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let mut c = h.db().connect().await;
    let node = f.nodes[0].clone();
    assert!(counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &node).await.unwrap();
        // Closed before the cordon commits, in its transaction: nothing can see one without the other.
        let o: bool = tx.query_one("SELECT bool_or(open) FROM node_atom_counts WHERE node_id = $1", &[&node]).await.unwrap().get(0);
        assert!(!o);
        tx.commit().await.unwrap();
    }
    assert!(!counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::uncordon(&tx, &node).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::taint(&tx, &node, "dedicated", "team-x").await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(!counts_open(&h, &node).await);
    {
        let tx = c.transaction().await.unwrap();
        actions::untaint(&tx, &node, "dedicated").await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(counts_open(&h, &node).await);
    c.execute("UPDATE nodes SET observed_generation = 0 WHERE id = $1", &[&node]).await.unwrap();
    assert!(!counts_open(&h, &node).await);
    c.execute("UPDATE nodes SET observed_generation = 3 WHERE id = $1", &[&node]).await.unwrap();
    assert!(counts_open(&h, &node).await);
}

/// `better_compute_placer_replans_total{reason}` as this process's recorder has it.
fn replans(reason: &str) -> u64 {
    let series = format!("better_compute_placer_replans_total{{reason=\"{reason}\"}} ");
    let text = better_compute_runtime::metrics::render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test]
async fn a_stale_open_flag_costs_a_replan_never_a_placement_and_the_rollup_puts_it_right() {
    // A flag left open on a cordoned node, as a refresh racing the cordon can leave it.
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    for node in &f.nodes {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, node).await.unwrap();
        tx.commit().await.unwrap();
    }
    c.execute("UPDATE node_atom_counts SET open = true, idle = 1 WHERE node_id = $1", &[&f.nodes[0]]).await.unwrap();
    // The only candidate: tried, and turned away by the recheck under the node's lock, which the
    // placer's replan counter shows (the recorder is this test process's own).
    better_compute_runtime::metrics::install(&[]);
    let before = replans("conflict");
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "pending", "{r:?}");
    let why = r.conditions[0]["message"].as_str().unwrap_or_default().to_owned();
    assert!(why.contains(&format!("{}: became ineligible", f.nodes[0])), "{why}");
    assert_eq!((replans("conflict") - before, replans("stale")), (1, 0));
    // With the other node open again, placements go there, best fit trying the stale node first.
    {
        let tx = c.transaction().await.unwrap();
        actions::uncordon(&tx, &f.nodes[1]).await.unwrap();
        tx.commit().await.unwrap();
    }
    for _ in 0..3 {
        let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
        assert_eq!(r.node_id.as_deref(), Some(f.nodes[1].as_str()), "{r:?}");
    }
    // The pool's rollup, as after any inventory change, closes it again.
    let pools = std::slice::from_ref(&f.pool_id);
    better_compute_runtime::work_queue::enqueue_many(&**h.db().client().await, &better_compute_capacity::ROLLUP_KIND, pools).await.unwrap();
    h.job("capacity.rollup").drain(5).await;
    let stale = better_compute_capacity::invariants::stale_open_flags(&**h.db().client().await).await.unwrap();
    assert!(stale.is_empty(), "{stale:?}");
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{}' AND open", f.nodes[0])).await, 0);
}

#[tokio::test]
async fn a_stale_idle_count_costs_a_replan_that_the_replan_counter_shows() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    let full = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    let full_node = full.node_id.clone().unwrap();
    // The full node's count says one GPU is idle: best fit tries it first, and the atoms' own
    // bookings turn it away under the lock.
    c.execute("UPDATE node_atom_counts SET idle = 1 WHERE node_id = $1", &[&full_node]).await.unwrap();
    better_compute_runtime::metrics::install(&[]);
    let (conflict, stale) = (replans("conflict"), replans("stale"));
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(r.state, "placed", "{r:?}");
    assert_ne!(r.node_id.as_deref(), Some(full_node.as_str()));
    assert_eq!((replans("conflict") - conflict, replans("stale") - stale), (0, 1));
}

#[tokio::test]
async fn what_fits_and_when_counts_one_nodes_free_atoms_and_finds_the_end_of_a_booking() {
    use better_compute_capacity::availability;
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let mut c = h.db().connect().await;
    let gpu = |count| GpuRequest { kind: "gpu".into(), model: MODEL.into(), profile: None, count };
    // Node A full for an hour, node B with one GPU left for two.
    let a = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    let b = reservations::create(&mut c, &TEST_ACTOR, ME, &reservations::CreateReservation { duration_s: Some(7200), ..whole(&f.pool_id, 3) }).await.unwrap();
    assert_ne!(a.node_id, b.node_id);
    let two = availability::of(&c, &f.pool_id, &gpu(2), 1800).await.unwrap();
    assert_eq!((two.placeable_atoms, two.most_free_on_one_node_now, two.fits_now), (8, 1, false), "{two:?}");
    // The earliest start is A's end; a reservation made for then is placed.
    let at = |s: &str| better_compute_core::time::parse_rfc3339(s).unwrap();
    assert_eq!(two.earliest_start.as_deref().map(at), Some(at(&a.ends_at)), "{two:?} {a:?}");
    let later = reservations::create(&mut c, &TEST_ACTOR, ME, &whole_between(&f.pool_id, 2, &a.ends_at, &b.ends_at)).await.unwrap();
    assert_eq!((later.state.as_str(), later.node_id.as_deref()), ("placed", a.node_id.as_deref()), "{later:?}");
    // One fits now; more than a node has never does; a quarantined GPU is not placeable.
    let one = availability::of(&c, &f.pool_id, &gpu(1), 1800).await.unwrap();
    assert_eq!((one.fits_now, one.earliest_start.is_some()), (true, true), "{one:?}");
    let five = availability::of(&c, &f.pool_id, &gpu(5), 1800).await.unwrap();
    assert_eq!((five.fits_now, five.earliest_start), (false, None));
    c.execute("UPDATE devices SET quarantined = true, quarantine_reason = 'test' WHERE id = $1", &[&f.gpus[0][0]]).await.unwrap();
    assert_eq!(availability::of(&c, &f.pool_id, &gpu(1), 1800).await.unwrap().placeable_atoms, 7);
    // Bad input changes nothing and says what is wrong.
    let e = better_compute_core::Error::from(availability::of(&c, &f.pool_id, &gpu(1), 0).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    let e = better_compute_core::Error::from(availability::of(&c, "pool_nope", &gpu(1), 60).await.unwrap_err());
    assert_eq!(e.code, ErrorCode::NotFound);
    // The class is checked as a create checks it: a kind, a profile only for MIG.
    for (kind, profile) in [("tpu", None), ("gpu", Some("3g.40gb")), ("mig", None), ("mig", Some("huge"))] {
        let bad = GpuRequest { kind: kind.into(), profile: profile.map(String::from), ..gpu(1) };
        let e = better_compute_core::Error::from(availability::of(&c, &f.pool_id, &bad, 60).await.unwrap_err());
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{kind} {profile:?}: {e}");
    }
}

#[tokio::test]
async fn a_pending_reservation_is_retried_every_30_seconds_and_placed_when_capacity_frees() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let mut c = h.db().connect().await;
    let first = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    let waiting = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(waiting.state, "pending");
    assert_eq!(waiting.conditions[0]["reason"], "NoCandidates");
    // Pending still holds its quota charge.
    assert_eq!(count(&h, "SELECT used FROM quota_usage WHERE resource = 'gpus'").await, 3);
    h.job("capacity.reservations").drain(5).await;
    assert_eq!(reservations::get(&c, ME, &waiting.id).await.unwrap().state, "pending");
    reservations::release(&mut c, &TEST_ACTOR, ME, &first.id).await.unwrap();
    h.db().advance(Duration::from_secs(29)).await;
    h.job("capacity.reservations").drain(5).await;
    assert_eq!(reservations::get(&c, ME, &waiting.id).await.unwrap().state, "pending");
    h.db().advance(Duration::from_secs(1)).await;
    h.job("capacity.reservations").drain(5).await;
    let placed = reservations::get(&c, ME, &waiting.id).await.unwrap();
    assert_eq!(placed.state, "active", "placed at the retry and, its start having come, active: {placed:?}");
    assert!(placed.conditions.is_empty());
    assert_eq!(placed.atoms.len(), 1);
}

#[tokio::test]
async fn reservations_become_active_at_their_start_and_expire_at_their_end_giving_everything_back() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let later = whole_between(&f.pool_id, 2, "2030-01-01T01:00:00Z", "2030-01-01T02:00:00Z");
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &later).await.unwrap();
    assert_eq!((r.state.as_str(), r.starts_at.as_str()), ("placed", "2030-01-01T01:00:00.000000Z"));
    h.job("capacity.reservations").drain(5).await;
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().state, "placed");
    h.db().advance(Duration::from_secs(3600)).await;
    h.job("capacity.reservations").drain(5).await;
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().state, "active");
    h.db().advance(Duration::from_secs(3600)).await;
    h.job("capacity.reservations").drain(5).await;
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().state, "expired");
    assert_eq!(count(&h, "SELECT coalesce(sum(used), 0)::bigint FROM quota_usage").await, 0);
    assert_eq!(count(&h, "SELECT sum(vcpu_allocated)::bigint FROM node_resources").await, 0);
    let events: Vec<String> = c
        .query("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq", &[&r.id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(events, ["reservation.placed", "reservation.active", "reservation.expired"]);
    // The job's moves are in the tenant's audit log (beside its create, the test's own).
    let job = |action: &str| ("capacity.reservations".to_owned(), action.to_owned(), r.id.clone(), Some(TENANT.to_owned()));
    assert_eq!(job_entries(&h, &r.id).await, [job("reservations.activate"), job("reservations.expire")]);
    // Its bookings left the live table whole, for the history.
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 0);
    let held = "SELECT count(*) FROM device_booking_history WHERE during = '[2030-01-01T01:00:00Z,2030-01-01T02:00:00Z)'";
    assert_eq!(count(&h, held).await, 2);
    // Every change invalidated the node's desired state.
    assert_eq!(count(&h, "SELECT count(*) FROM work_queue WHERE kind = 'nodespec'").await, 1);
}

#[tokio::test]
async fn release_gives_back_quota_scalars_and_the_future_of_the_bookings_once() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 3)).await.unwrap();
    h.db().advance(Duration::from_secs(600)).await;
    let released = reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    assert_eq!(released.state, "released");
    assert_eq!(count(&h, "SELECT coalesce(sum(used), 0)::bigint FROM quota_usage").await, 0);
    assert_eq!(count(&h, "SELECT sum(vcpu_allocated)::bigint FROM node_resources").await, 0);
    // Nothing stays live; what it held (the 600 s up to the release) is in the history, and the view
    // still names its atoms.
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 0);
    assert_eq!(
        count(&h, "SELECT count(*) FROM device_booking_history WHERE upper(during) = compute_now() AND upper(during) - lower(during) = '600 s'")
            .await,
        3
    );
    assert_eq!((released.atoms.len(), &released.atoms), (3, &r.atoms));
    // Again: unchanged, nothing refunded twice.
    assert_eq!(reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap(), released);
    assert_eq!(count(&h, "SELECT coalesce(sum(used), 0)::bigint FROM quota_usage").await, 0);
}

#[tokio::test]
async fn extend_books_the_added_time_or_changes_nothing() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let mut c = h.db().connect().await;
    let mut first = whole(&f.pool_id, 1);
    first.duration_s = None;
    first.ends_at = Some("2030-01-01T01:00:00Z".into());
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &first).await.unwrap();
    let e = reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T02:00:00Z", Some("ext-1")).await.unwrap();
    assert_eq!((e.ends_at.as_str(), e.version), ("2030-01-01T02:00:00.000000Z", r.version + 1));
    // A retry with the same key replays.
    assert_eq!(reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T02:00:00Z", Some("ext-1")).await.unwrap(), e);
    // Someone books the GPU after our end; extending into it is a conflict and changes nothing.
    let next = whole_between(&f.pool_id, 1, "2030-01-01T02:00:00Z", "2030-01-01T03:00:00Z");
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &next).await.unwrap().state, "placed");
    let err = reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T02:30:00Z", None).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Conflict);
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap(), e);
    let err = reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T01:30:00Z", None).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    // Once its end has come it is over, whether or not capacity.reservations has marked it expired.
    h.db().advance(Duration::from_secs(7200)).await;
    let err = reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T05:00:00Z", None).await.unwrap_err();
    assert_eq!((err.code, err.message.contains("ended at 2030-01-01T02:00:00")), (ErrorCode::FailedPrecondition, true), "{err:?}");
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap(), e);
}

#[tokio::test]
async fn extend_locks_its_atoms_before_booking_them_as_a_mode_change_does() {
    // Extend's bookings used to lock their atoms only through the foreign key, after the insert. A
    // mode change holding the GPU and booking its change window over the added time then waited for
    // the extend's booking while the extend waited for the GPU: the torture test met it once in 600
    // seeds. Here a transaction stands in for the mode change.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole_between(&f.pool_id, 1, "2030-01-01T00:00:00Z", "2030-01-01T01:00:00Z"))
        .await
        .unwrap();
    let atom = r.atoms[0].clone();
    let mut m = h.db().connect().await;
    let change = m.transaction().await.unwrap();
    change.execute("SELECT 1 FROM devices WHERE id = $1 FOR UPDATE", &[&atom]).await.unwrap();
    let extend = async { reservations::extend(&mut c, &TEST_ACTOR, ME, &r.id, "2030-01-01T02:00:00Z", None).await };
    let standin = async {
        waits_for_a_lock(&h, "device", "the extend never waited for the GPU").await;
        let held = change
            .execute(
                "INSERT INTO device_bookings (device_id, allocation_id, during)
                 VALUES ($1, 'change:standin', tstzrange('2030-01-01T01:00:00Z', '2030-01-01T01:02:00Z', '[)')) ON CONFLICT DO NOTHING",
                &[&atom],
            )
            .await
            .expect("the change window must not deadlock with the extend");
        change.commit().await.unwrap();
        held
    };
    let (extended, held) = tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(extend, standin) }).await.expect("hung");
    assert_eq!(held, 1);
    // Refused for the booking it met, not as a deadlock's victim ("a concurrent change interfered").
    let err = extended.unwrap_err();
    assert_eq!((err.code, err.message.contains("booked by another reservation")), (ErrorCode::Conflict, true), "{err:?}");
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().ends_at, "2030-01-01T01:00:00.000000Z");
}

#[tokio::test]
async fn an_idempotency_key_makes_a_retried_create_return_the_first_reservation() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let mut req = whole(&f.pool_id, 1);
    req.idempotency_key = Some("create-1".into());
    let a = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    let b = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    assert_eq!(a, b);
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 1);
    req.gpu.count = 2;
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap_err().code, ErrorCode::Conflict);
}

#[tokio::test]
async fn list_pages_through_the_tenants_reservations() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 8).await;
    let mut c = h.db().connect().await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap().id);
    }
    ids.sort();
    let p1 = reservations::list(&c, ME, None, None, 2).await.unwrap();
    let p2 = reservations::list(&c, ME, None, p1.next_cursor.as_deref(), 2).await.unwrap();
    let p3 = reservations::list(&c, ME, None, p2.next_cursor.as_deref(), 2).await.unwrap();
    let seen: Vec<String> = [p1.items, p2.items, p3.items.clone()].concat().into_iter().map(|r| r.id).collect();
    assert_eq!(seen, ids);
    assert!(p3.next_cursor.is_none());
    assert_eq!(reservations::list(&c, ME, Some("bogus"), None, 2).await.unwrap_err().code, ErrorCode::InvalidArgument);
}

#[tokio::test]
async fn mig_instances_and_slots_are_atoms_and_their_parent_never_is() {
    let h = harness().await;
    let modes = [GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }, GpuMode::TimeSlice { slots: 4 }];
    let f = fleet(&h, &modes, 1).await;
    let mut c = h.db().connect().await;
    let mut mig = whole(&f.pool_id, 2);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 2 };
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    assert_eq!(r.atoms, [format!("{}/mig0", f.gpus[0][0]), format!("{}/mig1", f.gpus[0][0])]);
    let mut slots = whole(&f.pool_id, 3);
    slots.gpu = GpuRequest { kind: "slot".into(), model: MODEL.into(), profile: None, count: 3 };
    let s = reservations::create(&mut c, &TEST_ACTOR, ME, &slots).await.unwrap();
    assert_eq!(s.atoms.len(), 3);
    assert!(s.atoms.iter().all(|a| a.starts_with(&format!("{}/s", f.gpus[1][0]))));
    // No whole GPU is bookable: both are shared.
    assert_eq!(
        reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    let q = quota::get(&c, TENANT).await.unwrap();
    assert_eq!(q.iter().find(|x| x.resource == "mig_instances").unwrap().used, 2);
    assert_eq!(q.iter().find(|x| x.resource == "gpu_slots").unwrap().used, 3);
}

#[tokio::test]
async fn a_mode_change_waits_for_an_empty_gpu_then_replaces_its_atoms() {
    let h = harness().await;
    let f = fleet(&h, &[GpuMode::Exclusive], 1).await;
    let gpu = f.gpus[0][0].clone();
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    let to_mig = GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] };
    let err = mode::change_gpu_mode(&mut c, &TEST_ACTOR, &gpu, &to_mig).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::FailedPrecondition);
    assert!(err.message.contains(&r.id), "{}", err.message);
    reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &gpu, &to_mig).await.unwrap();
    // The parent is no longer bookable; its instances are, after the change window.
    let mut mig = whole(&f.pool_id, 1);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 1 };
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap().state, "pending");
    h.db().advance(mode::CHANGE_WINDOW).await;
    let on_mig = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    assert_eq!(on_mig.state, "placed");
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap_err().code, ErrorCode::InvalidArgument);
    // The node's desired state was invalidated, and a bad layout is refused.
    assert!(count(&h, "SELECT count(*) FROM work_queue WHERE kind = 'nodespec'").await >= 1);
    let bad = GpuMode::Mig { layout: vec!["7g.80gb".into(), "1g.10gb".into()] };
    assert_eq!(mode::change_gpu_mode(&mut c, &TEST_ACTOR, &gpu, &bad).await.unwrap_err().code, ErrorCode::InvalidArgument);
    // The next change moves the ended window (the parent and both instances) to the history: only
    // its own window stays live.
    reservations::release(&mut c, &TEST_ACTOR, ME, &on_mig.id).await.unwrap();
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &gpu, &GpuMode::Exclusive).await.unwrap();
    let live = "SELECT count(DISTINCT allocation_id) FROM device_bookings";
    assert_eq!(count(&h, live).await, 1);
    assert_eq!(count(&h, "SELECT count(*) FROM device_booking_history WHERE allocation_id LIKE 'change:%'").await, 3);
}

#[tokio::test]
async fn a_release_before_the_start_gives_its_atoms_back_to_the_idle_counts() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 4).await;
    let mut c = h.db().connect().await;
    let later = whole_between(&f.pool_id, 2, "2030-01-01T01:00:00Z", "2030-01-01T02:00:00Z");
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &later).await.unwrap();
    assert_eq!(count(&h, "SELECT sum(total - idle)::bigint FROM node_atom_counts").await, 2);
    let released = reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    // Nothing was held, so nothing is kept; both atoms are idle again.
    assert!(released.atoms.is_empty(), "{released:?}");
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await + count(&h, "SELECT count(*) FROM device_booking_history").await, 0);
    assert_eq!(count(&h, "SELECT sum(total - idle)::bigint FROM node_atom_counts").await, 0);
}

#[tokio::test]
async fn the_rollup_counts_a_pools_atoms_nodes_and_free_scalars() {
    let h = harness().await;
    let modes = [GpuMode::Exclusive, GpuMode::Exclusive, GpuMode::TimeSlice { slots: 4 }];
    let f = fleet(&h, &modes, 2).await;
    let mut c = h.db().connect().await;
    reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    {
        let tx = c.transaction().await.unwrap();
        actions::cordon(&tx, &f.nodes[1]).await.unwrap();
        tx.commit().await.unwrap();
    }
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(5).await;
    h.job("capacity.rollup").drain(5).await;
    let row = c
        .query_one("SELECT atoms, nodes, schedulable_nodes, vcpu_free FROM pool_capacity_rollup WHERE pool_id = $1", &[&f.pool_id])
        .await
        .unwrap();
    let atoms: serde_json::Value = row.get(0);
    assert_eq!(
        atoms,
        serde_json::json!([
            {"kind": "gpu", "model": MODEL, "profile": "", "total": 4, "idle": 2},
            {"kind": "slot", "model": MODEL, "profile": "", "total": 8, "idle": 8},
        ])
    );
    assert_eq!((row.get::<_, i32>(1), row.get::<_, i32>(2), row.get::<_, i64>(3)), (3, 2, 3 * 128 - 8));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reservations_never_charge_past_the_quota_nor_book_an_atom_twice() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 8).await;
    {
        let c = h.db().client().await;
        quota::set(&**c, TENANT, "gpus", 10).await.unwrap();
    }
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let conn = h.db().connection_string().to_owned();
        let pool = f.pool_id.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&conn).await.unwrap();
            reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&pool, 1)).await
        }));
    }
    let (mut placed, mut refused) = (0, 0);
    for t in tasks {
        match tokio::time::timeout(Duration::from_secs(60), t).await.expect("hung").unwrap() {
            Ok(r) => {
                assert_eq!(r.state, "placed");
                placed += 1;
            }
            Err(e) => {
                assert_eq!(e.code, ErrorCode::QuotaExceeded, "{}", e.message);
                refused += 1;
            }
        }
    }
    assert_eq!((placed, refused), (10, 30));
    assert_eq!(count(&h, "SELECT used FROM quota_usage WHERE resource = 'gpus'").await, 10);
    assert_eq!(count(&h, "SELECT count(DISTINCT device_id) FROM device_bookings").await, 10);
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 10);
}

#[tokio::test]
async fn a_nodes_desired_state_follows_its_reservations_and_gpu_modes() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = f.nodes[0].clone();
    let mut c = h.db().connect().await;
    async fn spec_of(c: &tokio_postgres::Client, node: &str) -> (i64, i64, serde_json::Value) {
        let r = c.query_one("SELECT generation, observed_generation, spec FROM nodes WHERE id = $1", &[&node]).await.unwrap();
        (r.get(0), r.get(1), r.get(2))
    }
    // Adoption enqueued nodespec work: the first spec is generation 1.
    h.job("nodespec").drain(5).await;
    let (generation, observed, s) = spec_of(&c, &node).await;
    assert_eq!((generation, observed), (1, 1));
    assert_eq!(s["site"]["poolName"], "pool-a");
    assert_eq!(s["gpus"]["gpus"].as_array().unwrap().len(), 2);
    assert_eq!(s["agent"]["lanes"][0]["name"], "default");
    assert!(s["allocations"].get("allocations").is_none(), "{s}");
    // A reservation exposes its atoms to its allocation: one new generation.
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    h.job("nodespec").drain(5).await;
    let (generation, _, s) = spec_of(&c, &node).await;
    assert_eq!(generation, 2);
    assert_eq!(s["allocations"]["allocations"][0]["allocationId"], r.id.as_str());
    assert_eq!(s["allocations"]["allocations"][0]["atoms"], serde_json::json!(r.atoms));
    // Released: gone from the spec, one more generation.
    reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    h.job("nodespec").drain(5).await;
    assert_eq!(spec_of(&c, &node).await.0, 3);
    // A daemon's reports only move observedGeneration up.
    assert_eq!(better_compute_nodes::inventory::report_observed_generation(&c, &node, 3).await.unwrap(), 3);
    assert_eq!(better_compute_nodes::inventory::report_observed_generation(&c, &node, 2).await.unwrap(), 3);
    let v = better_compute_nodes::inventory::get_node(&c, &node).await.unwrap();
    assert_eq!((v.generation, v.observed_generation), (3, 3));
    // A mode change changes the gpus section.
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &f.gpus[0][1], &GpuMode::TimeSlice { slots: 2 }).await.unwrap();
    h.job("nodespec").drain(5).await;
    let (generation, _, s) = spec_of(&c, &node).await;
    assert_eq!(generation, 4);
    assert_eq!(s["gpus"]["gpus"][1]["mode"], "GPU_MODE_TIME_SLICE");
}

#[tokio::test]
async fn the_database_allows_exactly_the_transitions_of_the_reservation_state_table() {
    use better_compute_core::state::{ReservationState, State, RESERVATION_STATE_TABLE};
    let h = harness().await;
    let c = h.db().client().await;
    for from in ReservationState::ALL {
        for to in ReservationState::ALL {
            if from == to {
                continue;
            }
            let allowed: bool = c
                .query_one("SELECT reservations_state_may_become($1, $2)", &[&from.as_str(), &to.as_str()])
                .await
                .unwrap()
                .get(0);
            assert_eq!(allowed, RESERVATION_STATE_TABLE.check(*from, *to).is_ok(), "{} -> {}", from.as_str(), to.as_str());
        }
    }
}

#[tokio::test]
async fn an_undeclared_transition_is_refused_by_the_database_and_changes_nothing() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    reservations::release(&mut c, &TEST_ACTOR, ME, &r.id).await.unwrap();
    // released is terminal: even a statement written by hand cannot bring it back.
    let err = c.execute("UPDATE reservations SET state = 'active' WHERE id = $1", &[&r.id]).await.unwrap_err();
    let err: better_compute_core::Error = better_compute_db::DbError::from(err).into();
    assert_eq!(err.code, ErrorCode::FailedPrecondition);
    assert_eq!(err.details["reason"], "ILLEGAL_TRANSITION");
    assert_eq!((err.details["from"].as_str(), err.details["to"].as_str()), (Some("released"), Some("active")));
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().state, "released");
}

#[tokio::test]
async fn a_release_takes_the_nodes_counters_before_its_bookings_as_the_placer_does() {
    // The placer updates a node's node_resources row and then inserts bookings. A release that cut
    // its bookings first and then waited for that row deadlocked with a placement booking the same
    // atom over an overlapping range (one whose snapshot predates the released booking): the
    // capacity bench met it. Here a transaction stands in for that placement, step by step.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    let (node, atom) = (r.node_id.clone().unwrap(), r.atoms[0].clone());
    let mut p = h.db().connect().await;
    let placement = p.transaction().await.unwrap();
    placement.execute("UPDATE node_resources SET vcpu_allocated = vcpu_allocated + 1 WHERE node_id = $1", &[&node]).await.unwrap();
    let id = r.id.clone();
    let release = tokio::spawn(async move { reservations::release(&mut c, &TEST_ACTOR, ME, &id).await });
    // The release now waits for the node's row, having touched no booking yet.
    waits_for_a_lock(&h, "capacity_end", "the release never waited for the node's counters").await;
    // The placement books the same atom: the release's booking is committed and untouched, so the
    // insert sees the conflict at once (no row) instead of waiting for the release.
    let booked = placement
        .execute(
            "INSERT INTO device_bookings (device_id, allocation_id, during)
             VALUES ($1, 'res_standin', tstzrange(compute_now(), compute_now() + interval '1 hour', '[)')) ON CONFLICT DO NOTHING",
            &[&atom],
        )
        .await
        .expect("the placement's booking must not deadlock with the release");
    assert_eq!(booked, 0);
    placement.rollback().await.unwrap();
    let v = tokio::time::timeout(Duration::from_secs(30), release).await.expect("release hung").unwrap().unwrap();
    assert_eq!(v.state, "released");
}

#[tokio::test]
async fn a_placement_that_waited_books_a_released_gpu_only_from_the_instant_its_release_ended_it() {
    // A create reads the clock when it begins. One that then waited (here for its tenant's quota
    // rows) while the clock moved on and a release freed a GPU booked that GPU from its own earlier
    // instant, over the end of the released reservation: two tenants on one GPU for the wait.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let mut c = h.db().connect().await;
    open_quota(&c, "ten_b").await;
    let other = better_compute_capacity::Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    let held = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    let mut z = h.db().connect().await;
    let quota_rows = z.transaction().await.unwrap();
    quota_rows.execute("SELECT 1 FROM quota_usage WHERE tenant_id = 'ten_b' FOR UPDATE", &[]).await.unwrap();
    let mut p = h.db().connect().await;
    let pool = f.pool_id.clone();
    let create = tokio::spawn(async move { reservations::create(&mut p, &TEST_ACTOR, other, &whole(&pool, 1)).await });
    waits_for_a_lock(&h, "capacity_reserve", "the create never waited for its quota rows").await;
    h.db().advance(Duration::from_secs(5)).await;
    reservations::release(&mut c, &TEST_ACTOR, ME, &held.id).await.unwrap();
    quota_rows.commit().await.unwrap();
    let v = tokio::time::timeout(Duration::from_secs(30), create).await.expect("create hung").unwrap().unwrap();
    assert_eq!((v.state.as_str(), &v.atoms), ("placed", &held.atoms));
    let ended: String = c
        .query_one("SELECT upper(during)::text FROM device_booking_history WHERE allocation_id = $1", &[&held.id])
        .await
        .unwrap()
        .get(0);
    let booked = booking_starts(&c, &v.id).await;
    assert_eq!(booked, vec![ended.clone()], "the new booking starts where the released one ended");
    let starts: String = c.query_one("SELECT lower(during)::text FROM reservations WHERE id = $1", &[&v.id]).await.unwrap().get(0);
    assert_eq!(starts, ended, "the reservation starts with its bookings");
    assert_invariants_hold(&c).await;
    // And the invariants catch the overlap as it was.
    c.execute("UPDATE device_bookings SET during = tstzrange(lower(during) - interval '5 s', upper(during)) WHERE allocation_id = $1", &[&v.id])
        .await
        .unwrap();
    let report = better_compute_capacity::invariants::check(&c, &Default::default()).await.unwrap();
    let overlaps: Vec<_> = report.violations.iter().filter(|v| v.starts_with("a booking overlapping another reservation's ended")).collect();
    assert_eq!(overlaps.len(), 1, "{:?}", report.violations);
}

#[tokio::test]
async fn a_reservation_run_commits_each_step_so_its_wake_ups_never_wait_on_a_release_holding_quota() {
    // A run of capacity.reservations may take a reservation through several steps (activated, then
    // expired once the clock has moved on). Each step ends by queueing its node's desired-state
    // wake-up, the last table of the lock order; an expiry begins with the quota rows, the first. In
    // one transaction, a run that queued the wake-up and then waited for quota held by a release
    // deadlocked with it once the release went on to queue the same wake-up: the torture test met
    // it about once per 200 seeds. Here a transaction stands in for that release, step by step.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let node = f.nodes[0].clone();
    let mut c = h.db().connect().await;
    let later = whole_between(&f.pool_id, 2, "2030-01-01T01:00:00Z", "2030-01-01T01:00:20Z");
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &later).await.unwrap();
    h.job("capacity.reservations").drain(5).await;
    h.db().advance(Duration::from_secs(3610)).await;
    // The worker renews its leases (and queues its periodic keys) now; the clock will move 12 s
    // during the run, within the leases' 15 s.
    h.worker().maintain().await.unwrap();
    // The node's wake-up is held, so the run's first step (the activation) waits at its end.
    let mut z = h.db().connect().await;
    let wake_up = z.transaction().await.unwrap();
    wake_up.execute("SELECT work_queue_enqueue(ARRAY['nodespec'], ARRAY[$1], ARRAY[0::int2], 0)", &[&node]).await.unwrap();
    let mut y = h.db().connect().await;
    let y_pid: i32 = y.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let release = y.transaction().await.unwrap();
    let run = async { h.worker().tick("capacity.reservations").await.unwrap() };
    let standin = async {
        waits_for_a_lock(&h, "capacity_step", "the run never waited for the node's wake-up").await;
        // The clock passes the reservation's end, the release takes the tenant's quota rows (its
        // first lock) and the held wake-up commits: the run's next step, the expiry, waits for quota.
        h.db().advance(Duration::from_secs(12)).await;
        release.execute("SELECT 1 FROM quota_usage WHERE tenant_id = $1 FOR UPDATE", &[&TENANT]).await.unwrap();
        wake_up.commit().await.unwrap();
        let watcher = h.db().client().await;
        let blocked = async {
            while watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE query LIKE '%capacity_step%' AND $1 = ANY(pg_blocking_pids(pid))",
                    &[&y_pid],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 0
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), blocked).await.expect("the expiry never waited for quota");
        // The release ends as every change does: it queues the node's wake-up.
        release
            .execute("SELECT work_queue_enqueue(ARRAY['nodespec'], ARRAY[$1], ARRAY[0::int2], 0)", &[&node])
            .await
            .expect("the release's wake-up must not deadlock with the run");
        release.commit().await.unwrap();
    };
    let (report, ()) = tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(run, standin) }).await.expect("hung");
    assert_eq!((report.errors, report.last_error), (0, None));
    assert_eq!(reservations::get(&c, ME, &r.id).await.unwrap().state, "expired");
    let events: Vec<String> = c
        .query("SELECT type FROM outbox WHERE subject = $1 ORDER BY txid, seq", &[&r.id])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(events, ["reservation.placed", "reservation.active", "reservation.expired"]);
}

#[tokio::test]
async fn a_taint_and_a_refresh_lock_a_nodes_count_rows_in_the_same_order() {
    // A taint (or cordon) updates the node's row and, by trigger, the open flag of every count row
    // of the node; a refresh (the inventory subscriber's, a mode change's) upserts them in key
    // order. The trigger took them in its plan's order, which for a sequential scan is the heap's:
    // a node with two classes could have them locked in opposite orders, and the torture test met
    // the deadlock about once per 400 seeds. Here a transaction stands in for the refresh.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let node = f.nodes[0].clone();
    let mut c = h.db().connect().await;
    mode::change_gpu_mode(&mut c, &TEST_ACTOR, &f.gpus[0][1], &GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }).await.unwrap();
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    // A new version of the gpu row: in the heap it now comes after the mig row, though before it in
    // key order ('gpu' < 'mig').
    c.execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'gpu'", &[&node]).await.unwrap();
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{node}' AND open")).await, 2);
    let mut z = h.db().connect().await;
    let refresh = z.transaction().await.unwrap();
    refresh.execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'gpu'", &[&node]).await.unwrap();
    let mut t = h.db().connect().await;
    // The trigger's statement planned as a sequential scan, in heap order.
    t.batch_execute("SET enable_indexscan = off; SET enable_bitmapscan = off").await.unwrap();
    let taint_tx = t.transaction().await.unwrap();
    let taint = async {
        actions::taint(&taint_tx, &node, "maint", "yes").await.expect("the taint must not deadlock with the refresh");
        taint_tx.commit().await.unwrap();
    };
    let standin = async {
        waits_for_a_lock(&h, "UPDATE nodes SET taints", "the taint never waited for the refresh's first row").await;
        refresh
            .execute("UPDATE node_atom_counts SET idle = idle WHERE node_id = $1 AND kind = 'mig'", &[&node])
            .await
            .expect("the refresh's second row must not deadlock with the taint");
        refresh.commit().await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(taint, standin) }).await.expect("hung");
    assert_eq!(count(&h, &format!("SELECT count(*) FROM node_atom_counts WHERE node_id = '{node}' AND open")).await, 0);
}

#[tokio::test]
async fn two_releases_racing_end_a_reservation_once_and_give_its_atoms_back_once() {
    // Release ends the reservation's row in its first statement. The second of two racing releases
    // waits for the first's lock, re-reads the row as ended, and changes nothing: one refund, one
    // event, the idle counts back to the node's total once, its bookings moved once.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 4).await;
    let mut c = h.db().connect().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await.unwrap();
    h.db().advance(Duration::from_secs(60)).await;
    let mut a = h.db().connect().await;
    let first = a.transaction().await.unwrap();
    let ended: serde_json::Value = first
        .query_one("SELECT capacity_end($1, $2, 'released', 'evt_first', 0::int2)", &[&r.id, &ME.tenant_id])
        .await
        .unwrap()
        .get(0);
    let id = r.id.clone();
    let second = tokio::spawn(async move { reservations::release(&mut c, &TEST_ACTOR, ME, &id).await });
    waits_for_a_lock(&h, "capacity_end", "the second release never waited for the first").await;
    first.commit().await.unwrap();
    let v = tokio::time::timeout(Duration::from_secs(30), second).await.expect("release hung").unwrap().unwrap();
    assert_eq!((v.state.as_str(), serde_json::json!(v.version)), ("released", ended["version"].clone()));
    assert_eq!(count(&h, "SELECT coalesce(sum(used), 0)::bigint FROM quota_usage").await, 0);
    assert_eq!(count(&h, "SELECT sum(vcpu_allocated)::bigint FROM node_resources").await, 0);
    assert_eq!(count(&h, &format!("SELECT count(*) FROM outbox WHERE subject = '{}' AND type = 'reservation.released'", r.id)).await, 1);
    assert_eq!(count(&h, "SELECT sum(total - idle)::bigint FROM node_atom_counts").await, 0);
    // Its two bookings moved to the history once.
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 0);
    assert_eq!(count(&h, "SELECT count(*) FROM device_booking_history").await, 2);
}

#[tokio::test]
async fn an_atoms_bookings_are_looked_up_through_the_btree_whatever_the_statistics() {
    // The exclusion constraint's GiST also indexes device_id, but an equality on text reads most of
    // it; and plans made from a nearly empty table's statistics scanned every live booking for each
    // atom. The lookups compare device_id in the "C" collation, which only device_bookings_atom_end
    // has, and the functions that run them allow no index-only scan, which is how the GiST served
    // them as a full scan once the table was analyzed empty (capacity 0011). Checked on generic
    // plans over a table analyzed after its bookings were moved out, the worst case for the
    // planner's estimates, under the settings of those functions.
    let h = harness().await;
    let _fleet = fleet(&h, &exclusive(1), 2).await;
    let c = h.db().connect().await;
    // Indexes of some size, on a table with nothing live left in it.
    c.batch_execute(
        "INSERT INTO device_bookings (device_id, allocation_id, during)
           SELECT d.id, 'res_' || k, tstzrange(compute_now() + make_interval(hours => k), compute_now() + make_interval(hours => k + 1))
             FROM devices d, generate_series(1, 500) k;
         DELETE FROM device_bookings;
         ANALYZE device_bookings;",
    )
    .await
    .unwrap();
    assert_eq!(count(&h, "SELECT reltuples::bigint FROM pg_class WHERE relname = 'device_bookings'").await, 0);
    for function in ["capacity_place", "capacity_end", "capacity_upsert_node_counts"] {
        let config = format!("SELECT count(*) FROM pg_proc WHERE proname = '{function}' AND 'enable_indexonlyscan=off' = ANY(proconfig)");
        assert_eq!(count(&h, &config).await, 1, "{function} allows index-only scans");
    }
    c.batch_execute(
        "SET enable_seqscan = off; SET enable_indexonlyscan = off; SET plan_cache_mode = force_generic_plan;
         PREPARE latest_end(text) AS
           SELECT max(upper(o.during)) FROM device_bookings o WHERE o.device_id COLLATE \"C\" = $1;
         PREPARE free_atoms(text, tstzrange) AS
           SELECT a.id FROM devices a
            WHERE a.node_id = $1
              AND coalesce((SELECT max(upper(b.during)) FROM device_bookings b
                             WHERE b.device_id COLLATE \"C\" = a.id AND lower(b.during) < upper($2)),
                           '-infinity') <= lower($2);
         PREPARE busy(text[]) AS
           SELECT b.allocation_id FROM device_bookings b
            WHERE b.device_id COLLATE \"C\" = ANY($1) AND upper(b.during) > compute_now()
            ORDER BY upper(b.during) DESC LIMIT 1;",
    )
    .await
    .unwrap();
    for q in [
        "EXPLAIN EXECUTE latest_end('GPU-0')",
        "EXPLAIN EXECUTE free_atoms('node_0', tstzrange(compute_now(), compute_now() + interval '1 hour'))",
        "EXPLAIN EXECUTE busy(ARRAY['GPU-0'])",
    ] {
        let plan: Vec<String> = c.query(q, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let plan = plan.join("\n");
        assert!(plan.contains("device_bookings_atom_end"), "{q}:\n{plan}");
        assert!(!plan.contains("device_bookings_device_id_during_excl"), "{q}:\n{plan}");
        // The atom's id is part of the index condition, not a filter applied to every live booking.
        let cond = plan.lines().skip_while(|l| !l.contains("device_bookings_atom_end")).nth(1).unwrap_or_default();
        assert!(cond.contains("Index Cond") && cond.contains("device_id"), "{q}:\n{plan}");
    }
}

#[tokio::test]
async fn the_candidate_searches_run_on_generic_plans_that_walk_the_class_in_index_order() {
    // capacity_candidates forces generic plans: under load the plan cache kept planning its searches
    // again at most calls, which cost more than running them. Its generic plans must then be the
    // ones the searches are written for: the class's counts in index order, within the window.
    let h = harness().await;
    let c = h.db().connect().await;
    let config: Option<Vec<String>> = c
        .query_one("SELECT proconfig FROM pg_proc WHERE proname = 'capacity_candidates'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(config.unwrap_or_default().contains(&"plan_cache_mode=force_generic_plan".to_owned()));
    c.batch_execute(
        "SET plan_cache_mode = force_generic_plan;
         PREPARE best_fit(text, text, text, text, int, jsonb, text[], bigint) AS
           SELECT array_agg(s.node_id ORDER BY s.idle, s.r)
             FROM (SELECT c.node_id, c.idle, random() AS r
                     FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                             WHERE a.pool_id = $1 AND a.kind = $2 AND a.model = $3 AND a.profile = $4 AND a.open AND a.idle >= $5
                             ORDER BY a.idle, a.node_id LIMIT $8)
                           UNION ALL
                           (SELECT t.node_id, t.idle
                              FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                     WHERE $6 <> '[]'::jsonb AND a.pool_id = $1 AND a.kind = $2 AND a.model = $3
                                       AND a.profile = $4 AND NOT a.open AND a.idle >= $5
                                     ORDER BY a.idle, a.node_id LIMIT $8) t
                              JOIN nodes n ON n.id = t.node_id
                             WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, $6))) c
                    WHERE NOT (c.node_id = ANY($7))
                    ORDER BY c.idle, r LIMIT 32) s;
         PREPARE worst_fit(text, text, text, text, int, jsonb, text[], bigint) AS
           SELECT array_agg(s.node_id ORDER BY s.idle DESC, s.r)
             FROM (SELECT c.node_id, c.idle, random() AS r
                     FROM ((SELECT a.node_id, a.idle FROM node_atom_counts a
                             WHERE a.pool_id = $1 AND a.kind = $2 AND a.model = $3 AND a.profile = $4 AND a.open AND a.total >= $5
                             ORDER BY a.idle DESC, a.node_id DESC LIMIT $8)
                           UNION ALL
                           (SELECT t.node_id, t.idle
                              FROM (SELECT a.node_id, a.idle FROM node_atom_counts a
                                     WHERE $6 <> '[]'::jsonb AND a.pool_id = $1 AND a.kind = $2 AND a.model = $3
                                       AND a.profile = $4 AND NOT a.open AND a.total >= $5
                                     ORDER BY a.idle DESC, a.node_id DESC LIMIT $8) t
                              JOIN nodes n ON n.id = t.node_id
                             WHERE capacity_node_takes(n.observed_generation, n.no_schedule_reasons, n.taints, $6))) c
                    WHERE NOT (c.node_id = ANY($7))
                    ORDER BY c.idle DESC, r LIMIT 32) s;",
    )
    .await
    .unwrap();
    for q in [
        "EXPLAIN EXECUTE best_fit('pool_a', 'gpu', 'H100', '', 1, '[]', '{}', 64)",
        "EXPLAIN EXECUTE worst_fit('pool_a', 'gpu', 'H100', '', 1, '[]', '{}', 64)",
    ] {
        let plan: Vec<String> = c.query(q, &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
        let plan = plan.join("\n");
        // The window's LIMIT sits right on the walk of node_atom_counts_fit, with the class in the
        // index condition: the search reads the window, not the class.
        // Both parts (the open counts; the closed ones, for tolerations) walk it so; the closed
        // part's walk runs under its one-time filter, itself under the LIMIT.
        let lines: Vec<&str> = plan.lines().collect();
        let walks: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].contains("node_atom_counts_fit")).collect();
        assert_eq!(walks.len(), 2, "{q}:\n{plan}");
        for walk in walks {
            let limited = lines[walk - 1].contains("Limit") || (lines[walk - 1].contains("One-Time Filter") && lines[walk - 3].contains("Limit"));
            assert!(limited, "{q}:\n{plan}");
            let cond = lines[walk + 1];
            assert!(cond.contains("Index Cond") && cond.contains("pool_id") && cond.contains("open"), "{q}:\n{plan}");
        }
        // The nodes are joined only in the part that a request without tolerations skips.
        assert!(plan.contains("One-Time Filter"), "{q}:\n{plan}");
        assert_eq!(plan.matches("nodes_pkey").count(), 1, "{q}:\n{plan}");
    }
}

#[tokio::test]
async fn a_creates_poke_reaches_the_workers_only_after_the_create_has_committed() {
    // The poke is pipelined behind the create's statement on the same connection. Held up by a lock
    // on the tenant's quota, the create has not committed, and no poke may arrive; once it commits,
    // the poke arrives and a woken worker finds the reservation.
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let (tx, mut pokes) = tokio::sync::mpsc::unbounded_channel::<()>();
    tokio::spawn(better_compute_runtime::work_queue::listen(
        h.db().connection_string().to_owned(),
        &[better_compute_runtime::work_queue::POKE_CHANNEL],
        move |_, _| {
            let _ = tx.send(());
        },
    ));
    // The listener connects in the background: poke until it hears one.
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            better_compute_runtime::work_queue::poke(&**h.db().client().await).await;
            if tokio::time::timeout(Duration::from_millis(50), pokes.recv()).await.is_ok() {
                return;
            }
        }
    })
    .await
    .expect("the listener never heard a poke");
    let mut blocker = h.db().connect().await;
    let lock = blocker.transaction().await.unwrap();
    lock.execute("SELECT 1 FROM quota_usage WHERE tenant_id = $1 FOR UPDATE", &[&TENANT]).await.unwrap();
    while pokes.try_recv().is_ok() {}
    let mut c = h.db().connect().await;
    let pool = f.pool_id.clone();
    let create = tokio::spawn(async move { reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&pool, 1)).await });
    waits_for_a_lock(&h, "capacity_reserve", "the create never waited for the quota lock").await;
    // Queued behind the waiting statement, the poke cannot have run, however long we look.
    assert!(tokio::time::timeout(Duration::from_millis(200), pokes.recv()).await.is_err(), "a poke arrived before the create committed");
    lock.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), pokes.recv()).await.expect("no poke after the create committed");
    let placed = count(&h, "SELECT count(*) FROM reservations WHERE state = 'placed'").await;
    assert_eq!(placed, 1, "the poke arrived before the reservation was visible");
    let v = tokio::time::timeout(Duration::from_secs(30), create).await.expect("create hung").unwrap().unwrap();
    assert_eq!(v.state, "placed");
}

#[tokio::test]
async fn the_tables_placements_churn_are_vacuumed_once_two_percent_of_them_is_dead() {
    let h = harness().await;
    // Each placement and release leaves dead versions in these (the capacity baseline's autovacuum settings); at the default
    // 20% they piled up in the atom lookup's index and a create-and-release loop slowed by a quarter.
    for table in ["device_bookings", "reservations", "quota_usage", "node_atom_counts", "node_resources", "work_queue"] {
        let sql = format!(
            "SELECT count(*) FROM pg_class WHERE relname = '{table}' AND 'autovacuum_vacuum_scale_factor=0.02' = ANY(reloptions)"
        );
        assert_eq!(count(&h, &sql).await, 1, "{table}");
    }
}

#[tokio::test]
async fn a_quarantined_or_unhealthy_gpu_leaves_a_request_pending_and_only_the_hardware_refuses_one_cpu_only_too() {
    let h = harness().await;
    // One node of 8 whole GPUs, one of 8 GPUs each in MIG mode (two 3g.40gb instances).
    let modes = vec![GpuMode::Exclusive, GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }];
    let f = fleet(&h, &modes, 8).await;
    let mut c = h.db().connect().await;
    {
        let tx = c.transaction().await.unwrap();
        actions::quarantine(&tx, &f.gpus[0][0], "flaky fan").await.unwrap();
        actions::set_gpu_health(&tx, &f.gpus[0][1], false).await.unwrap();
        for g in &f.gpus[1] {
            actions::quarantine(&tx, g, "firmware update").await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    // The node has 8 GPUs, two out for now: 8 waits instead of being refused as too many.
    let eight = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 8)).await.unwrap();
    assert_eq!(eight.state, "pending", "{eight:?}");
    // Every MIG parent is quarantined: a MIG instance waits too, the pool has them.
    let mut mig = whole(&f.pool_id, 1);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 1 };
    let instance = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    assert_eq!(instance.state, "pending", "{instance:?}");
    // What the hardware can never hold is still refused, at once.
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 9)).await.unwrap_err();
    assert_eq!((err.code, err.message.contains("most on one node is 8")), (ErrorCode::FailedPrecondition, true), "{err:?}");
    mig.gpu.profile = Some("1g.10gb".into());
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidArgument, "{err:?}");
    // A CPU-only request names the GPU model of the nodes it may land on: one the pool lacks can
    // never be placed, and neither can more vCPU, memory or disk than any node has when empty.
    let mut cpu_only = whole(&f.pool_id, 0);
    cpu_only.gpu.model = "A100-40GB".into();
    let err = reservations::create(&mut c, &TEST_ACTOR, ME, &cpu_only).await.unwrap_err();
    assert_eq!((err.code, err.message.contains("has no gpu A100-40GB atoms")), (ErrorCode::InvalidArgument, true), "{err:?}");
    for (vcpu, memory_mib, disk_gib) in [(129, 1024, 1), (1, 1_048_577, 1), (1, 1024, 8_001)] {
        for gpus in [0, 1] {
            let req = reservations::CreateReservation { vcpu, memory_mib, disk_gib, ..whole(&f.pool_id, gpus) };
            let err = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap_err();
            assert_eq!(
                (err.code, err.message.contains("128 vCPU, 1048576 MiB memory and 8000 GiB disk")),
                (ErrorCode::FailedPrecondition, true),
                "{vcpu} vCPU, {memory_mib} MiB, {disk_gib} GiB with {gpus} GPUs: {err:?}"
            );
        }
    }
    // Exactly a whole node's scalars still fits (the quarantines do not matter to a CPU-only one).
    let full = reservations::CreateReservation { vcpu: 128, memory_mib: 1_048_576, disk_gib: 8_000, ..whole(&f.pool_id, 0) };
    let v = reservations::create(&mut c, &TEST_ACTOR, ME, &full).await.unwrap();
    assert_eq!(v.state, "placed", "{v:?}");
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 3);
}

/// An API request of `ME`'s to `action`, as the actor of what it changes.
fn request(action: &str) -> Actor {
    Actor::Request(std::sync::Arc::new(better_compute_audit::entry::Request {
        identity_id: ME.identity_id.into(),
        token_id: "tok_a".into(),
        tenant_id: ME.tenant_id.into(),
        action: action.into(),
        target: String::new(),
        request_id: "req_a".into(),
        source: None,
        request_digest: "0".repeat(64),
    }))
}

#[tokio::test]
async fn a_reservation_changed_alone_for_an_api_request_commits_its_audit_entry_with_it_and_a_replay_none() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 8).await;
    let mut c = h.db().connect().await;
    let entries = async |action: &str| -> Vec<String> {
        h.db().connect().await.query("SELECT target FROM audit_entries WHERE action = $1 ORDER BY position", &[&action]).await.unwrap().iter().map(|r| r.get(0)).collect()
    };
    // Without a key, with one, its replay, and one refused (nothing written, nothing recorded).
    let a = reservations::create(&mut c, &request("reservations.create"), ME, &whole(&f.pool_id, 1)).await.unwrap();
    let mut keyed = whole(&f.pool_id, 1);
    keyed.idempotency_key = Some("audit-1".into());
    let b = reservations::create(&mut c, &request("reservations.create"), ME, &keyed).await.unwrap();
    assert_eq!(reservations::create(&mut c, &request("reservations.create"), ME, &keyed).await.unwrap(), b);
    assert!(reservations::create(&mut c, &request("reservations.create"), ME, &whole("pool_none", 1)).await.is_err());
    assert_eq!(entries("reservations.create").await, [a.id.clone(), b.id.clone()]);
    reservations::extend(&mut c, &request("reservations.extend"), ME, &a.id, "2030-01-01T03:00:00Z", None).await.unwrap();
    reservations::release(&mut c, &request("reservations.release"), ME, &b.id).await.unwrap();
    assert_eq!(entries("reservations.extend").await.len(), 1);
    assert_eq!(entries("reservations.release").await, std::slice::from_ref(&b.id));
    // A job's change is recorded too, as the job's.
    reservations::release(&mut c, &TEST_ACTOR, ME, &a.id).await.unwrap();
    assert_eq!(entries("reservations.release").await.len(), 2);
    let kinds: Vec<String> = c.query("SELECT actor_kind FROM audit_entries WHERE action = 'reservations.release' ORDER BY position", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(kinds, ["identity", "job"]);
}
