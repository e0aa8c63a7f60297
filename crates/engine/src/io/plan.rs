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
//! 2. **device I/O**, by the caller: with [`Hit::fd`] it reads the pieces itself from that
//!    descriptor (asynchronously), else [`Hit::read_blocking`] reads them through the cache
//!    device;
//! 3. **complete** (`Hit::finish`): the checksums, the statistics and the policy's notes, the
//!    pins dropped; a clean block that failed its checksum, or a failed cache read of clean
//!    data, drops the copy and hands back a `SlowRead` that reads the backing device. Dirty
//!    data that cannot be read correctly is an error, never wrong data.
//!
//! A `SlowRead` that goes around the cache (`Read::Bypass`: mode `none`, a detach) over a
//! range the cache holds no block of, on a backing device with a descriptor, can also be
//! read by the caller itself: `Volume::read_around` turns it into an [`AroundRead`] (one read
//! of the backing device's descriptor), and [`AroundRead::finish`] accounts it as
//! `read_inner` accounts the same read (`backing_read_bytes`, the client stamp, the device's
//! cost model sample and wrappers, `io_errors`, `cache_bypass_misses` and the bypass reason's
//! bytes).
//!
//! Invariants: a `Hit`'s buckets stay pinned from the plan until it is finished or dropped
//! (dropping an unfinished hit unpins them and abandons its timing), so its cache blocks
//! cannot be reused while the caller's reads are in flight; a request is noted by the stream
//! detector exactly once, in the plan, whichever stage carries it out; a hit is counted in the
//! statistics when it finishes, a `SlowRead` when it is carried out.

use super::read::Read;
use super::Volume;
use crate::cachedev::{Kind, Timed};
use crate::index::Segs;
use crate::stats::Counters;
use crate::types::{Error, Result};
use crate::units::BackingBlock;
use std::os::fd::RawFd;

/// Expected crcs of the cached blocks of a request: up to 16 blocks without allocating.
pub(super) type Crcs = smallvec::SmallVec<[u32; 16]>;

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
    pub(super) _use: Option<super::CacheUse>,
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

/// One cache-device read of a hit: `len` bytes at `dev_offset` of the cache device into the
/// caller's buffer at `buf_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub dev_offset: u64,
    pub buf_offset: usize,
    pub len: usize,
}

/// A planned hit: pinned, its pieces to read (see the module header).
pub struct Hit {
    vol: Volume,
    offset: u64,
    len: usize,
    read: Read,
    segs: Segs,
    crcs: Crcs,
    pieces: smallvec::SmallVec<[Piece; 4]>,
    /// The cache-device I/O, timed from the plan; `None` once ended.
    timed: Option<Timed>,
    /// Held until the read is done, as by every read (see `CacheUse`).
    cache_use: super::CacheUse,
}

