//! Workflows through the API: once per key, bad input refused with stable codes, cancel.

use super::*;

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
