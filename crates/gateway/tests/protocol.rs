//! The daemon<->gateway protocol end to end: real PostgreSQL, real gRPC over loopback with mTLS,
//! real daemons with fake GPUs, simulated time where time matters. Every wait is bounded.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use better_compute_daemon::fake::FakeGpus;
use better_compute_daemon::{Daemon, DaemonConfig, HostResources, RebootHook};
use better_compute_gateway::{Ca, Gateway, GatewayConfig};
use better_compute_nodes::commands::{self, NewCommand};
use better_compute_nodes::inventory::{self, NewPool};
use better_compute_nodes::{listing, NodesModule};
use better_compute_runtime::harness::Harness;
use tokio::sync::watch;

/// Who makes the changes these tests make.
static TEST_ACTOR: better_compute_audit::Actor = better_compute_audit::Actor::job("test");

/// Anything that waits for the system runs under this.
const PATIENCE: Duration = Duration::from_secs(30);

struct Fleet {
    h: Harness,
    ca: Arc<Ca>,
    /// The command-signing key: the registry signs reboots with it, the gateway hands out its
    /// public half at join.
    signer: Arc<better_compute_runtime::signing::CommandSigner>,
    pool_id: String,
    dir: tempfile::TempDir,
}

struct RunningGateway {
    gw: Gateway,
    stop: watch::Sender<bool>,
}

struct RunningDaemon {
    d: Arc<Daemon>,
    task: tokio::task::JoinHandle<()>,
    stop: watch::Sender<bool>,
}

impl RunningDaemon {
    /// Kills the daemon as a crash would: no goodbye; waits until its journal is closed.
    async fn kill(self) {
        let _ = self.stop.send(true);
        self.task.abort();
        let _ = self.task.await;
        let d = self.d;
        for _ in 0..3000 {
            if Arc::strong_count(&d) == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("daemon still referenced after kill");
    }
}

async fn wait_until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("timed out waiting until {what}");
}

