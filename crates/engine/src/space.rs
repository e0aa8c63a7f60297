//! Space management: block allocation with reclaim, and copying GC.
//!
//! Invariants:
//! - reclaim only empties clean, closed, unpinned buckets (dirty data is never evicted before
//!   it is written back); an emptied bucket is reusable only after its generation bump is
//!   durable (see `alloc`);
//! - foreground allocation never runs GC (GC takes range locks, and the foreground caller
//!   already holds one); when no bucket can be freed at once the caller writes around the
//!   cache instead of waiting, so a full cache never stalls a request;
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

/// Allocates up to `want` blocks at `point`, reclaiming clean buckets if none is free.
/// `Ok(None)`: the cache is full of dirty or pinned data right now; write around it.
pub fn alloc_blocks(inner: &Inner, point: WritePoint, want: u32) -> Result<Option<Grant<'_>>> {
    for _ in 0..2 {
        let tick = inner.next_tick();
        let granted = inner.state.lock().buckets.alloc(point, want, tick);
        if let Some((cb, n)) = granted {
            return Ok(Some(Grant { inner, cb, n }));
        }
        if reclaim(inner, 1, false)? == 0 {
            break;
        }
    }
    inner.wake_background();
    Ok(None)
}

/// Keeps `target` buckets free: reclaims clean buckets (least recently used first) and, when
/// allowed, compacts mostly-stale buckets. Returns buckets emptied.
pub fn make_space(inner: &Inner, target: usize) -> Result<usize> {
    reclaim(inner, target, true)
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
            if allow_gc && gc_one(inner)? {
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

/// Copying GC of the emptiest closed bucket: moves its live extents (clean and dirty) to the
/// open buckets, then retires it. Returns whether a bucket was emptied.
fn gc_one(inner: &Inner) -> Result<bool> {
    let (b, entries) = {
        let mut st = inner.state.lock();
        let st = &mut *st;
        let epoch = st.journal.appended_epoch;
        let Some(b) =
            st.buckets
                .gc_candidate(&st.index.bucket_live, inner.config.gc_live_pct, epoch)
        else {
            return Ok(false);
        };
        st.buckets.pin(b);
        (b, st.index.entries_in_bucket(b))
    };
    let moved = (|| -> Result<bool> {
        for (dev, s, e) in entries {
            let _g = inner.ranges.lock(dev, s, s + u64::from(e.len));
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
                    WritePoint::Dirty
                } else {
                    WritePoint::Clean
                };
                let Some(grant) = alloc_blocks(inner, point, e.len - done)? else {
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
                if st.index.maps_to(dev, from, n, e.cache_block + done) {
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
    Ok(emptied)
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
    let bad = first_bad_block(&data, &crcs, inner.block_size());
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

/// The first block of `data` (whole blocks of `bs` bytes) whose crc32c is not its entry in
/// `crcs`. Call it with no lock held.
pub(crate) fn first_bad_block(data: &[u8], crcs: &[u32], bs: u64) -> Option<u32> {
    debug_assert_eq!(data.len() as u64, crcs.len() as u64 * bs);
    data.chunks_exact(bs as usize)
        .zip(crcs)
        .position(|(d, &c)| crc32c::crc32c(d) != c)
        .map(|i| i as u32)
}
