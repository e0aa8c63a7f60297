//! The in-memory index: which backing blocks the cache holds, where, and whether dirty.
//!
//! One record per cache block, in flat arrays sized once for the cache (see the RAM budget in
//! `docs/decisions.md`, about 15 bytes per cache block):
//! - `owner[cb]` (6 bytes): the backing block that cache block `cb` holds, packed as
//!   `1 + (dev << 40 | block)`, or 0 when it holds nothing;
//! - `crc[cb]` (4 bytes): the crc32c of the data in `cb`;
//! - `dirty` (1 bit per cache block);
//! - `table` (`u32` slots, at most 90 % full): an open-addressing hash table (Robin Hood
//!   probing, backward-shift deletion) of `cb + 1` keyed by `owner[cb]`, so the key itself
//!   lives only in `owner`.
//!
//! Invariants (checked by `check_invariants` in tests):
//! - a backing block maps to at most one cache block and a cache block holds at most one
//!   backing block: `table` holds `cb + 1` exactly for the cache blocks with an owner, once;
//! - Robin Hood order: along a probe run, no slot is further from its home than the next one
//!   is from its own plus one (so a lookup stops at the first slot closer to home than itself);
//! - `bucket_live`/`bucket_dirty`/`live_blocks`/`dirty_blocks` and the per-device counts
//!   equal the sums over the owned cache blocks, and `live_buckets`/`dirty_buckets` hold
//!   exactly the buckets whose count is non-zero (so nothing on a frequent path sums them);
//! - all mutation goes through `put`/`take`, which keep the above in step.
//!
//! Every array is allocated zeroed and never resized: the kernel maps the pages as they are
//! first written, so an empty cache costs little and a full one never needs a rehash.
//! Lookups cost O(blocks asked for); a range operation over more blocks than the cache holds
//! walks the live buckets instead, so no operation costs more than the smaller of the two.
//! The index does no I/O; the journal records every change made to it so replay rebuilds it.
//! The per-block arrays and the table live in `slots::Slots`, shared with lock-free readers
//! (`IndexReader`): every public method that changes them is one seqlock write section.

use crate::bitset::LevelBits;
use crate::slots::{IndexReader, Slots};
use crate::types::DevId;
use crate::units::{BackingBlock, Bucket, CacheBlock};
use std::sync::Arc;

/// Backing blocks addressable per device (blocks `0..BLOCK_LIMIT`): 4 PiB of 4 KiB blocks.
pub const BLOCK_LIMIT: u64 = (1 << 40) - 1;
/// The end of every device's addressable blocks (a range up to it covers the whole device).
pub const BLOCK_END: BackingBlock = BackingBlock::new(BLOCK_LIMIT);
const DEV_SHIFT: u32 = 40;

/// A run of cached blocks: `len` backing blocks map to cache blocks from `cache_block`, all
/// in one bucket and all clean or all dirty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub len: u32,
    pub cache_block: CacheBlock,
    pub dirty: bool,
}

/// A piece of a looked-up range: either cached (with the extent shifted to the piece) or a hole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub block: BackingBlock,
    pub len: u64,
    pub ext: Option<Extent>,
}

/// The pieces of a looked-up range; a request of a few runs needs no heap allocation.
pub type Segs = smallvec::SmallVec<[Seg; 4]>;

/// The packed owner of a cache block (never 0).
fn pack(dev: DevId, block: BackingBlock) -> u64 {
    assert!(
        block.get() < BLOCK_LIMIT && dev.get() < 256,
        "block {block} or device id {} out of range",
        dev
    );
    1 + ((u64::from(dev.get()) << DEV_SHIFT) | block.get())
}

fn unpack(v: u64) -> (DevId, BackingBlock) {
    debug_assert!(v != 0, "unpack of an empty owner slot");
    let v = v - 1;
    (
        DevId::new((v >> DEV_SHIFT) as u32),
        BackingBlock::new(v & ((1 << DEV_SHIFT) - 1)),
    )
}

/// `[b0, b1)` as pieces, each a hole or a run of blocks in consecutive cache blocks of one
/// bucket, all clean or all dirty; `get` maps one block.
fn segments(
    b0: BackingBlock,
    b1: BackingBlock,
    bpb: u32,
    mut get: impl FnMut(BackingBlock) -> Option<Extent>,
) -> Segs {
    let mut out = Segs::new();
    for b in BackingBlock::range(b0, b1) {
        let ext = get(b);
        if let Some(last) = out.last_mut() {
            let joins = match (&mut last.ext, ext) {
                (None, None) => true,
                (Some(l), Some(e)) => {
                    e.cache_block == l.cache_block + l.len
                        && e.dirty == l.dirty
                        && e.cache_block.bucket(bpb) == l.cache_block.bucket(bpb)
                }
                _ => false,
            };
            if joins {
                last.len += 1;
                if let Some(l) = &mut last.ext {
                    l.len += 1;
                }
                continue;
            }
        }
        out.push(Seg {
            block: b,
            len: 1,
            ext,
        });
    }
    out
}

