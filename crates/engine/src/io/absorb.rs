//! The write path in stages, as `plan` is for reads: a write the cache absorbs (writeback,
//! whole blocks, no FUA) can be written to the cache device by a caller with its own
//! asynchronous I/O (the server's io_uring data path), and the synchronous `Volume::write`
//! goes through the same stages:
//!
//! 1. **plan** (`Volume::plan_write`): the bounds check, the stream detector (once per
//!    request), the route (`policy::route_write`: mode, shape, dirty limit, congestion). A
//!    write of whole blocks routed to the cache whose range lock is free right now, whose
//!    device header is already marked dirty and for which the write point has room without
//!    reclaiming becomes an [`Absorb`] (with FUA too: its flush is what is left once it is in
//!    the cache): its range locked, its cache blocks allocated (their buckets pinned), its
//!    cache-device writes listed as [`Piece`]s. Everything else is a [`SlowWrite`], carried
//!    out by `Volume::write_slow` (which may wait for the range, reclaim, write the header,
//!    write the backing device, flush);
//! 2. **device I/O** by the caller (the pieces, from the request's data), or
//!    [`Absorb::write_blocking`];
//! 3. **finish** (`Absorb::finish`): the blocks are inserted dirty (`insert_written`, the same
//!    insert as every cache write), the range and the pins given back. A failed cache write,
//!    a set degraded meanwhile, a header no longer marked dirty, a journal buffer past its
//!    bound or a FUA write's flush hand back a `SlowWrite` that completes the request the
//!    synchronous way.
//!
//! Invariants: as for every write, the data is on the cache device before its index entry
//! exists, and the range is locked from before the first byte is written until the entry is
//! in (so overlapping writes are ordered the same way in the cache and on the backing
//! device); an `Absorb` dropped unfinished gives back its range and pins and inserts nothing
//! (its blocks stay unused until their bucket is reclaimed); a request is counted by the
//! stream detector and in the bypass statistics once, in the plan.

use super::plan::Piece;
use super::write::Inserted;
use super::{CacheUse, Volume};
use crate::cachedev::{Kind, Timed};
use crate::format::BackingState;
use crate::policy::{Bypass, WriteRoute as Route};
use crate::stats::Counters;
use crate::types::{DevId, Error, Result};
use crate::units::{BackingBlock, CacheBlock};
use std::os::fd::RawFd;

/// What the plan of a write decided.
#[allow(clippy::large_enum_variant)]
pub enum WritePlan {
    /// Write [`Absorb::pieces`] to the cache device, then [`Absorb::finish`].
    Absorb(Absorb),
    /// Everything else, carried out by [`Volume::write_slow`] (which may block).
    Slow(SlowWrite),
}

/// A write whose route is decided but which may have to wait (see the module header).
#[derive(Debug)]
pub struct SlowWrite {
    offset: u64,
    len: u64,
    fua: bool,
    how: How,
    _use: Option<CacheUse>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    Nothing,
    Degraded,
    Range(Route),
    /// The write is in the cache; the journal's buffer wants a commit before the reply (and
    /// a FUA write its flush).
    Commit,
}

/// A planned absorbed write: its range locked, its blocks allocated.
pub struct Absorb {
    vol: Volume,
    offset: u64,
    len: u64,
    range: Option<(DevId, BackingBlock, BackingBlock)>,
    /// Allocated runs, in block order: (cache block, blocks); their buckets are pinned.
    grants: smallvec::SmallVec<[(CacheBlock, u32); 2]>,
    pieces: smallvec::SmallVec<[Piece; 2]>,
    timed: Option<Timed>,
    cache_use: Option<CacheUse>,
    /// FUA: once inserted, the journal is committed and the cache device flushed (a
    /// worker's job: `How::Commit`).
    fua: bool,
    /// Counts this write from before its look at the header's dirty mark until it is
    /// inserted or dropped, so the mark is not taken back meanwhile (`owner`).
    _writer: crate::owner::DirtyWriter,
}

