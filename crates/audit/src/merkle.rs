//! The Merkle tree of the audit log, as Certificate Transparency defines it (RFC 6962 §2.1, RFC
//! 9162 §2.1): leaves hashed `SHA-256(0x00 || entry)`, nodes `SHA-256(0x01 || left || right)`, a
//! tree of `n` leaves split at the largest power of two below `n`. A [`Frontier`] keeps only the
//! roots of the perfect subtrees the tree is made of (one per set bit of its size), so a checkpoint
//! extends the last one in `O(new entries · log n)` without reading the old entries; proofs read
//! the leaf hashes.

use sha2::{Digest, Sha256};

/// A SHA-256 digest.
pub type Hash = [u8; 32];

/// The hash of a leaf's data.
pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

/// The hash of an inner node.
pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The root of an empty tree.
pub fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

/// The largest power of two below `n` (`n` ≥ 2).
fn split(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// The root over `leaves` (leaf hashes).
pub fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n);
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// The perfect subtrees' roots of a tree, left to right: what extends it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frontier {
    size: u64,
    /// Roots of perfect subtrees, largest (leftmost) first; their heights are the set bits of
    /// `size`, high to low.
    subtrees: Vec<Hash>,
}

impl Frontier {
    /// The frontier of a stored tree: `subtrees` must be one per set bit of `size`.
    pub fn from_parts(size: u64, subtrees: Vec<Hash>) -> Option<Frontier> {
        (size.count_ones() as usize == subtrees.len()).then_some(Frontier { size, subtrees })
    }

    /// Leaves in the tree.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The perfect subtrees' roots, to store.
    pub fn subtrees(&self) -> &[Hash] {
        &self.subtrees
    }

    /// Appends a leaf (its hash).
    pub fn push(&mut self, leaf: Hash) {
        let mut h = leaf;
        // Each trailing set bit of the old size is a subtree of the new one's height: merge.
        let mut size = self.size;
        while size & 1 == 1 {
            let left = self.subtrees.pop().expect("a subtree per set bit");
            h = node_hash(&left, &h);
            size >>= 1;
        }
        self.subtrees.push(h);
        self.size += 1;
    }

    /// The tree's root.
    pub fn root(&self) -> Hash {
        let mut it = self.subtrees.iter().rev();
        let Some(last) = it.next() else { return empty_root() };
        it.fold(*last, |right, left| node_hash(left, &right))
    }
}

/// The inclusion proof of leaf `index` in the tree of `leaves` (RFC 6962 `PATH`).
pub fn inclusion_proof(index: usize, leaves: &[Hash]) -> Vec<Hash> {
    let n = leaves.len();
    if n <= 1 {
        return Vec::new();
    }
    let k = split(n);
    if index < k {
        let mut p = inclusion_proof(index, &leaves[..k]);
        p.push(root(&leaves[k..]));
        p
    } else {
        let mut p = inclusion_proof(index - k, &leaves[k..]);
        p.push(root(&leaves[..k]));
        p
    }
}

/// Whether `proof` shows leaf `leaf` at `index` in a tree of `size` leaves with root `root` (RFC
/// 9162 §2.1.3.2).
pub fn verify_inclusion(index: u64, size: u64, leaf: &Hash, proof: &[Hash], root: &Hash) -> bool {
    if index >= size {
        return false;
    }
    let (mut f, mut s) = (index, size - 1);
    let mut r = *leaf;
    for p in proof {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            r = node_hash(p, &r);
            while f & 1 == 0 && f != 0 {
                f >>= 1;
                s >>= 1;
            }
        } else {
            r = node_hash(&r, p);
        }
        f >>= 1;
        s >>= 1;
    }
    s == 0 && r == *root
}

