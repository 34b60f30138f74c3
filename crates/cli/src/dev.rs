//! `better-compute dev`: the main job on one machine.

use std::path::{Path, PathBuf};

use anyhow::Context;
use better_compute_db::launcher::{Cluster, ClusterOptions, FileLock};

/// The database `dev` keeps its data in.
pub(crate) const DEV_DATABASE: &str = "better_compute";

/// Options of `better-compute dev`.
#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Where the private cluster lives. Reused on the next start; delete it to start afresh.
    #[arg(long, default_value = "./.better-compute")]
    data_dir: PathBuf,
    /// Where the API listens (port 0 picks a free one; the URL is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    api_listen: String,
    /// Where the gateway listens for daemons (port 0 picks a free one; the URL is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    gateway_listen: String,
    /// Simulated nodes: real daemons with fake GPUs that join through the real protocol.
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Each simulated node's GPUs.
    #[arg(long, default_value = "fake:8xH100-80GB")]
    gpus: String,
}

/// A short name for a data folder, stable across runs: where its socket or cluster goes when it
/// cannot be inside it.
fn folder_hash(root: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    root.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Unix socket paths are limited to 107 bytes; fall back to a short private folder in /tmp.
fn socket_dir_for(root: &Path) -> PathBuf {
    let preferred = root.join("run");
    if preferred.as_os_str().len() + "/.s.PGSQL.5432".len() < 100 {
        return preferred;
    }
    std::env::temp_dir().join(format!("better-compute-{}", folder_hash(root)))
}

/// Where the cluster's folders go: in `root`, unless PostgreSQL's unprivileged user (this process
/// being root) cannot reach it, as when the checkout sits under root's private home (mode 0700):
/// then in a folder of its own under `/var/lib/better-compute/dev/`, named for `root`, kept across
/// restarts as `root` would keep it.
fn cluster_home(root: &Path) -> anyhow::Result<PathBuf> {
    let Some(run_as) = better_compute_db::launcher::RunAs::detect()? else { return Ok(root.to_owned()) };
    if run_as.can_reach(root) {
        return Ok(root.to_owned());
    }
    let home = Path::new(DEV_CLUSTERS).join(folder_hash(root));
    std::fs::create_dir_all(&home).with_context(|| format!("cannot create {}", home.display()))?;
    use std::os::unix::fs::PermissionsExt;
    for dir in [Path::new("/var/lib/better-compute"), Path::new(DEV_CLUSTERS), &home] {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).with_context(|| format!("cannot open {} to PostgreSQL's user", dir.display()))?;
    }
    println!(
        "PostgreSQL runs as an unprivileged user that cannot reach {} (a folder above it is private), so its cluster lives in {}",
        root.display(),
        home.display()
    );
    Ok(home)
}

/// Where clusters go whose `--data-dir` PostgreSQL's user cannot reach.
const DEV_CLUSTERS: &str = "/var/lib/better-compute/dev";

/// A private PostgreSQL cluster under a data folder, held by this process (its lock).
pub(crate) struct Local {
    pub(crate) cluster: Cluster,
    pub(crate) root: PathBuf,
    _lock: FileLock,
}

/// Opens `data_dir` (created if needed) for one process at a time (`<lock>.lock`), and starts its
/// PostgreSQL (initialized on first use, reused if an earlier run was killed and left it running).
pub(crate) fn open_local(data_dir: &Path, lock: &str) -> anyhow::Result<Local> {
    std::fs::create_dir_all(data_dir).with_context(|| format!("cannot create {}", data_dir.display()))?;
    let root = data_dir.canonicalize()?;
    // The server's unprivileged user must be able to reach its folders inside.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))?;
    // One process per data folder: a second one is refused before it touches anything.
    let lock = FileLock::try_acquire(&root.join(format!("{lock}.lock")), &root)?;
    let pg_root = cluster_home(&root)?;
    let cluster = Cluster::new(ClusterOptions {
        data_dir: pg_root.join("pgdata"),
        socket_dir: socket_dir_for(&pg_root),
        durable: true,
        max_connections: 200,
    })?;
    if cluster.is_running() {
        // Left behind by a run that was killed; we hold the lock, so it is ours to reuse.
        println!("reusing PostgreSQL left running by an earlier run (pid {:?})", cluster.postmaster_pid());
    } else {
        if cluster.init_if_needed()? {
            println!("initialized a new PostgreSQL cluster in {}", cluster.options().data_dir.display());
        }
        cluster.start()?;
    }
    Ok(Local { cluster, root, _lock: lock })
}

