//! The batch placer against a real PostgreSQL: what a batch places and books, what it hands back
//! to run alone, idempotency keys inside a batch, batched releases, and the invariants under
//! concurrent batches.


use better_compute_audit::Actor;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use better_compute_capacity::batch::{BatchPlacer, BatchSettings};
use better_compute_capacity::reservations::{self, CreateReservation, ReservationView};
use better_compute_capacity::{quota, Caller};
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_runtime::harness::Harness;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

async fn count(h: &Harness, sql: &str) -> i64 {
    h.db().client().await.query_one(sql, &[]).await.unwrap().get(0)
}

/// A batch placer over a pool of one connection, and that connection held: the batcher takes its
/// first request and waits for it, so what the test submits next queues up for one batch. Drop the
/// held connection to let the batches run.
async fn held_placer(h: &Harness) -> (BatchPlacer, deadpool_postgres::Object) {
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 1).unwrap();
    let held = pool.get().await.unwrap();
    (BatchPlacer::start(pool, BatchSettings { batchers: 1, max_batch: 32, queue_len: 64, retries: 1 }), held)
}

/// Waits (at most 30 s) until `n` requests wait on the placer.
async fn until_waiting(p: &BatchPlacer, n: u64) {
    let waiting = async {
        while p.counters().waiting.load(Ordering::SeqCst) < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("requests never reached the placer");
}

/// Creates every request through the placer at once, each caller on its own connection; returns
/// the results in order once the connection held by `held_placer` is let go.
async fn create_together(
    h: &Harness,
    p: &BatchPlacer,
    held: deadpool_postgres::Object,
    reqs: Vec<(Caller<'static>, CreateReservation)>,
) -> Vec<Result<ReservationView, better_compute_core::Error>> {
    let n = reqs.len() as u64;
    let mut tasks = Vec::new();
    for (caller, req) in reqs {
        let (p, mut c) = (p.clone(), h.db().connect().await);
        tasks.push(tokio::spawn(async move { reservations::create_batched(&p, &mut c, &TEST_ACTOR, caller, &req).await }));
    }
    until_waiting(p, n).await;
    drop(held);
    let mut out = Vec::new();
    for t in tasks {
        out.push(tokio::time::timeout(Duration::from_secs(60), t).await.expect("create hung").unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_places_its_requests_together_and_books_what_one_placement_would() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(12), 8).await;
    let c = h.db().client().await;
    c.execute("UPDATE nodes SET labels = '{\"rack\": \"r7\"}' WHERE id = $1", &[&f.nodes[5]]).await.unwrap();
    let gens = "SELECT coalesce(sum(gen), 0)::int8 FROM work_queue WHERE kind = 'nodespec'";
    let gens_before = count(&h, gens).await;
    let (p, held) = held_placer(&h).await;
    let mut reqs: Vec<_> = (0..9).map(|i| (ME, whole(&f.pool_id, 1 + i % 2))).collect();
    let mut racked = whole(&f.pool_id, 3);
    racked.node_selector.insert("rack".into(), serde_json::json!("r7"));
    reqs.push((ME, racked));
    let views: Vec<_> = create_together(&h, &p, held, reqs).await.into_iter().map(|r| r.unwrap()).collect();
    // Two batches at most: the one request the batcher took before the connection was free, then
    // the rest together; none was handed back.
    let counters = p.counters();
    assert_eq!(counters.done.load(Ordering::SeqCst), 10);
    assert_eq!(counters.run_alone.load(Ordering::SeqCst), 0);
    assert!(counters.batches.load(Ordering::SeqCst) <= 2, "{} batches", counters.batches.load(Ordering::SeqCst));
    assert!(views.iter().all(|v| v.state == "placed"));
    assert_eq!(views[9].node_id.as_deref(), Some(f.nodes[5].as_str()), "the node selector holds in a batch");
    // What one placement books, for each: its atoms on its node, its scalars, its quota, its
    // node's idle count, its event and its wake-ups.
    let gpus: i64 = views.iter().map(|v| v.atoms.len() as i64).sum();
    assert_eq!(gpus, 5 + 4 * 2 + 3, "five of 1, four of 2, one of 3");
    for v in &views {
        let node = f.nodes.iter().position(|n| Some(n) == v.node_id.as_ref()).unwrap();
        assert!(v.atoms.iter().all(|a| f.gpus[node].contains(a)), "{v:?}");
    }
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, gpus);
    assert_eq!(count(&h, "SELECT sum(vcpu_allocated)::int8 FROM node_resources").await, 8 * 10);
    let used: HashMap<String, i64> = quota::get(&**c, TENANT).await.unwrap().into_iter().map(|q| (q.resource, q.used)).collect();
    assert_eq!((used["gpus"], used["vcpu"], used["disk_gib"]), (gpus, 80, 1000));
    assert_eq!(count(&h, "SELECT (sum(total) - sum(idle))::int8 FROM node_atom_counts").await, gpus);
    assert_eq!(count(&h, "SELECT count(*) FROM outbox WHERE type = 'reservation.placed'").await, 10);
    assert_eq!(count(&h, "SELECT count(*) FROM work_queue WHERE kind = 'capacity.reservations'").await, 10);
    let nodes_used = views.iter().filter_map(|v| v.node_id.clone()).collect::<std::collections::BTreeSet<_>>().len() as i64;
    assert!(count(&h, gens).await - gens_before >= nodes_used, "every node placed on has its desired state invalidated");
    // The views are the database's own.
    for v in &views {
        assert_eq!(&reservations::get(&**c, ME, &v.id).await.unwrap(), v);
    }
    assert_invariants_hold(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_takes_several_requests_of_a_batch_while_it_has_room() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 8).await;
    let c = h.db().client().await;
    c.execute("UPDATE nodes SET labels = '{\"rack\": \"r7\"}' WHERE id = $1", &[&f.nodes[0]]).await.unwrap();
    c.execute("UPDATE nodes SET labels = '{\"rack\": \"r9\"}' WHERE id = $1", &[&f.nodes[2]]).await.unwrap();
    let on_rack = |rack: &str, n: i32| {
        let mut r = whole(&f.pool_id, n);
        r.node_selector.insert("rack".into(), serde_json::json!(rack));
        (ME, r)
    };
    let (p, held) = held_placer(&h).await;
    // The batcher takes the first request alone; five for rack r7 come as one batch. From the
    // smallest up, 1 + 1 + 2 + 4 GPUs fill the node, and the second 4 is left to run alone.
    let reqs = vec![on_rack("r9", 1), on_rack("r7", 4), on_rack("r7", 1), on_rack("r7", 2), on_rack("r7", 4), on_rack("r7", 1)];
    let out: Vec<_> = create_together(&h, &p, held, reqs).await.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(p.counters().done.load(Ordering::SeqCst), 5, "all but the one that does not fit were placed in the batch");
    let on_r7: Vec<_> = out[1..].iter().filter(|v| v.state == "placed").collect();
    assert_eq!(on_r7.len(), 4, "{out:?}");
    assert!(on_r7.iter().all(|v| v.node_id.as_deref() == Some(f.nodes[0].as_str())));
    let mut atoms: Vec<_> = on_r7.iter().flat_map(|v| v.atoms.clone()).collect();
    atoms.sort();
    let mut all = f.gpus[0].clone();
    all.sort();
    assert_eq!(atoms, all, "each GPU of the node to one request");
    assert_eq!(out.iter().filter(|v| v.state == "pending").count(), 1, "{out:?}");
    let node = &f.nodes[0];
    assert_eq!(count(&h, &format!("SELECT vcpu_allocated::int8 FROM node_resources WHERE node_id = '{node}'")).await, 4 * 8);
    assert_eq!(count(&h, &format!("SELECT idle::int8 FROM node_atom_counts WHERE node_id = '{node}'")).await, 0);
    assert_invariants_hold(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_whose_sum_a_nodes_scalars_do_not_fit_leave_no_booking_reservation_or_event_behind() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(1), 4).await;
    let c = h.db().client().await;
    // 20 vCPUs: room for two requests of 8, not three.
    c.execute("UPDATE node_resources SET vcpu_allocatable = 20, vcpu_usable = 20", &[]).await.unwrap();
    let (p, held) = held_placer(&h).await;
    // The batcher takes the first request alone; the other two come as one batch, whose sum (16 on
    // top of 8) the node does not fit: both are turned away after their bookings, reservations and
    // events were written, then run alone under the same ids.
    let out = create_together(&h, &p, held, (0..3).map(|_| (ME, whole(&f.pool_id, 1))).collect()).await;
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(out.iter().filter(|v| v.state == "placed").count(), 2, "{out:?}");
    assert_eq!(out.iter().filter(|v| v.state == "pending").count(), 1, "{out:?}");
    assert_eq!(p.counters().run_alone.load(Ordering::SeqCst), 2);
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 3);
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 2);
    assert_eq!(count(&h, "SELECT count(*) FROM outbox WHERE type = 'reservation.placed'").await, 2);
    assert_eq!(count(&h, "SELECT vcpu_allocated::int8 FROM node_resources").await, 16);
    assert_invariants_hold(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_batch_cannot_place_runs_alone_and_ends_as_it_would_have() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 4).await;
    let c = h.db().client().await;
    quota::set(&**c, TENANT, "gpus", 3).await.unwrap();
    open_quota(&**c, "ten_b").await;
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    {
        let mut tx = h.db().connect().await;
        let tx = tx.transaction().await.unwrap();
        actions::cordon(&tx, &f.nodes[1]).await.unwrap();
        tx.commit().await.unwrap();
    }
    let (p, held) = held_placer(&h).await;
    // One batch (after the first request): the tenant's two requests do not fit its quota together,
    // so both run alone and one of them is refused; the other tenant's 3 GPUs fit on no open node
    // once those are placed… or do: each ends as the one-request path decides.
    let out = create_together(&h, &p, held, vec![(ME, whole(&f.pool_id, 2)), (ME, whole(&f.pool_id, 2)), (other, whole(&f.pool_id, 9))]).await;
    let refused: Vec<_> = out.iter().filter_map(|r| r.as_ref().err()).map(|e| e.code).collect();
    assert!(refused.contains(&ErrorCode::QuotaExceeded), "{out:?}");
    // More GPUs than any node has: refused with the field named, by the one-request path.
    assert!(refused.contains(&ErrorCode::FailedPrecondition), "{out:?}");
    assert_eq!(out.iter().filter(|r| r.as_ref().is_ok_and(|v| v.state == "placed")).count(), 1, "{out:?}");
    assert!(p.counters().run_alone.load(Ordering::SeqCst) >= 2);
    // The cordoned node took nothing, and a request with no room left goes pending alone.
    let v = reservations::create_batched(&p, &mut h.db().connect().await, &TEST_ACTOR, other, &whole(&f.pool_id, 3)).await.unwrap();
    assert_eq!(v.state, "pending", "{v:?}");
    assert_eq!(v.conditions[0]["type"], "Unschedulable");
    assert_eq!(count(&h, &format!("SELECT count(*) FROM reservations WHERE node_id = '{}'", f.nodes[1])).await, 0);
    assert_invariants_hold(&c).await;
    // Nothing of the handed-back requests stayed: quota is exactly the placed one's.
    let used: HashMap<String, i64> = quota::get(&**c, TENANT).await.unwrap().into_iter().map(|q| (q.resource, q.used)).collect();
    assert_eq!(used["gpus"], 2);
}

