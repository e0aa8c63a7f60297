//! The one shape of a staged request: device I/O that a caller with its own asynchronous I/O
//! (the server's io_uring data path) carries out itself between an engine plan and its
//! finish. There are two kinds, and every staged request is one of them:
//!
//! - [`OnCache`]: pieces of the cache device, read (`Hit`) or written (`Absorb`), timed from
//!   the plan on the cache device's own clock;
//! - [`OnBacking`]: one piece of the backing device, read (`AroundRead`) or written
//!   (`AroundWrite`) around the cache, on its descriptor or on a connection a remote device
//!   lends for the one request ([`Via`]).
//!
//! What differs between a read and a write, and between a hit and an absorbed write, is a
//! stage ([`CacheStage`], [`BackingStage`]) that each plan defines beside the plan that makes
//! it (`plan` for reads, `absorb` for writes). A caller treats all four alike through
//! [`Staged`]: the descriptor and the pieces (or the lent connection), then `finish`, which
//! hands back what is left ([`Unstaged`], carried out on a thread that may block) or nothing.
//!
//! Invariants: a staged request is finished at most once and, dropped unfinished, gives back
//! what its plan took (the stage's `release`: pins, range lock, unflushed change) and
//! abandons its cache-device timing; the caller's own I/O is accounted where the engine's own
//! would have been (the cache device's latency and wrappers for `OnCache`, the backing
//! device's cost model, client stamp and wrappers for `OnBacking`), exactly once, in
//! `finish`; everything here is static dispatch (generic over the stage), and a staged
//! request of up to four pieces allocates nothing.

use super::Volume;
use crate::cachedev::{CacheDev, Kind, Timed};
use crate::stats::Counters;
use crate::types::Result;
use std::os::fd::RawFd;

/// One device I/O of a staged request: `len` bytes at `dev_offset` of its device, into (a
/// read) or from (a write) the caller's buffer at `buf_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub dev_offset: u64,
    pub buf_offset: usize,
    pub len: usize,
}

impl Piece {
    /// The piece's bytes in the caller's buffer.
    pub(super) fn in_buf(&self) -> std::ops::Range<usize> {
        self.buf_offset..self.buf_offset + self.len
    }
}

/// The pieces of a staged request (up to four without allocating).
pub(super) type Pieces = smallvec::SmallVec<[Piece; 4]>;

/// A request staged for its caller's own device I/O (see the module header): what the server
/// and the binary need of a `Hit`, an `Absorb`, an `AroundRead` and an `AroundWrite` alike.
pub trait Staged: Send + 'static {
    /// What is left when the caller's I/O did not finish the request.
    type Slow: Unstaged;
    /// The pieces are written from the request's data (else read into its buffer).
    const WRITES: bool;

    /// The descriptor to do every piece at, with buffers aligned to 4 KiB (the socket of the
    /// lent connection when there is one); `None`: the request cannot be done by the caller.
    fn fd(&self) -> Option<RawFd>;

    /// The device I/O to do at [`Staged::fd`].
    fn pieces(&self) -> &[Piece];

    /// A remote backing device's connection lent for this request: the caller carries out
    /// the request on it instead of doing the pieces.
    fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        None
    }

    /// When the lent connection's request must have been answered.
    fn remote_deadline(&self) -> Option<std::time::Instant> {
        None
    }

    /// After the caller's I/O (`io`: its first error, `Ok` if every piece was done whole;
    /// `buf`: the request's buffer). `Ok(None)`: done; `Ok(Some(rest))`: carry out `rest`
    /// ([`Unstaged::carry_out`]); `Err`: the request fails.
    fn finish(self, buf: &[u8], io: std::io::Result<()>) -> Result<Option<Self::Slow>>;
}

/// The rest of a request that may block (`SlowRead`, `SlowWrite`).
pub trait Unstaged: Send + 'static {
    /// Carries it out on `vol` with the request's buffer (`read_slow`, `write_slow`).
    fn carry_out(self, vol: &Volume, buf: &mut [u8]) -> Result<()>;
}

// ----- on the cache device -----

/// A staged request on the cache device: its pieces there, timed from the plan; `S` is what
/// its plan made of it (a hit, an absorbed write).
pub struct OnCache<S: CacheStage> {
    pub(super) vol: Volume,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) pieces: Pieces,
    /// The cache-device I/O, timed from the plan; `None` once ended.
    pub(super) timed: Option<Timed>,
    pub(super) stage: S,
}

