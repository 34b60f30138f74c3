//! Operators' views: roles and pages, health and readiness (clock skew too), per-method metrics, GPUs, labels, conditions and drains.

use super::*;

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
