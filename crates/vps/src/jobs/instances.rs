//! `vps.instances`: one key per vps-host node. Each run re-reads the node's live instances, their
//! reservations and what the host last reported, and moves each instance on: placed → in the
//! host's desired state (provisioning); reported running → running; reported stopped → stopped;
//! reported failed → failed; its reservation ended → deleting; gone from the host's applied spec
//! and its report → deleted. It tells the tenant once, [`EXPIRING_AHEAD_S`] before the
//! reservation's end, and arms itself for that moment.

use std::time::Duration;

use better_compute_capacity::reservations::{self, ReservationFacts};
use better_compute_core::state::{InstanceState, State, INSTANCE_STATE_TABLE};
use better_compute_db::DbError;
use better_compute_runtime::outbox::Event;
use better_compute_runtime::{work_queue, Kind, NewEvent, Outcome, ReconcileContext, Reconciler, RunError, Sink};
use tokio_postgres::Transaction;

use crate::INSTANCES_KIND;

/// How long before its reservation's end a tenant hears that its instance goes.
pub const EXPIRING_AHEAD_S: f64 = 15.0 * 60.0;

/// `vps.instances`, keyed by node.
pub struct InstancesJob;

struct Row {
    id: String,
    tenant_id: String,
    allocation_id: String,
    state: InstanceState,
    expiring_sent: bool,
}

#[async_trait::async_trait]
impl Reconciler for InstancesJob {
    fn kind(&self) -> Kind {
        INSTANCES_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        let rows: Vec<Row> = tx
            .query(
                "SELECT id, tenant_id, allocation_id, state, expiring_sent_at IS NOT NULL FROM instances
                  WHERE node_id = $1 AND state <> 'deleted' ORDER BY id FOR UPDATE",
                &[&node],
            )
            .await?
            .iter()
            .map(|r| {
                let state: String = r.get(3);
                Ok(Row {
                    id: r.get(0),
                    tenant_id: r.get(1),
                    allocation_id: r.get(2),
                    state: InstanceState::parse(&state).ok_or_else(|| DbError::from(better_compute_core::Error::internal(format!("unknown instance state {state}"))))?,
                    expiring_sent: r.get(4),
                })
            })
            .collect::<Result<_, DbError>>()?;
        let ids: Vec<String> = rows.iter().map(|r| r.allocation_id.clone()).collect();
        let facts: Vec<ReservationFacts> = reservations::facts(&*tx, &ids, false).await?;
        let host = better_compute_nodes::inventory::host_instances(&*tx, node).await?;
        let applied = host.observed_generation >= host.generation;
        let (mut moved, mut spec_changed, mut next_s) = (0u64, false, None::<f64>);
        for row in &rows {
            let Some(r) = facts.iter().find(|f| f.id == row.allocation_id) else { continue };
            let observed = host.observed.get(&row.id);
            let reported = observed.and_then(|o| o.get("state")).and_then(|s| s.as_str()).unwrap_or("");
            let text = |k: &str| observed.and_then(|o| o.get(k)).and_then(|s| s.as_str()).filter(|s| !s.is_empty()).map(str::to_owned);
            use InstanceState::*;
            let to = match row.state {
                s if !r.is_live() && s != Deleting => Some((Deleting, Some("its reservation ended".to_owned()))),
                Requested if r.node_id.as_deref() == Some(node) => Some((Provisioning, None)),
                Provisioning if reported == "running" => Some((Running, None)),
                Provisioning | Running if reported == "failed" => Some((Failed, text("message"))),
                Stopping if reported == "stopped" => Some((Stopped, None)),
                Deleting if applied && !host.desired.contains(&row.id) && observed.is_none() => Some((Deleted, None)),
                _ => None,
            };
            if let Some((to, reason)) = to {
                INSTANCE_STATE_TABLE.check(row.state, to)?;
                let v = tx
                    .query_one(
                        "UPDATE instances SET state = $2, reason = coalesce($3, reason), version = version + 1, updated_at = compute_now()
                          WHERE id = $1 AND state = $4 RETURNING version",
                        &[&row.id, &to.as_str(), &reason, &row.state.as_str()],
                    )
                    .await?;
                let version: i64 = v.get(0);
                crate::usage::follow(&*tx, &row.id, &r.pool_id, row.state, to).await?;
                let data = serde_json::json!({"state": to.as_str(), "reservationId": row.allocation_id, "nodeId": node, "reason": reason, "version": version});
                ctx.emit(&tx, NewEvent { event_type: &format!("instance.{}", to.as_str()), tenant_id: Some(&row.tenant_id), subject: &row.id, data }).await?;
                moved += 1;
                // What the host should have changes with these; running and failed are reports.
                spec_changed |= matches!(to, Provisioning | Deleting | Deleted);
            }
            // Address and host key, as the host last reported them.
            if let (Some(addr), Some(fp)) = (text("address"), text("hostKeyFingerprint")) {
                tx.execute(
                    "UPDATE instances SET address = $2, host_key_fingerprint = $3, version = version + 1, updated_at = compute_now()
                      WHERE id = $1 AND (address, host_key_fingerprint) IS DISTINCT FROM ($2, $3)",
                    &[&row.id, &addr, &fp],
                )
                .await?;
            }
            if r.is_live() {
                let until = r.ends_in_s - EXPIRING_AHEAD_S;
                if until <= 0.0 && !row.expiring_sent {
                    let ends_at = better_compute_core::time::rfc3339(ctx.clock().now() + Duration::from_secs_f64(r.ends_in_s.max(0.0)));
                    tx.execute("UPDATE instances SET expiring_sent_at = compute_now() WHERE id = $1", &[&row.id]).await?;
                    let data = serde_json::json!({"reservationId": row.allocation_id, "endsAt": ends_at});
                    ctx.emit(&tx, NewEvent { event_type: "instance.expiring", tenant_id: Some(&row.tenant_id), subject: &row.id, data }).await?;
                } else if until > 0.0 {
                    next_s = Some(next_s.map_or(until, |n: f64| n.min(until)));
                }
            }
        }
        if spec_changed {
            better_compute_runtime::desired::invalidate(&*tx, node).await?;
        }
        if let Some(s) = next_s {
            work_queue::enqueue_after(&*tx, &INSTANCES_KIND, node, Duration::from_secs_f64(s + 1.0)).await?;
        }
        tx.commit().await?;
        ctx.count("instances moved", moved);
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        let c = ctx.read().await?;
        let rows = c.query("SELECT DISTINCT node_id FROM instances WHERE state <> 'deleted' AND node_id IS NOT NULL", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|n| shards.contains(&INSTANCES_KIND.shard_of(n))).collect())
    }
}

