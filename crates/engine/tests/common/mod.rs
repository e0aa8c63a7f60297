//! Shared test support: a reference model of what each sector may contain, recognisable data
//! patterns, and a harness that runs the engine on simulated devices with a seeded workload.
//!
//! The model keeps, per 512-byte sector, the set of values a read may return now (`live`) and
//! the set a crash may leave (`crash`). Values are write ids: every write fills each sector
//! with a pattern derived from (write id, sector), so a read identifies exactly which write it
//! came from, and anything else (garbage, a sector from elsewhere) is detected.
#![allow(dead_code)]

use blockdev::fault::{FaultController, SimDevice};
use blockdev::BlockDevice;
use engine::clock::ManualClock;
use engine::{CacheMode, CacheSet, Config, FormatOptions, Volume};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

pub const SECTOR: usize = 512;

/// Fills `buf` (whole sectors, starting at sector `first`) with the pattern of write `id`.
pub fn fill(buf: &mut [u8], first: u64, id: u64) {
    for (i, s) in buf.chunks_mut(SECTOR).enumerate() {
        let sector = first + i as u64;
        let mut x =
            id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ sector.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        s[..8].copy_from_slice(&id.to_le_bytes());
        s[8..16].copy_from_slice(&sector.to_le_bytes());
        for w in s[16..].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
    }
}

/// Identifies which write a sector came from: 0 for zeroes, `Err` for anything unrecognised.
pub fn identify(s: &[u8], sector: u64) -> Result<u64, String> {
    if s.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let id = u64::from_le_bytes(s[..8].try_into().unwrap());
    let mut expect = vec![0u8; SECTOR];
    fill(&mut expect, sector, id);
    if s == &expect[..] {
        Ok(id)
    } else {
        Err(format!(
            "sector {sector} holds data that no write produced (claims write {id}, sector {})",
            u64::from_le_bytes(s[8..16].try_into().unwrap())
        ))
    }
}

#[derive(Clone)]
pub struct Model {
    pub live: Vec<Vec<u64>>,
    pub crash: Vec<Vec<u64>>,
}

fn add(set: &mut Vec<u64>, v: u64) {
    if !set.contains(&v) {
        set.push(v);
    }
}

impl Model {
    pub fn new(sectors: usize) -> Model {
        Model {
            live: vec![vec![0]; sectors],
            crash: vec![vec![0]; sectors],
        }
    }
    pub fn write(&mut self, first: usize, n: usize, id: u64, fua: bool) {
        for s in first..first + n {
            self.live[s] = vec![id];
            if fua {
                self.crash[s] = vec![id];
            } else {
                add(&mut self.crash[s], id);
            }
        }
    }
    pub fn zero(&mut self, first: usize, n: usize, fua: bool) {
        self.write(first, n, 0, fua);
    }
    pub fn discard(&mut self, first: usize, n: usize) {
        for s in first..first + n {
            add(&mut self.live[s], 0);
            add(&mut self.crash[s], 0);
        }
    }
    pub fn flush(&mut self) {
        self.crash = self.live.clone();
    }
    pub fn crashed(&mut self) {
        self.live = self.crash.clone();
    }
    /// Checks a read of sectors `[first, first + n)`.
    pub fn check(&self, first: usize, data: &[u8]) -> Result<(), String> {
        for (i, s) in data.chunks(SECTOR).enumerate() {
            let sector = first + i;
            let id = identify(s, sector as u64)?;
            if !self.live[sector].contains(&id) {
                return Err(format!(
                    "sector {sector} reads write {id}, expected one of {:?}",
                    self.live[sector]
                ));
            }
        }
        Ok(())
    }
}

/// Sizes of the simulated devices (small, so thousands of runs stay fast).
#[derive(Clone, Copy)]
pub struct Geometry {
    pub cache_bytes: u64,
    pub backing_bytes: u64,
    pub bucket_size: u32,
    pub block_size: u32,
}

impl Default for Geometry {
    fn default() -> Self {
        Geometry {
            cache_bytes: 2560 << 10,
            backing_bytes: (2 << 20) + 8192,
            bucket_size: 64 << 10,
            block_size: 4096,
        }
    }
}

/// A configuration without background threads (tests drive writeback and commits).
/// Most ops one `Op::Checkpoint` runs between its chunks.
pub const INTERLEAVED_MAX: usize = 8;

