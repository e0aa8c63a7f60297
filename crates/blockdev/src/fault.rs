//! Deterministic fault injection for tests: simulated storage that knows what is durable, and
//! a wrapper that injects errors and latency into any device.
//!
//! Owns: [`FaultController`] (one seeded RNG, one I/O counter and one crash switch shared by
//! every device attached to it), [`SimDevice`] (in-memory storage with a live and a durable
//! image, in the spirit of FoundationDB's AsyncFileNonDurable and TigerBeetle's testing
//! storage), [`FaultyDevice`] (EIO rules and latency around a real device).
//!
//! Invariants:
//! - same seed and same sequence of calls ⇒ same decisions (every random choice comes from the
//!   controller's ChaCha8 RNG);
//! - the I/O counter spans all attached devices, so "crash at I/O N" names one point in a
//!   multi-device run; the N-th I/O itself fails (a write is recorded as in flight, so the
//!   crash may tear it), and every later I/O on every attached device fails with EIO;
//! - `SimDevice::crash_image` = durable image + each write since the last completed flush,
//!   in order, kept whole, dropped, or torn (a random subset of its 512-byte sectors);
//!   `crash_image_with` lets a test choose the surviving sectors of each write itself.
//!   Sectors are never torn internally.
//!
//! Fault model (what tests can inject): EIO from rules (per device name, operation, byte range,
//! probability, firing budget, matching requests let through first), seeded latency per
//! operation, and a crash at a chosen I/O number or on demand. Requests rejected as `InvalidInput` reach no device and are not
//! counted. `write_zeroes` counts as a write and `discard` as a discard; on a `SimDevice` both
//! are recorded as writes of zeroes.

use crate::{check_range, BlockDevice, SECTOR_SIZE};
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Which operations a rule or latency applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    Discard,
    Any,
}

impl FaultOp {
    fn matches(self, op: FaultOp) -> bool {
        self == FaultOp::Any || self == op
    }
}

/// Fail matching operations with EIO.
#[derive(Clone, Debug)]
pub struct FaultRule {
    /// Only devices with this name (None: all).
    pub device: Option<String>,
    pub op: FaultOp,
    /// Only requests overlapping this byte range `[start, end)` (None: all).
    pub range: Option<(u64, u64)>,
    /// Chance that a matching request fails.
    pub probability: f64,
    /// How many more times the rule may fire (None: unlimited).
    pub remaining: Option<u64>,
    /// Matching requests let through before the rule starts firing (so "fail the N-th
    /// cache-device I/O" is `skip: N - 1`).
    pub skip: u64,
}

#[derive(Debug)]
pub struct FaultController {
    seed: u64,
    count: AtomicU64,
    crash_at: AtomicU64,
    crashed: AtomicBool,
    rng: Mutex<ChaCha8Rng>,
    rules: Mutex<Vec<FaultRule>>,
    latency: Mutex<Vec<(FaultOp, Duration, Duration)>>,
}

fn crash_error() -> io::Error {
    io::Error::other("simulated crash: device is gone")
}

