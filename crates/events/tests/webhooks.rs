//! Webhooks against a real PostgreSQL and real HTTP receivers, in simulated time: signatures
//! checked by an independent implementation, the retry timeline, dead letters and replay, 410,
//! SSRF refusals with zero connections, and pruning behind cursors.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use better_compute_events::webhooks::{self, WebhookWithSecret};
use better_compute_events::jobs::deliver;
use better_compute_events::{signing, EgressPolicy, EventsConfig, EventsModule};
use better_compute_runtime::harness::Harness;
use better_compute_runtime::outbox::{self, NewEvent};
use sha2::{Digest, Sha256};

const TENANT: &str = "ten_01aaaaaaaaaaaaaaaaaaaaaaaa";
const DEV: EgressPolicy = EgressPolicy { allow_http: true, allow_private: true };

/// HMAC-SHA256 written from RFC 2104 over plain SHA-256, independent of the `hmac` crate.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let inner: Vec<u8> = k.iter().map(|b| b ^ 0x36).chain(msg.iter().copied()).collect();
    let outer: Vec<u8> = k.iter().map(|b| b ^ 0x5c).chain(Sha256::digest(&inner)).collect();
    Sha256::digest(&outer).into()
}

/// A receiver's check, from the Standard Webhooks spec: some `v1,` signature matches, and the
/// timestamp is within five minutes of `now_s`.
fn verify(secret: &str, headers: &HeaderMap, body: &[u8], now_s: i64) -> bool {
    let get = |h: &str| headers.get(h).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let (id, ts) = (get("webhook-id"), get("webhook-timestamp"));
    let Ok(ts_n) = ts.parse::<i64>() else { return false };
    if (now_s - ts_n).abs() > 300 {
        return false;
    }
    let key = STANDARD.decode(secret.trim_start_matches("whsec_")).unwrap();
    let expected = STANDARD.encode(hmac_sha256(&key, format!("{id}.{ts}.").as_bytes().iter().chain(body).copied().collect::<Vec<_>>().as_slice()));
    get("webhook-signature").split(' ').any(|s| s.strip_prefix("v1,") == Some(expected.as_str()))
}

#[test]
fn signatures_verify_with_an_independent_implementation_and_tampering_fails() {
    let (secret, old) = (signing::new_secret(), signing::new_secret());
    let body = br#"{"id":"evt_1","type":"reservation.placed"}"#;
    let mut h = HeaderMap::new();
    h.insert("webhook-id", "evt_1".parse().unwrap());
    h.insert("webhook-timestamp", "1900000000".parse().unwrap());
    h.insert("webhook-signature", signing::header(&[&secret, &old], "evt_1", 1_900_000_000, body).parse().unwrap());
    assert!(verify(&secret, &h, body, 1_900_000_010));
    // During a rotation's grace, the old secret verifies too.
    assert!(verify(&old, &h, body, 1_900_000_010));
    assert!(!verify(&signing::new_secret(), &h, body, 1_900_000_010));
    assert!(!verify(&secret, &h, br#"{"id":"evt_1","type":"reservation.released"}"#, 1_900_000_010), "a tampered body verified");
    assert!(!verify(&secret, &h, body, 1_900_000_000 + 301), "an old timestamp verified");
}

/// What a test receiver answers next.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Status(u16),
    RetryAfter(u16, u64),
    Hang,
}

/// A delivery as the receiver saw it: its headers and body.
type Seen = (HeaderMap, Vec<u8>);

#[derive(Clone, Default)]
struct Receiver {
    script: Arc<Mutex<Vec<Reply>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicUsize>,
}

impl Receiver {
    /// Serves on 127.0.0.1; replies in `script` order, then 200 forever.
    async fn start(script: Vec<Reply>) -> (Receiver, SocketAddr) {
        let r = Receiver { script: Arc::new(Mutex::new(script)), ..Default::default() };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let rr = r.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                rr.connections.fetch_add(1, Ordering::SeqCst);
                let app = axum::Router::new().route(
                    "/hook",
                    axum::routing::post({
                        let rr = rr.clone();
                        move |headers: HeaderMap, body: axum::body::Bytes| {
                            let rr = rr.clone();
                            async move {
                                rr.seen.lock().unwrap().push((headers, body.to_vec()));
                                let next = { let mut s = rr.script.lock().unwrap(); if s.is_empty() { Reply::Status(200) } else { s.remove(0) } };
                                match next {
                                    Reply::Status(s) => StatusCode::from_u16(s).unwrap().into_response(),
                                    Reply::RetryAfter(s, after) => (StatusCode::from_u16(s).unwrap(), [("retry-after", after.to_string())]).into_response(),
                                    Reply::Hang => {
                                        tokio::time::sleep(Duration::from_secs(5)).await;
                                        StatusCode::OK.into_response()
                                    }
                                }
                            }
                        }
                    }),
                );
                let io = hyper_util::rt::TokioIo::new(stream);
                tokio::spawn(async move {
                    let svc = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new()).serve_connection(io, svc).await;
                });
            }
        });
        (r, addr)
    }
}

