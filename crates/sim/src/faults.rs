//! The faults: at most one in each interval, healed before it ends, and the supervision that
//! restarts server processes that exited on their own.

use std::time::{Duration, Instant};

use anyhow::Context;
use better_compute_core::seeded::Rng;

use crate::args::Fault;
use crate::clock::advance_clock;
use crate::procs::Crash;
use crate::{Fleet, Sim};

impl Sim {
    /// Restarts server processes that exited on their own (as systemd would) and points proxies at
    /// restarted gateways.
    pub(crate) async fn supervise(&self, fleet: &mut Fleet) -> anyhow::Result<()> {
        for (i, g) in fleet.gateways.iter_mut().enumerate() {
            if g.exited() {
                self.count("gateway exited by itself", format!("(gateway {i})"));
                g.restart().await?;
                fleet.proxies[i].retarget(g.addr.context("the gateway printed no address")?);
            }
        }
        for w in fleet.workers.iter_mut() {
            if w.exited() {
                self.count("worker exited by itself", format!("(worker {})", w.index));
                w.restart().await?;
            }
        }
        Ok(())
    }

    pub(crate) fn count(&self, fault: &'static str, detail: String) {
        *self.tally.faults.lock().expect("faults").entry(fault).or_default() += 1;
        println!("  [{:>5.1} s] {fault} {detail}", self.started.elapsed().as_secs_f64());
    }

