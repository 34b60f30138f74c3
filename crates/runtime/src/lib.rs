//! The runtime every module runs on: the [`Module`] contract, level-triggered [`Reconciler`]s woken
//! through the [`work_queue`], sharded [`Worker`]s under fenced leases, and the [`outbox`] through which
//! side effects leave. The runtime knows no module: modules register with it.

pub mod authz;
pub mod commands;
pub mod desired;
pub mod events;
#[cfg(feature = "testing")]
pub mod harness;
pub mod jobs;
pub mod metrics;
pub mod module;
pub mod nodespec;
pub mod occupancy;
pub mod outbox;
pub mod reconciler;
pub mod signing;
pub mod status;
pub mod work_queue;
pub mod worker;
pub mod workflow;

pub use module::{Module, Registry};
pub use outbox::{Event, NewEvent, Sink};
pub use reconciler::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};
pub use worker::{Worker, WorkerConfig};

/// The runtime's own migrations: the work queue, job status, the outbox and its cursors; and the
/// SQL functions that enqueue and emit.
pub const RUNTIME_MIGRATIONS: &[better_compute_db::Migration] = &[
    better_compute_db::Migration::numbered("runtime", "0001_runtime", include_str!("migrations/runtime/0001_runtime.sql")),
    better_compute_db::Migration::repeatable("runtime", "work_queue", include_str!("sql/work_queue.sql")),
    better_compute_db::Migration::repeatable("runtime", "outbox", include_str!("sql/outbox.sql")),
];
