//! The HTTP API against a real PostgreSQL: tenant isolation on every method, token revocation,
//! idempotency through HTTP, and bad input on every method.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use better_compute_api::ApiState;
use better_compute_iam::Iam;
use better_compute_nodes::inventory::{self, NewGpu, NewNode, NewPool};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::harness::Harness;
use serde_json::{json, Value};

struct Api {
    h: Harness,
    url: String,
    http: reqwest::Client,
    op: String,
    pool: String,
    node: String,
    _stop: tokio::sync::watch::Sender<bool>,
}

struct Tenant {
    id: String,
    token: String,
    identity: String,
}

impl Api {
    async fn start() -> Api {
        Api::start_with(|_| {}).await
    }

    /// [`Api::start`], with the server's state adjusted first.
    async fn start_with(adjust: impl FnOnce(&mut ApiState)) -> Api {
        Api::start_serving(adjust, better_compute_api::http::HttpSettings::default()).await
    }

    /// [`Api::start_with`], with other connection limits.
    async fn start_serving(adjust: impl FnOnce(&mut ApiState), http: better_compute_api::http::HttpSettings) -> Api {
        let h = Harness::new(vec![
            Arc::new(better_compute_nodes::NodesModule),
            Arc::new(better_compute_capacity::CapacityModule),
            Arc::new(better_compute_vps::VpsModule),
            Arc::new(better_compute_iam::IamModule),
            Arc::new(better_compute_events::EventsModule::default()),
            Arc::new(better_compute_audit::AuditModule),
            Arc::new(better_compute_workflows::WorkflowsModule),
        ])
        .await;
        let mut c = h.db().connect().await;
        let tx = c.transaction().await.unwrap();
        let op = better_compute_iam::bootstrap::bootstrap(&tx, &h.registry().permissions(), "operators", "admin").await.unwrap();
        let site = inventory::create_site(&tx, "s").await.unwrap();
        let pool = inventory::create_pool(
            &tx,
            &NewPool { site_id: site, name: "p".into(), kind: "bare-metal".into(), vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
        )
        .await
        .unwrap();
        let gpus = (0..4).map(|i| NewGpu { uuid: format!("GPU-{i}"), model: "H100".into(), memory_mib: 81_920, mode: GpuMode::Exclusive }).collect();
        let node = inventory::register_node(
            &tx,
            &NewNode { pool_id: pool.clone(), name: "n".into(), labels: Default::default(), vcpu: 64, memory_mib: 1 << 20, disk_gib: 1000, gpus },
        )
        .await
        .unwrap();
        inventory::adopt(&tx, &node).await.unwrap();
        inventory::report_observed_generation(&tx, &node, 1).await.unwrap();
        better_compute_capacity::inventory::refresh_nodes(&tx, std::slice::from_ref(&node)).await.unwrap();
        tx.commit().await.unwrap();
        let pg = better_compute_db::pool::connect_pool(&h.db().pgbouncer_connection_string().await, 8).unwrap();
        let iam = Arc::new(Iam::new(pg.clone()));
        iam.start_tail().await.unwrap();
        let mut state = ApiState::new(pg, iam, h.registry().clone());
        adjust(Arc::get_mut(&mut state).expect("not shared yet"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(better_compute_api::serve_with(listener, state, http, async move {
            let _ = stopped.wait_for(|s| *s).await;
        }));
        Api { h, url, http: better_compute_client::http().build().unwrap(), op: op.token.secret, pool, node, _stop: stop }
    }

    async fn raw(&self, token: &str, method: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/v1/{method}", self.url))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        assert!(r.headers().contains_key("x-request-id"), "{method}: no request id");
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// One request written by hand on a fresh connection (headers only, no body): the status and
    /// the JSON body of the answer, so refusals of the HTTP layer itself can be checked.
    async fn http_exchange(&self, verb: &str, path: &str, headers: &str) -> (u16, Value) {
        self.raw_exchange(format!("{verb} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n").as_bytes()).await
    }

    /// Writes `request` on a fresh connection and reads the answer until the server closes it.
    async fn raw_exchange(&self, request: &[u8]) -> (u16, Value) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(self.url.trim_start_matches("http://")).await.unwrap();
        c.write_all(request).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), c.read_to_end(&mut out)).await.expect("no answer").unwrap();
        let text = String::from_utf8_lossy(&out);
        assert!(text.is_empty() || text.to_ascii_lowercase().contains("\r\nx-request-id: req_"), "an answer without a request id: {text}");
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        // A body may come chunked: take the JSON object inside.
        let json = body.find('{').zip(body.rfind('}')).map(|(a, b)| &body[a..=b]).unwrap_or("null");
        (status, serde_json::from_str(json).unwrap_or(Value::Null))
    }

    async fn call(&self, token: &str, method: &str, body: Value) -> (u16, Value) {
        self.raw(token, method, body.to_string()).await
    }

    async fn ok(&self, token: &str, method: &str, body: Value) -> Value {
        let (s, v) = self.call(token, method, body.clone()).await;
        assert_eq!(s, 200, "{method} {body}: {v}");
        v
    }

    /// A vps-host pool with one adopted node of two GPUs: its pool id.
    async fn vps_host(&self) -> String {
        let mut c = self.h.db().connect().await;
        let tx = c.transaction().await.unwrap();
        let site = inventory::create_site(&tx, "vms").await.unwrap();
        let kind = "vps-host".into();
        let pool = inventory::create_pool(&tx, &NewPool { site_id: site, name: "vms".into(), kind, vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None }).await.unwrap();
        let gpus = (0..2).map(|i| NewGpu { uuid: format!("GPU-V{i}"), model: "H100".into(), memory_mib: 81_920, mode: GpuMode::Exclusive }).collect();
        let node = NewNode { pool_id: pool.clone(), name: "v".into(), labels: Default::default(), vcpu: 64, memory_mib: 1 << 20, disk_gib: 1000, gpus };
        let node = inventory::register_node(&tx, &node).await.unwrap();
        inventory::adopt(&tx, &node).await.unwrap();
        inventory::report_observed_generation(&tx, &node, 1).await.unwrap();
        better_compute_capacity::inventory::refresh_nodes(&tx, std::slice::from_ref(&node)).await.unwrap();
        tx.commit().await.unwrap();
        pool
    }

    /// A tenant made by the operator, with a quota.
    async fn tenant(&self, name: &str) -> Tenant {
        let t = self.ok(&self.op, "tenants.create", json!({"name": name})).await;
        let id = t["tenant"]["id"].as_str().unwrap().to_owned();
        for (resource, max) in [("gpus", 8), ("vcpu", 64), ("memory_mib", 1 << 20), ("disk_gib", 1000)] {
            self.ok(&self.op, "quotas.set", json!({"tenantId": id, "resource": resource, "max": max})).await;
        }
        Tenant { id, token: t["token"]["secret"].as_str().unwrap().to_owned(), identity: t["identity"]["id"].as_str().unwrap().to_owned() }
    }

    async fn openapi(&self) -> Value {
        self.http.get(format!("{}/v1/openapi.json", self.url)).send().await.unwrap().json().await.unwrap()
    }

    async fn count(&self, table: &str) -> i64 {
        self.h.db().connect().await.query_one(&format!("SELECT count(*) FROM {table}"), &[]).await.unwrap().get(0)
    }
}

fn reservation(pool: &str, key: Option<&str>) -> Value {
    let mut v = json!({"poolId": pool, "gpu": {"kind": "gpu", "model": "H100", "count": 1}, "vcpu": 2, "durationS": 3600});
    if let Some(k) = key {
        v["idempotencyKey"] = json!(k);
    }
    v
}

/// Replaces every `{name}` in a body template.
fn fill(template: &Value, ids: &[(&str, String)]) -> Value {
    let mut s = template.to_string();
    for (k, v) in ids {
        s = s.replace(&format!("{{{k}}}"), v);
    }
    serde_json::from_str(&s).unwrap()
}

/// A body for every method, naming tenant B's resources (or the fleet's, which C may not touch).
fn bodies() -> Vec<(&'static str, Value)> {
    vec![
        ("tenants.get", json!({"tenantId": "{ten}"})),
        ("tenants.list", json!({})),
        ("tenants.create", json!({"name": "intruder"})),
        ("identities.create", json!({"tenantId": "{ten}", "name": "x", "kind": "person"})),
        ("identities.get", json!({"tenantId": "{ten}", "identityId": "{idn}"})),
        ("identities.list", json!({"tenantId": "{ten}"})),
        ("tokens.create", json!({"tenantId": "{ten}", "identityId": "{idn}"})),
        ("tokens.list", json!({"tenantId": "{ten}"})),
        ("tokens.revoke", json!({"tenantId": "{ten}", "tokenId": "{tok}"})),
        ("roleBindings.create", json!({"tenantId": "{ten}", "identityId": "{idn}", "role": "tenant-viewer", "scopeKind": "tenant"})),
        ("roleBindings.list", json!({"tenantId": "{ten}"})),
        ("roleBindings.delete", json!({"tenantId": "{ten}", "roleBindingId": "{rb}"})),
        ("sites.create", json!({"name": "intruder"})),
        ("sites.get", json!({"siteId": "{site}"})),
        ("sites.list", json!({})),
        ("sites.boot", json!({"siteId": "{site}"})),
        ("sites.update", json!({"siteId": "{site}", "bootAdmitPerS": 5})),
        ("pools.create", json!({"siteId": "{site}", "name": "intruder", "kind": "bare-metal"})),
        ("pools.get", json!({"poolId": "{pool}"})),
        ("pools.list", json!({"siteId": "{site}"})),
        ("nodes.get", json!({"nodeId": "{node}"})),
        ("nodes.list", json!({"poolId": "{pool}"})),
        ("nodes.cordon", json!({"nodeId": "{node}"})),
        ("nodes.uncordon", json!({"nodeId": "{node}"})),
        ("nodes.taint", json!({"nodeId": "{node}", "key": "k", "value": "v"})),
        ("nodes.untaint", json!({"nodeId": "{node}", "key": "k"})),
        ("nodes.createJoinToken", json!({"poolId": "{pool}"})),
        ("nodes.update", json!({"nodeId": "{node}", "labels": {"rack": "r9"}})),
        ("nodes.describe", json!({"nodeId": "{node}"})),
        ("nodes.drain", json!({"nodeId": "{node}", "reason": "x", "mode": "evict"})),
        ("nodes.undrain", json!({"nodeId": "{node}"})),
        ("nodes.retire", json!({"nodeId": "{node}"})),
        ("drains.list", json!({"poolId": "{pool}"})),
        ("jobs.list", json!({})),
        ("reservations.availability", json!({"tenantId": "{ten}", "poolId": "{pool}", "gpu": {"kind": "gpu", "model": "H100", "count": 1}, "durationS": 3600})),
        ("inventory.findings", json!({"poolId": "{pool}"})),
        ("pools.update", json!({"poolId": "{pool}", "maxUnavailable": "10%"})),
        ("pools.closeHealthCircuit", json!({"poolId": "{pool}"})),
        ("devices.get", json!({"deviceId": "{gpu}"})),
        ("devices.list", json!({"nodeId": "{node}"})),
        ("devices.quarantine", json!({"deviceId": "{gpu}", "reason": "x"})),
        ("devices.releaseQuarantine", json!({"deviceId": "{gpu}"})),
        ("quotas.set", json!({"tenantId": "{ten}", "resource": "gpus", "max": 100})),
        ("quotas.get", json!({"tenantId": "{ten}"})),
        ("reservations.create", json!({"tenantId": "{ten}", "poolId": "{pool}", "gpu": {"kind": "gpu", "model": "H100", "count": 1}, "durationS": 60, "idempotencyKey": "k"})),
        ("reservations.get", json!({"tenantId": "{ten}", "reservationId": "{res}"})),
        ("reservations.list", json!({"tenantId": "{ten}"})),
        ("reservations.extend", json!({"tenantId": "{ten}", "reservationId": "{res}", "endsAt": "2031-01-01T00:00:00Z", "idempotencyKey": "k"})),
        ("reservations.release", json!({"tenantId": "{ten}", "reservationId": "{res}"})),
        ("commands.run", json!({"tenantId": "{ten}", "nodeId": "{node}", "kind": "diag.nvml", "idempotencyKey": "k"})),
        ("commands.get", json!({"tenantId": "{ten}", "nodeId": "{node}", "commandId": "{cmd}"})),
        ("commands.list", json!({"tenantId": "{ten}", "nodeId": "{node}"})),
        ("commands.cancel", json!({"tenantId": "{ten}", "nodeId": "{node}", "commandId": "{cmd}"})),
        ("webhooks.create", json!({"tenantId": "{ten}", "url": "https://example.com/hook"})),
        ("webhooks.get", json!({"tenantId": "{ten}", "webhookId": "{wh}"})),
        ("webhooks.list", json!({"tenantId": "{ten}"})),
        ("webhooks.update", json!({"tenantId": "{ten}", "webhookId": "{wh}", "description": "mine now"})),
        ("webhooks.delete", json!({"tenantId": "{ten}", "webhookId": "{wh}"})),
        ("webhooks.rotateSecret", json!({"tenantId": "{ten}", "webhookId": "{wh}"})),
        ("webhooks.test", json!({"tenantId": "{ten}", "webhookId": "{wh}"})),
        ("webhooks.deadLetters.list", json!({"tenantId": "{ten}"})),
        ("webhooks.deadLetters.replay", json!({"tenantId": "{ten}", "deliveryId": "{dlv}"})),
        ("usage.list", json!({"tenantId": "{ten}", "from": "2020-01-01T00:00:00Z", "to": "2040-01-01T00:00:00Z", "groupBy": "reservation"})),
        ("usage.export", json!({"tenantId": "{ten}", "from": "2020-01-01T00:00:00Z", "to": "2040-01-01T00:00:00Z"})),
        ("instanceUsage.list", json!({"tenantId": "{ten}", "from": "2020-01-01T00:00:00Z", "to": "2040-01-01T00:00:00Z", "groupBy": "flavour"})),
        ("instanceUsage.export", json!({"tenantId": "{ten}", "from": "2020-01-01T00:00:00Z", "to": "2040-01-01T00:00:00Z"})),
        ("workflows.start", json!({"tenantId": "{ten}", "definition": "node.maintenance", "target": {"nodeId": "{node}"}, "params": {"reason": "r"}, "idempotencyKey": "k"})),
        ("workflows.get", json!({"tenantId": "{ten}", "workflowId": "{wf}"})),
        ("workflows.list", json!({"tenantId": "{ten}", "nodeId": "{node}"})),
        ("workflows.cancel", json!({"tenantId": "{ten}", "workflowId": "{wf}"})),
        ("workflows.resume", json!({"tenantId": "{ten}", "workflowId": "{wf}"})),
        ("instances.create", json!({"tenantId": "{ten}", "reservationId": "{res}", "image": "debian-12", "sshPublicKeys": ["ssh-ed25519 AAAA me"], "idempotencyKey": "k"})),
        ("instances.get", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("instances.list", json!({"tenantId": "{ten}"})),
        ("instances.console", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("instances.stop", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("instances.start", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("instances.reboot", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("instances.delete", json!({"tenantId": "{ten}", "instanceId": "{ins}"})),
        ("vpsHosts.list", json!({})),
        ("vpsImages.set", json!({"name": "debian-12", "url": "https://images.example/d.qcow2", "sha256": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"})),
        ("vpsImages.delete", json!({"name": "debian-12"})),
        ("audit.list", json!({"tenantId": "{ten}"})),
        ("audit.get", json!({"tenantId": "{ten}", "entryId": "{aud}"})),
        ("audit.proof", json!({"tenantId": "{ten}", "entryId": "{aud}", "treeSize": 1})),
    ]
}

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
async fn usage_list_sums_a_tenants_own_windows_and_every_tenants_only_at_fleet_scope() {
    // One window per page, so the streamed export walks several pages.
    let api = Api::start_with(|s| s.usage_export_page_rows = 1).await;
    let b = api.tenant("tenant-b").await;
    let c = api.tenant("tenant-c").await;
    better_compute_capacity::usage::set_window_s(&api.h.db().connect().await, 60).await.unwrap();
    let res = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("u-1"))).await;
    assert_eq!(res["state"], "placed", "{res}");
    // The placement wakes the pool's metering, which arms itself for each window's end.
    let c0 = api.h.db().connect().await;
    for _ in 0..2000 {
        let settled: bool = c0.query_one("SELECT coalesce(max(txid) < pg_snapshot_xmin(pg_current_snapshot()), true) FROM outbox", &[]).await.unwrap().get(0);
        if settled {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    api.h.job("event-subscribers").drain(20).await;
    api.h.job("capacity.usage").drain(10).await;
    for _ in 0..3 {
        api.h.db().advance(Duration::from_secs(61)).await;
        api.h.job("capacity.usage").drain(10).await;
    }
    let body = json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "reservation"});
    let mine = api.ok(&b.token, "usage.list", body.clone()).await;
    let items = mine["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{mine}");
    assert_eq!((items[0]["group"].as_str(), mine["windowS"].as_i64()), (res["id"].as_str(), Some(60)));
    assert!(items[0]["windows"].as_i64().unwrap() >= 2 && items[0]["atomSeconds"].as_f64().unwrap() > 0.0, "{mine}");
    // Another tenant sees none of it, and cannot ask for every tenant's.
    assert_eq!(api.ok(&c.token, "usage.list", body.clone()).await["items"], json!([]));
    let mut all = body.clone();
    all["allTenants"] = json!(true);
    let (s, v) = api.call(&c.token, "usage.list", all.clone()).await;
    assert!(s == 403 || s == 404, "{v}");
    // An operator with fleet scope sums every tenant's, by day.
    all["groupBy"] = json!("day");
    let fleet = api.ok(&api.op, "usage.list", all).await;
    assert_eq!(fleet["items"].as_array().unwrap().len(), 1, "{fleet}");
    assert_eq!(fleet["items"][0]["tenantId"], b.id.as_str());
    // The export: every window, one by one, a page at a time; the sum is the list's.
    let mut keys = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut q = json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "pageSize": 1});
        if let Some(t) = &token {
            q["pageToken"] = json!(t);
        }
        let page = api.ok(&b.token, "usage.export", q).await;
        keys.extend(page["items"].as_array().unwrap().iter().map(|w| w["key"].as_str().unwrap().to_owned()));
        match page["nextPageToken"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    assert_eq!(keys.len() as i64, items[0]["windows"].as_i64().unwrap());
    assert!(keys.windows(2).all(|w| w[0] < w[1]) && keys[0].starts_with(&format!("cmp:{}:", res["id"].as_str().unwrap())), "{keys:?}");
    // The streamed export: the same rows, whole, as CSV (a header first) or JSON lines.
    let stream = async |token: &str, query: &str| {
        let r = api.http.get(format!("{}/v1/usage.export?{query}", api.url)).bearer_auth(token).send().await.unwrap();
        let ct = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
        (r.status().as_u16(), ct, r.text().await.unwrap())
    };
    let period = "from=2000-01-01T00:00:00Z&to=2100-01-01T00:00:00Z";
    let (s, ct, csv) = stream(&b.token, period).await;
    assert_eq!((s, ct.as_str()), (200, "text/csv; charset=utf-8"), "{csv}");
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), keys.len() + 1, "{csv}");
    assert!(lines[0].starts_with("key,reservationId,tenantId,"), "{csv}");
    assert_eq!(lines[1..].iter().map(|l| l.split(',').next().unwrap()).collect::<Vec<_>>(), keys, "{csv}");
    assert!(lines[1..].iter().all(|l| l.split(',').nth(2) == Some(b.id.as_str())), "{csv}");
    let (s, ct, jsonl) = stream(&b.token, &format!("{period}&format=jsonl&after={}", keys[0])).await;
    assert_eq!((s, ct.as_str()), (200, "application/x-ndjson"), "{jsonl}");
    let resumed: Vec<String> = jsonl.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["key"].as_str().unwrap().to_owned()).collect();
    assert_eq!(resumed, keys[1..], "resuming after the first key streams the rest");
    // Another tenant streams nothing of it, and every tenant's only at fleet scope.
    let (s, _, other) = stream(&c.token, period).await;
    assert_eq!((s, other.lines().count()), (200, 1), "{other}");
    let (s, _, refused) = stream(&c.token, &format!("{period}&allTenants=true")).await;
    assert!(s == 403 || s == 404, "{refused}");
    let (s, _, fleet) = stream(&api.op, &format!("{period}&allTenants=true&format=jsonl")).await;
    assert_eq!((s, fleet.lines().count()), (200, keys.len()), "{fleet}");
    // Bad input is a JSON error before any row.
    for bad in ["from=yesterday&to=2100-01-01T00:00:00Z", "to=2100-01-01T00:00:00Z", &format!("{period}&format=xml"), &format!("{period}&limit=5")] {
        let (s, ct, body) = stream(&b.token, bad).await;
        assert_eq!((s, ct.as_str()), (400, "application/json"), "{bad}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["code"], "INVALID_ARGUMENT", "{bad}: {body}");
    }
    let (s, _, _) = stream("bct_nope", period).await;
    assert_eq!(s, 401);
    let (_, v) = api.call(&b.token, "usage.list", json!({"from": "yesterday", "to": "2100-01-01T00:00:00Z", "groupBy": "pool"})).await;
    assert_eq!(v["code"], "INVALID_ARGUMENT", "{v}");
    // Instance usage reads the same way (no instance ran here: its windows are the vps tests').
    let ins = api.ok(&b.token, "instanceUsage.list", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "flavour"})).await;
    assert_eq!((ins["items"].clone(), ins["windowS"].as_i64()), (json!([]), Some(60)), "{ins}");
    let page = api.ok(&api.op, "instanceUsage.export", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "allTenants": true})).await;
    assert_eq!(page["items"], json!([]), "{page}");
    let (s, v) = api.call(&c.token, "instanceUsage.export", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "allTenants": true})).await;
    assert!(s == 403 || s == 404, "{v}");
    let (_, v) = api.call(&b.token, "instanceUsage.list", json!({"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "groupBy": "model"})).await;
    assert_eq!(v["code"], "INVALID_ARGUMENT", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflows_start_once_per_key_refuse_bad_input_with_stable_codes_and_cancel() {
    let api = Api::start().await;
    let start = json!({"definition": "node.maintenance", "target": {"nodeId": api.node}, "params": {"reason": "bios"}, "idempotencyKey": "m-1"});
    let w = api.ok(&api.op, "workflows.start", start.clone()).await;
    assert_eq!((w["definition"].as_str(), w["nodeId"].as_str(), w["poolId"].as_str()), (Some("node.maintenance"), Some(api.node.as_str()), Some(api.pool.as_str())));
    assert_eq!(w["steps"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect::<Vec<_>>(), ["drain", "reboot", "wait-ready", "diag", "verdict", "uncordon"]);
    let again = api.ok(&api.op, "workflows.start", start).await;
    assert_eq!(again["id"], w["id"], "the same key answers the first workflow");
    let listed = api.ok(&api.op, "workflows.list", json!({"nodeId": api.node})).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    for (body, code) in [
        (json!({"definition": "node.nope", "target": {"nodeId": api.node}, "idempotencyKey": "b-1"}), "UNSUPPORTED"),
        (json!({"definition": "node.maintenance", "target": {}, "idempotencyKey": "b-2"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node, "poolId": api.pool}, "idempotencyKey": "b-3"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node}, "params": {"parallel": 2}, "idempotencyKey": "b-4"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node}, "params": {"drainMode": "now"}, "idempotencyKey": "b-5"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"poolId": api.pool}, "params": {"parallel": 65}, "idempotencyKey": "b-6"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.recover", "target": {"nodeId": api.node}, "idempotencyKey": "b-7"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node}, "idempotencyKey": "b-9"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node}, "params": {"reason": " "}, "idempotencyKey": "b-10"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.recover", "target": {"nodeId": api.node}, "params": {"gpuUuid": "GPU-of-no-node"}, "idempotencyKey": "b-11"}), "NOT_FOUND"),
        (json!({"definition": "node.recover", "target": {"poolId": api.pool}, "params": {"gpuUuid": "GPU-of-no-node"}, "idempotencyKey": "b-12"}), "INVALID_ARGUMENT"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": "node_01aaaaaaaaaaaaaaaaaaaaaaaa"}, "params": {"reason": "r"}, "idempotencyKey": "b-8"}), "NOT_FOUND"),
        (json!({"definition": "node.maintenance", "target": {"nodeId": api.node}}), "INVALID_ARGUMENT"),
    ] {
        let (status, v) = api.call(&api.op, "workflows.start", body.clone()).await;
        assert_eq!(v["code"].as_str(), Some(code), "{body}: {status} {v}");
    }
    assert_eq!(api.count("workflows").await, 1, "a refusal starts nothing");
    let (_, v) = api.call(&api.op, "workflows.resume", json!({"workflowId": w["id"]})).await;
    assert_eq!(v["code"], "FAILED_PRECONDITION", "only a held workflow resumes: {v}");
    let c = api.ok(&api.op, "workflows.cancel", json!({"workflowId": w["id"]})).await;
    assert!(c["state"] == "cancelling" || c["state"] == "cancelled", "{c}");
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_replay_refuse_a_changed_body_and_belong_to_one_identity() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    // The key is required where the spec requires it (of callers who may call the method).
    for (token, m, body) in [
        (&b.token, "reservations.create", reservation(&api.pool, None)),
        (&b.token, "reservations.extend", json!({"reservationId": "res_01aaaaaaaaaaaaaaaaaaaaaaaa", "endsAt": "2031-01-01T00:00:00Z"})),
        (&api.op, "commands.run", json!({"nodeId": api.node, "kind": "diag.nvml"})),
    ] {
        let (s, v) = api.call(token, m, body).await;
        assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{m}: {v}");
        assert!(v["message"].as_str().unwrap().contains("idempotencyKey"), "{m}: {v}");
    }
    let first = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("same"))).await;
    let again = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("same"))).await;
    assert_eq!(first, again);
    let mut changed = reservation(&api.pool, Some("same"));
    changed["vcpu"] = json!(4);
    let (s, v) = api.call(&b.token, "reservations.create", changed).await;
    assert_eq!((s, v["code"].as_str()), (409, Some("CONFLICT")), "{v}");
    // Another identity of the same tenant, same key: its own reservation.
    let idn = api.ok(&b.token, "identities.create", json!({"name": "other", "kind": "person"})).await;
    api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "member", "scopeKind": "tenant"})).await;
    let other = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await["secret"].as_str().unwrap().to_owned();
    let theirs = api.ok(&other, "reservations.create", reservation(&api.pool, Some("same"))).await;
    assert_ne!(theirs["id"], first["id"]);
    assert_eq!(api.ok(&b.token, "reservations.list", json!({})).await["items"].as_array().unwrap().len(), 2);
    // commands.run through HTTP: the same key is the same command.
    let c1 = api.ok(&api.op, "commands.run", json!({"nodeId": api.node, "kind": "inventory.refresh", "idempotencyKey": "r"})).await;
    let c2 = api.ok(&api.op, "commands.run", json!({"nodeId": api.node, "kind": "inventory.refresh", "idempotencyKey": "r"})).await;
    assert_eq!(c1["id"], c2["id"]);
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
async fn operators_run_the_fleet_through_explicit_roles_and_pages_walk_every_item() {
    let api = Api::start().await;
    let site = api.ok(&api.op, "sites.create", json!({"name": "east", "idempotencyKey": "site-east"})).await;
    assert_eq!(api.ok(&api.op, "sites.create", json!({"name": "east", "idempotencyKey": "site-east"})).await["id"], site["id"]);
    let (s, v) = api.call(&api.op, "sites.create", json!({"name": "east"})).await;
    assert_eq!((s, v["code"].as_str()), (409, Some("CONFLICT")));
    for i in 0..5 {
        api.ok(&api.op, "pools.create", json!({"siteId": site["id"], "name": format!("p{i}"), "kind": "bare-metal"})).await;
    }
    let mut seen = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut body = json!({"siteId": site["id"], "pageSize": 2});
        if let Some(t) = &token {
            body["pageToken"] = json!(t);
        }
        let page = api.ok(&api.op, "pools.list", body).await;
        seen.extend(page["items"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_owned()));
        match page["nextPageToken"].as_str() {
            Some(t) => token = Some(t.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, ["p0", "p1", "p2", "p3", "p4"]);
    let cordoned = api.ok(&api.op, "nodes.cordon", json!({"nodeId": api.node})).await;
    assert_eq!(cordoned["noScheduleReasons"], json!(["cordoned"]));
    assert_eq!(api.ok(&api.op, "nodes.list", json!({"cordoned": true})).await["items"].as_array().unwrap().len(), 1);
    let jt = api.ok(&api.op, "nodes.createJoinToken", json!({"poolId": api.pool, "ttlSeconds": 600})).await;
    assert!(jt["secret"].as_str().unwrap().starts_with("bcj_"));
    // A tenant admin with a node-scope operator binding? Only the operator can grant it: the
    // operator binds its own colleague at node scope, who then cordons that node and no other.
    let colleague = api.ok(&api.op, "identities.create", json!({"name": "oncall", "kind": "person"})).await;
    api.ok(&api.op, "roleBindings.create", json!({"identityId": colleague["id"], "role": "operator", "scopeKind": "node", "scopeId": api.node})).await;
    let secret = api.ok(&api.op, "tokens.create", json!({"identityId": colleague["id"]})).await["secret"].as_str().unwrap().to_owned();
    api.ok(&secret, "nodes.uncordon", json!({"nodeId": api.node})).await;
    let (s, _) = api.call(&secret, "sites.create", json!({"name": "west"})).await;
    assert_eq!(s, 403);
    tokio::time::timeout(Duration::from_secs(5), async { let _ = api.h.db().now().await; }).await.unwrap();
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
async fn operators_see_health_readiness_and_per_method_metrics() {
    let api = Api::start().await;
    api.ok(&api.op, "nodes.get", json!({"nodeId": api.node})).await;
    let (s, _) = api.call(&api.op, "nodes.get", json!({"nodeId": "node_01aaaaaaaaaaaaaaaaaaaaaaaa"})).await;
    assert_eq!(s, 404);
    let get = |path: &'static str| {
        let (h, u) = (api.http.clone(), api.url.clone());
        async move {
            let r = h.get(format!("{u}{path}")).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    assert_eq!(get("/healthz").await.0, 200);
    let (s, ready) = get("/readyz").await;
    assert_eq!(s, 200, "{ready}");
    let ready: Value = serde_json::from_str(&ready).unwrap();
    assert_eq!((ready["ready"].as_bool(), ready["checks"][0]["name"].as_str(), ready["checks"][0]["ok"].as_bool()), (Some(true), Some("clock.skew"), Some(true)), "{ready}");
    assert_eq!((ready["checks"][1]["name"].as_str(), ready["checks"][1]["ok"].as_bool()), (Some("migrations"), Some(true)), "{ready}");
    // A database behind this version's migrations (a repeatable file changed since) is not ready.
    let c = api.h.db().client().await;
    let kept: String = c.query_one("SELECT checksum FROM schema_migrations WHERE module = 'audit' AND name = 'audit'", &[]).await.unwrap().get(0);
    c.execute("UPDATE schema_migrations SET checksum = 'older' WHERE module = 'audit' AND name = 'audit'", &[]).await.unwrap();
    let (s, behind) = get("/readyz").await;
    assert_eq!(s, 503, "{behind}");
    assert!(behind.contains("1 migration(s) of this version are not applied (the first: audit/audit); run `better-compute migrate`"), "{behind}");
    c.execute("UPDATE schema_migrations SET checksum = $1 WHERE module = 'audit' AND name = 'audit'", &[&kept]).await.unwrap();
    assert_eq!(get("/readyz").await.0, 200);
    let (s, text) = get("/metrics").await;
    assert_eq!(s, 200);
    for line in [
        "better_compute_api_requests_total{method=\"nodes.get\",code=\"OK\"} 1",
        "better_compute_api_requests_total{method=\"nodes.get\",code=\"NOT_FOUND\"} 1",
        "better_compute_api_request_seconds_bucket{method=\"nodes.get\",code=\"OK\",le=\"+Inf\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
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

/// An `instances.create` body with a new one-GPU reservation in `pool`.
fn instance(pool: &str, key: &str) -> Value {
    json!({"poolId": pool, "gpu": {"kind": "gpu", "model": "H100", "count": 1}, "vcpu": 4, "memoryMib": 8192, "diskGib": 20, "durationS": 3600,
           "image": "debian-12", "sshPublicKeys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 me@laptop"], "idempotencyKey": key})
}

/// The IAM rule, modelled independently of the server: which `(permission, scope)` grants a set
/// of bindings confers, and whether one set covers another.
mod iam_model {
    use std::collections::{BTreeMap, BTreeSet};

    /// `(kind, id)`: `("fleet", "")`, `("tenant", ten)`, `("site", s)`, `("pool", p)`, `("node", n)`.
    pub type Scope = (&'static str, String);

    pub fn tenant_perm(p: &str) -> bool {
        ["compute:reservations:", "compute:instances:", "compute:webhooks:", "iam:identities:", "iam:bindings:"].iter().any(|x| p.starts_with(x))
            || p == "compute:quotas:read"
            || p == "compute:usage:read"
            || p == "compute:audit:read"
    }

    fn applies(p: &str, kind: &str) -> bool {
        if kind == "tenant" { tenant_perm(p) } else { !tenant_perm(p) || p == "compute:quotas:read" || p == "compute:usage:read" || p == "compute:audit:read" }
    }

    pub struct World {
        pub roles: BTreeMap<String, Vec<String>>,
        pub tenant: String,
        /// Each inventory scope with the scopes that cover it, itself included.
        pub paths: BTreeMap<Scope, Vec<Scope>>,
    }

    impl World {
        pub fn grants(&self, bindings: &[(String, Scope)]) -> BTreeSet<(String, Scope)> {
            let mut out = BTreeSet::new();
            for (role, scope) in bindings {
                for p in &self.roles[role] {
                    if applies(p, scope.0) {
                        out.insert((p.clone(), scope.clone()));
                    }
                }
            }
            out
        }

        pub fn has(&self, grants: &BTreeSet<(String, Scope)>, p: &str, at: &Scope) -> bool {
            let covering: Vec<Scope> = if at.0 == "tenant" { vec![at.clone()] } else { self.paths[at].clone() };
            covering.iter().any(|s| grants.contains(&(p.to_owned(), s.clone())))
        }

        pub fn dominates(&self, actor: &BTreeSet<(String, Scope)>, target: &BTreeSet<(String, Scope)>) -> bool {
            target.iter().all(|(p, s)| self.has(actor, p, s))
        }

        pub fn holds_role(&self, actor: &BTreeSet<(String, Scope)>, role: &str, at: &Scope) -> bool {
            self.roles[role].iter().all(|p| {
                let scope = if applies(p, at.0) {
                    at.clone()
                } else if tenant_perm(p) {
                    ("tenant", self.tenant.clone())
                } else {
                    ("fleet", String::new())
                };
                self.has(actor, p, &scope)
            })
        }
    }
}

/// Expected HTTP status of a decision: 200 when allowed, else the refusal's.
fn expect(allowed: bool, refused: u16) -> u16 {
    if allowed { 200 } else { refused }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "a test: one loop over every role, scope and IAM method, asserting as it goes")]
async fn every_iam_method_refuses_acting_on_an_identity_mightier_than_the_caller_for_every_role_and_scope() {
    use iam_model::{Scope, World};
    let api = Api::start().await;
    let roles: Vec<(String, Vec<String>)> = api.ok(&api.op, "roles.list", json!({})).await["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["name"].as_str().unwrap().to_owned(), r["permissions"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect()))
        .collect();
    assert_eq!(roles.len(), 6, "the built-in roles: {roles:?}");
    let names: Vec<String> = roles.iter().map(|r| r.0.clone()).collect();
    let site = api.ok(&api.op, "pools.get", json!({"poolId": api.pool})).await["siteId"].as_str().unwrap().to_owned();
    let mut db = api.h.db().connect().await;
    let tx = db.transaction().await.unwrap();
    let made = better_compute_iam::bootstrap::tenant_with_admin(&tx, "matrix", "root", false).await.unwrap();
    let ten = made.tenant.id.clone();
    let fleet: Scope = ("fleet", String::new());
    let (s_site, s_pool, s_node): (Scope, Scope, Scope) = (("site", site.clone()), ("pool", api.pool.clone()), ("node", api.node.clone()));
    let world = World {
        roles: roles.iter().cloned().collect(),
        tenant: ten.clone(),
        paths: [
            (fleet.clone(), vec![fleet.clone()]),
            (s_site.clone(), vec![fleet.clone(), s_site.clone()]),
            (s_pool.clone(), vec![fleet.clone(), s_site.clone(), s_pool.clone()]),
            (s_node.clone(), vec![fleet.clone(), s_site.clone(), s_pool.clone(), s_node.clone()]),
        ]
        .into_iter()
        .collect(),
    };
    let tenant: Scope = ("tenant", ten.clone());
    let all_scopes = [fleet.clone(), tenant.clone(), s_site.clone(), s_pool.clone(), s_node.clone()];
    let mut seq = 0;
    // An identity of the tenant with these bindings (written directly, as an operator with the
    // database would) and a token for it.
    let mut identity = async |bindings: &[(String, Scope)]| -> (String, String, String, Vec<String>) {
        seq += 1;
        let idn = better_compute_iam::directory::create_identity(&tx, &ten, &format!("i{seq}"), "service").await.unwrap().id;
        let mut rbs = Vec::new();
        for (role, (kind, id)) in bindings {
            let rb = format!("rb_m{seq}_{}", rbs.len());
            tx.execute("INSERT INTO role_bindings (id, tenant_id, identity_id, role, scope_kind, scope_id) VALUES ($1, $2, $3, $4, $5, $6)", &[&rb, &ten, &idn, role, kind, id])
                .await
                .unwrap();
            rbs.push(rb);
        }
        better_compute_iam::bindings::project(&tx, &idn).await.unwrap();
        let tok = better_compute_iam::tokens::issue(&tx, &ten, None, &idn, "m", None).await.unwrap();
        (idn, tok.token.id, tok.secret, rbs)
    };
    // Callers: each role at tenant scope, at fleet scope, and at fleet scope beside `admin` at
    // tenant scope (an operator who also administers the tenant).
    let mut callers = Vec::new();
    for r in &names {
        callers.push(vec![(r.clone(), tenant.clone())]);
        callers.push(vec![(r.clone(), fleet.clone())]);
        callers.push(vec![("admin".to_owned(), tenant.clone()), (r.clone(), fleet.clone())]);
    }
    // Targets: nothing, or each role at each scope.
    let mut targets: Vec<Vec<(String, Scope)>> = vec![vec![]];
    for r in &names {
        for s in &all_scopes {
            targets.push(vec![(r.clone(), s.clone())]);
        }
    }
    let mut cells = Vec::new();
    for c in &callers {
        let caller = identity(c).await;
        let mut ts = Vec::new();
        for t in &targets {
            ts.push((t.clone(), identity(t).await));
        }
        let mut fresh = Vec::new();
        for _ in 0..names.len() * all_scopes.len() {
            fresh.push(identity(&[]).await);
        }
        cells.push((c.clone(), caller, ts, fresh));
    }
    tx.commit().await.unwrap();
    let other = api.tenant("other").await;

    let mut checked = 0;
    let mut allowed_acts = 0;
    for (c, (_, _, secret, _), ts, fresh) in &cells {
        let cg = world.grants(c);
        let has = |p: &str, at: &Scope| world.has(&cg, p, at);
        let who = format!("caller {c:?}");
        // Methods that act on no identity.
        for (m, body, want) in [
            ("roles.list", json!({}), 200),
            ("identities.list", json!({}), expect(has("iam:identities:read", &tenant), 403)),
            ("tokens.list", json!({}), expect(has("iam:identities:read", &tenant), 403)),
            ("roleBindings.list", json!({}), expect(has("iam:bindings:read", &tenant), 403)),
            ("tenants.list", json!({}), expect(has("iam:tenants:read", &fleet), 403)),
            ("tenants.get", json!({"tenantId": other.id}), expect(has("iam:tenants:read", &fleet), 404)),
            ("identities.create", json!({"name": format!("new{checked}"), "kind": "person"}), expect(has("iam:identities:write", &tenant), 403)),
            ("tenants.create", json!({"name": format!("made{checked}")}), expect(has("iam:tenants:write", &fleet), 403)),
        ] {
            let (s, v) = api.call(secret, m, body).await;
            assert_eq!(s, want, "{who}: {m}: {v}");
            checked += 1;
        }
        // Acting on each target: a token, a revocation, a binding, an unbinding.
        for (t, (idn, tok, _, rbs)) in ts {
            let mut tg = world.grants(t);
            let who = format!("{who} on target {t:?}");
            let may_act = |tg: &std::collections::BTreeSet<_>| world.dominates(&cg, tg);
            let (s, v) = api.call(secret, "tokens.create", json!({"identityId": idn})).await;
            assert_eq!(s, expect(has("iam:identities:write", &tenant) && may_act(&tg), 403), "{who}: tokens.create: {v}");
            allowed_acts += usize::from(s == 200);
            let (s, v) = api.call(secret, "tokens.revoke", json!({"tokenId": tok})).await;
            assert_eq!(s, expect(has("iam:identities:write", &tenant) && may_act(&tg), 403), "{who}: tokens.revoke: {v}");
            let (s, v) = api.call(secret, "roleBindings.create", json!({"identityId": idn, "role": "member", "scopeKind": "tenant"})).await;
            let bound = has("iam:bindings:write", &tenant) && may_act(&tg) && world.holds_role(&cg, "member", &tenant);
            assert_eq!(s, expect(bound, 403), "{who}: roleBindings.create: {v}");
            if bound {
                tg.extend(world.grants(&[("member".to_owned(), tenant.clone())]));
            }
            for rb in rbs {
                let (s, v) = api.call(secret, "roleBindings.delete", json!({"roleBindingId": rb})).await;
                assert_eq!(s, expect(has("iam:bindings:write", &tenant) && may_act(&tg), 403), "{who}: roleBindings.delete: {v}");
            }
            checked += 3 + rbs.len();
        }
        // Binding each role at each scope to an identity that holds nothing yet.
        let mut fresh = fresh.iter();
        for r in &names {
            for at in &all_scopes {
                let (idn, ..) = fresh.next().unwrap();
                let (s, v) = api.call(secret, "roleBindings.create", json!({"identityId": idn, "role": r, "scopeKind": at.0, "scopeId": at.1})).await;
                let want = expect(has("iam:bindings:write", &tenant) && world.holds_role(&cg, r, at), 403);
                assert_eq!(s, want, "{who}: binding {r} at {at:?}: {v}");
                checked += 1;
            }
        }
    }
    let callers_n = callers.len();
    assert_eq!(callers_n, 18);
    assert_eq!(checked, callers_n * (8 + (targets.len() - 1) * 4 + 3 + names.len() * all_scopes.len()), "every cell was checked");
    assert!(allowed_acts > 0 && allowed_acts < callers_n * targets.len(), "the matrix has both outcomes: {allowed_acts}");
    // The escalation found from outside, in so many words: a tenant admin cannot mint a token
    // for the fleet's operator, unbind them, revoke their tokens or make itself fleet-admin.
    let (s, v) = api.call(&made.token.secret, "roleBindings.create", json!({"identityId": made.identity.id, "role": "fleet-admin", "scopeKind": "tenant"})).await;
    assert_eq!((s, v["code"].as_str()), (403, Some("PERMISSION_DENIED")), "{v}");
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

/// Reads SSE blocks until `quiet` passes without any or the stream ends: `(event, data)` pairs,
/// and whether it ended.
async fn sse_until_quiet(resp: &mut reqwest::Response, quiet: Duration) -> (Vec<(String, Value)>, bool) {
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
async fn the_http_layer_answers_its_own_refusals_as_json_and_drops_slow_and_idle_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = better_compute_api::http::HttpSettings { header_read_timeout: Duration::from_millis(300), ..Default::default() };
    let api = Api::start_serving(|s| s.body_read_timeout = Duration::from_millis(300), limits).await;
    // Refusals hyper makes before the router sees the request: JSON with a request id.
    let many: String = (0..150).map(|i| format!("X-H{i}: v\r\n")).collect();
    let huge = format!("X-Big: {}\r\n", "v".repeat(70_000));
    let mut refused = 0;
    for (what, request, want) in [
        ("a bad request line", b"GARBAGE\r\n\r\n".to_vec(), 400),
        ("a bad header", b"POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n".to_vec(), 400),
        ("150 headers", format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n{many}\r\n").into_bytes(), 431),
        ("a 70 kB header", format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n{huge}\r\n").into_bytes(), 431),
    ] {
        let (s, v) = api.raw_exchange(&request).await;
        assert_eq!((s, v["code"].as_str()), (want, Some("INVALID_ARGUMENT")), "{what}: {v}");
        assert!(!v["message"].as_str().unwrap_or_default().is_empty(), "{what}");
        refused += 1;
    }
    assert_eq!(refused, 4);
    let addr = api.url.trim_start_matches("http://").to_owned();
    // The server closes within its 300 ms; the 60 s guard only turns "held forever" into a failure.
    let closed = async |c: &mut tokio::net::TcpStream| {
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), c.read_to_end(&mut buf)).await.expect("the server held the connection").ok();
        String::from_utf8_lossy(&buf).into_owned()
    };
    // A head that never finishes: the connection is dropped.
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    slow.write_all(b"POST /v1/roles.list HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    closed(&mut slow).await;
    // A body that never finishes: refused as JSON.
    let mut stalled = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{{", api.op);
    stalled.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(60), stalled.read(&mut answer)).await.expect("no answer to a stalled body").unwrap();
    let text = String::from_utf8_lossy(&answer[..n]);
    assert!(text.starts_with("HTTP/1.1 400") && text.contains("did not arrive"), "{text}");
    // A body shorter than its Content-Length (the client stops sending): said so, not "too large".
    let mut short = tokio::net::TcpStream::connect(&addr).await.unwrap();
    short.write_all(head.as_bytes()).await.unwrap();
    short.shutdown().await.unwrap();
    let text = closed(&mut short).await;
    assert!(text.starts_with("HTTP/1.1 400") && text.contains("ended before its Content-Length"), "{text}");
    // An idle keep-alive connection after an answer: closed too.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = format!("POST /v1/roles.list HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}", api.op);
    idle.write_all(request.as_bytes()).await.unwrap();
    let text = closed(&mut idle).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_or_tenant_over_its_rate_is_answered_429_with_retry_after_and_others_are_not_held_back() {
    use better_compute_api::rate_limit::{RateLimiter, RateLimits};
    let now_ms = Arc::new(AtomicU64::new(0));
    let clock = now_ms.clone();
    let limits = RateLimits { per_token_per_s: 6, per_tenant_per_s: 10, burst_s: 1 };
    let api = Api::start_with(move |s| s.set_rate_limiter(RateLimiter::with_clock(limits, Arc::new(move || clock.load(Ordering::SeqCst))))).await;
    // Each setup step in a second of its own, so the setup itself stays under the rates.
    let next_second = || now_ms.fetch_add(1000, Ordering::SeqCst);
    let b = api.tenant("tenant-b").await;
    next_second();
    let c = api.tenant("tenant-c").await;
    next_second();
    let idn = api.ok(&c.token, "identities.create", json!({"name": "second", "kind": "service"})).await;
    api.ok(&c.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "member", "scopeKind": "tenant"})).await;
    let second = api.ok(&c.token, "tokens.create", json!({"identityId": idn["id"]})).await["secret"].as_str().unwrap().to_owned();
    next_second();
    let get = async |token: &str| {
        let r = api.http.post(format!("{}/v1/roles.list", api.url)).bearer_auth(token).header("content-type", "application/json").body("{}").send().await.unwrap();
        let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
        (r.status().as_u16(), retry, r.json::<Value>().await.unwrap())
    };
    let mut served = 0;
    for _ in 0..6 {
        assert_eq!(get(&b.token).await.0, 200);
        served += 1;
    }
    assert_eq!(served, 6);
    let (s, retry, v) = get(&b.token).await;
    assert_eq!((s, v["code"].as_str(), retry.as_deref()), (429, Some("RATE_LIMITED"), Some("1")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("token"), "{v}");
    // A watch stream opened counts as a request too.
    assert_eq!(api.http.get(format!("{}/v1/watch", api.url)).bearer_auth(&b.token).send().await.unwrap().status().as_u16(), 429);
    // Another tenant is not held back; its two tokens share its 10 a second.
    for token in [&c.token, &second] {
        for _ in 0..5 {
            assert_eq!(get(token).await.0, 200);
        }
    }
    let (s, _, v) = get(&second).await;
    assert_eq!((s, v["message"].as_str().is_some_and(|m| m.contains("tenant"))), (429, true), "{v}");
    // A second later, both are served again.
    next_second();
    assert_eq!(get(&b.token).await.0, 200);
    assert_eq!(get(&second).await.0, 200);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_repeats_of_a_create_near_the_quota_all_answer_the_first_outcome() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    // Room for exactly one such reservation.
    api.ok(&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "gpus", "max": 1})).await;
    let mut rounds = 0;
    for round in 0..20 {
        let key = format!("near-quota-{round}");
        let calls = (0..6).map(|_| api.call(&b.token, "reservations.create", reservation(&api.pool, Some(&key))));
        let answers = futures_util::future::join_all(calls).await;
        let first = &answers[0];
        for (s, v) in &answers {
            assert_eq!((s, &v["id"], &v["code"]), (&first.0, &first.1["id"], &first.1["code"]), "round {round}: {answers:?}");
        }
        if first.0 == 200 {
            api.ok(&b.token, "reservations.release", json!({"reservationId": first.1["id"]})).await;
        }
        rounds += 1;
    }
    assert_eq!(rounds, 20);
    // A refusal is the key's answer too: once quota is raised, a repeat of the refused key is
    // still refused (it replays), and a new key is placed.
    api.ok(&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "gpus", "max": 0})).await;
    let (s, v) = api.call(&b.token, "reservations.create", reservation(&api.pool, Some("refused-first"))).await;
    assert_eq!((s, v["code"].as_str()), (409, Some("QUOTA_EXCEEDED")), "final, so not 429: {v}");
    api.ok(&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "gpus", "max": 1})).await;
    let (s, again) = api.call(&b.token, "reservations.create", reservation(&api.pool, Some("refused-first"))).await;
    assert_eq!((s, &again), (409, &v), "a repeat of a refused key was judged afresh");
    assert_eq!(api.call(&b.token, "reservations.create", reservation(&api.pool, Some("a-new-key"))).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_with_clock_skew_when_the_database_clock_jumps() {
    let api = Api::start().await;
    let c = api.h.db().connect().await;
    better_compute_db::clock::use_real_clock(&c).await.unwrap();
    let ready = || async {
        let r = api.http.get(format!("{}/readyz", api.url)).send().await.unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    // The first look anchors the process's clock to the database's; the next agrees.
    assert_eq!(ready().await.0, 200);
    let (s, v) = ready().await;
    assert_eq!((s, v["checks"][0]["ok"].as_bool()), (200, Some(true)), "{v}");
    // The database's clock jumps ten seconds ahead: not ready, and the check says why.
    c.batch_execute("CREATE OR REPLACE FUNCTION compute_now() RETURNS timestamptz LANGUAGE sql STABLE AS $$ SELECT now() + interval '10 s' $$") // check-sql-now: allow (a jumped clock)
        .await
        .unwrap();
    let (s, v) = ready().await;
    assert_eq!((s, v["ready"].as_bool(), v["checks"][0]["name"].as_str(), v["checks"][0]["ok"].as_bool()), (503, Some(false), Some("clock.skew"), Some(false)), "{v}");
    // It holds steady there: the next sample agrees with the new anchor.
    assert_eq!(ready().await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_reads_gpus_labels_and_conditions_and_drains_a_node_over_http() {
    let api = Api::start().await;
    // The GPUs the API never showed before: uuid, mode, atoms, health.
    let gpu = api.ok(&api.op, "devices.get", json!({"deviceId": "GPU-2"})).await;
    assert_eq!((gpu["nodeId"].as_str(), gpu["mode"].as_str(), gpu["healthy"].as_bool(), gpu["schedulable"].as_bool()), (Some(api.node.as_str()), Some("exclusive"), Some(true), Some(true)));
    assert_eq!(gpu["atoms"], json!([{"id": "GPU-2", "kind": "gpu", "profile": null, "memoryMib": 81920, "active": true}]));
    let page = api.ok(&api.op, "devices.list", json!({"poolId": api.pool, "pageSize": 3})).await;
    assert_eq!(page["items"].as_array().unwrap().iter().map(|g| g["id"].as_str().unwrap()).collect::<Vec<_>>(), ["GPU-0", "GPU-1", "GPU-2"]);
    let rest = api.ok(&api.op, "devices.list", json!({"poolId": api.pool, "pageToken": page["nextPageToken"]})).await;
    assert_eq!(rest["items"].as_array().unwrap().len(), 1);
    let (s, v) = api.call(&api.op, "devices.list", json!({})).await;
    assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")));
    api.ok(&api.op, "devices.quarantine", json!({"deviceId": "GPU-2", "reason": "xid 79"})).await;
    let node = api.ok(&api.op, "nodes.get", json!({"nodeId": api.node})).await;
    let types: Vec<&str> = node["conditions"].as_array().unwrap().iter().map(|c| c["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["Disconnected", "QuarantinedGpus"], "{node}");
    assert!(node["conditions"][1]["message"].as_str().unwrap().contains("GPU-2 (xid 79)"));

    // Described: its GPUs, the reservation holding it, and what happened to it.
    let b = api.tenant("tenant-b").await;
    let res = api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("d-1"))).await;
    let described = api.ok(&api.op, "nodes.describe", json!({"nodeId": api.node})).await;
    assert_eq!(described["gpus"].as_array().unwrap().len(), 4);
    assert_eq!(described["reservations"].as_array().unwrap().len(), 1);
    assert_eq!((&described["reservations"][0]["id"], described["reservations"][0]["tenantId"].as_str()), (&res["id"], Some(b.id.as_str())));
    assert_eq!(described["session"], Value::Null);
    let events: Vec<&str> = described["recentEvents"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(events, ["device.quarantined", "node.registered"], "newest first, the node's and its GPUs'");
    api.ok(&b.token, "reservations.release", json!({"reservationId": res["id"]})).await;

    // Labels, and selecting on them.
    let labelled = api.ok(&api.op, "nodes.update", json!({"nodeId": api.node, "labels": {"rack": "r1", "ssd": "yes"}})).await;
    assert_eq!(labelled["labels"], json!({"rack": "r1", "ssd": "yes"}));
    let labelled = api.ok(&api.op, "nodes.update", json!({"nodeId": api.node, "labels": {"ssd": null}})).await;
    assert_eq!(labelled["labels"], json!({"rack": "r1"}));
    for (selector, found) in [("rack=r1", 1), ("rack!=r1", 0), ("rack", 1), ("!rack", 0), ("rack=r2", 0), ("gpu!=L4,rack=r1", 1)] {
        let page = api.ok(&api.op, "nodes.list", json!({"labelSelector": selector})).await;
        assert_eq!(page["items"].as_array().unwrap().len(), found, "{selector}");
    }
    let (s, v) = api.call(&api.op, "nodes.list", json!({"labelSelector": "rack=a,,b"})).await;
    assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")));

    // A budget of zero: the drain cordons the node at once and waits, queued, saying why.
    let pool = api.ok(&api.op, "pools.update", json!({"poolId": api.pool, "maxUnavailable": 0})).await;
    assert_eq!(pool["maxUnavailable"], "0");
    for bad in [json!("101%"), json!(-1), json!("lots")] {
        let (s, v) = api.call(&api.op, "pools.update", json!({"poolId": api.pool, "maxUnavailable": bad})).await;
        assert_eq!((s, v["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{bad}");
    }
    let drain = api.ok(&api.op, "nodes.drain", json!({"nodeId": api.node, "reason": "firmware", "mode": "evict", "deadline": "2031-01-01T00:00:00Z"})).await;
    assert_eq!((drain["state"].as_str(), drain["deadline"].as_str()), (Some("queued"), Some("2031-01-01T00:00:00.000000Z")));
    assert_eq!(api.ok(&api.op, "nodes.get", json!({"nodeId": api.node})).await["noScheduleReasons"], json!(["draining"]));
    api.h.job("drain").drain(5).await;
    let listed = api.ok(&api.op, "drains.list", json!({"poolId": api.pool})).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    assert_eq!(listed["items"][0]["condition"]["reason"], "WaitingForBudget");
    // Retiring before it is drained is refused, saying what to do.
    let (s, v) = api.call(&api.op, "nodes.retire", json!({"nodeId": api.node})).await;
    assert_eq!((s, v["code"].as_str()), (412, Some("FAILED_PRECONDITION")), "{v}");
    assert!(v["message"].as_str().unwrap().contains("drain it"));
    // Room in the budget: drained (nothing holds the node), then retired for ever.
    api.ok(&api.op, "pools.update", json!({"poolId": api.pool, "maxUnavailable": "100%"})).await;
    api.h.job("drain").drain(5).await;
    assert_eq!(api.ok(&api.op, "drains.list", json!({"poolId": api.pool})).await["items"][0]["state"], "drained");
    let retired = api.ok(&api.op, "nodes.retire", json!({"nodeId": api.node})).await;
    assert_eq!(retired["noScheduleReasons"], json!(["retired"]));
    assert!(retired["conditions"].as_array().unwrap().iter().any(|c| c["type"] == "Retired"));
    let (s, v) = api.call(&api.op, "nodes.drain", json!({"nodeId": api.node, "reason": "again"})).await;
    assert_eq!((s, v["code"].as_str()), (412, Some("FAILED_PRECONDITION")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_are_created_once_per_key_read_listed_and_deleted_through_the_api() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let vms = api.vps_host().await;
    let v = api.ok(&b.token, "instances.create", instance(&vms, "vm-1")).await;
    assert_eq!((v["state"].as_str(), v["image"].as_str()), (Some("requested"), Some("debian-12")), "{v}");
    assert_eq!(api.ok(&b.token, "instances.create", instance(&vms, "vm-1")).await["id"], v["id"], "the same key, the same instance");
    let res = api.ok(&b.token, "reservations.get", json!({"reservationId": v["reservationId"]})).await;
    assert_eq!((res["state"].as_str(), res["poolId"].as_str()), (Some("placed"), Some(vms.as_str())), "the reservation was made with it: {res}");
    // One live instance per reservation.
    let again = json!({"reservationId": v["reservationId"], "image": "debian-12", "sshPublicKeys": ["ssh-ed25519 AAAA me"], "idempotencyKey": "vm-2"});
    let (s, e) = api.call(&b.token, "instances.create", again).await;
    assert_eq!((s, e["code"].as_str()), (409, Some("CONFLICT")), "{e}");
    // Only in vps-host pools.
    let (s, e) = api.call(&b.token, "instances.create", instance(&api.pool, "vm-3")).await;
    assert_eq!((s, e["code"].as_str()), (412, Some("FAILED_PRECONDITION")), "{e}");
    let (s, e) = api.call(&b.token, "instances.create", json!({"image": "debian-12", "sshPublicKeys": ["x"], "idempotencyKey": "vm-4"})).await;
    assert_eq!((s, e["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{e}");
    let list = api.ok(&b.token, "instances.list", json!({})).await;
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1), "{list}");
    // Not running yet: it cannot reboot; delete takes it off its host.
    let (s, e) = api.call(&b.token, "instances.reboot", json!({"instanceId": v["id"]})).await;
    assert_eq!((s, e["code"].as_str()), (412, Some("FAILED_PRECONDITION")), "{e}");
    // The image catalogue: operators keep it, tenants read it.
    let img = json!({"name": "debian-12", "url": "https://images.example/debian-12.qcow2", "sha256": "ab".repeat(32)});
    assert_eq!(api.ok(&api.op, "vpsImages.set", img.clone()).await["version"], 1);
    let (s, e) = api.call(&b.token, "vpsImages.set", img.clone()).await;
    assert!(s == 403 || s == 404, "a tenant does not change the catalogue: {e}");
    let listed = api.ok(&b.token, "vpsImages.list", json!({})).await;
    assert_eq!((listed["items"].as_array().map(Vec::len), listed["items"][0]["sha256"].as_str()), (Some(1), img["sha256"].as_str()), "{listed}");
    let (s, e) = api.call(&api.op, "vpsImages.set", json!({"name": "debian-12", "url": "ftp://x", "sha256": "ab".repeat(32)})).await;
    assert_eq!((s, e["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{e}");
    assert_eq!(api.ok(&api.op, "vpsImages.delete", json!({"name": "debian-12"})).await["name"], "debian-12");
    let (s, e) = api.call(&api.op, "vpsImages.delete", json!({"name": "debian-12"})).await;
    assert_eq!((s, e["code"].as_str()), (404, Some("NOT_FOUND")), "{e}");
    // Its console: empty until a host sends some; the GET streams it; only with the permission,
    // only in its tenant.
    let page = api.ok(&b.token, "instances.console", json!({"instanceId": v["id"]})).await;
    assert_eq!((page["text"].as_str(), page["nextOffset"].as_i64()), (Some(""), Some(0)), "{page}");
    let url = format!("{}/v1/instances.console?instanceId={}", api.url, v["id"].as_str().unwrap());
    let mut stream = api.http.get(&url).bearer_auth(&b.token).send().await.unwrap();
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    let c = api.tenant("tenant-c").await;
    let r = api.http.get(&url).bearer_auth(&c.token).send().await.unwrap();
    assert_eq!(r.status(), 404, "another tenant's instance is not found");
    let idn = api.ok(&b.token, "identities.create", json!({"name": "looker", "kind": "service"})).await;
    let tok = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "tenant-viewer", "scopeKind": "tenant"})).await;
    let viewer = tok["secret"].as_str().unwrap().to_owned();
    assert!(api.ok(&viewer, "instances.get", json!({"instanceId": v["id"]})).await["id"] == v["id"], "a viewer reads the instance");
    let (s, e) = api.call(&viewer, "instances.console", json!({"instanceId": v["id"]})).await;
    assert_eq!((s, e["code"].as_str()), (403, Some("PERMISSION_DENIED")), "but not its console: {e}");
    assert_eq!(api.http.get(&url).bearer_auth(&viewer).send().await.unwrap().status(), 403);
    let r = api.http.get(format!("{url}&offset=-3")).bearer_auth(&b.token).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let d = api.ok(&b.token, "instances.delete", json!({"instanceId": v["id"]})).await;
    assert_eq!(d["state"], "deleting", "{d}");
    // The stream ends (OK) once the instance is deleted.
    api.h.db().client().await.execute("UPDATE instances SET state = 'deleted' WHERE id = $1", &[&v["id"].as_str().unwrap()]).await.unwrap();
    let (events, ended) = sse_until_quiet(&mut stream, Duration::from_secs(10)).await;
    assert!(ended, "{events:?}");
    assert_eq!(events.iter().map(|(e, v)| (e.as_str(), v["code"].as_str())).collect::<Vec<_>>(), [("end", Some("OK"))]);
    assert_eq!(api.ok(&b.token, "instances.delete", json!({"instanceId": v["id"]})).await["version"], d["version"], "a repeat changes nothing");
}

/// Mutating methods audited through the same path as a method the sweep calls, with no call of
/// their own (each needs state the sweep does not make): instances' power actions go through
/// `instances::act` as `instances.delete` does; a resume and a dead letter's replay through
/// `Ctx::in_tx` as `workflows.cancel` and `webhooks.test` do.
const AUDITED_LIKE_ANOTHER: &[&str] = &["instances.stop", "instances.start", "instances.reboot", "workflows.resume", "webhooks.deadLetters.replay"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "a test: every changing method in turn, each with its assertions beside it")]
async fn every_change_through_the_api_writes_one_audit_entry_with_it_and_a_refusal_one_denied() {
    let api = Api::start().await;
    let b = api.tenant("tenant-b").await;
    let c = api.h.db().client().await;
    let since: i64 = c.query_one("SELECT coalesce(max(position), 0) FROM audit_entries", &[]).await.unwrap().get(0);
    let idn = api.ok(&b.token, "identities.create", json!({"name": "robot", "kind": "service"})).await;
    let tok = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    let rb = api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "tenant-viewer", "scopeKind": "tenant"})).await;
    let viewer = tok["secret"].as_str().unwrap().to_owned();
    let image = json!({"name": "debian-12", "url": "https://images.example/d.qcow2", "sha256": "ab".repeat(32)});
    let calls: Vec<(&str, &str, Value)> = vec![
        (&api.op, "nodes.cordon", json!({"nodeId": api.node})),
        (&api.op, "nodes.uncordon", json!({"nodeId": api.node})),
        (&api.op, "nodes.taint", json!({"nodeId": api.node, "key": "k", "value": "v"})),
        (&api.op, "nodes.untaint", json!({"nodeId": api.node, "key": "k"})),
        (&api.op, "nodes.update", json!({"nodeId": api.node, "labels": {"rack": "r9"}})),
        (&api.op, "nodes.createJoinToken", json!({"poolId": api.pool})),
        (&api.op, "pools.update", json!({"poolId": api.pool, "maxUnavailable": "100%"})),
        (&api.op, "devices.quarantine", json!({"deviceId": "GPU-0", "reason": "test"})),
        (&api.op, "devices.releaseQuarantine", json!({"deviceId": "GPU-0"})),
        (&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "gpus", "max": 100})),
        (&api.op, "tenants.create", json!({"name": "tenant-d"})),
        (&api.op, "vpsImages.set", image.clone()),
        (&api.op, "vpsImages.delete", json!({"name": "debian-12"})),
        (&b.token, "tokens.revoke", json!({"tokenId": tok["token"]["id"]})),
        (&b.token, "roleBindings.delete", json!({"roleBindingId": rb["id"]})),
        (&b.token, "webhooks.create", json!({"url": "https://example.com/hook"})),
        (&api.op, "sites.create", json!({"name": "site-audit"})),
        (&api.op, "sites.update", json!({"siteId": "{site}", "bootAdmitPerS": 5})),
        (&api.op, "sites.boot", json!({"siteId": "{site}"})),
        (&api.op, "pools.create", json!({"siteId": "{site}", "name": "pool-audit", "kind": "bare-metal"})),
        (&api.op, "pools.closeHealthCircuit", json!({"poolId": api.pool})),
        (&api.op, "nodes.drain", json!({"nodeId": api.node, "reason": "audit", "mode": "evict"})),
        (&api.op, "nodes.undrain", json!({"nodeId": api.node})),
        (&b.token, "webhooks.update", json!({"webhookId": "{wh}", "description": "mine"})),
        (&b.token, "webhooks.rotateSecret", json!({"webhookId": "{wh}"})),
        (&b.token, "webhooks.test", json!({"webhookId": "{wh}"})),
        (&b.token, "webhooks.delete", json!({"webhookId": "{wh}"})),
        (&api.op, "commands.run", json!({"nodeId": api.node, "kind": "inventory.refresh", "idempotencyKey": "audit-1"})),
        (&api.op, "commands.cancel", json!({"nodeId": api.node, "commandId": "{cmd}"})),
        (&b.token, "instances.create", instance("{vms}", "audit-vm")),
        (&b.token, "instances.delete", json!({"instanceId": "{ins}"})),
        (&api.op, "workflows.start", json!({"definition": "node.maintenance", "target": {"poolId": api.pool, "labels": {"rack": "none"}}, "params": {"reason": "r"}, "idempotencyKey": "audit-wf"})),
        (&api.op, "workflows.cancel", json!({"workflowId": "{wf}"})),
        (&b.token, "reservations.create", reservation(&api.pool, Some("audit-res"))),
        (&b.token, "reservations.extend", json!({"reservationId": "{res}", "endsAt": "2030-01-02T00:00:00Z", "idempotencyKey": "audit-ext"})),
        (&b.token, "reservations.release", json!({"reservationId": "{res}"})),
    ];
    let vms = api.vps_host().await;
    let site = api.ok(&api.op, "pools.get", json!({"poolId": api.pool})).await["siteId"].as_str().unwrap().to_owned();
    let mut ids: Vec<(&str, String)> = vec![("site", site.clone()), ("vms", vms.clone())];
    for (token, method, body) in &calls {
        let v = api.ok(token, method, fill(body, &ids)).await;
        let made = match *method {
            "webhooks.create" => Some(("wh", v["webhook"]["id"].clone())),
            "commands.run" => Some(("cmd", v["id"].clone())),
            "instances.create" => Some(("ins", v["id"].clone())),
            "workflows.start" => Some(("wf", v["id"].clone())),
            "reservations.create" => Some(("res", v["id"].clone())),
            _ => None,
        };
        if let Some((k, id)) = made {
            ids.push((k, id.as_str().unwrap().to_owned()));
        }
    }
    // A repeat of a create (its key replayed) and an action that changes nothing are not changes.
    api.ok(&b.token, "reservations.create", reservation(&api.pool, Some("audit-res"))).await;
    api.ok(&b.token, "instances.create", fill(&calls.iter().find(|c| c.1 == "instances.create").unwrap().2, &ids)).await;
    api.ok(&b.token, "instances.delete", fill(&json!({"instanceId": "{ins}"}), &ids)).await;
    // A change that fails inside its transaction leaves no entry.
    let (s, _) = api.call(&api.op, "vpsImages.delete", json!({"name": "debian-12"})).await;
    assert_eq!(s, 404);
    // A refusal is recorded, denied; the viewer's token was revoked above, so use a fresh one.
    let tok2 = api.ok(&b.token, "tokens.create", json!({"identityId": idn["id"]})).await;
    api.ok(&b.token, "roleBindings.create", json!({"identityId": idn["id"], "role": "tenant-viewer", "scopeKind": "tenant"})).await;
    let (s, e) = api.call(tok2["secret"].as_str().unwrap(), "webhooks.create", json!({"url": "https://example.com/x"})).await;
    assert_eq!((s, e["code"].as_str()), (403, Some("PERMISSION_DENIED")), "{e}");
    let _ = viewer;
    let rows = c
        .query("SELECT action, outcome, actor_id, token_id, tenant_id, target, request_id, source, request_digest FROM audit_entries WHERE position > $1 ORDER BY position", &[&since])
        .await
        .unwrap();
    let seen: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    // One entry per change (each method above ran once; the failed delete left none).
    for (_, method, _) in &calls {
        assert_eq!(seen.iter().filter(|(a, o)| a == method && o == "ok").count(), 1, "{method}: {seen:?}");
    }
    assert_eq!(seen.iter().filter(|(a, o)| a == "webhooks.create" && o == "denied").count(), 1, "{seen:?}");
    assert!(!seen.iter().any(|(a, _)| a.ends_with(".get") || a.ends_with(".list")), "reads are not audited: {seen:?}");
    // What an entry holds: the actor and its token, the tenant, the target, the request, the client.
    let cordon = rows.iter().find(|r| r.get::<_, String>(0) == "nodes.cordon").unwrap();
    let (target, request_id, source, digest): (String, String, String, String) = (cordon.get(5), cordon.get(6), cordon.get(7), cordon.get(8));
    assert_eq!(target, api.node);
    assert!(request_id.starts_with("req_") && source == "127.0.0.1" && digest.len() == 64, "{request_id} {source} {digest}");
    assert!(cordon.get::<_, Option<String>>(3).is_some_and(|t| t.starts_with("tok_")));
    let created = rows.iter().find(|r| r.get::<_, String>(0) == "reservations.create").unwrap();
    assert!(created.get::<_, String>(5).starts_with("res_"), "a create's target is what it made");
    let started = rows.iter().find(|r| r.get::<_, String>(0) == "workflows.start").unwrap();
    assert!(started.get::<_, String>(5).starts_with("wf_"), "a started workflow's entry names it: {:?}", started.get::<_, String>(5));
    // A retire needs a drained node: drained again, then retired, with one entry.
    api.ok(&api.op, "nodes.drain", json!({"nodeId": api.node, "reason": "audit again", "mode": "evict"})).await;
    api.h.job("drain").drain(5).await;
    api.ok(&api.op, "nodes.retire", json!({"nodeId": api.node})).await;
    let retired: i64 = c.query_one("SELECT count(*) FROM audit_entries WHERE action = 'nodes.retire' AND outcome = 'ok'", &[]).await.unwrap().get(0);
    assert_eq!(retired, 1);
    // The sweep: every mutating method has a case above, or is named as not audited yet.
    let methods: Vec<String> = api.openapi().await["paths"].as_object().unwrap().iter().filter(|(_, i)| i.get("post").is_some()).map(|(p, _)| p.trim_start_matches("/v1/").to_owned()).collect();
    let mut covered: Vec<&str> = calls.iter().map(|c| c.1).collect();
    covered.extend(["identities.create", "tokens.create", "roleBindings.create", "nodes.retire"]);
    // What each method declared at registration; a method declared a read must read by its name.
    let declared: std::collections::HashMap<&str, bool> = better_compute_api::all_methods().iter().map(|m| (m.name, m.changes)).collect();
    const READ_VERBS: &[&str] = &["get", "list", "describe", "findings", "console", "export", "proof", "availability"];
    for m in &methods {
        let changes = declared[m.as_str()];
        assert_eq!(changes, !READ_VERBS.contains(&m.rsplit('.').next().unwrap()), "{m} is declared {}", if changes { "a change" } else { "a read" });
        if !changes {
            continue;
        }
        assert!(
            covered.contains(&m.as_str()) || AUDITED_LIKE_ANOTHER.contains(&m.as_str()),
            "{m} changes something and has no audit case"
        );
    }
    for m in ["identities.create", "tokens.create", "roleBindings.create"] {
        assert!(seen.iter().any(|(a, o)| a == m && o == "ok"), "{m}: {seen:?}");
    }
    assert!(seen.len() >= calls.len() + 3, "{seen:?}");
    // Tenant B reads its own entries through the API; another tenant sees none of them.
    let page = api.ok(&b.token, "audit.list", json!({"action": "tokens.revoke"})).await;
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1), "{page}");
    let d = api.tenant("tenant-e").await;
    assert_eq!(api.ok(&d.token, "audit.list", json!({"action": "tokens.revoke"})).await["items"], json!([]));
    let fleet = api.ok(&api.op, "audit.list", json!({"allTenants": true, "action": "nodes.cordon"})).await;
    assert_eq!(fleet["items"].as_array().map(Vec::len), Some(1), "{fleet}");
    // An operator's change to B's quota is in B's log, with the operator as its actor.
    api.ok(&api.op, "quotas.set", json!({"tenantId": b.id, "resource": "gpus", "max": 7})).await;
    let quota = api.ok(&b.token, "audit.list", json!({"action": "quotas.set"})).await;
    let items = quota["items"].as_array().unwrap();
    let of_b = items.iter().filter(|e| e["target"] == json!(b.id) && e["tenantId"] == json!(b.id)).count();
    assert!(of_b >= 1, "{quota}");
    assert_eq!(items.len(), of_b, "B's log holds only changes of B's quota: {quota}");
    let of_d = api.ok(&d.token, "audit.list", json!({"action": "quotas.set"})).await;
    assert!(of_d["items"].as_array().unwrap().iter().all(|e| e["target"] == json!(d.id)), "another tenant sees only its own: {of_d}");
    // The whole log as JSON lines, for `audit verify`: operators only.
    let signer = Arc::new(better_compute_runtime::signing::CommandSigner::generate());
    let key = signer.public_key();
    assert!(api.h.registry().install_command_signer(signer));
    let total: i64 = c.query_one("SELECT count(*) FROM audit_entries", &[]).await.unwrap().get(0);
    for _ in 0..600 {
        api.h.db().advance(Duration::from_secs(10)).await;
        api.h.job("audit.checkpoint").drain(10).await;
        let placed: i64 = c.query_one("SELECT count(*) FROM audit_entries WHERE log_index IS NOT NULL", &[]).await.unwrap().get(0);
        if placed >= total {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = api.http.get(format!("{}/v1/audit.export", api.url)).bearer_auth(&api.op).send().await.unwrap();
    assert_eq!((r.status().as_u16(), r.headers()["content-type"].to_str().unwrap().to_owned()), (200, "application/x-ndjson".to_owned()));
    let lines: Vec<better_compute_audit::verify::ExportLine> = r.text().await.unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let v = better_compute_audit::verify::verify(&lines, Some(&key));
    assert!(v.problem.is_none() && v.entries as i64 >= total && v.checkpoints >= 1, "{v:?}");
    assert_eq!(api.http.get(format!("{}/v1/audit.export", api.url)).bearer_auth(&b.token).send().await.unwrap().status(), 403, "a tenant proves its entries instead");
}

/// A CA and a certificate from it for 127.0.0.1: (CA PEM, certificate PEM, key PEM).
fn tls_identity() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap().signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_serves_https_and_a_renewed_certificate_reaches_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (cert_file, key_file) = (dir.path().join("api.pem"), dir.path().join("api.key"));
    let (ca1, cert1, key1) = tls_identity();
    std::fs::write(&cert_file, &cert1).unwrap();
    std::fs::write(&key_file, &key1).unwrap();
    let tls = better_compute_api::tls::server_config(cert_file.clone(), key_file.clone()).unwrap();
    let api = Api::start_serving(|_| {}, better_compute_api::http::HttpSettings { tls: Some(tls), ..Default::default() }).await;
    let url = api.url.replace("http://", "https://");
    // A new client per call: a new connection, so a new handshake.
    let get = |ca: &str| {
        let client = better_compute_client::http_trusting(Some(ca.as_bytes())).unwrap().build().unwrap();
        let u = format!("{url}/v1/openapi.json");
        async move { client.get(u).send().await.map(|r| r.status().as_u16()).map_err(|e| format!("{e:?}")) }
    };
    assert_eq!(get(&ca1).await, Ok(200));
    assert_eq!(api.http.get(format!("{}/healthz", api.url)).send().await.ok().map(|r| r.status().as_u16()), None, "plain HTTP to the HTTPS port gets no answer");
    // Renewed by another CA on disk: the next connection gets the new certificate.
    let (ca2, cert2, key2) = tls_identity();
    std::fs::write(&key_file, &key2).unwrap();
    std::fs::write(&cert_file, &cert2).unwrap();
    assert_eq!(get(&ca2).await, Ok(200));
    assert!(get(&ca1).await.is_err(), "the old CA no longer vouches for what is served");
    // A broken renewal keeps the last good certificate.
    std::fs::write(&cert_file, "half-written").unwrap();
    assert_eq!(get(&ca2).await, Ok(200));
    // A certificate that does not load is refused at start, naming the files.
    let e = better_compute_api::tls::server_config(cert_file.clone(), key_file.clone()).unwrap_err().to_string();
    assert!(e.contains("api.pem") && e.contains("api.key"), "{e}");
}
