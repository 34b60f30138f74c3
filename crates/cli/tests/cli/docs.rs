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
    page_matches("metrics", "docs/metrics.md", "the metric catalogue (server::metric_catalogue)", "| `better_compute_job_runs_total` | counter | job, outcome | worker |");
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

/// A job's file: `crates/<module>/src/jobs/<kind>.rs`, the kind without its module's prefix, dots
/// and dashes as underscores (`inventory.hygiene` → `jobs/inventory_hygiene.rs`).
fn job_file(module: &str, kind: &str) -> std::path::PathBuf {
    let stem = kind.strip_prefix(&format!("{module}.")).unwrap_or(kind).replace(['.', '-'], "_");
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join("crates").join(module).join("src/jobs").join(format!("{stem}.rs"))
}

fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_job_lives_in_a_file_named_for_it_in_its_modules_jobs_folder() {
    let registry = better_compute_server::registry().unwrap();
    let mut jobs: Vec<(&str, String)> = Vec::new();
    for m in registry.modules() {
        jobs.extend(m.reconcilers().iter().map(|r| (m.name(), r.kind().name.to_owned())));
        jobs.extend(m.outbox_sinks().iter().map(|s| (m.name(), s.name().to_owned())));
    }
    // The registry's own jobs (the NodeSpec controller, workflows, housekeeping) are the runtime's.
    for r in registry.reconcilers() {
        if !jobs.iter().any(|(_, k)| k == r.kind().name) {
            jobs.push(("runtime", r.kind().name.to_owned()));
        }
    }
    for (module, kind) in &jobs {
        let file = job_file(module, kind);
        let text = std::fs::read_to_string(&file).unwrap_or_else(|_| panic!("the job {kind} of {module} must live in {}", file.display()));
        assert!(text.contains("Reconciler for") || text.contains("Sink for"), "{} holds no job", file.display());
    }
    // Every file in a jobs folder is a job, and no job is implemented outside one.
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&crates).unwrap() {
        let dir = e.unwrap().path().join("src");
        // The bench's no-op job is a fixture of its own measurements.
        if dir.is_dir() && !dir.starts_with(crates.join("bench")) {
            rust_files(&dir, &mut files);
        }
    }
    let mut in_jobs = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let is_job = text.lines().any(|l| l.starts_with("impl Reconciler for") || l.starts_with("impl better_compute_runtime::Reconciler for"));
        let under_jobs = f.parent().is_some_and(|p| p.ends_with("jobs"));
        if under_jobs && !f.ends_with("mod.rs") {
            in_jobs += 1;
            assert!(jobs.iter().any(|(m, k)| job_file(m, k) == *f || job_file(m, k).canonicalize().ok() == f.canonicalize().ok()), "{} is in a jobs folder but is no registered job", f.display());
        } else {
            assert!(!is_job, "{} implements a job outside its module's src/jobs/", f.display());
        }
    }
    assert_eq!(in_jobs, jobs.len(), "one file per job: {jobs:?}");
}

#[test]
fn every_api_field_of_seconds_is_named_with_the_short_unit() {
    fn names(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(serde_json::Value::Object(p)) = m.get("properties") {
                    out.extend(p.keys().cloned());
                }
                m.values().for_each(|v| names(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| names(v, out)),
            _ => {}
        }
    }
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/openapi.json")).unwrap()).unwrap();
    let mut all = Vec::new();
    names(&doc, &mut all);
    assert!(all.iter().any(|n| n == "durationS") && all.iter().any(|n| n == "ttlS"), "{all:?}");
    // Usage quantities (GPU-seconds, vCPU-seconds, …) are amounts, not durations.
    const QUANTITIES: &[&str] = &["atomSeconds", "vcpuSeconds", "memoryMibSeconds", "diskGibSeconds", "instanceSeconds"];
    let long: Vec<&String> = all.iter().filter(|n| n.ends_with("Seconds") && !QUANTITIES.contains(&n.as_str())).collect();
    assert!(long.is_empty(), "durations are named with `S` (durationS, ttlS): {long:?}");
}

#[test]
fn every_metric_is_a_prometheus_name_of_ours_declared_once_by_the_crate_that_writes_it() {
    let registry = better_compute_server::registry().unwrap();
    let all = better_compute_server::metric_catalogue(&registry);
    let mut seen = std::collections::HashSet::new();
    for c in &all {
        assert!(seen.insert(c.name), "{} declared twice", c.name);
        assert!(c.name.starts_with("better_compute_") && c.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{}", c.name);
        let counter = c.kind == better_compute_runtime::metrics::MetricKind::Counter;
        assert_eq!(counter, c.name.ends_with("_total"), "{}: counters and only counters end in _total", c.name);
    }
    // Each module's own, beside the runtime's.
    let of = |module: &str| registry.modules().iter().find(|m| m.name() == module).unwrap().metrics().iter().map(|m| m.name).collect::<Vec<_>>();
    assert_eq!(of("capacity"), ["better_compute_placements_total", "better_compute_placer_replans_total"]);
    assert_eq!(of("events"), ["better_compute_webhook_deliveries_total"]);
    assert_eq!(seen.len(), all.len());
    assert!(all.len() >= 24, "{}", all.len());
}
