//! Full-cache steady state: a working set five times the cache, mixed random reads and writes
//! in writeback mode, background threads on (real concurrency), long enough that reclaim, GC
//! and writeback cycle many times. No deadlock (the test has a watchdog), every read correct.
//! Each thread owns a disjoint region, so its own model is exact.

mod common;

use blockdev::{BlockDevice, MemDevice};
use common::*;
use engine::{CacheMode, Config};
use rand::Rng;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn full_cache_steady_state_writeback() {
    let seed = seed_from_env("full_cache_steady_state_writeback");
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(4 << 20));
    let backing: Arc<dyn BlockDevice> = Arc::new(MemDevice::new((16 << 20) + 8192));
    let (set, vol) = format_and_open(cache, backing, CacheMode::Writeback, Config::default());
    vol.set_sequential_cutoff(0).unwrap();
    vol.set_writeback_delay_secs(0).unwrap();
    let data_bytes = set.layout().nbuckets as u64 * set.layout().bucket_size as u64;
    assert!(
        vol.size_bytes() >= 5 * data_bytes,
        "the working set must be five times the cache"
    );
    let threads = 4u64;
    let region = vol.size_bytes() / threads / 4096 * 4096;
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            while !done.load(Ordering::SeqCst) {
                assert!(
                    start.elapsed() < Duration::from_secs(240),
                    "deadlock: workload did not finish"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let mut r = rng(seed ^ t);
                let base = t * region;
                let blocks = region / 4096;
                let mut model = Model::new((region / 512) as usize);
                let mut id = t << 40;
                let mut buf = vec![0u8; 16384];
                for i in 0..40_000u32 {
                    let b = r.gen_range(0..blocks - 4);
                    let n = r.gen_range(1..=4u64);
                    let len = (n * 4096) as usize;
                    let sector = (b * 8) as usize;
                    if r.gen_bool(0.5) {
                        id += 1;
                        fill(&mut buf[..len], (base / 512) + sector as u64, id);
                        vol.write(base + b * 4096, &buf[..len], false)
                            .map_err(|e| format!("write {i}: {e}"))?;
                        // The model is per region; ids identify content by absolute sector.
                        model.write(sector, len / 512, id, false);
                    } else {
                        vol.read(base + b * 4096, &mut buf[..len])
                            .map_err(|e| format!("read {i}: {e}"))?;
                        for (k, s) in buf[..len].chunks(512).enumerate() {
                            let abs = base / 512 + (sector + k) as u64;
                            let got = identify(s, abs)?;
                            if !model.live[sector + k].contains(&got) {
                                return Err(format!(
                                    "op {i}: sector {abs} reads {got}, expected {:?}",
                                    model.live[sector + k]
                                ));
                            }
                        }
                    }
                    if i % 1000 == 0 {
                        vol.flush().map_err(|e| format!("flush: {e}"))?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    // Writeback yields to clients (a small share of the disk while they use it), so under
    // this nonstop load it is also forced from here, to make sure dirty data cycles through
    // writeback and eviction many times whatever the machine's speed.
    while !workers.iter().all(|w| w.is_finished()) {
        set.writeback_step(true).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    for w in workers {
        if let Err(e) = w.join().unwrap() {
            panic!("seed {seed}: {e}");
        }
    }
    done.store(true, Ordering::SeqCst);
    watchdog.join().unwrap();
    set.check_invariants().unwrap();
    let totals = vol.status();
    let occ = set.occupancy();
    eprintln!(
        "hits {} misses {} writeback {} MiB, occupancy {:?}",
        totals.stats.total.cache_hits,
        totals.stats.total.cache_misses,
        totals.stats.total.writeback_bytes >> 20,
        occ
    );
    // Cached data was written back and evicted many times over.
    assert!(
        totals.stats.total.writeback_bytes > 4 * data_bytes,
        "writeback did not cycle"
    );
    assert!(totals.stats.total.cache_hits > 0);
    set.close().unwrap();
}
