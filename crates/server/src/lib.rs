//! The one place that knows every module: the registry, in merge order, and the server roles
//! (`api`, `gateway`, `worker`) that run against a shared database. The binary, the simulator and
//! the benchmarks start their servers through here.
//!
//! An application crate: its functions return `anyhow` errors, as the binary reports them.

pub mod metrics;
pub mod roles;

use std::sync::Arc;

use better_compute_iam::bootstrap::{bootstrap, Bootstrapped};

pub use roles::{run, start_api, start_api_with, start_gateway, start_worker, ServerArgs};

/// Where the database is.
#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseArgs {
    /// The database, as a URL (postgresql://user@host/db) or a libpq key=value string.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
}

/// Every module, in registration order (merge order).
pub fn modules() -> Vec<Arc<dyn better_compute_runtime::Module>> {
    vec![
        Arc::new(better_compute_nodes::NodesModule),
        Arc::new(better_compute_capacity::CapacityModule),
        Arc::new(better_compute_vps::VpsModule),
        Arc::new(better_compute_iam::IamModule),
        Arc::new(better_compute_events::EventsModule { config: better_compute_events::EventsConfig::from_env() }),
        Arc::new(better_compute_audit::AuditModule),
        Arc::new(better_compute_workflows::WorkflowsModule),
    ]
}

/// The assembled registry of [`modules`].
pub fn registry() -> anyhow::Result<Arc<better_compute_runtime::Registry>> {
    Ok(Arc::new(better_compute_runtime::Registry::new(modules())?))
}

/// Every metric the control plane writes: the runtime's and each module's (`Registry::metrics`),
/// the API's and the gateway's.
pub fn metric_catalogue(registry: &better_compute_runtime::Registry) -> Vec<better_compute_runtime::metrics::Metric> {
    let mut all = registry.metrics();
    all.extend_from_slice(better_compute_api::metrics::METRICS);
    all.extend_from_slice(better_compute_gateway::METRICS);
    all
}

/// Migrates the database `db` is connected to and bootstraps its first tenant, admin and token.
pub async fn bootstrap_db(db: &mut tokio_postgres::Client, tenant: &str, admin: &str) -> anyhow::Result<Bootstrapped> {
    let registry = registry()?;
    better_compute_db::migrate(db, &registry.migrations()).await?;
    let tx = db.transaction().await?;
    let done = bootstrap(&tx, &registry.permissions(), tenant, admin).await?;
    tx.commit().await?;
    Ok(done)
}

/// Resolves on Ctrl-C or SIGTERM, naming which.
pub async fn shutdown_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    Ok(tokio::select! {
        _ = interrupt.recv() => "interrupt",
        _ = terminate.recv() => "terminate",
    })
}
