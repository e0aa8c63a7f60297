//! `tiercache bench`: runs the field's workloads (W1–W7 of BENCHMARKS.md) against every
//! configuration (the emulated disk alone, the fast file alone, tiercache in three modes,
//! nbdkit's cache filter) through fio's `nbd` engine, and reports tables, JSON and plots.
//!
//! Invariants: every (configuration, workload) pair starts from fresh devices; every
//! configuration reaches the same emulated disk over NBD with the same cache size; numbers
//! come from fio's JSON and tiercache's own statistics; nothing here asserts a time.

mod fio;
mod procs;
mod report;

use anyhow::{bail, Result};
use procs::{Running, Sizes, CONFIGS};
use report::{Row, Series};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scale {
    /// Seconds per configuration (CI smoke).
    Tiny,
    /// About 7 minutes on 2 cores.
    Quick,
    /// Long runs on a bigger disk.
    Full,
}

/// Options of `tiercache bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// How big and long: tiny (smoke), quick (minutes), full (long).
    #[arg(long, value_enum, default_value = "quick")]
    scale: Scale,
    /// Workloads to run, comma separated (W1..W7; default all).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Configurations, comma separated (default all: hdd, ssd, tiercache-writethrough,
    /// tiercache-writeback, tiercache-writearound, nbdkit-cache).
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// Directory for results.md, results.json, plots and scratch devices.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// Sizes and durations of one scale.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Params {
    disk_bytes: u64,
    cache_bytes: u64,
    runtime_s: u64,
    jobs: u32,
    /// Dirty data W7 drains.
    drain_bytes: u64,
}

fn params(scale: Scale) -> Params {
    match scale {
        Scale::Tiny => Params {
            disk_bytes: 64 << 20,
            cache_bytes: 8 << 20,
            runtime_s: 1,
            jobs: 2,
            drain_bytes: 1 << 20,
        },
        Scale::Quick => Params {
            disk_bytes: 1 << 30,
            cache_bytes: 128 << 20,
            runtime_s: 3,
            jobs: 4,
            drain_bytes: 8 << 20,
        },
        Scale::Full => Params {
            disk_bytes: 8 << 30,
            cache_bytes: 1 << 30,
            runtime_s: 60,
            jobs: 16,
            drain_bytes: 512 << 20,
        },
    }
}

/// One fio run of a workload.
struct Step {
    name: String,
    args: Vec<String>,
}

fn step(name: &str, args: Vec<String>) -> Step {
    Step {
        name: name.to_string(),
        args,
    }
}

pub const WORKLOADS: [(&str, &str); 7] = [
    (
        "W1",
        "4 KiB psync (QD1) read-seq, read-random, write-seq, write-random; run twice: cold, warm",
    ),
    (
        "W2",
        "IOzone-style record sizes: random read/write IOPS by record size",
    ),
    (
        "W3",
        "ext4 over nbdfuse + loop: randwrite 4k direct=1 numjobs=16",
    ),
    (
        "W4",
        "4 KiB random writes with a flush after each (sync writes), many jobs, over time",
    ),
    (
        "W5",
        "4 KiB libaio-style iodepth 8: randread, randwrite, read, write; sequential_cutoff=0",
    ),
    (
        "W6",
        "zipf:1.2 random 70/30 read/write over the whole disk, cache at 1/8 of it: steady state",
    ),
    (
        "W7",
        "fill the cache with random 4 KiB dirty data, then time the drain to the disk",
    ),
];

