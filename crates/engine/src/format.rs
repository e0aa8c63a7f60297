//! On-disk layout of both device kinds: the cache device superblock and region layout, and the
//! backing device header. `docs/format.md` documents the same layout byte by byte.
//!
//! Invariants:
//! - the cache device has two superblock copies (at 4 KiB and in the last 4 KiB); the valid
//!   copy with the highest sequence wins, and updates write one copy, flush, then the other, so
//!   a crash at any point leaves at least one valid copy;
//! - the backing device has two header copies (at 0 and 4 KiB) updated the same way; its data
//!   starts at `BACKING_DATA_OFFSET` (8 KiB, like bcache);
//! - every region offset is 4 KiB aligned, the data region is block aligned, and no two regions
//!   overlap (`Layout::compute` is the only constructor for fresh layouts and `validate` checks
//!   layouts read from disk, since media is never trusted).

use crate::codec::{frame, frame_header, round_up, unframe, Reader, Writer};
use crate::knobs::{Knob, Tunables};
use crate::types::{CacheMode, Error, IoContext, Result};
use blockdev::BlockDevice;
use uuid::Uuid;

/// Version of the cache device format (superblock, checkpoints). Format 2 replaced the
/// whole-index checkpoint with per-bucket chunks; a format 1 device is refused.
pub const FORMAT_VERSION: u32 = 2;
/// Version of the backing device header (unchanged by cache format 2).
pub const BACKING_VERSION: u32 = 1;
pub const SB_MAGIC: &[u8; 8] = b"TCCACHE1";
pub const BACKING_MAGIC: &[u8; 8] = b"TCBACKNG";
pub const META_BLOCK: u64 = 4096;
pub const SB_OFFSET: u64 = 4096;
pub const BACKING_HEADER_OFFSETS: [u64; 2] = [0, 4096];
pub const BACKING_DATA_OFFSET: u64 = 8192;
/// The backing header's dirty amount when none is recorded.
const DIRTY_UNKNOWN: u64 = u64::MAX;
pub use crate::knobs::LABEL_BYTES;
/// Most backing devices one cache set tracks.
pub const MAX_DEVS: usize = 256;
/// Bytes per cached block in a checkpoint body: offset in bucket (4), device (1), backing
/// block (5), crc (4), dirty (1).
pub const CKPT_BLOCK_BYTES: u64 = 15;
/// Bytes per live bucket in a checkpoint body: bucket (4), generation (1), count (4).
pub const CKPT_BUCKET_BYTES: u64 = 9;
/// Payload bytes after which a checkpoint body chunk is closed (it may exceed this by one
/// bucket's records).
pub const CKPT_CHUNK_BYTES: u64 = 1 << 20;
/// Fixed part of a checkpoint payload: counts plus the device table.
pub const CKPT_FIXED_BYTES: u64 = 64 + MAX_DEVS as u64 * 20;
pub const MIN_BUCKETS: u32 = 8;
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;
pub const DEFAULT_BUCKET_SIZE: u32 = 512 * 1024;

/// Region layout of a cache device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub device_size: u64,
    pub block_size: u32,
    pub bucket_size: u32,
    pub nbuckets: u32,
    pub sb_offsets: [u64; 2],
    pub ckpt_offsets: [u64; 2],
    pub ckpt_len: u64,
    pub journal_off: u64,
    pub journal_len: u64,
    pub data_off: u64,
}

impl Layout {
    /// Computes the layout for a fresh cache device, or explains why it cannot hold one.
    pub fn compute(device_size: u64, block_size: u32, bucket_size: u32) -> Result<Layout> {
        if !block_size.is_power_of_two() || !(512..=65536).contains(&block_size) {
            return Err(Error::Invalid(format!(
                "block size {block_size} must be a power of two between 512 and 65536"
            )));
        }
        if !bucket_size.is_power_of_two()
            || bucket_size < block_size.max(4096) * 2
            || bucket_size > 64 << 20
        {
            return Err(Error::Invalid(format!(
                "bucket size {bucket_size} must be a power of two, at least two blocks and 8 KiB, at most 64 MiB"
            )));
        }
        let rounded = device_size / META_BLOCK * META_BLOCK;
        if let Some(layout) = Self::fit(rounded, block_size, bucket_size)? {
            return Ok(layout);
        }
        let bucket = u64::from(bucket_size);
        Err(Error::Invalid(format!(
            "cache device of {} is too small: {MIN_BUCKETS} buckets of {} with {block_size}-byte \
             blocks plus metadata need at least {} ({} bytes); give a bigger device or a \
             smaller --bucket-size",
            crate::units::human(device_size),
            crate::units::human(bucket),
            crate::units::human(Self::min_device_size(block_size, bucket_size)),
            Self::min_device_size(block_size, bucket_size),
        )))
    }

