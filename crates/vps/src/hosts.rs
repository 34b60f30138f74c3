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
use better_compute_proto::v1::{command_body::Payload, CommandBody, VpsBootstrap};
use better_compute_runtime::commands::CommandKind;
use serde::Serialize;
use tokio_postgres::GenericClient;

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
pub(crate) async fn host_record(db: &impl GenericClient, node: &str) -> Result<bool, DbError> {
    if better_compute_nodes::inventory::vps_hosts(db, &[node.to_owned()]).await?.is_empty() {
        return Ok(false);
    }
    db.execute("INSERT INTO vps_hosts (node_id, state) VALUES ($1, 'new') ON CONFLICT DO NOTHING", &[&node]).await?;
    Ok(true)
}