impl Local {
    /// Stops PostgreSQL cleanly.
    pub(crate) async fn close(self) -> anyhow::Result<()> {
        println!("stopping PostgreSQL…");
        let cluster = self.cluster.clone();
        tokio::task::spawn_blocking(move || cluster.stop()).await?.context("PostgreSQL did not stop cleanly; see server.log in the data folder")?;
        println!("stopped cleanly; data kept in {}", self.root.display());
        Ok(())
    }
}

/// Runs until Ctrl-C (or SIGTERM), then stops PostgreSQL cleanly.
pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let local = open_local(&args.data_dir, "dev")?;
    let result = serve(&local.cluster, &local.root, &args).await;
    local.close().await?;
    result
}

/// The dev database, migrated, with its admin and demo fleet.
pub(crate) struct Prepared {
    /// Its connection string.
    pub(crate) conn: String,
    /// Every module, as the database was migrated for.
    pub(crate) registry: std::sync::Arc<better_compute_runtime::Registry>,
    pub(crate) report: better_compute_db::migrate::MigrateReport,
    pub(crate) admin: DevAdmin,
    /// Whether the demo fleet was made now.
    pub(crate) first_start: bool,
}

/// Creates the dev database if needed, migrates it, and makes its admin and demo fleet.
pub(crate) async fn prepare(cluster: &Cluster, root: &Path) -> anyhow::Result<Prepared> {
    let admin = better_compute_db::pool::connect(&cluster.connection_string("postgres")).await?;
    if admin.query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&DEV_DATABASE]).await?.is_none() {
        admin.batch_execute(&format!("CREATE DATABASE {DEV_DATABASE}")).await?;
    }
    drop(admin);
    let registry = better_compute_server::registry()?;
    let conn = cluster.connection_string(DEV_DATABASE);
    let mut db = better_compute_db::pool::connect(&conn).await?;
    let report = better_compute_db::migrate(&mut db, &registry.migrations()).await.with_context(|| {
        format!(
            "the database in {} does not take this build's migrations (made by an older build before the \
             schema's baseline?): remove that folder to start afresh, or pass another --data-dir",
            root.display()
        )
    })?;
    let admin = admin_credentials(&mut db, root).await?;
    let first_start = seed_demo_fleet(&mut db, &admin.tenant_id).await?;
    if first_start {
        println!("created site dev, pools gpus (bare metal), burst (a provider's, lost after 1 h unreachable) and vms (a vps-host, fake VMs), and a quota for tenant dev");
    }
    Ok(Prepared { conn, registry, report, admin, first_start })
}

