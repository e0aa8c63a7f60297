//! Adapters to the server's `Export` trait: `VolumeExport` serves an engine `Volume`;
//! `DeviceExport` serves a bare device (for `tiercache emulate`).
//!
//! Invariant: a thin adapter — every decision about caching is the engine's; this only maps
//! calls and errors (engine errors become `io::Error`s, which the server turns into NBD error
//! replies), and times and counts each request of a volume (`metrics::volume`: which devices
//! served it, how long it took), since every client request passes here.

use crate::metrics::volume::{Op, Timer, VolumeMetrics};
use engine::{Absorb, AroundRead, AroundWrite, Hit, ReadPlan, Volume, WritePlan};
use server::{DeviceIo, DirectIo, Finished, Rest, Start, ValidRequest};
use std::io;
use std::sync::Arc;

pub struct VolumeExport {
    vol: Volume,
    name: String,
    metrics: Arc<VolumeMetrics>,
}

impl VolumeExport {
    pub fn new(vol: Volume, metrics: Arc<VolumeMetrics>) -> VolumeExport {
        let name = vol.name();
        VolumeExport { vol, name, metrics }
    }

    /// Runs one request of `bytes` bytes, recording its time and result.
    fn timed(&self, op: Op, bytes: u64, f: impl FnOnce() -> engine::Result<()>) -> io::Result<()> {
        let t = self.metrics.start();
        let r = f().map_err(io::Error::from);
        self.metrics.finish(t, op, bytes, &r);
        r
    }
}

/// The rest of a started request on a worker thread: `f` with the request's buffer, timed
/// and classified on that thread (`Timer::here`) as `op`.
fn on_worker(
    metrics: Arc<VolumeMetrics>,
    op: Op,
    t: Timer,
    f: impl FnOnce(&mut [u8]) -> engine::Result<()> + Send + 'static,
) -> Rest {
    Box::new(move |buf| {
        let t = t.here();
        let r = f(buf).map_err(io::Error::from);
        metrics.finish(t, op, buf.len() as u64, &r);
        r
    })
}

/// What the engine left of a request, for a worker thread.
type EngineRest = Box<dyn FnOnce(&mut [u8]) -> engine::Result<()> + Send>;

/// What the server carries out itself (the io_uring data path): a hit read from the cache
/// device, a write the cache absorbs written to it, or a read or a write around the cache on
/// the backing device.
enum Staged {
    Hit(Hit),
    Absorb(Absorb),
    Around(AroundRead),
    AroundWrite(AroundWrite),
}

struct Direct {
    staged: Staged,
    fd: std::os::fd::RawFd,
    /// The staged request's pieces (up to four without allocating, as the engine's).
    pieces: smallvec::SmallVec<[DeviceIo; 4]>,
    vol: Volume,
    metrics: Arc<VolumeMetrics>,
    t: Timer,
}

impl Direct {
    fn start(
        staged: Staged,
        fd: std::os::fd::RawFd,
        vol: Volume,
        metrics: Arc<VolumeMetrics>,
        t: Timer,
    ) -> Start {
        let pieces = match &staged {
            Staged::Hit(hit) => hit.pieces(),
            Staged::Absorb(absorb) => absorb.pieces(),
            Staged::Around(around) => around.pieces(),
            Staged::AroundWrite(around) => around.pieces(),
        };
        let pieces = pieces
            .iter()
            .map(|p| DeviceIo {
                offset: p.dev_offset,
                buf_offset: p.buf_offset,
                len: p.len,
            })
            .collect();
        Start::Direct(Box::new(Direct {
            staged,
            fd,
            pieces,
            vol,
            metrics,
            t,
        }))
    }
}

impl Direct {
    /// The remote backing device's connection lent for a read or write around the cache.
    fn lease(&mut self) -> Option<&mut blockdev::NbdDirect> {
        match &mut self.staged {
            Staged::Around(around) => around.remote(),
            Staged::AroundWrite(around) => around.remote(),
            Staged::Hit(_) | Staged::Absorb(_) => None,
        }
    }

    fn leased(&mut self) -> &mut blockdev::NbdDirect {
        self.lease()
            .expect("remote I/O only of a request lent a connection")
    }
}

impl server::RemoteIo for Direct {
    fn request(&mut self) -> &[u8] {
        self.leased().request()
    }
    fn reply(&mut self, header: &[u8]) -> io::Result<usize> {
        self.leased().reply(header)
    }
    fn done(&mut self) {
        self.leased().done()
    }
    fn deadline(&self) -> std::time::Instant {
        match &self.staged {
            Staged::Around(a) => a.remote_deadline(),
            Staged::AroundWrite(a) => a.remote_deadline(),
            Staged::Hit(_) | Staged::Absorb(_) => None,
        }
        .expect("remote I/O only of a request lent a connection")
    }
    fn abort(&mut self) {
        self.leased().abort()
    }
    fn failed(&mut self, res: i32) -> io::Error {
        self.leased().failed(res)
    }
}

