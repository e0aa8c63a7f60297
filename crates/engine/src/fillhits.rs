//! The measured benefit of miss fills: of the blocks fills brought into the cache beyond what
//! the client asked for, the share that a later read found there. The miss fill
//! (`policy::miss_fill_window`) weighs it against what a fill costs.
//!
//! Sampled and bounded: one block in `SAMPLE` (by a hash of its number) is tracked, in a table
//! of `SLOTS` atomics per backing device, each holding the block's number and the epoch (a
//! count of tracked fills, in units of `EPOCH_FILLS`) of its fill. A tracked block's outcome
//! is known when a read finds it (read) or when a newer filled block takes its slot after
//! `HORIZON_EPOCHS` epochs (unread: it had about `HORIZON_EPOCHS` × `EPOCH_FILLS` × `SAMPLE`
//! filled blocks' time, 128 MiB of 4 KiB blocks, to be read). A slot taken sooner (two blocks
//! hashing alike) drops the older block without an outcome: a fill a moment ago is not yet
//! taken for useless. Until `MIN_RESOLVED` outcomes are known there is no ratio.
//!
//! Invariants:
//! - memory is `SLOTS` words per backing device, whatever the cache or device size;
//! - `note_read` costs one hash per block read and, for one block in `SAMPLE`, one atomic load
//!   (a compare-and-swap when it is a tracked filled block); no lock;
//! - each tracked block has at most one outcome; both counts decay together (halved once they
//!   reach `DECAY_AT`), so the ratio follows the current workload; races between the halving
//!   and concurrent increments only blur it.

use crate::units::BackingBlock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// One block in `SAMPLE` is tracked (a power of two).
pub const SAMPLE: u64 = 8;
/// Tracked filled blocks remembered per backing device (a power of two).
pub const SLOTS: usize = 4096;
/// Tracked fills per epoch.
pub const EPOCH_FILLS: u64 = 256;
/// Epochs a tracked block has to be read in before losing its slot counts as unread.
pub const HORIZON_EPOCHS: u64 = 16;
/// Outcomes known before the ratio is reported.
pub const MIN_RESOLVED: u64 = 16;
/// Outcomes at which both counts are halved.
pub const DECAY_AT: u64 = 4096;
/// Bits of a slot holding the epoch (the block number above them).
const EPOCH_BITS: u32 = 16;
const EPOCH_MASK: u64 = (1 << EPOCH_BITS) - 1;

pub struct FillHits {
    /// A tracked filled block: `(number + 1) << EPOCH_BITS | epoch`, or 0.
    slots: Box<[AtomicU64]>,
    /// Tracked fills so far.
    fills: AtomicU64,
    read: AtomicU64,
    unread: AtomicU64,
}

impl Default for FillHits {
    fn default() -> Self {
        FillHits {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            fills: AtomicU64::new(0),
            read: AtomicU64::new(0),
            unread: AtomicU64::new(0),
        }
    }
}

/// The slot of `block` if it is sampled.
fn slot(block: u64) -> Option<usize> {
    let h = block.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let h = h ^ (h >> 29);
    (h & (SAMPLE - 1) == 0).then_some(((h >> 3) as usize) & (SLOTS - 1))
}

/// The block part of a slot's value for `block`.
fn tag(block: u64) -> u64 {
    (block + 1) << EPOCH_BITS
}

impl FillHits {
    /// Blocks `[b0, b1)` were brought in by a fill (beyond the request).
    pub fn note_filled(&self, b0: BackingBlock, b1: BackingBlock) {
        for b in b0.get()..b1.get() {
            if let Some(s) = slot(b) {
                let epoch = (self.fills.fetch_add(1, Relaxed) / EPOCH_FILLS) & EPOCH_MASK;
                let old = self.slots[s].swap(tag(b) | epoch, Relaxed);
                let age = epoch.wrapping_sub(old & EPOCH_MASK) & EPOCH_MASK;
                if old != 0 && old & !EPOCH_MASK != tag(b) && age >= HORIZON_EPOCHS {
                    self.outcome(&self.unread);
                }
            }
        }
    }

