//! Containment and persistence of operator input: a panic inside the engine fails the set
//! without writing anything more to the cache device, and recovery finds everything flushed
//! before it; every knob survives a restart; a refused knob value changes nothing on disk.

mod common;

use blockdev::{BlockDevice, MemDevice};
use common::*;
use engine::{CacheMode, CacheSet, Error, Knob};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A device that panics on reads while armed (a stand-in for any bug below the engine's
/// entry points), and counts writes and flushes.
#[derive(Debug)]
struct Booby {
    inner: MemDevice,
    armed: AtomicBool,
    writes: AtomicU64,
}

impl Booby {
    fn new(size: u64) -> Arc<Booby> {
        Arc::new(Booby {
            inner: MemDevice::new(size),
            armed: AtomicBool::new(false),
            writes: AtomicU64::new(0),
        })
    }
}

impl BlockDevice for Booby {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        assert!(!self.armed.load(Ordering::SeqCst), "booby trap: read");
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.discard(offset, len)
    }
    fn describe(&self) -> String {
        "booby-trapped memory".into()
    }
}

fn pattern(id: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| id ^ (i % 251) as u8).collect()
}

#[test]
fn a_panic_fails_the_set_writes_nothing_more_and_recovery_keeps_flushed_data() {
    let cache = Booby::new(4 << 20);
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 << 20));
    let (set, vol) = format_and_open(
        cache.clone(),
        backing.clone(),
        CacheMode::Writeback,
        no_threads(),
    );
    let flushed = pattern(1, 65536);
    vol.write(0, &flushed, false).unwrap();
    vol.flush().unwrap();
    // Acknowledged but never flushed: may or may not survive, but must not be half-applied.
    vol.write(1 << 20, &pattern(2, 4096), false).unwrap();

    cache.armed.store(true, Ordering::SeqCst);
    let err = vol
        .read(0, &mut [0u8; 4096])
        .expect_err("a panic below the engine must come back as an error, not unwind");
    assert!(
        matches!(&err, Error::State(m) if m.contains("panic") && m.contains("booby trap")),
        "{err}"
    );
    cache.armed.store(false, Ordering::SeqCst);
    let writes_after_panic = cache.writes.load(Ordering::SeqCst);

    // Every entry point now refuses, and none of them writes to the cache device.
    assert!(vol.read(0, &mut [0u8; 4096]).is_err());
    assert!(vol.write(8192, &pattern(3, 4096), true).is_err());
    assert!(vol.flush().is_err());
    assert!(set.commit().is_err());
    assert!(set.checkpoint().is_err());
    assert!(set.writeback_step(true).is_err());
    assert!(set.close().is_err());
    assert_eq!(
        cache.writes.load(Ordering::SeqCst),
        writes_after_panic,
        "a failed set wrote to the cache device"
    );
    drop((vol, set));

    // Restart: recovery reads the journal as the last commit left it.
    let (set, report) = CacheSet::open(cache.clone(), no_threads()).unwrap();
    let vol = set.attach(backing).unwrap();
    assert!(report.dirty_blocks >= 16, "{report:?}");
    let mut buf = vec![0u8; flushed.len()];
    vol.read(0, &mut buf).unwrap();
    assert!(buf == flushed, "flushed data lost after the panic");
    set.check_invariants().unwrap();
}

#[test]
fn every_knob_survives_a_restart() {
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 << 20));
    let (set, vol) = format_and_open(
        cache.clone(),
        backing.clone(),
        CacheMode::Writethrough,
        no_threads(),
    );
    let knobs = [
        Knob::CacheMode(CacheMode::Writearound),
        Knob::SequentialCutoff(12 << 20),
        Knob::WritebackPercent(37),
        Knob::WritebackDelaySecs(5),
        Knob::WritebackRunning(false),
        Knob::Label("renamed".into()),
    ];
    assert_eq!(knobs.len(), Knob::NAMES.len(), "a knob is missing here");
    for k in &knobs {
        vol.set_knob(k.clone()).unwrap();
    }
    let before = vol.knobs();
    set.close().unwrap();
    drop((vol, set));

    // After a clean close and after a crash (no close) alike.
    for crash in [false, true] {
        let (set, _) = CacheSet::open(cache.clone(), no_threads()).unwrap();
        let vol = set.attach(backing.clone()).unwrap();
        assert_eq!(vol.knobs(), before, "crash={crash}");
        assert_eq!(vol.name(), "renamed");
        assert!(!vol.knobs().writeback_running);
        if !crash {
            set.close().unwrap();
        }
    }
}

#[test]
fn refused_knob_values_change_nothing_in_memory_or_on_disk() {
    let backing = Arc::new(MemDevice::new(8 << 20));
    let (set, vol) = open_on_mem_cache(backing.clone(), CacheMode::Writeback);
    let image = backing.image();
    let knobs = vol.knobs();
    for bad in [
        Knob::Label(String::new()),
        Knob::Label("has\0nul".into()),
        Knob::Label("white space".into()),
        Knob::Label("x".repeat(65)),
        Knob::SequentialCutoff(u64::MAX),
        Knob::WritebackPercent(101),
        Knob::WritebackDelaySecs(u64::MAX),
    ] {
        let e = vol.set_knob(bad.clone()).expect_err("accepted a bad value");
        assert!(matches!(e, Error::Invalid(_)), "{bad:?}: {e}");
    }
    assert_eq!(vol.knobs(), knobs);
    assert!(backing.image() == image, "a refused value reached the disk");
    assert_eq!(vol.name(), "vol");
    set.close().unwrap();
}

#[test]
fn two_devices_cannot_share_a_label() {
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let a: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let b: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let (set, _va) = format_and_open(cache, a, CacheMode::Writethrough, no_threads());
    engine::format_backing(&*b, "other", CacheMode::Writethrough, false).unwrap();
    let vb = set.attach(b).unwrap();
    assert!(matches!(vb.set_label("vol"), Err(Error::Invalid(_))));
    assert_eq!(vb.name(), "other");
    vb.set_label("other2").unwrap();
    assert_eq!(vb.name(), "other2");
}

#[test]
fn unformatted_devices_are_reported_as_unformatted_not_corrupt() {
    let blank = MemDevice::new(8 << 20);
    assert!(matches!(
        engine::format::Superblock::read(&blank),
        Err(Error::Unformatted(_))
    ));
    assert!(matches!(
        engine::format::BackingHeader::read(&blank),
        Err(Error::Unformatted(_))
    ));
    assert!(matches!(
        engine::check_device(&blank, false),
        Err(Error::Unformatted(_))
    ));
    let r = CacheSet::open(Arc::new(MemDevice::new(8 << 20)), no_threads());
    assert!(matches!(r, Err(Error::Unformatted(_))));
    // A damaged superblock (magic present, checksum wrong) is still corruption.
    let cache = MemDevice::new(16 << 20);
    CacheSet::format(&cache, &engine::FormatOptions::default(), false).unwrap();
    let mut img = cache.image();
    img[4096 + 40] ^= 0xff;
    let last = img.len() - 4096 + 40;
    img[last] ^= 0xff;
    let damaged = MemDevice::from_image(img);
    assert!(matches!(
        engine::format::Superblock::read(&damaged),
        Err(Error::Corrupt(_))
    ));
}