impl DirectIo for Direct {
    fn fd(&self) -> std::os::fd::RawFd {
        self.fd
    }
    fn remote(&mut self) -> Option<&mut dyn server::RemoteIo> {
        match self.lease() {
            Some(_) => Some(self),
            None => None,
        }
    }
    fn pieces(&self) -> &[DeviceIo] {
        &self.pieces
    }
    fn writes(&self) -> bool {
        matches!(self.staged, Staged::Absorb(_) | Staged::AroundWrite(_))
    }
    fn finish(self: Box<Self>, buf: &mut [u8], result: io::Result<()>) -> Finished {
        let Direct {
            staged,
            vol,
            metrics,
            t,
            ..
        } = *self;
        let n = buf.len() as u64;
        // The request is judged by the devices its own finish accounts on this thread (a
        // reactor finishes other requests between this one's start and its finish).
        let t = t.here();
        // What the engine left to do, for a worker (`None`: done).
        let (op, left): (Op, engine::Result<Option<EngineRest>>) = match staged {
            Staged::Hit(hit) => (
                Op::Read,
                hit.finish(buf, result).map(|again| {
                    again.map(|slow| -> EngineRest { Box::new(move |b| vol.read_slow(slow, b)) })
                }),
            ),
            Staged::Absorb(absorb) => (
                Op::Write,
                absorb.finish(buf, result).map(|again| {
                    again.map(|slow| -> EngineRest { Box::new(move |b| vol.write_slow(slow, b)) })
                }),
            ),
            Staged::Around(around) => (
                Op::Read,
                around.finish(result).map(|again| {
                    again.map(|slow| -> EngineRest { Box::new(move |b| vol.read_slow(slow, b)) })
                }),
            ),
            Staged::AroundWrite(around) => (
                Op::Write,
                around.finish(result).map(|again| {
                    again.map(|slow| -> EngineRest { Box::new(move |b| vol.write_slow(slow, b)) })
                }),
            ),
        };
        match left {
            Ok(Some(f)) => Finished::Again(on_worker(metrics, op, t, f)),
            Ok(None) => {
                metrics.finish_as(t, op, n, true);
                Finished::Done(Ok(()))
            }
            Err(err) => {
                metrics.finish_as(t, op, n, false);
                Finished::Done(Err(io::Error::from(err)))
            }
        }
    }
}

/// Reads above this size have the engine's copy of their data budgeted with them.
const LARGE_READ_BYTES: u64 = 1 << 20;

