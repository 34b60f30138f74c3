//! vps hosts: what each vps-host node can do for instances.
//!
//! `vps.bootstraps` (one key per node) runs the `vps.bootstrap` command on a newly joined vps-host
//! node, and on every host again when the image catalogue changes (`images.rs`): the daemon fetches
//! the catalogue's images its cache lacks, checks the hypervisor, KVM, the IOMMU groups and the
//! images' digests, and reports. The job keeps the report, trying up to [`BOOTSTRAP_ATTEMPTS`] times
//! per catalogue generation. `vps.hosts` (one key per node) derives the
//! host's state from that report and its node: `bootstrapping` until the report, `degraded` with
//! the report's problems, `draining` while its node is cordoned or drained, else `ready`; records
//! what the node has left for new instances; and keeps the `vps/not-ready` taint on every host that
//! is bootstrapping or degraded, so nothing is placed there.

use std::time::Duration;

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_nodes::commands::{self, NewCommand};
use better_compute_proto::v1::{command_body::Payload, CommandBody, VpsBootstrap};
use better_compute_runtime::commands::CommandKind;
use better_compute_runtime::{work_queue, Kind, NewEvent, Outcome, ReconcileContext, Reconciler, RunError, ShardBy};
use serde::Serialize;
use tokio_postgres::GenericClient;

/// `vps.bootstraps`: one key per vps-host node.
pub const BOOTSTRAPS_KIND: Kind = Kind { name: "vps.bootstraps", shard_by: ShardBy::Node };
/// `vps.hosts`: one key per vps-host node.
pub const HOSTS_KIND: Kind = Kind { name: "vps.hosts", shard_by: ShardBy::Node };
/// The taint that keeps new reservations off a host that cannot run instances.
pub const NOT_READY_TAINT: &str = "vps/not-ready";
/// Runs of `vps.bootstrap` before the host is left degraded.
pub const BOOTSTRAP_ATTEMPTS: i32 = 3;

fn vps_bootstrap(p: &serde_json::Value) -> Result<CommandBody, Error> {
    let m: VpsBootstrap = if p.is_null() { VpsBootstrap::default() } else { serde_json::from_value(p.clone()).map_err(|e| Error::invalid_argument(format!("payload of vps.bootstrap: {e}")))? };
    Ok(CommandBody { payload: Some(Payload::VpsBootstrap(m)) })
}

/// The command kinds the vps module defines.
pub fn command_kinds() -> Vec<CommandKind> {
    vec![CommandKind {
        name: "vps.bootstrap",
        summary: "Fetches the base image catalogue's images (`sources`: name, url, sha256) the host's cache lacks, each used only if its bytes hash to its sha256, then checks what a vps-host needs to run VMs (the hypervisor, KVM, IOMMU groups, the images) and reports it, with what was fetched; `vps.bootstraps` runs it on every new vps-host node and on every host when the catalogue changes.",
        lane: "default",
        // Fetching images takes as long as they are big (one hour at most each, on the daemon).
        timeout: Duration::from_secs(7200),
        retry_safe: true,
        self_terminating: false,
        destructive: false,
        api_allowed: false,
        payload_message: "VpsBootstrap",
        encode: vps_bootstrap,
    }]
}

/// A vps host as operators see it.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostView {
    /// The node.
    pub node_id: String,
    /// bootstrapping, ready, degraded or draining.
    pub state: String,
    /// Why it is not ready.
    pub reasons: Vec<String>,
    /// The last `vps.bootstrap` report.
    pub report: Option<serde_json::Value>,
    /// What it has left for new instances: vcpu, memoryMib, diskGib, idle atoms by class.
    pub free: serde_json::Value,
    /// The record's version.
    pub version: i64,
}

/// Every vps host's record, by node.
pub async fn list(db: &impl GenericClient) -> Result<Vec<HostView>, DbError> {
    let rows = db.query("SELECT node_id, state, reasons, report, free, version FROM vps_hosts ORDER BY node_id", &[]).await?;
    Ok(rows
        .iter()
        .map(|r| HostView { node_id: r.get(0), state: r.get(1), reasons: r.get(2), report: r.get(3), free: r.get(4), version: r.get(5) })
        .collect())
}

/// Makes the node's record (state `new`) if it has none; false when the node is not a vps host.
async fn host_record(db: &impl GenericClient, node: &str) -> Result<bool, DbError> {
    if better_compute_nodes::inventory::vps_hosts(db, &[node.to_owned()]).await?.is_empty() {
        return Ok(false);
    }
    db.execute("INSERT INTO vps_hosts (node_id, state) VALUES ($1, 'new') ON CONFLICT DO NOTHING", &[&node]).await?;
    Ok(true)
}

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
                    requested_by: Some("vps.bootstraps"),
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
