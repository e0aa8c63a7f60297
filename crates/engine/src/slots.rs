//! The index's per-cache-block arrays and its hash table, readable without the state lock.
//!
//! `Slots` holds what a cache hit needs: for each cache block its packed owner (6 bytes, as a
//! `u32` and a `u16`), its crc32c and its dirty bit, and the Robin Hood hash table of `cb + 1`
//! keyed through the owner (see `index` for the layout and the RAM budget). Every cell is an
//! atomic accessed with `Relaxed` loads and stores, so a reader racing the writer reads
//! possibly inconsistent values but never undefined ones.
//!
//! Invariants:
//! - there is one writer at a time (the `Index` that owns the `&mut`, under the state lock);
//!   it brackets every change with [`Slots::write_begin`] / [`Slots::write_end`], which make
//!   `seq` odd during the change and advance it to the next even value after it (a seqlock);
//! - a reader ([`IndexReader`]) takes `seq`, reads, and keeps what it read only if `seq` is
//!   unchanged and even afterwards, so what it keeps is exactly what the index held at one
//!   moment between two changes. Its probes are bounded (`READ_PROBES`), so a torn table cannot
//!   keep it looping; running out of probes is a failed read, never a wrong answer;
//! - `write_end` ends with a `SeqCst` fence, and a reader that pins the buckets it found does so
//!   before a `SeqCst` fence and its final `seq` check. Of a writer that removed an entry and
//!   then (later, under the lock) looked at the bucket's pins to reuse it, and a reader that
//!   pinned that bucket, one of the two sees the other: the writer sees the pin and does not
//!   reuse the bucket, or the reader sees `seq` moved and drops its pin and its answer. This is
//!   what lets a hit pin without the lock (see `alloc`'s pin protocol).
//! - the arrays are sized once and never reallocated, so a reader's `Arc` stays valid.

