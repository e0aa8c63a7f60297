//! What `tiercache bench` runs: the workloads (W1–W7) and their steps (fio jobs) at each
//! scale, and which configurations each workload runs on by default. Data and pure
//! functions: nothing here starts a process.
//!
//! Invariants: every step names its fio arguments in full; a step that asks for a flush after
//! every write says so (`FLUSH_EVERY_WRITE`), so its result can be checked against fio's sync
//! count.

use crate::procs::{CONFIGS, MEMLIMIT, MEMLIMIT_CONFIGS, NONROT, NONROT_CONFIGS};

/// When W6 is steady: `intervals` consecutive intervals of `interval_s` whose IOPS differ by at
/// most `iops_tolerance` of their mean (max − min), whose hit ratios differ by at most
/// `hit_tolerance_pct` points, and whose cache occupancy (`in_use`) differs by at most
/// `in_use_tolerance_pct` points (a cache still filling is warming up, however flat its rate:
/// nothing has been evicted yet, so replacement and admission are not measured); no window of
/// a configuration with a cache starts before `warm_min_s` (about the time the scale's cache
/// takes to fill under W6: nbdkit's cache reports no occupancy, and its rate can hold flat
/// while it still fills); the run stops at `cap_s` regardless.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Rule {
    pub interval_s: u64,
    pub intervals: usize,
    pub iops_tolerance: f64,
    pub hit_tolerance_pct: f64,
    pub in_use_tolerance_pct: f64,
    pub warm_min_s: u64,
    pub cap_s: u64,
}

/// How big and long a run is (`--scale`): the parameters of each are [`params`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scale {
    /// Seconds per configuration (CI smoke).
    Tiny,
    /// About 11 minutes on 2 cores.
    Quick,
    /// Long runs on a bigger disk.
    Full,
}

/// Sizes and durations of one scale.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct Params {
    pub(crate) disk_bytes: u64,
    pub(crate) cache_bytes: u64,
    /// Length of a time-based step.
    pub(crate) runtime_s: u64,
    /// Length of a time-based step of a `+nonrot` configuration (shorter at quick, to keep
    /// quick short; its ratios are over `hdd+nonrot`, which runs as long).
    pub(crate) nonrot_runtime_s: u64,
    /// fio jobs of W3 and of W4's sync writes.
    pub(crate) jobs: u32,
    /// fio jobs of W4's 64k mostly-sequential writes.
    pub(crate) seek_jobs: u32,
    /// Cap on W4's size-based sync-write step.
    pub(crate) w4_cap_s: u64,
    /// Dirty data W7 drains.
    pub(crate) drain_bytes: u64,
    /// Memory limit of each server process of a `+memlimit` configuration (None: off).
    pub(crate) mem_limit_bytes: Option<u64>,
    /// How W6 runs until steady.
    pub(crate) w6: Rule,
}

pub(crate) fn params(scale: Scale) -> Params {
    match scale {
        Scale::Tiny => Params {
            disk_bytes: 64 << 20,
            cache_bytes: 8 << 20,
            runtime_s: 1,
            nonrot_runtime_s: 1,
            jobs: 2,
            seek_jobs: 2,
            w4_cap_s: 2,
            drain_bytes: 1 << 20,
            mem_limit_bytes: None,
            w6: Rule {
                interval_s: 1,
                intervals: 2,
                iops_tolerance: 0.5,
                hit_tolerance_pct: 20.0,
                in_use_tolerance_pct: 20.0,
                warm_min_s: 0,
                cap_s: 4,
            },
        },
        Scale::Quick => Params {
            disk_bytes: 1 << 30,
            cache_bytes: 128 << 20,
            runtime_s: 2,
            nonrot_runtime_s: 1,
            jobs: 4,
            seek_jobs: 4,
            w4_cap_s: 10,
            drain_bytes: 8 << 20,
            mem_limit_bytes: None,
            w6: Rule {
                interval_s: 1,
                intervals: 4,
                iops_tolerance: 0.20,
                hit_tolerance_pct: 2.0,
                in_use_tolerance_pct: 2.0,
                warm_min_s: 25,
                cap_s: 40,
            },
        },
        Scale::Full => Params {
            disk_bytes: 8 << 30,
            cache_bytes: 1 << 30,
            runtime_s: 60,
            nonrot_runtime_s: 60,
            jobs: 16,
            seek_jobs: 15,
            w4_cap_s: 900,
            drain_bytes: 512 << 20,
            mem_limit_bytes: None,
            w6: Rule {
                interval_s: 10,
                intervals: 6,
                iops_tolerance: 0.05,
                hit_tolerance_pct: 1.0,
                in_use_tolerance_pct: 2.0,
                warm_min_s: 240,
                cap_s: 1800,
            },
        },
    }
}

