//! Checkpoints (full snapshots of the index, bucket generations and device table) and the
//! loader that rebuilds the in-memory state from the newest checkpoint plus the journal.
//!
//! Invariants:
//! - a checkpoint is written to the slot the superblock does *not* point at, flushed, and only
//!   then does the superblock switch to it; the journal after the old checkpoint is not reused
//!   until that switch, so a crash at any point leaves a consistent (checkpoint, journal) pair;
//! - the superblock records the current checkpoint's sequence; a checkpoint whose sequence or
//!   checksum disagrees is damage, reported, never silently replaced by an older snapshot (an
//!   older snapshot plus a partly overwritten journal could serve stale data);
//! - every entry read from disk is range-checked before it touches the index.

use crate::codec::{frame, unframe, Reader, Writer};
use crate::format::{Layout, Superblock, MAX_DEVS};
use crate::index::{Extent, Index, BLOCK_LIMIT};
use crate::journal::{self, Entry, Ring};
use crate::types::{DevId, Error, IoContext, Result};
use blockdev::BlockDevice;
use std::collections::BTreeMap;
use uuid::Uuid;

pub const CKPT_MAGIC: &[u8; 8] = b"TCCKPT01";
pub const CKPT_VERSION: u32 = 1;

/// Encodes a checkpoint of the current state.
pub fn encode(
    seq: u64,
    ring: &Ring,
    devs: &BTreeMap<DevId, Uuid>,
    gens: &[u8],
    index: &Index,
) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(ring.head);
    w.u64(ring.next_seq);
    w.u32(gens.len() as u32);
    w.u32(devs.len() as u32);
    let runs = index.runs();
    w.u64(runs.len() as u64);
    for (d, u) in devs {
        w.u32(d.0);
        w.bytes(u.as_bytes());
    }
    w.bytes(gens);
    for (dev, block, e) in runs {
        w.u32(dev.0);
        w.u64(block);
        w.u32(e.len);
        w.u32(e.cache_block);
        w.u8(gens[index.bucket_of(e.cache_block) as usize]);
        w.u8(u8::from(e.dirty));
        for i in 0..e.len {
            w.u32(index.crc(e.cache_block + i));
        }
    }
    let mut image = frame(CKPT_MAGIC, CKPT_VERSION, seq, &w.buf);
    image.resize(
        crate::codec::round_up(image.len() as u64, crate::format::META_BLOCK) as usize,
        0,
    );
    image
}

/// Everything recovery rebuilds, ready to run an engine on (also used by `check`).
pub struct Loaded {
    pub sb: Superblock,
    pub index: Index,
    pub gens: Vec<u8>,
    pub devs: BTreeMap<DevId, Uuid>,
    pub ring: Ring,
    /// Non-fatal findings (a damaged superblock copy, stale entries dropped, ...).
    pub notes: Vec<String>,
    pub records_replayed: usize,
    pub entries_replayed: usize,
}

fn corrupt(m: impl Into<String>) -> Error {
    Error::Corrupt(m.into())
}

/// Checks an index entry from disk against the layout before it touches the index.
fn check_extent(
    l: &Layout,
    gens: &[u8],
    dev: DevId,
    block: u64,
    e: &Extent,
    gen: u8,
) -> Result<bool> {
    let bpb = l.blocks_per_bucket();
    let end = u64::from(e.cache_block) + u64::from(e.len);
    if e.len == 0
        || end > u64::from(l.total_blocks())
        || e.cache_block / bpb != (end as u32 - 1) / bpb
        || block
            .checked_add(u64::from(e.len))
            .is_none_or(|x| x > BLOCK_LIMIT)
        || dev.0 >= MAX_DEVS as u32
    {
        return Err(corrupt(format!(
            "index entry dev {} block {block} len {} cache block {} is out of range",
            dev.0, e.len, e.cache_block
        )));
    }
    Ok(gens[(e.cache_block / bpb) as usize] == gen)
}

/// Loads the newest state of a cache device: superblock, checkpoint, journal replay.
/// Reads the checkpoint frame in `slot`: its first block, then only as much more as its
/// header claims (checked against the slot), so RAM and I/O follow the checkpoint's size, not
/// the slot's (which is sized for a cache full of 4 KiB extents). The header's length is not
/// trusted beyond that: the frame checksum is verified over exactly the bytes read.
fn read_checkpoint_frame(cache: &dyn BlockDevice, l: &Layout, slot: u32) -> Result<Vec<u8>> {
    let at = l.ckpt_offsets[slot as usize];
    let block = crate::format::META_BLOCK;
    let mut buf = vec![0u8; block.min(l.ckpt_len) as usize];
    cache
        .read_at(&mut buf, at)
        .ctx(|| "reading checkpoint".into())?;
    let claimed = crate::codec::frame_header(CKPT_MAGIC, &buf).map(|h| {
        h.payload_len
            .saturating_add(crate::codec::FRAME_HEADER_BYTES as u64)
    });
    let want = match claimed {
        Some(total) if total <= l.ckpt_len => crate::codec::round_up(total, block).min(l.ckpt_len),
        // Absent or impossible: unframe reports why from what was read.
        _ => return Ok(buf),
    };
    if want > buf.len() as u64 {
        let first = buf.len();
        buf.resize(want as usize, 0);
        cache
            .read_at(&mut buf[first..], at + first as u64)
            .ctx(|| "reading checkpoint".into())?;
    }
    Ok(buf)
}

