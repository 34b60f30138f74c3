//! `capacity.reservations`: one key per reservation, moved through time by `capacity_step`.

use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::reservations;

/// Moves a reservation through time (start, end) and retries it while pending; key: reservation
/// id. One key per reservation, so reservations never contend on a shared queue row.
pub const RESERVATIONS_KIND: Kind = Kind { name: "capacity.reservations", shard_by: ShardBy::Key };

/// The most steps one run takes a reservation through (placed, active, expired, and one spare); what
/// is still due after them is due at once, so the timer armed last runs it again.
const MAX_STEPS_PER_RUN: usize = 4;

/// `capacity.reservations`, keyed by reservation.
pub struct ReservationsJob;

#[async_trait::async_trait]
impl Reconciler for ReservationsJob {
    fn kind(&self) -> Kind {
        RESERVATIONS_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, id: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        // Everything due now (a reservation may be both started and ended by a clock jump), one
        // step per transaction: a step ends by queueing wake-ups, the last table of the lock
        // order, and the next one may begin with quota, the first. In one transaction, a release
        // holding quota and queueing the same node's wake-up deadlocked with the run.
        let mut tx = ctx.begin_fenced(&mut c).await?;
        for _ in 0..MAX_STEPS_PER_RUN {
            let step = reservations::step(&mut tx, id).await?;
            if step == reservations::Step::Nothing {
                break;
            }
            tx.commit().await?;
            ctx.count(
                match step {
                    reservations::Step::Activated => "activated",
                    reservations::Step::Expired => "expired",
                    reservations::Step::Placed => "placed",
                    _ => "retried",
                },
                1,
            );
            tx = ctx.begin_fenced(&mut c).await?;
        }
        // Arm the timer for what is due next: its start, its end, or its next retry.
        let next: Option<f64> = tx
            .query_opt(
                "SELECT extract(epoch FROM (CASE state WHEN 'pending' THEN LEAST(next_attempt_at, upper(during))
                                                     WHEN 'placed' THEN lower(during)
                                                     ELSE upper(during) END) - compute_now())::float8
                   FROM reservations WHERE id = $1 AND state IN ('pending', 'placed', 'active')",
                &[&id],
            )
            .await?
            .map(|r| r.get(0));
        if let Some(secs) = next {
            work_queue::enqueue_after(&*tx, &RESERVATIONS_KIND, id, std::time::Duration::from_secs_f64(secs.max(0.0))).await?;
        }
        tx.commit().await?;
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let rows = ctx.read().await?.query("SELECT id FROM reservations WHERE state IN ('pending', 'placed', 'active')", &[]).await?;
        Ok(rows
            .iter()
            .map(|r| r.get::<_, String>(0))
            .filter(|id| shards.contains(&RESERVATIONS_KIND.shard_of(id)))
            .collect())
    }
}
