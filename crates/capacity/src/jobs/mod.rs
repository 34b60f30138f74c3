//! The capacity jobs, one file each, named for the job's kind: `capacity.reservations` moves
//! reservations through time and retries pending ones (`reservations.rs`); `capacity.rollup` keeps
//! `pool_capacity_rollup` true (`rollup.rs`); `capacity.usage` closes usage windows (`usage.rs`).

pub mod reservations;
pub mod rollup;
pub mod usage;

pub use reservations::ReservationsJob;
pub use rollup::Rollup;
pub use usage::{UsageJob, RESERVATIONS_PER_RUN};
