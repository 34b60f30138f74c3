//! The watch stream: resumes without gaps, drops slow readers, ends or narrows with its grant, starts from now.

use super::*;

/// Reads SSE events from `resp` until `want` arrive or `quiet` passes without any; returns
/// `(cursor id, event id)` pairs.
async fn sse_events(resp: &mut reqwest::Response, want: usize, quiet: Duration) -> Vec<(String, String)> {
    let mut buf = String::new();
    let mut out = Vec::new();
    while out.len() < want {
        let Ok(Ok(Some(chunk))) = tokio::time::timeout(quiet, resp.chunk()).await else { break };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let field = |name: &str| block.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim_start().to_owned());
            if let (Some(id), Some(data)) = (field("id:"), field("data:")) {
                let v: Value = serde_json::from_str(&data).unwrap();
                out.push((id, v["id"].as_str().unwrap().to_owned()));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watch_stream_resumes_after_a_thousand_forced_reconnects_with_no_gap_and_no_duplicate() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let c = api.tenant("tenant-c").await;
    // A writer commits events of both tenants while the reader keeps reconnecting.
    let writer = {
        let conn = api.h.db().connection_string().to_owned();
        let (tb, tc) = (b.id.clone(), c.id.clone());
        tokio::spawn(async move {
            let mut db = better_compute_db::pool::connect(&conn).await.unwrap();
            for i in 0..1200 {
                let tx = db.transaction().await.unwrap();
                for k in 0..(1 + i % 3) {
                    let subject = format!("s{i}-{k}");
                    let e = better_compute_runtime::outbox::NewEvent { event_type: "test.event", tenant_id: Some(&tb), subject: &subject, data: json!({"i": i}) };
                    better_compute_runtime::outbox::emit(&tx, e).await.unwrap();
                }
                if i % 4 == 0 {
                    let e = better_compute_runtime::outbox::NewEvent { event_type: "test.event", tenant_id: Some(&tc), subject: "other", data: json!({}) };
                    better_compute_runtime::outbox::emit(&tx, e).await.unwrap();
                }
                tx.commit().await.unwrap();
            }
        })
    };
    let mut received: Vec<String> = Vec::new();
    let mut last = "0-0".to_owned();
    let mut reconnects = 0;
    let total_b = 1200 / 3 * (1 + 2 + 3);
    let done = tokio::time::timeout(Duration::from_secs(240), async {
        while received.len() < total_b {
            let mut resp = api
                .http
                .get(format!("{}/v1/watch", api.url))
                .bearer_auth(&b.token)
                .header("Last-Event-ID", &last)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            // Take one to three events, then cut the connection.
            for (cursor, id) in sse_events(&mut resp, 1 + reconnects % 3, Duration::from_secs(2)).await {
                last = cursor;
                received.push(id);
            }
            drop(resp);
            reconnects += 1;
        }
    })
    .await;
    writer.await.unwrap();
    assert!(done.is_ok(), "stuck after {} of {total_b} events and {reconnects} reconnects", received.len());
    assert!(reconnects >= 1000, "only {reconnects} reconnects");
    let db = api.h.db().connect().await;
    let expected: Vec<String> =
        db.query("SELECT id FROM outbox WHERE tenant_id = $1 ORDER BY txid, seq", &[&b.id]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(expected.len(), total_b);
    assert_eq!(received, expected, "gaps, duplicates, order or another tenant's events");
    // Filters, and a bad cursor.
    let mut resp = api.http.get(format!("{}/v1/watch?types=test.event&subject=s7-1", api.url)).bearer_auth(&b.token).header("Last-Event-ID", "0-0").send().await.unwrap();
    let only = sse_events(&mut resp, 2, Duration::from_secs(2)).await;
    assert_eq!(only.len(), 1);
    let r = api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).header("Last-Event-ID", "nonsense").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let r = api.http.get(format!("{}/v1/watch", api.url)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_client_that_stops_reading_is_dropped_instead_of_buffered() {
    let api = Api::start_with(|s| s.watch_slow_client_timeout = Duration::from_millis(200)).await;
    let b = api.tenant("tenant-b").await;
    // Far more than the stream's buffer and the sockets' buffers hold.
    let mut db = api.h.db().connect().await;
    for batch in 0..10 {
        let tx = db.transaction().await.unwrap();
        for i in 0..1000 {
            let subject = format!("s{batch}-{i}");
            let e = better_compute_runtime::outbox::NewEvent { event_type: "test.event", tenant_id: Some(&b.id), subject: &subject, data: json!({"pad": "x".repeat(4000)}) };
            better_compute_runtime::outbox::emit(&tx, e).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let mut resp = api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).header("Last-Event-ID", "0-0").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    // Take nothing for a while: the server's buffer fills, and it gives up on us.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = tokio::time::timeout(Duration::from_secs(180), async {
        let mut n = 0;
        while let Ok(Some(chunk)) = resp.chunk().await {
            n += String::from_utf8_lossy(&chunk).matches("\ndata:").count();
        }
        n
    })
    .await
    .expect("the stream never ended");
    assert!(got > 0 && got < 10_000, "the server buffered the slow client's whole backlog, or sent nothing ({got} events)");
}

/// Reads SSE blocks until `quiet` passes without any or the stream ends: `(event, data)` pairs,
/// and whether it ended.
pub(crate) async fn sse_until_quiet(resp: &mut reqwest::Response, quiet: Duration) -> (Vec<(String, Value)>, bool) {
    let mut buf = String::new();
    let mut out = Vec::new();
    loop {
        let chunk = match tokio::time::timeout(quiet, resp.chunk()).await {
            Err(_) => return (out, false),
            Ok(Ok(Some(c))) => c,
            Ok(_) => return (out, true),
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let field = |name: &str| block.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim_start().to_owned());
            if let (Some(event), Some(data)) = (field("event:"), field("data:")) {
                out.push((event, serde_json::from_str(&data).unwrap()));
            }
        }
    }
}

/// Reads SSE blocks until a `test.event` about `last` arrives (60 s at most: under load the outbox
/// shows an event only once every older transaction of the cluster has ended); the subjects of
/// the test events read, in order, and whether the stream ended first.
async fn sse_until_subject(resp: &mut reqwest::Response, last: &str) -> (Vec<String>, bool) {
    let mut buf = String::new();
    let mut out = Vec::new();
    let read = async {
        loop {
            let Ok(Some(chunk)) = resp.chunk().await else { return true };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let field = |name: &str| block.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim_start().to_owned());
                if let (Some("test.event"), Some(data)) = (field("event:").as_deref(), field("data:")) {
                    let v: Value = serde_json::from_str(&data).unwrap();
                    out.push(v["subject"].as_str().unwrap().to_owned());
                    if out.last().map(String::as_str) == Some(last) {
                        return false;
                    }
                }
            }
        }
    };
    let ended = tokio::time::timeout(Duration::from_secs(60), read).await.unwrap_or_else(|_| panic!("no {last:?} event within 60 s"));
    (out, ended)
}

