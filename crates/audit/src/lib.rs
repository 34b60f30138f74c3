//! The audit log: a tamper-evident record of who did what.
//!
//! An entry ([`entry::record`]) is written in the transaction that makes the change it records,
//! with no hash, so recording takes no log-wide lock. The `audit.checkpoint` job
//! ([`jobs::checkpoint::CheckpointJob`]) places entries in the log in commit order, chains them
//! (`sha256(previous || canonical entry)`) and signs a checkpoint of the Merkle tree over them
//! (RFC 6962). [`verify::verify`] checks an export offline; [`log`] reads entries, checkpoints and
//! proofs.

pub mod checkpoint;
pub mod entry;
pub mod jobs;
pub mod log;
pub mod merkle;
pub mod prune;
pub mod verify;

pub use entry::Actor;

use std::sync::Arc;

use better_compute_db::Migration;
use better_compute_runtime::Reconciler;

/// The audit module's migrations.
pub const AUDIT_MIGRATIONS: &[Migration] = &[
    Migration::numbered("audit", "0001_audit", include_str!("migrations/audit/0001_audit.sql")),
    Migration::numbered("audit", "0002_retention", include_str!("migrations/audit/0002_retention.sql")),
    Migration::repeatable("audit", "audit", include_str!("sql/audit.sql")),
];

/// The audit module, for the registry.
pub struct AuditModule;

impl better_compute_runtime::Module for AuditModule {
    fn name(&self) -> &'static str {
        "audit"
    }

    fn migrations(&self) -> &'static [Migration] {
        AUDIT_MIGRATIONS
    }

    fn reconcilers(&self) -> Vec<Arc<dyn Reconciler>> {
        vec![Arc::new(jobs::checkpoint::CheckpointJob)]
    }

    fn permissions(&self) -> Vec<better_compute_runtime::authz::Permission> {
        use better_compute_runtime::authz::Permission;
        vec![Permission { name: "compute:audit:read", description: "Read the audit log: a tenant's own entries at tenant scope, every entry and the checkpoints at fleet scope." }]
    }
}
