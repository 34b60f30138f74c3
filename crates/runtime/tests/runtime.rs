//! The runtime against a real PostgreSQL in simulated time: the work queue, outcomes and back-off,
//! sharing between workers and takeover, pokes, periodic keys and resync, and the outbox.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use better_compute_db::lease::WORKER_LEASE_TTL;
use better_compute_db::{DbError, Lease};
use better_compute_runtime::harness::Harness;
use better_compute_runtime::outbox::{self, dispatch_batch, sink_lease, Cursor, DispatchError, Event};
use better_compute_runtime::work_queue::{self, ShardGrant};
use better_compute_runtime::{
    status, Kind, Module, NewEvent, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy, Sink, Worker,
    WorkerConfig,
};
use tokio::sync::Notify;

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f).await.unwrap_or_else(|_| panic!("timed out: {what}"))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Behave {
    Done,
    SyncAgain,
    Fail,
}

/// A reconciler that records what it runs and can be scripted.
struct Probe {
    kind: Kind,
    behave: Mutex<Behave>,
    periodic: Vec<Periodic>,
    keys: Vec<String>,
    runs: Mutex<Vec<(String, String)>>,
    running: Mutex<HashSet<String>>,
    overlaps: AtomicUsize,
    /// Keys whose first run waits for `gate` after announcing itself on `entered`.
    gated: Mutex<HashSet<String>>,
    entered: Notify,
    gate: Notify,
    /// Write a fenced effect row for every run.
    write_effects: bool,
    /// Re-enqueue the key from another transaction during its first run.
    dirty_during_first_run: bool,
    /// Keys whose runs hold a pooled connection for a while before they end.
    hold_connection: Mutex<HashSet<String>>,
    fenced_failures: AtomicUsize,
}

impl Probe {
    fn new(name: &'static str, shard_by: ShardBy) -> Probe {
        Probe {
            kind: Kind { name, shard_by },
            behave: Mutex::new(Behave::Done),
            periodic: Vec::new(),
            keys: Vec::new(),
            runs: Mutex::new(Vec::new()),
            running: Mutex::new(HashSet::new()),
            overlaps: AtomicUsize::new(0),
            gated: Mutex::new(HashSet::new()),
            entered: Notify::new(),
            gate: Notify::new(),
            write_effects: false,
            dirty_during_first_run: false,
            hold_connection: Mutex::new(HashSet::new()),
            fenced_failures: AtomicUsize::new(0),
        }
    }

    fn runs_of(&self, key: &str) -> usize {
        self.runs.lock().unwrap().iter().filter(|(k, _)| k == key).count()
    }

    fn total_runs(&self) -> usize {
        self.runs.lock().unwrap().len()
    }
}

#[async_trait::async_trait]
impl Reconciler for Probe {
    fn kind(&self) -> Kind {
        self.kind
    }

    fn periodic(&self) -> &[Periodic] {
        &self.periodic
    }

    async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError> {
        if !self.running.lock().unwrap().insert(key.to_owned()) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let first = self.runs_of(key) == 0;
        self.runs.lock().unwrap().push((key.to_owned(), ctx.worker_id().to_owned()));
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        if self.gated.lock().unwrap().remove(key) {
            self.entered.notify_one();
            self.gate.notified().await;
        }
        if self.hold_connection.lock().unwrap().contains(key) {
            let _held = ctx.client().await?;
            // Long enough for a quicker run to end and its outcome to need a connection.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if first && self.dirty_during_first_run {
            let mut c = ctx.client().await?;
            let tx = c.transaction().await?;
            work_queue::enqueue(&*tx, &self.kind, key).await?;
            tx.commit().await?;
        }
        if self.write_effects {
            let mut c = ctx.client().await?;
            match ctx.begin_fenced(&mut c).await {
                Ok(tx) => {
                    tx.execute(
                        "INSERT INTO effects (key, worker, epoch) VALUES ($1, $2, $3)",
                        &[&key, &ctx.worker_id(), &tx.epoch()],
                    )
                    .await?;
                    tx.commit().await?;
                }
                Err(e) => {
                    self.fenced_failures.fetch_add(1, Ordering::SeqCst);
                    self.running.lock().unwrap().remove(key);
                    return Err(e.into());
                }
            }
        }
        self.running.lock().unwrap().remove(key);
        match *self.behave.lock().unwrap() {
            Behave::Done => {
                ctx.count("finished", 1);
                Ok(Outcome::Done)
            }
            Behave::SyncAgain => Ok(Outcome::SyncAgain),
            Behave::Fail => Err("planned failure".into()),
        }
    }

    async fn keys(&self, _ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        Ok(self.keys.iter().filter(|k| shards.contains(&self.kind.shard_of(k))).cloned().collect())
    }
}

/// Records delivered events; can be told to fail after recording.
struct Recorder {
    name: String,
    seen: Mutex<Vec<String>>,
    fail: std::sync::atomic::AtomicBool,
}

impl Recorder {
    fn new(name: &str) -> Arc<Recorder> {
        Arc::new(Recorder { name: name.to_owned(), seen: Mutex::new(Vec::new()), fail: false.into() })
    }
}

#[async_trait::async_trait]
impl Sink for Recorder {
    fn name(&self) -> &str {
        &self.name
    }

    async fn deliver(&self, _tx: &tokio_postgres::Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        self.seen.lock().unwrap().extend(events.iter().map(|e| e.subject.clone()));
        if self.fail.load(Ordering::SeqCst) {
            return Err("receiver crashed".into());
        }
        Ok(())
    }
}

struct TestModule {
    reconcilers: Vec<Arc<dyn Reconciler>>,
    subscribers: Vec<Arc<dyn Sink>>,
}

impl Module for TestModule {
    fn name(&self) -> &'static str {
        "test"
    }
    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        self.reconcilers.clone()
    }
    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        self.subscribers.clone()
    }
}

async fn harness_with(probe: Arc<Probe>, subscribers: Vec<Arc<dyn Sink>>) -> Harness {
    let h = Harness::new(vec![Arc::new(TestModule { reconcilers: vec![probe], subscribers })]).await;
    h.db().client().await.batch_execute("CREATE TABLE effects (key text, worker text, epoch bigint)").await.unwrap();
    h
}

