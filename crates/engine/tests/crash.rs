//! Crash consistency: run a seeded workload, crash both devices at I/O number N (dropping and
//! tearing every write not covered by a completed flush), reopen, and check that every write
//! acknowledged before the last completed flush (or with FUA) reads back and that no read
//! returns data that was never written. N covers every I/O of one workload exhaustively, then
//! random points across many seeds. `TIERCACHE_CRASH_POINTS` sets the total (default 10,000);
//! `TIERCACHE_SEED` replays a run.

mod common;

use common::*;
use engine::CacheMode;

const OPS: usize = 120;

fn workload(seed: u64) -> Vec<Op> {
    let mut r = rng(seed ^ 0x5eed);
    let sectors = (2 << 20) / SECTOR;
    (0..OPS).map(|_| random_op(&mut r, sectors)).collect()
}

fn mode_for(seed: u64) -> CacheMode {
    CacheMode::ALL[(seed % 4) as usize]
}

/// Runs the workload, crashing at I/O `crash_at` (counted after setup). Returns the number of
/// I/Os the workload issued when it ran to the end.
fn crash_run(seed: u64, ops: &[Op], crash_at: Option<u64>) -> Result<u64, String> {
    let mut rig = Rig::new(seed, Geometry::default(), mode_for(seed));
    rig.short_cutoff_for_some_seeds(seed);
    let sectors = (rig.vol().size_bytes() / SECTOR as u64) as usize;
    let mut model = Model::new(sectors);
    let base = rig.ctrl.io_count();
    rig.ctrl.set_crash_at(crash_at.map(|n| base + n));
    let mut id = 0;
    for (i, op) in ops.iter().enumerate() {
        let r = apply(&rig, &mut model, op, &mut id).map_err(|e| format!("op {i} {op:?}: {e}"))?;
        if rig.ctrl.is_crashed() {
            break;
        }
        r.map_err(|e| format!("op {i} {op:?} failed without a crash: {e}"))?;
    }
    let ios = rig.ctrl.io_count() - base;
    // Crash now if the crash point was not reached, so the end state is checked too.
    rig.crash_and_reopen()
        .map_err(|e| format!("reopen after crash: {e}"))?;
    model.crashed();
    verify_all(&rig, &model).map_err(|e| format!("after crash: {e}"))?;
    // The recovered set keeps working: a few more ops, a flush, another crash.
    let more = workload(seed.wrapping_add(99));
    for op in more.iter().take(30) {
        apply(&rig, &mut model, op, &mut id)?
            .map_err(|e| format!("after recovery, {op:?}: {e}"))?;
    }
    rig.vol().flush().map_err(|e| e.to_string())?;
    model.flush();
    rig.crash_and_reopen()
        .map_err(|e| format!("second reopen: {e}"))?;
    model.crashed();
    verify_all(&rig, &model).map_err(|e| format!("after second crash: {e}"))?;
    Ok(ios)
}

fn budget() -> u64 {
    std::env::var("TIERCACHE_CRASH_POINTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000)
}

/// Replays one failing point: `TIERCACHE_CRASH_ONLY=SEED:N` (printed by a failure).
fn replay_one() -> bool {
    let Ok(spec) = std::env::var("TIERCACHE_CRASH_ONLY") else {
        return false;
    };
    let (s, n) = spec.split_once(':').expect("SEED:N");
    let (s, n): (u64, u64) = (s.parse().unwrap(), n.parse().unwrap());
    let ops = workload(s);
    for (i, op) in ops.iter().enumerate() {
        eprintln!("op {i}: {op:?}");
    }
    if let Err(e) = crash_run(s, &ops, Some(n)) {
        panic!("seed {s} crash at I/O {n}: {e}");
    }
    true
}

#[test]
fn crash_at_every_io_then_random_points() {
    if replay_one() {
        return;
    }
    let seed = seed_from_env("crash_at_every_io_then_random_points");
    let total_budget = budget();
    let mut points = 0u64;
    // Exhaustive: every I/O of one workload per mode.
    for m in 0..4u64 {
        let s = seed - seed % 4 + m;
        let ops = workload(s);
        let total =
            crash_run(s, &ops, None).unwrap_or_else(|e| panic!("seed {s} without crash: {e}"));
        for n in 1..=total {
            if let Err(e) = crash_run(s, &ops, Some(n)) {
                panic!("seed {s} crash at I/O {n}: {e}\nreplay: TIERCACHE_CRASH_ONLY={s}:{n}");
            }
            points += 1;
        }
    }
    // Random crash points across further seeds.
    let mut r = rng(seed);
    let mut s = seed;
    while points < total_budget {
        s = s.wrapping_add(4);
        let ops = workload(s);
        let total =
            crash_run(s, &ops, None).unwrap_or_else(|e| panic!("seed {s} without crash: {e}"));
        for _ in 0..20 {
            let n = rand::Rng::gen_range(&mut r, 1..=total.max(1));
            if let Err(e) = crash_run(s, &ops, Some(n)) {
                panic!("seed {s} crash at I/O {n}: {e}\nreplay: TIERCACHE_CRASH_ONLY={s}:{n}");
            }
            points += 1;
        }
    }
    eprintln!("crash points checked: {points}");
}
