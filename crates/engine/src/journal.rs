//! The journal: index changes as typed entries, grouped into checksummed records written to a
//! ring on the cache device, and the replay that rebuilds them after a restart or a crash.
//!
//! Invariants:
//! - records carry consecutive sequence numbers; a record is written at the ring head, or at
//!   the ring start when it does not fit before the end (the reader tries the same two places);
//! - every record is stored as two identical copies side by side — copy 0 at the record's
//!   position, copy 1 right after it — written by one write and made durable by the commit's
//!   one flush of the cache device; that flush also makes durable the data every `Insert` of
//!   the record points to (written before the entry was appended), so at most the last record
//!   can be on the device while data it points to is not (recovery checks it, see `replay`);
//! - commits are serialized and each returns only after its flush, so every record but the
//!   last was followed by a completed flush before the next one was written: at most the last
//!   record can be torn by a crash;
//! - ring space between the checkpoint's start position and the head is never overwritten
//!   (`Ring::reserve` refuses, and the caller writes a checkpoint instead);
//! - replay stops at the first record found in neither copy; if any valid record with a later
//!   sequence exists elsewhere in the ring, that was corruption in the middle of the journal,
//!   not a torn tail, and replay reports damage instead of silently losing entries.
//!
//! Why two copies, and why side by side (the durability argument). With one copy, damage to
//! the newest record would look exactly like a torn final write, and its entries — acknowledged
//! by a completed flush — would be dropped silently. With two:
//! - after the commit's flush completed, damage to either copy (a flipped bit, an unreadable
//!   sector) leaves the other whole: each copy is whole 4 KiB blocks, so the two share no
//!   sector, and the reader finds copy 1 without trusting anything in copy 0 (below);
//! - a crash during the write may leave any subset of its sectors (`docs/format.md`, media
//!   assumptions): a copy that reads back valid is the whole record as it was meant to be, and
//!   the last record's data check decides whether it stays; if neither copy is valid the
//!   commit never returned (its flush had not completed), so dropping it is allowed;
//! - one flush covers both copies, as it did when they were two writes: the record was never
//!   durable in one copy before the other.
//!
//! What side by side gives up against copies in two halves of the region (the layout before
//! journal records version 2, two writes per commit): damage that spans both copies of one
//! record at once — a run of bad sectors across the boundary, a misdirected write over the
//! range — is no longer survived. On flash the copies of either layout were written together
//! and the device places them by its own mapping, so only such address-range damage tells the
//! layouts apart; the second write was about a quarter of a commit's device time under W4's
//! sync writes (`docs/decisions.md`).
//!
//! Finding copy 1 when copy 0 is damaged: every 4 KiB block after the record's position is
//! probed for a valid copy with the expected sequence whose own size puts it exactly one copy
//! after the position. A valid copy of a given sequence belongs to one record only: recovery
//! either replays a record it finds (the next one gets the next sequence) or drops it and
//! erases both copies before its sequence is written again; so a valid copy with the expected
//! sequence at that distance is that record's copy 1.

use crate::codec::{frame, frame_header, round_up, unframe, Reader, Writer, FRAME_HEADER_BYTES};
use crate::format::META_BLOCK;
use crate::types::{DevId, Error, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock, Gen};
use uuid::Uuid;

/// Pending journal bytes after which a writer commits at once.
pub const JOURNAL_BUF_MAX: usize = 256 * 1024;

pub const JOURNAL_MAGIC: &[u8; 8] = b"TCJRNL01";
/// Version 2: the two copies side by side. Version 1 (an earlier build of format 2) put them
/// in two halves of the region; its records are refused by name (see `replay`).
pub const JOURNAL_VERSION: u32 = 2;
const JOURNAL_VERSION_HALVES: u32 = 1;

