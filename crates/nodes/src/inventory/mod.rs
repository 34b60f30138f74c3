//! Sites, pools, nodes and their GPUs.

pub mod devices;
pub mod findings;
pub mod join;
pub mod labels;
pub mod reports;

use better_compute_core::id::{NodeId, PoolId, SiteId};
use better_compute_core::shard::shard_of;
use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use serde::{Deserialize, Serialize};
use tokio_postgres::GenericClient;

use better_compute_core::gpu_mode::GpuMode;

fn valid_name(what: &str, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_argument(format!(
            "{what} must be 1 to 63 lowercase letters, digits and dashes, not starting with a dash"
        )))
    }
}

fn unique_violation(e: &DbError) -> bool {
    e.sqlstate() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
}

/// Creates a site.
pub async fn create_site(tx: &impl GenericClient, name: &str) -> Result<String, DbError> {
    valid_name("site name", name)?;
    let id = SiteId::generate().to_string();
    let r = tx.execute("INSERT INTO sites (id, name) VALUES ($1, $2)", &[&id, &name]).await.map_err(DbError::from);
    match r {
        Err(e) if unique_violation(&e) => Err(Error::conflict(format!("a site named {name} exists")).into()),
        Err(e) => Err(e),
        Ok(_) => Ok(id),
    }
}

/// A pool to create.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewPool {
    /// Its site.
    pub site_id: String,
    /// Its name, unique in the site.
    pub name: String,
    /// `bare-metal`, `provider` or `vps-host`.
    pub kind: String,
    /// vCPU overcommit (1 to 16).
    #[serde(default = "one")]
    pub vcpu_ratio: f64,
    /// Memory overcommit (1 to 4).
    #[serde(default = "one")]
    pub memory_ratio: f64,
    /// Disk overcommit (1 to 4).
    #[serde(default = "one")]
    pub disk_ratio: f64,
    /// Unreachable nodes become lost after this long (provider and vps-host pools only).
    #[serde(default)]
    pub lost_after_s: Option<i32>,
}

fn one() -> f64 {
    1.0
}

/// Creates a pool.
pub async fn create_pool(tx: &impl GenericClient, p: &NewPool) -> Result<String, DbError> {
    valid_name("pool name", &p.name)?;
    if !["bare-metal", "provider", "vps-host"].contains(&p.kind.as_str()) {
        return Err(Error::invalid_argument("pool kind must be bare-metal, provider or vps-host").into());
    }
    for (field, v, max) in [("vcpuRatio", p.vcpu_ratio, 16.0), ("memoryRatio", p.memory_ratio, 4.0), ("diskRatio", p.disk_ratio, 4.0)] {
        if !(1.0..=max).contains(&v) {
            return Err(Error::invalid_argument(format!("{field} must be between 1 and {max}")).into());
        }
    }
    if let Some(s) = p.lost_after_s && (s <= 0 || p.kind == "bare-metal") {
        return Err(Error::invalid_argument(
            "lostAfterS must be positive, and only provider and vps-host pools may set it (bare metal is never lost automatically)",
        )
        .into());
    }
    let site = tx.query_opt("SELECT 1 FROM sites WHERE id = $1", &[&p.site_id]).await?;
    if site.is_none() {
        return Err(Error::not_found("site", &p.site_id).into());
    }
    let id = PoolId::generate().to_string();
    let r = tx
        .execute(
            "INSERT INTO pools (id, site_id, name, kind, vcpu_ratio, memory_ratio, disk_ratio, lost_after_s)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[&id, &p.site_id, &p.name, &p.kind, &p.vcpu_ratio, &p.memory_ratio, &p.disk_ratio, &p.lost_after_s],
        )
        .await
        .map_err(DbError::from);
    match r {
        Err(e) if unique_violation(&e) => Err(Error::conflict(format!("a pool named {} exists in the site", p.name)).into()),
        Err(e) => Err(e),
        Ok(_) => Ok(id),
    }
}

