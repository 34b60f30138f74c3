//! `drain`: one key per pool with open drains; admits the pool's queued drains within its
//! disruption budget and brings the admitted ones to drained ([`crate::drain`]). Admission runs
//! alone under the pool's row; each drain's progress runs in a transaction of its own, since an
//! eviction takes reservations and quota, which come before pools in the lock order.

use std::time::Duration;

use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::drain::{admit, progress, DrainReport};

/// The job's kind: one key per pool.
pub const DRAIN_KIND: Kind = Kind { name: "drain", shard_by: ShardBy::Pool };

/// Admitted drains one run brings forward, each in its own transaction; more makes it run again.
const DRAINS_PER_RUN: usize = 32;

/// The drain job: admits each pool's drains within its budget and brings the admitted ones to
/// drained.
pub struct DrainJob;

#[async_trait::async_trait]
impl Reconciler for DrainJob {
    fn kind(&self) -> Kind {
        DRAIN_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, pool_id: &str) -> Result<Outcome, RunError> {
        let mut report = DrainReport::default();
        let mut c = ctx.client().await?;
        // Admission alone, under the pool's row: an eviction takes reservations and quota, which
        // come before pools in the lock order, so it runs in transactions of its own below.
        let tx = ctx.begin_fenced(&mut c).await?;
        admit(&*tx, pool_id, &mut report).await?;
        let draining: Vec<String> = tx
            .query("SELECT id FROM node_drains WHERE pool_id = $1 AND state = 'draining' ORDER BY id LIMIT $2", &[&pool_id, &(DRAINS_PER_RUN as i64 + 1)])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        tx.commit().await?;
        report.more = draining.len() > DRAINS_PER_RUN;
        let mut next: Option<f64> = None;
        for id in draining.iter().take(DRAINS_PER_RUN) {
            let tx = ctx.begin_fenced(&mut c).await?;
            if let Some(s) = progress(&tx, ctx.occupants(), id, &mut report).await? {
                next = Some(next.map_or(s, |n| n.min(s)));
            }
            if let Some(s) = next {
                work_queue::enqueue_after(&*tx, &DRAIN_KIND, pool_id, Duration::from_secs_f64(s)).await?;
            }
            tx.commit().await?;
        }
        ctx.count("drains admitted", report.admitted);
        ctx.count("drains waiting for budget", report.waiting);
        ctx.count("nodes drained", report.drained);
        ctx.count("evictions requested", report.eviction_requested);
        ctx.count("evicted", report.evicted);
        Ok(if report.more { Outcome::SyncAgain } else { Outcome::Done })
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let c = ctx.read().await?;
        let rows = c.query("SELECT DISTINCT pool_id FROM node_drains WHERE state IN ('queued', 'draining')", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|p| shards.contains(&DRAIN_KIND.shard_of(p))).collect())
    }
}
