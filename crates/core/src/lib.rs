//! Domain types shared by every part of Better Compute: prefixed ids, the one error-code enum, the
//! state tables that declare each aggregate's legal transitions, and time constants. This crate does
//! no I/O, so every other crate can depend on it.

pub mod bounds;
pub mod error;
pub mod gpu_mode;
pub mod id;
pub mod lease;
pub mod seeded;
pub mod page;
pub mod state;
pub mod time;

pub use error::{Error, ErrorCode};
pub use id::Id;
pub use state::{StateTable, Transition};
pub mod shard;
pub mod xid;

/// Who is asking: every tenant-facing method is scoped to the caller's tenant, and idempotency keys
/// to its tenant and identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller<'a> {
    /// The caller's tenant.
    pub tenant_id: &'a str,
    /// The caller's identity (for idempotency keys and audit).
    pub identity_id: &'a str,
}
