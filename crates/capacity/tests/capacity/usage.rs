//! Usage metering in simulated time: windows closed once per reservation and hour, aligned in UTC,
//! summing exactly to the booked atom-seconds; an early release stops at its instant; a late extend
//! into a closed window adds an adjustment row, never an edit; MIG and slot atoms are metered by
//! their class; a reservation on an unreachable node keeps billing.


use better_compute_audit::Actor;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use better_compute_capacity::reservations::{self, GpuRequest};
use better_compute_nodes::actions;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

/// An instant on an hour's boundary (UTC), after the harness's start.
const HOUR0: u64 = 1_900_000_800;

async fn at(h: &Harness, s: u64) {
    h.db().set_sim_clock(UNIX_EPOCH + Duration::from_secs(HOUR0 + s)).await;
}

/// Runs the usage and reservations jobs until they have nothing due.
async fn meter(h: &Harness) {
    h.job("capacity.reservations").drain(20).await;
    h.job("capacity.usage").drain(20).await;
}

/// (key, window start offset from HOUR0 in s, adjustment, atom-seconds, vCPU-seconds, gpu kind) of
/// a reservation's windows, in key order.
async fn windows(h: &Harness, res: &str) -> Vec<(String, i64, i32, f64, f64, String)> {
    h.db()
        .client()
        .await
        .query(
            "SELECT id, extract(epoch FROM window_start)::int8 - $2, adjustment, atom_seconds::float8, vcpu_seconds::float8, gpu_kind
               FROM usage_windows WHERE allocation_id = $1 ORDER BY window_start, adjustment",
            &[&res, &(HOUR0 as i64)],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect()
}

/// The reservation's booked atom-seconds, from its bookings (live and ended), exact.
async fn booked_atom_seconds(h: &Harness, res: &str) -> f64 {
    h.db()
        .client()
        .await
        .query_one(
            "SELECT coalesce(sum(extract(epoch FROM upper(during) - lower(during))), 0)::float8 FROM
               (SELECT during FROM device_bookings WHERE allocation_id = $1 UNION ALL SELECT during FROM device_booking_history WHERE allocation_id = $1) b",
            &[&res],
        )
        .await
        .unwrap()
        .get(0)
}

async fn events(h: &Harness, res: &str) -> i64 {
    settle_outbox(h).await;
    h.db().client().await.query_one("SELECT count(*) FROM outbox WHERE type = 'usage.window' AND data->>'reservationId' = $1", &[&res]).await.unwrap().get(0)
}

#[tokio::test]
async fn a_reservation_spanning_windows_is_metered_once_per_closed_window_and_sums_to_its_booked_atom_seconds() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(2), 4).await;
    at(&h, 20 * 60).await;
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 2);
    req.duration_s = Some(3 * 3600);
    req.vcpu = 8;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    // The node goes unreachable for a while: reserved time is billed all the same.
    {
        let tx = c.transaction().await.unwrap();
        actions::set_liveness(&*tx, r.node_id.as_deref().unwrap(), "unreachable").await.unwrap();
        tx.commit().await.unwrap();
    }
    at(&h, 3600 + 5).await;
    meter(&h).await;
    let w = windows(&h, &r.id).await;
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!((w[0].1, w[0].2, w[0].3, w[0].4), (0, 0, 2.0 * 40.0 * 60.0, 8.0 * 40.0 * 60.0), "the first 40 minutes of the first hour");
    assert_eq!(w[0].0, format!("cmp:{}:2030-03-17T18:00:00Z", r.id));
    // Nothing is written twice, however often the job runs.
    h.job("capacity.usage").tick().await;
    assert_eq!(windows(&h, &r.id).await.len(), 1);

    at(&h, 4 * 3600 + 60).await;
    meter(&h).await;
    let w = windows(&h, &r.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(), [(0, 0, 4800.0), (3600, 0, 7200.0), (7200, 0, 7200.0), (10800, 0, 2400.0)]);
    let sum: f64 = w.iter().map(|w| w.3).sum();
    assert_eq!(sum, booked_atom_seconds(&h, &r.id).await, "the windows sum to the booked atom-seconds, exactly");
    assert_eq!(sum, 2.0 * 3.0 * 3600.0);
    assert_eq!(events(&h, &r.id).await, 4, "one usage.window event per row");
    h.job("capacity.usage").drain(5).await;
    assert_eq!(windows(&h, &r.id).await.len(), 4);
}

