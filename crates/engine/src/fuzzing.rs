//! Entry points that feed arbitrary bytes to the engine's on-disk decoders; shared by the
//! cargo-fuzz targets (`fuzz/`), the stable-toolchain fallback runner and the property tests
//! (`tests/no_panic.rs`), so all three exercise the same code.
//!
//! Owns: nothing but the driving code and a small formatted cache device image (built once,
//! deterministically, from the engine's own encoders: two checkpoint slots, a one-chunk
//! checkpoint, journal records that wrap around the ring, patterned data blocks).
//!
//! Checked for every input: each function returns normally (a panic here is a bug in a
//! decoder or in recovery); a decoder returns an error or a value that passes the same checks
//! as one the engine wrote (a decoded superblock's layout validates, a decoded header or entry
//! list encodes back to what was decoded); recovery (`checkpoint::load`, `check_device`,
//! `CacheSet::open`) returns `Ok` or `Err`, and when it accepts a device the state it rebuilt
//! keeps the index invariants, the opened set closes, and what close wrote loads again.
//! Allocation follows the device or the input, never a length field, and every loop is
//! bounded by the input or the device, so a run that does not return is a hang to report.
//!
//! Checksums: most fuzz inputs would never get past a frame's crc32c, so the drivers frame
//! fuzz payloads themselves (superblock, backing header, checkpoint header and chunks, journal
//! records) or reseal a frame after patching it, besides writing raw bytes.
//!
//! Fault model: every byte of the input is hostile; the devices are in memory and never fail.

use crate::checkpoint::{self, ChunkEncoder, Header, CHUNK_MAGIC, CKPT_MAGIC, CKPT_VERSION};
use crate::codec::{frame, frame_header, Writer, FRAME_HEADER_BYTES};
use crate::format::{
    BackingHeader, BackingState, Layout, StaleCopies, Superblock, BACKING_DATA_OFFSET,
    BACKING_HEADER_OFFSETS, BACKING_MAGIC, BACKING_VERSION, FORMAT_VERSION, META_BLOCK, SB_MAGIC,
};
use crate::index::{Extent, Index};
use crate::journal::{self, Entry, Ring, JOURNAL_MAGIC};
use crate::knobs::Tunables;
use crate::types::{CacheMode, DevId};
use crate::units::{BackingBlock, Bucket, CacheBlock, Gen};
use blockdev::{BlockDevice, MemDevice};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use uuid::Uuid;

/// The fuzz targets, by the names `fuzz/` gives them.
pub const TARGETS: [&str; 5] = [
    "engine_superblock",
    "engine_backing_header",
    "engine_checkpoint",
    "engine_journal",
    "engine_recovery",
];

/// The entry point of a target named in `TARGETS`.
pub fn target(name: &str) -> Option<fn(&[u8])> {
    Some(match name {
        "engine_superblock" => superblock,
        "engine_backing_header" => backing_header,
        "engine_checkpoint" => checkpoint,
        "engine_journal" => journal,
        "engine_recovery" => recovery,
        _ => return None,
    })
}

// ---- the base image --------------------------------------------------------------------------

const BLOCK: u32 = 4096;
const BUCKET: u32 = 16384;
const NBUCKETS: u32 = 8;
const JOURNAL_LEN: u64 = 16 * META_BLOCK;
const CKPT_SEQ: u64 = 5;
const JOURNAL_POS: u64 = 12 * META_BLOCK;
const JOURNAL_SEQ: u64 = 20;

/// The small cache device every image-based driver starts from.
struct Base {
    layout: Layout,
    set: Uuid,
    sb: Superblock,
    devs: BTreeMap<DevId, Uuid>,
    gens: Vec<Gen>,
    image: Vec<u8>,
    /// Payloads of the current checkpoint's header and chunks (seeds).
    header_payload: Vec<u8>,
    chunk_payloads: Vec<Vec<u8>>,
    /// Encoded entries of each journal record after the checkpoint, in order (seeds).
    records: Vec<Vec<u8>>,
}

/// A layout as small as `Layout::validate` allows in practice: 8 buckets of 4 blocks, a
/// 64 KiB journal (the smallest `Layout::compute` makes is 1 MiB, which would make each run
/// slower for no more coverage).
fn small_layout() -> Layout {
    let ckpt_len = 4 * META_BLOCK;
    let ckpt0 = 2 * META_BLOCK;
    let journal_off = ckpt0 + 2 * ckpt_len;
    let data_off = journal_off + JOURNAL_LEN;
    let sb1 = data_off + u64::from(NBUCKETS) * u64::from(BUCKET);
    Layout {
        device_size: sb1 + META_BLOCK,
        block_size: BLOCK,
        bucket_size: BUCKET,
        nbuckets: NBUCKETS,
        sb_offsets: [META_BLOCK, sb1],
        ckpt_offsets: [ckpt0, ckpt0 + ckpt_len],
        ckpt_len,
        journal_off,
        journal_len: JOURNAL_LEN,
        data_off,
    }
}

