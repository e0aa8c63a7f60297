//! The cache device as the engine sees it: every I/O to it goes through [`CacheDev`], which
//! times it, counts it and its failures, and keeps the start time of the I/Os in flight, so
//! the engine can tell a failing, a hung and a slow cache device apart (see `health`).
//!
//! Invariants:
//! - an I/O that took longer than the timeout is a failure (`ErrorKind::TimedOut`) even if
//!   the device completed it: its caller treats it like any failed I/O (a write: any subset
//!   of its sectors may be on the device);
//! - every failure counts once in the decayed error count (`errors`), which halves every
//!   `halflife` cache-device I/Os (bcache's `io_error_halflife`); a checksum failure is
//!   counted by its finder through `note_error`;
//! - up to `SLOTS` I/Os in flight have their start time in `inflight` (more are not tracked:
//!   the oldest of those tracked is what the watchdog needs, and every I/O is tracked while
//!   fewer than `SLOTS` are in flight);
//! - the latency estimates are exponentially weighted averages of completed reads and writes
//!   (flushes excluded: their cost depends on what was written, not on the device's health),
//!   updated without locks; an estimate stops mattering after `SAMPLE_TTL` without a sample,
//!   and `congested` lets one request through every `PROBE_EVERY` (a probe, whose sample
//!   replaces the average) so a recovered device is used again at once.
//!
//! - reads and writes also feed the device's cost model (`cost`) through a `try_lock`: an I/O
//!   that finds the model busy is not a sample, so timing never waits on the model.
//!
//! Costs: two clock reads, three atomic operations and one uncontended lock per I/O; nothing
//! allocates.

use blockdev::BlockDevice;
use parking_lot::Mutex;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOTS: usize = 64;
/// A congestion estimate older than this no longer counts.
const SAMPLE_TTL: Duration = Duration::from_secs(2);
/// While congested, one request in this interval goes to the cache device anyway (a probe),
/// counted from when the previous probe is expected to end.
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// Only requests up to this size are probes (a probe waits on the slow device).
const PROBE_MAX_BYTES: u64 = 64 << 10;

/// What an I/O was, for the latency estimates.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Read,
    Write,
    Other,
}

/// An exponentially weighted average of latencies (ns) and when it last had a sample.
#[derive(Default)]
struct Estimate {
    avg_ns: AtomicU64,
    at_ns: AtomicU64,
    probe_ns: AtomicU64,
    /// A probe was let through: the next sample replaces the average (a device that
    /// recovered is used again after one fast probe, not after the average decays).
    probing: AtomicBool,
}

impl Estimate {
    fn sample(&self, ns: u64, now: u64) {
        let old = self.avg_ns.load(Ordering::Relaxed);
        // Weight 1/8 for the new sample; the first sample (or one after a long gap) sets it.
        let fresh =
            now.saturating_sub(self.at_ns.load(Ordering::Relaxed)) > SAMPLE_TTL.as_nanos() as u64;
        let probe = self.probing.swap(false, Ordering::Relaxed);
        let new = if old == 0 || fresh || probe {
            ns
        } else {
            old - old / 8 + ns / 8
        };
        self.avg_ns.store(new.max(1), Ordering::Relaxed);
        self.at_ns.store(now.max(1), Ordering::Relaxed);
    }

    /// The average, or 0 when it has had no sample for `SAMPLE_TTL` (or four times the
    /// average, for a device so slow that its samples come further apart).
    fn current(&self, now: u64) -> u64 {
        let at = self.at_ns.load(Ordering::Relaxed);
        let avg = self.avg_ns.load(Ordering::Relaxed);
        let ttl = (SAMPLE_TTL.as_nanos() as u64).max(avg.saturating_mul(4));
        if at == 0 || now.saturating_sub(at) > ttl {
            0
        } else {
            avg
        }
    }
}

/// Error count decayed by I/Os done since the last error.
struct Decayed {
    count: f64,
    at_io: u64,
}

