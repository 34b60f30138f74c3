//! A worker: one per server process. It heartbeats in `workers`, takes the shards and singletons
//! that rendezvous hashing gives it under fenced leases, runs its jobs, and keeps periodic keys and
//! resyncs going.
//!
//! Everything a worker does is a method that tests can call step by step ([`Worker::maintain`],
//! [`Worker::tick`]); [`Worker::run`] loops over the same steps, woken by pokes and polling: a
//! loop per job, each reconciler's keeping its runs going and claiming more as slots free.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use better_compute_core::shard::{rendezvous_owner, stable_hash, SHARD_COUNT};
use better_compute_db::lease::{acquire_many, release_many, WORKER_LEASE_TTL};
use better_compute_db::workers::{self, WorkerInfo};
use better_compute_db::{Clock, DbError, Lease, Pool};
use futures_util::{FutureExt, StreamExt};
use tracing::Instrument;
use serde::Serialize;

use crate::module::{Registry, EVENT_SUBSCRIBERS_JOB, OUTBOX_DISPATCH_JOB};
use crate::outbox::{dispatch_batch, sink_lease, DispatchError, Sink};
use crate::reconciler::{Kind, ReconcileContext, Reconciler, ShardBy};
use crate::work_queue::{self, Claimed, RunResult, ShardGrant};

/// Every key a reconciler owns is re-enqueued this often…
pub const RESYNC_EVERY: Duration = Duration::from_secs(300);
/// …plus up to this much jitter, so workers do not resync in step.
pub const RESYNC_JITTER_MAX: Duration = Duration::from_secs(300);

/// Tunables of a worker; [`WorkerConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// This worker's id (`wrk_…`).
    pub id: String,
    /// The server roles of the process, recorded in `workers`.
    pub roles: Vec<String>,
    /// Keys claimed per claim.
    pub claim_batch: i64,
    /// Runs of one job in flight at once (within a tick, and in `run`'s loop).
    pub run_concurrency: usize,
    /// Events per outbox batch.
    pub outbox_batch: i64,
    /// Outbox batches per sink per tick.
    pub outbox_batches_per_tick: usize,
    /// How long the loop sleeps when nothing pokes it.
    pub poll_interval: Duration,
    /// How often the loop heartbeats and renews its leases.
    pub maintain_every: Duration,
    /// A direct (not pooled) connection string for LISTEN; `None` polls only.
    pub listen: Option<String>,
}

impl WorkerConfig {
    /// Defaults for a worker with this id.
    pub fn new(id: impl Into<String>) -> Self {
        WorkerConfig {
            id: id.into(),
            roles: vec!["worker".to_owned()],
            claim_batch: 256,
            run_concurrency: 32,
            outbox_batch: 500,
            outbox_batches_per_tick: 20,
            poll_interval: Duration::from_secs(1),
            maintain_every: Duration::from_secs(better_compute_core::lease::WORKER_LEASE_RENEW_EVERY_S),
            listen: None,
        }
    }
}

/// What one tick of a job did; the last one per job is kept in `job_runs` for operators.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct JobReport {
    /// Keys claimed.
    pub claimed: u64,
    /// Runs that returned Done.
    pub done: u64,
    /// Runs that returned SyncAgain.
    pub sync_again: u64,
    /// Runs or deliveries that failed.
    pub errors: u64,
    /// Events delivered (outbox jobs).
    pub delivered: u64,
    /// The last error of this tick.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// What the job's runs did on this worker since it started, as they count it
    /// ([`ReconcileContext::count`]).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub counts: BTreeMap<String, u64>,
}

/// What one maintenance pass found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MaintainReport {
    /// Live workers, this one included.
    pub live_workers: usize,
    /// Shards held after the pass.
    pub shards: usize,
    /// Singleton leases held after the pass.
    pub singletons: Vec<String>,
    /// Keys enqueued by periodic entries and resyncs.
    pub enqueued: usize,
}

#[derive(Default)]
struct State {
    /// Every lease held, by name (`shard:<n>`, `singleton:…`).
    leases: BTreeMap<String, Lease>,
    periodic_last: HashMap<(&'static str, &'static str), SystemTime>,
    resync_next: HashMap<&'static str, SystemTime>,
    reports: BTreeMap<String, (u64, JobReport)>,
    /// Each job's counts ([`ReconcileContext::count`]).
    counts: HashMap<&'static str, Arc<crate::reconciler::JobCounts>>,
}