async fn harness(policy: EgressPolicy) -> Harness {
    let config = EventsConfig { policy, timeout: Duration::from_millis(300), ..EventsConfig::default() };
    Harness::new(vec![Arc::new(EventsModule { config })]).await
}

async fn hook(h: &Harness, url: &str, policy: EgressPolicy) -> WebhookWithSecret {
    let c = h.db().connect().await;
    webhooks::create(&c, TENANT, url, &[], "", policy, &["reservation.placed"]).await.unwrap()
}

async fn emit(h: &Harness, tenant: &str, subject: &str) -> String {
    let mut c = h.db().connect().await;
    let tx = c.transaction().await.unwrap();
    let id = outbox::emit(&tx, NewEvent { event_type: "reservation.placed", tenant_id: Some(tenant), subject, data: serde_json::json!({"n": 1}) }).await.unwrap();
    tx.commit().await.unwrap();
    id
}

/// Runs the fan-out job (`events.fanout`, ticked alone) until `event` has its deliveries. The outbox is read only behind every running
/// transaction of the cluster (other tests' too), so an event may take a few passes to show.
async fn fan_out(h: &Harness, event: &str) {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            h.job("events.fanout").drain(5).await;
            let c = h.db().connect().await;
            let n: i64 = c.query_one("SELECT count(*) FROM webhook_deliveries WHERE event_id = $1", &[&event]).await.unwrap().get(0);
            if n > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the fan-out never saw the event");
}

