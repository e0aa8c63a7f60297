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
//! - one open bucket per write point, so clean promotions, dirty writes and what GC moves
//!   live in different buckets (clean buckets can be reclaimed whole, dirty ones wait for writeback), and the
//!   blocks a miss fill brought in beside the ones asked for live apart from both (if nobody
//!   reads them their buckets are never used again, so LRU gives them up first instead of the
//!   buckets of blocks clients asked for);
//! - which clean bucket to reclaim is the policy's (`policy::ReplacementOrder`, owned here:
//!   told of every allocation and use, asked for each bucket's rank);
//! - nothing here scans every bucket on a frequent path: free and pending buckets are kept in
//!   queues with a count, and reclaim and GC victims are served from candidate lists that one
//!   scan fills with up to `candidates_max` buckets (so a scan costs O(buckets) once per that
//!   many victims); a candidate is re-checked when it is taken (a bucket used since the scan
//!   is skipped, as warm), and after a scan that found nothing, the next one waits until the
//!   journal has grown by `rescan_pause` entries, so a cache full of dirty data does not
//!   rescan per request.
//!
//! Pins ([`Pins`]) are atomic and shared outside the state lock, so a reader can drop its pin
//! without the lock every request shares. The rules and why they are enough:
//! - a pin is *taken* only under the state lock, in the critical section whose lookup found
//!   the bucket (or that allocates from it); every decision to reuse a bucket (reclaim and GC
//!   candidates, `release`, the freeing on a last unpin) is also made under that lock, so it
//!   sees every pin taken before it (the mutex orders them), and a bucket that is retired
//!   (`PendingFree`) is in no index entry and no open bucket, so nobody pins it again;
//! - a pin is *dropped* with a `Release` decrement and every check for "no pins" is an
//!   `Acquire` load, so a reader's cache read happens before the bucket is freed, and so
//!   before anything is written to it again;
//! - `retire` sets [`RETIRED`] in the same atomic, under the lock. The decrement that takes
//!   the count of a retired bucket to zero sees the flag (one read-modify-write returns both),
//!   and only that unpin takes the state lock, to free the bucket if its tag is durable. If
//!   the decrement came first in the atomic's order, it saw no flag and does nothing, but then
//!   `release` (under the lock, later) sees the count at zero and frees the bucket. A
//!   decrement that saw the flag read a value written inside `retire`'s critical section, so
//!   the lock it then takes is acquired after that section ended and sees `PendingFree`.
//!   Either way exactly one of them frees it (`free_bucket` requires `PendingFree`), and a
//!   bucket freed meanwhile by the other is left alone;
//! - the flag is cleared when the bucket is freed (under the lock, with no pins left).
//!
//! A cache hit may also pin *without* the lock, after a lock-free index lookup: it pins, then
//! checks that the index has not changed since the lookup (`slots`' seqlock, with `SeqCst`
//! fences on both sides), and drops the pin and takes the locked path if it has. Every bucket
//! is emptied from the index (a change) before it is retired, so a pin that passed the check
//! was taken while the bucket still held the data, and a reuse decision made after that change
//! sees it. A pin dropped after a failed check may land on a bucket in any state; the count
//! goes back to what it was and the last-unpin rule above still frees a retired bucket once.
//! Hits found that way record their use in `policy::Touches`, applied under the lock before a
//! reclaim victim is chosen.

use crate::policy::{Replacement, ReplacementOrder, Touches};
use crate::units::{Bucket, CacheBlock, Gen};
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

/// One byte per bucket: the per-bucket tables are part of the RAM budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BucketState {
    Free,
    Open,
    Closed,
    /// Emptied; free once its retirement tag (a journal epoch, `ReplacementOrder::tag`) is
    /// durable and no pins remain.
    PendingFree,
}

/// Where a write's data goes: clean data (blocks read or written by clients), dirty data,
/// the blocks a miss fill read beside the ones asked for, and what GC moves (clean and dirty:
/// buckets only GC fills, so the room it keeps for itself is not taken by clients).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePoint {
    Clean = 0,
    Dirty = 1,
    Fill = 2,
    MovedClean = 3,
    MovedDirty = 4,
}