async fn serve(cluster: &Cluster, root: &Path, args: &DevArgs) -> anyhow::Result<()> {
    let Prepared { conn, registry, report, admin, first_start } = prepare(cluster, root).await?;
    let mut db = better_compute_db::pool::connect(&conn).await?;
    let pool = better_compute_db::pool::connect_pool(&conn, 32)?;
    better_compute_runtime::work_queue::Poker::install(pool.clone());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let stopped_status = stopped.clone();
    let ca_dir = better_compute_gateway::default_ca_dir(root);
    registry.install_command_signer(std::sync::Arc::new(better_compute_runtime::signing::CommandSigner::load_or_create(&ca_dir)?));
    let (api_addr, api) = better_compute_server::start_api(pool.clone(), registry.clone(), &args.api_listen, Default::default(), stopped.clone()).await?;
    let (worker, handle) = better_compute_server::start_worker(pool.clone(), registry.clone(), Some(conn.clone()), stopped.clone()).await?;
    let hostnames = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    let gateway = better_compute_server::start_gateway(pool.clone(), &ca_dir, &args.gateway_listen, hostnames, Some(conn.clone()), stopped.clone()).await?;
    let gateway_url = format!("https://{}", gateway.addr());
    let fleet = better_compute_sim::fleet::start(&mut db, root, &gateway_url, &ca_dir.join("ca.pem"), args.nodes, &args.gpus, stopped.clone())
        .await
        .context("the simulated nodes could not join")?;
    if first_start {
        better_compute_sim::fleet::demo_modes(&mut db, &fleet.node_ids).await?;
    }
    better_compute_sim::fleet::wait_converged(&db, &fleet.node_ids, std::time::Duration::from_secs(90)).await;
    print!("{}", crate::ops::nodes_table(&db).await?);
    drop(db);
    let url = cluster.url(DEV_DATABASE);
    let api_url = format!("http://{api_addr}");
    println!("migrations: {} applied, {} already applied", report.applied.len(), report.already_applied);
    println!();
    println!("Better Compute dev is running.");
    println!("  database   {url}");
    println!("  psql       psql -h {} -U postgres {DEV_DATABASE}", cluster.options().socket_dir.display());
    println!("  data       {} (kept across restarts)", cluster.options().data_dir.display());
    println!("  api        {api_url}  (OpenAPI: {api_url}/v1/openapi.json, metrics: {api_url}/metrics)");
    println!("  worker     {} running {}", worker.id(), registry.job_names().join(", "));
    println!("  gateway    {gateway_url}  (CA: {}; {} simulated daemons with {} joined through it)", ca_dir.join("ca.pem").display(), fleet.node_ids.len(), args.gpus);
    println!("  admin      {} of tenant dev ({}); token kept in {}", admin.identity, admin.tenant_id, root.join("admin-token").display());
    println!();
    println!("Use it from another shell:");
    println!("  export BETTER_COMPUTE_URL={api_url} BETTER_COMPUTE_TENANT={} BETTER_COMPUTE_TOKEN={}", admin.tenant_id, admin.secret);
    println!("  cargo run -- api --list");
    println!("  cargo run -- api nodes.list");
    if let Some(pool) = pool_named(&conn, "gpus").await {
        println!("  cargo run -- api reservations.create poolId={pool} gpu.kind=gpu gpu.model=H100-80GB gpu.count:=2 vcpu:=16 memoryMib:=65536 durationS:=3600 idempotencyKey=first --wait");
    }
    println!("  cargo run -- api reservations.list");
    if let Some(vms) = pool_named(&conn, "vms").await {
        println!("A VM with a GPU on the vps host (fake VMs in dev; `daemon --hypervisor qemu` on a KVM host runs real ones), then where to SSH:");
        println!("  cargo run -- api instances.create poolId={vms} gpu.kind=gpu gpu.model=H100-80GB gpu.count:=1 vcpu:=4 memoryMib:=8192 diskGib:=20 durationS:=3600 image=debian-12 sshPublicKeys:=\"[\\\"$(cat ~/.ssh/id_ed25519.pub)\\\"]\" idempotencyKey=vm-1");
        println!("  cargo run -- api instances.get instanceId=<ins_…>   (address, hostKeyFingerprint; then: ssh debian@<address>)");
    }
    println!("  cargo run -- api watch        (your events, live; Ctrl-C stops)");
    println!("  cargo run -- api commands.run nodeId=<node> kind=diag.nvml idempotencyKey=diag-1   (runs on the simulated daemon)");
    if let Some(node) = fleet.node_ids.last() {
        println!("Maintenance of a node, as a workflow: drain (evicting after 10 s), a signed reboot, wait for the new boot, check the GPUs, uncordon; its steps live:");
        println!("  cargo run -- api workflows.start definition=node.maintenance target.nodeId={node} params.reason=demo params.drainDeadlineS:=10 idempotencyKey=maint-1 --wait");
    }
    if let Some((node, gpu)) = &fleet.flaky_gpu {
        println!("GPU health: about a minute from now GPU {gpu} of node {node} throws XID 119 (transient). It leaves placement,");
        println!("  diag.nvml checks it, and it is back after 3 clean checks a minute apart. Watch it:");
        println!("  cargo run -- api watch types=device.suspect,device.recovering,device.healthy");
        println!("  DATABASE_URL='{url}' cargo run -- nodes describe {node}");
        println!("  cargo run -- api devices.get deviceId={gpu}");
    }
    println!("Join one more node (a real daemon process, fake GPUs):");
    println!("  cargo run -- daemon --gateway {gateway_url} --ca-cert {} --join-token $(cargo run -q -- api nodes.createJoinToken poolId=<pool> -o json | jq -r .secret) --gpus fake:4xA100-40GB --state-dir /tmp/extra-node --node-name extra-1", ca_dir.join("ca.pem").display());
    println!("Operators, straight from the database:");
    println!("  DATABASE_URL='{url}' cargo run -- jobs | capacity | nodes list");
    println!("Press Ctrl-C to stop.");
    println!("ready: DATABASE_URL={url} BETTER_COMPUTE_URL={api_url} BETTER_COMPUTE_TENANT={} BETTER_COMPUTE_TOKEN={}", admin.tenant_id, admin.secret);
    // SAFETY: isatty on our own stdout.
    let status = (unsafe { libc::isatty(1) } == 1).then(|| tokio::spawn(better_compute_sim::fleet::live_status(conn.clone(), stopped_status)));
    let ended = tokio::select! {
        signal = better_compute_server::shutdown_signal() => Ok(signal?),
        e = watch_postgres(cluster) => Err(e),
    };
    if let Some(s) = status {
        s.abort();
        println!();
    }
    match &ended {
        Ok(signal) => println!("received {signal}"),
        Err(e) => println!("stopping: {e}"),
    }
    stop.send(true)?;
    fleet.stop().await;
    gateway.join().await;
    handle.await??;
    api.await??;
    ended.map(|_| ())
}