    /// Blocks `[b0, b1)` were read from the cache.
    pub fn note_read(&self, b0: BackingBlock, b1: BackingBlock) {
        for b in b0.get()..b1.get() {
            if let Some(s) = slot(b) {
                let slot = &self.slots[s];
                let cur = slot.load(Relaxed);
                if cur & !EPOCH_MASK == tag(b)
                    && slot.compare_exchange(cur, 0, Relaxed, Relaxed).is_ok()
                {
                    self.outcome(&self.read);
                }
            }
        }
    }

    fn outcome(&self, which: &AtomicU64) {
        which.fetch_add(1, Relaxed);
        let (r, u) = (self.read.load(Relaxed), self.unread.load(Relaxed));
        if r + u >= DECAY_AT {
            self.read.fetch_sub(r / 2, Relaxed);
            self.unread.fetch_sub(u / 2, Relaxed);
        }
    }

    /// The share of tracked filled blocks read within the horizon, once enough are known.
    pub fn ratio(&self) -> Option<f64> {
        let (r, u) = (self.read.load(Relaxed), self.unread.load(Relaxed));
        (r + u >= MIN_RESOLVED).then(|| r as f64 / (r + u) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Backing block `b` (short for the tests' many literals).
    fn bb(b: u64) -> BackingBlock {
        BackingBlock::new(b)
    }

    /// Blocks filled after `[b0, b1)` until every slot holds a newer one past the horizon.
    const HORIZON: u64 = (HORIZON_EPOCHS * EPOCH_FILLS + SLOTS as u64 * 4) * SAMPLE;

    #[test]
    fn the_ratio_counts_filled_blocks_read_before_the_horizon_once_each() {
        let h = FillHits::default();
        h.note_filled(bb(0), bb(4096));
        // Nothing resolved yet: a fill a moment ago is not taken for useless.
        assert_eq!(h.ratio(), None);
        // A quarter read, twice; blocks never filled count nothing.
        h.note_read(bb(0), bb(1024));
        h.note_read(bb(0), bb(1024));
        h.note_read(bb(1 << 40), bb((1 << 40) + 10_000));
        let r = h.ratio().expect("about 128 reads resolved");
        // Tracked blocks of the same fill that took one another's slot have no outcome.
        assert_eq!(r, 1.0, "only reads are resolved so far");
        // Far more fills push the rest out unread: a quarter of the first fill was read.
        h.note_filled(bb(1 << 30), bb((1 << 30) + HORIZON));
        let r = h.ratio().unwrap();
        assert!(r < 0.1, "{r}");
    }

    #[test]
    fn counts_decay_so_the_ratio_follows_the_workload() {
        let h = FillHits::default();
        // A phase where every filled block is read...
        for i in 0..256u64 {
            h.note_filled(bb(i * 1024), bb((i + 1) * 1024));
            h.note_read(bb(i * 1024), bb((i + 1) * 1024));
        }
        assert_eq!(h.ratio(), Some(1.0));
        // ...then one where none is: the ratio falls well below.
        h.note_filled(bb(1 << 30), bb((1 << 30) + 4 * HORIZON));
        assert!(h.ratio().unwrap() < 0.2, "{:?}", h.ratio());
    }

    #[test]
    fn blocks_filled_a_moment_ago_are_not_taken_for_unread() {
        let h = FillHits::default();
        // Far more tracked blocks than slots, but all within the horizon: collisions only.
        h.note_filled(bb(0), bb(HORIZON_EPOCHS * EPOCH_FILLS * SAMPLE / 2));
        assert_eq!(h.ratio(), None);
    }

    #[test]
    fn one_block_in_sample_is_tracked() {
        let n = (0..100_000u64).filter(|&b| slot(b).is_some()).count() as f64;
        assert!((n / 100_000.0 - 1.0 / SAMPLE as f64).abs() < 0.01, "{n}");
    }
}
