//! The write path: routing (writeback, writethrough, bypass), whole-block and sub-block
//! writes, and inserting written or promoted data into the cache.
//!
//! Invariants:
//! - a sub-block write either merges into the cached block (read-modify-write, so a dirty
//!   block never loses its other sectors) or, when the block is not cached, goes straight to
//!   the backing device;
//! - data is written to the cache before its index entry is inserted, and the entry's journal
//!   record is what makes it survive a crash (see `docs/durability.md`).

use super::Volume;
use crate::alloc::WritePoint;
use crate::policy::{Bypass, WriteRoute as Route};
use crate::stats::Counters;
use crate::types::{IoContext, Result};
use crate::units::BackingBlock;
use blockdev::BlockDevice;
use std::sync::atomic::Ordering;

/// What `insert_written` did.
pub(super) enum Inserted {
    /// Nothing (a collided promotion, a degraded set).
    No,
    /// Inserted; `commit`: the journal's buffer wants a commit now.
    Yes { commit: bool },
}

impl Volume {
    /// Writes whole blocks to the cache at write point `point` and inserts them (dirty at
    /// `WritePoint::Dirty`, else clean). With `promotion`, the insert is skipped if that
    /// promotion collided. Returns the number of leading blocks stored (fewer than given when
    /// the cache has no room).
    pub(super) fn cache_insert(
        &self,
        block: BackingBlock,
        data: &[u8],
        point: WritePoint,
        promotion: Option<u64>,
    ) -> Result<u64> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let nblocks = data.len() as u64 / bs;
        let dirty = point == WritePoint::Dirty;
        let mut done = 0u64;
        while done < nblocks && !inner.is_degraded() {
            let want = (nblocks - done).min(u64::from(u32::MAX)) as u32;
            let Some(grant) = crate::space::alloc_blocks(inner, point, want)? else {
                break;
            };
            let (cb, n) = (grant.cb, grant.n);
            let chunk = &data[(done * bs) as usize..((done + u64::from(n)) * bs) as usize];
            let off = inner.layout.cache_block_offset(cb);
            Counters::add(
                &self.backing.counters.cache_written_bytes,
                chunk.len() as u64,
            );
            inner
                .cache
                .write_at(chunk, off)
                .ctx(|| format!("writing cache device at {off}"))?;
            let inserted = self.insert_written(block + done, grant.cb, chunk, dirty, promotion)?;
            drop(grant);
            match inserted {
                Inserted::No => return Ok(done),
                Inserted::Yes { commit } => {
                    done += u64::from(n);
                    if commit {
                        inner.commit_to(u64::MAX)?;
                    }
                }
            }
        }
        Ok(done)
    }

    /// Inserts `chunk`, just written to the cache at `cb`, as the blocks from `block`: dirty
    /// or clean; with `promotion`, only if that promotion did not collide; not at all once the
    /// set is degraded. `commit`: the journal's buffer is past its bound, the caller commits.
    pub(super) fn insert_written(
        &self,
        block: BackingBlock,
        cb: crate::units::CacheBlock,
        chunk: &[u8],
        dirty: bool,
        promotion: Option<u64>,
    ) -> Result<Inserted> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let n = (chunk.len() as u64 / bs) as u32;
        let crcs: Vec<u32> = chunk.chunks(bs as usize).map(crc32c::crc32c).collect();
        let mut st = inner.state.lock();
        if let Some(id) = promotion {
            if st.promotions.get(&id).is_none_or(|p| p.collided) {
                return Ok(Inserted::No);
            }
        }
        if st.uncertain.is_some() {
            // Degraded since the caller checked: nothing more enters the cache.
            return Ok(Inserted::No);
        }
        let dev = self.backing.id;
        let ext = crate::index::Extent {
            len: n,
            cache_block: cb,
            dirty,
        };
        st.collide(dev, block, block + u64::from(n));
        if let Some(id) = promotion {
            // Our own insert must not mark our own promotion collided.
            st.promotions
                .get_mut(&id)
                .expect("promotion registered")
                .collided = false;
        }
        let now = inner.now_ns();
        st.insert_extent(dev, block, ext, crcs, now);
        let pending = st.journal.buf.buf.len();
        Ok(Inserted::Yes {
            commit: pending > crate::journal::JOURNAL_BUF_MAX,
        })
    }

    // ----- writes -----

    /// Writes `data` (or zeroes when `None`) over `[offset, offset + len)` along `route`.
    pub(super) fn write_range(
        &self,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        route: Route,
    ) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let end = offset + len;
        let (b0, b1) = BackingBlock::touched_by(offset, len, bs);
        let _guard = inner.ranges.lock(self.backing.id, b0, b1);
        inner.state.lock().collide(self.backing.id, b0, b1);
        let piece =
            |from: u64, to: u64| data.map(|d| &d[(from - offset) as usize..(to - offset) as usize]);
        // Head and tail blocks that the request covers only partly.
        let head_end = (b0 + 1).offset(bs);
        let head_partial = !offset.is_multiple_of(bs) || end < head_end;
        let tail_partial = b1 - 1 > b0 && !end.is_multiple_of(bs);
        let full0 = if head_partial { b0 + 1 } else { b0 };
        let full1 = if tail_partial { b1 - 1 } else { b1 };
        if head_partial {
            self.write_partial(
                b0,
                offset,
                end.min(head_end),
                piece(offset, end.min(head_end)),
                route,
            )?;
        }
        if full1 > full0 {
            self.write_blocks(
                full0,
                piece(full0.offset(bs), full1.offset(bs)),
                full1 - full0,
                route,
            )?;
        }
        if tail_partial {
            let from = (b1 - 1).offset(bs);
            self.write_partial(b1 - 1, from, end, piece(from, end), route)?;
        }
        Ok(())
    }

    /// A write covering `[from, to)` inside block `block` but not the whole block.
    fn write_partial(
        &self,
        block: BackingBlock,
        from: u64,
        to: u64,
        data: Option<&[u8]>,
        route: Route,
    ) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let block_end = (block + 1).offset(bs).min(self.size_bytes());
        let (seg, crc) = {
            let mut st = inner.state.lock();
            let seg = st.index.lookup(self.backing.id, block, block + 1)[0];
            let crc = seg.ext.map(|e| {
                let bucket = st.index.bucket_of(e.cache_block);
                st.buckets.pin(bucket);
                st.index.crc(e.cache_block)
            });
            (seg, crc)
        };
        let cached = match (seg.ext, crc) {
            (Some(e), Some(crc)) => {
                let mut whole = vec![0u8; bs as usize];
                let r = self.read_cached(block, e, &[crc], &mut whole);
                inner.unpin(inner.bucket_of(e.cache_block));
                r?.then_some(whole)
            }
            _ => None,
        };
        match cached {
            Some(mut whole) if block_end == (block + 1).offset(bs) => {
                let at = (from - block.offset(bs)) as usize;
                let n = (to - from) as usize;
                match data {
                    Some(d) => whole[at..at + n].copy_from_slice(d),
                    None => whole[at..at + n].fill(0),
                }
                self.write_blocks(block, Some(&whole), 1, route)
            }
            _ => {
                // Not cached (or the device's partial last block): straight to the backing
                // device; anything cached for the block is stale now.
                if data.is_some() && !matches!(route, Route::Bypass(_)) {
                    self.backing.counters.bypass(Bypass::Partial, to - from);
                }
                match data {
                    Some(d) => self.backing_write(d, from)?,
                    None => self.backing_zero(from, to - from)?,
                }
                let now = inner.now_ns();
                inner
                    .state
                    .lock()
                    .invalidate(self.backing.id, block, block + 1, now);
                Ok(())
            }
        }
    }

    pub(super) fn backing_zero(&self, offset: u64, len: u64) -> Result<()> {
        Counters::add(&self.backing.counters.backing_written_bytes, len);
        self.change_backing(offset, len, |d, at| d.write_zeroes(at, len))
            .ctx(|| format!("zeroing backing device at {offset}"))
    }

    /// Writes whole blocks `[block, block + n)` (data, or zeroes when `None`) along `route`.
    fn write_blocks(
        &self,
        block: BackingBlock,
        data: Option<&[u8]>,
        n: u64,
        route: Route,
    ) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let dev = self.backing.id;
        let (from, len) = (block.offset(bs), n * bs);
        let data = match (data, route) {
            (None, _) => {
                // Zeroes always go down as a zeroing command, never through the cache.
                self.backing_zero(from, len)?;
                let now = inner.now_ns();
                inner.state.lock().invalidate(dev, block, block + n, now);
                return Ok(());
            }
            (Some(d), _) => d,
        };
        if route != Route::Back {
            self.backing_write(data, from)?;
        }
        let stored = match route {
            Route::Bypass(_) => Ok(0),
            Route::Through => self.cache_insert(block, data, WritePoint::Clean, None),
            Route::Back => {
                // Counted until the insert is done, so the header is never marked clean
                // between its dirty mark and this data (see `owner`).
                let _writer = crate::owner::dirty_write(&self.backing, inner, len)?;
                if inner.state.lock().index.dev_dirty_blocks(dev) == 0 {
                    self.backing
                        .dirty_since_ns
                        .store(inner.now_ns(), Ordering::Relaxed);
                }
                self.cache_insert(block, data, WritePoint::Dirty, None)
            }
        };
        // The cache device failed: the write goes on without it, as when it has no room (a
        // part already inserted is dropped below once the backing device has the data).
        let stored = stored.unwrap_or_else(|e| {
            self.cache_failed(&e);
            0
        });
        if stored < n {
            // No room in the cache for the rest: write it around (writeback) and drop any
            // stale copy.
            let rest = &data[(stored * bs) as usize..];
            if !matches!(route, Route::Bypass(_)) {
                self.backing
                    .counters
                    .bypass(Bypass::Full, rest.len() as u64);
            }
            if route == Route::Back {
                self.backing_write(rest, from + stored * bs)?;
            }
            let now = inner.now_ns();
            inner
                .state
                .lock()
                .invalidate(dev, block + stored, block + n, now);
        }
        Ok(())
    }
}
