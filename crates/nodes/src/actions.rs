//! Operator actions that change whether the placer may use a node or GPU. Each is one update of
//! the row the placer locks `FOR SHARE`, so a placement and an action are strictly ordered.

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::outbox::{self, NewEvent};
use tokio_postgres::GenericClient;

/// The reason a cordon adds to `noScheduleReasons`.
pub const CORDONED: &str = "cordoned";
/// The reason liveness `unreachable` adds.
pub const UNREACHABLE: &str = "unreachable";
/// The reason liveness `lost` adds.
pub const LOST: &str = "lost";
/// The reason an open drain adds (see [`crate::drain`]).
pub const DRAINING: &str = "draining";
/// The reason a retired node has for ever.
pub const RETIRED: &str = "retired";

/// Writes a fleet event about a node.
pub(crate) async fn node_event(tx: &impl GenericClient, node_id: &str, event_type: &str, data: serde_json::Value) -> Result<(), DbError> {
    outbox::emit(tx, NewEvent { event_type, tenant_id: None, subject: node_id, data }).await?;
    Ok(())
}

pub(crate) async fn set_reason(tx: &impl GenericClient, node_id: &str, reason: &str, on: bool) -> Result<bool, DbError> {
    let row = tx
        .query_opt(
            "WITH old AS (SELECT no_schedule_reasons AS r FROM nodes WHERE id = $1 FOR UPDATE)
             UPDATE nodes n SET
                no_schedule_reasons = CASE WHEN $3 THEN
                    (SELECT array_agg(DISTINCT x ORDER BY x) FROM unnest(n.no_schedule_reasons || $2::text) x)
                  ELSE array_remove(n.no_schedule_reasons, $2) END,
                version = n.version + 1
               FROM old WHERE n.id = $1
             RETURNING ($2 = ANY(old.r)) <> $3",
            &[&node_id, &reason, &on],
        )
        .await?
        .ok_or_else(|| Error::not_found("node", node_id))?;
    Ok(row.get(0))
}

/// Cordons a node: the placer skips it from the moment this commits. Returns whether it changed.
pub async fn cordon(tx: &impl GenericClient, node_id: &str) -> Result<bool, DbError> {
    let changed = set_reason(tx, node_id, CORDONED, true).await?;
    if changed {
        node_event(tx, node_id, "node.cordoned", serde_json::json!({})).await?;
    }
    Ok(changed)
}

/// Uncordons a node.
pub async fn uncordon(tx: &impl GenericClient, node_id: &str) -> Result<bool, DbError> {
    let changed = set_reason(tx, node_id, CORDONED, false).await?;
    if changed {
        node_event(tx, node_id, "node.uncordoned", serde_json::json!({})).await?;
    }
    Ok(changed)
}

fn valid_taint_key(key: &str) -> Result<(), Error> {
    if key.is_empty() || key.chars().count() > better_compute_core::bounds::KEY_CHARS || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::invalid_argument(format!("taint key must be 1 to {} characters without spaces", better_compute_core::bounds::KEY_CHARS)));
    }
    Ok(())
}

/// Taints a node with `key=value` (replacing a taint of the same key): only reservations that
/// tolerate it are placed there.
pub async fn taint(tx: &impl GenericClient, node_id: &str, key: &str, value: &str) -> Result<(), DbError> {
    valid_taint_key(key)?;
    better_compute_core::bounds::check_text("value", value, better_compute_core::bounds::VALUE_CHARS)?;
    let n = tx
        .execute(
            "UPDATE nodes SET taints = (SELECT coalesce(jsonb_agg(t), '[]') FROM jsonb_array_elements(taints) t
                                         WHERE t->>'key' <> $2) || jsonb_build_array(jsonb_build_object('key', $2::text, 'value', $3::text)),
                    version = version + 1
              WHERE id = $1",
            &[&node_id, &key, &value],
        )
        .await?;
    if n == 0 {
        return Err(Error::not_found("node", node_id).into());
    }
    node_event(tx, node_id, "node.tainted", serde_json::json!({"key": key, "value": value})).await
}

