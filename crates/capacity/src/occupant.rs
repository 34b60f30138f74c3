//! Reservations as what holds a node, for the nodes module's drains
//! ([`better_compute_runtime::occupancy`]): a reservation placed or active on a node holds it.

use better_compute_db::DbError;
use better_compute_runtime::occupancy::{NodeOccupant, Occupancy};
use better_compute_runtime::outbox::{self, NewEvent};
use serde::Serialize;
use tokio_postgres::Transaction;

/// The reservations on a node.
pub struct ReservationOccupant;

#[async_trait::async_trait]
impl NodeOccupant for ReservationOccupant {
    fn name(&self) -> &'static str {
        "reservations"
    }

    async fn occupancy(&self, tx: &Transaction<'_>, node_id: &str) -> Result<Occupancy, DbError> {
        let r = tx
            .query_one(
                "SELECT count(*), extract(epoch FROM min(upper(during)) - compute_now())::float8
                   FROM reservations WHERE node_id = $1 AND state IN ('placed', 'active')",
                &[&node_id],
            )
            .await?;
        Ok(Occupancy { holding: r.get(0), next_end_s: r.get(1) })
    }

    async fn holds_device(&self, tx: &Transaction<'_>, device_id: &str) -> Result<bool, DbError> {
        let r = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM devices a JOIN device_bookings b ON b.device_id = a.id
                                 WHERE (a.id = $1 OR a.parent_id = $1)
                                   AND b.during && tstzrange(compute_now(), compute_now() + interval '10 minutes'))",
                &[&device_id],
            )
            .await?;
        Ok(r.get(0))
    }

    async fn request_eviction(&self, tx: &Transaction<'_>, node_id: &str, deadline: &str, reason: &str) -> Result<u64, DbError> {
        let rows = tx
            .query("SELECT id, tenant_id FROM reservations WHERE node_id = $1 AND state IN ('placed', 'active') ORDER BY id", &[&node_id])
            .await?;
        let data = serde_json::json!({"nodeId": node_id, "deadline": deadline, "reason": reason});
        let events: Vec<NewEvent<'_>> = rows
            .iter()
            .map(|r| NewEvent { event_type: "reservation.evictionRequested", tenant_id: Some(r.get(1)), subject: r.get(0), data: data.clone() })
            .collect();
        outbox::emit_many(tx, &events).await?;
        Ok(events.len() as u64)
    }

    async fn evict(&self, tx: &Transaction<'_>, node_id: &str, reason: &str) -> Result<u64, DbError> {
        // The lock order: every reservation's row, in id order, then the quota rows all of them
        // refund, then each ends (the node's scalars, bookings, wake-ups).
        let rows = tx
            .query(
                "WITH locked AS (SELECT id, tenant_id FROM reservations WHERE node_id = $1 AND state IN ('placed', 'active') ORDER BY id FOR UPDATE)
                 UPDATE reservations r SET end_reason = $2 FROM locked l WHERE r.id = l.id RETURNING r.id, r.tenant_id",
                &[&node_id, &reason],
            )
            .await?;
        let ids: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        let just_ids: Vec<&str> = ids.iter().map(|(id, _)| id.as_str()).collect();
        tx.execute("SELECT capacity_lock_refunds_of($1)", &[&just_ids]).await?;
        for (id, tenant) in &ids {
            let (event_id, shard) = crate::reservations::change_ids(id);
            tx.query_one("SELECT capacity_end($1, NULL, 'released', $2, $3)", &[id, &event_id, &shard]).await?;
            better_compute_audit::Actor::job("drain").record(tx, "reservations.evict", id, Some(tenant)).await?;
        }
        Ok(ids.len() as u64)
    }
}

/// A reservation holding a node, as an operator's `nodes.describe` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeReservation {
    /// `res_…`.
    pub id: String,
    /// Its tenant.
    pub tenant_id: String,
    /// `placed` (it starts later) or `active`.
    pub state: String,
    /// RFC 3339.
    pub starts_at: String,
    /// RFC 3339.
    pub ends_at: String,
    /// The atoms it books.
    pub atoms: Vec<String>,
    /// Its vCPU.
    pub vcpu: i32,
    /// Its memory.
    pub memory_mib: i64,
    /// Its disk.
    pub disk_gib: i64,
}

/// The reservations holding `node_id` now and next, by start (at most `limit`).
pub async fn on_node(db: &impl tokio_postgres::GenericClient, node_id: &str, limit: i64) -> Result<Vec<NodeReservation>, DbError> {
    use better_compute_db::clock::rfc3339_sql as ts;
    let sql = format!(
        "SELECT r.id, r.tenant_id, r.state, {}, {}, r.vcpu, r.memory_mib, r.disk_gib,
                ARRAY(SELECT DISTINCT b.device_id FROM device_bookings b WHERE b.allocation_id = r.id ORDER BY 1)
           FROM reservations r WHERE r.node_id = $1 AND r.state IN ('placed', 'active')
          ORDER BY lower(r.during), r.id LIMIT $2",
        ts("lower(r.during)"),
        ts("upper(r.during)")
    );
    Ok(db
        .query(&sql, &[&node_id, &limit])
        .await?
        .iter()
        .map(|r| NodeReservation {
            id: r.get(0),
            tenant_id: r.get(1),
            state: r.get(2),
            starts_at: r.get(3),
            ends_at: r.get(4),
            vcpu: r.get(5),
            memory_mib: r.get(6),
            disk_gib: r.get(7),
            atoms: r.get(8),
        })
        .collect())
}

/// What a node has left for new reservations: scalars (within their overcommit ratios) and idle
/// atoms, by class (`kind/model[/profile]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeFree {
    /// vCPUs.
    pub vcpu: i64,
    /// Memory.
    pub memory_mib: i64,
    /// Disk.
    pub disk_gib: i64,
    /// Idle atoms by class.
    pub atoms: std::collections::BTreeMap<String, i32>,
}

/// [`NodeFree`] of a node (all zero when capacity does not know it).
pub async fn node_free(db: &impl tokio_postgres::GenericClient, node_id: &str) -> Result<NodeFree, DbError> {
    let mut free = NodeFree::default();
    if let Some(r) = db
        .query_opt(
            "SELECT (floor(vcpu_allocatable * vcpu_ratio) - vcpu_allocated)::int8, (floor(memory_mib_allocatable * memory_ratio) - memory_mib_allocated)::int8,
                    (floor(disk_gib_allocatable * disk_ratio) - disk_gib_allocated)::int8
               FROM node_resources WHERE node_id = $1",
            &[&node_id],
        )
        .await?
    {
        (free.vcpu, free.memory_mib, free.disk_gib) = (r.get(0), r.get(1), r.get(2));
    }
    for r in db.query("SELECT kind || '/' || model || coalesce(nullif('/' || profile, '/'), ''), idle FROM node_atom_counts WHERE node_id = $1 ORDER BY 1", &[&node_id]).await? {
        free.atoms.insert(r.get(0), r.get(1));
    }
    Ok(free)
}
