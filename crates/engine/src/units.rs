//! The engine's numbering units, each its own type so the compiler keeps them apart: a bucket
//! index is not a cache block (both were `u32`), a backing block is not a byte offset (both
//! were `u64`), and a generation is not any other byte.
//!
//! - [`Bucket`]: a bucket of the cache device's data area, `0..nbuckets`;
//! - [`CacheBlock`]: a block of the cache device's data area, `0..nbuckets * bpb`; block `cb`
//!   lies in bucket `cb / bpb` (bpb: blocks per bucket, from the layout);
//! - [`Gen`]: a bucket's generation, bumped (wrapping) each time the bucket is emptied;
//! - [`BackingBlock`]: a block of a backing device's data area (block-size units, the same
//!   block size as the cache), below `index::BLOCK_LIMIT`; byte offsets stay `u64` and convert
//!   only through [`BackingBlock::of_offset`], [`BackingBlock::ceil_of_offset`] and
//!   [`BackingBlock::offset`];
//! - [`human`]: byte counts as messages show them.
//!
//! Invariants:
//! - the integer inside is private: a number becomes a unit only through `new` (a decoded
//!   field, a test's literal) and leaves it only through `get` (an encoding, a hash, a
//!   message) or `idx` (a table index); everything else goes through the methods and
//!   operators here, so a raw number cannot be taken for the wrong unit by accident (`DevId`,
//!   in `types`, is kept the same way);
//! - every type is `repr(transparent)` over its integer: zero cost, and arrays of them have
//!   the element size of the integer (the RAM budget counts those bytes);
//! - on-disk encodings (journal entries, checkpoints) write and read the inner integer exactly
//!   as before: the types change nothing on disk;
//! - arithmetic is only what the engine needs (an offset added to a block or a bucket, the
//!   distance between two backing blocks, a range of backing blocks, a cache block's bucket),
//!   not a numeric tower; `Display` prints the bare number, so messages read as before.
//!
//! Where raw integers remain, and why:
//! - counts and lengths (`Extent::len`, blocks per bucket, a bucket's live and dirty counts,
//!   offsets inside a bucket) are plain `u32`/`u64`: they are amounts, not positions;
//! - the per-bucket tables (`Index::bucket_live`/`bucket_dirty`, the bucket state and pin
//!   arrays) are plain `Vec`s indexed with `Bucket::idx`, and the per-block arrays of `slots`
//!   with `CacheBlock::idx`; the hash table of `slots` stores `cb + 1` as a raw `u32` (0 is
//!   the empty slot), and an owner is a packed `u64` (`index::pack`); `Touches` stores
//!   `bucket + 1` the same way: these are encodings, private to their module;
//! - the policy state takes the units at its interface (`policy::reclaim_rank` a `Bucket`,
//!   `admit::Ghost::key` a `DevId` and a `BackingBlock`, `fillhits::FillHits` backing blocks)
//!   and hashes their raw numbers inside;
//! - byte offsets (`Volume` requests, cache and backing device I/O, readahead windows) are
//!   `u64`, as in the public API; the read path's miss-fill window alignment and the
//!   sequential detector work on raw block numbers or bytes locally;
//! - the public API keeps its integers: `format::Layout` keeps `block_offset(u32)` and its
//!   `u32` counts (the engine calls `Layout::cache_block_offset(CacheBlock)`), and `Volume`
//!   takes byte offsets. Only `Loaded::gens` (from `load_metadata`) now holds `Gen`s.

use std::fmt;
use std::ops::{Add, Sub};

/// A bucket index (`0..nbuckets`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Bucket(u32);

/// A block of the cache device's data area (`0..nbuckets * bpb`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct CacheBlock(u32);

/// A bucket's generation (wraps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Gen(u8);

/// A block of a backing device's data area (block-size units).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct BackingBlock(u64);

impl Bucket {
    /// Bucket `n`.
    pub const fn new(n: u32) -> Bucket {
        Bucket(n)
    }

    /// The bucket's number, for encodings (journal, checkpoint) and messages.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// For indexing the per-bucket tables.
    pub fn idx(self) -> usize {
        self.0 as usize
    }

    /// Buckets `0..n`.
    pub fn all(n: usize) -> impl Iterator<Item = Bucket> {
        (0..n as u32).map(Bucket)
    }

    /// The cache blocks of this bucket, in order.
    pub fn blocks(self, bpb: u32) -> impl Iterator<Item = CacheBlock> {
        let first = CacheBlock::first_of(self, bpb);
        (0..bpb).map(move |i| first + i)
    }
}

/// `b + n`: the bucket `n` further on.
impl Add<u32> for Bucket {
    type Output = Bucket;
    fn add(self, n: u32) -> Bucket {
        Bucket(self.0 + n)
    }
}

impl CacheBlock {
    /// Cache block `n`.
    pub const fn new(n: u32) -> CacheBlock {
        CacheBlock(n)
    }

    /// The block's number, for encodings (journal, checkpoint, the packed slots) and messages.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// For indexing the per-cache-block arrays.
    pub fn idx(self) -> usize {
        self.0 as usize
    }

    /// The bucket holding this block.
    pub fn bucket(self, bpb: u32) -> Bucket {
        Bucket(self.0 / bpb)
    }

