//! Space management: block allocation with reclaim, and copying GC.
//!
//! Invariants:
//! - reclaim only empties clean, closed, unpinned buckets (dirty data is never evicted before
//!   it is written back); an emptied bucket is reusable only after its generation bump is
//!   durable (see `alloc`);
//! - client allocations leave the last [`gc_reserve`] free buckets to GC, so GC can always
//!   move a bucket's live blocks and make room (a cache filled by clients to the last bucket
//!   could be compacted no more);
//! - a client's dirty write that finds no free bucket and no clean one to reclaim runs GC
//!   itself before it spills to the backing device (which the cache is there to spare): GC
//!   from the foreground takes every range of the bucket's live extents with `try_lock`
//!   before it moves anything (the caller holds its own range, and two writers must not wait
//!   for each other's), or gives the bucket up untouched and tries the next; other
//!   allocations (promotions, clean copies) never wait for GC. When no room can be made at
//!   once the caller writes around the cache, so a full cache never stalls a request for
//!   longer than a few bounded GC rounds;
//! - one GC round at a time (`Inner::gc_lock`): a round moves at most `gc_live_pct` % of a
//!   bucket to each write point, so the reserve always holds what it moves and a round never
//!   stops half way for want of room (which would use space and free none). A client waits
//!   for a round under way (at most `GC_WAIT`: a maintenance round may wait for the client's
//!   range), then takes the room it made before it runs one;
//! - GC moves each live piece with its own dirty state, and only while the range lock shows
//!   it is still the current copy;
//! - every loop here is bounded (`RECLAIM_MAX` buckets a round) so one step takes bounded time.

use crate::alloc::WritePoint;
use crate::journal::Entry;
use crate::state::Inner;
use crate::types::{DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock};
use blockdev::BlockDevice;

/// Most buckets one space-management round empties.
const RECLAIM_MAX: usize = 16;

/// Blocks granted by `alloc_blocks`; their bucket stays pinned until this is dropped (after
/// the index entry is inserted, or when the write is abandoned). Drop it without holding the
/// state lock.
pub struct Grant<'a> {
    inner: &'a Inner,
    pub cb: CacheBlock,
    pub n: u32,
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        self.inner.unpin(self.inner.bucket_of(self.cb));
    }
}

/// Free buckets client allocations leave to GC: one open bucket for each of the two write
/// points GC moves live blocks to, which only GC fills (fewer on caches under 32 buckets).
pub fn gc_reserve(inner: &Inner) -> usize {
    (inner.layout.nbuckets as usize / 16).min(2)
}

/// Rounds of making room one allocation may run (each bounded; see the module header).
const ALLOC_ROUNDS: usize = 4;

/// Longest a client's write waits for another GC round to end before its own.
const GC_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Who allocates: clients leave [`gc_reserve`] to GC; GC may use it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum For {
    Client,
    Gc,
}

/// Allocates up to `want` blocks at `point` for a client, reclaiming clean buckets if none is
/// free and, for dirty data, compacting one with GC (see the module header). `Ok(None)`: the
/// cache is full of live dirty or pinned data right now; write around it.
pub fn alloc_blocks(inner: &Inner, point: WritePoint, want: u32) -> Result<Option<Grant<'_>>> {
    alloc_for(inner, point, want, For::Client)
}

fn alloc_for(inner: &Inner, point: WritePoint, want: u32, who: For) -> Result<Option<Grant<'_>>> {
    let keep = match who {
        For::Client => gc_reserve(inner),
        For::Gc => 0,
    };
    for _ in 0..ALLOC_ROUNDS {
        let tick = inner.next_tick();
        let granted = inner.state.lock().buckets.alloc(point, want, tick, keep);
        if let Some((cb, n)) = granted {
            return Ok(Some(Grant { inner, cb, n }));
        }
        if reclaim(inner, keep + 1, false)? > 0 {
            continue;
        }
        if who == For::Client && point == WritePoint::Dirty {
            // One round at a time: wait for one under way, then take the room it made, or
            // run one.
            let Some(_round) = inner.gc_lock.try_lock_for(GC_WAIT) else {
                continue;
            };
            let tick = inner.next_tick();
            let granted = inner.state.lock().buckets.alloc(point, want, tick, keep);
            if let Some((cb, n)) = granted {
                return Ok(Some(Grant { inner, cb, n }));
            }
            match gc_round(inner, false)? {
                Gc::Emptied => {
                    // The bucket is free once its generation bump is durable.
                    inner.commit_to(u64::MAX)?;
                    continue;
                }
                // A range in use (often the writer's own, whose old copy is in the emptiest
                // bucket): the next candidate.
                Gc::GaveUp => continue,
                Gc::NoCandidate => {}
            }
        }
        break;
    }
    inner.wake_background();
    Ok(None)
}