/// One process's worker.
pub struct Worker {
    cfg: WorkerConfig,
    pool: Pool,
    registry: Arc<Registry>,
    clock: Arc<Clock>,
    state: Mutex<State>,
}

/// The keys a claim takes for a reconciler that runs batches: enough that a shard's batch fills
/// on a fleet of thousands of nodes spread over 256 shards, few enough that every claim is run
/// well inside its claim's time to live.
pub const MAX_BATCH_CLAIM: i64 = 1024;

/// How many keys to claim for `free_runs` runs: one each, up to `claim_batch`; for a reconciler
/// that runs batches, [`MAX_BATCH_CLAIM`], so that each shard's batch fills (the runs stay
/// bounded by the free slots: batches beyond them queue inside a run's task).
fn claim_limit(claim_batch: i64, batch_size: usize, free_runs: usize) -> i64 {
    if batch_size <= 1 {
        i64::try_from(free_runs).unwrap_or(i64::MAX).min(claim_batch.max(1))
    } else {
        MAX_BATCH_CLAIM
    }
}

/// Claimed keys grouped by shard (so each group runs under one lease), in groups of at most
/// `size`, in claim order.
fn batches<L>(claimed: Vec<(Claimed, L)>, size: usize) -> Vec<(Vec<Claimed>, L)> {
    let size = size.max(1);
    let mut out: Vec<(Vec<Claimed>, L)> = Vec::new();
    let mut open: HashMap<i16, usize> = HashMap::new();
    for (c, lease) in claimed {
        match open.get(&c.shard) {
            Some(&i) if out[i].0.len() < size => out[i].0.push(c),
            _ => {
                open.insert(c.shard, out.len());
                out.push((vec![c], lease));
            }
        }
    }
    out
}

/// The lease name of a shard.
pub fn shard_lease(shard: i16) -> String {
    format!("shard:{shard}")
}

impl Worker {
    /// Registers the worker and anchors its clock. It holds nothing until [`Worker::maintain`].
    pub async fn start(pool: Pool, registry: Arc<Registry>, cfg: WorkerConfig) -> Result<Worker, DbError> {
        // Every statement of the worker runs inside a transaction: behind PgBouncer in transaction
        // pooling, a prepared statement outside one could reach another server than its Parse did.
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let clock = Arc::new(Clock::start(&*tx).await?);
        workers::register(&*tx, &Self::info(&cfg)).await?;
        tx.commit().await?;
        drop(client);
        Ok(Worker { cfg, pool, registry, clock, state: Mutex::new(State::default()) })
    }

