//! Cache-device faults and what clients see: stale copies dropped at attach, read and write
//! errors on the cache device, the degraded state and re-admission, hung devices, congestion.

mod common;

use blockdev::fault::{FaultOp, FaultRule};
use blockdev::BlockDevice;
use common::*;
use engine::format::{BackingHeader, StaleCopies};
use engine::CacheMode;

fn data(id: u64, sector: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    fill(&mut b, sector, id);
    b
}

/// Writes `d` straight to the backing device's data area, as a server that served it
/// without the cache set would have.
fn write_around(rig: &Rig, offset: u64, d: &[u8]) {
    rig.backing
        .write_at(d, engine::format::BACKING_DATA_OFFSET + offset)
        .unwrap();
    rig.backing.flush().unwrap();
}

fn mark_stale(rig: &Rig, stale: StaleCopies) {
    let (mut h, _) = BackingHeader::read(&*rig.backing).unwrap();
    h.stale = stale;
    h.write(&*rig.backing).unwrap();
}

#[test]
fn stale_clean_copies_are_dropped_at_attach_and_dirty_ones_kept() {
    let mut rig = Rig::new(1, Geometry::default(), CacheMode::Writeback);
    let dirty = data(1, 0, 8192);
    rig.vol().write(0, &dirty, false).unwrap();
    rig.vol().set_mode(CacheMode::Writethrough).unwrap();
    let clean = data(2, 64, 8192);
    rig.vol().write(32768, &clean, false).unwrap();
    rig.vol().flush().unwrap();
    assert_eq!(rig.vol().status().cached_bytes, 16384);
    rig.close().unwrap();
    // Served without the cache meanwhile: the clean block's range was rewritten.
    let newer = data(3, 64, 8192);
    write_around(&rig, 32768, &newer);
    mark_stale(&rig, StaleCopies::Clean);
    rig.open().unwrap();
    let mut buf = vec![0u8; 8192];
    rig.vol().read(32768, &mut buf).unwrap();
    assert!(buf == newer, "a stale clean copy was served");
    rig.vol().read(0, &mut buf).unwrap();
    assert!(buf == dirty, "dirty data was dropped");
    assert_eq!(rig.vol().status().dirty_bytes, 8192);
    let (h, _) = BackingHeader::read(&*rig.backing).unwrap();
    assert_eq!(
        h.stale,
        StaleCopies::None,
        "the header is cleared once dropped"
    );
    // The drop is durable: a crash does not bring the stale copy back.
    rig.crash_and_reopen().unwrap();
    rig.vol().read(32768, &mut buf).unwrap();
    assert!(buf == newer, "the stale copy came back after a crash");
}

#[test]
fn all_stale_drops_dirty_data_too() {
    let mut rig = Rig::new(2, Geometry::default(), CacheMode::Writeback);
    rig.vol().write(0, &data(1, 0, 8192), false).unwrap();
    rig.vol().flush().unwrap();
    rig.close().unwrap();
    let newer = data(4, 0, 8192);
    write_around(&rig, 0, &newer);
    mark_stale(&rig, StaleCopies::All);
    rig.open().unwrap();
    let mut buf = vec![0u8; 8192];
    rig.vol().read(0, &mut buf).unwrap();
    assert!(buf == newer);
    assert_eq!(rig.vol().status().dirty_bytes, 0);
    let (h, _) = BackingHeader::read(&*rig.backing).unwrap();
    assert_eq!(h.state, engine::format::BackingState::Clean);
}

fn cache_rule(op: FaultOp, skip: u64, remaining: Option<u64>) -> FaultRule {
    FaultRule {
        device: Some("cache".into()),
        op,
        range: None,
        probability: 1.0,
        remaining,
        skip,
    }
}

fn read_vec(rig: &Rig, offset: u64, len: usize) -> engine::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    rig.vol().read(offset, &mut buf).map(|()| buf)
}

