//! The module's jobs, one file each, named for the job's kind.

pub mod workflow;
