//! A node's conditions, as `nodes.get` and `nodes.list` show them: each that holds (Ready,
//! Converging, Disconnected, Unreachable, Lost, Cordoned, Draining, Unhealthy, QuarantinedGpus,
//! Retired) with a stable reason, a message and since when. They are computed in one place,
//! `nodes_conditions` (`sql/conditions.sql`), from the rows that own them, so they can never
//! disagree with those rows; `noScheduleReasons` beside them says why the placer skips the node.

use serde::Serialize;

/// One condition of a node.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Draining`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// A stable word: `Converged`, `WaitingForBudget`, `Evicting`, …
    pub reason: String,
    /// For people.
    pub message: String,
    /// RFC 3339: since when this reason holds, where the rows know it.
    pub since: Option<String>,
}
