//! The read path in stages, so that a caller with its own asynchronous I/O (the server's
//! io_uring data path) and the synchronous callers (`Volume::read`: tests, `check`, the
//! thread model) run one implementation:
//!
//! 1. **look up and plan** (`Volume::plan_read`): the bounds check, the stream detector, the
//!    route (degraded, around a congested cache, bypass, cached) and, for a request of whole
//!    blocks wholly cached, the lock-free hit: its buckets pinned, its expected crcs copied,
//!    and the cache-device reads it needs ([`Hit::pieces`]). Anything else is a [`SlowRead`]:
//!    the decisions taken so far, carried out by `Volume::read_slow`, which may block on the
//!    backing device;
//! 2. **device I/O**, by the caller: with `Hit::fd` it reads the pieces itself from that
//!    descriptor (asynchronously), else [`Hit::read_blocking`] reads them through the cache
//!    device;
//! 3. **complete** (`Hit::finish`): the checksums (`Volume::verify_cached`, in `read`), the
//!    statistics and the policy's notes, the pins dropped; a clean block that failed its
//!    checksum, or a failed cache read of clean data, drops the copy and hands back a
//!    `SlowRead` that reads the backing device. Dirty data that cannot be read correctly is
//!    an error, never wrong data.
//!
//! A `Hit` and an `AroundRead` are the read stages of `direct`'s one shape (`OnCache`,
//! `OnBacking`): what they carry and how a caller drives them is there, what a read makes of
//! them is here. This file is where a read enters the engine (`Volume::read`, `plan_read`,
//! and its route: `route_read`); it calls down into `read` (the lock-free hit, the
//! checksums, the statistics, the slow path) and `direct`, and nothing there calls back up.
//!
//! A `SlowRead` that goes around the cache (`Read::Bypass`: mode `none`, a detach) over a
//! range the cache holds no block of, on a backing device with a descriptor, can also be
//! read by the caller itself: `Volume::read_around` turns it into an [`AroundRead`] (one read
//! of the backing device's descriptor), and `AroundRead::finish` accounts it as
//! `read_inner` accounts the same read (`backing_read_bytes`, the client stamp, the device's
//! cost model sample and wrappers, `io_errors`, `cache_bypass_misses` and the bypass reason's
//! bytes).
//!
//! Invariants: a `Hit`'s buckets stay pinned from the plan until it is finished or dropped
//! (dropping an unfinished hit unpins them and abandons its timing), so its cache blocks
//! cannot be reused while the caller's reads are in flight; a request is noted by the stream
//! detector exactly once, in the plan, whichever stage carries it out; a hit is counted in the
//! statistics when it finishes, a `SlowRead` when it is carried out.

use super::direct::{BackingStage, CacheStage, OnBacking, OnCache, Piece, Unstaged, Via};
use super::read::{Crcs, Read};
use super::{CacheUse, Volume};
use crate::index::Segs;
use crate::stats::Counters;
use crate::types::{Error, Result};
use crate::units::BackingBlock;

/// What the plan of a read decided. (A `Hit` is moved once, to its caller: boxing it would
/// cost an allocation per hit for nothing.)
#[allow(clippy::large_enum_variant)]
pub enum ReadPlan {
    /// Wholly cached: read [`Hit::pieces`] from the cache device, then [`Hit::finish`].
    Hit(Hit),
    /// Everything else, carried out by [`Volume::read_slow`] (which may block).
    Slow(SlowRead),
}

/// A read whose route is decided but which may have to wait on the backing device.
#[derive(Debug)]
pub struct SlowRead {
    pub(super) offset: u64,
    pub(super) len: usize,
    pub(super) route: Route,
    /// The lock-free hit was tried (and missed): the slow path need not try it again.
    pub(super) tried_fast: bool,
    /// Held until the read is done: a detach waits for it (see `CacheUse`).
    pub(super) _use: Option<CacheUse>,
}

/// How a `SlowRead` goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// Nothing to read (an empty request).
    Nothing,
    /// The set is degraded: around the cache (see `degraded`).
    Degraded,
    /// The cache device is congested: the backing device serves it unless part of it is
    /// dirty, then as `read`.
    AroundCongestion(Read),
    Normal(Read),
    /// A hit whose copies of these byte ranges (offset, length) could not be used (a failed
    /// cache read, a checksum mismatch) and were dropped: they are read from the backing
    /// device, the rest of the buffer already holds the request's data. Counted as a hit,
    /// as the copies were found.
    Reread(Read, smallvec::SmallVec<[(u64, usize); 4]>),
}

