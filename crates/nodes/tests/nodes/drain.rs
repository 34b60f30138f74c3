//! Drains in simulated time: cordoned at once, admitted in request order within the pool's
//! disruption budget (also under concurrent drains), waiting for reservations or evicting them at
//! the deadline, never releasing anything because a node is unreachable, and retirement. (The
//! drain job lives in the nodes module; what holds a node comes from capacity.)


use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations;
use better_compute_core::state::{DrainState, State, DRAIN_STATE_TABLE};
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_nodes::drain::{self, Budget, DrainMode, DrainRequest, DrainView};
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn request(h: &Harness, node: &str, mode: DrainMode, deadline: Option<&str>) -> Result<DrainView, better_compute_core::Error> {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let r = drain::request(&*tx, &DrainRequest { node_id: node, reason: "swap the fans", mode, deadline, requested_by: "ten_op/idn_op" }).await;
    match r {
        Ok(v) => {
            tx.commit().await.unwrap();
            Ok(v)
        }
        Err(e) => Err(e.into()),
    }
}

async fn in_tx<T>(h: &Harness, f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> T) -> T {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let v = f(&tx).await;
    tx.commit().await.unwrap();
    v
}

async fn drain_of(h: &Harness, node: &str) -> DrainView {
    drain::open_drain(&**h.db().client().await, node).await.unwrap().expect("an open drain")
}

async fn reasons(h: &Harness, node: &str) -> Vec<String> {
    h.db().client().await.query_one("SELECT no_schedule_reasons FROM nodes WHERE id = $1", &[&node]).await.unwrap().get(0)
}

async fn set_budget(h: &Harness, pool: &str, b: Budget) {
    in_tx(h, async |tx| drain::set_budget(tx, pool, b).await.unwrap()).await;
}

/// The reservation's node, placed there by pinning on the node's name label.
async fn reserve_on(h: &Harness, f: &Fleet, node: usize) -> reservations::ReservationView {
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 1);
    req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!(format!("r{}", node % 4)))]);
    let r = reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap();
    assert_eq!(r.node_id.as_deref(), Some(f.nodes[node].as_str()), "{r:?}");
    r
}

#[tokio::test]
async fn a_wait_drain_cordons_at_once_and_is_drained_when_the_last_reservation_ends_by_itself() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let held = reserve_on(&h, &f, 0).await;

    let d = request(&h, &f.nodes[0], DrainMode::Wait, None).await.unwrap();
    assert_eq!((d.state.as_str(), d.condition.reason.as_str()), ("queued", "Queued"));
    assert_eq!(reasons(&h, &f.nodes[0]).await, ["draining"], "cordoned at once");
    // Asking again for the same drain returns it; another mode is a conflict.
    assert_eq!(request(&h, &f.nodes[0], DrainMode::Wait, None).await.unwrap().id, d.id);
    assert_eq!(request(&h, &f.nodes[0], DrainMode::Evict, None).await.unwrap_err().code, ErrorCode::Conflict);
    // A wait drain has no deadline.
    assert_eq!(request(&h, &f.nodes[1], DrainMode::Wait, Some("2030-01-01T00:00:00Z")).await.unwrap_err().code, ErrorCode::InvalidArgument);

    h.job("drain").drain(5).await;
    let d = drain_of(&h, &f.nodes[0]).await;
    assert_eq!((d.state.as_str(), d.condition.reason.as_str()), ("draining", "WaitingForReservations"), "{d:?}");
    // New work goes elsewhere: the next reservation for the drained node's rack stays pending.
    settle_outbox(&h).await;
    h.job("event-subscribers").drain(20).await;
    let mut c = h.db().client().await;
    let mut req = whole(&f.pool_id, 1);
    req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r0"))]);
    assert_eq!(reservations::create(&mut c, &TEST_ACTOR, ME, &req).await.unwrap().state, "pending");

    // The reservation runs to its end; the drain follows without anyone asking.
    h.db().advance(Duration::from_secs(3601)).await;
    h.job("capacity.reservations").drain(20).await;
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().state, "expired");
    h.db().advance(Duration::from_secs(2)).await;
    h.job("drain").drain(5).await;
    let d = drain_of(&h, &f.nodes[0]).await;
    assert_eq!((d.state.as_str(), d.condition.reason.as_str()), ("drained", "Drained"), "{d:?}");
    let events: i64 = c.query_one("SELECT count(*) FROM outbox WHERE subject = $1 AND type IN ('node.drainRequested', 'node.drainAdmitted', 'node.drained')", &[&f.nodes[0]]).await.unwrap().get(0);
    assert_eq!(events, 3);

    // Undrain: schedulable again; a second undrain is harmless.
    assert!(in_tx(&h, async |tx| drain::undrain(tx, &f.nodes[0]).await.unwrap()).await);
    assert!(!in_tx(&h, async |tx| drain::undrain(tx, &f.nodes[0]).await.unwrap()).await);
    assert!(reasons(&h, &f.nodes[0]).await.is_empty());
}