/// One fio run of a workload.
pub(crate) struct Step {
    pub(crate) name: String,
    pub(crate) args: Vec<String>,
    /// Record the IOPS / dirty / occupancy time series of this step.
    pub(crate) plot: bool,
    /// Run in intervals until steady ([`steady`]; `args` bound it to the rule's cap): a
    /// warm-up row and a steady row instead of one.
    pub(crate) until_steady: Option<Rule>,
}

impl Step {
    /// fio jobs the step runs (`--numjobs`, else 1).
    pub(crate) fn jobs(&self) -> u32 {
        self.args
            .iter()
            .find_map(|a| a.strip_prefix("--numjobs=")?.parse().ok())
            .unwrap_or(1)
    }
}

/// fio's option for a flush after every write. With the `nbd` engine it is how a step asks for
/// O_SYNC / O_DSYNC writes: the engine ignores `--sync` (O_DSYNC is an open(2) flag; it sends
/// no FUA) and rejects `--fdatasync`.
pub(crate) const FLUSH_EVERY_WRITE: &str = "--fsync=1";

pub const WORKLOADS: [(&str, &str); 7] = [
    (
        "W1",
        "4 KiB psync (QD1) sequential and random reads and writes, run twice: cold, warm (the tiny scale: reads only)",
    ),
    (
        "W2",
        "IOzone-style record sizes, QD1: sequential write/read, random read/write by record size",
    ),
    (
        "W3",
        "ext4 over nbdfuse + loop: fio psync randwrite 4k direct=1, many jobs, on files in it",
    ),
    (
        "W4",
        "4 KiB sync random writes (a flush after each) until 70 % of the cache is written, over time; 64 KiB writes with 1 % random seeks, plain and O_DSYNC (a flush after each)",
    ),
    (
        "W5",
        "4 KiB libaio-style iodepth 8: randread, randwrite, read, write; sequential_cutoff=0",
    ),
    (
        "W6",
        "zipf:1.2 random 70/30 read/write over the whole disk, cache at 1/8 of it: warm-up, then steady state",
    ),
    (
        "W7",
        "fill the cache with random 4 KiB dirty data, then time the drain to the disk",
    ),
];

/// Workloads whose reads can be served from RAM, where the `+memlimit` variants run by default.
pub(crate) const MEMLIMIT_WORKLOADS: [&str; 3] = ["W1", "W5", "W6"];

/// Seek-bound workloads, also run by default over the disk that does not report itself
/// rotational (the `+nonrot` variants).
pub(crate) const NONROT_WORKLOADS: [&str; 2] = ["W1", "W5"];

/// The configurations W7 compares: the drain against raw random writes.
pub(crate) const W7_CONFIGS: [&str; 2] = ["hdd", "tiercache-writeback"];

/// The configurations W6 compares: the disks, and the two write-back caches (nbdkit's filter
/// runs `cache=writeback`; writethrough and writearound rows would compare unlike things, and
/// each cached configuration runs until its cache is full, which costs time at every scale).
pub(crate) const W6_CONFIGS: [&str; 4] = ["hdd", "ssd", "tiercache-writeback", "nbdkit-cache"];

