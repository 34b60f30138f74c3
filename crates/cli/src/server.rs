//! `better-compute server`: server roles against a shared database.

use std::sync::Arc;

use anyhow::Context;
use better_compute_core::id::WorkerId;
use better_compute_runtime::{Registry, Worker, WorkerConfig};

/// Options of `better-compute server`.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    #[command(flatten)]
    db: crate::DatabaseArgs,
    /// Roles to run, comma-separated. Available today: worker.
    #[arg(long, value_delimiter = ',', default_value = "worker")]
    roles: Vec<String>,
    /// Connections in this process's pool.
    #[arg(long, default_value_t = 16)]
    pool_size: usize,
    /// A direct (not pooled) connection string for LISTEN pokes; defaults to DATABASE_URL. Set it when
    /// DATABASE_URL goes through PgBouncer in transaction mode.
    #[arg(long, env = "BETTER_COMPUTE_DIRECT_URL")]
    direct_url: Option<String>,
}

const KNOWN_ROLES: &[&str] = &["worker"];

/// Starts a worker over `pool`, running until `shutdown` turns true.
pub(crate) async fn start_worker(
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    listen: Option<String>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(Arc<Worker>, tokio::task::JoinHandle<Result<(), better_compute_db::DbError>>)> {
    let mut cfg = WorkerConfig::new(WorkerId::generate().to_string());
    cfg.listen = listen;
    let worker = Arc::new(Worker::start(pool, registry, cfg).await.context("worker could not register")?);
    let handle = tokio::spawn(worker.clone().run(shutdown));
    Ok((worker, handle))
}

/// Runs the roles until Ctrl-C or SIGTERM.
pub async fn run(args: ServerArgs) -> anyhow::Result<()> {
    if let Some(bad) = args.roles.iter().find(|r| !KNOWN_ROLES.contains(&r.as_str())) {
        anyhow::bail!("unknown role {bad:?}; available roles: {}", KNOWN_ROLES.join(", "));
    }
    let registry = crate::registry()?;
    let pool = better_compute_db::pool::connect_pool(&args.db.database_url, args.pool_size)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let listen = Some(args.direct_url.unwrap_or_else(|| args.db.database_url.clone()));
    let (worker, handle) = start_worker(pool, registry, listen, stopped).await?;
    println!("worker {} running; Ctrl-C stops it", worker.id());
    let signal = crate::shutdown_signal().await?;
    println!("received {signal}; letting leases go");
    stop.send(true)?;
    handle.await??;
    Ok(())
}