pub fn no_threads() -> Config {
    Config {
        background: false,
        // One bucket per hold of the state lock: every checkpoint of a small cache is fuzzy.
        checkpoint_buckets_per_lock: 1,
        ..Config::default()
    }
}

pub fn test_config(clock: Arc<ManualClock>) -> Config {
    Config {
        clock,
        ..no_threads()
    }
}

/// Engine on simulated devices sharing one fault controller.
pub struct Rig {
    pub ctrl: Arc<FaultController>,
    pub cache: Arc<SimDevice>,
    pub backing: Arc<SimDevice>,
    pub clock: Arc<ManualClock>,
    pub set: Option<CacheSet>,
    pub vol: Option<Volume>,
    /// Sequential cutoff applied at every open (`None`: the default).
    pub seq_cutoff: Option<u64>,
}

impl Rig {
    /// Formats fresh devices and opens the set.
    pub fn new(seed: u64, g: Geometry, mode: CacheMode) -> Rig {
        let ctrl = FaultController::new(seed);
        let cache = Arc::new(SimDevice::new("cache", g.cache_bytes, ctrl.clone()));
        let backing = Arc::new(SimDevice::new("backing", g.backing_bytes, ctrl.clone()));
        // Half the seeds see a rotational backing device (which turns on the miss fill).
        backing.set_rotational(seed.is_multiple_of(2));
        CacheSet::format(
            &*cache,
            &FormatOptions {
                block_size: g.block_size,
                bucket_size: g.bucket_size,
                label: String::new(),
            },
            false,
        )
        .expect("format cache");
        engine::format_backing(&*backing, "vol", mode, false).expect("format backing");
        let clock = Arc::new(ManualClock::default());
        let mut rig = Rig {
            ctrl,
            cache,
            backing,
            clock,
            set: None,
            vol: None,
            seq_cutoff: None,
        };
        rig.open().expect("open fresh set");
        rig
    }

    pub fn open(&mut self) -> engine::Result<()> {
        let (set, _report) = CacheSet::open(
            self.cache.clone() as Arc<dyn BlockDevice>,
            test_config(self.clock.clone()),
        )?;
        let vol = set.attach(self.backing.clone() as Arc<dyn BlockDevice>)?;
        vol.set_writeback_delay_secs(0).unwrap();
        if let Some(c) = self.seq_cutoff {
            vol.set_sequential_cutoff(c).unwrap();
        }
        self.set = Some(set);
        self.vol = Some(vol);
        Ok(())
    }

    pub fn vol(&self) -> &Volume {
        self.vol.as_ref().expect("volume open")
    }

    /// For a quarter of the seeds, a 32 KiB sequential cutoff from now on, so sequential
    /// streams bypass the cache and are served through readahead.
    pub fn short_cutoff_for_some_seeds(&mut self, seed: u64) {
        // Bits 2-3 of the seed: independent of tests that pick the mode by `seed % 4`.
        if (seed >> 2) % 4 == 1 {
            self.seq_cutoff = Some(32 << 10);
            self.vol().set_sequential_cutoff(32 << 10).unwrap();
        }
    }

    pub fn set(&self) -> &CacheSet {
        self.set.as_ref().expect("set open")
    }

    /// Simulates power loss: the devices keep only what a crash may keep; reopen.
    pub fn crash_and_reopen(&mut self) -> engine::Result<()> {
        self.ctrl.crash_now();
        self.vol = None;
        self.set = None; // dropped without close: nothing more is written
        let cache_img = self.cache.crash_image();
        let backing_img = self.backing.crash_image();
        self.ctrl = FaultController::new(self.ctrl.seed().wrapping_add(1));
        self.cache = Arc::new(SimDevice::from_image("cache", cache_img, self.ctrl.clone()));
        self.backing = Arc::new(SimDevice::from_image(
            "backing",
            backing_img,
            self.ctrl.clone(),
        ));
        self.open()
    }

    /// Clean shutdown and reopen.
    pub fn close_and_reopen(&mut self) -> engine::Result<()> {
        self.vol = None;
        self.set.take().expect("set open").close()?;
        self.open()
    }
}

