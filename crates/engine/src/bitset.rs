//! A fixed-size bit set with summary levels, so "the next set bit from here" costs a few word
//! reads whatever the size (used for the buckets that hold live or dirty data, so writeback
//! and checkpoints visit those buckets without scanning every bucket).
//!
//! Invariants: level 0 holds the bits; bit `w` of level `k + 1` is set exactly when word `w`
//! of level `k` is non-zero; the top level is a single word. `set`/`clear` keep the levels in
//! step, each in O(levels).

pub struct LevelBits {
    levels: Vec<Vec<u64>>,
}

impl LevelBits {
    pub fn new(len: usize) -> LevelBits {
        let mut levels = vec![vec![0u64; len.div_ceil(64).max(1)]];
        while levels.last().expect("one level").len() > 1 {
            let words = levels.last().expect("one level").len().div_ceil(64);
            levels.push(vec![0u64; words]);
        }
        LevelBits { levels }
    }

    pub fn get(&self, i: usize) -> bool {
        self.levels[0][i / 64] & (1 << (i % 64)) != 0
    }

    pub fn set(&mut self, i: usize) {
        debug_assert!(i / 64 < self.levels[0].len());
        let mut i = i;
        for level in &mut self.levels {
            let was = level[i / 64];
            level[i / 64] = was | 1 << (i % 64);
            if was != 0 {
                return;
            }
            i /= 64;
        }
    }

    pub fn clear(&mut self, i: usize) {
        let mut i = i;
        for level in &mut self.levels {
            let now = level[i / 64] & !(1 << (i % 64));
            level[i / 64] = now;
            if now != 0 {
                return;
            }
            i /= 64;
        }
    }

    /// The first set bit at or after `from`.
    pub fn next_set(&self, from: usize) -> Option<usize> {
        self.next_in(0, from)
    }

    fn next_in(&self, level: usize, from: usize) -> Option<usize> {
        let words = &self.levels[level];
        let w = from / 64;
        if w >= words.len() {
            return None;
        }
        let masked = words[w] & (!0u64 << (from % 64));
        if masked != 0 {
            return Some(w * 64 + masked.trailing_zeros() as usize);
        }
        if level + 1 == self.levels.len() {
            return None;
        }
        let next_word = self.next_in(level + 1, w + 1)?;
        Some(next_word * 64 + words[next_word].trailing_zeros() as usize)
    }

    /// Heap bytes used (for the memory budget).
    pub fn heap_bytes(&self) -> usize {
        self.levels.capacity() * std::mem::size_of::<Vec<u64>>()
            + self.levels.iter().map(|l| l.capacity() * 8).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn next_set_matches_a_plain_scan() {
        let seed = crate::test_seed("next_set_matches_a_plain_scan");
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for len in [1usize, 63, 64, 65, 4096, 300_001] {
            let mut bits = LevelBits::new(len);
            let mut plain = vec![false; len];
            for _ in 0..2000 {
                let i = r.gen_range(0..len);
                if r.gen_bool(0.6) {
                    bits.set(i);
                    plain[i] = true;
                } else {
                    bits.clear(i);
                    plain[i] = false;
                }
                let from = r.gen_range(0..len);
                let want = (from..len).find(|&j| plain[j]);
                assert_eq!(bits.next_set(from), want, "len {len} from {from}");
                assert_eq!(bits.get(i), plain[i]);
            }
        }
    }
}
