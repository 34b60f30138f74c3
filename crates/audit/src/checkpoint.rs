//! `audit.checkpoint`: places new entries in the log and signs what the log is.
//!
//! A singleton job, run every [`EVERY`]. A run takes the entries with no place yet that are older
//! than every running transaction (`txid < pg_snapshot_xmin`, the outbox's rule: no entry can
//! commit behind one already placed), in transaction-id then position order, at most [`BATCH`];
//! gives each its log index and chain hash (`sha256(previous || canonical entry)`); extends the last
//! checkpoint's Merkle frontier with them; and writes a checkpoint: the tree's size, root and last
//! chain hash, signed with the control plane's Ed25519 key. Log indexes and checkpoint sizes are
//! unique, so a zombie's run that raced this one cannot commit a second placement. Then it prunes
//! what is past the retention (`prune.rs`).

use std::time::Duration;

use better_compute_db::DbError;
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::entry::{canonical, chain_hash, entry_of, COLUMNS};
use crate::merkle::{leaf_hash, Frontier, Hash};

/// How often it runs.
pub const EVERY: Duration = Duration::from_secs(10);
/// Entries placed per run; more makes it run again at once.
pub const BATCH: i64 = 5000;

/// What a checkpoint's signature covers.
pub fn signed_message(tree_size: i64, root: &[u8], chain: &[u8]) -> Vec<u8> {
    format!("better-compute audit checkpoint v1\n{tree_size}\n{}\n{}\n", hex::encode(root), hex::encode(chain)).into_bytes()
}

/// A checkpoint as the API shows it and the export carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointView {
    /// Entries in the log at the checkpoint.
    pub tree_size: i64,
    /// The Merkle root over them (RFC 6962), hex.
    pub root: String,
    /// The last entry's chain hash, hex.
    pub chain_hash: String,
    /// The Ed25519 public key that signed it, hex (none: the control plane had no key).
    pub public_key: Option<String>,
    /// The signature over [`signed_message`], hex.
    pub signature: Option<String>,
    /// RFC 3339.
    pub at: String,
}

pub(crate) const CHECKPOINT_COLUMNS: &str = "tree_size, encode(root, 'hex'), encode(chain_hash, 'hex'), encode(public_key, 'hex'), encode(signature, 'hex'),
     to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

pub(crate) fn checkpoint_of(r: &tokio_postgres::Row) -> CheckpointView {
    CheckpointView { tree_size: r.get(0), root: r.get(1), chain_hash: r.get(2), public_key: r.get(3), signature: r.get(4), at: r.get(5) }
}

fn hash_of(b: &[u8]) -> Result<Hash, DbError> {
    b.try_into().map_err(|_| DbError::from(better_compute_core::Error::internal("a stored audit hash is not 32 bytes")))
}

/// What one placement did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placed {
    /// Entries placed.
    pub entries: usize,
    /// The log's size after.
    pub tree_size: i64,
}

/// Places up to `batch` entries and writes their checkpoint, in the caller's transaction, signing
/// with `signer` when there is one.
pub async fn place(tx: &impl GenericClient, batch: i64, signer: Option<&better_compute_runtime::signing::CommandSigner>) -> Result<Placed, DbError> {
    let last = tx.query_opt("SELECT tree_size, frontier, chain_hash FROM audit_checkpoints ORDER BY tree_size DESC LIMIT 1", &[]).await?;
    let (mut frontier, mut prev) = match &last {
        Some(r) => {
            let size: i64 = r.get(0);
            let subtrees = r.get::<_, Vec<Vec<u8>>>(1).iter().map(|b| hash_of(b)).collect::<Result<Vec<_>, _>>()?;
            let f = Frontier::from_parts(size as u64, subtrees).ok_or_else(|| DbError::from(better_compute_core::Error::internal("a stored audit frontier does not fit its size")))?;
            (f, hash_of(r.get::<_, &[u8]>(2))?)
        }
        None => (Frontier::default(), [0u8; 32]),
    };
    let rows = tx
        .query(
            &format!(
                "SELECT {COLUMNS} FROM audit_entries WHERE log_index IS NULL AND txid < pg_snapshot_xmin(pg_current_snapshot())
                  ORDER BY txid, position LIMIT $1 FOR UPDATE"
            ),
            &[&batch],
        )
        .await?;
    if rows.is_empty() {
        return Ok(Placed { entries: 0, tree_size: frontier.size() as i64 });
    }
    let (mut ids, mut indexes, mut hashes) = (Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()), Vec::with_capacity(rows.len()));
    for r in &rows {
        let mut e = entry_of(r);
        let index = frontier.size() as i64;
        e.log_index = Some(index);
        let h = chain_hash(&prev, &e);
        frontier.push(leaf_hash(&canonical(&e)));
        prev = h;
        ids.push(e.id);
        indexes.push(index);
        hashes.push(h.to_vec());
    }
    tx.execute(
        "UPDATE audit_entries a SET log_index = u.i, chain_hash = u.h FROM unnest($1::text[], $2::int8[], $3::bytea[]) AS u(id, i, h) WHERE a.id = u.id",
        &[&ids, &indexes, &hashes],
    )
    .await?;
    let size = frontier.size() as i64;
    let root = frontier.root();
    let (public_key, signature) = match signer {
        Some(s) => (Some(s.public_key()), Some(s.sign(&signed_message(size, &root, &prev)))),
        None => (None, None),
    };
    let subtrees: Vec<Vec<u8>> = frontier.subtrees().iter().map(|h| h.to_vec()).collect();
    tx.execute(
        "INSERT INTO audit_checkpoints (tree_size, root, chain_hash, frontier, public_key, signature) VALUES ($1, $2, $3, $4, $5, $6)",
        &[&size, &root.as_slice(), &prev.as_slice(), &subtrees, &public_key, &signature],
    )
    .await?;
    Ok(Placed { entries: rows.len(), tree_size: size })
}