pub(crate) struct CacheDev {
    dev: Arc<dyn BlockDevice>,
    epoch: Instant,
    timeout_ns: u64,
    halflife: u64,
    ios: AtomicU64,
    errors: Mutex<Decayed>,
    total_errors: AtomicU64,
    inflight: [AtomicU64; SLOTS],
    reads: Estimate,
    writes: Estimate,
    cost: Mutex<crate::cost::CostModel>,
}

impl std::fmt::Debug for CacheDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheDev").field("dev", &self.dev).finish()
    }
}

/// A cache-device I/O under way: when it started and the in-flight slot it holds (freed by
/// [`CacheDev::end`] or [`CacheDev::abandon`]). Lets an I/O the caller carries out itself (with
/// io_uring, on its own descriptor) be measured like one `CacheDev` runs.
#[derive(Debug)]
pub(crate) struct Timed {
    start: u64,
    slot: Option<usize>,
}

impl CacheDev {
    /// `timeout`: longest an I/O may take before it counts as failed (zero: no limit);
    /// `halflife`: I/Os after which the error count halves (0: it never decays).
    pub fn new(dev: Arc<dyn BlockDevice>, timeout: Duration, halflife: u64) -> CacheDev {
        CacheDev {
            epoch: Instant::now(),
            timeout_ns: timeout.as_nanos() as u64,
            halflife,
            ios: AtomicU64::new(0),
            errors: Mutex::new(Decayed {
                count: 0.0,
                at_io: 0,
            }),
            total_errors: AtomicU64::new(0),
            inflight: std::array::from_fn(|_| AtomicU64::new(0)),
            reads: Estimate::default(),
            writes: Estimate::default(),
            cost: Mutex::new(crate::cost::CostModel::new(dev.is_rotational())),
            dev,
        }
    }

    /// Monotonic nanoseconds since this device was opened (never 0).
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    fn claim(&self, start: u64, hint: u64) -> Option<usize> {
        (0..SLOTS).map(|i| (hint as usize + i) % SLOTS).find(|&i| {
            let s = &self.inflight[i];
            s.load(Ordering::Relaxed) == 0
                && s.compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
        })
    }

    /// Starts timing an I/O (it claims an in-flight slot, so a stalled device is seen as
    /// congested while the I/O is still under way).
    pub(crate) fn begin(&self) -> Timed {
        let n = self.ios.fetch_add(1, Ordering::Relaxed);
        let start = self.now();
        Timed {
            start,
            slot: self.claim(start, n),
        }
    }

    /// How long ago `t` began.
    pub(crate) fn elapsed(&self, t: &Timed) -> std::time::Duration {
        std::time::Duration::from_nanos(self.now().saturating_sub(t.start))
    }

    /// An I/O begun but never carried out: frees its slot, measures nothing.
    pub(crate) fn abandon(&self, t: Timed) {
        if let Some(i) = t.slot {
            self.inflight[i].store(0, Ordering::Release);
        }
    }

