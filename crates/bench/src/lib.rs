//! The harness behind `tiercache bench`: runs the field's workloads (W1–W7 of docs/benchmarks.md)
//! against every configuration (the emulated disk alone, the fast file alone, tiercache in
//! three modes, nbdkit's cache filter, memory-limited variants, and variants over a disk that
//! does not report itself rotational) through fio, and reports tables, JSON and plots. W6 runs
//! until steady ([`steady`]).
//!
//! Owns: process orchestration of the benchmarks (servers, fio, cgroups, W3's filesystem) and
//! their reports. The command line is `cli`'s, the catalogue of workloads and their steps
//! `catalogue`'s. It links none of tiercache's internals: it runs the `tiercache` binary
//! (`emulate`, `make`, `serve`) named by the [`Tiercache`] the binary hands to [`run`], and
//! speaks the admin protocol through the client lent with it.
//!
//! Invariants: every (workload, configuration) pair starts from fresh devices and fresh
//! processes, and (as root) from an empty page cache; every configuration reaches the same
//! emulated disk over NBD with the same cache size; numbers come from fio's JSON and
//! tiercache's own statistics; nothing here asserts a time; a step that asks for a flush after
//! every write is checked against fio's own sync count. A pair that fails is reported as a
//! notice and the run goes on, but the command then exits with an error.
//!
//! `--workloads scale` runs instead the engine-at-real-size measurements of [`scale`] (make,
//! start, RSS, restart after kill -9, CPU per write on big sparse caches), on their own;
//! `--workloads hits` runs [`hits`] (cached reads, writeback writes and passthrough I/O
//! against fio on the file itself, `nbdkit memory`, `qemu-nbd` and nbdkit's file plugin), on
//! its own.

mod catalogue;
mod cgroup;
mod cli;
mod fio;
mod fs;
mod hits;
mod plot;
mod procs;
mod report;
mod results;
mod scale;
mod steady;