impl Fleet {
    async fn new() -> Fleet {
        let h = Harness::new(vec![Arc::new(NodesModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await;
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        let site = inventory::create_site(&*tx, "s").await.unwrap();
        let pool_id = inventory::create_pool(
            &*tx,
            &NewPool { site_id: site, name: "p".into(), kind: "bare-metal".into(), vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let signer = Arc::new(better_compute_runtime::signing::CommandSigner::generate());
        assert!(h.registry().install_command_signer(signer.clone()));
        Fleet { h, ca: Arc::new(Ca::generate().unwrap()), signer, pool_id, dir: tempfile::tempdir().unwrap() }
    }

    async fn gateway(&self, id: &str, pokes: bool) -> RunningGateway {
        let mut cfg = GatewayConfig::new(id, "127.0.0.1:0");
        cfg.poll_interval = Duration::from_millis(if pokes { 200 } else { 400 });
        cfg.flush_interval = Duration::from_millis(200);
        cfg.listen_url = pokes.then(|| self.h.db().connection_string().to_owned());
        cfg.command_key = self.signer.public_key();
        let (stop, stopped) = watch::channel(false);
        let gw = Gateway::start(self.h.db().pool.clone(), self.ca.clone(), cfg, stopped).await.unwrap();
        RunningGateway { gw, stop }
    }

    async fn join_token(&self, ttl_s: Option<i64>) -> String {
        let mut c = self.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        let t = listing::create_join_token(&*tx, &self.pool_id, ttl_s, "test").await.unwrap();
        tx.commit().await.unwrap();
        t.secret
    }

    fn config(&self, gw: &RunningGateway, name: &str, token: Option<String>) -> DaemonConfig {
        let mut cfg = DaemonConfig::new(format!("https://{}", gw.gw.addr()), self.dir.path().join(name), name);
        cfg.join_token = token;
        cfg.ca_pem = Some(self.ca.cert_pem().to_owned());
        cfg.boot_id = "boot-1".into();
        cfg.host = HostResources { vcpu: 64, memory_mib: 512 * 1024, disk_gib: 1000 };
        cfg.backoff_min = Duration::from_millis(50);
        cfg.backoff_max = Duration::from_millis(200);
        cfg
    }

    async fn start(&self, cfg: DaemonConfig, gpus: Arc<FakeGpus>) -> RunningDaemon {
        let d = Daemon::start(cfg, gpus).await.unwrap();
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(d.clone().run(stopped));
        RunningDaemon { d, task, stop }
    }

    async fn one(&self, sql: &str, node: &str) -> tokio_postgres::Row {
        self.h.db().client().await.query_one(sql, &[&node]).await.unwrap()
    }

    async fn observed(&self, node: &str) -> (i64, i64) {
        let r = self.one("SELECT generation, observed_generation FROM nodes WHERE id = $1", node).await;
        (r.get(0), r.get(1))
    }

    /// Runs the NodeSpec controller until the node's spec is stored.
    async fn settle_spec(&self) {
        self.h.job("nodespec").drain(20).await;
    }

    async fn converged(&self, node: &str) {
        wait_until("the node reports its current generation", || async {
            let (g, o) = self.observed(node).await;
            g >= 1 && o == g
        })
        .await;
    }

    /// [`Fleet::joined`] with a reboot hook that counts: the gateway, the daemon's config (for
    /// restarts), its GPUs, the daemon, its node and the count.
    async fn joined_with_reboot_hook(&self) -> (RunningGateway, DaemonConfig, Arc<FakeGpus>, RunningDaemon, String, Arc<AtomicU32>) {
        let g = self.gateway("gw_a", true).await;
        let token = self.join_token(None).await;
        let reboots = Arc::new(AtomicU32::new(0));
        let fake = gpus("n1");
        let mut cfg = self.config(&g, "n1", Some(token));
        let counter = reboots.clone();
        cfg.reboot = RebootHook::Callback(Arc::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        let d = self.start(cfg.clone(), fake.clone()).await;
        let node = d.d.node_id();
        cfg.join_token = None;
        self.settle_spec().await;
        self.converged(&node).await;
        (g, cfg, fake, d, node, reboots)
    }

    /// A gateway and one daemon (`n1`, two fake GPUs) that joined and applied its first spec.
    async fn joined(&self, pokes: bool) -> (RunningGateway, Arc<FakeGpus>, RunningDaemon, String) {
        let g = self.gateway("gw_a", pokes).await;
        let token = self.join_token(None).await;
        let fake = gpus("n1");
        let d = self.start(self.config(&g, "n1", Some(token)), fake.clone()).await;
        let node = d.d.node_id();
        self.settle_spec().await;
        self.converged(&node).await;
        (g, fake, d, node)
    }

    async fn enqueue(&self, node: &str, kind: &str, payload: serde_json::Value, key: &str) -> String {
        self.enqueue_through(self.h.registry(), node, kind, payload, key).await
    }

    /// [`Fleet::enqueue`] through another registry (another command-signing key).
    async fn enqueue_through(&self, registry: &better_compute_runtime::Registry, node: &str, kind: &str, payload: serde_json::Value, key: &str) -> String {
        let c = self.h.db().client().await;
        let v = commands::enqueue(
            &**c,
            registry,
            NewCommand {
                node_id: node,
                kind,
                payload: &payload,
                idempotency_key: key,
                not_after: Some(Duration::from_secs(600)),
                min_generation: 0,
                owner: None,
                actor: &TEST_ACTOR,
            },
        )
        .await
        .unwrap();
        commands::poke_gateway(&c, node).await;
        v.id
    }

    /// What the daemons reported of a GPU, as recorded for the health job, in order.
    async fn signals(&self, uuid: &str) -> Vec<String> {
        let c = self.h.db().client().await;
        c.query("SELECT detail FROM gpu_health_signals WHERE device_id = $1 ORDER BY id", &[&uuid]).await.unwrap().iter().map(|r| r.get(0)).collect()
    }

    async fn command(&self, node: &str, id: &str) -> commands::CommandView {
        commands::get(&**self.h.db().client().await, node, id).await.unwrap()
    }

    async fn wait_command(&self, node: &str, id: &str, state: &str) -> commands::CommandView {
        wait_until(&format!("command {id} is {state}"), || async { self.command(node, id).await.state == state }).await;
        self.command(node, id).await
    }
}

fn gpus(name: &str) -> Arc<FakeGpus> {
    Arc::new(FakeGpus::parse("fake:2xH100-80GB", name).unwrap())
}

#[tokio::test]
async fn a_valid_token_joins_once_an_expired_or_reused_one_is_refused_and_a_foreign_ca_cannot_open_a_session() {
    let f = Fleet::new().await;
    let g = f.gateway("gw_a", true).await;
    let token = f.join_token(None).await;
    let d = f.start(f.config(&g, "n1", Some(token.clone())), gpus("n1")).await;
    let node = d.d.node_id();
    let r = f.one("SELECT joined_at IS NOT NULL, generation, (SELECT count(*) FROM devices WHERE node_id = $1 AND parent_id IS NULL) FROM nodes WHERE id = $1", &node).await;
    assert_eq!((r.get::<_, bool>(0), r.get::<_, i64>(1), r.get::<_, i64>(2)), (true, 1, 2), "joined, adopted at generation 1, with its GPUs");
    f.settle_spec().await;
    f.converged(&node).await;
    assert_eq!(f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0), "connected");

    // The same token again: refused, and nothing is registered.
    let err = Daemon::start(f.config(&g, "n2", Some(token)), gpus("n2")).await.err().expect("reused token");
    assert!(err.to_string().contains("already used"), "{err}");
    // An expired token: refused.
    let expired = f.join_token(Some(60)).await;
    f.h.db().advance(Duration::from_secs(61)).await;
    let err = Daemon::start(f.config(&g, "n3", Some(expired)), gpus("n3")).await.err().expect("expired token");
    assert!(err.to_string().contains("expired"), "{err}");
    assert_eq!(f.h.db().client().await.query_one("SELECT count(*) FROM nodes", &[]).await.unwrap().get::<_, i64>(0), 1);

    // A certificate from another CA: the TLS handshake itself fails.
    let other = Ca::generate().unwrap();
    let req = better_compute_daemon::identity::request("n1").unwrap();
    let signed = other.sign_node(&req.csr_pem, &node, Duration::from_secs(3600)).unwrap();
    let forged = better_compute_daemon::identity::Identity::from_grant(
        &node,
        req,
        better_compute_proto::v1::CertificateGrant {
            certificate_pem: signed.pem,
            ca_pem: f.ca.cert_pem().to_owned(),
            not_before_unix_s: signed.not_before_unix_s,
            not_after_unix_s: signed.not_after_unix_s,
        },
        Vec::new(),
    );
    let forged_dir = f.dir.path().join("forged");
    forged.save(&forged_dir).unwrap();
    let mut cfg = f.config(&g, "forged", None);
    cfg.backoff_min = Duration::from_secs(3600);
    let imposter = Daemon::start(cfg, gpus("n1")).await.unwrap();
    let epoch_before = f.one("SELECT session_epoch FROM node_sessions WHERE node_id = $1", &node).await.get::<_, i64>(0);
    let (_stop, stopped) = watch::channel(false);
    let attempt = tokio::time::timeout(Duration::from_secs(3), tokio::spawn(imposter.clone().run(stopped)));
    let _ = attempt.await; // it never gets a session; its back-off is an hour
    let epoch_after = f.one("SELECT session_epoch FROM node_sessions WHERE node_id = $1", &node).await.get::<_, i64>(0);
    assert_eq!(epoch_before, epoch_after, "a certificate from another CA opened no session");
    assert_eq!(f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0), "connected");
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_daemon_reconnecting_behind_the_current_generation_gets_the_full_spec_and_a_lost_poke_only_delays() {
    let f = Fleet::new().await;
    // No LISTEN: every poke is lost; only the gateway's poll delivers.
    let (g, fake, d, node) = f.joined(false).await;
    assert_eq!(d.d.applied_generation(), 1);

    // A change while the daemon is away: generation 2.
    d.kill().await;
    wait_until("the session is closed", || async { f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0) == "disconnected" }).await;
    {
        let c = f.h.db().client().await;
        c.execute("UPDATE nodes SET labels = '{\"rack\": \"r9\"}' WHERE id = $1", &[&node]).await.unwrap();
        better_compute_runtime::desired::invalidate(&**c, &node).await.unwrap();
    }
    f.settle_spec().await;
    assert_eq!(f.observed(&node).await, (2, 1));
    // It comes back at generation 1 and is sent the whole spec after Welcome.
    let d = f.start(f.config(&g, "n1", None), fake.clone()).await;
    f.converged(&node).await;
    assert_eq!(d.d.applied_generation(), 2);

    // A change while it is connected, with the poke lost: the poll delivers it.
    {
        let c = f.h.db().client().await;
        c.execute("UPDATE nodes SET labels = '{\"rack\": \"r10\"}' WHERE id = $1", &[&node]).await.unwrap();
        better_compute_runtime::desired::invalidate(&**c, &node).await.unwrap();
    }
    f.settle_spec().await;
    assert_eq!(f.observed(&node).await.0, 3);
    f.converged(&node).await;
    assert_eq!(d.d.applied_generation(), 3);
    let status: serde_json::Value = f.one("SELECT spec_status FROM nodes WHERE id = $1", &node).await.get(0);
    assert_eq!(status["observedGeneration"], "3", "{status}");
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_zombie_gateway_can_neither_route_nor_mark_liveness_after_the_node_reconnected_elsewhere() {
    let f = Fleet::new().await;
    let a = f.gateway("gw_a", true).await;
    let b = f.gateway("gw_b", true).await;
    let token = f.join_token(None).await;
    let fake_a = gpus("n1");
    let mut cfg = f.config(&a, "n1", Some(token));
    cfg.backoff_min = Duration::from_secs(3600); // once A drops it, this daemon stays away
    cfg.backoff_max = Duration::from_secs(3600);
    let d1 = f.start(cfg, fake_a.clone()).await;
    let node = d1.d.node_id();
    f.settle_spec().await;
    f.converged(&node).await;
    // The same node (a copy of its identity and journal) reaches gateway B: a partition where A
    // has not noticed that its connection is gone.
    let copy = f.dir.path().join("n1-copy");
    std::fs::create_dir_all(&copy).unwrap();
    for file in ["node.json", "node.pem", "node.key", "ca.pem"] {
        std::fs::copy(f.dir.path().join("n1").join(file), copy.join(file)).unwrap();
    }
    let mut cfg_b = f.config(&b, "n1-copy", None);
    cfg_b.node_name = "n1".into();
    let fake_b = gpus("n1");
    let d2 = f.start(cfg_b, fake_b.clone()).await;
    wait_until("B holds the session", || async {
        f.one("SELECT gateway_id FROM node_sessions WHERE node_id = $1", &node).await.get::<_, String>(0) == "gw_b"
    })
    .await;
    let epoch_b: i64 = f.one("SELECT session_epoch FROM node_sessions WHERE node_id = $1", &node).await.get(0);
    assert_eq!(epoch_b, 2);

    // A's writes carry its old epoch and change nothing. B, which holds the session, may move
    // last_seen_at itself at any moment, so what is checked is that A's transaction wrote nothing:
    // it never got a transaction id.
    f.h.db().advance(Duration::from_secs(30)).await;
    {
        let mut c = f.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        let wrote = better_compute_nodes::sessions::flush_last_seen(&*tx, "gw_a", std::slice::from_ref(&node), &[1], &[0.0]).await.unwrap();
        assert_eq!(wrote, better_compute_nodes::sessions::Flushed::default(), "a stale epoch holds no session");
        let wrote_nothing: bool = tx.query_one("SELECT pg_current_xact_id_if_assigned() IS NULL", &[]).await.unwrap().get(0);
        assert!(wrote_nothing, "the zombie's flush wrote a row");
    }
    {
        let mut c = f.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        assert!(better_compute_nodes::sessions::dispatch(&*tx, &node, "gw_a", 1, 10).await.unwrap().is_none());
    }

    // A command goes through B to the daemon B serves; A, poked too, routes nothing.
    let id = f.enqueue(&node, "diag.nvml", serde_json::json!({"level": 1}), "diag-1").await;
    let done = f.wait_command(&node, &id, "succeeded").await;
    assert_eq!(done.result.unwrap()["backend"], "fake");
    assert_eq!((fake_a.diag_runs(), fake_b.diag_runs()), (0, 1));
    wait_until("A dropped its superseded session", || async { a.gw.sessions() == 0 }).await;
    let r = f.one("SELECT gateway_id, session_epoch, closed_at IS NULL FROM node_sessions WHERE node_id = $1", &node).await;
    assert_eq!((r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, bool>(2)), ("gw_b".into(), 2, true));
    assert_eq!(f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0), "connected");
    d1.kill().await;
    d2.kill().await;
    let _ = (a.stop.send(true), b.stop.send(true));
}

#[tokio::test]
async fn killed_mid_command_the_journal_keeps_a_reboot_from_running_twice_a_wiped_one_fails_it_and_a_new_boot_succeeds_it() {
    let f = Fleet::new().await;
    let (g, mut cfg, fake, d, node, reboots) = f.joined_with_reboot_hook().await;
    let reboot = serde_json::json!({"reason": "kernel update"});

    // 1. Same journal, same boot: the reboot was started and the daemon died before the machine
    // went down. It is sent again, and the journal refuses to run it twice.
    let first = f.enqueue(&node, "node.reboot", reboot.clone(), "reboot-1").await;
    wait_until("the reboot hook ran", || async { reboots.load(Ordering::SeqCst) == 1 }).await;
    f.wait_command(&node, &first, "running").await;
    d.kill().await;
    let journal_before = std::fs::read(f.dir.path().join("n1/journal.redb")).unwrap().len();
    assert!(journal_before > 0);
    let d = f.start(cfg.clone(), fake.clone()).await;
    let v = f.wait_command(&node, &first, "failed").await;
    assert!(v.reason.as_deref().unwrap().starts_with("interrupted"), "{v:?}");
    assert_eq!(reboots.load(Ordering::SeqCst), 1, "not run twice");

    // 2. A wiped journal: the in-flight reboot is not retry-safe, so it fails with journal-lost.
    let second = f.enqueue(&node, "node.reboot", reboot.clone(), "reboot-2").await;
    wait_until("the reboot hook ran again", || async { reboots.load(Ordering::SeqCst) == 2 }).await;
    f.wait_command(&node, &second, "running").await;
    let old_journal = d.d.journal_id().to_owned();
    d.kill().await;
    std::fs::remove_file(f.dir.path().join("n1/journal.redb")).unwrap();
    let d = f.start(cfg.clone(), fake.clone()).await;
    assert_ne!(d.d.journal_id(), old_journal);
    let v = f.wait_command(&node, &second, "failed").await;
    assert_eq!(v.reason.as_deref(), Some("journal-lost"));
    assert_eq!(reboots.load(Ordering::SeqCst), 2);

    // 3. The node really reboots: it comes back with a new boot id and the reboot succeeded.
    let third = f.enqueue(&node, "node.reboot", reboot, "reboot-3").await;
    wait_until("the reboot hook ran a third time", || async { reboots.load(Ordering::SeqCst) == 3 }).await;
    f.wait_command(&node, &third, "running").await;
    d.kill().await;
    cfg.boot_id = "boot-2".into();
    let d = f.start(cfg, fake).await;
    f.wait_command(&node, &third, "succeeded").await;
    assert_eq!(reboots.load(Ordering::SeqCst), 3);
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_daemon_that_lost_its_pinned_key_refuses_a_signed_reboot_with_bad_signature_and_a_bad_signature_is_refused_too() {
    let f = Fleet::new().await;
    let (g, mut cfg, fake, d, node, reboots) = f.joined_with_reboot_hook().await;
    let pinned = std::fs::read_to_string(f.dir.path().join("n1").join(better_compute_daemon::identity::COMMAND_KEY_FILE)).unwrap();
    assert_eq!(pinned.trim(), f.signer.public_key().iter().map(|b| format!("{b:02x}")).collect::<String>(), "pinned at join");

    // Signed at enqueue, verified by the daemon: it runs.
    let signed = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "kernel"}), "reboot-signed").await;
    wait_until("the reboot hook ran", || async { reboots.load(Ordering::SeqCst) == 1 }).await;
    f.wait_command(&node, &signed, "running").await;
    d.kill().await;
    cfg.boot_id = "boot-2".into();
    let d = f.start(cfg.clone(), fake.clone()).await;
    f.wait_command(&node, &signed, "succeeded").await;

    // Tampered in the database: another payload under the signature (written while the daemon is
    // away, before the gateway can send it). Refused, finally.
    let c = f.h.db().client().await;
    d.kill().await;
    let tampered = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "x"}), "reboot-tampered").await;
    let n = c
        .execute("UPDATE commands SET body = (SELECT body FROM commands WHERE id = $2) WHERE id = $1 AND state = 'pending'", &[&tampered, &signed])
        .await
        .unwrap();
    assert_eq!(n, 1);
    let d = f.start(cfg.clone(), fake.clone()).await;
    let v = f.wait_command(&node, &tampered, "failed").await;
    assert_eq!(v.reason.as_deref(), Some("BAD_SIGNATURE"));
    assert_eq!(reboots.load(Ordering::SeqCst), 1, "never run");

    // The key store wiped: the daemon keeps its certificate but not the key, and learns it again
    // only by joining afresh. A properly signed reboot is refused.
    d.kill().await;
    std::fs::remove_file(f.dir.path().join("n1").join(better_compute_daemon::identity::COMMAND_KEY_FILE)).unwrap();
    let d = f.start(cfg.clone(), fake.clone()).await;
    let refused = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "kernel"}), "reboot-unpinned").await;
    let v = f.wait_command(&node, &refused, "failed").await;
    assert_eq!(v.reason.as_deref(), Some("BAD_SIGNATURE"));
    assert_eq!(reboots.load(Ordering::SeqCst), 1, "never run");
    // Operators are told, whoever asked.
    let told: i64 = c.query_one("SELECT count(*) FROM outbox WHERE type = 'command.badSignature' AND data->>'nodeId' = $1", &[&node]).await.unwrap().get(0);
    assert_eq!(told, 2);
    d.kill().await;
    let _ = g.stop.send(true);
}

