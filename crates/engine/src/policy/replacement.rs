//! Which clean bucket a full cache gives up ([`Replacement`], [`reclaim_rank`]).
//!
//! Invariant: pure; the same inputs give the same decisions.

use crate::units::Bucket;

/// Which clean bucket a full cache gives up (bcache's `cache_replacement_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Replacement {
    /// Least recently used: the bucket whose last read or write is oldest.
    #[default]
    Lru,
    /// First in, first out: the bucket opened longest ago, whatever was read since.
    Fifo,
    /// A bucket at random.
    Random,
}

impl Replacement {
    pub const ALL: [Replacement; 3] = [Replacement::Lru, Replacement::Fifo, Replacement::Random];

    pub fn name(self) -> &'static str {
        match self {
            Replacement::Lru => "lru",
            Replacement::Fifo => "fifo",
            Replacement::Random => "random",
        }
    }

    pub fn parse(s: &str) -> Option<Replacement> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Whether reads keep a bucket (its stamp moves on a use); under fifo and random the
    /// stamp is the tick the bucket was opened.
    pub fn tracks_use(self) -> bool {
        self == Replacement::Lru
    }
}

/// The replacement order of clean buckets: smallest reclaimed first. Empty buckets first,
/// then by `policy`: `stamp` is the tick of the last use (lru) or of the bucket's opening
/// (fifo); random orders by a hash of the bucket and `salt` (a new order per scan).
pub fn reclaim_rank(
    policy: Replacement,
    bucket: Bucket,
    live_blocks: u32,
    stamp: u64,
    salt: u64,
) -> (bool, u64) {
    let key = match policy {
        Replacement::Lru | Replacement::Fifo => stamp,
        Replacement::Random => {
            let mut z = (u64::from(bucket.get()) << 32 ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z ^= z >> 29;
            z.wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 1
        }
    };
    (live_blocks > 0, key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_buckets_go_first_then_by_stamp_or_at_random() {
        for policy in [Replacement::Lru, Replacement::Fifo] {
            let mut b = [(3, 10), (0, 50), (1, 5), (0, 7)];
            b.sort_by_key(|&(live, used)| reclaim_rank(policy, Bucket::new(0), live, used, 0));
            assert_eq!(b, [(0, 7), (0, 50), (1, 5), (3, 10)]);
        }
        // Random: empty ones still first; the rest in an order that changes with the salt
        // and ignores the stamps.
        let order = |salt: u64| {
            let mut b: Vec<Bucket> = Bucket::all(64).collect();
            b.sort_by_key(|&i| {
                let live = u32::from(i != Bucket::new(9));
                reclaim_rank(Replacement::Random, i, live, 7, salt)
            });
            b
        };
        let (a, b) = (order(1), order(2));
        assert_eq!((a[0], b[0]), (Bucket::new(9), Bucket::new(9)));
        assert_ne!(a, b);
        for r in Replacement::ALL {
            assert_eq!(Replacement::parse(r.name()), Some(r));
        }
        assert_eq!(Replacement::parse("arc"), None);
    }
}
