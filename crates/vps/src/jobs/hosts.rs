//! `vps.hosts`: one key per vps-host node; derives the host's state from its bootstrap report and
//! its node, records what it has left for instances, and keeps the `vps/not-ready` taint
//! ([`crate::hosts`]).

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::{Kind, NewEvent, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::hosts::*;

/// `vps.hosts`: one key per vps-host node.
pub const HOSTS_KIND: Kind = Kind { name: "vps.hosts", shard_by: ShardBy::Node };

/// `vps.hosts`, keyed by node.
pub struct HostsJob;

#[async_trait::async_trait]
impl Reconciler for HostsJob {
    fn kind(&self) -> Kind {
        HOSTS_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        if !host_record(&*tx, node).await? {
            return Ok(Outcome::Done);
        }
        let r = tx.query_one("SELECT state, reasons, report, free FROM vps_hosts WHERE node_id = $1 FOR UPDATE", &[&node]).await?;
        let (was, was_reasons, report, was_free): (String, Vec<String>, Option<serde_json::Value>, serde_json::Value) = (r.get(0), r.get(1), r.get(2), r.get(3));
        let n = better_compute_nodes::inventory::get_node(&*tx, node).await?;
        let problems: Vec<String> =
            report.as_ref().and_then(|r| r.get("problems")).and_then(|p| p.as_array()).into_iter().flatten().filter_map(|p| p.as_str().map(str::to_owned)).collect();
        let (state, mut reasons) = match &report {
            None => ("bootstrapping", vec!["waiting for vps.bootstrap's report".to_owned()]),
            Some(_) if !problems.is_empty() => ("degraded", problems),
            Some(_) if n.no_schedule_reasons.iter().any(|r| r == "cordoned" || r == "draining") => ("draining", n.no_schedule_reasons.clone()),
            Some(_) => ("ready", Vec::new()),
        };
        if n.liveness != "connected" && state != "bootstrapping" {
            reasons.push(format!("the node is {}", n.liveness));
        }
        let tainted = n.taints.as_array().into_iter().flatten().any(|t| t.get("key").and_then(|k| k.as_str()) == Some(NOT_READY_TAINT));
        let not_ready = matches!(state, "bootstrapping" | "degraded");
        if not_ready && !tainted {
            better_compute_nodes::actions::taint(&*tx, node, NOT_READY_TAINT, state).await?;
        } else if !not_ready && tainted {
            better_compute_nodes::actions::untaint(&*tx, node, NOT_READY_TAINT).await?;
        }
        let free = serde_json::to_value(better_compute_capacity::occupant::node_free(&*tx, node).await?).map_err(|e| DbError::from(Error::internal(e.to_string())))?;
        if (was.as_str(), &was_reasons, &was_free) != (state, &reasons, &free) {
            tx.execute(
                "UPDATE vps_hosts SET state = $2, reasons = $3, free = $4, version = version + 1, updated_at = compute_now() WHERE node_id = $1",
                &[&node, &state, &reasons, &free],
            )
            .await?;
        }
        if was != state {
            let data = serde_json::json!({"state": state, "reasons": reasons});
            ctx.emit(&tx, NewEvent { event_type: &format!("vps.host.{state}"), tenant_id: None, subject: node, data }).await?;
            ctx.count("hosts changed state", 1);
        }
        tx.commit().await?;
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // Every vps-host node: the resync refreshes what each has left.
        let c = ctx.read().await?;
        let rows = c.query("SELECT n.id FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE p.kind = 'vps-host'", &[]).await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|n| shards.contains(&HOSTS_KIND.shard_of(n))).collect())
    }
}
