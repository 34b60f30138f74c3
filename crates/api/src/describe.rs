//! `nodes.describe`: a node with everything an operator looks at when something is wrong, read
//! from each owning module (as `kubectl describe` does): its conditions, GPUs and atoms, the
//! reservations holding it now and next, its drain, its daemon's session, its newest commands and
//! its newest fleet events.

use better_compute_capacity::occupant::{self, NodeReservation};
use better_compute_core::Error;
use better_compute_nodes::commands::{self, CommandView};
use better_compute_nodes::inventory::devices::{self, DeviceView};
use better_compute_nodes::drain::{self, DrainView};
use better_compute_nodes::inventory::{self, NodeView};
use better_compute_nodes::sessions::{self, SessionView};
use serde::Serialize;
use tokio_postgres::GenericClient;

/// How many reservations, commands and events a description shows at most.
pub const DESCRIBE_ITEMS: i64 = 20;

/// A fleet event about the node or one of its GPUs.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeEvent {
    /// `evt_…`.
    pub id: String,
    /// Its type.
    #[serde(rename = "type")]
    pub event_type: String,
    /// The node or GPU it is about.
    pub subject: String,
    /// Its data.
    pub data: serde_json::Value,
    /// RFC 3339.
    pub time: String,
}

/// A node described.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeDescription {
    /// The node, with its conditions.
    pub node: NodeView,
    /// Its GPUs and their atoms.
    pub gpus: Vec<DeviceView>,
    /// The reservations holding it now and next, by start.
    pub reservations: Vec<NodeReservation>,
    /// Its open drain.
    pub drain: Option<DrainView>,
    /// Its daemon's latest session.
    pub session: Option<SessionView>,
    /// Its newest commands, newest first.
    pub recent_commands: Vec<CommandView>,
    /// Its newest fleet events (and its GPUs'), newest first.
    pub recent_events: Vec<NodeEvent>,
}

/// Reads everything of `node_id` (NOT_FOUND when it does not exist).
pub async fn node(db: &impl GenericClient, node_id: &str) -> Result<NodeDescription, Error> {
    let node = inventory::get_node(db, node_id).await?;
    let page = better_compute_core::page::PageRequest { page_size: Some(500), page_token: None };
    let gpus = devices::list_devices(db, Some(node_id), None, &page).await?.items;
    let mut subjects: Vec<String> = gpus.iter().map(|g| g.id.clone()).collect();
    subjects.push(node_id.to_owned());
    let recent_events = better_compute_runtime::outbox::recent_fleet_events(db, &subjects, DESCRIBE_ITEMS)
        .await?
        .into_iter()
        .map(|e| NodeEvent { id: e.id, event_type: e.event_type, subject: e.subject, data: e.data, time: better_compute_core::time::rfc3339(e.time) })
        .collect();
    Ok(NodeDescription {
        reservations: occupant::on_node(db, node_id, DESCRIBE_ITEMS).await?,
        drain: drain::open_drain(db, node_id).await?,
        session: sessions::latest(db, node_id).await?,
        recent_commands: commands::recent(db, node_id, DESCRIBE_ITEMS).await?,
        recent_events,
        node,
        gpus,
    })
}

/// The description as text for people (`better-compute nodes describe`).
pub fn text(d: &NodeDescription) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let n = &d.node;
    let _ = writeln!(s, "Node:        {} ({})", n.name, n.id);
    let _ = writeln!(s, "Pool:        {}", n.pool_id);
    let _ = writeln!(s, "Liveness:    {}", n.liveness);
    let _ = writeln!(s, "Generation:  {} (applied {})", n.generation, n.observed_generation);
    let _ = writeln!(s, "Labels:      {}", n.labels);
    let _ = writeln!(s, "Taints:      {}", n.taints);
    let reasons = if n.no_schedule_reasons.is_empty() { "none: schedulable".to_owned() } else { n.no_schedule_reasons.join(", ") };
    let _ = writeln!(s, "No-schedule: {reasons}");
    let _ = writeln!(s, "Conditions:");
    for c in &n.conditions {
        let _ = writeln!(s, "  {:<16} {:<24} {:<28} {}", c.kind, c.reason, c.since.as_deref().unwrap_or("-"), c.message);
    }
    let _ = writeln!(s, "GPUs:");
    for g in &d.gpus {
        let state = match (g.quarantined, &g.quarantine_reason) {
            (true, Some(r)) => format!("{}, quarantined ({r})", g.health_state),
            _ => g.health_state.clone(),
        };
        let atoms: Vec<&str> = g.atoms.iter().filter(|a| a.active).map(|a| a.profile.as_deref().unwrap_or(a.kind.as_str())).collect();
        let _ = writeln!(s, "  {} {:<20} {:<10} {:<10} {} atoms: {}", g.index, g.id, g.model, g.mode, state, atoms.join(" "));
    }
    let _ = writeln!(s, "Reservations (now and next):");
    for r in &d.reservations {
        let _ = writeln!(s, "  {} {} {:<7} {} → {} atoms: {}", r.id, r.tenant_id, r.state, r.starts_at, r.ends_at, r.atoms.join(" "));
    }
    if let Some(dr) = &d.drain {
        let _ = writeln!(s, "Drain:       {} {} ({}), {}: {}", dr.id, dr.mode.as_str(), dr.reason, dr.state, dr.condition.message);
    }
    match &d.session {
        Some(x) => {
            let _ = writeln!(
                s,
                "Session:     epoch {} on {} (daemon {}), opened {}, last seen {}{}",
                x.epoch,
                x.gateway_id,
                x.daemon_version,
                x.opened_at,
                x.last_seen_at,
                x.closed_at.as_ref().map(|c| format!(", closed {c} ({})", x.close_reason.as_deref().unwrap_or(""))).unwrap_or_default()
            );
        }
        None => {
            let _ = writeln!(s, "Session:     never connected");
        }
    }
    let _ = writeln!(s, "Recent commands:");
    for c in &d.recent_commands {
        let _ = writeln!(s, "  #{} {} {} {}", c.seq, c.kind, c.state, c.reason.as_deref().unwrap_or(""));
    }
    let _ = writeln!(s, "Recent events:");
    for e in &d.recent_events {
        let _ = writeln!(s, "  {} {:<24} {} {}", e.time, e.event_type, e.subject, e.data);
    }
    s
}