/// A GPU of a node being registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewGpu {
    /// Its uuid (`GPU-…`).
    pub uuid: String,
    /// Its model, e.g. `H100-80GB`.
    pub model: String,
    /// Its memory.
    pub memory_mib: i32,
    /// How it is shared.
    #[serde(flatten)]
    pub mode: GpuMode,
}

/// A node being registered with its inventory.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewNode {
    /// Its pool.
    pub pool_id: String,
    /// Its name, unique in the pool.
    pub name: String,
    /// Labels that reservations select on.
    #[serde(default)]
    pub labels: serde_json::Map<String, serde_json::Value>,
    /// vCPUs it can hand out before overcommit.
    pub vcpu: i32,
    /// Memory it can hand out before overcommit.
    pub memory_mib: i64,
    /// Disk it can hand out before overcommit.
    pub disk_gib: i64,
    /// Its GPUs, in index order.
    pub gpus: Vec<NewGpu>,
}

/// Registers a node with its GPUs (and their atoms) and resources. It has no desired state and is
/// not schedulable until adopted and converged (`observedGeneration >= 1`).
pub async fn register_node(tx: &impl GenericClient, n: &NewNode) -> Result<String, DbError> {
    if n.name.is_empty() || n.name.len() > 253 {
        return Err(Error::invalid_argument("node name must be 1 to 253 characters").into());
    }
    if n.vcpu < 0 || n.memory_mib < 0 || n.disk_gib < 0 {
        return Err(Error::invalid_argument("vcpu, memoryMib and diskGib must not be negative").into());
    }
    if n.labels.values().any(|v| !v.is_string()) {
        return Err(Error::invalid_argument("label values must be strings").into());
    }
    let mut seen = std::collections::HashSet::new();
    for g in &n.gpus {
        if g.uuid.is_empty() || g.uuid.contains('/') || !seen.insert(&g.uuid) {
            return Err(Error::invalid_argument(format!("gpu uuid {:?} is empty, has a '/', or repeats", g.uuid)).into());
        }
        if g.model.is_empty() || g.memory_mib <= 0 {
            return Err(Error::invalid_argument(format!("gpu {}: model and a positive memoryMib are required", g.uuid)).into());
        }
        g.mode.validate(g.memory_mib)?;
    }
    // Lock order: pools before nodes. The pool must exist; capacity copies its ratios to the node's
    // ledger as the node's row is inserted (capacity's resources.sql).
    tx.query_opt("SELECT 1 FROM pools WHERE id = $1 FOR SHARE", &[&n.pool_id]).await?.ok_or_else(|| Error::not_found("pool", &n.pool_id))?;
    let id = NodeId::generate().to_string();
    let labels = serde_json::Value::Object(n.labels.clone());
    let r = tx
        .execute(
            "INSERT INTO nodes (id, pool_id, name, shard, labels, vcpu, memory_mib, disk_gib) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            &[&id, &n.pool_id, &n.name, &shard_of(&id), &labels, &n.vcpu, &n.memory_mib, &n.disk_gib],
        )
        .await
        .map_err(DbError::from);
    if let Err(e) = r {
        return Err(if unique_violation(&e) { Error::conflict(format!("a node named {} exists in the pool", n.name)).into() } else { e });
    }
    for (i, g) in n.gpus.iter().enumerate() {
        let r = tx
            .execute(
                "INSERT INTO devices (id, node_id, kind, index, model, memory_mib, mode, mig_layout, slots)
                 VALUES ($1, $2, 'gpu', $3, $4, $5, $6, $7, $8)",
                &[&g.uuid, &id, &(i as i16), &g.model, &g.memory_mib, &g.mode.name(), &g.mode.mig_layout(), &g.mode.slots()],
            )
            .await
            .map_err(DbError::from);
        if let Err(e) = r {
            return Err(if unique_violation(&e) { Error::conflict(format!("gpu {} is already registered", g.uuid)).into() } else { e });
        }
        insert_children(tx, &id, &g.uuid, &g.model, g.memory_mib, &g.mode).await?;
    }
    outbox::emit(tx, NewEvent { event_type: "node.registered", tenant_id: None, subject: &id, data: serde_json::json!({"poolId": n.pool_id, "name": n.name}) }).await?;
    Ok(id)
}

