//! The policy state every volume of a cache set shares: the admission filter's history of
//! recent misses ([`crate::admit::Ghost`], one cache's worth, keyed by device and block) and
//! the admission rule it feeds. Each volume's [`super::VolumePolicy`] holds it and asks it
//! when planning a miss.
//!
//! Invariants: the ghost's lock is a leaf (nothing is locked under it), so the mechanism may
//! ask under the state lock; its memory is fixed at creation (the sketch's size) and counted
//! in the set's index memory.

use super::Admission;
use crate::admit::Ghost;
use crate::types::DevId;
use crate::units::BackingBlock;
use parking_lot::Mutex;

/// See the module header.
pub struct SetPolicy {
    admission: Admission,
    ghost: Mutex<Ghost>,
}

impl SetPolicy {
    /// The shared policy of a set whose cache holds `cache_blocks` blocks.
    pub fn new(admission: Admission, cache_blocks: u64) -> SetPolicy {
        SetPolicy {
            admission,
            ghost: Mutex::new(Ghost::new(cache_blocks)),
        }
    }

    /// Which misses a full cache admits.
    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// Records a miss of `block` of `dev` in the history; returns how often it missed
    /// recently before this one.
    pub(super) fn record_miss(&self, dev: DevId, block: BackingBlock) -> u8 {
        self.ghost.lock().record(Ghost::key(dev, block))
    }

    /// Heap bytes of the history (for the memory report).
    pub fn heap_bytes(&self) -> u64 {
        self.ghost.lock().heap_bytes()
    }
}
