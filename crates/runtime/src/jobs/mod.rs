//! The runtime's own jobs, one file each, named for the job's kind.

pub mod housekeeping;
pub mod nodespec;
