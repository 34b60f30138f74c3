//! The occupancy contract: what of other modules holds a node (capacity's reservations; later a
//! host's instances), so that the nodes module can drain a node without knowing those modules. A
//! module registers its occupants with [`crate::Module::node_occupants`]; every job's
//! [`crate::ReconcileContext::occupants`] lists them, in registration order.

use better_compute_db::DbError;
use tokio_postgres::Transaction;

/// What holds a node now or later.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Occupancy {
    /// Things that hold the node now or will from a later start (reservations placed or active).
    pub holding: i64,
    /// Seconds from now until the first of them ends by itself, if any.
    pub next_end_s: Option<f64>,
}

impl Occupancy {
    /// Both together: the sum of what holds the node, and the earlier of the ends.
    pub fn and(self, other: Occupancy) -> Occupancy {
        let next_end_s = match (self.next_end_s, other.next_end_s) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Occupancy { holding: self.holding + other.holding, next_end_s }
    }
}

/// One module's things on nodes. Every method runs in the caller's transaction, which has taken
/// the drain's own row first; each method takes its own rows in its module's lock order after it.
#[async_trait::async_trait]
pub trait NodeOccupant: Send + Sync + 'static {
    /// Its name in job status, e.g. `reservations`.
    fn name(&self) -> &'static str;

    /// What holds `node_id` now or later.
    async fn occupancy(&self, tx: &Transaction<'_>, node_id: &str) -> Result<Occupancy, DbError>;

    /// Whether something of this module uses the GPU `device_id` (or one of its atoms) now or
    /// within the next ten minutes: a GPU reset would kill its workload.
    async fn holds_device(&self, tx: &Transaction<'_>, device_id: &str) -> Result<bool, DbError>;

    /// Tells each affected tenant that its things on `node_id` end at `deadline` (RFC 3339), for
    /// `reason`. Called once per drain. Returns how many were told.
    async fn request_eviction(&self, tx: &Transaction<'_>, node_id: &str, deadline: &str, reason: &str) -> Result<u64, DbError>;

    /// Ends everything on `node_id` now with `reason` (refunding what each held from now on).
    /// Returns how many ended.
    async fn evict(&self, tx: &Transaction<'_>, node_id: &str, reason: &str) -> Result<u64, DbError>;
}