#[tokio::test]
async fn an_evicting_drain_tells_each_tenant_at_once_and_releases_at_the_deadline_with_reason_drained() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let held = reserve_on(&h, &f, 0).await;
    let c = h.db().client().await;
    let used_before: i64 = c.query_one("SELECT coalesce(sum(used), 0)::int8 FROM quota_usage WHERE tenant_id = $1", &[&TENANT]).await.unwrap().get(0);
    assert!(used_before > 0);

    let deadline: String = c.query_one("SELECT to_char((compute_now() + interval '10 minutes') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')", &[]).await.unwrap().get(0);
    request(&h, &f.nodes[0], DrainMode::Evict, Some(&deadline)).await.unwrap();
    h.job("drain").drain(5).await;
    let d = drain_of(&h, &f.nodes[0]).await;
    assert_eq!((d.state.as_str(), d.condition.reason.as_str()), ("draining", "Evicting"), "{d:?}");
    let told = c
        .query("SELECT tenant_id, data FROM outbox WHERE type = 'reservation.evictionRequested' AND subject = $1", &[&held.id])
        .await
        .unwrap();
    assert_eq!(told.len(), 1, "one notice per reservation");
    assert_eq!(told[0].get::<_, Option<String>>(0).as_deref(), Some(TENANT));
    assert_eq!(told[0].get::<_, serde_json::Value>(1)["reason"], "swap the fans");
    // Before the deadline nothing ends, however often the job runs.
    h.db().advance(Duration::from_secs(599)).await;
    h.job("drain").drain(5).await;
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().state, "placed");

    h.db().advance(Duration::from_secs(1)).await;
    h.job("drain").drain(5).await;
    let ended = reservations::get(&**c, ME, &held.id).await.unwrap();
    assert_eq!((ended.state.as_str(), ended.end_reason.as_deref()), ("released", Some("drained")));
    // It says when it actually ended (the deadline), beside the end it had booked.
    assert_eq!(held.ended_at, None);
    let ended_at = better_compute_core::time::parse_rfc3339(ended.ended_at.as_deref().expect("an ended reservation says when")).unwrap();
    assert_eq!(ended_at, h.db().now().await);
    assert_eq!(ended.ends_at, held.ends_at);
    assert!(better_compute_core::time::parse_rfc3339(&ended.ends_at).unwrap() > ended_at);
    let used_after: i64 = c.query_one("SELECT coalesce(sum(used), 0)::int8 FROM quota_usage WHERE tenant_id = $1", &[&TENANT]).await.unwrap().get(0);
    assert_eq!(used_after, 0, "quota refunded from the deadline");
    let bookings: i64 = c.query_one("SELECT count(*) FROM device_bookings WHERE allocation_id = $1", &[&held.id]).await.unwrap().get(0);
    assert_eq!(bookings, 0);
    assert_eq!(drain_of(&h, &f.nodes[0]).await.state, "drained");
    let released: serde_json::Value = c
        .query_one("SELECT data FROM outbox WHERE type = 'reservation.released' AND subject = $1", &[&held.id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(released["endReason"], "drained");
    // The drain job's decision is in the audit log, as the job's.
    let audited = c
        .query("SELECT actor_kind, actor_id, tenant_id FROM audit_entries WHERE action = 'reservations.evict' AND target = $1", &[&held.id])
        .await
        .unwrap();
    assert_eq!(audited.len(), 1);
    assert_eq!((audited[0].get::<_, String>(0), audited[0].get::<_, String>(1), audited[0].get::<_, Option<String>>(2)), ("job".into(), "drain".into(), Some(TENANT.into())));
}

#[tokio::test]
async fn drains_are_admitted_in_request_order_and_wait_queued_beyond_the_pools_budget() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 1).await;
    set_budget(&h, &f.pool_id, Budget::Nodes(1)).await;
    for n in [2, 0, 1] {
        request(&h, &f.nodes[n], DrainMode::Wait, None).await.unwrap();
        h.db().advance(Duration::from_millis(10)).await;
    }
    h.job("drain").drain(5).await;
    let states = |v: Vec<DrainView>| v.into_iter().map(|d| (d.node_id, d.state, d.condition.reason)).collect::<Vec<_>>();
    let s = |n: usize, st: &str, r: &str| (f.nodes[n].clone(), st.to_owned(), r.to_owned());
    let drains = drain::pool_drains(&**h.db().client().await, &f.pool_id).await.unwrap();
    assert_eq!(states(drains), [s(2, "drained", "Drained"), s(0, "queued", "WaitingForBudget"), s(1, "queued", "WaitingForBudget")]);

    // The budget frees when the first is undrained; the next in request order goes, not the last.
    in_tx(&h, async |tx| drain::undrain(tx, &f.nodes[2]).await.unwrap()).await;
    h.job("drain").drain(5).await;
    let drains = drain::pool_drains(&**h.db().client().await, &f.pool_id).await.unwrap();
    assert_eq!(states(drains), [s(0, "drained", "Drained"), s(1, "queued", "WaitingForBudget")]);
    // A wider budget admits the rest.
    set_budget(&h, &f.pool_id, Budget::Percent(50)).await;
    h.job("drain").drain(5).await;
    assert_eq!(drain_of(&h, &f.nodes[1]).await.state, "drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_drains_never_exceed_the_pools_budget() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(8), 1).await;
    set_budget(&h, &f.pool_id, Budget::Nodes(3)).await;
    // Eight operators drain eight nodes at once, each then running an admission pass itself.
    let tasks: Vec<_> = f
        .nodes
        .iter()
        .map(|node| {
            let (pool, node, db) = (f.pool_id.clone(), node.clone(), h.db().pool.clone());
            tokio::spawn(async move {
                let mut c = db.get().await.unwrap();
                let tx = c.transaction().await.unwrap();
                drain::request(&*tx, &DrainRequest { node_id: &node, reason: "r", mode: DrainMode::Wait, deadline: None, requested_by: "x/y" }).await.unwrap();
                tx.commit().await.unwrap();
                let tx = c.transaction().await.unwrap();
                drain::admit(&*tx, &pool, &mut Default::default()).await.unwrap();
                tx.commit().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(60), t).await.expect("no deadlock").unwrap();
    }
    h.job("drain").drain(5).await;
    let c = h.db().client().await;
    let by_state: Vec<(String, i64)> =
        c.query("SELECT state, count(*) FROM node_drains GROUP BY state ORDER BY state", &[]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(by_state, [("drained".to_owned(), 3), ("queued".to_owned(), 5)]);
}

#[tokio::test]
async fn an_unreachable_node_counts_against_the_budget_and_no_drain_releases_its_reservations() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 1).await;
    set_budget(&h, &f.pool_id, Budget::Nodes(1)).await;
    let held = reserve_on(&h, &f, 0).await;
    in_tx(&h, async |tx| actions::set_liveness(tx, &f.nodes[0], "unreachable").await.unwrap()).await;
    // The budget is spent on the unreachable node: another node's drain waits.
    request(&h, &f.nodes[1], DrainMode::Wait, None).await.unwrap();
    h.job("drain").drain(5).await;
    assert_eq!(drain_of(&h, &f.nodes[1]).await.condition.reason, "WaitingForBudget");
    // Draining the unreachable node itself costs nothing more, but it waits behind the earlier one.
    request(&h, &f.nodes[0], DrainMode::Wait, None).await.unwrap();
    h.job("drain").drain(5).await;
    assert_eq!(drain_of(&h, &f.nodes[0]).await.state, "queued", "request order holds");
    in_tx(&h, async |tx| drain::undrain(tx, &f.nodes[1]).await.unwrap()).await;
    h.job("drain").drain(5).await;
    assert_eq!(drain_of(&h, &f.nodes[0]).await.condition.reason, "WaitingForReservations");
    // However long it stays unreachable, a wait drain releases nothing.
    for _ in 0..10 {
        h.db().advance(Duration::from_secs(300)).await;
        h.job("drain").drain(5).await;
        h.job("liveness").drain(5).await;
    }
    let c = h.db().client().await;
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().state, "placed");
    assert_eq!(drain_of(&h, &f.nodes[0]).await.state, "draining");
}