    fn info(cfg: &WorkerConfig) -> WorkerInfo {
        WorkerInfo {
            id: cfg.id.clone(),
            hostname: std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_default(),
            pid: std::process::id() as i32,
            roles: cfg.roles.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }

    /// This worker's id.
    pub fn id(&self) -> &str {
        &self.cfg.id
    }

    /// Its business clock.
    pub fn clock(&self) -> &Arc<Clock> {
        &self.clock
    }

    /// The shards it holds.
    pub fn shards(&self) -> Vec<i16> {
        let st = self.state.lock().expect("worker state");
        st.leases.keys().filter_map(|n| n.strip_prefix("shard:")?.parse().ok()).collect()
    }

    /// The lease names it wants: the shards and singletons rendezvous hashing gives it.
    fn desired_leases(&self, live: &[String]) -> BTreeSet<String> {
        let mine = |name: &str| rendezvous_owner(live, name) == Some(self.cfg.id.as_str());
        let mut want: BTreeSet<String> = (0..SHARD_COUNT).map(shard_lease).filter(|n| mine(n)).collect();
        let singletons = self
            .registry
            .reconcilers()
            .iter()
            .filter(|r| r.kind().shard_by == ShardBy::None)
            .map(|r| r.kind().singleton_lease())
            .chain(self.registry.subscribers().iter().chain(self.registry.outbox_sinks()).map(|s| sink_lease(s.name())));
        want.extend(singletons.filter(|n| mine(n)));
        want
    }

    /// Heartbeats, takes and renews the leases it should hold, lets go of those that now belong to
    /// another live worker, enqueues due periodic keys and resyncs, and saves job reports.
    pub async fn maintain(&self) -> Result<MaintainReport, DbError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let checks: serde_json::Value =
            self.clock.self_check().iter().map(|c| serde_json::json!({"name": c.name, "ok": c.ok, "detail": c.detail})).collect();
        if !workers::heartbeat(&*tx, &self.cfg.id, &checks).await? {
            workers::register(&*tx, &Self::info(&self.cfg)).await?;
        }
        let mut live = workers::live(&*tx).await?;
        if !live.contains(&self.cfg.id) {
            live.push(self.cfg.id.clone());
        }
        let want = self.desired_leases(&live);
        let held: Vec<Lease> = self.state.lock().expect("worker state").leases.values().cloned().collect();
        let (keep, give_up): (Vec<Lease>, Vec<Lease>) = held.into_iter().partition(|l| want.contains(l.name()));
        // Let go at once, so the new owner need not wait for expiry.
        release_many(&*tx, &give_up).await?;
        // One statement renews what we hold and takes what is free, waiting on no row a fenced
        // transaction holds; a name missing from the answer is held by someone else (for now).
        let names: Vec<String> = want.iter().cloned().collect();
        let acquired = acquire_many(&*tx, &names, &self.cfg.id, WORKER_LEASE_TTL, Some(&self.clock)).await?;
        let mut now_held = acquired.held;
        // Ours, but a job's fenced transaction holds them now: still ours, renewed next time.
        now_held.extend(keep.iter().filter(|l| acquired.busy.iter().any(|(n, e)| n == l.name() && *e == l.epoch())).cloned());
        for l in &keep {
            if !now_held.iter().any(|h| h.name() == l.name() && h.epoch() == l.epoch()) {
                tracing::warn!(lease = l.name(), epoch = l.epoch(), "lease lost");
            }
        }
        // A lease new to us that had an earlier holder (its epoch moved past 1) is a takeover.
        for l in now_held.iter().filter(|l| l.epoch() > 1 && !keep.iter().any(|k| k.name() == l.name())) {
            let kind = l.name().split(':').next().unwrap_or("other").to_owned();
            metrics::counter!("better_compute_lease_takeovers_total", "kind" => kind).increment(1);
        }
        {
            let mut st = self.state.lock().expect("worker state");
            st.leases = now_held.into_iter().map(|l| (l.name().to_owned(), l)).collect();
        }
        self.save_reports(&tx).await?;
        tx.commit().await?;
        // Each enqueue in a short transaction of its own: holding enqueued rows of several kinds in
        // one long transaction would lock them in an order business transactions do not follow.
        let enqueued = self.enqueue_periodic_and_resync(&mut client).await?;
        if enqueued > 0 {
            work_queue::poke(&client).await;
        }
        let st = self.state.lock().expect("worker state");
        Ok(MaintainReport {
            live_workers: live.len(),
            shards: st.leases.keys().filter(|n| n.starts_with("shard:")).count(),
            singletons: st.leases.keys().filter(|n| n.starts_with("singleton:")).cloned().collect(),
            enqueued,
        })
    }

    /// The shards (with leases) this worker may claim `kind` from.
    fn grants(&self, kind: &Kind) -> Vec<(ShardGrant, Lease)> {
        let st = self.state.lock().expect("worker state");
        let grant = |shard: i16, l: &Lease| {
            (ShardGrant { shard, lease: l.name().to_owned(), epoch: l.epoch() }, l.clone())
        };
        match kind.shard_by {
            ShardBy::Node | ShardBy::Pool | ShardBy::Key => st
                .leases
                .iter()
                .filter_map(|(n, l)| Some(grant(n.strip_prefix("shard:")?.parse().ok()?, l)))
                .collect(),
            ShardBy::None => st.leases.get(&kind.singleton_lease()).map(|l| grant(-1, l)).into_iter().collect(),
        }
    }

