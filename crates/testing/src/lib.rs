//! Test support for the modules' tests: a harness with the inventory, capacity, audit and
//! workflow modules, a fleet built through the owners' functions (a site, a pool, nodes with GPUs
//! in the modes asked for, adopted and converged), reservation constructors, and checks that the
//! invariants hold, a statement waits for a lock, or jobs wrote their audit entries.

use std::sync::Arc;

use better_compute_capacity::reservations::{CreateReservation, GpuRequest};
use better_compute_capacity::{invariants, quota, CapacityModule, Caller};
use better_compute_nodes::inventory::{self, NewGpu, NewNode, NewPool};
use better_compute_core::gpu_mode::GpuMode;
use better_compute_nodes::NodesModule;
use better_compute_runtime::harness::Harness;

/// The fleet's GPU model.
pub const MODEL: &str = "H100-80GB";
/// The tenant whose quota the fleet opens.
pub const TENANT: &str = "ten_a";
/// The tenant's caller.
pub const ME: Caller<'static> = Caller { tenant_id: TENANT, identity_id: "idn_a" };

/// What [`fleet`] built.
pub struct Fleet {
    /// The pool.
    pub pool_id: String,
    /// Its nodes, in order.
    pub nodes: Vec<String>,
    /// GPU uuids per node.
    pub gpus: Vec<Vec<String>>,
}

/// A harness with the nodes, capacity, audit and workflows modules.
pub async fn harness() -> Harness {
    Harness::new(vec![Arc::new(NodesModule), Arc::new(CapacityModule), Arc::new(better_compute_audit::AuditModule), Arc::new(better_compute_workflows::WorkflowsModule)]).await
}

/// `modes[i]` is the mode of every GPU of node i.
pub async fn fleet(h: &Harness, modes: &[GpuMode], gpus_per_node: usize) -> Fleet {
    let mut c = h.db().client().await;
    let tx = c.transaction().await.unwrap();
    let site = inventory::create_site(&*tx, "site-a").await.unwrap();
    let pool_id = inventory::create_pool(
        &*tx,
        &NewPool { site_id: site, name: "pool-a".into(), kind: "bare-metal".into(), vcpu_ratio: 1.0, memory_ratio: 1.0, disk_ratio: 1.0, lost_after_s: None },
    )
    .await
    .unwrap();
    let mut nodes = Vec::new();
    let mut gpus = Vec::new();
    for (i, mode) in modes.iter().enumerate() {
        let node_gpus: Vec<NewGpu> = (0..gpus_per_node)
            .map(|g| NewGpu { uuid: format!("GPU-{i:03}-{g}"), model: MODEL.into(), memory_mib: 81_920, mode: mode.clone() })
            .collect();
        let id = inventory::register_node(
            &*tx,
            &NewNode {
                pool_id: pool_id.clone(),
                name: format!("node-{i:03}"),
                labels: serde_json::Map::from_iter([("rack".to_owned(), serde_json::json!(format!("r{}", i % 4)))]),
                vcpu: 128,
                memory_mib: 1_048_576,
                disk_gib: 8_000,
                gpus: node_gpus.clone(),
            },
        )
        .await
        .unwrap();
        inventory::adopt(&*tx, &id).await.unwrap();
        inventory::report_observed_generation(&*tx, &id, 1).await.unwrap();
        gpus.push(node_gpus.into_iter().map(|g| g.uuid).collect());
        nodes.push(id);
    }
    open_quota(&*tx, TENANT).await;
    tx.commit().await.unwrap();
    // The inventory watcher turns node.registered into atom counts.
    settle_outbox(h).await;
    h.job("event-subscribers").drain(20).await;
    Fleet { pool_id, nodes, gpus }
}

/// Waits until every outbox row is below the cluster's xmin (other tests share the cluster).
pub async fn settle_outbox(h: &Harness) {
    let c = h.db().client().await;
    for _ in 0..6000 {
        let settled: bool = c
            .query_one("SELECT coalesce(max(txid) < pg_snapshot_xmin(pg_current_snapshot()), true) FROM outbox", &[])
            .await
            .unwrap()
            .get(0);
        if settled {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("outbox did not settle");
}

/// Gives `tenant` room in every resource.
pub async fn open_quota(c: &impl tokio_postgres::GenericClient, tenant: &str) {
    for r in quota::RESOURCES {
        quota::set(c, tenant, r, 1_000_000_000).await.unwrap();
    }
}

/// A reservation in `pool` of `gpu` with these scalars, for `duration_s` from now: the fields a
/// test varies, the others their defaults (no selector, no tolerations, no key).
pub fn reservation(pool: &str, gpu: GpuRequest, vcpu: i32, memory_mib: i64, disk_gib: i64, duration_s: i64) -> CreateReservation {
    CreateReservation {
        tenant_id: None,
        pool_id: pool.to_owned(),
        gpu,
        vcpu,
        memory_mib,
        disk_gib,
        starts_at: None,
        ends_at: None,
        duration_s: Some(duration_s),
        node_selector: Default::default(),
        tolerations: vec![],
        idempotency_key: None,
    }
}

/// `count` atoms of `kind` (`gpu`, `mig` with its `profile`, `slot`) of [`MODEL`].
pub fn atoms(kind: &str, profile: Option<String>, count: i32) -> GpuRequest {
    GpuRequest { kind: kind.into(), model: MODEL.into(), profile, count }
}

/// A reservation of `count` whole GPUs in `pool` for an hour from now, with 8 vCPU, 64 GiB and 100 GiB.
pub fn whole(pool: &str, count: i32) -> CreateReservation {
    reservation(pool, atoms("gpu", None, count), 8, 65_536, 100, 3600)
}

/// `whole(pool, count)` over a fixed range, RFC 3339 bounds.
pub fn whole_between(pool: &str, count: i32, starts_at: &str, ends_at: &str) -> CreateReservation {
    CreateReservation { duration_s: None, starts_at: Some(starts_at.into()), ends_at: Some(ends_at.into()), ..whole(pool, count) }
}

/// `n` nodes' worth of exclusive GPUs, for [`fleet`].
pub fn exclusive(n: usize) -> Vec<GpuMode> {
    vec![GpuMode::Exclusive; n]
}

/// The audit entries the control plane's jobs wrote (not the tests' own, as `test`) whose target
/// starts with `target`, in order: (job, action, target, tenant).
pub async fn job_entries(h: &Harness, target: &str) -> Vec<(String, String, String, Option<String>)> {
    let c = h.db().client().await;
    c.query(
        "SELECT actor_id, action, target, tenant_id FROM audit_entries WHERE actor_kind = 'job' AND actor_id <> 'test' AND starts_with(target, $1) ORDER BY position",
        &[&target],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// Every invariant of invariants::check holds.
pub async fn assert_invariants_hold(c: &tokio_postgres::Client) {
    let report = invariants::check(c, &std::collections::HashMap::new()).await.unwrap();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

/// Returns once a statement calling `function` waits for a lock (within 30 s, else fails with `why`).
pub async fn waits_for_a_lock(h: &Harness, function: &str, why: &str) {
    let watcher = h.db().client().await;
    let waiting = async {
        loop {
            let n: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
                    &[&function],
                )
                .await
                .unwrap()
                .get(0);
            if n > 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), waiting).await.expect(why);
}

/// Where each of `allocation`'s live bookings starts, as text.
pub async fn booking_starts(c: &tokio_postgres::Client, allocation: &str) -> Vec<String> {
    let rows = c.query("SELECT lower(during)::text FROM device_bookings WHERE allocation_id = $1", &[&allocation]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}