/// One change to the index or the device table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Map `len` backing blocks from `block` to cache blocks from `cache_block`.
    Insert {
        dev: DevId,
        block: BackingBlock,
        len: u32,
        cache_block: CacheBlock,
        gen: Gen,
        dirty: bool,
        crcs: Vec<u32>,
    },
    /// Forget whatever the cache holds for the range.
    Invalidate {
        dev: DevId,
        block: BackingBlock,
        len: u64,
    },
    /// The range, where it still maps to the given cache blocks, has been written back.
    MarkClean {
        dev: DevId,
        block: BackingBlock,
        len: u32,
        cache_block: CacheBlock,
    },
    /// A bucket was emptied and its generation set to `gen`.
    BucketGen { bucket: Bucket, gen: Gen },
    /// A backing device joined the set.
    AttachDev { dev: DevId, uuid: Uuid },
    /// A backing device left the set (its entries are gone).
    DetachDev { dev: DevId },
}

const TAG_INSERT: u8 = 1;
const TAG_INVALIDATE: u8 = 2;
const TAG_MARK_CLEAN: u8 = 3;
const TAG_BUCKET_GEN: u8 = 4;
const TAG_ATTACH: u8 = 5;
const TAG_DETACH: u8 = 6;

impl Entry {
    pub fn encode(&self, w: &mut Writer) {
        match self {
            Entry::Insert {
                dev,
                block,
                len,
                cache_block,
                gen,
                dirty,
                crcs,
            } => {
                assert_eq!(crcs.len(), *len as usize, "one checksum per block");
                w.u8(TAG_INSERT);
                w.u32(dev.get());
                w.u64(block.get());
                w.u32(*len);
                w.u32(cache_block.get());
                w.u8(gen.get());
                w.u8(u8::from(*dirty));
                for c in crcs {
                    w.u32(*c);
                }
            }
            Entry::Invalidate { dev, block, len } => {
                w.u8(TAG_INVALIDATE);
                w.u32(dev.get());
                w.u64(block.get());
                w.u64(*len);
            }
            Entry::MarkClean {
                dev,
                block,
                len,
                cache_block,
            } => {
                w.u8(TAG_MARK_CLEAN);
                w.u32(dev.get());
                w.u64(block.get());
                w.u32(*len);
                w.u32(cache_block.get());
            }
            Entry::BucketGen { bucket, gen } => {
                w.u8(TAG_BUCKET_GEN);
                w.u32(bucket.get());
                w.u8(gen.get());
            }
            Entry::AttachDev { dev, uuid } => {
                w.u8(TAG_ATTACH);
                w.u32(dev.get());
                w.bytes(uuid.as_bytes());
            }
            Entry::DetachDev { dev } => {
                w.u8(TAG_DETACH);
                w.u32(dev.get());
            }
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<Entry> {
        Some(match r.u8()? {
            TAG_INSERT => {
                let dev = DevId::new(r.u32()?);
                let block = BackingBlock::new(r.u64()?);
                let len = r.u32()?;
                let cache_block = CacheBlock::new(r.u32()?);
                let gen = Gen::new(r.u8()?);
                let dirty = match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return None,
                };
                if len == 0 || len as usize > r.remaining() / 4 {
                    return None;
                }
                let crcs = (0..len).map(|_| r.u32()).collect::<Option<Vec<_>>>()?;
                Entry::Insert {
                    dev,
                    block,
                    len,
                    cache_block,
                    gen,
                    dirty,
                    crcs,
                }
            }
            TAG_INVALIDATE => Entry::Invalidate {
                dev: DevId::new(r.u32()?),
                block: BackingBlock::new(r.u64()?),
                len: r.u64()?,
            },
            TAG_MARK_CLEAN => Entry::MarkClean {
                dev: DevId::new(r.u32()?),
                block: BackingBlock::new(r.u64()?),
                len: r.u32()?,
                cache_block: CacheBlock::new(r.u32()?),
            },
            TAG_BUCKET_GEN => Entry::BucketGen {
                bucket: Bucket::new(r.u32()?),
                gen: Gen::new(r.u8()?),
            },
            TAG_ATTACH => Entry::AttachDev {
                dev: DevId::new(r.u32()?),
                uuid: Uuid::from_bytes(r.array()?),
            },
            TAG_DETACH => Entry::DetachDev {
                dev: DevId::new(r.u32()?),
            },
            _ => return None,
        })
    }
}

/// Encodes a record holding already-encoded entries as it goes on the device: one copy padded
/// to whole 4 KiB blocks (`record_len`), then the same copy again. The payload starts with the
/// cache set's uuid, so records left by an earlier format of the same device are never mistaken
/// for ours.
pub fn encode_record(seq: u64, set_uuid: &Uuid, entries: &[u8]) -> Vec<u8> {
    let len = record_len(entries.len()) as usize;
    let mut payload = Vec::with_capacity(16 + entries.len());
    payload.extend_from_slice(set_uuid.as_bytes());
    payload.extend_from_slice(entries);
    let mut rec = frame(JOURNAL_MAGIC, JOURNAL_VERSION, seq, &payload);
    assert!(rec.len() <= len, "a record outgrew its reserved size");
    rec.reserve_exact(2 * len - rec.len());
    rec.resize(len, 0);
    rec.extend_from_within(..len);
    rec
}

/// The size of one copy of the record `encode_record` makes of `entries_len` bytes of entries.
pub fn record_len(entries_len: usize) -> u64 {
    round_up((FRAME_HEADER_BYTES + 16 + entries_len) as u64, META_BLOCK)
}

/// The ring space such a record takes: both copies (reserved before the record is encoded).
pub fn record_space(entries_len: usize) -> u64 {
    2 * record_len(entries_len)
}

/// Decodes the entries of a record payload; `None` if any entry is malformed.
pub fn decode_entries(payload: &[u8]) -> Option<Vec<Entry>> {
    let mut r = Reader::new(payload);
    let mut out = Vec::new();
    while r.remaining() > 0 {
        out.push(Entry::decode(&mut r)?);
    }
    Some(out)
}

/// Position bookkeeping of the ring (relative byte offsets inside the journal region).
#[derive(Clone, Debug)]
pub struct Ring {
    /// The whole journal region (a record's two copies are one piece of it).
    pub len: u64,
    /// Where the next record goes.
    pub head: u64,
    /// Bytes between the checkpoint's start position and the head (never overwritten).
    pub used: u64,
    /// Sequence number of the next record.
    pub next_seq: u64,
}

impl Ring {
    /// Where a record taking `size` bytes (both copies) would go and how many ring bytes it
    /// consumes (including the wasted tail when it wraps), or `None` if it does not fit
    /// without overwriting.
    pub fn reserve(&self, size: u64) -> Option<(u64, u64)> {
        let (pos, cost) = if self.head + size <= self.len {
            (self.head, size)
        } else {
            (0, self.len - self.head + size)
        };
        (self.used + cost <= self.len).then_some((pos, cost))
    }