/// Keeps `target` buckets free for clients, beyond the [`gc_reserve`]: reclaims clean
/// buckets (least recently used first) and compacts mostly-stale buckets. Returns buckets
/// emptied.
pub fn make_space(inner: &Inner, target: usize) -> Result<usize> {
    reclaim(inner, target + gc_reserve(inner), true)
}

fn reclaim(inner: &Inner, target: usize, allow_gc: bool) -> Result<usize> {
    let mut emptied = 0;
    while emptied < RECLAIM_MAX {
        let victim = {
            let mut st = inner.state.lock();
            let st = &mut *st;
            if st.buckets.free_count() + st.buckets.pending_count() >= target {
                break;
            }
            let epoch = st.journal.appended_epoch;
            let victim =
                st.buckets
                    .reclaim_candidate(&st.index.bucket_live, &st.index.bucket_dirty, epoch);
            if let Some(b) = victim {
                retire_bucket(inner, st, b);
                emptied += 1;
            }
            victim
        };
        if victim.is_none() {
            if allow_gc && gc_one(inner)? == Gc::Emptied {
                emptied += 1;
            } else {
                break;
            }
        }
    }
    let pending = inner.state.lock().buckets.pending_count();
    if emptied > 0 || pending > 0 {
        inner.commit_to(u64::MAX)?;
    }
    Ok(emptied)
}

/// Drops a clean bucket's entries, bumps its generation (journaled) and queues it for reuse.
fn retire_bucket(inner: &Inner, st: &mut crate::state::State, b: Bucket) {
    let dirty = st.index.drop_bucket(b);
    assert_eq!(dirty, 0, "reclaim must never drop dirty data");
    let now = inner.now_ns();
    let gen = st.buckets.gen[b.idx()].next();
    st.log(&Entry::BucketGen { bucket: b, gen }, now);
    let tag = st.journal.appended_epoch;
    assert_eq!(st.buckets.retire(b, tag), gen);
}

/// What a GC round did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Gc {
    Emptied,
    /// Not emptied: a range in use (without `wait`), or a copy that could not be moved.
    GaveUp,
    NoCandidate,
}

/// A GC round from maintenance, which waits for the ranges it moves.
fn gc_one(inner: &Inner) -> Result<Gc> {
    let _round = inner.gc_lock.lock();
    gc_round(inner, true)
}

