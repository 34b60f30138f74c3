//! Where the control plane's own decisions are recorded. The audit module gives the registry its
//! log ([`crate::Module::decision_log`]); code below it in the map (the workflow runtime) records
//! through [`crate::Registry::record_decision`], in the transaction that makes the decision, so a
//! decision that commits has its record and one that rolls back has none.

use async_trait::async_trait;
use better_compute_db::DbError;
use tokio_postgres::Transaction;

/// A decision a job took on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    /// The job that took it (`workflow`).
    pub job: &'a str,
    /// What it decided (`workflows.stepSucceeded`).
    pub action: &'a str,
    /// On what (`wfl_…/drain`).
    pub target: &'a str,
    /// The tenant it concerns (none: the fleet).
    pub tenant_id: Option<&'a str>,
}

/// A log of decisions (the audit log).
#[async_trait]
pub trait DecisionLog: Send + Sync + 'static {
    /// Appends `d` in `tx`.
    async fn record(&self, tx: &Transaction<'_>, d: &Decision<'_>) -> Result<(), DbError>;
}