#[test]
fn writethrough_clients_see_no_error_while_the_cache_device_fails_then_dies() {
    let rig = Rig::new(11, Geometry::default(), CacheMode::Writethrough);
    let d = data(1, 0, 65536);
    rig.vol().write(0, &d, false).unwrap();
    rig.vol().flush().unwrap();
    assert_eq!(rig.vol().status().cached_bytes, 65536);
    // Reads of the cached blocks fail on the cache device: served from the backing device.
    rig.ctrl.add_rule(cache_rule(FaultOp::Read, 0, Some(3)));
    for i in 0..3u64 {
        let got = read_vec(&rig, i * 4096, 4096).unwrap();
        assert!(got == d[(i * 4096) as usize..][..4096], "block {i}");
    }
    let s = rig.vol().status();
    assert_eq!(s.stats.total.cache_io_errors, 3);
    assert_eq!(s.state, "clean", "3 failures are under the limit of 8");
    assert_eq!(
        s.cached_bytes,
        65536 - 3 * 4096,
        "unreadable copies dropped"
    );
    // Now the device dies: every I/O fails. Reads, writes and flushes go on.
    rig.ctrl.add_rule(cache_rule(FaultOp::Any, 0, None));
    let d2 = data(2, 256, 32768);
    for round in 0..4u64 {
        let got = read_vec(&rig, 0, 65536).unwrap();
        assert!(got[..32768] == d[..32768] || round > 0);
        rig.vol().write(131072, &d2, round % 2 == 0).unwrap();
        rig.vol().flush().unwrap();
        let got = read_vec(&rig, 131072, 32768).unwrap();
        assert!(got == d2);
    }
    let h = rig.set().health();
    let degraded = h.degraded.expect("the set is degraded");
    assert!(degraded.reason.contains("io_error_limit") || degraded.reason.contains("metadata"));
    assert_eq!(rig.vol().status().state, "degraded");
    // The backing device has everything, flushed.
    let mut raw = vec![0u8; 32768];
    rig.backing
        .read_at(&mut raw, engine::format::BACKING_DATA_OFFSET + 131072)
        .unwrap();
    assert!(raw == d2);
}

#[test]
fn writeback_degraded_refuses_only_what_the_cache_device_alone_holds() {
    let rig = Rig::new(12, Geometry::default(), CacheMode::Writeback);
    let dirty = data(1, 0, 16384);
    rig.vol().write(0, &dirty, false).unwrap();
    rig.vol().flush().unwrap();
    let other = data(2, 512, 8192);
    rig.backing
        .write_at(&other, engine::format::BACKING_DATA_OFFSET + 262144)
        .unwrap();
    rig.ctrl.add_rule(cache_rule(FaultOp::Any, 0, None));
    rig.set().degrade("test");
    // The dirty range: an error, never the older backing data.
    let e = read_vec(&rig, 0, 4096).unwrap_err();
    assert!(e.to_string().contains("degraded"), "{e}");
    assert!(rig.vol().write(4096, &data(3, 8, 4096), false).is_err());
    assert!(rig.vol().discard(0, 16384).is_err());
    // Everything else works, flushes included (nothing about this device is in doubt).
    assert!(read_vec(&rig, 262144, 8192).unwrap() == other);
    let fresh = data(4, 1024, 8192);
    rig.vol().write(524288, &fresh, true).unwrap();
    assert!(read_vec(&rig, 524288, 8192).unwrap() == fresh);
    rig.vol().flush().unwrap();
    assert_eq!(
        rig.vol().status().dirty_bytes,
        16384,
        "nothing declared clean"
    );
}

#[test]
fn unflushed_dirty_data_makes_a_degraded_flush_fail() {
    let rig = Rig::new(13, Geometry::default(), CacheMode::Writeback);
    rig.vol().write(0, &data(1, 0, 8192), false).unwrap();
    // Its journal entry is not durable when the cache device dies.
    rig.ctrl.add_rule(cache_rule(FaultOp::Any, 0, None));
    let e = rig.vol().flush().unwrap_err();
    assert!(e.to_string().contains("degraded"), "{e}");
    assert!(rig.set().health().degraded.is_some());
    // Other ranges are still served; a write over the unflushed one is refused.
    rig.vol().write(65536, &data(2, 128, 4096), false).unwrap();
    assert!(rig.vol().write(0, &data(3, 0, 4096), false).is_err());
    assert!(rig.vol().flush().is_err(), "still not durable");
}

