//! The nodes module's tests against a real PostgreSQL, one module per concept: the command queue,
//! node conditions, drains, GPU health, the inventory, liveness, site boots and the maintenance
//! and recovery workflows. One binary, so the tests link once.

mod commands;
mod conditions;
mod drain;
mod health;
mod inventory;
mod liveness;
mod site_boot;
mod workflows;
