//! `tiercache bench --workloads hits`: what tiercache costs on top of the device it reads and
//! writes, measured against a plain NBD file server and against fio on the file itself.
//!
//! 1. Cached reads: a cache file and a backing file, both written in full (no holes, so every
//!    read costs real I/O), `tiercache make --writeback`, one random read pass over a region of
//!    the export (`sequential_cutoff 0`), then a check in tiercache's stats that the whole
//!    region is cached. Then 4 KiB random reads for three servers on the same cache file, in
//!    turn per row: tiercache over the region, `nbdkit -r file CACHE cache=none fadvise=random`
//!    and fio `libaio` with O_DIRECT (no NBD) over the whole cache file. Rows: QD1 and QD32 on
//!    one connection, and 4 connections × QD8 (fio `numjobs=4`: each job its own connection).
//! 2. Passthrough: 4 KiB QD1 random writes to the backing file (a region the cache holds
//!    none of): tiercache in `writearound`, `nbdkit file` on that file (`cache=none`, which
//!    waits for each write to reach the file, and its default page cache), and fio `libaio`
//!    O_DIRECT on it.
//!
//! W4's 4 KiB sync-write row (writeback against the fast file alone) is not repeated here: it
//! is `--workloads W4 --configs ssd,tiercache-writeback`.
//!
//! Invariants: numbers come from fio's JSON, server CPU time from `/proc/PID/stat` (utime +
//! stime of the whole process, all threads) before and after each fio run, hit counts from
//! tiercache's admin `stats`; every ratio compares figures of the same run; nothing here
//! asserts a time. Every process is a [`Proc`] (stopped on every exit path) and the scratch
//! files live in `OUT/hits-scratch`, deleted at the end, also on error. A missing nbdkit
//! leaves its columns n/a with a notice; any other failure fails the workload.

use super::fio::{self, Target};
use super::procs::{self, Proc, Tiercache};
use super::report::{self, opt};
use super::scale::{self, Devices};
use super::Scale;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};
use tiercache_units::human;

/// Time limit of `make` and of the server's start.
const LIMIT: Duration = Duration::from_secs(120);
/// Bucket size of the cache (`make`'s default).
const BUCKET: u64 = 512 << 10;

/// Sizes and step length of one scale.
#[derive(Clone, Copy, Debug, Serialize)]
struct Params {
    /// The cached region of the export (reads), and the region written (passthrough).
    region_bytes: u64,
    /// The cache file: the region, a quarter more, and 16 MiB, so nothing is evicted.
    cache_bytes: u64,
    /// The backing file: two regions (read, then written) and 1 MiB for tiercache's header.
    backing_bytes: u64,
    step_ms: u64,
}

fn params(scale: Scale) -> Params {
    let (region, step_ms) = match scale {
        Scale::Tiny => (16 << 20, 500),
        Scale::Quick => (256 << 20, 5000),
        Scale::Full => (1 << 30, 30_000),
    };
    Params {
        region_bytes: region,
        cache_bytes: region + region / 4 + (16 << 20),
        backing_bytes: 2 * region + (1 << 20),
        step_ms,
    }
}

/// The rows of the read table: name, fio jobs (connections), queue depth per job.
const READ_ROWS: [(&str, u32, u32); 3] = [
    ("QD1, 1 connection", 1, 1),
    ("QD32, 1 connection", 1, 32),
    ("4 connections × QD8", 4, 8),
];

/// One fio run, and the server's CPU time over it.
#[derive(Clone, Debug, Serialize)]
struct Point {
    #[serde(flatten)]
    fio: fio::Measured,
    /// Server utime + stime over the run / I/Os (None: no server, i.e. fio on the file).
    server_cpu_us_per_io: Option<f64>,
    command: String,
}

/// One row of the read table.
#[derive(Clone, Debug, Serialize)]
struct ReadRow {
    row: String,
    numjobs: u32,
    iodepth: u32,
    tiercache: Point,
    /// Hits / (hits + misses) over the tiercache run, from its stats.
    tiercache_hit_pct: Option<f64>,
    tiercache_misses: u64,
    nbdkit: Option<Point>,
    raw: Point,
    /// tiercache IOPS / nbdkit IOPS.
    ratio_nbdkit: Option<f64>,
    /// tiercache IOPS / raw IOPS.
    ratio_raw: Option<f64>,
}

/// One server of the passthrough table.
#[derive(Clone, Debug, Serialize)]
struct WriteRow {
    server: String,
    point: Point,
    /// tiercache's mean latency minus this one's, µs (None on tiercache's own row).
    tiercache_minus_us: Option<f64>,
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (a > 0.0 && b > 0.0).then(|| a / b)
}

