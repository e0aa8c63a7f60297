//! Metadata and data corruption: flip bytes in every metadata region (both superblock copies,
//! both checkpoint slots, the journal records and each of their two copies, both backing
//! header copies) and in cached data.
//! Open must either recover or refuse with a clear error; it never serves wrong data. The
//! images hold two backing devices and the metadata of attach, detach and close: attach and
//! detach journal records after the checkpoint, the checkpoint's device table, and the
//! header of a second device that is attached or detached. A clean
//! cached block that fails its checksum is re-read from the backing device; a dirty one is an
//! I/O error.

mod common;

use blockdev::fault::{FaultController, SimDevice};
use blockdev::BlockDevice;
use common::*;
use engine::{CacheMode, CacheSet};
use rand::Rng;
use std::sync::Arc;

/// Durable images of the cache device, the backing device and the second backing device.
#[derive(Clone)]
struct Images {
    cache: Vec<u8>,
    backing: Vec<u8>,
    second: Vec<u8>,
}

/// Builds a set with clean and dirty data on two backing devices, a checkpoint, and journal
/// records after it, with the second device's lifecycle in both: attached, detached and
/// attached again freshly formatted before the checkpoint (which holds its new id), detached
/// and attached again after it (journal records). With `detached`, the second device ends
/// detached. Returns the durable images and the models of what they hold.
fn prepared(seed: u64, detached: bool) -> (Images, Vec<Model>) {
    let rig = Rig::with_second(
        seed,
        Geometry::default(),
        CacheMode::Writeback,
        SECOND_BYTES,
    );
    let mut w = World::new(rig);
    let sectors = w.models[0].live.len();
    let mut r = rng(seed);
    let step = |w: &mut World, op: Op| {
        w.apply(&op)
            .unwrap_or_else(|e| panic!("seed {seed}: {op:?}: {e}"))
            .unwrap_or_else(|e| panic!("seed {seed}: {op:?}: {e}"))
    };
    step(&mut w, Op::Attach { fresh: false });
    for round in 0..3 {
        for i in 0..60 {
            let op = random_op(&mut r, sectors);
            if matches!(op, Op::Mode(_)) {
                continue;
            }
            step(&mut w, op);
            if i % 20 == 0 {
                let other = 1 - w.target;
                step(&mut w, Op::Target(other));
            }
        }
        w.flush_all().unwrap();
        match round {
            0 => {
                step(&mut w, Op::Detach);
                step(&mut w, Op::Attach { fresh: true });
            }
            1 => {
                w.close_and_reopen().unwrap();
                step(&mut w, Op::Detach);
                step(&mut w, Op::Attach { fresh: false });
            }
            _ if detached => step(&mut w, Op::Detach),
            _ => {}
        }
    }
    w.verify().unwrap();
    // The flips aim at the journal records after the checkpoint, so there must be some; the
    // last ops or the fills of `verify`'s reads may have left none (a checkpoint op, or a
    // commit that checkpointed a full journal: the seeds of `FLIP_REGRESSIONS`), and then
    // flushed writes to the first device add them.
    let records = |w: &World| records_since_checkpoint(&w.rig.cache.durable_image()).1;
    for sector in (0..sectors - 8).step_by(8).take(16) {
        if records(&w) > 0 {
            break;
        }
        step(&mut w, Op::Target(0));
        step(
            &mut w,
            Op::Write {
                sector,
                n: 8,
                fua: true,
            },
        );
        w.flush_all().unwrap();
    }
    assert!(
        records(&w) > 0,
        "seed {seed}: no journal record after the checkpoint"
    );
    // Everything was flushed, so the durable images hold all of it.
    let images = Images {
        cache: w.rig.cache.durable_image(),
        backing: w.rig.backing.durable_image(),
        second: w.rig.second.as_ref().unwrap().durable_image(),
    };
    (images, w.models)
}

