//! A reservation's life: pending and retried, active at its start and expired at its end, release and extend, mode changes, the state table the database enforces, and races between releases, placements and runs.

use super::*;

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
