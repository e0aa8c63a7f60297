//! Checkpoints (format 2) and the loader that rebuilds the in-memory state from the newest
//! checkpoint plus the journal.
//!
//! A checkpoint slot holds a header frame (journal start, device table, one generation byte
//! per bucket, how many body chunks follow) and then body chunks: frames of up to about
//! `CKPT_CHUNK_BYTES`, each listing live buckets with their generation and, per cached block,
//! its offset, backing block, crc and dirty bit. Only live buckets appear, so a checkpoint's
//! size, and what recovery reads, follows what is cached, not the size of the cache.
//!
//! Invariants:
//! - a checkpoint is written to the slot the superblock does *not* point at, flushed, and only
//!   then does the superblock switch to it; the journal after the old checkpoint's start is not
//!   reused until that switch, so a crash at any point leaves a consistent (checkpoint,
//!   journal) pair;
//! - a checkpoint may be *fuzzy*: its chunks are encoded one at a time while requests go on,
//!   so each bucket is as of its own moment. It names the journal position from before the
//!   first chunk was encoded, and every entry appended up to the last chunk is durable in the
//!   journal before the superblock switches. Replay applies each of those entries again over
//!   the snapshot; every entry sets what it touches (a mapping, a generation, a dirty bit)
//!   rather than depending on what was there, except `MarkClean`, which applies only where the
//!   mapping it names still holds, and the generation check, which drops inserts into a bucket
//!   that was since reused (the header's generations are from the checkpoint's end). A dropped
//!   insert still unmaps its backing blocks, as the engine did when it made it: a chunk encoded
//!   before it may hold the mapping it replaced, and nothing later in the journal would remove
//!   that one (a mapping in a chunk that was made after it is made again by its own later
//!   entry). So replay reaches the same state whichever moment each bucket was encoded at (the
//!   crash test checks this at every I/O);
//! - the superblock records the current checkpoint's sequence; a checkpoint whose sequence or
//!   checksum (header or any chunk) disagrees is damage, reported, never silently replaced by an
//!   older snapshot;
//! - loading holds one chunk in memory at a time, and every record read from disk is
//!   range-checked before it touches the index.

use crate::codec::{frame, round_up, unframe, Reader, Writer, FRAME_HEADER_BYTES};
use crate::format::{Layout, Superblock, CKPT_CHUNK_BYTES, CKPT_FIXED_BYTES, MAX_DEVS, META_BLOCK};
use crate::index::{Extent, Index, BLOCK_END, BLOCK_LIMIT};
use crate::journal::{self, Entry, Ring};
use crate::types::{DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock, Gen};
use blockdev::BlockDevice;
use std::collections::BTreeMap;
use uuid::Uuid;

pub const CKPT_MAGIC: &[u8; 8] = b"TCCKPT02";
pub const CHUNK_MAGIC: &[u8; 8] = b"TCCKBODY";
pub const CKPT_VERSION: u32 = 2;

/// What a checkpoint header says.
pub struct Header<'a> {
    /// Journal position and sequence replay starts from.
    pub journal_pos: u64,
    pub journal_seq: u64,
    pub devs: &'a BTreeMap<DevId, Uuid>,
    pub gens: &'a [Gen],
    pub chunks: u64,
    pub body_bytes: u64,
}

/// Encodes the header frame, padded to whole 4 KiB blocks.
pub fn encode_header(seq: u64, h: &Header<'_>) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(h.journal_pos);
    w.u64(h.journal_seq);
    w.u32(h.gens.len() as u32);
    w.u32(h.devs.len() as u32);
    w.u64(h.chunks);
    w.u64(h.body_bytes);
    for (d, u) in h.devs {
        w.u32(d.get());
        w.bytes(u.as_bytes());
    }
    w.buf.extend(h.gens.iter().map(|g| g.get()));
    debug_assert!(w.buf.len() as u64 <= CKPT_FIXED_BYTES + h.gens.len() as u64);
    padded(frame(CKPT_MAGIC, CKPT_VERSION, seq, &w.buf))
}

fn padded(mut v: Vec<u8>) -> Vec<u8> {
    v.resize(round_up(v.len() as u64, META_BLOCK) as usize, 0);
    v
}

