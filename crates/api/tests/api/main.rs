//! The HTTP API against a real PostgreSQL, one module per concept; this file holds what they share:
//! an API over a harness with every module, tenants with their tokens, and request bodies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use better_compute_api::ApiState;
use better_compute_iam::Iam;
use better_compute_nodes::inventory::{self, NewGpu, NewNode, NewPool};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::harness::Harness;
use serde_json::{json, Value};

mod audit;
mod http;
mod iam;
mod idempotency;
mod instances;
mod isolation;
mod operators;
mod tokens;
mod usage;
mod watch;
mod workflows;

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

/// An `instances.create` body with a new one-GPU reservation in `pool`.
fn instance(pool: &str, key: &str) -> Value {
    json!({"poolId": pool, "gpu": {"kind": "gpu", "model": "H100", "count": 1}, "vcpu": 4, "memoryMib": 8192, "diskGib": 20, "durationS": 3600,
           "image": "debian-12", "sshPublicKeys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 me@laptop"], "idempotencyKey": key})
}
