//! The capacity jobs, one file each: `capacity.reservations` moves a pool's reservations through
//! time and retries pending ones (`reservations.rs`); `capacity.rollup` keeps
//! `pool_capacity_rollup` true (`rollup.rs`); `capacity.usage` closes usage windows (`usage.rs`); and an in-process subscriber refreshes a node's atom
//! counts and wakes the rollup when the inventory changes (`inventory.rs`).

mod inventory;
mod reservations;
mod rollup;
mod usage;

pub use inventory::{refresh_nodes, InventoryWatcher};
pub use reservations::ReservationsJob;
pub use rollup::Rollup;
pub use usage::{UsageJob, RESERVATIONS_PER_RUN};
