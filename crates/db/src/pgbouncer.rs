//! PgBouncer in transaction pooling mode in front of a [`Cluster`]: the proof that the system needs
//! no session state. Consecutive transactions of one client land on different server connections
//! (the pool is smaller than the clients, and `server_round_robin` hands out the server idle
//! longest rather than the one just used), so a named prepared statement, a session variable, an
//! advisory lock or a LISTEN that outlived its transaction breaks at once. So does a statement with
//! parameters sent outside a transaction: tokio-postgres prepares it and executes it in two
//! exchanges, which PgBouncer may give to two servers; such statements run in a transaction.
//!
//! The test support and `better-compute sim --pgbouncer` start one. It runs as the cluster's user
//! (PgBouncer refuses root), listens only on a Unix socket in its own folder, and dies with the
//! thread that started it (`PR_SET_PDEATHSIG`), so a killed test leaves none behind.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::launcher::{io_err, Cluster, LaunchError, SUPERUSER};

/// The port in the socket's name (`.s.PGSQL.6432`); the socket lives in a private folder.
const PORT: u16 = 6432;
/// How long PgBouncer may take to open its socket.
const READY_TIMEOUT_S: u64 = 20;

/// A running PgBouncer; stopped when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
}

fn find_binary() -> Result<PathBuf, LaunchError> {
    if let Some(p) = std::env::var_os("BETTER_COMPUTE_PGBOUNCER") {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = vec![PathBuf::from("/usr/sbin/pgbouncer"), PathBuf::from("/usr/bin/pgbouncer")];
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("pgbouncer")));
    }
    candidates.into_iter().find(|p| p.is_file()).ok_or(LaunchError::PgBouncerNotFound)
}

impl PgBouncer {
    /// Starts PgBouncer in `dir` (created, private to the server's user) in front of `cluster`,
    /// for every database, with at most `pool_size` server connections per database.
    pub fn start(cluster: &Cluster, dir: &Path, pool_size: u32) -> Result<PgBouncer, LaunchError> {
        let binary = find_binary()?;
        cluster.private_dir(dir)?;
        let log = dir.join("pgbouncer.log");
        let ini = dir.join("pgbouncer.ini");
        // server_login_retry = 1: after PostgreSQL restarts (the simulator crashes it), logins are
        // retried after 1 s instead of every client being refused for the default 15 s.
        let text = format!(
            "[databases]\n\
             * = host={pg} user={SUPERUSER}\n\
             [pgbouncer]\n\
             listen_addr =\n\
             listen_port = {PORT}\n\
             unix_socket_dir = {dir}\n\
             auth_type = any\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             server_round_robin = 1\n\
             max_client_conn = 2000\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             server_login_retry = 1\n\
             logfile = {log}\n\
             log_connections = 0\n\
             log_disconnections = 0\n",
            pg = cluster.options().socket_dir.display(),
            dir = dir.display(),
            log = log.display(),
        );
        std::fs::write(&ini, text).map_err(io_err("write", &ini))?;
        let mut cmd = Command::new(&binary);
        cmd.arg(&ini).current_dir("/").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        if let Some(r) = cluster.run_as() {
            std::os::unix::fs::chown(&ini, Some(r.uid), Some(r.gid)).map_err(io_err("chown", &ini))?;
            cmd.uid(r.uid).gid(r.gid);
        }
        // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec, after the
        // uid change (which would clear it).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(io_err("run", &binary))?;
        let mut bouncer = PgBouncer { child, dir: dir.to_owned() };
        let socket = dir.join(format!(".s.PGSQL.{PORT}"));
        let started = Instant::now();
        // Ready when it accepts a connection, not when its socket file exists: the file appears at
        // bind, before listen, and a client that came in between was refused (the PgBouncer run of
        // the capacity torture test failed so, about one run in five on a loaded machine).
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            if bouncer.child.try_wait().ok().flatten().is_some() || started.elapsed() > Duration::from_secs(READY_TIMEOUT_S) {
                return Err(LaunchError::NotReady { program: "pgbouncer".into(), waited_s: READY_TIMEOUT_S, log: log.display().to_string() });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(bouncer)
    }

    /// [`PgBouncer::start`] from a thread that lives as long as the process: PgBouncer dies with the
    /// thread that started it, and a pool's or runtime's threads come and go.
    pub fn start_on_own_thread(cluster: &Cluster, dir: &Path, pool_size: u32) -> Result<PgBouncer, LaunchError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (cluster, dir) = (cluster.clone(), dir.to_owned());
        std::thread::spawn(move || {
            let _ = tx.send(PgBouncer::start(&cluster, &dir, pool_size));
            loop {
                std::thread::park();
            }
        });
        rx.recv().unwrap_or_else(|_| Err(LaunchError::NotReady { program: "pgbouncer".into(), waited_s: 0, log: "its thread died".into() }))
    }

    /// A libpq-style connection string for `dbname` through PgBouncer.
    pub fn connection_string(&self, dbname: &str) -> String {
        format!("host={} port={PORT} user={SUPERUSER} dbname={dbname}", self.dir.display())
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
