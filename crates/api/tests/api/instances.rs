//! Instances through the API: once per key, read, listed, deleted.

use super::*;
use crate::watch::sse_until_quiet;

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