/// One step of a random workload.
#[derive(Clone, Debug)]
pub enum Op {
    Write {
        sector: usize,
        n: usize,
        fua: bool,
    },
    Read {
        sector: usize,
        n: usize,
    },
    Flush,
    Discard {
        sector: usize,
        n: usize,
    },
    Zero {
        sector: usize,
        n: usize,
        fua: bool,
    },
    Mode(CacheMode),
    Writeback,
    Maintenance,
    /// A checkpoint with up to `INTERLEAVED_MAX` ops (drawn from `interleave`) run between its
    /// chunks, so the fuzzy checkpoint meets writes, discards, writeback and GC mid-way.
    Checkpoint {
        interleave: u32,
    },
    Tick,
    /// 16 consecutive reads of `n` sectors from `sector` (a sequential stream); with
    /// `write`, the stream's 7th chunk is overwritten after the 5th is read (readahead must
    /// not serve the old data).
    Stream {
        sector: usize,
        n: usize,
        write: bool,
    },
}

/// Draws a random op over a device of `sectors` sectors.
pub fn random_op(rng: &mut ChaCha8Rng, sectors: usize) -> Op {
    op_from(rng.gen(), rng.gen(), rng.gen(), rng.gen(), sectors)
}

/// Maps raw numbers to an op (a pure function, so proptest can shrink the raw numbers).
/// A quarter of the device is hot and gets most of the traffic.
pub fn op_from(kind: u8, a: u32, b: u32, c: u32, sectors: usize) -> Op {
    let len = match b % 10 {
        0..=4 => 8,                     // one 4 KiB block
        5..=6 => 1 + (c % 7) as usize,  // sub-block
        7..=8 => 1 + (c % 63) as usize, // a few blocks, unaligned
        _ => 64 + (c % 448) as usize,   // large
    }
    .min(sectors);
    let hot = (sectors / 4).max(1);
    let s = if a % 10 < 7 {
        (a as usize / 10) % hot
    } else {
        (a as usize / 10) % sectors
    };
    let s = if c.is_multiple_of(2) { s / 8 * 8 } else { s };
    let sector = s.min(sectors - len);
    let flag = |pct: u32| (c / 7) % 100 < pct;
    match kind % 100 {
        0..=39 => Op::Write {
            sector,
            n: len,
            fua: flag(10),
        },
        40..=69 => Op::Read { sector, n: len },
        70..=77 => Op::Flush,
        78..=80 => Op::Discard { sector, n: len },
        81..=83 => Op::Zero {
            sector,
            n: len,
            fua: flag(20),
        },
        84..=86 => Op::Mode(CacheMode::ALL[(a % 4) as usize]),
        87..=91 => Op::Writeback,
        92..=93 => Op::Maintenance,
        94..=96 => Op::Checkpoint { interleave: a ^ c },
        97..=98 => {
            let n = len.min(sectors / 16);
            Op::Stream {
                sector: sector.min(sectors - 16 * n),
                n,
                write: flag(50),
            }
        }
        _ => Op::Tick,
    }
}