/// The contents of cache block `cb` in the base image.
fn block_data(cb: u32) -> Vec<u8> {
    (0..BLOCK as usize)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(cb * 7 + 1) as u8)
        .collect()
}

fn crcs(first: u32, len: u32) -> Vec<u32> {
    (first..first + len)
        .map(|cb| crc32c::crc32c(&block_data(cb)))
        .collect()
}

fn encode_entries(entries: &[Entry]) -> Vec<u8> {
    let mut w = Writer::default();
    entries.iter().for_each(|e| e.encode(&mut w));
    w.buf
}

fn put(image: &mut [u8], at: u64, bytes: &[u8]) {
    image[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
}

fn base() -> &'static Base {
    static BASE: OnceLock<Base> = OnceLock::new();
    BASE.get_or_init(build_base)
}

fn build_base() -> Base {
    let layout = small_layout();
    layout.validate().expect("the fuzzing layout is valid");
    let bpb = layout.blocks_per_bucket();
    let set = Uuid::from_bytes([0x5e; 16]);
    let mut image = vec![0u8; layout.device_size as usize];
    for cb in 0..layout.total_blocks() {
        put(&mut image, layout.block_offset(cb), &block_data(cb));
    }
    // Checkpoint state: device 0 has four dirty blocks in bucket 0, device 1 one clean block
    // in bucket 2.
    let devs = BTreeMap::from([
        (DevId::new(0), Uuid::from_bytes([0xa0; 16])),
        (DevId::new(1), Uuid::from_bytes([0xa1; 16])),
    ]);
    let mut gens = vec![Gen::new(0); NBUCKETS as usize];
    gens[0] = Gen::new(3);
    gens[2] = Gen::new(1);
    let index = base_index(bpb);
    let (header, chunk) = write_checkpoints(&mut image, &layout, &devs, &gens, &index);
    // Journal: a record older than the checkpoint, then three after it; the third wraps to
    // the ring start and, being last, has its data checked.
    let records = journal_records();
    write_journal(&mut image, &layout, &set, &records);
    let sb = write_superblocks(&mut image, &layout, set);
    let payload = |magic, f: &[u8]| {
        crate::codec::unframe(magic, CKPT_VERSION, f)
            .expect("base frame")
            .1
            .to_vec()
    };
    Base {
        header_payload: payload(CKPT_MAGIC, &header),
        chunk_payloads: vec![payload(CHUNK_MAGIC, &chunk)],
        layout,
        set,
        sb,
        devs,
        gens,
        image,
        records,
    }
}

/// The checkpoint's index: device 0 has four dirty blocks in bucket 0, device 1 one clean
/// block in bucket 2.
fn base_index(bpb: u32) -> Index {
    let mut index = Index::new(NBUCKETS, bpb);
    let ext = |cb: u32, len: u32, dirty: bool| Extent {
        len,
        cache_block: CacheBlock::new(cb),
        dirty,
    };
    index.insert(
        DevId::new(0),
        BackingBlock::new(10),
        ext(0, 4, true),
        &crcs(0, 4),
    );
    index.insert(
        DevId::new(1),
        BackingBlock::new(7),
        ext(8, 1, false),
        &crcs(8, 1),
    );
    index
}

/// Writes the checkpoint of `index` to slot 1 and the previous one (no chunks) to slot 0;
/// returns the new one's header and its one chunk.
fn write_checkpoints(
    image: &mut [u8],
    layout: &Layout,
    devs: &BTreeMap<DevId, Uuid>,
    gens: &[Gen],
    index: &Index,
) -> (Vec<u8>, Vec<u8>) {
    let mut enc = ChunkEncoder::default();
    let mut cursor = Bucket::new(0);
    while enc.add_next(index, gens, &mut cursor) {}
    let chunk = enc.finish(CKPT_SEQ);
    let header = checkpoint::encode_header(
        CKPT_SEQ,
        &Header {
            journal_pos: JOURNAL_POS,
            journal_seq: JOURNAL_SEQ,
            devs,
            gens,
            chunks: 1,
            body_bytes: chunk.len() as u64,
        },
    );
    let slot = layout.ckpt_offsets[1];
    put(image, slot, &header);
    put(image, slot + Layout::ckpt_header_len(NBUCKETS), &chunk);
    // The previous checkpoint, still in the other slot.
    let old = checkpoint::encode_header(
        CKPT_SEQ - 1,
        &Header {
            journal_pos: 0,
            journal_seq: JOURNAL_SEQ - 3,
            devs,
            gens,
            chunks: 0,
            body_bytes: 0,
        },
    );
    put(image, layout.ckpt_offsets[0], &old);
    (header, chunk)
}