/// The consistency proof of the tree of the first `first` leaves with the tree of all `leaves`
/// (RFC 6962 `PROOF`).
pub fn consistency_proof(first: usize, leaves: &[Hash]) -> Vec<Hash> {
    fn sub(m: usize, leaves: &[Hash], whole: bool) -> Vec<Hash> {
        let n = leaves.len();
        if m == n {
            return if whole { Vec::new() } else { vec![root(leaves)] };
        }
        let k = split(n);
        if m <= k {
            let mut p = sub(m, &leaves[..k], whole);
            p.push(root(&leaves[k..]));
            p
        } else {
            let mut p = sub(m - k, &leaves[k..], false);
            p.push(root(&leaves[..k]));
            p
        }
    }
    if first == 0 || first > leaves.len() {
        return Vec::new();
    }
    sub(first, leaves, true)
}

/// Whether `proof` shows the tree of `first` leaves (root `first_root`) is a prefix of the tree of
/// `second` leaves (root `second_root`) (RFC 9162 §2.1.4.2).
pub fn verify_consistency(first: u64, second: u64, first_root: &Hash, second_root: &Hash, proof: &[Hash]) -> bool {
    if first > second {
        return false;
    }
    if first == second {
        return proof.is_empty() && first_root == second_root;
    }
    if first == 0 {
        return proof.is_empty();
    }
    let mut path = proof.to_vec();
    if first.is_power_of_two() {
        path.insert(0, *first_root);
    }
    let Some((head, rest)) = path.split_first() else { return false };
    let (mut f, mut s) = (first - 1, second - 1);
    while f & 1 == 1 {
        f >>= 1;
        s >>= 1;
    }
    let (mut fr, mut sr) = (*head, *head);
    for c in rest {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            while f & 1 == 0 && f != 0 {
                f >>= 1;
                s >>= 1;
            }
        } else {
            sr = node_hash(&sr, c);
        }
        f >>= 1;
        s >>= 1;
    }
    fr == *first_root && sr == *second_root && s == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Hash> {
        (0..n).map(|i| leaf_hash(format!("entry {i}").as_bytes())).collect()
    }

    #[test]
    fn the_frontier_extends_to_the_same_root_as_the_whole_tree_at_every_size() {
        let all = leaves(70);
        let mut f = Frontier::default();
        assert_eq!(f.root(), empty_root());
        assert_eq!(hex::encode(empty_root()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        for (i, l) in all.iter().enumerate() {
            f.push(*l);
            assert_eq!(f.root(), root(&all[..=i]), "size {}", i + 1);
            assert_eq!(f.subtrees().len(), (i + 1).count_ones() as usize);
        }
        let again = Frontier::from_parts(f.size(), f.subtrees().to_vec()).unwrap();
        assert_eq!(again.root(), f.root());
        assert!(Frontier::from_parts(3, vec![[0; 32]]).is_none());
        // Two leaves: the node of their hashes, as RFC 6962 defines it.
        assert_eq!(root(&all[..2]), node_hash(&all[0], &all[1]));
    }

    #[test]
    fn every_inclusion_and_consistency_proof_verifies_and_a_changed_one_does_not() {
        let all = leaves(23);
        for n in 1..=all.len() {
            let r = root(&all[..n]);
            for i in 0..n {
                let p = inclusion_proof(i, &all[..n]);
                assert!(verify_inclusion(i as u64, n as u64, &all[i], &p, &r), "leaf {i} of {n}");
                let other = if i + 1 < n { all[i + 1] } else { all[0] };
                assert!(n == 1 || !verify_inclusion(i as u64, n as u64, &other, &p, &r), "another leaf at {i} of {n}");
                if let Some(first) = p.first() {
                    let mut bad = p.clone();
                    bad[0] = node_hash(first, first);
                    assert!(!verify_inclusion(i as u64, n as u64, &all[i], &bad, &r));
                }
            }
            for m in 1..=n {
                let p = consistency_proof(m, &all[..n]);
                assert!(verify_consistency(m as u64, n as u64, &root(&all[..m]), &r, &p), "{m} of {n}");
                if m < n {
                    let mut forked = all[..n].to_vec();
                    forked[m - 1] = leaf_hash(b"rewritten");
                    assert!(!verify_consistency(m as u64, n as u64, &root(&all[..m]), &root(&forked), &p), "a rewritten history: {m} of {n}");
                }
            }
        }
    }
}
