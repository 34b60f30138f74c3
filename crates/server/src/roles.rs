//! `better-compute server`: the server roles against a shared database, and the functions that start
//! each (the binary's `dev`, the simulator and the benchmarks start them too).

use std::sync::Arc;

use anyhow::Context;
use better_compute_core::id::WorkerId;
use better_compute_runtime::{Registry, Worker, WorkerConfig};

/// Options of `better-compute server`.
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    #[command(flatten)]
    db: crate::DatabaseArgs,
    /// Roles to run, comma-separated: api, gateway, worker.
    #[arg(long, env = "BETTER_COMPUTE_ROLES", value_delimiter = ',', default_value = "api,gateway,worker")]
    roles: Vec<String>,
    /// Where the api role listens.
    #[arg(long, env = "BETTER_COMPUTE_API_LISTEN", default_value = "127.0.0.1:8080")]
    api_listen: String,
    /// Where the gateway role listens for daemons (gRPC over mTLS).
    #[arg(long, env = "BETTER_COMPUTE_GATEWAY_LISTEN", default_value = "127.0.0.1:8443")]
    gateway_listen: String,
    /// Names and addresses daemons reach the gateway by, comma-separated: its certificate's names.
    #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1")]
    gateway_hostname: Vec<String>,
    /// The gateway's server certificate chain (PEM), instead of one it signs from the CA for
    /// --gateway-hostname; daemons must trust its issuer (give them it in --ca-cert, with ca.pem).
    #[arg(long, env = "BETTER_COMPUTE_GATEWAY_TLS_CERT", requires = "gateway_tls_key")]
    gateway_tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --gateway-tls-cert.
    #[arg(long, env = "BETTER_COMPUTE_GATEWAY_TLS_KEY", requires = "gateway_tls_cert")]
    gateway_tls_key: Option<std::path::PathBuf>,
    /// The certificate authority's folder, created on first start: ca.pem, ca.key (mode 0600) and
    /// command-signing.pk8 (mode 0600: the key destructive commands such as node.reboot are signed
    /// with at enqueue; daemons pin its public half at join). Every gateway, api and worker of a
    /// fleet needs the same one.
    #[arg(long, env = "BETTER_COMPUTE_CA_DIR", default_value = "./better-compute-ca")]
    ca_dir: std::path::PathBuf,
    /// Connections in this process's pool.
    #[arg(long, default_value_t = 16)]
    pool_size: usize,
    /// A direct (not pooled) connection string for LISTEN pokes; defaults to DATABASE_URL. Set it when
    /// DATABASE_URL goes through PgBouncer in transaction mode.
    #[arg(long, env = "BETTER_COMPUTE_DIRECT_URL")]
    direct_url: Option<String>,
    /// Requests a second one token may make to this API process, on average (bursts of 2 s of
    /// it); more are answered 429 RATE_LIMITED with Retry-After. 0: no limit.
    #[arg(long, env = "BETTER_COMPUTE_API_RATE_PER_TOKEN", default_value_t = better_compute_api::rate_limit::RateLimits::default().per_token_per_s)]
    api_rate_per_token: u32,
    /// Requests a second all of one tenant's tokens may make to this API process together. 0: no limit.
    #[arg(long, env = "BETTER_COMPUTE_API_RATE_PER_TENANT", default_value_t = better_compute_api::rate_limit::RateLimits::default().per_tenant_per_s)]
    api_rate_per_tenant: u32,
    /// Serve the API over HTTPS with this certificate chain (PEM), read again when the file
    /// changes (with --api-tls-key); plain HTTP when unset (behind a TLS proxy).
    #[arg(long, env = "BETTER_COMPUTE_API_TLS_CERT", requires = "api_tls_key")]
    api_tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --api-tls-cert.
    #[arg(long, env = "BETTER_COMPUTE_API_TLS_KEY", requires = "api_tls_cert")]
    api_tls_key: Option<std::path::PathBuf>,
    /// Where to serve Prometheus metrics (`GET /metrics`) for whatever roles this process runs,
    /// e.g. 0.0.0.0:9464; none when unset (the api role also serves /metrics on its listener).
    #[arg(long, env = "BETTER_COMPUTE_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