impl std::fmt::Debug for Absorb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Absorb")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl Volume {
    /// Stage 1 of a write of `len` bytes at `offset` (see the module header).
    pub fn plan_write(&self, offset: u64, len: usize, fua: bool) -> Result<WritePlan> {
        crate::guard::contain(&self.inner, "write", || {
            self.plan_write_unguarded(offset, len as u64, fua)
        })
    }

    pub(super) fn plan_write_unguarded(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
    ) -> Result<WritePlan> {
        self.check(offset, len)?;
        let slow = |how, cache_use| {
            Ok(WritePlan::Slow(SlowWrite {
                offset,
                len,
                fua,
                how,
                _use: cache_use,
            }))
        };
        if len == 0 {
            return slow(How::Nothing, None);
        }
        if self.inner.is_degraded() {
            return slow(How::Degraded, None);
        }
        let cache_use = self.backing.cache_use();
        let (mut facts, now) = self.routing(len, cache_use.detaching());
        let r = self
            .backing
            .policy
            .route_write(offset, len, fua, now, &mut facts);
        self.note_stream(r.seen, now);
        let route = r.route;
        if let Route::Bypass(why) = route {
            self.backing.counters.bypass(why, len);
        }
        let bs = self.inner.block_size();
        let whole = offset.is_multiple_of(bs) && len.is_multiple_of(bs);
        if route != Route::Back || !whole {
            return slow(How::Range(route), Some(cache_use));
        }
        match self.try_absorb(offset, len) {
            Some(mut a) => {
                a.cache_use = Some(cache_use);
                a.fua = fua;
                Ok(WritePlan::Absorb(a))
            }
            None => slow(How::Range(route), Some(cache_use)),
        }
    }

    /// The absorbed write's range and blocks, if they can be had without waiting.
    fn try_absorb(&self, offset: u64, len: u64) -> Option<Absorb> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let dev = self.backing.id;
        let writer = crate::owner::dirty_writer(&self.backing);
        if self.backing.header.lock().state != BackingState::Dirty {
            // Marking it dirty writes the header: the slow path's job.
            return None;
        }
        let (b0, b1) = BackingBlock::touched_by(offset, len, bs);
        if !inner.ranges.try_lock(dev, b0, b1) {
            return None;
        }
        let mut a = Absorb {
            vol: self.clone(),
            offset,
            len,
            range: Some((dev, b0, b1)),
            grants: smallvec::SmallVec::new(),
            pieces: smallvec::SmallVec::new(),
            timed: None,
            cache_use: None,
            fua: false,
            _writer: writer,
        };
        let nblocks = len / bs;
        {
            let mut st = inner.state.lock();
            st.collide(dev, b0, b1);
            if st.index.dev_dirty_blocks(dev) == 0 {
                self.backing
                    .dirty_since_ns
                    .store(inner.now_ns(), std::sync::atomic::Ordering::Relaxed);
            }
            let mut done = 0u64;
            while done < nblocks {
                let want = (nblocks - done).min(u64::from(u32::MAX)) as u32;
                let tick = inner.next_tick();
                let keep = crate::space::gc_reserve(inner);
                let Some((cb, n)) =
                    st.buckets
                        .alloc(crate::alloc::WritePoint::Dirty, want, tick, keep)
                else {
                    // No room without reclaiming: `a` gives back what it holds.
                    drop(st);
                    return None;
                };
                a.grants.push((cb, n));
                a.pieces.push(Piece {
                    dev_offset: inner.layout.cache_block_offset(cb),
                    buf_offset: (done * bs) as usize,
                    len: (u64::from(n) * bs) as usize,
                });
                done += u64::from(n);
            }
        }
        a.timed = Some(inner.cache.begin());
        Some(a)
    }

    /// Carries out a write the plan did not absorb (or an absorbed one's rest), `data` being
    /// the request's. May block.
    pub fn write_slow(&self, slow: SlowWrite, data: &[u8]) -> Result<()> {
        crate::guard::contain(&self.inner, "write", || {
            self.write_slow_unguarded(slow, data)
        })
    }

    pub(super) fn write_slow_unguarded(&self, slow: SlowWrite, data: &[u8]) -> Result<()> {
        debug_assert_eq!(data.len() as u64, slow.len);
        match slow.how {
            How::Nothing => {}
            How::Degraded => self.degraded_change(slow.offset, slow.len, Some(data), false)?,
            How::Range(route) => self.write_range(slow.offset, slow.len, Some(data), route)?,
            How::Commit => self.inner.commit_to(u64::MAX)?,
        }
        if slow.fua {
            self.flush()?;
        }
        Ok(())
    }
}