/// fio against `target` with `args`, and the CPU time `server` used meanwhile.
fn measure(target: &Target, server: Option<&Proc>, args: &[String]) -> Result<Point> {
    let cpu = || -> Result<Option<f64>> {
        server
            .map(|p| procs::cpu_seconds(p.pid()).context("reading the server's CPU time"))
            .transpose()
    };
    let cpu0 = cpu()?;
    let m = fio::run(target, args, None)?;
    let cpu1 = cpu()?;
    let per_io = cpu0
        .zip(cpu1)
        .map(|(a, b)| (b - a) * 1e6 / m.ios.max(1) as f64);
    Ok(Point {
        fio: m,
        server_cpu_us_per_io: per_io,
        command: fio::command_line(target, args),
    })
}

/// fio options of a 4 KiB random step of `p.step_ms` over `[offset, offset + size)`.
fn job(p: &Params, rw: &str, numjobs: u32, iodepth: u32, offset: u64, size: u64) -> Vec<String> {
    let mut v: Vec<String> = vec![
        format!("--rw={rw}"),
        "--bs=4k".into(),
        format!("--numjobs={numjobs}"),
        format!("--iodepth={iodepth}"),
        "--time_based".into(),
        format!("--runtime={}ms", p.step_ms),
        format!("--offset={offset}"),
        format!("--size={size}"),
    ];
    if rw == "randread" {
        v.push("--readonly".into());
    }
    v
}

/// Drops the page cache's copy of `path` (clean pages; the files are synced when written), so
/// nbdkit, which reads through the page cache, starts from the disk like the others.
fn evict(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: posix_fadvise(2) on a descriptor we own; it touches no memory of ours.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        bail!(
            "posix_fadvise on {}: {}",
            path.display(),
            std::io::Error::from_raw_os_error(r)
        );
    }
    Ok(())
}

/// `nbdkit file FILE OPTS` on a Unix socket in `dir`, up and listening.
fn nbdkit(dir: &Path, name: &str, file: &Path, opts: &[&str]) -> Result<(Proc, Target)> {
    let sock = dir.join(format!("{name}.sock"));
    let _ = std::fs::remove_file(&sock);
    let mut c = std::process::Command::new("nbdkit");
    c.arg("--foreground")
        .arg("-U")
        .arg(&sock)
        .args(opts.iter().filter(|o| o.starts_with('-')))
        .arg("file")
        .arg(file)
        .args(opts.iter().filter(|o| !o.starts_with('-')));
    let p = Proc::spawn(&mut c, "nbdkit", None)?;
    procs::wait_for(&sock, "nbdkit")?;
    Ok((
        p,
        Target::Nbd(format!("nbd+unix:///?socket={}", sock.display())),
    ))
}

/// What the workload measured.
struct Measured {
    cached_after_warm: u64,
    reads: Vec<ReadRow>,
    writes: Vec<WriteRow>,
}

