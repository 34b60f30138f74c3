//! The workflow events (fleet events in the outbox) and how the engine writes them.

use better_compute_db::DbError;
use better_compute_runtime::events::EventType;
use better_compute_runtime::{outbox, NewEvent};
use tokio_postgres::Transaction;

pub(crate) fn emit<'a>(tx: &'a Transaction<'_>, event_type: &'a str, workflow_id: &'a str, data: serde_json::Value) -> impl std::future::Future<Output = Result<String, DbError>> + 'a {
    outbox::emit(tx, NewEvent { event_type, tenant_id: None, subject: workflow_id, data })
}

/// The event types workflows write (fleet events).
pub fn event_types() -> Vec<EventType> {
    vec![
        EventType {
            name: "workflow.started",
            version: 1,
            audience: "fleet",
            description: "A workflow was started (by `workflows.start`, a job, or a fleet-wide run for one of its nodes).",
            data: &[("definition", "its definition"), ("target", "what it runs on"), ("parentId", "the fleet-wide run it belongs to, if any"), ("requestedBy", "who started it")],
        },
        EventType {
            name: "workflow.stepChanged",
            version: 1,
            audience: "fleet",
            description: "A step started an attempt (`running`), succeeded, failed an attempt (`retrying`) or failed.",
            data: &[
                ("definition", "the workflow's definition"),
                ("nodeId", "its node (null for a fleet-wide run)"),
                ("step", "the step"),
                ("state", "running, retrying, succeeded or failed"),
                ("attempt", "the attempt's number"),
                ("reason", "why it failed (a stable code)"),
                ("message", "for operators"),
            ],
        },
        EventType {
            name: "workflow.held",
            version: 1,
            audience: "fleet",
            description: "A workflow stopped for an operator: `workflows.resume` goes on, `workflows.cancel` ends it.",
            data: &[("definition", "its definition"), ("nodeId", "its node"), ("step", "the step it holds at"), ("reason", "why"), ("message", "for operators")],
        },
        EventType {
            name: "workflow.resumed",
            version: 1,
            audience: "fleet",
            description: "A held workflow was resumed.",
            data: &[("fromStep", "the step it runs again from"), ("requestedBy", "who resumed it")],
        },
        EventType {
            name: "workflow.cancelRequested",
            version: 1,
            audience: "fleet",
            description: "A cancel was asked for; the job stops the current step's command and ends the workflow.",
            data: &[("requestedBy", "who cancelled it")],
        },
        EventType {
            name: "workflow.ended",
            version: 1,
            audience: "fleet",
            description: "A workflow ended: succeeded, failed or cancelled.",
            data: &[
                ("definition", "its definition"),
                ("nodeId", "its node"),
                ("parentId", "its fleet-wide run"),
                ("state", "succeeded, failed or cancelled"),
                ("reason", "why it failed"),
                ("message", "for operators"),
            ],
        },
    ]
}
