//! The batch placer: concurrent `reservations.create` and `reservations.release` calls done
//! together, one statement per step for the whole batch (`capacity_reserve_batch`,
//! `capacity_release_batch`, src/sql/batch.sql).
//!
//! Batchers take requests from a bounded queue per kind; a batch is whatever waited while the
//! batcher was busy, up to [`BatchSettings::max_batch`], so an idle server places a lone request at
//! once. With several create batchers, each plans on its own share of the nodes
//! (`abs(hashtext(node_id)) % batchers`), so concurrent batches do not collide on nodes. Only the
//! common case is batched ([`batchable`]: whole GPUs, starting now, no tolerations). A create the
//! batch does not place goes into the next batch ([`BatchSettings::retries`]), then, like a release
//! the batch does not do, is handed back to run alone, with nothing of it written, and the caller
//! runs it through `capacity_reserve` or `capacity_end`, which replans, leaves it pending or says
//! what is wrong. A batch that fails as a whole (a deadlock, a lost connection) hands every
//! request back the same way.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use better_compute_audit::Actor;
use better_compute_db::idempotency::{self, IDEMPOTENCY_KEY_TTL};
use better_compute_db::{DbError, Pool};
use better_compute_runtime::work_queue;
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_postgres::types::{ToSql, Type};

use crate::reservations::{CreateReservation, ReservationView, MAX_DURATION};
use crate::Caller;

/// How the batch placer runs.
#[derive(Debug, Clone, Copy)]
pub struct BatchSettings {
    /// Batchers, each on its own share of the nodes and its own connection while it places.
    pub batchers: usize,
    /// Most requests in one batch.
    pub max_batch: usize,
    /// Most requests waiting for a batcher; a request finding the queue full is run alone.
    pub queue_len: usize,
    /// Further batches a create the batch did not place tries before it runs alone. A request turned
    /// away because the nodes it aims at were full, or their atoms held by a placement in flight,
    /// often fits a moment later, once the releases between two batches have committed; in the
    /// next batch it costs a share of one statement, alone a placer run of its own. A release the
    /// batch did not do (not found, another tenant's) runs alone at once: another batch would not
    /// change that.
    pub retries: u8,
}

impl Default for BatchSettings {
    /// One batcher for creates and one for releases, of at most 32 requests: a second batcher
    /// halves the batches, and a batch's fixed cost outweighs the overlap (`bench capacity
    /// --batchers 2` shows it; docs/capacity.md, "Why it is built this way").
    fn default() -> Self {
        BatchSettings { batchers: 1, max_batch: 32, queue_len: 1024, retries: 1 }
    }
}

/// A request waiting for a batcher, with where its outcome goes.
struct Queued<J> {
    job: J,
    reply: oneshot::Sender<Outcome>,
    /// Batches it was already in.
    tries: u8,
}

/// A create, in the terms `capacity_reserve_batch` takes.
struct CreateJob {
    id: String,
    tenant: String,
    identity: String,
    pool: String,
    model: String,
    selector: serde_json::Value,
    count: i32,
    vcpu: i32,
    memory_mib: i64,
    disk_gib: i64,
    ends_at: Option<String>,
    duration_s: Option<f64>,
    key: Option<String>,
    key_hash: Option<Vec<u8>>,
    event_id: String,
    shard: i16,
    /// Who asks for it: its audit entry commits with the batch.
    actor: Actor,
}

/// A release, in the terms `capacity_release_batch` takes.
struct ReleaseJob {
    id: String,
    tenant: String,
    event_id: String,
    shard: i16,
    /// Who asks for it.
    actor: Actor,
}

/// What the batch did with a request.
pub(crate) enum Outcome {
    /// Done and committed: the reservation's view (boxed: it is most of the enum's size).
    Done(Box<ReservationView>),
    /// Not done, and nothing of it written: run it alone. Safe even when the batch's commit is
    /// in doubt, because the reservation keeps its id: a second placement of it cannot commit, and a
    /// second release returns it unchanged.
    RunAlone,
    /// Done and committed, but its view could not be read.
    Failed(better_compute_core::Error),
}

/// What the batch placer has done since it started, for operators and the bench.
#[derive(Debug, Default)]
pub struct BatchCounters {
    /// Requests queued or in a batch now.
    pub waiting: AtomicU64,
    /// Batches run (creates and releases).
    pub batches: AtomicU64,
    /// Requests done in a batch.
    pub done: AtomicU64,
    /// Requests handed back to run alone.
    pub run_alone: AtomicU64,
    /// Creates a batch did not place that went into the next batch ([`BatchSettings::retries`]).
    pub retried: AtomicU64,
    /// Batches that failed whole (every request ran alone).
    pub failed_batches: AtomicU64,
}