/// The journal's records: one older than the checkpoint, then three after it; the third
/// wraps to the ring start and, being last, has its data checked.
fn journal_records() -> Vec<Vec<u8>> {
    [
        vec![
            Entry::AttachDev {
                dev: DevId::new(2),
                uuid: Uuid::from_bytes([0xa2; 16]),
            },
            Entry::Insert {
                dev: DevId::new(2),
                block: BackingBlock::new(100),
                len: 2,
                cache_block: CacheBlock::new(4),
                gen: Gen::new(0),
                dirty: true,
                crcs: crcs(4, 2),
            },
            Entry::MarkClean {
                dev: DevId::new(0),
                block: BackingBlock::new(10),
                len: 2,
                cache_block: CacheBlock::new(0),
            },
        ],
        vec![
            Entry::BucketGen {
                bucket: Bucket::new(2),
                gen: Gen::new(2),
            },
            Entry::Invalidate {
                dev: DevId::new(0),
                block: BackingBlock::new(13),
                len: 1,
            },
            Entry::DetachDev { dev: DevId::new(1) },
        ],
        vec![Entry::Insert {
            dev: DevId::new(0),
            block: BackingBlock::new(50),
            len: 3,
            cache_block: CacheBlock::new(12),
            gen: Gen::new(0),
            dirty: false,
            crcs: crcs(12, 3),
        }],
    ]
    .iter()
    .map(|r| encode_entries(r))
    .collect()
}

/// Writes the records to the journal: the second, as an older record, before the ring's
/// head, then all of them from the head on.
fn write_journal(image: &mut [u8], layout: &Layout, set: &Uuid, records: &[Vec<u8>]) {
    let older = journal::encode_record(JOURNAL_SEQ - 1, set, &records[1]);
    put(image, layout.journal_off + 8 * META_BLOCK, &older);
    let mut ring = Ring {
        len: JOURNAL_LEN,
        head: JOURNAL_POS,
        used: 0,
        next_seq: JOURNAL_SEQ,
    };
    for entries in records {
        let rec = journal::encode_record(ring.next_seq, set, entries);
        let (pos, cost) = ring
            .reserve(rec.len() as u64)
            .expect("the base journal fits");
        put(image, layout.journal_off + pos, &rec);
        ring.advance(pos, rec.len() as u64, cost);
    }
}

/// Writes the superblock (seq 9, checkpoint slot 1) and an older copy; returns the newer.
fn write_superblocks(image: &mut [u8], layout: &Layout, set: Uuid) -> Superblock {
    let sb = Superblock {
        seq: 9,
        set_uuid: set,
        dev_uuid: Uuid::from_bytes([0xdd; 16]),
        layout: layout.clone(),
        ckpt_slot: 1,
        ckpt_seq: CKPT_SEQ,
        created_unix: 1_700_000_000,
        label: "fuzz".into(),
    };
    put(image, layout.sb_offsets[0], &sb.encode());
    let older_sb = Superblock {
        seq: 8,
        ..sb.clone()
    };
    put(image, layout.sb_offsets[1], &older_sb.encode());
    sb
}

/// The payload of a frame padded to one 4 KiB block (a payload too long for it is cut).
fn framed_block(magic: &[u8; 8], version: u32, seq: u64, payload: &[u8]) -> Vec<u8> {
    let max = META_BLOCK as usize - FRAME_HEADER_BYTES;
    let mut f = frame(magic, version, seq, &payload[..payload.len().min(max)]);
    f.resize(META_BLOCK as usize, 0);
    f
}

/// Recomputes the crc of the frame at `at` (if a frame of a known kind starts there and its
/// claimed length fits) as `codec::frame` does; whether it covers `covering`.
fn reseal(image: &mut [u8], at: usize, covering: usize) -> bool {
    let data = &image[at..];
    let Some(h) = [
        SB_MAGIC,
        CKPT_MAGIC,
        CHUNK_MAGIC,
        JOURNAL_MAGIC,
        BACKING_MAGIC,
    ]
    .iter()
    .find_map(|m| frame_header(m, data)) else {
        return false;
    };
    let Some(total) = h
        .payload_len
        .checked_add(FRAME_HEADER_BYTES as u64)
        .filter(|&t| t <= data.len() as u64)
    else {
        return false;
    };
    let total = total as usize;
    if at + total <= covering {
        return false;
    }
    let mut crc = crc32c::crc32c(&data[..12]);
    crc = crc32c::crc32c_append(crc, &[0; 4]);
    crc = crc32c::crc32c_append(crc, &data[16..total]);
    image[at + 12..at + 16].copy_from_slice(&crc.to_le_bytes());
    true
}