    fn context(&self, job: &'static str, lease: Lease) -> ReconcileContext {
        let counts = self.state.lock().expect("worker state").counts.entry(job).or_default().clone();
        ReconcileContext {
            pool: self.pool.clone(),
            clock: self.clock.clone(),
            lease,
            worker_id: self.cfg.id.clone(),
            counts,
            registry: self.registry.clone(),
        }
    }

    async fn enqueue_periodic_and_resync(&self, client: &mut deadpool_postgres::Client) -> Result<usize, DbError> {
        let now = self.clock.now();
        let mut enqueued = 0;
        for r in self.registry.reconcilers() {
            let kind = r.kind();
            let grants = self.grants(&kind);
            let Some((_, any_lease)) = grants.first().cloned() else { continue };
            let owned: Vec<i16> = grants.iter().map(|(g, _)| g.shard).collect();
            for p in r.periodic() {
                let due = {
                    let st = self.state.lock().expect("worker state");
                    owned.contains(&kind.shard_of(p.key))
                        && st.periodic_last.get(&(kind.name, p.key)).is_none_or(|last| now >= *last + p.every)
                };
                if due {
                    let tx = client.transaction().await?;
                    work_queue::enqueue(&*tx, &kind, p.key).await?;
                    tx.commit().await?;
                    self.state.lock().expect("worker state").periodic_last.insert((kind.name, p.key), now);
                    enqueued += 1;
                }
            }
            let jitter = Duration::from_secs(
                stable_hash(format!("{}/{}", self.cfg.id, kind.name).as_bytes()) % (RESYNC_JITTER_MAX.as_secs() + 1),
            );
            let next = *self
                .state
                .lock()
                .expect("worker state")
                .resync_next
                .entry(kind.name)
                .or_insert(now + RESYNC_EVERY + jitter);
            if now >= next {
                let keys = r.keys(&self.context(kind.name, any_lease), &owned).await;
                match keys {
                    Ok(keys) => {
                        for chunk in keys.chunks(1_000) {
                            let tx = client.transaction().await?;
                            work_queue::enqueue_many(&*tx, &kind, chunk).await?;
                            tx.commit().await?;
                        }
                        enqueued += keys.len();
                    }
                    Err(e) => tracing::warn!(job = kind.name, error = %e, "listing keys for resync failed"),
                }
                self.state.lock().expect("worker state").resync_next.insert(kind.name, now + RESYNC_EVERY + jitter);
            }
        }
        Ok(enqueued)
    }

    async fn save_reports(&self, tx: &deadpool_postgres::Transaction<'_>) -> Result<(), DbError> {
        let reports: Vec<(String, i64, serde_json::Value, Option<String>)> = {
            let st = self.state.lock().expect("worker state");
            st.reports
                .iter()
                .map(|(job, (ticks, r))| {
                    (job.clone(), *ticks as i64, serde_json::to_value(r).expect("report serializes"), r.last_error.clone())
                })
                .collect()
        };
        for (job, ticks, report, error) in reports {
            tx.execute(
                    "INSERT INTO job_runs AS j (job, worker_id, ticks, last_tick_at, last_report, last_error, last_error_at)
                     VALUES ($1, $2, $3, compute_now(), $4, $5, CASE WHEN $5::text IS NULL THEN NULL ELSE compute_now() END)
                     ON CONFLICT (job, worker_id) DO UPDATE SET ticks = EXCLUDED.ticks, last_tick_at = EXCLUDED.last_tick_at,
                       last_report = EXCLUDED.last_report,
                       last_error = COALESCE(EXCLUDED.last_error, j.last_error),
                       last_error_at = COALESCE(EXCLUDED.last_error_at, j.last_error_at)",
                    &[&job, &self.cfg.id, &ticks, &report, &error],
                )
                .await?;
        }
        Ok(())
    }

