//! The database layer against a real PostgreSQL, one module per concept: throwaway clusters
//! through a crash, the foundation (migrations, the clock, leases and fencing, idempotency keys),
//! and TLS to PostgreSQL. One binary, so the tests link once.

mod crash;
mod foundation;
mod tls;