/// A planned hit: pinned, its pieces to read from the cache device (see the module header).
pub type Hit = OnCache<Hitting>;

/// What a read makes of a request on the cache device: a hit (see `Hit`).
pub struct Hitting {
    read: Read,
    segs: Segs,
    crcs: Crcs,
    /// Held until the read is done, as by every read (see `CacheUse`).
    cache_use: CacheUse,
}

impl Volume {
    /// Reads `buf.len()` bytes at `offset`: the stages one after the other.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        crate::guard::contain(&self.inner, "read", || self.read_unguarded(offset, buf))
    }

    fn read_unguarded(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let slow = match self.plan_read_unguarded(offset, buf.len())? {
            ReadPlan::Hit(hit) => match hit.read_blocking(buf)? {
                None => return Ok(()),
                Some(slow) => slow,
            },
            ReadPlan::Slow(slow) => slow,
        };
        self.read_slow_unguarded(slow, buf)
    }

    /// Stage 1 of a read of `len` bytes at `offset` (see the module header).
    pub fn plan_read(&self, offset: u64, len: usize) -> Result<ReadPlan> {
        crate::guard::contain(&self.inner, "read", || {
            self.plan_read_unguarded(offset, len)
        })
    }

    fn plan_read_unguarded(&self, offset: u64, len: usize) -> Result<ReadPlan> {
        self.check(offset, len as u64)?;
        let slow = |route, tried_fast, cache_use| {
            Ok(ReadPlan::Slow(SlowRead {
                offset,
                len,
                route,
                tried_fast,
                _use: cache_use,
            }))
        };
        if len == 0 {
            return slow(Route::Nothing, false, None);
        }
        if self.inner.is_degraded() {
            return slow(Route::Degraded, false, None);
        }
        let (read, around_congestion, cache_use) = self.route_read(offset, len as u64);
        if around_congestion {
            return slow(Route::AroundCongestion(read), false, Some(cache_use));
        }
        let bs = self.inner.block_size();
        if !offset.is_multiple_of(bs) || !(len as u64).is_multiple_of(bs) {
            // Partial blocks are cut out of whole ones: the slow path's job.
            return slow(Route::Normal(read), false, Some(cache_use));
        }
        let (b0, b1) = BackingBlock::touched_by(offset, len as u64, bs);
        let mut crcs = Crcs::new();
        let Some(segs) = self.lock_free_hit(b0, b1, &mut crcs) else {
            return slow(Route::Normal(read), true, Some(cache_use));
        };
        let inner = &*self.inner;
        let pieces = segs
            .iter()
            .filter_map(|s| {
                s.ext.map(|e| Piece {
                    dev_offset: inner.layout.cache_block_offset(e.cache_block),
                    buf_offset: ((s.block.offset(bs)) - offset) as usize,
                    len: (s.len * bs) as usize,
                })
            })
            .collect();
        Ok(ReadPlan::Hit(Hit {
            vol: self.clone(),
            offset,
            len: len as u64,
            pieces,
            timed: Some(inner.cache.begin()),
            stage: Hitting {
                read,
                segs,
                crcs,
                cache_use,
            },
        }))
    }

    /// How a read of `len` bytes at `offset` treats the cache, as the policy routes it (once
    /// per request: it notes it in the stream detector), and whether it goes around a
    /// congested cache device. The read holds the returned `CacheUse` until it is done (it
    /// may promote).
    fn route_read(&self, offset: u64, len: u64) -> (Read, bool, CacheUse) {
        let cache_use = self.backing.cache_use();
        let (mut facts, now) = self.routing(len, cache_use.detaching());
        let r = self.backing.policy.route_read(offset, len, now, &mut facts);
        self.note_stream(r.seen, now);
        let read = match r.route {
            crate::policy::ReadRoute::Cached { stream } => Read::Cached { stream },
            crate::policy::ReadRoute::Bypass(why) => Read::Bypass(why),
            crate::policy::ReadRoute::Ahead(why) => Read::Ahead(why),
        };
        (read, r.around_congestion, cache_use)
    }

    /// Carries out a read the plan did not serve from the cache alone, into `buf` (its
    /// `len` bytes). May block on the backing device.
    pub fn read_slow(&self, slow: SlowRead, buf: &mut [u8]) -> Result<()> {
        crate::guard::contain(&self.inner, "read", || self.read_slow_unguarded(slow, buf))
    }

    fn read_slow_unguarded(&self, slow: SlowRead, buf: &mut [u8]) -> Result<()> {
        debug_assert_eq!(buf.len(), slow.len);
        let offset = slow.offset;
        match slow.route {
            Route::Nothing => Ok(()),
            Route::Degraded => self.degraded_read(offset, buf),
            Route::AroundCongestion(read) => match self.read_around_congestion(offset, buf) {
                Some(r) => r,
                None => self.read_inner(offset, buf, read, false),
            },
            Route::Normal(read) => self.read_inner(offset, buf, read, slow.tried_fast),
            Route::Reread(read, ranges) => {
                for (at, len) in ranges {
                    let from = (at - offset) as usize;
                    self.backing_read(&mut buf[from..from + len], at)?;
                }
                self.count_read(read, slow.len as u64, true, false);
                Ok(())
            }
        }
    }
}