impl FaultController {
    pub fn new(seed: u64) -> Arc<FaultController> {
        Arc::new(FaultController {
            seed,
            count: AtomicU64::new(0),
            crash_at: AtomicU64::new(u64::MAX),
            crashed: AtomicBool::new(false),
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)),
            rules: Mutex::new(Vec::new()),
            latency: Mutex::new(Vec::new()),
        })
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// I/Os issued so far on all attached devices.
    pub fn io_count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// Crash when the I/O numbered `n` (counting from 1) is issued.
    pub fn set_crash_at(&self, n: Option<u64>) {
        self.crash_at.store(n.unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    pub fn crash_now(&self) {
        self.crashed.store(true, Ordering::SeqCst);
    }

    pub fn is_crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    pub fn add_rule(&self, rule: FaultRule) {
        self.rules.lock().push(rule);
    }

    /// The rules as they stand (`skip` and `remaining` count down as requests match).
    pub fn rules(&self) -> Vec<FaultRule> {
        self.rules.lock().clone()
    }

    pub fn clear_rules(&self) {
        self.rules.lock().clear();
    }

    /// Adds a seeded-random delay in `[min, max]` to every operation matching `op`, replacing
    /// an earlier setting for the same `op` (`Duration::ZERO` twice turns it off). When several
    /// settings match an operation, the earliest set one applies.
    pub fn set_latency(&self, op: FaultOp, min: Duration, max: Duration) {
        assert!(min <= max, "latency range is inverted");
        let mut lat = self.latency.lock();
        lat.retain(|&(o, _, _)| o != op);
        lat.push((op, min, max));
    }

    /// Accounts one I/O. `Ok(true)`: this I/O is the crash point (it must fail after
    /// recording any write as in flight).
    fn begin(&self, device: &str, op: FaultOp, offset: u64, len: u64) -> io::Result<bool> {
        if self.is_crashed() {
            return Err(crash_error());
        }
        let n = self.count.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.crash_at.load(Ordering::SeqCst) {
            self.crash_now();
            return Ok(true);
        }
        let delay = {
            let lat = self.latency.lock();
            lat.iter()
                .find(|(o, _, _)| o.matches(op))
                .map(|&(_, min, max)| {
                    let span = (max - min).as_nanos() as u64;
                    min + Duration::from_nanos(if span == 0 {
                        0
                    } else {
                        self.rng.lock().gen_range(0..=span)
                    })
                })
        };
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        let mut rules = self.rules.lock();
        for rule in rules.iter_mut() {
            let dev_ok = rule.device.as_deref().is_none_or(|d| d == device);
            // Flushes (and empty requests) cover no bytes, so they never match a range rule.
            let range_ok = rule
                .range
                .is_none_or(|(s, e)| len > 0 && offset < e && s < offset.saturating_add(len));
            if dev_ok && range_ok && rule.op.matches(op) && rule.remaining != Some(0) {
                if rule.skip > 0 {
                    rule.skip -= 1;
                    continue;
                }
                if !self.rng.lock().gen_bool(rule.probability.clamp(0.0, 1.0)) {
                    continue;
                }
                if let Some(r) = &mut rule.remaining {
                    *r -= 1;
                }
                return Err(io::Error::other(format!(
                    "injected EIO on {device} {op:?} at {offset}"
                )));
            }
        }
        Ok(false)
    }
}

#[derive(Debug)]
struct Images {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Writes since the last completed flush, in order.
    pending: Vec<(u64, Vec<u8>)>,
    /// A restart lost unflushed writes: the next flush fails (reports it), once.
    lost: bool,
}

/// In-memory storage with a live image (what reads see) and a durable image (what survives).
#[derive(Debug)]
pub struct SimDevice {
    name: String,
    ctrl: Arc<FaultController>,
    img: Mutex<Images>,
    rotational: AtomicBool,
}

impl SimDevice {
    /// A zero-filled device of `size_bytes` (a multiple of 512).
    pub fn new(name: &str, size_bytes: u64, ctrl: Arc<FaultController>) -> SimDevice {
        SimDevice::from_image(name, vec![0; size_bytes as usize], ctrl)
    }

    /// A device whose live and durable contents are `image`.
    pub fn from_image(name: &str, image: Vec<u8>, ctrl: Arc<FaultController>) -> SimDevice {
        assert!(
            (image.len() as u64).is_multiple_of(SECTOR_SIZE),
            "image size must be a multiple of 512"
        );
        SimDevice {
            name: name.to_string(),
            ctrl,
            img: Mutex::new(Images {
                live: image.clone(),
                durable: image,
                pending: Vec::new(),
                lost: false,
            }),
            rotational: AtomicBool::new(false),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn set_rotational(&self, on: bool) {
        self.rotational.store(on, Ordering::Relaxed);
    }

    pub fn live_image(&self) -> Vec<u8> {
        self.img.lock().live.clone()
    }

    pub fn durable_image(&self) -> Vec<u8> {
        self.img.lock().durable.clone()
    }

    pub fn pending_writes(&self) -> usize {
        self.img.lock().pending.len()
    }

    /// What a crash leaves: the durable image plus each unflushed write kept, dropped or torn.
    pub fn crash_image(&self) -> Vec<u8> {
        let img = self.img.lock();
        let mut out = img.durable.clone();
        let mut rng = self.ctrl.rng.lock();
        for (off, data) in &img.pending {
            let off = *off as usize;
            match rng.gen_range(0..3) {
                0 => {}
                1 => out[off..off + data.len()].copy_from_slice(data),
                _ => {
                    for (i, s) in data.chunks(SECTOR_SIZE as usize).enumerate() {
                        if rng.gen_bool(0.5) {
                            let o = off + i * SECTOR_SIZE as usize;
                            out[o..o + s.len()].copy_from_slice(s);
                        }
                    }
                }
            }
        }
        out
    }

    /// What a crash leaves when `keep` decides, for each write since the last completed flush
    /// (its offset and data, in order), which of its 512-byte sectors survive: the durable
    /// image plus those sectors. For tests that need one particular torn write.
    pub fn crash_image_with(&self, keep: &mut dyn FnMut(u64, &[u8]) -> Vec<bool>) -> Vec<u8> {
        let img = self.img.lock();
        let mut out = img.durable.clone();
        for (off, data) in &img.pending {
            let sectors = keep(*off, data);
            assert_eq!(
                sectors.len(),
                data.len().div_ceil(SECTOR_SIZE as usize),
                "one decision per sector"
            );
            for (i, s) in data.chunks(SECTOR_SIZE as usize).enumerate() {
                if sectors[i] {
                    let o = *off as usize + i * SECTOR_SIZE as usize;
                    out[o..o + s.len()].copy_from_slice(s);
                }
            }
        }
        out
    }

    /// A restart of the device's server (a remote NBD disk) that loses what it had not
    /// flushed: the live image becomes the durable one, and the next flush fails once, as
    /// the NBD client reports a lost connection with unflushed writes. Returns whether
    /// unflushed writes were dropped.
    pub fn restart(&self) -> bool {
        let mut img = self.img.lock();
        let img = &mut *img;
        let lost = !img.pending.is_empty();
        img.pending.clear();
        img.live.copy_from_slice(&img.durable);
        img.lost |= lost;
        lost
    }

    fn record_write(&self, data: &[u8], offset: u64) {
        let mut img = self.img.lock();
        let o = offset as usize;
        img.live[o..o + data.len()].copy_from_slice(data);
        img.pending.push((offset, data.to_vec()));
    }
}

impl BlockDevice for SimDevice {
    fn size_bytes(&self) -> u64 {
        self.img.lock().live.len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        if self
            .ctrl
            .begin(&self.name, FaultOp::Read, offset, buf.len() as u64)?
        {
            return Err(crash_error());
        }
        let img = self.img.lock();
        buf.copy_from_slice(&img.live[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        let crash = self
            .ctrl
            .begin(&self.name, FaultOp::Write, offset, buf.len() as u64)?;
        // The crashing write is in flight: the crash image may keep, drop or tear it.
        self.record_write(buf, offset);
        if crash {
            return Err(crash_error());
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.ctrl.begin(&self.name, FaultOp::Flush, 0, 0)? {
            return Err(crash_error());
        }
        let mut img = self.img.lock();
        if std::mem::take(&mut img.lost) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!("{}: restarted, unflushed writes lost", self.name),
            ));
        }
        let pending = std::mem::take(&mut img.pending);
        for (off, data) in pending {
            img.durable[off as usize..off as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        let crash = self.ctrl.begin(&self.name, FaultOp::Discard, offset, len)?;
        self.record_write(&vec![0; len as usize], offset);
        if crash {
            return Err(crash_error());
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        let crash = self.ctrl.begin(&self.name, FaultOp::Write, offset, len)?;
        self.record_write(&vec![0; len as usize], offset);
        if crash {
            return Err(crash_error());
        }
        Ok(())
    }

    fn is_rotational(&self) -> bool {
        self.rotational.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("sim {} {} bytes", self.name, self.size_bytes())
    }
}

/// Injects the controller's EIO rules and latency into any device (no crash images).
#[derive(Debug)]
pub struct FaultyDevice<D: BlockDevice> {
    name: String,
    inner: D,
    ctrl: Arc<FaultController>,
}

impl<D: BlockDevice> FaultyDevice<D> {
    pub fn new(name: &str, inner: D, ctrl: Arc<FaultController>) -> Self {
        FaultyDevice {
            name: name.to_string(),
            inner,
            ctrl,
        }
    }

    /// Rejects bad requests (they reach no device and count as no I/O), then consults the
    /// controller.
    fn gate(&self, op: FaultOp, offset: u64, len: u64) -> io::Result<()> {
        if op != FaultOp::Flush {
            check_range(self.inner.size_bytes(), offset, len)?;
        }
        if self.ctrl.begin(&self.name, op, offset, len)? {
            return Err(crash_error());
        }
        Ok(())
    }
}

impl<D: BlockDevice> BlockDevice for FaultyDevice<D> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.gate(FaultOp::Read, offset, buf.len() as u64)?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.gate(FaultOp::Write, offset, buf.len() as u64)?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.gate(FaultOp::Flush, 0, 0)?;
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.gate(FaultOp::Discard, offset, len)?;
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.gate(FaultOp::Write, offset, len)?;
        self.inner.write_zeroes(offset, len)
    }
    fn is_rotational(&self) -> bool {
        self.inner.is_rotational()
    }
    fn refresh_size(&self) -> io::Result<u64> {
        self.inner.refresh_size()
    }
    fn describe(&self) -> String {
        format!("faulty {} ({})", self.name, self.inner.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn seed() -> u64 {
        let s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        eprintln!("seed={s}");
        s
    }

    #[test]
    fn crash_point_fails_that_io_and_every_later_one() {
        let c = FaultController::new(1);
        let a = SimDevice::new("a", 8192, c.clone());
        let b = SimDevice::new("b", 8192, c.clone());
        c.set_crash_at(Some(3));
        a.write_at(&[1; 512], 0).unwrap();
        b.flush().unwrap();
        assert!(a.write_at(&[2; 512], 512).is_err());
        assert!(c.is_crashed());
        assert!(b.read_at(&mut [0; 512], 0).is_err());
        assert_eq!(a.pending_writes(), 2, "the crashing write is in flight");
    }

    #[test]
    fn flushed_data_always_survives_unflushed_sometimes() {
        let s = seed();
        let (mut kept, mut dropped, mut torn) = (0, 0, 0);
        for i in 0..200 {
            let c = FaultController::new(s.wrapping_add(i));
            let d = SimDevice::new("d", 16384, c.clone());
            d.write_at(&[7; 4096], 0).unwrap();
            d.flush().unwrap();
            d.write_at(&[9; 4096], 4096).unwrap();
            c.crash_now();
            let img = d.crash_image();
            assert!(
                img[..4096].iter().all(|&b| b == 7),
                "seed {s}: flushed data lost"
            );
            let nines = img[4096..8192].chunks(512).filter(|s| s[0] == 9).count();
            for sector in img[4096..8192].chunks(512) {
                assert!(
                    sector.iter().all(|&b| b == sector[0]),
                    "a sector was torn inside"
                );
            }
            match nines {
                8 => kept += 1,
                0 => dropped += 1,
                _ => torn += 1,
            }
        }
        assert!(
            kept > 0 && dropped > 0 && torn > 0,
            "seed {s}: {kept} {dropped} {torn}"
        );
    }

    #[test]
    fn same_seed_same_crash_image() {
        let run = || {
            let c = FaultController::new(42);
            let d = SimDevice::new("d", 65536, c.clone());
            for i in 0..16u8 {
                d.write_at(&[i; 4096], u64::from(i) * 4096).unwrap();
            }
            d.crash_image()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn eio_rules_fire_with_remaining_counts_and_ranges() {
        let c = FaultController::new(3);
        let d = FaultyDevice::new("x", MemDevice::new(65536), c.clone());
        c.add_rule(FaultRule {
            device: Some("x".into()),
            op: FaultOp::Write,
            range: Some((4096, 8192)),
            probability: 1.0,
            remaining: Some(2),
            skip: 0,
        });
        d.write_at(&[1; 512], 0).unwrap();
        assert!(d.write_at(&[1; 512], 4096).is_err());
        assert!(d.write_at(&[1; 512], 4608).is_err());
        d.write_at(&[1; 512], 4096).unwrap();
        d.read_at(&mut [0; 512], 4096).unwrap();
    }

    #[test]
    fn crashing_write_is_in_flight_and_may_tear() {
        let s = seed();
        let mut outcomes = std::collections::BTreeSet::new();
        for i in 0..100 {
            let c = FaultController::new(s.wrapping_add(i));
            let d = SimDevice::new("d", 8192, c.clone());
            c.set_crash_at(Some(2));
            d.write_at(&[1; 4096], 0).unwrap();
            let e = d.write_at(&[2; 4096], 4096).unwrap_err();
            assert!(e.to_string().contains("simulated crash"), "{e}");
            assert_eq!(c.io_count(), 2);
            assert!(d.flush().is_err(), "flush after the crash must fail");
            let img = d.crash_image();
            outcomes.insert(img[4096..].chunks(512).filter(|s| s[0] == 2).count());
        }
        assert!(
            outcomes.contains(&0) && outcomes.contains(&8),
            "seed {s}: {outcomes:?}"
        );
        assert!(outcomes.len() > 2, "seed {s}: never torn: {outcomes:?}");
    }

    #[test]
    fn discard_and_write_zeroes_are_pending_until_flush() {
        let c = FaultController::new(5);
        let d = SimDevice::from_image("d", vec![8; 4096], c.clone());
        d.discard(0, 1024).unwrap();
        d.write_zeroes(2048, 512).unwrap();
        assert_eq!(d.pending_writes(), 2);
        assert_eq!(d.durable_image(), vec![8; 4096]);
        let live = d.live_image();
        assert_eq!(&live[..1024], &[0; 1024]);
        assert_eq!(&live[1024..2048], &[8; 1024]);
        assert_eq!(&live[2048..2560], &[0; 512]);
        d.flush().unwrap();
        assert_eq!(d.pending_writes(), 0);
        assert_eq!(d.durable_image(), live);
        assert_eq!(
            d.crash_image(),
            live,
            "nothing pending: the crash image is durable"
        );
        assert_eq!(c.io_count(), 3);
        assert_eq!(d.describe(), "sim d 4096 bytes");
    }

    #[test]
    fn latency_is_applied_and_bounded() {
        let c = FaultController::new(9);
        let d = SimDevice::new("d", 4096, c.clone());
        c.set_latency(
            FaultOp::Read,
            Duration::from_secs(5),
            Duration::from_secs(5),
        );
        c.set_latency(
            FaultOp::Read,
            Duration::from_millis(2),
            Duration::from_millis(3),
        );
        let t = std::time::Instant::now();
        d.read_at(&mut [0; 512], 0).unwrap();
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(2), "{took:?}");
        assert!(
            took < Duration::from_secs(1),
            "set_latency replaces: {took:?}"
        );
    }

    #[test]
    fn faulty_device_rejects_bad_requests_without_counting() {
        let c = FaultController::new(0);
        let d = FaultyDevice::new("x", MemDevice::new(4096), c.clone());
        c.add_rule(FaultRule {
            device: None,
            op: FaultOp::Any,
            range: Some((0, 4096)),
            probability: 1.0,
            remaining: None,
            skip: 0,
        });
        assert_eq!(
            d.read_at(&mut [0; 512], u64::MAX - 511).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.discard(u64::MAX - 511, 1024).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(c.io_count(), 0);
        d.flush().unwrap(); // a flush covers no bytes: range rules do not match it
        assert!(d.read_at(&mut [0; 512], 0).is_err());
        c.clear_rules();
        d.read_at(&mut [0; 512], 0).unwrap();
        assert_eq!(c.io_count(), 3);
    }

    #[test]
    fn bad_requests_are_invalid_input() {
        let c = FaultController::new(0);
        let d = SimDevice::new("d", 4096, c);
        assert_eq!(
            d.write_at(&[0; 100], 0).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.read_at(&mut [0; 512], 4096).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
