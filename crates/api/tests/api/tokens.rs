//! Bearer tokens through the API: revocation (in this process and another), expiry on the database's clock, and no secret in the logs.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_stops_working_and_no_secret_is_ever_returned_again() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let idn = api.ok(&b.token, "identities.create", json!({"name": "ci", "kind": "service"})).await;
    let issued = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"], "name": "ci"})).await;
    let secret = issued["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("bct_"));
    // The new identity holds no role: authenticated, but nothing of the tenant.
    let (s, v) = api.call(&secret, "reservations.list", json!({})).await;
    assert_eq!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")));
    api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "member", "scopeKind": "tenant"})).await;
    api.ok(&secret, "reservations.list", json!({})).await;
    // Nothing lists or reads the secret again, and the database holds only its hash.
    for (m, body) in [("tokens.list", json!({})), ("identities.get", json!({"identityId": idn["id"]}))] {
        let v = api.ok(&b.token, m, body).await;
        assert!(!v.to_string().contains(&secret), "{m} returned a secret");
    }
    let stored: i64 = api.h.db().connect().await.query_one("SELECT count(*) FROM tokens WHERE position($1 in encode(secret_sha256, 'escape')) > 0", &[&secret]).await.unwrap().get(0);
    assert_eq!(stored, 0);
    // A member cannot grant itself more than it holds.
    let (s, v) = api.call(&secret, "roleBindings.create", json!({"identityId": idn["id"], "role": "fleet-admin", "scopeKind": "fleet"})).await;
    assert_eq!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")), "{v}");
    let (s, v) = api.call(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "operator", "scopeKind": "fleet"})).await;
    assert_eq!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")), "a tenant admin made someone an operator: {v}");
    // Revoked through the API: refused at once on this server.
    api.ok(&b.token, "tokens.revoke", json!({"tokenId": issued["token"]["id"]})).await;
    let (s, v) = api.call(&secret, "reservations.list", json!({})).await;
    assert_eq!((s, v["code"].as_str()), (401, Some("UNAUTHENTICATED")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_drops_a_revoked_token_on_its_next_tail_or_after_the_30_s_cache_at_most() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let pg = better_compute_db::pool::connect_pool(&api.h.db().pgbouncer_connection_string().await, 4).unwrap();
    let now_ms = Arc::new(AtomicU64::new(0));
    let clock = now_ms.clone();
    // Two other API processes: one tails authz_changes, one never does.
    let tailing = Iam::with_clock(pg.clone(), Arc::new({ let c = clock.clone(); move || c.load(Ordering::SeqCst) }));
    let stalled = Iam::with_clock(pg, Arc::new(move || clock.load(Ordering::SeqCst)));
    tailing.start_tail().await.unwrap();
    assert_eq!(tailing.authenticate(&b.token).await.unwrap().tenant_id, b.id);
    assert_eq!(stalled.authenticate(&b.token).await.unwrap().tenant_id, b.id);
    let tokens = api.ok(&b.token, "tokens.list", json!({})).await;
    let id = tokens["items"][0]["id"].as_str().unwrap().to_owned();
    api.ok(&api.op, "tenants.get", json!({"tenantId": b.id})).await;
    api.ok(&b.token, "tokens.revoke", json!({"tokenId": id})).await;
    // Both still trust their cache…
    assert!(tailing.authenticate(&b.token).await.is_ok());
    assert!(stalled.authenticate(&b.token).await.is_ok());
    // …until the tail applies the change. The tail only reads changes older than every running
    // transaction of the cluster (other tests' too), so it may take a few polls.
    tokio::time::timeout(Duration::from_secs(30), async {
        while tailing.apply_changes().await.unwrap() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the tail never saw the revocation");
    assert_eq!(tailing.authenticate(&b.token).await.unwrap_err().code, better_compute_core::ErrorCode::Unauthenticated);
    // or, without a tail, until the 30 s cache expires.
    now_ms.store(29_999, Ordering::SeqCst);
    assert!(stalled.authenticate(&b.token).await.is_ok());
    now_ms.store(30_000, Ordering::SeqCst);
    assert_eq!(stalled.authenticate(&b.token).await.unwrap_err().code, better_compute_core::ErrorCode::Unauthenticated);
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_secret_reaches_the_logs_even_at_trace_level() {
    let logs = Captured::default();
    let writer = logs.clone();
    // Every target, every level: the server, axum, hyper and tokio-postgres (which logs statements).
    // (try_init also forwards the `log` records of tokio-postgres.)
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::fmt().with_max_level(tracing::Level::TRACE).with_ansi(false).with_writer(move || writer.clone()).finish().try_init().unwrap();
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let idn = api.ok(&b.token, "identities.create", json!({"name": "ci", "kind": "service"})).await;
    let issued = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    let secret = issued["secret"].as_str().unwrap().to_owned();
    let (s, _) = api.call(&secret, "reservations.list", json!({})).await;
    assert_eq!(s, 403);
    api.ok(&b.token, "tokens.revoke", json!({"tokenId": issued["token"]["id"]})).await;
    let (s, _) = api.call(&secret, "reservations.list", json!({})).await;
    assert_eq!(s, 401);
    let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    assert!(text.contains("request_id=req_"), "the capture saw no request logs:\n{text}");
    for s in [&secret, &b.token, &api.op] {
        assert!(!text.contains(s.as_str()), "a token secret was logged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_expires_on_the_database_clock_and_bootstrap_happens_once() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let idn = api.ok(&b.token, "identities.create", json!({"name": "short", "kind": "service"})).await;
    let issued = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"], "ttlSeconds": 60})).await;
    let secret = issued["secret"].as_str().unwrap().to_owned();
    let pg = better_compute_db::pool::connect_pool(&api.h.db().pgbouncer_connection_string().await, 2).unwrap();
    let fresh = || Iam::with_clock(pg.clone(), Arc::new(|| 0));
    assert!(fresh().authenticate(&secret).await.is_ok());
    api.h.db().advance(Duration::from_secs(61)).await;
    assert_eq!(fresh().authenticate(&secret).await.unwrap_err().code, better_compute_core::ErrorCode::Unauthenticated);
    let (s, v) = api.call(&b.token, "tokens.create", json!({"identityId": idn["id"], "ttlSeconds": 5})).await;
    assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")));
    // The first admin comes from bootstrap, once.
    let mut c = api.h.db().connect().await;
    let tx = c.transaction().await.unwrap();
    let again = better_compute_iam::bootstrap::bootstrap(&tx, &api.h.registry().permissions(), "again", "admin").await.unwrap_err();
    assert_eq!(again.code, better_compute_core::ErrorCode::FailedPrecondition);
}
