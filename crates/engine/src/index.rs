//! The in-memory index: which backing blocks the cache holds, where, and whether dirty.
//!
//! Invariants (checked by `check_invariants` in tests):
//! - entries of one device never overlap; an entry never spans two buckets;
//! - every cache block is referenced by at most one entry; `owner[cb]` names the backing block
//!   that references `cb` (or `NO_OWNER`), so a bucket can be emptied without scanning the map;
//! - `bucket_live`/`bucket_dirty`/`live_blocks`/`dirty_blocks` and the per-device live and
//!   dirty counts always equal the sums over the entries (so nothing on a frequent path sums
//!   them), and `dirty_keys` holds exactly the keys of dirty entries;
//! - all mutation goes through `put`/`take`, which keep the above in step.
//!
//! The index does no I/O; the journal records every change made to it so replay rebuilds it.

use crate::types::DevId;
use std::collections::{BTreeMap, BTreeSet};

/// One mapping: `len` backing blocks starting at the key map to cache blocks from `cache_block`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub len: u32,
    pub cache_block: u32,
    pub gen: u8,
    pub dirty: bool,
}

/// A piece of a looked-up range: either cached (with the extent shifted to the piece) or a hole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub block: u64,
    pub len: u64,
    pub ext: Option<Extent>,
}

type Key = (u32, u64);
/// An owner slot nobody references. Zero, so the owner table of a fresh index is zeroed
/// memory the kernel maps lazily: its RAM follows the blocks in use, not the cache size.
const NO_OWNER: u64 = 0;
const DEV_SHIFT: u32 = 48;
/// Set in every packed owner, so no owner packs to `NO_OWNER`.
const OWNED: u64 = 1 << 63;

fn pack(dev: DevId, block: u64) -> u64 {
    assert!(
        block < 1 << DEV_SHIFT && dev.0 < 1 << 15,
        "block or device id out of range"
    );
    OWNED | (u64::from(dev.0) << DEV_SHIFT) | block
}

fn unpack(v: u64) -> (DevId, u64) {
    debug_assert!(v & OWNED != 0, "unpack of an empty owner slot");
    let v = v & !OWNED;
    (DevId((v >> DEV_SHIFT) as u32), v & ((1 << DEV_SHIFT) - 1))
}

