//! `tiercache bench --workloads hits`: what tiercache costs on top of the devices it reads and
//! writes, measured in one run against the physical ceilings (fio on the file itself, no NBD;
//! `nbdkit memory`, the NBD transport and fio's nbd client with no device behind them) and
//! against the NBD file servers a user would pick instead (`qemu-nbd`, `nbdkit file`).
//!
//! Set-up: a cache file and a backing file, both written in full (no holes, so every read
//! costs real I/O), `tiercache make --writeback`, `sequential_cutoff 0`, writeback paused
//! (`writeback_running 0`, so no background write competes with a measurement), one random
//! read pass over the first region of the export, then a check in tiercache's stats that the
//! whole region is cached.
//!
//! 1. Cached reads, per row the columns in turn: tiercache over the region; over the whole
//!    cache file `nbdkit -r file CACHE cache=none fadvise=random`, `qemu-nbd -r --cache=none
//!    --aio=io_uring -f raw CACHE` (`--aio=native` when io_uring is refused; its column says
//!    so), `nbdkit memory` of the cache file's size, and fio `libaio` O_DIRECT on the file
//!    (raw). Rows: 4 KiB random reads at QD1 and QD32 on one connection and 4 connections ×
//!    QD8 (fio `numjobs=4`: each job its own connection); 128 KiB sequential reads at QD8 on
//!    one connection (bandwidth). The CPUs are the scheduler's choice, except in two more QD32
//!    rows: the server's threads pinned to the one of the first two CPUs this process may use
//!    where fio alone on the cache file ran faster (a short probe first; raw's fio runs there
//!    too) and fio (`--cpus_allowed`) to the other ("on two CPUs"; not run on a machine with
//!    one), or both to the server's ("on one CPU"); the server gets every CPU back after each.
//! 2. Writeback writes: 4 KiB random writes at QD32 writing each block of a third region of
//!    the export once (bounded by size, capped by the step time), absorbed by the cache
//!    device as dirty data (its stats' dirty bytes must cover what fio wrote, else a notice);
//!    `nbdkit memory` and raw (on the cache file, once tiercache is stopped for good) write
//!    as much.
//! 3. When `tiercache serve --help` offers `--data-path` (probed once): tiercache restarted
//!    with `--data-path threads` runs the rows of 1 and 2 again (column "tiercache
//!    (threads)"), then the default server is started again. Without it, a notice.
//! 4. Passthrough, QD1 4 KiB random reads (`cache_mode none`) and writes (`writearound`) to
//!    the second region, which the cache holds none of: tiercache against fio on its backing
//!    device alone, for the local file (raw) and for an NBD export of the same file
//!    (`nbdkit file cache=none fadvise=random` on a Unix socket) with a second tiercache made
//!    on it (`--backing nbd+unix:///?socket=...`); the added µs are tiercache's mean and p50
//!    minus the device's. And the local writearound write against `nbdkit file` serving the
//!    backing file (`cache=none`, and its default page cache).
//!
//! W4's 4 KiB sync-write row (writeback against the fast file alone) is not repeated here: it
//! is `--workloads W4 --configs ssd,tiercache-writeback`.
//!
//! Invariants: numbers come from fio's JSON, server CPU time from `/proc/PID/stat` (utime +
//! stime of the whole process, all threads) before and after each fio run, hit, miss and
//! dirty counts from tiercache's admin `stats`; every ratio and every added µs compares
//! figures of the same run, and one whose figure is missing is n/a; nothing here asserts a
//! time. fio never writes to a file a running server uses: raw writes to the cache file and
//! nbdkit's writes to the backing file come after tiercache is stopped for good, and the
//! second tiercache is made on the backing file only then. Every process is a [`Proc`]
//! (stopped on every exit path) and the scratch files live in `OUT/hits-scratch`, deleted at
//! the end, also on error. A missing nbdkit or qemu-nbd leaves its columns and rows n/a with
//! a notice (an error under `CI=true`); any other failure fails the workload.

mod rows;
mod table;