/// Reseals the nearest frame starting at or before `offset` (on a 4 KiB boundary) that
/// covers it.
fn reseal_covering(image: &mut [u8], offset: usize) {
    let mut at = offset / META_BLOCK as usize * META_BLOCK as usize;
    loop {
        if reseal(image, at, offset) || at == 0 {
            return;
        }
        at -= META_BLOCK as usize;
    }
}

/// Splits an input into patches: `op(1) where(2, LE) len(2, LE) bytes(len, cut to what is
/// left)`, each given to `f(op, where, bytes)`.
fn patches(mut data: &[u8], mut f: impl FnMut(u8, u16, &[u8])) {
    while data.len() >= 5 {
        let op = data[0];
        let at = u16::from_le_bytes([data[1], data[2]]);
        let len = usize::from(u16::from_le_bytes([data[3], data[4]]));
        let bytes = &data[5..(5 + len).min(data.len())];
        f(op, at, bytes);
        data = &data[5 + bytes.len()..];
    }
}

fn patch(op: u8, at: u16, bytes: &[u8]) -> Vec<u8> {
    let mut v = vec![op];
    v.extend_from_slice(&at.to_le_bytes());
    v.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    v.extend_from_slice(bytes);
    v
}

/// Writes the current checkpoint anew: `header_payload` framed as its header, then `chunks`
/// framed as its body chunks (as many as fit in the slot).
fn write_checkpoint(image: &mut [u8], slot: usize, seq: u64, header: &[u8], chunks: &[&[u8]]) {
    let b = base();
    let l = &b.layout;
    let header_len = Layout::ckpt_header_len(l.nbuckets) as usize;
    let at = l.ckpt_offsets[slot] as usize;
    let h = frame(
        CKPT_MAGIC,
        CKPT_VERSION,
        seq,
        &header[..header.len().min(header_len - 32)],
    );
    image[at..at + h.len()].copy_from_slice(&h);
    let body_end = at + l.ckpt_len as usize;
    let mut pos = at + header_len;
    for c in chunks {
        let mut f = frame(CHUNK_MAGIC, CKPT_VERSION, seq, c);
        f.resize(
            f.len().div_ceil(META_BLOCK as usize) * META_BLOCK as usize,
            0,
        );
        if pos + f.len() > body_end {
            break;
        }
        image[pos..pos + f.len()].copy_from_slice(&f);
        pos += f.len();
    }
}

/// A checkpoint header payload like the engine writes, with the given chunk count and body
/// size and the base image's device table and generations.
fn header_payload(chunks: u64, body_bytes: u64) -> Vec<u8> {
    let b = base();
    let h = checkpoint::encode_header(
        0,
        &Header {
            journal_pos: JOURNAL_POS,
            journal_seq: JOURNAL_SEQ,
            devs: &b.devs,
            gens: &b.gens,
            chunks,
            body_bytes,
        },
    );
    crate::codec::unframe(CKPT_MAGIC, CKPT_VERSION, &h)
        .expect("own frame")
        .1
        .to_vec()
}

/// Runs recovery on an image and checks what it accepts (see the module header).
fn recover(image: Vec<u8>) {
    let dev = Arc::new(MemDevice::from_image(image));
    let loaded = checkpoint::load(&*dev);
    if let Ok(l) = &loaded {
        check_loaded(l);
    }
    let _ = crate::check_device(&*dev, true);
    let opened = crate::CacheSet::open(
        dev.clone(),
        crate::Config {
            background: false,
            ..crate::Config::default()
        },
    );
    match opened {
        Ok((set, _)) => {
            assert!(loaded.is_ok(), "open accepted what load refused");
            if let Err(e) = set.check_invariants() {
                panic!("recovered set breaks an invariant: {e}");
            }
            set.close().expect("a recovered set closes");
            drop(set);
            let again = checkpoint::load(&*dev).expect("what close wrote loads again");
            check_loaded(&again);
        }
        Err(e) => assert!(loaded.is_err(), "load accepted what open refused: {e}"),
    }
}

fn check_loaded(l: &checkpoint::Loaded) {
    if let Err(e) = l.index.check_invariants() {
        panic!("recovery accepted a state that breaks an index invariant: {e}");
    }
    let layout = &l.sb.layout;
    assert_eq!(l.gens.len(), layout.nbuckets as usize);
    assert!(l.ring.len == layout.journal_len && l.ring.head < l.ring.len);
    assert!(l.ring.used <= l.ring.len);
    assert!(l
        .devs
        .keys()
        .all(|d| d.get() < crate::format::MAX_DEVS as u32));
}

