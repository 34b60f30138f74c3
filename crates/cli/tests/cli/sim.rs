//! `better-compute sim` as CI runs it: a few seeds of the fault-injecting simulator (real gateway
//! and worker processes, real SIGKILL and SIGSTOP, PostgreSQL restarted under load) must pass;
//! one seed also runs through PgBouncer in transaction pooling mode; and a deliberately broken
//! daemon must be caught, which proves the checker can fail.

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_better-compute");

/// Runs the simulator with `args`; its own timeouts bound it (each seed's duration plus a heal
/// deadline), and nextest's slow-timeout bounds the test.
fn sim(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("sim")
        .args(args)
        .stdin(Stdio::null())
        .env("BETTER_COMPUTE_LOG", "warn")
        .output()
        .expect("run better-compute sim")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn two_seeds_of_faults_keep_every_invariant_and_the_fleet_converges_after() {
    let o = sim(&["--seeds", "1-2", "--duration", "32s", "--nodes", "6", "--heal-timeout-s", "150"]);
    let out = text(&o);
    assert!(o.status.success(), "the simulator found a violation:\n{out}");
    assert_eq!(out.matches(": passed in ").count(), 2, "both seeds ran to the end:\n{out}");
    // Faults really happened: every seed prints each one it injected.
    assert!(out.matches("] ").count() >= 4, "faults were injected:\n{out}");
    // The workload's creates and releases went through the batch placer the API uses.
    let batched: Vec<u64> = out
        .split(" creates and releases in batches")
        .filter_map(|before| before.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(batched.len(), 2, "each seed counts its batched creates and releases:\n{out}");
    assert!(batched.iter().all(|&n| n > 0), "every seed placed or released some in batches: {batched:?}\n{out}");
}

#[test]
fn a_seed_passes_through_pgbouncer_in_transaction_pooling_mode() {
    let o = sim(&["--seeds", "5", "--duration", "24s", "--nodes", "4", "--pgbouncer", "--heal-timeout-s", "150"]);
    let out = text(&o);
    assert!(o.status.success(), "the simulator found a violation behind PgBouncer:\n{out}");
    assert!(out.contains("through PgBouncer") && out.contains(": passed in "), "{out}");
}

#[test]
fn a_daemon_that_reruns_journaled_commands_is_caught_with_its_seed_and_a_replay_command() {
    // Every reboot crashes mid-command, and the broken daemon runs it again on restart.
    let o = sim(&[
        "--seeds", "7", "--duration", "30s", "--nodes", "4", "--reboot-crash-percent", "100",
        "--broken", "rerun-journaled-commands",
    ]);
    let out = text(&o);
    assert!(!o.status.success(), "the checker missed a command that ran twice:\n{out}");
    assert!(out.contains("seed 7:") && out.contains(" times"), "the violation names the seed and the rerun:\n{out}");
    assert!(out.contains("replay: better-compute sim --seeds 7 "), "a replay command is printed:\n{out}");
}

#[test]
fn a_worker_that_skips_its_lease_fence_is_caught_writing_under_a_stale_epoch() {
    // Only zombies: a worker paused until others took its leases wakes up and, with its fence
    // broken, writes under the epochs it lost; the audit of fenced writes must catch it. A zombie
    // writes only if the pause caught it inside a run, which is chance: with a fault every 8 s and
    // 10 operations a second, one seed of 64 s missed in one run of three on a loaded
    // machine, and once in CI. Twice the pauses and three times the work make a miss rare.
    let o = sim(&[
        "--seeds", "11", "--duration", "64s", "--nodes", "4", "--faults", "zombie", "--broken", "skip-fence",
        "--fault-interval-s", "4", "--ops-per-s", "30",
    ]);
    let out = text(&o);
    assert!(!o.status.success(), "the checker missed a zombie's writes:\n{out}");
    assert!(out.contains("stale-epoch write accepted"), "the violation says what was written under which epoch:\n{out}");
    assert!(out.contains("--faults zombie --broken skip-fence"), "the replay command keeps the switches:\n{out}");
}

#[test]
fn hosts_that_keep_deleted_vms_are_caught_leaking_them_after_the_heal() {
    // The broken fake hypervisor deletes nothing: every instance deleted during the run (its
    // tenant's, or its reservation's end) leaves its VM behind.
    // No database crash: one early in the run left too few placed reservations, and so too few
    // VMs on hosts to leak, for the seed to be sure to delete one.
    let o = sim(&[
        "--seeds", "8", "--duration", "24s", "--nodes", "3", "--faults", "partition,gateway-kill", "--broken", "keep-deleted-vms",
        "--heal-timeout-s", "45",
    ]);
    let out = text(&o);
    assert!(!o.status.success(), "the checker missed leaked VMs:\n{out}");
    // Its instances never reach deleted (their VMs stay), or reach it with the VM still there.
    let named = out.contains("leaked: its instance is") || out.contains("is deleting although its reservation");
    assert!(out.contains("seed 8:") && named, "the violation names the instance whose VM stayed:\n{out}");
}

#[test]
fn cordons_that_commit_without_their_audit_entry_are_caught_by_the_audit_check() {
    // The broken workload cordons and uncordons without recording them; at 30 operations a
    // second for 12 s, 3 of every 100 are cordons, so a run without one is out of the question.
    let o = sim(&["--seeds", "3", "--duration", "12s", "--nodes", "3", "--faults", "clock-jump", "--broken", "unaudited-cordons", "--ops-per-s", "30"]);
    let out = text(&o);
    assert!(!o.status.success(), "the checker missed changes without audit entries:\n{out}");
    let named = out.contains("nodes.cordon request req_sim") || out.contains("nodes.uncordon request req_sim");
    assert!(out.contains("seed 3:") && named && out.contains("(Committed) has 0 audit entries"), "the violation names the request:\n{out}");
}