async fn emit_event(api: &Api, tenant: Option<&str>, subject: &str) {
    let db = api.h.db().connect().await;
    let e = better_compute_runtime::outbox::NewEvent { event_type: "test.event", tenant_id: tenant, subject, data: json!({}) };
    better_compute_runtime::outbox::emit(&db, e).await.unwrap();
}

fn subjects(events: &[(String, Value)]) -> Vec<String> {
    events.iter().filter(|(e, _)| e == "test.event").map(|(_, v)| v["subject"].as_str().unwrap().to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_stream_ends_when_its_token_is_revoked_or_expires_and_narrows_when_a_binding_is_removed() {
    let api = Api::start_with(|s| s.watch_revalidate_interval = Duration::from_millis(100)).await;
    let b = api.tenant("tenant-b").await;
    let watch = async |token: &str, url: &str| {
        let r = api.http.get(format!("{url}/v1/watch")).bearer_auth(token).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r
    };
    // A second API process over the same database, learning changes only from its tail.
    let pg = better_compute_db::pool::connect_pool(&api.h.db().pgbouncer_connection_string().await, 4).unwrap();
    let iam2 = Arc::new(Iam::new(pg.clone()));
    iam2.start_tail().await.unwrap();
    let (stop2, mut stopped2) = tokio::sync::watch::channel(false);
    tokio::spawn(iam2.clone().run_tail(Duration::from_millis(50), async move {
        let _ = stopped2.wait_for(|s| *s).await;
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url2 = format!("http://{}", listener.local_addr().unwrap());
    let mut stopped = stop2.subscribe();
    tokio::spawn(better_compute_api::serve(listener, ApiState::new(pg, iam2, api.h.registry().clone()), async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));

    // Revoked on this process, and (the same token's stream) on the other one.
    let idn = api.ok(&b.token, "identities.create", json!({"name": "watcher", "kind": "service"})).await;
    api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "member", "scopeKind": "tenant"})).await;
    let tok = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    let secret = tok["secret"].as_str().unwrap();
    let (mut here, mut there) = (watch(secret, &api.url).await, watch(secret, &url2).await);
    emit_event(&api, Some(&b.id), "before").await;
    for (name, s) in [("this process", &mut here), ("the other process", &mut there)] {
        assert_eq!(sse_until_subject(s, "before").await, (vec!["before".to_owned()], false), "{name}");
    }
    api.ok(&b.token, "tokens.revoke", json!({"tokenId": tok["token"]["id"]})).await;
    emit_event(&api, Some(&b.id), "after").await;
    for (name, s) in [("this process", &mut here), ("the other process", &mut there)] {
        let (seen, ended) = tokio::time::timeout(Duration::from_secs(30), sse_until_quiet(s, Duration::from_secs(20))).await.unwrap();
        assert!(ended, "{name}: the revoked token's stream goes on: {seen:?}");
        assert_eq!(subjects(&seen), Vec::<String>::new(), "{name}: an event reached a revoked token");
        assert_eq!(seen.last().map(|(e, v)| (e.as_str(), v["code"].as_str())), Some(("end", Some("UNAUTHENTICATED"))), "{name}");
    }

    // A removed fleet binding narrows the stream to the tenant's events; removing the last ends it.
    let op_tenant = api.ok(&api.op, "tenants.list", json!({})).await["items"].as_array().unwrap().iter().find(|t| t["name"] == "operators").unwrap()["id"].as_str().unwrap().to_owned();
    let fw = api.ok(&api.op, "identities.create", json!({"name": "fleetwatch", "kind": "service"})).await;
    let viewer = api.ok(&api.op, "roleBindings.create", json!({"identityId": fw["id"], "role": "viewer", "scopeKind": "fleet"})).await;
    let member = api.ok(&api.op, "roleBindings.create", json!({"identityId": fw["id"], "role": "member", "scopeKind": "tenant"})).await;
    let fw_secret = api.ok(&api.op, "tokens.create", json!({"identityId": fw["id"]})).await["secret"].as_str().unwrap().to_owned();
    let mut s = watch(&fw_secret, &api.url).await;
    emit_event(&api, None, "fleet-1").await;
    emit_event(&api, Some(&op_tenant), "tenant-1").await;
    assert_eq!(sse_until_subject(&mut s, "tenant-1").await, (vec!["fleet-1".to_owned(), "tenant-1".to_owned()], false));
    api.ok(&api.op, "roleBindings.delete", json!({"roleBindingId": viewer["id"]})).await;
    emit_event(&api, None, "fleet-2").await;
    emit_event(&api, Some(&op_tenant), "tenant-2").await;
    // fleet-2 was emitted first: had it passed, it would come before tenant-2.
    assert_eq!(sse_until_subject(&mut s, "tenant-2").await, (vec!["tenant-2".to_owned()], false), "fleet events after the fleet binding went");
    api.ok(&api.op, "roleBindings.delete", json!({"roleBindingId": member["id"]})).await;
    emit_event(&api, Some(&op_tenant), "tenant-3").await;
    let (seen, ended) = sse_until_quiet(&mut s, Duration::from_secs(20)).await;
    assert!(ended && subjects(&seen).is_empty(), "{seen:?}");
    assert_eq!(seen.last().map(|(_, v)| v["code"].as_str()), Some(Some("PERMISSION_DENIED")));
    let r = api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&fw_secret).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 403, "a stream opened with no binding at all");

    // Expiry on the database's clock ends a stream too.
    let short = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"], "ttlSeconds": 60})).await["secret"].as_str().unwrap().to_owned();
    let mut s = watch(&short, &api.url).await;
    api.h.db().advance(Duration::from_secs(61)).await;
    let (seen, ended) = sse_until_quiet(&mut s, Duration::from_secs(20)).await;
    assert!(ended, "{seen:?}");
    assert_eq!(seen.last().map(|(_, v)| v["code"].as_str()), Some(Some("UNAUTHENTICATED")));
    let _ = stop2.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_watch_starts_from_now_across_a_txid_digit_rollover_and_a_bad_cursor_is_a_clear_400() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    // Events of old transactions whose ids have two and three digits: as text '99' sorts after
    // '100' and after every real txid, as numbers it is the other way round.
    let c = api.h.db().connect().await;
    let xmin: i64 = c.query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8", &[]).await.unwrap().get(0);
    assert!(xmin > 100, "{xmin}");
    for txid in ["99", "100"] {
        c.execute(
            "INSERT INTO outbox (txid, id, type, tenant_id, subject, data) VALUES ($1::text::xid8, 'evt_old' || $1, 'test.event', $2, 'old', '{}')",
            &[&txid, &b.id],
        )
        .await
        .unwrap();
    }
    let mut s = api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).send().await.unwrap();
    assert_eq!(s.status().as_u16(), 200);
    emit_event(&api, Some(&b.id), "new").await;
    assert_eq!(sse_until_subject(&mut s, "new").await.0, vec!["new".to_owned()], "a new watch replayed history");
    // A cursor past every event, one that is not a cursor, and a header that is not ASCII.
    let mut refused = 0;
    for (what, value) in [("from the future", reqwest::header::HeaderValue::from_static("99999999999-1")), ("not a cursor", reqwest::header::HeaderValue::from_static("yesterday")), ("not ASCII", reqwest::header::HeaderValue::from_bytes("1-ä".as_bytes()).unwrap()), ("signed", reqwest::header::HeaderValue::from_static("+1-1"))] {
        let r = api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).header("Last-Event-ID", value).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 400, "{what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["code"], "INVALID_ARGUMENT", "{what}: {v}");
        refused += 1;
    }
    assert_eq!(refused, 4);
}
