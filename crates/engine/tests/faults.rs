//! Cache-device faults and what clients see: stale copies dropped at attach, read and write
//! errors on the cache device, the degraded state and re-admission, hung devices, congestion.

mod common;

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
