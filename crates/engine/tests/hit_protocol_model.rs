//! A model check of the lock-free hit protocol (`slots`' seqlock and `alloc`'s pins): the
//! protocol written out over `shuttle`'s atomics and threads, whose schedulers explore the
//! interleavings of a hit, a reclaim that moves the hit's block away and retires its bucket,
//! and an allocation that reuses the bucket once it is free. What must hold: a hit that passed
//! its seqlock check never reads a bucket that was reused (its data is the block's), and a
//! retired bucket is freed exactly once, by the reclaim or by the hit's last unpin.
//!
//! The model runs under sequential consistency (shuttle's atomics): it checks the protocol's
//! logic over every interleaving the schedulers reach, not the memory-ordering argument (the
//! `SeqCst` fences on both sides of the pin, argued in `slots.rs` and `alloc.rs`). Beside it,
//! `tests/behaviour.rs` stress-tests the real code. A variant without the reader's re-check
//! must fail, so the check can fail.

use shuttle::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use shuttle::sync::{Arc, Mutex};
use shuttle::thread;

/// Hits of the broken variant that read a reused bucket, over all explored schedules.
static STALE_HITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The pin word's flag for a retired bucket (as in `alloc`).
const RETIRED: u32 = 1 << 15;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Bucket {
    /// Holds the block's data.
    Live,
    /// Emptied from the index, waiting for its last pin.
    PendingFree,
    /// Free for allocation.
    Free,
    /// Allocated again: new data is being written over the old.
    Reused,
}

struct Model {
    /// The state lock and, under it, the bucket's state.
    state: Mutex<Bucket>,
    /// The index's seqlock.
    seq: AtomicU64,
    /// The index entry of the block: 1 (in the bucket) or 0 (moved away).
    slot: AtomicU32,
    /// The bucket's pin count and `RETIRED` flag.
    pins: AtomicU32,
    /// What the bucket holds: 1 (the block's data) or 2 (what reused it).
    data: AtomicU32,
    /// How many times the bucket was freed.
    freed: AtomicU32,
}

impl Model {
    fn new() -> Model {
        Model {
            state: Mutex::new(Bucket::Live),
            seq: AtomicU64::new(0),
            slot: AtomicU32::new(1),
            pins: AtomicU32::new(0),
            data: AtomicU32::new(1),
            freed: AtomicU32::new(0),
        }
    }

    /// Under the lock: frees the bucket if it is retired and has no pins (`free_unpinned`).
    fn free_if_unpinned(&self, st: &mut Bucket) {
        if *st == Bucket::PendingFree && self.pins.load(SeqCst) & !RETIRED == 0 {
            *st = Bucket::Free;
            self.pins.fetch_and(!RETIRED, SeqCst);
            self.freed.fetch_add(1, SeqCst);
        }
    }

    /// Reclaim: moves the block out of the bucket (an index change inside the seqlock), then
    /// retires the bucket and frees it if nobody holds a pin (`retire`, `release`).
    fn reclaim(&self) {
        {
            let _st = self.state.lock().unwrap();
            self.seq.fetch_add(1, SeqCst);
            self.slot.store(0, SeqCst);
            self.seq.fetch_add(1, SeqCst);
        }
        let mut st = self.state.lock().unwrap();
        *st = Bucket::PendingFree;
        self.pins.fetch_or(RETIRED, SeqCst);
        self.free_if_unpinned(&mut st);
    }

    /// An allocation: takes the bucket if it is free and writes new data into it.
    fn allocate(&self) {
        let reused = {
            let mut st = self.state.lock().unwrap();
            if *st == Bucket::Free {
                *st = Bucket::Reused;
                true
            } else {
                false
            }
        };
        if reused {
            self.data.store(2, SeqCst);
        }
    }

    /// A lock-free hit: seqlock read of the index, pin, re-check, read the data, unpin (the
    /// last unpin of a retired bucket frees it under the lock). `recheck: false` is the
    /// broken variant. Returns whether it hit.
    fn hit(&self, recheck: bool) -> bool {
        let s1 = self.seq.load(SeqCst);
        if s1 % 2 == 1 {
            return false; // a change in progress: the locked path
        }
        if self.slot.load(SeqCst) == 0 {
            return false; // not cached (any more): the locked path
        }
        self.pins.fetch_add(1, SeqCst);
        let valid = !recheck || self.seq.load(SeqCst) == s1;
        if valid && self.data.load(SeqCst) != 1 {
            // The broken variant counts what the check must find; the real one may not.
            assert!(
                !recheck,
                "a hit that passed its check read a bucket that was reused"
            );
            STALE_HITS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        let prev = self.pins.fetch_sub(1, SeqCst);
        if prev == RETIRED | 1 {
            let mut st = self.state.lock().unwrap();
            self.free_if_unpinned(&mut st);
        }
        valid
    }
}

/// The hit, the reclaim and the allocation at once; then the bucket is freed at most once,
/// and freed at all unless a hit still holds it (none does once all are done).
fn scenario(recheck: bool) {
    let m = Arc::new(Model::new());
    let hit = {
        let m = m.clone();
        thread::spawn(move || m.hit(recheck))
    };
    let reclaim = {
        let m = m.clone();
        thread::spawn(move || m.reclaim())
    };
    let alloc = {
        let m = m.clone();
        thread::spawn(move || m.allocate())
    };
    hit.join().unwrap();
    reclaim.join().unwrap();
    alloc.join().unwrap();
    assert_eq!(m.freed.load(SeqCst), 1, "the retired bucket was freed once");
    assert_eq!(m.pins.load(SeqCst), 0, "no pin or flag left behind");
}

#[test]
fn a_hit_that_passed_its_check_never_reads_a_reused_bucket() {
    // PCT with depth 3 finds, with a known probability per run, any bug that needs up to two
    // preemptions (this protocol's need one or two); the random scheduler covers the rest.
    shuttle::check_pct(|| scenario(true), 20_000, 3);
    shuttle::check_random(|| scenario(true), 20_000);
}

#[test]
fn without_the_recheck_a_hit_can_read_a_reused_bucket() {
    shuttle::check_pct(|| scenario(false), 20_000, 3);
    assert!(
        STALE_HITS.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the model check did not find the bug of a hit that does not re-check the index"
    );
}
