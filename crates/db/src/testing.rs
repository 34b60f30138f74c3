//! Test support: a real PostgreSQL for every test, never a mock.
//!
//! One throwaway cluster (fsync off) serves a whole test run. Under cargo-nextest every test is its
//! own process, so the cluster is keyed by the test runner's pid (our parent): the first test
//! process to need it starts it under a file lock, the others find it running. A detached reaper
//! watches the runner and, when it exits (also when tests panicked or the runner was killed), stops
//! the cluster and removes its folder. A template database is migrated once per migration set, and
//! each test gets its own `CREATE DATABASE … TEMPLATE` copy with the simulated clock on.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use crate::clock;
use crate::launcher::{Cluster, ClusterOptions, FileLock, LaunchError};
use crate::migrate::{fingerprint, migrate, Migration};
use crate::pgbouncer::PgBouncer;
use crate::pool::{connect, connect_pool, Pool};
use crate::DbError;

/// Connections each test's pool may open (enough for tests that run 50 calls at once).
pub const TEST_POOL_SIZE: usize = 64;

struct RunCluster {
    cluster: Cluster,
    root: PathBuf,
}

static RUN_CLUSTER: OnceLock<Result<RunCluster, String>> = OnceLock::new();
static READY_TEMPLATES: Mutex<Option<HashSet<String>>> = Mutex::new(None);
static NEXT_DB: AtomicU64 = AtomicU64::new(0);
static GC_DONE: OnceLock<()> = OnceLock::new();
static BOUNCER: OnceLock<Result<PgBouncer, String>> = OnceLock::new();

/// This test process's PgBouncer in front of the run's cluster, with a pool of
/// [`BOUNCER_POOL_SIZE`] server connections per database.
fn bouncer() -> &'static PgBouncer {
    let started = BOUNCER.get_or_init(|| {
        let rc = run_cluster();
        let dir = rc.root.join(format!("bouncer-{}", std::process::id()));
        PgBouncer::start_on_own_thread(&rc.cluster, &dir, BOUNCER_POOL_SIZE).map_err(|e| e.to_string())
    });
    match started {
        Ok(b) => b,
        Err(e) => panic!("PgBouncer could not start: {e}"),
    }
}

/// Server connections PgBouncer keeps per test database: fewer than the tests' clients, so
/// consecutive transactions of one client run on different server connections.
pub const BOUNCER_POOL_SIZE: u32 = 4;

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
}

fn run_root(run_pid: i32) -> PathBuf {
    std::env::temp_dir().join(format!("better-compute-test-{run_pid}"))
}

/// Removes clusters of test runs that ended without their reaper (it was killed too).
fn remove_orphaned_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("better-compute-test-")).and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if pid_alive(pid) {
            continue;
        }
        let dir = e.path();
        if let Ok(text) = std::fs::read_to_string(dir.join("data/postmaster.pid"))
            && let Some(pm) = text.lines().next().and_then(|l| l.trim().parse::<i32>().ok())
        {
            // SAFETY: SIGQUIT asks the postmaster for an immediate shutdown.
            unsafe { libc::kill(pm, libc::SIGQUIT) };
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Starts a detached process that, once the process `run_pid` is gone, stops the cluster in
/// `<root>/data` and removes `root`, unless a file `<root>/keep` exists by then (`bench --keep`). It
/// is in its own session, so the runner's timeouts and Ctrl-C do not reach it. Test runs and
/// benchmarks use it, so a killed one leaves no cluster behind.
pub fn spawn_reaper(run_pid: i32, root: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let script = r#"
        while kill -0 "$1" 2>/dev/null; do sleep 1; done
        [ -e "$2/keep" ] && exit 0
        pm=$(head -n 1 "$2/data/postmaster.pid" 2>/dev/null)
        if [ -n "$pm" ]; then
          kill -QUIT "$pm" 2>/dev/null
          i=0; while kill -0 "$pm" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
        fi
        rm -rf "$2" "$2.lock"
    "#;
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c").arg(script).arg("better-compute-test-reaper").arg(run_pid.to_string()).arg(root);
    cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    // SAFETY: setsid is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    cmd.spawn().map(|_| ())
}

fn start_run_cluster() -> Result<RunCluster, LaunchError> {
    // SAFETY: getppid has no preconditions.
    let run_pid = unsafe { libc::getppid() };
    let root = run_root(run_pid);
    let _lock = FileLock::acquire_blocking(&std::env::temp_dir().join(format!("better-compute-test-{run_pid}.lock")))?;
    remove_orphaned_runs();
    let cluster = Cluster::new(ClusterOptions {
        data_dir: root.join("data"),
        socket_dir: root.join("sock"),
        durable: false,
        max_connections: 300,
    })?;
    if !cluster.is_running() {
        let fresh = !root.exists();
        std::fs::create_dir_all(&root)
            .map_err(|source| LaunchError::Io { what: "create", path: root.display().to_string(), source })?;
        cluster.init_if_needed()?;
        cluster.start()?;
        if fresh {
            spawn_reaper(run_pid, &root)
                .map_err(|source| LaunchError::Io { what: "spawn reaper for", path: root.display().to_string(), source })?;
        }
    }
    Ok(RunCluster { cluster, root })
}

fn run_cluster() -> &'static RunCluster {
    match RUN_CLUSTER.get_or_init(|| start_run_cluster().map_err(|e| e.to_string())) {
        Ok(c) => c,
        Err(e) => panic!("test PostgreSQL could not start: {e}"),
    }
}

