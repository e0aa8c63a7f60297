//! Metadata and data corruption: flip bytes in every metadata region (both superblock copies,
//! both checkpoint slots, both journal mirrors, both backing header copies) and in cached data.
//! Open must either recover or refuse with a clear error; it never serves wrong data. A clean
//! cached block that fails its checksum is re-read from the backing device; a dirty one is an
//! I/O error.

mod common;

use blockdev::fault::{FaultController, SimDevice};
use blockdev::BlockDevice;
use common::*;
use engine::{CacheMode, CacheSet};
use rand::Rng;
use std::sync::Arc;

/// Builds a set with clean and dirty data, a checkpoint, and journal records after it.
/// Returns the durable images and the model of what they hold.
fn prepared(seed: u64) -> (Vec<u8>, Vec<u8>, Model) {
    let mut rig = Rig::new(seed, Geometry::default(), CacheMode::Writeback);
    let sectors = (rig.vol().size_bytes() / SECTOR as u64) as usize;
    let mut model = Model::new(sectors);
    let mut id = 0;
    let mut r = rng(seed);
    for round in 0..3 {
        for _ in 0..60 {
            let op = random_op(&mut r, sectors);
            if matches!(op, Op::Mode(_)) {
                continue;
            }
            apply(&rig, &mut model, &op, &mut id).unwrap().unwrap();
        }
        rig.vol().flush().unwrap();
        model.flush();
        if round == 1 {
            rig.close_and_reopen().unwrap();
        }
    }
    // Everything was flushed, so the durable images hold all of it.
    (
        rig.cache.durable_image(),
        rig.backing.durable_image(),
        model,
    )
}

/// Opens images and reads everything: Ok(true) if served (all reads correct or errors),
/// Ok(false) if refused, Err on wrong data.
fn open_and_check(cache_img: Vec<u8>, backing_img: Vec<u8>, model: &Model) -> Result<bool, String> {
    let ctrl = FaultController::new(0);
    let cache = Arc::new(SimDevice::from_image("cache", cache_img, ctrl.clone()));
    let backing = Arc::new(SimDevice::from_image("backing", backing_img, ctrl));
    let clock = Arc::new(engine::clock::ManualClock::default());
    let set = match CacheSet::open(cache as Arc<dyn BlockDevice>, test_config(clock)) {
        Ok((s, _)) => s,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.len() > 10, "refusal without a useful message: {msg}");
            return Ok(false);
        }
    };
    let vol = match set.attach(backing as Arc<dyn BlockDevice>) {
        Ok(v) => v,
        Err(e) => {
            assert!(e.to_string().len() > 10);
            return Ok(false);
        }
    };
    let mut buf = vec![0u8; 4096];
    for at in (0..vol.size_bytes()).step_by(4096) {
        if vol.read(at, &mut buf).is_ok() {
            model.check((at / 512) as usize, &buf)?;
        }
    }
    Ok(true)
}

#[test]
fn flipped_metadata_never_serves_wrong_data() {
    let seed = seed_from_env("flipped_metadata_never_serves_wrong_data");
    let (cache_img, backing_img, model) = prepared(seed);
    // Untouched images open and read back correctly.
    assert!(open_and_check(cache_img.clone(), backing_img.clone(), &model).unwrap());
    let ctrl = FaultController::new(0);
    let probe = SimDevice::from_image("probe", cache_img.clone(), ctrl);
    let sb = engine::format::Superblock::read(&probe).unwrap().0;
    let l = &sb.layout;
    let cache_regions: Vec<(&str, u64, u64)> = vec![
        ("superblock copy 0", l.sb_offsets[0], 4096),
        ("superblock copy 1", l.sb_offsets[1], 4096),
        ("checkpoint slot 0", l.ckpt_offsets[0], 8192),
        ("checkpoint slot 1", l.ckpt_offsets[1], 8192),
        ("journal copy 0", l.journal_off, 16384),
        ("journal copy 1", l.journal_off + l.journal_len / 2, 16384),
    ];
    let mut r = rng(seed);
    let (mut served, mut refused) = (0, 0);
    for (name, off, len) in &cache_regions {
        for _ in 0..12 {
            let mut img = cache_img.clone();
            let at = (off + r.gen_range(0..*len)) as usize;
            img[at] ^= r.gen_range(1..=255u8);
            match open_and_check(img, backing_img.clone(), &model) {
                Ok(true) => served += 1,
                Ok(false) => refused += 1,
                Err(e) => panic!("seed {seed}: flip in {name} at {at}: wrong data served: {e}"),
            }
        }
    }
    for (name, off) in [
        ("backing header copy 0", 0u64),
        ("backing header copy 1", 4096),
    ] {
        for _ in 0..12 {
            let mut img = backing_img.clone();
            let at = (off + r.gen_range(0..200)) as usize;
            img[at] ^= r.gen_range(1..=255u8);
            match open_and_check(cache_img.clone(), img, &model) {
                Ok(true) => served += 1,
                Ok(false) => refused += 1,
                Err(e) => panic!("seed {seed}: flip in {name} at {at}: wrong data served: {e}"),
            }
        }
    }
    eprintln!("metadata flips: {served} recovered, {refused} refused");
    // Single flips in mirrored metadata (superblocks, journal, backing headers) are survived.
    assert!(
        served > refused,
        "mirrored metadata should survive most single flips"
    );
}