    /// One pass of job `name`: for a reconciler, claim what is due in its shards, run it, apply the
    /// outcomes; for an outbox job, deliver each sink this worker holds. Returns what it did.
    pub async fn tick(&self, name: &str) -> Result<JobReport, DbError> {
        let report = if name == EVENT_SUBSCRIBERS_JOB {
            self.tick_sinks(self.registry.subscribers()).await?
        } else if name == OUTBOX_DISPATCH_JOB {
            self.tick_sinks(self.registry.outbox_sinks()).await?
        } else if let Some(sink) = self.registry.outbox_sinks().iter().chain(self.registry.subscribers()).find(|s| s.name() == name) {
            // One sink alone (`events.fanout`), as its dispatcher would run it.
            self.tick_sinks(std::slice::from_ref(sink)).await?
        } else {
            let r = self
                .registry
                .reconcilers()
                .iter()
                .find(|r| r.kind().name == name)
                .cloned()
                .ok_or_else(|| better_compute_core::Error::not_found("job", name))?;
            self.tick_reconciler(r).await?
        };
        Ok(self.save_report(name, &report))
    }

    async fn tick_reconciler(&self, r: Arc<dyn Reconciler>) -> Result<JobReport, DbError> {
        let claimed = self.claim(&r.kind(), claim_limit(self.cfg.claim_batch, r.batch_size(), usize::MAX)).await?;
        // No connection is held while the runs go: every job runs at once, each run takes its own.
        let results: Vec<Vec<(Claimed, RunResult)>> = futures_util::stream::iter(batches(claimed, r.batch_size()))
            .map(|(keys, lease)| self.run_batch(r.clone(), keys, lease))
            .buffer_unordered(self.cfg.run_concurrency.max(1))
            .collect()
            .await;
        self.apply(&r.kind(), &results.into_iter().flatten().collect::<Vec<_>>()).await
    }

    /// Claims up to `limit` due keys of `kind` in this worker's shards, each with the lease it
    /// runs under.
    async fn claim(&self, kind: &Kind, limit: i64) -> Result<Vec<(Claimed, Lease)>, DbError> {
        let grants = self.grants(kind);
        if grants.is_empty() || limit <= 0 {
            return Ok(Vec::new());
        }
        let leases: HashMap<i16, Lease> = grants.iter().map(|(g, l)| (g.shard, l.clone())).collect();
        let grants: Vec<ShardGrant> = grants.into_iter().map(|(g, _)| g).collect();
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let claimed = work_queue::claim(&*tx, kind.name, &grants, &self.cfg.id, WORKER_LEASE_TTL, limit).await?;
        tx.commit().await?;
        Ok(claimed.into_iter().map(|c| { let l = leases[&c.shard].clone(); (c, l) }).collect())
    }

    /// Runs claimed keys of one shard under its `lease`, timed (`better_compute_job_run_seconds`).
    async fn run_batch(&self, r: Arc<dyn Reconciler>, keys: Vec<Claimed>, lease: Lease) -> Vec<(Claimed, RunResult)> {
        let job = r.kind().name;
        let started = std::time::Instant::now();
        // One span per run (a reconcile of one key, or one run_many over several).
        let span = tracing::info_span!("reconcile", otel.name = %format!("reconcile {job}"), job, key = %keys.first().map_or("", |c| c.key.as_str()), keys = keys.len());
        let ended = self.run_keys(r, keys, lease).instrument(span).await;
        metrics::histogram!("better_compute_job_run_seconds", "job" => job).record(started.elapsed().as_secs_f64());
        ended
    }

    /// Runs claimed keys of one shard under its `lease`: one run, or one `run_many` for several.
    async fn run_keys(&self, r: Arc<dyn Reconciler>, keys: Vec<Claimed>, lease: Lease) -> Vec<(Claimed, RunResult)> {
        let job = r.kind().name;
        let ctx = self.context(job, lease);
        let result = |o: Result<crate::Outcome, crate::RunError>| match o {
            Ok(o) => RunResult::Ok(o),
            Err(e) => {
                if matches!(e.downcast_ref::<DbError>(), Some(DbError::LeaseLost { .. })) {
                    metrics::counter!("better_compute_job_fence_lost_total", "job" => job).increment(1);
                }
                RunResult::Err(error_chain(&*e))
            }
        };
        // A panicking reconciler fails its keys, not the worker.
        if let [one] = keys.as_slice() {
            let res = match AssertUnwindSafe(r.run(&ctx, &one.key)).catch_unwind().await {
                Ok(o) => result(o),
                Err(_) => RunResult::Err("the reconciler panicked".to_owned()),
            };
            return keys.into_iter().map(|c| (c, res.clone())).collect();
        }
        let names: Vec<String> = keys.iter().map(|c| c.key.clone()).collect();
        match AssertUnwindSafe(r.run_many(&ctx, &names)).catch_unwind().await {
            Ok(outcomes) if outcomes.len() == keys.len() => keys.into_iter().zip(outcomes).map(|(c, o)| (c, result(o))).collect(),
            Ok(outcomes) => {
                let e = format!("run_many answered {} outcomes for {} keys", outcomes.len(), keys.len());
                keys.into_iter().map(|c| (c, RunResult::Err(e.clone()))).collect()
            }
            Err(_) => keys.into_iter().map(|c| (c, RunResult::Err("the reconciler panicked".to_owned()))).collect(),
        }
    }

