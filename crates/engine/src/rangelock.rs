//! Range locks: exclusive locks on block ranges of a backing device.
//!
//! Invariants: two held ranges of the same device never overlap; a waiter sleeps on a condvar
//! until no held range overlaps its own, then takes it atomically. Writers, writeback and
//! read-modify-write hold a range for as long as backing and cache must change together, so
//! the cache and the backing device never disagree about which of two overlapping writes won.
//! The table is bounded by the number of requests in flight (bounded by the server).

use crate::types::DevId;
use crate::units::BackingBlock;
use parking_lot::{Condvar, Mutex};

#[derive(Default)]
pub struct RangeLocks {
    held: Mutex<Vec<(DevId, BackingBlock, BackingBlock)>>,
    cv: Condvar,
}

/// Releases its range when dropped.
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    range: (DevId, BackingBlock, BackingBlock),
}

impl RangeLocks {
    /// Locks blocks `[b0, b1)` of `dev`, waiting for overlapping holders to finish.
    pub fn lock(&self, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> RangeGuard<'_> {
        assert!(b0 < b1, "empty range lock");
        let mut held = self.held.lock();
        while held.iter().any(|&(d, s, e)| d == dev && s < b1 && b0 < e) {
            self.cv.wait(&mut held);
        }
        held.push((dev, b0, b1));
        RangeGuard {
            locks: self,
            range: (dev, b0, b1),
        }
    }
}

impl RangeLocks {
    /// Takes blocks `[b0, b1)` of `dev` if no held range overlaps them, without waiting (for
    /// a caller that must not block: the staged write). The caller gives the range back with
    /// [`RangeLocks::unlock`].
    pub fn try_lock(&self, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> bool {
        assert!(b0 < b1, "empty range lock");
        let mut held = self.held.lock();
        if held.iter().any(|&(d, s, e)| d == dev && s < b1 && b0 < e) {
            return false;
        }
        held.push((dev, b0, b1));
        true
    }

    /// `try_lock` with a guard that gives the range back when dropped.
    pub fn try_guard(
        &self,
        dev: DevId,
        b0: BackingBlock,
        b1: BackingBlock,
    ) -> Option<RangeGuard<'_>> {
        // Lazily: a guard made for a range not taken would give it back when dropped.
        self.try_lock(dev, b0, b1).then(|| RangeGuard {
            locks: self,
            range: (dev, b0, b1),
        })
    }

    /// Gives back a range taken by `try_lock` (or a guard's).
    pub fn unlock(&self, range: (DevId, BackingBlock, BackingBlock)) {
        let mut held = self.held.lock();
        let i = held
            .iter()
            .position(|r| *r == range)
            .expect("the range is held");
        held.swap_remove(i);
        self.cv.notify_all();
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks.unlock(self.range);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn overlapping_ranges_exclude_each_other() {
        let locks = Arc::new(RangeLocks::default());
        let inside = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let (locks, inside) = (locks.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _g = locks.lock(
                            DevId::new(0),
                            BackingBlock::new(i),
                            BackingBlock::new(i + 10),
                        );
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0);
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        // Disjoint ranges and other devices do not block.
        let b = BackingBlock::new;
        let _a = locks.lock(DevId::new(0), b(0), b(5));
        let _b = locks.lock(DevId::new(0), b(5), b(9));
        let _c = locks.lock(DevId::new(1), b(0), b(9));
    }
}