// ---- the entry points ------------------------------------------------------------------------

/// Superblock decoding: the input as a whole block, the input after its first byte as the
/// payload of a valid frame (so the field parser and `Layout::validate` see it), and
/// `Superblock::read` of a device holding those as its two copies (the first byte picks
/// which goes where).
pub fn superblock(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    check_superblock(Superblock::decode(data));
    let seq = u64::from(mode >> 2);
    let framed = framed_block(SB_MAGIC, FORMAT_VERSION, seq, rest);
    check_superblock(Superblock::decode(&framed));
    // Older formats are refused by name, not misread.
    let old = framed_block(SB_MAGIC, FORMAT_VERSION - 1, seq, rest);
    assert!(Superblock::decode(&old).is_err());
    let b = base();
    let mut image = b.image.clone();
    let copy0 = if mode & 1 == 0 { &framed[..] } else { rest };
    put(
        &mut image,
        b.layout.sb_offsets[0],
        &copy0[..copy0.len().min(META_BLOCK as usize)],
    );
    if mode & 2 != 0 {
        put(&mut image, b.layout.sb_offsets[1], &framed);
    }
    let dev = MemDevice::from_image(image);
    if let Ok((sb, _)) = Superblock::read(&dev) {
        sb.layout.validate().expect("read returned a valid layout");
        assert!(sb.layout.device_size <= dev.size_bytes());
        check_superblock(Ok(sb));
    }
}

fn check_superblock(r: Result<Superblock, String>) {
    let Ok(sb) = r else { return };
    sb.layout.validate().expect("a decoded layout validates");
    let mut again = Superblock::decode(&sb.encode()).expect("a decoded superblock re-encodes");
    // A label that is not UTF-8 comes back lossy and cut to its field; the rest is exact.
    assert!(sb.label.starts_with(&again.label));
    again.label = sb.label.clone();
    assert_eq!(again, sb);
}

/// Backing header decoding: the input as a whole block, the input after its first byte as the
/// payload of a valid frame, and `BackingHeader::read` of a device holding them as its two
/// copies (the first byte picks the device size too).
pub fn backing_header(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    check_backing(BackingHeader::decode(data));
    let seq = u64::from(mode >> 3);
    let framed = framed_block(BACKING_MAGIC, BACKING_VERSION, seq, rest);
    check_backing(BackingHeader::decode(&framed));
    let size = BACKING_DATA_OFFSET + u64::from(mode & 7) * 4096 + 4096;
    let mut image = vec![0u8; size as usize];
    let copy0 = if mode & 1 == 0 { &framed[..] } else { rest };
    put(
        &mut image,
        BACKING_HEADER_OFFSETS[0],
        &copy0[..copy0.len().min(META_BLOCK as usize)],
    );
    put(&mut image, BACKING_HEADER_OFFSETS[1], &framed);
    let dev = MemDevice::from_image(image);
    if let Ok((h, _)) = BackingHeader::read(&dev) {
        let end = h.data_offset.checked_add(h.data_size);
        assert!(
            end.is_some_and(|e| e <= dev.size_bytes()),
            "read accepted {} data bytes on a device of {size}",
            h.data_size
        );
        check_backing(Ok(h));
    }
}

fn check_backing(r: Result<BackingHeader, String>) {
    let Ok(h) = r else { return };
    assert_eq!(h.data_offset, BACKING_DATA_OFFSET);
    let mut again = BackingHeader::decode(&h.encode()).expect("a decoded header re-encodes");
    assert!(h.label.starts_with(&again.label));
    again.label = h.label.clone();
    assert_eq!(again, h);
}

/// Checkpoint decoding: the input is `chunks(1) split(2, LE) header-payload(split) body`;
/// the body is cut into `chunks % 4 + 1` equal chunk payloads. Each chunk payload is first
/// applied alone to an empty index (`load_chunk`); then the header and chunks are framed
/// into the base image's current checkpoint slot and the device is loaded.
pub fn checkpoint(data: &[u8]) {
    if data.len() < 3 {
        return;
    }
    let b = base();
    let n = usize::from(data[0] % 4) + 1;
    let split = usize::from(u16::from_le_bytes([data[1], data[2]])).min(data.len() - 3);
    let (header, body) = data[3..].split_at(split);
    let piece = body.len().div_ceil(n).max(1);
    let chunks: Vec<&[u8]> = body.chunks(piece).collect();
    for c in &chunks {
        let mut gens = b.gens.clone();
        let mut index = Index::new(b.layout.nbuckets, b.layout.blocks_per_bucket());
        if checkpoint::load_chunk(&b.layout, c, &b.devs, &mut gens, &mut index).is_ok() {
            if let Err(e) = index.check_invariants() {
                panic!("a chunk that loads breaks an index invariant: {e}");
            }
        }
    }
    let mut image = b.image.clone();
    write_checkpoint(&mut image, 1, CKPT_SEQ, header, &chunks);
    let dev = MemDevice::from_image(image);
    if let Ok(l) = checkpoint::load(&dev) {
        check_loaded(&l);
    }
}