impl std::fmt::Debug for Hit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hit")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl Volume {
    /// Stage 1 of a read of `len` bytes at `offset` (see the module header).
    pub fn plan_read(&self, offset: u64, len: usize) -> Result<ReadPlan> {
        crate::guard::contain(&self.inner, "read", || {
            self.plan_read_unguarded(offset, len)
        })
    }

    pub(super) fn plan_read_unguarded(&self, offset: u64, len: usize) -> Result<ReadPlan> {
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
            len,
            read,
            segs,
            crcs,
            pieces,
            timed: Some(inner.cache.begin()),
            cache_use,
        }))
    }

    /// Carries out a read the plan did not serve from the cache alone, into `buf` (its
    /// `len` bytes). May block on the backing device.
    pub fn read_slow(&self, slow: SlowRead, buf: &mut [u8]) -> Result<()> {
        crate::guard::contain(&self.inner, "read", || self.read_slow_unguarded(slow, buf))
    }

    pub(super) fn read_slow_unguarded(&self, slow: SlowRead, buf: &mut [u8]) -> Result<()> {
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

impl Hit {
    /// The cache device's descriptor to read every piece from, with buffers aligned to its
    /// direct-I/O needs (4 KiB always suffices); `None`: read through [`Hit::read_blocking`].
    pub fn fd(&self) -> Option<RawFd> {
        pieces_fd(&self.vol.inner.cache, &self.pieces)
    }

    /// The cache-device reads this hit needs.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Stages 2 and 3 with blocking reads through the cache device.
    pub fn read_blocking(mut self, buf: &mut [u8]) -> Result<Option<SlowRead>> {
        let cache = std::sync::Arc::clone(&self.vol.inner.cache);
        let io = self.pieces.iter().try_for_each(|p| {
            let out = &mut buf[p.buf_offset..p.buf_offset + p.len];
            cache.device().read_at(out, p.dev_offset)
        });
        self.finish_io(buf, io)
    }

    /// Stage 3 after the caller read every piece from [`Hit::fd`] itself (`io`: the first
    /// error among them, `Ok` if all were read whole). `Ok(None)`: `buf` holds the data;
    /// `Ok(Some(slow))`: read it again with `Volume::read_slow` (a clean copy was dropped);
    /// `Err`: the read fails. The caller's own reads are accounted to the cache device (its
    /// latency, its wrappers' statistics) here.
    pub fn finish(mut self, buf: &mut [u8], io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        direct_done(
            &self.vol.inner.cache,
            self.timed.as_ref(),
            &self.pieces,
            false,
            &io,
        );
        self.finish_io(buf, io)
    }

    fn finish_io(&mut self, buf: &mut [u8], io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        let vol = self.vol.clone();
        crate::guard::contain(&vol.inner, "read", || self.complete(buf, io))
    }

    fn complete(&mut self, buf: &mut [u8], io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        let vol = &self.vol;
        let inner = &*vol.inner;
        let cache = &inner.cache;
        let at = self
            .pieces
            .first()
            .map_or((0, 0), |p| (p.dev_offset, self.len as u64));
        let io = match self.timed.take() {
            Some(t) => cache.end(t, Kind::Read, at, io),
            None => io,
        };
        let bs = inner.block_size();
        let c = &vol.backing.counters;
        Counters::add(&c.cache_read_bytes, self.len as u64);
        // Byte ranges whose cached copies were dropped, to read from the backing device.
        let mut again = smallvec::SmallVec::<[(u64, usize); 4]>::new();
        let mut result = Ok(());
        match io {
            Err(err) => {
                let err = Error::io(format!("reading cache device at {}", at.0), err);
                vol.cache_failed(&err);
                if self.segs.iter().any(|s| s.ext.is_some_and(|e| e.dirty)) {
                    // The cache device holds the only current copy.
                    result = Err(err);
                } else {
                    for s in &self.segs {
                        if let Some(e) = s.ext {
                            vol.drop_copy(s.block, e);
                            again.push((s.block.offset(bs), (s.len * bs) as usize));
                        }
                    }
                }
            }
            Ok(()) => {
                let mut crcs = &self.crcs[..];
                for s in &self.segs {
                    let Some(e) = s.ext else { continue };
                    let (expected, rest) = crcs.split_at(e.len as usize);
                    crcs = rest;
                    let from = (s.block.offset(bs) - self.offset) as usize;
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
            for s in &self.segs {
                vol.backing.policy.note_read(s.block, s.block + s.len);
            }
        }
        unpin(inner, &mut self.segs);
        if let Err(err) = result {
            Counters::add(&c.io_errors, 1);
            return Err(err);
        }
        if !again.is_empty() {
            // Counted when carried out.
            return Ok(Some(SlowRead {
                offset: self.offset,
                len: self.len,
                route: Route::Reread(self.read, again),
                tried_fast: true,
                _use: Some(std::mem::replace(
                    &mut self.cache_use,
                    super::CacheUse::none(),
                )),
            }));
        }
        vol.count_read(self.read, self.len as u64, true, false);
        Ok(None)
    }
}

/// A read around the cache carried out by the caller (see the module header): `len` bytes of
/// the backing device at [`AroundRead::pieces`] of [`AroundRead::fd`] into its buffer, then
/// [`AroundRead::finish`]. Dropping it unfinished abandons it (its bytes stay counted as
/// `backing_read_bytes`, which the slow path counts before its read too).
pub struct AroundRead {
    vol: Volume,
    offset: u64,
    why: crate::policy::Bypass,
    via: Via,
    piece: [Piece; 1],
    /// When the read was issued, on the backing device's `io_epoch` (the cost model's clock).
    issued: crate::state::IoUnderWay,
    /// Held until the read is done, as by every read (see `CacheUse`).
    _use: Option<super::CacheUse>,
}

impl std::fmt::Debug for AroundRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AroundRead")
            .field("offset", &self.offset)
            .field("piece", &self.piece[0])
            .finish()
    }
}

/// How the caller reaches the backing device for a read or write around the cache: a
/// descriptor it reads or writes at the piece's offset, or a connection of a remote device
/// lent for the one request (see `blockdev::NbdDirect`).
#[derive(Debug)]
pub(super) enum Via {
    Fd(RawFd),
    Nbd(blockdev::NbdDirect),
}

impl Via {
    /// The backing device's way for `len` bytes at `at` (`write`: a write), if it has one.
    pub(super) fn of(
        dev: &dyn blockdev::BlockDevice,
        write: bool,
        at: u64,
        len: usize,
    ) -> Option<Via> {
        match dev.direct_fd(at, len) {
            Some(fd) => Some(Via::Fd(fd)),
            None => dev.direct_nbd(write, at, len).map(Via::Nbd),
        }
    }

    pub(super) fn fd(&self) -> RawFd {
        match self {
            Via::Fd(fd) => *fd,
            Via::Nbd(lease) => lease.fd(),
        }
    }

    pub(super) fn deadline(&self) -> Option<std::time::Instant> {
        match self {
            Via::Fd(_) => None,
            Via::Nbd(lease) => Some(lease.deadline()),
        }
    }

    pub(super) fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        match self {
            Via::Fd(_) => None,
            Via::Nbd(lease) => Some(lease),
        }
    }
}