    /// The first block of bucket `b`.
    pub fn first_of(b: Bucket, bpb: u32) -> CacheBlock {
        CacheBlock(b.0 * bpb)
    }
}

/// `cb + n`: the block `n` further on.
impl Add<u32> for CacheBlock {
    type Output = CacheBlock;
    fn add(self, n: u32) -> CacheBlock {
        CacheBlock(self.0 + n)
    }
}

impl Gen {
    /// Generation `n`.
    pub const fn new(n: u8) -> Gen {
        Gen(n)
    }

    /// The generation's number, for encodings (journal, checkpoint).
    pub const fn get(self) -> u8 {
        self.0
    }

    /// The generation after this one (wrapping).
    #[must_use]
    pub fn next(self) -> Gen {
        Gen(self.0.wrapping_add(1))
    }
}

impl BackingBlock {
    /// Backing block `n`.
    pub const fn new(n: u64) -> BackingBlock {
        BackingBlock(n)
    }

    /// The block's number, for encodings (journal, checkpoint, the packed owner) and messages.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The blocks `[b0, b1)`, in order.
    pub fn range(b0: BackingBlock, b1: BackingBlock) -> impl Iterator<Item = BackingBlock> {
        (b0.0..b1.0).map(BackingBlock)
    }

    /// The block holding byte `off` (blocks of `bs` bytes).
    pub fn of_offset(off: u64, bs: u64) -> BackingBlock {
        BackingBlock(off / bs)
    }

    /// The first block starting at or after byte `off`: the end (exclusive) of the blocks a
    /// byte range ending at `off` touches, or the first block wholly after `off`.
    pub fn ceil_of_offset(off: u64, bs: u64) -> BackingBlock {
        BackingBlock(off.div_ceil(bs))
    }

    /// The blocks `[b0, b1)` that the byte range `[off, off + len)` touches.
    pub fn touched_by(off: u64, len: u64, bs: u64) -> (BackingBlock, BackingBlock) {
        (
            BackingBlock::of_offset(off, bs),
            BackingBlock::ceil_of_offset(off + len, bs),
        )
    }

    /// The byte offset where this block starts.
    pub fn offset(self, bs: u64) -> u64 {
        self.0 * bs
    }
}

/// `b + n`: the block `n` further on.
impl Add<u64> for BackingBlock {
    type Output = BackingBlock;
    fn add(self, n: u64) -> BackingBlock {
        BackingBlock(self.0 + n)
    }
}

/// `b - n`: the block `n` before.
impl Sub<u64> for BackingBlock {
    type Output = BackingBlock;
    fn sub(self, n: u64) -> BackingBlock {
        BackingBlock(self.0 - n)
    }
}

/// `b1 - b0`: how many blocks from `b0` to `b1`.
impl Sub for BackingBlock {
    type Output = u64;
    fn sub(self, b0: BackingBlock) -> u64 {
        self.0 - b0.0
    }
}

macro_rules! display_inner {
    ($($t:ty),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    )*};
}
display_inner!(Bucket, CacheBlock, Gen, BackingBlock);

/// Sizes in messages: bytes, and MiB or GiB beside them when that is shorter to read.
pub(crate) fn human(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    match bytes {
        b if b >= 1 << 30 => format!("{:.1} GiB", b as f64 / (MIB * 1024.0)),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / MIB),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_as_the_integers() {
        use std::mem::size_of;
        assert_eq!(size_of::<Bucket>(), 4);
        assert_eq!(size_of::<CacheBlock>(), 4);
        assert_eq!(size_of::<Gen>(), 1);
        assert_eq!(size_of::<BackingBlock>(), 8);
        assert_eq!(size_of::<(u64, Bucket)>(), size_of::<(u64, u32)>());
    }

    #[test]
    fn conversions() {
        assert_eq!(CacheBlock(37).bucket(16), Bucket(2));
        assert_eq!(CacheBlock::first_of(Bucket(2), 16) + 5, CacheBlock(37));
        assert_eq!(
            Bucket(1).blocks(4).collect::<Vec<_>>(),
            (4..8).map(CacheBlock).collect::<Vec<_>>()
        );
        assert_eq!(Gen(255).next(), Gen(0));
        assert_eq!(BackingBlock::of_offset(8191, 4096), BackingBlock(1));
        assert_eq!(BackingBlock::ceil_of_offset(8191, 4096), BackingBlock(2));
        assert_eq!(BackingBlock::ceil_of_offset(8192, 4096), BackingBlock(2));
        assert_eq!(BackingBlock(3).offset(4096), 12288);
        assert_eq!(BackingBlock(7) - BackingBlock(3), 4);
        assert_eq!(format!("{}", CacheBlock(9)), "9");
        assert_eq!(Bucket::new(3) + 1, Bucket(4));
        assert_eq!(
            BackingBlock::range(BackingBlock(5), BackingBlock(8)).collect::<Vec<_>>(),
            (5..8).map(BackingBlock::new).collect::<Vec<_>>()
        );
        assert_eq!(
            BackingBlock::range(BackingBlock(8), BackingBlock(8)).count(),
            0
        );
        let b = BackingBlock::new(1 << 40);
        assert_eq!(BackingBlock::new(b.get()), b);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(512), "512 bytes");
        assert_eq!(human(4096), "4.0 KiB");
        assert_eq!(human(12 << 20), "12.0 MiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