/// Journal decoding: the entry decoder on the whole input (what decodes must encode back to
/// the same bytes), then replay of a 64 KiB region built from the input:
/// `start(1) flags(1)` then patches (`op where len bytes`): op bit 0 clear writes a record
/// of sequence `start seq + where % 8` holding `bytes` as entries at block `where / 8 % 16`
/// (bit 1: copy 0 only), set raw writes `bytes` at byte `where` of the region. Replay starts
/// at block `start % 16` with sequence 20; flags bit 0 makes the last record's data check
/// fail.
pub fn journal(data: &[u8]) {
    if let Some(entries) = journal::decode_entries(data) {
        assert_eq!(encode_entries(&entries), data, "entries re-encode exactly");
    }
    if data.len() < 2 {
        return;
    }
    let b = base();
    let start = u64::from(data[0] % 16) * META_BLOCK;
    let data_ok = data[1] & 1 == 0;
    let mut region = vec![0u8; JOURNAL_LEN as usize];
    patches(&data[2..], |op, at, bytes| {
        if op & 1 == 0 {
            let seq = JOURNAL_SEQ + u64::from(at % 8);
            let pos = (usize::from(at / 8) % 16) * META_BLOCK as usize;
            let mut rec = journal::encode_record(seq, &b.set, bytes);
            if op & 2 != 0 {
                rec.truncate(rec.len() / 2);
            }
            let end = (pos + rec.len()).min(region.len());
            region[pos..end].copy_from_slice(&rec[..end - pos]);
        } else {
            let pos = usize::from(at) % region.len();
            let end = (pos + bytes.len()).min(region.len());
            region[pos..end].copy_from_slice(&bytes[..end - pos]);
        }
    });
    let mut asked = 0;
    let mut last_ok = |_: &[Entry]| {
        asked += 1;
        Ok(data_ok)
    };
    if let Ok(r) = journal::replay(&region, &b.set, start, JOURNAL_SEQ, &mut last_ok) {
        assert!(asked <= 1, "only the last record is checked");
        for (i, (seq, _)) in r.records.iter().enumerate() {
            assert_eq!(*seq, JOURNAL_SEQ + i as u64, "records are consecutive");
        }
        assert_eq!(r.ring.next_seq, JOURNAL_SEQ + r.records.len() as u64);
        assert!(r.ring.head < r.ring.len && r.ring.used <= r.ring.len);
        assert_eq!(r.dropped_last.is_some(), asked == 1 && !data_ok);
    }
}