/// Write points (open buckets at once, at most).
const WRITE_POINTS: usize = 5;

/// The pin-count bit of a `Pins` slot that says the bucket is `PendingFree`.
const RETIRED: u16 = 1 << 15;

/// Per-bucket pin counts (the low 15 bits) and the [`RETIRED`] flag, readable and droppable
/// without the state lock (see the module header for the protocol). Clones share them.
#[derive(Clone)]
pub struct Pins(Arc<[AtomicU16]>);

impl Pins {
    fn new(n: usize) -> Pins {
        Pins((0..n).map(|_| AtomicU16::new(0)).collect())
    }

    /// Heap bytes: the counts and the `Arc`'s two reference counts.
    fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.0) + 2 * std::mem::size_of::<usize>()
    }

    /// Pins on bucket `b` (an `Acquire` load: the reads of the dropped pins are done).
    fn count(&self, b: Bucket) -> u16 {
        self.0[b.idx()].load(Ordering::Acquire) & !RETIRED
    }

    /// Takes a pin. Call only under the state lock (see the module header).
    fn pin(&self, b: Bucket) {
        let prev = self.0[b.idx()].fetch_add(1, Ordering::Relaxed);
        assert!(
            prev & !RETIRED < RETIRED - 1,
            "more than 32766 concurrent pins on one bucket"
        );
    }

    /// Takes a pin without the state lock, for a lock-free hit that checks the index after
    /// (see the module header).
    pub fn pin_unlocked(&self, b: Bucket) {
        self.pin(b);
    }

    /// Drops a pin; needs no lock. `true`: it was the last pin on a retired bucket, and the
    /// caller must call [`Buckets::free_unpinned`] under the state lock.
    #[must_use]
    pub fn unpin(&self, b: Bucket) -> bool {
        let prev = self.0[b.idx()].fetch_sub(1, Ordering::Release);
        assert!(prev & !RETIRED > 0, "unpin of an unpinned bucket");
        prev == RETIRED | 1
    }
}

pub struct Buckets {
    pub gen: Vec<Gen>,
    pub state: Vec<BucketState>,
    /// The replacement order (and, for a `PendingFree` bucket, the journal epoch (tag) that
    /// must be durable before it is free).
    order: ReplacementOrder,
    pins: Pins,
    free: VecDeque<Bucket>,
    /// Retired buckets in retirement order (tags never decrease). An entry whose bucket is no
    /// longer `PendingFree` with that tag (freed by its last unpin) is skipped when popped.
    pending: VecDeque<(u64, Bucket)>,
    /// Buckets in state `PendingFree`.
    pending_count: usize,
    /// Reclaim victims (with their stamps as seen by the scan).
    lru: Candidates,
    /// GC victims.
    gc: Candidates,
    /// The open bucket of each write point and how many of its blocks are handed out (a
    /// closed bucket is full, a free one empty: only open buckets need a fill pointer).
    open: [Option<(Bucket, u32)>; WRITE_POINTS],
    bpb: u32,
}

/// Most candidates one scan keeps: a scan costs O(buckets), so victims cost O(64) each.
fn candidates_max(nbuckets: usize) -> usize {
    (nbuckets / 64).max(16)
}

/// Journal entries after a scan that found nothing before the next scan: O(64) bucket checks
/// per entry at most, and at once (any change) for caches under 128 buckets.
fn rescan_pause(nbuckets: usize) -> u64 {
    (nbuckets as u64 / 64).max(1)
}

/// Victims found by the last scan, best last, each with a stamp that must still hold when it
/// is taken; and the pacing of scans.
#[derive(Default)]
struct Candidates {
    list: Vec<(Bucket, u64)>,
    /// After a scan that found nothing: the journal epoch before which none is repeated.
    rescan_epoch: u64,
    scans: u64,
}