/// Applies `op` to the engine and the model. Returns `Err` with a description when the engine
/// disagrees with the model, or the engine's error (e.g. after a simulated crash) as `Ok(Err)`.
pub fn apply(
    rig: &Rig,
    model: &mut Model,
    op: &Op,
    next_id: &mut u64,
) -> Result<engine::Result<()>, String> {
    let vol = rig.vol();
    let res = match *op {
        Op::Write { sector, n, fua } => {
            *next_id += 1;
            let mut buf = vec![0u8; n * SECTOR];
            fill(&mut buf, sector as u64, *next_id);
            let r = vol.write((sector * SECTOR) as u64, &buf, fua);
            if r.is_ok() {
                model.write(sector, n, *next_id, fua);
            } else {
                // Unacknowledged: the write may or may not have happened.
                for s in sector..sector + n {
                    add(&mut model.live[s], *next_id);
                    add(&mut model.crash[s], *next_id);
                }
            }
            r
        }
        Op::Read { sector, n } => {
            let mut buf = vec![0u8; n * SECTOR];
            let r = vol.read((sector * SECTOR) as u64, &mut buf);
            if r.is_ok() {
                model.check(sector, &buf)?;
            }
            r
        }
        Op::Flush => {
            let r = vol.flush();
            if r.is_ok() {
                model.flush();
            }
            r
        }
        Op::Discard { sector, n } => {
            model.discard(sector, n);
            vol.discard((sector * SECTOR) as u64, (n * SECTOR) as u64)
        }
        Op::Zero { sector, n, fua } => {
            let r = vol.write_zeroes((sector * SECTOR) as u64, (n * SECTOR) as u64, fua);
            if r.is_ok() {
                model.zero(sector, n, fua);
            } else {
                for s in sector..sector + n {
                    add(&mut model.live[s], 0);
                    add(&mut model.crash[s], 0);
                }
            }
            r
        }
        Op::Mode(m) => vol.set_mode(m),
        Op::Writeback => rig.set().writeback_step(true).map(|_| ()),
        Op::Maintenance => rig.set().maintenance_step().map(|_| ()),
        Op::Checkpoint { interleave } => {
            let sectors = (vol.size_bytes() / SECTOR as u64) as usize;
            let mut r = rng(u64::from(interleave));
            let mut left = INTERLEAVED_MAX;
            let mut failure: Option<String> = None;
            let res = rig.set().checkpoint_interleaved(&mut || {
                if left == 0 || failure.is_some() || r.gen_bool(0.3) {
                    return;
                }
                left -= 1;
                let op = random_op(&mut r, sectors);
                if matches!(op, Op::Checkpoint { .. }) {
                    return;
                }
                if let Err(e) = apply(rig, model, &op, next_id) {
                    failure = Some(format!("{op:?} during a checkpoint: {e}"));
                }
            });
            if let Some(f) = failure {
                return Err(f);
            }
            res
        }
        Op::Tick => {
            rig.clock.advance_ns(2_000_000_000);
            Ok(())
        }
        Op::Stream { sector, n, write } => {
            let mut buf = vec![0u8; n * SECTOR];
            let mut r = Ok(());
            for i in 0..16 {
                let at = sector + i * n;
                if let Err(e) = vol.read((at * SECTOR) as u64, &mut buf) {
                    r = Err(e);
                    break;
                }
                model.check(at, &buf)?;
                if write && i == 4 {
                    let w = Op::Write {
                        sector: at + 2 * n,
                        n,
                        fua: false,
                    };
                    if let Err(e) = apply(rig, model, &w, next_id)? {
                        r = Err(e);
                        break;
                    }
                }
            }
            r
        }
    };
    Ok(res)
}

/// Reads the whole device and checks every sector against the model.
pub fn verify_all(rig: &Rig, model: &Model) -> Result<(), String> {
    let vol = rig.vol();
    let size = vol.size_bytes() as usize;
    let chunk = 64 << 10;
    let mut buf = vec![0u8; chunk];
    let mut at = 0;
    while at < size {
        let n = chunk.min(size - at);
        vol.read(at as u64, &mut buf[..n])
            .map_err(|e| format!("read at {at} failed: {e}"))?;
        model.check(at / SECTOR, &buf[..n])?;
        at += n;
    }
    rig.set().check_invariants()
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// The seed for a randomized test: `TIERCACHE_SEED` if set, else from the clock. Printed.
pub fn seed_from_env(test: &str) -> u64 {
    let seed = std::env::var("TIERCACHE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: seed={seed} (replay with TIERCACHE_SEED={seed})");
    seed
}

/// Formats `cache` (64 KiB buckets) and `backing`, opens the set and attaches the volume.
/// `format_and_open` on a 4 MiB in-memory cache, without background threads.
pub fn open_on_mem_cache(backing: Arc<dyn BlockDevice>, mode: CacheMode) -> (CacheSet, Volume) {
    format_and_open(
        Arc::new(blockdev::MemDevice::new(4 << 20)),
        backing,
        mode,
        no_threads(),
    )
}

pub fn format_and_open(
    cache: Arc<dyn BlockDevice>,
    backing: Arc<dyn BlockDevice>,
    mode: CacheMode,
    config: Config,
) -> (CacheSet, Volume) {
    CacheSet::format(
        &*cache,
        &FormatOptions {
            bucket_size: 64 << 10,
            ..FormatOptions::default()
        },
        false,
    )
    .expect("format cache");
    engine::format_backing(&*backing, "vol", mode, false).expect("format backing");
    let (set, _) = CacheSet::open(cache, config).expect("open set");
    let vol = set.attach(backing).expect("attach");
    (set, vol)
}
