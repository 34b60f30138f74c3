//! A small seeded generator for workloads that must replay from a seed (the capacity torture
//! test, the simulator): SplitMix64, not for anything secret.

/// SplitMix64: the state is the seed; the same seed gives the same sequence.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn the_same_seed_replays_the_same_sequence_and_below_stays_below() {
        let (mut a, mut b) = (Rng(7), Rng(7));
        let xs: Vec<u64> = (0..100).map(|_| a.below(10)).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.below(10)).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|x| *x < 10));
        assert_ne!(Rng(7).next(), Rng(8).next());
        assert_eq!(Rng(1).below(0), 0);
    }
}
