//! Version-guarded state transitions.
//!
//! Every aggregate row has `id`, `state` and `version`. A transition reads the row, asks the
//! aggregate's state table whether the move is legal, and applies it with
//! `UPDATE … WHERE id = $1 AND version = $2`: zero rows means someone else changed it first, and the
//! caller gets `CONFLICT`.

use better_compute_core::state::{State, StateTable};
use better_compute_core::Error;
use tokio_postgres::GenericClient;

use crate::DbError;

/// A table whose rows follow a state table.
#[derive(Debug)]
pub struct Aggregate<S: 'static> {
    /// The SQL table (a trusted, static identifier: never user input).
    pub table: &'static str,
    /// Its legal transitions.
    pub states: &'static StateTable<S>,
}

/// The state a row moved to, and its new version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transitioned<S> {
    /// The state before.
    pub from: S,
    /// The state now.
    pub to: S,
    /// The new version.
    pub version: i64,
}

impl<S: State> Aggregate<S> {
    /// Moves row `id` from its current state to `to`, if it is still at `expected_version`.
    ///
    /// Errors: `NOT_FOUND`; `CONFLICT` for a stale version; `FAILED_PRECONDITION` for a transition
    /// the state table does not allow.
    pub async fn transition(
        &self,
        db: &impl GenericClient,
        id: &str,
        expected_version: i64,
        to: S,
    ) -> Result<Transitioned<S>, DbError> {
        let noun = self.states.aggregate;
        let row = db
            .query_opt(&format!("SELECT state, version FROM {} WHERE id = $1", self.table), &[&id])
            .await?
            .ok_or_else(|| Error::not_found(noun, id))?;
        let (state, version): (String, i64) = (row.get(0), row.get(1));
        if version != expected_version {
            return Err(stale(noun, id, expected_version, Some(version)).into());
        }
        let from = S::parse(&state).ok_or_else(|| Error::internal(format!("{noun} {id} has unknown state {state:?}")))?;
        self.states.check(from, to)?;
        // The version guard: if anything changed the row since we read it, zero rows.
        let updated = db
            .query_opt(
                &format!(
                    "UPDATE {} SET state = $3, version = version + 1 WHERE id = $1 AND version = $2 RETURNING version",
                    self.table
                ),
                &[&id, &expected_version, &to.as_str()],
            )
            .await?;
        match updated {
            Some(r) => Ok(Transitioned { from, to, version: r.get(0) }),
            None => Err(stale(noun, id, expected_version, None).into()),
        }
    }
}

fn stale(noun: &str, id: &str, expected: i64, current: Option<i64>) -> Error {
    Error::conflict(format!("{noun} {id} changed since version {expected}; read it again and retry")).with_details(
        serde_json::json!({"reason": "STALE_VERSION", "expectedVersion": expected, "currentVersion": current}),
    )
}