impl Candidates {
    /// The best candidate that `still` holds for, scanning all buckets with `rank` (a key,
    /// smallest best, and a stamp; `None` for a bucket that is no candidate) when the list runs
    /// out and the pacing allows. One scan keeps the `candidates_max` best.
    fn next<K: Ord>(
        &mut self,
        bk: &Buckets,
        epoch: u64,
        still: impl Fn(&Buckets, Bucket, u64) -> bool,
        rank: impl Fn(&Buckets, Bucket) -> Option<(K, u64)>,
    ) -> Option<Bucket> {
        if let Some(b) = self.take(bk, &still) {
            return Some(b);
        }
        if epoch < self.rescan_epoch {
            return None;
        }
        self.scans += 1;
        let n = bk.state.len();
        let max = candidates_max(n);
        // A max-heap whose top is the worst kept.
        let mut best = BinaryHeap::with_capacity(max + 1);
        for b in Bucket::all(n) {
            if let Some((key, stamp)) = rank(bk, b) {
                best.push((key, b, stamp));
                if best.len() > max {
                    best.pop();
                }
            }
        }
        // `into_sorted_vec` is best first; serve from the end.
        self.list = best
            .into_sorted_vec()
            .into_iter()
            .rev()
            .map(|(_, b, stamp)| (b, stamp))
            .collect();
        if self.list.is_empty() {
            self.rescan_epoch = epoch + rescan_pause(n);
        }
        self.take(bk, &still)
    }

    fn take(
        &mut self,
        bk: &Buckets,
        still: &impl Fn(&Buckets, Bucket, u64) -> bool,
    ) -> Option<Bucket> {
        while let Some((b, stamp)) = self.list.pop() {
            if still(bk, b, stamp) {
                return Some(b);
            }
        }
        None
    }
}

impl Buckets {
    /// Fresh bucket table: buckets with `live[b] > 0` are `Closed`, the rest `Free`.
    pub fn new(gens: Vec<Gen>, live: &[u32], bpb: u32) -> Buckets {
        let n = gens.len();
        let mut state = vec![BucketState::Free; n];
        let mut free = VecDeque::new();
        for b in Bucket::all(n) {
            if live[b.idx()] > 0 {
                state[b.idx()] = BucketState::Closed;
            } else {
                free.push_back(b);
            }
        }
        Buckets {
            gen: gens,
            state,
            order: ReplacementOrder::new(n),
            pins: Pins::new(n),
            free,
            pending: VecDeque::new(),
            pending_count: 0,
            lru: Candidates::default(),
            gc: Candidates::default(),
            open: [None; WRITE_POINTS],
            bpb,
        }
    }

    /// Sets the replacement policy (see `ReplacementOrder::set_policy`).
    pub fn set_replacement(&mut self, r: Replacement) {
        self.order.set_policy(r);
    }

    /// Bytes of heap the bucket table holds (for the memory budget).
    pub fn heap_bytes(&self) -> u64 {
        (self.gen.capacity() * std::mem::size_of::<Gen>()
            + self.state.capacity() * std::mem::size_of::<BucketState>()
            + self.order.heap_bytes()
            + self.pins.heap_bytes()
            + self.free.capacity() * std::mem::size_of::<Bucket>()
            + self.pending.capacity() * std::mem::size_of::<(u64, Bucket)>()
            + (self.lru.list.capacity() + self.gc.list.capacity())
                * std::mem::size_of::<(Bucket, u64)>()) as u64
    }

    /// The pin counts, to drop pins without the state lock.
    pub fn pins(&self) -> Pins {
        self.pins.clone()
    }