/// The handle callers place and release through; clones share the batchers.
#[derive(Clone)]
pub struct BatchPlacer {
    creates: mpsc::Sender<Queued<CreateJob>>,
    releases: mpsc::Sender<Queued<ReleaseJob>>,
    counters: Arc<BatchCounters>,
}

/// Whether a checked request is of the kind the batch places: whole GPUs (at least one), starting
/// now, no tolerations, and a well-formed idempotency key if any.
pub fn batchable(req: &CreateReservation) -> bool {
    req.gpu.kind == "gpu"
        && req.gpu.count >= 1
        && req.starts_at.is_none()
        && req.tolerations.is_empty()
        && req.idempotency_key.as_deref().is_none_or(|k| idempotency::validate_key(k).is_ok())
}

impl BatchPlacer {
    /// Starts the batchers (`settings.batchers` for creates, each on its share of the nodes, and as
    /// many for releases), taking a connection from `pool` for each batch.
    pub fn start(pool: Pool, settings: BatchSettings) -> BatchPlacer {
        let counters = Arc::new(BatchCounters::default());
        let (creates, create_queue) = mpsc::channel(settings.queue_len.max(1));
        let (releases, release_queue) = mpsc::channel(settings.queue_len.max(1));
        let (create_queue, release_queue) = (Arc::new(Mutex::new(create_queue)), Arc::new(Mutex::new(release_queue)));
        let shares = settings.batchers.max(1) as i32;
        let limits = Limits { max_batch: settings.max_batch.max(1), retries: settings.retries };
        for share in 0..shares {
            tokio::spawn(batcher(create_queue.clone(), pool.clone(), limits, counters.clone(), move |db, jobs| async move {
                let views = reserve_batch(&db, &jobs, share, shares).await?;
                Ok((db, views))
            }));
            tokio::spawn(batcher(release_queue.clone(), pool.clone(), Limits { retries: 0, ..limits }, counters.clone(), |db, jobs| async move {
                let views = release_batch(&db, &jobs).await?;
                Ok((db, views))
            }));
        }
        BatchPlacer { creates, releases, counters }
    }

    /// What the batchers have done so far.
    pub fn counters(&self) -> &BatchCounters {
        &self.counters
    }

    /// Places a [`batchable`] request in the next batch. `id`, `event_id` and `shard` are the
    /// reservation's id, its event's and its key's shard.
    pub(crate) async fn place(&self, actor: &Actor, caller: Caller<'_>, req: &CreateReservation, id: &str, event_id: String, shard: i16) -> Outcome {
        let key_hash = req
            .idempotency_key
            .as_ref()
            .map(|_| idempotency::request_sha256("reservations.create", &serde_json::to_value(req).expect("request serializes")));
        let job = CreateJob {
            id: id.to_owned(),
            tenant: caller.tenant_id.to_owned(),
            identity: caller.identity_id.to_owned(),
            pool: req.pool_id.clone(),
            model: req.gpu.model.clone(),
            selector: serde_json::Value::Object(req.node_selector.clone()),
            count: req.gpu.count,
            vcpu: req.vcpu,
            memory_mib: req.memory_mib,
            disk_gib: req.disk_gib,
            ends_at: req.ends_at.clone(),
            duration_s: req.duration_s.map(|d| d as f64),
            key: req.idempotency_key.clone(),
            key_hash,
            event_id,
            shard,
            actor: actor.clone(),
        };
        submit(&self.creates, &self.counters, job).await
    }

    /// Releases the caller's reservation `id` in the next batch.
    pub(crate) async fn release(&self, actor: &Actor, caller: Caller<'_>, id: &str, event_id: String, shard: i16) -> Outcome {
        let job = ReleaseJob { id: id.to_owned(), tenant: caller.tenant_id.to_owned(), event_id, shard, actor: actor.clone() };
        submit(&self.releases, &self.counters, job).await
    }
}

