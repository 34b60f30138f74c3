//! `capacity.usage`: one key per pool. Each run closes the usage windows of up to
//! [`RESERVATIONS_PER_RUN`] of the pool's reservations (`capacity_usage_close`, `src/sql/usage.sql`)
//! and writes each row's `usage.window` event in the same transaction, then arms the pool's key for
//! the end of the current window. A window is written once (its id is the billing key
//! `cmp:<allocationId>:<windowStart>`); a late change adds an adjustment row.

use std::time::Duration;

use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};


/// `capacity.usage`: one key per pool, closing its reservations' usage windows.
pub const USAGE_KIND: Kind = Kind { name: "capacity.usage", shard_by: ShardBy::Pool };

/// Reservations one run meters (one transaction): the rest go in the next run, at once.
pub const RESERVATIONS_PER_RUN: i32 = 256;

/// `capacity.usage`, keyed by pool.
pub struct UsageJob;

#[async_trait::async_trait]
impl Reconciler for UsageJob {
    fn kind(&self) -> Kind {
        USAGE_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, pool: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let written = crate::usage::close_windows(ctx, &tx, "capacity_usage_close", pool, RESERVATIONS_PER_RUN, "usage.window").await?;
        // Whether more are due now (more than a run takes, or some locked), and when the current
        // window closes.
        let r = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM reservations r WHERE r.pool_id = $1 AND capacity_usage_is_due(r, capacity_usage_closed_until())),
                        (s.window_s - mod(extract(epoch FROM compute_now()), s.window_s))::float8
                   FROM usage_settings s",
                &[&pool],
            )
            .await?;
        let (more, next_s): (bool, f64) = (r.get(0), r.get(1));
        work_queue::enqueue_after(&*tx, &USAGE_KIND, pool, Duration::from_secs_f64(next_s.max(0.0) + 1.0)).await?;
        tx.commit().await?;
        ctx.count("usage windows written", written);
        Ok(if more { Outcome::SyncAgain } else { Outcome::Done })
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // Every pool with reservations that held or hold atoms: a pool's key arms itself for each
        // window's end, and the resync starts the pools that had none.
        let c = ctx.read().await?;
        let rows = c.query("SELECT DISTINCT p.id FROM pools p WHERE EXISTS (SELECT 1 FROM reservations r WHERE r.pool_id = p.id AND r.state <> 'pending')", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|p| shards.contains(&USAGE_KIND.shard_of(p))).collect())
    }
}
