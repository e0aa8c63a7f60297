//! Adapters to the server's `Export` trait: `VolumeExport` serves an engine `Volume`;
//! `DeviceExport` serves a bare device (for `tiercache emulate`).
//!
//! Invariant: a thin adapter — every decision about caching is the engine's; this only maps
//! calls and errors (engine errors become `io::Error`s, which the server turns into NBD error
//! replies), and times and counts each request of a volume (`metrics::volume`: which devices
//! served it, how long it took), since every client request passes here.

use crate::metrics::volume::{Op, Timer, VolumeMetrics};
use engine::{ReadPlan, Staged, Unstaged, Volume, WritePlan};
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

/// What the server carries out itself (the io_uring data path): any of the engine's staged
/// requests (`engine::Staged`: a hit read from the cache device, a write the cache absorbs
/// written to it, a read or a write around the cache on the backing device), one path for
/// all of them (generic: each kind is its own code, without a dispatch of its own).
struct Direct<S: Staged> {
    staged: S,
    fd: std::os::fd::RawFd,
    /// The staged request's pieces (up to four without allocating, as the engine's).
    pieces: smallvec::SmallVec<[DeviceIo; 4]>,
    vol: Volume,
    metrics: Arc<VolumeMetrics>,
    t: Timer,
}

impl<S: Staged> Direct<S> {
    /// The metrics' name of the request.
    const OP: Op = if S::WRITES { Op::Write } else { Op::Read };

    /// The server's own I/O of `staged` at `fd` (its `Staged::fd`).
    fn start(
        staged: S,
        fd: std::os::fd::RawFd,
        vol: Volume,
        metrics: Arc<VolumeMetrics>,
        t: Timer,
    ) -> Start {
        let pieces = staged
            .pieces()
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

    fn leased(&mut self) -> &mut blockdev::NbdDirect {
        self.staged
            .remote()
            .expect("remote I/O only of a request lent a connection")
    }
}

impl<S: Staged> server::RemoteIo for Direct<S> {
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
        self.staged
            .remote_deadline()
            .expect("remote I/O only of a request lent a connection")
    }
    fn abort(&mut self) {
        self.leased().abort()
    }
    fn failed(&mut self, res: i32) -> io::Error {
        self.leased().failed(res)
    }
}

impl<S: Staged> DirectIo for Direct<S> {
    fn fd(&self) -> std::os::fd::RawFd {
        self.fd
    }
    fn remote(&mut self) -> Option<&mut dyn server::RemoteIo> {
        match self.staged.remote() {
            Some(_) => Some(self),
            None => None,
        }
    }
    fn pieces(&self) -> &[DeviceIo] {
        &self.pieces
    }
    fn writes(&self) -> bool {
        S::WRITES
    }
    fn finish(self: Box<Self>, buf: &mut [u8], result: io::Result<()>) -> Finished {
        let Direct {
            staged,
            vol,
            metrics,
            t,
            ..
        } = *self;
        let (op, n) = (Self::OP, buf.len() as u64);
        // The request is judged by the devices its own finish accounts on this thread (a
        // reactor finishes other requests between this one's start and its finish).
        let t = t.here();
        // What the engine left to do, for a worker (`None`: done).
        let left = staged.finish(buf, result).map(|again| {
            again.map(|slow| -> EngineRest { Box::new(move |b| slow.carry_out(&vol, b)) })
        });
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

impl VolumeExport {
    /// Starts a planned read or write (`plan`: staged for the server, or the rest that may
    /// block): a staged request whose device has a descriptor is carried out by the server
    /// itself (`Direct`), else through the engine's calls on a worker (`blocking`); a rest
    /// that the engine can stage around the cache (`around`: `Volume::read_around`,
    /// `write_around`) likewise, else it continues on a worker from where the plan left it
    /// (the request is noted once).
    fn start<F, A>(
        &self,
        len: usize,
        plan: impl FnOnce() -> engine::Result<Result<F, F::Slow>>,
        blocking: impl FnOnce(F, &mut [u8]) -> engine::Result<Option<F::Slow>> + Send + 'static,
        around: impl FnOnce(&Volume, F::Slow) -> Result<A, F::Slow>,
    ) -> Start
    where
        F: Staged,
        A: Staged<Slow = F::Slow>,
    {
        let op = Direct::<F>::OP;
        let t = self.metrics.start();
        let (vol, metrics) = (self.vol.clone(), Arc::clone(&self.metrics));
        let slow = match plan() {
            Err(err) => {
                self.metrics.finish_as(t, op, len as u64, false);
                return Start::Failed(io::Error::from(err));
            }
            Ok(Ok(fast)) => match fast.fd() {
                Some(fd) => return Direct::start(fast, fd, vol, metrics, t),
                None => {
                    return Start::Rest(on_worker(metrics, op, t, move |buf| {
                        let again = blocking(fast, buf)?;
                        again.map_or(Ok(()), |s| s.carry_out(&vol, buf))
                    }))
                }
            },
            Ok(Err(slow)) => slow,
        };
        match around(&vol, slow) {
            Ok(around) => {
                let fd = around
                    .fd()
                    .expect("a request around the cache has a descriptor");
                Direct::start(around, fd, vol, metrics, t)
            }
            Err(slow) => Start::Rest(on_worker(metrics, op, t, move |buf| {
                slow.carry_out(&vol, buf)
            })),
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
    /// The engine's staged read (`VolumeExport::start`): a hit, or a read around the cache
    /// (`Volume::read_around`). (The plan is moved once, by value, as the engine moves it:
    /// boxing it would cost an allocation per read.)
    #[allow(clippy::result_large_err)]
    fn start_read(&self, offset: u64, len: usize) -> Start {
        let plan = || {
            self.vol.plan_read(offset, len).map(|plan| match plan {
                ReadPlan::Hit(hit) => Ok(hit),
                ReadPlan::Slow(slow) => Err(slow),
            })
        };
        self.start(
            len,
            plan,
            |hit, buf| hit.read_blocking(buf),
            Volume::read_around,
        )
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let n = data.len() as u64;
        self.timed(Op::Write, n, || self.vol.write(offset, data, fua))
    }
    /// The engine's staged write (`VolumeExport::start`): a write the cache absorbs, or a
    /// write around the cache (`Volume::write_around`).
    fn start_write(&self, offset: u64, len: usize, fua: bool) -> Start {
        let plan = || {
            self.vol
                .plan_write(offset, len, fua)
                .map(|plan| match plan {
                    WritePlan::Absorb(absorb) => Ok(absorb),
                    WritePlan::Slow(slow) => Err(slow),
                })
        };
        self.start(
            len,
            plan,
            |absorb, data| absorb.write_blocking(data),
            Volume::write_around,
        )
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
