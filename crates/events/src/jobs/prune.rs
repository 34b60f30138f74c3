//! `events.prune`: removes outbox rows older than the retention that every sink's cursor has
//! passed (a row a cursor still needs is never removed), and finished deliveries (delivered or
//! dead) older than the retention. Watch streams resume only within the retention.

use std::time::Duration;

use better_compute_runtime::{Kind, Outcome, Periodic, ReconcileContext, Reconciler, RunError, ShardBy};

/// The pruner's kind: one singleton key, `all`.
pub const PRUNE: Kind = Kind { name: "events.prune", shard_by: ShardBy::None };
/// Rows removed per statement; a full batch runs again.
const BATCH: i64 = 10_000;

/// The pruner.
pub struct Pruner {
    /// How long events and finished deliveries are kept.
    pub retention: Duration,
}

const PERIODIC: &[Periodic] = &[Periodic { key: "all", every: Duration::from_secs(600) }];

/// Removes up to [`BATCH`] prunable outbox rows and finished deliveries; returns how many of each.
pub async fn prune(tx: &impl tokio_postgres::GenericClient, retention: Duration) -> Result<(u64, u64), tokio_postgres::Error> {
    let secs = retention.as_secs_f64();
    let events = better_compute_runtime::outbox::prune(tx, retention, BATCH).await?;
    let deliveries = tx
        .execute(
            "DELETE FROM webhook_deliveries WHERE id IN (
               SELECT id FROM webhook_deliveries
                WHERE state <> 'pending' AND finished_at < compute_now() - make_interval(secs => $1) LIMIT $2)",
            &[&secs, &BATCH],
        )
        .await?;
    Ok((events, deliveries))
}

#[async_trait::async_trait]
impl Reconciler for Pruner {
    fn kind(&self) -> Kind {
        PRUNE
    }

    fn periodic(&self) -> &[Periodic] {
        PERIODIC
    }

    async fn run(&self, ctx: &ReconcileContext, _key: &str) -> Result<Outcome, RunError> {
        let (events, deliveries) = ctx.in_fenced_tx(async |tx| Ok(prune(tx, self.retention).await?)).await?;
        ctx.count("events pruned", events);
        ctx.count("deliveries pruned", deliveries);
        if events + deliveries > 0 {
            tracing::info!(events, deliveries, "pruned");
        }
        Ok(if events as i64 == BATCH || deliveries as i64 == BATCH { Outcome::SyncAgain } else { Outcome::Done })
    }
}