/// A lock-free lookup of a read that may be a cache hit: if every block of `[b0, b1)` of
/// `dev` is cached, its pieces and the blocks' crcs (appended to `crcs`) and the read's
/// sequence. The caller pins the pieces' buckets and then keeps the answer only if
/// `reader.valid(seq)`; `None` means "take the locked path" (a miss, or a change under way).
pub fn lookup_hit(
    reader: &IndexReader,
    dev: DevId,
    b0: BackingBlock,
    b1: BackingBlock,
    crcs: &mut impl Extend<u32>,
) -> Option<(u64, Segs)> {
    if b1 > BLOCK_END || dev.get() >= 256 {
        return None;
    }
    let seq = reader.begin()?;
    let mut miss = false;
    let segs = segments(b0, b1, reader.blocks_per_bucket(), |b| {
        if miss {
            return None;
        }
        let f = reader.get(pack(dev, b));
        miss = f.is_none();
        f.map(|f| {
            crcs.extend([f.crc]);
            Extent {
                len: 1,
                cache_block: f.cache_block,
                dirty: f.dirty,
            }
        })
    });
    (!miss).then_some((seq, segs))
}

/// Whether every block of `[b0, b1)` of `dev` was cached at one moment (a lock-free look
/// that pins nothing: a hint, e.g. that a read will not wait on the backing device).
pub fn all_cached(reader: &IndexReader, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> bool {
    struct Discard;
    impl Extend<u32> for Discard {
        fn extend<I: IntoIterator<Item = u32>>(&mut self, _: I) {}
    }
    lookup_hit(reader, dev, b0, b1, &mut Discard).is_some_and(|(seq, _)| reader.valid(seq))
}

pub struct Index {
    sh: Arc<Slots>,
    bpb: u32,
    pub bucket_live: Vec<u32>,
    pub bucket_dirty: Vec<u32>,
    live_buckets: LevelBits,
    dirty_buckets: LevelBits,
    pub live_blocks: u64,
    pub dirty_blocks: u64,
    /// Per device (indexed by device id, grown on demand): cached and dirty blocks.
    dev_blocks: Vec<DevBlocks>,
}

/// Cached and dirty blocks of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct DevBlocks {
    live: u64,
    dirty: u64,
}

impl Index {
    pub fn new(nbuckets: u32, blocks_per_bucket: u32) -> Index {
        let total = nbuckets as usize * blocks_per_bucket as usize;
        assert!(total < u32::MAX as usize, "cache blocks must fit a u32");
        Index {
            sh: Arc::new(Slots::new(total)),
            bpb: blocks_per_bucket,
            bucket_live: vec![0; nbuckets as usize],
            bucket_dirty: vec![0; nbuckets as usize],
            live_buckets: LevelBits::new(nbuckets as usize),
            dirty_buckets: LevelBits::new(nbuckets as usize),
            live_blocks: 0,
            dirty_blocks: 0,
            dev_blocks: Vec::new(),
        }
    }

    /// Bytes of heap this index holds (its arrays are allocated once, at their full size).
    pub fn heap_bytes(&self) -> u64 {
        (self.sh.heap_bytes()
            + 2 * std::mem::size_of::<usize>()
            + (self.bucket_live.capacity() + self.bucket_dirty.capacity()) * 4
            + self.live_buckets.heap_bytes()
            + self.dirty_buckets.heap_bytes()
            + self.dev_blocks.capacity() * std::mem::size_of::<DevBlocks>()) as u64
    }

    /// Cached blocks (each one an entry).
    pub fn entry_count(&self) -> usize {
        self.live_blocks as usize
    }

    pub fn bucket_of(&self, cache_block: CacheBlock) -> Bucket {
        cache_block.bucket(self.bpb)
    }

    pub fn crc(&self, cache_block: CacheBlock) -> u32 {
        self.sh.crc(cache_block)
    }

    /// A reader of this index that needs no lock (see `slots`).
    pub fn reader(&self) -> IndexReader {
        IndexReader::new(self.sh.clone(), self.bpb)
    }

    fn owner_of(&self, cb: CacheBlock) -> u64 {
        self.sh.owner(cb)
    }

    fn is_dirty(&self, cb: CacheBlock) -> bool {
        self.sh.is_dirty(cb)
    }

    fn find(&self, key: u64) -> Option<(usize, CacheBlock)> {
        self.sh.find(key)
    }

    /// Runs `f` as one change of the shared arrays (a seqlock write section).
    fn change<T>(&mut self, f: impl FnOnce(&mut Index) -> T) -> T {
        self.sh.write_begin();
        let out = f(self);
        self.sh.write_end();
        out
    }

    /// The cache block holding `(dev, block)`.
    pub fn get(&self, dev: DevId, block: BackingBlock) -> Option<CacheBlock> {
        if block >= BLOCK_END || dev.get() >= 256 {
            return None;
        }
        self.find(pack(dev, block)).map(|(_, cb)| cb)
    }