/// How often dev looks whether its PostgreSQL is still there.
const POSTGRES_WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Watches dev's own PostgreSQL: when it dies (killed, crashed), starts it again at once and says
/// so in one line, so the server, worker, gateway and daemons reconnect instead of logging
/// failures until someone notices. Returns only when it cannot be started again.
pub(crate) async fn watch_postgres(cluster: &Cluster) -> anyhow::Error {
    loop {
        tokio::time::sleep(POSTGRES_WATCH_EVERY).await;
        // SAFETY: signal 0 only asks whether the process exists.
        let alive = cluster.postmaster_pid().is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
        if alive {
            continue;
        }
        let c = cluster.clone();
        match tokio::task::spawn_blocking(move || c.start()).await {
            Ok(Ok(())) => println!("PostgreSQL stopped unexpectedly; started it again (pid {:?}); everything reconnects", cluster.postmaster_pid()),
            Ok(Err(e)) => {
                return anyhow::anyhow!(
                    "PostgreSQL stopped unexpectedly and could not be started again: {e}; see {}",
                    cluster.options().data_dir.join("server.log").display()
                )
            }
            Err(e) => return anyhow::anyhow!("PostgreSQL stopped unexpectedly; restarting it failed: {e}"),
        }
    }
}

/// The dev admin's token and tenant.
pub(crate) struct DevAdmin {
    pub(crate) tenant_id: String,
    pub(crate) identity: String,
    pub(crate) secret: String,
}