#[test]
fn a_readmitted_cache_serves_again_and_its_dirty_data_is_intact() {
    let mut rig = Rig::new(14, Geometry::default(), CacheMode::Writeback);
    let dirty = data(1, 0, 16384);
    rig.vol().write(0, &dirty, false).unwrap();
    rig.vol().set_mode(CacheMode::Writethrough).unwrap();
    let clean = data(2, 128, 16384);
    rig.vol().write(65536, &clean, false).unwrap();
    rig.vol().flush().unwrap();
    rig.ctrl.add_rule(cache_rule(FaultOp::Any, 0, None));
    // Reading the clean copy fails on the device: served from the backing device.
    assert!(read_vec(&rig, 65536, 16384).unwrap() == clean);
    rig.set().degrade("test");
    // Written while degraded: the clean copy in the cache is stale now.
    let newer = data(3, 128, 16384);
    rig.vol().write(65536, &newer, false).unwrap();
    rig.vol().flush().unwrap();
    // Still failing: re-admission fails and changes nothing.
    assert!(rig.set().readmit().is_err());
    assert!(rig.set().health().degraded.is_some());
    rig.ctrl.clear_rules();
    rig.set().readmit().unwrap();
    assert!(rig.set().health().degraded.is_none());
    assert_eq!(rig.vol().status().state, "dirty");
    assert!(read_vec(&rig, 0, 16384).unwrap() == dirty);
    assert!(
        read_vec(&rig, 65536, 16384).unwrap() == newer,
        "stale copy served"
    );
    // Durable as re-admitted: a crash keeps the dirty data and not the stale copy.
    rig.crash_and_reopen().unwrap();
    assert!(read_vec(&rig, 0, 16384).unwrap() == dirty);
    assert!(read_vec(&rig, 65536, 16384).unwrap() == newer);
    while rig.set().writeback_step(true).unwrap() > 0 {}
    rig.vol().flush().unwrap();
    let mut raw = vec![0u8; 16384];
    rig.backing
        .read_at(&mut raw, engine::format::BACKING_DATA_OFFSET)
        .unwrap();
    assert!(raw == dirty, "written back after re-admission");
}

#[test]
fn a_restart_after_degrading_drops_stale_clean_copies() {
    let mut rig = Rig::new(15, Geometry::default(), CacheMode::Writethrough);
    let clean = data(1, 0, 16384);
    rig.vol().write(0, &clean, false).unwrap();
    rig.vol().flush().unwrap();
    rig.set().degrade("test");
    let newer = data(2, 0, 16384);
    rig.vol().write(0, &newer, false).unwrap();
    rig.vol().flush().unwrap();
    rig.crash_and_reopen().unwrap();
    assert!(
        read_vec(&rig, 0, 16384).unwrap() == newer,
        "stale copy served"
    );
    assert!(rig.set().health().degraded.is_none());
}

// ----- seeded fault enumeration -----

/// How a device fails at its N-th I/O.
#[derive(Clone, Copy, Debug)]
enum Failure {
    /// That I/O alone fails.
    Once,
    /// That I/O and every later one fail (the device died), until it is repaired.
    Dead,
}

fn is_client_op(op: &Op) -> bool {
    matches!(
        op,
        Op::Write { .. }
            | Op::Read { .. }
            | Op::Flush
            | Op::Discard { .. }
            | Op::Zero { .. }
            | Op::Stream { .. }
    )
}

/// The workload: random ops without mode changes (each case runs in one mode).
fn workload(seed: u64, n: usize, sectors: usize) -> Vec<Op> {
    let mut r = rng(seed);
    let mut ops = Vec::new();
    while ops.len() < n {
        let op = random_op(&mut r, sectors);
        if !matches!(op, Op::Mode(_)) {
            ops.push(op);
        }
    }
    ops
}

/// I/Os of `device` the workload makes in `mode` (a rule that never fires counts them).
fn count_ios(seed: u64, mode: CacheMode, ops: &[Op], device: &str) -> u64 {
    let rig = Rig::new(seed, Geometry::default(), mode);
    let mut model = Model::new(rig.vol().size_bytes() as usize / SECTOR);
    rig.ctrl.add_rule(FaultRule {
        device: Some(device.into()),
        op: FaultOp::Any,
        range: None,
        probability: 1.0,
        remaining: None,
        skip: u64::MAX,
    });
    let mut next_id = 0;
    for op in ops {
        let _ = apply(&rig, &mut model, op, &mut next_id);
    }
    u64::MAX - rig.ctrl.rules()[0].skip
}