    /// The device under the timing (for reads timed by a [`Timed`] of their own).
    pub(crate) fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }

    /// See [`BlockDevice::direct_fd`].
    pub(crate) fn direct_fd(&self, offset: u64, len: usize) -> Option<std::os::fd::RawFd> {
        self.dev.direct_fd(offset, len)
    }

    /// An I/O made through [`CacheDev::direct_fd`] ended: its wrappers account it (the timing
    /// of this layer is the caller's [`Timed`]).
    pub(crate) fn direct_done(
        &self,
        write: bool,
        at: (u64, usize),
        ok: bool,
        took: std::time::Duration,
    ) {
        self.dev.direct_done(write, at.0, at.1, took, ok)
    }

    fn run<T>(
        &self,
        kind: Kind,
        at: (u64, u64),
        io: impl FnOnce(&dyn BlockDevice) -> io::Result<T>,
    ) -> io::Result<T> {
        let t = self.begin();
        let r = io(&*self.dev);
        self.end(t, kind, at, r)
    }

    /// Ends the I/O `t` of `kind` over `at` (offset, length) with result `r`: frees its slot,
    /// feeds the latency estimates and the cost model, turns one that took longer than the
    /// timeout into an error, and counts errors.
    pub(crate) fn end<T>(
        &self,
        t: Timed,
        kind: Kind,
        at: (u64, u64),
        r: io::Result<T>,
    ) -> io::Result<T> {
        let start = t.start;
        self.abandon(t);
        let end = self.now();
        let took = end - start;
        let op = match kind {
            Kind::Read => {
                self.reads.sample(took, end);
                Some(crate::cost::Op::Read)
            }
            Kind::Write => {
                self.writes.sample(took, end);
                Some(crate::cost::Op::Write)
            }
            Kind::Other => None,
        };
        if let (Some(op), true) = (op, r.is_ok()) {
            if let Some(mut m) = self.cost.try_lock() {
                m.observe(op, at.0, at.1, took);
            }
        }
        let r = match r {
            Ok(_) if self.timeout_ns > 0 && took > self.timeout_ns => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "cache device I/O took {} ms, longer than the {} ms timeout",
                    took / 1_000_000,
                    self.timeout_ns / 1_000_000
                ),
            )),
            r => r,
        };
        if r.is_err() {
            self.note_error();
        }
        r
    }

    /// Counts one failure (an I/O error, a timeout or a checksum mismatch); returns the
    /// decayed count.
    pub fn note_error(&self) -> f64 {
        self.total_errors.fetch_add(1, Ordering::Relaxed);
        let ios = self.ios.load(Ordering::Relaxed);
        let mut d = self.errors.lock();
        d.count = decay(d.count, ios.saturating_sub(d.at_io), self.halflife) + 1.0;
        d.at_io = ios;
        d.count
    }

    /// The decayed error count now.
    pub fn error_count(&self) -> f64 {
        let ios = self.ios.load(Ordering::Relaxed);
        let d = self.errors.lock();
        decay(d.count, ios.saturating_sub(d.at_io), self.halflife)
    }

    /// Failures counted since open (not decayed).
    pub fn total_errors(&self) -> u64 {
        self.total_errors.load(Ordering::Relaxed)
    }

    /// Forgets the error count (a re-admitted device starts afresh).
    pub fn reset_errors(&self) {
        let mut d = self.errors.lock();
        d.count = 0.0;
        d.at_io = self.ios.load(Ordering::Relaxed);
    }

    /// How long the oldest tracked I/O in flight has been running.
    pub fn oldest_inflight(&self) -> Duration {
        let now = self.now();
        let oldest = self
            .inflight
            .iter()
            .map(|s| s.load(Ordering::Acquire))
            .filter(|&t| t != 0)
            .min();
        Duration::from_nanos(oldest.map_or(0, |t| now.saturating_sub(t)))
    }

    /// Whether an I/O in flight has outlived the timeout (a hung device).
    pub fn hung(&self) -> Option<Duration> {
        let age = self.oldest_inflight();
        (self.timeout_ns > 0 && age.as_nanos() as u64 > self.timeout_ns).then_some(age)
    }

    /// Current latency estimates `(read, write)` in µs (0: no recent sample).
    pub fn latency_us(&self) -> (u64, u64) {
        let now = self.now();
        (
            self.reads.current(now) / 1000,
            self.writes.current(now) / 1000,
        )
    }

    /// What the cache device costs a miss fill, by its model (see `policy::CacheCosts`). While
    /// its reads are not learned yet (a cold cache sees promotions long before hits), a read is
    /// taken to cost what a write does.
    pub fn fill_costs(&self) -> crate::policy::CacheCosts {
        let m = self.cost.lock();
        let write = m.estimate(crate::cost::Op::Write);
        let read = m.estimate(crate::cost::Op::Read);
        crate::policy::CacheCosts {
            read: if read.learned || !write.learned {
                read
            } else {
                write
            },
            write_per_byte_ns: write.per_byte_ns.unwrap_or(0.0),
        }
    }

    /// The cache device's cost model estimates now.
    pub fn cost(&self) -> crate::cost::DevCost {
        let m = self.cost.lock();
        crate::cost::DevCost {
            read: m.estimate(crate::cost::Op::Read),
            write: m.estimate(crate::cost::Op::Write),
        }
    }

    /// Whether a request of `kind` should avoid the cache device: its recent latency (or the
    /// age of an I/O still in flight) is above `threshold_us` (0: never) and above what the
    /// backing device's cost model expects the request to take there (`backing_ns`, asked
    /// only past the threshold): going around a slow cache to a slower disk gains nothing.
    /// One request per `PROBE_EVERY` is let through so the estimate follows a device that
    /// recovers.
    pub fn congested(
        &self,
        kind: Kind,
        threshold_us: u64,
        len: u64,
        backing_ns: impl FnOnce() -> u64,
    ) -> bool {
        self.congested_at(self.now(), kind, threshold_us, len, backing_ns)
    }

    /// [`CacheDev::congested`] at `now` (this device's clock; tests pass their own times).
    fn congested_at(
        &self,
        now: u64,
        kind: Kind,
        threshold_us: u64,
        len: u64,
        backing_ns: impl FnOnce() -> u64,
    ) -> bool {
        if threshold_us == 0 {
            return false;
        }
        let est = match kind {
            Kind::Read => &self.reads,
            Kind::Write => &self.writes,
            Kind::Other => return false,
        };
        let avg = est.current(now);
        if avg <= threshold_us * 1000 || avg <= backing_ns() {
            return false;
        }
        if len > PROBE_MAX_BYTES {
            return true;
        }
        // The next probe is due `PROBE_EVERY` after this one is expected to end (now plus the
        // average), so a device slower than the interval is not probed by every request.
        let next = est.probe_ns.load(Ordering::Relaxed);
        let probe = now >= next
            && est
                .probe_ns
                .compare_exchange(
                    next,
                    now + PROBE_EVERY.as_nanos() as u64 + avg,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok();
        if probe {
            est.probing.store(true, Ordering::Relaxed);
        }
        !probe
    }

    /// Feeds the age of a stuck I/O into the estimates, so congestion engages while the device
    /// holds it (the watchdog calls this; a completed I/O would do it itself).
    pub fn note_stuck(&self) {
        let age = self.oldest_inflight().as_nanos() as u64;
        if age > 0 {
            let now = self.now();
            for e in [&self.reads, &self.writes] {
                if e.current(now) < age {
                    e.avg_ns.store(age, Ordering::Relaxed);
                    e.at_ns.store(now, Ordering::Relaxed);
                }
            }
        }
    }
}