/// Opens images, attaches both backing devices and reads everything: Ok(true) if served (all
/// reads correct or errors), Ok(false) if refused, Err on wrong data.
fn open_and_check(img: Images, models: &[Model]) -> Result<bool, String> {
    let ctrl = FaultController::new(0);
    let cache = Arc::new(SimDevice::from_image("cache", img.cache, ctrl.clone()));
    let backing = Arc::new(SimDevice::from_image("backing", img.backing, ctrl.clone()));
    let second = Arc::new(SimDevice::from_image("second", img.second, ctrl));
    let clock = Arc::new(engine::clock::ManualClock::default());
    let set = match CacheSet::open(cache as Arc<dyn BlockDevice>, test_config(clock)) {
        Ok((s, _)) => s,
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.len() > 10, "refusal without a useful message: {msg}");
            return Ok(false);
        }
    };
    for (i, dev) in [backing, second].into_iter().enumerate() {
        let vol = match set.attach(dev as Arc<dyn BlockDevice>) {
            Ok(v) => v,
            Err(e) => {
                assert!(e.to_string().len() > 10);
                return Ok(false);
            }
        };
        let mut buf = vec![0u8; 4096];
        for at in (0..vol.size_bytes()).step_by(4096) {
            if vol.read(at, &mut buf).is_ok() {
                models[i]
                    .check((at / 512) as usize, &buf)
                    .map_err(|e| format!("device {i}: {e}"))?;
            }
        }
    }
    Ok(true)
}

/// The journal records written since the current checkpoint (both copies of each): offset and
/// length on the cache device (the part after the ring's wrap if it wrapped).
fn records_since_checkpoint(cache_img: &[u8]) -> (u64, u64) {
    let probe = SimDevice::from_image("probe", cache_img.to_vec(), FaultController::new(0));
    let loaded = engine::load_metadata(&probe).unwrap();
    let (l, ring) = (&loaded.sb.layout, &loaded.ring);
    let (start, len) = if ring.head >= ring.used {
        (ring.head - ring.used, ring.used)
    } else if ring.head > 0 {
        (0, ring.head)
    } else {
        (ring.len - ring.used, ring.used)
    };
    (l.journal_off + start, len)
}

/// Every journal record on the cache image, current or left behind: the offset of its first
/// copy on the device and the size of one copy (the second copy follows the first, byte for
/// byte the same).
fn journal_records(cache_img: &[u8], l: &engine::format::Layout) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = l.journal_off;
    while at + 32 <= l.journal_off + l.journal_len {
        let b = &cache_img[at as usize..];
        if &b[..8] == b"TCJRNL01" {
            let frame = 32 + u64::from_le_bytes(b[24..32].try_into().unwrap());
            let copy = frame.div_ceil(4096) * 4096;
            let end = at + 2 * copy;
            if end <= l.journal_off + l.journal_len
                && b[..copy as usize] == b[copy as usize..2 * copy as usize]
            {
                out.push((at, copy));
                at = end;
                continue;
            }
        }
        at += 4096;
    }
    out
}

/// Seeds that once failed `flipped_metadata_never_serves_wrong_data` (no journal record was
/// left after the checkpoint), run every time.
const FLIP_REGRESSIONS: &[u64] = &[1795795521034104872, 8502496573348760206];

#[test]
fn flipped_metadata_never_serves_wrong_data() {
    flips_never_serve_wrong_data(seed_from_env("flipped_metadata_never_serves_wrong_data"));
}

#[test]
fn flipped_metadata_regression_seeds() {
    for &seed in FLIP_REGRESSIONS {
        flips_never_serve_wrong_data(seed);
    }
}