    fn dev_counts(&mut self, dev: DevId) -> &mut DevBlocks {
        let d = dev.idx();
        if self.dev_blocks.len() <= d {
            self.dev_blocks.resize(d + 1, DevBlocks::default());
        }
        &mut self.dev_blocks[d]
    }

    fn set_dirty(&mut self, cb: CacheBlock, dev: DevId) {
        debug_assert!(!self.is_dirty(cb));
        self.sh.set_dirty(cb, true);
        let bucket = self.bucket_of(cb).idx();
        self.bucket_dirty[bucket] += 1;
        if self.bucket_dirty[bucket] == 1 {
            self.dirty_buckets.set(bucket);
        }
        self.dirty_blocks += 1;
        self.dev_counts(dev).dirty += 1;
    }

    fn clear_dirty(&mut self, cb: CacheBlock, dev: DevId) {
        debug_assert!(self.is_dirty(cb));
        self.sh.set_dirty(cb, false);
        let bucket = self.bucket_of(cb).idx();
        self.bucket_dirty[bucket] -= 1;
        if self.bucket_dirty[bucket] == 0 {
            self.dirty_buckets.clear(bucket);
        }
        self.dirty_blocks -= 1;
        self.dev_blocks[dev.idx()].dirty -= 1;
    }

    /// Maps `(dev, block)` to the unreferenced cache block `cb`; the block must be unmapped.
    fn put(&mut self, dev: DevId, block: BackingBlock, cb: CacheBlock, dirty: bool, crc: u32) {
        assert_eq!(self.owner_of(cb), 0, "cache block {cb} referenced twice");
        self.sh.set_owner(cb, pack(dev, block));
        self.sh.table_insert(cb);
        self.sh.set_crc(cb, crc);
        let bucket = self.bucket_of(cb).idx();
        self.bucket_live[bucket] += 1;
        if self.bucket_live[bucket] == 1 {
            self.live_buckets.set(bucket);
        }
        self.live_blocks += 1;
        self.dev_counts(dev).live += 1;
        if dirty {
            self.set_dirty(cb, dev);
        }
    }

    /// Unmaps the block in table slot `pos` (holding `cb`); returns whether it was dirty.
    fn take(&mut self, pos: usize, cb: CacheBlock) -> bool {
        let (dev, _) = unpack(self.owner_of(cb));
        self.sh.table_remove(pos);
        self.sh.set_owner(cb, 0);
        let dirty = self.is_dirty(cb);
        if dirty {
            self.clear_dirty(cb, dev);
        }
        let bucket = self.bucket_of(cb).idx();
        self.bucket_live[bucket] -= 1;
        if self.bucket_live[bucket] == 0 {
            self.live_buckets.clear(bucket);
        }
        self.live_blocks -= 1;
        self.dev_blocks[dev.idx()].live -= 1;
        dirty
    }

    /// Unmaps `(dev, block)` if mapped; returns whether it was dirty.
    fn take_key(&mut self, key: u64) -> Option<bool> {
        let (pos, cb) = self.find(key)?;
        Some(self.take(pos, cb))
    }

    /// The cache blocks holding blocks of `dev` in `[b0, b1)`, as `(block, cb)`, in no
    /// particular order: by lookups when the range is no bigger than what is cached, else by
    /// walking the live buckets (so the cost is the smaller of the two).
    fn mapped_in(
        &self,
        dev: DevId,
        b0: BackingBlock,
        b1: BackingBlock,
    ) -> Vec<(BackingBlock, CacheBlock)> {
        let b1 = b1.min(BLOCK_END);
        if b0 >= b1 || self.dev_live_blocks(dev) == 0 {
            return Vec::new();
        }
        if self.lookups_cheaper(b0, b1) {
            BackingBlock::range(b0, b1)
                .filter_map(|b| self.get(dev, b).map(|cb| (b, cb)))
                .collect()
        } else {
            let mut out = Vec::new();
            self.for_each_owned(|cb, d, b| {
                if d == dev && (b0..b1).contains(&b) {
                    out.push((b, cb));
                }
            });
            out
        }
    }

    /// Whether looking up each block of `[b0, b1)` costs less than walking the live buckets.
    fn lookups_cheaper(&self, b0: BackingBlock, b1: BackingBlock) -> bool {
        b1 - b0 <= self.live_blocks.max(64)
    }

    /// Calls `f(cb, dev, block)` for every owned cache block, bucket by bucket (live buckets
    /// only), in cache order.
    fn for_each_owned(&self, mut f: impl FnMut(CacheBlock, DevId, BackingBlock)) {
        let mut from = Bucket::new(0);
        while let Some(b) = self.next_live_bucket(from) {
            for cb in b.blocks(self.bpb) {
                let v = self.owner_of(cb);
                if v != 0 {
                    let (d, blk) = unpack(v);
                    f(cb, d, blk);
                }
            }
            from = b + 1;
        }
    }

