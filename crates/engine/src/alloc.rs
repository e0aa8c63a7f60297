//! Bucket allocation: append-only open buckets, free list, reclaim order, pins.
//!
//! Invariants:
//! - data is only ever appended to an `Open` bucket at its fill pointer; a bucket is never
//!   written again until it has gone `Closed -> PendingFree -> Free`;
//! - a bucket becomes `Free` only when (a) the journal entry that bumped its generation is
//!   durable (`durable_epoch >= tag`), so after a crash no durable index entry can point into
//!   rewritten data, and (b) no reader holds a pin on it;
//! - a bucket with pins is never reclaimed, compacted or reused: readers pin the buckets they
//!   read, and every allocation pins its bucket until its index entry is inserted (or the
//!   allocation is abandoned), so a bucket closed while writes into it are still in flight
//!   cannot be emptied under them;
//! - one open bucket per write point, so clean promotions and dirty writes live in different
//!   buckets (clean buckets can be reclaimed whole, dirty ones wait for writeback);
//! - the policy (which bucket to reclaim) is a pure function of the counters here.

use std::collections::VecDeque;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketState {
    Free,
    Open,
    Closed,
    /// Emptied; free once the journal epoch `tag` is durable and no pins remain.
    PendingFree {
        tag: u64,
    },
}

/// Where a write's data goes: clean data (promotions, writethrough) or dirty data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePoint {
    Clean = 0,
    Dirty = 1,
}

pub struct Buckets {
    pub gen: Vec<u8>,
    pub state: Vec<BucketState>,
    pub fill: Vec<u32>,
    pub last_use: Vec<u64>,
    pub pins: Vec<u32>,
    free: VecDeque<u32>,
    open: [Option<u32>; 2],
    bpb: u32,
}

impl Buckets {
    /// Fresh bucket table: buckets with `live[b] > 0` are `Closed`, the rest `Free`.
    pub fn new(gens: Vec<u8>, live: &[u32], bpb: u32) -> Buckets {
        let n = gens.len();
        let mut state = vec![BucketState::Free; n];
        let mut free = VecDeque::new();
        for b in 0..n {
            if live[b] > 0 {
                state[b] = BucketState::Closed;
            } else {
                free.push_back(b as u32);
            }
        }
        Buckets {
            gen: gens,
            state,
            // A closed bucket is full: after a restart nothing more is appended to it.
            fill: live.iter().map(|&l| if l > 0 { bpb } else { 0 }).collect(),
            last_use: vec![0; n],
            pins: vec![0; n],
            free,
            open: [None, None],
            bpb,
        }
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn count(&self, pred: impl Fn(BucketState) -> bool) -> usize {
        self.state.iter().filter(|&&s| pred(s)).count()
    }

    /// Grants up to `want` blocks at the open bucket of `point`, opening a free bucket if
    /// needed. Returns `(first cache block, granted)`, or `None` if no free bucket exists.
    pub fn alloc(&mut self, point: WritePoint, want: u32, tick: u64) -> Option<(u32, u32)> {
        assert!(want > 0);
        let p = point as usize;
        if let Some(b) = self.open[p] {
            if self.fill[b as usize] >= self.bpb {
                self.state[b as usize] = BucketState::Closed;
                self.open[p] = None;
            }
        }
        if self.open[p].is_none() {
            let b = self.free.pop_front()?;
            debug_assert_eq!(self.state[b as usize], BucketState::Free);
            self.state[b as usize] = BucketState::Open;
            self.fill[b as usize] = 0;
            self.open[p] = Some(b);
        }
        let b = self.open[p].unwrap() as usize;
        let n = want.min(self.bpb - self.fill[b]);
        let first = b as u32 * self.bpb + self.fill[b];
        self.fill[b] += n;
        self.last_use[b] = tick;
        self.pins[b] += 1;
        Some((first, n))
    }

    pub fn pin(&mut self, b: u32) {
        self.pins[b as usize] += 1;
    }

    /// Drops a pin; a retired bucket whose last pin goes may become free.
    pub fn unpin(&mut self, b: u32, durable_epoch: u64) {
        let i = b as usize;
        assert!(self.pins[i] > 0, "unpin of an unpinned bucket");
        self.pins[i] -= 1;
        if self.pins[i] == 0 && matches!(self.state[i], BucketState::PendingFree { .. }) {
            self.release(durable_epoch);
        }
    }

    /// The clean, closed, unpinned bucket used least recently (the reclaim victim).
    pub fn reclaim_candidate(&self, live: &[u32], dirty: &[u32]) -> Option<u32> {
        (0..self.state.len())
            .filter(|&b| self.state[b] == BucketState::Closed && dirty[b] == 0 && self.pins[b] == 0)
            .min_by_key(|&b| (live[b] > 0, self.last_use[b]))
            .map(|b| b as u32)
    }

    /// The closed, unpinned bucket with the fewest live blocks, if under `max_live_pct`.
    pub fn gc_candidate(&self, live: &[u32], max_live_pct: u32) -> Option<u32> {
        (0..self.state.len())
            .filter(|&b| self.state[b] == BucketState::Closed && self.pins[b] == 0)
            .filter(|&b| live[b] * 100 <= self.bpb * max_live_pct)
            .min_by_key(|&b| live[b])
            .map(|b| b as u32)
    }

    /// Marks an emptied bucket: generation bumped, free once epoch `tag` is durable.
    pub fn retire(&mut self, b: u32, tag: u64) -> u8 {
        let i = b as usize;
        assert!(matches!(self.state[i], BucketState::Closed));
        self.gen[i] = self.gen[i].wrapping_add(1);
        self.state[i] = BucketState::PendingFree { tag };
        self.gen[i]
    }

    /// Moves pending buckets whose generation bump is durable and that nobody reads to free.
    pub fn release(&mut self, durable_epoch: u64) {
        for b in 0..self.state.len() {
            if let BucketState::PendingFree { tag } = self.state[b] {
                if tag <= durable_epoch && self.pins[b] == 0 {
                    self.state[b] = BucketState::Free;
                    self.free.push_back(b as u32);
                }
            }
        }
    }

    /// Records a use of the bucket (reads and writes keep it warm for LRU reclaim).
    pub fn touch(&mut self, b: u32, tick: u64) {
        self.last_use[b as usize] = tick;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_appends_then_opens_next() {
        let mut bk = Buckets::new(vec![0; 3], &[0, 5, 0], 4);
        assert_eq!(bk.alloc(WritePoint::Dirty, 3, 1), Some((0, 3)));
        assert_eq!(bk.alloc(WritePoint::Dirty, 3, 1), Some((3, 1)));
        assert_eq!(bk.alloc(WritePoint::Clean, 8, 1), Some((8, 4)));
        assert_eq!(bk.alloc(WritePoint::Dirty, 1, 1), None);
        // Allocations pin their bucket until the writer is done.
        assert_eq!(bk.reclaim_candidate(&[0, 5, 4], &[0, 5, 0]), None);
        bk.unpin(0, 0);
        bk.unpin(0, 0);
        bk.unpin(2, 0);
        // Bucket 0 was closed when full; reclaim it.
        let live = [0, 5, 4];
        assert_eq!(bk.reclaim_candidate(&live, &[0, 5, 0]), Some(0));
        bk.retire(0, 7);
        bk.release(6);
        assert_eq!(bk.free_count(), 0);
        bk.release(7);
        assert_eq!(bk.alloc(WritePoint::Dirty, 1, 2), Some((0, 1)));
        assert_eq!(bk.gen[0], 1);
    }
}
