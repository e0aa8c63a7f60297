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
