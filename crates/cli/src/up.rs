//! `better-compute up`: the scale-out shape on one machine, each role a process of its own:
//! PostgreSQL, PgBouncer in transaction pooling mode, API servers, workers and gateways
//! (`server --roles …`, all through PgBouncer, LISTEN straight to PostgreSQL), and daemons with fake
//! GPUs joining through the gateways in turn. A process that exits is started again, as systemd
//! would; Ctrl-C stops them all. What runs where is in `<data>/up.json`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use better_compute_sim::procs::ServerProc;

use crate::dev;

/// How often `up` looks for processes that exited.
const SUPERVISE_EVERY: Duration = Duration::from_secs(1);
/// How long a process has to stop cleanly at the end.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Server connections PgBouncer keeps to PostgreSQL per database.
const BOUNCER_POOL_SIZE: u32 = 20;
/// Connections each server process keeps (to PgBouncer).
const SERVER_POOL_SIZE: &str = "8";

/// Options of `better-compute up`.
#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// Where the cluster, the CA, the daemons' state and every process's log live. Reused on the
    /// next start; delete it to start afresh.
    #[arg(long, default_value = "./.better-compute-up")]
    data_dir: PathBuf,
    /// API server processes (`server --roles api`), each on a port of its own.
    #[arg(long, default_value_t = 2)]
    apis: usize,
    /// Worker processes (`server --roles worker`): the jobs' shards are spread over them.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Gateway processes (`server --roles gateway`); daemons join through them in turn.
    #[arg(long, default_value_t = 2)]
    gateways: usize,
    /// Daemon processes, each a node with fake GPUs.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Each node's GPUs.
    #[arg(long, default_value = "fake:8xH100-80GB")]
    gpus: String,
    /// Servers connect to PostgreSQL directly instead of through PgBouncer.
    #[arg(long)]
    no_pgbouncer: bool,
}

/// Runs until Ctrl-C (or SIGTERM), then stops every process and PostgreSQL cleanly.
pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.apis >= 1 && args.workers >= 1 && args.gateways >= 1, "up needs at least one api, worker and gateway (--apis, --workers, --gateways)");
    let local = dev::open_local(&args.data_dir, "up")?;
    let result = serve(&local, &args).await;
    local.close().await?;
    result
}

