//! The placer: chooses a node and atoms for a demand and books them, or says why it cannot.
//!
//! It runs in the database, as `capacity_place` (migrations/capacity/0002_placer.sql): one round
//! trip per placement, with the plans kept by the backend. Candidates come from `node_atom_counts`
//! by index (idle atoms of the class, fewest first, so reservations pack onto busy nodes and leave
//! whole nodes free; ties broken by chance, so concurrent placers spread), never from a scan of the
//! pool. Each attempt is a savepoint (a PL/pgSQL block): it locks the node row and the chosen atoms
//! (and their GPUs) `FOR SHARE` with the eligibility rules in the `WHERE`, takes the scalars with a
//! guarded update, and inserts the bookings with `ON CONFLICT DO NOTHING`. A node, atom or counter
//! conflict rolls back to the savepoint and replans without that node, at most three times.

use better_compute_db::DbError;
use serde_json::Value;
use tokio_postgres::Transaction;

/// Replans after the first attempt.
pub const MAX_REPLANS: i32 = 3;

/// What a reservation needs from one node.
#[derive(Debug, Clone)]
pub struct Demand {
    /// The pool.
    pub pool_id: String,
    /// `gpu`, `mig` or `slot`.
    pub kind: String,
    /// The GPU model.
    pub model: String,
    /// The MIG profile, or empty.
    pub profile: String,
    /// Atoms wanted.
    pub count: i32,
    /// vCPUs.
    pub vcpu: i32,
    /// Memory.
    pub memory_mib: i64,
    /// Disk.
    pub disk_gib: i64,
    /// Labels the node must have (a JSON object).
    pub node_selector: Value,
    /// Taints tolerated (a JSON array of `{key, value?}`).
    pub tolerations: Value,
}

/// The outcome of placing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Booked.
    Placed {
        /// The node.
        node_id: String,
        /// The atoms booked.
        atoms: Vec<String>,
    },
    /// Not now; the reservation waits as `pending`.
    Unschedulable {
        /// A stable reason: `NoCandidates` or `Conflicts`.
        reason: &'static str,
        /// What an operator or tenant can act on.
        message: String,
    },
}

/// Places `d` for `allocation_id` over `during` (a `tstzrange` literal) inside `tx`: at most one
/// first plan and [`MAX_REPLANS`] replans, each under its own savepoint.
pub async fn place(tx: &Transaction<'_>, d: &Demand, allocation_id: &str, during: &str) -> Result<Placement, DbError> {
    let row = tx
        .query_one(
            "SELECT placed_node, placed_atoms, tried, raced
               FROM capacity_place($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12::text::tstzrange, $13)",
            &[
                &d.pool_id, &d.kind, &d.model, &d.profile, &d.count, &d.vcpu, &d.memory_mib, &d.disk_gib,
                &d.node_selector, &d.tolerations, &allocation_id, &during, &MAX_REPLANS,
            ],
        )
        .await?;
    if let Some(node_id) = row.get::<_, Option<String>>(0) {
        return Ok(Placement::Placed { node_id, atoms: row.get(1) });
    }
    let tried: Vec<String> = row.get(2);
    let raced: bool = row.get(3);
    let what = format!(
        "{} {}{} atom{} of {}",
        d.count,
        d.kind,
        if d.profile.is_empty() { String::new() } else { format!(" {}", d.profile) },
        if d.count == 1 { "" } else { "s" },
        d.model
    );
    let tried = if tried.is_empty() { String::new() } else { format!(" (tried {})", tried.join("; ")) };
    Ok(if raced {
        Placement::Unschedulable {
            reason: "Conflicts",
            message: format!("concurrent placements took the nodes that fit {what}{tried}; retrying every 30 s"),
        }
    } else {
        Placement::Unschedulable {
            reason: "NoCandidates",
            message: format!("no eligible node in the pool has {what} and the vCPU, memory and disk free for the range{tried}; retrying every 30 s"),
        }
    })
}
