//! `better-compute dev` as a user runs it: it starts, refuses a second copy on the same folder,
//! stops cleanly on Ctrl-C, and keeps its data across restarts, even after being killed. And
//! `better-compute up`, the scale-out shape, losing one process of each role under load. And the
//! web console in a real browser (headless Chromium) against a dev fleet.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

struct Dev {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Dev {
    fn start(dir: &Path) -> Dev {
        Dev::run(&["dev", "--api-listen", "127.0.0.1:0"], dir, &[])
    }

    /// `better-compute <args> --data-dir <dir>` with `env`, its stdout read line by line.
    fn run(args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Dev {
        let mut child = Command::new(BIN)
            .args(args)
            .envs(env.iter().copied())
            .arg("--data-dir")
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn better-compute dev");
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Dev { child, lines: rx, seen: Vec::new() }
    }

    /// Reads output until a line starts with `prefix`; fails loudly after two minutes.
    fn wait_for(&mut self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(120)) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(e) => panic!("no line starting with {prefix:?} ({e}); output so far:\n{}", self.seen.join("\n")),
            }
        }
    }

    fn database_url(&mut self) -> String {
        self.ready().0
    }

    /// The database URL and the API's environment (`BETTER_COMPUTE_URL`, `_TENANT`, `_TOKEN`).
    fn ready(&mut self) -> (String, Vec<(String, String)>) {
        let line = self.wait_for("ready: DATABASE_URL=");
        let mut words = line.trim_start_matches("ready: ").split_whitespace();
        let url = words.next().unwrap().trim_start_matches("DATABASE_URL=").to_owned();
        let env = words.filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
        (url, env)
    }

    fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    fn wait_exit(mut self) -> (std::process::ExitStatus, Vec<String>) {
        for _ in 0..1200 {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
                    self.seen.push(line);
                }
                return (status, std::mem::take(&mut self.seen));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        panic!("better-compute dev did not exit; output:\n{}", self.seen.join("\n"));
    }
}

impl Drop for Dev {
    /// A failed assertion must not leave a dev (and its PostgreSQL) running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
            for _ in 0..300 {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
        }
    }
}

async fn query_one_i64(url: &str, sql: &str) -> i64 {
    let client = better_compute_db::pool::connect(url).await.expect("connect to dev database");
    client.query_one(sql, &[]).await.expect(sql).get(0)
}

fn first_line_with<'a>(lines: &'a [String], needle: &str) -> Option<&'a str> {
    lines.iter().map(String::as_str).find(|l| l.contains(needle))
}

fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bc-dev-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::too_many_lines, reason = "a test: one scenario (second copy, Ctrl-C, restarts, kills) with its assertions in order")]
async fn dev_refuses_a_second_copy_stops_on_ctrl_c_and_keeps_data_across_restarts_and_kills() {
    let dir = scratch_dir();

    let mut first = Dev::start(&dir);
    let (url, env) = first.ready();
    let api = |args: &[&str]| {
        let out = Command::new(BIN).arg("api").args(args).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let client = better_compute_db::pool::connect(&url).await.unwrap();
    client.batch_execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (42);").await.unwrap();
    // dev runs a worker: it registers and, within moments, holds every shard.
    let mut shards = 0i64;
    for _ in 0..600 {
        shards = client
            .query_one("SELECT count(*) FROM leases WHERE name LIKE 'shard:%' AND owner LIKE 'wrk_%'", &[])
            .await
            .unwrap()
            .get(0);
        if shards == 256 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(shards, 256);
    drop(client);
    // The demo fleet's capacity appears once the worker has rolled it up.
    let mut rolled = false;
    for _ in 0..600 {
        let c = better_compute_db::pool::connect(&url).await.unwrap();
        if c.query_one("SELECT count(*) FROM pool_capacity_rollup", &[]).await.unwrap().get::<_, i64>(0) == 3 {
            rolled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(rolled, "the rollup never ran");
    // Three pools: vms (a vps-host), gpus (bare metal; GPU 7 of its first node in MIG, of its second time-sliced) and
    // burst (a provider's). The mode changes and the rollup are jobs of their own, running side by
    // side, so the rollup may first show the pools before the changes: wait for them.
    let mut text = String::new();
    for _ in 0..600 {
        let cap = Command::new(BIN).args(["capacity", "--database-url", &url]).output().unwrap();
        text = String::from_utf8_lossy(&cap.stdout).into_owned();
        if text.contains("H100-80GB: 14 of 14 idle") && text.contains("3g.40gb: 2 of 2 idle") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(text.contains("pool dev/gpus") && text.contains("H100-80GB: 14 of 14 idle") && text.contains("3g.40gb: 2 of 2 idle"), "{text}");
    assert!(text.contains("pool dev/burst") && text.contains("H100-80GB: 16 of 16 idle"), "{text}");
    // Every demo node joined through the gateway and applied its desired state.
    let nodes = Command::new(BIN).args(["nodes", "list", "--database-url", &url]).output().unwrap();
    let text = String::from_utf8_lossy(&nodes.stdout);
    assert!(text.contains("GENERATION") && text.matches("dev-node-").count() == 4 && text.matches("dev-vps-").count() == 1, "{text}");
    // The operator commands take -o as the API's do.
    let listed = Command::new(BIN).args(["nodes", "list", "-o", "json", "--database-url", &url]).output().unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(listed["items"].as_array().map(Vec::len), Some(5), "{listed}");
    let jobs = Command::new(BIN).args(["jobs", "-o", "jsonpath=.queues[*].job", "--database-url", &url]).output().unwrap();
    let jobs = String::from_utf8_lossy(&jobs.stdout).into_owned();
    assert!(jobs.lines().any(|l| l == "health") && jobs.lines().any(|l| l == "audit.checkpoint"), "{jobs}");
    let pools = Command::new(BIN).args(["capacity", "-o", "jsonpath=.items[*].pool", "--database-url", &url]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&pools.stdout).lines().count(), 3, "{}", String::from_utf8_lossy(&pools.stdout));
    // A command through the API client: queued for the node, a retry with the same key is the same
    // command, and the node's daemon runs it.
    let node = text.lines().find_map(|l| l.split_whitespace().next().filter(|w| w.starts_with("node_"))).unwrap().to_owned();
    let run = |key: &str| {
        let node_arg = format!("nodeId={node}");
        let key_arg = format!("idempotencyKey={key}");
        let (ok, out, err) = api(&["commands.run", &node_arg, "kind=inventory.refresh", r#"payload:={"sections":["gpus"]}"#, &key_arg, "-o", "json"]);
        assert!(ok, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let queued = run("refresh-1");
    assert_eq!((queued["state"].as_str(), queued["seq"].as_i64()), (Some("pending"), Some(1)));
    assert_eq!(run("refresh-1")["id"], queued["id"]);
    let node_arg = format!("nodeId={node}");
    let cmd_arg = format!("commandId={}", queued["id"].as_str().unwrap());
    let (ok, out, err) = api(&["commands.get", &node_arg, &cmd_arg]);
    assert!(ok && out.contains("inventory.refresh"), "{out}{err}");
    // A reservation through the API client, on the demo pool dev printed: placed (--wait shows
    // progress until it is), read back, and its node converges.
    let pool = first_line_with(&first.seen, "poolId=pool_").and_then(|l| l.split("poolId=").nth(1)).and_then(|r| r.split_whitespace().next()).expect("dev printed the demo pool").to_owned();
    let pool_arg = format!("poolId={pool}");
    let (ok, out, err) = api(&["reservations.create", &pool_arg, "gpu.kind=gpu", "gpu.model=H100-80GB", "gpu.count:=2", "vcpu:=8", "durationS:=3600", "idempotencyKey=first", "--wait", "-o", "json"]);
    assert!(ok, "{err}");
    let reservation: serde_json::Value = serde_json::from_str(&out).unwrap();
    // Placed, and active as soon as the worker sees its start has come.
    assert!(reservation["state"] == "placed" || reservation["state"] == "active", "{reservation}");
    let res_arg = format!("reservationId={}", reservation["id"].as_str().unwrap());
    let (ok, out, _) = api(&["reservations.get", &res_arg]);
    assert!(ok && (out.contains("placed") || out.contains("active")) && out.contains(reservation["id"].as_str().unwrap()), "{out}");
    // The events, live: `api watch` from the start shows the reservation's placement.
    let mut watch = Command::new(BIN)
        .args(["api", "watch", "lastEventId=0-0", "-o", "json"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (wtx, wrx) = mpsc::channel();
    let wout = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(wout).lines().map_while(Result::ok) {
            if wtx.send(line).is_err() {
                break;
            }
        }
    });
    let wanted = format!("\"subject\":\"{}\"", reservation["id"].as_str().unwrap());
    let mut seen_placed = false;
    while let Ok(line) = wrx.recv_timeout(Duration::from_secs(30)) {
        if line.contains("\"type\":\"reservation.placed\"") && line.contains(&wanted) {
            seen_placed = true;
            break;
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(seen_placed, "api watch never showed the reservation's placement");
    let (ok, out, _) = api(&["reservations.list"]);
    assert!(ok && out.starts_with("STATE ") && out.contains(reservation["id"].as_str().unwrap()), "{out}");
    // A profile instead of variables: login checks the token and saves it, mode 0600.
    let home = tempfile::tempdir().unwrap();
    let var = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    let login = |token: &str| {
        Command::new(BIN).args(["login", "--url", &var("BETTER_COMPUTE_URL"), "--profile", "dev", "--token", token]).env("XDG_CONFIG_HOME", home.path()).output().unwrap()
    };
    let refused = login("bct_not_a_token");
    assert_eq!(refused.status.code(), Some(1), "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(login(&var("BETTER_COMPUTE_TOKEN")).status.success());
    let file = home.path().join("better-compute/config.toml");
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions()) & 0o777, 0o600);
    let by_profile = Command::new(BIN).args(["api", "reservations.list", "-o", "jsonpath=.items[*].id"]).env("XDG_CONFIG_HOME", home.path()).env_remove("BETTER_COMPUTE_URL").env_remove("BETTER_COMPUTE_TOKEN").env_remove("BETTER_COMPUTE_TENANT").output().unwrap();
    assert!(String::from_utf8_lossy(&by_profile.stdout).contains(reservation["id"].as_str().unwrap()), "{}", String::from_utf8_lossy(&by_profile.stderr));
    let missing = Command::new(BIN).args(["api", "--profile", "nope", "reservations.list"]).env("XDG_CONFIG_HOME", home.path()).output().unwrap();
    assert_eq!(missing.status.code(), Some(2));
    // Exit statuses a script can branch on.
    let status = |args: &[&str]| Command::new(BIN).arg("api").args(args).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap().status.code();
    assert_eq!(status(&["reservations.get", "reservationId=res_nope"]), Some(3), "not found");
    assert_eq!(status(&["reservations.get", "reservationId"]), Some(2), "usage");
    assert_eq!(status(&["reservations.get", "reservationIdd=res_x"]), Some(2), "INVALID_ARGUMENT (an unknown field)");
    let other_body = ["reservations.create", &pool_arg, "gpu.kind=gpu", "gpu.model=H100-80GB", "gpu.count:=1", "vcpu:=8", "durationS:=3600", "idempotencyKey=first"];
    assert_eq!(status(&other_body), Some(4), "a key reused with another body is a conflict");
    let pending = ["commands.run", &node_arg, "kind=inventory.refresh", r#"payload:={"sections":["gpus"]}"#, "idempotencyKey=exit-5", "--wait", "--wait-timeout-s", "0"];
    assert_eq!(status(&pending), Some(5), "--wait gave up");
    // The reservation's node gets a new generation, and its daemon (real, fake GPUs) applies it.
    let applied = format!(
        "SELECT count(*) FROM nodes WHERE spec::text LIKE '%{}%' AND observed_generation = generation AND generation >= 2",
        reservation["id"].as_str().unwrap()
    );
    let mut converged = false;
    for _ in 0..600 {
        if query_one_i64(&url, &applied).await == 1 {
            converged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(converged, "the reserved node's daemon never applied its new desired state");
    // The command ran on the node's daemon.
    let mut ran = false;
    for _ in 0..600 {
        let (ok, out, _) = api(&["commands.get", &node_arg, &cmd_arg, "-o", "json"]);
        if ok && serde_json::from_str::<serde_json::Value>(&out).unwrap()["state"] == "succeeded" {
            ran = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ran, "inventory.refresh never succeeded on the simulated daemon");
    // A reboot, signed by the api role with the key in dev's CA folder that the daemon pinned when
    // it joined: the node goes down and comes back with a new boot, which settles it.
    let (ok, out, err) = api(&["commands.run", &node_arg, "kind=node.reboot", r#"payload:={"reason":"dev test","graceSeconds":0}"#, "idempotencyKey=reboot-1", "-o", "json"]);
    assert!(ok, "{err}");
    let reboot_arg = format!("commandId={}", serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"].as_str().unwrap());
    let mut state = serde_json::Value::Null;
    for _ in 0..600 {
        let (ok, out, _) = api(&["commands.get", &node_arg, &reboot_arg, "-o", "json"]);
        state = if ok { serde_json::from_str::<serde_json::Value>(&out).unwrap() } else { serde_json::Value::Null };
        if matches!(state["state"].as_str(), Some("succeeded" | "failed" | "expired")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state["state"], "succeeded", "the signed reboot: {state}");
    // The maintenance workflow dev printed: it drains, reboots (signed), waits for the new boot,
    // checks the GPUs and uncordons; --wait shows its steps until it ends.
    let line = first_line_with(&first.seen, "workflows.start").expect("dev printed a maintenance workflow");
    let args: Vec<&str> = line.split_whitespace().skip_while(|w| *w != "workflows.start").collect();
    let mut args = args.clone();
    args.extend(["-o", "json"]);
    let (ok, out, err) = api(&args);
    assert!(ok, "{err}");
    let w: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(w["state"], "succeeded", "{w}\n{err}");
    let steps: Vec<(&str, &str)> = w["steps"].as_array().unwrap().iter().map(|s| (s["name"].as_str().unwrap(), s["state"].as_str().unwrap())).collect();
    assert_eq!(steps.len(), 6, "{steps:?}");
    assert!(steps.iter().all(|s| s.1 == "succeeded"), "{steps:?}");
    assert!(err.contains("STEP") && err.contains("wait-ready"), "--wait showed its steps: {err}");
    // Usage export through the API: the CSV header, then a row per closed window (none yet: dev's
    // windows are an hour).
    let export = Command::new(BIN)
        .args(["usage", "export", "--from", "2000-01-01T00:00:00Z", "--to", "2100-01-01T00:00:00Z"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&export.stdout);
    assert!(export.status.success() && text.starts_with("key,reservationId,tenantId,"), "{text}{}", String::from_utf8_lossy(&export.stderr));
    assert!(String::from_utf8_lossy(&export.stderr).contains("exported"), "progress on stderr");
    // An instance on the vps host, as dev's line shows it (with a key of the test's): the fake
    // hypervisor runs it, and instances.get shows where to SSH.
    let line = first_line_with(&first.seen, "api instances.create").expect("dev printed an instances.create line");
    let vms_arg = line.split_whitespace().find(|w| w.starts_with("poolId=")).unwrap().to_owned();
    let (ok, out, err) = api(&[
        "instances.create", &vms_arg, "gpu.kind=gpu", "gpu.model=H100-80GB", "gpu.count:=1", "vcpu:=4", "memoryMib:=8192", "diskGib:=20", "durationS:=3600",
        "image=debian-12", r#"sshPublicKeys:=["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 dev@test"]"#, "idempotencyKey=vm-1", "-o", "json",
    ]);
    assert!(ok, "{err}");
    let ins: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id_arg = format!("instanceId={}", ins["id"].as_str().unwrap());
    let mut seen = serde_json::Value::Null;
    for _ in 0..600 {
        let (ok, out, err) = api(&["instances.get", &id_arg, "-o", "json"]);
        assert!(ok, "{err}");
        seen = serde_json::from_str(&out).unwrap();
        if seen["state"] == "running" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(seen["state"] == "running" && seen["address"].as_str().is_some_and(|a| a.starts_with("10.88.")), "{seen}");
    // Its serial console, as the host sent it: a page, then followed as Server-Sent Events.
    let mut page = serde_json::Value::Null;
    for _ in 0..300 {
        let (ok, out, err) = api(&["instances.console", &id_arg, "-o", "json"]);
        assert!(ok, "{err}");
        page = serde_json::from_str(&out).unwrap();
        if page["text"].as_str().is_some_and(|t| t.contains("login:")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(page["text"].as_str().is_some_and(|t| t.contains("boot 0") && t.contains("login:")) && page["offset"] == 0, "{page}");
    let mut follow = Command::new(BIN)
        .args(["api", "instances.console", &id_arg, "--follow"])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = follow.stdout.take().unwrap();
    let (lines_tx, lines_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufRead::lines(std::io::BufReader::new(stdout)).map_while(Result::ok) {
            let _ = lines_tx.send(l);
        }
    });
    let streamed: Vec<String> = std::iter::from_fn(|| lines_rx.recv_timeout(Duration::from_secs(30)).ok()).take(2).collect();
    follow.kill().unwrap();
    let _ = follow.wait();
    assert!(streamed.len() == 2 && streamed[0].contains("boot 0") && streamed[1].starts_with("SSH host key: SHA256:fake"), "{streamed:?}");
    let (ok, _, err) = api(&["commands.run", &node_arg, "kind=disk.wipe", "idempotencyKey=x"]);
    assert!(!ok && err.contains("UNSUPPORTED"), "{err}");
    let (ok, _, err) = api(&["reservations.create", &pool_arg, "nonsense=1"]);
    assert!(!ok && err.contains("INVALID_ARGUMENT") && err.contains("nonsense"), "{err}");
    let (ok, out, _) = api(&["--list"]);
    assert!(ok && out.contains("reservations.create") && out.contains("commands.run"), "{out}");
    let (ok, out, _) = api(&["reservations.create", "--help"]);
    assert!(ok && out.contains("poolId=") && out.contains("(required)") && out.contains("compute:reservations:create"), "{out}");
    // The operator view reads the same database.
    let jobs = Command::new(BIN).args(["jobs", "--database-url", &url]).output().unwrap();
    let text = String::from_utf8_lossy(&jobs.stdout);
    assert!(jobs.status.success(), "{}", String::from_utf8_lossy(&jobs.stderr));
    assert!(text.contains("event-subscribers") && text.contains("SHARDS") && text.contains(" 256 "), "{text}");
    // Each worker's self-checks (clock.skew): the worker holding the shards reports ok.
    assert!(text.lines().any(|l| l.starts_with("wrk_") && l.contains(" 256 ok")), "{text}");
    // The live gateway, apart from the workers, with its sessions.
    let gateways: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("GATEWAY")).skip(1).filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(gateways.len(), 1, "{text}");
    assert!(!text.lines().any(|l| l.starts_with("gw") && l.contains("false")), "a gateway shown as a dead worker: {text}");

    // Its PostgreSQL dies (an immediate shutdown, as a crash): dev starts it again and says so once.
    let pid: i32 = std::fs::read_to_string(dir.join("pgdata/postmaster.pid")).unwrap().lines().next().unwrap().trim().parse().unwrap();
    // SAFETY: signalling the PostgreSQL our own child started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGQUIT) }, 0);
    first.wait_for("PostgreSQL stopped unexpectedly; started it again");
    let mut back = None;
    for _ in 0..600 {
        if let Ok(c) = better_compute_db::pool::connect(&url).await
            && let Ok(r) = c.query_one("SELECT n::bigint FROM kept", &[]).await
        {
            back = Some(r.get::<_, i64>(0));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(back, Some(42), "the restarted PostgreSQL lost the data");

    // A second dev on the same folder is refused, clearly, and the first keeps running.
    let second = Command::new(BIN).arg("dev").arg("--data-dir").arg(&dir).output().unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("in use by another process") && err.contains(&first.child.id().to_string()), "{err}");
    assert_eq!(query_one_i64(&url, "SELECT n::bigint FROM kept").await, 42);

    // Ctrl-C stops PostgreSQL cleanly.
    first.signal(libc::SIGINT);
    let (status, out) = first.wait_exit();
    assert!(status.success(), "{status}: {out:?}");
    assert!(out.iter().any(|l| l.starts_with("stopped cleanly")), "{out:?}");
    assert!(!dir.join("pgdata/postmaster.pid").exists(), "PostgreSQL is still running");
    assert!(out.iter().any(|l| l.starts_with("  worker ")), "{out:?}");

    // A restart finds the data.
    let mut again = Dev::start(&dir);
    let url = again.database_url();
    assert_eq!(query_one_i64(&url, "SELECT n::bigint FROM kept").await, 42);
    assert!(!again.seen.iter().any(|l| l.starts_with("initialized")), "{:?}", again.seen);

    // Killed outright, it leaves PostgreSQL running; the next dev takes it over and still has the data.
    again.signal(libc::SIGKILL);
    let _ = again.wait_exit();
    let mut third = Dev::start(&dir);
    let url = third.database_url();
    assert!(third.seen.iter().any(|l| l.starts_with("reusing PostgreSQL")), "{:?}", third.seen);
    assert_eq!(query_one_i64(&url, "SELECT n::bigint FROM kept").await, 42);
    third.signal(libc::SIGTERM);
    let (status, _) = third.wait_exit();
    assert!(status.success());
    assert!(!dir.join("pgdata/postmaster.pid").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_run_by_root_under_a_private_home_keeps_its_cluster_where_postgres_can_reach_it() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: PostgreSQL runs as this user and reaches any folder it can; nothing to show");
        return;
    }
    // A home like /root: mode 0700, so the postgres user cannot pass it.
    let home = std::env::temp_dir().join(format!("bc-private-home-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
    let dir = home.join("checkout").join(".better-compute");

    let mut dev = Dev::start(&dir);
    let url = dev.database_url();
    let moved = first_line_with(&dev.seen, "its cluster lives in /var/lib/better-compute/dev/").map(str::to_owned);
    assert!(moved.as_deref().is_some_and(|l| l.contains(&dir.display().to_string())), "dev says where the cluster went and why:\n{}", dev.seen.join("\n"));
    assert_eq!(query_one_i64(&url, "SELECT 1::bigint").await, 1);
    dev.signal(libc::SIGINT);
    let (status, _) = dev.wait_exit();
    assert!(status.success(), "{status}");
    // Started again, it finds the same cluster (the data outlives the run).
    let mut again = Dev::start(&dir);
    assert_eq!(again.database_url(), url);
    assert!(first_line_with(&again.seen, "initialized a new PostgreSQL cluster").is_none(), "{}", again.seen.join("\n"));
    again.signal(libc::SIGINT);
    assert!(again.wait_exit().0.success());
    let cluster = moved.unwrap().rsplit(' ').next().unwrap().to_owned();
    let _ = std::fs::remove_dir_all(&home);
    let _ = std::fs::remove_dir_all(&cluster);
}

/// Calls `method` on the first of `apis` that answers, trying the others while one is down (a
/// killed API server refuses connections until `up` has started it again). Bodies carry an
/// idempotency key, so a request retried after a lost answer changes nothing twice.
async fn call_any(client: &reqwest::Client, apis: &[String], token: &str, method: &str, body: serde_json::Value) -> serde_json::Value {
    let mut last = String::new();
    for attempt in 0..240 {
        let api = &apis[attempt % apis.len()];
        match client.post(format!("{api}/v1/{method}")).bearer_auth(token).json(&body).send().await {
            Ok(r) if r.status().is_success() => return r.json().await.unwrap(),
            // UNAVAILABLE (its database connection went with a killed process): retried.
            Ok(r) if r.status().is_server_error() => last = format!("{} {}", r.status(), r.text().await.unwrap_or_default()),
            Ok(r) => panic!("{method} {body}: {} {}", r.status(), r.text().await.unwrap_or_default()),
            Err(e) => last = e.to_string(),
        }
        // A back-off between tries of real processes, not a wait for simulated time.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("no API server answered {method} in a minute: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_runs_the_scale_out_shape_and_loses_nothing_when_one_process_of_each_role_is_killed() {
    let dir = std::env::temp_dir().join(format!("bc-up-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut up = Dev::run(&["up", "--nodes", "2"], &dir, &[]);
    up.wait_for("ready: BETTER_COMPUTE_URL=");
    let shape: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("up.json")).unwrap()).unwrap();
    let apis: Vec<String> = shape["apis"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let nodes: Vec<String> = shape["nodes"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let (token, pool, db) = (shape["token"].as_str().unwrap().to_owned(), shape["gpuPool"].as_str().unwrap().to_owned(), shape["database"].as_str().unwrap().to_owned());
    assert_eq!((apis.len(), nodes.len(), shape["pgbouncer"].as_bool()), (2, 2, Some(true)), "{shape}");
    let roles: Vec<&str> = shape["processes"].as_array().unwrap().iter().map(|p| p["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["api", "api", "gateway", "gateway", "worker", "worker", "daemon", "daemon"]);
    better_compute_tls::install_process_default();
    let client = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    const ROUNDS: usize = 20;
    let mut reservations = std::collections::BTreeSet::new();
    let mut released = 0;
    for i in 0..ROUNDS {
        if i == 6 {
            // SIGKILL the first process of every role, mid-workload.
            for p in shape["processes"].as_array().unwrap().iter().filter(|p| p["index"] == 0) {
                // SAFETY: a signal to a process `up` started for this test.
                assert_eq!(unsafe { libc::kill(p["pid"].as_i64().unwrap() as i32, libc::SIGKILL) }, 0, "{p}");
            }
        }
        let body = serde_json::json!({"poolId": pool, "gpu": {"kind": "gpu", "model": "H100-80GB", "count": 1}, "vcpu": 2, "memoryMib": 1024,
                                      "durationS": 3600, "idempotencyKey": format!("up-r{i}")});
        let r = call_any(&client, &apis, &token, "reservations.create", body).await;
        let id = r["id"].as_str().unwrap().to_owned();
        reservations.insert(id.clone());
        let c = serde_json::json!({"nodeId": nodes[i % nodes.len()], "kind": "diag.nvml", "idempotencyKey": format!("up-c{i}")});
        call_any(&client, &apis, &token, "commands.run", c).await;
        if i % 3 == 2 {
            call_any(&client, &apis, &token, "reservations.release", serde_json::json!({"reservationId": id})).await;
            released += 1;
        }
    }
    // Nothing lost, nothing twice: one reservation per key, each placed or released as asked.
    assert_eq!(reservations.len(), ROUNDS);
    assert_eq!(query_one_i64(&db, "SELECT count(*) FROM reservations").await, ROUNDS as i64);
    assert_eq!(query_one_i64(&db, "SELECT count(*) FROM reservations WHERE state = 'released'").await, released);
    assert_eq!(query_one_i64(&db, "SELECT count(*) FROM reservations WHERE state IN ('placed', 'active')").await, (ROUNDS as i64) - released);
    // Every command reaches its node and succeeds, those of the killed daemon's node too.
    let mut done = 0;
    for _ in 0..1200 {
        done = query_one_i64(&db, "SELECT count(*) FROM commands WHERE idempotency_key LIKE 'api:%:up-c%' AND state = 'succeeded'").await;
        if done == ROUNDS as i64 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(done, ROUNDS as i64, "of {} commands", query_one_i64(&db, "SELECT count(*) FROM commands WHERE idempotency_key LIKE 'api:%:up-c%'").await);
    // up started each killed process again, and stops everything cleanly.
    up.signal(libc::SIGINT);
    let (status, lines) = up.wait_exit();
    assert!(status.success(), "{}", lines.join("\n"));
    let restarted: Vec<&String> = lines.iter().filter(|l| l.contains("ended (signal: 9 (SIGKILL)); starting it again")).collect();
    assert_eq!(restarted.len(), 4, "{}", lines.join("\n"));
    assert!(first_line_with(&lines, "stopped cleanly").is_some(), "{}", lines.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: it
/// reads commands on fd 3 and writes answers on fd 4, each a JSON text ended by a NUL byte).
struct Browser {
    child: Child,
    to: std::fs::File,
    from: BufReader<std::fs::File>,
    next_id: u64,
    session: Option<String>,
}

impl Browser {
    fn start(profile: &Path) -> Browser {
        use std::os::fd::FromRawFd;
        use std::os::unix::process::CommandExt;
        let chromium = std::env::var("BETTER_COMPUTE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
        assert!(Path::new(&chromium).exists(), "{chromium} is missing: install Debian's chromium (.ci/run does) or set BETTER_COMPUTE_CHROMIUM");
        let (mut commands, mut answers) = ([0; 2], [0; 2]);
        // SAFETY: pipe(2) fills the arrays with two new descriptors each.
        unsafe { assert_eq!((libc::pipe(commands.as_mut_ptr()), libc::pipe(answers.as_mut_ptr())), (0, 0)) };
        let (their_in, their_out) = (commands[0], answers[1]);
        let mut cmd = Command::new(chromium);
        cmd.args(["--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run", "--disable-extensions",
                  "--disable-background-networking", "--window-size=1366,900", "--hide-scrollbars"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: dup2 is async-signal-safe; the duplicates at 3 and 4 are not close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(their_in, 3) < 0 || libc::dup2(their_out, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start chromium");
        // SAFETY: the descriptors are ours; the child holds its own copies.
        let (to, from) = unsafe {
            libc::close(their_in);
            libc::close(their_out);
            (std::fs::File::from_raw_fd(commands[1]), std::fs::File::from_raw_fd(answers[0]))
        };
        Browser { child, to, from: BufReader::new(from), next_id: 0, session: None }
    }

    /// Sends one command (to the page's session once there is one) and returns its result.
    fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        use std::io::Write;
        self.next_id += 1;
        let mut msg = serde_json::json!({"id": self.next_id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = serde_json::Value::String(s.clone());
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).unwrap();
        loop {
            let mut buf = Vec::new();
            assert!(self.from.read_until(0, &mut buf).unwrap() > 0, "chromium closed its pipe");
            buf.pop();
            let answer: serde_json::Value = serde_json::from_slice(&buf).unwrap();
            if answer["id"] == self.next_id {
                assert!(answer.get("error").is_none(), "{method}: {answer}");
                return answer["result"].clone();
            }
        }
    }

    /// Opens `url` in a new page and talks to that page from now on.
    fn open(&mut self, url: &str) {
        let target = self.call("Target.createTarget", serde_json::json!({"url": url}))["targetId"].clone();
        let session = self.call("Target.attachToTarget", serde_json::json!({"targetId": target, "flatten": true}))["sessionId"].as_str().unwrap().to_owned();
        self.session = Some(session);
    }

    /// The value of a JavaScript expression in the page (awaited if a promise).
    fn eval(&mut self, js: &str) -> serde_json::Value {
        let r = self.call("Runtime.evaluate", serde_json::json!({"expression": js, "awaitPromise": true, "returnByValue": true}));
        assert!(r.get("exceptionDetails").is_none(), "{js}: {r}");
        r["result"]["value"].clone()
    }

    /// Waits (two minutes at most) until `js` is true in the page (an error, as of an element not
    /// there yet, counts as false).
    fn wait_until(&mut self, what: &str, js: &str) {
        let check = format!("(() => {{ try {{ return !!({js}); }} catch (e) {{ return false; }} }})()");
        for _ in 0..1200 {
            if self.eval(&check) == serde_json::Value::Bool(true) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let text = self.eval("document.body.innerText");
        panic!("the console never showed {what}; it shows:\n{text}");
    }

    /// Goes to the console's `page`, waits until it shows `text`, and saves it as `<page>.png`.
    fn visit(&mut self, page: &str, text: &str, shots: &Path) {
        self.eval(&format!("location.hash = '#/{page}'; true"));
        let main = "document.querySelector('main')";
        self.wait_until(&format!("{text:?} on page {page}"), &format!("{main}.dataset.page === '{page}' && {main}.innerText.includes({text:?})"));
        self.screenshot(&shots.join(format!("{page}.png")));
    }

    /// Saves what the page shows as a PNG.
    fn screenshot(&mut self, path: &Path) {
        use base64::Engine;
        let png = self.call("Page.captureScreenshot", serde_json::json!({"format": "png"}))["data"].as_str().unwrap().to_owned();
        std::fs::write(path, base64::engine::general_purpose::STANDARD.decode(png).unwrap()).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP endpoint that answers every request 410 Gone, as a removed webhook receiver does.
fn gone_endpoint() -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0; 65536];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(b"HTTP/1.1 410 Gone\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    format!("http://{addr}/hook")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_in_a_browser_signs_in_reserves_shows_the_timeline_drains_and_shows_a_dead_letter() {
    let dir = std::env::temp_dir().join(format!("bc-console-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // The webhook receiver below is on this machine, over plain HTTP.
    let mut dev = Dev::run(&["dev", "--api-listen", "127.0.0.1:0", "--nodes", "2"], &dir,
                           &[("BETTER_COMPUTE_WEBHOOKS_ALLOW_HTTP", "1"), ("BETTER_COMPUTE_WEBHOOKS_ALLOW_PRIVATE", "1")]);
    let (db, env) = dev.ready();
    let var = |k: &str| env.iter().find(|(n, _)| n == k).unwrap().1.clone();
    let (api, token) = (var("BETTER_COMPUTE_URL"), var("BETTER_COMPUTE_TOKEN"));
    better_compute_tls::install_process_default();
    let client = reqwest::Client::new();
    let hook = client.post(format!("{api}/v1/webhooks.create")).bearer_auth(&token)
        .json(&serde_json::json!({"url": gone_endpoint(), "eventTypes": ["reservation.placed"]})).send().await.unwrap();
    assert!(hook.status().is_success(), "{}", hook.text().await.unwrap());
    // Served by the API, loading nothing from elsewhere.
    let page = client.get(format!("{api}/console")).send().await.unwrap();
    let csp = page.headers().get("content-security-policy").map(|v| v.to_str().unwrap().to_owned()).unwrap_or_default();
    assert!(csp.starts_with("default-src 'none'; script-src 'self'") && csp.contains("connect-src 'self'"), "{csp}");
    assert!(page.text().await.unwrap().contains("<script type=\"module\" src=\"/console/app.js\">"));
    // The pictures in docs/console are replaced only when asked (as the schema snapshot is).
    let shots = match std::env::var_os("UPDATE_CONSOLE_SCREENSHOTS") {
        Some(_) => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/console"),
        None => dir.join("screenshots"),
    };
    std::fs::create_dir_all(&shots).unwrap();
    let profile = dir.join("chromium");
    let token_js = serde_json::to_string(&token).unwrap();
    let node_count = query_one_i64(&db, "SELECT count(*) FROM nodes").await;
    let (reservation, node) = tokio::task::spawn_blocking(move || {
        let mut b = Browser::start(&profile);
        b.open(&format!("{api}/console"));
        // Sign in with the token, as a person pastes it.
        b.wait_until("the sign-in form", "!!document.getElementById('token')");
        b.eval(&format!("document.getElementById('token').value = {token_js}; document.querySelector('main form').requestSubmit(); true"));
        // An operator lands on the fleet: every node in the grid.
        b.wait_until("the fleet grid", &format!("document.querySelectorAll('main .grid a').length === {node_count}"));
        b.screenshot(&shots.join("fleet.png"));
        // A reservation from the form, on pool gpus.
        b.eval("location.hash = '#/reservations'; true");
        b.wait_until("the reservation form", "!!document.querySelector('main form[aria-label=\"New reservation\"]')");
        // The form says what fits before anything is reserved.
        b.eval("const s = document.getElementById('f-pool'); s.value = [...s.options].find(o => o.text.startsWith('gpus ')).value; \
                document.querySelector('main input[name=count]').value = 2; \
                document.querySelector('main form').dispatchEvent(new Event('input', {bubbles: true})); true");
        b.wait_until("what fits", "document.getElementById('f-fits').innerText.startsWith('Fits now: a node has ')");
        b.eval("document.querySelector('main form').requestSubmit(); true");
        b.wait_until("the reservation placed", "/Reservation res_\\S+ is (placed|active) on node_/.test(document.getElementById('message').innerText)");
        let said = b.eval("document.getElementById('message').innerText").as_str().unwrap().to_owned();
        let reservation = said.split_whitespace().nth(1).unwrap().to_owned();
        let node = said.split_whitespace().last().unwrap().trim_end_matches('.').to_owned();
        let pool = b.eval("document.getElementById('f-pool').value").as_str().unwrap().to_owned();
        b.wait_until("the reservation in the list", &format!("document.querySelector('main table').innerText.includes('{reservation}')"));
        b.wait_until("what fits, again", "document.getElementById('f-fits').innerText.length > 0");
        b.screenshot(&shots.join("reservations.png"));
        // On its node's page: the bar on the timeline.
        b.eval(&format!("location.hash = '#/node/{node}'; true"));
        b.wait_until("the reservation on the timeline", &format!("!!document.querySelector('svg.timeline rect[data-reservation=\"{reservation}\"]')"));
        b.screenshot(&shots.join("node.png"));
        // Live: a reservation made elsewhere (not through the console's own code) appears on the
        // open page's timeline without a reload, through the watch stream.
        let before = b.eval("document.querySelectorAll('svg.timeline rect.bar').length").as_i64().unwrap();
        let other = b.eval(&format!(
            "fetch('/v1/reservations.create', {{method: 'POST', headers: {{'Content-Type': 'application/json', Authorization: 'Bearer ' + {token_js}}}, \
             body: JSON.stringify({{poolId: '{pool}', gpu: {{kind: 'gpu', model: 'H100-80GB', count: 1}}, vcpu: 2, memoryMib: 1024, durationS: 7200, idempotencyKey: 'live-1'}})}}) \
             .then(r => r.json()).then(r => r.id)"
        ));
        let other = other.as_str().unwrap().to_owned();
        b.wait_until("the other reservation, live", &format!("!!document.querySelector('svg.timeline rect[data-reservation=\"{other}\"]')"));
        assert!(b.eval("document.querySelectorAll('svg.timeline rect.bar').length").as_i64().unwrap() > before);
        // Drain the node from its page (the reason prompt answered).
        b.eval("window.prompt = () => 'console test'; [...document.querySelectorAll('main button')].find(x => x.textContent === 'Drain').click(); true");
        b.wait_until("the node not schedulable", "/not schedulable: .*(drain|cordon)/.test(document.querySelector('main').innerText)");
        // The webhook's delivery met 410 Gone: a dead letter, shown.
        // A VM on the vps host, from the form, until it runs with its connect line.
        b.eval("location.hash = '#/instances'; true");
        b.wait_until("the instance form", "!!document.querySelector('main form[aria-label=\"New instance\"]')");
        b.eval("document.querySelector('main input[name=sshKey]').value = 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl console@test'; \
                document.querySelector('main form').requestSubmit(); true");
        b.visit("instances", "ssh debian@", &shots);
        // Every field has a label and every button a name (for keyboards and screen readers).
        let unlabelled = b.eval("[...document.querySelectorAll('input, select')].filter(e => !e.labels || e.labels.length === 0).length \
                                 + [...document.querySelectorAll('button')].filter(x => !(x.getAttribute('aria-label') || x.textContent).trim()).length");
        assert_eq!(unlabelled, 0);
        assert!(b.eval("document.querySelectorAll('main input, main select, main button').length").as_i64().unwrap() >= 12);
        b.visit("audit", "reservations.create", &shots);
        b.visit("jobs", "Queues: ", &shots);
        b.visit("account", "Quota: 6", &shots);
        (reservation, node)
    })
    .await
    .unwrap();
    // What the browser did is what the database holds.
    assert_eq!(query_one_i64(&db, &format!("SELECT count(*) FROM reservations WHERE id = '{reservation}' AND node_id = '{node}'")).await, 1);
    assert_eq!(query_one_i64(&db, &format!("SELECT count(*) FROM node_drains WHERE node_id = '{node}'")).await, 1);
    dev.signal(libc::SIGINT);
    let (status, lines) = dev.wait_exit();
    assert!(status.success(), "{}", lines.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}
