//! Adapters to the server's `Export` trait: `VolumeExport` serves an engine `Volume`;
//! `DeviceExport` serves a bare device (for `tiercache emulate`).
//!
//! Invariant: a thin adapter — every decision about caching is the engine's; this only maps
//! calls and errors (engine errors become `io::Error`s, which the server turns into NBD error
//! replies), and times and counts each request of a volume (`metrics::volume`: which devices
//! served it, how long it took), since every client request passes here.

use crate::metrics::volume::{Op, VolumeMetrics};
use engine::Volume;
use server::ValidRequest;
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
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let n = data.len() as u64;
        self.timed(Op::Write, n, || self.vol.write(offset, data, fua))
    }
    fn flush(&self) -> io::Result<()> {
        self.timed(Op::Flush, 0, || self.vol.flush())
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
            self.dev.flush()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.dev.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.dev.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, _no_hole: bool) -> io::Result<()> {
        self.dev.write_zeroes(offset, len)?;
        if fua {
            self.dev.flush()?;
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