    pub fn advance(&mut self, pos: u64, size: u64, cost: u64) {
        self.head = pos + size;
        if self.head == self.len {
            self.head = 0;
        }
        self.used += cost;
        self.next_seq += 1;
    }

    /// After a checkpoint: everything before the head is covered.
    pub fn checkpointed(&mut self) {
        self.used = 0;
    }
}

/// A last record dropped by replay because the data it points to is not there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dropped {
    pub seq: u64,
    /// Position of copy 0 (copy 1 is `copy_len` after it).
    pub pos: u64,
    pub copy_len: u64,
}

impl Dropped {
    /// What happened, for the log and `check`.
    pub fn what(&self) -> String {
        format!(
            "journal record {} dropped: its data did not reach the cache device before the crash",
            self.seq
        )
    }
}

/// Result of reading the journal after a checkpoint.
pub struct Replay {
    pub records: Vec<(u64, Vec<Entry>)>,
    pub ring: Ring,
    /// The opener must erase a dropped record (the first block of both copies) before writing
    /// a new record: a new record with the same sequence may go elsewhere (to the ring start),
    /// and this one must not be found instead.
    pub dropped_last: Option<Dropped>,
}

/// The record with sequence `seq` stored at `pos`: copy 0 there, else copy 1 right after it.
/// Copy 1 is looked for without trusting copy 0's header: each 4 KiB block after `pos` is
/// probed for a valid copy with this sequence whose own size puts it exactly there. Returns
/// the entries and the size of one copy.
fn record_at(region: &[u8], set: &Uuid, pos: u64, seq: u64) -> Option<(Vec<Entry>, u64)> {
    if let Some(found) = copy_at(region, set, pos, seq) {
        return Some(found);
    }
    let mut at = pos + META_BLOCK;
    while at + FRAME_HEADER_BYTES as u64 <= region.len() as u64 {
        if let Some((entries, size)) = copy_at(region, set, at, seq) {
            if at - pos == size {
                return Some((entries, size));
            }
        }
        at += META_BLOCK;
    }
    None
}

