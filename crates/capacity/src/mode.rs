//! Changing a GPU's mode or MIG layout.
//!
//! A change books every atom of the GPU, the parent included, for the change window, so it commits
//! only when nothing on the GPU is booked; it also refuses while any booking on the GPU reaches
//! past now, since the old atoms stop existing. The new layout's atoms are booked for the window
//! too, so nothing is placed on them before the node has had time to apply it. Then the new atoms
//! replace the old, and the node's desired state (`gpus` section) changes.

use std::time::Duration;

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_nodes::inventory;
use better_compute_core::gpu_mode::GpuMode;
use better_compute_runtime::outbox::{self, NewEvent};
use better_compute_runtime::{desired, work_queue};
use tokio_postgres::Client;

use crate::ROLLUP_KIND;

/// How long the GPU is held by a change, for the node to apply it.
pub const CHANGE_WINDOW: Duration = Duration::from_secs(120);

/// The allocation id of a change's bookings: never a reservation's.
pub fn change_allocation(uuid: &str, version: i64) -> String {
    format!("change:{uuid}:{version}")
}

/// Changes GPU `uuid` to `mode`. `FAILED_PRECONDITION` while anything on it is booked.
pub async fn change_gpu_mode(client: &mut Client, actor: &better_compute_audit::Actor, uuid: &str, mode: &GpuMode) -> Result<(), Error> {
    let tx = client.transaction().await.map_err(DbError::from)?;
    // Lock order: nodes, devices. The node row FOR SHARE (an eligibility change waits), then the GPU
    // and every atom of it FOR UPDATE, so no placement can lock them FOR SHARE until we are done.
    let gpu = tx
        .query_opt(
            "SELECT d.node_id, d.version, d.memory_mib, d.mode FROM devices d JOIN nodes n ON n.id = d.node_id
              WHERE d.id = $1 AND d.parent_id IS NULL FOR SHARE OF n",
            &[&uuid],
        )
        .await
        .map_err(DbError::from)?
        .ok_or_else(|| Error::not_found("gpu", uuid))?;
    let (node_id, version, memory_mib): (String, i64, i32) = (gpu.get(0), gpu.get(1), gpu.get(2));
    mode.validate(memory_mib)?;
    let atoms: Vec<String> = tx
        .query("SELECT id FROM devices WHERE id = $1 OR parent_id = $1 ORDER BY id FOR UPDATE", &[&uuid])
        .await
        .map_err(DbError::from)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let busy = tx
        .query_opt(
            &format!(
                "SELECT b.allocation_id, {} FROM device_bookings b
                  WHERE b.device_id COLLATE \"C\" = ANY($1) AND upper(b.during) > compute_now()
                  ORDER BY upper(b.during) DESC LIMIT 1",
                better_compute_db::clock::rfc3339_sql("upper(b.during)")
            ),
            &[&atoms],
        )
        .await
        .map_err(DbError::from)?;
    if let Some(b) = busy {
        return Err(Error::failed_precondition(format!(
            "gpu {uuid} is booked (by {} until {}); release or wait for its reservations first",
            b.get::<_, String>(0),
            b.get::<_, String>(1)
        )));
    }
    // The GPU's ended change windows leave the live table for the history (capacity 0011), so a
    // GPU keeps at most its last window in the exclusion index however often it changes.
    tx.execute(
        "WITH gone AS (DELETE FROM device_bookings
                        WHERE device_id COLLATE \"C\" = ANY($1) AND allocation_id LIKE 'change:%' AND upper(during) <= compute_now()
                       RETURNING device_id, allocation_id, during)
         INSERT INTO device_booking_history (device_id, allocation_id, during) SELECT * FROM gone",
        &[&atoms],
    )
    .await
    .map_err(DbError::from)?;
    let allocation = change_allocation(uuid, version);
    let window = CHANGE_WINDOW.as_secs_f64();
    let hold = "INSERT INTO device_bookings (device_id, allocation_id, during)
                SELECT a, $2, tstzrange(compute_now(), compute_now() + make_interval(secs => $3), '[)')
                  FROM unnest($1::text[]) a
                ON CONFLICT DO NOTHING";
    let held = tx.execute(hold, &[&atoms, &allocation, &window]).await.map_err(DbError::from)?;
    if held < atoms.len() as u64 {
        return Err(Error::conflict(format!("gpu {uuid} was booked concurrently; retry")));
    }
    inventory::replace_mode(&tx, uuid, mode).await?;
    let new_atoms: Vec<String> = tx
        .query("SELECT id FROM devices WHERE parent_id = $1 AND active AND NOT (id = ANY($2))", &[&uuid, &atoms])
        .await
        .map_err(DbError::from)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    tx.execute(hold, &[&new_atoms, &allocation, &window]).await.map_err(DbError::from)?;
    tx.execute("SELECT capacity_refresh_node_counts($1)", &[&node_id]).await.map_err(DbError::from)?;
    let pool: String = tx
        .query_one("SELECT pool_id FROM nodes WHERE id = $1", &[&node_id])
        .await
        .map_err(DbError::from)?
        .get(0);
    work_queue::enqueue(&tx, &ROLLUP_KIND, &pool).await?;
    desired::invalidate(&tx, &node_id).await?;
    outbox::emit(
        &tx,
        NewEvent {
            event_type: "device.mode_changed",
            tenant_id: None,
            subject: uuid,
            data: serde_json::json!({"nodeId": node_id, "mode": mode}),
        },
    )
    .await?;
    // Its audit entry commits with the change.
    actor.record(&tx, "devices.setMode", uuid, None).await?;
    tx.commit().await.map_err(DbError::from)?;
    work_queue::poke(&*client).await;
    Ok(())
}