impl Absorb {
    /// The cache device's descriptor to write every piece through, from a buffer aligned to
    /// 4 KiB; `None`: write them with [`Absorb::write_blocking`].
    pub fn fd(&self) -> Option<RawFd> {
        super::plan::pieces_fd(&self.vol.inner.cache, &self.pieces)
    }

    /// The cache-device writes: `len` bytes of the request's data from `buf_offset` to
    /// `dev_offset`.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Stages 2 and 3 with blocking writes through the cache device.
    pub fn write_blocking(mut self, data: &[u8]) -> Result<Option<SlowWrite>> {
        let cache = std::sync::Arc::clone(&self.vol.inner.cache);
        let io = self.pieces.iter().try_for_each(|p| {
            let from = &data[p.buf_offset..p.buf_offset + p.len];
            cache.device().write_at(from, p.dev_offset)
        });
        self.finish_io(data, io)
    }

    /// Stage 3 after the caller wrote every piece through [`Absorb::fd`] itself (`io`: the
    /// first error among them). `Ok(None)`: the write is done (in the cache, dirty);
    /// `Ok(Some(slow))`: complete it with `Volume::write_slow`.
    pub fn finish(mut self, data: &[u8], io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        let cache = &self.vol.inner.cache;
        super::plan::direct_done(cache, self.timed.as_ref(), &self.pieces, true, &io);
        self.finish_io(data, io)
    }

    fn finish_io(&mut self, data: &[u8], io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        let vol = self.vol.clone();
        crate::guard::contain(&vol.inner, "write", || self.complete(data, io))
    }

    fn complete(&mut self, data: &[u8], io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        let vol = self.vol.clone();
        let inner = &*vol.inner;
        let bs = inner.block_size();
        let at = self
            .pieces
            .first()
            .map_or((0, 0), |p| (p.dev_offset, self.len));
        let io = match self.timed.take() {
            Some(t) => inner.cache.end(t, Kind::Write, at, io),
            None => io,
        };
        Counters::add(&vol.backing.counters.cache_written_bytes, self.len);
        let again = |a: &mut Absorb, how| {
            Some(SlowWrite {
                offset: a.offset,
                len: a.len,
                fua: a.fua,
                how,
                _use: a.cache_use.take(),
            })
        };
        if let Err(err) = io {
            // The write goes on without the cache device, as when it has no room.
            let err = Error::io(format!("writing cache device at {}", at.0), err);
            vol.cache_failed(&err);
            self.release();
            vol.backing.counters.bypass(Bypass::Full, self.len);
            return Ok(again(self, How::Range(Route::Bypass(Bypass::Full))));
        }
        if vol.backing.header.lock().state != BackingState::Dirty {
            // Not marked clean while this write is counted (`_writer`, see `owner`); should
            // the mark be gone all the same, the slow way writes it first. These blocks stay
            // unused.
            self.release();
            return Ok(again(self, How::Range(Route::Back)));
        }
        let mut commit = false;
        let (b0, _, _) = self.block_range();
        let mut block = b0;
        for (i, &(cb, n)) in self.grants.clone().iter().enumerate() {
            let p = self.pieces[i];
            let chunk = &data[p.buf_offset..p.buf_offset + p.len];
            debug_assert_eq!(chunk.len() as u64, u64::from(n) * bs);
            match vol.insert_written(block, cb, chunk, true, None)? {
                Inserted::Yes { commit: c } => commit |= c,
                Inserted::No => {
                    // Degraded meanwhile: the slow path writes the backing device (what was
                    // inserted before stays: the same data, dirty, superseded by it).
                    self.release();
                    return Ok(again(self, How::Range(Route::Back)));
                }
            }
            block = block + u64::from(n);
        }
        self.release();
        Ok(if commit {
            again(self, How::Commit)
        } else if self.fua {
            // Durable before the reply: the flush commits the journal and flushes the device.
            again(self, How::Nothing)
        } else {
            None
        })
    }