    /// The smallest device (a multiple of the metadata block) a layout of `block_size` and
    /// `bucket_size` fits on; both already checked.
    fn min_device_size(block_size: u32, bucket_size: u32) -> u64 {
        let fits = |blocks: u64| {
            Self::fit(blocks * META_BLOCK, block_size, bucket_size).is_ok_and(|l| l.is_some())
        };
        let mut hi = 16u64;
        while !fits(hi) {
            hi *= 2;
        }
        let mut lo = hi / 2; // does not fit (or is below the floor)
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        hi * META_BLOCK
    }

    /// The layout on a device of `device_size` bytes (a multiple of the metadata block), or
    /// `None` if it is too small for `MIN_BUCKETS` buckets and the metadata.
    fn fit(device_size: u64, block_size: u32, bucket_size: u32) -> Result<Option<Layout>> {
        if device_size < 16 * META_BLOCK {
            return Ok(None);
        }
        let sb_last = device_size - META_BLOCK;
        // A multiple of 8 KiB (as when the region was split into two mirror halves).
        let journal_len = round_up((device_size / 64).clamp(1 << 20, 256 << 20), 2 * META_BLOCK);
        let bpb = u64::from(bucket_size / block_size);
        let mut nbuckets = (device_size / u64::from(bucket_size)) as u32;
        loop {
            if nbuckets < MIN_BUCKETS {
                return Ok(None);
            }
            let ckpt_len = Self::ckpt_len_for(nbuckets, bpb);
            let ckpt0 = 2 * META_BLOCK;
            let ckpt1 = ckpt0 + ckpt_len;
            let journal_off = ckpt1 + ckpt_len;
            let data_off = round_up(
                journal_off + journal_len,
                u64::from(block_size).max(META_BLOCK),
            );
            let data_end = data_off + u64::from(nbuckets) * u64::from(bucket_size);
            if data_end <= sb_last {
                let layout = Layout {
                    device_size,
                    block_size,
                    bucket_size,
                    nbuckets,
                    sb_offsets: [SB_OFFSET, sb_last],
                    ckpt_offsets: [ckpt0, ckpt1],
                    ckpt_len,
                    journal_off,
                    journal_len,
                    data_off,
                };
                layout.validate()?;
                return Ok(Some(layout));
            }
            // Shrink by the overshoot (at least one bucket) and try again.
            let over = data_end - sb_last;
            let shrink = over.div_ceil(u64::from(bucket_size)).max(1);
            nbuckets = nbuckets.saturating_sub(u32::try_from(shrink).unwrap_or(u32::MAX));
        }
    }

    /// Bytes at the start of a checkpoint slot reserved for its header frame (counts, device
    /// table, one generation byte per bucket).
    pub fn ckpt_header_len(nbuckets: u32) -> u64 {
        round_up(
            crate::codec::FRAME_HEADER_BYTES as u64 + CKPT_FIXED_BYTES + u64::from(nbuckets),
            META_BLOCK,
        )
    }

    /// Space one checkpoint slot needs for `nbuckets` buckets of `bpb` blocks when every
    /// cache block is live: the header, then body chunks of whole 4 KiB blocks. A chunk is
    /// closed once it passes `CKPT_CHUNK_BYTES`, so each but the last holds at least that much
    /// and there are at most `body / CKPT_CHUNK_BYTES + 1` of them.
    fn ckpt_len_for(nbuckets: u32, bpb: u64) -> u64 {
        let body = u64::from(nbuckets) * (CKPT_BUCKET_BYTES + bpb * CKPT_BLOCK_BYTES);
        let chunks = body / CKPT_CHUNK_BYTES + 1;
        round_up(
            Self::ckpt_header_len(nbuckets)
                + body
                + chunks * (crate::codec::FRAME_HEADER_BYTES as u64 + META_BLOCK),
            META_BLOCK,
        )
    }

    pub fn blocks_per_bucket(&self) -> u32 {
        self.bucket_size / self.block_size
    }

    pub fn total_blocks(&self) -> u32 {
        self.nbuckets * self.blocks_per_bucket()
    }

