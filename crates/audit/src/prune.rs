//! Retention: placed entries older than the retention are pruned, but only below a checkpoint,
//! which stays as the anchor an export starts from. Its chain hash and frontier (the perfect
//! subtrees' roots) let a verifier go on from it exactly as from the entries pruned, and its
//! signature proves them. `audit.checkpoint` prunes after it places, at most
//! [`MAX_PRUNED_PER_RUN`] entries a run.

use better_compute_db::DbError;
use tokio_postgres::GenericClient;

use crate::checkpoint::{checkpoint_of, CHECKPOINT_COLUMNS};
use crate::verify::Anchor;

/// Entries pruned per run at most.
pub const MAX_PRUNED_PER_RUN: i64 = 50_000;

/// Keeps placed entries `retention_s` (at least an hour) after their checkpoint, or for ever (`None`).
pub async fn set_retention_s(db: &impl GenericClient, retention_s: Option<i32>) -> Result<(), DbError> {
    if retention_s.is_some_and(|s| s < 3600) {
        return Err(better_compute_core::Error::invalid_argument("the audit log's retention is at least 3600 s").into());
    }
    db.execute("UPDATE audit_settings SET retention_s = $1", &[&retention_s]).await?;
    Ok(())
}

/// The retention (`None`: for ever) and the log index below which entries were pruned.
pub async fn retention(db: &impl GenericClient) -> Result<(Option<i32>, i64), DbError> {
    let r = db.query_one("SELECT retention_s, pruned_below FROM audit_settings", &[]).await?;
    Ok((r.get(0), r.get(1)))
}

/// Prunes, in the caller's transaction, the entries below the newest checkpoint that is older than
/// the retention (and at most [`MAX_PRUNED_PER_RUN`] past what was pruned); how many went.
pub async fn prune(tx: &impl GenericClient) -> Result<u64, DbError> {
    let r = tx.query_one("SELECT retention_s, pruned_below FROM audit_settings FOR UPDATE", &[]).await?;
    let (retention_s, below): (Option<i32>, i64) = (r.get(0), r.get(1));
    let Some(retention_s) = retention_s else { return Ok(0) };
    let anchor: Option<i64> = tx
        .query_one(
            "SELECT max(tree_size) FROM audit_checkpoints
              WHERE at < compute_now() - make_interval(secs => $1) AND tree_size > $2 AND tree_size <= $2 + $3",
            &[&f64::from(retention_s), &below, &MAX_PRUNED_PER_RUN],
        )
        .await?
        .get(0);
    let Some(anchor) = anchor else { return Ok(0) };
    tx.execute("UPDATE audit_settings SET pruned_below = $1", &[&anchor]).await?;
    // The guard lets this transaction delete below the anchor, and nothing else.
    tx.execute("SELECT set_config('better_compute.audit_prune', 'on', true)", &[]).await?;
    let n = tx.execute("DELETE FROM audit_entries WHERE log_index >= $1 AND log_index < $2", &[&below, &anchor]).await?;
    tx.execute("SELECT set_config('better_compute.audit_prune', 'off', true)", &[]).await?;
    Ok(n)
}

/// The checkpoint entries were pruned below, with its frontier: where an export starts.
pub async fn anchor(db: &impl GenericClient) -> Result<Option<Anchor>, DbError> {
    let row = db
        .query_opt(
            &format!(
                "SELECT {CHECKPOINT_COLUMNS}, ARRAY(SELECT encode(f, 'hex') FROM unnest(c.frontier) f) FROM audit_checkpoints c
                  WHERE c.tree_size = (SELECT pruned_below FROM audit_settings)"
            ),
            &[],
        )
        .await?;
    Ok(row.map(|r| Anchor { checkpoint: checkpoint_of(&r), frontier: r.get(6) }))
}