/// Builds one body chunk bucket by bucket (the caller may release the state lock between
/// buckets: a checkpoint is fuzzy per bucket, see the module invariants).
#[derive(Default)]
pub struct ChunkEncoder {
    w: Writer,
}

impl ChunkEncoder {
    /// Adds the next live bucket from `*cursor` on and moves the cursor past it; `false` when
    /// no live bucket is left.
    pub fn add_next(&mut self, index: &Index, gens: &[Gen], cursor: &mut Bucket) -> bool {
        let Some(b) = index.next_live_bucket(*cursor) else {
            return false;
        };
        let w = &mut self.w;
        w.u32(b.get());
        w.u8(gens[b.idx()].get());
        w.u32(index.bucket_live[b.idx()]);
        for (offset, dev, block, crc, dirty) in index.bucket_blocks(b) {
            w.u32(offset);
            w.u8(dev.get() as u8);
            w.bytes(&block.get().to_le_bytes()[..5]);
            w.u32(crc);
            w.u8(u8::from(dirty));
        }
        *cursor = b + 1;
        true
    }

    /// Whether the chunk has reached `CKPT_CHUNK_BYTES` and should be written.
    pub fn full(&self) -> bool {
        self.w.buf.len() as u64 >= CKPT_CHUNK_BYTES
    }

    pub fn is_empty(&self) -> bool {
        self.w.buf.is_empty()
    }

    /// The framed, padded chunk of checkpoint `seq`; the encoder starts over empty.
    pub fn finish(&mut self, seq: u64) -> Vec<u8> {
        let payload = std::mem::take(&mut self.w.buf);
        padded(frame(CHUNK_MAGIC, CKPT_VERSION, seq, &payload))
    }
}

/// Everything recovery rebuilds, ready to run an engine on (also used by `check`).
pub struct Loaded {
    pub sb: Superblock,
    pub index: Index,
    pub gens: Vec<Gen>,
    pub devs: BTreeMap<DevId, Uuid>,
    pub ring: Ring,
    /// Non-fatal findings (a damaged superblock copy, stale entries dropped, ...).
    pub notes: Vec<String>,
    pub records_replayed: usize,
    pub entries_replayed: usize,
    /// A last journal record dropped for missing data (erase both copies before committing).
    pub dropped_record: Option<journal::Dropped>,
}

fn corrupt(m: impl Into<String>) -> Error {
    Error::Corrupt(m.into())
}

/// Checks a journal insert against the layout before it touches the index; `Ok(false)` if
/// its generation is stale (the bucket was reused after it).
fn check_extent(
    l: &Layout,
    gens: &[Gen],
    dev: DevId,
    block: BackingBlock,
    e: &Extent,
    gen: Gen,
) -> Result<bool> {
    let bpb = l.blocks_per_bucket();
    let end = u64::from(e.cache_block.get()) + u64::from(e.len);
    if e.len == 0
        || end > u64::from(l.total_blocks())
        || e.cache_block.bucket(bpb) != CacheBlock::new(end as u32 - 1).bucket(bpb)
        || block
            .get()
            .checked_add(u64::from(e.len))
            .is_none_or(|x| x > BLOCK_LIMIT)
        || dev.get() >= MAX_DEVS as u32
    {
        return Err(corrupt(format!(
            "index entry dev {} block {block} len {} cache block {} is out of range",
            dev, e.len, e.cache_block
        )));
    }
    Ok(gens[e.cache_block.bucket(bpb).idx()] == gen)
}

