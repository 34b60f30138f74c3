//! `vps.bootstraps`: one key per vps-host node; runs `vps.bootstrap` on a newly joined host, and
//! on every host again when the image catalogue changes, and keeps the report ([`crate::hosts`]).

use std::time::Duration;

use better_compute_nodes::commands::{self, NewCommand};
use better_compute_runtime::{work_queue, Kind, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};

use crate::hosts::*;
use crate::jobs::hosts::HOSTS_KIND;

/// `vps.bootstraps`: one key per vps-host node.
pub const BOOTSTRAPS_KIND: Kind = Kind { name: "vps.bootstraps", shard_by: ShardBy::Node };

/// `vps.bootstraps`, keyed by node.
pub struct BootstrapsJob;

#[async_trait::async_trait]
impl Reconciler for BootstrapsJob {
    fn kind(&self) -> Kind {
        BOOTSTRAPS_KIND
    }

    async fn run(&self, ctx: &ReconcileContext, node: &str) -> Result<Outcome, RunError> {
        let mut c = ctx.client().await?;
        let tx = ctx.begin_fenced(&mut c).await?;
        if !host_record(&*tx, node).await? {
            return Ok(Outcome::Done);
        }
        let (generation, payload) = crate::images::catalogue(&*tx).await?;
        let r = tx
            .query_one(
                "SELECT bootstrap_command_id, bootstrap_attempts, report IS NOT NULL, report_generation, bootstrap_generation FROM vps_hosts WHERE node_id = $1 FOR UPDATE",
                &[&node],
            )
            .await?;
        let (mut command, mut attempts, reported, report_generation, bootstrap_generation): (Option<String>, i32, bool, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        if reported && report_generation >= generation {
            return Ok(Outcome::Done);
        }
        if bootstrap_generation < generation {
            // The bootstrap in hand checked an older catalogue: start over against this one. The
            // host keeps its report, and state, until the new one comes.
            (command, attempts) = (None, 0);
        }
        let last = match &command {
            Some(id) => Some(commands::get(&*tx, node, id).await?),
            None => None,
        };
        let report = match &last {
            Some(c) if c.state == "succeeded" => Some(c.result.clone().unwrap_or(serde_json::Value::Null)),
            Some(c) if !["succeeded", "failed", "expired", "cancelled"].contains(&c.state.as_str()) => return Ok(Outcome::Done), // it runs; its end wakes this key
            Some(c) if attempts >= BOOTSTRAP_ATTEMPTS => Some(serde_json::json!({
                "problems": [format!("vps.bootstrap {} after {attempts} attempts: {}", c.state, c.reason.clone().unwrap_or_default())]
            })),
            _ => None,
        };
        match report {
            Some(report) => {
                tx.execute(
                    "UPDATE vps_hosts SET report = $2, report_generation = bootstrap_generation, version = version + 1, updated_at = compute_now() WHERE node_id = $1",
                    &[&node, &report],
                )
                .await?;
                ctx.count("hosts bootstrapped", 1);
            }
            None => {
                let kind = command_kinds().into_iter().next().expect("vps.bootstrap");
                let key = format!("vps.bootstrap:{node}:{generation}:{}", attempts + 1);
                let cmd = NewCommand {
                    node_id: node,
                    kind: kind.name,
                    payload: &payload,
                    idempotency_key: &key,
                    not_after: Some(Duration::from_secs(600)),
                    min_generation: 0,
                    owner: Some((BOOTSTRAPS_KIND.name, node, BOOTSTRAPS_KIND.shard_of(node))),
                    actor: &better_compute_audit::Actor::job(BOOTSTRAPS_KIND.name),
                };
                let v = commands::enqueue_kind(&*tx, &kind, cmd).await?;
                tx.execute(
                    "UPDATE vps_hosts SET bootstrap_command_id = $2, bootstrap_attempts = $3, bootstrap_generation = $4, updated_at = compute_now() WHERE node_id = $1",
                    &[&node, &v.id, &(attempts + 1), &generation],
                )
                .await?;
                ctx.count("bootstraps sent", 1);
            }
        }
        work_queue::enqueue(&*tx, &HOSTS_KIND, node).await?;
        tx.commit().await?;
        Ok(Outcome::Done)
    }

    async fn keys(&self, ctx: &ReconcileContext, shards: &[i16]) -> Result<Vec<String>, RunError> {
        // vps-host nodes with no report against the catalogue as it is.
        let c = ctx.read().await?;
        let rows = c
            .query(
                "SELECT n.id FROM nodes n JOIN pools p ON p.id = n.pool_id LEFT JOIN vps_hosts h ON h.node_id = n.id, vps_settings s
                  WHERE p.kind = 'vps-host' AND (h.report IS NULL OR h.report_generation < s.catalogue_generation)",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get::<_, String>(0)).filter(|n| shards.contains(&BOOTSTRAPS_KIND.shard_of(n))).collect())
    }
}