    /// Whether any block of `[b0, b1)` is cached and satisfies `pred`.
    pub fn any_overlapping(
        &self,
        dev: DevId,
        b0: BackingBlock,
        b1: BackingBlock,
        pred: impl Fn(&Extent) -> bool,
    ) -> bool {
        let b1 = b1.min(BLOCK_END);
        if b0 >= b1 || self.dev_live_blocks(dev) == 0 {
            return false;
        }
        let test = |cb: CacheBlock| {
            pred(&Extent {
                len: 1,
                cache_block: cb,
                dirty: self.is_dirty(cb),
            })
        };
        if self.lookups_cheaper(b0, b1) {
            BackingBlock::range(b0, b1).any(|b| self.get(dev, b).is_some_and(test))
        } else {
            self.mapped_in(dev, b0, b1)
                .into_iter()
                .any(|(_, cb)| test(cb))
        }
    }

    /// Removes whatever is mapped in `[b0, b1)`; returns the number of dirty blocks dropped.
    pub fn remove_range(&mut self, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> u64 {
        let mapped = self.mapped_in(dev, b0, b1);
        if mapped.is_empty() {
            return 0;
        }
        self.change(|ix| {
            let mut dirty = 0;
            for (b, _) in mapped {
                if ix.take_key(pack(dev, b)) == Some(true) {
                    dirty += 1;
                }
            }
            dirty
        })
    }

    /// Maps `[block, block + ext.len)` to `ext`, replacing anything there. The target cache
    /// blocks must be unreferenced (the allocator hands out each block once per generation).
    pub fn insert(&mut self, dev: DevId, block: BackingBlock, ext: Extent, crcs: &[u32]) {
        self.change(|ix| ix.insert_raw(dev, block, ext, crcs, false));
    }

    /// Like `insert`, for replay: an older entry that still references the target cache
    /// blocks (the journal recorded their reuse) loses them.
    pub fn insert_replayed(&mut self, dev: DevId, block: BackingBlock, ext: Extent, crcs: &[u32]) {
        self.change(|ix| ix.insert_raw(dev, block, ext, crcs, true));
    }

    fn insert_raw(
        &mut self,
        dev: DevId,
        block: BackingBlock,
        ext: Extent,
        crcs: &[u32],
        steal: bool,
    ) {
        assert_eq!(crcs.len(), ext.len as usize);
        assert!(ext.len > 0);
        assert_eq!(
            self.bucket_of(ext.cache_block),
            self.bucket_of(ext.cache_block + (ext.len - 1)),
            "extent spans buckets"
        );
        for i in 0..ext.len {
            let (b, cb) = (block + u64::from(i), ext.cache_block + i);
            self.take_key(pack(dev, b));
            if steal {
                let v = self.owner_of(cb);
                if v != 0 {
                    self.take_key(v);
                }
            }
            self.put(dev, b, cb, ext.dirty, crcs[i as usize]);
        }
    }

    /// Covers `[b0, b1)` with cached pieces and holes, in order. A cached piece is a run of
    /// blocks in consecutive cache blocks of one bucket, all clean or all dirty.
    pub fn lookup(&self, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> Segs {
        segments(b0, b1, self.bpb, |b| {
            self.get(dev, b).map(|cb| Extent {
                len: 1,
                cache_block: cb,
                dirty: self.is_dirty(cb),
            })
        })
    }

    /// True if every block of `[b, b + len)` still maps to `cache_block + (x - b)`.
    pub fn maps_to(&self, dev: DevId, b: BackingBlock, len: u32, cache_block: CacheBlock) -> bool {
        (0..len).all(|i| self.get(dev, b + u64::from(i)) == Some(cache_block + i))
    }

    /// True if every block of `[b, b + len)` maps to `cache_block + (x - b)` and is dirty.
    pub fn dirty_at(&self, dev: DevId, b: BackingBlock, len: u32, cache_block: CacheBlock) -> bool {
        self.maps_to(dev, b, len, cache_block) && (0..len).all(|i| self.is_dirty(cache_block + i))
    }

    /// Marks clean the parts of `[b, b + len)` still mapped to `cache_block + (x - b)`.
    /// Returns the number of blocks that changed state.
    pub fn mark_clean(
        &mut self,
        dev: DevId,
        b: BackingBlock,
        len: u32,
        cache_block: CacheBlock,
    ) -> u64 {
        self.change(|ix| ix.mark_clean_raw(dev, b, len, cache_block))
    }

    fn mark_clean_raw(
        &mut self,
        dev: DevId,
        b: BackingBlock,
        len: u32,
        cache_block: CacheBlock,
    ) -> u64 {
        let mut cleaned = 0;
        for i in 0..len {
            let cb = cache_block + i;
            if self.get(dev, b + u64::from(i)) == Some(cb) && self.is_dirty(cb) {
                self.clear_dirty(cb, dev);
                cleaned += 1;
            }
        }
        cleaned
    }

    /// Removes every entry pointing into `bucket`; returns the number of dirty blocks dropped.
    pub fn drop_bucket(&mut self, bucket: Bucket) -> u64 {
        if self.bucket_live[bucket.idx()] == 0 {
            return 0;
        }
        self.change(|ix| ix.drop_bucket_raw(bucket))
    }

    fn drop_bucket_raw(&mut self, bucket: Bucket) -> u64 {
        let mut dirty = 0;
        for cb in bucket.blocks(self.bpb) {
            let v = self.owner_of(cb);
            if v != 0 && self.take_key(v) == Some(true) {
                dirty += 1;
            }
        }
        dirty
    }

    /// Live entries in a bucket (for copying GC), in cache order, as runs of consecutive
    /// backing blocks in consecutive cache blocks.
    pub fn entries_in_bucket(&self, bucket: Bucket) -> Vec<(DevId, BackingBlock, Extent)> {
        let mut out: Vec<(DevId, BackingBlock, Extent)> = Vec::new();
        for cb in bucket.blocks(self.bpb) {
            let v = self.owner_of(cb);
            if v != 0 {
                self.push_run(&mut out, cb, v);
            }
        }
        out
    }

    /// Appends cache block `cb` (owner `v`) to `out`, extending the last run if it continues it.
    fn push_run(&self, out: &mut Vec<(DevId, BackingBlock, Extent)>, cb: CacheBlock, v: u64) {
        let (dev, block) = unpack(v);
        let dirty = self.is_dirty(cb);
        if let Some((d, s, e)) = out.last_mut() {
            if *d == dev
                && *s + u64::from(e.len) == block
                && e.cache_block + e.len == cb
                && e.dirty == dirty
                && self.bucket_of(e.cache_block) == self.bucket_of(cb)
            {
                e.len += 1;
                return;
            }
        }
        out.push((
            dev,
            block,
            Extent {
                len: 1,
                cache_block: cb,
                dirty,
            },
        ));
    }

    /// Dirty blocks in cache order from bucket `*cursor` on (wrapping once), at most
    /// `max_blocks`, of device `only` if given, as runs; `*cursor` moves past the last bucket
    /// visited. Visits only buckets holding dirty data.
    pub fn dirty_runs(
        &self,
        cursor: &mut Bucket,
        max_blocks: u64,
        only: Option<DevId>,
    ) -> Vec<(DevId, BackingBlock, Extent)> {
        let mut out = Vec::new();
        let nbuckets = self.bucket_dirty.len();
        if self.dirty_blocks == 0 || nbuckets == 0 {
            return out;
        }
        let start = cursor.idx().min(nbuckets - 1);
        let mut at = start;
        let mut wrapped = false;
        let mut taken = 0u64;
        loop {
            let next = match self.dirty_buckets.next_set(at) {
                Some(b) if !wrapped || b < start => b,
                Some(_) => break,
                None if !wrapped => {
                    wrapped = true;
                    at = 0;
                    continue;
                }
                None => break,
            };
            for cb in Bucket::new(next as u32).blocks(self.bpb) {
                if !self.is_dirty(cb) {
                    continue;
                }
                let v = self.owner_of(cb);
                if only.is_some_and(|d| unpack(v).0 != d) {
                    continue;
                }
                self.push_run(&mut out, cb, v);
                taken += 1;
            }
            at = next + 1;
            *cursor = Bucket::new((at % nbuckets) as u32);
            if taken >= max_blocks {
                break;
            }
            if at >= nbuckets {
                if wrapped {
                    break;
                }
                wrapped = true;
                at = 0;
            }
        }
        out
    }

    /// Dirty blocks belonging to one device.
    pub fn dev_dirty_blocks(&self, dev: DevId) -> u64 {
        self.dev_blocks.get(dev.idx()).map_or(0, |c| c.dirty)
    }

    /// Cached blocks belonging to one device (a counter: `status` costs no scan).
    pub fn dev_live_blocks(&self, dev: DevId) -> u64 {
        self.dev_blocks.get(dev.idx()).map_or(0, |c| c.live)
    }

    /// The owned cache blocks of `bucket` as `(offset in bucket, dev, block, crc, dirty)`.
    pub fn bucket_blocks(
        &self,
        bucket: Bucket,
    ) -> impl Iterator<Item = (u32, DevId, BackingBlock, u32, bool)> + '_ {
        let first = CacheBlock::first_of(bucket, self.bpb);
        (0..self.bpb).filter_map(move |i| {
            let cb = first + i;
            let v = self.owner_of(cb);
            (v != 0).then(|| {
                let (d, b) = unpack(v);
                (i, d, b, self.sh.crc(cb), self.is_dirty(cb))
            })
        })
    }

    /// The next bucket at or after `from` that holds live blocks.
    pub fn next_live_bucket(&self, from: Bucket) -> Option<Bucket> {
        self.live_buckets
            .next_set(from.idx())
            .map(|b| Bucket::new(b as u32))
    }

    /// Removes, without a journal entry, the clean (with `all`: every) cached blocks of `dev`,
    /// a bucket at a time; returns how many. Only for copies known stale as a whole (see
    /// `health`): the caller writes a checkpoint before anything relies on them being gone,
    /// and until it is durable the reason they are stale must still be on record (the backing
    /// header's `stale` field), so a crash meanwhile drops them again at the next attach.
    pub fn forget_copies(&mut self, dev: DevId, all: bool) -> u64 {
        let mut n = 0;
        let mut from = Bucket::new(0);
        while let Some(b) = self.next_live_bucket(from) {
            let keys: Vec<u64> = b
                .blocks(self.bpb)
                .filter_map(|cb| {
                    let v = self.owner_of(cb);
                    (v != 0 && unpack(v).0 == dev && (all || !self.is_dirty(cb))).then_some(v)
                })
                .collect();
            if !keys.is_empty() {
                n += keys.len() as u64;
                self.change(|ix| {
                    for k in keys {
                        ix.take_key(k);
                    }
                });
            }
            from = b + 1;
        }
        n
    }

    /// Every entry as runs, in cache order (for `check`).
    pub fn runs(&self) -> Vec<(DevId, BackingBlock, Extent)> {
        let mut out = Vec::new();
        self.for_each_owned(|cb, d, b| {
            let v = pack(d, b);
            self.push_run(&mut out, cb, v);
        });
        out
    }

    /// Recomputes every derived field from the owners and compares (test and `check` use).
    pub fn check_invariants(&self) -> Result<(), String> {
        let nb = self.bucket_live.len();
        let mut live = vec![0u32; nb];
        let mut dirty = vec![0u32; nb];
        let mut dev_blocks = vec![DevBlocks::default(); self.dev_blocks.len()];
        let mut owned = 0u64;
        for cb in (0..self.sh.blocks()).map(CacheBlock::new) {
            let v = self.owner_of(cb);
            if v == 0 {
                if self.is_dirty(cb) {
                    return Err(format!("cache block {cb} is dirty but holds nothing"));
                }
                continue;
            }
            owned += 1;
            let (d, _) = unpack(v);
            match self.find(v) {
                Some((_, found)) if found == cb => {}
                other => return Err(format!("cache block {cb}: its owner looks up to {other:?}")),
            }
            let b = self.bucket_of(cb).idx();
            live[b] += 1;
            let Some(c) = dev_blocks.get_mut(d.idx()) else {
                return Err(format!("device {d} has entries but no counters"));
            };
            c.live += 1;
            if self.is_dirty(cb) {
                dirty[b] += 1;
                c.dirty += 1;
            }
        }
        let in_table = (0..self.sh.table_len())
            .filter(|&p| self.sh.slot(p) != 0)
            .count() as u64;
        if in_table != owned || owned != self.live_blocks {
            return Err(format!(
                "{in_table} table slots, {owned} owned blocks, {} counted",
                self.live_blocks
            ));
        }
        for pos in 0..self.sh.table_len() {
            let next = self.sh.next_slot(pos);
            if self.sh.slot(pos) != 0
                && self.sh.slot(next) != 0
                && self.sh.displacement(next) > self.sh.displacement(pos) + 1
            {
                return Err(format!("table slot {next} breaks Robin Hood order"));
            }
        }
        if live != self.bucket_live || dirty != self.bucket_dirty {
            return Err("bucket counters disagree with entries".into());
        }
        if dirty.iter().map(|&x| u64::from(x)).sum::<u64>() != self.dirty_blocks {
            return Err("dirty block count disagrees with entries".into());
        }
        for b in 0..nb {
            if self.live_buckets.get(b) != (live[b] > 0)
                || self.dirty_buckets.get(b) != (dirty[b] > 0)
            {
                return Err(format!("bucket {b}: summary bits disagree with counts"));
            }
        }
        if dev_blocks != self.dev_blocks {
            return Err("per-device counters disagree with entries".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    fn ext(len: u32, cb: u32, dirty: bool) -> Extent {
        Extent {
            len,
            cache_block: CacheBlock::new(cb),
            dirty,
        }
    }

    /// Backing block `b` (short for the tests' many literals).
    fn bb(b: u64) -> BackingBlock {
        BackingBlock::new(b)
    }

    #[test]
    fn insert_split_remove_keep_invariants() {
        let mut ix = Index::new(4, 16);
        let d = DevId::new(1);
        ix.insert(d, bb(10), ext(8, 0, true), &[0; 8]);
        ix.insert(d, bb(12), ext(2, 16, false), &[0; 2]);
        ix.check_invariants().unwrap();
        let segs = ix.lookup(d, bb(8), bb(20));
        assert_eq!(segs.len(), 5);
        assert_eq!(segs[0].ext, None);
        assert_eq!(segs[1].ext.unwrap().cache_block, CacheBlock::new(0));
        assert_eq!(segs[2].ext.unwrap().cache_block, CacheBlock::new(16));
        assert_eq!(segs[3].ext.unwrap().cache_block, CacheBlock::new(4));
        assert_eq!(ix.dirty_blocks, 6);
        assert_eq!(ix.remove_range(d, bb(11), bb(15)), 2);
        ix.check_invariants().unwrap();
        assert_eq!(ix.mark_clean(d, bb(10), 8, CacheBlock::new(0)), 4);
        assert_eq!(ix.dirty_blocks, 0);
        ix.check_invariants().unwrap();
        assert_eq!(ix.drop_bucket(Bucket::new(0)), 0);
        assert_eq!(ix.live_blocks, 0);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn mark_clean_skips_remapped_blocks() {
        let mut ix = Index::new(4, 16);
        let d = DevId::new(0);
        ix.insert(d, bb(0), ext(4, 0, true), &[0; 4]);
        ix.insert(d, bb(1), ext(1, 20, true), &[0]);
        assert_eq!(ix.mark_clean(d, bb(0), 4, CacheBlock::new(0)), 3);
        assert_eq!(ix.dirty_blocks, 1);
        assert!(!ix.maps_to(d, bb(0), 4, CacheBlock::new(0)));
        assert!(ix.maps_to(d, bb(2), 2, CacheBlock::new(2)));
        ix.check_invariants().unwrap();
    }

    /// Random inserts, overwrites, range removals, cleans and bucket drops on a nearly full
    /// index, against a plain map; checks every invariant as it goes.
    #[test]
    fn random_operations_match_a_plain_map() {
        let seed = crate::test_seed("random_operations_match_a_plain_map");
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        let (nb, bpb) = (32u32, 8u32);
        let mut ix = Index::new(nb, bpb);
        let mut model: BTreeMap<(u32, u64), (u32, bool)> = BTreeMap::new();
        let mut next_cb = 0u32;
        for step in 0..4000 {
            let dev = DevId::new(r.gen_range(0..3));
            let b = r.gen_range(0..400u64);
            match r.gen_range(0..10) {
                0..=5 => {
                    // Insert a run into fresh cache blocks of one bucket (recycle by dropping
                    // the bucket first, as the allocator would).
                    let len = r.gen_range(1..=4u32).min(bpb - next_cb % bpb);
                    let bucket = ix.bucket_of(CacheBlock::new(next_cb));
                    if next_cb.is_multiple_of(bpb) {
                        ix.drop_bucket(bucket);
                        model.retain(|_, (cb, _)| CacheBlock::new(*cb).bucket(bpb) != bucket);
                    }
                    let dirty = r.gen_bool(0.5);
                    ix.insert(dev, bb(b), ext(len, next_cb, dirty), &vec![7; len as usize]);
                    for i in 0..len {
                        model.insert((dev.get(), b + u64::from(i)), (next_cb + i, dirty));
                    }
                    next_cb = (next_cb + len) % (nb * bpb);
                }
                6 | 7 => {
                    let len = r.gen_range(1..50u64);
                    let want = model
                        .range((dev.get(), b)..(dev.get(), b + len))
                        .filter(|(_, v)| v.1)
                        .count() as u64;
                    assert_eq!(ix.remove_range(dev, bb(b), bb(b + len)), want);
                    model.retain(|k, _| !(k.0 == dev.get() && (b..b + len).contains(&k.1)));
                }
                8 => {
                    if let Some((&(d, s), &(cb, _))) = model.range((dev.get(), b)..).next() {
                        ix.mark_clean(DevId::new(d), bb(s), 1, CacheBlock::new(cb));
                        model.insert((d, s), (cb, false));
                    }
                }
                _ => {
                    let bucket = Bucket::new(r.gen_range(0..nb));
                    ix.drop_bucket(bucket);
                    model.retain(|_, (cb, _)| CacheBlock::new(*cb).bucket(bpb) != bucket);
                }
            }
            if step % 97 == 0 {
                ix.check_invariants()
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
            }
            for (&(d, s), &(cb, dirty)) in model.range((dev.get(), b)..).take(3) {
                assert_eq!(
                    ix.get(DevId::new(d), bb(s)),
                    Some(CacheBlock::new(cb)),
                    "seed {seed} step {step}"
                );
                assert_eq!(
                    ix.is_dirty(CacheBlock::new(cb)),
                    dirty,
                    "seed {seed} step {step}"
                );
            }
        }
        ix.check_invariants().unwrap();
        assert_eq!(ix.live_blocks, model.len() as u64);
        // A whole-device removal takes the bucket walk.
        for d in 0..3 {
            ix.remove_range(DevId::new(d), bb(0), BLOCK_END);
        }
        assert_eq!(ix.live_blocks, 0);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn dirty_runs_visit_dirty_buckets_from_the_cursor_and_wrap() {
        let mut ix = Index::new(8, 4);
        let d = DevId::new(0);
        ix.insert(d, bb(100), ext(2, 4, true), &[0; 2]); // bucket 1
        ix.insert(d, bb(50), ext(1, 20, true), &[0]); // bucket 5
        ix.insert(d, bb(7), ext(1, 28, false), &[0]); // bucket 7, clean
        let mut cursor = Bucket::new(3);
        let runs = ix.dirty_runs(&mut cursor, 1, None);
        assert_eq!(runs, vec![(d, bb(50), ext(1, 20, true))]);
        assert_eq!(cursor, Bucket::new(6));
        let runs = ix.dirty_runs(&mut cursor, 100, None);
        assert_eq!(
            runs,
            vec![(d, bb(100), ext(2, 4, true)), (d, bb(50), ext(1, 20, true))]
        );
        assert!(ix
            .dirty_runs(&mut cursor, 100, Some(DevId::new(1)))
            .is_empty());
    }
}

#[cfg(test)]
mod lock_free_tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    /// The crc every entry of this test carries: a function of where it is, so a reader that
    /// kept a torn answer (a key found at a cache block with another block's crc) is caught.
    fn tag(block: BackingBlock, cb: CacheBlock) -> u32 {
        (block.get() as u32).wrapping_mul(0x9e37_79b9) ^ cb.get().wrapping_mul(0x85eb_ca6b) ^ 1
    }

    /// Readers doing lock-free lookups while one writer inserts, moves, cleans and drops
    /// entries (shifting Robin Hood runs all the time): every answer that passes the seqlock
    /// check is one the index really held, and full lookups do succeed.
    #[test]
    fn validated_lock_free_lookups_are_never_torn() {
        let seed = crate::test_seed("validated_lock_free_lookups_are_never_torn");
        let (nb, bpb) = (16u32, 8u32);
        let mut ix = Index::new(nb, bpb);
        let reader = ix.reader();
        let dev = DevId::new(3);
        let blocks = 96u64;
        let stop = AtomicBool::new(false);
        let (kept, torn) = (AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|s| {
            for r in 0..2u64 {
                let (reader, stop, kept, torn) = (&reader, &stop, &kept, &torn);
                s.spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (r + 1));
                    while !stop.load(Ordering::Relaxed) {
                        let b0 = rng.gen_range(0..blocks);
                        let b1 = (b0 + rng.gen_range(1..4)).min(blocks);
                        let mut crcs = Vec::new();
                        let Some((seq, segs)) = lookup_hit(
                            reader,
                            dev,
                            BackingBlock::new(b0),
                            BackingBlock::new(b1),
                            &mut crcs,
                        ) else {
                            continue;
                        };
                        if !reader.valid(seq) {
                            continue;
                        }
                        kept.fetch_add(1, Ordering::Relaxed);
                        let mut i = 0;
                        for sg in &segs {
                            let e = sg.ext.expect("a kept answer has no holes");
                            for k in 0..sg.len {
                                if crcs[i] != tag(sg.block + k, e.cache_block + k as u32) {
                                    torn.fetch_add(1, Ordering::Relaxed);
                                }
                                i += 1;
                            }
                        }
                        assert_eq!(i as u64, b1 - b0);
                    }
                });
            }
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut next_cb = 0u32;
            for _ in 0..200_000 {
                match rng.gen_range(0..10) {
                    0 => {
                        let bucket = rng.gen_range(0..nb);
                        ix.drop_bucket(Bucket::new(bucket));
                    }
                    1 => {
                        let b = rng.gen_range(0..blocks);
                        ix.remove_range(dev, BackingBlock::new(b), BackingBlock::new(b + 2));
                    }
                    2 => {
                        if let Some(cb) = ix.get(dev, BackingBlock::new(rng.gen_range(0..blocks))) {
                            let (d, b) = unpack(ix.owner_of(cb));
                            ix.mark_clean(d, b, 1, cb);
                        }
                    }
                    _ => {
                        let b = rng.gen_range(0..blocks - 2);
                        let len = 2.min(bpb - next_cb % bpb);
                        let cb = next_cb;
                        // The target blocks must be unreferenced: free the bucket as it opens.
                        if cb.is_multiple_of(bpb) {
                            ix.drop_bucket(Bucket::new(cb / bpb));
                        }
                        let crcs: Vec<u32> = (0..len)
                            .map(|i| {
                                tag(BackingBlock::new(b + u64::from(i)), CacheBlock::new(cb + i))
                            })
                            .collect();
                        ix.insert(
                            dev,
                            BackingBlock::new(b),
                            ext(len, cb, rng.gen_bool(0.5)),
                            &crcs,
                        );
                        next_cb = (cb + len) % (nb * bpb);
                    }
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
        ix.check_invariants().unwrap();
        let (kept, torn) = (kept.into_inner(), torn.into_inner());
        eprintln!("lock-free lookups kept: {kept}, torn: {torn}");
        assert_eq!(torn, 0, "a validated lookup returned a torn entry");
        assert!(kept > 0, "no lock-free lookup ever succeeded");
    }

    fn ext(len: u32, cb: u32, dirty: bool) -> Extent {
        Extent {
            len,
            cache_block: CacheBlock::new(cb),
            dirty,
        }
    }
}