/// Reads the frame at `at`: its first block, then only as much more as its header claims
/// (at most `limit` bytes in all), so RAM and I/O follow the frame's size. The claimed length
/// is not trusted beyond that: the frame checksum is verified over exactly the bytes read.
fn read_frame(cache: &dyn BlockDevice, magic: &[u8; 8], at: u64, limit: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; META_BLOCK.min(limit) as usize];
    cache
        .read_at(&mut buf, at)
        .ctx(|| "reading checkpoint".into())?;
    let claimed = crate::codec::frame_header(magic, &buf)
        .map(|h| h.payload_len.saturating_add(FRAME_HEADER_BYTES as u64));
    let want = match claimed {
        Some(total) if total <= limit => round_up(total, META_BLOCK).min(limit),
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

/// Loads the newest state of a cache device: superblock, checkpoint, journal replay. Data of
/// the journal's last record is read back and checked (see `journal::replay`).
pub fn load(cache: &dyn BlockDevice) -> Result<Loaded> {
    let (sb, notes) = Superblock::read(cache)?;
    let l = sb.layout.clone();
    let slot_at = l.ckpt_offsets[sb.ckpt_slot as usize];
    let header_len = Layout::ckpt_header_len(l.nbuckets);
    let where_ = || format!("checkpoint {} in slot {}", sb.ckpt_seq, sb.ckpt_slot);
    let buf = read_frame(cache, CKPT_MAGIC, slot_at, header_len)?;
    let (seq, payload) = unframe(CKPT_MAGIC, CKPT_VERSION, &buf)
        .map_err(|e| corrupt(format!("{}: {e}", where_())))?;
    if seq != sb.ckpt_seq {
        return Err(corrupt(format!(
            "checkpoint slot {} holds sequence {seq}, superblock expects {}",
            sb.ckpt_slot, sb.ckpt_seq
        )));
    }
    let mut r = Reader::new(payload);
    let short = || corrupt("checkpoint header truncated");
    let jpos = r.u64().ok_or_else(short)?;
    let jseq = r.u64().ok_or_else(short)?;
    let nbuckets = r.u32().ok_or_else(short)?;
    let ndevs = r.u32().ok_or_else(short)?;
    let chunks = r.u64().ok_or_else(short)?;
    let body_bytes = r.u64().ok_or_else(short)?;
    if nbuckets != l.nbuckets
        || ndevs as usize > MAX_DEVS
        || body_bytes > l.ckpt_len - header_len
        || chunks > body_bytes / META_BLOCK
    {
        return Err(corrupt("checkpoint counts disagree with the superblock"));
    }
    let mut devs = BTreeMap::new();
    for _ in 0..ndevs {
        let d = DevId::new(r.u32().ok_or_else(short)?);
        if d.get() >= MAX_DEVS as u32 {
            return Err(corrupt(format!(
                "{}: device id {} out of range",
                where_(),
                d
            )));
        }
        devs.insert(d, Uuid::from_bytes(r.array().ok_or_else(short)?));
    }
    let mut gens: Vec<Gen> = (r.take(nbuckets as usize).ok_or_else(short)?.iter())
        .map(|&g| Gen::new(g))
        .collect();
    drop(buf);
    let mut index = Index::new(l.nbuckets, l.blocks_per_bucket());
    let mut at = slot_at + header_len;
    let body_end = at + body_bytes;
    for i in 0..chunks {
        let buf = read_frame(cache, CHUNK_MAGIC, at, body_end - at)?;
        let (cseq, payload) = unframe(CHUNK_MAGIC, CKPT_VERSION, &buf)
            .map_err(|e| corrupt(format!("{} chunk {i}: {e}", where_())))?;
        if cseq != sb.ckpt_seq {
            return Err(corrupt(format!(
                "{} chunk {i} belongs to checkpoint {cseq}",
                where_()
            )));
        }
        load_chunk(&l, payload, &devs, &mut gens, &mut index)
            .map_err(|e| corrupt(format!("{} chunk {i}: {e}", where_())))?;
        at += buf.len() as u64;
    }
    if at != body_end {
        return Err(corrupt(format!(
            "{}: its chunks end at {} of {body_bytes} body bytes",
            where_(),
            at - (slot_at + header_len)
        )));
    }
    // Read in pieces: a device that needs aligned buffers bounces each read through a copy
    // of its size, which for the whole region would double the peak.
    let mut region = vec![0u8; l.journal_len as usize];
    for (i, piece) in region.chunks_mut(4 << 20).enumerate() {
        cache
            .read_at(piece, l.journal_off + (i as u64) * (4 << 20))
            .ctx(|| "reading journal".into())?;
    }
    let mut check_data = |entries: &[Entry]| last_record_data_ok(cache, &l, entries);
    let replay = journal::replay(&region, &sb.set_uuid, jpos, jseq, &mut check_data)?;
    drop(region);
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
        dropped_record: replay.dropped_last,
    })
}