impl Volume {
    /// Stage 1 of a read around the cache on the backing device's descriptor: `Ok` if `slow`
    /// is a bypassed read (not a stream read ahead) of a range with no cached block (the
    /// cache may hold the only current copy of one) and the backing device has a descriptor
    /// for it; else `slow` back, for `read_slow`.
    /// (`slow` comes back by value, as `ReadPlan` carries a `Hit`: boxing it would cost an
    /// allocation per read for nothing.)
    #[allow(clippy::result_large_err)]
    pub fn read_around(&self, slow: SlowRead) -> std::result::Result<AroundRead, SlowRead> {
        let Route::Normal(Read::Bypass(why)) = slow.route else {
            return Err(slow);
        };
        let inner = &*self.inner;
        let backing = &self.backing;
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
            why,
            via,
            piece: [Piece {
                dev_offset: at,
                buf_offset: 0,
                len: slow.len,
            }],
            issued: backing.io_start(),
            _use: slow._use,
        })
    }
}

impl AroundRead {
    /// The backing device's descriptor to read from, into a 4 KiB-aligned buffer (the
    /// socket of the lent connection, for a remote device: see [`AroundRead::remote`]).
    pub fn fd(&self) -> RawFd {
        self.via.fd()
    }

    /// A remote backing device's connection lent for this read: the caller carries out the
    /// request on it instead of reading [`AroundRead::pieces`] at [`AroundRead::fd`].
    pub fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        self.via.remote()
    }

    /// When the lent connection's request must have been answered (see
    /// [`AroundRead::remote`]).
    pub fn remote_deadline(&self) -> Option<std::time::Instant> {
        self.via.deadline()
    }

    /// The one read: at `dev_offset` of [`AroundRead::fd`], the whole buffer.
    pub fn pieces(&self) -> &[Piece] {
        &self.piece
    }

    /// Stage 3 after the caller's read (`io`: `Ok` if it was read whole): accounts it as
    /// `read_inner` does the same read (see the module header; the cost model's sample as in
    /// `Backing::timed`). `Ok(Some(slow))`: read it again with `Volume::read_slow` — the
    /// connection lent by a remote device broke with nothing at stake, and the device's
    /// shared connections send a read again after a reconnection, as its client does with a
    /// read in flight on a connection that breaks (this attempt is not accounted; its bytes
    /// stay counted as `backing_read_bytes`, and are counted again). `Err`: the read fails.
    pub fn finish(self, io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        let vol = self.vol.clone();
        crate::guard::contain(&vol.inner, "read", || self.complete(io))
    }

    fn complete(mut self, io: std::io::Result<()>) -> Result<Option<SlowRead>> {
        if io.is_err() && self.via.remote().is_some_and(|l| l.may_resend()) {
            return Ok(Some(SlowRead {
                offset: self.offset,
                len: self.piece[0].len,
                route: Route::Normal(Read::Bypass(self.why)),
                tried_fast: true,
                _use: self._use.take(),
            }));
        }
        self.account(io).map(|()| None)
    }

    fn account(self, io: std::io::Result<()>) -> Result<()> {
        use crate::types::IoContext;
        let (vol, p) = (&self.vol, self.piece[0]);
        let backing = &vol.backing;
        vol.caller_backing_done(crate::cost::Op::Read, p, self.issued.issued_ns, io.is_ok());
        let offset = self.offset;
        match io.ctx(|| format!("reading backing device at {offset}")) {
            Ok(()) => {
                vol.count_read(Read::Bypass(self.why), p.len as u64, false, false);
                Ok(())
            }
            Err(err) => {
                Counters::add(&backing.counters.io_errors, 1);
                Err(err)
            }
        }
    }
}

/// The one descriptor of the cache device that every piece can go through, if there is one
/// (the staged read's and the staged write's `fd`).
pub(super) fn pieces_fd(cache: &crate::cachedev::CacheDev, pieces: &[Piece]) -> Option<RawFd> {
    let mut fds = pieces.iter().map(|p| cache.direct_fd(p.dev_offset, p.len));
    let first = fds.next()??;
    fds.all(|fd| fd == Some(first)).then_some(first)
}

/// Accounts the caller's own I/O of `pieces` to the cache device's wrappers (the time since
/// the plan began `timed`).
pub(super) fn direct_done(
    cache: &crate::cachedev::CacheDev,
    timed: Option<&Timed>,
    pieces: &[Piece],
    write: bool,
    io: &std::io::Result<()>,
) {
    if let Some(t) = timed {
        let took = cache.elapsed(t);
        for p in pieces {
            cache.direct_done(write, (p.dev_offset, p.len), io.is_ok(), took);
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

impl Drop for Hit {
    fn drop(&mut self) {
        if let Some(t) = self.timed.take() {
            self.vol.inner.cache.abandon(t);
        }
        unpin(&self.vol.inner, &mut self.segs);
    }
}
