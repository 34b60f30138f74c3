//! Reference pages generated from the registry cannot drift from it.

#[test]
fn the_command_kinds_reference_page_matches_the_registry() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "command-kinds"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/command-kinds.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        on_disk,
        String::from_utf8(out.stdout).unwrap(),
        "docs/command-kinds.md drifted from the registry; regenerate it: cargo run -- docs command-kinds > docs/command-kinds.md"
    );
    assert!(on_disk.contains("| `node.reboot` | power | 900 s | no | yes | yes | yes | `NodeReboot` |"));
}

#[test]
fn the_workflow_definitions_page_matches_the_registry() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "workflows"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/workflow-definitions.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        on_disk,
        String::from_utf8(out.stdout).unwrap(),
        "docs/workflow-definitions.md drifted from the registry; regenerate it: cargo run -- docs workflows > docs/workflow-definitions.md"
    );
    assert!(on_disk.contains("## `node.maintenance`") && on_disk.contains("| `reboot` | 2 | 30 s |"));
}

#[test]
fn the_api_reference_page_matches_the_openapi_document() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "api"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/api.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(on_disk, String::from_utf8(out.stdout).unwrap(), "docs/api.md drifted from the API; regenerate it: cargo run -- docs api > docs/api.md");
    assert!(on_disk.contains("## `reservations.create`") && on_disk.contains("| `idempotencyKey` | string | no |"));
}

#[test]
fn the_event_catalogue_page_matches_the_registry() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "events"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/events.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(on_disk, String::from_utf8(out.stdout).unwrap(), "docs/events.md drifted from the registry; regenerate it: cargo run -- docs events > docs/events.md");
    assert!(on_disk.contains("| `reservation.placed` | 1 | tenant |"));
}

#[test]
fn the_clients_openapi_document_matches_the_api() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "openapi"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/openapi.json");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        on_disk,
        String::from_utf8(out.stdout).unwrap(),
        "crates/client/openapi.json drifted from the API, so the typed client is stale; regenerate it: cargo run -- docs openapi > crates/client/openapi.json"
    );
    assert!(on_disk.contains("\"operationId\": \"reservations.create\""));
}
