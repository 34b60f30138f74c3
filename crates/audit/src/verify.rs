//! Verifying an export of the log without the database: the entries' chain in log order, each
//! checkpoint's Merkle root and chain hash against the entries, and its Ed25519 signature against
//! the key the verifier trusts. The first entry that does not fit is named.

use crate::checkpoint::{signed_message, CheckpointView};
use crate::entry::{canonical, chain_hash, Entry};
use crate::merkle::{leaf_hash, Frontier, Hash};

/// One line of an export (JSON lines): the anchor, an entry or a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ExportLine {
    /// First, when older entries were pruned: the checkpoint they were pruned below.
    Anchor(Anchor),
    /// An entry, in log order.
    Entry(Entry),
    /// A checkpoint, after the last entry it covers.
    Checkpoint(CheckpointView),
    /// Last: how far the export reaches. Without it the export was cut short.
    End(End),
}

/// The last line of an export.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct End {
    /// The log index the export reaches: it holds every placed entry below it (from the anchor on).
    pub tree_size: i64,
}

/// The checkpoint a pruned log starts from, with the frontier to go on from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Anchor {
    /// The checkpoint.
    pub checkpoint: CheckpointView,
    /// The roots of its tree's perfect subtrees, largest first, hex.
    pub frontier: Vec<String>,
}

/// What a verification found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verified {
    /// Entries whose chain verified.
    pub entries: u64,
    /// Checkpoints whose root, chain hash and signature verified.
    pub checkpoints: u64,
    /// The log index the export says it reaches (its end line), once verified against the entries.
    pub reaches: Option<u64>,
    /// The first problem, if any: what is wrong and where. An export without its end line (cut
    /// short) is one.
    pub problem: Option<String>,
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    hex::decode(s).ok()
}

/// Whether `sig` is `public_key`'s Ed25519 signature of `message`.
pub fn signature_ok(public_key: &[u8], message: &[u8], sig: &[u8]) -> bool {
    ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, public_key).verify(message, sig).is_ok()
}

/// Checks a checkpoint's signature against `trusted_key` (none: its own key); the problem if not.
fn check_signature(c: &CheckpointView, root: &Hash, chain: &Hash, trusted_key: Option<&[u8]>) -> Option<String> {
    let size = c.tree_size;
    let own = c.public_key.as_deref().and_then(unhex);
    if let (Some(k), Some(own)) = (trusted_key, &own)
        && k != own.as_slice()
    {
        return Some(format!("checkpoint of size {size} is signed by key {}, not the trusted key", hex::encode(own)));
    }
    match (own, c.signature.as_deref().and_then(unhex)) {
        (Some(k), Some(sig)) if signature_ok(&k, &signed_message(size, root, chain), &sig) => None,
        _ => Some(format!("checkpoint of size {size}: its signature does not verify (or it has none)")),
    }
}

/// Verifies `lines` (the anchor first when the log was pruned, then entries in log order, each
/// checkpoint after the last entry it covers) against `trusted_key` (32 bytes; none: each
/// checkpoint's own key, which proves only that the export is consistent with itself).
pub fn verify(lines: &[ExportLine], trusted_key: Option<&[u8]>) -> Verified {
    let mut out = Verified::default();
    let mut prev: Hash = [0; 32];
    let mut tree = Frontier::default();
    for (i, line) in lines.iter().enumerate() {
        if out.reaches.is_some() {
            out.problem = Some(format!("line {} comes after the export's end line", i + 1));
            return out;
        }
        match line {
            ExportLine::Anchor(a) => {
                let c = &a.checkpoint;
                let subtrees: Option<Vec<Hash>> = a.frontier.iter().map(|h| unhex(h).and_then(|b| b.try_into().ok())).collect();
                let (Some(f), Some(chain)) = (subtrees.and_then(|s| Frontier::from_parts(c.tree_size as u64, s)), unhex(&c.chain_hash).and_then(|b| <Hash>::try_from(b).ok())) else {
                    out.problem = Some(format!("the anchor (checkpoint of size {}) is malformed", c.tree_size));
                    return out;
                };
                if i != 0 || unhex(&c.root).as_deref() != Some(f.root().as_slice()) {
                    out.problem = Some(format!("the anchor (checkpoint of size {}) is not first, or its frontier is not its root's", c.tree_size));
                    return out;
                }
                if let Some(p) = check_signature(c, &f.root(), &chain, trusted_key) {
                    out.problem = Some(p);
                    return out;
                }
                (tree, prev) = (f, chain);
                out.checkpoints += 1;
            }
            ExportLine::Entry(e) => {
                let expected = tree.size() as i64;
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
                tree.push(leaf_hash(&canonical(e)));
                out.entries += 1;
            }
            ExportLine::Checkpoint(c) => {
                let size = c.tree_size;
                if size != tree.size() as i64 {
                    out.problem = Some(format!("checkpoint of size {size} comes after {} entries", tree.size()));
                    return out;
                }
                if unhex(&c.root).as_deref() != Some(tree.root().as_slice()) {
                    out.problem = Some(format!("checkpoint of size {size}: its Merkle root is not the entries' (an entry before index {size} was changed, added or taken away)"));
                    return out;
                }
                if unhex(&c.chain_hash).as_deref() != Some(prev.as_slice()) {
                    out.problem = Some(format!("checkpoint of size {size}: its chain hash is not entry {}'s", size - 1));
                    return out;
                }
                if let Some(p) = check_signature(c, &tree.root(), &prev, trusted_key) {
                    out.problem = Some(p);
                    return out;
                }
                out.checkpoints += 1;
            }
            ExportLine::End(e) => {
                if e.tree_size != tree.size() as i64 {
                    out.problem = Some(format!("the export says it reaches log index {} but holds entries up to {}", e.tree_size, tree.size()));
                    return out;
                }
                out.reaches = Some(tree.size());
            }
        }
    }
    if out.reaches.is_none() {
        out.problem = Some(format!("the export has no end line: it was cut short after {} entries (export it again)", tree.size()));
    }
    out
}