/// A reboot enqueued through `registry` (signed with its key), keyed `key`.
async fn reboot_through(f: &Fleet, registry: &better_compute_runtime::Registry, node: &str, key: &str) -> String {
    f.enqueue_through(registry, node, "node.reboot", serde_json::json!({"reason": key}), key).await
}

#[tokio::test]
async fn a_key_rotation_is_followed_without_a_rejoin_both_keys_verify_until_the_old_one_is_retired() {
    let f = Fleet::new().await;
    let (g, mut cfg, fake, mut d, node, reboots) = f.joined_with_reboot_hook().await;
    let pinned = || std::fs::read_to_string(f.dir.path().join("n1").join(better_compute_daemon::identity::COMMAND_KEY_FILE)).unwrap().lines().count();
    assert_eq!(pinned(), 1);
    let hex = |k: Vec<u8>| k.iter().map(|b| format!("{b:02x}")).collect::<String>();

    // A reboot signed by the old key waits, queued, while the rotation happens.
    let old: &better_compute_runtime::Registry = f.h.registry();
    let new_key = Arc::new(better_compute_runtime::signing::CommandSigner::generate());
    let new = better_compute_runtime::Registry::new(vec![Arc::new(NodesModule), Arc::new(better_compute_workflows::WorkflowsModule)]).unwrap();
    new.install_command_signer(new_key.clone());
    {
        let mut c = f.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        assert_eq!(better_compute_nodes::commands::keys::rotate(&*tx, &f.signer, &new_key).await.unwrap(), 1);
        let again = better_compute_nodes::commands::keys::rotate(&*tx, &f.signer, &new_key).await.unwrap_err();
        assert!(again.to_string().contains("under way"), "{again}");
        tx.commit().await.unwrap();
    }
    f.settle_spec().await;
    f.converged(&node).await;
    wait_until("the daemon pinned the endorsed key", || async { pinned() == 2 }).await;
    let text = std::fs::read_to_string(f.dir.path().join("n1").join(better_compute_daemon::identity::COMMAND_KEY_FILE)).unwrap();
    assert!(text.contains(&hex(new_key.public_key())) && text.contains(&hex(f.signer.public_key())), "{text}");

    // Both verify during the rotation: each reboot runs, and the node comes back each time.
    for (i, (registry, key)) in [(old, "by-old"), (&new, "by-new")].into_iter().enumerate() {
        let id = reboot_through(&f, registry, &node, key).await;
        wait_until("the reboot hook ran", || async { reboots.load(Ordering::SeqCst) as usize == i + 1 }).await;
        f.wait_command(&node, &id, "running").await;
        d.kill().await;
        cfg.boot_id = format!("boot-{}", i + 2);
        d = f.start(cfg.clone(), fake.clone()).await;
        f.wait_command(&node, &id, "succeeded").await;
    }

    // The old key retired: the daemon forgets it; its signature no longer runs anything.
    {
        let mut c = f.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        assert_eq!(better_compute_nodes::commands::keys::retire_previous(&*tx).await.unwrap(), 1);
        tx.commit().await.unwrap();
    }
    f.settle_spec().await;
    f.converged(&node).await;
    wait_until("the daemon forgot the old key", || async { pinned() == 1 }).await;
    let id = reboot_through(&f, old, &node, "by-old-after").await;
    assert_eq!(f.wait_command(&node, &id, "failed").await.reason.as_deref(), Some("BAD_SIGNATURE"));
    assert_eq!(reboots.load(Ordering::SeqCst), 2);
    // And a restarted daemon still holds the new key alone.
    d.kill().await;
    let d = f.start(cfg.clone(), fake.clone()).await;
    let id = reboot_through(&f, &new, &node, "by-new-after").await;
    wait_until("the reboot hook ran", || async { reboots.load(Ordering::SeqCst) == 3 }).await;
    f.wait_command(&node, &id, "running").await;
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_session_closed_underneath_its_gateway_ends_its_stream_and_the_daemon_reconnects_to_run_what_is_queued() {
    let f = Fleet::new().await;
    let (g, _fake, d, node) = f.joined(true).await;
    // The gateway's lease lapses (a clock jump past it) and the liveness job closes its sessions
    // before the gateway renews: the gateway still holds the stream, the database no session.
    {
        let mut c = f.h.db().client().await;
        let tx = c.transaction().await.unwrap();
        tx.execute("UPDATE leases SET expires_at = compute_now() - interval '1 second' WHERE name = 'gateway:gw_a'", &[]).await.unwrap();
        let report = better_compute_nodes::sessions::liveness::evaluate(&*tx).await.unwrap();
        assert_eq!(report.gateway_lost, 1);
        tx.commit().await.unwrap();
    }
    let r = f.one("SELECT session_epoch, close_reason FROM node_sessions WHERE node_id = $1", &node).await;
    assert_eq!((r.get::<_, i64>(0), r.get::<_, Option<String>>(1)), (1, Some("gateway-lost".into())));
    // A command poked at the closed session finds it closed; the gateway must end the stream
    // (not only forget it), or the daemon heartbeats into it forever and the command never runs.
    let id = f.enqueue(&node, "diag.nvml", serde_json::json!({}), "after-close").await;
    f.wait_command(&node, &id, "succeeded").await;
    let r = f.one("SELECT session_epoch, closed_at IS NULL FROM node_sessions WHERE node_id = $1", &node).await;
    assert!(r.get::<_, i64>(0) >= 2 && r.get::<_, bool>(1), "the daemon reconnected in a new session");
    assert_eq!(f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0), "connected");
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_command_whose_lane_has_no_free_credit_waits_at_the_gateway_and_goes_the_moment_one_frees() {
    let f = Fleet::new().await;
    let (g, fake, d, node) = f.joined(true).await;
    // The diag lane has one credit; the first diagnostic holds it.
    fake.hold_diag();
    let a = f.enqueue(&node, "diag.nvml", serde_json::json!({}), "diag-a").await;
    f.wait_command(&node, &a, "running").await;
    let b = f.enqueue(&node, "diag.nvml", serde_json::json!({}), "diag-b").await;
    // A later command of another lane is sent past it: b was considered, and held.
    let inv = f.enqueue(&node, "inventory.refresh", serde_json::json!({}), "inv-after-b").await;
    f.wait_command(&node, &inv, "succeeded").await;
    let held = f.command(&node, &b).await;
    assert_eq!(held.state, "pending");
    assert_eq!(f.one("SELECT busy_count FROM commands WHERE id = $1", &b).await.get::<_, i32>(0), 0, "b was sent to be refused BUSY");
    // The running one's result frees the credit, and b goes at once: no back-off, no clock moved.
    fake.release_diag();
    f.wait_command(&node, &a, "succeeded").await;
    let v = f.wait_command(&node, &b, "succeeded").await;
    assert_eq!(v.result.unwrap()["backend"], "fake");
    assert_eq!(fake.diag_runs(), 2);
    // A flood of one lane's commands: every one runs, none is refused, none expires.
    let mut ids = Vec::new();
    for i in 0..60 {
        ids.push(f.enqueue(&node, "diag.nvml", serde_json::json!({}), &format!("flood-{i}")).await);
    }
    for id in &ids {
        f.wait_command(&node, id, "succeeded").await;
    }
    let busy: i64 = f.h.db().client().await.query_one("SELECT coalesce(sum(busy_count), 0)::int8 FROM commands WHERE id = ANY($1)", &[&ids]).await.unwrap().get(0);
    assert_eq!((ids.len(), busy), (60, 0));
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn the_four_api_kinds_run_for_real_and_injected_xids_each_reach_the_health_job_which_quarantines_on_a_fatal_one() {
    let f = Fleet::new().await;
    let (g, fake, d, node) = f.joined(true).await;

    let diag = f.enqueue(&node, "diag.nvml", serde_json::json!({"level": 2}), "k-diag").await;
    let v = f.wait_command(&node, &diag, "succeeded").await.result.unwrap();
    assert_eq!((v["level"].as_i64(), v["gpus"].as_array().map(Vec::len)), (Some(2), Some(2)));

    let inv = f.enqueue(&node, "inventory.refresh", serde_json::json!({"sections": ["gpus", "cpus"], "rescan": true}), "k-inv").await;
    let v = f.wait_command(&node, &inv, "succeeded").await.result.unwrap();
    assert_eq!(v["sections"]["cpus"]["vcpu"], 64);
    assert_eq!(v["sections"]["gpus"].as_array().unwrap().len(), 2);
    assert!(v["sections"].get("memory").is_none());
    let reported: serde_json::Value = f.one("SELECT reported_inventory FROM nodes WHERE id = $1", &node).await.get(0);
    assert_eq!(reported["gpus"].as_array().unwrap().len(), 2);

    let logs = f.enqueue(&node, "logs.collect", serde_json::json!({"maxBytes": 4096}), "k-logs").await;
    let v = f.wait_command(&node, &logs, "succeeded").await.result.unwrap();
    let lines = v["units"][0]["lines"].as_array().unwrap();
    assert!(lines.iter().any(|l| l.as_str().unwrap().contains("daemon started")), "{v}");
    assert!(lines.iter().map(|l| l.as_str().unwrap().len()).sum::<usize>() <= 4096);

    // Without a configured hook a reboot is refused UNSUPPORTED at admission, never accepted.
    let reboot = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "test"}), "k-reboot").await;
    let v = f.wait_command(&node, &reboot, "failed").await;
    assert!(v.reason.as_deref().is_some_and(|r| r.starts_with("UNSUPPORTED")), "{v:?}");

    // Health: XIDs that change nothing on the daemon's side (13 is the application's) still reach
    // the control plane as they happen, each one, in order: none is lost between heartbeats.
    let uuid = fake.uuids()[1].clone();
    fake.inject_xid(1, 13);
    fake.inject_xid(1, 31);
    wait_until("both XIDs are recorded", || async { f.signals(&uuid).await.len() == 2 }).await;
    let got = f.signals(&uuid).await;
    assert!(got[0].starts_with("XID 13:") && got[1].starts_with("XID 31:"), "{got:?}");
    // XID 79 (fallen off the bus): the health job quarantines the GPU, out of placement.
    fake.inject_xid(1, 79);
    wait_until("XID 79 is recorded", || async { f.signals(&uuid).await.len() == 3 }).await;
    f.h.job("health").drain(5).await;
    let r = f.h.db().client().await.query_one("SELECT healthy, health_state, quarantined FROM devices WHERE id = $1", &[&uuid]).await.unwrap();
    assert_eq!((r.get::<_, bool>(0), r.get::<_, String>(1), r.get::<_, bool>(2)), (false, "unhealthy".to_owned(), true));
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_rotated_certificate_replaces_the_old_one_and_moves_the_join_time() {
    let f = Fleet::new().await;
    let g = f.gateway("gw_a", true).await;
    let token = f.join_token(None).await;
    let d = f.start(f.config(&g, "n1", Some(token)), gpus("n1")).await;
    let node = d.d.node_id();
    let joined: std::time::SystemTime = f.one("SELECT joined_at FROM nodes WHERE id = $1", &node).await.get(0);
    f.h.db().advance(Duration::from_secs(60)).await;
    d.d.rotate_certificate().await.unwrap();
    let r = f.one("SELECT count(*), max(created_at) FROM node_certificates WHERE node_id = $1", &node).await;
    assert_eq!(r.get::<_, i64>(0), 2);
    let rejoined: std::time::SystemTime = f.one("SELECT joined_at FROM nodes WHERE id = $1", &node).await.get(0);
    assert_eq!(rejoined, r.get::<_, std::time::SystemTime>(1), "joined is the newest certificate");
    assert!(rejoined > joined);
    // The new certificate opens sessions.
    d.kill().await;
    let d = f.start(f.config(&g, "n1", None), gpus("n1")).await;
    wait_until("a session with the new certificate", || async {
        // The old session's row may be gone for a moment between the two.
        let epoch = f.h.db().client().await.query_opt("SELECT session_epoch FROM node_sessions WHERE node_id = $1", &[&node]).await.unwrap();
        epoch.is_some_and(|r| r.get::<_, i64>(0) >= 2)
    })
    .await;
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn bad_input_from_a_daemon_gets_a_clear_code_and_changes_nothing() {
    use better_compute_proto::v1::gateway_client::GatewayClient;
    use better_compute_proto::v1::{daemon_message, DaemonMessage, Heartbeat, Hello, JoinRequest};
    let f = Fleet::new().await;
    let g = f.gateway("gw_a", true).await;
    let token = f.join_token(None).await;
    let d = f.start(f.config(&g, "n1", Some(token)), gpus("n1")).await;
    let node = d.d.node_id();
    wait_until("the daemon's session is open", || async {
        f.h.db().client().await.query_opt("SELECT 1 FROM node_sessions WHERE node_id = $1", &[&node]).await.unwrap().is_some()
    })
    .await;
    d.kill().await;
    let id = better_compute_daemon::identity::Identity::load(&f.dir.path().join("n1")).unwrap().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{}", g.gw.addr()))
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(f.ca.cert_pem()))
                .identity(tonic::transport::Identity::from_pem(&id.cert_pem, &id.key_pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = GatewayClient::new(channel);
    let session = |first: daemon_message::Msg| {
        let mut client = client.clone();
        async move { client.session(tokio_stream::iter(vec![DaemonMessage { msg: Some(first) }])).await.map(|_| ()).unwrap_err() }
    };
    let hello = |node: &str, boot: &str| Hello {
        node_id: node.into(),
        boot_id: boot.into(),
        journal_id: "j".into(),
        observed_generation: 0,
        daemon_version: "t".into(),
        inventory_digest: String::new(),
    };
    let epoch = || async { f.one("SELECT session_epoch FROM node_sessions WHERE node_id = $1", &node).await.get::<_, i64>(0) };
    let before = epoch().await;
    let e = session(daemon_message::Msg::Heartbeat(Heartbeat {})).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    let e = session(daemon_message::Msg::Hello(hello("node_someone_else", "b"))).await;
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let e = session(daemon_message::Msg::Hello(hello(&node, ""))).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("bootId"), "{e}");
    assert_eq!(epoch().await, before, "no session was opened");
    // A join without a token, or with a garbled CSR, changes nothing either.
    let e = client.join(JoinRequest { join_token: String::new(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let token = f.join_token(None).await;
    let inventory = Some(better_compute_proto::v1::Inventory { vcpu: 1, memory_mib: 1, ..Default::default() });
    let e = client
        .join(JoinRequest { join_token: token.clone(), csr_pem: "garbage".into(), node_name: "n9".into(), inventory, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    let nodes: i64 = f.h.db().client().await.query_one("SELECT count(*) FROM nodes", &[]).await.unwrap().get(0);
    assert_eq!(nodes, 1, "the garbled join registered nothing");
    let used: bool = f.h.db().client().await.query_one("SELECT bool_or(used_at IS NOT NULL) FROM join_tokens WHERE used_by_node IS NULL", &[]).await.unwrap().get(0);
    assert!(!used, "and did not burn the token");
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_reboot_cancelled_during_its_grace_never_reboots_and_reports_cancelled() {
    let f = Fleet::new().await;
    let g = f.gateway("gw_a", true).await;
    let token = f.join_token(None).await;
    let reboots = Arc::new(AtomicU32::new(0));
    let mut cfg = f.config(&g, "n1", Some(token));
    let counter = reboots.clone();
    cfg.reboot = RebootHook::Callback(Arc::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let d = f.start(cfg, gpus("n1")).await;
    let node = d.d.node_id();
    f.settle_spec().await;
    f.converged(&node).await;
    // A grace far longer than the test: only the cancel can end it.
    let reboot = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "maintenance", "graceSeconds": 3600}), "reboot-later").await;
    f.wait_command(&node, &reboot, "running").await;
    let c = f.h.db().client().await;
    let marked = commands::cancel(&**c, &node, &reboot).await.unwrap();
    assert!(marked.cancel_requested);
    commands::poke_gateway(&c, &node).await;
    let v = f.wait_command(&node, &reboot, "failed").await;
    assert_eq!(v.reason.as_deref(), Some("cancelled"));
    assert_eq!(reboots.load(Ordering::SeqCst), 0, "the node rebooted after all");
    // The lane is free again: another reboot runs (and its hook fires).
    let now = f.enqueue(&node, "node.reboot", serde_json::json!({"reason": "now"}), "reboot-now").await;
    wait_until("the second reboot's hook ran", || async { reboots.load(Ordering::SeqCst) == 1 }).await;
    f.wait_command(&node, &now, "running").await;
    d.kill().await;
    let _ = g.stop.send(true);
}

#[tokio::test]
async fn a_gateway_that_stops_cleanly_marks_its_nodes_disconnected_at_once() {
    let f = Fleet::new().await;
    let (g, _fake, d, node) = f.joined(true).await;
    assert_eq!(f.one("SELECT liveness FROM nodes WHERE id = $1", &node).await.get::<_, String>(0), "connected");
    let _ = g.stop.send(true);
    tokio::time::timeout(Duration::from_secs(60), g.gw.join()).await.expect("the gateway did not stop");
    // No time has passed on the database's clock: the close, not the silence, disconnected it.
    let row = f.one("SELECT liveness, (SELECT close_reason FROM node_sessions WHERE node_id = $1) FROM nodes WHERE id = $1", &node).await;
    let (liveness, reason): (String, Option<String>) = (row.get(0), row.get(1));
    assert_eq!((liveness.as_str(), reason.as_deref()), ("disconnected", Some("the gateway stopped")));
    d.kill().await;
}

#[tokio::test]
async fn a_restarted_daemon_restores_the_layout_its_allocations_were_placed_on_from_its_journal() {
    use better_compute_daemon::backend::GpuBackend;
    use better_compute_daemon::journal::Journal;
    use better_compute_proto::v1::{Allocation, AllocationsSection, Gpu, GpuMode, GpusSection, NodeSpec};
    use prost::Message;

    let f = Fleet::new().await;
    let (g, fake, d, _node) = f.joined(true).await;
    let u = fake.uuids();
    d.kill().await;
    let path = f.dir.path().join("n1/journal.redb");
    {
        let j = Journal::open(&path).unwrap();
        // The first spec's layouts (both GPUs exclusive) were journaled as they were applied.
        let layouts = GpusSection::decode(j.gpu_layouts().unwrap().expect("layouts journaled").as_slice()).unwrap();
        assert_eq!(layouts.gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>(), u);
        // As if GPU 0 had since been put in MIG mode and an allocation held its second instance
        // (this fleet has no capacity module to place one).
        let (generation, bytes) = j.applied_spec().unwrap().unwrap();
        let mut spec = NodeSpec::decode(bytes.as_slice()).unwrap();
        let mig = Gpu { uuid: u[0].clone(), index: 0, mode: GpuMode::Mig as i32, mig_layout: vec!["3g.40gb".into(), "3g.40gb".into()], slots: 0 };
        spec.gpus.as_mut().unwrap().gpus[0] = mig.clone();
        spec.allocations = Some(AllocationsSection {
            allocations: vec![Allocation { allocation_id: "res_a".into(), atoms: vec![format!("{}/mig1", u[0])], ..Default::default() }],
        });
        j.set_applied_spec(generation, &spec.encode_to_vec()).unwrap();
        let mut layouts = layouts;
        layouts.gpus[0] = mig;
        j.set_gpu_layouts(&layouts.encode_to_vec()).unwrap();
    }
    // The daemon restarts on GPUs that lost their layout (fresh fakes are exclusive): before it
    // runs, it has restored the MIG layout its allocation was placed on.
    let fresh = gpus("n1");
    assert!(!fresh.inventory().unwrap().gpus[0].mig_enabled);
    let restarted = Daemon::start(f.config(&g, "n1", None), fresh.clone()).await.unwrap();
    let inv = fresh.inventory().unwrap();
    assert!(inv.gpus[0].mig_enabled, "the MIG layout was not restored");
    assert_eq!(inv.gpus[0].mig_instances.len(), 2);
    assert!(!inv.gpus[1].mig_enabled);
    drop(restarted);
    let _ = g.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_serves_an_operators_certificate_and_daemons_trusting_its_issuer_join_through_it() {
    let f = Fleet::new().await;
    // The operator's certificate comes from a CA of their own, not the fleet's.
    let operators = Ca::generate().unwrap();
    let mut cfg = GatewayConfig::new("gw_op", "127.0.0.1:0");
    cfg.command_key = f.signer.public_key();
    cfg.server_identity = Some(operators.server_identity(&["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap());
    let (stop, stopped) = watch::channel(false);
    let gw = Gateway::start(f.h.db().pool.clone(), f.ca.clone(), cfg, stopped).await.unwrap();
    let g = RunningGateway { gw, stop };
    // A daemon trusting only the fleet's CA cannot reach it.
    let refused = Daemon::start(f.config(&g, "n0", Some(f.join_token(None).await)), gpus("n0")).await.err().map(|e| e.to_string());
    assert!(refused.as_deref().is_some_and(|e| e.contains("UnknownIssuer") || e.contains("BadSignature")), "{refused:?}");
    // One trusting the operator's CA joins and converges.
    let mut cfg = f.config(&g, "n1", Some(f.join_token(None).await));
    cfg.ca_pem = Some(operators.cert_pem().to_owned());
    let d = f.start(cfg, gpus("n1")).await;
    let node = d.d.node_id();
    f.settle_spec().await;
    f.converged(&node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_answers_the_grpc_health_check_without_a_client_certificate() {
    use tonic_health::pb::health_check_response::ServingStatus;
    let f = Fleet::new().await;
    let g = f.gateway("gw_health", false).await;
    let tls = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(f.ca.cert_pem())).domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://{}", g.gw.addr())).unwrap().tls_config(tls).unwrap().connect().await.unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in ["", "bettercompute.agent.v1.Gateway"] {
        let r = health.check(tonic_health::pb::HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{service:?}");
    }
    let unknown = health.check(tonic_health::pb::HealthCheckRequest { service: "no.such.Service".into() }).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

/// The spans this test process's OpenTelemetry layer ended.
#[derive(Debug, Clone, Default)]
struct EndedSpans(Arc<std::sync::Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

impl opentelemetry_sdk::trace::SpanExporter for EndedSpans {
    fn export(&self, batch: Vec<opentelemetry_sdk::trace::SpanData>) -> impl std::future::Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        self.0.lock().unwrap().extend(batch);
        std::future::ready(Ok(()))
    }
}

#[tokio::test]
async fn a_commands_run_on_its_node_joins_the_trace_of_the_span_that_enqueued_it() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider};
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;
    let ended = EndedSpans::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().with_simple_exporter(ended.clone()).build();
    let subscriber = tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    tracing::subscriber::set_global_default(subscriber).expect("this test process's only subscriber");
    let f = Fleet::new().await;
    let (_g, _fake, _d, node) = f.joined(true).await;
    // An API request's span, in a caller's trace.
    let span = tracing::info_span!("request");
    better_compute_trace::follow(&span, Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    let id = f.enqueue(&node, "diag.nvml", serde_json::json!({}), "traced").instrument(span.clone()).await;
    let request = span.context().span().span_context().span_id();
    drop(span);
    // The command's row holds the request span's context, and the daemon's run is its child.
    let row: String = f.h.db().client().await.query_one("SELECT trace_parent FROM commands WHERE id = $1", &[&id]).await.unwrap().get(0);
    assert_eq!(row, format!("00-4bf92f3577b34da6a3ce929d0e0e4736-{request}-01"));
    f.wait_command(&node, &id, "succeeded").await;
    wait_until("the daemon's span of the run ended", || async { ended.0.lock().unwrap().iter().any(|s| s.name == "command diag.nvml") }).await;
    let spans = ended.0.lock().unwrap().clone();
    let runs: Vec<_> = spans.iter().filter(|s| s.name == "command diag.nvml").collect();
    assert_eq!(runs.len(), 1, "{spans:?}");
    assert_eq!(runs[0].span_context.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!((runs[0].parent_span_id, runs[0].parent_span_is_remote), (request, true));
    // Spans of the request's own process ended in the caller's trace too (the enqueue's span).
    assert!(spans.iter().any(|s| s.name == "request" && s.parent_span_id.to_string() == "00f067aa0ba902b7"), "{spans:?}");
}
