//! The RAM budget of the in-memory metadata, measured by a counting allocator (tests only).
//!
//! Invariant checked: index, checksums, dirty bits, bucket tables and their summaries together
//! take at most `BUDGET_BYTES_PER_BLOCK` per cache block when the cache is full of 4 KiB
//! random data, for the default and the smallest common bucket size; and a 4 KiB cache hit
//! allocates nothing. The allocator counts per thread, so tests running in parallel do not
//! disturb each other.

use crate::alloc::Buckets;
use crate::index::{Extent, Index};
use crate::types::DevId;
use crate::units::{BackingBlock, CacheBlock, Gen};
use rand::{Rng, SeedableRng};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The budget: dm-cache's smq manages 16 bytes per block.
pub const BUDGET_BYTES_PER_BLOCK: f64 = 16.0;

struct Counting;

thread_local! {
    static NET: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn add(delta: i64) {
    // `try_with`: allocations during thread teardown are not counted.
    let _ = NET.try_with(|n| {
        let v = n.get() + delta;
        n.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        add(layout.size() as i64);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        add(-(layout.size() as i64));
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        add(new as i64 - layout.size() as i64);
        System.realloc(ptr, layout, new)
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Net bytes this thread holds now, and the most it held since the last `reset_peak`.
pub fn held() -> (i64, i64) {
    (NET.with(Cell::get), PEAK.with(Cell::get))
}

pub fn reset_peak() {
    let now = NET.with(Cell::get);
    PEAK.with(|p| p.set(now));
}

/// Fills every cache block of a fresh index with a random 4 KiB backing block (about half of
/// them dirty) and returns the metadata bytes per cache block, with the peak during the fill.
fn full_cache_bytes_per_block(nbuckets: u32, bpb: u32, seed: u64) -> (f64, f64) {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let before = held().0;
    reset_peak();
    let mut index = Index::new(nbuckets, bpb);
    let total = nbuckets * bpb;
    for cb in 0..total {
        let dev = DevId::new(r.gen_range(0..4));
        let block = BackingBlock::new(r.gen_range(0..1u64 << 36));
        let ext = Extent {
            len: 1,
            cache_block: CacheBlock::new(cb),
            dirty: r.gen_bool(0.5),
        };
        index.insert(dev, block, ext, &[r.gen()]);
    }
    let buckets = Buckets::new(
        vec![Gen::new(0); nbuckets as usize],
        &index.bucket_live,
        bpb,
    );
    let (now, peak) = held();
    let per_block = |bytes: i64| (bytes - before) as f64 / f64::from(total);
    let result = (per_block(now), per_block(peak));
    assert_eq!(
        index.heap_bytes() + buckets.heap_bytes(),
        (now - before) as u64,
        "heap_bytes must account for every allocation"
    );
    drop((index, buckets));
    result
}

#[test]
fn metadata_of_a_full_cache_fits_the_budget() {
    let seed = crate::test_seed("metadata_of_a_full_cache_fits_the_budget");
    // 512 KiB buckets (the default) and 64 KiB buckets, 4 KiB blocks, 1 GiB of cache.
    for (nbuckets, bpb) in [(2048, 128), (16384, 16)] {
        let (steady, peak) = full_cache_bytes_per_block(nbuckets, bpb, seed);
        eprintln!("{bpb} blocks per bucket: {steady:.2} bytes per cache block (peak {peak:.2})");
        assert!(
            steady <= BUDGET_BYTES_PER_BLOCK,
            "{bpb} blocks per bucket: {steady:.2} bytes per block exceeds the budget (seed {seed})"
        );
        assert!(
            peak <= steady + 0.5,
            "{bpb} blocks per bucket: filling peaked at {peak:.2} bytes per block (steady {steady:.2})"
        );
    }
}

/// A cache hit of 4 KiB allocates nothing (the issue: no allocation per request). Measured on
/// this thread, after every stream slot of the sequential detector has been used once (its
/// slots grow on first use only).
#[test]
fn a_cached_4k_read_allocates_nothing() {
    use crate::set::{format_backing, CacheSet, FormatOptions};
    use crate::state::Config;
    use crate::types::CacheMode;
    use blockdev::{BlockDevice, MemDevice};
    use std::sync::Arc;
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let opts = FormatOptions {
        bucket_size: 64 << 10,
        ..FormatOptions::default()
    };
    CacheSet::format(&*cache, &opts, false).unwrap();
    format_backing(&*backing, "vol", CacheMode::Writethrough, false).unwrap();
    let config = Config {
        background: false,
        ..Config::default()
    };
    let (set, _) = CacheSet::open(cache, config).unwrap();
    let vol = set.attach(backing).unwrap();
    vol.set_sequential_cutoff(0).unwrap();
    let mut buf = vec![0u8; 4096];
    // Misses (promoted), then hits, each at its own stream slot.
    let slots = crate::policy::SEQ_SLOTS as u64 + 1;
    for _ in 0..2 {
        for i in 0..slots {
            vol.read(i * 8192, &mut buf).unwrap();
        }
    }
    let hits = vol.status().stats.total.cache_hits;
    reset_peak();
    let before = held().0;
    vol.read(8192, &mut buf).unwrap();
    let peak = held().1;
    assert_eq!(vol.status().stats.total.cache_hits, hits + 1, "a hit");
    assert_eq!(peak, before, "the hit allocated {} bytes", peak - before);
}

/// Resident memory of this process in bytes (Linux `/proc/self/statm`).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// An empty index costs address space, not RAM: its arrays are allocated zeroed and the
/// kernel maps their pages only as they are written (an index for a 64 GiB cache is about
/// 240 MiB of arrays; writing them at creation, as an early version of `slots` did, made an
/// empty 1 TiB cache start with 1 GiB resident).
#[test]
fn an_empty_index_is_not_resident() {
    let (nbuckets, bpb) = (131_072, 128); // 64 GiB of 512 KiB buckets
    let before = resident_bytes();
    let index = Index::new(nbuckets, bpb);
    let grown = resident_bytes().saturating_sub(before);
    let arrays = index.heap_bytes();
    assert!(arrays > 200 << 20, "the arrays are {arrays} bytes");
    assert!(
        grown < arrays / 8,
        "creating an empty index made {grown} of its {arrays} bytes resident"
    );
}