#[test]
fn one_damaged_copy_of_mirrored_metadata_is_survived() {
    let seed = seed_from_env("one_damaged_copy_of_mirrored_metadata_is_survived");
    let (cache_img, backing_img, model) = prepared(seed);
    let ctrl = FaultController::new(0);
    let sb = engine::format::Superblock::read(&SimDevice::from_image("p", cache_img.clone(), ctrl))
        .unwrap()
        .0;
    let l = sb.layout.clone();
    for (off, len) in [
        (l.sb_offsets[0], 4096u64),
        (l.sb_offsets[1], 4096),
        (l.journal_off, l.journal_len / 2),
    ] {
        let mut img = cache_img.clone();
        img[off as usize..(off + len) as usize].fill(0xA5);
        assert!(
            open_and_check(img, backing_img.clone(), &model).unwrap(),
            "wiping {off}+{len} was not survived"
        );
    }
    for off in [0usize, 4096] {
        let mut img = backing_img.clone();
        img[off..off + 4096].fill(0x5A);
        assert!(open_and_check(cache_img.clone(), img, &model).unwrap());
    }
    // The current checkpoint slot is not mirrored: damage is refused, never guessed around.
    let mut img = cache_img.clone();
    let slot = l.ckpt_offsets[sb.ckpt_slot as usize] as usize;
    img[slot + 40] ^= 1;
    assert!(!open_and_check(img, backing_img, &model).unwrap());
}

#[test]
fn damaged_cached_data_is_repaired_when_clean_and_an_error_when_dirty() {
    let seed = seed_from_env("damaged_cached_data");
    for mode in [CacheMode::Writethrough, CacheMode::Writeback] {
        let rig = Rig::new(seed, Geometry::default(), mode);
        let vol = rig.vol();
        let mut buf = vec![0u8; 64 << 10];
        fill(&mut buf, 0, 1);
        vol.write(0, &buf, true).unwrap();
        let ranges = vol.cached_ranges(0, buf.len() as u64).unwrap();
        assert_eq!(ranges.iter().map(|r| r.1).sum::<u64>(), buf.len() as u64);
        // Corrupt every cached block of the range on the cache device.
        let l = rig.set().layout().clone();
        let data_region = l.data_off..l.data_off + l.nbuckets as u64 * l.bucket_size as u64;
        let img = rig.cache.live_image();
        let mut hits = 0;
        for at in (data_region.start..data_region.end).step_by(512) {
            let s = &img[at as usize..at as usize + 512];
            if let Ok(id) = identify(s, u64::from_le_bytes(s[8..16].try_into().unwrap())) {
                if id == 1 {
                    let mut bad = s.to_vec();
                    bad[100] ^= 0xff;
                    rig.cache.write_at(&bad, at).unwrap();
                    hits += 1;
                }
            }
        }
        assert_eq!(hits, 128, "expected to find every cached sector");
        let mut out = vec![0u8; buf.len()];
        let r = vol.read(0, &mut out);
        match mode {
            CacheMode::Writethrough => {
                r.unwrap();
                assert_eq!(
                    out, buf,
                    "clean data must be repaired from the backing device"
                );
                assert!(vol.status().stats.total.checksum_repairs > 0);
            }
            _ => {
                let e = r.unwrap_err();
                assert!(e.to_string().contains("checksum"), "{e}");
            }
        }
    }
}

/// A cache device whose superblocks are in format 1 (the version before per-bucket
/// checkpoints) is refused with one line that says so, not reported as damage.
#[test]
fn an_older_format_is_refused_with_one_line() {
    let dev = blockdev::MemDevice::new(16 << 20);
    CacheSet::format(&dev, &engine::FormatOptions::default(), false).unwrap();
    let (sb, _) = engine::format::Superblock::read(&dev).unwrap();
    for off in sb.layout.sb_offsets {
        let mut frame = vec![0u8; 4096];
        dev.read_at(&mut frame, off).unwrap();
        // Version 1, checksum recomputed over the frame with its checksum field zeroed.
        frame[8..12].copy_from_slice(&1u32.to_le_bytes());
        let len = 32 + u64::from_le_bytes(frame[24..32].try_into().unwrap()) as usize;
        frame[12..16].fill(0);
        let crc = crc32c::crc32c(&frame[..len]);
        frame[12..16].copy_from_slice(&crc.to_le_bytes());
        dev.write_at(&frame, off).unwrap();
    }
    let dev: Arc<dyn BlockDevice> = Arc::new(dev);
    let err = match CacheSet::open(dev, no_threads()) {
        Ok(_) => panic!("a format 1 device was opened"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("format 1") && err.contains("format 2") && !err.contains('\n'),
        "unexpected refusal: {err}"
    );
}
