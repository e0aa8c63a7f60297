//! Measures the RAM the index uses per GiB of cached 4 KiB random data.
//!
//! A counting global allocator records live heap bytes; the cache set is opened on an
//! in-memory cache device (allocated before the baseline), filled with 4 KiB writes at random,
//! non-adjacent offsets (so every block is its own index entry: the worst case), and the heap
//! growth is divided by the bytes cached.
//!
//! Run: `cargo run --release -p engine --example index_memory [CACHE_MIB]`

use blockdev::{BlockDevice, MemDevice};
use engine::{CacheMode, CacheSet, Config, FormatOptions};
use rand::{seq::SliceRandom, SeedableRng};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    let cache_mib: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(cache_mib << 20));
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(((4 * cache_mib) << 20) + 8192));
    CacheSet::format(&*cache, &FormatOptions::default(), false).unwrap();
    engine::format_backing(&*backing, "m", CacheMode::Writethrough, false).unwrap();
    let before = LIVE.load(Ordering::Relaxed);
    let (set, _) = CacheSet::open(
        cache,
        Config {
            background: false,
            ..Config::default()
        },
    )
    .unwrap();
    let vol = set.attach(backing).unwrap();
    vol.set_sequential_cutoff(0).unwrap();
    let data_bytes = u64::from(set.layout().nbuckets) * u64::from(set.layout().bucket_size);
    // Every other 4 KiB block of a region twice the cache, shuffled: no two writes adjacent.
    let mut slots: Vec<u64> = (0..vol.size_bytes() / 8192).collect();
    slots.shuffle(&mut rand::rngs::StdRng::seed_from_u64(1));
    let target = data_bytes * 9 / 10 / 4096;
    let buf = vec![0x5au8; 4096];
    for s in slots.iter().take(target as usize) {
        vol.write(s * 8192, &buf, false).unwrap();
    }
    set.commit().unwrap();
    let (entries, estimate) = set.index_memory();
    let after = LIVE.load(Ordering::Relaxed);
    let cached = set.occupancy().clean_bytes;
    let used = after - before;
    println!(
        "cache {} MiB: {} entries, {} MiB cached, heap growth {:.1} MiB => {:.1} MiB RAM per GiB cached ({:.1} bytes per 4 KiB block; estimate {:.1} MiB)",
        cache_mib,
        entries,
        cached >> 20,
        used as f64 / (1 << 20) as f64,
        used as f64 / (cached as f64 / (1u64 << 30) as f64) / (1 << 20) as f64,
        used as f64 / (cached / 4096) as f64,
        estimate as f64 / (1 << 20) as f64,
    );
}