#[tokio::test]
async fn only_a_drained_node_retires_and_a_retired_node_is_out_for_ever() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 1).await;
    let node = f.nodes[0].clone();
    let c = h.db().client().await;
    c.execute(
        "INSERT INTO node_certificates (fingerprint_sha256, node_id, serial, not_before, not_after) VALUES (sha256('x'), $1, 's1', compute_now(), compute_now() + interval '1 day')",
        &[&node],
    )
    .await
    .unwrap();
    let mut tx_c = h.db().client().await;
    let tx = tx_c.transaction().await.unwrap();
    let e: better_compute_core::Error = drain::retire(&*tx, &node).await.unwrap_err().into();
    assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");
    drop(tx);
    request(&h, &node, DrainMode::Wait, None).await.unwrap();
    h.job("drain").drain(5).await;
    in_tx(&h, async |tx| drain::retire(tx, &node).await.unwrap()).await;
    in_tx(&h, async |tx| drain::retire(tx, &node).await.unwrap()).await; // twice is harmless
    assert_eq!(reasons(&h, &node).await, ["retired"]);
    let revoked: i64 = c.query_one("SELECT count(*) FROM node_certificates WHERE node_id = $1 AND revoked_at IS NOT NULL", &[&node]).await.unwrap().get(0);
    assert_eq!(revoked, 1);
    assert_eq!(request(&h, &node, DrainMode::Wait, None).await.unwrap_err().code, ErrorCode::FailedPrecondition);
    assert!(!in_tx(&h, async |tx| drain::undrain(tx, &node).await.unwrap()).await, "nothing open to undrain");
    assert_eq!(reasons(&h, &node).await, ["retired"]);
}

