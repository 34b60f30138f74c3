//! What `better-compute sim` runs and breaks: server processes (gateways, workers) that a fault
//! kills with a real SIGKILL or pauses with SIGSTOP, TCP proxies between the daemons and their
//! gateway that a partition cuts, and simulated nodes (real daemons with fake GPUs, in this process)
//! that a fault crashes with the same journal, a wiped journal or a new boot id.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
pub use crate::fleet::Crash;
use crate::fleet::supervise;
use better_compute_daemon::{Daemon, DaemonConfig, HostResources, RebootHook};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

/// How long a server process may take to say it is up.
const READY_TIMEOUT_S: u64 = 60;

/// One process of this binary: a server (`better-compute server --roles <role>`) or a daemon.
pub struct ServerProc {
    /// `api`, `gateway`, `worker` or `daemon`.
    pub role: &'static str,
    /// Which of its role.
    pub index: usize,
    child: Option<Child>,
    env: Vec<(String, String)>,
    /// Everything after the binary's name.
    args: Vec<String>,
    /// The start of the line it prints once it is up.
    ready: &'static str,
    log: PathBuf,
    /// For a gateway: where it listens now (a restart picks a new port; its proxy follows).
    pub addr: Option<SocketAddr>,
    /// Stopped with SIGSTOP.
    pub paused: bool,
}

impl ServerProc {
    /// Starts `better-compute server --roles <role>` with `args`, logging to `<dir>/<role>-<index>.log`.
    pub async fn start(role: &'static str, index: usize, args: Vec<String>, env: Vec<(String, String)>, dir: &Path) -> anyhow::Result<ServerProc> {
        let args = ["server", "--roles", role].into_iter().map(str::to_owned).chain(args).collect();
        Self::start_as(role, index, args, "Ctrl-C stops it", env, dir).await
    }

    /// Starts `better-compute daemon` with `args`, logging to `<dir>/daemon-<index>.log`; up once it
    /// has joined (or found its identity) and says it connects.
    pub async fn start_daemon(index: usize, args: Vec<String>, env: Vec<(String, String)>, dir: &Path) -> anyhow::Result<ServerProc> {
        let args = std::iter::once("daemon".to_owned()).chain(args).collect();
        Self::start_as("daemon", index, args, "node ", env, dir).await
    }

    async fn start_as(role: &'static str, index: usize, args: Vec<String>, ready: &'static str, env: Vec<(String, String)>, dir: &Path) -> anyhow::Result<ServerProc> {
        let mut p = ServerProc { role, index, child: None, env, args, ready, log: dir.join(format!("{role}-{index}.log")), addr: None, paused: false };
        p.spawn().await?;
        Ok(p)
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    /// Where it logs.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// SIGTERM, then up to `grace` for it to stop cleanly, then SIGKILL.
    pub async fn stop(&mut self, grace: Duration) {
        if let Some(mut c) = self.child.take() {
            self.paused = false;
            if let Some(pid) = c.id() {
                // SAFETY: signals to our own child.
                unsafe {
                    libc::kill(pid as i32, libc::SIGCONT);
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
            if tokio::time::timeout(grace, c.wait()).await.is_err() {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let exe = std::env::current_exe()?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut cmd = Command::new(exe);
        cmd.args(&self.args).envs(self.env.iter().cloned());
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(log).kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe; the server dies with the simulator.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("start a server process")?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let ready = async {
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.split(" listening on ").nth(1) {
                    let url = rest.split_whitespace().next().unwrap_or_default();
                    self.addr = Some(url.trim_start_matches("https://").trim_start_matches("http://").parse()?);
                }
                if line.starts_with(self.ready) {
                    return Ok::<_, anyhow::Error>(());
                }
            }
            anyhow::bail!("{} {} exited while starting; see {}", self.role, self.index, self.log.display())
        };
        tokio::time::timeout(Duration::from_secs(READY_TIMEOUT_S), ready)
            .await
            .with_context(|| format!("{} {} did not start in {READY_TIMEOUT_S} s; see {}", self.role, self.index, self.log.display()))??;
        // Keep draining its stdout so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        self.child = Some(child);
        self.paused = false;
        Ok(())
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.child.as_ref().and_then(|c| c.id()) {
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(pid as i32, sig) };
        }
    }

    /// SIGKILL, and reaps it.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            self.signal(libc::SIGCONT);
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
        self.paused = false;
    }

    /// Starts it again after a kill (or an exit of its own).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill().await;
        self.spawn().await
    }

    /// SIGSTOP: a process that stops running without knowing it (a long GC pause, a frozen VM).
    pub fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
        self.paused = true;
    }

    /// SIGCONT: the zombie wakes up.
    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
        self.paused = false;
    }

    /// Whether it exited on its own (then the supervisor restarts it, as systemd would).
    pub fn exited(&mut self) -> bool {
        self.exit_status().is_some()
    }

    /// How it ended, if it did (`None` while it runs); after a kill, there is no status to tell.
    pub fn exit_status(&mut self) -> Option<String> {
        match self.child.as_mut() {
            Some(c) => match c.try_wait() {
                Ok(Some(status)) => Some(status.to_string()),
                Ok(None) => None,
                Err(e) => Some(e.to_string()),
            },
            None => Some("not running".into()),
        }
    }
}

