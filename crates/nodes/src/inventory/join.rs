//! Node join, the database side: a daemon presents a single-use join token with its inventory; the
//! node is registered in the token's pool and adopted (generation 1) in the same transaction that
//! burns the token. The gateway signs the daemon's certificate and records it here; the newest
//! certificate is the node's `joined_at`, and a certificate's SHA-256 is how a gateway finds the
//! node behind a TLS session.

use better_compute_core::{Error, ErrorCode};
use better_compute_db::DbError;
use better_compute_proto::v1::Inventory;
use sha2::{Digest, Sha256};
use tokio_postgres::GenericClient;

use crate::inventory::{self, NewGpu, NewNode};
use better_compute_core::gpu_mode::GpuMode;

/// A node the join created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Joined {
    /// The new node.
    pub node_id: String,
    /// Its pool (the token's).
    pub pool_id: String,
}

fn unauthenticated(message: &str) -> DbError {
    Error::new(ErrorCode::Unauthenticated, message).into()
}

/// The GPUs of a reported inventory as the inventory module registers them: a GPU with MIG
/// instances in MIG mode with that layout, any other exclusive.
pub fn gpus_of(inv: &Inventory) -> Result<Vec<NewGpu>, Error> {
    inv.gpus
        .iter()
        .map(|g| {
            let memory_mib = i32::try_from(g.memory_mib).map_err(|_| Error::invalid_argument(format!("gpu {}: memoryMib is too large", g.uuid)))?;
            let mode = if g.mig_enabled && !g.mig_instances.is_empty() {
                GpuMode::Mig { layout: g.mig_instances.iter().map(|m| m.profile.clone()).collect() }
            } else {
                GpuMode::Exclusive
            };
            Ok(NewGpu { uuid: g.uuid.clone(), model: g.model.clone(), memory_mib, mode })
        })
        .collect()
}

/// Redeems a join token: registers `node_name` with `inventory` in the token's pool, adopts it and
/// burns the token, all or nothing. An unknown, used or expired token is UNAUTHENTICATED and
/// changes nothing.
pub async fn redeem(
    tx: &impl GenericClient,
    secret: &str,
    node_name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    inv: &Inventory,
) -> Result<Joined, DbError> {
    let hash: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    // Lock order: join_tokens first; the row lock makes two daemons racing on one token take turns,
    // and the second sees it used.
    let row = tx
        .query_opt(
            "SELECT id, pool_id, used_at IS NOT NULL, expires_at <= compute_now() FROM join_tokens WHERE secret_sha256 = $1 FOR UPDATE",
            &[&hash.as_slice()],
        )
        .await?
        .ok_or_else(|| unauthenticated("unknown join token; issue one with `better-compute api nodes.createJoinToken poolId=…`"))?;
    let (token_id, pool_id, used, expired): (String, String, bool, bool) = (row.get(0), row.get(1), row.get(2), row.get(3));
    if used {
        return Err(unauthenticated("this join token was already used; join tokens are single use, issue a new one"));
    }
    if expired {
        return Err(unauthenticated("this join token has expired; issue a new one"));
    }
    let vcpu = i32::try_from(inv.vcpu).map_err(|_| Error::invalid_argument("vcpu is too large"))?;
    let node = NewNode {
        pool_id: pool_id.clone(),
        name: node_name.to_owned(),
        labels: labels.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect(),
        vcpu,
        memory_mib: i64::try_from(inv.memory_mib).map_err(|_| Error::invalid_argument("memoryMib is too large"))?,
        disk_gib: i64::try_from(inv.disk_gib).map_err(|_| Error::invalid_argument("diskGib is too large"))?,
        gpus: gpus_of(inv)?,
    };
    let node_id = inventory::register_node(tx, &node).await?;
    tx.execute(
        "UPDATE nodes SET joined_at = compute_now(), liveness_since = compute_now(), reported_inventory = $2 WHERE id = $1",
        &[&node_id, &serde_json::to_value(inv).map_err(|e| Error::internal(e.to_string()))?],
    )
    .await?;
    inventory::adopt(tx, &node_id).await?;
    // Guarded: only a token nobody used, so a token can never make two nodes.
    let burned = tx
        .execute("UPDATE join_tokens SET used_at = compute_now(), used_by_node = $2 WHERE id = $1 AND used_at IS NULL", &[&token_id, &node_id])
        .await?;
    assert_eq!(burned, 1, "the token row is locked and was unused");
    Ok(Joined { node_id, pool_id })
}

/// A certificate the CA signed for a node.
#[derive(Debug, Clone)]
pub struct IssuedCertificate<'a> {
    /// SHA-256 of its DER.
    pub fingerprint: [u8; 32],
    /// Its serial, hex.
    pub serial: &'a str,
    /// Its validity, Unix seconds.
    pub not_before_unix_s: i64,
    /// Its validity, Unix seconds.
    pub not_after_unix_s: i64,
}

/// Records a certificate of `node_id`; the node's `joined_at` becomes now.
pub async fn record_certificate(tx: &impl GenericClient, node_id: &str, c: &IssuedCertificate<'_>) -> Result<(), DbError> {
    tx.execute(
        "INSERT INTO node_certificates (fingerprint_sha256, node_id, serial, not_before, not_after)
         VALUES ($1, $2, $3, to_timestamp($4), to_timestamp($5))",
        &[&c.fingerprint.as_slice(), &node_id, &c.serial, &(c.not_before_unix_s as f64), &(c.not_after_unix_s as f64)],
    )
    .await?;
    tx.execute("UPDATE nodes SET joined_at = compute_now() WHERE id = $1", &[&node_id]).await?;
    Ok(())
}

/// The node a certificate belongs to, unless it is unknown or revoked. TLS has already checked the
/// chain and the validity period.
pub async fn certificate_node(db: &impl GenericClient, fingerprint: &[u8; 32]) -> Result<Option<String>, DbError> {
    Ok(db
        .query_opt("SELECT node_id FROM node_certificates WHERE fingerprint_sha256 = $1 AND revoked_at IS NULL", &[&fingerprint.as_slice()])
        .await?
        .map(|r| r.get(0)))
}
