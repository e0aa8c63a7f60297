//! The admission filter's ghost history: how often each backing block missed recently, in a
//! fixed-size count-min sketch (TinyLFU's: 4-bit counters, four per key, halved every
//! `window` recorded misses so old misses fade).
//!
//! Sizing: the filter asks "did this block miss before?", so what matters is the chance that
//! a key never seen finds all four of its counters raised by others: with `n` keys in `m`
//! counters it is about (1 − e^(−4n/m))^4. Between halvings `n` ≤ `window` = `m` / 8, which
//! keeps it under 2.5 % (conservative increment lowers it further). The window is one cache's
//! worth of block misses up to 4 Mi misses (16 GiB of 4 KiB misses), so on caches over 16 GiB
//! a block must miss again within that many misses to be admitted.
//!
//! Invariants:
//! - bounded memory fixed at creation (`counters / 2` bytes, at most 16 MiB) and O(1) work per
//!   recorded miss, amortised: the halving touches every word once per `window` records, and
//!   `window` is an eighth of the counters;
//! - an estimate never undercounts a key's misses since the last halving (count-min: each of
//!   the key's four counters was incremented at least as often as the key, conservative
//!   increment never raises a counter above the key's new minimum), and saturates at 15;
//! - no data is stored, only counts: a wrong estimate (a collision) admits a block early,
//!   never loses one — admission is only ever an optimisation.
//!
//! Keys are `(device, backing block)`; the policy deciding from the counts is
//! [`crate::policy::admit_miss`].

use crate::types::DevId;
use crate::units::BackingBlock;

/// Counters of the smallest and the largest sketch (4 bits each).
const COUNTERS_MIN: usize = 1 << 15;
const COUNTERS_MAX: usize = 1 << 25;
/// Counters per key of the window (see the sizing note).
const COUNTERS_PER_KEY: usize = 8;

pub struct Ghost {
    /// Sixteen 4-bit counters per word.
    words: Vec<u64>,
    /// Counters - 1 (a power of two).
    mask: u64,
    /// Misses recorded since the last halving.
    recorded: u64,
    /// Records between halvings.
    window: u64,
}

/// Four counter positions for one key (splitmix64 of the key, 16 bits per position, mixed
/// with the key's upper hash bits so tables over 2^16 counters are covered).
fn positions(key: u64, mask: u64) -> [u64; 4] {
    let mut z = key.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let hi = z.rotate_left(32).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    [0u32, 1, 2, 3].map(|i| (z.rotate_left(16 * i) ^ hi.rotate_left(11 * i + 7)) & mask)
}

impl Ghost {
    /// A sketch whose window is about one cache's worth (`cache_blocks`) of misses, within
    /// fixed bounds.
    pub fn new(cache_blocks: u64) -> Ghost {
        let counters = (cache_blocks.clamp(1, 1 << 40) as usize)
            .next_power_of_two()
            .saturating_mul(COUNTERS_PER_KEY)
            .clamp(COUNTERS_MIN, COUNTERS_MAX);
        Ghost {
            words: vec![0; counters / 16],
            mask: counters as u64 - 1,
            recorded: 0,
            window: (counters / COUNTERS_PER_KEY) as u64,
        }
    }

    pub fn heap_bytes(&self) -> u64 {
        (self.words.capacity() * 8) as u64
    }

    fn get(&self, at: u64) -> u8 {
        ((self.words[(at / 16) as usize] >> ((at % 16) * 4)) & 0xf) as u8
    }

    fn set(&mut self, at: u64, v: u8) {
        let w = &mut self.words[(at / 16) as usize];
        let shift = (at % 16) * 4;
        *w = (*w & !(0xf << shift)) | (u64::from(v) << shift);
    }

    /// Recent misses of `key` (an upper bound; 0 to 15).
    #[cfg(test)]
    pub fn estimate(&self, key: u64) -> u8 {
        positions(key, self.mask)
            .into_iter()
            .map(|at| self.get(at))
            .min()
            .unwrap_or(0)
    }

    /// Records a miss of `key` and returns the estimate from before it.
    pub fn record(&mut self, key: u64) -> u8 {
        let at = positions(key, self.mask);
        let before = at.iter().map(|&a| self.get(a)).min().unwrap_or(0);
        if before < 15 {
            // Conservative increment: only the counters at the minimum move.
            for a in at {
                if self.get(a) == before {
                    self.set(a, before + 1);
                }
            }
        }
        self.recorded += 1;
        if self.recorded >= self.window {
            self.halve();
        }
        before
    }

    /// Ages every count: each counter halves (TinyLFU's reset).
    fn halve(&mut self) {
        for w in &mut self.words {
            *w = (*w >> 1) & 0x7777_7777_7777_7777;
        }
        self.recorded = 0;
    }

    /// The key of a backing block.
    pub fn key(dev: DevId, block: BackingBlock) -> u64 {
        (u64::from(dev.get()) << 56) ^ block.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key of block `block` of device `dev` (short for the tests' many literals).
    fn key(dev: u32, block: u64) -> u64 {
        Ghost::key(DevId::new(dev), BackingBlock::new(block))
    }

    #[test]
    fn a_second_miss_is_seen_and_counts_never_undercount() {
        let mut g = Ghost::new(1 << 15);
        // 20,000 distinct keys, each missed a known number of times (within one window).
        let counts: Vec<u8> = (0..20_000u64).map(|k| (k % 4) as u8).collect();
        for (k, &n) in counts.iter().enumerate() {
            for _ in 0..n {
                g.record(key(1, k as u64));
            }
        }
        let mut over = 0;
        for (k, &n) in counts.iter().enumerate() {
            let e = g.estimate(key(1, k as u64));
            assert!(e >= n, "key {k}: estimate {e} < {n} recorded");
            over += usize::from(e > n);
        }
        // 30,000 records (under one window) in 262,144 counters: collisions are rare.
        assert!(over < counts.len() / 50, "{over} of 20,000 overestimated");
        // Never seen: under 2.5 % look seen.
        let seen = (1_000_000..1_010_000u64)
            .filter(|&k| g.estimate(key(1, k)) > 0)
            .count();
        assert!(seen < 250, "{seen} of 10,000 unseen keys look seen");
        assert_eq!(g.estimate(key(2, 0)), 0, "another device's block");
    }

    #[test]
    fn misses_fade_after_a_window_of_other_misses() {
        let mut g = Ghost::new(1 << 12);
        assert_eq!(g.window, 1 << 12);
        assert_eq!(g.record(key(0, 7)), 0);
        assert_eq!(g.record(key(0, 7)), 1);
        // A window's worth of other keys halves every count: 2 -> 1 -> 0.
        for w in 0..2 {
            for k in 0..g.window {
                g.record(key(0, 1_000_000 + w * g.window + k));
            }
        }
        assert_eq!(g.estimate(key(0, 7)), 0);
    }

    #[test]
    fn counts_saturate_and_memory_is_bounded() {
        let mut g = Ghost::new(10);
        for _ in 0..40 {
            g.record(5);
        }
        assert_eq!(g.estimate(5), 15);
        assert_eq!(g.heap_bytes(), (COUNTERS_MIN / 2) as u64);
        assert_eq!(
            Ghost::new(1 << 40).heap_bytes(),
            (COUNTERS_MAX / 2) as u64,
            "16 MiB at most"
        );
    }
}