    /// The first backing block and the range lock.
    fn block_range(&self) -> (BackingBlock, BackingBlock, DevId) {
        let bs = self.vol.inner.block_size();
        let (b0, b1) = BackingBlock::touched_by(self.offset, self.len, bs);
        (b0, b1, self.vol.backing.id)
    }

    /// Gives back the pins and the range (once).
    fn release(&mut self) {
        let inner = &*self.vol.inner;
        for (cb, _) in self.grants.drain(..) {
            inner.unpin(inner.bucket_of(cb));
        }
        if let Some(range) = self.range.take() {
            inner.ranges.unlock(range);
        }
    }
}

impl Drop for Absorb {
    fn drop(&mut self) {
        if let Some(t) = self.timed.take() {
            self.vol.inner.cache.abandon(t);
        }
        self.release();
    }
}

/// A write around the cache carried out by the caller (see the module header): the request's
/// data to the backing device at [`AroundWrite::pieces`] of [`AroundWrite::fd`], then
/// [`AroundWrite::finish`]. Its range is locked from the plan to the finish; dropping it
/// unfinished gives the range back (the backing device may hold the data or not, as for any
/// write whose reply was never sent).
pub struct AroundWrite {
    vol: Volume,
    offset: u64,
    fua: bool,
    via: super::plan::Via,
    piece: [Piece; 1],
    range: Option<(DevId, BackingBlock, BackingBlock)>,
    /// The change recorded as unflushed until the write completes (`unflushed`).
    change: Option<u64>,
    /// When the write was issued (`Backing::io_issued`).
    issued: crate::state::IoUnderWay,
    /// Held until the write is done, as by every write (see `CacheUse`).
    cache_use: Option<CacheUse>,
}

impl std::fmt::Debug for AroundWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AroundWrite")
            .field("offset", &self.offset)
            .field("piece", &self.piece[0])
            .finish()
    }
}

impl Volume {
    /// Stage 1 of a write around the cache on the backing device's descriptor: `Ok` if `slow`
    /// goes around the cache, in whole blocks, over a range the cache holds no dirty block of
    /// (clean copies are dropped by the finish once the backing device has the data, as
    /// `write_blocks` drops them; dirty ones stay the slow path's), whose range lock is free
    /// right now, and the backing device has a descriptor for it; else `slow` back, for
    /// `write_slow`. What `write_range` does before its backing write is done
    /// here: the range locked, promotions in flight over it marked collided, the bytes and the
    /// client's use of the backing device counted.
    #[allow(clippy::result_large_err)]
    pub fn write_around(&self, slow: SlowWrite) -> std::result::Result<AroundWrite, SlowWrite> {
        let How::Range(Route::Bypass(_)) = slow.how else {
            return Err(slow);
        };
        let inner = &*self.inner;
        let bs = inner.block_size();
        if slow.len == 0 || !slow.offset.is_multiple_of(bs) || !slow.len.is_multiple_of(bs) {
            return Err(slow);
        }
        let backing = &self.backing;
        let at = backing.data_offset() + slow.offset;
        let Some(via) = super::plan::Via::of(&*backing.dev, true, at, slow.len as usize) else {
            return Err(slow);
        };
        let dev = backing.id;
        let (b0, b1) = BackingBlock::touched_by(slow.offset, slow.len, bs);
        if !inner.ranges.try_lock(dev, b0, b1) {
            return Err(slow);
        }
        {
            let mut st = inner.state.lock();
            if st.index.any_overlapping(dev, b0, b1, |e| e.dirty) {
                drop(st);
                inner.ranges.unlock((dev, b0, b1));
                return Err(slow);
            }
            st.collide(dev, b0, b1);
        }
        Counters::add(&backing.counters.backing_written_bytes, slow.len);
        let change = backing.unflushed.lock().begin(b0, b1);
        backing
            .client_backing_ns
            .store(inner.now_ns(), std::sync::atomic::Ordering::Relaxed);
        let SlowWrite {
            offset,
            len,
            fua,
            _use,
            ..
        } = slow;
        Ok(AroundWrite {
            vol: self.clone(),
            offset,
            fua,
            via,
            piece: [Piece {
                dev_offset: at,
                buf_offset: 0,
                len: len as usize,
            }],
            range: Some((dev, b0, b1)),
            change: Some(change),
            issued: backing.io_start(),
            cache_use: _use,
        })
    }
}

