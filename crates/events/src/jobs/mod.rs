//! The events module's jobs, one file each, named for the job's kind.

pub mod deliver;
pub mod fanout;
pub mod prune;
