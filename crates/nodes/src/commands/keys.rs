//! Rotating the command-signing key without a rejoin. The control plane keeps the public halves of
//! its keys since the first rotation in `command_keys`; every daemon's desired state announces
//! those not retired (the `agent` section), each new one endorsed by its predecessor. A daemon pins
//! an announced key that a key it already holds endorsed, and forgets a pinned key no longer
//! announced, so during a rotation both keys verify, and after the old one is retired only the new.
//!
//! The operator's two steps (`better-compute admin command-key rotate`, then, once every node has
//! converged and the api and worker roles were restarted with the new key, `… retire-previous`) are
//! [`rotate`] and [`retire_previous`]; the key files in the CA's folder are the CLI's to move.

use better_compute_core::Error;
use better_compute_db::DbError;
use better_compute_runtime::signing::CommandSigner;
use tokio_postgres::GenericClient;

/// A key as the desired state announces it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnouncedKey {
    /// Ed25519, 32 bytes.
    pub public_key: Vec<u8>,
    /// The predecessor's endorsement (empty for the first).
    pub endorsement: Vec<u8>,
}

/// The keys daemons accept now, oldest first.
pub async fn announced(tx: &impl GenericClient) -> Result<Vec<AnnouncedKey>, DbError> {
    Ok(tx
        .query("SELECT public_key, coalesce(endorsement, '') FROM command_keys WHERE retired_at IS NULL ORDER BY position", &[])
        .await?
        .iter()
        .map(|r| AnnouncedKey { public_key: r.get(0), endorsement: r.get(1) })
        .collect())
}

/// Every node's desired state changes with the keys.
async fn announce(tx: &impl GenericClient) -> Result<u64, DbError> {
    let nodes: Vec<String> = tx.query("SELECT id FROM nodes WHERE retired_at IS NULL ORDER BY id", &[]).await?.iter().map(|r| r.get(0)).collect();
    better_compute_runtime::desired::invalidate_many(tx, &nodes).await?;
    Ok(nodes.len() as u64)
}

/// Announces `new`, endorsed by `old` (the key the fleet signs with now), beside `old`. Returns how
/// many nodes' desired state changed. Refused when another rotation has not been finished.
pub async fn rotate(tx: &impl GenericClient, old: &CommandSigner, new: &CommandSigner) -> Result<u64, DbError> {
    tx.execute("LOCK TABLE command_keys IN SHARE ROW EXCLUSIVE MODE", &[]).await?;
    let live = announced(tx).await?;
    if live.len() > 1 {
        return Err(Error::failed_precondition("a rotation is under way: retire the previous key first (better-compute admin command-key retire-previous)").into());
    }
    if live.first().is_some_and(|k| k.public_key != old.public_key()) {
        return Err(Error::failed_precondition("the key in the CA's folder is not the one the fleet accepts now; restore the folder from its backup").into());
    }
    tx.execute("INSERT INTO command_keys (public_key) VALUES ($1) ON CONFLICT DO NOTHING", &[&old.public_key()]).await?;
    let endorsement = old.sign(&better_compute_proto::command_key_endorsement_message(&new.public_key()));
    tx.execute(
        "INSERT INTO command_keys (public_key, endorsement) VALUES ($1, $2)",
        &[&new.public_key(), &endorsement],
    )
    .await?;
    announce(tx).await
}

/// Ends a rotation: every key but the newest is retired, so daemons forget them. Returns how many
/// nodes' desired state changed (0 when there was nothing to retire).
pub async fn retire_previous(tx: &impl GenericClient) -> Result<u64, DbError> {
    tx.execute("LOCK TABLE command_keys IN SHARE ROW EXCLUSIVE MODE", &[]).await?;
    let live = announced(tx).await?;
    if live.len() < 2 {
        return Ok(0);
    }
    let newest = &live[live.len() - 1].public_key;
    tx.execute("UPDATE command_keys SET retired_at = compute_now() WHERE retired_at IS NULL AND public_key <> $1", &[newest]).await?;
    announce(tx).await
}
