//! The reconciler contract: level-triggered loops that read the current state, compare it with the
//! desired state and act on the difference. A run gets a key, never a hint of what changed.

use std::sync::Arc;
use std::time::Duration;

use better_compute_db::{Clock, DbError, FencedTransaction, Lease, Pool};

/// How a reconciler's keys are spread over workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardBy {
    /// Keys are node ids, spread over 256 shards (`nodes.shard`).
    Node,
    /// Keys are pool ids, spread over the same 256 shards.
    Pool,
    /// Keys are other ids (reservation ids, say), spread over the same 256 shards by their hash.
    Key,
    /// One worker runs every key, under `singleton:<name>`.
    None,
}

/// A reconciler's identity: its job name and how its keys are sharded. Declared as a `const` next to
/// the reconciler, so that `work_queue::enqueue` callers name the same thing the worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    /// The job name, e.g. `nodespec`.
    pub name: &'static str,
    /// How its keys are sharded.
    pub shard_by: ShardBy,
}

impl Kind {
    /// The shard a key of this kind lives in: 0..255, or -1 for a singleton kind.
    pub fn shard_of(&self, key: &str) -> i16 {
        match self.shard_by {
            ShardBy::Node | ShardBy::Pool | ShardBy::Key => better_compute_core::shard::shard_of(key),
            ShardBy::None => -1,
        }
    }

    /// The lease a singleton kind runs under.
    pub fn singleton_lease(&self) -> String {
        format!("singleton:{}", self.name)
    }
}

/// What a run asks for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Converged: the key leaves the queue (unless it was dirtied during the run).
    Done,
    /// Not yet: run the key again after 1 s.
    SyncAgain,
}

/// A key enqueued on a fixed period, e.g. `{ key: "all", every: 5 min }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Periodic {
    /// The key.
    pub key: &'static str,
    /// How often.
    pub every: Duration,
}

/// A failed run; its message is kept on the queue row for operators.
pub type RunError = Box<dyn std::error::Error + Send + Sync>;

/// A level-triggered controller.
#[async_trait::async_trait]
pub trait Reconciler: Send + Sync + 'static {
    /// Its kind: job name and sharding.
    fn kind(&self) -> Kind;

    /// Keys also enqueued on a fixed period.
    fn periodic(&self) -> &[Periodic] {
        &[]
    }

    /// Brings `key` to its desired state. Re-reads everything it needs; writes in a transaction
    /// opened with [`ReconcileContext::begin_fenced`].
    async fn run(&self, ctx: &ReconcileContext, key: &str) -> Result<Outcome, RunError>;

    /// How many keys of one shard a run may take at once (1: each key its own run). A reconciler
    /// that answers more implements [`Reconciler::run_many`] set-based.
    fn batch_size(&self) -> usize {
        1
    }

    /// Brings `keys`, all of one shard and so under one lease, to their desired state: one
    /// outcome per key, in `keys`' order. By default, [`Reconciler::run`] for each in turn.
    async fn run_many(&self, ctx: &ReconcileContext, keys: &[String]) -> Vec<Result<Outcome, RunError>> {
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push(self.run(ctx, k).await);
        }
        out
    }

    /// Every key this reconciler owns in `shards` (all of them for a singleton kind), for the
    /// periodic resync that catches anything a lost wake-up let slip.
    async fn keys(&self, _ctx: &ReconcileContext, _shards: &[i16]) -> Result<Vec<String>, RunError> {
        Ok(Vec::new())
    }
}

/// What a run may use: the pool, the business clock, and the lease that fences its writes.
#[derive(Clone)]
pub struct ReconcileContext {
    pub(crate) pool: Pool,
    pub(crate) clock: Arc<Clock>,
    pub(crate) lease: Lease,
    pub(crate) worker_id: String,
    pub(crate) counts: Arc<JobCounts>,
    pub(crate) registry: Arc<crate::Registry>,
}

/// What a job's runs did on this worker since it started, by name: its status for `jobs`.
pub type JobCounts = std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>;

impl ReconcileContext {
    /// Counts `n` of `what` this run did (`expired`, `delivered`, …) into its job's status, which
    /// `better-compute jobs` shows. A run counts what it committed.
    pub fn count(&self, what: &'static str, n: u64) {
        if n > 0 {
            *self.counts.lock().expect("job counts").entry(what).or_default() += n;
        }
    }

    /// A pooled connection, for transactions (every statement runs in one: `better_compute_db::pool`).
    pub async fn client(&self) -> Result<deadpool_postgres::Client, DbError> {
        Ok(self.pool.get().await?)
    }

    /// A pooled connection in a read-only transaction of its own, for reads outside a fenced
    /// transaction ([`Reconciler::keys`], say).
    pub async fn read(&self) -> Result<better_compute_db::pool::ReadTx, DbError> {
        better_compute_db::pool::read_tx(&self.pool).await
    }

    /// Opens a transaction fenced by the shard or singleton lease this run holds: it fails with
    /// `LeaseLost` once the lease was taken over, so a zombie cannot write.
    pub async fn begin_fenced<'a>(&self, client: &'a mut tokio_postgres::Client) -> Result<FencedTransaction<'a>, DbError> {
        self.lease.begin_fenced(client).await
    }

    /// Runs `f` in one transaction fenced by this run's lease, on a connection of its own, and
    /// commits it: the whole of a run that is one transaction.
    pub async fn in_fenced_tx<T>(&self, f: impl AsyncFnOnce(&tokio_postgres::Transaction<'_>) -> Result<T, RunError>) -> Result<T, RunError> {
        let mut c = self.client().await?;
        let tx = self.begin_fenced(&mut c).await?;
        let v = f(&tx).await?;
        tx.commit().await?;
        Ok(v)
    }

    /// Business time.
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The lease fencing this run.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Every module's things that hold nodes (see [`crate::occupancy`]).
    pub fn occupants(&self) -> &[Arc<dyn crate::occupancy::NodeOccupant>] {
        self.registry.node_occupants()
    }

    /// Every module: command kinds, the signing key, workflow definitions.
    pub fn registry(&self) -> &crate::Registry {
        &self.registry
    }

    /// The worker running this.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// Enqueues `key` of `kind` in the caller's transaction (see [`crate::work_queue::enqueue`]).
    pub async fn enqueue(&self, tx: &tokio_postgres::Transaction<'_>, kind: &Kind, key: &str) -> Result<(), DbError> {
        crate::work_queue::enqueue(tx, kind, key).await
    }

    /// Writes an event to the outbox in the caller's transaction (see [`crate::outbox::emit`]).
    pub async fn emit(&self, tx: &tokio_postgres::Transaction<'_>, event: crate::NewEvent<'_>) -> Result<String, DbError> {
        crate::outbox::emit(tx, event).await
    }
}
