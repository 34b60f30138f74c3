//! The `workflows` module: multi-step operations (drain → reboot → wait → check → uncordon) that
//! survive worker crashes, gateway restarts and partitions. A workflow is a row with its steps as
//! rows; the `workflow` job ([`jobs::workflow`]) advances one workflow per key, level-triggered:
//! it locks the workflow, reads its current step and lets the step read the world and act, all in
//! one fenced transaction. A crash anywhere rolls everything back, so the next run repeats at most
//! the read and the enqueue, and a step's command is keyed `wf:<workflowId>:<step>.<attempt>`
//! (`UNIQUE (node_id, idempotency_key)`), so a step never sends it twice.
//!
//! Other modules define workflows through the runtime's contract
//! (`better_compute_runtime::workflow`: definitions of steps, each with a retry policy, a timeout
//! per attempt and what a failure does); this module stores, starts, cancels, resumes and runs
//! them. A workflow whose target is a pool or a label selector is fleet-wide: it runs one child
//! workflow per node, `parallel` at a time, and holds on the first child that fails
//! ([`fleet`]).
//!
//! Lock order: the workflow's row comes first of all (position 1 of docs/architecture.md), a
//! fleet-wide run's row before its children's, children in id order.

pub mod crash;
mod events;
mod fleet;
pub mod jobs;
mod lifecycle;
mod steps;
mod views;
mod waker;

use std::sync::Arc;

use better_compute_db::Migration;
use better_compute_runtime::authz::Permission;
use better_compute_runtime::{Reconciler, Sink};

pub use better_compute_runtime::workflow::Target;
pub use events::event_types;
pub use lifecycle::{cancel, resume, start, NewWorkflow};
pub use views::{get, list, open_with, ChildCounts, ListFilter, StepView, WorkflowView};
pub use waker::WorkflowWaker;

/// Starting, cancelling and resuming workflows.
pub const WRITE: &str = "compute:workflows:write";
/// Reading workflows.
pub const READ: &str = "compute:workflows:read";
/// The most nodes a fleet-wide run works on at once.
pub const MAX_PARALLEL: i64 = 64;
/// The most nodes one fleet-wide run covers.
pub const MAX_FLEET_NODES: usize = 10_000;

/// The module's migrations: the workflows and their steps (applied as `runtime/0002_workflows`
/// while the engine lived in the runtime; such a database keeps it), and their state guards.
pub const WORKFLOWS_MIGRATIONS: &[Migration] = &[
    Migration::numbered("workflows", "0001_workflows", include_str!("migrations/workflows/0001_workflows.sql")).was("runtime", "0002_workflows"),
    Migration::repeatable("workflows", "state_guards", include_str!("sql/state_guards.sql")),
];

/// The workflows module, for the registry: the engine every module's definitions run on.
pub struct WorkflowsModule;

impl better_compute_runtime::Module for WorkflowsModule {
    fn name(&self) -> &'static str {
        "workflows"
    }

    fn migrations(&self) -> &'static [Migration] {
        WORKFLOWS_MIGRATIONS
    }

    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![Arc::new(jobs::workflow::WorkflowJob)]
    }

    fn subscribers(&self) -> Vec<Arc<dyn Sink>> {
        vec![Arc::new(WorkflowWaker)]
    }

    fn event_types(&self) -> Vec<better_compute_runtime::events::EventType> {
        event_types()
    }

    fn permissions(&self) -> Vec<Permission> {
        vec![
            Permission { name: WRITE, description: "Start, cancel and resume workflows (at the node, pool or fleet they target)." },
            Permission { name: READ, description: "Read workflows and their steps." },
        ]
    }

    fn runs_workflows(&self) -> bool {
        true
    }
}
