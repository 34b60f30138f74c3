//! A PostgreSQL that starts itself: finds the server binaries, runs `initdb`, starts the server on a
//! Unix socket in a private folder, waits until it accepts connections, and stops it cleanly.
//!
//! `initdb` and `postgres` refuse to run as root, so when this process is root the cluster runs as
//! an unprivileged user (`postgres`, which Debian's server package creates, or
//! `BETTER_COMPUTE_PG_USER`) that owns the data and socket folders. Root can still connect through
//! the socket. `better-compute dev` and the test support both use this one launcher.

use std::ffi::CString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Why a cluster could not be found, created, started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// No usable `initdb`, `pg_ctl` and `postgres`.
    #[error(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; install Debian's `postgresql` \
         package (`apt-get install postgresql`) or set BETTER_COMPUTE_PG_BIN to the folder holding them \
         (looked in: {searched})"
    )]
    BinariesNotFound {
        /// Where we looked, for the message.
        searched: String,
    },
    /// Running as root without an unprivileged user to run the server as.
    #[error(
        "running as root, and PostgreSQL refuses to run as root, but user {user:?} does not exist; \
         install Debian's `postgresql` package (it creates `postgres`) or set BETTER_COMPUTE_PG_USER"
    )]
    NoUnprivilegedUser {
        /// The user we looked for.
        user: String,
    },
    /// Another process holds the data folder.
    #[error(
        "{path} is in use by another process (pid {pid}); stop it first (Ctrl-C in its terminal), \
         or use another data folder"
    )]
    InUse {
        /// The folder.
        path: String,
        /// The holder's pid as it wrote it, or `unknown`.
        pid: String,
    },
    /// A server program failed.
    #[error("{program} failed ({status}): {output}")]
    Program {
        /// Which program.
        program: String,
        /// Its exit status.
        status: String,
        /// The end of what it printed.
        output: String,
    },
    /// PgBouncer is not installed.
    #[error(
        "pgbouncer not found; install Debian's `pgbouncer` package (`apt-get install pgbouncer`) or set \
         BETTER_COMPUTE_PGBOUNCER to its path"
    )]
    PgBouncerNotFound,
    /// A server did not come up in time.
    #[error("{program} did not start within {waited_s} s; see {log}")]
    NotReady {
        /// Which program.
        program: String,
        /// How long we waited.
        waited_s: u64,
        /// Its log file.
        log: String,
    },
    /// A file-system operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What we tried.
        what: &'static str,
        /// On which path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
}

pub(crate) fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LaunchError {
    let path = path.display().to_string();
    move |source| LaunchError::Io { what, path, source }
}

/// The folder holding `initdb`, `pg_ctl` and `postgres`.
#[derive(Debug, Clone)]
pub struct PgBinaries {
    bindir: PathBuf,
}

impl PgBinaries {
    /// Finds the binaries: `BETTER_COMPUTE_PG_BIN`, then `pg_config --bindir`, then the newest
    /// `/usr/lib/postgresql/*/bin`, then `PATH`.
    pub fn find() -> Result<Self, LaunchError> {
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Some(dir) = std::env::var_os("BETTER_COMPUTE_PG_BIN") {
            candidates.push(PathBuf::from(dir));
        }
        if let Ok(out) = Command::new("pg_config").arg("--bindir").stderr(Stdio::null()).output() && out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
        if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
            let mut versions: Vec<(u32, PathBuf)> = entries
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let v = e.file_name().to_str()?.parse::<u32>().ok()?;
                    Some((v, e.path().join("bin")))
                })
                .collect();
            versions.sort_by_key(|v| std::cmp::Reverse(v.0));
            candidates.extend(versions.into_iter().map(|(_, p)| p));
        }
        if let Some(path) = std::env::var_os("PATH") {
            candidates.extend(std::env::split_paths(&path));
        }
        Self::find_in(&candidates)
    }

    /// The first of `candidates` that holds all three programs.
    pub fn find_in(candidates: &[PathBuf]) -> Result<Self, LaunchError> {
        let usable = |dir: &Path| ["initdb", "pg_ctl", "postgres"].iter().all(|b| dir.join(b).is_file());
        match candidates.iter().find(|d| usable(d)) {
            Some(dir) => Ok(PgBinaries { bindir: dir.clone() }),
            None => Err(LaunchError::BinariesNotFound {
                searched: candidates.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
            }),
        }
    }

    /// The folder.
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    fn program(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }
}

