//! `better-compute daemon`: the node agent.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use better_compute_daemon::{Daemon, DaemonConfig, HostResources, RebootHook};

/// Options of `better-compute daemon`.
#[derive(Debug, clap::Args)]
pub struct DaemonArgs {
    /// The gateway (or a load balancer in front of gateways), https://host:port.
    #[arg(long, env = "BETTER_COMPUTE_GATEWAY_URL")]
    gateway: String,
    /// The name the gateway's certificate is checked against (default: the host of --gateway).
    #[arg(long)]
    server_name: Option<String>,
    /// A join token (`bcj_…`, from `api nodes.createJoinToken`); needed only on the first start.
    #[arg(long, env = "BETTER_COMPUTE_JOIN_TOKEN", hide_env_values = true)]
    join_token: Option<String>,
    /// The CA certificate (PEM) the gateway's certificate is checked against: `ca.pem` of the
    /// server's CA folder, or the issuer of an operator's gateway certificate. Needed to join;
    /// after that trusted beside the fleet's CA pinned at join.
    #[arg(long)]
    ca_cert: Option<PathBuf>,
    /// Where the node's key, certificate and journal live.
    #[arg(long, default_value = "/var/lib/better-compute-daemon")]
    state_dir: PathBuf,
    /// The node's name in its pool (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// A label, key=value; repeat for more. Sent when joining.
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// The GPU backend: `nvml` for real GPUs, or fake GPUs such as `fake:8xH100-80GB`.
    #[arg(long, default_value = "nvml")]
    gpus: String,
    /// What runs instances on a vps-host node: `qemu` (QEMU/KVM), `fake` (no VMs, for tests and
    /// demos), or `none` (the node runs no instances).
    #[arg(long, default_value = "none", value_parser = ["none", "fake", "qemu"])]
    hypervisor: String,
    /// Report this many vCPUs instead of this machine's.
    #[arg(long)]
    vcpu: Option<u32>,
    /// Report this much memory instead of this machine's.
    #[arg(long)]
    memory_mib: Option<u64>,
    /// Disk to offer to reservations.
    #[arg(long, default_value_t = 0)]
    disk_gib: u64,
    /// What node.reboot runs, e.g. "/usr/local/sbin/drain-and-reboot". Without this or
    /// --allow-systemctl-reboot, node.reboot fails and says so.
    #[arg(long)]
    reboot_command: Option<String>,
    /// Let node.reboot run `systemctl reboot`.
    #[arg(long, conflicts_with = "reboot_command")]
    allow_systemctl_reboot: bool,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())).ok_or_else(|| format!("label {s:?} is not key=value"))
}

/// The host of the gateway's URL, as its certificate names it (`[::1]` as `::1`).
fn gateway_host(gateway: &str) -> anyhow::Result<String> {
    let url = url::Url::parse(gateway).with_context(|| format!("--gateway {gateway:?} is not a URL; write it like https://gw.example:8443"))?;
    let host = url.host_str().with_context(|| format!("--gateway {gateway:?} names no host"))?;
    Ok(host.trim_start_matches('[').trim_end_matches(']').to_owned())
}

/// Runs the daemon until Ctrl-C or SIGTERM.
pub async fn run(args: DaemonArgs) -> anyhow::Result<()> {
    let name = match args.node_name {
        Some(n) => n,
        None => std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "node".into()),
    };
    let server_name = match args.server_name {
        Some(n) => n,
        None => gateway_host(&args.gateway)?,
    };
    let mut cfg = DaemonConfig::new(args.gateway, &args.state_dir, &name);
    cfg.server_name = server_name;
    cfg.join_token = args.join_token;
    cfg.ca_pem = match args.ca_cert {
        Some(p) => Some(std::fs::read_to_string(&p).with_context(|| format!("cannot read the CA certificate {}", p.display()))?),
        None => None,
    };
    cfg.labels = args.labels.into_iter().collect();
    let machine = HostResources::of_this_machine();
    cfg.host = HostResources { vcpu: args.vcpu.unwrap_or(machine.vcpu), memory_mib: args.memory_mib.unwrap_or(machine.memory_mib), disk_gib: args.disk_gib };
    cfg.reboot = if args.allow_systemctl_reboot {
        RebootHook::Command(vec!["systemctl".into(), "reboot".into()])
    } else if let Some(c) = args.reboot_command {
        RebootHook::Command(c.split_whitespace().map(str::to_owned).collect())
    } else {
        RebootHook::Disabled
    };
    cfg.hypervisor = better_compute_daemon::hypervisor::open(&args.hypervisor, &args.state_dir)?;
    let backend = better_compute_daemon::backend::open(&args.gpus, &name)?;
    let daemon = Daemon::start(cfg, backend).await.context("the daemon could not start")?;
    println!("node {} (journal {}) connecting…", daemon.node_id(), daemon.journal_id());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(daemon.run(stopped));
    let signal = better_compute_server::shutdown_signal().await?;
    println!("received {signal}; stopping");
    stop.send(true)?;
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_server_name_defaults_to_the_gateways_host() {
        assert_eq!(super::gateway_host("https://gw1.example:8443").unwrap(), "gw1.example");
        assert_eq!(super::gateway_host("https://127.0.0.1:8443").unwrap(), "127.0.0.1");
        assert_eq!(super::gateway_host("https://[::1]:8443").unwrap(), "::1");
        assert!(super::gateway_host("gw1.example:8443").is_err(), "no scheme: no host");
    }
}