#[tokio::test]
async fn an_early_release_stops_at_its_instant_an_extend_adds_to_open_windows_and_a_late_change_adds_an_adjustment_never_an_edit() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(1), 4).await;
    let mut c = h.db().client().await;
    // Released early: 10 minutes of a two-hour reservation.
    let mut req = whole(&f.pool_id, 1);
    req.duration_s = Some(2 * 3600);
    let early = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    at(&h, 600).await;
    reservations::release(&mut c, &TEST_ACTOR, ME, &early.id).await.unwrap();
    // 90 minutes, extended to two hours while it runs.
    req.duration_s = Some(90 * 60);
    let extended = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    at(&h, 3600 + 1).await;
    meter(&h).await;
    let w = windows(&h, &early.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(), [(0, 0, 600.0)], "stops at the release instant");
    assert_eq!(w[0].3, booked_atom_seconds(&h, &early.id).await);
    assert_eq!(windows(&h, &extended.id).await.iter().map(|w| w.3).collect::<Vec<_>>(), [3000.0]);
    let ends = better_compute_core::time::rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(HOUR0 + 2 * 3600 + 600));
    reservations::extend(&mut c, &TEST_ACTOR, ME, &extended.id, &ends, None).await.unwrap();
    at(&h, 3 * 3600 + 1).await;
    meter(&h).await;
    let w = windows(&h, &extended.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(), [(0, 0, 3000.0), (3600, 0, 3600.0), (7200, 0, 600.0)], "{w:?}");
    assert_eq!(w.iter().map(|w| w.3).sum::<f64>(), booked_atom_seconds(&h, &extended.id).await);
    // An ended reservation cannot be extended into the windows it closed.
    let e = reservations::extend(&mut c, &TEST_ACTOR, ME, &early.id, &ends, None).await.unwrap_err();
    assert_eq!(e.code, better_compute_core::ErrorCode::FailedPrecondition);
    // A late change to what it held (a correction of its history) is an adjustment for the
    // closed window; the window's row stays as it was.
    c.execute("UPDATE device_booking_history SET during = tstzrange(lower(during), upper(during) + interval '5 minutes') WHERE allocation_id = $1", &[&early.id]).await.unwrap();
    c.execute("UPDATE reservations SET version = version + 1 WHERE id = $1", &[&early.id]).await.unwrap();
    // Looked at when the pool's key next runs: at the end of the current window.
    at(&h, 4 * 3600 + 1).await;
    h.job("capacity.usage").drain(20).await;
    let w = windows(&h, &early.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(), [(0, 0, 600.0), (0, 1, 300.0)], "{w:?}");
    assert_eq!(w[1].0, format!("{}:1", w[0].0));
    assert_eq!(w.iter().map(|w| w.3).sum::<f64>(), booked_atom_seconds(&h, &early.id).await);
    assert_eq!(events(&h, &early.id).await, 2);
    assert_eq!(events(&h, &extended.id).await, 3);
}

#[tokio::test]
async fn mig_and_slot_atoms_are_metered_by_their_class() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &[GpuMode::Mig { layout: vec!["3g.40gb".into(), "3g.40gb".into()] }, GpuMode::TimeSlice { slots: 4 }], 1).await;
    let mut c = h.db().client().await;
    let mut mig = whole(&f.pool_id, 2);
    mig.gpu = GpuRequest { kind: "mig".into(), model: MODEL.into(), profile: Some("3g.40gb".into()), count: 2 };
    let mig = reservations::create(&mut c, &TEST_ACTOR, ME, &mig).await.unwrap();
    let mut slot = whole(&f.pool_id, 3);
    slot.gpu = GpuRequest { kind: "slot".into(), model: MODEL.into(), profile: None, count: 3 };
    let slot = reservations::create(&mut c, &TEST_ACTOR, ME, &slot).await.unwrap();
    at(&h, 3600).await;
    meter(&h).await;
    let m = windows(&h, &mig.id).await;
    let s = windows(&h, &slot.id).await;
    assert_eq!((m.len(), m[0].3, m[0].5.as_str()), (1, 2.0 * 3600.0, "mig"));
    assert_eq!((s.len(), s[0].3, s[0].5.as_str()), (1, 3.0 * 3600.0, "slot"));
    let profile: Option<String> = c.query_one("SELECT mig_profile FROM usage_windows WHERE allocation_id = $1", &[&mig.id]).await.unwrap().get(0);
    assert_eq!(profile.as_deref(), Some("3g.40gb"));
}

