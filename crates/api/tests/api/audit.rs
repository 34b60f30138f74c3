//! Every change through the API writes one audit entry with it, and a refusal one denied.

use super::*;

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
