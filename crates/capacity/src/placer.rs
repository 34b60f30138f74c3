//! The placer: chooses a node and atoms for a demand and books them, or says why it cannot.
//!
//! It runs in the database, as `capacity_place` (src/sql/placer.sql), with the plans kept by the
//! backend; `capacity_reserve` and `capacity_step` (src/sql/reservation.sql) call it. Candidates come from `node_atom_counts`
//! by index (idle atoms of the class, fewest first, so reservations pack onto busy nodes and leave
//! whole nodes free; ties broken by chance, so concurrent placers spread), never from a scan of the
//! pool. Each attempt is a savepoint (a PL/pgSQL block): it locks the node row and the chosen atoms
//! (and their GPUs) `FOR SHARE` with the eligibility rules in the `WHERE`, takes the scalars with a
//! guarded update, and inserts the bookings with `ON CONFLICT DO NOTHING`. A node, atom or counter
//! conflict rolls back to the savepoint and replans without that node, at most three times, picking
//! from the candidates left by the plan before where there are any.
//!
//! Concurrent creates through the API are first tried in a batch (batch.rs), which places what it
//! can on the first try in one statement per step; what it hands back runs through this placer.

/// Replans after the first attempt.
pub const MAX_REPLANS: i32 = 3;