/// A TCP proxy between daemons and one gateway; a partition closes every stream through it and
/// refuses new ones until it heals.
pub struct Proxy {
    /// Where daemons connect.
    pub addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    cut: watch::Sender<bool>,
}

impl Proxy {
    /// Listens on a free local port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let target = Arc::new(Mutex::new(target));
        let (cut, cut_rx) = watch::channel(false);
        let t = target.clone();
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    continue; // dropped: the daemon sees a reset
                }
                let to = *t.lock().expect("target");
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(to).await else { return };
                    let (mut a, mut b) = (inbound, outbound);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut a, &mut b) => {}
                        _ = cut_rx.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Ok(Proxy { addr, target, cut })
    }

    /// Points it at a restarted gateway.
    pub fn retarget(&self, to: SocketAddr) {
        *self.target.lock().expect("target") = to;
    }

    /// Cuts (true) or heals (false) the link.
    pub fn set_cut(&self, cut: bool) {
        let _ = self.cut.send(cut);
    }
}

/// Every `node.reboot` a daemon started, by the command's reason (unique per command): a
/// command that is not retry-safe must appear at most once.
pub type RebootLog = Arc<Mutex<HashMap<String, u32>>>;

/// One simulated node.
pub struct SimNode {
    /// Its node id.
    pub node_id: String,
    crash: mpsc::Sender<Crash>,
    gpus: Arc<better_compute_daemon::fake::FakeGpus>,
}

impl SimNode {
    /// Its GPU at `index` throws `xid`, as the driver would report it.
    pub fn inject_xid(&self, index: usize, xid: u32) {
        self.gpus.inject_xid(index, xid);
    }

    /// An uncorrectable memory error on one of its GPUs: a row remap that waits for a reset, or
    /// (`failed`) one that failed. The next health report carries it.
    pub fn inject_memory_error(&self, index: usize, failed: bool) {
        self.gpus.inject_memory_error(index, failed);
    }

    /// Crashes its daemon; it comes back on its own.
    pub fn crash(&self, how: Crash) {
        let _ = self.crash.try_send(how);
    }
}

/// Settings every simulated node shares.
pub struct NodeSetup {
    /// The CA certificate the daemons trust.
    pub ca_pem: String,
    /// Where reboots are recorded.
    pub reboots: RebootLog,
    /// Percent of reboots where the daemon dies after starting the reboot but the machine does not
    /// go down: the daemon restarts with the same journal and boot id, and the gateway sends the
    /// in-flight reboot again.
    pub reboot_crash_percent: u64,
    /// Test only: the broken daemon (see [`DaemonConfig::broken_rerun_journaled_commands`]).
    pub broken_rerun_journaled_commands: bool,
    /// Test only: hosts whose fake hypervisor never deletes a VM.
    pub broken_keep_deleted_vms: bool,
}

/// Starts node `name` with its state in `dir`, joining with `join_token` through `gateway_url`.
pub async fn start_node(
    name: String,
    dir: PathBuf,
    gateway_url: String,
    join_token: String,
    setup: &NodeSetup,
    seed: u64,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<SimNode> {
    let mut cfg = DaemonConfig::new(gateway_url, &dir, &name);
    cfg.ca_pem = Some(setup.ca_pem.clone());
    cfg.host = HostResources { vcpu: 96, memory_mib: 1_048_576, disk_gib: 7_000 };
    cfg.boot_id = format!("{name}-boot-1");
    cfg.join_token = Some(join_token);
    cfg.backoff_min = Duration::from_millis(200);
    cfg.backoff_max = Duration::from_secs(3);
    cfg.broken_rerun_journaled_commands = setup.broken_rerun_journaled_commands;
    // Fake VMs, kept in the node's folder so they outlive a daemon crash as real ones would.
    let vms = Some(dir.join("fake-vms.tsv"));
    cfg.hypervisor = Some(Arc::new(if setup.broken_keep_deleted_vms {
        better_compute_daemon::hypervisor::FakeHypervisor::leaking(vms)
    } else {
        better_compute_daemon::hypervisor::FakeHypervisor::new(vms)
    }));
    let (crash_tx, crash_rx) = mpsc::channel(4);
    let reboots = setup.reboots.clone();
    let crash_on_reboot = crash_tx.clone();
    let percent = setup.reboot_crash_percent;
    cfg.reboot = RebootHook::Callback(Arc::new(move |reason: &str| {
        *reboots.lock().expect("reboots").entry(reason.to_owned()).or_default() += 1;
        // Decided by the command (its reason names the seed and the operation), so a replay agrees.
        let h = reason.bytes().fold(seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        let how = if h % 100 < percent { Crash::Restart } else { Crash::Reboot };
        let _ = crash_on_reboot.try_send(how);
    }));
    let gpus = Arc::new(better_compute_daemon::fake::FakeGpus::parse("fake:8xH100-80GB", &name)?);
    let backend: Arc<dyn better_compute_daemon::backend::GpuBackend> = gpus.clone();
    let d = Daemon::start(cfg.clone(), backend.clone()).await.with_context(|| format!("{name} could not start"))?;
    let node_id = d.node_id();
    cfg.join_token = None;
    tokio::spawn(supervise(d, cfg, backend, crash_rx, format!("{name}-boot"), Duration::from_millis(300), shutdown));
    Ok(SimNode { node_id, crash: crash_tx, gpus })
}