#[tokio::test]
async fn concurrent_meterings_of_one_pool_write_each_window_exactly_once() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(5), 8).await;
    at(&h, 600).await;
    let mut c = h.db().client().await;
    let mut ids = Vec::new();
    for i in 0..40 {
        let mut req = whole(&f.pool_id, 1);
        req.duration_s = Some(7200);
        req.idempotency_key = Some(format!("u-{i}"));
        ids.push(reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap().id);
    }
    at(&h, 3600 + 1).await;
    // Four meterings at once (as a zombie worker and its successor would be, were the lease's fence
    // not there), each taking a few reservations at a time until none is due.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let url = h.db().connection_string().to_owned();
        let pool = f.pool_id.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = better_compute_db::pool::connect(&url).await.unwrap();
            let mut written = 0usize;
            for _ in 0..100 {
                let tx = c.transaction().await.unwrap();
                let n = tx.query("SELECT id FROM capacity_usage_close($1, 3)", &[&pool]).await.unwrap().len();
                tx.commit().await.unwrap();
                written += n;
            }
            written
        }));
    }
    let mut written = 0;
    for t in tasks {
        written += tokio::time::timeout(Duration::from_secs(60), t).await.expect("a metering hung").unwrap();
    }
    assert_eq!(written, 40, "every reservation's first window, once");
    let rows: Vec<(String, f64)> = c
        .query("SELECT allocation_id, atom_seconds::float8 FROM usage_windows WHERE allocation_id = ANY($1) ORDER BY 1", &[&ids])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows.len(), 40);
    assert!(rows.iter().all(|r| r.1 == 3000.0), "{rows:?}");
}

#[tokio::test]
async fn a_drain_eviction_stops_metering_at_the_eviction() {
    use better_compute_nodes::drain::{self, DrainMode, DrainRequest};
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 2);
    req.duration_s = Some(3 * 3600);
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    // Evicted 25 minutes in.
    let deadline = better_compute_core::time::rfc3339(UNIX_EPOCH + Duration::from_secs(HOUR0 + 25 * 60));
    {
        let tx = c.transaction().await.unwrap();
        drain::request(&*tx, &DrainRequest { node_id: &f.nodes[0], reason: "fans", mode: DrainMode::Evict, deadline: Some(&deadline), requested_by: "ops" })
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    h.job("drain").drain(5).await;
    at(&h, 25 * 60).await;
    h.job("drain").drain(5).await;
    let ended = reservations::get(&**c, ME, &r.id).await.unwrap();
    assert_eq!((ended.state.as_str(), ended.end_reason.as_deref()), ("released", Some("drained")));
    at(&h, 2 * 3600 + 1).await;
    meter(&h).await;
    let w = windows(&h, &r.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3)).collect::<Vec<_>>(), [(0, 0, 2.0 * 25.0 * 60.0)], "{w:?}");
    assert_eq!(w[0].3, booked_atom_seconds(&h, &r.id).await);
    // And the invariant holds over everything metered.
    let tx = c.transaction().await.unwrap();
    let report = better_compute_capacity::invariants::check(&*tx, &Default::default()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    // A window billed a second too much is a violation the checker names.
    tx.execute("UPDATE usage_windows SET atom_seconds = atom_seconds + 1 WHERE allocation_id = $1", &[&r.id]).await.unwrap();
    let report = better_compute_capacity::invariants::check(&*tx, &Default::default()).await.unwrap();
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(report.violations[0].contains("do not sum to its booked atom-") && report.violations[0].contains(&r.id), "{:?}", report.violations);
}

#[tokio::test]
async fn a_second_window_over_the_same_time_or_key_is_refused_by_the_database() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let mut c = h.db().client().await;
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    at(&h, 3600 + 1).await;
    meter(&h).await;
    assert_eq!(windows(&h, &r.id).await.len(), 1);
    let copy = |id: &str, start_s: i64, adjustment: i32| {
        format!(
            "INSERT INTO usage_windows (id, allocation_id, tenant_id, pool_id, node_id, window_start, window_end, adjustment, gpu_kind, gpu_model,
                                        mig_profile, atom_seconds, vcpu_seconds, memory_mib_seconds, disk_gib_seconds)
             SELECT '{id}', allocation_id, tenant_id, pool_id, node_id, window_start + make_interval(secs => {start_s}),
                    window_end + make_interval(secs => {start_s}), {adjustment}, gpu_kind, gpu_model, mig_profile, 1, 1, 1, 1
               FROM usage_windows WHERE allocation_id = '{}'",
            r.id
        )
    };
    // The same billing key; a window overlapping it; the same window again as an "adjustment 0".
    for (sql, constraint) in [
        (copy(&windows(&h, &r.id).await[0].0, 3600, 0), "usage_windows_pkey"),
        (copy("cmp:overlap", 1800, 0), "usage_windows_allocation_id_tstzrange_excl"),
        (copy("cmp:again", 0, 0), "usage_windows_allocation_id_window_start_adjustment_key"),
    ] {
        let e = c.execute(&sql, &[]).await.unwrap_err();
        assert_eq!(e.as_db_error().map(|d| d.constraint()), Some(Some(constraint)), "{e}");
    }
    assert_eq!(windows(&h, &r.id).await.len(), 1);
}

