//! The vps module's jobs, one file each, named for the job's kind.

pub mod bootstraps;
pub mod hosts;
pub mod instances;
pub mod usage;