use anyhow::{bail, Context, Result};
use catalogue::*;
pub use catalogue::{Scale, WORKLOADS};
use cgroup::Limiter;
pub use cli::BenchArgs;
pub use procs::Tiercache;
use procs::{Running, Sizes, MEMLIMIT};
use results::{Row, Series};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Adds `n` to the notices unless it is there already.
fn notice(notices: &mut Vec<String>, n: String) {
    if !notices.contains(&n) {
        notices.push(n);
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// One line per (workload, configuration) pair, and one per step as it starts.
struct Progress {
    started: Instant,
    total: usize,
    done: usize,
}

impl Progress {
    fn pair(&mut self, w: &str, c: &str) {
        self.done += 1;
        eprintln!(
            "[{}/{}] {w} on {c} ({:.0} s elapsed)",
            self.done,
            self.total,
            self.started.elapsed().as_secs_f64()
        );
    }

    fn step(&self, name: &str) {
        eprintln!(
            "    {name} ({:.0} s elapsed)",
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// What every pair of a run shares.
struct Ctx {
    tc: Tiercache,
    p: Params,
    scale: Scale,
    scratch: PathBuf,
    limiter: Option<Limiter>,
}

/// Runs the selected workloads on the selected configurations, starting `tc`'s binary for the
/// emulated disks and the tiercache configurations.
pub fn run(args: &BenchArgs, tc: &Tiercache) -> Result<()> {
    let tc = &Tiercache {
        serve_args: args.serve_args.clone(),
        make_args: args.make_args.clone(),
        ..tc.clone()
    };
    // Workloads that run alone (their own measurements, no configurations).
    for alone in ["scale", "hits"] {
        if !args.workloads.iter().any(|w| w.eq_ignore_ascii_case(alone)) {
            continue;
        }
        if args.workloads.len() > 1 || !args.configs.is_empty() {
            bail!("the {alone} workload runs alone: no other workload and no --configs");
        }
        return match alone {
            "scale" => scale::run(tc, &args.scale_workload, &args.out),
            _ => hits::run(tc, args.scale, &args.out),
        };
    }
    let p = bench_params(args)?;
    let workloads = selected_workloads(args)?;
    check_configs(args, &p)?;
    if !procs::on_path("fio") {
        bail!("fio is not installed (Debian: apt-get install fio)");
    }
    let plan = plan_pairs(args, &workloads, &p);

    let mut notices = Vec::new();
    let limited = |c: &str| procs::parse_config(c).is_ok_and(|c| c.memlimit);
    let limiter = match p.mem_limit_bytes {
        Some(bytes) if plan.iter().any(|(_, c)| limited(c)) => match Limiter::probe(bytes) {
            Ok(l) => Some(l),
            Err(why) => {
                notices.push(format!("{MEMLIMIT} configurations skipped: {why}"));
                None
            }
        },
        _ => None,
    };
    let w3_unavailable = plan
        .iter()
        .any(|(w, _)| w == "W3")
        .then(fs::unavailable)
        .flatten();
    if let Some(n) = &w3_unavailable {
        notices.push(n.clone());
    }
    if !is_root() {
        notices.push("the page cache is not dropped before cold runs: not running as root".into());
    }
    if plan.iter().any(|(w, _)| w == "W4") {
        notices.push(format!(
            "W4's O_DSYNC step runs {FLUSH_EVERY_WRITE} (an NBD flush after every write): fio's nbd engine ignores --sync=dsync and rejects --fdatasync"
        ));
    }
    let have_nbdkit = procs::on_path("nbdkit");

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = std::fs::canonicalize(&args.out)?;
    let ctx = Ctx {
        tc: tc.clone(),
        p,
        scale: args.scale,
        scratch: out.join("scratch"),
        limiter,
    };
    let mut progress = Progress {
        started: Instant::now(),
        total: plan.len(),
        done: 0,
    };
    let mut rows = Vec::new();
    let mut series = Vec::new();
    let mut failures = 0;
    for (w, c) in &plan {
        progress.pair(w, c);
        if c.starts_with("nbdkit-cache") && !have_nbdkit {
            notice(
                &mut notices,
                format!("{c} skipped: nbdkit is not installed"),
            );
            continue;
        }
        if (limited(c) && ctx.limiter.is_none()) || (w == "W3" && w3_unavailable.is_some()) {
            continue;
        }
        match run_pair(&ctx, w, c, &progress) {
            Ok(done) => {
                rows.extend(done.rows);
                series.extend(done.series);
                for n in done.notices {
                    notice(&mut notices, n);
                }
            }
            Err(e) => {
                failures += 1;
                eprintln!("    FAILED: {e:#}");
                notices.push(format!("FAILED: {w} on {c}: {e:#}"));
            }
        }
    }
    report::ratios(&mut rows);
    report::write(&out, ctx.scale, &ctx.p, &rows, &series, &notices)?;
    for n in &notices {
        eprintln!("notice: {n}");
    }
    println!("{}", std::fs::read_to_string(out.join("results.md"))?);
    if fs::mounts_under(&ctx.scratch).is_empty() {
        let _ = std::fs::remove_dir_all(&ctx.scratch);
    }
    if failures > 0 {
        bail!("{failures} (workload, configuration) pair(s) failed; see the notices in results.md");
    }
    Ok(())
}

/// The scale's parameters with the command line's memory limit and W6 settings, checked.
fn bench_params(args: &BenchArgs) -> Result<Params> {
    let mut p = params(args.scale);
    p.mem_limit_bytes = cgroup::limit_bytes(args.mem_limit, p.cache_bytes)?;
    if let Some(cap) = args.w6_cap {
        p.w6.cap_s = cap;
    }
    if let Some(n) = args.w6_intervals {
        p.w6.intervals = n as usize;
    }
    if let Some(s) = args.w6_warm_min {
        p.w6.warm_min_s = s;
    }
    if p.w6.warm_min_s + p.w6.intervals as u64 * p.w6.interval_s > p.w6.cap_s {
        bail!(
            "W6 cannot be steady within its cap: {} s before the first window plus {} intervals of {} s exceed {} s (--w6-cap)",
            p.w6.warm_min_s,
            p.w6.intervals,
            p.w6.interval_s,
            p.w6.cap_s
        );
    }
    Ok(p)
}

/// The workloads asked for (every one when none is named), each known and named once.
fn selected_workloads(args: &BenchArgs) -> Result<Vec<String>> {
    let workloads: Vec<String> = if args.workloads.is_empty() {
        WORKLOADS.iter().map(|w| w.0.to_string()).collect()
    } else {
        args.workloads.iter().map(|w| w.to_uppercase()).collect()
    };
    for (i, w) in workloads.iter().enumerate() {
        if !WORKLOADS.iter().any(|k| k.0 == w) {
            bail!("unknown workload '{w}' (known: W1..W7, or scale or hits alone)");
        }
        if workloads[..i].contains(w) {
            bail!("workload '{w}' given twice");
        }
    }
    Ok(workloads)
}

/// Each configuration asked for named once, and given the memory limit it needs.
fn check_configs(args: &BenchArgs, p: &Params) -> Result<()> {
    for (i, c) in args.configs.iter().enumerate() {
        if args.configs[..i].contains(c) {
            bail!("configuration '{c}' given twice");
        }
        if procs::parse_config(c)?.memlimit && p.mem_limit_bytes.is_none() {
            bail!("configuration '{c}' needs a memory limit, but --mem-limit 0 turns it off");
        }
    }
    Ok(())
}

/// The (workload, configuration) pairs to run, in order: the configurations asked for (or
/// each workload's defaults), W7 only on its own.
fn plan_pairs(args: &BenchArgs, workloads: &[String], p: &Params) -> Vec<(String, String)> {
    workloads
        .iter()
        .flat_map(|w| {
            let configs = if args.configs.is_empty() {
                default_configs(w, p.mem_limit_bytes.is_some())
            } else {
                args.configs.clone()
            };
            configs
                .into_iter()
                .filter(|c| w != "W7" || W7_CONFIGS.contains(&c.as_str()))
                .map(|c| (w.clone(), c))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Empties the page cache (as root), so that a cold run starts cold.
fn drop_page_cache() -> Result<()> {
    if is_root() {
        // SAFETY: sync(2) has no preconditions.
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache")?;
    }
    Ok(())
}

/// What one (workload, configuration) pair produced.
#[derive(Default)]
struct PairOut {
    rows: Vec<Row>,
    series: Vec<Series>,
    notices: Vec<String>,
}

/// One (workload, configuration) pair from fresh devices.
fn run_pair(ctx: &Ctx, w: &str, c: &str, progress: &Progress) -> Result<PairOut> {
    let cfg = procs::parse_config(c)?;
    let stale = fs::mounts_under(&ctx.scratch);
    if !stale.is_empty() {
        bail!(
            "refusing to wipe {}: still mounted there: {}",
            ctx.scratch.display(),
            stale.join(", ")
        );
    }
    let limit = if cfg.memlimit {
        ctx.limiter.as_ref()
    } else {
        None
    };
    let sizes = Sizes {
        disk_bytes: ctx.p.disk_bytes,
        cache_bytes: ctx.p.cache_bytes,
    };
    let mut running = procs::start(&ctx.tc, &cfg, &ctx.scratch, sizes, limit)?;
    if w == "W5" || w == "W6" || w == "W7" {
        running.set("sequential_cutoff", "0")?;
    }
    // Declared after `running`, so it is torn down before the servers stop.
    let ext4 = if w == "W3" {
        progress.step("nbdfuse + losetup + mkfs.ext4 + mount");
        Some(fs::Ext4::create(&running.uri, &ctx.scratch)?)
    } else {
        None
    };
    drop_page_cache()?;
    let mut out = PairOut::default();
    if w == "W7" {
        progress.step("fill, then drain");
        out.rows.push(Row {
            disk: cfg.disk(),
            ..w7(&running, c, &ctx.p)?
        });
        running.discard();
        return Ok(out);
    }
    if ext4.as_ref().is_some_and(|e| !e.direct_io) {
        out.notices.push(
            "W3: losetup refused --direct-io=on, so the loop device goes through the page cache"
                .into(),
        );
    }
    let target = match &ext4 {
        Some(fs) => fio::Target::Files(fs.dir().to_path_buf()),
        None => fio::Target::Nbd(running.uri.clone()),
    };
    let p = Params {
        runtime_s: if cfg.nonrot {
            ctx.p.nonrot_runtime_s
        } else {
            ctx.p.runtime_s
        },
        ..ctx.p
    };
    for s in steps(w, &p, ctx.scale) {
        progress.step(&s.name);
        let done = match &s.until_steady {
            Some(rule) => steady::run(&running, &target, w, c, &s, rule),
            None => run_step(&running, &target, w, c, &s, &ctx.scratch),
        };
        match done {
            Ok(done) => {
                out.rows.extend(done.rows.into_iter().map(|r| Row {
                    disk: cfg.disk(),
                    ..r
                }));
                out.series.extend(done.series);
                out.notices.extend(done.notices);
            }
            Err(e) => {
                let exited = running.exited();
                return Err(if exited.is_empty() {
                    e
                } else {
                    e.context(exited.join("; "))
                });
            }
        }
    }
    // The filesystem goes first (unmounting flushes it through the servers).
    drop(ext4);
    running.discard();
    Ok(out)
}

/// A counter of tiercache's `stats` (first device, totals); 0 when absent.
fn stat(v: &Option<serde_json::Value>, key: &str) -> u64 {
    v.as_ref()
        .and_then(|v| v["devices"][0]["stats_total"][key].as_u64())
        .unwrap_or(0)
}

/// The hit % and the MiB written to the cache device between two of tiercache's `stats`
/// (None for the peers, which have none; no hit % without reads that could hit).
fn cache_columns(
    before: &Option<serde_json::Value>,
    after: &Option<serde_json::Value>,
) -> (Option<f64>, Option<f64>) {
    let delta = |key| stat(after, key) - stat(before, key);
    let tc = after.is_some();
    let (hits, misses) = (delta("cache_hits"), delta("cache_misses"));
    (
        (tc && hits + misses > 0).then(|| hits as f64 * 100.0 / (hits + misses) as f64),
        tc.then(|| delta("cache_written_bytes") as f64 / (1 << 20) as f64),
    )
}

/// Dirty MiB and cache occupancy % of one of tiercache's `stats`.
fn occupancy(v: &serde_json::Value) -> (f64, f64) {
    (
        v["cache"]["dirty_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        v["cache"]["in_use"].as_f64().unwrap_or(0.0),
    )
}

/// One fio run, with tiercache's stats before and after, and the time series if the step
/// asks for it; a notice if a step meant to flush after every write did not.
fn run_step(
    running: &Running,
    target: &fio::Target,
    w: &str,
    c: &str,
    s: &Step,
    scratch: &Path,
) -> Result<PairOut> {
    let before = running.stats();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = (s.plot && running.admin.is_some()).then(|| {
        let admin = running.admin.clone().expect("checked");
        let (samples, stop, tc) = (samples.clone(), stop.clone(), running.tc.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                if let Ok(v) = tc.stats(&admin) {
                    let (dirty, in_use) = occupancy(&v);
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
    let m = fio::run(target, &s.args, s.plot.then_some(log_prefix.as_path()));
    stop.store(true, Ordering::SeqCst);
    if let Some(t) = sampler {
        let _ = t.join();
    }
    let m = m?;
    let after = running.stats();
    let (hit_ratio_pct, cache_written_mib) = cache_columns(&before, &after);
    let flushes_every_write = s.args.iter().any(|a| a == FLUSH_EVERY_WRITE);
    let mut out = PairOut::default();
    let flushes_per_write = flushes_every_write.then(|| m.syncs as f64 / m.writes.max(1) as f64);
    // fio's last write of a job may end the run before its flush.
    if flushes_every_write && m.syncs + u64::from(s.jobs()) < m.writes {
        out.notices.push(format!(
            "{w} on {c}, {}: fio issued {} flushes for {} writes (asked for one per write)",
            s.name, m.syncs, m.writes
        ));
    }
    out.rows.push(Row {
        workload: w.to_string(),
        step: s.name.clone(),
        config: c.to_string(),
        iops: m.iops,
        bw_mib_s: m.bw_mib_s,
        mean_lat_us: m.mean_lat_us,
        p99_lat_us: Some(m.p99_lat_us),
        hit_ratio_pct,
        cache_written_mib,
        seconds: m.runtime_s,
        flushes_per_write,
        ..Row::default()
    });
    // One lock for both columns: two `lock()` temporaries in one expression would deadlock.
    let samples = std::mem::take(&mut *samples.lock().expect("sampler lock"));
    out.series.extend(s.plot.then(|| Series {
        workload: w.to_string(),
        step: s.name.clone(),
        config: c.to_string(),
        iops: fio::iops_series(&log_prefix),
        dirty_mib: samples.iter().map(|s| (s.0, s.1)).collect(),
        in_use_pct: samples.iter().map(|s| (s.0, s.2)).collect(),
    }));
    Ok(out)
}

/// W7: fill the cache with random dirty writes (writeback paused), then time the drain; on
/// `hdd`, time random writes of the same bytes straight to the disk.
fn w7(running: &Running, c: &str, p: &Params) -> Result<Row> {
    let bytes = p.drain_bytes;
    let target = fio::Target::Nbd(running.uri.clone());
    let write = |extra: &[&str]| -> Result<fio::Measured> {
        let mut a: Vec<String> = vec![
            "--bs=4k".into(),
            "--rw=randwrite".into(),
            "--iodepth=8".into(),
            format!("--size={}", p.disk_bytes),
            format!("--io_size={bytes}"),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        fio::run(&target, &a, None)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::{CONFIGS, NONROT, NONROT_CONFIGS};

    fn arg<'a>(s: &'a Step, key: &str) -> Option<&'a str> {
        s.args.iter().find_map(|a| a.strip_prefix(key))
    }

    #[test]
    fn memlimit_variants_only_where_reads_can_hit_ram() {
        let w1 = default_configs("W1", true);
        assert!(w1.contains(&"tiercache-writeback+memlimit".to_string()));
        assert!(w1.contains(&"nbdkit-cache+memlimit".to_string()));
        assert_eq!(w1.len(), CONFIGS.len() + 2 + NONROT_CONFIGS.len());
        assert_eq!(
            default_configs("W1", false).len(),
            CONFIGS.len() + NONROT_CONFIGS.len()
        );
        assert_eq!(default_configs("W2", true).len(), CONFIGS.len());
        assert_eq!(default_configs("W7", true), W7_CONFIGS.map(String::from));
        assert_eq!(
            default_configs("W6", true),
            [
                "hdd",
                "ssd",
                "tiercache-writeback",
                "tiercache-writeback+memlimit",
                "nbdkit-cache",
                "nbdkit-cache+memlimit"
            ]
        );
        for c in default_configs("W6", true) {
            procs::parse_config(&c).expect("default configurations parse");
        }
        assert!(
            procs::parse_config("ssd+memlimit")
                .expect("any base")
                .memlimit
        );
        assert!(procs::parse_config("zfs").is_err());
    }

    #[test]
    fn nonrot_variants_on_the_seek_bound_workloads_with_their_own_hdd() {
        for w in ["W1", "W5"] {
            let v = default_configs(w, true);
            let flat: Vec<&str> = v.iter().filter_map(|c| c.strip_suffix(NONROT)).collect();
            assert_eq!(flat, NONROT_CONFIGS, "{w}");
            // The reference of their ratios runs wherever they do.
            assert!(v.contains(&"hdd+nonrot".to_string()));
            for c in &v {
                let cfg = procs::parse_config(c).expect("default configurations parse");
                assert_eq!(cfg.nonrot, c.ends_with(NONROT));
                let disk = cfg.disk();
                assert!(v.contains(&disk.hdd_reference()), "{c}: no reference");
            }
        }
        for w in ["W2", "W3", "W4", "W6", "W7"] {
            assert!(!default_configs(w, true).iter().any(|c| c.contains(NONROT)));
        }
    }

    #[test]
    fn w4_has_an_o_dsync_twin_of_its_64k_step_and_w6_runs_until_steady() {
        for scale in [Scale::Tiny, Scale::Quick, Scale::Full] {
            let p = params(scale);
            let w4 = steps("W4", &p, scale);
            let names: Vec<&str> = w4.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(
                names,
                [
                    "sync randwrite 4k to 70 % of cache",
                    "64k write 1 % random",
                    "64k write 1 % random O_DSYNC"
                ]
            );
            let (plain, dsync) = (&w4[1], &w4[2]);
            assert!(!plain.args.iter().any(|a| a == FLUSH_EVERY_WRITE));
            assert_eq!(dsync.args[..plain.args.len()], plain.args[..]);
            assert_eq!(dsync.args[plain.args.len()..], [FLUSH_EVERY_WRITE]);
            assert_eq!(dsync.jobs(), p.seek_jobs);
            assert!(w4[0].args.iter().any(|a| a == FLUSH_EVERY_WRITE));

            let w6 = steps("W6", &p, scale);
            assert_eq!(w6.len(), 1);
            let rule = w6[0].until_steady.expect("W6 runs until steady");
            assert_eq!(rule, p.w6);
            let cap = format!("{}", rule.cap_s);
            assert_eq!(arg(&w6[0], "--runtime="), Some(cap.as_str()));
            // Room for the first (warm-up) interval and one steady window.
            assert!(rule.cap_s >= (rule.intervals as u64 + 1) * rule.interval_s);
            for w in ["W1", "W2", "W3", "W4", "W5"] {
                assert!(steps(w, &p, scale).iter().all(|s| s.until_steady.is_none()));
            }
        }
    }

    #[test]
    fn w4_sync_step_writes_70_percent_of_the_cache_and_w2_has_sequential_steps() {
        for scale in [Scale::Tiny, Scale::Quick, Scale::Full] {
            let p = params(scale);
            let w4 = steps("W4", &p, scale);
            let sync = &w4[0];
            assert!(sync.plot && !sync.args.iter().any(|a| a == "--time_based"));
            let per_job: u64 = arg(sync, "--io_size=").unwrap().parse().unwrap();
            let total = per_job * u64::from(p.jobs);
            assert!(total <= p.cache_bytes * 7 / 10 && total + 4096 * 16 > p.cache_bytes * 7 / 10);
            let seeks = &w4[1];
            assert_eq!(arg(seeks, "--percentage_random="), Some("1"));
            assert_eq!(arg(sync, "--fsync="), Some("1"));
            let region: u64 = arg(seeks, "--size=").unwrap().parse().unwrap();
            assert!(region * u64::from(p.seek_jobs) < p.disk_bytes && region.is_multiple_of(65536));
            let w2: Vec<String> = steps("W2", &p, scale).into_iter().map(|s| s.name).collect();
            assert!(["write 8k", "read 8k", "randread 8k", "randwrite 8k"]
                .iter()
                .all(|n| w2.iter().any(|s| s == n)));
        }
        assert_eq!(steps("W2", &params(Scale::Quick), Scale::Quick).len(), 8);
        assert_eq!(steps("W2", &params(Scale::Full), Scale::Full).len(), 20);
        let w3 = steps("W3", &params(Scale::Full), Scale::Full);
        assert_eq!(arg(&w3[0], "--numjobs="), Some("16"));
        assert_eq!(arg(&w3[0], "--runtime="), Some("20"));
    }

    #[test]
    fn mem_limit_default_and_bounds() {
        assert_eq!(
            cgroup::limit_bytes(None, 128 << 20).unwrap(),
            Some(64 << 20)
        );
        assert_eq!(cgroup::limit_bytes(None, 1 << 30).unwrap(), Some(512 << 20));
        assert_eq!(cgroup::limit_bytes(None, 8 << 20).unwrap(), Some(64 << 20));
        assert_eq!(cgroup::limit_bytes(Some(0), 1 << 30).unwrap(), None);
        assert_eq!(
            cgroup::limit_bytes(Some(100), 1 << 30).unwrap(),
            Some(100 << 20)
        );
        assert!(cgroup::limit_bytes(Some(8), 1 << 30).is_err());
        assert!(cgroup::limit_bytes(Some(u64::MAX), 1 << 30).is_err());
    }
}