    /// Byte offset on the cache device of a global cache block.
    pub fn block_offset(&self, block: u32) -> u64 {
        self.data_off + u64::from(block) * u64::from(self.block_size)
    }

    /// Byte offset on the cache device of cache block `cb` (what the engine calls;
    /// `block_offset` is the same for callers outside it, with a raw number).
    pub(crate) fn cache_block_offset(&self, cb: crate::units::CacheBlock) -> u64 {
        self.block_offset(cb.get())
    }

    /// Checks a layout read from disk: sizes sane, regions ordered and inside the device.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Corrupt(format!("superblock layout: {m}")));
        if !self.block_size.is_power_of_two() || !(512..=65536).contains(&self.block_size) {
            return bad("bad block size");
        }
        if !self.bucket_size.is_power_of_two() || self.bucket_size < 2 * self.block_size {
            return bad("bad bucket size");
        }
        if self.nbuckets < MIN_BUCKETS
            || u64::from(self.nbuckets) * u64::from(self.blocks_per_bucket()) >= u64::from(u32::MAX)
        {
            return bad("bad bucket count");
        }
        let aligned = [
            self.ckpt_offsets[0],
            self.ckpt_offsets[1],
            self.ckpt_len,
            self.journal_off,
            self.journal_len,
            self.data_off,
            self.sb_offsets[1],
        ]
        .iter()
        .all(|v| v % META_BLOCK == 0);
        if !aligned || self.sb_offsets[0] != SB_OFFSET {
            return bad("misaligned region");
        }
        // Region ends in checked arithmetic: every field comes from disk, and a sum that
        // wrapped would pass the comparisons below with a region past the end of the device.
        let ends = (|| {
            Some([
                self.ckpt_offsets[0].checked_add(self.ckpt_len)?,
                self.ckpt_offsets[1].checked_add(self.ckpt_len)?,
                self.journal_off.checked_add(self.journal_len)?,
                self.data_off
                    .checked_add(u64::from(self.nbuckets) * u64::from(self.bucket_size))?,
                self.sb_offsets[1].checked_add(META_BLOCK)?,
            ])
        })();
        let Some([ckpt0_end, ckpt1_end, journal_end, data_end, sb1_end]) = ends else {
            return bad("regions overlap or exceed the device");
        };
        let ordered = SB_OFFSET + META_BLOCK <= self.ckpt_offsets[0]
            && ckpt0_end <= self.ckpt_offsets[1]
            && ckpt1_end <= self.journal_off
            && journal_end <= self.data_off
            && self.data_off.is_multiple_of(u64::from(self.block_size))
            && data_end <= self.sb_offsets[1]
            && sb1_end <= self.device_size;
        if !ordered
            || self.journal_len < 16 * META_BLOCK
            || !self.journal_len.is_multiple_of(2 * META_BLOCK)
        {
            return bad("regions overlap or exceed the device");
        }
        if self.ckpt_len < Self::ckpt_len_for(self.nbuckets, u64::from(self.blocks_per_bucket())) {
            return bad("checkpoint slot too small");
        }
        Ok(())
    }
}