/// Runs the hits workload and writes `hits.md` and `hits.json` into `out`.
pub fn run(tc: &Tiercache, scale: Scale, out: &Path) -> Result<()> {
    if !procs::on_path("fio") {
        bail!("fio is not installed (Debian: apt-get install fio)");
    }
    let mut notices = Vec::new();
    let have_nbdkit = procs::on_path("nbdkit");
    if !have_nbdkit {
        notices.push("nbdkit columns n/a: nbdkit is not installed".to_string());
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = std::fs::canonicalize(out)?;
    let scratch = out.join("hits-scratch");
    let p = params(scale);
    let t0 = Instant::now();
    let progress = |what: &str| eprintln!("{what} ({:.0} s elapsed)", t0.elapsed().as_secs_f64());
    let measured = measure_all(tc, &p, &scratch, have_nbdkit, &progress);
    let _ = std::fs::remove_dir_all(&scratch);
    let m = measured?;
    for r in &m.reads {
        if r.tiercache_misses > 0 {
            notices.push(format!(
                "{}: tiercache missed {} reads, so that row is not all hits",
                r.row, r.tiercache_misses
            ));
        }
    }
    let md = write(&out, scale, &p, &m, &notices)?;
    println!("{md}");
    Ok(())
}

fn measure_all(
    tc: &Tiercache,
    p: &Params,
    scratch: &Path,
    have_nbdkit: bool,
    progress: &dyn Fn(&str),
) -> Result<Measured> {
    progress(&format!(
        "hits: cache file {}, backing file {}, both written in full",
        human(p.cache_bytes),
        human(p.backing_bytes)
    ));
    // Deletes the scratch directory when dropped.
    let dev = Devices::create(tc, scratch, p.cache_bytes, p.backing_bytes)?;
    procs::write_whole_file(&dev.cache, p.cache_bytes)?;
    procs::write_whole_file(&dev.backing, p.backing_bytes)?;
    dev.make(BUCKET, LIMIT)?;
    let (mut server, _) = dev.serve(LIMIT)?;
    dev.set("sequential_cutoff", "0")?;
    let tc = Target::Nbd(dev.uri());
    let region = p.region_bytes;

    progress(&format!(
        "warm: one random 64 KiB read pass over {}",
        human(region)
    ));
    fio::run(
        &tc,
        &[
            "--rw=randread".into(),
            "--bs=64k".into(),
            "--iodepth=16".into(),
            format!("--size={region}"),
            "--readonly".into(),
        ],
        None,
    )?;
    let cached = scale::cached_bytes(&dev)?;
    if cached < region {
        bail!(
            "warming left {} of the {} region cached",
            human(cached),
            human(region)
        );
    }
    for f in [&dev.cache, &dev.backing] {
        evict(f)?;
    }

    let kit_dir = scratch.join("kit");
    std::fs::create_dir_all(&kit_dir)?;
    let kit = have_nbdkit
        .then(|| {
            nbdkit(
                &kit_dir,
                "read",
                &dev.cache,
                &["-r", "cache=none", "fadvise=random"],
            )
        })
        .transpose()?;
    let raw_cache = Target::Raw(dev.cache.clone());
    let mut reads = Vec::new();
    for (row, numjobs, iodepth) in READ_ROWS {
        progress(&format!(
            "cached reads, {row}: tiercache, nbdkit, fio on the file"
        ));
        let before = Some(scale::stats(&dev)?);
        let t = measure(
            &tc,
            Some(&server),
            &job(p, "randread", numjobs, iodepth, 0, region),
        )?;
        let after = Some(scale::stats(&dev)?);
        let delta = |k: &str| super::stat(&after, k) - super::stat(&before, k);
        let (hits, misses) = (delta("cache_hits"), delta("cache_misses"));
        let whole = job(p, "randread", numjobs, iodepth, 0, p.cache_bytes);
        let k = kit
            .as_ref()
            .map(|(proc_, target)| measure(target, Some(proc_), &whole))
            .transpose()?;
        let r = measure(&raw_cache, None, &whole)?;
        reads.push(ReadRow {
            row: row.into(),
            numjobs,
            iodepth,
            tiercache_hit_pct: (hits + misses > 0)
                .then(|| hits as f64 * 100.0 / (hits + misses) as f64),
            tiercache_misses: misses,
            ratio_nbdkit: k.as_ref().and_then(|k| ratio(t.fio.iops, k.fio.iops)),
            ratio_raw: ratio(t.fio.iops, r.fio.iops),
            tiercache: t,
            nbdkit: k,
            raw: r,
        });
    }
    drop(kit);

    // Passthrough: the second region of the export, which the cache holds none of. The raw run
    // goes first and nbdkit's page-cache run last, so that no other run pays for its dirty
    // pages being written back.
    progress("passthrough: 4 KiB QD1 random writes, writearound, nbdkit, fio on the file");
    dev.set("cache_mode", "writearound")?;
    let w = job(p, "randwrite", 1, 1, region, region);
    let mut writes = vec![WriteRow {
        server: "fio libaio O_DIRECT on the file (no NBD)".into(),
        point: measure(&Target::Raw(dev.backing.clone()), None, &w)?,
        tiercache_minus_us: None,
    }];
    let t = measure(&tc, Some(&server), &w)?;
    // Nothing more is asked of tiercache: stop it before nbdkit writes to its backing file.
    server.kill();
    writes.insert(
        0,
        WriteRow {
            server: "tiercache writearound".into(),
            point: t,
            tiercache_minus_us: None,
        },
    );
    if have_nbdkit {
        for (name, opts) in [
            ("nbdkit file cache=none", &["cache=none"][..]),
            ("nbdkit file (page cache)", &[][..]),
        ] {
            let (kit, target) = nbdkit(&kit_dir, "write", &dev.backing, opts)?;
            writes.push(WriteRow {
                server: name.into(),
                point: measure(&target, Some(&kit), &w)?,
                tiercache_minus_us: None,
            });
        }
    }
    let tc_lat = writes[0].point.fio.mean_lat_us;
    for r in writes.iter_mut().skip(1) {
        r.tiercache_minus_us = Some(tc_lat - r.point.fio.mean_lat_us);
    }
    Ok(Measured {
        cached_after_warm: cached,
        reads,
        writes,
    })
}

fn cpu(p: Option<&Point>) -> String {
    opt(p.and_then(|p| p.server_cpu_us_per_io), 1)
}

/// Writes hits.md and hits.json; returns the Markdown.
fn write(out: &Path, scale: Scale, p: &Params, m: &Measured, notices: &[String]) -> Result<String> {
    let (date, machine) = (report::date(), report::machine());
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let step_s = p.step_ms as f64 / 1000.0;
    let mut md = String::new();
    writeln!(
        md,
        "# tiercache bench: hits ({scale:?} scale, {date})\n\nMachine: {machine}. Command: `{command}`.\n\
         Files on the filesystem of `{}`: cache file {}, backing file {}, both written in full \
         (no holes), `tiercache make --writeback`, buckets of {}. {step_s} s per fio run. \
         Server CPU: utime + stime of the server process (all threads) over the fio run, per I/O.\n",
        out.display(),
        human(p.cache_bytes),
        human(p.backing_bytes),
        human(BUCKET),
    )?;
    for n in notices {
        writeln!(md, "> {n}\n")?;
    }
    writeln!(
        md,
        "## Cached 4 KiB random reads\n\n\
         tiercache: the first {} of its export, after one random 64 KiB read pass \
         (`sequential_cutoff 0`) left {} cached; hit % from its stats over each run. \
         nbdkit: `nbdkit -r file CACHE cache=none fadvise=random`; raw: fio `--ioengine=libaio \
         --direct=1` on the cache file; both over the whole cache file. Per row the three run \
         in turn; ratios are of IOPS.\n\n\
         | row | tiercache IOPS | nbdkit IOPS | raw IOPS | tiercache/nbdkit | tiercache/raw | tiercache CPU µs/IO | nbdkit CPU µs/IO | tiercache hit % |\n\
         |---|---|---|---|---|---|---|---|---|",
        human(p.region_bytes),
        human(m.cached_after_warm),
    )?;
    for r in &m.reads {
        writeln!(
            md,
            "| {} | {:.0} | {} | {:.0} | {} | {} | {} | {} | {} |",
            r.row,
            r.tiercache.fio.iops,
            opt(r.nbdkit.as_ref().map(|k| k.fio.iops), 0),
            r.raw.fio.iops,
            opt(r.ratio_nbdkit, 2),
            opt(r.ratio_raw, 2),
            cpu(Some(&r.tiercache)),
            cpu(r.nbdkit.as_ref()),
            opt(r.tiercache_hit_pct, 1),
        )?;
    }
    writeln!(
        md,
        "\n## Passthrough: 4 KiB QD1 random writes to the backing file\n\n\
         The second {} of the backing file, which the cache holds none of: tiercache in \
         `writearound` (the file as its local backing device, O_DIRECT), `nbdkit file` on the \
         same file with `cache=none` (each write goes through the page cache, is waited for with \
         `sync_file_range` and its pages dropped: no device flush, the closest to O_DIRECT) and \
         with its default page cache (the write returns once in RAM), and fio `--ioengine=libaio --direct=1` on the file. The last \
         column is tiercache's mean latency minus the row's.\n\n\
         | server | IOPS | mean µs | p99 µs | server CPU µs/IO | tiercache − this, µs |\n\
         |---|---|---|---|---|---|",
        human(p.region_bytes),
    )?;
    for r in &m.writes {
        writeln!(
            md,
            "| {} | {:.0} | {:.1} | {:.0} | {} | {} |",
            r.server,
            r.point.fio.iops,
            r.point.fio.mean_lat_us,
            r.point.fio.p99_lat_us,
            cpu(Some(&r.point)),
            opt(r.tiercache_minus_us, 1),
        )?;
    }
    writeln!(
        md,
        "\nThe fio command of every cell is in hits.json (`command`).\n\n\
         W4's 4 KiB sync random writes (writeback against the fast file alone) are not repeated \
         here: `tiercache bench --scale {} --workloads W4 --configs ssd,tiercache-writeback`, \
         row `sync randwrite 4k to 70 % of cache`.",
        format!("{scale:?}").to_lowercase()
    )?;
    std::fs::write(out.join("hits.md"), &md)?;
    let json = serde_json::json!({
        "date": date,
        "machine": machine,
        "command": command,
        "scale": scale,
        "params": p,
        "notices": notices,
        "cached_after_warm_bytes": m.cached_after_warm,
        "reads": m.reads,
        "writes": m.writes,
    });
    std::fs::write(out.join("hits.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_fit_their_files() {
        for scale in [Scale::Tiny, Scale::Quick, Scale::Full] {
            let p = params(scale);
            // The cached region fits the cache with room to spare; both regions fit the export.
            assert!(p.cache_bytes > p.region_bytes + p.region_bytes / 8);
            assert!(p.backing_bytes >= 2 * p.region_bytes + (1 << 20));
            let w = job(&p, "randwrite", 1, 1, p.region_bytes, p.region_bytes);
            assert!(!w.iter().any(|a| a == "--readonly"));
            assert!(job(&p, "randread", 4, 8, 0, p.region_bytes)
                .iter()
                .any(|a| a == "--readonly"));
        }
    }
}
