//! Shards: node- and pool-sharded work spreads over [`SHARD_COUNT`] shards, and live workers divide
//! the shards among themselves by rendezvous hashing.

/// How many shards node- and pool-sharded work is spread over.
pub const SHARD_COUNT: i16 = 256;

/// 64-bit FNV-1a, then a SplitMix64 finaliser so that nearby inputs spread well.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The shard of a node or pool id (stored as `nodes.shard`); stable forever, since the database
/// stores it.
pub fn shard_of(key: &str) -> i16 {
    (stable_hash(key.as_bytes()) % SHARD_COUNT as u64) as i16
}

/// Rendezvous (highest random weight) hashing: the worker that owns `item` among `workers`.
/// When a worker joins or leaves, only the items it wins or held move.
pub fn rendezvous_owner<'a>(workers: &'a [String], item: &str) -> Option<&'a str> {
    workers
        .iter()
        .max_by_key(|w| {
            let mut buf = Vec::with_capacity(w.len() + item.len() + 1);
            buf.extend_from_slice(w.as_bytes());
            buf.push(0);
            buf.extend_from_slice(item.as_bytes());
            (stable_hash(&buf), w.as_str())
        })
        .map(|w| w.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_in_range_and_stable() {
        for i in 0..1000 {
            let s = shard_of(&format!("node_{i}"));
            assert!((0..SHARD_COUNT).contains(&s));
        }
        assert_eq!(shard_of("node_x"), shard_of("node_x"));
    }

    #[test]
    fn rendezvous_spreads_shards_and_moves_only_the_leavers_share() {
        let three: Vec<String> = ["wrk_a", "wrk_b", "wrk_c"].map(String::from).to_vec();
        let two: Vec<String> = ["wrk_a", "wrk_b"].map(String::from).to_vec();
        let mut counts = std::collections::HashMap::new();
        for s in 0..SHARD_COUNT {
            let item = format!("shard:{s}");
            let owner3 = rendezvous_owner(&three, &item).unwrap();
            *counts.entry(owner3).or_insert(0) += 1;
            let owner2 = rendezvous_owner(&two, &item).unwrap();
            if owner3 != "wrk_c" {
                assert_eq!(owner2, owner3, "shard {s} moved although its owner stayed");
            }
        }
        for (w, n) in counts {
            assert!((50..120).contains(&n), "{w} owns {n} of 256");
        }
        assert_eq!(rendezvous_owner(&[], "x"), None);
    }
}