/// Recovery of a whole cache device: the base image patched by the input, a list of patches
/// `op(1) where(2, LE) len(2, LE) bytes`; `op % 7` picks:
/// 0: raw bytes at byte `4 * where`; 1: the same, then the frame covering it resealed;
/// 2: superblock copy `where & 1` with `bytes` as its payload and sequence `where >> 1`;
/// 3: checkpoint slot `where & 1` with `bytes` as its header payload (sequence: the
/// superblock's unless `where & 2`, then `where >> 2`); 4: the current checkpoint with the
/// base header and `bytes` cut into `where % 4 + 1` chunks; 5: a journal record holding
/// `bytes` as entries, sequence `20 + where % 8`, at journal block `where / 8 % 16`, copy 0
/// only if `where & 0x8000`; 6: a zeroed 4 KiB block (`where` modulo the device).
/// Then `checkpoint::load`, `check_device` and `CacheSet::open` (and close and load again
/// when it opens).
pub fn recovery(data: &[u8]) {
    let b = base();
    let l = &b.layout;
    let mut image = b.image.clone();
    let size = image.len();
    patches(data, |op, at, bytes| match op % 7 {
        0 | 1 => {
            let pos = usize::from(at) * 4 % size;
            let end = (pos + bytes.len()).min(size);
            image[pos..end].copy_from_slice(&bytes[..end - pos]);
            if op % 7 == 1 {
                reseal_covering(&mut image, pos);
            }
        }
        2 => {
            let f = framed_block(SB_MAGIC, FORMAT_VERSION, u64::from(at >> 1), bytes);
            put(&mut image, l.sb_offsets[usize::from(at & 1)], &f);
        }
        3 => {
            let seq = if at & 2 == 0 {
                b.sb.ckpt_seq
            } else {
                u64::from(at >> 2)
            };
            let slot = usize::from(at & 1);
            let header_len = Layout::ckpt_header_len(l.nbuckets) as usize;
            let f = frame(
                CKPT_MAGIC,
                CKPT_VERSION,
                seq,
                &bytes[..bytes.len().min(header_len - 32)],
            );
            put(&mut image, l.ckpt_offsets[slot], &f);
        }
        4 => {
            let n = usize::from(at % 4) + 1;
            let piece = bytes.len().div_ceil(n).max(1);
            let chunks: Vec<&[u8]> = bytes.chunks(piece).collect();
            let body: u64 = chunks
                .iter()
                .map(|c| (c.len() as u64 + 32).div_ceil(META_BLOCK) * META_BLOCK)
                .sum();
            let header = header_payload(chunks.len() as u64, body);
            write_checkpoint(
                &mut image,
                b.sb.ckpt_slot as usize,
                b.sb.ckpt_seq,
                &header,
                &chunks,
            );
        }
        5 => {
            let seq = JOURNAL_SEQ + u64::from(at % 8);
            let pos = (usize::from(at / 8) % 16) * META_BLOCK as usize;
            let mut rec = journal::encode_record(seq, &b.set, bytes);
            if at & 0x8000 != 0 {
                rec.truncate(rec.len() / 2);
            }
            let end = (pos + rec.len()).min(JOURNAL_LEN as usize);
            let off = l.journal_off as usize;
            image[off + pos..off + end].copy_from_slice(&rec[..end - pos]);
        }
        _ => {
            let blocks = size / META_BLOCK as usize;
            let pos = usize::from(at) % blocks * META_BLOCK as usize;
            image[pos..pos + META_BLOCK as usize].fill(0);
        }
    });
    recover(image);
}

// ---- seeds -----------------------------------------------------------------------------------

/// Inputs that decode (or nearly), for the fallback runner, the property tests and
/// `fuzz/seeds/`: valid prefixes from which mutations reach deep states.
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let b = base();
    let with = |first: u8, rest: &[u8]| {
        let mut v = vec![first];
        v.extend_from_slice(rest);
        v
    };
    match target {
        "engine_superblock" => {
            let block = b.sb.encode();
            let payload = crate::codec::unframe(SB_MAGIC, FORMAT_VERSION, &block)
                .expect("own frame")
                .1
                .to_vec();
            let framed = block[..FRAME_HEADER_BYTES + payload.len()].to_vec();
            vec![with(0, &payload), with(2 | (9 << 2), &payload), framed]
        }
        "engine_backing_header" => {
            let h = BackingHeader {
                seq: 3,
                dev_uuid: Uuid::from_bytes([0xa0; 16]),
                set_uuid: b.set,
                data_offset: BACKING_DATA_OFFSET,
                data_size: 8192,
                mode: CacheMode::Writeback,
                state: BackingState::Dirty,
                label: "slow".into(),
                tunables: Tunables::default(),
                stale: StaleCopies::Clean,
                dirty_bytes: Some(4096),
                owner_host: "fast".into(),
            };
            let block = h.encode();
            let payload = crate::codec::unframe(BACKING_MAGIC, BACKING_VERSION, &block)
                .expect("own frame")
                .1;
            // Without the tunables, the stale-copies byte, the dirty amount and the owner's
            // label: an older header; and one without only the last two.
            let tail = 8 + crate::format::LABEL_BYTES;
            let short = &payload[..payload.len() - 22 - tail];
            let no_amount = &payload[..payload.len() - tail];
            let framed = &block[..FRAME_HEADER_BYTES + payload.len()];
            vec![
                with(6 | (3 << 3), payload),
                with(6, short),
                framed.to_vec(),
                with(6, no_amount),
            ]
        }
        "engine_checkpoint" => {
            let chunk = &b.chunk_payloads[0];
            let body = (chunk.len() as u64 + 32).div_ceil(META_BLOCK) * META_BLOCK;
            let header = header_payload(1, body);
            let mut v = vec![0];
            v.extend_from_slice(&(header.len() as u16).to_le_bytes());
            v.extend_from_slice(&header);
            v.extend_from_slice(chunk);
            let mut two = v.clone();
            two[0] = 1;
            let h2 = header_payload(2, 2 * META_BLOCK);
            two.truncate(3);
            two[1..3].copy_from_slice(&(h2.len() as u16).to_le_bytes());
            two.extend_from_slice(&h2);
            two.extend_from_slice(chunk);
            two.extend_from_slice(chunk);
            vec![v, two]
        }
        "engine_journal" => {
            let mut v = vec![12, 0];
            // Records 20, 21 after the start, 22 wrapped to block 0, as the base image has.
            v.extend(patch(0, 12 * 8, &b.records[0]));
            v.extend(patch(0, 14 * 8 + 1, &b.records[1]));
            v.extend(patch(0, 2, &b.records[2]));
            let mut dropped = v.clone();
            dropped[1] = 1;
            vec![v, dropped, b.records.concat()]
        }
        "engine_recovery" => {
            let mut sb_payload = b.sb.clone();
            sb_payload.seq = 10;
            let block = sb_payload.encode();
            let payload = crate::codec::unframe(SB_MAGIC, FORMAT_VERSION, &block)
                .expect("own frame")
                .1;
            vec![
                Vec::new(),
                patch(2, 20, payload),
                patch(3, 1, &b.header_payload),
                patch(4, 0, &b.chunk_payloads[0]),
                // A fourth record after the three of the base image.
                patch(5, 3 + 8 * 2, &b.records[1]),
                // Copy 0 of the last record damaged: copy 1 is used.
                patch(0, raw_where(b.layout.journal_off + 100), &[0xff]),
                // A byte of the checkpoint header changed behind a valid checksum.
                patch(1, raw_where(b.layout.ckpt_offsets[1] + 32 + 16), &[0x07]),
            ]
        }
        _ => Vec::new(),
    }
}