/// The cache device superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub seq: u64,
    pub set_uuid: Uuid,
    pub dev_uuid: Uuid,
    pub layout: Layout,
    /// Which checkpoint slot holds the current checkpoint, and its sequence number.
    pub ckpt_slot: u32,
    pub ckpt_seq: u64,
    pub created_unix: u64,
    pub label: String,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let l = &self.layout;
        let mut w = Writer::default();
        w.bytes(self.set_uuid.as_bytes());
        w.bytes(self.dev_uuid.as_bytes());
        w.u64(l.device_size);
        w.u32(l.block_size);
        w.u32(l.bucket_size);
        w.u32(l.nbuckets);
        w.u64(l.sb_offsets[1]);
        w.u64(l.ckpt_offsets[0]);
        w.u64(l.ckpt_offsets[1]);
        w.u64(l.ckpt_len);
        w.u64(l.journal_off);
        w.u64(l.journal_len);
        w.u64(l.data_off);
        w.u32(self.ckpt_slot);
        w.u64(self.ckpt_seq);
        w.u64(self.created_unix);
        w.fixed_str(&self.label, LABEL_BYTES);
        let mut out = frame(SB_MAGIC, FORMAT_VERSION, self.seq, &w.buf);
        out.resize(META_BLOCK as usize, 0);
        out
    }

    pub fn decode(data: &[u8]) -> Result<Superblock, String> {
        let (seq, payload) = unframe(SB_MAGIC, FORMAT_VERSION, data)?;
        let mut r = Reader::new(payload);
        let short = || "superblock payload too short".to_string();
        let set_uuid = Uuid::from_bytes(r.array().ok_or_else(short)?);
        let dev_uuid = Uuid::from_bytes(r.array().ok_or_else(short)?);
        let device_size = r.u64().ok_or_else(short)?;
        let block_size = r.u32().ok_or_else(short)?;
        let bucket_size = r.u32().ok_or_else(short)?;
        let nbuckets = r.u32().ok_or_else(short)?;
        let sb1 = r.u64().ok_or_else(short)?;
        let c0 = r.u64().ok_or_else(short)?;
        let c1 = r.u64().ok_or_else(short)?;
        let ckpt_len = r.u64().ok_or_else(short)?;
        let journal_off = r.u64().ok_or_else(short)?;
        let journal_len = r.u64().ok_or_else(short)?;
        let data_off = r.u64().ok_or_else(short)?;
        let ckpt_slot = r.u32().ok_or_else(short)?;
        let ckpt_seq = r.u64().ok_or_else(short)?;
        let created_unix = r.u64().ok_or_else(short)?;
        let label = r.fixed_str(LABEL_BYTES).ok_or_else(short)?;
        if ckpt_slot > 1 {
            return Err(format!("checkpoint slot {ckpt_slot} out of range"));
        }
        let layout = Layout {
            device_size,
            block_size,
            bucket_size,
            nbuckets,
            sb_offsets: [SB_OFFSET, sb1],
            ckpt_offsets: [c0, c1],
            ckpt_len,
            journal_off,
            journal_len,
            data_off,
        };
        layout.validate().map_err(|e| e.to_string())?;
        Ok(Superblock {
            seq,
            set_uuid,
            dev_uuid,
            layout,
            ckpt_slot,
            ckpt_seq,
            created_unix,
            label,
        })
    }

    /// Reads both copies; returns the valid one with the highest sequence and a note per
    /// damaged copy.
    pub fn read(dev: &dyn BlockDevice) -> Result<(Superblock, Vec<String>)> {
        let size = dev.size_bytes() / META_BLOCK * META_BLOCK;
        if size < 16 * META_BLOCK {
            return Err(Error::Invalid(format!(
                "device of {size} bytes is too small to hold a tiercache cache"
            )));
        }
        let mut best: Option<Superblock> = None;
        let mut notes = Vec::new();
        let mut magic_seen = false;
        let mut older: Option<u32> = None;
        let mut buf = vec![0u8; META_BLOCK as usize];
        dev.read_at(&mut buf, SB_OFFSET)
            .ctx(|| "reading superblock copy 0".into())?;
        magic_seen |= frame_header(SB_MAGIC, &buf).is_some();
        let mut note_version = |buf: &[u8]| {
            if let Some(h) = frame_header(SB_MAGIC, buf) {
                if h.version < FORMAT_VERSION {
                    older = Some(h.version);
                }
            }
        };
        note_version(&buf);
        let first = Superblock::decode(&buf);
        // The second copy's location is recorded in the first; if the first is damaged, it is
        // in the last 4 KiB of the device.
        let second_off = match &first {
            Ok(sb) => sb.layout.sb_offsets[1],
            Err(_) => size - META_BLOCK,
        };
        for (i, res) in [(0, Ok(first)), (1, Err(second_off))] {
            let parsed = match res {
                Ok(p) => p,
                Err(off) => {
                    if off + META_BLOCK > dev.size_bytes() {
                        Err("second copy lies past the end of the device".into())
                    } else {
                        dev.read_at(&mut buf, off)
                            .ctx(|| "reading superblock copy 1".into())?;
                        magic_seen |= frame_header(SB_MAGIC, &buf).is_some();
                        note_version(&buf);
                        Superblock::decode(&buf)
                    }
                }
            };
            match parsed {
                Ok(sb) => {
                    if best.as_ref().is_none_or(|b| sb.seq > b.seq) {
                        best = Some(sb);
                    }
                }
                Err(e) => notes.push(format!("superblock copy {i}: {e}")),
            }
        }
        match best {
            Some(sb) => {
                if sb.layout.device_size > dev.size_bytes() {
                    return Err(Error::Corrupt(format!(
                        "superblock says the cache device holds {} bytes but it has {}",
                        sb.layout.device_size,
                        dev.size_bytes()
                    )));
                }
                Ok((sb, notes))
            }
            None if older.is_some() => Err(Error::State(format!(
                "this cache device is in tiercache format {} and this version reads format {FORMAT_VERSION}: write back its dirty data and detach its backing devices with the tiercache that made it, then format it again with `tiercache make`",
                older.unwrap_or(0)
            ))),
            None if !magic_seen => Err(Error::Unformatted(
                "not a tiercache cache device (no superblock found; format it with `tiercache make`)"
                    .into(),
            )),
            None => Err(Error::Corrupt(format!(
                "no valid tiercache superblock ({})",
                notes.join("; ")
            ))),
        }
    }

    /// Writes both copies, flushing after each, so one is always valid.
    pub fn write(&self, dev: &dyn BlockDevice) -> Result<()> {
        let buf = self.encode();
        for off in self.layout.sb_offsets {
            dev.write_at(&buf, off)
                .ctx(|| "writing superblock".into())?;
            dev.flush().ctx(|| "flushing superblock".into())?;
        }
        Ok(())
    }
}