    /// At most one fault in this interval, healed before it ends.
    #[allow(clippy::too_many_lines, reason = "one arm per fault kind, each short, drawn from the seed in a fixed order")]
    pub(crate) async fn fault(&self, fleet: &mut Fleet, rng: &mut Rng, interval: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        let pause = |d: Duration| tokio::time::sleep(d);
        let at = Duration::from_millis(rng.below(interval.as_millis() as u64 / 3) + 200);
        pause(at).await;
        // Twelve slots: the eight kinds (daemon crashes and clock jumps take more than one) and a
        // quiet one. With --faults, every interval has one of the kinds given.
        let kind = if self.args.faults.is_empty() {
            rng.below(12)
        } else {
            match self.args.faults[rng.below(self.args.faults.len() as u64) as usize] {
                Fault::GatewayKill => 0,
                Fault::WorkerKill => 1,
                Fault::DaemonCrash => 2 + rng.below(3),
                Fault::Partition => 5,
                Fault::PostgresCrash => 6,
                Fault::ClockJump => 7,
                Fault::Zombie => 9,
                Fault::GpuXid => 10,
                Fault::SiteOutage => 12,
            }
        };
        match kind {
            0 => {
                let i = rng.below(fleet.gateways.len() as u64) as usize;
                self.count("gateway SIGKILL", format!("(gateway {i})"));
                fleet.gateways[i].kill().await;
                pause(Duration::from_millis(500 + rng.below(1500))).await;
                fleet.gateways[i].restart().await?;
                fleet.proxies[i].retarget(fleet.gateways[i].addr.context("no address")?);
            }
            1 => {
                let i = rng.below(fleet.workers.len() as u64) as usize;
                self.count("worker SIGKILL", format!("(worker {i})"));
                fleet.workers[i].kill().await;
                pause(Duration::from_millis(500 + rng.below(1500))).await;
                fleet.workers[i].restart().await?;
            }
            2..=4 => {
                let n = &fleet.nodes[rng.below(fleet.nodes.len() as u64) as usize];
                let how = match kind {
                    2 => Crash::Restart,
                    3 => Crash::WipedJournal,
                    _ => Crash::Reboot,
                };
                self.count(
                    match how {
                        Crash::Restart => "daemon crash (same journal)",
                        Crash::WipedJournal => "daemon crash (wiped journal)",
                        Crash::Reboot => "daemon crash (new boot id)",
                    },
                    format!("({})", n.node_id),
                );
                n.crash(how);
            }
            5 => {
                let i = rng.below(fleet.proxies.len() as u64) as usize;
                self.count("partition daemons | gateway", format!("(gateway {i})"));
                fleet.proxies[i].set_cut(true);
                pause(Duration::from_millis(1000 + rng.below(interval.as_millis() as u64 / 3))).await;
                fleet.proxies[i].set_cut(false);
            }
            6 => {
                self.count("PostgreSQL crash and restart", String::new());
                let c = self.cluster.clone();
                tokio::task::spawn_blocking(move || c.crash_and_restart()).await??;
            }
            7 | 8 => {
                let jump = Duration::from_secs(5 + rng.below(40));
                self.count("clock jump", format!("(+{} s)", jump.as_secs()));
                advance_clock(&self.direct_conn, jump).await;
            }
            9 => {
                // A worker stops without knowing; its leases expire (the clock jumps past their
                // 15 s), others take its shards (or wait for its open fenced transactions), and
                // then it wakes up as a zombie.
                let i = rng.below(fleet.workers.len() as u64) as usize;
                self.count("worker paused past its leases (zombie)", format!("(worker {i})"));
                fleet.workers[i].pause();
                advance_clock(&self.direct_conn, Duration::from_secs(20)).await;
                self.wait_for_takeover(Duration::from_secs(interval.as_secs() / 2)).await;
                pause(Duration::from_millis(200 + rng.below(800))).await;
                fleet.workers[i].resume();
            }
            10 => {
                let n = &fleet.nodes[rng.below(fleet.nodes.len() as u64) as usize];
                match rng.below(6) {
                    // A memory error whose row remap waits for a reset (or failed): the health
                    // job's counters, and a reset where the GPU is free.
                    5 => {
                        let failed = rng.below(4) == 0;
                        self.count("GPU memory error", format!("({} on {})", if failed { "remap failed" } else { "remap pending" }, n.node_id));
                        n.inject_memory_error(rng.below(8) as usize, failed);
                    }
                    _ => {
                        let xid = [13, 119, 62, 79][rng.below(4) as usize];
                        self.count("GPU XID", format!("(XID {xid} on {})", n.node_id));
                        n.inject_xid(rng.below(8) as usize, xid);
                    }
                }
            }
            12 => {
                // Every stream cut; simulated time moves past the 40 s after which a disconnected
                // node is unreachable, 10 s at a time so that the liveness job (every 5 s) does not take
                // them for an outage of its own; the site boot starts; then everything comes back
                // at once, paced by the boot.
                self.count("site-wide outage", format!("({} nodes)", fleet.nodes.len()));
                for p in &fleet.proxies {
                    p.set_cut(true);
                }
                for _ in 0..5 {
                    pause(Duration::from_secs(5)).await;
                    advance_clock(&self.direct_conn, Duration::from_secs(10)).await;
                }
                // The liveness job marks them unreachable and the site-boot job starts the boot
                // within a few seconds of each other; wait for it (bounded), then let them back.
                let booting = self.wait_for_site_boot(Duration::from_secs(30)).await;
                println!("  [{:>5.1} s] the site boot {}", self.started.elapsed().as_secs_f64(), if booting { "started" } else { "did not start within 30 s" });
                for p in &fleet.proxies {
                    p.set_cut(false);
                }
            }
            _ => {} // a quiet interval
        }
        if let Some(rest) = interval.checked_sub(start.elapsed()) {
            pause(rest).await;
        }
        Ok(())
    }

    /// Waits (at most `patience`) until a site boots; whether one did.
    pub(crate) async fn wait_for_site_boot(&self, patience: Duration) -> bool {
        let Ok(db) = better_compute_db::pool::connect(&self.direct_conn).await else { return false };
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            if let Ok(r) = db.query_one("SELECT count(*) FROM sites WHERE boot_state = 'booting'", &[]).await
                && r.get::<_, i64>(0) > 0
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        false
    }

    /// Waits (at most `patience`) until no worker lease is left expired: the awake workers took
    /// over what the paused one held.
    pub(crate) async fn wait_for_takeover(&self, patience: Duration) {
        let Ok(db) = better_compute_db::pool::connect(&self.direct_conn).await else { return };
        let deadline = Instant::now() + patience;
        while Instant::now() < deadline {
            let expired = db
                .query_one(
                    "SELECT count(*) FROM leases WHERE (name LIKE 'shard:%' OR name LIKE 'singleton:%') AND expires_at <= compute_now()",
                    &[],
                )
                .await
                .map(|r| r.get::<_, i64>(0));
            if matches!(expired, Ok(0)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
