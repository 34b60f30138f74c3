//! What `deploy/` ships holds against the code: the alert rules and the dashboard name only metrics
//! the control plane writes, and a server process serves them on `--metrics-listen`, with JSON logs,
//! and exports its traces to an OTLP collector.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use better_compute_db::testing::TestDb;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use better_compute_runtime::metrics::Metric;

/// Every metric the control plane writes.
fn catalogue() -> Vec<Metric> {
    better_compute_server::metric_catalogue(&better_compute_server::registry().unwrap())
}

fn in_catalogue(series: &str) -> bool {
    better_compute_runtime::metrics::in_catalogue(&catalogue(), series)
}

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

/// Every `better_compute_…` name in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("better_compute_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')).unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[test]
fn the_alert_rules_and_the_dashboard_name_only_metrics_of_the_catalogue() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    for file in ["prometheus/alerts.yaml", "grafana/better-compute.json"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let names = metric_names(&text);
        assert!(names.len() >= 10, "{file} names {} metrics", names.len());
        let unknown: Vec<&String> = names.iter().filter(|n| !in_catalogue(n)).collect();
        assert!(unknown.is_empty(), "{file} names metrics the control plane does not write: {unknown:?}");
    }
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("grafana/better-compute.json")).unwrap()).unwrap();
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 10));
}

/// `GET path` on `addr`: the status and the body.
fn get_any(addr: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head[9..12].parse().unwrap(), body.to_owned())
}

/// Applies every migration to the database at `url`, as an operator would.
fn migrate(url: &str) {
    let migrated = Command::new(BIN).args(["migrate", "--database-url", url]).output().unwrap();
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
}

/// Reads a server's stdout until a line starts with `prefix`, and returns the rest of that line.
fn printed(server: &mut std::process::Child, prefix: &str) -> (String, std::io::Lines<BufReader<std::process::ChildStdout>>) {
    let mut out = BufReader::new(server.stdout.take().unwrap()).lines();
    loop {
        let line = out.next().unwrap_or_else(|| panic!("the server printed no line starting with {prefix:?}")).unwrap();
        if let Some(rest) = line.strip_prefix(prefix) {
            return (rest.to_owned(), out);
        }
    }
}

/// `GET path` on `addr`, answered 200: the body.
fn get(addr: &str, path: &str) -> String {
    let (status, body) = get_any(addr, path);
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_and_gateway_serve_metrics_and_readiness_on_their_own_listener_and_log_json() {
    let db = TestDb::core().await;
    let url = db.connection_string().to_owned();
    let ca = tempfile::tempdir().unwrap();
    let ca_dir = ca.path().to_str().unwrap().to_owned();
    let (exposition, log_lines) = tokio::task::spawn_blocking(move || {
        migrate(&url);
        let mut server = Command::new(BIN)
            .args(["--log-format", "json", "server", "--roles", "worker,gateway", "--gateway-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--ca-dir", &ca_dir, "--database-url", &url])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (addr, _out) = printed(&mut server, "metrics on http://");
        let addr = addr.trim_end_matches("/metrics").to_owned();
        // The worker runs its jobs at once (every periodic one is due at start); wait for a run.
        let mut text = String::new();
        for _ in 0..300 {
            text = get(&addr, "/metrics");
            if text.contains("better_compute_job_runs_total{") {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(get(&addr, "/healthz"), "ok\n");
        // Ready: the database's checks and each role's own.
        let ready: serde_json::Value = serde_json::from_str(&get(&addr, "/readyz")).unwrap();
        let names: Vec<&str> = ready["checks"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!((ready["ready"].as_bool(), names), (Some(true), vec!["clock.skew", "migrations", "worker", "gateway"]), "{ready}");
        // Another owner takes the gateway's lease: not ready, and the check says why.
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let c = better_compute_db::pool::connect(&url).await.unwrap();
            assert_eq!(c.execute("UPDATE leases SET owner = 'gw_someone_else' WHERE name LIKE 'gateway:%'", &[]).await.unwrap(), 1);
        });
        let (status, body) = get_any(&addr, "/readyz");
        assert!(status == 503 && body.contains("lost its lease"), "{status} {body}");
        // SAFETY: signalling our own child.
        unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
        let status = server.wait().unwrap();
        assert!(status.success(), "{status}");
        let mut err = String::new();
        server.stderr.take().unwrap().read_to_string(&mut err).unwrap();
        (text, err.lines().map(str::to_owned).collect::<Vec<_>>())
    })
    .await
    .unwrap();
    // Its counters, and the fleet's gauges sampled from the database at the scrape.
    for want in ["better_compute_build_info{version=", "better_compute_job_runs_total{job=", "better_compute_job_run_seconds_bucket{job=", "better_compute_job_queue_depth{job=\"health\"}", "better_compute_leases_held{kind=\"shard\"} 256", "better_compute_workers_live 1", "better_compute_outbox_lag_events{sink=", "# HELP better_compute_job_runs_total"] {
        assert!(exposition.contains(want), "no {want:?} in:\n{exposition}");
    }
    let names = metric_names(&exposition);
    assert!(names.len() >= 20, "{exposition}");
    let unknown: Vec<&String> = names.iter().filter(|n| !in_catalogue(n)).collect();
    assert!(unknown.is_empty(), "written but not in the catalogue (docs/metrics.md): {unknown:?}");
    assert!(catalogue().iter().any(|c| c.name == "better_compute_job_runs_total"));
    // Every log line is one JSON object with a level and a message.
    assert!(!log_lines.is_empty());
    for line in &log_lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v["level"].is_string() && v["fields"]["message"].is_string(), "{line}");
    }
}