/// Whether a backing device may hold data not yet written back from its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingState {
    Clean,
    Dirty,
}

/// Which of the cache set's copies of a backing device may no longer match it, because the
/// device was written while the cache set was not in use (a degraded cache set, or `serve`
/// without the cache device). Attach drops them before the device is served through the set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StaleCopies {
    /// Every copy the set holds is current.
    #[default]
    None,
    /// Clean copies may be stale; dirty ones are still the newest data (nothing overlapping
    /// them was written meanwhile).
    Clean,
    /// Every copy may be stale: the device was served without its dirty data, which the
    /// operator gave up (`serve --without-cache-discard-dirty`).
    All,
}

impl StaleCopies {
    fn code(self) -> u8 {
        match self {
            StaleCopies::None => 0,
            StaleCopies::Clean => 1,
            StaleCopies::All => 2,
        }
    }

    fn from_code(c: u8) -> Option<StaleCopies> {
        Some(match c {
            0 => StaleCopies::None,
            1 => StaleCopies::Clean,
            2 => StaleCopies::All,
            _ => return None,
        })
    }
}

/// The header at the start of a backing device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackingHeader {
    pub seq: u64,
    pub dev_uuid: Uuid,
    /// The cache set this device belongs to (nil when detached).
    pub set_uuid: Uuid,
    pub data_offset: u64,
    pub data_size: u64,
    pub mode: CacheMode,
    pub state: BackingState,
    pub label: String,
    /// The other knobs, so every knob set survives a restart. Headers written before these
    /// fields existed end after the label and decode with the defaults.
    pub tunables: Tunables,
    /// Copies in the cache set that attach must drop first. Headers written before this field
    /// existed end before it and decode as `None`.
    pub stale: StaleCopies,
    /// How much dirty data the owning set held for the device when it last wrote the header
    /// (meaningful while `state` is `Dirty`; see `owner.rs` for when it is rewritten). `None`:
    /// not recorded (a header written before this field existed).
    pub dirty_bytes: Option<u64>,
    /// The name of the host whose cache set owns the device (`Config::host_name`; empty when
    /// detached or not recorded), so that a refused attach on another host can name it.
    pub owner_host: String,
}