impl AroundWrite {
    /// The backing device's descriptor to write to, from a buffer aligned to 4 KiB (the
    /// socket of the lent connection, for a remote device: see [`AroundWrite::remote`]).
    pub fn fd(&self) -> RawFd {
        self.via.fd()
    }

    /// A remote backing device's connection lent for this write: the caller carries out the
    /// request on it instead of writing [`AroundWrite::pieces`] at [`AroundWrite::fd`].
    pub fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        self.via.remote()
    }

    /// When the lent connection's request must have been answered (see
    /// [`AroundWrite::remote`]).
    pub fn remote_deadline(&self) -> Option<std::time::Instant> {
        self.via.deadline()
    }

    /// The one write: the whole request at `dev_offset` of [`AroundWrite::fd`].
    pub fn pieces(&self) -> &[Piece] {
        &self.piece
    }

    /// Stage 3 after the caller's write (`io`: `Ok` if it was written whole): accounts it as
    /// `write_range` does the same write (the cost model's sample, the device wrappers, the
    /// client's use, readahead dropped, the backing device owed a flush) and drops the cache's
    /// copies of the range (clean ones it held, or promoted meanwhile), as `write_blocks` does
    /// after its backing write; a failed write keeps them. `Ok(Some(slow))`: a FUA write's
    /// flush, for `Volume::write_slow`. `Err`: the write failed.
    pub fn finish(mut self, io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        let vol = self.vol.clone();
        crate::guard::contain(&vol.inner, "write", || self.complete(io))
    }

    fn complete(&mut self, io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        use crate::types::IoContext;
        use std::sync::atomic::Ordering;
        let (vol, p) = (&self.vol, self.piece[0]);
        let inner = &*vol.inner;
        let backing = &vol.backing;
        vol.caller_backing_done(crate::cost::Op::Write, p, self.issued.issued_ns, io.is_ok());
        let (offset, len) = (self.offset, p.len as u64);
        backing.readahead.lock().invalidate(offset, offset + len);
        backing.backing_written.store(true, Ordering::SeqCst);
        if let Some(change) = self.change.take() {
            backing.unflushed.lock().end(change, io.is_ok());
        }
        io.ctx(|| format!("writing backing device at {offset}"))?;
        if let Some((dev, b0, b1)) = self.range {
            let now = inner.now_ns();
            inner.state.lock().invalidate(dev, b0, b1, now);
        }
        self.release();
        Ok(self.fua.then(|| SlowWrite {
            offset,
            len,
            fua: true,
            how: How::Nothing,
            _use: self.cache_use.take(),
        }))
    }

    fn release(&mut self) {
        if let Some(change) = self.change.take() {
            // Dropped unfinished: the write may have reached the device.
            self.vol.backing.unflushed.lock().end(change, true);
        }
        if let Some(range) = self.range.take() {
            self.vol.inner.ranges.unlock(range);
        }
    }
}

impl Drop for AroundWrite {
    fn drop(&mut self) {
        self.release();
    }
}