/// `(state, attempts, seconds until the next attempt)` of the delivery of `event` to `webhook`.
async fn delivery(h: &Harness, webhook: &str, event: &str) -> (String, i32, Option<f64>) {
    let r = h
        .db()
        .connect()
        .await
        .query_one(
            "SELECT state, attempts, extract(epoch FROM next_attempt_at - compute_now())::float8 FROM webhook_deliveries
              WHERE webhook_id = $1 AND event_id = $2",
            &[&webhook, &event],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_then_hanging_then_throttling_receiver_gets_the_event_on_schedule_signed() {
    let h = harness(DEV).await;
    let (rx, addr) = Receiver::start(vec![Reply::Status(500), Reply::Hang, Reply::RetryAfter(429, 7200)]).await;
    let wh = hook(&h, &format!("http://{addr}/hook"), DEV).await;
    let event = emit(&h, TENANT, "res_1").await;
    emit(&h, "ten_01bbbbbbbbbbbbbbbbbbbbbbbb", "res_other").await; // another tenant's: not sent here
    fan_out(&h, &event).await;
    let deliver_job = h.job("events.deliver");
    deliver_job.tick().await;
    // 500: retried after 5 s (±10%).
    let (state, attempts, next) = delivery(&h, &wh.webhook.id, &event).await;
    assert_eq!((state.as_str(), attempts), ("pending", 1));
    let next = next.unwrap();
    assert!((4.5..=5.5).contains(&next), "{next}");
    // Not due yet: nothing is sent.
    deliver_job.tick().await;
    assert_eq!(rx.seen.lock().unwrap().len(), 1);
    h.db().advance(Duration::from_secs_f64(next)).await;
    deliver_job.tick().await;
    // No answer within the timeout: retried after 5 min.
    let (_, attempts, next) = delivery(&h, &wh.webhook.id, &event).await;
    assert_eq!(attempts, 2);
    let next = next.unwrap();
    assert!((270.0..=330.0).contains(&next), "{next}");
    h.db().advance(Duration::from_secs_f64(next)).await;
    deliver_job.tick().await;
    // 429 with Retry-After: 7200 beats the 30 min of the schedule.
    let (_, attempts, next) = delivery(&h, &wh.webhook.id, &event).await;
    assert_eq!(attempts, 3);
    assert!((next.unwrap() - 7200.0).abs() < 1.0, "{next:?}");
    h.db().advance(Duration::from_secs(7200)).await;
    deliver_job.tick().await;
    let (state, attempts, next) = delivery(&h, &wh.webhook.id, &event).await;
    assert_eq!((state.as_str(), attempts, next), ("delivered", 4, None));
    // Every attempt carried the same id and a valid signature over the same body.
    let seen = rx.seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    for (headers, body) in seen.iter() {
        assert_eq!(headers["webhook-id"], event.as_str());
        let ts: i64 = headers["webhook-timestamp"].to_str().unwrap().parse().unwrap();
        assert!(verify(&wh.secret, headers, body, ts));
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!((v["id"].as_str(), v["tenantId"].as_str(), v["subject"].as_str()), (Some(event.as_str()), Some(TENANT), Some("res_1")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_retries_become_a_dead_letter_that_a_replay_delivers_and_410_disables_the_endpoint() {
    let h = harness(DEV).await;
    let (_rx, addr) = Receiver::start(vec![Reply::Status(503); 10]).await;
    let (_gone_rx, gone_addr) = Receiver::start(vec![Reply::Status(410)]).await;
    let wh = hook(&h, &format!("http://{addr}/hook"), DEV).await;
    let gone = hook(&h, &format!("http://{gone_addr}/hook"), DEV).await;
    let event = emit(&h, TENANT, "res_1").await;
    fan_out(&h, &event).await;
    let deliver_job = h.job("events.deliver");
    deliver_job.tick().await;
    let mut waited = 0.0;
    loop {
        let (state, attempts, next) = delivery(&h, &wh.webhook.id, &event).await;
        if state == "dead" {
            assert_eq!(attempts, 10);
            break;
        }
        assert!(attempts < 10, "still pending after {attempts} attempts");
        let next = next.unwrap();
        waited += next;
        h.db().advance(Duration::from_secs_f64(next)).await;
        deliver_job.tick().await;
    }
    // About three days: the schedule's 3 d 4 h, give or take the jitter.
    let schedule: f64 = deliver::SCHEDULE_S.iter().map(|s| *s as f64).sum();
    assert!((waited - schedule).abs() <= schedule * 0.1, "{waited} vs {schedule}");
    // 410: the endpoint is disabled and its delivery is dead at once.
    let (state, attempts, _) = delivery(&h, &gone.webhook.id, &event).await;
    assert_eq!((state.as_str(), attempts), ("dead", 1));
    let c = h.db().connect().await;
    let v = webhooks::get(&c, TENANT, &gone.webhook.id).await.unwrap();
    assert!(!v.enabled && v.disabled_reason.unwrap().contains("410"));
    // The dead letter is listed, and a replay (the receiver has recovered) delivers it.
    let dead = webhooks::dead_letters(&c, TENANT, Some(&wh.webhook.id), &Default::default()).await.unwrap();
    assert_eq!(dead.items.len(), 1);
    webhooks::replay(&c, TENANT, &dead.items[0].id).await.unwrap();
    assert_eq!(webhooks::replay(&c, TENANT, &dead.items[0].id).await.unwrap_err().code, better_compute_core::ErrorCode::FailedPrecondition);
    deliver_job.tick().await;
    assert_eq!(delivery(&h, &wh.webhook.id, &event).await.0, "delivered");
    assert!(webhooks::dead_letters(&c, TENANT, Some(&wh.webhook.id), &Default::default()).await.unwrap().items.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssrf_every_non_public_target_is_refused_and_no_connection_is_made() {
    let strict = EgressPolicy { allow_http: true, allow_private: false };
    let h = harness(strict).await;
    let c = h.db().connect().await;
    let (rx, addr) = Receiver::start(vec![]).await;
    let port = addr.port();
    let refused = [
        "https://127.0.0.1/hook".to_owned(),
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://2130706433:{port}/hook"),
        format!("http://0x7f.0.0.1:{port}/hook"),
        format!("http://0177.0.0.1:{port}/hook"),
        format!("http://127.1:{port}/hook"),
        format!("http://[::1]:{port}/hook"),
        format!("http://[::ffff:127.0.0.1]:{port}/hook"),
        "https://10.0.0.1/".into(),
        "https://172.16.5.4/".into(),
        "https://192.168.1.1/".into(),
        "https://169.254.169.254/latest/meta-data/".into(),
        "https://[fd00::1]/".into(),
        "https://[fe80::1]/".into(),
        "https://100.64.0.1/".into(),
        "https://0.0.0.0/".into(),
        "https://[::]/".into(),
        "https://[64:ff9b::7f00:1]/".into(),
        format!("http://localhost:{port}/hook"),
        format!("http://localhost.:{port}/hook"),
        format!("http://[::ffff:0:127.0.0.1]:{port}/hook"),
        format!("http://[2002:7f00:1::]:{port}/hook"),
        format!("http://[2001:0:4136:e378::80ff:fffe]:{port}/hook"),
        "https://[100::1]/".into(),
        "https://[2001:2::1]/".into(),
        "https://[2001:10::1]/".into(),
        "https://[2001:20::1]/".into(),
        "https://192.88.99.1/".into(),
        "https://user:secret@example.com/".into(),
        "ftp://example.com/".into(),
        "not a url".into(),
    ];
    for url in &refused {
        let e = webhooks::create(&c, TENANT, url, &[], "", strict, &[]).await.unwrap_err();
        assert_eq!(e.code, better_compute_core::ErrorCode::InvalidArgument, "{url}");
    }
    let https_only = webhooks::create(&c, TENANT, "http://example.com/", &[], "", EgressPolicy::default(), &[]).await.unwrap_err();
    assert!(https_only.message.contains("https"), "{}", https_only.message);
    // A webhook stored while it was allowed (or whose name resolved publicly then): refused at
    // the connection, which is never made.
    let sneaky = webhooks::create(&c, TENANT, &format!("http://localhost:{port}/hook"), &[], "", DEV, &[]).await.unwrap();
    let event = emit(&h, TENANT, "res_1").await;
    fan_out(&h, &event).await;
    h.job("events.deliver").tick().await;
    let (state, attempts, _) = delivery(&h, &sneaky.webhook.id, &event).await;
    assert_eq!((state.as_str(), attempts), ("pending", 1));
    let err: String = c.query_one("SELECT last_error FROM webhook_deliveries WHERE webhook_id = $1", &[&sneaky.webhook.id]).await.unwrap().get(0);
    assert!(err.contains("not a public address"), "{err}");
    // Names are checked after resolution, at every connection: one that resolves only to private
    // addresses yields no address to connect to.
    use reqwest::dns::Resolve;
    let resolved = better_compute_events::ssrf::PublicOnly(strict).resolve("localhost".parse().unwrap()).await;
    assert!(resolved.is_err_and(|e| e.to_string().contains("non-public")));
    let allowed = better_compute_events::ssrf::PublicOnly(DEV).resolve("localhost".parse().unwrap()).await;
    assert!(allowed.is_ok());
    assert_eq!(rx.connections.load(Ordering::SeqCst), 0, "a connection reached the private receiver");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_never_removes_a_row_a_cursor_still_needs() {
    let h = harness(DEV).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(emit(&h, TENANT, &format!("s{i}")).await);
    }
    let c = h.db().connect().await;
    let cursor_of = |id: &str| {
        let id = id.to_owned();
        let c = &c;
        async move { c.query_one("SELECT txid::text, seq FROM outbox WHERE id = $1", &[&id]).await.unwrap() }
    };
    // Two sinks: one has taken four events, the slowest only two.
    for (sink, upto) in [("fast", 3usize), ("slow", 1usize)] {
        let r = cursor_of(&ids[upto]).await;
        c.execute("INSERT INTO outbox_cursors (sink, txid, seq) VALUES ($1, $2::text::xid8, $3)", &[&sink, &r.get::<_, String>(0), &r.get::<_, i64>(1)])
            .await
            .unwrap();
    }
    let retention = Duration::from_secs(3600);
    // Nothing is old enough yet.
    assert_eq!(better_compute_events::jobs::prune::prune(&c, retention).await.unwrap().0, 0);
    h.db().advance(Duration::from_secs(7200)).await;
    let recent = emit(&h, TENANT, "recent").await;
    let (removed, _) = better_compute_events::jobs::prune::prune(&c, retention).await.unwrap();
    assert_eq!(removed, 2);
    let left: Vec<String> = c.query("SELECT id FROM outbox ORDER BY txid, seq", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    let mut expected: Vec<String> = ids[2..].to_vec();
    expected.push(recent);
    assert_eq!(left, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rotation_both_secrets_sign_until_the_grace_ends() {
    let h = harness(DEV).await;
    let (rx, addr) = Receiver::start(vec![]).await;
    let wh = hook(&h, &format!("http://{addr}/hook"), DEV).await;
    let c = h.db().connect().await;
    let rotated = webhooks::rotate_secret(&c, TENANT, &wh.webhook.id, 3600).await.unwrap();
    assert_ne!(rotated.secret, wh.secret);
    assert!(rotated.webhook.previous_secret_valid_until.is_some());
    webhooks::send_test(&c, TENANT, &wh.webhook.id).await.unwrap();
    h.job("events.deliver").tick().await;
    h.db().advance(Duration::from_secs(3601)).await;
    webhooks::send_test(&c, TENANT, &wh.webhook.id).await.unwrap();
    h.job("events.deliver").tick().await;
    let seen = rx.seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    let (during, after) = (&seen[0], &seen[1]);
    let ts = |h: &HeaderMap| h["webhook-timestamp"].to_str().unwrap().parse::<i64>().unwrap();
    assert!(verify(&rotated.secret, &during.0, &during.1, ts(&during.0)) && verify(&wh.secret, &during.0, &during.1, ts(&during.0)));
    assert!(verify(&rotated.secret, &after.0, &after.1, ts(&after.0)));
    assert!(!verify(&wh.secret, &after.0, &after.1, ts(&after.0)), "the old secret still signs after its grace");
}

/// Every plan node of an `EXPLAIN (FORMAT JSON)`, depth first.
fn plan_nodes(node: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
    out.push(node.clone());
    for child in node["Plans"].as_array().into_iter().flatten() {
        plan_nodes(child, out);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_a_million_row_outbox_walks_it_once_instead_of_once_per_row() {
    let h = harness(DEV).await;
    let c = h.db().connect().await;
    // 10 rows past the retention, then a million recent ones; every sink has read them all.
    c.batch_execute(
        "INSERT INTO outbox (id, type, subject, data, time)
           SELECT 'evt_old' || g, 'test.event', 's', '{}', compute_now() - interval '30 days' FROM generate_series(1, 10) g;
         INSERT INTO outbox (id, type, subject, data)
           SELECT 'evt_new' || g, 'test.event', 's', '{}' FROM generate_series(1, 1000000) g;
         INSERT INTO outbox_cursors (sink, txid, seq)
           SELECT 'test-sink', txid, seq FROM outbox ORDER BY txid DESC, seq DESC LIMIT 1;
         ANALYZE outbox;",
    )
    .await
    .unwrap();
    let cursor = c.query_one(better_compute_runtime::outbox::SLOWEST_CURSOR_SQL, &[]).await.unwrap();
    let (txid, seq): (String, i64) = (cursor.get(0), cursor.get(1));
    let explain = format!("EXPLAIN (FORMAT JSON) {}", better_compute_runtime::outbox::PRUNE_SQL);
    let plan: serde_json::Value = c.query_one(&explain, &[&(7.0 * 86400.0), &10_000i64, &txid, &seq]).await.unwrap().get(0);
    let mut nodes = Vec::new();
    plan_nodes(&plan[0]["Plan"], &mut nodes);
    assert!(nodes.len() >= 3, "{plan}");
    assert!(
        nodes.iter().all(|n| n["Parent Relationship"] != "SubPlan"),
        "the prune rescans the outbox per row (a correlated SubPlan): {plan}"
    );
    // And it runs: the ten old rows go, the million stay.
    let retention = Duration::from_secs(7 * 86400);
    let (events, _) = tokio::time::timeout(Duration::from_secs(120), better_compute_events::jobs::prune::prune(&c, retention)).await.expect("prune hung").unwrap();
    assert_eq!(events, 10);
    let left: i64 = c.query_one("SELECT count(*) FROM outbox", &[]).await.unwrap().get(0);
    assert_eq!(left, 1_000_000);
}

#[test]
fn retry_after_is_read_as_seconds_or_as_an_http_date() {
    use better_compute_events::jobs::deliver::retry_after_s;
    let now = std::time::UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
    assert_eq!(retry_after_s("120", now), Some(120));
    assert_eq!(retry_after_s(" 7 ", now), Some(7));
    assert_eq!(retry_after_s("Sun, 06 Nov 1994 08:51:37 GMT", now), Some(120));
    assert_eq!(retry_after_s("Sun, 06 Nov 1994 08:00:00 GMT", now), Some(0), "a date past is now");
    assert_eq!(retry_after_s("soon", now), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_neither_delays_nor_loses_the_batchs_other_outcomes_and_its_webhook_may_go_meanwhile() {
    // Requests may take 10 s: the hanging receiver answers after 5.
    let config = EventsConfig { policy: DEV, timeout: Duration::from_secs(10), ..EventsConfig::default() };
    let h = Arc::new(Harness::new(vec![Arc::new(EventsModule { config })]).await);
    let (_slow_rx, slow_addr) = Receiver::start(vec![Reply::Hang]).await;
    let (fast_rx, fast_addr) = Receiver::start(vec![]).await;
    let slow = hook(&h, &format!("http://{slow_addr}/hook"), DEV).await;
    let fast = hook(&h, &format!("http://{fast_addr}/hook"), DEV).await;
    let event = emit(&h, TENANT, "res_hang").await;
    fan_out(&h, &event).await;
    let run = tokio::spawn({
        let h = h.clone();
        async move { h.job("events.deliver").tick().await }
    });
    // The fast endpoint's outcome is recorded while the slow one is still in flight…
    tokio::time::timeout(Duration::from_secs(60), async {
        while delivery(&h, &fast.webhook.id, &event).await.0 != "delivered" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the fast delivery was not recorded while the slow one hung");
    assert!(!run.is_finished(), "the slow receiver was not in flight any more");
    assert_eq!(fast_rx.seen.lock().unwrap().len(), 1);
    // …and the slow endpoint's webhook is deleted meanwhile: the run still ends cleanly.
    let c = h.db().connect().await;
    webhooks::delete(&c, TENANT, &slow.webhook.id).await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(60), run).await.expect("the run hung").unwrap();
    assert_eq!(report.errors, 0, "{report:?}");
    assert_eq!(delivery(&h, &fast.webhook.id, &event).await, ("delivered".to_owned(), 1, None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoints_backlog_holds_up_no_other_endpoint_and_sends_at_most_four_at_once_within_its_budget() {
    // Requests may take 10 s; each of the slow receiver's answers takes 5; the endpoint's budget is
    // 4 s, so its run starts one wave of four and gives the rest back.
    let config = EventsConfig { policy: DEV, timeout: Duration::from_secs(10), endpoint_budget: Duration::from_secs(4), ..EventsConfig::default() };
    let h = Arc::new(Harness::new(vec![Arc::new(EventsModule { config })]).await);
    let (slow_rx, slow_addr) = Receiver::start(vec![Reply::Hang; 20]).await;
    let (fast_rx, fast_addr) = Receiver::start(vec![]).await;
    let slow = hook(&h, &format!("http://{slow_addr}/hook"), DEV).await;
    let mut events = Vec::new();
    for i in 0..9 {
        events.push(emit(&h, TENANT, &format!("res_{i}")).await);
    }
    fan_out(&h, events.last().unwrap()).await;
    h.job("outbox-dispatch").drain(5).await;
    let fast = hook(&h, &format!("http://{fast_addr}/hook"), DEV).await;
    let late = emit(&h, TENANT, "res_late").await;
    fan_out(&h, &late).await;
    let c = h.db().connect().await;
    let count = |webhook: String, state: &'static str| {
        let c = &c;
        async move {
            let n: i64 = c
                .query_one("SELECT count(*) FROM webhook_deliveries WHERE webhook_id = $1 AND state = $2", &[&webhook, &state])
                .await
                .unwrap()
                .get(0);
            n
        }
    };
    // Ten for the slow endpoint (the late event too), one for the other.
    assert_eq!(count(slow.webhook.id.clone(), "pending").await, 10);
    let run = tokio::spawn({
        let h = h.clone();
        async move { h.job("events.deliver").tick().await }
    });
    // The other endpoint is served while the slow one hangs, with four of its requests in flight.
    // Either endpoint's key may start first, so wait for both: the hanging answers take 5 s each,
    // longer than this wait, so all four are still in flight when it ends.
    let in_flight = || slow_rx.seen.lock().unwrap().len();
    tokio::time::timeout(Duration::from_secs(4), async {
        while delivery(&h, &fast.webhook.id, &late).await.0 != "delivered" || in_flight() < better_compute_events::jobs::deliver::PER_ENDPOINT {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the other endpoint waited behind the hanging one, or the slow one got fewer than four requests");
    assert_eq!(fast_rx.seen.lock().unwrap().len(), 1);
    assert!(!run.is_finished(), "the slow receiver was not in flight any more");
    assert_eq!(in_flight(), better_compute_events::jobs::deliver::PER_ENDPOINT, "requests in flight at once");
    let report = tokio::time::timeout(Duration::from_secs(60), run).await.expect("the run hung").unwrap();
    assert_eq!(report.errors, 0, "{report:?}");
    // One wave went before the budget ran out; the other six are due again, unsent and unattempted.
    assert_eq!(slow_rx.seen.lock().unwrap().len(), 4);
    assert_eq!(count(slow.webhook.id.clone(), "delivered").await, 4);
    let unsent: i64 = c
        .query_one(
            "SELECT count(*) FROM webhook_deliveries WHERE webhook_id = $1 AND state = 'pending' AND attempts = 0 AND next_attempt_at <= compute_now()",
            &[&slow.webhook.id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unsent, 6);
}