impl BackingHeader {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(self.dev_uuid.as_bytes());
        w.bytes(self.set_uuid.as_bytes());
        w.u64(self.data_offset);
        w.u64(self.data_size);
        w.u8(self.mode.code());
        w.u8(match self.state {
            BackingState::Clean => 0,
            BackingState::Dirty => 1,
        });
        w.fixed_str(&self.label, LABEL_BYTES);
        let t = &self.tunables;
        w.u64(t.sequential_cutoff);
        w.u32(t.writeback_percent);
        w.u64(t.writeback_delay_secs);
        w.u8(u8::from(t.writeback_running));
        w.u8(self.stale.code());
        w.u64(self.dirty_bytes.unwrap_or(DIRTY_UNKNOWN));
        w.fixed_str(&self.owner_host, LABEL_BYTES);
        let mut out = frame(BACKING_MAGIC, BACKING_VERSION, self.seq, &w.buf);
        out.resize(META_BLOCK as usize, 0);
        out
    }

    pub fn decode(data: &[u8]) -> Result<BackingHeader, String> {
        let (seq, payload) = unframe(BACKING_MAGIC, BACKING_VERSION, data)?;
        let mut r = Reader::new(payload);
        let short = || "backing header payload too short".to_string();
        let dev_uuid = Uuid::from_bytes(r.array().ok_or_else(short)?);
        let set_uuid = Uuid::from_bytes(r.array().ok_or_else(short)?);
        let data_offset = r.u64().ok_or_else(short)?;
        let data_size = r.u64().ok_or_else(short)?;
        let mode_code = r.u8().ok_or_else(short)?;
        let mode = CacheMode::from_code(mode_code)
            .ok_or(format!("unknown cache mode code {mode_code}"))?;
        let state = match r.u8().ok_or_else(short)? {
            0 => BackingState::Clean,
            1 => BackingState::Dirty,
            s => return Err(format!("unknown state code {s}")),
        };
        let label = r.fixed_str(LABEL_BYTES).ok_or_else(short)?;
        let tunables = if r.remaining() == 0 {
            Tunables::default()
        } else {
            let t = Tunables {
                sequential_cutoff: r.u64().ok_or_else(short)?,
                writeback_percent: r.u32().ok_or_else(short)?,
                writeback_delay_secs: r.u64().ok_or_else(short)?,
                writeback_running: match r.u8().ok_or_else(short)? {
                    0 => false,
                    1 => true,
                    v => return Err(format!("bad writeback_running {v}")),
                },
            };
            for k in [
                Knob::SequentialCutoff(t.sequential_cutoff),
                Knob::WritebackPercent(t.writeback_percent),
                Knob::WritebackDelaySecs(t.writeback_delay_secs),
            ] {
                k.validate().map_err(|e| e.to_string())?;
            }
            t
        };
        let stale = match r.u8() {
            None => StaleCopies::None,
            Some(c) => StaleCopies::from_code(c).ok_or(format!("unknown stale-copies code {c}"))?,
        };
        // Both or neither: a header ends after the stale byte (written before these fields
        // existed) or holds both.
        let (dirty_bytes, owner_host) = if r.remaining() == 0 {
            (None, String::new())
        } else {
            let d = r.u64().ok_or_else(short)?;
            let l = r.fixed_str(LABEL_BYTES).ok_or_else(short)?;
            ((d != DIRTY_UNKNOWN).then_some(d), l)
        };
        if data_offset != BACKING_DATA_OFFSET
            || data_size % 512 != 0
            || data_offset.checked_add(data_size).is_none()
        {
            return Err(format!("bad data offset {data_offset} or size {data_size}"));
        }
        Ok(BackingHeader {
            seq,
            dev_uuid,
            set_uuid,
            data_offset,
            data_size,
            mode,
            state,
            label,
            tunables,
            stale,
            dirty_bytes,
            owner_host,
        })
    }

    /// Reads both copies and returns the valid one with the highest sequence.
    pub fn read(dev: &dyn BlockDevice) -> Result<(BackingHeader, Vec<String>)> {
        if dev.size_bytes() < BACKING_DATA_OFFSET + 4096 {
            return Err(Error::Invalid(format!(
                "backing device of {} bytes is too small (needs {} bytes of header plus data)",
                dev.size_bytes(),
                BACKING_DATA_OFFSET
            )));
        }
        let mut best: Option<BackingHeader> = None;
        let mut notes = Vec::new();
        let mut magic_seen = false;
        let mut buf = vec![0u8; META_BLOCK as usize];
        for (i, off) in BACKING_HEADER_OFFSETS.into_iter().enumerate() {
            dev.read_at(&mut buf, off)
                .ctx(|| "reading backing header".into())?;
            magic_seen |= frame_header(BACKING_MAGIC, &buf).is_some();
            match BackingHeader::decode(&buf) {
                Ok(h) => {
                    if best.as_ref().is_none_or(|b| h.seq > b.seq) {
                        best = Some(h);
                    }
                }
                Err(e) => notes.push(format!("backing header copy {i}: {e}")),
            }
        }
        match best {
            Some(h)
                if h.data_offset
                    .checked_add(h.data_size)
                    .is_none_or(|end| end > dev.size_bytes()) =>
            {
                Err(Error::Corrupt(format!(
                    "backing header says {} data bytes but the device has {}",
                    h.data_size,
                    dev.size_bytes() - h.data_offset
                )))
            }
            Some(h) => Ok((h, notes)),
            None if !magic_seen => Err(Error::Unformatted(
                "not a tiercache backing device (no header found; format it with `tiercache make`)"
                    .into(),
            )),
            None => Err(Error::Corrupt(format!(
                "no valid tiercache backing header ({})",
                notes.join("; ")
            ))),
        }
    }

    /// Writes both copies (flushing after each) with the sequence bumped.
    pub fn write(&mut self, dev: &dyn BlockDevice) -> Result<()> {
        self.seq += 1;
        let buf = self.encode();
        for off in BACKING_HEADER_OFFSETS {
            dev.write_at(&buf, off)
                .ctx(|| "writing backing header".into())?;
            dev.flush().ctx(|| "flushing backing header".into())?;
        }
        Ok(())
    }
}

