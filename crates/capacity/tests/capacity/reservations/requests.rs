//! A tenant's requests: booking whole GPUs, scalars and quota, isolation, quota and bad input refused with nothing written, idempotency keys, pages, quota under concurrency, and the audit entry a request commits with.

use super::*;

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