/// The `where` of a raw patch (`recovery` op 0 or 1) at byte `offset` of the device.
fn raw_where(offset: u64) -> u16 {
    (offset / 4) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The base image is what the engine would accept, and replays every record: the fuzz
    /// drivers start from a deep state, not from an error.
    #[test]
    fn base_image_recovers_whole() {
        let b = base();
        let dev = MemDevice::from_image(b.image.clone());
        let l = checkpoint::load(&dev).unwrap();
        assert_eq!(l.records_replayed, 3);
        assert_eq!(l.entries_replayed, 7);
        assert!(l.dropped_record.is_none());
        assert_eq!(l.notes, Vec::<String>::new());
        // Bucket 0: blocks 10, 11 (cleaned) and 12 (13 invalidated); bucket 1: device 2's
        // two blocks; bucket 2 retired; bucket 3: three blocks of device 0.
        assert_eq!(l.index.live_blocks, 3 + 2 + 3);
        assert_eq!(l.index.dirty_blocks, 1 + 2);
        let report = crate::check_device(&dev, true).unwrap();
        assert!(report.problems.is_empty(), "{:?}", report.problems);
    }

    /// A checkpoint header whose device table names device 300 (found by fuzzing
    /// `engine_checkpoint`): refused like a journal `AttachDev` of it, instead of loading a
    /// device id that the index (`pack`) and the chunk encoder (one byte) cannot hold.
    #[test]
    fn checkpoint_device_id_out_of_range_is_refused() {
        let b = base();
        let mut header = b.header_payload.clone();
        // A third device (after the two of the base image, which its chunk refers to).
        header[20..24].copy_from_slice(&3u32.to_le_bytes());
        let mut dev = 300u32.to_le_bytes().to_vec();
        dev.extend_from_slice(&[0x33; 16]);
        header.splice(80..80, dev);
        let mut image = b.image.clone();
        let chunks = [&b.chunk_payloads[0][..]];
        write_checkpoint(&mut image, 1, CKPT_SEQ, &header, &chunks);
        let e = checkpoint::load(&MemDevice::from_image(image))
            .err()
            .expect("refused");
        assert!(e.to_string().contains("device id 300"), "{e}");
    }

    #[test]
    fn every_seed_runs() {
        for t in TARGETS {
            let run = target(t).unwrap();
            let seeds = seeds(t);
            assert!(!seeds.is_empty(), "{t}");
            for s in seeds {
                assert!(s.len() < 4096, "{t}: seeds stay small");
                run(&s);
            }
        }
    }

    /// The seeds reach what they are meant to: the decoders accept them.
    #[test]
    fn seeds_decode() {
        let s = &seeds("engine_superblock")[0];
        let f = framed_block(SB_MAGIC, FORMAT_VERSION, 0, &s[1..]);
        assert!(Superblock::decode(&f).is_ok());
        let s = &seeds("engine_backing_header")[1];
        let f = framed_block(BACKING_MAGIC, BACKING_VERSION, 0, &s[1..]);
        assert!(BackingHeader::decode(&f).is_ok());
        let e = &seeds("engine_journal")[2];
        assert_eq!(journal::decode_entries(e).map(|v| v.len()), Some(7));
    }
}
