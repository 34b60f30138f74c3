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

#[test]
fn the_metrics_page_matches_the_catalogue() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", "metrics"]).output().unwrap();
    assert!(out.status.success());
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/metrics.md");
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        on_disk,
        String::from_utf8(out.stdout).unwrap(),
        "docs/metrics.md drifted from runtime::metrics::CATALOGUE; regenerate it: cargo run -- docs metrics > docs/metrics.md"
    );
    assert!(on_disk.contains("| `better_compute_job_runs_total` | counter | job, outcome | worker |"));
}

#[test]
fn completions_know_the_commands_flags_and_api_methods_and_man_pages_cover_each_command() {
    let bin = env!("CARGO_BIN_EXE_better-compute");
    for shell in ["bash", "zsh", "fish"] {
        let out = std::process::Command::new(bin).args(["completions", shell]).output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        for want in ["reservations.create", "instances.console", "log-format", "metrics-listen"] {
            assert!(text.contains(want), "{shell} completions lack {want}");
        }
    }
    assert_eq!(std::process::Command::new(bin).args(["completions", "tcsh"]).output().unwrap().status.code(), Some(2));
    let dir = tempfile::tempdir().unwrap();
    assert!(std::process::Command::new(bin).arg("man").arg(dir.path()).status().unwrap().success());
    let mut pages: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    pages.sort();
    assert!(pages.len() >= 15, "{pages:?}");
    for want in ["better-compute.1", "better-compute-server.1", "better-compute-api.1", "better-compute-daemon.1"] {
        assert!(pages.contains(&want.to_owned()), "{want} missing: {pages:?}");
    }
    let server = std::fs::read_to_string(dir.path().join("better-compute-server.1")).unwrap();
    assert!(server.starts_with(".ie") || server.contains(".TH"), "{server}");
    assert!(server.contains("metrics\\-listen"), "{server}");
}
