//! Tenant isolation on every method, refusals that teach nothing, bounded input, and the typed client.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typed_client_reserves_reads_lists_and_releases_and_a_refusal_carries_the_apis_stable_code() {
    use better_compute_client::{types, Client, Error};
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let client = Client::with_token(&api.url, &b.token).unwrap();
    let request = types::CreateReservation {
        tenant_id: None,
        pool_id: api.pool.clone(),
        gpu: types::GpuRequest { kind: types::GpuRequestKind::Gpu, model: "H100".into(), profile: None, count: 2 },
        vcpu: 4,
        memory_mib: 4096,
        disk_gib: 10,
        starts_at: None,
        ends_at: None,
        duration_s: Some(3600),
        node_selector: Default::default(),
        tolerations: vec![],
        idempotency_key: Some("typed-1".into()),
    };
    let placed = client.reservations_create(&request).await.unwrap().into_inner();
    assert_eq!(placed.state, types::ReservationViewState::Placed);
    assert_eq!((placed.atoms.len(), placed.node_id.as_deref()), (2, Some(api.node.as_str())));
    let again = client.reservations_create(&request).await.unwrap().into_inner();
    assert_eq!(again.id, placed.id, "the same key answers the first reservation");
    let got = client.reservations_get(&types::ReservationRef { tenant_id: None, reservation_id: placed.id.clone() }).await.unwrap().into_inner();
    assert_eq!((got.id.as_str(), got.vcpu, got.gpu.count), (placed.id.as_str(), 4, 2));
    let page = client
        .reservations_list(&types::ListReservations { tenant_id: None, state: None, page_size: Some(10), page_token: None })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.items.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), [placed.id.as_str()]);
    let released = client.reservations_release(&types::ReservationRef { tenant_id: None, reservation_id: placed.id.clone() }).await.unwrap().into_inner();
    assert_eq!(released.state, types::ReservationViewState::Released);
    // A refusal is the API's error body, with its stable code.
    match client.reservations_get(&types::ReservationRef { tenant_id: None, reservation_id: "res_nope".into() }).await {
        Err(Error::ErrorResponse(e)) => {
            assert_eq!((e.status().as_u16(), e.code), (404, types::ErrorCode::NotFound), "{}", e.message);
        }
        other => panic!("expected NOT_FOUND, got {other:?}"),
    }
    let bad = Client::with_token(&api.url, "bct_not_a_token").unwrap();
    match bad.nodes_get(&types::NodeRef { node_id: api.node.clone() }).await {
        Err(Error::ErrorResponse(e)) => assert_eq!(e.code, types::ErrorCode::Unauthenticated),
        other => panic!("expected UNAUTHENTICATED, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_can_neither_read_nor_change_nor_learn_of_anything_of_a_tenant() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let c = api.tenant("tenant-c").await;
    // Tenant B's things: a reservation, an identity with a token and a binding; a command the
    // operator ran on the fleet's node.
    let res = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("b-1"))).await;
    assert_eq!(res["state"], "placed", "{res}");
    let idn = api.ok(&b.token, "identities.create", json!({"name": "robot", "kind": "service"})).await;
    let tok = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    let rb = api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "tenant-viewer", "scopeKind": "tenant"})).await;
    // A scopeId where the scope has none, or one too long to be an id, is refused, not ignored.
    for (kind, scope_id) in [("tenant", "x".repeat(2000)), ("fleet", "f".into()), ("pool", "p".repeat(2000))] {
        let (_, v) = api.call(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "tenant-viewer", "scopeKind": kind, "scopeId": scope_id})).await;
        assert_eq!(v["code"], "INVALID_ARGUMENT", "{kind}: {v}");
    }
    let cmd = api.ok(&api.op, "commands.run", json!({"nodeId": api.node, "kind": "diag.nvml", "idempotencyKey": "op-1"})).await;
    let wh = api.ok(&b.token, "webhooks.create", json!({"url": "https://example.com/b", "eventTypes": ["reservation.placed"]})).await;
    let dlv = api.ok(&b.token, "webhooks.test", json!({"webhookId": wh["webhook"]["id"]})).await;
    let site = api.ok(&api.op, "pools.get", json!({"poolId": api.pool})).await["siteId"].as_str().unwrap().to_owned();
    // An operator's fleet-wide workflow over the pool (its selector matches no node, so it changes nothing).
    let wf = api.ok(&api.op, "workflows.start", json!({"definition": "node.maintenance", "target": {"poolId": api.pool, "labels": {"rack": "none"}}, "params": {"reason": "r"}, "idempotencyKey": "op-wf"})).await;
    let vms = api.vps_host().await;
    let ins = api.ok(&b.token, "instances.create", instance(&vms, "b-vm")).await;
    assert_eq!(ins["state"], "requested", "{ins}");
    let real = [
        ("ten", b.id.clone()),
        ("idn", idn["id"].as_str().unwrap().to_owned()),
        ("tok", tok["token"]["id"].as_str().unwrap().to_owned()),
        ("rb", rb["id"].as_str().unwrap().to_owned()),
        ("res", res["id"].as_str().unwrap().to_owned()),
        ("cmd", cmd["id"].as_str().unwrap().to_owned()),
        ("site", site),
        ("pool", api.pool.clone()),
        ("node", api.node.clone()),
        ("gpu", "GPU-0".to_owned()),
        ("wh", wh["webhook"]["id"].as_str().unwrap().to_owned()),
        ("dlv", dlv["id"].as_str().unwrap().to_owned()),
        ("wf", wf["id"].as_str().unwrap().to_owned()),
        ("ins", ins["id"].as_str().unwrap().to_owned()),
        ("aud", api.h.db().client().await.query_one("SELECT id FROM audit_entries WHERE tenant_id = $1 LIMIT 1", &[&b.id]).await.unwrap().get(0)),
    ];
    // Ids of the same kinds that do not exist.
    let fake: Vec<(&str, String)> = real
        .iter()
        .map(|(k, v)| (*k, if *k == "gpu" { "GPU-nope".to_owned() } else { format!("{}_01aaaaaaaaaaaaaaaaaaaaaaaa", v.split('_').next().unwrap()) }))
        .collect();
    let before = (api.count("reservations").await, api.count("identities").await, api.count("tokens").await, api.count("role_bindings").await, api.count("webhooks").await, api.count("webhook_deliveries").await);
    let before_nodes = api.ok(&api.op, "nodes.get", json!({"nodeId": api.node})).await;
    // The POST methods; GET /v1/watch has tests of its own (watch streams end with their grant).
    let methods: Vec<String> = api.openapi().await["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, item)| item.get("post").is_some())
        .map(|(p, _)| p.trim_start_matches("/v1/").to_owned())
        .collect();
    assert!(methods.len() >= 40, "{methods:?}");
    let bodies = bodies();
    for m in &methods {
        // Every tenant reads the same role list, image catalogue and audit checkpoints.
        assert!(["roles.list", "vpsImages.list", "audit.checkpoints.list"].contains(&m.as_str()) || bodies.iter().any(|(n, _)| n == m), "the isolation sweep misses {m}");
    }
    for (method, template) in &bodies {
        let (status, v) = api.call(&c.token, method, fill(template, &real)).await;
        assert!(status >= 400, "{method}: tenant C succeeded on tenant B's or the fleet's resource: {v}");
        let (fake_status, fake_v) = api.call(&c.token, method, fill(template, &fake)).await;
        // Not yours and does not exist look the same (ids aside).
        let mut msg = v["message"].as_str().unwrap_or("").to_owned();
        for ((_, r), (_, f)) in real.iter().zip(&fake) {
            msg = msg.replace(r.as_str(), f.as_str());
        }
        assert_eq!((status, v["code"].clone(), msg), (fake_status, fake_v["code"].clone(), fake_v["message"].as_str().unwrap_or("").to_owned()), "{method}: {v} vs {fake_v}");
    }
    let after = (api.count("reservations").await, api.count("identities").await, api.count("tokens").await, api.count("role_bindings").await, api.count("webhooks").await, api.count("webhook_deliveries").await);
    assert_eq!(before, after, "tenant C's attempts wrote something");
    assert_eq!(api.ok(&api.op, "nodes.get", json!({"nodeId": api.node})).await["version"], before_nodes["version"]);
    // B's reservation is untouched and B still sees it.
    assert_eq!(api.ok(&b.token, "reservations.get", json!({"reservationId": res["id"]})).await["state"], "placed");
    // C's own view has none of B's.
    assert_eq!(api.ok(&c.token, "reservations.list", json!({})).await["items"], json!([]));
    let _ = c.identity;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_every_method_is_a_clear_4xx_with_a_stable_code_and_writes_nothing() {
    use better_compute_api::rate_limit::{RateLimiter, RateLimits};
    // Seven bad bodies for each of the methods exceed a token's rate: this test is about input.
    let api = Api::start_with(|s| s.set_rate_limiter(RateLimiter::new(RateLimits::NONE))).await;
    let doc = api.openapi().await;
    let tables = ["tenants", "identities", "tokens", "role_bindings", "sites", "pools", "reservations", "commands", "join_tokens", "quota_usage", "outbox"];
    let mut before = Vec::new();
    for t in tables {
        before.push(api.count(t).await);
    }
    for (path, item) in doc["paths"].as_object().unwrap().iter().filter(|(_, item)| item.get("post").is_some()) {
        let m = path.trim_start_matches("/v1/");
        let schema_ref = item["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].as_str().unwrap();
        let schema = doc.pointer(schema_ref.trim_start_matches('#')).unwrap();
        let required: Vec<&str> = schema["required"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
        let mut cases: Vec<(&str, String)> = vec![
            ("unknown field", json!({"surelyNotAField": 1}).to_string()),
            ("malformed JSON", "{\"a\": ".to_owned()),
            ("not an object", "[1, 2]".to_owned()),
            ("an empty body", String::new()),
        ];
        if let Some(field) = required.first() {
            cases.push(("missing required", "{}".to_owned()));
            cases.push(("wrong type", json!({*field: {"nested": [true]}}).to_string()));
        }
        for (what, body) in cases {
            let (s, v) = api.raw(&api.op, m, body).await;
            assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{m}, {what}: {v}");
            assert!(!v["message"].as_str().unwrap_or("").is_empty(), "{m}, {what}: no message");
        }
        // A declared length over the limit is answered before any of the body is sent.
        let head = format!("Authorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", api.op, better_compute_api::MAX_BODY_BYTES + 1);
        let (s, v) = api.http_exchange("POST", &format!("/v1/{m}"), &head).await;
        assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{m}, oversized: {v}");
    }
    // Without a token, or with a wrong one: 401, for any method.
    let r = api.http.post(format!("{}/v1/nodes.get", api.url)).body("{}").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let (s, v) = api.call("bct_forged", "nodes.get", json!({"nodeId": api.node})).await;
    assert_eq!((s, v["code"].as_str()), (401, Some("UNAUTHENTICATED")));
    let (s, v) = api.call(&api.op, "nodes.explode", json!({})).await;
    assert_eq!((s, v["code"].as_str()), (404, Some("NOT_FOUND")));
    // The HTTP layer's own refusals are JSON with a stable code too.
    let auth = format!("Authorization: Bearer {}\r\n", api.op);
    for (verb, path, headers, want, code) in [
        ("GET", "/v1/nodes.get", auth.clone(), 405, "UNSUPPORTED"),
        ("PUT", "/v1/watch", auth.clone(), 405, "UNSUPPORTED"),
        ("POST", "/v1/roles.list", format!("{auth}{auth}Content-Length: 2\r\n"), 400, "INVALID_ARGUMENT"),
        ("POST", "/v1/roles.list", format!("{auth}Content-Type: application/jsonp\r\nContent-Length: 0\r\n"), 400, "INVALID_ARGUMENT"),
        ("POST", "/v1/roles.list", format!("{auth}Content-Type: text/plain\r\nContent-Length: 0\r\n"), 400, "INVALID_ARGUMENT"),
    ] {
        let (s, v) = api.http_exchange(verb, path, &headers).await;
        assert_eq!((s, v["code"].as_str()), (want, Some(code)), "{verb} {path} {headers:?}: {v}");
    }
    let r = api.http.post(format!("{}/v1/roles.list", api.url)).bearer_auth(&api.op).header("content-type", "application/json; charset=utf-8").body("{}").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "a charset parameter is still JSON");
    for (i, t) in tables.iter().enumerate() {
        assert_eq!(api.count(t).await, before[i], "bad input wrote to {t}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_the_permission_learns_nothing_of_the_input_not_even_a_missing_idempotency_key() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let idn = api.ok(&b.token, "identities.create", json!({"name": "nobody", "kind": "service"})).await;
    let bare = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await["secret"].as_str().unwrap().to_owned();
    let before = (api.count("commands").await, api.count("idempotency_keys").await);
    let mut refused = 0;
    for (token, m, body) in [
        (&bare, "commands.run", json!({"nodeId": api.node, "kind": "diag.nvml"})),
        (&bare, "commands.run", json!({"nodeId": api.node, "kind": "diag.nvml", "idempotencyKey": "has space"})),
        (&b.token, "commands.run", json!({"nodeId": api.node, "kind": "diag.nvml"})),
        (&bare, "commands.cancel", json!({"nodeId": api.node, "commandId": "cmd_x"})),
        (&bare, "commands.run", json!({"nodeId": "node_hidden", "kind": "diag.nvml", "idempotencyKey": "k"})),
        (&bare, "reservations.create", reservation(&api.pool, None)),
        (&bare, "reservations.extend", json!({"reservationId": "res_x", "endsAt": "2031-01-01T00:00:00Z", "idempotencyKey": ""})),
    ] {
        let (s, v) = api.call(token, m, body.clone()).await;
        assert!(matches!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")) | (404, Some("NOT_FOUND"))), "{m} {body}: {s} {v}");
        refused += 1;
    }
    assert_eq!(refused, 7);
    assert_eq!((api.count("commands").await, api.count("idempotency_keys").await), before, "a refused request wrote something");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stored_string_and_amount_is_bounded_and_no_sum_can_overflow() {
    use better_compute_core::bounds;
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let wh = api.ok(&b.token, "webhooks.create", json!({"url": "https://example.com/b"})).await;
    let tables = ["reservations", "commands", "webhooks", "outbox", "quota_usage"];
    let mut before = Vec::new();
    for t in tables {
        before.push(api.count(t).await);
    }
    let res = |patch: Value| {
        let mut r = reservation(&api.pool, Some("bounded"));
        for (k, v) in patch.as_object().unwrap() {
            r[k] = v.clone();
        }
        r
    };
    let long = |n: usize| "x".repeat(n);
    let selector: serde_json::Map<String, Value> = (0..=bounds::SELECTOR_ENTRIES).map(|i| (format!("k{i}"), json!("v"))).collect();
    let cases: Vec<(&str, &str, Value)> = vec![
        ("memoryMib 2^63-1", "reservations.create", res(json!({"memoryMib": i64::MAX}))),
        ("diskGib 2^63-1", "reservations.create", res(json!({"diskGib": i64::MAX}))),
        ("memoryMib past its bound", "reservations.create", res(json!({"memoryMib": bounds::MAX_MEMORY_MIB + 1}))),
        ("vcpu 2^31-1", "reservations.create", res(json!({"vcpu": i32::MAX}))),
        ("a long gpu.model", "reservations.create", res(json!({"gpu": {"kind": "gpu", "model": long(bounds::VALUE_CHARS + 1), "count": 1}}))),
        ("a selector of 33", "reservations.create", res(json!({"nodeSelector": selector}))),
        ("a long selector value", "reservations.create", res(json!({"nodeSelector": {"k": long(bounds::VALUE_CHARS + 1)}}))),
        ("a long toleration key", "reservations.create", res(json!({"tolerations": [{"key": long(bounds::KEY_CHARS + 1)}]}))),
        ("quota 2^63-1", "quotas.set", json!({"tenantId": b.id, "resource": "memory_mib", "max": i64::MAX})),
        ("a long taint value", "nodes.taint", json!({"nodeId": api.node, "key": "k", "value": long(bounds::VALUE_CHARS + 1)})),
        ("a long quarantine reason", "devices.quarantine", json!({"deviceId": "GPU-0", "reason": long(bounds::NOTE_CHARS + 1)})),
        ("a long drain reason", "nodes.drain", json!({"nodeId": api.node, "reason": long(bounds::NOTE_CHARS + 1)})),
        ("a drain deadline that is not RFC 3339", "nodes.drain", json!({"nodeId": api.node, "reason": "r", "mode": "evict", "deadline": "now"})),
        ("a long label value", "nodes.update", json!({"nodeId": api.node, "labels": {"k": long(bounds::VALUE_CHARS + 1)}})),
        ("a label of 33", "nodes.update", json!({"nodeId": api.node, "labels": selector})),
        ("a long label selector key", "nodes.list", json!({"labelSelector": long(bounds::KEY_CHARS + 1)})),
        ("a long webhook description", "webhooks.create", json!({"url": "https://example.com/c", "description": long(bounds::NOTE_CHARS + 1)})),
        ("a long webhook description, updated", "webhooks.update", json!({"webhookId": wh["webhook"]["id"], "description": long(900 * 1024)})),
        ("a large command payload", "commands.run", json!({"nodeId": api.node, "kind": "logs.collect", "payload": {"pad": long(bounds::COMMAND_PAYLOAD_BYTES)}, "idempotencyKey": "big"})),
    ];
    let mut refused = 0;
    for (what, m, body) in &cases {
        let token = if m.starts_with("reservations") || m.starts_with("webhooks") { &b.token } else { &api.op };
        let (s, v) = api.call(token, m, body.clone()).await;
        assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{what}: {v}");
        assert!(v.to_string().len() < 2048, "{what}: the answer echoes the input: {} bytes", v.to_string().len());
        refused += 1;
    }
    assert_eq!(refused, cases.len());
    for (i, t) in tables.iter().enumerate() {
        assert_eq!(api.count(t).await, before[i], "a refused value wrote to {t}");
    }
    // At their bounds, the amounts are taken, and the sums stay exact.
    api.ok(&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "memory_mib", "max": bounds::MAX_QUOTA})).await;
    let (s, v) = api.call(&b.token, "reservations.create", res(json!({"memoryMib": bounds::MAX_MEMORY_MIB}))).await;
    assert!(s == 200 || v["code"] == "FAILED_PRECONDITION", "{v}");
    // An id of 10,000 characters is not repeated back.
    let (s, v) = api.call(&b.token, "reservations.get", json!({"reservationId": long(10_000)})).await;
    assert_eq!(s, 404);
    assert!(v["message"].as_str().unwrap().chars().count() < 200, "{v}");
}
