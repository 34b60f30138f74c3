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

/// The slowest sink's cursor, as `(txid as text, seq)`: no outbox row past it may go.
pub const SLOWEST_CURSOR_SQL: &str = "SELECT txid::text, seq FROM outbox_cursors ORDER BY txid, seq LIMIT 1";

/// Deletes up to `$2` outbox rows older than `$1` seconds at or behind the cursor `($3, $4)`. The
/// cursor is a constant, so the rows are found by one walk of the primary key from its start,
/// stopping after `$2` (a correlated cursor made this a rescan of the outbox per row).
pub const PRUNE_EVENTS_SQL: &str = "DELETE FROM outbox o WHERE (o.txid, o.seq) IN (
       SELECT x.txid, x.seq FROM outbox x
        WHERE (x.txid, x.seq) <= ($3::text::xid8, $4::int8) AND x.time < compute_now() - make_interval(secs => $1)
        ORDER BY x.txid, x.seq LIMIT $2)";

/// Removes up to [`BATCH`] prunable outbox rows and finished deliveries; returns how many of each.
pub async fn prune(tx: &impl tokio_postgres::GenericClient, retention: Duration) -> Result<(u64, u64), tokio_postgres::Error> {
    let secs = retention.as_secs_f64();
    // Only rows at or behind the slowest cursor: every sink has taken them.
    let events = match tx.query_opt(SLOWEST_CURSOR_SQL, &[]).await? {
        Some(c) => tx.execute(PRUNE_EVENTS_SQL, &[&secs, &BATCH, &c.get::<_, String>(0), &c.get::<_, i64>(1)]).await?,
        None => 0,
    };
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
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let (events, deliveries) = prune(&*tx, self.retention).await?;
        tx.commit().await?;
        if events + deliveries > 0 {
            tracing::info!(events, deliveries, "pruned");
        }
        Ok(if events as i64 == BATCH || deliveries as i64 == BATCH { Outcome::SyncAgain } else { Outcome::Done })
    }
}