/// (vCPU-, memory-, disk-seconds) summed over a reservation's windows and adjustments.
async fn scalar_seconds(h: &Harness, res: &str) -> (f64, f64, f64) {
    let r = h
        .db()
        .client()
        .await
        .query_one(
            "SELECT coalesce(sum(vcpu_seconds), 0)::float8, coalesce(sum(memory_mib_seconds), 0)::float8, coalesce(sum(disk_gib_seconds), 0)::float8
               FROM usage_windows WHERE allocation_id = $1",
            &[&res],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[tokio::test]
async fn a_reservation_without_gpus_and_an_extended_one_are_billed_every_second_of_their_scalars() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let mut c = h.db().client().await;
    // vCPU, memory and disk alone, for 20 minutes, released after 10.
    let mut bare = whole(&f.pool_id, 0);
    bare.duration_s = Some(1200);
    let bare = reservations::create(&mut c, &TEST_ACTOR, ME, &bare).await.unwrap();
    assert!(bare.node_id.is_some() && bare.atoms.is_empty(), "placed on a node with no atoms: {bare:?}");
    // 1 GPU and 8 vCPU for 30 s, extended by 60 s while it runs: two booking segments per atom.
    let mut short = whole(&f.pool_id, 1);
    short.duration_s = Some(30);
    let short = reservations::create(&mut c, &TEST_ACTOR, ME, &short).await.unwrap();
    at(&h, 10).await;
    let ends = better_compute_core::time::rfc3339(UNIX_EPOCH + Duration::from_secs(HOUR0 + 90));
    reservations::extend(&mut c, &TEST_ACTOR, ME, &short.id, &ends, None).await.unwrap();
    at(&h, 600).await;
    reservations::release(&mut c, &TEST_ACTOR, ME, &bare.id).await.unwrap();
    at(&h, 3600 + 1).await;
    meter(&h).await;

    let w = windows(&h, &bare.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3, w.4)).collect::<Vec<_>>(), [(0, 0, 0.0, 8.0 * 600.0)], "{w:?}");
    assert_eq!(scalar_seconds(&h, &bare.id).await, (8.0 * 600.0, 65_536.0 * 600.0, 100.0 * 600.0));

    let w = windows(&h, &short.id).await;
    assert_eq!(w.iter().map(|w| (w.1, w.2, w.3, w.4)).collect::<Vec<_>>(), [(0, 0, 90.0, 8.0 * 90.0)], "{w:?}");
    assert_eq!(scalar_seconds(&h, &short.id).await, (720.0, 65_536.0 * 90.0, 100.0 * 90.0));
    // The invariant the torture test and the simulator check holds, and it saw both reservations.
    let report = better_compute_capacity::invariants::check(&**c, &Default::default()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let checked: i64 = c
        .query_one(
            "SELECT count(*) FROM reservations WHERE id = ANY($1) AND state IN ('released', 'expired') AND usage_version = version",
            &[&vec![bare.id.clone(), short.id.clone()]],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(checked, 2, "both are ended and metered, so the invariant looked at them");
}

#[tokio::test]
async fn the_metering_invariant_catches_a_window_missing_its_scalars() {
    let h = harness().await;
    at(&h, 0).await;
    let f = fleet(&h, &exclusive(1), 2).await;
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 0);
    req.duration_s = Some(600);
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    at(&h, 3600 + 1).await;
    meter(&h).await;
    let report = better_compute_capacity::invariants::check(&**c, &Default::default()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    // A window that under-bills memory by one MiB-second is named.
    c.execute("UPDATE usage_windows SET memory_mib_seconds = memory_mib_seconds - 1 WHERE allocation_id = $1", &[&r.id]).await.unwrap();
    let report = better_compute_capacity::invariants::check(&**c, &Default::default()).await.unwrap();
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(report.violations[0].contains(&r.id) && report.violations[0].contains("memory-s"), "{:?}", report.violations);
}