/// Watches reservations and nodes: a placement gives a requested instance its host, and a
/// placement or an end wakes the host's `vps.instances` key; a vps-host node's events wake its
/// `vps.hosts` key, and its registration its `vps.bootstraps` key.
pub struct ReservationWatcher;

#[async_trait::async_trait]
impl Sink for ReservationWatcher {
    fn name(&self) -> &str {
        "vps.reservations"
    }

    async fn deliver(&self, tx: &Transaction<'_>, events: &[Event]) -> Result<(), RunError> {
        let mut touched: Vec<String> = events.iter().filter(|e| e.event_type.starts_with("node.")).map(|e| e.subject.clone()).collect();
        touched.sort();
        touched.dedup();
        if !touched.is_empty() {
            let hosts = better_compute_nodes::inventory::vps_hosts(tx, &touched).await?;
            let joined: Vec<String> =
                events.iter().filter(|e| e.event_type == "node.registered" && hosts.contains(&e.subject)).map(|e| e.subject.clone()).collect();
            work_queue::enqueue_many(tx, &crate::jobs::hosts::HOSTS_KIND, &hosts).await?;
            work_queue::enqueue_many(tx, &crate::jobs::bootstraps::BOOTSTRAPS_KIND, &joined).await?;
        }
        let ids: Vec<String> = events
            .iter()
            .filter(|e| matches!(e.event_type.as_str(), "reservation.placed" | "reservation.released" | "reservation.expired"))
            .map(|e| e.subject.clone())
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let facts = reservations::facts(tx, &ids, false).await?;
        let mut nodes = Vec::new();
        for f in &facts {
            if !f.is_live() {
                // Ended before it was placed: its requested instance was on no host.
                let gone = tx
                    .query(
                        "UPDATE instances SET state = 'deleted', reason = 'its reservation ended', version = version + 1, updated_at = compute_now()
                          WHERE allocation_id = $1 AND state = 'requested' AND node_id IS NULL RETURNING id, tenant_id, version",
                        &[&f.id],
                    )
                    .await?;
                for g in &gone {
                    let (id, tenant, version): (String, String, i64) = (g.get(0), g.get(1), g.get(2));
                    let data = serde_json::json!({"state": "deleted", "reservationId": f.id, "nodeId": null, "reason": "its reservation ended", "version": version});
                    better_compute_runtime::outbox::emit(tx, NewEvent { event_type: "instance.deleted", tenant_id: Some(&tenant), subject: &id, data }).await?;
                }
            }
            let Some(node) = &f.node_id else { continue };
            let n = tx
                .execute("UPDATE instances SET node_id = $2 WHERE allocation_id = $1 AND state = 'requested' AND node_id IS NULL", &[&f.id, node])
                .await?;
            let has = n > 0 || tx.query_opt("SELECT 1 FROM instances WHERE allocation_id = $1 AND state <> 'deleted'", &[&f.id]).await?.is_some();
            if has && !nodes.contains(node) {
                nodes.push(node.clone());
            }
        }
        if !nodes.is_empty() {
            work_queue::enqueue_many(tx, &INSTANCES_KIND, &nodes).await?;
        }
        // What a host has left changed with its reservations.
        let mut placed_on: Vec<String> = facts.iter().filter_map(|f| f.node_id.clone()).collect();
        placed_on.sort();
        placed_on.dedup();
        let hosts = better_compute_nodes::inventory::vps_hosts(tx, &placed_on).await?;
        work_queue::enqueue_many(tx, &crate::jobs::hosts::HOSTS_KIND, &hosts).await?;
        Ok(())
    }
}