/// What a staged request on the cache device is (see `OnCache`).
pub trait CacheStage: Send + Sized + 'static {
    /// The pieces are written (else read).
    const WRITES: bool;
    type Slow: Unstaged;
    /// Stage 3 once the pieces were done and accounted (`io`: their result, on the cache
    /// device's clock).
    fn complete(
        c: &mut OnCache<Self>,
        buf: &[u8],
        io: std::io::Result<()>,
    ) -> Result<Option<Self::Slow>>;
    /// Gives back what the plan took (once; also when dropped unfinished).
    fn release(c: &mut OnCache<Self>);
}

impl<S: CacheStage> OnCache<S> {
    /// The cache device's descriptor to do every piece at, with buffers aligned to its
    /// direct-I/O needs (4 KiB always suffices); `None`: do them through the engine
    /// (`Hit::read_blocking`, `Absorb::write_blocking`).
    pub fn fd(&self) -> Option<RawFd> {
        let cache = &self.vol.inner.cache;
        let mut fds = self
            .pieces
            .iter()
            .map(|p| cache.direct_fd(p.dev_offset, p.len));
        let first = fds.next()??;
        fds.all(|fd| fd == Some(first)).then_some(first)
    }

    /// The cache-device I/O.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Stage 3 after the caller did every piece at [`OnCache::fd`] itself (`io`: the first
    /// error among them). The caller's own I/O is accounted to the cache device (its latency,
    /// its wrappers' statistics) here; see the stage for the rest.
    pub fn finish(mut self, buf: &[u8], io: std::io::Result<()>) -> Result<Option<S::Slow>> {
        let cache = &self.vol.inner.cache;
        if let Some(t) = &self.timed {
            let took = cache.elapsed(t);
            for p in &self.pieces {
                cache.direct_done(S::WRITES, (p.dev_offset, p.len), io.is_ok(), took);
            }
        }
        self.finish_io(buf, io)
    }

    /// Does every piece through the cache device's own calls (`each`: one piece), for a
    /// caller without a descriptor; the first error is the result.
    pub(super) fn each_piece(
        &self,
        mut each: impl FnMut(&dyn blockdev::BlockDevice, &Piece) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let dev = self.vol.inner.cache.device();
        self.pieces.iter().try_for_each(|p| each(&**dev, p))
    }

    /// Stage 3 (see the stage), with its panics and errors contained as every request's.
    pub(super) fn finish_io(
        &mut self,
        buf: &[u8],
        io: std::io::Result<()>,
    ) -> Result<Option<S::Slow>> {
        let vol = self.vol.clone();
        let what = if S::WRITES { "write" } else { "read" };
        crate::guard::contain(&vol.inner, what, || S::complete(self, buf, io))
    }

    /// Ends the cache device's timing of the I/O with its result and counts its bytes;
    /// returns where it was (for messages) and the result.
    pub(super) fn end_io(&mut self, io: std::io::Result<()>) -> (u64, std::io::Result<()>) {
        let cache: &CacheDev = &self.vol.inner.cache;
        let at = self
            .pieces
            .first()
            .map_or((0, 0), |p| (p.dev_offset, self.len));
        let (kind, bytes) = if S::WRITES {
            (Kind::Write, &self.vol.backing.counters.cache_written_bytes)
        } else {
            (Kind::Read, &self.vol.backing.counters.cache_read_bytes)
        };
        let io = match self.timed.take() {
            Some(t) => cache.end(t, kind, at, io),
            None => io,
        };
        Counters::add(bytes, self.len);
        (at.0, io)
    }
}

impl<S: CacheStage> Drop for OnCache<S> {
    fn drop(&mut self) {
        if let Some(t) = self.timed.take() {
            self.vol.inner.cache.abandon(t);
        }
        S::release(self);
    }
}

impl<S: CacheStage> std::fmt::Debug for OnCache<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(if S::WRITES { "Absorb" } else { "Hit" })
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("pieces", &self.pieces)
            .finish()
    }
}

impl<S: CacheStage> Staged for OnCache<S> {
    type Slow = S::Slow;
    const WRITES: bool = S::WRITES;

    fn fd(&self) -> Option<RawFd> {
        OnCache::fd(self)
    }

    fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    fn finish(self, buf: &[u8], io: std::io::Result<()>) -> Result<Option<S::Slow>> {
        OnCache::finish(self, buf, io)
    }
}

