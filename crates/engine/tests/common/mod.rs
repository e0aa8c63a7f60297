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

/// A sector of write `id`'s pattern holds the id, the sector number, then a xorshift
/// sequence started from both.
fn pattern_start(id: u64, sector: u64) -> u64 {
    id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ sector.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// Fills `buf` (whole sectors, starting at sector `first`) with the pattern of write `id`.
pub fn fill(buf: &mut [u8], first: u64, id: u64) {
    for (i, s) in buf.chunks_mut(SECTOR).enumerate() {
        let sector = first + i as u64;
        let mut x = pattern_start(id, sector);
        s[..8].copy_from_slice(&id.to_le_bytes());
        s[8..16].copy_from_slice(&sector.to_le_bytes());
        for w in s[16..].chunks_exact_mut(8) {
            x = xorshift(x);
            w.copy_from_slice(&x.to_le_bytes());
        }
    }
}

/// Identifies which write a sector came from: 0 for zeroes, `Err` for anything unrecognised.
pub fn identify(s: &[u8], sector: u64) -> Result<u64, String> {
    let word = |j: usize| u64::from_le_bytes(s[j * 8..j * 8 + 8].try_into().unwrap());
    if s.chunks_exact(8).all(|w| w == [0; 8]) {
        return Ok(0);
    }
    let id = word(0);
    let mut x = pattern_start(id, sector);
    let mut ok = word(1) == sector;
    for j in 2..SECTOR / 8 {
        x = xorshift(x);
        ok &= word(j) == x;
    }
    if ok {
        Ok(id)
    } else {
        Err(format!(
            "sector {sector} holds data that no write produced (claims write {id}, sector {})",
            word(1)
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

/// Size of the second backing device of `Rig::with_second` rigs in the model, crash and
/// corruption tests: 512 KiB of data (small, so a detach drains it quickly).
pub const SECOND_BYTES: u64 = (512 << 10) + 8192;

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

/// Chooses which 512-byte sectors of an unflushed write (offset, data) a crash keeps.
pub type KeepSectors<'a> = dyn FnMut(u64, &[u8]) -> Vec<bool> + 'a;

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
    /// The cache set's uuid (a backing header names it while the device is attached).
    pub set_uuid: u128,
    /// A second backing device (`Rig::with_second`), on the same fault controller, that the
    /// lifecycle ops attach and detach; formatted but not attached at first.
    pub second: Option<Arc<SimDevice>>,
    pub second_vol: Option<Volume>,
    /// `open` attaches the second device: it is part of the set, or an attach or detach of
    /// it was under way (after a crash it is attached again).
    pub second_member: bool,
    /// Applied to the configuration at every open (tests of failure handling set limits).
    pub tune: Option<fn(&mut Config)>,
}

impl Rig {
    /// Formats fresh devices and opens the set.
    pub fn new(seed: u64, g: Geometry, mode: CacheMode) -> Rig {
        Rig::build(seed, g, mode, None)
    }

    /// Like `new`, plus a second backing device of `second_bytes` (writeback mode) that is
    /// not attached yet.
    pub fn with_second(seed: u64, g: Geometry, mode: CacheMode, second_bytes: u64) -> Rig {
        Rig::build(seed, g, mode, Some(second_bytes))
    }

    fn build(seed: u64, g: Geometry, mode: CacheMode, second_bytes: Option<u64>) -> Rig {
        let ctrl = FaultController::new(seed);
        let cache = Arc::new(SimDevice::new("cache", g.cache_bytes, ctrl.clone()));
        let backing = Arc::new(SimDevice::new("backing", g.backing_bytes, ctrl.clone()));
        // Half the seeds see a rotational backing device (which turns on the miss fill).
        backing.set_rotational(seed.is_multiple_of(2));
        let set_uuid = CacheSet::format(
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
        let second = second_bytes.map(|bytes| {
            let d = Arc::new(SimDevice::new("second", bytes, ctrl.clone()));
            d.set_rotational(seed.is_multiple_of(3));
            engine::format_backing(&*d, "second", CacheMode::Writeback, false)
                .expect("format second backing");
            d
        });
        let clock = Arc::new(ManualClock::default());
        let mut rig = Rig {
            ctrl,
            cache,
            backing,
            clock,
            set: None,
            vol: None,
            seq_cutoff: None,
            set_uuid: set_uuid.as_u128(),
            second,
            second_vol: None,
            second_member: false,
            tune: None,
        };
        rig.open().expect("open fresh set");
        rig
    }

    /// Opens the set and attaches the backing device (and the second one if it is a member).
    /// Every I/O may be a crash point: errors are returned, and nothing is kept on failure.
    pub fn open(&mut self) -> engine::Result<()> {
        let mut config = test_config(self.clock.clone());
        if let Some(tune) = self.tune {
            tune(&mut config);
        }
        let (set, _report) = CacheSet::open(self.cache.clone() as Arc<dyn BlockDevice>, config)?;
        let vol = set.attach(self.backing.clone() as Arc<dyn BlockDevice>)?;
        self.configure(&vol)?;
        let second_vol = match &self.second {
            Some(d) if self.second_member => {
                let v = set.attach(d.clone() as Arc<dyn BlockDevice>)?;
                self.configure(&v)?;
                Some(v)
            }
            _ => None,
        };
        self.set = Some(set);
        self.vol = Some(vol);
        self.second_vol = second_vol;
        Ok(())
    }

    /// Test knobs for a newly attached volume (header writes only when they change).
    fn configure(&self, vol: &Volume) -> engine::Result<()> {
        vol.set_writeback_delay_secs(0)?;
        if let Some(c) = self.seq_cutoff {
            vol.set_sequential_cutoff(c)?;
        }
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
            if let Some(v) = &self.second_vol {
                v.set_sequential_cutoff(32 << 10).unwrap();
            }
        }
    }

    pub fn set(&self) -> &CacheSet {
        self.set.as_ref().expect("set open")
    }

    /// Simulates power loss: the devices keep only what a crash may keep (not reopened).
    pub fn crash(&mut self) {
        self.crash_with(None);
    }

    /// Like `crash`, with `cache_keep` choosing which sectors of each unflushed cache write
    /// survive (see `SimDevice::crash_image_with`); the other devices as `crash` leaves them.
    pub fn crash_with(&mut self, cache_keep: Option<&mut KeepSectors<'_>>) {
        self.ctrl.crash_now();
        let cache_img = match cache_keep {
            Some(keep) => self.cache.crash_image_with(keep),
            None => self.cache.crash_image(),
        };
        self.vol = None;
        self.second_vol = None;
        self.set = None; // dropped without close: nothing more is written
        self.ctrl = FaultController::new(self.ctrl.seed().wrapping_add(1));
        let survive = |d: &SimDevice, name: &str, ctrl: &Arc<FaultController>| {
            let img = d.crash_image();
            let new = SimDevice::from_image(name, img, ctrl.clone());
            new.set_rotational(d.is_rotational());
            Arc::new(new)
        };
        let cache = SimDevice::from_image("cache", cache_img, self.ctrl.clone());
        cache.set_rotational(self.cache.is_rotational());
        self.cache = Arc::new(cache);
        self.backing = survive(&self.backing, "backing", &self.ctrl);
        self.second = self
            .second
            .as_ref()
            .map(|d| survive(d, "second", &self.ctrl));
    }

    /// Simulates power loss and reopens.
    pub fn crash_and_reopen(&mut self) -> engine::Result<()> {
        self.crash();
        self.open()
    }

    /// Clean shutdown (the set is gone afterwards, also when it fails).
    pub fn close(&mut self) -> engine::Result<()> {
        self.vol = None;
        self.second_vol = None;
        self.set.take().expect("set open").close()
    }

    /// Clean shutdown and reopen.
    pub fn close_and_reopen(&mut self) -> engine::Result<()> {
        self.close()?;
        self.open()
    }

    /// Detaches the second device (writeback drains its dirty data first).
    pub fn detach_second(&mut self) -> engine::Result<()> {
        let vol = self.second_vol.clone().expect("second device attached");
        self.set().detach(&vol, &mut |_, _| {})?;
        self.second_vol = None;
        self.second_member = false;
        Ok(())
    }

    /// Attaches the second device; `fresh` formats it first (a new identity, same data).
    pub fn attach_second(&mut self, fresh: bool) -> engine::Result<()> {
        let dev = self.second.clone().expect("a second device");
        assert!(self.second_vol.is_none(), "second device already attached");
        if fresh {
            engine::format_backing(&*dev, "second", CacheMode::Writeback, true)?;
        }
        self.second_member = true;
        let vol = self.set().attach(dev as Arc<dyn BlockDevice>)?;
        self.configure(&vol)?;
        self.second_vol = Some(vol);
        Ok(())
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
    // Lifecycle ops (a `World` applies them; they act on its second backing device).
    /// Clean shutdown of the set, then open it again.
    Close,
    /// Detach the second device if it is attached (no-op otherwise).
    Detach,
    /// Attach the second device if it is not attached (no-op otherwise); `fresh` formats it
    /// first, so it joins under a new identity.
    Attach {
        fresh: bool,
    },
    /// Later I/O ops go to backing device 0 or 1 (to 0 while 1 is detached).
    Target(usize),
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
    apply_to(rig, rig.vol(), model, op, next_id)
}

/// `apply` on the given volume of the rig (lifecycle ops are refused: see `World`).
pub fn apply_to(
    rig: &Rig,
    vol: &Volume,
    model: &mut Model,
    op: &Op,
    next_id: &mut u64,
) -> Result<engine::Result<()>, String> {
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
                if let Err(e) = apply_to(rig, vol, model, &op, next_id) {
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
                    if let Err(e) = apply_to(rig, vol, model, &w, next_id)? {
                        r = Err(e);
                        break;
                    }
                }
            }
            r
        }
        Op::Close | Op::Detach | Op::Attach { .. } | Op::Target(_) => {
            return Err(format!("{op:?} needs a World"));
        }
    };
    Ok(res)
}

/// Moves an I/O op drawn for a larger device into a device of `sectors` sectors (the same
/// op when it fits).
pub fn fit(op: &Op, sectors: usize) -> Op {
    let place = |sector: usize, n: usize| {
        let n = n.min(sectors);
        (sector % (sectors - n + 1), n)
    };
    match *op {
        Op::Write { sector, n, fua } => {
            let (sector, n) = place(sector, n);
            Op::Write { sector, n, fua }
        }
        Op::Read { sector, n } => {
            let (sector, n) = place(sector, n);
            Op::Read { sector, n }
        }
        Op::Discard { sector, n } => {
            let (sector, n) = place(sector, n);
            Op::Discard { sector, n }
        }
        Op::Zero { sector, n, fua } => {
            let (sector, n) = place(sector, n);
            Op::Zero { sector, n, fua }
        }
        Op::Stream { sector, n, write } => {
            let n = n.min(sectors / 16).max(1);
            Op::Stream {
                sector: sector % (sectors - 16 * n + 1),
                n,
                write,
            }
        }
        ref other => other.clone(),
    }
}

/// A rig with one model per backing device, applying every op including the lifecycle ops
/// (close, detach, attach) and checking what each of them promises.
pub struct World {
    pub rig: Rig,
    /// One per backing device: `models[1]` is the second device's.
    pub models: Vec<Model>,
    pub next_id: u64,
    /// The device I/O ops go to (see `Op::Target`).
    pub target: usize,
    /// Lifecycle ops completed so far.
    pub done: Lifecycle,
}

/// Counts of completed lifecycle ops (what a workload covered).
#[derive(Clone, Copy, Debug, Default)]
pub struct Lifecycle {
    pub closes: u32,
    pub detaches: u32,
    /// Detaches that found dirty data on the device leaving and on device 0.
    pub detaches_both_dirty: u32,
    pub attaches: u32,
    pub fresh_attaches: u32,
}

impl World {
    pub fn new(rig: Rig) -> World {
        let mut models = vec![Model::new(rig.vol().size_bytes() as usize / SECTOR)];
        if let Some(d) = &rig.second {
            let (h, _) = engine::format::BackingHeader::read(&**d).expect("second header");
            models.push(Model::new(h.data_size as usize / SECTOR));
        }
        World {
            rig,
            models,
            next_id: 0,
            target: 0,
            done: Lifecycle::default(),
        }
    }

    /// The volume I/O ops go to and its index in `models`.
    fn target_vol(&self) -> (usize, Volume) {
        match &self.rig.second_vol {
            Some(v) if self.target == 1 => (1, v.clone()),
            _ => (0, self.rig.vol().clone()),
        }
    }

    /// Applies `op` to the engine and the models: `Err` when the engine broke a promise, `Ok(Err)`
    /// with the engine's error (after a simulated crash).
    pub fn apply(&mut self, op: &Op) -> Result<engine::Result<()>, String> {
        match *op {
            Op::Close => {
                let r = self.rig.close();
                if r.is_ok() {
                    // A completed close made everything acknowledged durable.
                    for m in &mut self.models {
                        m.flush();
                    }
                    self.done.closes += 1;
                }
                Ok(r.and_then(|()| self.rig.open()))
            }
            Op::Detach => {
                let Some(vol) = &self.rig.second_vol else {
                    return Ok(Ok(()));
                };
                let dirty = [self.rig.vol(), vol].map(|v| v.status().dirty_bytes > 0);
                let r = self.rig.detach_second();
                if r.is_ok() {
                    self.done.detaches += 1;
                    if dirty == [true, true] {
                        self.done.detaches_both_dirty += 1;
                    }
                    // A completed detach wrote back and flushed everything acknowledged: the
                    // device alone holds it, durably, under a header that names no set.
                    self.models[1].flush();
                    let d = self.rig.second.as_ref().unwrap();
                    check_detached(&d.durable_image(), &self.models[1])
                        .map_err(|e| format!("after detach, durable image: {e}"))?;
                }
                Ok(r)
            }
            Op::Attach { fresh } => {
                if self.rig.second.is_none() || self.rig.second_vol.is_some() {
                    return Ok(Ok(()));
                }
                let r = self.rig.attach_second(fresh);
                if r.is_ok() {
                    self.done.attaches += 1;
                    self.done.fresh_attaches += u32::from(fresh);
                }
                Ok(r)
            }
            Op::Target(t) => {
                self.target = t.min(self.models.len() - 1);
                Ok(Ok(()))
            }
            _ => {
                let (i, vol) = self.target_vol();
                let op = fit(op, self.models[i].live.len());
                apply_to(&self.rig, &vol, &mut self.models[i], &op, &mut self.next_id)
            }
        }
    }

    /// Flushes every attached volume.
    pub fn flush_all(&mut self) -> Result<(), String> {
        self.rig.vol().flush().map_err(|e| e.to_string())?;
        self.models[0].flush();
        if let Some(v) = &self.rig.second_vol {
            v.flush().map_err(|e| e.to_string())?;
            self.models[1].flush();
        }
        Ok(())
    }

    /// Power loss, then open again and check everything. A second device caught in an
    /// attach or detach must be part of the set or cleanly out of it (header naming no set,
    /// every flushed write on the device itself), and it is attached again.
    pub fn crash_and_reopen(&mut self) -> Result<(), String> {
        self.rig.crash();
        for m in &mut self.models {
            m.crashed();
        }
        if let Some(d) = &self.rig.second {
            let (h, _) = engine::format::BackingHeader::read(&**d)
                .map_err(|e| format!("second device header after crash: {e}"))?;
            if h.set_uuid.is_nil() {
                check_detached(&d.live_image(), &self.models[1])
                    .map_err(|e| format!("second device, out of the set after crash: {e}"))?;
            } else if h.set_uuid.as_u128() != self.rig.set_uuid {
                return Err(format!(
                    "second device names set {} after crash",
                    h.set_uuid
                ));
            } else if !self.rig.second_member {
                return Err("second device was detached but its header names the set".into());
            }
        }
        self.rig
            .open()
            .map_err(|e| format!("reopen after crash: {e}"))?;
        self.verify()
    }

    /// Clean shutdown and reopen, then check everything.
    pub fn close_and_reopen(&mut self) -> Result<(), String> {
        self.apply(&Op::Close)?.map_err(|e| e.to_string())?;
        self.verify()
    }

    /// Reads every device and checks every sector against its model (a detached second
    /// device directly), then the set's invariants.
    pub fn verify(&self) -> Result<(), String> {
        verify_vol(self.rig.vol(), &self.models[0]).map_err(|e| format!("device 0: {e}"))?;
        if let Some(d) = &self.rig.second {
            match &self.rig.second_vol {
                Some(v) => verify_vol(v, &self.models[1]),
                None => check_detached(&d.live_image(), &self.models[1]),
            }
            .map_err(|e| format!("device 1: {e}"))?;
        }
        self.rig.set().check_invariants()
    }
}

/// Checks the image of a backing device that is out of the set: its header names no set and
/// is clean, and its data area holds what the model allows.
pub fn check_detached(img: &[u8], model: &Model) -> Result<(), String> {
    let probe = SimDevice::from_image("probe", img.to_vec(), FaultController::new(0));
    let (h, _) = engine::format::BackingHeader::read(&probe).map_err(|e| e.to_string())?;
    if !h.set_uuid.is_nil() || h.state != engine::format::BackingState::Clean {
        return Err(format!(
            "header of a detached device says set {} state {:?}",
            h.set_uuid, h.state
        ));
    }
    let off = engine::format::BACKING_DATA_OFFSET as usize;
    model.check(0, &img[off..off + model.live.len() * SECTOR])
}

/// Reads the whole device and checks every sector against the model.
pub fn verify_all(rig: &Rig, model: &Model) -> Result<(), String> {
    verify_vol(rig.vol(), model)?;
    rig.set().check_invariants()
}

/// Reads the whole volume and checks every sector against the model.
pub fn verify_vol(vol: &Volume, model: &Model) -> Result<(), String> {
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
    Ok(())
}

/// Every run allocates and frees several device images of megabytes; glibc would return
/// each to the kernel and fault it in again, zeroed, for the next (a third of the run time).
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes allocator tuning (under its own lock).
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 64 << 20);
            mallopt(M_TRIM_THRESHOLD, 512 << 20);
        }
    }
}

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// The seed for a randomized test: `TIERCACHE_SEED` if set, else from the clock. Printed.
pub fn seed_from_env(test: &str) -> u64 {
    engine::test_seed(test)
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

/// Formats `cache` as a cache device of 64 KiB buckets (small caches with many buckets).
pub fn format_cache(cache: &dyn BlockDevice) {
    CacheSet::format(
        cache,
        &FormatOptions {
            bucket_size: 64 << 10,
            ..FormatOptions::default()
        },
        false,
    )
    .expect("format cache");
}

pub fn format_and_open(
    cache: Arc<dyn BlockDevice>,
    backing: Arc<dyn BlockDevice>,
    mode: CacheMode,
    config: Config,
) -> (CacheSet, Volume) {
    format_cache(&*cache);
    engine::format_backing(&*backing, "vol", mode, false).expect("format backing");
    let (set, _) = CacheSet::open(cache, config).expect("open set");
    let vol = set.attach(backing).expect("attach");
    (set, vol)
}