/// Copying GC of the emptiest closed bucket (the caller holds `gc_lock`): moves its live
/// extents (clean and dirty) to the open buckets, then retires it. With `wait` false (from a
/// client's write) it takes every range first or gives the bucket up untouched (see the
/// module header).
fn gc_round(inner: &Inner, wait: bool) -> Result<Gc> {
    let (b, entries) = {
        let mut st = inner.state.lock();
        let st = &mut *st;
        let epoch = st.journal.appended_epoch;
        let Some(b) =
            st.buckets
                .gc_candidate(&st.index.bucket_live, inner.config.gc_live_pct, epoch)
        else {
            return Ok(Gc::NoCandidate);
        };
        st.buckets.pin(b);
        (b, st.index.entries_in_bucket(b))
    };
    let moved = (|| -> Result<bool> {
        let mut held = Vec::new();
        if !wait {
            for &(dev, s, e) in &entries {
                match inner.ranges.try_guard(dev, s, s + u64::from(e.len)) {
                    Some(g) => held.push(g),
                    None => return Ok(false),
                }
            }
        }
        for (dev, s, e) in entries {
            let _g = wait.then(|| inner.ranges.lock(dev, s, s + u64::from(e.len)));
            if !inner
                .state
                .lock()
                .index
                .maps_to(dev, s, e.len, e.cache_block)
            {
                continue;
            }
            let Some(data) = read_verified(inner, dev, s, e)? else {
                return Ok(false);
            };
            let bs = inner.block_size() as usize;
            let mut done = 0u32;
            while done < e.len {
                let dirty_now = inner.state.lock().index.lookup(
                    dev,
                    s + u64::from(done),
                    s + u64::from(done) + 1,
                )[0]
                .ext
                .is_some_and(|x| x.dirty);
                let point = if dirty_now {
                    WritePoint::MovedDirty
                } else {
                    WritePoint::MovedClean
                };
                let Some(grant) = alloc_for(inner, point, e.len - done, For::Gc)? else {
                    return Ok(false);
                };
                let (cb, n) = (grant.cb, grant.n);
                let chunk = &data[done as usize * bs..(done + n) as usize * bs];
                let off = inner.layout.cache_block_offset(cb);
                inner
                    .cache
                    .write_at(chunk, off)
                    .ctx(|| format!("GC writing cache at {off}"))?;
                let mut st = inner.state.lock();
                let from = s + u64::from(done);
                let moved = st.index.maps_to(dev, from, n, e.cache_block + done);
                if moved {
                    // Writeback may have cleaned part of the run since it was collected: each
                    // piece keeps its own state (a dirty block moved as clean would be lost).
                    let now = inner.now_ns();
                    for seg in st.index.lookup(dev, from, from + u64::from(n)) {
                        let old = seg.ext.expect("maps_to: every block is cached");
                        let at = (seg.block - from) as u32;
                        let crcs: Vec<u32> = (0..old.len)
                            .map(|i| st.index.crc(old.cache_block + i))
                            .collect();
                        let ext = crate::index::Extent {
                            len: old.len,
                            cache_block: cb + at,
                            dirty: old.dirty,
                        };
                        st.insert_extent(dev, seg.block, ext, crcs, now);
                    }
                }
                drop(st);
                if moved {
                    // The backings' lock is never taken under the state's.
                    if let Some(b) = inner.backings.read().get(&dev) {
                        crate::stats::Counters::add(
                            &b.counters.gc_moved_bytes,
                            u64::from(n) * bs as u64,
                        );
                    }
                }
                done += n;
            }
        }
        Ok(true)
    })();
    let mut st = inner.state.lock();
    let durable = st.journal.durable_epoch;
    st.buckets.unpin(b, durable);
    let emptied = moved?
        && st.index.bucket_live[b.idx()] == 0
        && st.buckets.state[b.idx()] == crate::alloc::BucketState::Closed;
    if emptied {
        retire_bucket(inner, &mut st, b);
    }
    Ok(if emptied { Gc::Emptied } else { Gc::GaveUp })
}

/// Reads an extent from the cache (bucket pinned by the caller or range-locked) and checks
/// it. A clean extent that fails is dropped (`None`); a dirty one is an error.
pub(crate) fn read_verified(
    inner: &Inner,
    dev: DevId,
    block: BackingBlock,
    e: crate::index::Extent,
) -> Result<Option<Vec<u8>>> {
    let bs = inner.block_size() as usize;
    let mut data = vec![0u8; e.len as usize * bs];
    let off = inner.layout.cache_block_offset(e.cache_block);
    inner
        .cache
        .read_at(&mut data, off)
        .ctx(|| format!("reading cache at {off}"))?;
    // The crcs cannot change while the extent is pinned or range-locked: copy them under the
    // lock, check outside it.
    let crcs: smallvec::SmallVec<[u32; 16]> = {
        let st = inner.state.lock();
        (0..e.len)
            .map(|i| st.index.crc(e.cache_block + i))
            .collect()
    };
    let bad = crate::codec::first_bad_block(&data, &crcs, inner.block_size());
    match bad {
        None => Ok(Some(data)),
        Some(i) if e.dirty => Err(Error::DataCorrupt(format!(
            "device {} block {} (cache block {})",
            dev,
            block + u64::from(i),
            e.cache_block + i
        ))),
        Some(_) => {
            let now = inner.now_ns();
            inner
                .state
                .lock()
                .invalidate(dev, block, block + u64::from(e.len), now);
            Ok(None)
        }
    }
}