    /// Where lock-free hits record their uses.
    pub fn touches(&self) -> Touches {
        self.order.touches()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Buckets emptied but not yet free (waiting for their generation bump to be durable, or
    /// for their last reader).
    pub fn pending_count(&self) -> usize {
        self.pending_count
    }

    /// Buckets that are not free (open, closed or pending).
    pub fn in_use_count(&self) -> usize {
        self.state.len() - self.free.len()
    }

    /// Grants up to `want` blocks at the open bucket of `point`, opening a free bucket if
    /// needed and more than `keep_free` are free (the ones GC needs to move live blocks: see
    /// `space`). Returns `(first cache block, granted)`, or `None` if no bucket can be opened.
    pub fn alloc(
        &mut self,
        point: WritePoint,
        want: u32,
        tick: u64,
        keep_free: usize,
    ) -> Option<(CacheBlock, u32)> {
        assert!(want > 0);
        let p = point as usize;
        if let Some((b, fill)) = self.open[p] {
            if fill >= self.bpb {
                self.state[b.idx()] = BucketState::Closed;
                self.open[p] = None;
            }
        }
        if self.open[p].is_none() {
            if self.free.len() <= keep_free {
                return None;
            }
            let b = self.free.pop_front()?;
            debug_assert_eq!(self.state[b.idx()], BucketState::Free);
            self.state[b.idx()] = BucketState::Open;
            self.open[p] = Some((b, 0));
        }
        let (b, fill) = self.open[p].as_mut().expect("an open bucket");
        let n = want.min(self.bpb - *fill);
        let first = CacheBlock::first_of(*b, self.bpb) + *fill;
        *fill += n;
        let (b, opened) = (*b, *fill == n);
        self.order.allocated(b, opened, tick);
        self.pin(b);
        Some((first, n))
    }

    /// Takes a pin (the caller holds the state lock: `&mut`).
    pub fn pin(&mut self, b: Bucket) {
        self.pins.pin(b);
    }

    /// Drops a pin under the state lock; a retired bucket whose last pin goes may become free.
    pub fn unpin(&mut self, b: Bucket, durable_epoch: u64) {
        if self.pins.unpin(b) {
            self.free_unpinned(b, durable_epoch);
        }
    }

    /// After [`Pins::unpin`] returned `true` (or any time): frees bucket `b` if it is retired,
    /// its tag durable and it has no pins.
    pub fn free_unpinned(&mut self, b: Bucket, durable_epoch: u64) {
        let i = b.idx();
        if self.state[i] == BucketState::PendingFree
            && self.order.tag(b) <= durable_epoch
            && self.pins.count(b) == 0
        {
            self.free_bucket(b);
        }
    }

    fn free_bucket(&mut self, b: Bucket) {
        debug_assert_eq!(self.state[b.idx()], BucketState::PendingFree);
        self.state[b.idx()] = BucketState::Free;
        self.pins.0[b.idx()].fetch_and(!RETIRED, Ordering::Relaxed);
        self.free.push_back(b);
        self.pending_count -= 1;
    }

    fn reclaimable(&self, b: Bucket, dirty: &[u32]) -> bool {
        self.state[b.idx()] == BucketState::Closed && dirty[b.idx()] == 0 && self.pins.count(b) == 0
    }

    fn collectable(&self, b: Bucket, live: &[u32], max_live_pct: u32) -> bool {
        self.state[b.idx()] == BucketState::Closed
            && self.pins.count(b) == 0
            && u64::from(live[b.idx()]) * 100 <= u64::from(self.bpb) * u64::from(max_live_pct)
    }

    /// The reclaim victim: a clean, closed, unpinned bucket, empty ones first, then the least
    /// recently used (as of the last scan; see the module invariants). `epoch` is the journal's
    /// appended epoch, which paces scans that find nothing.
    pub fn reclaim_candidate(&mut self, live: &[u32], dirty: &[u32], epoch: u64) -> Option<Bucket> {
        let state = &self.state;
        self.order
            .apply_touches(|b| state[b.idx()] != BucketState::PendingFree);
        let mut lru = std::mem::take(&mut self.lru);
        let salt = lru.scans;
        let victim = lru.next(
            self,
            epoch,
            // Used since the scan: warm again, not a victim now (the next scan reconsiders it).
            |bk, b, used| bk.reclaimable(b, dirty) && bk.order.stamp(b) == used,
            |bk, b| {
                bk.reclaimable(b, dirty)
                    .then(|| (bk.order.rank(b, live[b.idx()], salt), bk.order.stamp(b)))
            },
        );
        self.lru = lru;
        victim
    }

    /// The GC victim: a closed, unpinned bucket with at most `max_live_pct` % live blocks,
    /// fewest first (as of the last scan). `epoch` as for `reclaim_candidate`.
    pub fn gc_candidate(&mut self, live: &[u32], max_live_pct: u32, epoch: u64) -> Option<Bucket> {
        let mut gc = std::mem::take(&mut self.gc);
        let victim = gc.next(
            self,
            epoch,
            |bk, b, _| bk.collectable(b, live, max_live_pct),
            |bk, b| {
                bk.collectable(b, live, max_live_pct)
                    .then_some((live[b.idx()], 0))
            },
        );
        self.gc = gc;
        victim
    }

    /// Scans of every bucket so far (reclaim and GC candidates).
    #[cfg(test)]
    fn scans(&self) -> u64 {
        self.lru.scans + self.gc.scans
    }

    /// Marks an emptied bucket: generation bumped, free once epoch `tag` is durable.
    pub fn retire(&mut self, b: Bucket, tag: u64) -> Gen {
        let i = b.idx();
        assert!(matches!(self.state[i], BucketState::Closed));
        assert!(
            self.pending.back().is_none_or(|&(t, _)| t <= tag),
            "retirement tags must not decrease"
        );
        self.gen[i] = self.gen[i].next();
        self.state[i] = BucketState::PendingFree;
        self.pins.0[i].fetch_or(RETIRED, Ordering::Relaxed);
        self.order.set_tag(b, tag);
        self.pending.push_back((tag, b));
        self.pending_count += 1;
        self.gen[i]
    }

    /// Frees pending buckets whose generation bump is durable and that nobody reads (a pinned
    /// one is freed by its last unpin). Costs O(buckets released).
    pub fn release(&mut self, durable_epoch: u64) {
        while let Some(&(tag, b)) = self.pending.front() {
            if tag > durable_epoch {
                break;
            }
            self.pending.pop_front();
            if self.order.tag(b) == tag {
                self.free_unpinned(b, durable_epoch);
            }
        }
    }

    /// Checks the bookkeeping against the per-bucket states (tests; O(buckets)).
    pub fn check_invariants(&self) -> Result<(), String> {
        let pending = self
            .state
            .iter()
            .filter(|&&s| s == BucketState::PendingFree)
            .count();
        if pending != self.pending_count {
            return Err(format!(
                "{pending} pending buckets, count says {}",
                self.pending_count
            ));
        }
        let free = self
            .state
            .iter()
            .filter(|&&s| s == BucketState::Free)
            .count();
        if free != self.free.len()
            || self
                .free
                .iter()
                .any(|&b| self.state[b.idx()] != BucketState::Free)
        {
            return Err(format!(
                "{free} free buckets, free list holds {} (not all free)",
                self.free.len()
            ));
        }
        // Every pending bucket can still be found by `release`, or is waiting for its pins.
        for (b, s) in Bucket::all(self.state.len()).zip(&self.state) {
            if *s == BucketState::PendingFree {
                let tag = self.order.tag(b);
                if self.pins.count(b) == 0 && !self.pending.contains(&(tag, b)) {
                    return Err(format!("pending bucket {b} (tag {tag}) is in no queue"));
                }
            }
            let retired = self.pins.0[b.idx()].load(Ordering::Relaxed) & RETIRED != 0;
            if retired != (*s == BucketState::PendingFree) {
                return Err(format!(
                    "bucket {b} is {s:?}, its retired pin flag {retired}"
                ));
            }
        }
        Ok(())
    }

    /// Records a use of the bucket (reads and writes keep it warm for LRU reclaim).
    pub fn touch(&mut self, b: Bucket, tick: u64) {
        let in_order = self.state[b.idx()] != BucketState::PendingFree;
        self.order.used(b, tick, in_order);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_appends_then_opens_next() {
        let mut bk = Buckets::new(vec![Gen::new(0); 3], &[0, 5, 0], 4);
        assert_eq!(
            bk.alloc(WritePoint::Dirty, 3, 1, 0),
            Some((CacheBlock::new(0), 3))
        );
        assert_eq!(
            bk.alloc(WritePoint::Dirty, 3, 1, 0),
            Some((CacheBlock::new(3), 1))
        );
        assert_eq!(
            bk.alloc(WritePoint::Clean, 8, 1, 0),
            Some((CacheBlock::new(8), 4))
        );
        assert_eq!(bk.alloc(WritePoint::Dirty, 1, 1, 0), None);
        // Allocations pin their bucket until the writer is done.
        assert_eq!(bk.reclaim_candidate(&[0, 5, 4], &[0, 5, 0], 0), None);
        bk.unpin(Bucket::new(0), 0);
        bk.unpin(Bucket::new(0), 0);
        bk.unpin(Bucket::new(2), 0);
        // Bucket 0 was closed when full; reclaim it.
        let live = [0, 5, 4];
        assert_eq!(
            bk.reclaim_candidate(&live, &[0, 5, 0], 1),
            Some(Bucket::new(0))
        );
        bk.retire(Bucket::new(0), 7);
        bk.release(6);
        assert_eq!(bk.free_count(), 0);
        bk.release(7);
        assert_eq!(
            bk.alloc(WritePoint::Dirty, 1, 2, 0),
            Some((CacheBlock::new(0), 1))
        );
        assert_eq!(bk.gen[0], Gen::new(1));
    }

    /// Buckets closed with `live` blocks each (none dirty), unpinned.
    fn closed(n: usize, live: u32) -> (Buckets, Vec<u32>, Vec<u32>) {
        let lives = vec![live.max(1); n];
        let mut bk = Buckets::new(vec![Gen::new(0); n], &lives, 4);
        for b in Bucket::all(n) {
            bk.order.allocated(b, true, b.get().into());
        }
        (bk, vec![live; n], vec![0; n])
    }

    #[test]
    fn victims_come_from_one_scan_in_lru_order_and_touched_ones_are_skipped() {
        let n = 64 * 64;
        let (mut bk, live, dirty) = closed(n, 3);
        let max = candidates_max(n);
        bk.touch(Bucket::new(1), 10_000);
        let mut got = Vec::new();
        for _ in 0..max - 1 {
            got.push(bk.reclaim_candidate(&live, &dirty, 0).unwrap());
            let b = *got.last().unwrap();
            bk.retire(b, 1);
        }
        assert_eq!(bk.scans(), 1, "one scan serves {max} victims");
        // Least recently used first; bucket 1 was touched before the scan: not among them.
        assert_eq!(got[..4], [0, 2, 3, 4].map(Bucket::new));
        // A bucket touched after the scan is skipped when its turn comes.
        let next_expected = *got.last().unwrap() + 1;
        bk.touch(next_expected, 20_000);
        let b = bk.reclaim_candidate(&live, &dirty, 0).unwrap();
        assert_ne!(b, next_expected);
    }

    #[test]
    fn fifo_and_random_ignore_reads_lru_keeps_read_buckets() {
        let n = 256;
        let victims = |r: crate::policy::Replacement| {
            let (mut bk, live, dirty) = closed(n, 3);
            bk.set_replacement(r);
            bk.touch(Bucket::new(0), 10_000);
            bk.touches().note(Bucket::new(1));
            (0..8)
                .map(|_| {
                    let b = bk.reclaim_candidate(&live, &dirty, 0).unwrap();
                    bk.retire(b, 1);
                    b.get()
                })
                .collect::<Vec<_>>()
        };
        use crate::policy::Replacement as R;
        assert_eq!(
            victims(R::Lru),
            [2, 3, 4, 5, 6, 7, 8, 9],
            "read buckets kept"
        );
        assert_eq!(victims(R::Fifo), [0, 1, 2, 3, 4, 5, 6, 7], "oldest first");
        let random = victims(R::Random);
        assert_ne!(random, [0, 1, 2, 3, 4, 5, 6, 7]);
        assert!(random.iter().all(|&b| (b as usize) < n));
    }

    #[test]
    fn fifo_stamps_a_bucket_when_it_is_opened_not_per_allocation() {
        let mut bk = Buckets::new(vec![Gen::new(0); 3], &[0, 0, 0], 4);
        bk.set_replacement(crate::policy::Replacement::Fifo);
        bk.alloc(WritePoint::Clean, 1, 5, 0);
        bk.alloc(WritePoint::Clean, 1, 9, 0);
        assert_eq!(bk.order.stamp(Bucket::new(0)), 5);
        bk.set_replacement(crate::policy::Replacement::Lru);
        bk.alloc(WritePoint::Clean, 1, 12, 0);
        assert_eq!(bk.order.stamp(Bucket::new(0)), 12);
    }

    #[test]
    fn a_scan_that_finds_nothing_is_not_repeated_until_the_journal_grows() {
        let n = 64 * 64;
        let (mut bk, live, _) = closed(n, 3);
        let all_dirty = vec![1; n];
        assert_eq!(bk.reclaim_candidate(&live, &all_dirty, 100), None);
        for e in 100..100 + rescan_pause(n) {
            assert_eq!(bk.reclaim_candidate(&live, &all_dirty, e), None);
        }
        assert_eq!(bk.scans(), 1);
        let clean = vec![0; n];
        assert!(bk
            .reclaim_candidate(&live, &clean, 100 + rescan_pause(n))
            .is_some());
        assert_eq!(bk.scans(), 2);
    }

    #[test]
    fn gc_victims_fewest_live_first() {
        let (mut bk, mut live, _) = closed(8, 4);
        live[5] = 1;
        live[2] = 0;
        live[7] = 2;
        assert_eq!(bk.gc_candidate(&live, 50, 0), Some(Bucket::new(2)));
        bk.retire(Bucket::new(2), 1);
        assert_eq!(bk.gc_candidate(&live, 50, 0), Some(Bucket::new(5)));
        bk.retire(Bucket::new(5), 1);
        assert_eq!(bk.gc_candidate(&live, 50, 0), Some(Bucket::new(7)));
        bk.retire(Bucket::new(7), 1);
        assert_eq!(bk.gc_candidate(&live, 50, 1), None);
    }

    #[test]
    fn only_the_last_lock_free_unpin_of_a_retired_bucket_has_work_to_do() {
        let (mut bk, _, _) = closed(4, 2);
        let pins = bk.pins();
        bk.pin(Bucket::new(1));
        bk.pin(Bucket::new(1));
        assert!(!pins.unpin(Bucket::new(1)), "not retired: nothing to do");
        bk.retire(Bucket::new(1), 5);
        bk.release(5);
        assert_eq!(bk.free_count(), 0, "still pinned");
        bk.check_invariants().unwrap();
        assert!(pins.unpin(Bucket::new(1)), "last pin of a retired bucket");
        bk.free_unpinned(Bucket::new(1), 4);
        assert_eq!(bk.free_count(), 0, "tag not durable yet");
        bk.free_unpinned(Bucket::new(1), 5);
        assert_eq!((bk.free_count(), bk.pending_count()), (1, 0));
        bk.check_invariants().unwrap();
        // Unpinned before `release` ran: `release` frees it, a late `free_unpinned` is a no-op.
        bk.pin(Bucket::new(2));
        bk.retire(Bucket::new(2), 6);
        assert!(pins.unpin(Bucket::new(2)));
        bk.release(6);
        bk.free_unpinned(Bucket::new(2), 6);
        assert_eq!((bk.free_count(), bk.pending_count()), (2, 0));
        bk.check_invariants().unwrap();
    }

    #[test]
    fn pinned_pending_buckets_are_freed_by_their_last_unpin_once() {
        let (mut bk, _, _) = closed(4, 2);
        bk.pin(Bucket::new(1));
        bk.retire(Bucket::new(1), 5);
        bk.retire(Bucket::new(2), 6);
        assert_eq!(bk.pending_count(), 2);
        bk.release(6);
        assert_eq!(
            (bk.free_count(), bk.pending_count()),
            (1, 1),
            "2 free, 1 pinned"
        );
        bk.check_invariants().unwrap();
        bk.unpin(Bucket::new(1), 6);
        assert_eq!((bk.free_count(), bk.pending_count()), (2, 0));
        bk.release(100);
        assert_eq!(bk.free_count(), 2, "freed twice");
        // Freed by unpin before `release` saw it: the stale queue entry is skipped.
        bk.pin(Bucket::new(3));
        bk.retire(Bucket::new(3), 7);
        bk.unpin(Bucket::new(3), 8);
        assert_eq!(bk.free_count(), 3);
        bk.release(8);
        assert_eq!(bk.free_count(), 3);
        bk.check_invariants().unwrap();
    }
}