use crate::units::CacheBlock;
use std::sync::atomic::{fence, AtomicU16, AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;

/// Probes a lock-free lookup makes at most per block before giving up (falling back to the
/// locked path). Robin Hood probe runs at ≤ 90 % load are far shorter.
const READ_PROBES: usize = 128;

/// Spreads a packed key over 64 bits (the splitmix64 finalizer).
fn mix(k: u64) -> u64 {
    let mut z = k;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An array of `n` zeroed atomics, allocated zeroed (`calloc`): the kernel maps its pages as
/// they are first written, so an empty cache's arrays cost no RAM (writing each element
/// instead would touch every page: 1 GiB at start for an empty 1 TiB cache).
fn zeroed<T: Zeroable>(n: usize) -> Box<[T]> {
    let b = Box::<[T]>::new_zeroed_slice(n);
    // SAFETY: `T` is an atomic integer (see `Zeroable`), for which all-zero bytes are a valid
    // value (zero).
    unsafe { b.assume_init() }
}

/// Atomic integers, whose all-zero bit pattern is the value 0.
trait Zeroable {}
impl Zeroable for AtomicU16 {}
impl Zeroable for AtomicU32 {}
impl Zeroable for AtomicU64 {}

pub struct Slots {
    seq: AtomicU64,
    owner_lo: Box<[AtomicU32]>,
    owner_hi: Box<[AtomicU16]>,
    crc: Box<[AtomicU32]>,
    dirty: Box<[AtomicU64]>,
    table: Box<[AtomicU32]>,
}

impl Slots {
    /// Arrays for `blocks` cache blocks and a table at most 90 % full when all are owned.
    pub fn new(blocks: usize) -> Slots {
        let slots = blocks + blocks / 9 + 1;
        Slots {
            seq: AtomicU64::new(0),
            owner_lo: zeroed(blocks),
            owner_hi: zeroed(blocks),
            crc: zeroed(blocks),
            dirty: zeroed(blocks.div_ceil(64)),
            table: zeroed(slots),
        }
    }

    pub fn heap_bytes(&self) -> usize {
        self.owner_lo.len() * 6
            + self.crc.len() * 4
            + self.dirty.len() * 8
            + self.table.len() * 4
            + std::mem::size_of::<Slots>()
    }

    pub fn blocks(&self) -> u32 {
        self.owner_lo.len() as u32
    }

    pub fn table_len(&self) -> usize {
        self.table.len()
    }

    pub fn slot(&self, pos: usize) -> u32 {
        self.table[pos].load(Relaxed)
    }

    fn set_slot(&self, pos: usize, v: u32) {
        self.table[pos].store(v, Relaxed);
    }

    pub fn owner(&self, cb: CacheBlock) -> u64 {
        let i = cb.idx();
        u64::from(self.owner_lo[i].load(Relaxed)) | u64::from(self.owner_hi[i].load(Relaxed)) << 32
    }

    pub fn set_owner(&self, cb: CacheBlock, v: u64) {
        debug_assert!(v < 1 << 48);
        let i = cb.idx();
        self.owner_lo[i].store(v as u32, Relaxed);
        self.owner_hi[i].store((v >> 32) as u16, Relaxed);
    }

    pub fn crc(&self, cb: CacheBlock) -> u32 {
        self.crc[cb.idx()].load(Relaxed)
    }

    pub fn set_crc(&self, cb: CacheBlock, crc: u32) {
        self.crc[cb.idx()].store(crc, Relaxed);
    }

    pub fn is_dirty(&self, cb: CacheBlock) -> bool {
        self.dirty[cb.idx() / 64].load(Relaxed) & (1 << (cb.get() % 64)) != 0
    }

    /// Sets or clears the dirty bit (writer only: a load and a store, not a read-modify-write).
    pub fn set_dirty(&self, cb: CacheBlock, on: bool) {
        let w = &self.dirty[cb.idx() / 64];
        let bit = 1 << (cb.get() % 64);
        let v = w.load(Relaxed);
        w.store(if on { v | bit } else { v & !bit }, Relaxed);
    }

    /// Starts a change (writer only).
    pub fn write_begin(&self) {
        let s = self.seq.load(Relaxed);
        debug_assert!(s.is_multiple_of(2), "nested index change");
        self.seq.store(s + 1, Relaxed);
        fence(Release);
    }

    /// Ends a change (writer only); see the module header for the `SeqCst` fence.
    pub fn write_end(&self) {
        let s = self.seq.load(Relaxed);
        self.seq.store(s + 1, Release);
        fence(SeqCst);
    }

    fn home(&self, key: u64) -> usize {
        ((u128::from(mix(key)) * self.table.len() as u128) >> 64) as usize
    }

    /// How far slot `pos` is from the home of the key it holds.
    pub fn displacement(&self, pos: usize) -> usize {
        let cb = self.slot(pos).wrapping_sub(1);
        let home = self.home(self.owner(CacheBlock::new(cb.min(self.blocks().saturating_sub(1)))));
        (pos + self.table.len() - home) % self.table.len()
    }

    pub fn next_slot(&self, pos: usize) -> usize {
        if pos + 1 == self.table.len() {
            0
        } else {
            pos + 1
        }
    }

    /// The slot holding `key` and its cache block. `Err(())`: gave up after `max_probes`.
    fn probe(&self, key: u64, max_probes: usize) -> Result<Option<(usize, CacheBlock)>, ()> {
        let mut pos = self.home(key);
        for dist in 0..max_probes {
            let s = self.slot(pos);
            if s == 0 {
                return Ok(None);
            }
            let cb = CacheBlock::new(s - 1);
            if self.owner(cb) == key {
                return Ok(Some((pos, cb)));
            }
            if self.displacement(pos) < dist {
                return Ok(None);
            }
            pos = self.next_slot(pos);
        }
        Err(())
    }

    /// The slot holding `key` and its cache block (writer, or any holder of the state lock).
    pub fn find(&self, key: u64) -> Option<(usize, CacheBlock)> {
        self.probe(key, self.table.len() + 1)
            .expect("a consistent table ends every probe run")
    }

    /// Adds `cb` (whose owner is already set, and not in the table) to the table.
    pub fn table_insert(&self, cb: CacheBlock) {
        let mut carry = cb.get() + 1;
        let mut pos = self.home(self.owner(cb));
        let mut dist = 0;
        loop {
            let s = self.slot(pos);
            if s == 0 {
                self.set_slot(pos, carry);
                return;
            }
            let theirs = self.displacement(pos);
            if theirs < dist {
                self.set_slot(pos, carry);
                carry = s;
                dist = theirs;
            }
            pos = self.next_slot(pos);
            dist += 1;
        }
    }

    /// Empties slot `pos`, shifting the rest of its probe run back.
    pub fn table_remove(&self, mut pos: usize) {
        loop {
            let next = self.next_slot(pos);
            let s = self.slot(next);
            if s == 0 || self.displacement(next) == 0 {
                self.set_slot(pos, 0);
                return;
            }
            self.set_slot(pos, s);
            pos = next;
        }
    }
}

/// A lock-free reader of the index (clones share the arrays).
#[derive(Clone)]
pub struct IndexReader {
    slots: Arc<Slots>,
    bpb: u32,
}

/// What a lock-free read of one block found: its cache block, crc and dirty bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub cache_block: CacheBlock,
    pub crc: u32,
    pub dirty: bool,
}

impl IndexReader {
    pub fn new(slots: Arc<Slots>, bpb: u32) -> IndexReader {
        IndexReader { slots, bpb }
    }

    pub fn blocks_per_bucket(&self) -> u32 {
        self.bpb
    }

    /// Starts a read: the sequence to check against, or `None` while a change is under way.
    pub fn begin(&self) -> Option<u64> {
        let s = self.slots.seq.load(Acquire);
        s.is_multiple_of(2).then_some(s)
    }

    /// Looks up packed key `key` inside a read started at `begin`. `None`: not cached, or the
    /// probe gave up; either way only [`IndexReader::valid`] says whether it means anything.
    pub fn get(&self, key: u64) -> Option<Found> {
        let (_, cb) = self.slots.probe(key, READ_PROBES).ok()??;
        Some(Found {
            cache_block: cb,
            crc: self.slots.crc(cb),
            dirty: self.slots.is_dirty(cb),
        })
    }

    /// Ends a read: true if nothing changed since `begin` returned `seq`. Pins taken before
    /// this call are ordered before its check (see the module header).
    pub fn valid(&self, seq: u64) -> bool {
        fence(SeqCst);
        self.slots.seq.load(Relaxed) == seq
    }
}