/// The unprivileged user the server runs as when this process is root.
#[derive(Debug, Clone, Copy)]
pub struct RunAs {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

impl RunAs {
    /// `None` when this process is not root (the server then runs as us).
    pub fn detect() -> Result<Option<RunAs>, LaunchError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Ok(None);
        }
        let user = std::env::var("BETTER_COMPUTE_PG_USER").unwrap_or_else(|_| "postgres".to_owned());
        let c = CString::new(user.clone()).map_err(|_| LaunchError::NoUnprivilegedUser { user: user.clone() })?;
        // SAFETY: getpwnam reads a NUL-terminated name and returns a pointer to static storage or
        // null; we copy the two fields out at once, before any other call could reuse the storage.
        let pw = unsafe { libc::getpwnam(c.as_ptr()) };
        if pw.is_null() {
            return Err(LaunchError::NoUnprivilegedUser { user });
        }
        let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
        Ok(Some(RunAs { uid, gid }))
    }

    /// Whether this user can reach `dir`: search every folder on its path, as the server must to
    /// open its data and socket folders (a checkout under root's private home cannot be reached).
    pub fn can_reach(&self, dir: &Path) -> bool {
        Command::new("test")
            .arg("-x")
            .arg(dir)
            .current_dir("/")
            .stdin(Stdio::null())
            .uid(self.uid)
            .gid(self.gid)
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// Settings for one cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The data folder (`PGDATA`).
    pub data_dir: PathBuf,
    /// The private folder the Unix socket lives in.
    pub socket_dir: PathBuf,
    /// `false` for throwaway test clusters: fsync, full-page writes and synchronous commit off.
    pub durable: bool,
    /// `max_connections`.
    pub max_connections: u32,
}

/// One PostgreSQL cluster on a Unix socket.
#[derive(Debug, Clone)]
pub struct Cluster {
    bins: PgBinaries,
    run_as: Option<RunAs>,
    opts: ClusterOptions,
}

/// The superuser every cluster is initialised with.
pub const SUPERUSER: &str = "postgres";

impl Cluster {
    /// Finds the binaries and the user to run as; touches nothing.
    pub fn new(opts: ClusterOptions) -> Result<Self, LaunchError> {
        Ok(Cluster { bins: PgBinaries::find()?, run_as: RunAs::detect()?, opts })
    }

    /// The options.
    pub fn options(&self) -> &ClusterOptions {
        &self.opts
    }

    /// A libpq-style connection string for `dbname` over the socket.
    pub fn connection_string(&self, dbname: &str) -> String {
        format!("host={} user={} dbname={}", self.opts.socket_dir.display(), SUPERUSER, dbname)
    }

    /// The same as a URL (`postgresql://postgres@%2Fpath/db`), for `DATABASE_URL` and psql.
    pub fn url(&self, dbname: &str) -> String {
        let host: String = self
            .opts
            .socket_dir
            .display()
            .to_string()
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        format!("postgresql://{SUPERUSER}@{host}/{dbname}")
    }

    /// The user the server runs as, when this process is root.
    pub fn run_as(&self) -> Option<RunAs> {
        self.run_as
    }

    /// Creates a folder owned by the server's user, mode 0700.
    pub(crate) fn private_dir(&self, dir: &Path) -> Result<(), LaunchError> {
        std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        if let Some(r) = self.run_as {
            std::os::unix::fs::chown(dir, Some(r.uid), Some(r.gid)).map_err(io_err("chown", dir))?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io_err("chmod", dir))
    }