fn flips_never_serve_wrong_data(seed: u64) {
    let mut r = rng(seed);
    let (mut served, mut refused) = (0, 0);
    // The second device ends attached (its header names the set, the journal or the
    // checkpoint holds its detach and attach), then detached (its header names no set, the
    // cache forgot it).
    for detached in [false, true] {
        let (img, models) = prepared(seed, detached);
        // Untouched images open and read back correctly.
        assert!(open_and_check(img.clone(), &models).unwrap());
        let ctrl = FaultController::new(0);
        let probe = SimDevice::from_image("probe", img.cache.clone(), ctrl);
        let sb = engine::format::Superblock::read(&probe).unwrap().0;
        let l = &sb.layout;
        let (recs, recs_len) = records_since_checkpoint(&img.cache);
        // The newest record ends where the records since the checkpoint end.
        let (first, copy) = journal_records(&img.cache, l)
            .into_iter()
            .find(|&(at, copy)| at + 2 * copy == recs + recs_len)
            .expect("the newest journal record");
        assert!(
            recs_len > 0,
            "seed {seed}: no journal records after the checkpoint"
        );
        let cache_regions: Vec<(&str, u64, u64)> = vec![
            ("superblock copy 0", l.sb_offsets[0], 4096),
            ("superblock copy 1", l.sb_offsets[1], 4096),
            ("checkpoint slot 0", l.ckpt_offsets[0], 8192),
            ("checkpoint slot 1", l.ckpt_offsets[1], 8192),
            ("journal start", l.journal_off, 16384),
            ("records since the checkpoint", recs, recs_len),
            ("records since the checkpoint, again", recs, recs_len),
            ("newest record, copy 0", first, copy),
            ("newest record, copy 1", first + copy, copy),
        ];
        let flip = |r: &mut rand_chacha::ChaCha8Rng, img: &mut Vec<u8>, off: u64, len: u64| {
            let at = (off + r.gen_range(0..len)) as usize;
            img[at] ^= r.gen_range(1..=255u8);
            at
        };
        let mut tally = |what: String, res: Result<bool, String>| match res {
            Ok(true) => served += 1,
            Ok(false) => refused += 1,
            Err(e) => panic!("seed {seed}: {what}: wrong data served: {e}"),
        };
        for (name, off, len) in &cache_regions {
            for _ in 0..12 {
                let mut i = img.clone();
                let at = flip(&mut r, &mut i.cache, *off, *len);
                tally(
                    format!("flip in {name} at {at} (detached {detached})"),
                    open_and_check(i, &models),
                );
            }
        }
        for (name, off) in [("header copy 0", 0u64), ("header copy 1", 4096)] {
            for second in [false, true] {
                for _ in 0..12 {
                    let mut i = img.clone();
                    let dev = if second {
                        &mut i.second
                    } else {
                        &mut i.backing
                    };
                    let at = flip(&mut r, dev, off, 200);
                    tally(
                        format!(
                            "flip in {} {name} at {at} (detached {detached})",
                            if second { "second" } else { "backing" }
                        ),
                        open_and_check(i, &models),
                    );
                }
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
    for detached in [false, true] {
        let (img, models) = prepared(seed, detached);
        let ctrl = FaultController::new(0);
        let sb =
            engine::format::Superblock::read(&SimDevice::from_image("p", img.cache.clone(), ctrl))
                .unwrap()
                .0;
        let l = sb.layout.clone();
        for (off, len) in [(l.sb_offsets[0], 4096u64), (l.sb_offsets[1], 4096)] {
            let mut i = img.clone();
            i.cache[off as usize..(off + len) as usize].fill(0xA5);
            assert!(
                open_and_check(i, &models).unwrap(),
                "seed {seed}: wiping {off}+{len} was not survived (detached {detached})"
            );
        }
        // The first copy of every journal record wiped at once, then the second copy of every
        // record: the other copies hold the whole journal.
        let records = journal_records(&img.cache, &l);
        assert!(records.len() > 2, "seed {seed}: too few journal records");
        for second in [false, true] {
            let mut i = img.clone();
            for &(at, copy) in &records {
                let from = if second { at + copy } else { at };
                i.cache[from as usize..(from + copy) as usize].fill(0xA5);
            }
            assert!(
                open_and_check(i, &models).unwrap(),
                "seed {seed}: wiping copy {} of all {} journal records was not survived (detached {detached})",
                u8::from(second),
                records.len()
            );
        }
        for off in [0usize, 4096] {
            for second in [false, true] {
                let mut i = img.clone();
                let dev = if second {
                    &mut i.second
                } else {
                    &mut i.backing
                };
                dev[off..off + 4096].fill(0x5A);
                assert!(
                    open_and_check(i, &models).unwrap(),
                    "seed {seed}: wiping header copy at {off} (second {second}, detached {detached}) was not survived"
                );
            }
        }
        // The current checkpoint slot is not mirrored: damage is refused, never guessed around.
        let mut i = img.clone();
        let slot = l.ckpt_offsets[sb.ckpt_slot as usize] as usize;
        i.cache[slot + 40] ^= 1;
        assert!(!open_and_check(i, &models).unwrap());
    }
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