/// `count` after `ios` more I/Os with the given half-life (0: no decay).
fn decay(count: f64, ios: u64, halflife: u64) -> f64 {
    if halflife == 0 || count == 0.0 {
        count
    } else {
        count * 0.5f64.powf(ios as f64 / halflife as f64)
    }
}

impl BlockDevice for CacheDev {
    fn size_bytes(&self) -> u64 {
        self.dev.size_bytes()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.run(Kind::Read, (offset, buf.len() as u64), |d| {
            d.read_at(buf, offset)
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.run(Kind::Write, (offset, buf.len() as u64), |d| {
            d.write_at(buf, offset)
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.run(Kind::Other, (0, 0), |d| d.flush())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.run(Kind::Other, (offset, len), |d| d.discard(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.run(Kind::Write, (offset, len), |d| d.write_zeroes(offset, len))
    }

    fn is_rotational(&self) -> bool {
        self.dev.is_rotational()
    }

    fn refresh_size(&self) -> io::Result<u64> {
        self.dev.refresh_size()
    }

    fn describe(&self) -> String {
        self.dev.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::fault::{FaultController, FaultOp, FaultRule, FaultyDevice};
    use blockdev::MemDevice;

    #[test]
    fn errors_decay_by_half_every_halflife() {
        assert_eq!(decay(8.0, 0, 100), 8.0);
        assert!((decay(8.0, 100, 100) - 4.0).abs() < 1e-9);
        assert!((decay(8.0, 300, 100) - 1.0).abs() < 1e-9);
        assert_eq!(decay(8.0, 1_000_000, 0), 8.0);
    }

    #[test]
    fn failures_and_timeouts_are_counted() {
        let ctrl = FaultController::new(1);
        let faulty = Arc::new(FaultyDevice::new(
            "cache",
            MemDevice::new(1 << 20),
            ctrl.clone(),
        ));
        let d = CacheDev::new(faulty, Duration::from_millis(20), 0);
        let mut buf = vec![0u8; 4096];
        d.read_at(&mut buf, 0).unwrap();
        assert_eq!(d.total_errors(), 0);
        ctrl.add_rule(FaultRule {
            device: None,
            op: FaultOp::Read,
            range: None,
            probability: 1.0,
            remaining: Some(2),
            skip: 0,
        });
        assert!(d.read_at(&mut buf, 0).is_err());
        assert!(d.read_at(&mut buf, 0).is_err());
        d.read_at(&mut buf, 0).unwrap();
        assert_eq!(d.total_errors(), 2);
        assert!((d.error_count() - 2.0).abs() < 1e-9);
        ctrl.set_latency(
            FaultOp::Write,
            Duration::from_millis(40),
            Duration::from_millis(40),
        );
        let e = d.write_at(&buf, 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(d.total_errors(), 3);
        d.reset_errors();
        assert_eq!(d.error_count(), 0.0);
    }

    #[test]
    fn congestion_follows_latency_with_probes() {
        let ctrl = FaultController::new(2);
        let faulty = Arc::new(FaultyDevice::new(
            "cache",
            MemDevice::new(1 << 20),
            ctrl.clone(),
        ));
        let d = CacheDev::new(faulty, Duration::ZERO, 0);
        let mut buf = vec![0u8; 4096];
        d.read_at(&mut buf, 0).unwrap();
        assert!(!d.congested(Kind::Read, 2000, 4096, || 0));
        ctrl.set_latency(
            FaultOp::Read,
            Duration::from_millis(5),
            Duration::from_millis(5),
        );
        for _ in 0..30 {
            d.read_at(&mut buf, 0).unwrap();
        }
        assert!(d.latency_us().0 >= 4000, "{:?}", d.latency_us());
        // Every question below at the moment of the last sample, so no probe interval or
        // sample lifetime passes between them whatever the machine does meanwhile.
        let at = d.reads.at_ns.load(Ordering::Relaxed);
        let congested = |kind, threshold_us, backing_ns| {
            d.congested_at(at, kind, threshold_us, 4096, || backing_ns)
        };
        // The first call after the estimate rose is a probe (let through), the next are not.
        assert!(!congested(Kind::Read, 2000, 0), "a probe");
        assert!(congested(Kind::Read, 2000, 0));
        assert!(congested(Kind::Read, 2000, 0));
        assert!(!congested(Kind::Read, 0, 0), "0 disables");
        // The estimate itself, not the injected 5 ms: a loaded machine stretches the reads.
        let est_us = d.reads.current(at) / 1000;
        assert!(
            !congested(Kind::Read, est_us * 2 + 1000, 0),
            "below the threshold"
        );
        assert!(
            !congested(Kind::Write, 2000, 0),
            "writes have their own estimate"
        );
        assert!(
            !congested(Kind::Read, 2000, est_us * 4000),
            "the backing device would take longer"
        );
        assert!(congested(Kind::Read, 2000, 1_000_000));
    }

    #[test]
    fn a_device_slower_than_the_probe_interval_is_not_probed_by_every_request() {
        let d = CacheDev::new(Arc::new(MemDevice::new(1 << 20)), Duration::ZERO, 0);
        let t0 = 1_000_000;
        d.reads.sample(1_000_000_000, t0);
        let congested = |at, len| d.congested_at(at, Kind::Read, 2000, len, || 0);
        assert!(congested(t0, 1 << 20), "large requests never probe");
        assert!(!congested(t0, 4096), "the first small request probes");
        // The probe is expected to take a second: the next is due only after that, not after
        // the probe interval.
        let later = t0 + 2 * PROBE_EVERY.as_nanos() as u64;
        assert!(congested(later, 4096));
        // Its answer: fast. The bypass ends.
        d.reads.sample(10_000, later);
        assert!(!congested(later, 4096));
    }
}
