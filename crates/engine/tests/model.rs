//! Model-based property tests: random sequences of read / write / FUA write / flush /
//! discard / write-zeroes / mode switch / writeback / GC / checkpoint / close+reopen /
//! crash+reopen, switching between two backing devices and detaching and attaching the second
//! one (again, or freshly formatted), against the in-memory models; every read must be one
//! the model allows, a completed detach must leave the device holding everything, and a
//! crash must leave it attached or cleanly detached (see `World`).

mod common;

use common::*;
use engine::CacheMode;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    Op(Op),
    Crash,
}

fn run(seed: u64, steps: &[Step], mode: CacheMode) -> Result<(), String> {
    let rig = Rig::with_second(seed, Geometry::default(), mode, SECOND_BYTES);
    let mut w = World::new(rig);
    w.rig.short_cutoff_for_some_seeds(seed);
    let sectors = w.models[0].live.len();
    for (i, step) in steps.iter().enumerate() {
        let ctx = |e: String| format!("step {i} ({step:?}): {e}");
        match step {
            Step::Op(Op::Close) => w.close_and_reopen().map_err(ctx)?,
            Step::Op(op) => {
                if let Op::Write { sector, n, .. }
                | Op::Read { sector, n }
                | Op::Discard { sector, n }
                | Op::Zero { sector, n, .. } = op
                {
                    assert!(sector + n <= sectors);
                }
                w.apply(op)
                    .map_err(ctx)?
                    .map_err(|e| ctx(format!("engine error: {e}")))?;
            }
            Step::Crash => w.crash_and_reopen().map_err(ctx)?,
        }
    }
    w.verify()
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let sectors = (2 << 20) / SECTOR;
    prop_oneof![
        50 => (any::<u8>(), any::<u32>(), any::<u32>(), any::<u32>())
            .prop_map(move |(k, a, b, c)| Step::Op(op_from(k, a, b, c, sectors))),
        1 => Just(Step::Op(Op::Close)),
        1 => Just(Step::Crash),
        2 => (0usize..2).prop_map(|t| Step::Op(Op::Target(t))),
        1 => Just(Step::Op(Op::Detach)),
        1 => any::<bool>().prop_map(|fresh| Step::Op(Op::Attach { fresh })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_model(seed in any::<u64>(), mode in 0usize..4, steps in prop::collection::vec(step_strategy(), 1..400)) {
        let r = run(seed, &steps, CacheMode::ALL[mode]);
        prop_assert!(r.is_ok(), "seed {seed}: {}", r.unwrap_err());
    }
}

/// Inputs the property test once failed on, replayed every run (`model_cases/`, as proptest
/// printed them).
#[test]
fn model_regression_cases() {
    let cases: [(u64, usize, Vec<Step>); 1] = [(
        12791780051680594996,
        0,
        include!("model_cases/s12791780051680594996.rs"),
    )];
    for (seed, mode, steps) in cases {
        let r = run(seed, &steps, CacheMode::ALL[mode]);
        assert!(r.is_ok(), "seed {seed}: {}", r.unwrap_err());
    }
}

/// A long seeded run (printed seed; `TIERCACHE_SEED` replays it).
#[test]
fn long_random_run_matches_model() {
    let seed = seed_from_env("long_random_run_matches_model");
    let mut r = rng(seed);
    let sectors = (2 << 20) / SECTOR;
    let steps: Vec<Step> = (0..4000)
        .map(|_| match rand::Rng::gen_range(&mut r, 0..200) {
            0 => Step::Op(Op::Close),
            1 => Step::Crash,
            2..=4 => Step::Op(Op::Target(rand::Rng::gen_range(&mut r, 0..2))),
            5 => Step::Op(Op::Detach),
            6 => Step::Op(Op::Attach {
                fresh: rand::Rng::gen_bool(&mut r, 0.3),
            }),
            _ => Step::Op(random_op(&mut r, sectors)),
        })
        .collect();
    if let Err(e) = run(seed, &steps, CacheMode::Writeback) {
        panic!("seed {seed}: {e}\nreplay: TIERCACHE_SEED={seed} cargo test -p engine --test model long_random_run -- --nocapture");
    }
}