pub(crate) fn steps(w: &str, p: &Params, scale: Scale) -> Vec<Step> {
    let tiny = scale == Scale::Tiny;
    let span = format!("--size={}", p.disk_bytes);
    let timed = |name: String, extra: &[&str]| timed_step(name, p.runtime_s, extra);
    match w {
        "W1" => {
            let size = format!("--size={}", (p.disk_bytes / 16).min(100 << 20));
            let all = [
                ("read-seq", "read"),
                ("read-random", "randread"),
                ("write-seq", "write"),
                ("write-random", "randwrite"),
            ];
            let take = if tiny { 2 } else { 4 };
            let mut out = Vec::new();
            for pass in ["cold", "warm"] {
                for (n, rw) in all.iter().take(take) {
                    out.push(timed(
                        format!("{n} ({pass})"),
                        &["--bs=4k", "--iodepth=1", &format!("--rw={rw}"), &size],
                    ));
                }
            }
            out
        }
        "W2" => {
            let sizes: &[&str] = match scale {
                Scale::Tiny => &["8k"],
                Scale::Quick => &["8k", "128k"],
                Scale::Full => &["8k", "32k", "64k", "128k", "512k"],
            };
            // IOzone's order: write, read, then random read and random write.
            sizes
                .iter()
                .flat_map(|bs| {
                    ["write", "read", "randread", "randwrite"].map(|rw| {
                        timed(
                            format!("{rw} {bs}"),
                            &[
                                &format!("--bs={bs}"),
                                &format!("--rw={rw}"),
                                "--iodepth=1",
                                &span,
                            ],
                        )
                    })
                })
                .collect()
        }
        "W3" => {
            // Files fill about half of the filesystem; the field's run is 20 s.
            let per_job = (p.disk_bytes / 2 / u64::from(p.jobs)) & !((1 << 20) - 1);
            vec![timed_step(
                "randwrite 4k on ext4".into(),
                p.runtime_s.min(20),
                &[
                    "--bs=4k",
                    "--rw=randwrite",
                    "--direct=1",
                    &format!("--numjobs={}", p.jobs),
                    &format!("--size={per_job}"),
                ],
            )]
        }
        "W4" => w4_steps(p, &span),
        "W5" => {
            let take = if tiny { 1 } else { 4 };
            ["randread", "randwrite", "read", "write"]
                .iter()
                .take(take)
                .map(|rw| {
                    timed(
                        rw.to_string(),
                        &["--bs=4k", "--iodepth=8", &format!("--rw={rw}"), &span],
                    )
                })
                .collect()
        }
        "W6" => {
            let mut s = timed_step(
                "zipf:1.2 randrw 70/30".into(),
                p.w6.cap_s,
                &[
                    "--bs=4k",
                    "--rw=randrw",
                    "--rwmixread=70",
                    "--random_distribution=zipf:1.2",
                    "--iodepth=4",
                    &span,
                ],
            );
            s.plot = true;
            s.until_steady = Some(p.w6);
            vec![s]
        }
        _ => Vec::new(),
    }
}

/// A step that runs fio for `runtime_s` seconds with `extra` arguments.
fn timed_step(name: String, runtime_s: u64, extra: &[&str]) -> Step {
    Step {
        name,
        args: ["--time_based", &format!("--runtime={runtime_s}")]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect(),
        plot: false,
        until_steady: None,
    }
}

/// W4's steps: sync 4 KiB random writes until 70 % of the cache is written, then 64 KiB
/// mostly-sequential writes per job, without and with O_DSYNC.
fn w4_steps(p: &Params, span: &str) -> Vec<Step> {
    // Sync writes until 70 % of the cache has been written (over all jobs), capped in
    // time for the configurations that cannot get there.
    let per_job = p.cache_bytes * 7 / 10 / u64::from(p.jobs);
    let sync = Step {
        name: "sync randwrite 4k to 70 % of cache".into(),
        args: vec![
            "--bs=4k".into(),
            "--rw=randwrite".into(),
            FLUSH_EVERY_WRITE.into(),
            "--iodepth=1".into(),
            format!("--numjobs={}", p.jobs),
            span.to_string(),
            format!("--io_size={per_job}"),
            format!("--runtime={}", p.w4_cap_s),
        ],
        plot: true,
        until_steady: None,
    };
    // Each job streams through its own region (1 MiB kept clear of the export's end,
    // which is smaller than the disk by tiercache's header).
    let region = ((p.disk_bytes - (1 << 20)) / u64::from(p.seek_jobs)) & !0xffff;
    let seeks = |name: &str, extra: &[&str]| {
        let mut s = timed_step(
            name.into(),
            p.runtime_s,
            &[
                "--bs=64k",
                "--rw=randwrite",
                "--percentage_random=1",
                "--iodepth=1",
                &format!("--numjobs={}", p.seek_jobs),
                &format!("--size={region}"),
                &format!("--offset_increment={region}"),
            ],
        );
        s.args.extend(extra.iter().map(|a| a.to_string()));
        s
    };
    // The second as the field report ran it: every write O_DSYNC.
    vec![
        sync,
        seeks("64k write 1 % random", &[]),
        seeks("64k write 1 % random O_DSYNC", &[FLUSH_EVERY_WRITE]),
    ]
}

/// The configurations a workload runs on when `--configs` is not given.
pub(crate) fn default_configs(w: &str, memlimit: bool) -> Vec<String> {
    let mut v = Vec::new();
    for c in CONFIGS {
        if (w == "W7" && !W7_CONFIGS.contains(&c)) || (w == "W6" && !W6_CONFIGS.contains(&c)) {
            continue;
        }
        v.push(c.to_string());
        if memlimit && MEMLIMIT_WORKLOADS.contains(&w) && MEMLIMIT_CONFIGS.contains(&c) {
            v.push(format!("{c}{MEMLIMIT}"));
        }
    }
    if NONROT_WORKLOADS.contains(&w) {
        v.extend(NONROT_CONFIGS.map(|c| format!("{c}{NONROT}")));
    }
    v
}
