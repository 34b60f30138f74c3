//! Reference pages generated from the registry cannot drift from it.

/// The checked-in `file` (from the repository's root) equals what `docs PAGE` prints, and holds
/// `sample`; the message says how to regenerate it.
fn page_matches(page: &str, file: &str, source: &str, sample: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute")).args(["docs", page]).output().unwrap();
    assert!(out.status.success());
    let on_disk = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(file)).unwrap_or_default();
    assert_eq!(on_disk, String::from_utf8(out.stdout).unwrap(), "{file} drifted from {source}; regenerate it: cargo run -- docs {page} > {file}");
    assert!(on_disk.contains(sample), "{file} lacks {sample:?}");
}

#[test]
fn the_command_kinds_reference_page_matches_the_registry() {
    page_matches("command-kinds", "docs/command-kinds.md", "the registry", "| `node.reboot` | power | 900 s | no | yes | yes | yes | `NodeReboot` |");
}

#[test]
fn the_workflow_definitions_page_matches_the_registry() {
    page_matches("workflows", "docs/workflow-definitions.md", "the registry", "| `reboot` | 2 | 30 s |");
}

#[test]
fn the_api_reference_page_matches_the_openapi_document() {
    page_matches("api", "docs/api.md", "the API", "| `idempotencyKey` | string | no |");
}

#[test]
fn the_event_catalogue_page_matches_the_registry() {
    page_matches("events", "docs/events.md", "the registry", "| `reservation.placed` | 1 | tenant |");
}

#[test]
fn the_clients_openapi_document_matches_the_api() {
    // The typed client is generated from it: a stale copy is a stale client.
    page_matches("openapi", "crates/client/openapi.json", "the API", "\"operationId\": \"reservations.create\"");
}

#[test]
fn the_metrics_page_matches_the_catalogue() {
    page_matches("metrics", "docs/metrics.md", "runtime::metrics::CATALOGUE", "| `better_compute_job_runs_total` | counter | job, outcome | worker |");
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

/// The jobs the spec's desired-state page lists ("With every module registered, the runtime runs
/// these jobs: …"), as the registry of every module names them. The modules of those named in
/// `NOT_BUILT` do not exist yet; each leaves that list when its module lands. Beyond the list, the
/// runtime runs `housekeeping` (expired idempotency keys, long-dead workers' rows).
#[test]
fn the_registry_of_every_module_runs_the_jobs_the_spec_lists() {
    const SPEC: &[&str] = &[
        "node", "nodespec", "liveness", "drain", "site-boot", "inventory", "inventory.hygiene", "health", "capacity.reservations",
        "capacity.rollup", "capacity.usage", "capacity.mig", "workflow", "metal", "vps.instances", "vps.hosts", "vps.bootstraps",
        "vps.usage", "fleet.drift", "rollout", "audit.checkpoint", "events.fanout", "events.deliver", "events.prune",
        "command-sweeper", "outbox-dispatch", "event-subscribers",
    ];
    const NOT_BUILT: &[&str] = &["capacity.mig", "metal", "fleet.drift", "rollout"];
    const BEYOND: &[&str] = &["housekeeping"];
    let registry = better_compute_server::registry().unwrap();
    let mut runs: Vec<&str> = registry.job_names();
    runs.sort();
    let mut listed: Vec<&str> = SPEC.iter().chain(BEYOND).copied().filter(|j| !NOT_BUILT.contains(j)).collect();
    listed.sort();
    assert_eq!(runs, listed);
}
