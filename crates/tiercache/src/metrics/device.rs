//! `TimedDevice`: the cache and backing devices as `serve` hands them to the engine, timed.
//!
//! Every I/O through the wrapper is counted (bytes, errors) and timed into a histogram per
//! operation, and what a thread moved to and from each kind of device is added to that
//! thread's [`Tally`]. The engine runs a client request's device I/O on the thread that
//! called it, so the difference of the tally before and after a request says which devices
//! served it (see `volume`): that is how the export layer tells a hit from a miss or a
//! bypass without help from the engine. Background threads (writeback, maintenance) add to
//! their own tallies, which nobody reads.
//!
//! Invariants: a transparent wrapper — every call goes to the inner device unchanged, with
//! its result (the device's lock lives as long as the inner device, that is, as long as the
//! wrapper); on the cache device only I/O at or past the data area (`data_offset`) counts in
//! the tally, so journal and checkpoint writes are not mistaken for cached data; until the
//! data area is known nothing on the cache device counts. Costs: two clock reads, four
//! relaxed atomic adds and one thread-local update per I/O.

use super::hist::{HistSnapshot, Histogram};
use blockdev::BlockDevice;
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// Operations of a device, in the order of `DeviceMetrics::ops`.
pub const DEVICE_OPS: [&str; 5] = ["read", "write", "flush", "discard", "write_zeroes"];
const READ: usize = 0;
const WRITE: usize = 1;
const FLUSH: usize = 2;
const DISCARD: usize = 3;
const WRITE_ZEROES: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Cache,
    Backing,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Cache => "cache",
            Role::Backing => "backing",
        }
    }
}

/// What one thread moved to and from the devices so far (bytes; cache: data area only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub backing_read: u64,
    pub backing_written: u64,
    pub cache_read: u64,
    pub cache_written: u64,
}

impl Tally {
    pub fn since(&self, earlier: &Tally) -> Tally {
        Tally {
            backing_read: self.backing_read.wrapping_sub(earlier.backing_read),
            backing_written: self.backing_written.wrapping_sub(earlier.backing_written),
            cache_read: self.cache_read.wrapping_sub(earlier.cache_read),
            cache_written: self.cache_written.wrapping_sub(earlier.cache_written),
        }
    }
}

thread_local! {
    static TALLY: Cell<Tally> = const { Cell::new(Tally {
        backing_read: 0, backing_written: 0, cache_read: 0, cache_written: 0,
    }) };
}

/// This thread's tally.
pub fn tally() -> Tally {
    TALLY.with(Cell::get)
}

fn add_to_tally(f: impl FnOnce(&mut Tally)) {
    TALLY.with(|t| {
        let mut v = t.get();
        f(&mut v);
        t.set(v);
    });
}

/// One operation of one device.
#[derive(Default, Debug)]
pub struct OpStats {
    pub latency: Histogram,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
}

/// The I/O of one device, as `TimedDevice` saw it.
#[derive(Debug)]
pub struct DeviceMetrics {
    pub role: Role,
    /// The device as named on the command line or in the configuration.
    pub device: String,
    pub ops: [OpStats; 5],
    /// A remote (NBD) device, to ask for its connections when sampled: weak, so a sample
    /// never keeps a device the engine dropped (only remote devices: they hold no lock).
    pub remote: Option<Weak<dyn BlockDevice>>,
}

/// A point-in-time copy of one device's [`DeviceMetrics`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceSample {
    pub role: Role,
    pub device: String,
    pub ops: Vec<DeviceOpSample>,
    /// A remote device's connections (see [`blockdev::NbdLinks`]).
    #[serde(default)]
    pub nbd: Option<blockdev::NbdLinks>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceOpSample {
    pub op: String,
    pub bytes: u64,
    pub errors: u64,
    pub latency: HistSnapshot,
}

impl DeviceMetrics {
    pub fn sample(&self) -> DeviceSample {
        DeviceSample {
            role: self.role,
            device: self.device.clone(),
            ops: DEVICE_OPS
                .iter()
                .zip(&self.ops)
                .map(|(op, s)| DeviceOpSample {
                    op: op.to_string(),
                    bytes: s.bytes.load(Relaxed),
                    errors: s.errors.load(Relaxed),
                    latency: s.latency.snapshot(),
                })
                .collect(),
            nbd: self
                .remote
                .as_ref()
                .and_then(Weak::upgrade)
                .and_then(|d| d.nbd_links()),
        }
    }
}

/// A device whose I/O is timed and counted (see the module header).
#[derive(Debug)]
pub struct TimedDevice {
    inner: Arc<dyn BlockDevice>,
    metrics: Arc<DeviceMetrics>,
    /// Cache device: where its data area starts (`u64::MAX` until known). Backing: 0.
    data_offset: Arc<AtomicU64>,
}

impl TimedDevice {
    pub fn new(
        inner: Arc<dyn BlockDevice>,
        metrics: Arc<DeviceMetrics>,
        data_offset: Arc<AtomicU64>,
    ) -> TimedDevice {
        TimedDevice {
            inner,
            metrics,
            data_offset,
        }
    }

