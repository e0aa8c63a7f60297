//! The journal: index changes as typed entries, grouped into checksummed records written to a
//! ring on the cache device, and the replay that rebuilds them after a restart or a crash.
//!
//! Invariants:
//! - records carry consecutive sequence numbers; a record is written at the ring head, or at
//!   the ring start when it does not fit before the end (the reader tries the same two places);
//! - a record is only ever written after the cache device was flushed, so every `Insert` in a
//!   durable record points to durable data; the record itself is flushed before the commit
//!   returns, and commits are serialized, so at most the last record can be torn by a crash;
//! - ring space between the checkpoint's start position and the head is never overwritten
//!   (`Ring::reserve` refuses, and the caller writes a checkpoint instead);
//! - every record is written twice, at the same position in two mirror halves of the journal
//!   region (one write each, then one flush), so media damage to one copy of any record —
//!   including the newest, which a torn write could otherwise explain — is survived;
//! - replay stops at the first record that is missing or fails its checksum; if any valid record
//!   with a later sequence exists elsewhere in the ring, that was corruption in the middle of the
//!   journal, not a torn tail, and replay reports damage instead of silently losing entries.

use crate::codec::{frame, frame_header, round_up, unframe, Reader, Writer, FRAME_HEADER_BYTES};
use crate::format::META_BLOCK;
use crate::types::{DevId, Error, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock, Gen};
use uuid::Uuid;

pub const JOURNAL_MAGIC: &[u8; 8] = b"TCJRNL01";
pub const JOURNAL_VERSION: u32 = 1;

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
                w.u32(dev.0);
                w.u64(block.0);
                w.u32(*len);
                w.u32(cache_block.0);
                w.u8(gen.0);
                w.u8(u8::from(*dirty));
                for c in crcs {
                    w.u32(*c);
                }
            }
            Entry::Invalidate { dev, block, len } => {
                w.u8(TAG_INVALIDATE);
                w.u32(dev.0);
                w.u64(block.0);
                w.u64(*len);
            }
            Entry::MarkClean {
                dev,
                block,
                len,
                cache_block,
            } => {
                w.u8(TAG_MARK_CLEAN);
                w.u32(dev.0);
                w.u64(block.0);
                w.u32(*len);
                w.u32(cache_block.0);
            }
            Entry::BucketGen { bucket, gen } => {
                w.u8(TAG_BUCKET_GEN);
                w.u32(bucket.0);
                w.u8(gen.0);
            }
            Entry::AttachDev { dev, uuid } => {
                w.u8(TAG_ATTACH);
                w.u32(dev.0);
                w.bytes(uuid.as_bytes());
            }
            Entry::DetachDev { dev } => {
                w.u8(TAG_DETACH);
                w.u32(dev.0);
            }
        }
    }

    pub fn decode(r: &mut Reader<'_>) -> Option<Entry> {
        Some(match r.u8()? {
            TAG_INSERT => {
                let dev = DevId(r.u32()?);
                let block = BackingBlock(r.u64()?);
                let len = r.u32()?;
                let cache_block = CacheBlock(r.u32()?);
                let gen = Gen(r.u8()?);
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
                dev: DevId(r.u32()?),
                block: BackingBlock(r.u64()?),
                len: r.u64()?,
            },
            TAG_MARK_CLEAN => Entry::MarkClean {
                dev: DevId(r.u32()?),
                block: BackingBlock(r.u64()?),
                len: r.u32()?,
                cache_block: CacheBlock(r.u32()?),
            },
            TAG_BUCKET_GEN => Entry::BucketGen {
                bucket: Bucket(r.u32()?),
                gen: Gen(r.u8()?),
            },
            TAG_ATTACH => Entry::AttachDev {
                dev: DevId(r.u32()?),
                uuid: Uuid::from_bytes(r.array()?),
            },
            TAG_DETACH => Entry::DetachDev {
                dev: DevId(r.u32()?),
            },
            _ => return None,
        })
    }
}

/// Encodes a record holding already-encoded entries, padded to whole 4 KiB blocks. The payload
/// starts with the cache set's uuid, so records left by an earlier format of the same device
/// are never mistaken for ours.
pub fn encode_record(seq: u64, set_uuid: &Uuid, entries: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(16 + entries.len());
    payload.extend_from_slice(set_uuid.as_bytes());
    payload.extend_from_slice(entries);
    let mut rec = frame(JOURNAL_MAGIC, JOURNAL_VERSION, seq, &payload);
    let len = record_len(entries.len()) as usize;
    assert!(rec.len() <= len, "a record outgrew its reserved size");
    rec.resize(len, 0);
    rec
}