#[test]
fn the_debian_package_holds_the_binary_the_units_and_their_settings() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = tempfile::tempdir().unwrap();
    // Uncompressed: the test binary is large, and compression is not what is tested.
    let built = Command::new(repo.join("scripts/package-deb")).arg(BIN).arg(out.path()).env("DEB_COMPRESSION", "none").output().unwrap();
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let deb = String::from_utf8(built.stdout).unwrap().trim().to_owned();
    let field = |f: &str| String::from_utf8(Command::new("dpkg-deb").args(["--field", &deb, f]).output().unwrap().stdout).unwrap().trim().to_owned();
    assert_eq!(field("Package"), "better-compute");
    assert_eq!(field("Version"), env!("CARGO_PKG_VERSION"));
    let listing = String::from_utf8(Command::new("dpkg-deb").args(["--contents", &deb]).output().unwrap().stdout).unwrap();
    let files: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().nth(5)).collect();
    for want in [
        "./usr/bin/better-compute",
        "./lib/systemd/system/better-compute-server.service",
        "./lib/systemd/system/better-compute-daemon.service",
        "./etc/better-compute/server.env",
        "./etc/better-compute/daemon.env",
        "./usr/share/better-compute/prometheus/alerts.yaml",
    ] {
        assert!(files.contains(&want), "{want} is not in the package: {files:?}");
    }
    let conffiles = Command::new("dpkg-deb").args(["--info", &deb, "conffiles"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&conffiles.stdout), "/etc/better-compute/server.env\n/etc/better-compute/daemon.env\n");
    // Each unit runs the packaged binary with the packaged settings, and every variable the server
    // settings set is one the binary reads (a typo would be silently ignored).
    for (unit, env) in [("better-compute-server.service", "server.env"), ("better-compute-daemon.service", "daemon.env")] {
        let text = std::fs::read_to_string(repo.join("deploy/systemd").join(unit)).unwrap();
        assert!(text.contains("ExecStart=/usr/bin/better-compute ") && text.contains(&format!("EnvironmentFile=/etc/better-compute/{env}")), "{unit}");
    }
    let server_help = String::from_utf8(Command::new(BIN).args(["server", "--help"]).output().unwrap().stdout).unwrap();
    let settings = std::fs::read_to_string(repo.join("deploy/debian/server.env")).unwrap();
    let vars: Vec<&str> = settings.lines().map(|l| l.trim_start_matches('#')).filter_map(|l| l.split_once('=')).map(|(k, _)| k).filter(|k| k.starts_with("BETTER_COMPUTE_") || *k == "DATABASE_URL").collect();
    assert!(vars.len() >= 8, "{vars:?}");
    for v in vars {
        let global = ["BETTER_COMPUTE_LOG", "BETTER_COMPUTE_LOG_FORMAT"].contains(&v);
        assert!(global || server_help.contains(&format!("[env: {v}")), "server.env sets {v}, which `server` does not read");
    }
    // The image builds the same binary and runs it as `server` by default.
    let dockerfile = std::fs::read_to_string(repo.join("deploy/Dockerfile")).unwrap();
    assert!(dockerfile.contains("cargo build --release --locked -p better-compute") && dockerfile.contains(r#"ENTRYPOINT ["/usr/bin/better-compute"]"#));
}

/// A stand-in OTLP/HTTP collector on a free port: its base URL, and every `POST /v1/traces` it
/// took, decoded. HTTP/1.1 with keep-alive, bodies by Content-Length, as the exporter sends them.
fn collector() -> (String, Arc<Mutex<Vec<ExportTraceServiceRequest>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let took = Arc::new(Mutex::new(Vec::new()));
    let sink = took.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            let sink = sink.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    assert!(line.starts_with("POST /v1/traces "), "{line}");
                    let mut len = 0;
                    loop {
                        let mut header = String::new();
                        reader.read_line(&mut header).unwrap();
                        let header = header.trim_end();
                        if header.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = header.split_once(':') && k.eq_ignore_ascii_case("content-length") {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    reader.read_exact(&mut body).unwrap();
                    sink.lock().unwrap().push(prost::Message::decode(body.as_slice()).unwrap());
                    conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n").unwrap();
                }
            });
        }
    });
    (format!("http://{addr}"), took)
}