    fn timed<T>(&self, op: usize, bytes: u64, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let start = Instant::now();
        let r = f();
        self.record(op, bytes, start.elapsed(), r.is_ok());
        r
    }

    fn record(&self, op: usize, bytes: u64, took: std::time::Duration, ok: bool) {
        let s = &self.metrics.ops[op];
        s.latency.observe(took);
        if ok {
            s.bytes.fetch_add(bytes, Relaxed);
        } else {
            s.errors.fetch_add(1, Relaxed);
        }
    }

    /// Adds a completed data transfer to this thread's tally.
    fn tally(&self, write: bool, offset: u64, bytes: u64) {
        match self.metrics.role {
            Role::Backing => add_to_tally(|t| {
                if write {
                    t.backing_written += bytes;
                } else {
                    t.backing_read += bytes;
                }
            }),
            Role::Cache => {
                if offset < self.data_offset.load(Relaxed) {
                    return;
                }
                add_to_tally(|t| {
                    if write {
                        t.cache_written += bytes;
                    } else {
                        t.cache_read += bytes;
                    }
                })
            }
        }
    }
}

impl BlockDevice for TimedDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let n = buf.len() as u64;
        self.timed(READ, n, || self.inner.read_at(buf, offset))?;
        self.tally(false, offset, n);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let n = buf.len() as u64;
        // A failed write may have written any part: it counts as written.
        let r = self.timed(WRITE, n, || self.inner.write_at(buf, offset));
        self.tally(true, offset, n);
        r
    }
    fn flush(&self) -> io::Result<()> {
        self.timed(FLUSH, 0, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.timed(DISCARD, len, || self.inner.discard(offset, len))
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let r = self.timed(WRITE_ZEROES, len, || self.inner.write_zeroes(offset, len));
        self.tally(true, offset, len);
        r
    }
    fn is_rotational(&self) -> bool {
        self.inner.is_rotational()
    }
    fn refresh_size(&self) -> io::Result<u64> {
        self.inner.refresh_size()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn direct_fd(&self, offset: u64, len: usize) -> Option<std::os::fd::RawFd> {
        self.inner.direct_fd(offset, len)
    }
    fn direct_nbd(&self, write: bool, offset: u64, len: usize) -> Option<blockdev::NbdDirect> {
        self.inner.direct_nbd(write, offset, len)
    }
    fn nbd_links(&self) -> Option<blockdev::NbdLinks> {
        self.inner.nbd_links()
    }
    /// An I/O made by the caller through `direct_fd` or `direct_nbd` (the io_uring data path): timed, counted
    /// and tallied on the thread that finished it, like one through `read_at` or `write_at`
    /// (a failed write counts as written, as there).
    fn direct_done(
        &self,
        write: bool,
        offset: u64,
        len: usize,
        took: std::time::Duration,
        ok: bool,
    ) {
        self.inner.direct_done(write, offset, len, took, ok);
        self.record(if write { WRITE } else { READ }, len as u64, took, ok);
        if ok || write {
            self.tally(write, offset, len as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;

    fn timed(role: Role, data_offset: u64) -> (TimedDevice, Arc<DeviceMetrics>) {
        let m = Arc::new(DeviceMetrics {
            role,
            device: "mem".into(),
            ops: Default::default(),
            remote: None,
        });
        let d = TimedDevice::new(
            Arc::new(MemDevice::new(1 << 20)),
            m.clone(),
            Arc::new(AtomicU64::new(data_offset)),
        );
        (d, m)
    }

    #[test]
    fn io_is_counted_timed_and_tallied_on_this_thread_only() {
        let (cache, cm) = timed(Role::Cache, 64 << 10);
        let (backing, bm) = timed(Role::Backing, 0);
        let before = tally();
        let mut buf = vec![0u8; 4096];
        backing.read_at(&mut buf, 0).unwrap();
        cache.write_at(&buf, 0).unwrap(); // metadata area: not in the tally
        cache.write_at(&buf, 64 << 10).unwrap();
        cache.read_at(&mut buf, 64 << 10).unwrap();
        cache.flush().unwrap();
        assert!(backing.read_at(&mut buf, 1 << 20).is_err());
        let d = tally().since(&before);
        assert_eq!(
            d,
            Tally {
                backing_read: 4096,
                backing_written: 0,
                cache_read: 4096,
                cache_written: 4096
            }
        );
        let b = bm.sample();
        assert_eq!(b.ops[READ].bytes, 4096);
        assert_eq!(b.ops[READ].errors, 1);
        assert_eq!(b.ops[READ].latency.count(), 2);
        let c = cm.sample();
        assert_eq!(c.ops[WRITE].bytes, 8192);
        assert_eq!(c.ops[FLUSH].latency.count(), 1);
        // Another thread's I/O is not in this thread's tally.
        let before = tally();
        std::thread::scope(|s| {
            s.spawn(|| backing.write_at(&[0u8; 512], 0).unwrap());
        });
        assert_eq!(tally().since(&before), Tally::default());
        assert_eq!(bm.sample().ops[WRITE].bytes, 512);
    }
}