pub struct Index {
    map: BTreeMap<Key, Extent>,
    dirty_keys: BTreeSet<Key>,
    owner: Vec<u64>,
    crc: Vec<u32>,
    bpb: u32,
    pub bucket_live: Vec<u32>,
    pub bucket_dirty: Vec<u32>,
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
        let total = (nbuckets * blocks_per_bucket) as usize;
        Index {
            map: BTreeMap::new(),
            dirty_keys: BTreeSet::new(),
            owner: vec![NO_OWNER; total],
            crc: vec![0; total],
            bpb: blocks_per_bucket,
            bucket_live: vec![0; nbuckets as usize],
            bucket_dirty: vec![0; nbuckets as usize],
            live_blocks: 0,
            dirty_blocks: 0,
            dev_blocks: Vec::new(),
        }
    }

    pub fn entry_count(&self) -> usize {
        self.map.len()
    }

    pub fn bucket_of(&self, cache_block: u32) -> u32 {
        cache_block / self.bpb
    }

    pub fn crc(&self, cache_block: u32) -> u32 {
        self.crc[cache_block as usize]
    }

    fn put(&mut self, dev: DevId, start: u64, ext: Extent) {
        assert!(ext.len > 0);
        let bucket = self.bucket_of(ext.cache_block);
        assert_eq!(
            bucket,
            self.bucket_of(ext.cache_block + ext.len - 1),
            "extent spans buckets"
        );
        for i in 0..ext.len {
            let slot = &mut self.owner[(ext.cache_block + i) as usize];
            assert_eq!(
                *slot,
                NO_OWNER,
                "cache block {} referenced twice",
                ext.cache_block + i
            );
            *slot = pack(dev, start + u64::from(i));
        }
        self.bucket_live[bucket as usize] += ext.len;
        self.live_blocks += u64::from(ext.len);
        let d = dev.0 as usize;
        if self.dev_blocks.len() <= d {
            self.dev_blocks.resize(d + 1, DevBlocks::default());
        }
        self.dev_blocks[d].live += u64::from(ext.len);
        if ext.dirty {
            self.bucket_dirty[bucket as usize] += ext.len;
            self.dirty_blocks += u64::from(ext.len);
            self.dirty_keys.insert((dev.0, start));
            self.dev_blocks[d].dirty += u64::from(ext.len);
        }
        let prev = self.map.insert((dev.0, start), ext);
        assert!(prev.is_none(), "index entry inserted over an existing one");
    }

    fn take(&mut self, dev: DevId, start: u64) -> Extent {
        let ext = self
            .map
            .remove(&(dev.0, start))
            .expect("take of a missing entry");
        let bucket = self.bucket_of(ext.cache_block);
        for i in 0..ext.len {
            self.owner[(ext.cache_block + i) as usize] = NO_OWNER;
        }
        self.bucket_live[bucket as usize] -= ext.len;
        self.live_blocks -= u64::from(ext.len);
        let counts = &mut self.dev_blocks[dev.0 as usize];
        counts.live -= u64::from(ext.len);
        if ext.dirty {
            self.bucket_dirty[bucket as usize] -= ext.len;
            self.dirty_blocks -= u64::from(ext.len);
            self.dirty_keys.remove(&(dev.0, start));
            counts.dirty -= u64::from(ext.len);
        }
        ext
    }

    /// Entries overlapping `[b0, b1)`, in order, without allocating.
    fn overlapping_iter(
        &self,
        dev: DevId,
        b0: u64,
        b1: u64,
    ) -> impl Iterator<Item = (u64, Extent)> + '_ {
        let before = self
            .map
            .range(..(dev.0, b0))
            .next_back()
            .filter(|(&(d, s), e)| d == dev.0 && s + u64::from(e.len) > b0);
        before
            .into_iter()
            .chain(self.map.range((dev.0, b0)..(dev.0, b1)))
            .map(|(&(_, s), e)| (s, *e))
    }

    /// Entries overlapping `[b0, b1)`, in order (collected, for callers that mutate).
    fn overlapping(&self, dev: DevId, b0: u64, b1: u64) -> Vec<(u64, Extent)> {
        self.overlapping_iter(dev, b0, b1).collect()
    }

    /// Whether any entry overlapping `[b0, b1)` satisfies `pred` (no allocation: this runs on
    /// every write that goes around the cache).
    pub fn any_overlapping(
        &self,
        dev: DevId,
        b0: u64,
        b1: u64,
        pred: impl Fn(&Extent) -> bool,
    ) -> bool {
        self.overlapping_iter(dev, b0, b1).any(|(_, e)| pred(&e))
    }

    /// Splits entries so that `b` is an entry boundary (no entry strictly contains it).
    fn split_at(&mut self, dev: DevId, b: u64) {
        if let Some((&(d, s), &e)) = self.map.range(..(dev.0, b)).next_back() {
            if d == dev.0 && s < b && s + u64::from(e.len) > b {
                let left = (b - s) as u32;
                self.take(dev, s);
                self.put(dev, s, Extent { len: left, ..e });
                self.put(
                    dev,
                    b,
                    Extent {
                        len: e.len - left,
                        cache_block: e.cache_block + left,
                        ..e
                    },
                );
            }
        }
    }

    /// Removes whatever is mapped in `[b0, b1)`; returns the number of dirty blocks dropped.
    pub fn remove_range(&mut self, dev: DevId, b0: u64, b1: u64) -> u64 {
        if b0 >= b1 {
            return 0;
        }
        self.split_at(dev, b0);
        self.split_at(dev, b1);
        let mut dirty = 0;
        for (s, _) in self.overlapping(dev, b0, b1) {
            let e = self.take(dev, s);
            if e.dirty {
                dirty += u64::from(e.len);
            }
        }
        dirty
    }

    /// Maps `[block, block + ext.len)` to `ext`, replacing anything there. The target cache
    /// blocks must be unreferenced (the allocator hands out each block once per generation).
    pub fn insert(&mut self, dev: DevId, block: u64, ext: Extent, crcs: &[u32]) {
        self.insert_inner(dev, block, ext, crcs, false);
    }

    /// Like `insert`, for replay: an older entry that still references the target cache
    /// blocks (the journal recorded their reuse) loses them.
    pub fn insert_replayed(&mut self, dev: DevId, block: u64, ext: Extent, crcs: &[u32]) {
        self.insert_inner(dev, block, ext, crcs, true);
    }

    fn insert_inner(&mut self, dev: DevId, block: u64, ext: Extent, crcs: &[u32], steal: bool) {
        assert_eq!(crcs.len(), ext.len as usize);
        self.remove_range(dev, block, block + u64::from(ext.len));
        for i in (0..ext.len).filter(|_| steal) {
            let v = self.owner[(ext.cache_block + i) as usize];
            if v != NO_OWNER {
                let (d, b) = unpack(v);
                self.remove_range(d, b, b + 1);
            }
        }
        self.put(dev, block, ext);
        self.crc[ext.cache_block as usize..(ext.cache_block + ext.len) as usize]
            .copy_from_slice(crcs);
    }

    /// Covers `[b0, b1)` with cached pieces and holes, in order.
    pub fn lookup(&self, dev: DevId, b0: u64, b1: u64) -> Vec<Seg> {
        let mut out = Vec::new();
        let mut at = b0;
        for (s, e) in self.overlapping_iter(dev, b0, b1) {
            let from = s.max(b0);
            let to = (s + u64::from(e.len)).min(b1);
            if from > at {
                out.push(Seg {
                    block: at,
                    len: from - at,
                    ext: None,
                });
            }
            let skip = (from - s) as u32;
            out.push(Seg {
                block: from,
                len: to - from,
                ext: Some(Extent {
                    len: (to - from) as u32,
                    cache_block: e.cache_block + skip,
                    ..e
                }),
            });
            at = to;
        }
        if at < b1 {
            out.push(Seg {
                block: at,
                len: b1 - at,
                ext: None,
            });
        }
        out
    }

    /// True if every block of `[b, b + len)` still maps to `cache_block + (x - b)`.
    pub fn maps_to(&self, dev: DevId, b: u64, len: u32, cache_block: u32) -> bool {
        let segs = self.lookup(dev, b, b + u64::from(len));
        segs.iter().all(|s| {
            s.ext
                .is_some_and(|e| u64::from(e.cache_block) == u64::from(cache_block) + (s.block - b))
        })
    }

    /// Marks clean the parts of `[b, b + len)` still mapped to `cache_block + (x - b)`.
    /// Returns the number of blocks that changed state.
    pub fn mark_clean(&mut self, dev: DevId, b: u64, len: u32, cache_block: u32) -> u64 {
        let b1 = b + u64::from(len);
        self.split_at(dev, b);
        self.split_at(dev, b1);
        let mut cleaned = 0;
        for (s, e) in self.overlapping(dev, b, b1) {
            let matches = u64::from(e.cache_block) == u64::from(cache_block) + (s - b);
            if e.dirty && matches {
                self.take(dev, s);
                self.put(dev, s, Extent { dirty: false, ..e });
                cleaned += u64::from(e.len);
            }
        }
        cleaned
    }

    /// Removes every entry pointing into `bucket`; returns the number of dirty blocks dropped.
    pub fn drop_bucket(&mut self, bucket: u32) -> u64 {
        let mut dirty = 0;
        let first = bucket * self.bpb;
        for cb in first..first + self.bpb {
            let v = self.owner[cb as usize];
            if v == NO_OWNER {
                continue;
            }
            let (dev, b) = unpack(v);
            let (&(_, s), &e) = self
                .map
                .range(..=(dev.0, b))
                .next_back()
                .expect("owner names a block with no entry");
            assert!(s + u64::from(e.len) > b && e.cache_block + (b - s) as u32 == cb);
            let e = self.take(dev, s);
            if e.dirty {
                dirty += u64::from(e.len);
            }
        }
        dirty
    }

    /// Live entries in a bucket (for copying GC), in cache order.
    pub fn entries_in_bucket(&self, bucket: u32) -> Vec<(DevId, u64, Extent)> {
        let mut out = Vec::new();
        let first = bucket * self.bpb;
        let mut cb = first;
        while cb < first + self.bpb {
            let v = self.owner[cb as usize];
            if v == NO_OWNER {
                cb += 1;
                continue;
            }
            let (dev, b) = unpack(v);
            let (&(_, s), &e) = self
                .map
                .range(..=(dev.0, b))
                .next_back()
                .expect("owner without entry");
            out.push((dev, s, e));
            cb = e.cache_block + e.len;
        }
        out
    }

    /// Up to `max_blocks` of dirty entries in backing order, starting at `from` (wrapping).
    pub fn dirty_from(&self, from: (DevId, u64), max_blocks: u64) -> Vec<(DevId, u64, Extent)> {
        let mut out = Vec::new();
        let mut total = 0;
        let key = (from.0 .0, from.1);
        for &(d, s) in self
            .dirty_keys
            .range(key..)
            .chain(self.dirty_keys.range(..key))
        {
            if total >= max_blocks {
                break;
            }
            let e = self.map[&(d, s)];
            total += u64::from(e.len);
            out.push((DevId(d), s, e));
        }
        out
    }

    /// Dirty blocks belonging to one device.
    pub fn dev_dirty_blocks(&self, dev: DevId) -> u64 {
        self.dev_blocks.get(dev.0 as usize).map_or(0, |c| c.dirty)
    }

    /// Cached blocks belonging to one device (a counter: `status` costs no scan).
    pub fn dev_live_blocks(&self, dev: DevId) -> u64 {
        self.dev_blocks.get(dev.0 as usize).map_or(0, |c| c.live)
    }

    /// Every entry, in key order (for checkpoints).
    pub fn iter(&self) -> impl Iterator<Item = (DevId, u64, &Extent)> + '_ {
        self.map.iter().map(|(&(d, s), e)| (DevId(d), s, e))
    }

    /// Recomputes every derived field from the entries and compares (test and `check` use).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut live = vec![0u32; self.bucket_live.len()];
        let mut dirty = vec![0u32; self.bucket_live.len()];
        let mut last: Option<(u32, u64)> = None;
        let mut owners = 0usize;
        for (&(d, s), e) in &self.map {
            if let Some((ld, lend)) = last {
                if ld == d && lend > s {
                    return Err(format!("entries overlap at dev {d} block {s}"));
                }
            }
            last = Some((d, s + u64::from(e.len)));
            let b = self.bucket_of(e.cache_block) as usize;
            live[b] += e.len;
            if e.dirty {
                dirty[b] += e.len;
                if !self.dirty_keys.contains(&(d, s)) {
                    return Err("dirty entry missing from dirty set".into());
                }
            }
            for i in 0..e.len {
                if self.owner[(e.cache_block + i) as usize] != pack(DevId(d), s + u64::from(i)) {
                    return Err(format!("owner of cache block {} wrong", e.cache_block + i));
                }
            }
            owners += e.len as usize;
        }
        if owners != self.owner.iter().filter(|&&o| o != NO_OWNER).count() {
            return Err("stray owner entries".into());
        }
        if live != self.bucket_live || dirty != self.bucket_dirty {
            return Err("bucket counters disagree with entries".into());
        }
        if self.dirty_keys.len() != self.map.values().filter(|e| e.dirty).count() {
            return Err("dirty set has stray keys".into());
        }
        let mut dev_blocks = vec![DevBlocks::default(); self.dev_blocks.len()];
        for (&(d, _), e) in &self.map {
            let Some(c) = dev_blocks.get_mut(d as usize) else {
                return Err(format!("device {d} has entries but no counters"));
            };
            c.live += u64::from(e.len);
            if e.dirty {
                c.dirty += u64::from(e.len);
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

    fn ext(len: u32, cb: u32, dirty: bool) -> Extent {
        Extent {
            len,
            cache_block: cb,
            gen: 0,
            dirty,
        }
    }

    #[test]
    fn insert_split_remove_keep_invariants() {
        let mut ix = Index::new(4, 16);
        let d = DevId(1);
        ix.insert(d, 10, ext(8, 0, true), &[0; 8]);
        ix.insert(d, 12, ext(2, 16, false), &[0; 2]);
        ix.check_invariants().unwrap();
        let segs = ix.lookup(d, 8, 20);
        assert_eq!(segs.len(), 5);
        assert_eq!(segs[0].ext, None);
        assert_eq!(segs[1].ext.unwrap().cache_block, 0);
        assert_eq!(segs[2].ext.unwrap().cache_block, 16);
        assert_eq!(segs[3].ext.unwrap().cache_block, 4);
        assert_eq!(ix.dirty_blocks, 6);
        assert_eq!(ix.remove_range(d, 11, 15), 2);
        ix.check_invariants().unwrap();
        assert_eq!(ix.mark_clean(d, 10, 8, 0), 4);
        assert_eq!(ix.dirty_blocks, 0);
        ix.check_invariants().unwrap();
        assert_eq!(ix.drop_bucket(0), 0);
        assert_eq!(ix.live_blocks, 0);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn mark_clean_skips_remapped_blocks() {
        let mut ix = Index::new(4, 16);
        let d = DevId(0);
        ix.insert(d, 0, ext(4, 0, true), &[0; 4]);
        ix.insert(d, 1, ext(1, 20, true), &[0]);
        assert_eq!(ix.mark_clean(d, 0, 4, 0), 3);
        assert_eq!(ix.dirty_blocks, 1);
        assert!(!ix.maps_to(d, 0, 4, 0));
        assert!(ix.maps_to(d, 2, 2, 2));
        ix.check_invariants().unwrap();
    }
}