/// Applies one body chunk: live buckets with their generation and blocks.
pub(crate) fn load_chunk(
    l: &Layout,
    payload: &[u8],
    devs: &BTreeMap<DevId, Uuid>,
    gens: &mut [Gen],
    index: &mut Index,
) -> Result<(), String> {
    let bpb = l.blocks_per_bucket();
    let mut r = Reader::new(payload);
    let short = || "truncated".to_string();
    while r.remaining() > 0 {
        let bucket = Bucket::new(r.u32().ok_or_else(short)?);
        let gen = Gen::new(r.u8().ok_or_else(short)?);
        let count = r.u32().ok_or_else(short)?;
        if bucket.get() >= l.nbuckets || count == 0 || count > bpb {
            return Err(format!(
                "bucket {bucket} with {count} blocks is out of range"
            ));
        }
        // A bucket encoded after its generation changed carries the newer one (the header's
        // generations are from the end of the checkpoint; replay settles the rest).
        gens[bucket.idx()] = gen;
        for _ in 0..count {
            let offset = r.u32().ok_or_else(short)?;
            let dev = DevId::new(u32::from(r.u8().ok_or_else(short)?));
            let mut b = [0u8; 8];
            b[..5].copy_from_slice(r.take(5).ok_or_else(short)?);
            let block = BackingBlock::new(u64::from_le_bytes(b));
            let crc = r.u32().ok_or_else(short)?;
            let dirty = match r.u8().ok_or_else(short)? {
                0 => false,
                1 => true,
                x => return Err(format!("dirty flag {x}")),
            };
            if offset >= bpb || block >= BLOCK_END || !devs.contains_key(&dev) {
                return Err(format!(
                    "block record (offset {offset}, device {}, block {block}) is out of range",
                    dev
                ));
            }
            let e = Extent {
                len: 1,
                cache_block: CacheBlock::first_of(bucket, bpb) + offset,
                dirty,
            };
            index.insert_replayed(dev, block, e, &[crc]);
        }
    }
    Ok(())
}