// ----- on the backing device -----

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

    fn fd(&self) -> RawFd {
        match self {
            Via::Fd(fd) => *fd,
            Via::Nbd(lease) => lease.fd(),
        }
    }

    fn deadline(&self) -> Option<std::time::Instant> {
        match self {
            Via::Fd(_) => None,
            Via::Nbd(lease) => Some(lease.deadline()),
        }
    }

    fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        match self {
            Via::Fd(_) => None,
            Via::Nbd(lease) => Some(lease),
        }
    }
}

/// A staged request around the cache: the whole request at one place of the backing device,
/// reached [`Via`] a descriptor or a lent connection; `S` is what its plan made of it (a
/// read, a write).
pub struct OnBacking<S: BackingStage> {
    pub(super) vol: Volume,
    pub(super) offset: u64,
    pub(super) via: Via,
    pub(super) piece: [Piece; 1],
    /// When the I/O was issued, on the backing device's `io_epoch` (the cost model's clock).
    pub(super) issued: crate::state::IoUnderWay,
    pub(super) stage: S,
}

/// What a staged request around the cache is (see `OnBacking`).
pub trait BackingStage: Send + Sized + 'static {
    /// The pieces are written (else read).
    const WRITES: bool;
    type Slow: Unstaged;
    /// Stage 3 after the caller's I/O (`io`: `Ok` if it was done whole).
    fn complete(a: &mut OnBacking<Self>, io: std::io::Result<()>) -> Result<Option<Self::Slow>>;
    /// Gives back what the plan took (once; also when dropped unfinished).
    fn release(_a: &mut OnBacking<Self>) {}
}

impl<S: BackingStage> OnBacking<S> {
    /// The backing device's descriptor, for a 4 KiB-aligned buffer (the socket of the lent
    /// connection, for a remote device: see [`OnBacking::remote`]).
    pub fn fd(&self) -> RawFd {
        self.via.fd()
    }

    /// A remote backing device's connection lent for this request: the caller carries out
    /// the request on it instead of doing [`OnBacking::pieces`] at [`OnBacking::fd`].
    pub fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        self.via.remote()
    }

    /// When the lent connection's request must have been answered.
    pub fn remote_deadline(&self) -> Option<std::time::Instant> {
        self.via.deadline()
    }

    /// The one I/O: the whole request at `dev_offset` of [`OnBacking::fd`].
    pub fn pieces(&self) -> &[Piece] {
        &self.piece
    }

    /// Stage 3 after the caller's I/O (`io`: `Ok` if it was done whole); see the stage.
    pub fn finish(mut self, io: std::io::Result<()>) -> Result<Option<S::Slow>> {
        let vol = self.vol.clone();
        let what = if S::WRITES { "write" } else { "read" };
        crate::guard::contain(&vol.inner, what, || S::complete(&mut self, io))
    }

    /// Accounts the caller's I/O as `Backing::timed` and `Volume::on_backing` account the
    /// engine's own: the cost model's sample, the client's use of the device, its wrappers.
    pub(super) fn account(&self, ok: bool) {
        let (backing, p) = (&self.vol.backing, self.piece[0]);
        let op = if S::WRITES {
            crate::cost::Op::Write
        } else {
            crate::cost::Op::Read
        };
        let took = backing.io_done(op, p.dev_offset, p.len as u64, self.issued.issued_ns, ok);
        backing.client_backing_ns.store(
            self.vol.inner.now_ns(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let took = std::time::Duration::from_nanos(took);
        backing
            .dev
            .direct_done(S::WRITES, p.dev_offset, p.len, took, ok);
    }
}

impl<S: BackingStage> Drop for OnBacking<S> {
    fn drop(&mut self) {
        S::release(self);
    }
}

impl<S: BackingStage> std::fmt::Debug for OnBacking<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(if S::WRITES {
            "AroundWrite"
        } else {
            "AroundRead"
        })
        .field("offset", &self.offset)
        .field("piece", &self.piece[0])
        .finish()
    }
}

impl<S: BackingStage> Staged for OnBacking<S> {
    type Slow = S::Slow;
    const WRITES: bool = S::WRITES;

    fn fd(&self) -> Option<RawFd> {
        Some(self.via.fd())
    }

    fn pieces(&self) -> &[Piece] {
        &self.piece
    }

    fn remote(&mut self) -> Option<&mut blockdev::NbdDirect> {
        self.via.remote()
    }

    fn remote_deadline(&self) -> Option<std::time::Instant> {
        self.via.deadline()
    }

    /// (`buf` is not needed: the caller's I/O already moved the data.)
    fn finish(self, _buf: &[u8], io: std::io::Result<()>) -> Result<Option<S::Slow>> {
        OnBacking::finish(self, io)
    }
}
