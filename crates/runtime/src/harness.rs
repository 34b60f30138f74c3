//! Deterministic test driving: `harness.job("nodespec").tick()` runs one pass of a job at the
//! simulated time, with no background threads, so tests can script races step by step.

use std::sync::Arc;

use better_compute_db::testing::TestDb;

use crate::module::{Module, Registry};
use crate::worker::{JobReport, Worker, WorkerConfig};

/// A test database migrated for a set of modules, and a worker over it.
pub struct Harness {
    db: TestDb,
    registry: Arc<Registry>,
    worker: Worker,
}

impl Harness {
    /// A fresh test database with every migration of `modules`, and a worker `wrk_harness`.
    pub async fn new(modules: Vec<Arc<dyn Module>>) -> Harness {
        let registry = Arc::new(Registry::new(modules).expect("modules assemble"));
        let db = TestDb::with_migrations(&registry.migrations()).await;
        let worker = Worker::start(db.pool.clone(), registry.clone(), WorkerConfig::new("wrk_harness"))
            .await
            .expect("harness worker starts");
        Harness { db, registry, worker }
    }

    /// The database.
    pub fn db(&self) -> &TestDb {
        &self.db
    }

    /// The assembled modules.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The harness's own worker.
    pub fn worker(&self) -> &Worker {
        &self.worker
    }

    /// Another worker on the same database, for tests of sharing and takeover. It holds nothing
    /// until its `maintain`.
    pub async fn another_worker(&self, id: &str) -> Worker {
        Worker::start(self.db.pool.clone(), self.registry.clone(), WorkerConfig::new(id))
            .await
            .expect("worker starts")
    }

    /// A job by name.
    pub fn job<'a>(&'a self, name: &'a str) -> JobHandle<'a> {
        JobHandle { harness: self, name }
    }
}

/// One job of a [`Harness`].
pub struct JobHandle<'a> {
    harness: &'a Harness,
    name: &'a str,
}

impl JobHandle<'_> {
    /// One pass: the worker maintains its leases (and enqueues due periodic keys), then claims what
    /// is due at the simulated time, runs it and applies the outcomes.
    pub async fn tick(&self) -> JobReport {
        self.harness.worker.maintain().await.expect("maintain");
        self.harness.worker.tick(self.name).await.expect("tick")
    }

    /// Ticks until a pass claims and delivers nothing, at most `max` times; returns how many
    /// passes did something.
    pub async fn drain(&self, max: usize) -> usize {
        for i in 0..max {
            let r = self.tick().await;
            if r.claimed == 0 && r.delivered == 0 {
                return i;
            }
        }
        panic!("job {} still had work after {max} passes", self.name);
    }
}