const KNOWN_ROLES: &[&str] = &["api", "gateway", "worker"];

/// Starts a gateway on `listen` (port 0 picks one) with the CA in `ca_dir`, serving until
/// `shutdown` turns true.
pub async fn start_gateway(
    pool: better_compute_db::Pool,
    ca_dir: &std::path::Path,
    listen: &str,
    hostnames: Vec<String>,
    listen_url: Option<String>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<better_compute_gateway::Gateway> {
    start_gateway_with(pool, ca_dir, listen, hostnames, listen_url, None, shutdown).await
}

/// [`start_gateway`] serving an operator's certificate and key files (PEM).
pub async fn start_gateway_with(
    pool: better_compute_db::Pool,
    ca_dir: &std::path::Path,
    listen: &str,
    hostnames: Vec<String>,
    listen_url: Option<String>,
    identity: Option<(&std::path::Path, &std::path::Path)>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<better_compute_gateway::Gateway> {
    let ca = std::sync::Arc::new(better_compute_gateway::Ca::load_or_create(ca_dir)?);
    let mut cfg = better_compute_gateway::GatewayConfig::new(better_compute_core::id::GatewayId::generate().to_string(), listen);
    cfg.command_key = better_compute_runtime::signing::CommandSigner::load_or_create(ca_dir)?.public_key();
    cfg.hostnames = hostnames;
    cfg.status_watches = crate::registry()?.status_watches();
    cfg.listen_url = listen_url;
    if let Some((cert, key)) = identity {
        let read = |p: &std::path::Path| std::fs::read_to_string(p).with_context(|| format!("the gateway's TLS file {}", p.display()));
        cfg.server_identity = Some((read(cert)?, read(key)?));
    }
    Ok(better_compute_gateway::Gateway::start(pool, ca, cfg, shutdown).await?)
}

/// Starts a worker over `pool`, running until `shutdown` turns true.
pub async fn start_worker(
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

/// Starts the HTTP API on `listen` (port 0 picks one), serving until `shutdown` turns true.
/// Returns the address it listens on.
pub async fn start_api(
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    listen: &str,
    limits: better_compute_api::rate_limit::RateLimits,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    start_api_with(pool, registry, listen, limits, Default::default(), shutdown).await
}

/// [`start_api`] with other HTTP settings (HTTPS).
pub async fn start_api_with(
    pool: better_compute_db::Pool,
    registry: Arc<Registry>,
    listen: &str,
    limits: better_compute_api::rate_limit::RateLimits,
    http: better_compute_api::http::HttpSettings,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    {
        let mut db = pool.get().await.context("the api role cannot reach the database")?;
        let tx = db.transaction().await?;
        better_compute_iam::bindings::sync_roles(&*tx, &registry.permissions()).await?;
        tx.commit().await?;
    }
    let iam = Arc::new(better_compute_iam::Iam::new(pool.clone()));
    iam.start_tail().await?;
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("the api role cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let mut state = better_compute_api::ApiState::new(pool, iam.clone(), registry);
    Arc::get_mut(&mut state).expect("not shared yet").set_rate_limiter(better_compute_api::rate_limit::RateLimiter::new(limits));
    let mut tail_stop = shutdown.clone();
    tokio::spawn(iam.run_tail(std::time::Duration::from_secs(1), async move {
        let _ = tail_stop.wait_for(|s| *s).await;
    }));
    let handle = tokio::spawn(better_compute_api::serve_with(listener, state, http, async move {
        let _ = shutdown.wait_for(|s| *s).await;
    }));
    Ok((addr, handle))
}

/// Runs the roles until Ctrl-C or SIGTERM.
pub async fn run(args: ServerArgs) -> anyhow::Result<()> {
    if let Some(bad) = args.roles.iter().find(|r| !KNOWN_ROLES.contains(&r.as_str())) {
        anyhow::bail!("unknown role {bad:?}; available roles: {}", KNOWN_ROLES.join(", "));
    }
    if std::env::var_os("BETTER_COMPUTE_TEST_BROKEN_FENCE").is_some_and(|v| v == "1") {
        // Only the simulator's checker test sets this: it must catch the stale writes that follow.
        if !better_compute_db::lease::break_the_fence_for_tests() {
            anyhow::bail!("BETTER_COMPUTE_TEST_BROKEN_FENCE is set, but only test builds can skip the lease fence; unset it");
        }
        tracing::error!("BETTER_COMPUTE_TEST_BROKEN_FENCE=1: fenced transactions skip their fence; never run this in production");
    }
    tracing::info!(roles = %args.roles.join(","), version = env!("CARGO_PKG_VERSION"), "server starting");
    let registry = crate::registry()?;
    if args.roles.iter().any(|r| r == "api" || r == "worker") {
        // The roles that enqueue commands sign the destructive ones.
        let signer = better_compute_runtime::signing::CommandSigner::load_or_create(&args.ca_dir)
            .with_context(|| format!("the command-signing key in {} (pass the fleet's --ca-dir)", args.ca_dir.display()))?;
        registry.install_command_signer(Arc::new(signer));
    }
    let pool = better_compute_db::pool::connect_pool(&args.db.database_url, args.pool_size)?;
    // Every role's pokes share one NOTIFY stream (see work_queue::Poker).
    better_compute_runtime::work_queue::Poker::install(pool.clone());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut roles = crate::metrics::Roles::default();
    let mut api = None;
    if args.roles.iter().any(|r| r == "api") {
        let tls = match (&args.api_tls_cert, &args.api_tls_key) {
            (Some(cert), Some(key)) => Some(better_compute_api::tls::server_config(cert.clone(), key.clone())?),
            _ => None,
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let (addr, handle) = start_api_with(
            pool.clone(),
            registry.clone(),
            &args.api_listen,
            better_compute_api::rate_limit::RateLimits { per_token_per_s: args.api_rate_per_token, per_tenant_per_s: args.api_rate_per_tenant, ..Default::default() },
            better_compute_api::http::HttpSettings { tls, ..Default::default() },
            stopped.clone(),
        )
        .await?;
        println!("api listening on {scheme}://{addr}");
        api = Some(handle);
    }
    let mut gateway = None;
    if args.roles.iter().any(|r| r == "gateway") {
        let listen = Some(args.direct_url.clone().unwrap_or_else(|| args.db.database_url.clone()));
        let identity = args.gateway_tls_cert.as_deref().zip(args.gateway_tls_key.as_deref());
        let g = start_gateway_with(pool.clone(), &args.ca_dir, &args.gateway_listen, args.gateway_hostname.clone(), listen, identity, stopped.clone()).await?;
        println!("gateway {} listening on https://{} (CA: {})", g.id(), g.addr(), args.ca_dir.join("ca.pem").display());
        roles.gateway_id = Some(g.id().to_owned());
        gateway = Some(g);
    }
    let mut worker = None;
    if args.roles.iter().any(|r| r == "worker") {
        let listen = Some(args.direct_url.unwrap_or_else(|| args.db.database_url.clone()));
        let (w, handle) = start_worker(pool.clone(), registry.clone(), listen, stopped.clone()).await?;
        println!("worker {} running", w.id());
        roles.worker_id = Some(w.id().to_owned());
        worker = Some(handle);
    }
    // Last, so its /readyz knows the roles' ids.
    let mut metrics = None;
    if let Some(listen) = &args.metrics_listen {
        let (addr, handle) = crate::metrics::start(pool, registry, roles, listen, stopped).await?;
        println!("metrics on http://{addr}/metrics");
        metrics = Some(handle);
    }
    println!("Ctrl-C stops it");
    let signal = crate::shutdown_signal().await?;
    println!("received {signal}; letting leases go");
    stop.send(true)?;
    if let Some(h) = worker {
        h.await??;
    }
    if let Some(h) = api {
        h.await??;
    }
    if let Some(h) = metrics {
        h.await??;
    }
    if let Some(g) = gateway {
        g.join().await;
    }
    Ok(())
}