/// A valid record of this cache set at `pos`: `(seq, payload after the uuid, size)`.
fn valid_record<'a>(
    region: &'a [u8],
    set: &Uuid,
    pos: u64,
    version: u32,
) -> Option<(u64, &'a [u8], u64)> {
    let data = region.get(pos as usize..)?;
    frame_header(JOURNAL_MAGIC, data)?;
    let (seq, payload) = unframe(JOURNAL_MAGIC, version, data).ok()?;
    if payload.get(..16)? != set.as_bytes() {
        return None;
    }
    let size = round_up(FRAME_HEADER_BYTES as u64 + payload.len() as u64, META_BLOCK);
    Some((seq, &payload[16..], size))
}

/// One valid copy of record `seq` at `pos`: its entries and size.
fn copy_at(region: &[u8], set: &Uuid, pos: u64, seq: u64) -> Option<(Vec<Entry>, u64)> {
    let h = frame_header(JOURNAL_MAGIC, region.get(pos as usize..)?)?;
    if h.seq != seq {
        return None;
    }
    let (_, entries, size) = valid_record(region, set, pos, JOURNAL_VERSION)?;
    Some((decode_entries(entries)?, size))
}

/// Replays the journal region from the checkpoint's position and sequence.
/// `last_ok` is asked about the last record of the chain: a commit writes its record and
/// flushes the data and the record together, so after a crash the last record can be on the
/// device while data it points to is not; that commit never returned, and when `last_ok`
/// says so the record is dropped as if torn (only the last: every earlier record was followed
/// by a completed flush before the next one was written). The check is about the crash that
/// cut the record only: an opener that replayed records writes an empty one after them before
/// it writes anything else (`Inner::seal_journal`), so a record accepted once is never the
/// last again when the set crashes later, after it reused the blocks that record named.
pub fn replay(
    region: &[u8],
    set: &Uuid,
    start_pos: u64,
    start_seq: u64,
    last_ok: &mut dyn FnMut(&[Entry]) -> Result<bool>,
) -> Result<Replay> {
    let len = region.len() as u64;
    if start_pos >= len || !start_pos.is_multiple_of(META_BLOCK) {
        return Err(Error::Corrupt(format!(
            "checkpoint names journal position {start_pos} outside the {len}-byte journal"
        )));
    }
    let mut ring = Ring {
        len,
        head: start_pos,
        used: 0,
        next_seq: start_seq,
    };
    let mut records = Vec::new();
    let mut before_last = ring.clone();
    let mut last = (0, 0);
    loop {
        let seq = ring.next_seq;
        let found = record_at(region, set, ring.head, seq)
            .map(|r| (ring.head, r))
            .or_else(|| {
                (ring.head != 0)
                    .then(|| record_at(region, set, 0, seq).map(|r| (0, r)))
                    .flatten()
            });
        let Some((pos, (entries, copy_len))) = found else {
            break;
        };
        let size = 2 * copy_len;
        let cost = if pos == ring.head {
            size
        } else {
            len - ring.head + size
        };
        if pos + size > len || ring.used + cost > len {
            return Err(Error::Corrupt("journal records overlap themselves".into()));
        }
        before_last = ring.clone();
        last = (pos, copy_len);
        ring.advance(pos, size, cost);
        records.push((seq, entries));
    }
    let mut dropped_last = None;
    if let Some((seq, entries)) = records.last() {
        if !last_ok(entries)? {
            dropped_last = Some(Dropped {
                seq: *seq,
                pos: last.0,
                copy_len: last.1,
            });
            records.pop();
            ring = before_last;
        }
    }
    // A valid record beyond the end of the chain means the chain was cut by damage.
    let dropped_copy = |seq: u64, pos: u64| {
        dropped_last.is_some_and(|d| d.seq == seq && (pos == d.pos || pos == d.pos + d.copy_len))
    };
    let mut pos = 0;
    while pos + FRAME_HEADER_BYTES as u64 <= len {
        if let Some((seq, _, _)) = valid_record(region, set, pos, JOURNAL_VERSION) {
            if seq >= ring.next_seq && !dropped_copy(seq, pos) {
                return Err(Error::Corrupt(format!(
                    "journal damaged: record {} is unreadable but record {seq} exists at offset {pos}",
                    ring.next_seq
                )));
            }
        }
        if let Some((seq, _, _)) = valid_record(region, set, pos, JOURNAL_VERSION_HALVES) {
            if seq >= ring.next_seq {
                return Err(Error::Corrupt(format!(
                    "the journal holds record {seq} in the layout of an earlier build of format 2 \
                     (two mirror halves): open the device with that build, detach its backing \
                     devices and format it again"
                )));
            }
        }
        pos += META_BLOCK;
    }
    Ok(Replay {
        records,
        ring,
        dropped_last,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Entry> {
        vec![
            Entry::Insert {
                dev: DevId::new(1),
                block: BackingBlock::new(99),
                len: 2,
                cache_block: CacheBlock::new(7),
                gen: Gen::new(3),
                dirty: true,
                crcs: vec![1, 2],
            },
            Entry::Invalidate {
                dev: DevId::new(1),
                block: BackingBlock::new(5),
                len: 1 << 40,
            },
            Entry::MarkClean {
                dev: DevId::new(2),
                block: BackingBlock::new(1),
                len: 3,
                cache_block: CacheBlock::new(4),
            },
            Entry::BucketGen {
                bucket: Bucket::new(3),
                gen: Gen::new(255),
            },
            Entry::AttachDev {
                dev: DevId::new(9),
                uuid: Uuid::new_v4(),
            },
            Entry::DetachDev { dev: DevId::new(9) },
        ]
    }

    fn enc(entries: &[Entry]) -> Vec<u8> {
        let mut w = Writer::default();
        entries.iter().for_each(|e| e.encode(&mut w));
        w.buf
    }

    #[test]
    fn record_len_is_the_encoded_size() {
        let set = Uuid::new_v4();
        for n in (0..3 * META_BLOCK as usize).chain([4064, 4065, 4080, 4081, 8128, 8160]) {
            // `encode_record` refuses a frame longer than `record_len`; both padded copies
            // parse back whole, the second right after the first.
            let rec = encode_record(1, &set, &vec![0; n]);
            assert_eq!(rec.len() as u64, record_space(n), "{n} bytes of entries");
            for at in [0, record_len(n)] {
                let (_, entries, size) =
                    valid_record(&rec, &set, at, JOURNAL_VERSION).expect("valid copy");
                assert_eq!((entries.len(), size), (n, record_len(n)));
            }
        }
    }

    /// The on-disk bytes of the entries that carry blocks, buckets and generations, written
    /// out by hand: block numbers, buckets and generations must keep this encoding.
    #[test]
    fn entry_bytes_are_the_format() {
        let entries = [
            Entry::Insert {
                dev: DevId::new(2),
                block: BackingBlock::new(0x01_0203_0405),
                len: 1,
                cache_block: CacheBlock::new(0x0a0b_0c0d),
                gen: Gen::new(7),
                dirty: true,
                crcs: vec![0xdead_beef],
            },
            Entry::Invalidate {
                dev: DevId::new(1),
                block: BackingBlock::new(9),
                len: 3,
            },
            Entry::MarkClean {
                dev: DevId::new(1),
                block: BackingBlock::new(9),
                len: 2,
                cache_block: CacheBlock::new(300),
            },
            Entry::BucketGen {
                bucket: Bucket::new(0x0102),
                gen: Gen::new(255),
            },
        ];
        #[rustfmt::skip]
        let want: Vec<u8> = [
            &[TAG_INSERT, 2, 0, 0, 0, 0x05, 0x04, 0x03, 0x02, 0x01, 0, 0, 0, 1, 0, 0, 0][..],
            &[0x0d, 0x0c, 0x0b, 0x0a, 7, 1, 0xef, 0xbe, 0xad, 0xde],
            &[TAG_INVALIDATE, 1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0],
            &[TAG_MARK_CLEAN, 1, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 44, 1, 0, 0],
            &[TAG_BUCKET_GEN, 2, 1, 0, 0, 255],
        ]
        .concat();
        assert_eq!(enc(&entries), want);
        assert_eq!(decode_entries(&want).unwrap(), entries);
    }

    #[test]
    fn entries_round_trip() {
        let e = sample();
        assert_eq!(decode_entries(&enc(&e)).unwrap(), e);
        // Truncations never panic and never decode to the full list.
        let b = enc(&e);
        for cut in 0..b.len() {
            if let Some(d) = decode_entries(&b[..cut]) {
                assert!(d.len() < e.len());
            }
        }
    }

    /// Writes one record per item of `records` the way a commit does, from `head` with
    /// sequence 10 on; returns the ring and each record's (position, size of one copy).
    fn write_records(
        region: &mut [u8],
        set: &Uuid,
        head: u64,
        records: &[Vec<Entry>],
    ) -> (Ring, Vec<(u64, u64)>) {
        let mut ring = Ring {
            len: region.len() as u64,
            head,
            used: 0,
            next_seq: 10,
        };
        let mut at = Vec::new();
        for entries in records {
            let rec = encode_record(ring.next_seq, set, &enc(entries));
            let (pos, cost) = ring.reserve(rec.len() as u64).unwrap();
            region[pos as usize..pos as usize + rec.len()].copy_from_slice(&rec);
            at.push((pos, rec.len() as u64 / 2));
            ring.advance(pos, rec.len() as u64, cost);
        }
        (ring, at)
    }

    fn count(region: &[u8], set: &Uuid, head: u64) -> Result<usize> {
        replay(region, set, head, 10, &mut |_| Ok(true)).map(|r| r.records.len())
    }

    #[test]
    fn replay_follows_wrap_and_stops_at_torn_tail() {
        let len = 32 * META_BLOCK;
        let mut region = vec![0u8; len as usize];
        let big = vec![Entry::DetachDev { dev: DevId::new(1) }; 1000]; // 5 KB -> 2 blocks a copy
        let set = Uuid::new_v4();
        let (ring, at) = write_records(&mut region, &set, 26 * META_BLOCK, &vec![big; 4]);
        assert_eq!(at[1].0, 0, "the second record wrapped to the ring start");
        let r = replay(&region, &set, 26 * META_BLOCK, 10, &mut |_| Ok(true)).unwrap();
        assert_eq!(r.records.len(), 4);
        assert_eq!(r.ring.head, ring.head);
        assert_eq!(r.ring.used, ring.used);
        // Damage either copy of the last record (header or body): the other one is used.
        let (last, copy) = (at[3].0 as usize, at[3].1 as usize);
        for spot in [last + 3, last + 100, last + copy + 3, last + copy + 100] {
            region[spot] ^= 1;
            assert_eq!(count(&region, &set, 26 * META_BLOCK).unwrap(), 4, "{spot}");
            region[spot] ^= 1;
        }
        // Tear both copies of the last record: replay ends before it, without reporting damage.
        region[last + 100] ^= 1;
        region[last + copy + 100] ^= 1;
        assert_eq!(count(&region, &set, 26 * META_BLOCK).unwrap(), 3);
        // Damage both copies of a middle record: reported, not silently truncated.
        region[last + 100] ^= 1;
        region[last + copy + 100] ^= 1;
        let (mid, copy) = (at[1].0 as usize, at[1].1 as usize);
        region[mid + 50] ^= 1;
        region[mid + copy + 50] ^= 1;
        assert!(count(&region, &set, 26 * META_BLOCK).is_err());
        // Records of another cache set (an earlier format) are not ours.
        assert_eq!(count(&region, &Uuid::new_v4(), 26 * META_BLOCK).unwrap(), 0);
    }

    #[test]
    fn the_second_copy_is_found_whatever_the_first_claims() {
        let set = Uuid::new_v4();
        let sizes = [
            vec![Entry::DetachDev { dev: DevId::new(1) }; 1],
            vec![Entry::DetachDev { dev: DevId::new(2) }; 2000], // 3 blocks a copy
            vec![Entry::DetachDev { dev: DevId::new(3) }; 700],  // 1 block a copy
        ];
        let mut region = vec![0u8; 64 * META_BLOCK as usize];
        let (_, at) = write_records(&mut region, &set, 0, &sizes);
        for (i, &(pos, copy)) in at.iter().enumerate() {
            // Copy 0 wiped whole, or its header claiming another size or sequence: copy 1 is
            // found by its own size.
            let original = region.clone();
            region[pos as usize..(pos + copy) as usize].fill(0xA5);
            assert_eq!(count(&region, &set, 0).unwrap(), 3, "record {i} wiped");
            region.copy_from_slice(&original);
            region[pos as usize + 24] ^= 0x40; // payload length
            assert_eq!(count(&region, &set, 0).unwrap(), 3, "record {i} length");
            region.copy_from_slice(&original);
        }
        // Every first copy wiped at once, then every second copy.
        for second in [false, true] {
            let mut r = region.clone();
            for &(pos, copy) in &at {
                let from = if second { pos + copy } else { pos };
                r[from as usize..(from + copy) as usize].fill(0xA5);
            }
            assert_eq!(count(&r, &set, 0).unwrap(), 3, "second {second}");
        }
    }

    #[test]
    fn a_dropped_last_record_is_excused_in_both_copies_only() {
        let set = Uuid::new_v4();
        let mut region = vec![0u8; 32 * META_BLOCK as usize];
        let e = vec![Entry::DetachDev { dev: DevId::new(1) }; 1000];
        let (_, at) = write_records(&mut region, &set, 0, &vec![e; 3]);
        let mut calls = 0;
        let r = replay(&region, &set, 0, 10, &mut |_| {
            calls += 1;
            Ok(false)
        })
        .unwrap();
        assert_eq!(calls, 1, "only the last record is checked");
        assert_eq!(r.records.len(), 2);
        assert_eq!(
            r.dropped_last,
            Some(Dropped {
                seq: 12,
                pos: at[2].0,
                copy_len: at[2].1
            })
        );
        assert_eq!(r.ring.head, at[2].0);
    }

    #[test]
    fn records_of_the_halves_layout_are_refused_by_name() {
        let set = Uuid::new_v4();
        let mut region = vec![0u8; 16 * META_BLOCK as usize];
        let mut payload = set.as_bytes().to_vec();
        payload.extend_from_slice(&enc(&sample()));
        let old = frame(JOURNAL_MAGIC, JOURNAL_VERSION_HALVES, 10, &payload);
        region[..old.len()].copy_from_slice(&old);
        let e = count(&region, &set, 0).unwrap_err().to_string();
        assert!(e.contains("earlier build"), "{e}");
        // Older than the checkpoint: left behind by a journal that was checkpointed; ignored.
        assert_eq!(
            replay(&region, &set, 0, 11, &mut |_| Ok(true))
                .unwrap()
                .records
                .len(),
            0
        );
    }
}
