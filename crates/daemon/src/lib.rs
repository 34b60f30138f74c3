//! The node daemon. It joins with a join token (a CSR signed by the control plane's CA), then holds
//! one mTLS gRPC session at a time to a gateway: it converges the node on its NodeSpec and runs
//! one-shot commands, with a journal on local disk so that nothing runs twice that must not. It
//! never talks to the database.

pub mod agent;
pub mod backend;
pub mod converge;
pub mod fake;
pub mod hypervisor;
pub mod identity;
pub mod images;
pub mod instances;
pub mod journal;
pub mod logs;
pub mod nvml;
pub mod qemu;
pub mod sim;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use better_compute_proto::v1::{daemon_message, DaemonMessage, Inventory};

pub use agent::Daemon;

/// What the daemon runs for `node.reboot`.
#[derive(Clone, Default)]
pub enum RebootHook {
    /// Refuses: the command fails and says how to enable it. The default.
    #[default]
    Disabled,
    /// Runs this program with arguments (`systemctl reboot` only when explicitly enabled).
    Command(Vec<String>),
    /// Calls back (tests and the simulator restart the daemon with a new boot id).
    Callback(Arc<dyn Fn(&str) + Send + Sync>),
}

impl std::fmt::Debug for RebootHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RebootHook::Disabled => f.write_str("Disabled"),
            RebootHook::Command(c) => write!(f, "Command({c:?})"),
            RebootHook::Callback(_) => f.write_str("Callback"),
        }
    }
}

/// The host's own resources, reported with the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostResources {
    /// vCPUs.
    pub vcpu: u32,
    /// Memory.
    pub memory_mib: u64,
    /// Disk.
    pub disk_gib: u64,
}

impl HostResources {
    /// This machine's: CPUs, `/proc/meminfo`'s MemTotal, and the free-plus-used size of `/`.
    pub fn of_this_machine() -> HostResources {
        let vcpu = std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(1);
        let memory_mib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| m.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
            .map(|kb| kb / 1024)
            .unwrap_or(0);
        HostResources { vcpu, memory_mib, disk_gib: 0 }
    }

    /// Fills an inventory's host fields.
    pub fn fill(&self, inv: &mut Inventory) {
        inv.vcpu = self.vcpu;
        inv.memory_mib = self.memory_mib;
        inv.disk_gib = self.disk_gib;
    }
}

/// How a daemon runs.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// `https://host:port` of a gateway (or a load balancer in front of several).
    pub gateway_url: String,
    /// The name the gateway's certificate is checked against.
    pub server_name: String,
    /// Where the identity and the journal live.
    pub state_dir: PathBuf,
    /// The node's name in its pool.
    pub node_name: String,
    /// Labels reservations select on, sent at join.
    pub labels: BTreeMap<String, String>,
    /// A join token, needed only until the node has joined.
    pub join_token: Option<String>,
    /// The control plane's CA (PEM), needed to join.
    pub ca_pem: Option<String>,
    /// The machine's boot id (the kernel's on a real node).
    pub boot_id: String,
    /// The host's vCPU, memory and disk.
    pub host: HostResources,
    /// What `node.reboot` does.
    pub reboot: RebootHook,
    /// Back-off after a failed session: from this…
    pub backoff_min: Duration,
    /// …doubling up to this, with jitter.
    pub backoff_max: Duration,
    /// Test only, never in production: a deliberately broken daemon that runs a command again
    /// although its journal says an earlier run of it was interrupted and it is not retry-safe.
    /// `better-compute sim --broken rerun-journaled-commands` uses it to prove the checker
    /// catches a command that ran twice. It takes effect only in test builds (feature
    /// `fault-injection`); elsewhere the journal is always honoured.
    pub broken_rerun_journaled_commands: bool,
    /// What runs instances as VMs on a vps-host node (none: the node runs no instances, and says
    /// so in the `instances` section's status).
    pub hypervisor: Option<Arc<dyn hypervisor::Hypervisor>>,
}

/// Whether this build carries the deliberately broken variants (feature `fault-injection`, test
/// builds only): without it [`DaemonConfig::broken_rerun_journaled_commands`] does nothing.
pub const FAULT_INJECTION: bool = cfg!(feature = "fault-injection");

impl DaemonConfig {
    /// Defaults for a node named `node_name` keeping its state in `state_dir`.
    pub fn new(gateway_url: impl Into<String>, state_dir: impl Into<PathBuf>, node_name: impl Into<String>) -> DaemonConfig {
        DaemonConfig {
            gateway_url: gateway_url.into(),
            server_name: "localhost".into(),
            state_dir: state_dir.into(),
            node_name: node_name.into(),
            labels: BTreeMap::new(),
            join_token: None,
            ca_pem: None,
            boot_id: kernel_boot_id().unwrap_or_else(|| "unknown-boot".into()),
            host: HostResources::of_this_machine(),
            reboot: RebootHook::Disabled,
            backoff_min: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            broken_rerun_journaled_commands: false,
            hypervisor: None,
        }
    }
}

/// The kernel's boot id.
pub fn kernel_boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|s| s.trim().to_owned())
}

/// Why the daemon could not do something.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A setting or a local file.
    #[error("{0}")]
    Config(String),
    /// The journal.
    #[error("{0}")]
    Journal(String),
    /// The GPU backend.
    #[error("{0}")]
    Backend(String),
    /// Reaching the gateway.
    #[error("{0}")]
    Transport(String),
    /// The gateway said no.
    #[error("refused by the gateway: {0}")]
    Refused(String),
}

/// A daemon-to-gateway message.
pub(crate) fn daemon_msg(m: daemon_message::Msg) -> DaemonMessage {
    DaemonMessage { msg: Some(m) }
}