/// Bootstraps on the first start and keeps the admin's token in `<data>/admin-token` (0600, only
/// on this machine: dev is for one person), so every start prints a working one.
async fn admin_credentials(db: &mut tokio_postgres::Client, root: &Path) -> anyhow::Result<DevAdmin> {
    use std::os::unix::fs::PermissionsExt;
    let path = root.join("admin-token");
    if let Ok(text) = std::fs::read_to_string(&path) {
        let mut parts = text.split_whitespace();
        if let (Some(t), Some(i), Some(s)) = (parts.next(), parts.next(), parts.next())
            && better_compute_iam::tokens::authenticate(&*db, s).await.is_ok()
        {
            return Ok(DevAdmin { tenant_id: t.into(), identity: i.into(), secret: s.into() });
        }
    }
    let admin = match better_compute_iam::bootstrap::first_fleet_admin(&*db).await? {
        // Bootstrapped before, but the token file is gone or its token expired: issue another.
        Some((tenant_id, identity)) => {
            let tx = db.transaction().await?;
            let t = better_compute_iam::tokens::issue(&tx, &tenant_id, None, &identity, "dev", Some(better_compute_iam::tokens::MAX_TTL_S)).await?;
            tx.commit().await?;
            DevAdmin { tenant_id, identity, secret: t.secret }
        }
        None => {
            let done = better_compute_server::bootstrap_db(db, "dev", "admin").await?;
            println!("bootstrapped tenant dev ({}) and its admin", done.tenant.id);
            DevAdmin { tenant_id: done.tenant.id, identity: done.identity.id, secret: done.token.secret }
        }
    };
    std::fs::write(&path, format!("{} {} {}\n", admin.tenant_id, admin.identity, admin.secret))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(admin)
}

/// On a fresh database, creates the demo site `dev`, pools `gpus` (bare metal) and `burst` (a
/// provider's) and a quota for the dev tenant;
/// the nodes arrive as daemons that join. Returns whether it did (a first start).
async fn seed_demo_fleet(db: &mut tokio_postgres::Client, tenant_id: &str) -> anyhow::Result<bool> {
    use better_compute_nodes::inventory::{self, NewPool};
    if better_compute_nodes::listing::any_site(&*db).await? {
        return Ok(false);
    }
    let tx = db.transaction().await?;
    let site = inventory::create_site(&tx, "dev").await?;
    inventory::create_pool(
        &tx,
        &NewPool { site_id: site.clone(), name: "gpus".into(), kind: "bare-metal".into(), vcpu_ratio: 2.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
    )
    .await?;
    inventory::create_pool(
        &tx,
        &NewPool {
            site_id: site.clone(),
            name: "burst".into(),
            kind: "provider".into(),
            vcpu_ratio: 1.0,
            memory_ratio: 1.0,
            disk_ratio: 1.0,
            lost_after_s: Some(3600),
        },
    )
    .await?;
    inventory::create_pool(
        &tx,
        &NewPool {
            site_id: site.clone(),
            name: "vms".into(),
            kind: "vps-host".into(),
            vcpu_ratio: 1.0,
            memory_ratio: 1.0,
            disk_ratio: 1.0,
            lost_after_s: None,
        },
    )
    .await?;
    for (resource, max) in [("gpus", 24), ("mig_instances", 4), ("gpu_slots", 8), ("vcpu", 256), ("memory_mib", 2_097_152), ("disk_gib", 10_000)] {
        better_compute_capacity::quota::set(&tx, tenant_id, resource, max).await?;
    }
    tx.commit().await?;
    Ok(true)
}

pub(crate) async fn pool_named(conn: &str, name: &str) -> Option<String> {
    let c = better_compute_db::pool::connect(conn).await.ok()?;
    better_compute_nodes::listing::pool_named(&c, "dev", name).await.ok()?
}
