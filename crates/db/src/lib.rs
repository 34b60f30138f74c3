//! PostgreSQL, the single source of truth: the self-starting cluster, the pool, migrations, the one
//! clock, leases with fencing, workers, idempotency keys, and the test
//! support that gives every test its own migrated database.

pub mod clock;
pub mod error;
pub mod idempotency;
pub mod launcher;
pub mod lease;
pub mod migrate;
pub mod paging;
#[cfg(feature = "testing")]
pub mod pgbouncer;
pub mod pool;
pub mod readiness;
pub mod schema;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tls;
pub mod workers;

pub use clock::Clock;
pub use error::DbError;
pub use lease::{FencedTransaction, Lease};
pub use migrate::{migrate, Migration, MigrationKind, CLOCK_MIGRATIONS, CORE_MIGRATIONS, FOUNDATION_MIGRATIONS};
pub use pool::Pool;