    /// Applies ended runs' outcomes to the queue and returns what they did.
    async fn apply(&self, kind: &Kind, results: &[(Claimed, RunResult)]) -> Result<JobReport, DbError> {
        let mut report = JobReport { claimed: results.len() as u64, ..JobReport::default() };
        if results.is_empty() {
            return Ok(report);
        }
        for (c, res) in results {
            let outcome = match res {
                RunResult::Ok(crate::Outcome::Done) => "done",
                RunResult::Ok(crate::Outcome::SyncAgain) => "sync_again",
                RunResult::Err(_) => "error",
            };
            metrics::counter!("better_compute_job_runs_total", "job" => kind.name, "outcome" => outcome).increment(1);
            match res {
                RunResult::Ok(crate::Outcome::Done) => report.done += 1,
                RunResult::Ok(crate::Outcome::SyncAgain) => report.sync_again += 1,
                RunResult::Err(e) => {
                    report.errors += 1;
                    tracing::warn!(job = kind.name, key = c.key, error = e, "reconcile failed");
                    report.last_error = Some(format!("{}: {e}", c.key));
                }
            }
        }
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        work_queue::apply_outcomes(&*tx, kind.name, &self.cfg.id, results).await?;
        tx.commit().await?;
        // Runs may have enqueued work for other shards' owners (and a dirtied key is due now).
        work_queue::poke(&client).await;
        Ok(report)
    }

    /// Saves a job's report for `jobs`.
    fn save_report(&self, name: &str, report: &JobReport) -> JobReport {
        let mut st = self.state.lock().expect("worker state");
        let counts = st
            .counts
            .get(name)
            .map(|c| c.lock().expect("job counts").iter().map(|(k, v)| (k.to_string(), *v)).collect())
            .unwrap_or_default();
        let report = JobReport { counts, ..report.clone() };
        let entry = st.reports.entry(name.to_owned()).or_default();
        entry.0 += 1;
        entry.1 = report.clone();
        report
    }

