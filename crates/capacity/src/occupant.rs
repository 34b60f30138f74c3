//! Reservations as what holds a node, for the nodes module's drains
//! ([`better_compute_runtime::occupancy`]): a reservation placed or active on a node holds it.

use better_compute_db::DbError;
use better_compute_runtime::occupancy::{NodeOccupant, Occupancy};
use better_compute_runtime::outbox::{self, NewEvent};
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
        // Every reservation's row first, in id order, then each ends (quota, the node's scalars,
        // bookings) in tenant order, the order quota rows are taken in everywhere.
        let rows = tx
            .query(
                "WITH locked AS (SELECT id, tenant_id FROM reservations WHERE node_id = $1 AND state IN ('placed', 'active') ORDER BY id FOR UPDATE)
                 UPDATE reservations r SET end_reason = $2 FROM locked l WHERE r.id = l.id RETURNING r.id, r.tenant_id",
                &[&node_id, &reason],
            )
            .await?;
        let mut ids: Vec<(String, String)> = rows.iter().map(|r| (r.get(1), r.get(0))).collect();
        ids.sort();
        for (_, id) in &ids {
            let (event_id, shard) = crate::reservations::change_ids(id);
            tx.query_one("SELECT capacity_end($1, NULL, 'released', $2, $3)", &[id, &event_id, &shard]).await?;
        }
        Ok(ids.len() as u64)
    }
}
