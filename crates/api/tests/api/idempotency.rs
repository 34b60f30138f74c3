//! Idempotency keys through HTTP: replays, a changed body refused, one identity's keys, concurrent repeats.

use super::*;

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
