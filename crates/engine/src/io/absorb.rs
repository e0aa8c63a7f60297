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
//! An `Absorb` and an `AroundWrite` are the write stages of `direct`'s one shape (`OnCache`,
//! `OnBacking`): what they carry and how a caller drives them is there, what a write makes
//! of them is here. This file is where a write enters the engine (`Volume::write`,
//! `plan_write`); it calls down into `write` (the range's writes, the index insert) and
//! `direct`, and nothing there calls back up.
//!
//! Invariants: as for every write, the data is on the cache device before its index entry
//! exists, and the range is locked from before the first byte is written until the entry is
//! in (so overlapping writes are ordered the same way in the cache and on the backing
//! device); an `Absorb` dropped unfinished gives back its range and pins and inserts nothing
//! (its blocks stay unused until their bucket is reclaimed); a request is counted by the
//! stream detector and in the bypass statistics once, in the plan.

use super::direct::{BackingStage, CacheStage, OnBacking, OnCache, Piece, Unstaged, Via};
use super::write::Inserted;
use super::{CacheUse, Volume};
use crate::format::BackingState;
use crate::policy::{Bypass, WriteRoute as Route};
use crate::stats::Counters;
use crate::types::{DevId, Error, Result};
use crate::units::{BackingBlock, CacheBlock};

/// What the plan of a write decided.
#[allow(clippy::large_enum_variant)]
pub enum WritePlan {
    /// Write `Absorb::pieces` to the cache device, then `Absorb::finish`.
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

/// A planned absorbed write: its range locked, its blocks allocated, its pieces to write to
/// the cache device (see the module header).
pub type Absorb = OnCache<Absorbing>;

/// What a write makes of a request on the cache device: an absorbed write (see `Absorb`).
pub struct Absorbing {
    range: Option<(DevId, BackingBlock, BackingBlock)>,
    /// Allocated runs, in block order: (cache block, blocks); their buckets are pinned.
    grants: smallvec::SmallVec<[(CacheBlock, u32); 2]>,
    cache_use: Option<CacheUse>,
    /// FUA: once inserted, the journal is committed and the cache device flushed (a
    /// worker's job: `How::Commit`).
    fua: bool,
    /// Counts this write from before its look at the header's dirty mark until it is
    /// inserted or dropped, so the mark is not taken back meanwhile (`owner`).
    _writer: crate::owner::DirtyWriter,
}

impl Volume {
    /// Writes `data` at `offset`; with `fua` it is durable when this returns: the stages one
    /// after the other.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        crate::guard::contain(&self.inner, "write", || {
            self.write_unguarded(offset, data, fua)
        })
    }

    fn write_unguarded(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let slow = match self.plan_write_unguarded(offset, data.len() as u64, fua)? {
            WritePlan::Absorb(a) => match a.write_blocking(data)? {
                None => return Ok(()),
                Some(slow) => slow,
            },
            WritePlan::Slow(slow) => slow,
        };
        self.write_slow_unguarded(slow, data)
    }

    /// Stage 1 of a write of `len` bytes at `offset` (see the module header).
    pub fn plan_write(&self, offset: u64, len: usize, fua: bool) -> Result<WritePlan> {
        crate::guard::contain(&self.inner, "write", || {
            self.plan_write_unguarded(offset, len as u64, fua)
        })
    }

    fn plan_write_unguarded(&self, offset: u64, len: u64, fua: bool) -> Result<WritePlan> {
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
                a.stage.cache_use = Some(cache_use);
                a.stage.fua = fua;
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
            pieces: smallvec::SmallVec::new(),
            timed: None,
            stage: Absorbing {
                range: Some((dev, b0, b1)),
                grants: smallvec::SmallVec::new(),
                cache_use: None,
                fua: false,
                _writer: writer,
            },
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
                a.stage.grants.push((cb, n));
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

    fn write_slow_unguarded(&self, slow: SlowWrite, data: &[u8]) -> Result<()> {
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

impl Unstaged for SlowWrite {
    fn carry_out(self, vol: &Volume, data: &mut [u8]) -> Result<()> {
        vol.write_slow(self, data)
    }
}

impl Absorb {
    /// Stages 2 and 3 with blocking writes through the cache device.
    pub fn write_blocking(mut self, data: &[u8]) -> Result<Option<SlowWrite>> {
        let io = self.each_piece(|dev, p| dev.write_at(&data[p.in_buf()], p.dev_offset));
        self.finish_io(data, io)
    }

    /// A `SlowWrite` for what is left of this write (`how`), holding its cache use.
    fn rest(&mut self, how: How) -> Option<SlowWrite> {
        Some(SlowWrite {
            offset: self.offset,
            len: self.len,
            fua: self.stage.fua,
            how,
            _use: self.stage.cache_use.take(),
        })
    }
}

/// Stage 3 of an absorbed write, after the caller wrote every piece (`Absorb::finish`,
/// `write_blocking`): `Ok(None)`: the write is done (in the cache, dirty); `Ok(Some(slow))`:
/// complete it with `Volume::write_slow`.
impl CacheStage for Absorbing {
    const WRITES: bool = true;
    type Slow = SlowWrite;

    fn complete(a: &mut Absorb, data: &[u8], io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        let (at, io) = a.end_io(io);
        let vol = a.vol.clone();
        let bs = vol.inner.block_size();
        if let Err(err) = io {
            // The write goes on without the cache device, as when it has no room.
            let err = Error::io(format!("writing cache device at {at}"), err);
            vol.cache_failed(&err);
            Self::release(a);
            vol.backing.counters.bypass(Bypass::Full, a.len);
            return Ok(a.rest(How::Range(Route::Bypass(Bypass::Full))));
        }
        if vol.backing.header.lock().state != BackingState::Dirty {
            // Not marked clean while this write is counted (`_writer`, see `owner`); should
            // the mark be gone all the same, the slow way writes it first. These blocks stay
            // unused.
            Self::release(a);
            return Ok(a.rest(How::Range(Route::Back)));
        }
        let mut commit = false;
        let (mut block, _) = BackingBlock::touched_by(a.offset, a.len, bs);
        for (i, &(cb, n)) in a.stage.grants.clone().iter().enumerate() {
            let chunk = &data[a.pieces[i].in_buf()];
            debug_assert_eq!(chunk.len() as u64, u64::from(n) * bs);
            match vol.insert_written(block, cb, chunk, true, None)? {
                Inserted::Yes { commit: c } => commit |= c,
                Inserted::No => {
                    // Degraded meanwhile: the slow path writes the backing device (what was
                    // inserted before stays: the same data, dirty, superseded by it).
                    Self::release(a);
                    return Ok(a.rest(How::Range(Route::Back)));
                }
            }
            block = block + u64::from(n);
        }
        Self::release(a);
        Ok(if commit {
            a.rest(How::Commit)
        } else if a.stage.fua {
            // Durable before the reply: the flush commits the journal and flushes the device.
            a.rest(How::Nothing)
        } else {
            None
        })
    }

    /// Gives back the pins and the range (once).
    fn release(a: &mut Absorb) {
        let inner = &*a.vol.inner;
        for (cb, _) in a.stage.grants.drain(..) {
            inner.unpin(inner.bucket_of(cb));
        }
        if let Some(range) = a.stage.range.take() {
            inner.ranges.unlock(range);
        }
    }
}

/// A write around the cache carried out by the caller (see the module header): the request's
/// data to the backing device at `AroundWrite::pieces` of `AroundWrite::fd`, then
/// `AroundWrite::finish`. Its range is locked from the plan to the finish; dropping it
/// unfinished gives the range back (the backing device may hold the data or not, as for any
/// write whose reply was never sent).
pub type AroundWrite = OnBacking<WritingAround>;

/// What a write makes of a request around the cache (see `AroundWrite`).
pub struct WritingAround {
    fua: bool,
    range: Option<(DevId, BackingBlock, BackingBlock)>,
    /// The change recorded as unflushed until the write completes (`unflushed`).
    change: Option<u64>,
    /// Held until the write is done, as by every write (see `CacheUse`).
    cache_use: Option<CacheUse>,
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
        let Some(via) = Via::of(&*backing.dev, true, at, slow.len as usize) else {
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
            via,
            piece: [Piece {
                dev_offset: at,
                buf_offset: 0,
                len: len as usize,
            }],
            issued: backing.io_start(),
            stage: WritingAround {
                fua,
                range: Some((dev, b0, b1)),
                change: Some(change),
                cache_use: _use,
            },
        })
    }
}