#[tokio::test]
async fn the_database_allows_exactly_the_drain_state_tables_transitions() {
    let h = harness().await;
    let c = h.db().client().await;
    let mut checked = 0;
    for from in DrainState::ALL {
        for to in DrainState::ALL {
            let db: bool = c.query_one("SELECT node_drains_state_may_become($1, $2)", &[&from.as_str(), &to.as_str()]).await.unwrap().get(0);
            assert_eq!(db, DRAIN_STATE_TABLE.allows(*from, *to), "{from:?} -> {to:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, DrainState::ALL.len() * DrainState::ALL.len());
}

const TENANTS: [better_compute_capacity::Caller<'static>; 4] = [
    ME,
    better_compute_capacity::Caller { tenant_id: "ten_b", identity_id: "idn_b" },
    better_compute_capacity::Caller { tenant_id: "ten_c", identity_id: "idn_c" },
    better_compute_capacity::Caller { tenant_id: "ten_d", identity_id: "idn_d" },
];

/// Tenants create through batches and release alone and in batches while an eviction ends, in one
/// transaction, reservations of every tenant on one node, again and again. The eviction takes the
/// quota rows of all of them before anything of the node, as the lock order says: ending tenant
/// after tenant, it held the node's rows and wake-ups while waiting for the next tenant's quota,
/// held by a placement or release waiting for those.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn evictions_batch_placements_and_releases_running_together_never_deadlock() {
    use better_compute_capacity::batch::{BatchPlacer, BatchSettings};
    use better_compute_capacity::occupant::ReservationOccupant;
    use better_compute_runtime::occupancy::NodeOccupant;
    const ROUNDS: usize = 40;
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 8).await;
    for t in &TENANTS[1..] {
        open_quota(&**h.db().client().await, t.tenant_id).await;
    }
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 4).unwrap();
    let placer = BatchPlacer::start(pool, BatchSettings { batchers: 2, max_batch: 8, queue_len: 64, retries: 0 });
    let mut workers = Vec::new();
    for caller in TENANTS {
        let (placer, mut c, pool_id) = (placer.clone(), h.db().connect().await, f.pool_id.clone());
        workers.push(tokio::spawn(async move {
            let mut created = 0;
            for round in 0..ROUNDS {
                let v = reservations::create_batched(&placer, &mut c, &TEST_ACTOR, caller, &whole(&pool_id, 1)).await.expect("create");
                created += 1;
                let released = if round % 2 == 0 {
                    reservations::release(&mut c, &TEST_ACTOR, caller, &v.id).await
                } else {
                    reservations::release_batched(&placer, &mut c, &TEST_ACTOR, caller, &v.id).await
                };
                // Released by the tenant, or evicted first (released too).
                assert_eq!(released.expect("release").state, "released");
            }
            created
        }));
    }
    let (mut c, node, pool_id) = (h.db().connect().await, f.nodes[0].clone(), f.pool_id.clone());
    let evictor = tokio::spawn(async move {
        let (mut placed, mut evicted) = (0, 0);
        for _ in 0..ROUNDS / 2 {
            for caller in TENANTS.iter().rev() {
                let mut req = whole(&pool_id, 1);
                req.node_selector = serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!("r0"))]);
                let v = reservations::create(&mut c, &TEST_ACTOR, *caller, &req).await.expect("create on the evicted node");
                // Pending when the tenants' placements hold the node's atoms at that moment.
                match v.node_id.as_deref() {
                    Some(n) => {
                        assert_eq!(n, node);
                        placed += 1;
                    }
                    None => assert_eq!(reservations::release(&mut c, &TEST_ACTOR, *caller, &v.id).await.unwrap().state, "released"),
                }
            }
            let tx = c.transaction().await.unwrap();
            evicted += ReservationOccupant.evict(&tx, &node, "drained").await.expect("evict");
            tx.commit().await.unwrap();
        }
        (placed, evicted)
    });
    for w in workers {
        let created = tokio::time::timeout(Duration::from_secs(120), w).await.expect("a tenant hung").unwrap();
        assert_eq!(created, ROUNDS);
    }
    let (placed, evicted) = tokio::time::timeout(Duration::from_secs(120), evictor).await.expect("the evictor hung").unwrap();
    // Every reservation placed there is evicted, and those of the tenants' own the placer put there.
    assert!(placed >= ROUNDS, "only {placed} of {} placed on the evicted node", ROUNDS * 2);
    assert!(evicted >= placed as u64, "{evicted} evicted of {placed}");
    let deadlocks: Vec<String> = h.db().server_log().into_iter().filter(|l| l.contains("deadlock detected")).collect();
    assert_eq!(deadlocks, Vec::<String>::new(), "the server logged deadlocks");
}