/// Runs the workload with `device`'s `n`-th I/O failing as `failure` says, then repairs the
/// device and checks: no read ever returned data the model does not allow; a client saw an
/// error only where the contract allows one (cache device: never unless the device was in
/// writeback mode at some point, and then never for a read of a range no write touched); the set re-admits the cache
/// device, serves every sector as the model says, flushes, and after a crash reopens with
/// every flushed write.
fn run_case(
    seed: u64,
    mode: CacheMode,
    ops: &[Op],
    device: &str,
    n: u64,
    failure: Failure,
) -> Result<(), String> {
    let mut rig = Rig::new(seed, Geometry::default(), mode);
    let sectors = rig.vol().size_bytes() as usize / SECTOR;
    let mut model = Model::new(sectors);
    let mut touched = vec![false; sectors];
    let mut next_id = 0;
    rig.ctrl.add_rule(FaultRule {
        device: Some(device.into()),
        op: FaultOp::Any,
        range: None,
        probability: 1.0,
        remaining: match failure {
            Failure::Once => Some(1),
            Failure::Dead => None,
        },
        skip: n - 1,
    });
    // Ops run during a checkpoint may switch the mode: once in writeback, dirty data may
    // exist from then on.
    let mut dirty_possible = mode == CacheMode::Writeback;
    for (i, op) in ops.iter().enumerate() {
        let r =
            apply(&rig, &mut model, op, &mut next_id).map_err(|e| format!("op {i} {op:?}: {e}"))?;
        dirty_possible |= rig.vol().mode() == CacheMode::Writeback;
        if std::env::var("TIERCACHE_FAULT_TRACE").is_ok() {
            eprintln!(
                "op {i} {op:?}: {:?}, {:?}, degraded {}",
                r.as_ref().err(),
                rig.vol().mode(),
                rig.set().health().degraded.is_some()
            );
        }
        if let Err(e) = r {
            let allowed = !is_client_op(op)
                || device != "cache"
                || (dirty_possible
                    && match *op {
                        // The cache works in 4 KiB blocks: a dirty block holds the only
                        // current copy of all its sectors.
                        Op::Read { sector, n } => touched
                            [sector / 8 * 8..((sector + n).div_ceil(8) * 8).min(sectors)]
                            .iter()
                            .any(|t| *t),
                        _ => true,
                    });
            if !allowed {
                return Err(format!("op {i} {op:?}: a client saw an error: {e}"));
            }
        }
        // Written by this op or by ops run during it (a checkpoint's).
        for (t, (live, crash)) in touched.iter_mut().zip(model.live.iter().zip(&model.crash)) {
            *t |= live.as_slice() != [0] || crash.as_slice() != [0];
        }
    }
    rig.ctrl.clear_rules();
    if rig.set().health().degraded.is_some() {
        rig.set()
            .readmit()
            .map_err(|e| format!("re-admission: {e}"))?;
    }
    verify_all(&rig, &model).map_err(|e| format!("after repair: {e}"))?;
    rig.vol()
        .flush()
        .map_err(|e| format!("flush after repair: {e}"))?;
    model.flush();
    rig.crash_and_reopen()
        .map_err(|e| format!("reopen after crash: {e}"))?;
    model.crashed();
    verify_all(&rig, &model).map_err(|e| format!("after crash: {e}"))
}