/// Looks for a signature of something a user would not want overwritten: a tiercache cache or
/// backing device, bcache, a filesystem, a partition table or LUKS. Returns its name.
pub fn detect_signature(dev: &dyn BlockDevice) -> Result<Option<&'static str>> {
    let len = dev.size_bytes().min(68 * 1024) / 512 * 512;
    let mut buf = vec![0u8; len as usize];
    dev.read_at(&mut buf, 0)
        .ctx(|| "reading device start".into())?;
    let at = |off: usize, sig: &[u8]| buf.get(off..off + sig.len()) == Some(sig);
    let checks: [(&'static str, usize, &[u8]); 10] = [
        ("tiercache cache device", SB_OFFSET as usize, SB_MAGIC),
        ("tiercache backing device", 0, BACKING_MAGIC),
        ("tiercache backing device", 4096, BACKING_MAGIC),
        (
            "bcache",
            4096 + 24,
            &[0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca],
        ),
        ("ext2/3/4 filesystem", 1080, &[0x53, 0xef]),
        ("XFS filesystem", 0, b"XFSB"),
        ("btrfs filesystem", 65600, b"_BHRfS_M"),
        ("GPT partition table", 512, b"EFI PART"),
        ("LUKS volume", 0, b"LUKS\xba\xbe"),
        ("DOS partition table / boot sector", 510, &[0x55, 0xaa]),
    ];
    Ok(checks
        .iter()
        .find(|(_, off, sig)| at(*off, sig))
        .map(|c| c.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;

    #[test]
    fn layout_fits_and_scales() {
        for size in [8u64 << 20, 64 << 20, 1 << 30, 100 << 30] {
            let l = Layout::compute(size, 4096, 512 * 1024).unwrap();
            assert!(l.nbuckets >= MIN_BUCKETS);
            let data = u64::from(l.nbuckets) * u64::from(l.bucket_size);
            // Metadata overhead stays reasonable (< 10 % for anything over 64 MiB).
            if size >= 64 << 20 {
                assert!(
                    data * 10 >= size * 9 - (2 << 20),
                    "size {size}: data {data}"
                );
            }
        }
        assert!(Layout::compute(1 << 20, 4096, 512 * 1024).is_err());
        assert!(Layout::compute(64 << 20, 3000, 512 * 1024).is_err());
        assert!(Layout::compute(64 << 20, 4096, 4096).is_err());
    }

    #[test]
    fn superblock_round_trip_and_fallback_to_second_copy() {
        let dev = MemDevice::new(32 << 20);
        let layout = Layout::compute(dev.size_bytes(), 4096, 64 * 1024).unwrap();
        let sb = Superblock {
            seq: 7,
            set_uuid: Uuid::new_v4(),
            dev_uuid: Uuid::new_v4(),
            layout,
            ckpt_slot: 1,
            ckpt_seq: 3,
            created_unix: 1,
            label: "fast".into(),
        };
        sb.write(&dev).unwrap();
        assert_eq!(Superblock::read(&dev).unwrap().0, sb);
        dev.write_at(&[0xffu8; 512], SB_OFFSET).unwrap();
        let (got, notes) = Superblock::read(&dev).unwrap();
        assert_eq!(got, sb);
        assert_eq!(notes.len(), 1);
    }

    /// Region ends that overflow a `u64` (found by fuzzing `engine_superblock`): refused, not
    /// a panic (debug) or a wrapped sum that passes the checks and lets `checkpoint::load`
    /// allocate the wrapped length (release).
    #[test]
    fn layout_with_wrapping_region_ends_is_refused() {
        let good = Layout::compute(32 << 20, 4096, 64 * 1024).unwrap();
        let mut data = good.clone();
        data.data_off = u64::MAX - 4095;
        let mut journal = good.clone();
        journal.journal_len = 0u64.wrapping_sub(round_up(journal.journal_off, 2 * META_BLOCK));
        let mut ckpt = good.clone();
        ckpt.ckpt_len = 0u64.wrapping_sub(ckpt.ckpt_offsets[1]);
        let mut sb1 = good.clone();
        sb1.sb_offsets[1] = u64::MAX - 4095;
        for bad in [data, journal, ckpt, sb1] {
            assert!(bad.validate().is_err(), "{bad:?}");
            let sb = Superblock {
                seq: 1,
                set_uuid: Uuid::nil(),
                dev_uuid: Uuid::nil(),
                layout: bad,
                ckpt_slot: 0,
                ckpt_seq: 1,
                created_unix: 0,
                label: String::new(),
            };
            assert!(Superblock::decode(&sb.encode()).is_err());
        }
    }

    /// A backing header whose data end overflows a `u64` (found by fuzzing
    /// `engine_backing_header`): refused, not a panic (debug) or a wrapped sum that passes the
    /// size check (release) and serves a device of 2^64 bytes.
    #[test]
    fn backing_header_with_wrapping_data_end_is_refused() {
        let dev = MemDevice::new(1 << 20);
        let mut h = BackingHeader {
            seq: 0,
            dev_uuid: Uuid::new_v4(),
            set_uuid: Uuid::nil(),
            data_offset: BACKING_DATA_OFFSET,
            data_size: u64::MAX - 511,
            mode: CacheMode::Writeback,
            state: BackingState::Clean,
            label: String::new(),
            tunables: Tunables::default(),
            stale: StaleCopies::None,
            dirty_bytes: None,
            owner_host: String::new(),
        };
        assert!(BackingHeader::decode(&h.encode()).is_err());
        h.write(&dev).unwrap();
        assert!(BackingHeader::read(&dev).is_err());
    }

    #[test]
    fn backing_header_round_trip() {
        let dev = MemDevice::new(1 << 20);
        let mut h = BackingHeader {
            seq: 0,
            dev_uuid: Uuid::new_v4(),
            set_uuid: Uuid::nil(),
            data_offset: BACKING_DATA_OFFSET,
            data_size: (1 << 20) - BACKING_DATA_OFFSET,
            mode: CacheMode::Writeback,
            state: BackingState::Dirty,
            label: "slow".into(),
            tunables: Tunables {
                sequential_cutoff: 123 << 10,
                writeback_percent: 40,
                writeback_delay_secs: 7,
                writeback_running: false,
            },
            stale: StaleCopies::Clean,
            dirty_bytes: Some(12 << 20),
            owner_host: "host-a".into(),
        };
        h.write(&dev).unwrap();
        assert_eq!(BackingHeader::read(&dev).unwrap().0, h);
        assert_eq!(
            detect_signature(&dev).unwrap(),
            Some("tiercache backing device")
        );
    }

    /// A header written before the dirty amount and the owner's label existed (its payload
    /// ends after the stale byte) still decodes: amount unknown, no label. One that ends
    /// inside the new fields is refused.
    #[test]
    fn backing_header_without_dirty_amount_decodes() {
        let h = BackingHeader {
            seq: 3,
            dev_uuid: Uuid::new_v4(),
            set_uuid: Uuid::new_v4(),
            data_offset: BACKING_DATA_OFFSET,
            data_size: 1 << 20,
            mode: CacheMode::Writeback,
            state: BackingState::Dirty,
            label: "old".into(),
            tunables: Tunables::default(),
            stale: StaleCopies::None,
            dirty_bytes: Some(4096),
            owner_host: "a".into(),
        };
        let full = h.encode();
        let (_, payload) = unframe(BACKING_MAGIC, BACKING_VERSION, &full).unwrap();
        let old_len = payload.len() - 8 - LABEL_BYTES;
        let old = frame(BACKING_MAGIC, BACKING_VERSION, 3, &payload[..old_len]);
        let got = BackingHeader::decode(&old).unwrap();
        assert_eq!(got.dirty_bytes, None);
        assert_eq!(got.owner_host, "");
        assert_eq!(got.state, BackingState::Dirty);
        let cut = frame(BACKING_MAGIC, BACKING_VERSION, 3, &payload[..old_len + 8]);
        assert!(BackingHeader::decode(&cut).is_err());
        assert_eq!(BackingHeader::decode(&full).unwrap(), h);
    }
}