/// Removes the taint with `key`.
pub async fn untaint(tx: &impl GenericClient, node_id: &str, key: &str) -> Result<(), DbError> {
    valid_taint_key(key)?;
    let n = tx
        .execute(
            "UPDATE nodes SET taints = (SELECT coalesce(jsonb_agg(t), '[]') FROM jsonb_array_elements(taints) t
                                         WHERE t->>'key' <> $2),
                    version = version + 1
              WHERE id = $1",
            &[&node_id, &key],
        )
        .await?;
    if n == 0 {
        return Err(Error::not_found("node", node_id).into());
    }
    node_event(tx, node_id, "node.untainted", serde_json::json!({"key": key})).await
}

/// Sets a node's liveness, since now and with no extra disconnect grace; `unreachable` and `lost`
/// join `noScheduleReasons`, and leave it when the node is connected again. Nothing is released.
pub async fn set_liveness(tx: &impl GenericClient, node_id: &str, liveness: &str) -> Result<(), DbError> {
    if !["connected", "disconnected", "unreachable", "lost"].contains(&liveness) {
        return Err(Error::invalid_argument("liveness must be connected, disconnected, unreachable or lost").into());
    }
    let n = tx
        .execute(
            "UPDATE nodes SET liveness = $2, liveness_since = compute_now(), disconnect_grace_s = 0, version = version + 1 WHERE id = $1",
            &[&node_id, &liveness],
        )
        .await?;
    if n == 0 {
        return Err(Error::not_found("node", node_id).into());
    }
    set_reason(tx, node_id, UNREACHABLE, liveness == "unreachable").await?;
    set_reason(tx, node_id, LOST, liveness == "lost").await?;
    node_event(tx, node_id, &format!("node.{liveness}"), serde_json::json!({})).await
}

async fn update_gpu(tx: &impl GenericClient, uuid: &str, set: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> Result<String, DbError> {
    let sql = format!("UPDATE devices SET {set}, version = version + 1 WHERE id = $1 AND parent_id IS NULL RETURNING node_id");
    let row = tx.query_opt(&sql, params).await?.ok_or_else(|| Error::not_found("gpu", uuid))?;
    Ok(row.get(0))
}

/// Forces a GPU's health, past the `health` job's state machine (tests and the simulator's fault
/// injection; daemons' reports go through [`crate::health::record`]). An unhealthy GPU (and every
/// atom of it) leaves placement.
pub async fn set_gpu_health(tx: &impl GenericClient, uuid: &str, healthy: bool) -> Result<(), DbError> {
    let node = update_gpu(
        tx,
        uuid,
        "healthy = $2, health_state = CASE WHEN $2 THEN 'healthy' ELSE 'unhealthy' END, health_since = compute_now(),
         health_reason = 'forced', clean_checks = 0, next_check_at = NULL, check_command_id = NULL",
        &[&uuid, &healthy],
    )
    .await?;
    let t = if healthy { "device.healthy" } else { "device.unhealthy" };
    outbox::emit(tx, NewEvent { event_type: t, tenant_id: None, subject: uuid, data: serde_json::json!({"nodeId": node}) }).await?;
    Ok(())
}

/// Quarantines a GPU: the placer skips it and every atom of it until released. Existing
/// reservations keep it.
pub async fn quarantine(tx: &impl GenericClient, uuid: &str, reason: &str) -> Result<(), DbError> {
    if reason.trim().is_empty() {
        return Err(Error::invalid_argument("a quarantine needs a reason").into());
    }
    better_compute_core::bounds::check_text("reason", reason, better_compute_core::bounds::NOTE_CHARS)?;
    let node = update_gpu(tx, uuid, "quarantined = true, quarantine_reason = $2", &[&uuid, &reason]).await?;
    outbox::emit(tx, NewEvent { event_type: "device.quarantined", tenant_id: None, subject: uuid, data: serde_json::json!({"nodeId": node, "reason": reason}) }).await?;
    Ok(())
}

/// Releases a GPU from quarantine. A GPU the `health` job found unhealthy is checked again and
/// comes back after clean checks (see [`crate::health`]).
pub async fn release_quarantine(tx: &impl GenericClient, uuid: &str) -> Result<(), DbError> {
    crate::health::on_release(tx, uuid).await?;
    let node = update_gpu(tx, uuid, "quarantined = false, quarantine_reason = NULL", &[&uuid]).await?;
    outbox::emit(tx, NewEvent { event_type: "device.released", tenant_id: None, subject: uuid, data: serde_json::json!({"nodeId": node}) }).await?;
    Ok(())
}