/// Every N-th I/O of the device fails in turn (up to `MAX_CASES` values of N, evenly spread
/// when there are more), once and for good, in every mode. Replay one case with
/// `TIERCACHE_SEED=S TIERCACHE_FAULT_ONLY=MODE:N:once|dead`.
fn enumerate(test: &str, device: &str) {
    const MAX_CASES: u64 = 160;
    let seed = seed_from_env(test);
    let only = std::env::var("TIERCACHE_FAULT_ONLY").ok();
    let sectors = Rig::new(seed, Geometry::default(), CacheMode::Writethrough)
        .vol()
        .size_bytes() as usize
        / SECTOR;
    let ops = workload(seed, 120, sectors);
    let mut cases = 0;
    for mode in CacheMode::ALL {
        let total = count_ios(seed, mode, &ops, device);
        let step = total.div_ceil(MAX_CASES).max(1);
        for n in (1..=total).step_by(step as usize) {
            for failure in [Failure::Once, Failure::Dead] {
                let name = format!(
                    "{mode:?}:{n}:{}",
                    match failure {
                        Failure::Once => "once",
                        Failure::Dead => "dead",
                    }
                );
                if only
                    .as_ref()
                    .is_some_and(|o| !o.eq_ignore_ascii_case(&name))
                {
                    continue;
                }
                cases += 1;
                if let Err(e) = run_case(seed, mode, &ops, device, n, failure) {
                    panic!(
                        "{test}: seed {seed}, {device} I/O {n} of {total} failing {failure:?} in {mode:?}: {e}\n\
                         replay: TIERCACHE_SEED={seed} TIERCACHE_FAULT_ONLY={name}"
                    );
                }
            }
        }
        eprintln!("{test}: {mode:?}: {total} {device} I/Os, every {step}-th failed in turn");
    }
    eprintln!("{test}: seed {seed}: {cases} cases passed");
    assert!(
        only.is_some() || cases > 100,
        "too few cases ({cases}) to mean anything"
    );
}

/// Cases that once failed: `(seed, mode, n, failure)`.
const REGRESSIONS: &[(u64, CacheMode, u64, Failure)] = &[
    // Re-admission's checkpoint let a pending insert of a clean copy (made stale while
    // degraded) be replayed after it: a crash brought the stale copy back.
    (
        1795490639664916702,
        CacheMode::Writethrough,
        39,
        Failure::Dead,
    ),
];

#[test]
fn fault_regressions() {
    for &(seed, mode, n, failure) in REGRESSIONS {
        let sectors =
            Rig::new(seed, Geometry::default(), mode).vol().size_bytes() as usize / SECTOR;
        let ops = workload(seed, 120, sectors);
        if let Err(e) = run_case(seed, mode, &ops, "cache", n, failure) {
            panic!("regression seed {seed} {mode:?} {n} {failure:?}: {e}");
        }
    }
}

#[test]
fn every_cache_device_io_failing_in_turn() {
    enumerate("every_cache_device_io_failing_in_turn", "cache");
}

#[test]
fn every_backing_device_io_failing_in_turn() {
    enumerate("every_backing_device_io_failing_in_turn", "backing");
}

// ----- backing-device faults during writeback -----

/// A backing device whose flushes can be made to fail once, and whose writes can run a hook
/// (a client flush arriving while writeback writes).
struct Hooked {
    inner: blockdev::MemDevice,
    fail_flushes: std::sync::atomic::AtomicU32,
    on_write: std::sync::Mutex<Option<Box<dyn FnMut() + Send>>>,
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hooked")
    }
}

impl BlockDevice for Hooked {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.inner.write_at(buf, offset)?;
        let hook = self.on_write.lock().unwrap().take();
        if let Some(mut h) = hook {
            h();
        }
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        use std::sync::atomic::Ordering;
        if self
            .fail_flushes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(std::io::Error::other("injected flush failure"));
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn describe(&self) -> String {
        "hooked memory".into()
    }
}

