//! [`Reservations`]: capacity's one entry point for reservations. Creates and releases go through
//! the batch placer where it applies and run alone otherwise, extends run alone; all on this
//! service's pool. The API, the simulator and the benchmarks hold one each, so the path users hit
//! is the path the simulator attacks and the benchmarks measure.

use better_compute_audit::Actor;
use better_compute_core::Error;
use better_compute_db::{DbError, Pool};

use crate::batch::{BatchPlacer, BatchSettings};
use crate::reservations::{self, CreateReservation, ReservationPage, ReservationView};
use crate::Caller;

/// Creates, reads, extends and releases reservations.
pub struct Reservations {
    pool: Pool,
    placer: Option<BatchPlacer>,
}

impl Reservations {
    /// Over `pool`, with a batch placer of `settings` (none when `settings.batchers` is 0: every
    /// request runs alone).
    pub fn start(pool: Pool, settings: BatchSettings) -> Reservations {
        let placer = (settings.batchers > 0).then(|| BatchPlacer::start(pool.clone(), settings));
        Reservations { pool, placer }
    }

    /// The batch placer, for its counters.
    pub fn placer(&self) -> Option<&BatchPlacer> {
        self.placer.as_ref()
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, Error> {
        Ok(self.pool.get().await.map_err(DbError::from)?)
    }

    async fn read(&self) -> Result<better_compute_db::pool::ReadTx, Error> {
        Ok(better_compute_db::pool::read_tx(&self.pool).await?)
    }

    /// `reservations.create` (see [`reservations::create`]). A connection is taken only if the
    /// request runs alone: waiting for a batcher while holding one could starve the batchers.
    pub async fn create(&self, actor: &Actor, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
        let created = self.create_batched_or_alone(actor, caller, req).await;
        let outcome = match &created {
            Ok(v) if v.state == "pending" => "pending",
            Ok(_) => "placed",
            Err(e) if e.code == better_compute_core::ErrorCode::Unavailable => "unavailable",
            Err(_) => "refused",
        };
        metrics::counter!("better_compute_placements_total", "outcome" => outcome).increment(1);
        created
    }

    async fn create_batched_or_alone(&self, actor: &Actor, caller: Caller<'_>, req: &CreateReservation) -> Result<ReservationView, Error> {
        let alone = match &self.placer {
            Some(placer) => match reservations::create_in_batch(placer, actor, caller, req).await? {
                Ok(v) => return Ok(v),
                Err(alone) => alone,
            },
            None => reservations::RunAlone::new(req)?,
        };
        let mut c = self.client().await?;
        reservations::create_run_alone(&mut c, actor, caller, req, alone).await
    }

    /// `reservations.release` (see [`reservations::release`]).
    pub async fn release(&self, actor: &Actor, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
        if let Some(placer) = &self.placer
            && let Some(v) = reservations::release_in_batch(placer, actor, caller, id).await?
        {
            return Ok(v);
        }
        let mut c = self.client().await?;
        reservations::release(&mut c, actor, caller, id).await
    }

    /// `reservations.extend` (see [`reservations::extend`]).
    pub async fn extend(&self, actor: &Actor, caller: Caller<'_>, id: &str, ends_at: &str, idempotency_key: Option<&str>) -> Result<ReservationView, Error> {
        let mut c = self.client().await?;
        reservations::extend(&mut c, actor, caller, id, ends_at, idempotency_key).await
    }

    /// `reservations.get` (see [`reservations::get`]).
    pub async fn get(&self, caller: Caller<'_>, id: &str) -> Result<ReservationView, Error> {
        reservations::get(&*self.read().await?, caller, id).await
    }

    /// `reservations.list` (see [`reservations::list`]).
    pub async fn list(&self, caller: Caller<'_>, state: Option<&str>, cursor: Option<&str>, limit: i64) -> Result<ReservationPage, Error> {
        reservations::list(&*self.read().await?, caller, state, cursor, limit).await
    }
}