async fn enqueue(h: &Harness, kind: &Kind, key: &str) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    work_queue::enqueue(&*tx, kind, key).await.unwrap();
    tx.commit().await.unwrap();
    work_queue::poke(&c).await;
}

async fn queue_len(h: &Harness) -> i64 {
    h.db().client().await.query_one("SELECT count(*) FROM work_queue WHERE kind <> 'housekeeping'", &[]).await.unwrap().get(0)
}

const NODE_KIND: &str = "probe";

#[tokio::test]
async fn a_key_enqueued_100_times_while_queued_runs_once() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    for _ in 0..100 {
        enqueue(&h, &probe.kind, "node_a").await;
    }
    let generation: i64 = h.db().client().await.query_one("SELECT gen FROM work_queue WHERE kind = 'probe'", &[]).await.unwrap().get(0);
    assert_eq!(generation, 100);
    let r = h.job(NODE_KIND).tick().await;
    assert_eq!((r.claimed, r.done), (1, 1));
    assert_eq!(h.job(NODE_KIND).tick().await.claimed, 0);
    assert_eq!(probe.runs_of("node_a"), 1);
    assert_eq!(queue_len(&h).await, 0);
}

#[tokio::test]
async fn a_key_enqueued_again_while_its_run_is_in_flight_runs_again_afterwards() {
    let mut p = Probe::new(NODE_KIND, ShardBy::Node);
    p.dirty_during_first_run = true;
    let probe = Arc::new(p);
    let h = harness_with(probe.clone(), vec![]).await;
    enqueue(&h, &probe.kind, "node_a").await;
    assert_eq!(h.job(NODE_KIND).tick().await.done, 1);
    // Done, but the key was dirtied during the run: it stays, unclaimed and due.
    assert_eq!(queue_len(&h).await, 1);
    assert_eq!(h.job(NODE_KIND).tick().await.done, 1);
    assert_eq!(probe.runs_of("node_a"), 2);
    assert_eq!(queue_len(&h).await, 0);
}

#[tokio::test]
async fn sync_again_brings_the_key_back_after_one_second() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    *probe.behave.lock().unwrap() = Behave::SyncAgain;
    let h = harness_with(probe.clone(), vec![]).await;
    enqueue(&h, &probe.kind, "node_a").await;
    assert_eq!(h.job(NODE_KIND).tick().await.sync_again, 1);
    assert_eq!(h.job(NODE_KIND).tick().await.claimed, 0);
    h.db().advance(Duration::from_millis(999)).await;
    assert_eq!(h.job(NODE_KIND).tick().await.claimed, 0);
    h.db().advance(Duration::from_millis(1)).await;
    *probe.behave.lock().unwrap() = Behave::Done;
    assert_eq!(h.job(NODE_KIND).tick().await.done, 1);
    assert_eq!(queue_len(&h).await, 0);
}

#[tokio::test]
async fn errors_back_off_from_one_second_doubling_to_five_minutes_and_keep_the_last_error() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    *probe.behave.lock().unwrap() = Behave::Fail;
    let h = harness_with(probe.clone(), vec![]).await;
    enqueue(&h, &probe.kind, "node_a").await;
    assert_eq!(h.job(NODE_KIND).tick().await.errors, 1);
    let mut waited = Vec::new();
    for expected_s in [1u64, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300] {
        h.db().advance(Duration::from_secs(expected_s) - Duration::from_millis(1)).await;
        assert_eq!(h.job(NODE_KIND).tick().await.claimed, 0, "ran before its {expected_s} s back-off");
        h.db().advance(Duration::from_millis(1)).await;
        assert_eq!(h.job(NODE_KIND).tick().await.errors, 1, "did not run after its {expected_s} s back-off");
        waited.push(expected_s);
    }
    let c = h.db().client().await;
    let row = c.query_one("SELECT attempts, last_error FROM work_queue WHERE kind = 'probe'", &[]).await.unwrap();
    assert_eq!(row.get::<_, i32>(0), 12);
    assert_eq!(row.get::<_, String>(1), "planned failure");
    let queues = status::queues(&**c, &[NODE_KIND]).await.unwrap();
    let probe_queue = queues.iter().find(|q| q.job == NODE_KIND).unwrap();
    assert_eq!(probe_queue.failing, 1);
    assert_eq!(probe_queue.last_error.as_deref(), Some("node_a: planned failure"));
    // A success clears it.
    *probe.behave.lock().unwrap() = Behave::Done;
    h.db().advance(Duration::from_secs(300)).await;
    assert_eq!(h.job(NODE_KIND).tick().await.done, 1);
    assert_eq!(queue_len(&h).await, 0);
}

#[tokio::test]
async fn a_panicking_reconciler_fails_its_key_not_the_worker() {
    struct Panics;
    #[async_trait::async_trait]
    impl Reconciler for Panics {
        fn kind(&self) -> Kind {
            Kind { name: "panics", shard_by: ShardBy::None }
        }
        async fn run(&self, _ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
            panic!("bug")
        }
    }
    let h = Harness::new(vec![Arc::new(TestModule { reconcilers: vec![Arc::new(Panics)], subscribers: vec![] })]).await;
    enqueue(&h, &Kind { name: "panics", shard_by: ShardBy::None }, "all").await;
    let r = h.job("panics").tick().await;
    assert_eq!(r.errors, 1);
    assert!(r.last_error.unwrap().contains("panicked"));
}

async fn split_between(h: &Harness, a: &Worker, b: &Worker) {
    // The harness's own worker steps aside; both register, then each takes what rendezvous hashing gives it.
    h.worker().shutdown().await.unwrap();
    a.maintain().await.unwrap();
    b.maintain().await.unwrap();
    a.maintain().await.unwrap();
    b.maintain().await.unwrap();
    let (sa, sb) = (a.shards(), b.shards());
    assert_eq!(sa.len() + sb.len(), 256, "{} + {}", sa.len(), sb.len());
    assert!(sa.iter().all(|s| !sb.contains(s)));
    assert!(sa.len() > 60 && sb.len() > 60, "{} / {}", sa.len(), sb.len());
}