#[test]
fn writeback_marks_nothing_clean_after_a_failed_backing_flush() {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    let backing = Arc::new(Hooked {
        inner: blockdev::MemDevice::new(4 << 20),
        fail_flushes: AtomicU32::new(0),
        on_write: std::sync::Mutex::new(None),
    });
    let (set, vol) = format_and_open(
        Arc::new(blockdev::MemDevice::new(4 << 20)),
        backing.clone(),
        CacheMode::Writeback,
        no_threads(),
    );
    vol.set_writeback_delay_secs(0).unwrap();
    let d = data(1, 0, 16384);
    vol.write(0, &d, false).unwrap();
    vol.flush().unwrap();
    // Writeback's own flush fails: still dirty, and the failure shows in status.
    backing.fail_flushes.store(1, Ordering::SeqCst);
    assert!(set.writeback_step(true).is_err());
    assert_eq!(vol.status().dirty_bytes, 16384);
    let err = vol.status().writeback_error.expect("writeback error shown");
    assert_eq!(err.failures, 1);
    // A client's flush fails while writeback writes (an NBD backing server that restarted
    // and lost what it was sent reports it on one flush only); writeback's own flush then
    // succeeds, but what it wrote before the failure may be lost: nothing is marked clean.
    let vol2 = vol.clone();
    let b2 = backing.clone();
    *backing.on_write.lock().unwrap() = Some(Box::new(move || {
        vol2.set_mode(CacheMode::Writethrough).unwrap();
        vol2.write(1 << 20, &data(2, 2048, 4096), false).unwrap();
        b2.fail_flushes.store(1, Ordering::SeqCst);
        // The client's flush meets the failure, writes its write again from the cache's
        // clean copy and flushes again (see `io::lost`): it succeeds.
        vol2.flush()
            .expect("the write the failed flush covered is written again from the cache");
        assert_eq!(vol2.losses(), 0, "nothing lost to report");
        vol2.set_mode(CacheMode::Writeback).unwrap();
    }));
    assert!(set.writeback_step(true).is_err());
    assert_eq!(vol.status().dirty_bytes, 16384, "lost data marked clean");
    assert_eq!(vol.status().writeback_error.unwrap().failures, 2);
    // Nothing failing any more: written back, clean, and the error is gone.
    while set.writeback_step(true).unwrap() > 0 {}
    assert_eq!(vol.status().dirty_bytes, 0);
    assert!(vol.status().writeback_error.is_none());
}

/// A backing device whose flushes keep failing: a client's flush writes what the failures
/// may have lost again from the cache and flushes again a bounded number of times, then fails
/// (it never loops or hangs); once the device flushes again, the next flush succeeds and the
/// device holds the data.
#[test]
fn a_backing_device_that_keeps_failing_flushes_fails_the_flush_after_bounded_tries() {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    let backing = Arc::new(Hooked {
        inner: blockdev::MemDevice::new(4 << 20),
        fail_flushes: std::sync::atomic::AtomicU32::new(0),
        on_write: std::sync::Mutex::new(None),
    });
    let (_set, vol) = format_and_open(
        Arc::new(blockdev::MemDevice::new(4 << 20)),
        backing.clone(),
        CacheMode::Writethrough,
        no_threads(),
    );
    let d = data(7, 0, 16384);
    vol.write(0, &d, false).unwrap();
    backing.fail_flushes.store(100, Ordering::SeqCst);
    assert!(vol.flush().is_err(), "a device that fails every flush");
    let tried = 100 - backing.fail_flushes.load(Ordering::SeqCst);
    assert!(
        (1..=3).contains(&tried),
        "{tried} flushes sent for one client flush"
    );
    backing.fail_flushes.store(0, Ordering::SeqCst);
    vol.flush().expect("the device flushes again");
    assert_eq!(vol.losses(), 0, "the cache held the data: nothing lost");
    let mut on_disk = vec![0u8; d.len()];
    backing
        .read_at(&mut on_disk, engine::format::BACKING_DATA_OFFSET)
        .unwrap();
    assert!(on_disk == d, "the device holds the data after the flush");
}

// ----- hung and slow cache devices -----

/// A set on a cache device with its own fault controller (latency there slows the cache
/// device only), a memory backing device, writethrough, 64 KiB written and cached.
fn slow_rig(
    tune: impl FnOnce(&mut engine::Config),
) -> (
    std::sync::Arc<blockdev::fault::FaultController>,
    engine::CacheSet,
    engine::Volume,
    Vec<u8>,
) {
    use std::sync::Arc;
    let ctrl = blockdev::fault::FaultController::new(5);
    let cache = Arc::new(blockdev::fault::FaultyDevice::new(
        "cache",
        blockdev::MemDevice::new(4 << 20),
        ctrl.clone(),
    ));
    let mut config = engine::Config {
        congested_read_threshold_us: 0,
        congested_write_threshold_us: 0,
        ..engine::Config::default()
    };
    tune(&mut config);
    let (set, vol) = format_and_open(
        cache,
        Arc::new(blockdev::MemDevice::new(4 << 20)),
        CacheMode::Writethrough,
        config,
    );
    let d = data(1, 0, 65536);
    vol.write(0, &d, false).unwrap();
    vol.flush().unwrap();
    assert_eq!(vol.status().cached_bytes, 65536);
    (ctrl, set, vol, d)
}

fn read_at(vol: &engine::Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    vol.read(offset, &mut buf).unwrap();
    buf
}