use super::fio::{self, Target};
use super::procs::{self, Proc, Tiercache};
use super::scale::{self, Devices};
use super::Scale;
use anyhow::{bail, Context, Result};
use rows::{
    params, Column, Cpus, Measured, Params, PassRow, PeerRow, Place, Point, ReadRow, Shape,
    WriteRow, BUCKET, KIT_FILE, KIT_MEM, PASS_READ, PASS_WRITE, QD32, QEMU, RAW, READ_ROWS, TC,
    TC_THREADS, WRITE_ROW,
};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use tiercache_units::human;

/// Time limit of `make` and of the server's start.
const LIMIT: Duration = Duration::from_secs(120);
/// A column: what fio reaches, and the server process behind it (None: fio on the file).
struct Server {
    key: &'static str,
    name: String,
    proc_: Option<Proc>,
    target: Target,
}

impl Server {
    fn tiercache(&self) -> bool {
        self.key.starts_with(TC)
    }

    fn measure(&self, args: &[String]) -> Result<Point> {
        measure(&self.target, self.proc_.as_ref(), args)
    }
}

/// The optional columns available in this run.
struct Tools {
    nbdkit: bool,
    qemu_nbd: bool,
    /// `tiercache serve` offers `--data-path`.
    data_path: bool,
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

/// Picks [`Cpus`]: one short raw run on each of the first two CPUs.
fn pick_cpus(p: &Params, raw: &Server) -> Result<Cpus> {
    let allowed = procs::allowed_cpus()?;
    let mut probe = Vec::new();
    for &cpu in allowed.iter().take(2) {
        let mut args = job(p, &QD32, 0, p.cache_bytes, true);
        for a in args.iter_mut().filter(|a| a.starts_with("--runtime=")) {
            *a = format!("--runtime={}ms", (p.step_ms / 5).max(200));
        }
        args.push(format!("--cpus_allowed={cpu}"));
        probe.push((cpu, raw.measure(&args)?.fio.iops));
    }
    let best = probe
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .context("no CPU to run on")?;
    Ok(Cpus {
        server: best.0,
        client: probe.iter().map(|c| c.0).find(|&c| c != best.0),
        probe,
    })
}

/// `s.measure(args)` with the server's threads and fio where `place` puts them (raw's fio
/// where the server would be), the server given every CPU back after; None where this
/// machine has too few CPUs for `place`.
fn measure_placed(s: &Server, place: Place, cpus: &Cpus, args: &[String]) -> Result<Option<Point>> {
    let fio_cpu = match (place, cpus.client) {
        (Place::Scheduler, _) => return s.measure(args).map(Some),
        (Place::Apart, None) => return Ok(None),
        (Place::Apart, Some(c)) if s.proc_.is_some() => c,
        _ => cpus.server,
    };
    let pid = s.proc_.as_ref().map(Proc::pid);
    if let Some(pid) = pid {
        procs::set_cpus(pid, &[cpus.server])?;
    }
    let mut args = args.to_vec();
    args.push(format!("--cpus_allowed={fio_cpu}"));
    let point = s.measure(&args);
    if let Some(pid) = pid {
        procs::set_cpus(pid, &procs::allowed_cpus()?)?;
    }
    point.map(Some)
}

/// fio options of `s` over `[offset, offset + size)`: time-based for `p.step_ms`, or (not
/// `timed`) each block once, capped at `p.step_ms`.
fn job(p: &Params, s: &Shape, offset: u64, size: u64, timed: bool) -> Vec<String> {
    let mut v: Vec<String> = vec![
        format!("--rw={}", s.rw),
        format!("--bs={}", s.bs),
        format!("--numjobs={}", s.numjobs),
        format!("--iodepth={}", s.iodepth),
        format!("--runtime={}ms", p.step_ms),
        format!("--offset={offset}"),
        format!("--size={size}"),
    ];
    if timed {
        v.push("--time_based".into());
    }
    if !s.rw.contains("write") {
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

fn nbd_unix(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

/// `nbdkit --foreground -U DIR/NAME.sock ARGS` (flags, plugin, parameters), up and listening.
fn nbdkit<S: AsRef<OsStr>>(dir: &Path, name: &str, args: &[S]) -> Result<(Proc, String)> {
    let sock = dir.join(format!("{name}.sock"));
    let mut c = Command::new("nbdkit");
    c.arg("--foreground").arg("-U").arg(&sock).args(args);
    Ok((
        procs::listen(&mut c, "nbdkit", &sock, None)?,
        nbd_unix(&sock),
    ))
}

/// `qemu-nbd -r --cache=none --aio=io_uring -f raw` on `file` (`--aio=native` when io_uring
/// is refused, with a notice), on a Unix socket in `dir`, taking up to 8 connections. Returns
/// the server, its URI and its column name.
fn qemu_nbd(dir: &Path, file: &Path, notices: &mut Vec<String>) -> Result<(Proc, String, String)> {
    let sock = dir.join("qemu.sock");
    let start = |aio: &str| {
        let mut c = Command::new("qemu-nbd");
        c.args([
            "--read-only",
            "--persistent",
            "--shared=8",
            "--cache=none",
            &format!("--aio={aio}"),
            "--format=raw",
            "--socket",
        ])
        .arg(&sock)
        .arg(file);
        procs::listen(&mut c, &format!("qemu-nbd --aio={aio}"), &sock, None)
    };
    let (p, name) = match start("io_uring") {
        Ok(p) => (p, "qemu-nbd (aio=io_uring)".to_string()),
        Err(e) => {
            notices.push(format!("qemu-nbd runs with --aio=native: {e:#}"));
            (
                start("native")?,
                "qemu-nbd (aio=native: io_uring refused)".to_string(),
            )
        }
    };
    Ok((p, nbd_unix(&sock), name))
}

/// Whether `tiercache serve` offers `--data-path` (its help says so).
fn offers_data_path(tc: &Tiercache) -> Result<bool> {
    let help = procs::run_tool(
        tc.command().args(["serve", "--help"]),
        "tiercache serve --help",
    )?;
    Ok(help.contains("--data-path"))
}

/// tiercache serving `dev`, as the column `key` (`--data-path threads` for [`TC_THREADS`]).
fn serve(dev: &Devices, key: &'static str) -> Result<Server> {
    let (extra, name): (&[&str], _) = if key == TC_THREADS {
        (&["--data-path", "threads"], "tiercache (threads)")
    } else {
        (&[], "tiercache")
    };
    let (p, _) = dev.serve(LIMIT, extra)?;
    Ok(Server {
        key,
        name: name.into(),
        proc_: Some(p),
        target: Target::Nbd(dev.uri()),
    })
}

/// Runs the hits workload and writes `hits.md` and `hits.json` into `out`.
pub fn run(tc: &Tiercache, scale: Scale, out: &Path) -> Result<()> {
    if !procs::on_path("fio") {
        bail!("fio is not installed (Debian: apt-get install fio)");
    }
    let mut notices = Vec::new();
    let tools = Tools {
        nbdkit: procs::optional_tool(
            "nbdkit",
            "nbdkit",
            "the nbdkit columns and the passthrough rows through nbdkit (over NBD, nbdkit file)",
            &mut notices,
        )?,
        qemu_nbd: procs::optional_tool("qemu-nbd", "qemu-utils", "qemu-nbd column", &mut notices)?,
        data_path: offers_data_path(tc)?,
    };
    if !tools.data_path {
        notices.push(
            "no tiercache (threads) column: this tiercache serve has no --data-path option".into(),
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = std::fs::canonicalize(out)?;
    let scratch = out.join("hits-scratch");
    let p = params(scale);
    let t0 = Instant::now();
    let progress = |what: &str| eprintln!("{what} ({:.0} s elapsed)", t0.elapsed().as_secs_f64());
    let measured = measure_all(tc, &p, &scratch, &tools, &mut notices, &progress);
    let _ = std::fs::remove_dir_all(&scratch);
    let m = measured?;
    for r in &m.reads {
        if r.points.is_empty() {
            notices.push(format!(
                "{}: not run, this machine lets it use one CPU",
                r.shape.row
            ));
        }
        for (key, misses) in r.misses.iter().filter(|(_, m)| **m > 0) {
            notices.push(format!(
                "{}: {key} missed {misses} reads, so that cell is not all hits",
                r.shape.row
            ));
        }
    }
    for w in &m.writes {
        if let (Some(pt), Some(dirty)) = (&w.point, w.dirty_after_bytes) {
            let written = pt.fio.writes * 4096;
            if dirty < written {
                notices.push(format!(
                    "{}: {} of dirty data after {} written, so not every write was absorbed by the cache",
                    w.server,
                    human(dirty),
                    human(written)
                ));
            }
        }
    }
    let md = table::write(&out, scale, &p, &m, &notices)?;
    println!("{md}");
    Ok(())
}

fn measure_all(
    tc: &Tiercache,
    p: &Params,
    scratch: &Path,
    tools: &Tools,
    notices: &mut Vec<String>,
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
    let mut server = serve(&dev, TC)?;
    dev.set("sequential_cutoff", "0")?;
    dev.set("writeback_running", "0")?;

    let cached = warm(p, &dev, &server, progress)?;

    // The reference servers of the read table, all on the cache file (or its size).
    let kit_dir = scratch.join("kit");
    std::fs::create_dir_all(&kit_dir)?;
    let (columns, others) = reference_servers(p, &dev, &kit_dir, tools, notices)?;
    let raw_cache = Server {
        key: RAW,
        name: "raw".into(),
        proc_: None,
        target: Target::Raw(dev.cache.clone()),
    };

    let mut reads: Vec<ReadRow> = READ_ROWS
        .iter()
        .map(|&shape| ReadRow {
            shape,
            points: BTreeMap::new(),
            hit_pct: BTreeMap::new(),
            misses: BTreeMap::new(),
            tiercache_over: BTreeMap::new(),
        })
        .collect();
    let mut all: Vec<&Server> = vec![&server];
    all.extend(others.iter());
    all.push(&raw_cache);
    progress("which CPU: fio on the cache file alone, on each of the first two");
    let cpus = pick_cpus(p, &raw_cache)?;
    read_pass(p, &dev, &all, &cpus, &mut reads, progress)?;

    progress("writeback: 4 KiB random writes at QD32, tiercache and nbdkit memory");
    let mut writes = vec![write_tiercache(p, &dev, &server)?];
    let mem = others.iter().find(|s| s.key == KIT_MEM);
    writes.push(WriteRow {
        key: KIT_MEM,
        server: "nbdkit memory".into(),
        point: mem
            .map(|s| s.measure(&job(p, &WRITE_ROW, 0, p.write_bytes, false)))
            .transpose()?,
        over_raw: None,
        dirty_after_bytes: None,
    });
    drop(all);
    drop(others);

    if tools.data_path {
        progress("tiercache restarted with --data-path threads: the reads and writes again");
        drop(server);
        let threads = serve(&dev, TC_THREADS)?;
        read_pass(p, &dev, &[&threads], &cpus, &mut reads, progress)?;
        writes.insert(1, write_tiercache(p, &dev, &threads)?);
        drop(threads);
        server = serve(&dev, TC)?;
    }

    let (mut passthrough, tc_write) = local_passthrough(p, &dev, &server, progress)?;
    // Nothing more is asked of tiercache: stop it before anything else writes to its files.
    drop(server);
    progress("writeback: fio on the cache file");
    writes.push(WriteRow {
        key: RAW,
        server: "raw".into(),
        point: Some(raw_cache.measure(&job(p, &WRITE_ROW, 0, p.write_bytes, false))?),
        over_raw: None,
        dirty_after_bytes: None,
    });
    over_others(&mut writes, &mut reads);

    let peers = if tools.nbdkit {
        nbdkit_peers(p, &dev, &kit_dir, &tc_write, progress)?
    } else {
        Vec::new()
    };
    passthrough.extend(remote_passthrough(p, tc, &dev, &kit_dir, tools, progress)?);
    Ok(Measured {
        cached_after_warm: cached,
        cpus,
        columns,
        reads,
        writes,
        passthrough,
        peers,
    })
}

/// Warms the cache: one random 64 KiB read pass over the region, which must leave all of it
/// cached; then evicts both files from the page cache. Returns the bytes cached.
fn warm(p: &Params, dev: &Devices, server: &Server, progress: &dyn Fn(&str)) -> Result<u64> {
    let region = p.region_bytes;
    progress(&format!(
        "warm: one random 64 KiB read pass over {}",
        human(region)
    ));
    fio::run(
        &server.target,
        &[
            "--rw=randread".into(),
            "--bs=64k".into(),
            "--iodepth=16".into(),
            format!("--size={region}"),
            "--readonly".into(),
        ],
        None,
    )?;
    let cached = scale::cached_bytes(dev)?;
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
    Ok(cached)
}

/// The reference servers of the read table, all on the cache file (or its size), started
/// where their tools exist; every column, started or not.
fn reference_servers(
    p: &Params,
    dev: &Devices,
    kit_dir: &Path,
    tools: &Tools,
    notices: &mut Vec<String>,
) -> Result<(Vec<Column>, Vec<Server>)> {
    let mut others: Vec<Server> = Vec::new();
    let mut columns = vec![Column {
        key: TC,
        name: "tiercache".into(),
    }];
    if tools.data_path {
        columns.push(Column {
            key: TC_THREADS,
            name: "tiercache (threads)".into(),
        });
    }
    let mut column = |key: &'static str, name: String, started: Option<(Proc, String)>| {
        columns.push(Column {
            key,
            name: name.clone(),
        });
        if let Some((proc_, uri)) = started {
            others.push(Server {
                key,
                name,
                proc_: Some(proc_),
                target: Target::Nbd(uri),
            });
        }
    };
    let cache = dev.cache.as_os_str();
    let file_args = [
        OsStr::new("-r"),
        OsStr::new("file"),
        cache,
        OsStr::new("cache=none"),
        OsStr::new("fadvise=random"),
    ];
    let kit_file = tools
        .nbdkit
        .then(|| nbdkit(kit_dir, "file", &file_args))
        .transpose()?;
    column(KIT_FILE, "nbdkit file".into(), kit_file);
    let qemu = tools
        .qemu_nbd
        .then(|| qemu_nbd(kit_dir, &dev.cache, notices))
        .transpose()?;
    let qemu_name = qemu
        .as_ref()
        .map_or("qemu-nbd".to_string(), |q| q.2.clone());
    column(QEMU, qemu_name, qemu.map(|(p, uri, _)| (p, uri)));
    let size = p.cache_bytes.to_string();
    let kit_mem = tools
        .nbdkit
        .then(|| nbdkit(kit_dir, "memory", &["memory", size.as_str()]))
        .transpose()?;
    column(KIT_MEM, "nbdkit memory".into(), kit_mem);
    column(RAW, "raw".into(), None);
    Ok((columns, others))
}

/// Each write's IOPS over raw's, and each read row's tiercache IOPS over every other column's.
fn over_others(writes: &mut [WriteRow], reads: &mut [ReadRow]) {
    let raw_iops = writes
        .last()
        .and_then(|w| w.point.as_ref())
        .map(|pt| pt.fio.iops);
    for w in writes.iter_mut() {
        w.over_raw = w
            .point
            .as_ref()
            .zip(raw_iops)
            .and_then(|(pt, raw)| ratio(pt.fio.iops, raw));
    }
    for r in reads.iter_mut() {
        if let Some(t) = r.points.get(TC).map(|t| t.fio.iops) {
            r.tiercache_over = r
                .points
                .iter()
                .filter(|(k, _)| **k != TC)
                .filter_map(|(k, pt)| Some((*k, ratio(t, pt.fio.iops)?)))
                .collect();
        }
    }
}

/// `nbdkit file` on the backing file (with `cache=none` and with its page cache): the local
/// writearound write's peers, each against tiercache's write (`tc_write`).
fn nbdkit_peers(
    p: &Params,
    dev: &Devices,
    kit_dir: &Path,
    tc_write: &Point,
    progress: &dyn Fn(&str),
) -> Result<Vec<PeerRow>> {
    let region = p.region_bytes;
    let mut peers = Vec::new();
    progress("passthrough: nbdkit file on the backing file");
    let w = job(p, &PASS_WRITE, region, region, true);
    for (name, cache_opt) in [
        ("nbdkit file cache=none", Some("cache=none")),
        ("nbdkit file (page cache)", None),
    ] {
        let mut args = vec![OsStr::new("file"), dev.backing.as_os_str()];
        args.extend(cache_opt.map(OsStr::new));
        let (kit, uri) = nbdkit(kit_dir, "write", &args)?;
        let point = measure(&Target::Nbd(uri), Some(&kit), &w)?;
        peers.push(PeerRow {
            server: name.into(),
            tiercache_minus_us: tc_write.fio.mean_lat_us - point.fio.mean_lat_us,
            point,
        });
    }
    Ok(peers)
}

/// Runs every read row on each of `servers` in turn, row by row: tiercache over the cached
/// region (its hit % from `dev`'s stats around the run), the others over the whole cache file.
fn read_pass(
    p: &Params,
    dev: &Devices,
    servers: &[&Server],
    cpus: &Cpus,
    rows: &mut [ReadRow],
    progress: &dyn Fn(&str),
) -> Result<()> {
    let names: Vec<&str> = servers.iter().map(|s| s.name.as_str()).collect();
    for r in rows {
        progress(&format!(
            "cached reads, {}: {}",
            r.shape.row,
            names.join(", ")
        ));
        for s in servers {
            let place = r.shape.place;
            if !s.tiercache() {
                let args = job(p, &r.shape, 0, p.cache_bytes, true);
                if let Some(pt) = measure_placed(s, place, cpus, &args)? {
                    r.points.insert(s.key, pt);
                }
                continue;
            }
            let before = Some(scale::stats(dev)?);
            let args = job(p, &r.shape, 0, p.region_bytes, true);
            let Some(pt) = measure_placed(s, place, cpus, &args)? else {
                continue;
            };
            let after = Some(scale::stats(dev)?);
            let delta = |k: &str| super::stat(&after, k) - super::stat(&before, k);
            let (hits, misses) = (delta("cache_hits"), delta("cache_misses"));
            if hits + misses > 0 {
                r.hit_pct
                    .insert(s.key, hits as f64 * 100.0 / (hits + misses) as f64);
            }
            r.misses.insert(s.key, misses);
            r.points.insert(s.key, pt);
        }
    }
    Ok(())
}

/// The writeback writes on the tiercache `s` serves: the third region of its export.
fn write_tiercache(p: &Params, dev: &Devices, s: &Server) -> Result<WriteRow> {
    let offset = 2 * p.region_bytes;
    let point = s.measure(&job(p, &WRITE_ROW, offset, p.write_bytes, false))?;
    let dirty = scale::stats(dev)?["devices"][0]["dirty_bytes"]
        .as_u64()
        .context("stats have no devices[0].dirty_bytes")?;
    Ok(WriteRow {
        key: s.key,
        server: s.name.clone(),
        point: Some(point),
        over_raw: None,
        dirty_after_bytes: Some(dirty),
    })
}

/// The passthrough rows of the local backing file: reads in `cache_mode none` and writes in
/// `writearound` to the second region, fio on the file first. Also returns tiercache's write.
fn local_passthrough(
    p: &Params,
    dev: &Devices,
    server: &Server,
    progress: &dyn Fn(&str),
) -> Result<(Vec<PassRow>, Point)> {
    progress("passthrough, local backing file: fio on the file, then tiercache");
    let raw = Target::Raw(dev.backing.clone());
    let mut rows = Vec::new();
    let mut last = None;
    for (shape, mode) in [(PASS_READ, "none"), (PASS_WRITE, "writearound")] {
        dev.set("cache_mode", mode)?;
        let args = job(p, &shape, p.region_bytes, p.region_bytes, true);
        let alone = measure(&raw, None, &args)?;
        let t = server.measure(&args)?;
        last = Some(t.clone());
        rows.push(pass_row("local file", shape, mode, Some(alone), Some(t)));
    }
    Ok((rows, last.context("no passthrough write")?))
}

fn pass_row(
    backing: &'static str,
    shape: Shape,
    mode: &'static str,
    alone: Option<Point>,
    tiercache: Option<Point>,
) -> PassRow {
    let both = alone.as_ref().zip(tiercache.as_ref());
    PassRow {
        backing,
        shape,
        tiercache_mode: mode,
        added_mean_us: both.map(|(a, t)| t.fio.mean_lat_us - a.fio.mean_lat_us),
        added_p50_us: both.map(|(a, t)| t.fio.p50_lat_us - a.fio.p50_lat_us),
        alone,
        tiercache,
    }
}

/// The passthrough rows over NBD: `nbdkit file` serves the backing file (tiercache on it is
/// stopped) on a Unix socket, a second tiercache is made on that export with a cache file of
/// its own, and fio on the export runs first, then fio on that tiercache. n/a without nbdkit.
fn remote_passthrough(
    p: &Params,
    tc: &Tiercache,
    dev: &Devices,
    kit_dir: &Path,
    tools: &Tools,
    progress: &dyn Fn(&str),
) -> Result<Vec<PassRow>> {
    const BACKING: &str = "NBD export (nbdkit file)";
    let shapes = [(PASS_READ, "none"), (PASS_WRITE, "writearound")];
    if !tools.nbdkit {
        return Ok(shapes
            .iter()
            .map(|&(s, mode)| pass_row(BACKING, s, mode, None, None))
            .collect());
    }
    progress("passthrough, NBD backing device: fio on nbdkit's export, then tiercache on it");
    let (kit, uri) = nbdkit(
        kit_dir,
        "backing",
        &[
            OsStr::new("file"),
            dev.backing.as_os_str(),
            OsStr::new("cache=none"),
            OsStr::new("fadvise=random"),
        ],
    )?;
    let dir = kit_dir.join("remote");
    let remote = Devices::over_nbd(tc, &dir, p.remote_cache_bytes, &dev.backing, uri.clone())?;
    procs::write_whole_file(&remote.cache, p.remote_cache_bytes)?;
    remote.make(BUCKET, LIMIT)?;
    let server = serve(&remote, TC)?;
    remote.set("sequential_cutoff", "0")?;
    let alone = Target::Nbd(uri);
    let mut rows = Vec::new();
    for (shape, mode) in shapes {
        remote.set("cache_mode", mode)?;
        let args = job(p, &shape, p.region_bytes, p.region_bytes, true);
        let a = measure(&alone, Some(&kit), &args)?;
        let t = server.measure(&args)?;
        rows.push(pass_row(BACKING, shape, mode, Some(a), Some(t)));
    }
    // tiercache first: it holds connections to nbdkit.
    drop(server);
    drop(kit);
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_fit_their_files() {
        for scale in [Scale::Tiny, Scale::Quick, Scale::Full] {
            let p = params(scale);
            // The cached region and two passes of writeback writes fit the cache with room to
            // spare; the three regions fit the export (the backing file less 1 MiB of header).
            assert!(p.cache_bytes >= p.region_bytes + 2 * p.write_bytes + (16 << 20));
            assert!(p.backing_bytes >= 2 * p.region_bytes + p.write_bytes + (1 << 20));
            let w = job(&p, &WRITE_ROW, 2 * p.region_bytes, p.write_bytes, false);
            assert!(!w.iter().any(|a| a == "--readonly" || a == "--time_based"));
            for s in READ_ROWS {
                let r = job(&p, &s, 0, p.region_bytes, true);
                assert!(r.iter().any(|a| a == "--readonly"));
                assert!(r.iter().any(|a| a == "--time_based"));
            }
        }
    }

    pub(super) fn point(iops: f64, mean: f64, p50: f64) -> Point {
        Point {
            fio: fio::Measured {
                ios: 100,
                iops,
                bw_mib_s: iops / 256.0,
                mean_lat_us: mean,
                p50_lat_us: p50,
                ..fio::Measured::default()
            },
            server_cpu_us_per_io: Some(10.0),
            command: "fio".into(),
        }
    }

    #[test]
    fn added_latency_needs_both_figures() {
        let r = pass_row(
            "local file",
            PASS_READ,
            "none",
            Some(point(1.0, 50.0, 40.0)),
            Some(point(1.0, 70.5, 45.0)),
        );
        assert_eq!((r.added_mean_us, r.added_p50_us), (Some(20.5), Some(5.0)));
        let r = pass_row(
            "x",
            PASS_WRITE,
            "writearound",
            None,
            Some(point(1.0, 7.0, 7.0)),
        );
        assert_eq!((r.added_mean_us, r.added_p50_us), (None, None));
    }
}
