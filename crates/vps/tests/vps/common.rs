//! What the vps tests share: a vps-host node with two GPUs, and waiting for the outbox.

#![allow(dead_code)]

use better_compute_capacity::quota;
use better_compute_capacity::reservations::CreateReservation;
use better_compute_core::Caller;
use better_compute_nodes::inventory::{self, NewGpu, NewNode, NewPool};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_nodes::inventory::reports::{self, NodeLocks, Report, SessionReports};
use better_compute_nodes::sessions::{self, Hello};
use better_compute_runtime::harness::Harness;

pub const ME: Caller<'static> = Caller { tenant_id: "ten_a", identity_id: "idn_a" };

/// A vps-host pool with one adopted node of two GPUs, and room in the tenant's quota.
pub async fn host(h: &Harness) -> (String, String) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let site = inventory::create_site(&*tx, "site-a").await.unwrap();
    let pool = NewPool { site_id: site, name: "vms".into(), kind: "vps-host".into(), vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None };
    let pool_id = inventory::create_pool(&*tx, &pool).await.unwrap();
    let gpus = (0..2).map(|g| NewGpu { uuid: format!("GPU-0-{g}"), model: "H100-80GB".into(), memory_mib: 81_920, mode: GpuMode::Exclusive }).collect();
    let node = NewNode { pool_id: pool_id.clone(), name: "host-0".into(), labels: Default::default(), vcpu: 64, memory_mib: 524_288, disk_gib: 4_000, gpus };
    let node_id = inventory::register_node(&*tx, &node).await.unwrap();
    inventory::adopt(&*tx, &node_id).await.unwrap();
    inventory::report_observed_generation(&*tx, &node_id, 1).await.unwrap();
    for r in quota::RESOURCES {
        quota::set(&*tx, ME.tenant_id, r, 1_000_000_000).await.unwrap();
    }
    tx.commit().await.unwrap();
    settle(h).await;
    h.job("event-subscribers").drain(20).await;
    (pool_id, node_id)
}

/// Waits until every outbox row is below the cluster's xmin.
pub use better_compute_testing::settle_outbox as settle;

/// A reservation of one whole GPU for an hour in `pool`.
pub fn one_gpu(pool: &str) -> CreateReservation {
    better_compute_testing::reservation(pool, better_compute_testing::atoms("gpu", None, 1), 4, 4096, 10, 3600)
}

/// The node's daemon says `reports` in a session of its own, through the gateway's report path.
pub async fn apply(h: &Harness, node: &str, reports: Vec<Report>) {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let opened = sessions::open(&*tx, &Hello { node_id: node, gateway_id: "gw_a", boot_id: "b1", journal_id: "j1", daemon_version: "t" }).await.unwrap();
    let s = SessionReports { node_id: node.to_owned(), epoch: opened.session_epoch, reports };
    reports::apply(&*tx, "gw_a", &[&s], NodeLocks::Wait, &better_compute_runtime::Module::status_watches(&better_compute_vps::VpsModule)).await.unwrap();
    tx.commit().await.unwrap();
}