/// The size of the record `encode_record` makes of `entries_len` bytes of entries (ring
/// space is reserved with it before the record is encoded).
pub fn record_len(entries_len: usize) -> u64 {
    round_up((FRAME_HEADER_BYTES + 16 + entries_len) as u64, META_BLOCK)
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
    pub len: u64,
    /// Where the next record goes.
    pub head: u64,
    /// Bytes between the checkpoint's start position and the head (never overwritten).
    pub used: u64,
    /// Sequence number of the next record.
    pub next_seq: u64,
}

impl Ring {
    /// Where a record of `size` bytes would go and how many ring bytes it consumes (including
    /// the wasted tail when it wraps), or `None` if it does not fit without overwriting.
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

/// Result of reading the journal after a checkpoint.
pub struct Replay {
    pub records: Vec<(u64, Vec<Entry>)>,
    pub ring: Ring,
    /// `(sequence, position)` of a last record dropped because the data it points to is not
    /// there. The opener must erase it before writing a new record: a new record with the same
    /// sequence may go elsewhere (to the ring start), and this one must not be found instead.
    pub dropped_last: Option<(u64, u64)>,
}

/// Tries to parse a record with sequence `seq` at `pos` in either mirror half.
fn record_at(region: &[u8], set: &Uuid, pos: u64, seq: u64) -> Option<(Vec<Entry>, u64)> {
    let half = region.len() / 2;
    record_in(&region[..half], set, pos, seq).or_else(|| record_in(&region[half..], set, pos, seq))
}

/// A valid record of this cache set at `pos`: `(seq, payload after the uuid, size)`.
fn valid_record<'a>(ring: &'a [u8], set: &Uuid, pos: u64) -> Option<(u64, &'a [u8], u64)> {
    let data = ring.get(pos as usize..)?;
    frame_header(JOURNAL_MAGIC, data)?;
    let (seq, payload) = unframe(JOURNAL_MAGIC, JOURNAL_VERSION, data).ok()?;
    if payload.get(..16)? != set.as_bytes() {
        return None;
    }
    let size = round_up(FRAME_HEADER_BYTES as u64 + payload.len() as u64, META_BLOCK);
    Some((seq, &payload[16..], size))
}

fn record_in(ring: &[u8], set: &Uuid, pos: u64, seq: u64) -> Option<(Vec<Entry>, u64)> {
    let h = frame_header(JOURNAL_MAGIC, ring.get(pos as usize..)?)?;
    if h.seq != seq {
        return None;
    }
    let (_, entries, size) = valid_record(ring, set, pos)?;
    Some((decode_entries(entries)?, size))
}