impl Unstaged for SlowRead {
    fn carry_out(self, vol: &Volume, buf: &mut [u8]) -> Result<()> {
        vol.read_slow(self, buf)
    }
}

impl Hit {
    /// Stages 2 and 3 with blocking reads through the cache device.
    pub fn read_blocking(mut self, buf: &mut [u8]) -> Result<Option<SlowRead>> {
        let io = self.each_piece(|dev, p| dev.read_at(&mut buf[p.in_buf()], p.dev_offset));
        self.finish_io(buf, io)
    }
}

/// Stage 3 of a hit, after the caller read every piece (`Hit::finish`, `read_blocking`):
/// `Ok(None)`: `buf` holds the data; `Ok(Some(slow))`: read it again with
/// `Volume::read_slow` (a clean copy was dropped); `Err`: the read fails.
impl CacheStage for Hitting {
    const WRITES: bool = false;
    type Slow = SlowRead;

    fn complete(hit: &mut Hit, buf: &[u8], io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        let (at, io) = hit.end_io(io);
        let (vol, stage) = (&hit.vol, &mut hit.stage);
        let inner = &*vol.inner;
        let bs = inner.block_size();
        let c = &vol.backing.counters;
        // Byte ranges whose cached copies were dropped, to read from the backing device.
        let mut again = smallvec::SmallVec::<[(u64, usize); 4]>::new();
        let mut result = Ok(());
        match io {
            Err(err) => {
                let err = Error::io(format!("reading cache device at {at}"), err);
                vol.cache_failed(&err);
                if stage.segs.iter().any(|s| s.ext.is_some_and(|e| e.dirty)) {
                    // The cache device holds the only current copy.
                    result = Err(err);
                } else {
                    for s in &stage.segs {
                        if let Some(e) = s.ext {
                            vol.drop_copy(s.block, e);
                            again.push((s.block.offset(bs), (s.len * bs) as usize));
                        }
                    }
                }
            }
            Ok(()) => {
                let mut crcs = &stage.crcs[..];
                for s in &stage.segs {
                    let Some(e) = s.ext else { continue };
                    let (expected, rest) = crcs.split_at(e.len as usize);
                    crcs = rest;
                    let from = (s.block.offset(bs) - hit.offset) as usize;
                    let out = &buf[from..from + (s.len * bs) as usize];
                    match vol.verify_cached(s.block, e, expected, out) {
                        Ok(true) => {}
                        Ok(false) => again.push((s.block.offset(bs), (s.len * bs) as usize)),
                        Err(err) => {
                            result = Err(err);
                            break;
                        }
                    }
                }
            }
        }
        if result.is_ok() && again.is_empty() {
            for s in &stage.segs {
                vol.backing.policy.note_read(s.block, s.block + s.len);
            }
        }
        unpin(inner, &mut stage.segs);
        if let Err(err) = result {
            Counters::add(&c.io_errors, 1);
            return Err(err);
        }
        if !again.is_empty() {
            // Counted when carried out.
            return Ok(Some(SlowRead {
                offset: hit.offset,
                len: hit.len as usize,
                route: Route::Reread(stage.read, again),
                tried_fast: true,
                _use: Some(std::mem::replace(&mut stage.cache_use, CacheUse::none())),
            }));
        }
        vol.count_read(stage.read, hit.len, true, false);
        Ok(None)
    }