/// Index entries `index` returned to this transaction so far.
async fn index_entries_read(tx: &tokio_postgres::Transaction<'_>, index: &str) -> i64 {
    tx.query_one("SELECT pg_stat_get_xact_tuples_returned($1::text::regclass)", &[&index]).await.unwrap().get(0)
}

/// A fleet of one node of 4 GPUs, all of them reserved by the reservation returned, and a connection.
async fn one_full_node(h: &Harness) -> (Fleet, tokio_postgres::Client, ReservationView) {
    let f = fleet(h, &exclusive(1), 4).await;
    let mut c = h.db().connect().await;
    let full = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 4)).await.unwrap();
    (f, c, full)
}

/// Waits (at most 30 s) until `n` callers wait for a connection of `pool`.
async fn until_pool_waiters(pool: &deadpool_postgres::Pool, n: usize) {
    let waiting = async {
        while pool.status().waiting < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("the batchers never asked for the connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_waited_never_books_a_released_gpu_from_before_its_release_ended_it() {
    // A batch reads the clock when it begins; one that then waited for quota rows while the clock
    // moved on and a release freed a GPU must not book that GPU from its earlier instant.
    let h = harness().await;
    let (f, mut c, full) = one_full_node(&h).await;
    open_quota(&c, "ten_b").await;
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    let mut z = h.db().connect().await;
    let quota_rows = z.transaction().await.unwrap();
    quota_rows.execute("SELECT 1 FROM quota_usage WHERE tenant_id = 'ten_b' FOR UPDATE", &[]).await.unwrap();
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 2).unwrap();
    let p = BatchPlacer::start(pool, BatchSettings { retries: 0, ..BatchSettings::default() });
    let (bp, mut bc, pool_id) = (p.clone(), h.db().connect().await, f.pool_id.clone());
    let create = tokio::spawn(async move { reservations::create_batched(&bp, &mut bc, &TEST_ACTOR, other, &whole(&pool_id, 1)).await });
    waits_for_a_lock(&h, "capacity_reserve_batch", "the batch never waited for the quota rows").await;
    h.db().advance(Duration::from_secs(5)).await;
    reservations::release(&mut c, &TEST_ACTOR, ME, &full.id).await.unwrap();
    quota_rows.commit().await.unwrap();
    let v = tokio::time::timeout(Duration::from_secs(60), create).await.expect("create hung").unwrap().unwrap();
    assert_eq!(v.state, "placed", "{v:?}");
    // The batch left it (its atoms' history ends after the batch's now) and it ran alone.
    assert_eq!(p.counters().run_alone.load(Ordering::SeqCst), 1);
    let starts = booking_starts(&c, &v.id).await;
    let ended: String = c.query_one("SELECT max(upper(during))::text FROM device_booking_history", &[]).await.unwrap().get(0);
    assert_eq!(starts, vec![ended], "booked from the release's end");
    assert_invariants_hold(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_batch_turned_away_is_placed_by_the_next_batch_once_a_release_committed() {
    let h = harness().await;
    let (f, c, full) = one_full_node(&h).await;
    // One connection, held: the create batcher asks for it first with the new request, then the
    // release batcher with the release; the pool hands it out in that order.
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 1).unwrap();
    let held = pool.get().await.unwrap();
    let p = BatchPlacer::start(pool.clone(), BatchSettings { retries: 1, ..BatchSettings::default() });
    let (pc, mut cc) = (p.clone(), h.db().connect().await);
    let create = tokio::spawn(async move { reservations::create_batched(&pc, &mut cc, &TEST_ACTOR, ME, &whole(&f.pool_id, 2)).await });
    until_pool_waiters(&pool, 1).await;
    let (pr, mut cr, id) = (p.clone(), h.db().connect().await, full.id.clone());
    let release = tokio::spawn(async move { reservations::release_batched(&pr, &mut cr, &TEST_ACTOR, ME, &id).await });
    until_pool_waiters(&pool, 2).await;
    drop(held);
    let wait = |t: tokio::task::JoinHandle<_>| async { tokio::time::timeout(Duration::from_secs(60), t).await.expect("hung").unwrap() };
    assert_eq!(wait(release).await.unwrap().state, "released");
    let placed: ReservationView = wait(create).await.unwrap();
    // The first batch found the node full; the request went into the next create batch, which ran
    // after the release and placed it: nothing ran alone.
    assert_eq!(placed.state, "placed", "{placed:?}");
    let counters = p.counters();
    assert_eq!(counters.retried.load(Ordering::SeqCst), 1);
    assert_eq!(counters.run_alone.load(Ordering::SeqCst), 0);
    assert_eq!(counters.done.load(Ordering::SeqCst), 2);
    assert_invariants_hold(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_tries_as_many_further_batches_as_set_then_runs_alone() {
    let h = harness().await;
    let (f, mut c, _) = one_full_node(&h).await;
    for retries in [0u8, 2] {
        let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 2).unwrap();
        let p = BatchPlacer::start(pool, BatchSettings { retries, ..BatchSettings::default() });
        let v = reservations::create_batched(&p, &mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
        assert_eq!(v.state, "pending", "the one-request path decides what fits nowhere: {v:?}");
        assert_eq!(p.counters().retried.load(Ordering::SeqCst), retries as u64);
        assert_eq!(p.counters().run_alone.load(Ordering::SeqCst), 1);
        assert_eq!(p.counters().batches.load(Ordering::SeqCst), 1 + retries as u64);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_carried_to_the_next_batch_never_waits_on_another_batcher_waiting_for_requests() {
    let h = harness().await;
    let (f, mut c, _) = one_full_node(&h).await;
    // Two create batchers share the queue: while one places the request, the other holds the queue,
    // waiting for a request that only comes after this one is answered.
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 4).unwrap();
    let p = BatchPlacer::start(pool, BatchSettings { batchers: 2, retries: 1, ..BatchSettings::default() });
    let req = whole(&f.pool_id, 1);
    let create = reservations::create_batched(&p, &mut c, &TEST_ACTOR, ME, &req);
    let v = tokio::time::timeout(Duration::from_secs(60), create).await.expect("the carried request waited for the queue").unwrap();
    assert_eq!(v.state, "pending", "{v:?}");
    assert_eq!(p.counters().retried.load(Ordering::SeqCst), 1);
    assert_eq!(p.counters().run_alone.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_in_a_batch_places_once_and_replays_after() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(4), 8).await;
    let (p, held) = held_placer(&h).await;
    let mut req = whole(&f.pool_id, 1);
    req.idempotency_key = Some("batch-1".into());
    let out = create_together(&h, &p, held, vec![(ME, whole(&f.pool_id, 1)), (ME, req.clone()), (ME, req.clone())]).await;
    let (a, b) = (out[1].as_ref().unwrap(), out[2].as_ref().unwrap());
    assert_eq!(a, b, "the same key twice in a batch is one reservation");
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 2);
    let stored: serde_json::Value = h
        .db()
        .client()
        .await
        .query_one("SELECT response FROM idempotency_keys WHERE key = 'batch-1'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored["id"], a.id.as_str(), "the batch stores the key's response");
    let mut c = h.db().connect().await;
    assert_eq!(&reservations::create_batched(&p, &mut c, &TEST_ACTOR, ME, &req).await.unwrap(), a, "a retry replays");
    req.gpu.count = 2;
    assert_eq!(reservations::create_batched(&p, &mut c, &TEST_ACTOR, ME, &req).await.unwrap_err().code, ErrorCode::Conflict);
    assert_eq!(count(&h, "SELECT count(*) FROM reservations").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_release_gives_everything_back_once() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(3), 8).await;
    let placer = BatchPlacer::start(better_compute_db::pool::connect_pool(h.db().connection_string(), 2).unwrap(), BatchSettings::default());
    let mut c = h.db().connect().await;
    let mut held = Vec::new();
    for n in [1, 2, 3] {
        held.push(reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, n)).await.unwrap());
    }
    let ahead = whole_between(&f.pool_id, 2, "2030-01-01T05:00:00Z", "2030-01-01T06:00:00Z");
    let future = reservations::create(&mut c, &TEST_ACTOR, ME, &ahead).await.unwrap();
    h.db().advance(Duration::from_secs(60)).await;
    let mut tasks = Vec::new();
    for id in held.iter().map(|v| v.id.clone()).chain([future.id.clone(), future.id.clone()]) {
        let (p, mut c) = (placer.clone(), h.db().connect().await);
        tasks.push(tokio::spawn(async move { reservations::release_batched(&p, &mut c, &TEST_ACTOR, ME, &id).await }));
    }
    let mut views = Vec::new();
    for t in tasks {
        views.push(tokio::time::timeout(Duration::from_secs(60), t).await.expect("release hung").unwrap().unwrap());
    }
    for (v, before) in views.iter().zip(&held) {
        assert_eq!(v.state, "released");
        assert_eq!(v.atoms, before.atoms, "a released view lists the atoms it held");
    }
    assert_eq!(views[3].state, "released");
    assert!(views[3].atoms.is_empty(), "released before its start, it held nothing");
    assert_eq!(views[3], views[4], "a second release returns it unchanged");
    assert_eq!(count(&h, "SELECT count(*) FROM outbox WHERE type = 'reservation.released'").await, 4);
    assert_eq!(count(&h, "SELECT count(*) FROM device_bookings").await, 0);
    assert_eq!(count(&h, "SELECT count(*) FROM device_booking_history").await, 6);
    assert_eq!(count(&h, "SELECT sum(vcpu_allocated)::int8 FROM node_resources").await, 0);
    assert_eq!(count(&h, "SELECT sum(used)::int8 FROM quota_usage").await, 0);
    assert_eq!(count(&h, "SELECT (sum(total) - sum(idle))::int8 FROM node_atom_counts").await, 0);
    // Not the caller's, or not there: NOT_FOUND from the one-request path.
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    let fresh = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    assert_eq!(reservations::release_batched(&placer, &mut c, &TEST_ACTOR, other, &fresh.id).await.unwrap_err().code, ErrorCode::NotFound);
    assert_eq!(reservations::release_batched(&placer, &mut c, &TEST_ACTOR, ME, "res_nope").await.unwrap_err().code, ErrorCode::NotFound);
    assert_eq!(placer.counters().retried.load(Ordering::SeqCst), 0, "a release the batch did not do is not tried again");
    assert_eq!(reservations::get(&c, ME, &fresh.id).await.unwrap().state, "placed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_batch_shows_a_reservation_only_to_its_own_tenant() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 8).await;
    let (p, held) = held_placer(&h).await;
    let mut c = h.db().connect().await;
    let first = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    let mine = reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap();
    // Releases `id` through the placer, on connection `c`.
    let release = |caller: Caller<'static>, id: String, mut c: tokio_postgres::Client| {
        let p = p.clone();
        tokio::spawn(async move { reservations::release_batched(&p, &mut c, &TEST_ACTOR, caller, &id).await })
    };
    // The batcher takes the first release alone and waits for the held connection; the other
    // tenant's release of `mine`, then the owner's, queue up behind it for one batch.
    let other = Caller { tenant_id: "ten_b", identity_id: "idn_b" };
    let a = release(ME, first.id.clone(), h.db().connect().await);
    until_waiting(&p, 1).await;
    let theirs = release(other, mine.id.clone(), h.db().connect().await);
    until_waiting(&p, 2).await;
    let ours = release(ME, mine.id.clone(), h.db().connect().await);
    until_waiting(&p, 3).await;
    drop(held);
    let wait = |t: tokio::task::JoinHandle<_>| async { tokio::time::timeout(Duration::from_secs(60), t).await.expect("release hung").unwrap() };
    assert_eq!(wait(a).await.unwrap().state, "released");
    assert_eq!(wait(theirs).await.unwrap_err().code, ErrorCode::NotFound, "another tenant's reservation does not exist for it");
    assert_eq!(wait(ours).await.unwrap().state, "released");
    assert!(p.counters().batches.load(Ordering::SeqCst) >= 2);
    let events = h.db().client().await.query("SELECT tenant_id FROM outbox WHERE subject = $1 AND type = 'reservation.released'", &[&mine.id]).await.unwrap();
    let tenants: Vec<String> = events.iter().map(|r| r.get(0)).collect();
    assert_eq!(tenants, [ME.tenant_id], "one event, to the owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_batch_reads_only_its_own_reservations_however_many_have_ended() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 8).await;
    let mut c = h.db().connect().await;
    let live: Vec<String> = [
        reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap().id,
        reservations::create(&mut c, &TEST_ACTOR, ME, &whole(&f.pool_id, 1)).await.unwrap().id,
    ]
    .into();
    // Ended reservations of other tenants, `n` more of them.
    let history = |from: i32, n: i32| {
        format!(
            "INSERT INTO reservations (id, tenant_id, pool_id, state, gpu_kind, gpu_model, gpu_count, vcpu, memory_mib, disk_gib,
                                       during, node_selector, tolerations, node_id, created_by)
             SELECT 'res_ended' || g, 'ten_h' || g % 1000, pool_id, 'released', gpu_kind, gpu_model, gpu_count, vcpu, memory_mib,
                    disk_gib, during, node_selector, tolerations, node_id, created_by
               FROM reservations, generate_series({from}, {from} + {n} - 1) g WHERE id = '{}'",
            live[0]
        )
    };
    let release = "SELECT capacity_release_batch($1, ARRAY[$2, $2], ARRAY['evt_r1', 'evt_r2'], ARRAY[0, 0]::int2[])";
    // The connection plans the batch's statements once, from the statistics of a short history (a
    // batcher's connection lives on); the history then grows.
    c.batch_execute(&format!("{}; ANALYZE reservations", history(1, 300))).await.unwrap();
    let nothing: Vec<Option<serde_json::Value>> = c.query_one(release, &[&vec!["res_none", "res_none2"], &ME.tenant_id]).await.unwrap().get(0);
    assert_eq!(nothing, [None, None]);
    c.batch_execute(&history(301, 20_000)).await.unwrap();
    let tx = c.transaction().await.unwrap();
    let views: Vec<Option<serde_json::Value>> = tx.query_one(release, &[&live, &ME.tenant_id]).await.unwrap().get(0);
    assert!(views.iter().all(|v| v.as_ref().is_some_and(|v| v["state"] == "released")), "{views:?}");
    let read = index_entries_read(&tx, "reservations_pkey").await;
    assert!(read < 100, "the release batch read {read} reservations' index entries for 2 releases");
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_batch_locks_only_its_own_nodes_however_many_the_fleet_has() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(2), 8).await;
    let mut c = h.db().connect().await;
    // One request of one GPU; $1 is the reservation's id, $2 its event's.
    let create = format!(
        "SELECT capacity_reserve_batch(ARRAY[$1], ARRAY['{TENANT}'], ARRAY['{}'], ARRAY['{}'], ARRAY['{MODEL}'], ARRAY['{{}}'::jsonb],
                                       ARRAY[1], ARRAY[8], ARRAY[65536::int8], ARRAY[100::int8], ARRAY[NULL::timestamptz],
                                       ARRAY[3600::float8], ARRAY[NULL::text], ARRAY[NULL::bytea], 86400, ARRAY[$2], ARRAY[0::int2],
                                       0, 1, 31622400)",
        ME.identity_id, f.pool_id
    );
    // The connection plans the batch's statements once, on a fleet of two nodes (a batcher's
    // connection lives on); the fleet then grows by 20,000 nodes, unanalyzed.
    let first: Vec<Option<serde_json::Value>> = c.query_one(&create, &[&"res_first", &"evt_first"]).await.unwrap().get(0);
    assert_eq!(first[0].as_ref().map(|v| v["state"].clone()), Some(serde_json::json!("placed")));
    c.execute(
        "INSERT INTO nodes (id, pool_id, name, shard, labels, generation, observed_generation, vcpu, memory_mib, disk_gib)
         SELECT 'node_more' || g, $1, 'more' || g, 0, '{}', 1, 1, 64, 65536, 100 FROM generate_series(1, 20000) g",
        &[&f.pool_id],
    )
    .await
    .unwrap();
    let tx = c.transaction().await.unwrap();
    let views: Vec<Option<serde_json::Value>> = tx.query_one(&create, &[&"res_second", &"evt_second"]).await.unwrap().get(0);
    assert_eq!(views[0].as_ref().map(|v| v["state"].clone()), Some(serde_json::json!("placed")), "{views:?}");
    let read = index_entries_read(&tx, "nodes_pkey").await;
    assert!(read < 100, "the create batch read {read} nodes' index entries for 1 placement");
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_and_single_placements_never_double_book_nor_overcharge() {
    let h = harness().await;
    let f = fleet(&h, &exclusive(12), 8).await;
    let c = h.db().client().await;
    const TENANTS: [&str; 3] = ["ten_a", "ten_b", "ten_c"];
    for t in TENANTS {
        open_quota(&**c, t).await;
        quota::set(&**c, t, "gpus", 40).await.unwrap();
    }
    let placer = BatchPlacer::start(
        better_compute_db::pool::connect_pool(h.db().connection_string(), 4).unwrap(),
        BatchSettings { batchers: 2, max_batch: 8, queue_len: 64, retries: 1 },
    );
    let mut tasks = Vec::new();
    for i in 0..24 {
        let (p, pool_id, mut c) = (placer.clone(), f.pool_id.clone(), h.db().connect().await);
        tasks.push(tokio::spawn(async move {
            let me = Caller { tenant_id: TENANTS[i % 3], identity_id: "idn_x" };
            for k in 0..6 {
                let req = whole(&pool_id, 1 + ((i + k) % 3) as i32);
                let r = if (i + k) % 2 == 0 {
                    reservations::create_batched(&p, &mut c, &TEST_ACTOR, me, &req).await
                } else {
                    reservations::create(&mut c, &TEST_ACTOR, me, &req).await
                };
                if let Ok(v) = r
                    && k % 2 == 1
                {
                    let released = if i % 2 == 0 {
                        reservations::release_batched(&p, &mut c, &TEST_ACTOR, me, &v.id).await
                    } else {
                        reservations::release(&mut c, &TEST_ACTOR, me, &v.id).await
                    };
                    assert_eq!(released.unwrap().state, "released");
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t).await.expect("a client hung").unwrap();
    }
    assert!(placer.counters().done.load(Ordering::SeqCst) > 20, "{:?}", placer.counters());
    assert_invariants_hold(&c).await;
    let over = count(&h, "SELECT count(*) FROM quota_usage WHERE used > max").await;
    assert_eq!(over, 0);
}