/// Stage 3 of a write around the cache after the caller's write (`io`: `Ok` if it was
/// written whole): accounts it as `write_range` does the same write (the cost model's sample,
/// the device wrappers, the client's use, readahead dropped, the backing device owed a flush)
/// and drops the cache's copies of the range (clean ones it held, or promoted meanwhile), as
/// `write_blocks` does after its backing write; a failed write keeps them. `Ok(Some(slow))`: a
/// FUA write's flush, for `Volume::write_slow`. `Err`: the write failed.
impl BackingStage for WritingAround {
    const WRITES: bool = true;
    type Slow = SlowWrite;

    fn complete(a: &mut AroundWrite, io: std::io::Result<()>) -> Result<Option<SlowWrite>> {
        use crate::types::IoContext;
        use std::sync::atomic::Ordering;
        a.account(io.is_ok());
        let (vol, stage) = (&a.vol, &mut a.stage);
        let inner = &*vol.inner;
        let backing = &vol.backing;
        let (offset, len) = (a.offset, a.piece[0].len as u64);
        backing.readahead.lock().invalidate(offset, offset + len);
        backing.backing_written.store(true, Ordering::SeqCst);
        if let Some(change) = stage.change.take() {
            backing.unflushed.lock().end(change, io.is_ok());
        }
        io.ctx(|| format!("writing backing device at {offset}"))?;
        if let Some((dev, b0, b1)) = stage.range {
            let now = inner.now_ns();
            inner.state.lock().invalidate(dev, b0, b1, now);
        }
        Self::release(a);
        Ok(a.stage.fua.then(|| SlowWrite {
            offset,
            len,
            fua: true,
            how: How::Nothing,
            _use: a.stage.cache_use.take(),
        }))
    }

    fn release(a: &mut AroundWrite) {
        if let Some(change) = a.stage.change.take() {
            // Dropped unfinished: the write may have reached the device.
            a.vol.backing.unflushed.lock().end(change, true);
        }
        if let Some(range) = a.stage.range.take() {
            a.vol.inner.ranges.unlock(range);
        }
    }
}
