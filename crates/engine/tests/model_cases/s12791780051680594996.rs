// The minimal failing input proptest printed for `engine_matches_model`, seed
// 12791780051680594996, mode 0 (see `model.rs`'s regression cases).
vec![
    Step::Op(
        Op::Write {
            sector: 744,
            n: 43,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 229,
            n: 189,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 8,
            n: 18,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 544,
            n: 7,
        },
    ),
    Step::Op(
        Op::Stream {
            sector: 946,
            n: 8,
            write: true,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 678,
            n: 50,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 3112,
            n: 8,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 248,
            n: 3,
        },
    ),
    Step::Op(
        Op::Target(
            1,
        ),
    ),
    Step::Op(
        Op::Write {
            sector: 2288,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Write {
            sector: 2408,
            n: 28,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 624,
            n: 392,
            fua: false,
        },
    ),
    Step::Op(
        Op::Attach {
            fresh: false,
        },
    ),
    Step::Op(
        Op::Detach,
    ),
    Step::Op(
        Op::Write {
            sector: 696,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 337,
            n: 33,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 3368,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 883,
            n: 8,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 373,
            n: 14,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 2240,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 874,
            n: 175,
            fua: false,
        },
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Read {
            sector: 3741,
            n: 355,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 140,
            n: 2,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 422,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 872,
            n: 43,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 469,
            n: 48,
            fua: false,
        },
    ),
    Step::Op(
        Op::Attach {
            fresh: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 2450,
            n: 99,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 112,
            n: 4,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 1288,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 4017,
            n: 26,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 16,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Detach,
    ),
    Step::Op(
        Op::Write {
            sector: 3635,
            n: 461,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 956,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 724,
            n: 8,
        },
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Write {
            sector: 492,
            n: 211,
            fua: false,
        },
    ),
    Step::Op(
        Op::Close,
    ),
    Step::Op(
        Op::Checkpoint {
            interleave: 2441095271,
        },
    ),
    Step::Op(
        Op::Zero {
            sector: 666,
            n: 8,
            fua: true,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 672,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 188,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 3848,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2144,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 520,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 87,
            n: 279,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 1359,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Stream {
            sector: 330,
            n: 34,
            write: true,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 240,
            n: 3,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 74,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 3656,
            n: 440,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2495,
            n: 5,
            fua: false,
        },
    ),
    Step::Op(
        Op::Zero {
            sector: 302,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 200,
            n: 1,
            fua: true,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 2391,
            n: 8,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 776,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 4002,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 864,
            n: 3,
        },
    ),
    Step::Crash,
    Step::Op(
        Op::Read {
            sector: 1021,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 448,
            n: 140,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2688,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 3944,
            n: 8,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 2074,
            n: 8,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 1005,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 947,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 624,
            n: 2,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 1808,
            n: 118,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2424,
            n: 5,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 103,
            n: 2,
            fua: false,
        },
    ),
    Step::Op(
        Op::Mode(
            CacheMode::Writearound,
        ),
    ),
    Step::Op(
        Op::Read {
            sector: 914,
            n: 8,
        },
    ),
    Step::Op(
        Op::Stream {
            sector: 2384,
            n: 21,
            write: true,
        },
    ),
    Step::Op(
        Op::Target(
            0,
        ),
    ),
    Step::Op(
        Op::Write {
            sector: 1012,
            n: 46,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2194,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 200,
            n: 2,
        },
    ),
    Step::Op(
        Op::Discard {
            sector: 470,
            n: 7,
        },
    ),
    Step::Crash,
    Step::Op(
        Op::Write {
            sector: 88,
            n: 8,
            fua: true,
        },
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Attach {
            fresh: true,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 608,
            n: 36,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 88,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2583,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 48,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 280,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2896,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 320,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 840,
            n: 2,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 2970,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 711,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 88,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 793,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Close,
    ),
    Step::Op(
        Op::Write {
            sector: 472,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 3056,
            n: 116,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 0,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 152,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 269,
            n: 8,
        },
    ),
    Step::Op(
        Op::Stream {
            sector: 0,
            n: 256,
            write: true,
        },
    ),
    Step::Op(
        Op::Target(
            1,
        ),
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Write {
            sector: 953,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Writeback,
    ),
    Step::Op(
        Op::Write {
            sector: 848,
            n: 8,
            fua: false,
        },
    ),
    Step::Crash,
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Target(
            1,
        ),
    ),
    Step::Op(
        Op::Write {
            sector: 680,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 1352,
            n: 8,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 200,
            n: 7,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 976,
            n: 8,
            fua: false,
        },
    ),
    Step::Op(
        Op::Flush,
    ),
    Step::Op(
        Op::Write {
            sector: 688,
            n: 364,
            fua: false,
        },
    ),
    Step::Op(
        Op::Target(
            1,
        ),
    ),
    Step::Op(
        Op::Write {
            sector: 331,
            n: 59,
            fua: false,
        },
    ),
    Step::Crash,
    Step::Op(
        Op::Detach,
    ),
    Step::Op(
        Op::Write {
            sector: 72,
            n: 7,
            fua: false,
        },
    ),
    Step::Op(
        Op::Write {
            sector: 234,
            n: 2,
            fua: false,
        },
    ),
    Step::Op(
        Op::Read {
            sector: 709,
            n: 8,
        },
    ),
]