    fn run(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<Output, LaunchError> {
        let mut cmd = Command::new(self.bins.program(program));
        cmd.args(args).current_dir("/").stdin(Stdio::null());
        // LC_ALL from the caller's shell may name a locale this machine lacks.
        cmd.env("LC_ALL", "C").env_remove("PGDATA");
        if let Some(r) = self.run_as {
            cmd.uid(r.uid).gid(r.gid);
        }
        cmd.output().map_err(|source| LaunchError::Io {
            what: "run",
            path: self.bins.program(program).display().to_string(),
            source,
        })
    }

    fn run_ok(&self, program: &str, args: &[&std::ffi::OsStr]) -> Result<Output, LaunchError> {
        let out = self.run(program, args)?;
        if out.status.success() {
            return Ok(out);
        }
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        let tail: String = text.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
        Err(LaunchError::Program { program: program.to_owned(), status: out.status.to_string(), output: tail })
    }

    /// Whether `initdb` has run in the data folder.
    pub fn is_initialized(&self) -> bool {
        self.opts.data_dir.join("PG_VERSION").is_file()
    }

    /// Runs `initdb` unless the data folder already holds a cluster. Returns whether it ran.
    pub fn init_if_needed(&self) -> Result<bool, LaunchError> {
        if self.is_initialized() {
            return Ok(false);
        }
        self.private_dir(&self.opts.data_dir)?;
        let d = self.opts.data_dir.as_os_str();
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "-D".as_ref(), d, "-U".as_ref(), SUPERUSER.as_ref(), "--auth=trust".as_ref(),
            "--no-locale".as_ref(), "-E".as_ref(), "UTF8".as_ref(),
        ];
        if !self.opts.durable {
            args.push("--no-sync".as_ref());
        }
        self.run_ok("initdb", &args)?;
        let conf = self.opts.data_dir.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).map_err(io_err("read", &conf))?;
        text.push_str("\ninclude_if_exists = 'better_compute.conf'\n");
        std::fs::write(&conf, text).map_err(io_err("write", &conf))?;
        Ok(true)
    }

    /// Writes the settings we own; rewritten at every start so a moved socket folder takes effect.
    fn write_settings(&self) -> Result<(), LaunchError> {
        let sock = self.opts.socket_dir.display().to_string().replace('\'', "''");
        let mut s = format!(
            "# Written by better-compute at every start; edits are overwritten.\n\
             listen_addresses = ''\n\
             unix_socket_directories = '{sock}'\n\
             unix_socket_permissions = 0700\n\
             max_connections = {}\n\
             shared_buffers = 128MB\n\
             log_min_messages = warning\n\
             log_min_error_statement = panic\n\
             log_line_prefix = '%m [%p] %q%u@%d '\n",
            self.opts.max_connections
        );
        if !self.opts.durable {
            // Throwaway test clusters: nothing survives a crash of the machine, but synchronous_commit
            // stays on, so a commit is written to the kernel before it is acknowledged and a crash of
            // the server alone (the simulator's postgres-crash) loses no acknowledged commit. Commit
            // timestamps on, so invariant checks can order commits (pg_xact_commit_timestamp).
            s.push_str("fsync = off\nfull_page_writes = off\ntrack_commit_timestamp = on\n");
        }
        let path = self.opts.data_dir.join("better_compute.conf");
        std::fs::write(&path, s).map_err(io_err("write", &path))?;
        if let Some(r) = self.run_as {
            std::os::unix::fs::chown(&path, Some(r.uid), Some(r.gid)).map_err(io_err("chown", &path))?;
        }
        Ok(())
    }

    /// Whether a server is running on this data folder (`pg_ctl status`).
    pub fn is_running(&self) -> bool {
        self.is_initialized()
            && self.run("pg_ctl", &["status".as_ref(), "-D".as_ref(), self.opts.data_dir.as_os_str()])
                .map(|o| o.status.success())
                .unwrap_or(false)
    }

    /// The postmaster's pid, from `postmaster.pid`.
    pub fn postmaster_pid(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.opts.data_dir.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// The server's log (`pg_ctl -l`); each line of a session names its user and database.
    pub fn server_log_path(&self) -> std::path::PathBuf {
        self.opts.data_dir.join("server.log")
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) -> Result<(), LaunchError> {
        self.private_dir(&self.opts.socket_dir)?;
        self.write_settings()?;
        let log = self.server_log_path();
        self.run_ok(
            "pg_ctl",
            &[
                "start".as_ref(), "-w".as_ref(), "-t".as_ref(), "120".as_ref(), "-D".as_ref(),
                self.opts.data_dir.as_os_str(), "-l".as_ref(), log.as_os_str(),
            ],
        )?;
        Ok(())
    }

    /// Stops the server cleanly (`pg_ctl stop -m fast`: running transactions roll back, then a
    /// checkpoint), and waits until it is gone.
    pub fn stop(&self) -> Result<(), LaunchError> {
        if !self.is_running() {
            return Ok(());
        }
        self.run_ok(
            "pg_ctl",
            &["stop".as_ref(), "-w".as_ref(), "-t".as_ref(), "120".as_ref(), "-m".as_ref(), "fast".as_ref(),
              "-D".as_ref(), self.opts.data_dir.as_os_str()],
        )?;
        Ok(())
    }
}

impl Cluster {
    /// Crashes the server (`pg_ctl stop -m immediate`: every connection dropped, no checkpoint, as
    /// a power cut of the database alone) and starts it again, which replays the WAL. Transactions
    /// that were committing when it went down are in doubt to their clients.
    pub fn crash_and_restart(&self) -> Result<(), LaunchError> {
        self.run_ok(
            "pg_ctl",
            &["stop".as_ref(), "-w".as_ref(), "-t".as_ref(), "120".as_ref(), "-m".as_ref(), "immediate".as_ref(),
              "-D".as_ref(), self.opts.data_dir.as_os_str()],
        )?;
        self.start()
    }
}

/// An exclusive, process-lifetime lock on a file (flock): held until dropped or the process dies,
/// so a crashed holder never leaves it stuck.
#[derive(Debug)]
pub struct FileLock {
    file: std::fs::File,
}

impl FileLock {
    /// Takes the lock without waiting; when another process holds it, `InUse` with the pid it wrote.
    pub fn try_acquire(path: &Path, guarded: &Path) -> Result<FileLock, LaunchError> {
        use std::io::{Seek, Write};
        use std::os::fd::AsRawFd;
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err("open", path))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let pid = std::fs::read_to_string(path).unwrap_or_default().trim().to_owned();
            return Err(LaunchError::InUse {
                path: guarded.display().to_string(),
                pid: if pid.is_empty() { "unknown".into() } else { pid },
            });
        }
        file.set_len(0).map_err(io_err("truncate", path))?;
        file.rewind().map_err(io_err("rewind", path))?;
        writeln!(file, "{}", std::process::id()).map_err(io_err("write", path))?;
        Ok(FileLock { file })
    }

    /// Waits for the lock.
    pub fn acquire_blocking(path: &Path) -> Result<FileLock, LaunchError> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err("open", path))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io_err("lock", path)(std::io::Error::last_os_error()));
        }
        Ok(FileLock { file })
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking a descriptor we own; closing it would unlock too.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}
