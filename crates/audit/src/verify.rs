//! Verifying an export of the log without the database: the entries' chain in log order, each
//! checkpoint's Merkle root and chain hash against the entries, and its Ed25519 signature against
//! the key the verifier trusts. The first entry that does not fit is named.

use crate::checkpoint::{signed_message, CheckpointView};
use crate::entry::{canonical, chain_hash, Entry};
use crate::merkle::{self, leaf_hash, Hash};

/// One line of an export (JSON lines): an entry or a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ExportLine {
    /// An entry, in log order.
    Entry(Entry),
    /// A checkpoint, after the entries it covers.
    Checkpoint(CheckpointView),
}

/// What a verification found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verified {
    /// Entries whose chain verified.
    pub entries: u64,
    /// Checkpoints whose root, chain hash and signature verified.
    pub checkpoints: u64,
    /// The first problem, if any: what is wrong and where.
    pub problem: Option<String>,
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    hex::decode(s).ok()
}

/// Whether `sig` is `public_key`'s Ed25519 signature of `message`.
pub fn signature_ok(public_key: &[u8], message: &[u8], sig: &[u8]) -> bool {
    ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, public_key).verify(message, sig).is_ok()
}

/// Verifies `lines` (entries in log order, checkpoints after what they cover) against
/// `trusted_key` (32 bytes; none: each checkpoint's own key, which proves only that the export is
/// consistent with itself).
pub fn verify(lines: &[ExportLine], trusted_key: Option<&[u8]>) -> Verified {
    let mut out = Verified::default();
    let mut prev: Hash = [0; 32];
    let mut leaves: Vec<Hash> = Vec::new();
    let mut chains: Vec<Hash> = Vec::new();
    for line in lines {
        match line {
            ExportLine::Entry(e) => {
                let expected = leaves.len() as i64;
                if e.log_index != Some(expected) {
                    out.problem = Some(match e.log_index {
                        Some(i) if i > expected => format!("entry {} is at log index {i} but {expected} comes first: an entry is missing before it", e.id),
                        Some(i) => format!("entry {} is at log index {i} but {expected} was expected: the entries are out of order or repeated", e.id),
                        None => format!("entry {} has no place in the log (exported before audit.checkpoint placed it)", e.id),
                    });
                    return out;
                }
                let h = chain_hash(&prev, e);
                if e.chain_hash.as_deref() != Some(hex::encode(h).as_str()) {
                    out.problem = Some(format!("entry {} at log index {expected}: its chain hash does not match its content (it was changed, or its place was)", e.id));
                    return out;
                }
                prev = h;
                chains.push(h);
                leaves.push(leaf_hash(&canonical(e)));
                out.entries += 1;
            }
            ExportLine::Checkpoint(c) => {
                let size = c.tree_size as usize;
                if c.tree_size <= 0 || size > leaves.len() {
                    out.problem = Some(format!("checkpoint of size {} comes after {} entries", c.tree_size, leaves.len()));
                    return out;
                }
                if unhex(&c.root).as_deref() != Some(merkle::root(&leaves[..size]).as_slice()) {
                    out.problem = Some(format!("checkpoint of size {size}: its Merkle root is not the entries' (an entry before index {size} was changed, added or taken away)"));
                    return out;
                }
                if unhex(&c.chain_hash).as_deref() != Some(chains[size - 1].as_slice()) {
                    out.problem = Some(format!("checkpoint of size {size}: its chain hash is not entry {}'s", size - 1));
                    return out;
                }
                let key = match (trusted_key, c.public_key.as_deref().and_then(unhex)) {
                    (Some(k), Some(own)) if k != own.as_slice() => {
                        out.problem = Some(format!("checkpoint of size {size} is signed by key {}, not the trusted key", hex::encode(own)));
                        return out;
                    }
                    (_, own) => own,
                };
                let signed = match (key, c.signature.as_deref().and_then(unhex)) {
                    (Some(k), Some(sig)) => signature_ok(&k, &signed_message(c.tree_size, &merkle::root(&leaves[..size]), &chains[size - 1]), &sig),
                    _ => false,
                };
                if !signed {
                    out.problem = Some(format!("checkpoint of size {size}: its signature does not verify (or it has none)"));
                    return out;
                }
                out.checkpoints += 1;
            }
        }
    }
    out
}