    /// Keeps up to `run_concurrency` runs of reconciler `r` going until `shutdown`: claims keys for
    /// the free slots, applies each run's outcome as it ends (with any others that ended by then),
    /// and claims again once at most half the slots are busy, on a poke, or every poll interval.
    /// A run that takes long holds up only its own slot: later keys of the same job still run.
    async fn reconcile_loop(
        self: Arc<Self>,
        r: Arc<dyn Reconciler>,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
        mut poked: tokio::sync::watch::Receiver<u64>,
    ) {
        let kind = r.kind();
        let slots = self.cfg.run_concurrency.max(1);
        // Each run is a task of its own, so runs go on while the loop awaits a claim or an apply:
        // a run holding a pooled connection must never wait on the loop that waits on the pool.
        let mut runs = tokio::task::JoinSet::new();
        let mut claim_now = true;
        while !*shutdown.borrow() {
            if claim_now && runs.len() <= slots / 2 {
                poked.mark_unchanged();
                let free_runs = slots - runs.len();
                let free = claim_limit(self.cfg.claim_batch, r.batch_size(), free_runs) as usize;
                match self.claim(&kind, free as i64).await {
                    Ok(claimed) => {
                        let full = claimed.len() == free;
                        // At most `free_runs` tasks: batches beyond that queue behind others in a
                        // task, one after another, so runs in flight stay bounded by the slots.
                        let mut tasks: Vec<Vec<(Vec<Claimed>, Lease)>> = (0..free_runs).map(|_| Vec::new()).collect();
                        for (i, b) in batches(claimed, r.batch_size()).into_iter().enumerate() {
                            tasks[i % free_runs].push(b);
                        }
                        for task in tasks.into_iter().filter(|t| !t.is_empty()) {
                            let (me, r) = (self.clone(), r.clone());
                            runs.spawn(async move {
                                let mut ended = Vec::new();
                                for (keys, lease) in task {
                                    ended.extend(me.run_batch(r.clone(), keys, lease).await);
                                }
                                ended
                            });
                        }
                        // A full claim may have left more due: claim again once slots free.
                        claim_now = full;
                    }
                    Err(e) => {
                        tracing::warn!(job = kind.name, error = %e, "claiming failed");
                        claim_now = false;
                    }
                }
            }
            tokio::select! {
                Some(first) = runs.join_next(), if !runs.is_empty() => {
                    let mut ended: Vec<(Claimed, RunResult)> = first.into_iter().flatten().collect();
                    while let Some(more) = runs.try_join_next() {
                        ended.extend(more.into_iter().flatten());
                    }
                    match self.apply(&kind, &ended).await {
                        Ok(report) => {
                            self.save_report(kind.name, &report);
                        }
                        // The claims lapse and the keys are claimed again.
                        Err(e) => tracing::warn!(job = kind.name, error = %e, "applying outcomes failed"),
                    }
                    claim_now = true;
                }
                _ = poked.changed() => claim_now = true,
                _ = tokio::time::sleep(self.cfg.poll_interval) => claim_now = true,
                _ = shutdown.changed() => {}
            }
        }
        // The runs in flight end and their outcomes are applied before the leases go.
        let mut ended = Vec::new();
        while let Some(x) = runs.join_next().await {
            ended.extend(x.into_iter().flatten());
        }
        if let Err(e) = self.apply(&kind, &ended).await {
            tracing::warn!(job = kind.name, error = %e, "applying outcomes failed");
        }
    }

    async fn tick_sinks(&self, sinks: &[Arc<dyn Sink>]) -> Result<JobReport, DbError> {
        let mut report = JobReport::default();
        for sink in sinks {
            let Some(lease) = self.state.lock().expect("worker state").leases.get(&sink_lease(sink.name())).cloned()
            else {
                continue;
            };
            let limit = sink.batch_limit().map_or(self.cfg.outbox_batch, |l| l.clamp(1, self.cfg.outbox_batch));
            for _ in 0..self.cfg.outbox_batches_per_tick {
                match dispatch_batch(&self.pool, sink.as_ref(), &lease, limit).await {
                    Ok(n) => {
                        report.delivered += n as u64;
                        if (n as i64) < limit {
                            break;
                        }
                    }
                    Err(DispatchError::Db(DbError::LeaseLost { .. })) => break,
                    Err(DispatchError::Db(e)) => return Err(e),
                    Err(e @ DispatchError::Sink { .. }) => {
                        report.errors += 1;
                        report.last_error = Some(e.to_string());
                        tracing::warn!(error = %e, "outbox delivery failed");
                        break;
                    }
                }
            }
        }
        Ok(report)
    }

    /// Lets every lease go and removes the worker's row, so its shards move at once.
    pub async fn shutdown(&self) -> Result<(), DbError> {
        let mut client = self.pool.get().await?;
        let held: Vec<Lease> = std::mem::take(&mut self.state.lock().expect("worker state").leases).into_values().collect();
        let tx = client.transaction().await?;
        release_many(&*tx, &held).await?;
        workers::deregister(&*tx, &self.cfg.id).await?;
        Ok(tx.commit().await?)
    }