async fn in_minutes(h: &Harness, m: i32) -> String {
    h.db()
        .client()
        .await
        .query_one("SELECT to_char((compute_now() + make_interval(mins => $1)) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')", &[&m])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn an_evicting_drain_asked_again_moves_its_deadline_only_earlier_and_tells_its_tenants_again() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let held = reserve_on(&h, &f, 0).await;
    let (thirty, ten, forty) = (in_minutes(&h, 30).await, in_minutes(&h, 10).await, in_minutes(&h, 40).await);
    let first = request(&h, &f.nodes[0], DrainMode::Evict, Some(&thirty)).await.unwrap();
    h.job("drain").drain(5).await;
    let told = async || -> Vec<String> {
        h.db()
            .client()
            .await
            .query("SELECT data->>'deadline' FROM outbox WHERE type = 'reservation.evictionRequested' AND subject = $1 ORDER BY id", &[&held.id])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(told().await.len(), 1);
    // The same request again changes nothing; a later deadline is refused, saying why.
    assert_eq!(request(&h, &f.nodes[0], DrainMode::Evict, Some(&thirty)).await.unwrap().deadline, first.deadline);
    let later = request(&h, &f.nodes[0], DrainMode::Evict, Some(&forty)).await.unwrap_err();
    assert_eq!(later.code, ErrorCode::Conflict, "{later}");
    assert!(later.message.contains("only moves earlier"), "{later}");
    // An earlier one moves it, and the tenant is told the new deadline.
    let moved = request(&h, &f.nodes[0], DrainMode::Evict, Some(&ten)).await.unwrap();
    assert_eq!((moved.id.as_str(), moved.deadline.as_deref().map(|d| d.starts_with(&ten[..16]))), (first.id.as_str(), Some(true)), "{moved:?}");
    h.job("drain").drain(5).await;
    let told = told().await;
    assert_eq!(told.len(), 2, "{told:?}");
    assert_ne!(told[0], told[1], "told the new deadline");
    h.db().advance(Duration::from_secs(600)).await;
    h.job("drain").drain(5).await;
    let c = h.db().client().await;
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().state, "released", "ended at the earlier deadline");
}

#[tokio::test]
async fn a_reservation_on_a_draining_node_is_not_extended_so_a_wait_drain_ends() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 2).await;
    let held = reserve_on(&h, &f, 0).await;
    let mut c = h.db().client().await;
    let later = better_compute_core::time::rfc3339(better_compute_core::time::parse_rfc3339(&held.ends_at).unwrap() + Duration::from_secs(600));
    request(&h, &f.nodes[0], DrainMode::Wait, None).await.unwrap();
    let e = reservations::extend(&mut c, &TEST_ACTOR, ME, &held.id, &later, None).await.unwrap_err();
    assert_eq!(e.code, ErrorCode::FailedPrecondition, "{e}");
    assert!(e.message.contains("being drained"), "{e}");
    assert_eq!(reservations::get(&**c, ME, &held.id).await.unwrap().ends_at, held.ends_at, "nothing changed");
    // Undrained, it may be extended again.
    in_tx(&h, async |tx| drain::undrain(tx, &f.nodes[0]).await.unwrap()).await;
    assert_eq!(reservations::extend(&mut c, &TEST_ACTOR, ME, &held.id, &later, None).await.unwrap().ends_at[..19], later[..19]);
}
