//! Model-based property tests: random sequences of read / write / FUA write / flush /
//! discard / write-zeroes / mode switch / writeback / GC / checkpoint / close+reopen /
//! crash+reopen against the in-memory model; every read must be one the model allows.

mod common;

use common::*;
use engine::CacheMode;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Step {
    Op(Op),
    Reopen,
    Crash,
}

fn run(seed: u64, steps: &[Step], mode: CacheMode) -> Result<(), String> {
    let mut rig = Rig::new(seed, Geometry::default(), mode);
    rig.short_cutoff_for_some_seeds(seed);
    let sectors = (rig.vol().size_bytes() / SECTOR as u64) as usize;
    let mut model = Model::new(sectors);
    let mut id = 0;
    for (i, step) in steps.iter().enumerate() {
        let ctx = |e: String| format!("step {i} ({step:?}): {e}");
        match step {
            Step::Op(op) => {
                if let Op::Write { sector, n, .. }
                | Op::Read { sector, n }
                | Op::Discard { sector, n }
                | Op::Zero { sector, n, .. } = op
                {
                    assert!(sector + n <= sectors);
                }
                apply(&rig, &mut model, op, &mut id)
                    .map_err(ctx)?
                    .map_err(|e| ctx(format!("engine error: {e}")))?;
            }
            Step::Reopen => {
                rig.close_and_reopen().map_err(|e| ctx(e.to_string()))?;
                model.flush();
                verify_all(&rig, &model).map_err(ctx)?;
            }
            Step::Crash => {
                rig.crash_and_reopen().map_err(|e| ctx(e.to_string()))?;
                model.crashed();
                verify_all(&rig, &model).map_err(ctx)?;
            }
        }
    }
    verify_all(&rig, &model)
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let sectors = (2 << 20) / SECTOR;
    prop_oneof![
        50 => (any::<u8>(), any::<u32>(), any::<u32>(), any::<u32>())
            .prop_map(move |(k, a, b, c)| Step::Op(op_from(k, a, b, c, sectors))),
        1 => Just(Step::Reopen),
        1 => Just(Step::Crash),
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

/// A long seeded run (printed seed; `TIERCACHE_SEED` replays it).
#[test]
fn long_random_run_matches_model() {
    let seed = seed_from_env("long_random_run_matches_model");
    let mut r = rng(seed);
    let sectors = (2 << 20) / SECTOR;
    let steps: Vec<Step> = (0..4000)
        .map(|_| match rand::Rng::gen_range(&mut r, 0..200) {
            0 => Step::Reopen,
            1 => Step::Crash,
            _ => Step::Op(random_op(&mut r, sectors)),
        })
        .collect();
    if let Err(e) = run(seed, &steps, CacheMode::Writeback) {
        panic!("seed {seed}: {e}");
    }
}