/// Queues a job and waits for its outcome. A full queue means the batchers are behind: the request
/// runs alone rather than wait.
async fn submit<J>(queue: &mpsc::Sender<Queued<J>>, counters: &BatchCounters, job: J) -> Outcome {
    let (reply, answer) = oneshot::channel();
    counters.waiting.fetch_add(1, Ordering::Relaxed);
    if queue.try_send(Queued { job, reply, tries: 0 }).is_err() {
        counters.waiting.fetch_sub(1, Ordering::Relaxed);
        return Outcome::RunAlone;
    }
    let outcome = answer.await.unwrap_or(Outcome::RunAlone);
    counters.waiting.fetch_sub(1, Ordering::Relaxed);
    outcome
}

/// A batcher's bounds.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_batch: usize,
    retries: u8,
}

/// One batcher: takes the requests its last batch did not do and what waits in the queue (at least
/// one request, at most `max_batch`), runs them as one statement (`run`, on a connection from
/// `pool`, which it hands back), pokes the workers and answers each request: its view when the
/// statement did it; else, after `retries` further batches, run alone.
async fn batcher<J, F, Fut>(queue: Arc<Mutex<mpsc::Receiver<Queued<J>>>>, pool: Pool, limits: Limits, counters: Arc<BatchCounters>, run: F)
where
    F: Fn(deadpool_postgres::Object, Arc<Vec<J>>) -> Fut,
    Fut: std::future::Future<Output = Result<(deadpool_postgres::Object, Vec<Option<serde_json::Value>>), DbError>>,
{
    let mut carried: Vec<Queued<J>> = Vec::new();
    loop {
        // Requests carried over go first. With some in hand, the batcher neither waits for more nor
        // for the queue: another batcher may hold it, waiting for requests whose callers wait on
        // these.
        let mut batch = std::mem::take(&mut carried);
        batch.reserve(limits.max_batch.saturating_sub(batch.len()));
        {
            let rx = if batch.is_empty() { Some(queue.lock().await) } else { queue.try_lock().ok() };
            if let Some(mut rx) = rx {
                if batch.is_empty() {
                    let Some(first) = rx.recv().await else { return };
                    batch.push(first);
                }
                while batch.len() < limits.max_batch {
                    let Ok(q) = rx.try_recv() else { break };
                    batch.push(q);
                }
            }
        }
        let n = batch.len();
        let (jobs, replies): (Vec<J>, Vec<_>) = batch.into_iter().map(|q| (q.job, (q.reply, q.tries))).unzip();
        let jobs = Arc::new(jobs);
        counters.batches.fetch_add(1, Ordering::Relaxed);
        let ran = async {
            let (db, views) = run(pool.get().await?, jobs.clone()).await?;
            work_queue::poke(&db).await;
            Ok::<_, DbError>(views)
        };
        let views = ran.await.unwrap_or_else(|e| {
            counters.failed_batches.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, batch = n, "a batch failed; its requests go to the next batch or run alone");
            Vec::new()
        });
        // `run`'s future is done, so this is the last reference and the jobs come back whole.
        let jobs = Arc::try_unwrap(jobs).ok();
        let mut views = views.into_iter();
        let mut jobs = jobs.into_iter().flatten();
        for (reply, tries) in replies {
            let job = jobs.next();
            let outcome = match views.next().flatten() {
                None => match job {
                    Some(job) if tries < limits.retries && !reply.is_closed() => {
                        counters.retried.fetch_add(1, Ordering::Relaxed);
                        carried.push(Queued { job, reply, tries: tries + 1 });
                        continue;
                    }
                    _ => Outcome::RunAlone,
                },
                Some(v) => serde_json::from_value(v)
                    .map(|v| Outcome::Done(Box::new(v)))
                    .unwrap_or_else(|e| Outcome::Failed(better_compute_core::Error::internal(format!("reservation view: {e}")))),
            };
            let counter = if matches!(outcome, Outcome::RunAlone) { &counters.run_alone } else { &counters.done };
            counter.fetch_add(1, Ordering::Relaxed);
            let _ = reply.send(outcome);
        }
    }
}

/// The audit entries' columns as statement parameters (`better_compute_audit::entry::with_batch_entries`).
fn audit_params(audit: &better_compute_audit::entry::BatchColumns) -> impl Iterator<Item = (&(dyn ToSql + Sync), Type)> {
    audit.iter().map(|c| (c as &(dyn ToSql + Sync), Type::TEXT_ARRAY))
}