fn steps(w: &str, p: &Params, scale: Scale) -> Vec<Step> {
    let rt = format!("--runtime={}", p.runtime_s);
    let jobs = format!("--numjobs={}", p.jobs);
    let span = format!("--size={}", p.disk_bytes);
    let w1_size = format!("--size={}", (p.disk_bytes / 16).min(100 << 20));
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v = vec!["--time_based".to_string(), rt.clone()];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let tiny = scale == Scale::Tiny;
    match w {
        "W1" => {
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
                    let rw = format!("--rw={rw}");
                    out.push(step(
                        &format!("{n} ({pass})"),
                        base(&["--bs=4k", "--iodepth=1", &rw, &w1_size]),
                    ));
                }
            }
            out
        }
        "W2" => {
            let sizes: &[&str] = if tiny {
                &["8k"]
            } else if scale == Scale::Quick {
                &["8k", "128k"]
            } else {
                &["8k", "32k", "64k", "128k", "512k"]
            };
            let mut out = Vec::new();
            for bs in sizes {
                for (n, rw) in [("randread", "randread"), ("randwrite", "randwrite")] {
                    let bsa = format!("--bs={bs}");
                    let rwa = format!("--rw={rw}");
                    out.push(step(
                        &format!("{n} {bs}"),
                        base(&[&bsa, &rwa, "--iodepth=1", &span]),
                    ));
                }
            }
            out
        }
        "W4" => vec![step(
            "sync randwrite 4k",
            base(&[
                "--bs=4k",
                "--rw=randwrite",
                "--fsync=1",
                "--iodepth=1",
                &jobs,
                &span,
            ]),
        )],
        "W5" => {
            let all = ["randread", "randwrite", "read", "write"];
            let take = if tiny { 1 } else { 4 };
            all.iter()
                .take(take)
                .map(|rw| {
                    let rwa = format!("--rw={rw}");
                    step(rw, base(&["--bs=4k", "--iodepth=8", &rwa, &span]))
                })
                .collect()
        }
        "W6" => vec![step(
            "zipf:1.2 randrw 70/30",
            base(&[
                "--bs=4k",
                "--rw=randrw",
                "--rwmixread=70",
                "--random_distribution=zipf:1.2",
                "--iodepth=4",
                &span,
            ]),
        )],
        _ => Vec::new(),
    }
}