/// Polls `done` every 10 ms for at most 10 s (a hang guard, not a timing assertion).
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !done() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "never: {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn a_hung_cache_device_degrades_the_set_and_writethrough_clients_see_no_error() {
    let (ctrl, set, vol, d) = slow_rig(|c| c.cache_io_timeout_ms = 300);
    // Every cache-device I/O now takes 3 s: a device that stopped answering, as far as a
    // 300 ms timeout is concerned.
    let hang = std::time::Duration::from_secs(3);
    ctrl.set_latency(FaultOp::Any, hang, hang);
    let stuck = {
        let vol = vol.clone();
        std::thread::spawn(move || read_at(&vol, 0, 4096))
    };
    eventually("the watchdog degrades the set", || {
        set.health().degraded.is_some()
    });
    let reason = set.health().degraded.unwrap().reason;
    assert!(reason.contains("has not completed"), "{reason}");
    // Requests after that never touch the cache device: reads, writes and flushes succeed.
    assert!(read_at(&vol, 8192, 8192) == d[8192..16384]);
    let d2 = data(2, 512, 8192);
    vol.write(262144, &d2, true).unwrap();
    assert!(read_at(&vol, 262144, 8192) == d2);
    assert!(vol.status().stats.total.degraded_bytes > 0);
    // The read that was stuck in the device completes late: that counts as a failure, and
    // it is served from the backing device, correctly.
    assert!(stuck.join().unwrap() == d[..4096]);
    ctrl.set_latency(
        FaultOp::Any,
        std::time::Duration::ZERO,
        std::time::Duration::ZERO,
    );
    set.readmit().unwrap();
    assert!(read_at(&vol, 0, 65536) == d);
}

#[test]
fn a_slow_cache_device_is_bypassed_for_clean_reads_until_it_recovers() {
    let (ctrl, _set, vol, d) = slow_rig(|c| c.congested_read_threshold_us = 2_000);
    let slow = std::time::Duration::from_millis(5);
    ctrl.set_latency(FaultOp::Read, slow, slow);
    for _ in 0..30 {
        assert!(read_at(&vol, 0, 16384) == d[..16384]);
    }
    let s = vol.status().stats.total;
    assert!(s.congested >= 10, "congestion bypass never engaged: {s:?}");
    assert_eq!(s.bypassed_congested, s.congested * 16384, "{s:?}");
    // The device recovers: a probe notices, and hits come from the cache again.
    ctrl.set_latency(
        FaultOp::Read,
        std::time::Duration::ZERO,
        std::time::Duration::ZERO,
    );
    let hits = |v: &engine::Volume| v.status().stats.total.cache_hits;
    eventually("hits served by the cache again", || {
        let before = (hits(&vol), vol.status().stats.total.congested);
        let ok = read_at(&vol, 0, 16384) == d[..16384];
        assert!(ok);
        hits(&vol) > before.0 && vol.status().stats.total.congested == before.1
    });
}

#[test]
fn readmission_sticks_with_an_error_limit_of_zero() {
    let (ctrl, set, vol, d) = slow_rig(|c| c.io_error_limit = 0);
    ctrl.add_rule(FaultRule {
        device: None,
        op: FaultOp::Read,
        range: None,
        probability: 1.0,
        remaining: Some(1),
        skip: 0,
    });
    assert!(read_at(&vol, 0, 4096) == d[..4096]);
    assert!(
        set.health().degraded.is_some(),
        "limit 0: the first failure degrades"
    );
    set.readmit().unwrap();
    // Several watchdog periods: the failure counted before re-admission is not counted again.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(set.health().degraded.is_none(), "re-admission was undone");
    assert!(read_at(&vol, 0, 65536) == d);
}

#[test]
fn closing_a_degraded_set_flushes_the_backing_device() {
    let mut rig = Rig::new(16, Geometry::default(), CacheMode::Writethrough);
    rig.set().degrade("test");
    let d = data(1, 0, 8192);
    rig.vol().write(0, &d, false).unwrap();
    rig.close().unwrap();
    let img = rig.backing.durable_image();
    let off = engine::format::BACKING_DATA_OFFSET as usize;
    assert!(
        img[off..off + 8192] == d[..],
        "the close did not flush the write"
    );
}
