//! `vps.usage`: one key per pool; closes its instances' usage windows ([`crate::usage`]).

use std::time::Duration;

use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::usage::*;

/// The job's kind: one key per pool.
pub const USAGE_KIND: Kind = Kind { name: "vps.usage", shard_by: ShardBy::Pool };

/// The `vps.usage` job.
pub struct UsageJob;

#[async_trait::async_trait]
impl Reconciler for UsageJob {
    fn kind(&self) -> Kind {
        USAGE_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, pool: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let written = better_compute_capacity::usage::close_windows(ctx, &tx, "vps_usage_close", pool, INSTANCES_PER_RUN, "instance.usageWindow").await?;
        // More due now (more than a run takes, or some locked)? And while a VM of the pool is up,
        // the current window's end.
        let r = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM instances i JOIN instance_runs r ON r.instance_id = i.id
                                 WHERE i.pool_id = $1 AND r.during && tstzrange(coalesce(i.usage_closed_until, '-infinity'), capacity_usage_closed_until())),
                        EXISTS (SELECT 1 FROM instances i JOIN instance_runs r ON r.instance_id = i.id
                                 WHERE i.pool_id = $1 AND upper_inf(r.during)),
                        (capacity_usage_window_s() - mod(extract(epoch FROM compute_now()), capacity_usage_window_s()))::float8",
                &[&pool],
            )
            .await?;
        let (more, up_now, next_s): (bool, bool, f64) = (r.get(0), r.get(1), r.get(2));
        if up_now {
            work_queue::enqueue_after(&*tx, &USAGE_KIND, pool, Duration::from_secs_f64(next_s.max(0.0) + 1.0)).await?;
        }
        tx.commit().await?;
        ctx.count("instance usage windows written", written);
        Ok(if more { Outcome::SyncAgain } else { Outcome::Done })
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // Every pool with an instance up now or up in time not metered yet.
        let c = ctx.read().await?;
        let rows = c
            .query(
                "SELECT DISTINCT i.pool_id FROM instances i JOIN instance_runs r ON r.instance_id = i.id
                  WHERE upper_inf(r.during) OR upper(r.during) > coalesce(i.usage_closed_until, '-infinity')",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|p| shards.contains(&USAGE_KIND.shard_of(p))).collect())
    }
}