/// Runs the selected workloads on the selected configurations.
pub fn run(args: &BenchArgs) -> Result<()> {
    let p = params(args.scale);
    let configs: Vec<String> = if args.configs.is_empty() {
        CONFIGS.iter().map(|s| s.to_string()).collect()
    } else {
        args.configs.clone()
    };
    for c in &configs {
        if !CONFIGS.contains(&c.as_str()) {
            bail!(
                "unknown configuration '{c}' (known: {})",
                CONFIGS.join(", ")
            );
        }
    }
    let workloads: Vec<String> = if args.workloads.is_empty() {
        WORKLOADS.iter().map(|w| w.0.to_string()).collect()
    } else {
        args.workloads.iter().map(|w| w.to_uppercase()).collect()
    };
    for w in &workloads {
        if !WORKLOADS.iter().any(|k| k.0 == w) {
            bail!("unknown workload '{w}' (known: W1..W7)");
        }
    }
    if std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_err()
    {
        bail!("fio is not installed (Debian: apt-get install fio)");
    }
    let have_nbdkit = std::process::Command::new("nbdkit")
        .arg("--version")
        .output()
        .is_ok();
    std::fs::create_dir_all(&args.out)?;
    let scratch = args.out.join("scratch");
    let sizes = Sizes {
        disk_bytes: p.disk_bytes,
        cache_bytes: p.cache_bytes,
    };
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut notices = Vec::new();
    let total = workloads.len() * configs.len();
    let mut done = 0;
    for w in &workloads {
        for c in &configs {
            done += 1;
            eprintln!(
                "[{done}/{total}] {w} on {c} ({:.0} s elapsed)",
                started.elapsed().as_secs_f64()
            );
            if c == "nbdkit-cache" && !have_nbdkit {
                notices.push("nbdkit-cache skipped: nbdkit is not installed".to_string());
                continue;
            }
            if w == "W3" {
                let n = "W3 skipped: the ext4-over-nbdfuse workload is not built yet".to_string();
                if !notices.contains(&n) {
                    notices.push(n);
                }
                continue;
            }
            if w == "W7" && !(c == "hdd" || c == "tiercache-writeback") {
                continue;
            }
            let running = procs::start(c, &scratch, sizes)?;
            if w == "W5" || w == "W6" || w == "W7" {
                running.set("sequential_cutoff", "0")?;
            }
            if w == "W7" {
                rows.push(w7(&running, c, &p)?);
                continue;
            }
            for s in steps(w, &p, args.scale) {
                let plot = w == "W4" || w == "W6";
                let (row, ser) = run_step(&running, w, c, &s, plot, &scratch)?;
                rows.push(row);
                if let Some(ser) = ser {
                    series.push(ser);
                }
            }
        }
    }
    report::ratios(&mut rows);
    report::write(&args.out, args.scale, &p, &rows, &series, &notices)?;
    for n in &notices {
        eprintln!("notice: {n}");
    }
    println!("{}", std::fs::read_to_string(args.out.join("results.md"))?);
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

fn stat(v: &Option<serde_json::Value>, key: &str) -> u64 {
    v.as_ref()
        .and_then(|v| v["devices"][0]["stats_total"][key].as_u64())
        .unwrap_or(0)
}

/// One fio run, with tiercache's stats before and after, and optionally a time series.
fn run_step(
    running: &Running,
    w: &str,
    c: &str,
    s: &Step,
    plot: bool,
    scratch: &Path,
) -> Result<(Row, Option<Series>)> {
    let before = running.stats();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = (plot && running.admin.is_some()).then(|| {
        let admin = running.admin.clone().expect("checked");
        let (samples, stop) = (samples.clone(), stop.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                if let Ok(v) =
                    crate::admin::request(&admin, &serde_json::json!({"cmd": "stats"}), &mut |_| {})
                {
                    let dirty =
                        v["cache"]["dirty_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64;
                    let in_use = v["cache"]["in_use"].as_f64().unwrap_or(0.0);
                    samples.lock().expect("sampler lock").push((
                        t0.elapsed().as_secs_f64(),
                        dirty,
                        in_use,
                    ));
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    });
    let log_prefix = scratch.join(format!("iops-{w}-{c}"));
    let m = fio::run(&running.uri, &s.args, plot.then_some(log_prefix.as_path()));
    stop.store(true, Ordering::SeqCst);
    if let Some(t) = sampler {
        let _ = t.join();
    }
    let m = m?;
    let after = running.stats();
    let (hits, misses) = (
        stat(&after, "cache_hits") - stat(&before, "cache_hits"),
        stat(&after, "cache_misses") - stat(&before, "cache_misses"),
    );
    let tc = running.admin.is_some();
    let row = Row {
        workload: w.to_string(),
        step: s.name.clone(),
        config: c.to_string(),
        iops: m.iops,
        bw_mib_s: m.bw_mib_s,
        mean_lat_us: m.mean_lat_us,
        p99_lat_us: m.p99_lat_us,
        hit_ratio_pct: (tc && hits + misses > 0)
            .then(|| hits as f64 * 100.0 / (hits + misses) as f64),
        cache_written_mib: tc.then(|| {
            (stat(&after, "cache_written_bytes") - stat(&before, "cache_written_bytes")) as f64
                / (1 << 20) as f64
        }),
        seconds: m.runtime_s,
        ratio_hdd: None,
        ratio_ssd: None,
    };
    // One lock for both columns: two `lock()` temporaries in one expression would deadlock.
    let samples = std::mem::take(&mut *samples.lock().expect("sampler lock"));
    let series = plot.then(|| Series {
        workload: w.to_string(),
        config: c.to_string(),
        iops: fio::iops_series(&log_prefix),
        dirty_mib: samples.iter().map(|s| (s.0, s.1)).collect(),
        in_use_pct: samples.iter().map(|s| (s.0, s.2)).collect(),
    });
    Ok((row, series))
}

/// W7: fill the cache with random dirty writes (writeback paused), then time the drain; on
/// `hdd`, time random writes of the same bytes straight to the disk.
fn w7(running: &Running, c: &str, p: &Params) -> Result<Row> {
    let bytes = p.drain_bytes;
    let write = |extra: &[&str]| -> Result<fio::Measured> {
        let mut a: Vec<String> = vec![
            "--bs=4k".into(),
            "--rw=randwrite".into(),
            "--iodepth=8".into(),
            format!("--size={}", p.disk_bytes),
            format!("--io_size={bytes}"),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        fio::run(&running.uri, &a, None)
    };
    let mut row = Row {
        workload: "W7".into(),
        step: format!("drain {} MiB of random 4k", bytes >> 20),
        config: c.to_string(),
        ..Row::default()
    };
    if running.admin.is_none() {
        let m = write(&["--end_fsync=1"])?;
        row.seconds = m.runtime_s;
    } else {
        running.set("writeback_running", "0")?;
        write(&[])?;
        running.set("writeback_percent", "0")?;
        running.set("writeback_delay", "0")?;
        let t = Instant::now();
        running.set("writeback_running", "1")?;
        loop {
            let dirty = running
                .stats()
                .and_then(|v| v["devices"][0]["dirty_bytes"].as_u64())
                .unwrap_or(0);
            if dirty == 0 {
                break;
            }
            if t.elapsed() > Duration::from_secs(3600) {
                bail!("writeback did not drain within an hour");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        row.seconds = t.elapsed().as_secs_f64();
    }
    row.bw_mib_s = (bytes >> 20) as f64 / row.seconds.max(1e-9);
    row.iops = (bytes / 4096) as f64 / row.seconds.max(1e-9);
    Ok(row)
}