/// Inserts, or re-activates, the child atoms of a GPU in `mode`.
pub(crate) async fn insert_children(
    tx: &impl GenericClient,
    node_id: &str,
    uuid: &str,
    model: &str,
    memory_mib: i32,
    mode: &GpuMode,
) -> Result<(), DbError> {
    for c in mode.child_atoms(uuid, memory_mib) {
        tx.execute(
            "INSERT INTO devices (id, node_id, parent_id, kind, index, model, profile, memory_mib, active)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, true)
             ON CONFLICT (id) DO UPDATE SET kind = EXCLUDED.kind, profile = EXCLUDED.profile,
               memory_mib = EXCLUDED.memory_mib, active = true, version = devices.version + 1",
            &[&c.id, &node_id, &uuid, &c.kind, &c.index, &model, &c.profile, &c.memory_mib],
        )
        .await?;
    }
    Ok(())
}

/// Replaces a GPU's mode: retires its old child atoms and activates those of `mode`. The caller
/// (capacity's mode change) has locked the GPU and proven nothing on it is booked.
pub async fn replace_mode(tx: &impl GenericClient, uuid: &str, mode: &GpuMode) -> Result<String, DbError> {
    let row = tx
        .query_opt("SELECT node_id, model, memory_mib FROM devices WHERE id = $1 AND parent_id IS NULL", &[&uuid])
        .await?
        .ok_or_else(|| Error::not_found("gpu", uuid))?;
    let (node_id, model, memory_mib): (String, String, i32) = (row.get(0), row.get(1), row.get(2));
    mode.validate(memory_mib)?;
    tx.execute("UPDATE devices SET active = false, version = version + 1 WHERE parent_id = $1 AND active", &[&uuid]).await?;
    tx.execute(
        "UPDATE devices SET mode = $2, mig_layout = $3, slots = $4, version = version + 1 WHERE id = $1",
        &[&uuid, &mode.name(), &mode.mig_layout(), &mode.slots()],
    )
    .await?;
    insert_children(tx, &node_id, uuid, &model, memory_mib, mode).await?;
    Ok(node_id)
}

/// Adoption: the node gets desired state, generation 1. Idempotent.
pub async fn adopt(tx: &impl GenericClient, node_id: &str) -> Result<i64, DbError> {
    let row = tx
        .query_opt(
            "UPDATE nodes SET generation = GREATEST(generation, 1), version = version + 1 WHERE id = $1 RETURNING generation",
            &[&node_id],
        )
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    better_compute_runtime::desired::invalidate(tx, node_id).await?;
    Ok(row.get(0))
}

/// Records a daemon's report of the generation it has applied. The stored value only moves up, so a
/// late, lower report never moves it back. Returns the stored value.
pub async fn report_observed_generation(tx: &impl GenericClient, node_id: &str, observed: i64) -> Result<i64, DbError> {
    if observed < 0 {
        return Err(Error::invalid_argument("observedGeneration must not be negative").into());
    }
    let row = tx
        .query_opt(
            "UPDATE nodes SET observed_generation = GREATEST(observed_generation, $2),
                    version = version + CASE WHEN observed_generation < $2 THEN 1 ELSE 0 END
              WHERE id = $1 RETURNING observed_generation",
            &[&node_id, &observed],
        )
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    Ok(row.get(0))
}