/// Whether the data every insert of the journal's last record points to is on the cache
/// device (a commit writes its record and flushes once, so after a crash the last record may
/// be there while data it points to is not; then that commit never returned and the whole
/// record is dropped, exactly like a torn record). An insert into a bucket that a later entry
/// of the same record retires (`BucketGen`) is not checked: once the record was durable the
/// bucket could be reused and its blocks rewritten, and the insert is void on replay anyway.
/// Reads one block at a time.
fn last_record_data_ok(cache: &dyn BlockDevice, l: &Layout, entries: &[Entry]) -> Result<bool> {
    let bpb = l.blocks_per_bucket();
    // The last `BucketGen` of each bucket in the record.
    let retired: std::collections::HashMap<Bucket, usize> = entries
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Entry::BucketGen { bucket, .. } => Some((*bucket, i)),
            _ => None,
        })
        .collect();
    let mut buf = vec![0u8; l.block_size as usize];
    for (i, e) in entries.iter().enumerate() {
        let Entry::Insert {
            cache_block, crcs, ..
        } = e
        else {
            continue;
        };
        if retired
            .get(&cache_block.bucket(bpb))
            .is_some_and(|&at| at > i)
        {
            continue;
        }
        for (k, &want) in crcs.iter().enumerate() {
            // In `u64`: a damaged entry's block number plus `k` may not fit a `u32`.
            if u64::from(cache_block.get()) + k as u64 >= u64::from(l.total_blocks()) {
                return Ok(false);
            }
            let cb = *cache_block + k as u32;
            cache
                .read_at(&mut buf, l.cache_block_offset(cb))
                .ctx(|| "reading data of the last journal record".into())?;
            if crc32c::crc32c(&buf) != want {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Applies one journal entry during replay (the same effect the live engine had).
fn apply(
    l: &Layout,
    index: &mut Index,
    gens: &mut [Gen],
    devs: &mut BTreeMap<DevId, Uuid>,
    entry: Entry,
) -> Result<()> {
    let known = |devs: &BTreeMap<DevId, Uuid>, d: DevId| {
        if devs.contains_key(&d) {
            Ok(())
        } else {
            Err(corrupt(format!("entry for unknown device {d}")))
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
            } else {
                // Stale: its bucket was retired later, so it maps nothing now. But when the
                // engine made it, it also replaced whatever mapped these blocks before, and a
                // checkpoint chunk written before it may still hold that older mapping.
                index.remove_range(dev, block, block + u64::from(len));
            }
        }
        Entry::Invalidate { dev, block, len } => {
            known(devs, dev)?;
            let end = BackingBlock::new(block.get().saturating_add(len)).min(BLOCK_END);
            index.remove_range(dev, block, end);
        }
        Entry::MarkClean {
            dev,
            block,
            len,
            cache_block,
        } => {
            known(devs, dev)?;
            if block
                .get()
                .checked_add(u64::from(len))
                .is_none_or(|e| e > BLOCK_LIMIT)
                || u64::from(cache_block.get()) + u64::from(len) > u64::from(l.total_blocks())
            {
                return Err(corrupt("mark-clean range out of bounds"));
            }
            index.mark_clean(dev, block, len, cache_block);
        }
        Entry::BucketGen { bucket, gen } => {
            let slot = gens
                .get_mut(bucket.idx())
                .ok_or_else(|| corrupt(format!("bucket {bucket} out of range")))?;
            index.drop_bucket(bucket);
            *slot = gen;
        }
        Entry::AttachDev { dev, uuid } => {
            if dev.get() >= MAX_DEVS as u32 {
                return Err(corrupt("device id out of range"));
            }
            devs.insert(dev, uuid);
        }
        Entry::DetachDev { dev } => {
            known(devs, dev)?;
            index.remove_range(dev, BackingBlock::new(0), BLOCK_END);
            devs.remove(&dev);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes of a checkpoint's generations and of one body bucket, written out by hand:
    /// buckets, cache blocks, generations and backing blocks must keep this encoding.
    #[test]
    fn header_gens_and_body_bytes_are_the_format() {
        let gens = [Gen::new(0), Gen::new(9), Gen::new(255), Gen::new(0)];
        let devs = BTreeMap::from([(DevId::new(1), Uuid::from_bytes([0x11; 16]))]);
        let header = encode_header(
            3,
            &Header {
                journal_pos: 4096,
                journal_seq: 5,
                devs: &devs,
                gens: &gens,
                chunks: 1,
                body_bytes: 4096,
            },
        );
        let (_, payload) = unframe(CKPT_MAGIC, CKPT_VERSION, &header).unwrap();
        let mut want = Vec::new();
        for v in [4096u64, 5] {
            want.extend(v.to_le_bytes());
        }
        want.extend(4u32.to_le_bytes());
        want.extend(1u32.to_le_bytes());
        for v in [1u64, 4096] {
            want.extend(v.to_le_bytes());
        }
        want.extend(1u32.to_le_bytes());
        want.extend([0x11; 16]);
        want.extend([0, 9, 255, 0]);
        assert_eq!(payload, &want[..]);

        // Bucket 1 (of 4 blocks) holds block 0x01_0203_0405 of device 1 at its block 1.
        let mut index = Index::new(4, 4);
        let e = Extent {
            len: 1,
            cache_block: CacheBlock::new(5),
            dirty: true,
        };
        index.insert(
            DevId::new(1),
            BackingBlock::new(0x01_0203_0405),
            e,
            &[0xdead_beef],
        );
        let mut enc = ChunkEncoder::default();
        let mut cursor = Bucket::new(0);
        assert!(enc.add_next(&index, &gens, &mut cursor));
        assert_eq!(cursor, Bucket::new(2));
        assert!(!enc.add_next(&index, &gens, &mut cursor));
        let chunk = enc.finish(3);
        let (_, payload) = unframe(CHUNK_MAGIC, CKPT_VERSION, &chunk).unwrap();
        #[rustfmt::skip]
        let want: [u8; 24] = [
            1, 0, 0, 0, 9, 1, 0, 0, 0, // bucket 1, generation 9, 1 block
            1, 0, 0, 0, 1, 0x05, 0x04, 0x03, 0x02, 0x01, // offset 1, device 1, block
            0xef, 0xbe, 0xad, 0xde, 1, // crc, dirty
        ];
        assert_eq!(payload, &want[..]);
    }
}