async fn drain(w: &Worker) {
    while w.tick(NODE_KIND).await.unwrap().claimed > 0 {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_never_run_the_same_key_at_the_same_time() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    let w1 = h.another_worker("wrk_1").await;
    let w2 = h.another_worker("wrk_2").await;
    split_between(&h, &w1, &w2).await;
    let keys: Vec<String> = (0..400).map(|i| format!("node_{i}")).collect();
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        work_queue::enqueue_many(&*tx, &probe.kind, &keys).await.unwrap();
        tx.commit().await.unwrap();
    }
    within("both workers drain", async { tokio::join!(drain(&w1), drain(&w2)) }).await;
    assert_eq!(probe.overlaps.load(Ordering::SeqCst), 0);
    let runs = probe.runs.lock().unwrap().clone();
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for (k, _) in &runs {
        *per_key.entry(k.as_str()).or_default() += 1;
    }
    assert_eq!(per_key.len(), 400);
    assert!(per_key.values().all(|n| *n == 1));
    let by_w1 = runs.iter().filter(|(_, w)| w == "wrk_1").count();
    assert!(by_w1 > 50 && by_w1 < 350, "wrk_1 ran {by_w1} of 400");
    assert_eq!(queue_len(&h).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lapsed_workers_shards_move_to_the_other_and_its_fenced_write_then_fails() {
    let mut p = Probe::new(NODE_KIND, ShardBy::Node);
    p.write_effects = true;
    let probe = Arc::new(p);
    let h = harness_with(probe.clone(), vec![]).await;
    let w1 = h.another_worker("wrk_1").await;
    let w2 = h.another_worker("wrk_2").await;
    split_between(&h, &w1, &w2).await;
    let key = (0..).map(|i| format!("node_{i}")).find(|k| w1.shards().contains(&probe.kind.shard_of(k))).unwrap();
    enqueue(&h, &probe.kind, &key).await;
    probe.gated.lock().unwrap().insert(key.clone());

    let zombie = async {
        // w1 claims the key and starts its run, which stalls (a GC pause, a stopped VM).
        w1.tick(NODE_KIND).await.unwrap()
    };
    let world = async {
        probe.entered.notified().await;
        // w2 must not get the key while w1's lease and claim are live.
        assert_eq!(w2.tick(NODE_KIND).await.unwrap().claimed, 0);
        // w1 misses its renewals: after 16 s its heartbeat and leases are stale, and w2 takes every shard.
        h.db().advance(Duration::from_secs(16)).await;
        let m = w2.maintain().await.unwrap();
        assert_eq!((m.live_workers, m.shards), (1, 256));
        let r = w2.tick(NODE_KIND).await.unwrap();
        assert_eq!((r.claimed, r.done), (1, 1));
        // Only now does the zombie wake up and try to write.
        probe.gate.notify_one();
    };
    let (zombie_report, ()) = within("takeover", async { tokio::join!(zombie, world) }).await;
    assert_eq!(zombie_report.errors, 1, "{zombie_report:?}");
    assert!(zombie_report.last_error.unwrap().contains("no longer held"));
    assert_eq!(probe.fenced_failures.load(Ordering::SeqCst), 1);
    let effects: Vec<(String, String, i64)> = h
        .db()
        .client()
        .await
        .query("SELECT key, worker, epoch FROM effects", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(effects, [(key.clone(), "wrk_2".to_owned(), 2)]);
    // The zombie can no longer claim anything, even with a stale idea of its shards.
    enqueue(&h, &probe.kind, &key).await;
    assert_eq!(w1.tick(NODE_KIND).await.unwrap().claimed, 0);
    assert_eq!(queue_len(&h).await, 1);
}

#[tokio::test]
async fn a_crashed_workers_claim_expires_and_the_key_is_claimed_again() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    h.worker().shutdown().await.unwrap();
    let crashed = h.another_worker("wrk_crashed").await;
    crashed.maintain().await.unwrap();
    enqueue(&h, &probe.kind, "node_a").await;
    // It claims the key and dies before applying any outcome.
    let c = h.db().client().await;
    let shard = probe.kind.shard_of("node_a");
    let lease: (String, i64) = {
        let r = c.query_one("SELECT name, epoch FROM leases WHERE name = $1", &[&format!("shard:{shard}")]).await.unwrap();
        (r.get(0), r.get(1))
    };
    let grant = ShardGrant { shard, lease: lease.0, epoch: lease.1 };
    let claimed = work_queue::claim(&**c, NODE_KIND, &[grant], "wrk_crashed", WORKER_LEASE_TTL, 10).await.unwrap();
    assert_eq!(claimed.len(), 1);
    // The harness worker cannot take the shard or the key yet.
    assert_eq!(h.job(NODE_KIND).tick().await.claimed, 0);
    h.db().advance(Duration::from_secs(16)).await;
    let r = h.job(NODE_KIND).tick().await;
    assert_eq!((r.claimed, r.done), (1, 1));
    assert_eq!(probe.runs_of("node_a"), 1);
}

#[tokio::test]
async fn periodic_keys_and_resync_enqueue_in_simulated_time() {
    let mut p = Probe::new("sweeper", ShardBy::None);
    p.periodic = vec![Periodic { key: "all", every: Duration::from_secs(300) }];
    p.keys = vec!["x".into(), "y".into()];
    let probe = Arc::new(p);
    let h = harness_with(probe.clone(), vec![]).await;
    assert_eq!(h.job("sweeper").tick().await.done, 1);
    assert_eq!(h.job("sweeper").tick().await.claimed, 0);
    h.db().advance(Duration::from_secs(299)).await;
    assert_eq!(h.job("sweeper").tick().await.claimed, 0);
    h.db().advance(Duration::from_secs(1)).await;
    assert_eq!(h.job("sweeper").tick().await.done, 1);
    assert_eq!(probe.runs_of("all"), 2);
    // Resync: within 5 to 10 minutes every key the reconciler owns is enqueued again.
    assert_eq!(probe.runs_of("x"), 0);
    h.db().advance(Duration::from_secs(600)).await;
    h.job("sweeper").drain(10).await;
    assert_eq!((probe.runs_of("x"), probe.runs_of("y")), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_wakes_a_sleeping_worker_at_once() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    h.worker().shutdown().await.unwrap();
    let registry = h.registry().clone();
    let mut cfg = WorkerConfig::new("wrk_listening");
    cfg.poll_interval = Duration::from_secs(3600);
    cfg.maintain_every = Duration::from_secs(3600);
    cfg.listen = Some(h.db().connection_string().to_owned());
    let worker = Arc::new(Worker::start(h.db().pool.clone(), registry, cfg).await.unwrap());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(worker.clone().run(stopped));
    // Wait until it holds its shards and sleeps.
    within("worker holds shards", async {
        while worker.shards().len() < 256 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    for i in 0..3 {
        enqueue(&h, &probe.kind, &format!("node_{i}")).await;
        // The worker polls only hourly here, so only a poke can wake it. The listener connects in the
        // background and a poke sent before it listens is lost (by design, polling covers that), so
        // poke again until the run happens.
        within("the poked worker runs the key", async {
            while probe.total_runs() <= i {
                tokio::time::sleep(Duration::from_millis(50)).await;
                work_queue::poke(&**h.db().client().await).await;
            }
        })
        .await;
    }
    stop.send(true).unwrap();
    within("worker stops", running).await.unwrap().unwrap();
    // A clean stop lets the leases go and removes the worker.
    let c = h.db().client().await;
    let holders = status::holders(&**c).await.unwrap();
    assert!(!holders.iter().any(|x| x.worker_id == "wrk_listening"), "{holders:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pokes_that_come_together_share_a_notify_and_every_poke_is_followed_by_one() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let listener = tokio::spawn(work_queue::listen(h.db().connection_string().to_owned(), &[work_queue::POKE_CHANNEL], move |_, _| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let poker = work_queue::Poker::start(h.db().pool.clone());
    // A poke sent before the listener listens is lost by design (polling covers it): poke until
    // one arrives.
    within("the listener hears a poke", async {
        while seen.load(Ordering::SeqCst) == 0 {
            poker.poke();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // The warm-up's last poke may still be on its way.
    let start = seen.load(Ordering::SeqCst) + 1;
    for burst in 1..=3 {
        let before = seen.load(Ordering::SeqCst);
        for _ in 0..1000 {
            poker.poke();
        }
        within("a burst of pokes is followed by a NOTIFY", async {
            while seen.load(Ordering::SeqCst) == before {
                tokio::task::yield_now().await;
            }
        })
        .await;
        // A burst is folded into the NOTIFY being sent when it came, if any, and one after it: never
        // more than two a burst, however late they arrive (one per poke would be a thousand).
        let sent = seen.load(Ordering::SeqCst).saturating_sub(start);
        assert!(sent <= 2 * burst, "{sent} NOTIFYs for {burst} bursts of 1,000 pokes");
    }
    listener.abort();
}

#[tokio::test]
async fn the_operator_view_shows_queues_job_runs_and_shard_holders() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    for i in 0..5 {
        enqueue(&h, &probe.kind, &format!("node_{i}")).await;
    }
    h.worker().maintain().await.unwrap();
    let c = h.db().client().await;
    let q = status::queues(&**c, &[NODE_KIND, "event-subscribers"]).await.unwrap();
    let probe_q = q.iter().find(|q| q.job == NODE_KIND).unwrap();
    assert_eq!((probe_q.depth, probe_q.due), (5, 5));
    assert!(q.iter().any(|q| q.job == "event-subscribers" && q.depth == 0));
    h.job(NODE_KIND).tick().await;
    h.worker().maintain().await.unwrap();
    let runs = status::job_runs(&**c).await.unwrap();
    let run = runs.iter().find(|r| r.job == NODE_KIND && r.worker_id == "wrk_harness").unwrap();
    assert_eq!(run.last_report["done"], 5);
    let holders = status::holders(&**c).await.unwrap();
    let me = holders.iter().find(|x| x.worker_id == "wrk_harness").unwrap();
    assert_eq!(me.shards.len(), 256);
    assert!(me.live);
}

/// Waits until every outbox row is older than every running transaction in the cluster. Other
/// tests share the cluster, and their open transactions hold the snapshot's xmin back for a moment.
async fn outbox_settled(h: &Harness) {
    let c = h.db().client().await;
    within("outbox rows to settle below xmin", async {
        loop {
            let settled: bool = c
                .query_one(
                    "SELECT coalesce(max(txid) < pg_snapshot_xmin(pg_current_snapshot()), true) FROM outbox",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if settled {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

async fn emit_in_own_tx(h: &Harness, subject: &str) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    outbox::emit(&*tx, NewEvent { event_type: "test.happened", tenant_id: Some("ten_a"), subject, data: serde_json::json!({}) })
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_reader_never_skips_a_row_that_commits_late() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    let mut a = h.db().connect().await;
    let mut b = h.db().connect().await;
    let reader = h.db().client().await;
    // A writes first (lower txid and seq) but commits last.
    let tx_a = a.transaction().await.unwrap();
    outbox::emit(&tx_a, NewEvent { event_type: "t", tenant_id: None, subject: "A", data: serde_json::json!({}) }).await.unwrap();
    let tx_b = b.transaction().await.unwrap();
    outbox::emit(&tx_b, NewEvent { event_type: "t", tenant_id: None, subject: "B", data: serde_json::json!({}) }).await.unwrap();
    tx_b.commit().await.unwrap();
    // B is committed, but A could still commit behind it: the reader must not pass A.
    for _ in 0..20 {
        let seen = outbox::read_after(&**reader, Cursor::START, 100).await.unwrap();
        assert!(seen.is_empty(), "read {:?} while an older transaction was open", seen.iter().map(|e| &e.subject).collect::<Vec<_>>());
    }
    tx_a.commit().await.unwrap();
    outbox_settled(&h).await;
    let seen: Vec<String> = outbox::read_after(&**reader, Cursor::START, 100).await.unwrap().into_iter().map(|e| e.subject).collect();
    assert_eq!(seen, ["A", "B"]);
}

#[tokio::test]
async fn a_new_dispatch_lease_holder_resumes_from_the_saved_cursor() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    for i in 1..=10 {
        emit_in_own_tx(&h, &format!("e{i}")).await;
    }
    outbox_settled(&h).await;
    let sink = Recorder::new("recorder");
    let c = h.db().client().await;
    let lease_a = Lease::acquire(&**c, &sink_lease("recorder"), "wrk_a", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(dispatch_batch(&h.db().pool, sink.as_ref(), &lease_a, 4).await.unwrap(), 4);
    // A's next batch reaches the receiver, but A dies before its cursor is saved.
    sink.fail.store(true, Ordering::SeqCst);
    assert!(matches!(dispatch_batch(&h.db().pool, sink.as_ref(), &lease_a, 4).await, Err(DispatchError::Sink { .. })));
    sink.fail.store(false, Ordering::SeqCst);
    h.db().advance(WORKER_LEASE_TTL + Duration::from_secs(1)).await;
    let lease_b = Lease::acquire(&**c, &sink_lease("recorder"), "wrk_b", WORKER_LEASE_TTL, None).await.unwrap().unwrap();
    assert_eq!(lease_b.epoch(), 2);
    assert_eq!(dispatch_batch(&h.db().pool, sink.as_ref(), &lease_b, 4).await.unwrap(), 4);
    assert_eq!(dispatch_batch(&h.db().pool, sink.as_ref(), &lease_b, 4).await.unwrap(), 2);
    assert_eq!(dispatch_batch(&h.db().pool, sink.as_ref(), &lease_b, 4).await.unwrap(), 0);
    let seen = sink.seen.lock().unwrap().clone();
    let expected: Vec<String> = [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10].iter().map(|i| format!("e{i}")).collect();
    assert_eq!(seen, expected, "nothing skipped; only the unsaved batch repeats");
    // The old holder is fenced off.
    assert!(matches!(
        dispatch_batch(&h.db().pool, sink.as_ref(), &lease_a, 4).await,
        Err(DispatchError::Db(DbError::LeaseLost { .. }))
    ));
}

#[tokio::test]
async fn in_process_subscribers_receive_every_event_through_the_event_subscribers_job() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let sink = Recorder::new("audit");
    let h = harness_with(probe, vec![sink.clone()]).await;
    for i in 0..7 {
        emit_in_own_tx(&h, &format!("s{i}")).await;
    }
    outbox_settled(&h).await;
    let r = h.job("event-subscribers").tick().await;
    assert_eq!(r.delivered, 7);
    assert_eq!(h.job("event-subscribers").tick().await.delivered, 0);
    emit_in_own_tx(&h, "s7").await;
    outbox_settled(&h).await;
    assert_eq!(h.job("event-subscribers").tick().await.delivered, 1);
    let seen = sink.seen.lock().unwrap().clone();
    assert_eq!(seen, (0..8).map(|i| format!("s{i}")).collect::<Vec<_>>());
    let c = h.db().client().await;
    let delivered: i64 = c.query_one("SELECT delivered FROM outbox_cursors WHERE sink = 'audit'", &[]).await.unwrap().get(0);
    assert_eq!(delivered, 8);
}

#[test]
fn a_job_name_registered_twice_is_refused() {
    let a: Arc<dyn Reconciler> = Arc::new(Probe::new("same", ShardBy::Node));
    let b: Arc<dyn Reconciler> = Arc::new(Probe::new("same", ShardBy::Pool));
    let err = better_compute_runtime::Registry::new(vec![Arc::new(TestModule { reconcilers: vec![a, b], subscribers: vec![] })])
        .err()
        .unwrap();
    assert_eq!(err.to_string(), "job same is registered twice");
}

#[tokio::test]
async fn a_run_can_arm_its_own_next_pass_for_a_later_time() {
    struct Timer;
    #[async_trait::async_trait]
    impl Reconciler for Timer {
        fn kind(&self) -> Kind {
            Kind { name: "timer", shard_by: ShardBy::Pool }
        }
        async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError> {
            let mut c = ctx.client().await?;
            let tx = ctx.begin_fenced(&mut c).await?;
            work_queue::enqueue_after(&*tx, &self.kind(), key, Duration::from_secs(30)).await?;
            tx.commit().await?;
            Ok(Outcome::Done)
        }
    }
    let kind = Kind { name: "timer", shard_by: ShardBy::Pool };
    let h = Harness::new(vec![Arc::new(TestModule { reconcilers: vec![Arc::new(Timer)], subscribers: vec![] })]).await;
    enqueue(&h, &kind, "pool_a").await;
    assert_eq!(h.job("timer").tick().await.done, 1);
    // Done, but re-armed for 30 s later: not due before that, due at it.
    assert_eq!(queue_len(&h).await, 1);
    h.db().advance(Duration::from_secs(29)).await;
    assert_eq!(h.job("timer").tick().await.claimed, 0);
    h.db().advance(Duration::from_secs(1)).await;
    assert_eq!(h.job("timer").tick().await.done, 1);
    // An ordinary enqueue while the timer waits makes it due now.
    enqueue(&h, &kind, "pool_a").await;
    assert_eq!(h.job("timer").tick().await.done, 1);
}

/// A part that contributes some `site` fields, switchable between two versions.
struct SiteFields {
    name: &'static str,
    fields: fn(&mut better_compute_proto::v1::SiteSection, bool),
    changed: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl better_compute_runtime::nodespec::NodeSpecPart for SiteFields {
    fn name(&self) -> &'static str {
        self.name
    }
    async fn node_specs(
        &self,
        _tx: &tokio_postgres::Transaction<'_>,
        node_ids: &[String],
    ) -> Result<Vec<better_compute_proto::v1::NodeSpec>, RunError> {
        let mut s = better_compute_proto::v1::SiteSection::default();
        (self.fields)(&mut s, self.changed.load(Ordering::SeqCst));
        Ok(vec![better_compute_proto::v1::NodeSpec { site: Some(s), ..Default::default() }; node_ids.len()])
    }
}

struct PartModule {
    name: &'static str,
    part: Arc<SiteFields>,
}

impl Module for PartModule {
    fn name(&self) -> &'static str {
        self.name
    }
    fn node_spec_parts(&self) -> Vec<Arc<dyn better_compute_runtime::nodespec::NodeSpecPart>> {
        vec![self.part.clone()]
    }
}

#[tokio::test]
async fn two_modules_site_fields_merge_in_registration_order_and_generation_moves_only_on_change() {
    let first = Arc::new(SiteFields {
        name: "first",
        fields: |s, _| {
            s.site_id = "site_1".into();
            s.node_name = "from-first".into();
            s.labels.insert("zone".into(), "a".into());
        },
        changed: false.into(),
    });
    let second = Arc::new(SiteFields {
        name: "second",
        fields: |s, changed| {
            s.pool_id = "pool_1".into();
            s.node_name = "from-second".into();
            s.labels.insert("rack".into(), if changed { "r2".into() } else { "r1".into() });
        },
        changed: false.into(),
    });
    let h = Harness::new(vec![
        Arc::new(PartModule { name: "first", part: first.clone() }),
        Arc::new(PartModule { name: "second", part: second.clone() }),
    ])
    .await;
    let c = h.db().client().await;
    // The runtime writes nodes.spec and nodes.generation; the nodes module owns the table.
    c.batch_execute(FAKE_NODES).await.unwrap();
    c.batch_execute("INSERT INTO nodes (id, shard, generation) VALUES ('node_adopted', 0, 1), ('node_new', 0, 0);").await.unwrap();
    let nodespec = better_compute_runtime::desired::NODESPEC;
    let spec_of = |id: &'static str| {
        let c = &c;
        async move {
            let r = c.query_one("SELECT generation, spec FROM nodes WHERE id = $1", &[&id]).await.unwrap();
            (r.get::<_, i64>(0), r.get::<_, Option<serde_json::Value>>(1))
        }
    };
    for id in ["node_adopted", "node_new"] {
        enqueue(&h, &nodespec, id).await;
    }
    h.job("nodespec").drain(5).await;
    let (generation, spec) = spec_of("node_adopted").await;
    assert_eq!(generation, 1, "the first spec is adoption's generation 1");
    assert_eq!(
        spec.unwrap(),
        serde_json::json!({"site": {"siteId": "site_1", "poolId": "pool_1", "nodeName": "from-second",
                                     "labels": {"rack": "r1", "zone": "a"}}})
    );
    // Not adopted: no desired state.
    assert_eq!(spec_of("node_new").await, (0, None));
    // Recomputing an unchanged spec does not move the generation.
    enqueue(&h, &nodespec, "node_adopted").await;
    h.job("nodespec").drain(5).await;
    assert_eq!(spec_of("node_adopted").await.0, 1);
    // A real change moves it by exactly one.
    second.changed.store(true, Ordering::SeqCst);
    enqueue(&h, &nodespec, "node_adopted").await;
    h.job("nodespec").drain(5).await;
    let (generation, spec) = spec_of("node_adopted").await;
    assert_eq!(generation, 2);
    assert_eq!(spec.unwrap()["site"]["labels"]["rack"], "r2");
    enqueue(&h, &nodespec, "node_adopted").await;
    h.job("nodespec").drain(5).await;
    assert_eq!(spec_of("node_adopted").await.0, 2);
}

/// The runtime's own `nodes` table for the NodeSpec tests (the nodes module owns the real one).
const FAKE_NODES: &str = "CREATE TABLE nodes (id text PRIMARY KEY, shard smallint NOT NULL, generation bigint NOT NULL DEFAULT 0,
                                              spec jsonb, version bigint NOT NULL DEFAULT 1);";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodespec_batch_recomputes_a_shards_nodes_in_one_run_and_writes_none_once_its_lease_is_taken_over() {
    let part = Arc::new(SiteFields { name: "site", fields: |s, changed| s.site_id = if changed { "site_2".into() } else { "site_1".into() }, changed: false.into() });
    let h = Harness::new(vec![Arc::new(PartModule { name: "site", part: part.clone() })]).await;
    let nodespec = better_compute_runtime::desired::NODESPEC;
    // Twenty adopted nodes of one shard, one batch.
    let shard = nodespec.shard_of("node_0");
    let ids: Vec<String> = (0..).map(|i| format!("node_{i}")).filter(|k| nodespec.shard_of(k) == shard).take(20).collect();
    let c = h.db().client().await;
    c.batch_execute(FAKE_NODES).await.unwrap();
    c.execute("INSERT INTO nodes (id, shard, generation) SELECT id, $2, 1 FROM unnest($1::text[]) id", &[&ids, &shard]).await.unwrap();
    let specs = || async {
        let rows = h.db().client().await.query("SELECT generation, spec->'site'->>'siteId' FROM nodes ORDER BY id", &[]).await.unwrap();
        rows.iter().map(|r| (r.get::<_, i64>(0), r.get::<_, Option<String>>(1))).collect::<Vec<_>>()
    };
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        work_queue::enqueue_many(&*tx, &nodespec, &ids).await.unwrap();
        tx.commit().await.unwrap();
    }
    let r = h.job("nodespec").tick().await;
    assert_eq!((r.claimed, r.done, r.errors), (20, 20, 0), "{r:?}");
    assert_eq!(r.counts.get("changed"), Some(&20), "{r:?}");
    let first = specs().await;
    assert_eq!(first.len(), 20);
    assert!(first.iter().all(|s| *s == (1, Some("site_1".to_owned()))), "{first:?}");

    // The spec changes; the batch is claimed under the shard's lease, and a takeover commits
    // between the claim and the batch's fenced transaction (the test holds the lease row so that
    // the batch's fence waits on it, then moves the lease on).
    part.changed.store(true, Ordering::SeqCst);
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        work_queue::enqueue_many(&*tx, &nodespec, &ids).await.unwrap();
        tx.commit().await.unwrap();
    }
    let lease = better_compute_runtime::worker::shard_lease(shard);
    let mut taker = h.db().client().await;
    let takeover = taker.transaction().await.unwrap();
    takeover.query_one("SELECT 1 FROM leases WHERE name = $1 FOR UPDATE", &[&lease]).await.unwrap();
    let zombie = h.job("nodespec");
    let world = async {
        // Until the batch's fence waits on the lease row.
        loop {
            let waiting: i64 = c
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%better_compute.fence%'", &[])
                .await
                .unwrap()
                .get(0);
            if waiting > 0 {
                break;
            }
            tokio::task::yield_now().await;
        }
        takeover.execute("UPDATE leases SET owner = 'wrk_other', epoch = epoch + 1 WHERE name = $1", &[&lease]).await.unwrap();
        takeover.commit().await.unwrap();
    };
    let (r, ()) = within("the batch meets the takeover", async { tokio::join!(zombie.tick(), world) }).await;
    assert_eq!((r.claimed, r.done, r.errors), (20, 0, 20), "{r:?}");
    assert!(r.last_error.as_deref().is_some_and(|e| e.contains("no longer held")), "{r:?}");
    assert_eq!(specs().await, first, "no node of the batch changed");
}

#[tokio::test]
async fn housekeeping_deletes_expired_idempotency_keys_every_minute() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    {
        let mut c = h.db().client().await;
        let tx = c.transaction().await.unwrap();
        let scope = better_compute_db::idempotency::IdempotencyScope { tenant_id: "ten_a", identity_id: "idn_a", key: "k" };
        better_compute_db::idempotency::claim(&tx, scope, "m", &serde_json::json!({})).await.unwrap();
        better_compute_db::idempotency::complete(&tx, scope, &serde_json::json!({"ok": true})).await.unwrap();
        tx.commit().await.unwrap();
    }
    let keys = || async { h.db().client().await.query_one("SELECT count(*) FROM idempotency_keys", &[]).await.unwrap().get::<_, i64>(0) };
    h.job("housekeeping").drain(5).await;
    assert_eq!(keys().await, 1, "a live key stays");
    h.db().advance(better_compute_db::idempotency::IDEMPOTENCY_KEY_TTL).await;
    h.job("housekeeping").drain(5).await;
    assert_eq!(keys().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_outcomes_and_an_enqueue_of_the_same_keys_never_deadlock() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    const KIND: &str = "lock.order";
    let c = h.db().client().await;
    let (k1, k2) = ("k1".to_owned(), "k2".to_owned());
    work_queue::enqueue_stored(&**c, KIND, &[k1.clone(), k2.clone()], &[0, 0], Duration::ZERO).await.unwrap();
    c.execute("UPDATE work_queue SET claimed_by = 'wrk_a', claimed_until = compute_now() + interval '1 minute' WHERE kind = $1", &[&KIND])
        .await
        .unwrap();
    let claimed = |key: &str| work_queue::Claimed { key: key.to_owned(), generation: 1, shard: 0, attempts: 0 };
    // An enqueue takes its keys in key order (work_queue_enqueue); this one holds k1 so far.
    let mut enqueuer = h.db().connect().await;
    let enqueuing = enqueuer.transaction().await.unwrap();
    work_queue::enqueue_stored(&enqueuing, KIND, std::slice::from_ref(&k1), &[0], Duration::ZERO).await.unwrap();
    // The worker's outcomes name k2 first (done), then k1 (failed).
    let mut w = h.db().connect().await;
    let worker = tokio::spawn(async move {
        let tx = w.transaction().await?;
        let results = [(claimed("k2"), work_queue::RunResult::Ok(Outcome::Done)), (claimed("k1"), work_queue::RunResult::Err("x".into()))];
        work_queue::apply_outcomes(&tx, KIND, "wrk_a", &results).await?;
        tx.commit().await.map_err(DbError::from)
    });
    within("the worker waits for k1", async {
        let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()";
        while c.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // Then k2: a worker holding it while it waits for k1 would close a cycle.
    within("the enqueue of k2", work_queue::enqueue_stored(&enqueuing, KIND, std::slice::from_ref(&k2), &[0], Duration::ZERO)).await.unwrap();
    enqueuing.commit().await.unwrap();
    within("the worker's outcomes", worker).await.unwrap().unwrap();
    // The enqueue bumped both generations past the claims: both keys stay queued, k1 with its error.
    let rows = c.query("SELECT key, last_error FROM work_queue WHERE kind = $1 ORDER BY key", &[&KIND]).await.unwrap();
    let rows: Vec<(String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rows, [(k1, Some("x".to_owned())), (k2, None)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_does_not_end_never_holds_up_its_workers_lease_renewals() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    // The harness's own worker is idle: let its leases lapse, so the running worker takes them all.
    h.db().advance(Duration::from_secs(16)).await;
    let mut cfg = WorkerConfig::new("wrk_running");
    cfg.maintain_every = Duration::from_millis(50);
    let w = Arc::new(Worker::start(h.db().pool.clone(), h.registry().clone(), cfg).await.unwrap());
    probe.gated.lock().unwrap().insert("node_stuck".to_owned());
    enqueue(&h, &probe.kind, "node_stuck").await;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(w.clone().run(stopping));
    // The run starts and does not end.
    within("the stuck run to start", probe.entered.notified()).await;
    let c = h.db().client().await;
    let renewed_past = |at: std::time::SystemTime| {
        let c = &c;
        async move {
            loop {
                let lapsing: i64 = c
                    .query_one("SELECT count(*) FROM leases WHERE owner = 'wrk_running' AND expires_at < $1::timestamptz + interval '14 s'", &[&at])
                    .await
                    .unwrap()
                    .get(0);
                let held: i64 = c.query_one("SELECT count(*) FROM leases WHERE owner = 'wrk_running'", &[]).await.unwrap().get(0);
                if held > 0 && lapsing == 0 {
                    return held;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Time passes twice by 10 s of the 15 s lease; each time every lease is renewed from the new now.
    for _ in 0..2 {
        h.db().advance(Duration::from_secs(10)).await;
        let now: std::time::SystemTime = c.query_one("SELECT compute_now()", &[]).await.unwrap().get(0);
        let held = within("the leases to be renewed while a run is stuck", renewed_past(now)).await;
        assert!(held >= 256, "{held} leases held");
    }
    probe.gate.notify_one();
    let _ = stop.send(true);
    within("the worker to stop", running).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_run_does_not_end_holds_up_no_other_job_of_its_worker() {
    let stuck = Arc::new(Probe::new("stuck-job", ShardBy::Node));
    let other = Arc::new(Probe::new("other-job", ShardBy::Node));
    let module = TestModule { reconcilers: vec![stuck.clone(), other.clone()], subscribers: vec![] };
    let h = Harness::new(vec![Arc::new(module)]).await;
    // The harness's own worker is idle: let its leases lapse, so the running worker takes them all.
    h.db().advance(Duration::from_secs(16)).await;
    let mut cfg = WorkerConfig::new("wrk_running");
    cfg.poll_interval = Duration::from_millis(50);
    let w = Arc::new(Worker::start(h.db().pool.clone(), h.registry().clone(), cfg).await.unwrap());
    stuck.gated.lock().unwrap().insert("node_stuck".to_owned());
    enqueue(&h, &stuck.kind, "node_stuck").await;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(w.clone().run(stopping));
    within("the stuck run to start", stuck.entered.notified()).await;
    // The first job's run does not end; the second job's keys still run, again and again.
    for i in 0..3 {
        enqueue(&h, &other.kind, &format!("node_other_{i}")).await;
        within("the other job to run while the first is stuck", async {
            while other.runs_of(&format!("node_other_{i}")) == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
    assert_eq!((stuck.total_runs(), other.total_runs()), (1, 3));
    stuck.gate.notify_one();
    let _ = stop.send(true);
    within("the worker to stop", running).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_run_does_not_end_holds_up_no_later_key_of_its_job() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    h.db().advance(Duration::from_secs(16)).await;
    let mut cfg = WorkerConfig::new("wrk_running");
    cfg.poll_interval = Duration::from_millis(50);
    let w = Arc::new(Worker::start(h.db().pool.clone(), h.registry().clone(), cfg).await.unwrap());
    probe.gated.lock().unwrap().insert("node_stuck".to_owned());
    enqueue(&h, &probe.kind, "node_stuck").await;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(w.clone().run(stopping));
    within("the stuck run to start", probe.entered.notified()).await;
    // Keys of the same job enqueued after the stuck run began still run, and their outcomes are
    // applied (their queue rows go) while it hangs.
    for i in 0..3 {
        let key = format!("node_later_{i}");
        enqueue(&h, &probe.kind, &key).await;
        within("a later key of the job to run while one of its keys is stuck", async {
            while probe.runs_of(&key) == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
    within("the later keys' outcomes to be applied", async {
        while queue_len(&h).await > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(queue_len(&h).await, 1, "only the stuck key is still queued");
    assert_eq!((probe.runs_of("node_stuck"), probe.total_runs()), (1, 4));
    probe.gate.notify_one();
    let _ = stop.send(true);
    within("the worker to stop", running).await.unwrap().unwrap();
    assert_eq!(queue_len(&h).await, 0, "the stuck run's outcome was applied before the worker stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_holding_every_pooled_connection_never_deadlock_the_loop_applying_an_ended_runs_outcome() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    h.db().advance(Duration::from_secs(16)).await;
    // Two connections: both held by slow runs while a quick run's outcome waits to be applied.
    let pool = better_compute_db::pool::connect_pool(h.db().connection_string(), 2).unwrap();
    let mut cfg = WorkerConfig::new("wrk_small_pool");
    cfg.poll_interval = Duration::from_millis(50);
    let w = Arc::new(Worker::start(pool, h.registry().clone(), cfg).await.unwrap());
    w.maintain().await.unwrap();
    probe.hold_connection.lock().unwrap().extend(["node_slow_1".to_owned(), "node_slow_2".to_owned()]);
    for key in ["node_quick", "node_slow_1", "node_slow_2"] {
        enqueue(&h, &probe.kind, key).await;
    }
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(w.clone().run(stopping));
    within("every outcome to be applied", async {
        while queue_len(&h).await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(probe.total_runs(), 3);
    let _ = stop.send(true);
    within("the worker to stop", running).await.unwrap().unwrap();
}

#[tokio::test]
async fn what_a_jobs_runs_count_is_its_status_in_every_report_and_in_job_runs() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe.clone(), vec![]).await;
    for key in ["node_a", "node_b", "node_c"] {
        enqueue(&h, &probe.kind, key).await;
    }
    let report = h.job(NODE_KIND).tick().await;
    assert_eq!((report.done, report.counts.get("finished").copied()), (3, Some(3)));
    // Counts add up over the worker's life; a run that counts nothing adds no name.
    enqueue(&h, &probe.kind, "node_d").await;
    *probe.behave.lock().unwrap() = Behave::SyncAgain;
    let report = h.job(NODE_KIND).tick().await;
    assert_eq!((report.sync_again, report.counts.len(), report.counts["finished"]), (1, 1, 3));
    h.worker().maintain().await.unwrap();
    let stored: serde_json::Value = h
        .db()
        .client()
        .await
        .query_one("SELECT last_report->'counts' FROM job_runs WHERE job = $1", &[&NODE_KIND])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, serde_json::json!({"finished": 3}));
}

#[tokio::test]
async fn the_sql_desired_invalidate_wakes_the_nodespec_kind_in_the_given_shards() {
    let probe = Arc::new(Probe::new(NODE_KIND, ShardBy::Node));
    let h = harness_with(probe, vec![]).await;
    let c = h.db().client().await;
    let woken: i32 = c
        .query_one("SELECT desired_invalidate(ARRAY['node_a', 'node_b'], ARRAY[3, 7]::int2[])", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(woken, 2);
    // An empty set (an aggregate over no rows) wakes nothing and does not fail.
    c.query_one("SELECT desired_invalidate(NULL, NULL)", &[]).await.unwrap();
    let rows = c.query("SELECT kind, key, shard FROM work_queue WHERE kind <> 'housekeeping' ORDER BY key", &[]).await.unwrap();
    let queued: Vec<(String, String, i16)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    let name = better_compute_runtime::desired::NODESPEC.name.to_owned();
    assert_eq!(queued, vec![(name.clone(), "node_a".to_owned(), 3), (name, "node_b".to_owned(), 7)]);
}
