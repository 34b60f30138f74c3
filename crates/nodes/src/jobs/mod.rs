//! The nodes module's jobs, one file each, named for the job's kind. A job's file holds its kind,
//! its schedule and its `Reconciler`; what it does lives with the concept it calls.

pub mod command_sweeper;
pub mod drain;
pub mod health;
pub mod inventory;
pub mod inventory_hygiene;
pub mod liveness;
pub mod node;
pub mod site_boot;