/// Replays the journal region (both mirror halves) from the checkpoint's position and sequence.
/// `last_ok` is asked about the last record of the chain: a commit writes its record and
/// flushes the data and the record together, so after a crash the last record can be on the
/// device while data it points to is not; that commit never returned, and when `last_ok`
/// says so the record is dropped as if torn (only the last: every earlier record was followed
/// by a completed flush before the next one was written).
pub fn replay(
    region: &[u8],
    set: &Uuid,
    start_pos: u64,
    start_seq: u64,
    last_ok: &mut dyn FnMut(&[Entry]) -> Result<bool>,
) -> Result<Replay> {
    let len = region.len() as u64 / 2;
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
    let mut last_pos = 0;
    loop {
        let seq = ring.next_seq;
        let found = record_at(region, set, ring.head, seq)
            .map(|r| (ring.head, r))
            .or_else(|| {
                (ring.head != 0)
                    .then(|| record_at(region, set, 0, seq).map(|r| (0, r)))
                    .flatten()
            });
        let Some((pos, (entries, size))) = found else {
            break;
        };
        let cost = if pos == ring.head {
            size
        } else {
            len - ring.head + size
        };
        if ring.used + cost > len {
            return Err(Error::Corrupt("journal records overlap themselves".into()));
        }
        before_last = ring.clone();
        last_pos = pos;
        ring.advance(pos, size, cost);
        records.push((seq, entries));
    }
    let mut dropped_last = None;
    if let Some((seq, entries)) = records.last() {
        if !last_ok(entries)? {
            dropped_last = Some((*seq, last_pos));
            records.pop();
            ring = before_last;
        }
    }
    // A valid record beyond the end of the chain means the chain was cut by damage.
    for (copy, half) in region.chunks(len as usize).enumerate() {
        let mut pos = 0;
        while pos + FRAME_HEADER_BYTES as u64 <= len {
            if let Some((seq, _, _)) = valid_record(half, set, pos) {
                if seq >= ring.next_seq && dropped_last != Some((seq, pos)) {
                    return Err(Error::Corrupt(format!(
                        "journal damaged: record {} is unreadable but record {seq} exists at offset {pos} of copy {copy}",
                        ring.next_seq
                    )));
                }
            }
            pos += META_BLOCK;
        }
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
                dev: DevId(1),
                block: BackingBlock(99),
                len: 2,
                cache_block: CacheBlock(7),
                gen: Gen(3),
                dirty: true,
                crcs: vec![1, 2],
            },
            Entry::Invalidate {
                dev: DevId(1),
                block: BackingBlock(5),
                len: 1 << 40,
            },
            Entry::MarkClean {
                dev: DevId(2),
                block: BackingBlock(1),
                len: 3,
                cache_block: CacheBlock(4),
            },
            Entry::BucketGen {
                bucket: Bucket(3),
                gen: Gen(255),
            },
            Entry::AttachDev {
                dev: DevId(9),
                uuid: Uuid::new_v4(),
            },
            Entry::DetachDev { dev: DevId(9) },
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
            // `encode_record` refuses a frame longer than `record_len`; the padded record
            // parses back whole.
            let rec = encode_record(1, &set, &vec![0; n]);
            assert_eq!(rec.len() as u64, record_len(n), "{n} bytes of entries");
            let (_, entries, size) = valid_record(&rec, &set, 0).expect("valid record");
            assert_eq!((entries.len(), size), (n, record_len(n)));
        }
    }

    /// The on-disk bytes of the entries that carry blocks, buckets and generations, written
    /// out by hand: block numbers, buckets and generations must keep this encoding.
    #[test]
    fn entry_bytes_are_the_format() {
        let entries = [
            Entry::Insert {
                dev: DevId(2),
                block: BackingBlock(0x01_0203_0405),
                len: 1,
                cache_block: CacheBlock(0x0a0b_0c0d),
                gen: Gen(7),
                dirty: true,
                crcs: vec![0xdead_beef],
            },
            Entry::Invalidate {
                dev: DevId(1),
                block: BackingBlock(9),
                len: 3,
            },
            Entry::MarkClean {
                dev: DevId(1),
                block: BackingBlock(9),
                len: 2,
                cache_block: CacheBlock(300),
            },
            Entry::BucketGen {
                bucket: Bucket(0x0102),
                gen: Gen(255),
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

    #[test]
    fn replay_follows_wrap_and_stops_at_torn_tail() {
        let len = 16 * META_BLOCK;
        let mut region = vec![0u8; 2 * len as usize];
        let mut ring = Ring {
            len,
            head: 12 * META_BLOCK,
            used: 0,
            next_seq: 10,
        };
        let big = vec![Entry::DetachDev { dev: DevId(1) }; 1000]; // 5 KB -> 2 blocks
        let set = Uuid::new_v4();
        for _ in 0..4 {
            let rec = encode_record(ring.next_seq, &set, &enc(&big));
            let (pos, cost) = ring.reserve(rec.len() as u64).unwrap();
            region[pos as usize..pos as usize + rec.len()].copy_from_slice(&rec);
            let m = (len + pos) as usize;
            region[m..m + rec.len()].copy_from_slice(&rec);
            ring.advance(pos, rec.len() as u64, cost);
        }
        let r = replay(&region, &set, 12 * META_BLOCK, 10, &mut |_| Ok(true)).unwrap();
        assert_eq!(r.records.len(), 4);
        assert_eq!(r.ring.head, ring.head);
        // Damage one copy of the last record: the mirror copy is used.
        let last = (ring.head - 2 * META_BLOCK) as usize;
        region[last + 100] ^= 1;
        assert_eq!(
            replay(&region, &set, 12 * META_BLOCK, 10, &mut |_| Ok(true))
                .unwrap()
                .records
                .len(),
            4
        );
        // Tear both copies of the last record: replay ends before it, without reporting damage.
        region[len as usize + last + 100] ^= 1;
        assert_eq!(
            replay(&region, &set, 12 * META_BLOCK, 10, &mut |_| Ok(true))
                .unwrap()
                .records
                .len(),
            3
        );
        // Damage both copies of a middle record: reported, not silently truncated.
        region[last + 100] ^= 1;
        region[len as usize + last + 100] ^= 1;
        for base in [0, len as usize] {
            region[base + (12 * META_BLOCK) as usize + 50] ^= 1;
        }
        assert!(replay(&region, &set, 12 * META_BLOCK, 10, &mut |_| Ok(true)).is_err());
        // Records of another cache set (an earlier format) are not ours.
        assert!(
            replay(&region, &Uuid::new_v4(), 12 * META_BLOCK, 10, &mut |_| Ok(
                true
            ))
            .unwrap()
            .records
            .is_empty()
        );
    }
}
