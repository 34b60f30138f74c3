//! Reservations against a real PostgreSQL in simulated time, a module per part: a tenant's
//! requests, placement, and a reservation's life. This file holds what they share.

use better_compute_audit::Actor;
use std::time::Duration;

use better_compute_capacity::reservations::{self, GpuRequest, Toleration};
use better_compute_capacity::{mode, quota};
use better_compute_core::ErrorCode;
use better_compute_nodes::actions;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_testing::*;

/// Who makes the changes these tests make.
static TEST_ACTOR: Actor = Actor::job("test");

mod lifecycle;
mod placement;
mod requests;

async fn count(h: &better_compute_runtime::harness::Harness, sql: &str) -> i64 {
    h.db().client().await.query_one(sql, &[]).await.unwrap().get(0)
}

/// Whether a node's atom counts say it is open (all its rows agree, or this fails).
async fn counts_open(h: &better_compute_runtime::harness::Harness, node: &str) -> bool {
    let rows = h.db().client().await.query("SELECT open FROM node_atom_counts WHERE node_id = $1", &[&node]).await.unwrap();
    let flags: Vec<bool> = rows.iter().map(|r| r.get(0)).collect();
    assert!(!flags.is_empty() && flags.iter().all(|o| *o == flags[0]), "{node}: {flags:?}");
    flags[0]
}

/// `better_compute_placer_replans_total{reason}` as this process's recorder has it.
fn replans(reason: &str) -> u64 {
    let series = format!("better_compute_placer_replans_total{{reason=\"{reason}\"}} ");
    let text = better_compute_runtime::metrics::render();
    text.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.trim().parse().unwrap())
}

/// An API request of `ME`'s to `action`, as the actor of what it changes.
fn request(action: &str) -> Actor {
    Actor::Request(std::sync::Arc::new(better_compute_audit::entry::Request {
        identity_id: ME.identity_id.into(),
        token_id: "tok_a".into(),
        tenant_id: ME.tenant_id.into(),
        action: action.into(),
        target: String::new(),
        request_id: "req_a".into(),
        source: None,
        request_digest: "0".repeat(64),
    }))
}