    fn release(hit: &mut Hit) {
        unpin(&hit.vol.inner, &mut hit.stage.segs);
    }
}

/// A read around the cache carried out by the caller (see the module header): `len` bytes of
/// the backing device at `AroundRead::pieces` of `AroundRead::fd` into its buffer, then
/// `AroundRead::finish`. Dropping it unfinished abandons it (its bytes stay counted as
/// `backing_read_bytes`, which the slow path counts before its read too).
pub type AroundRead = OnBacking<ReadingAround>;

impl Volume {
    /// Stage 1 of a read around the cache on the backing device's descriptor: `Ok` if `slow`
    /// is a bypassed read (not a stream read ahead) of a range with no cached block (the
    /// cache may hold the only current copy of one) and the backing device has a descriptor
    /// for it; else `slow` back, for `read_slow`.
    /// (`slow` comes back by value, as `ReadPlan` carries a `Hit`: boxing it would cost an
    /// allocation per read for nothing.)
    #[allow(clippy::result_large_err)]
    pub fn read_around(&self, slow: SlowRead) -> std::result::Result<AroundRead, SlowRead> {
        let (inner, backing) = (&*self.inner, &self.backing);
        let Route::Normal(Read::Bypass(why)) = slow.route else {
            return Err(slow);
        };
        let at = backing.data_offset() + slow.offset;
        let Some(via) = Via::of(&*backing.dev, false, at, slow.len) else {
            return Err(slow);
        };
        let (b0, b1) = BackingBlock::touched_by(slow.offset, slow.len as u64, inner.block_size());
        if inner
            .state
            .lock()
            .index
            .any_overlapping(backing.id, b0, b1, |_| true)
        {
            return Err(slow);
        }
        // What `read_inner` and `backing_read` do before the device read.
        inner.next_tick();
        Counters::add(&backing.counters.backing_read_bytes, slow.len as u64);
        backing
            .client_backing_ns
            .store(inner.now_ns(), std::sync::atomic::Ordering::Relaxed);
        Ok(AroundRead {
            vol: self.clone(),
            offset: slow.offset,
            via,
            piece: [Piece {
                dev_offset: at,
                buf_offset: 0,
                len: slow.len,
            }],
            issued: backing.io_start(),
            stage: ReadingAround {
                why,
                _use: slow._use,
            },
        })
    }
}

/// What a read makes of a request around the cache (see `AroundRead`).
pub struct ReadingAround {
    why: crate::policy::Bypass,
    /// Held until the read is done, as by every read (see `CacheUse`).
    _use: Option<CacheUse>,
}

/// Stage 3 of a read around the cache after the caller's read (`io`: `Ok` if it was read
/// whole): accounts it as `read_inner` does the same read (see the module header; the cost
/// model's sample as in `Backing::timed`). `Ok(Some(slow))`: read it again with
/// `Volume::read_slow` — the connection lent by a remote device broke with nothing at stake,
/// and the device's shared connections send a read again after a reconnection, as its client
/// does with a read in flight on a connection that breaks (this attempt is not accounted; its
/// bytes stay counted as `backing_read_bytes`, and are counted again). `Err`: the read fails.
impl BackingStage for ReadingAround {
    const WRITES: bool = false;
    type Slow = SlowRead;

    fn complete(a: &mut AroundRead, io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        use crate::types::IoContext;
        if io.is_err() && a.remote().is_some_and(|l| l.may_resend()) {
            return Ok(Some(SlowRead {
                offset: a.offset,
                len: a.piece[0].len,
                route: Route::Normal(Read::Bypass(a.stage.why)),
                tried_fast: true,
                _use: a.stage._use.take(),
            }));
        }
        a.account(io.is_ok());
        let (vol, offset, len) = (&a.vol, a.offset, a.piece[0].len as u64);
        match io.ctx(|| format!("reading backing device at {offset}")) {
            Ok(()) => {
                vol.count_read(Read::Bypass(a.stage.why), len, false, false);
                Ok(None)
            }
            Err(err) => {
                Counters::add(&vol.backing.counters.io_errors, 1);
                Err(err)
            }
        }
    }
}

/// Drops the pins of `segs` (once: they are taken out).
fn unpin(inner: &crate::state::Inner, segs: &mut Segs) {
    for s in segs.drain(..) {
        if let Some(e) = s.ext {
            inner.unpin(inner.bucket_of(e.cache_block));
        }
    }
}
