//! Which clean bucket a full cache gives up: the rule ([`Replacement`], [`reclaim_rank`],
//! pure) and the state it decides from ([`ReplacementOrder`]: each bucket's stamp, the tick,
//! and the uses lock-free hits record in [`Touches`]). The bucket table (`alloc`) owns a
//! `ReplacementOrder`, tells it of allocations and uses, and asks it for each bucket's rank
//! when it looks for a victim.
//!
//! Invariants: `reclaim_rank` is pure (the same inputs give the same decisions); a stamp
//! moves only forward in ticks while its bucket is in the order; a bucket out of the order
//! (retired, waiting to be free) keeps the mechanism's retirement tag in its stamp's slot
//! ([`ReplacementOrder::set_tag`]) — one array of 8 bytes per bucket, not two, as the RAM
//! budget counts them — and uses recorded for it are ignored until it is opened again.

use crate::units::Bucket;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// Slots of [`Touches`] (a fixed 16 KiB, not per bucket).
const TOUCH_SLOTS: usize = 4096;

/// Bucket uses recorded without the state lock (lock-free cache hits), applied to the
/// stamps under it before reclaim picks a victim. Lossy by design: one slot per
/// `bucket % TOUCH_SLOTS`, so of two buckets sharing a slot between two reclaims only the later
/// use is kept (the other looks as old as its last locked use: an approximation of LRU, never
/// a correctness issue). A slot already holding the bucket is not written again, so a hot
/// bucket's slot is not a shared write on every hit.
#[derive(Clone)]
pub struct Touches(Arc<[AtomicU32]>);

impl Touches {
    fn new() -> Touches {
        Touches((0..TOUCH_SLOTS).map(|_| AtomicU32::new(0)).collect())
    }

    /// Records a use of bucket `b` (no lock). A slot holds `b + 1`, 0 when empty.
    pub fn note(&self, b: Bucket) {
        let slot = &self.0[b.idx() % TOUCH_SLOTS];
        if slot.load(Ordering::Relaxed) != b.get() + 1 {
            slot.store(b.get() + 1, Ordering::Relaxed);
        }
    }
}

/// The replacement order's state: see the module header.
pub struct ReplacementOrder {
    policy: Replacement,
    /// Per bucket: the tick of its last use (lru) or opening (fifo, random); for a bucket
    /// out of the order, its retirement tag.
    stamps: Vec<u64>,
    /// The latest tick seen (allocations and locked uses): the stamp of applied touches.
    tick: u64,
    touches: Touches,
}

impl ReplacementOrder {
    /// The order of `n` buckets, all stamped 0, by lru.
    pub fn new(n: usize) -> ReplacementOrder {
        ReplacementOrder {
            policy: Replacement::default(),
            stamps: vec![0; n],
            tick: 0,
            touches: Touches::new(),
        }
    }

    /// Sets the rule (stamps already taken keep their meaning until the buckets are used or
    /// opened again).
    pub fn set_policy(&mut self, r: Replacement) {
        self.policy = r;
    }

    /// Where lock-free hits record their uses.
    pub fn touches(&self) -> Touches {
        self.touches.clone()
    }

    /// Heap bytes (stamps, touch slots, the `Arc`'s counts).
    pub fn heap_bytes(&self) -> usize {
        self.stamps.capacity() * 8 + TOUCH_SLOTS * 4 + 2 * std::mem::size_of::<usize>()
    }

    /// Blocks of bucket `b` were handed out at `tick` (`opened`: the bucket's first).
    pub fn allocated(&mut self, b: Bucket, opened: bool, tick: u64) {
        if opened || self.policy.tracks_use() {
            self.stamps[b.idx()] = tick;
        }
        self.tick = self.tick.max(tick);
    }

    /// Bucket `b` was read or written at `tick` (`in_order`: false for a retired bucket,
    /// whose slot holds its tag).
    pub fn used(&mut self, b: Bucket, tick: u64, in_order: bool) {
        self.tick = self.tick.max(tick);
        if self.policy.tracks_use() && in_order {
            self.stamps[b.idx()] = tick;
        }
    }

    /// Applies the uses lock-free hits recorded since the last call (only where uses count)
    /// before a victim is chosen; `in_order` as for `used`.
    pub fn apply_touches(&mut self, in_order: impl Fn(Bucket) -> bool) {
        if !self.policy.tracks_use() {
            return;
        }
        let tick = self.tick;
        let touches = self.touches.clone();
        for slot in touches.0.iter() {
            if slot.load(Ordering::Relaxed) != 0 {
                let v = slot.swap(0, Ordering::Relaxed);
                if let Some(b) = v.checked_sub(1) {
                    let b = Bucket::new(b);
                    self.used(b, tick, in_order(b));
                }
            }
        }
    }

    /// Bucket `b`'s stamp (a candidate found by a scan is taken only if it still holds).
    pub fn stamp(&self, b: Bucket) -> u64 {
        self.stamps[b.idx()]
    }

    /// Bucket `b`'s rank for reclaim (smallest first; see `reclaim_rank`).
    pub fn rank(&self, b: Bucket, live_blocks: u32, salt: u64) -> (bool, u64) {
        reclaim_rank(self.policy, b, live_blocks, self.stamps[b.idx()], salt)
    }

    /// Takes bucket `b` out of the order, keeping the mechanism's retirement `tag` in its
    /// slot until it is opened again.
    pub fn set_tag(&mut self, b: Bucket, tag: u64) {
        self.stamps[b.idx()] = tag;
    }

    /// The retirement tag of a bucket out of the order.
    pub fn tag(&self, b: Bucket) -> u64 {
        self.stamps[b.idx()]
    }
}

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