    /// Runs until `shutdown` turns true: maintains every few seconds and, for every job in a task
    /// of its own, ticks it while it has work and otherwise sleeps until a poke or the poll
    /// interval. A job whose run is slow (a webhook receiver taking its time) holds up only itself.
    pub async fn run(self: Arc<Self>, shutdown: tokio::sync::watch::Receiver<bool>) -> Result<(), DbError> {
        // Each poke bumps the count; every job's loop wakes on the change.
        // The sender lives as long as the loops do: a dropped one would end every wait at once.
        let (poke, poked) = tokio::sync::watch::channel(0u64);
        let poke = Arc::new(poke);
        let listener = self.cfg.listen.clone().map(|conn| {
            let poke = poke.clone();
            tokio::spawn(work_queue::listen(conn, &[work_queue::POKE_CHANNEL], move |_, _| poke.send_modify(|n| *n += 1)))
        });
        // Maintenance (heartbeat, lease renewal) runs on its own, so no job's run, however long,
        // holds up the renewal of the leases every other job runs under.
        if let Err(e) = self.maintain().await {
            tracing::warn!(error = %e, "worker maintenance failed");
        }
        let maintenance = {
            let (me, mut stop) = (self.clone(), shutdown.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(me.cfg.maintain_every) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                    if let Err(e) = me.maintain().await {
                        tracing::warn!(error = %e, "worker maintenance failed");
                    }
                }
            })
        };
        let mut loops: Vec<_> = self
            .registry
            .reconcilers()
            .iter()
            .map(|r| tokio::spawn(self.clone().reconcile_loop(r.clone(), shutdown.clone(), poked.clone())))
            .collect();
        loops.extend([EVENT_SUBSCRIBERS_JOB, OUTBOX_DISPATCH_JOB].into_iter().map(|job| {
                let (me, job, mut shutdown, mut poked) = (self.clone(), job.to_owned(), shutdown.clone(), poked.clone());
                tokio::spawn(async move {
                    while !*shutdown.borrow() {
                        poked.mark_unchanged();
                        let busy = match me.tick(&job).await {
                            Ok(r) => r.claimed as i64 >= me.cfg.claim_batch || r.delivered > 0,
                            Err(e) => {
                                tracing::warn!(job, error = %e, "job tick failed");
                                false
                            }
                        };
                        if busy {
                            continue;
                        }
                        tokio::select! {
                            _ = poked.changed() => {}
                            _ = tokio::time::sleep(me.cfg.poll_interval) => {}
                            _ = shutdown.changed() => {}
                        }
                    }
                })
            }));
        for l in loops {
            let _ = l.await;
        }
        drop(poke);
        if let Some(l) = listener {
            l.abort();
        }
        // No maintenance may run after the shutdown lets the leases go.
        let _ = maintenance.await;
        self.shutdown().await
    }
}


/// An error with its causes (`db error: prepared statement … does not exist`): a driver's error
/// often says little by itself and keeps the database's message in its source.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_runs_error_names_its_causes_once_each() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("db error")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Wrapper(std::io::Error::other("prepared statement \"s1\" does not exist"));
        assert_eq!(error_chain(&e), "db error: prepared statement \"s1\" does not exist");
        // A cause its wrapper already quotes is not repeated.
        let io = std::io::Error::other("connection reset");
        assert_eq!(error_chain(&io), "connection reset");
    }

    fn claimed(key: &str, shard: i16) -> (Claimed, i16) {
        (Claimed { key: key.into(), generation: 1, shard, attempts: 0 }, shard)
    }

    #[test]
    fn claimed_keys_run_in_batches_of_one_shard_each_at_most_the_batch_size_in_claim_order() {
        let keys = vec![claimed("a", 1), claimed("b", 2), claimed("c", 1), claimed("d", 1), claimed("e", 2), claimed("f", 1)];
        let got: Vec<(Vec<String>, i16)> =
            batches(keys.clone(), 2).into_iter().map(|(b, shard)| (b.into_iter().map(|c| c.key).collect(), shard)).collect();
        let want: Vec<(Vec<String>, i16)> = vec![
            (vec!["a".into(), "c".into()], 1),
            (vec!["b".into(), "e".into()], 2),
            (vec!["d".into(), "f".into()], 1),
        ];
        assert_eq!(got, want);
        assert!(batches(keys.clone(), 2).iter().all(|(b, shard)| b.iter().all(|c| c.shard == *shard)));
        assert_eq!(batches(keys, 1).len(), 6, "batch size 1: each key its own run");
        assert_eq!(claim_limit(256, 1, 7), 7);
        assert_eq!(claim_limit(256, 1, usize::MAX), 256);
        assert_eq!(claim_limit(256, 64, 3), MAX_BATCH_CLAIM);
    }
}