/// A node as operators and tenants with access see it.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    /// `node_…`.
    pub id: String,
    /// Its pool.
    pub pool_id: String,
    /// Its name.
    pub name: String,
    /// Its labels.
    pub labels: serde_json::Value,
    /// Its taints.
    pub taints: serde_json::Value,
    /// Why the placer skips it.
    pub no_schedule_reasons: Vec<String>,
    /// connected, disconnected, unreachable or lost.
    #[schemars(extend("enum" = ["connected", "disconnected", "unreachable", "lost"]))]
    pub liveness: String,
    /// The desired-state generation.
    pub generation: i64,
    /// The highest generation the daemon reported applied.
    pub observed_generation: i64,
    /// Each condition that holds, with its reason and since when.
    pub conditions: Vec<crate::conditions::Condition>,
    /// The record's version.
    pub version: i64,
}

/// The columns of a [`NodeView`], in [`node_view`]'s order.
pub(crate) const NODE_VIEW: &str =
    "SELECT id, pool_id, name, labels, taints, no_schedule_reasons, liveness, generation, observed_generation, version, nodes_conditions_seen(nodes) FROM nodes";

/// Reads a node.
pub async fn get_node(db: &impl GenericClient, node_id: &str) -> Result<NodeView, DbError> {
    let r = db
        .query_opt(&format!("{NODE_VIEW} WHERE id = $1"), &[&node_id])
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    Ok(node_view(&r))
}

/// A [`NODE_VIEW`] row as a [`NodeView`].
pub(crate) fn node_view(r: &tokio_postgres::Row) -> NodeView {
    NodeView {
        id: r.get(0),
        pool_id: r.get(1),
        name: r.get(2),
        labels: r.get(3),
        taints: r.get(4),
        no_schedule_reasons: r.get(5),
        liveness: r.get(6),
        generation: r.get(7),
        observed_generation: r.get(8),
        conditions: serde_json::from_value(r.get(10)).unwrap_or_default(),
        version: r.get(9),
    }
}

/// The pool's kind (`bare-metal`, `provider` or `vps-host`); NOT_FOUND when there is no such pool.
pub async fn pool_kind(db: &impl GenericClient, pool_id: &str) -> Result<String, DbError> {
    db.query_opt("SELECT kind FROM pools WHERE id = $1", &[&pool_id]).await?.map(|r| r.get(0)).ok_or_else(|| Error::not_found("pool", pool_id).into())
}

/// Which of `node_ids` are in `vps-host` pools.
pub async fn vps_hosts(db: &impl GenericClient, node_ids: &[String]) -> Result<Vec<String>, DbError> {
    let rows = db.query("SELECT n.id FROM nodes n JOIN pools p ON p.id = n.pool_id WHERE n.id = ANY($1) AND p.kind = 'vps-host'", &[&node_ids]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// What a vps-host node last reported of its instances, against its desired state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostInstances {
    /// The node's desired-state generation.
    pub generation: i64,
    /// The highest generation it has applied.
    pub observed_generation: i64,
    /// The instances its stored desired state names.
    pub desired: Vec<String>,
    /// What it reported of each instance it has (proto3 JSON of `InstanceObserved`), by id.
    pub observed: std::collections::BTreeMap<String, serde_json::Value>,
}

/// [`HostInstances`] of one node (empty when the node does not exist).
pub async fn host_instances(db: &impl GenericClient, node_id: &str) -> Result<HostInstances, DbError> {
    let Some(r) = db
        .query_opt(
            "SELECT generation, observed_generation,
                    coalesce((SELECT array_agg(i->>'instanceId') FROM jsonb_array_elements(spec->'instances'->'instances') i), '{}'),
                    coalesce(spec_status->'instances', '[]')
               FROM nodes WHERE id = $1",
            &[&node_id],
        )
        .await?
    else {
        return Ok(HostInstances::default());
    };
    let observed: serde_json::Value = r.get(3);
    Ok(HostInstances {
        generation: r.get(0),
        observed_generation: r.get(1),
        desired: r.get(2),
        observed: observed
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|o| Some((o.get("instanceId")?.as_str()?.to_owned(), o.clone())))
            .collect(),
    })
}