impl server::Export for VolumeExport {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn description(&self) -> String {
        format!("tiercache volume {} ({})", self.vol.uuid(), self.vol.mode())
    }
    fn size_bytes(&self) -> u64 {
        self.vol.size_bytes()
    }
    fn is_rotational(&self) -> bool {
        self.vol.is_rotational()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn is_quick(&self, request: &ValidRequest) -> bool {
        match *request {
            ValidRequest::Read { offset, length, .. } => {
                self.vol.read_is_quick(offset, u64::from(length))
            }
            ValidRequest::Write { offset, length, .. } => {
                self.vol.write_is_quick(offset, u64::from(length))
            }
            _ => false,
        }
    }
    /// A read that misses may bring its data (and the miss fill around it) through one buffer
    /// of the engine's before it is copied into the reply and into the cache. Counted for
    /// large reads only: a small read's copy (at most `LARGE_READ_BYTES` and the fill window)
    /// is bounded by the worker threads that can hold one, and counting it would take every
    /// small read beyond its connection's guaranteed share of the budget.
    fn read_working_bytes(&self, length: u64) -> u64 {
        if length > LARGE_READ_BYTES {
            length + engine::policy::MISS_FILL_MAX_BYTES * 2
        } else {
            0
        }
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let n = buf.len() as u64;
        self.timed(Op::Read, n, || self.vol.read(offset, buf))
    }
    /// The engine's staged read: a hit whose cache device has a descriptor, and a read around
    /// the cache that the engine lets the server make on the backing device's descriptor
    /// (`Volume::read_around`), are read by the server itself (`Direct`); anything else
    /// continues on a worker from where the plan left it (the request is noted once).
    fn start_read(&self, offset: u64, len: usize) -> Start {
        let t = self.metrics.start();
        let (vol, metrics) = (self.vol.clone(), Arc::clone(&self.metrics));
        match self.vol.plan_read(offset, len) {
            Err(err) => {
                self.metrics.finish_as(t, Op::Read, len as u64, false);
                Start::Failed(io::Error::from(err))
            }
            Ok(ReadPlan::Hit(hit)) => match hit.fd() {
                Some(fd) => Direct::start(Staged::Hit(hit), fd, vol, metrics, t),
                None => Start::Rest(on_worker(metrics, Op::Read, t, move |buf| {
                    let again = hit.read_blocking(buf)?;
                    again.map_or(Ok(()), |s| vol.read_slow(s, buf))
                })),
            },
            Ok(ReadPlan::Slow(slow)) => match self.vol.read_around(slow) {
                Ok(around) => {
                    let fd = around.fd();
                    Direct::start(Staged::Around(around), fd, vol, metrics, t)
                }
                Err(slow) => Start::Rest(on_worker(metrics, Op::Read, t, move |buf| {
                    vol.read_slow(slow, buf)
                })),
            },
        }
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let n = data.len() as u64;
        self.timed(Op::Write, n, || self.vol.write(offset, data, fua))
    }
    /// The engine's staged write: a write the cache absorbs, on a cache device with a
    /// descriptor, and a write around the cache that the engine lets the server make on the
    /// backing device's descriptor (`Volume::write_around`) are written by the server itself
    /// (`Direct`); anything else continues on a worker from where the plan left it.
    fn start_write(&self, offset: u64, len: usize, fua: bool) -> Start {
        let t = self.metrics.start();
        let (vol, metrics) = (self.vol.clone(), Arc::clone(&self.metrics));
        match self.vol.plan_write(offset, len, fua) {
            Err(err) => {
                self.metrics.finish_as(t, Op::Write, len as u64, false);
                Start::Failed(io::Error::from(err))
            }
            Ok(WritePlan::Absorb(absorb)) => match absorb.fd() {
                Some(fd) => Direct::start(Staged::Absorb(absorb), fd, vol, metrics, t),
                None => Start::Rest(on_worker(metrics, Op::Write, t, move |data| {
                    let again = absorb.write_blocking(data)?;
                    again.map_or(Ok(()), |s| vol.write_slow(s, data))
                })),
            },
            Ok(WritePlan::Slow(slow)) => match self.vol.write_around(slow) {
                Ok(around) => {
                    let fd = around.fd();
                    Direct::start(Staged::AroundWrite(around), fd, vol, metrics, t)
                }
                Err(slow) => Start::Rest(on_worker(metrics, Op::Write, t, move |data| {
                    vol.write_slow(slow, data)
                })),
            },
        }
    }
    fn flush(&self) -> io::Result<()> {
        self.timed(Op::Flush, 0, || self.vol.flush())
    }
    fn losses(&self) -> u64 {
        self.vol.losses()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.timed(Op::Trim, len, || self.vol.discard(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, _no_hole: bool) -> io::Result<()> {
        // Zeroes always reach the backing device as a zeroing command (never a hole in the
        // cache), which satisfies NO_HOLE too.
        self.timed(Op::WriteZeroes, len, || {
            self.vol.write_zeroes(offset, len, fua)
        })
    }
    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.timed(Op::Cache, len, || self.vol.prefetch(offset, len))
    }
    fn block_status(&self, _offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        // The cache does not know where the backing device has holes: everything is data.
        Ok(vec![(len, 0)])
    }
}

/// `DeviceExport`: serves a bare `BlockDevice` (used by `tiercache emulate`).
pub struct DeviceExport {
    pub dev: std::sync::Arc<dyn blockdev::BlockDevice>,
    pub name: String,
    /// Failed flushes and FUA writes: each may have lost writes the device had acknowledged,
    /// so every connection is told (`Export::losses`).
    failed_flushes: std::sync::atomic::AtomicU64,
}

impl DeviceExport {
    pub fn new(dev: std::sync::Arc<dyn blockdev::BlockDevice>, name: String) -> DeviceExport {
        DeviceExport {
            dev,
            name,
            failed_flushes: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Flushes the device, counting a failure as a loss every connection is told of.
    fn flush_counted(&self) -> io::Result<()> {
        self.dev.flush().inspect_err(|_| {
            self.failed_flushes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        })
    }
}

impl server::Export for DeviceExport {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn description(&self) -> String {
        self.dev.describe()
    }
    fn size_bytes(&self) -> u64 {
        self.dev.size_bytes()
    }
    fn is_rotational(&self) -> bool {
        self.dev.is_rotational()
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.dev.read_at(buf, offset)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.dev.write_at(data, offset)?;
        if fua {
            self.flush_counted()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.flush_counted()
    }
    fn losses(&self) -> u64 {
        self.failed_flushes
            .load(std::sync::atomic::Ordering::SeqCst)
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.dev.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, _no_hole: bool) -> io::Result<()> {
        self.dev.write_zeroes(offset, len)?;
        if fua {
            self.flush_counted()?;
        }
        Ok(())
    }
    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn block_status(&self, _offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        Ok(vec![(len, 0)])
    }
}
