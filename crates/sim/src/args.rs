//! The simulator's command line: `better-compute sim`'s options, the faults it injects and the
//! deliberately broken variants its tests prove the checks catch.

use std::time::Duration;

/// Options of `better-compute sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Seeds to run, one after another: `7`, or a range such as `1-100`.
    #[arg(long, default_value = "1")]
    pub(crate) seeds: String,
    /// How long each seed runs with faults (`90s`, `10m`); then faults stop and the fleet must heal.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Simulated nodes: real daemons with fake GPUs (8 x H100-80GB each), in this process.
    #[arg(long, default_value_t = 8)]
    pub(crate) nodes: usize,
    /// Gateway processes; the nodes are spread over them.
    #[arg(long, default_value_t = 2)]
    pub(crate) gateways: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    pub(crate) workers: usize,
    /// Seconds in a fault interval: at most one fault starts in each, and heals within it, so the
    /// fleet can stay live.
    #[arg(long, default_value_t = 8)]
    pub(crate) fault_interval_s: u64,
    /// Workload operations per second, over all its clients.
    #[arg(long, default_value_t = 40)]
    pub(crate) ops_per_s: u64,
    /// Concurrent workload clients, each with its own connection and its own seeded operations.
    /// Their reservations go through one reservations service, as the API's do, so concurrent
    /// creates and releases are done in batches.
    #[arg(long, default_value_t = 8)]
    pub(crate) clients: u64,
    /// Send every server connection (and the workload's) through PgBouncer in transaction pooling
    /// mode (Debian's `pgbouncer`); LISTEN goes straight to PostgreSQL.
    #[arg(long)]
    pub(crate) pgbouncer: bool,
    /// Also check liveness: no node stays away for more than two fault intervals, and some command
    /// reaches an end in every interval.
    #[arg(long)]
    pub(crate) liveness: bool,
    /// Seconds the fleet has after the last fault to converge (every node's observedGeneration at
    /// its generation, no due work left, every sink caught up).
    #[arg(long, default_value_t = 120)]
    pub(crate) heal_timeout_s: u64,
    /// Percent of reboots where the daemon dies mid-reboot and comes back with the same journal and
    /// boot id, so the gateway sends the in-flight reboot again.
    #[arg(long, default_value_t = 50)]
    pub(crate) reboot_crash_percent: u64,
    /// Inject only these faults (comma-separated); all of them when not given.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub(crate) faults: Vec<Fault>,
    /// Test only: run a deliberately broken variant, to prove the checker catches it.
    #[arg(long, hide = true, value_enum)]
    pub(crate) broken: Option<Broken>,
}

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// SIGKILL a gateway and restart it.
    GatewayKill,
    /// SIGKILL a worker and restart it.
    WorkerKill,
    /// Crash a daemon: same journal, wiped journal, or a new boot id.
    DaemonCrash,
    /// Cut the streams between a gateway and its daemons for a while.
    Partition,
    /// Crash PostgreSQL under load and start it again.
    PostgresCrash,
    /// Jump the simulated clock 5 to 45 s.
    ClockJump,
    /// Pause a worker past its leases until others take them over, then let it wake up.
    Zombie,
    /// A GPU throws an XID (informational, transient or fatal), or has an uncorrectable memory
    /// error whose row remap waits for a reset or failed.
    GpuXid,
    /// Every daemon loses its gateway until the site counts as down, then all come back at once
    /// through the site boot. Only with `--faults`: it takes longer than an interval.
    SiteOutage,
}

/// Deliberately broken variants (test only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Broken {
    /// Daemons run a not-retry-safe command again after a restart, ignoring their journal.
    RerunJournaledCommands,
    /// Workers skip the lease fence of their transactions (`BETTER_COMPUTE_TEST_BROKEN_FENCE`).
    SkipFence,
    /// The hosts' fake hypervisor never deletes a VM: deleted instances leak.
    KeepDeletedVms,
    /// The workload's cordons and uncordons commit without their audit entry.
    UnauditedCordons,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration; write it like 90s, 10m or 1h");
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| bad())?;
    Ok(Duration::from_secs(match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(bad()),
    }))
}

pub(crate) fn parse_seeds(s: &str) -> anyhow::Result<std::ops::RangeInclusive<u64>> {
    let bad = || anyhow::anyhow!("--seeds {s:?}: give a seed (7) or a range (1-100)");
    let (a, b) = s.split_once('-').unwrap_or((s, s));
    let (a, b): (u64, u64) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a > b {
        return Err(bad());
    }
    Ok(a..=b)
}

/// The `--broken` part of a replay command.
pub(crate) fn replay_tail(args: &SimArgs) -> String {
    args.broken.map(|b| format!(" --broken {}", value_names(&[b])[0])).unwrap_or_default()
}

/// Values as they are written on the command line.
pub(crate) fn value_names<T: clap::ValueEnum>(vs: &[T]) -> Vec<String> {
    vs.iter().filter_map(|v| v.to_possible_value()).map(|p| p.get_name().to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_seed_ranges_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("ten").unwrap_err().contains("like 90s"));
        assert_eq!(parse_seeds("3").unwrap(), 3..=3);
        assert_eq!(parse_seeds("1-100").unwrap(), 1..=100);
        assert!(parse_seeds("9-1").is_err());
    }
}