/// Runs `capacity_reserve_batch` over the jobs: one view per job placed (`None` for the others),
/// in order.
async fn reserve_batch(db: &tokio_postgres::Client, jobs: &[CreateJob], share: i32, shares: i32) -> Result<Vec<Option<serde_json::Value>>, DbError> {
    let col = |f: fn(&CreateJob) -> &str| jobs.iter().map(f).collect::<Vec<_>>();
    let (ids, tenants, identities) = (col(|j| &j.id), col(|j| &j.tenant), col(|j| &j.identity));
    let (pools, models, event_ids) = (col(|j| &j.pool), col(|j| &j.model), col(|j| &j.event_id));
    let selectors: Vec<&serde_json::Value> = jobs.iter().map(|j| &j.selector).collect();
    let counts: Vec<i32> = jobs.iter().map(|j| j.count).collect();
    let vcpus: Vec<i32> = jobs.iter().map(|j| j.vcpu).collect();
    let memory: Vec<i64> = jobs.iter().map(|j| j.memory_mib).collect();
    let disk: Vec<i64> = jobs.iter().map(|j| j.disk_gib).collect();
    let ends_at: Vec<Option<&str>> = jobs.iter().map(|j| j.ends_at.as_deref()).collect();
    let durations: Vec<Option<f64>> = jobs.iter().map(|j| j.duration_s).collect();
    let keys: Vec<Option<&str>> = jobs.iter().map(|j| j.key.as_deref()).collect();
    let key_hashes: Vec<Option<&[u8]>> = jobs.iter().map(|j| j.key_hash.as_deref()).collect();
    let shards: Vec<i16> = jobs.iter().map(|j| j.shard).collect();
    let (ttl_s, max_duration_s) = (IDEMPOTENCY_KEY_TTL.as_secs_f64(), MAX_DURATION.as_secs_f64());
    let audit = better_compute_audit::entry::batch_columns(jobs.iter().map(|j| ("reservations.create", j.id.as_str(), j.tenant.as_str(), &j.actor)));
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
        (&ids, Type::TEXT_ARRAY),
        (&tenants, Type::TEXT_ARRAY),
        (&identities, Type::TEXT_ARRAY),
        (&pools, Type::TEXT_ARRAY),
        (&models, Type::TEXT_ARRAY),
        (&selectors, Type::JSONB_ARRAY),
        (&counts, Type::INT4_ARRAY),
        (&vcpus, Type::INT4_ARRAY),
        (&memory, Type::INT8_ARRAY),
        (&disk, Type::INT8_ARRAY),
        (&ends_at, Type::TEXT_ARRAY),
        (&durations, Type::FLOAT8_ARRAY),
        (&keys, Type::TEXT_ARRAY),
        (&key_hashes, Type::BYTEA_ARRAY),
        (&ttl_s, Type::FLOAT8),
        (&event_ids, Type::TEXT_ARRAY),
        (&shards, Type::INT2_ARRAY),
        (&share, Type::INT4),
        (&shares, Type::INT4),
        (&max_duration_s, Type::FLOAT8),
    ];
    params.extend(audit_params(&audit));
    let statement = better_compute_audit::entry::with_batch_entries(
        "SELECT capacity_reserve_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::timestamptz[], $12, $13, $14, $15, $16,
                                       $17, $18, $19, $20) AS v",
        21,
    );
    let row = db.query_typed_one(&statement, &params).await?;
    Ok(row.get(0))
}

/// Runs `capacity_release_batch` over the jobs: one view per job released (`None` for the others),
/// in order.
async fn release_batch(db: &tokio_postgres::Client, jobs: &[ReleaseJob]) -> Result<Vec<Option<serde_json::Value>>, DbError> {
    let ids: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
    let tenants: Vec<&str> = jobs.iter().map(|j| j.tenant.as_str()).collect();
    let event_ids: Vec<&str> = jobs.iter().map(|j| j.event_id.as_str()).collect();
    let shards: Vec<i16> = jobs.iter().map(|j| j.shard).collect();
    let audit = better_compute_audit::entry::batch_columns(jobs.iter().map(|j| ("reservations.release", j.id.as_str(), j.tenant.as_str(), &j.actor)));
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
        (&ids, Type::TEXT_ARRAY),
        (&tenants, Type::TEXT_ARRAY),
        (&event_ids, Type::TEXT_ARRAY),
        (&shards, Type::INT2_ARRAY),
    ];
    params.extend(audit_params(&audit));
    let row = db.query_typed_one(&better_compute_audit::entry::with_batch_entries("SELECT capacity_release_batch($1, $2, $3, $4) AS v", 5), &params).await?;
    Ok(row.get(0))
}