pub fn load(cache: &dyn BlockDevice) -> Result<Loaded> {
    let (sb, mut notes) = Superblock::read(cache)?;
    let l = sb.layout.clone();
    let buf = read_checkpoint_frame(cache, &l, sb.ckpt_slot)?;
    let (seq, payload) = unframe(CKPT_MAGIC, CKPT_VERSION, &buf).map_err(|e| {
        corrupt(format!(
            "checkpoint {} in slot {}: {e}",
            sb.ckpt_seq, sb.ckpt_slot
        ))
    })?;
    if seq != sb.ckpt_seq {
        return Err(corrupt(format!(
            "checkpoint slot {} holds sequence {seq}, superblock expects {}",
            sb.ckpt_slot, sb.ckpt_seq
        )));
    }
    let mut r = Reader::new(payload);
    let short = || corrupt("checkpoint payload truncated");
    let jpos = r.u64().ok_or_else(short)?;
    let jseq = r.u64().ok_or_else(short)?;
    let nbuckets = r.u32().ok_or_else(short)?;
    let ndevs = r.u32().ok_or_else(short)?;
    let nentries = r.u64().ok_or_else(short)?;
    if nbuckets != l.nbuckets || ndevs as usize > MAX_DEVS || nentries > u64::from(l.total_blocks())
    {
        return Err(corrupt("checkpoint counts disagree with the superblock"));
    }
    let mut devs = BTreeMap::new();
    for _ in 0..ndevs {
        let d = DevId(r.u32().ok_or_else(short)?);
        devs.insert(d, Uuid::from_bytes(r.array().ok_or_else(short)?));
    }
    let mut gens = r.take(nbuckets as usize).ok_or_else(short)?.to_vec();
    let mut index = Index::new(l.nbuckets, l.blocks_per_bucket());
    let mut stale = 0u64;
    for _ in 0..nentries {
        let dev = DevId(r.u32().ok_or_else(short)?);
        let block = r.u64().ok_or_else(short)?;
        let len = r.u32().ok_or_else(short)?;
        let cache_block = r.u32().ok_or_else(short)?;
        let gen = r.u8().ok_or_else(short)?;
        let dirty = r.u8().ok_or_else(short)? == 1;
        let e = Extent {
            len,
            cache_block,
            dirty,
        };
        let fresh = check_extent(&l, &gens, dev, block, &e, gen)?;
        let crcs = (0..len)
            .map(|_| r.u32())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(short)?;
        if !devs.contains_key(&dev) {
            return Err(corrupt(format!(
                "checkpoint entry for unknown device {}",
                dev.0
            )));
        }
        if fresh {
            index.insert_replayed(dev, block, e, &crcs);
        } else {
            stale += 1;
        }
    }
    if stale > 0 {
        notes.push(format!(
            "{stale} checkpoint entries with stale generations dropped"
        ));
    }
    let mut region = vec![0u8; l.journal_len as usize];
    cache
        .read_at(&mut region, l.journal_off)
        .ctx(|| "reading journal".into())?;
    let replay = journal::replay(&region, &sb.set_uuid, jpos, jseq)?;
    let records_replayed = replay.records.len();
    let mut entries_replayed = 0;
    for (rseq, entries) in replay.records {
        for entry in entries {
            entries_replayed += 1;
            apply(&l, &mut index, &mut gens, &mut devs, entry)
                .map_err(|e| corrupt(format!("journal record {rseq}: {e}")))?;
        }
    }
    Ok(Loaded {
        sb,
        index,
        gens,
        devs,
        ring: replay.ring,
        notes,
        records_replayed,
        entries_replayed,
    })
}

/// Applies one journal entry during replay (the same effect the live engine had).
fn apply(
    l: &Layout,
    index: &mut Index,
    gens: &mut [u8],
    devs: &mut BTreeMap<DevId, Uuid>,
    entry: Entry,
) -> Result<()> {
    let known = |devs: &BTreeMap<DevId, Uuid>, d: DevId| {
        if devs.contains_key(&d) {
            Ok(())
        } else {
            Err(corrupt(format!("entry for unknown device {}", d.0)))
        }
    };
    match entry {
        Entry::Insert {
            dev,
            block,
            len,
            cache_block,
            gen,
            dirty,
            crcs,
        } => {
            known(devs, dev)?;
            let e = Extent {
                len,
                cache_block,
                dirty,
            };
            if check_extent(l, gens, dev, block, &e, gen)? {
                index.insert_replayed(dev, block, e, &crcs);
            }
        }
        Entry::Invalidate { dev, block, len } => {
            known(devs, dev)?;
            index.remove_range(dev, block, block.saturating_add(len).min(BLOCK_LIMIT));
        }
        Entry::MarkClean {
            dev,
            block,
            len,
            cache_block,
        } => {
            known(devs, dev)?;
            if block
                .checked_add(u64::from(len))
                .is_none_or(|e| e > BLOCK_LIMIT)
            {
                return Err(corrupt("mark-clean range out of bounds"));
            }
            index.mark_clean(dev, block, len, cache_block);
        }
        Entry::BucketGen { bucket, gen } => {
            let slot = gens
                .get_mut(bucket as usize)
                .ok_or_else(|| corrupt(format!("bucket {bucket} out of range")))?;
            index.drop_bucket(bucket);
            *slot = gen;
        }
        Entry::AttachDev { dev, uuid } => {
            if dev.0 >= MAX_DEVS as u32 {
                return Err(corrupt("device id out of range"));
            }
            devs.insert(dev, uuid);
        }
        Entry::DetachDev { dev } => {
            known(devs, dev)?;
            index.remove_range(dev, 0, BLOCK_LIMIT);
            devs.remove(&dev);
        }
    }
    Ok(())
}