/// Drops databases left by test processes that have exited.
async fn drop_databases_of_dead_processes(admin: &tokio_postgres::Client) {
    let Ok(rows) = admin.query("SELECT datname FROM pg_database WHERE datname LIKE 't\\_%'", &[]).await else { return };
    for r in rows {
        let name: String = r.get(0);
        let pid = name.split('_').nth(1).and_then(|p| p.parse::<i32>().ok());
        if pid.is_some_and(|p| !pid_alive(p)) {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).await;
        }
    }
}

async fn ensure_template(rc: &RunCluster, sets: &[&[Migration]]) -> Result<String, DbError> {
    let template = format!("bc_tpl_{}", fingerprint(sets));
    if READY_TEMPLATES.lock().expect("templates").get_or_insert_with(HashSet::new).contains(&template) {
        return Ok(template);
    }
    let lock_path = rc.root.join(format!("{template}.lock"));
    let _lock = tokio::task::spawn_blocking(move || FileLock::acquire_blocking(&lock_path))
        .await
        .expect("lock task")
        .map_err(|e| better_compute_core::Error::internal(e.to_string()))?;
    let admin = connect(&rc.cluster.connection_string("postgres")).await?;
    let exists = admin.query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&template]).await?.is_some();
    if !exists {
        // Build under another name and rename, so a crash mid-way never leaves a half template.
        let building = format!("{template}_building");
        admin.batch_execute(&format!("DROP DATABASE IF EXISTS \"{building}\" WITH (FORCE)")).await?;
        admin.batch_execute(&format!("CREATE DATABASE \"{building}\"")).await?;
        {
            let mut db = connect(&rc.cluster.connection_string(&building)).await?;
            migrate(&mut db, sets).await?;
            clock::use_sim_clock(&db, clock::sim_epoch()).await?;
        }
        // The migrating connection must be gone before the database can be renamed or copied.
        for _ in 0..200 {
            let busy = admin
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", &[&building])
                .await?
                .get::<_, i64>(0);
            if busy == 0 {
                break;
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        admin.batch_execute(&format!("ALTER DATABASE \"{building}\" RENAME TO \"{template}\"")).await?;
    }
    READY_TEMPLATES.lock().expect("templates").get_or_insert_with(HashSet::new).insert(template.clone());
    Ok(template)
}

/// A test's own database, copied from the migrated template, with the simulated clock at
/// [`clock::sim_epoch`].
pub struct TestDb {
    /// A pool of connections to this database through PgBouncer, for the system under test.
    pub pool: Pool,
    /// The test's own connections ([`TestDb::client`]): straight to PostgreSQL even when `pool`
    /// goes through PgBouncer, so the audit finds the system's statements, not the tests'.
    direct: Pool,
    name: String,
    conn: String,
}

impl TestDb {
    /// A database with the foundation's migrations (the clock and core).
    pub async fn core() -> TestDb {
        Self::with_migrations(crate::FOUNDATION_MIGRATIONS).await
    }

    /// A database with these migration sets applied (core first).
    pub async fn with_migrations(sets: &[&[Migration]]) -> TestDb {
        match Self::try_new(sets).await {
            Ok(db) => db,
            Err(e) => panic!("test database could not be created: {e}"),
        }
    }

    async fn try_new(sets: &[&[Migration]]) -> Result<TestDb, DbError> {
        let rc = tokio::task::spawn_blocking(run_cluster).await.expect("cluster task");
        let template = ensure_template(rc, sets).await?;
        let admin = connect(&rc.cluster.connection_string("postgres")).await?;
        if GC_DONE.set(()).is_ok() {
            drop_databases_of_dead_processes(&admin).await;
        }
        let name = format!("t_{}_{}", std::process::id(), NEXT_DB.fetch_add(1, Ordering::Relaxed));
        let mut attempt = 0;
        loop {
            match admin.batch_execute(&format!("CREATE DATABASE \"{name}\" TEMPLATE \"{template}\"")).await {
                Ok(()) => break,
                // Someone is briefly connected to the template (another process checking it): retry.
                Err(e) if attempt < 50 && e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE) => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        let conn = rc.cluster.connection_string(&name);
        // The system's connections go through PgBouncer in transaction pooling mode, so every
        // test also checks that nothing needs session state: a statement outside a transaction,
        // say, fails at once there (`pgbouncer`'s module doc).
        let n = name.clone();
        let pooled = tokio::task::spawn_blocking(move || bouncer().connection_string(&n)).await.expect("bouncer task");
        let direct = connect_pool(&conn, TEST_POOL_SIZE)?;
        Ok(TestDb { pool: connect_pool(&pooled, TEST_POOL_SIZE)?, direct, name, conn })
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its connection string.
    pub fn connection_string(&self) -> &str {
        &self.conn
    }

    /// A pooled connection for the test's own statements (always straight to PostgreSQL).
    pub async fn client(&self) -> deadpool_postgres::Client {
        self.direct.get().await.expect("test pool connection")
    }

    /// A dedicated connection, outside the pool.
    pub async fn connect(&self) -> tokio_postgres::Client {
        connect(&self.conn).await.expect("test connection")
    }

    /// The connection string of this database through PgBouncer in transaction pooling mode.
    pub async fn pgbouncer_connection_string(&self) -> String {
        let name = self.name.clone();
        tokio::task::spawn_blocking(move || bouncer().connection_string(&name)).await.expect("bouncer task")
    }

    /// A dedicated connection through PgBouncer in transaction pooling mode.
    pub async fn connect_through_pgbouncer(&self) -> tokio_postgres::Client {
        connect(&self.pgbouncer_connection_string().await).await.expect("connection through PgBouncer")
    }

    /// The lines the server logged for this database's sessions so far (the cluster is shared by
    /// a run's tests; every session's line names its database).
    pub fn server_log(&self) -> Vec<String> {
        let path = run_cluster().cluster.server_log_path();
        let text = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let mark = format!("@{} ", self.name);
        String::from_utf8_lossy(&text).lines().filter(|l| l.contains(&mark)).map(str::to_owned).collect()
    }

    /// Sets simulated time.
    pub async fn set_sim_clock(&self, at: SystemTime) {
        clock::set_sim_clock(&**self.client().await, at).await.expect("set sim clock");
    }

    /// Moves simulated time forward and returns the new time.
    pub async fn advance(&self, by: Duration) -> SystemTime {
        clock::advance_sim_clock(&**self.client().await, by).await.expect("advance sim clock")
    }

    /// `compute_now()`.
    pub async fn now(&self) -> SystemTime {
        clock::db_now(&**self.client().await).await.expect("compute_now()")
    }
}