/// Every span the collector took: (service name, span).
fn spans_of(took: &[ExportTraceServiceRequest]) -> Vec<(String, opentelemetry_proto::tonic::trace::v1::Span)> {
    let mut out = Vec::new();
    for request in took {
        for rs in &request.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| a.value.as_ref())
                .and_then(|v| match &v.value {
                    Some(opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in &rs.scope_spans {
                out.extend(ss.spans.iter().map(|s| (service.clone(), s.clone())));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_otlp_endpoint_a_server_exports_its_request_and_reconcile_spans_joining_the_callers_trace() {
    let db = TestDb::core().await;
    let url = db.connection_string().to_owned();
    let ca = tempfile::tempdir().unwrap();
    let ca_dir = ca.path().to_str().unwrap().to_owned();
    let (endpoint, took) = collector();
    let took_here = took.clone();
    tokio::task::spawn_blocking(move || {
        migrate(&url);
        let boot = Command::new(BIN).args(["admin", "bootstrap", "--database-url", &url]).output().unwrap();
        let boot = String::from_utf8(boot.stdout).unwrap();
        let token = boot.lines().find_map(|l| l.strip_prefix("export BETTER_COMPUTE_TOKEN=")).expect("a token").to_owned();
        let mut server = Command::new(BIN)
            .args(["server", "--roles", "api,worker", "--api-listen", "127.0.0.1:0", "--ca-dir", &ca_dir, "--database-url", &url, "--otlp-endpoint", &endpoint])
            // Batches every 100 ms instead of 5 s, so the test waits less.
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let (addr, _out) = printed(&mut server, "api listening on http://");
        // A request in a caller's trace.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "POST /v1/nodes.list HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n\
             traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // The worker runs its jobs at once (every periodic one is due at start).
        for _ in 0..300 {
            let spans = spans_of(&took.lock().unwrap());
            if spans.iter().any(|(_, s)| s.name == "api nodes.list") && spans.iter().any(|(_, s)| s.name.starts_with("reconcile ")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: signalling our own child.
        unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
        assert!(server.wait().unwrap().success());
    })
    .await
    .unwrap();
    let spans = spans_of(&took_here.lock().unwrap());
    let api: Vec<_> = spans.iter().filter(|(_, s)| s.name == "api nodes.list").collect();
    assert_eq!(api.len(), 1, "{spans:?}");
    let (service, span) = api[0];
    assert_eq!(service, "better-compute-server");
    assert_eq!((hex::encode(&span.trace_id), hex::encode(&span.parent_span_id)), ("0af7651916cd43dd8448eb211c80319c".to_owned(), "b7ad6b7169203331".to_owned()));
    // SpanKind::Server.
    assert_eq!(span.kind, 2);
    assert!(spans.iter().any(|(_, s)| s.name.starts_with("reconcile ") && s.parent_span_id.is_empty()), "{spans:?}");
}