/// A free TCP port on the loopback address: a process keeps its port across restarts, so daemons
/// and clients find a restarted gateway or API server where it was.
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[allow(clippy::too_many_lines, reason = "the processes of the scale-out shape started in dependency order, each a few lines")]
async fn serve(local: &dev::Local, args: &UpArgs) -> anyhow::Result<()> {
    let root = &local.root;
    let prepared = dev::prepare(&local.cluster, root).await?;
    let direct = prepared.conn.clone();
    let bouncer = if args.no_pgbouncer {
        None
    } else {
        let dir = root.join("bouncer");
        let b = better_compute_db::pgbouncer::PgBouncer::start_on_own_thread(&local.cluster, &dir, BOUNCER_POOL_SIZE)
            .context("PgBouncer did not start (pass --no-pgbouncer to connect the servers to PostgreSQL directly)")?;
        Some(b)
    };
    let db_url = bouncer.as_ref().map_or_else(|| direct.clone(), |b| b.connection_string(dev::DEV_DATABASE));
    // The CA and the command-signing key are made here, once, before processes could race to.
    let ca_dir = better_compute_gateway::default_ca_dir(root);
    better_compute_gateway::Ca::load_or_create(&ca_dir)?;
    better_compute_runtime::signing::CommandSigner::load_or_create(&ca_dir)?;
    let ca_arg = ca_dir.display().to_string();
    let logs = root.join("logs");
    std::fs::create_dir_all(&logs)?;
    let env = vec![("DATABASE_URL".to_owned(), db_url.clone()), ("BETTER_COMPUTE_DIRECT_URL".to_owned(), direct.clone())];
    let mut procs: Vec<ServerProc> = Vec::new();
    let total = args.apis + args.gateways + args.workers + args.nodes;
    let started = |procs: &Vec<ServerProc>, p: &ServerProc| println!("[{}/{total}] {}-{} started (pid {})", procs.len() + 1, p.role, p.index, p.pid().unwrap_or_default());
    for i in 0..args.apis {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let p = ServerProc::start("api", i, strings(&["--api-listen", &listen, "--ca-dir", &ca_arg, "--pool-size", SERVER_POOL_SIZE]), env.clone(), &logs).await?;
        started(&procs, &p);
        procs.push(p);
    }
    for i in 0..args.gateways {
        let listen = format!("127.0.0.1:{}", free_port()?);
        let p = ServerProc::start("gateway", i, strings(&["--gateway-listen", &listen, "--ca-dir", &ca_arg, "--pool-size", SERVER_POOL_SIZE]), env.clone(), &logs).await?;
        started(&procs, &p);
        procs.push(p);
    }
    for i in 0..args.workers {
        let p = ServerProc::start("worker", i, strings(&["--ca-dir", &ca_arg, "--pool-size", SERVER_POOL_SIZE]), env.clone(), &logs).await?;
        started(&procs, &p);
        procs.push(p);
    }
    let url_of = |role: &str, scheme: &str| -> Vec<String> {
        procs.iter().filter(|p| p.role == role).filter_map(|p| p.addr.map(|a| format!("{scheme}://{a}"))).collect()
    };
    let (apis, gateways) = (url_of("api", "http"), url_of("gateway", "https"));
    anyhow::ensure!(apis.len() == args.apis && gateways.len() == args.gateways, "a server printed no address; see the logs in {}", logs.display());
    let db = better_compute_db::pool::connect(&direct).await?;
    let pool = dev::pool_named(&direct, "gpus").await.context("dev's pool gpus is gone")?;
    let ca_pem = ca_dir.join("ca.pem").display().to_string();
    let mut names = Vec::new();
    for i in 0..args.nodes {
        let name = format!("up-node-{i}");
        let state = root.join("daemons").join(&name);
        let a = strings(&[
            "--gateway", &gateways[i % gateways.len()], "--ca-cert", &ca_pem, "--state-dir", &state.display().to_string(), "--node-name", &name,
            "--gpus", &args.gpus, "--vcpu", "96", "--memory-mib", "1048576", "--disk-gib", "7000", "--label", &format!("rack=r{}", i / 2),
        ]);
        // A node without an identity joins with a fresh token (a restart finds its identity).
        let mut daemon_env = Vec::new();
        if !state.join("node.json").exists() {
            let t = better_compute_nodes::listing::create_join_token(&db, &pool, Some(600), "up").await?;
            daemon_env.push(("BETTER_COMPUTE_JOIN_TOKEN".to_owned(), t.secret));
        }
        let p = ServerProc::start_daemon(i, a, daemon_env, &logs).await?;
        started(&procs, &p);
        procs.push(p);
        names.push(name);
    }
    let node_ids = better_compute_nodes::listing::node_ids_named(&db, &names).await?;
    anyhow::ensure!(node_ids.len() == names.len(), "{} of {} nodes are registered; see the daemons' logs in {}", node_ids.len(), names.len(), logs.display());
    better_compute_sim::fleet::wait_converged(&db, &node_ids, Duration::from_secs(90)).await;
    print!("{}", crate::ops::nodes_table(&db).await?);
    let up = root.join("up.json");
    let describe = |procs: &[ServerProc]| {
        serde_json::json!({
            "database": local.cluster.url(dev::DEV_DATABASE),
            "pgbouncer": bouncer.is_some(),
            "apis": apis,
            "gateways": gateways,
            "caCert": ca_pem,
            "tenantId": prepared.admin.tenant_id,
            "token": prepared.admin.secret,
            "gpuPool": pool,
            "nodes": node_ids,
            "processes": procs.iter().map(|p| serde_json::json!({"role": p.role, "index": p.index, "pid": p.pid(), "log": p.log()})).collect::<Vec<_>>(),
        })
    };
    write_private(&up, &describe(&procs))?;
    println!();
    println!("Better Compute is up: {} API servers, {} workers and {} gateways through {}, and {} daemons.", args.apis, args.workers, args.gateways,
             if bouncer.is_some() { "PgBouncer (transaction pooling)" } else { "PostgreSQL directly" }, args.nodes);
    for (i, a) in apis.iter().enumerate() {
        println!("  api-{i}      {a}");
    }
    for (i, g) in gateways.iter().enumerate() {
        println!("  gateway-{i}  {g}");
    }
    println!("  logs       {}", logs.display());
    println!("  processes  {} (pids, addresses, the admin's token)", up.display());
    println!("Kill any one process: up starts it again, and the others carry on meanwhile. Ctrl-C stops everything.");
    println!("ready: BETTER_COMPUTE_URL={} BETTER_COMPUTE_TOKEN={}", apis[0], prepared.admin.secret);
    let ended = tokio::select! {
        signal = better_compute_server::shutdown_signal() => signal.map(|s| println!("received {s}")),
        e = dev::watch_postgres(&local.cluster) => Err(e),
        () = supervise(&mut procs, &up, &describe) => Ok(()),
    };
    // Daemons first, so no node sees its gateway go away; then the servers.
    procs.sort_by_key(|p| if p.role == "daemon" { 0 } else { 1 });
    for p in &mut procs {
        p.stop(STOP_GRACE).await;
    }
    println!("stopped {} processes", procs.len());
    drop(bouncer);
    ended
}

/// Starts again every process that exited, and keeps `up.json` naming their pids. Never returns.
async fn supervise(procs: &mut [ServerProc], up: &Path, describe: &impl Fn(&[ServerProc]) -> serde_json::Value) {
    loop {
        tokio::time::sleep(SUPERVISE_EVERY).await;
        let mut changed = false;
        for p in procs.iter_mut() {
            let Some(how) = p.exit_status() else { continue };
            println!("{}-{} ended ({how}); starting it again (log: {})", p.role, p.index, p.log().display());
            match p.restart().await {
                Ok(()) => changed = true,
                Err(e) => println!("{}-{} did not start again: {e:#}; trying again in {} s", p.role, p.index, SUPERVISE_EVERY.as_secs()),
            }
        }
        if changed && let Err(e) = write_private(up, &describe(procs)) {
            println!("cannot write {}: {e}", up.display());
        }
    }
}

/// Writes `value` to `path`, readable by this user only (it holds a token), replacing it whole.
fn write_private(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value)?)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
