//! `tiercache bench --workloads scale`: the engine at real size. For each cache size (a sparse
//! cache file, and a sparse backing file four times as big and at least 16 GiB) it times
//! `tiercache make`, the first start of `tiercache serve` until an NBD client is answered (with
//! the server's peak RSS while starting and its RSS once serving), fills the cache through NBD
//! with random, non-adjacent 4 KiB writes in writeback mode (RSS after, and its growth per
//! cached block), and times a restart after SIGKILL (with its peak RSS). Then, on a cache small
//! enough to fill, it drives 4 KiB random writes into a full-cache steady state and reports the
//! server's CPU time per write, once per bucket size.
//!
//! Invariants: every step has a time limit; a step that runs out of time is a value of its row
//! ("timeout" in the notes), not an abort, and the steps of that row that need it are left out,
//! saying why. Every process started here is a [`Proc`] (stopped on every exit path, error or
//! not); the scratch files of a row live in `OUT/scale-scratch` and are deleted once the row is
//! done, also on error. RSS comes from `/proc/PID/status` (VmHWM, VmRSS), CPU time from
//! `/proc/PID/stat` (utime + stime), cached bytes from the server's admin `stats`, I/O counts
//! from fio's JSON. Nothing here asserts a time.
//!
//! Fault model: a server that dies, a tool that fails, or a step that runs out of time costs
//! its row (its notes say what happened), never the run; the command exits non-zero at the end
//! if a step failed (running out of time is a measurement, not a failure). A server that
//! brings the machine's available memory under a floor (5 % of RAM, at least 1 GiB) is killed
//! and its row says so, so that measuring never takes the machine down.

use super::fio::{self, Target};
use super::procs::{self, Proc, Tiercache};
use super::report::{self, opt};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tiercache_units::{human, parse_size};

/// Options of the `scale` workload (ignored by W1–W7).
#[derive(clap::Args)]
pub struct ScaleArgs {
    /// scale: cache sizes, comma separated (sparse files; backing 4× each, at least 16 GiB).
    #[arg(long = "scale-caches", value_delimiter = ',', value_parser = parse_size,
          default_value = "4G,64G,1T", value_name = "SIZES")]
    caches: Vec<u64>,
    /// scale: bytes of random 4 KiB writes that fill each cache before the restart.
    #[arg(long = "scale-fill", value_parser = parse_size, default_value = "1G", value_name = "BYTES")]
    fill: u64,
    /// scale: cache size of the CPU-per-write step, driven into a full-cache steady state
    /// (0 leaves the step out).
    #[arg(long = "scale-cpu-cache", value_parser = parse_size, default_value = "4G",
          value_name = "SIZE")]
    cpu_cache: u64,
    /// scale: bucket sizes of the CPU-per-write step, comma separated.
    #[arg(long = "scale-cpu-buckets", value_delimiter = ',', value_parser = parse_size,
          default_value = "64k,512k", value_name = "SIZES")]
    cpu_buckets: Vec<u64>,
    /// scale: seconds of the measured window of the CPU-per-write step.
    #[arg(long = "scale-cpu-window", default_value_t = 20, value_name = "SECS")]
    cpu_window_s: u64,
    /// scale: time limit of each step in seconds (make, start, fill, restart, fill to full).
    #[arg(long = "scale-step-limit", default_value_t = 600, value_name = "SECS")]
    step_limit_s: u64,
}

const BLOCK: u64 = 4096;
/// The label (export name) of the device `Devices::make` formats.
const LABEL: &str = "scale";
const MIN_BACKING: u64 = 16 << 30;
/// The bucket size of the size rows (`make`'s default).
const SIZE_ROW_BUCKET: u64 = 512 << 10;
/// Queue depth of every fio run.
const QD: u32 = 16;
/// The cache counts as full once this share of its buckets holds data (bcache's in_use).
const FULL_IN_USE_PCT: u64 = 95;

/// One cache size: make, start, fill, restart.
#[derive(Clone, Debug, Default, Serialize)]
struct SizeRow {
    cache_bytes: u64,
    backing_bytes: u64,
    bucket_bytes: u64,
    make_s: Option<f64>,
    start_s: Option<f64>,
    start_peak_rss_bytes: Option<u64>,
    serving_rss_bytes: Option<u64>,
    fill_s: Option<f64>,
    fill_written_bytes: Option<u64>,
    fill_iops: Option<f64>,
    cached_bytes: Option<u64>,
    filled_rss_bytes: Option<u64>,
    /// (RSS after filling − RSS once serving) / cached 4 KiB blocks.
    rss_growth_per_cached_block: Option<f64>,
    restart_s: Option<f64>,
    restart_peak_rss_bytes: Option<u64>,
    restart_cached_bytes: Option<u64>,
    notes: Vec<String>,
}

/// One bucket size of the CPU-per-write step.
#[derive(Clone, Debug, Default, Serialize)]
struct CpuRow {
    cache_bytes: u64,
    backing_bytes: u64,
    bucket_bytes: u64,
    /// Bytes written to get the cache full, and how long it took.
    to_full_written_bytes: Option<u64>,
    to_full_s: Option<f64>,
    in_use_pct_before: Option<u64>,
    in_use_pct_after: Option<u64>,
    window_s: Option<f64>,
    writes: Option<u64>,
    iops: Option<f64>,
    server_cpu_s: Option<f64>,
    server_cpu_us_per_write: Option<f64>,
    notes: Vec<String>,
}

/// A limit reached (time, memory): a measurement of its own, not a failure.
#[derive(Debug)]
struct Stopped(String);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Stopped {}

/// Records how a row ended early in its notes; true if it was a failure (not a limit).
fn ended(notes: &mut Vec<String>, e: anyhow::Error) -> bool {
    let failed = e.downcast_ref::<Stopped>().is_none();
    let msg = format!("{}{e:#}", if failed { "FAILED: " } else { "" });
    eprintln!("    {msg}");
    notes.push(msg);
    failed
}

/// Runs the scale workload and writes `scale.md` and `scale.json` into `out`.
pub fn run(tc: &Tiercache, a: &ScaleArgs, out: &Path) -> Result<()> {
    validate(a)?;
    if !procs::on_path("fio") {
        bail!("fio is not installed (Debian: apt-get install fio)");
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = std::fs::canonicalize(out)?;
    let scratch = out.join("scale-scratch");
    let limit = Duration::from_secs(a.step_limit_s);
    let t0 = Instant::now();
    let progress = |what: &str| {
        eprintln!("{what} ({:.0} s elapsed)", t0.elapsed().as_secs_f64());
    };
    let mut failures = 0;
    let mut sizes = Vec::new();
    for (i, &cache) in a.caches.iter().enumerate() {
        progress(&format!(
            "[{}/{}] cache {}",
            i + 1,
            a.caches.len(),
            human(cache)
        ));
        let mut row = SizeRow {
            cache_bytes: cache,
            backing_bytes: backing_for(cache),
            bucket_bytes: SIZE_ROW_BUCKET,
            ..SizeRow::default()
        };
        if let Err(e) = size_row(
            tc,
            &mut row,
            &scratch.join(format!("size-{i}")),
            a.fill,
            limit,
        ) {
            failures += usize::from(ended(&mut row.notes, e));
        }
        sizes.push(row);
    }
    let mut cpu = Vec::new();
    if a.cpu_cache > 0 {
        for &bucket in &a.cpu_buckets {
            progress(&format!(
                "CPU per write: cache {}, buckets of {}",
                human(a.cpu_cache),
                human(bucket)
            ));
            let mut row = CpuRow {
                cache_bytes: a.cpu_cache,
                backing_bytes: backing_for(a.cpu_cache),
                bucket_bytes: bucket,
                ..CpuRow::default()
            };
            let dir = scratch.join(format!("cpu-{bucket}"));
            if let Err(e) = cpu_row(tc, &mut row, &dir, a.cpu_window_s, limit) {
                failures += usize::from(ended(&mut row.notes, e));
            }
            cpu.push(row);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let md = write(&out, a, &sizes, &cpu)?;
    println!("{md}");
    if failures > 0 {
        bail!("{failures} step(s) of the scale workload failed; see the notes in scale.md");
    }
    Ok(())
}

fn validate(a: &ScaleArgs) -> Result<()> {
    if a.caches.is_empty() && a.cpu_cache == 0 {
        bail!("--scale-caches is empty and --scale-cpu-cache is 0: nothing to measure");
    }
    for (what, v) in a
        .caches
        .iter()
        .map(|c| ("--scale-caches", *c))
        .chain([("--scale-fill", a.fill), ("--scale-cpu-cache", a.cpu_cache)])
        .chain(a.cpu_buckets.iter().map(|b| ("--scale-cpu-buckets", *b)))
    {
        if v % BLOCK != 0 || (v == 0 && what != "--scale-cpu-cache") {
            bail!("{what}: {v} is not a positive multiple of 4 KiB");
        }
    }
    if a.cpu_cache > 0 && a.cpu_buckets.is_empty() {
        bail!("--scale-cpu-buckets is empty");
    }
    if a.cpu_window_s == 0 || a.step_limit_s == 0 {
        bail!("--scale-cpu-window and --scale-step-limit must be at least 1 second");
    }
    Ok(())
}

/// The backing device of a cache: four times its size, at least 16 GiB.
fn backing_for(cache: u64) -> u64 {
    (cache.saturating_mul(4)).max(MIN_BACKING)
}

/// A cache file and a backing file (both sparse) in a scratch directory deleted on drop, and
/// the sockets of the server over them. Also used by the `hits` workload.
pub(super) struct Devices {
    dir: PathBuf,
    pub(super) cache: PathBuf,
    /// The backing file (the one served at `backing_uri` when that is set).
    pub(super) backing: PathBuf,
    /// How tiercache reaches the backing device when it is an NBD export (None: the file).
    backing_uri: Option<String>,
    socket: PathBuf,
    tc: Tiercache,
}

impl Devices {
    pub(super) fn create(
        tc: &Tiercache,
        dir: &Path,
        cache_bytes: u64,
        backing_bytes: u64,
    ) -> Result<Devices> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let d = Devices {
            dir: dir.to_path_buf(),
            cache: dir.join("cache.img"),
            backing: dir.join("backing.img"),
            backing_uri: None,
            socket: dir.join("tc.sock"),
            tc: tc.clone(),
        };
        for (p, len) in [(&d.cache, cache_bytes), (&d.backing, backing_bytes)] {
            sparse(p, len)?;
        }
        Ok(d)
    }

    /// A sparse cache file in `dir` (removed when dropped, like `dir`) in front of the NBD
    /// export `uri`, which serves the file `backing` (left alone when dropped).
    pub(super) fn over_nbd(
        tc: &Tiercache,
        dir: &Path,
        cache_bytes: u64,
        backing: &Path,
        uri: String,
    ) -> Result<Devices> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let d = Devices {
            dir: dir.to_path_buf(),
            cache: dir.join("cache.img"),
            backing: backing.to_path_buf(),
            backing_uri: Some(uri),
            socket: dir.join("tc.sock"),
            tc: tc.clone(),
        };
        sparse(&d.cache, cache_bytes)?;
        Ok(d)
    }

    /// The backing device as `make` and `serve` take it.
    fn backing_arg(&self) -> &std::ffi::OsStr {
        match &self.backing_uri {
            Some(uri) => uri.as_ref(),
            None => self.backing.as_os_str(),
        }
    }

    pub(super) fn uri(&self) -> String {
        format!("nbd+unix:///{LABEL}?socket={}", self.socket.display())
    }

    pub(super) fn admin(&self) -> PathBuf {
        procs::admin_socket(&self.socket)
    }

    /// `tiercache make ... --writeback` with `bucket` bytes per bucket; its wall time. With
    /// `--force`: the devices are the harness's own scratch files, and a backing file reached
    /// over NBD may hold the header of a device made on it before.
    pub(super) fn make(&self, bucket: u64, limit: Duration) -> Result<f64> {
        let mut c = self.tc.command();
        c.args([
            "make",
            "--force",
            "--label",
            LABEL,
            "--writeback",
            "--bucket-size",
        ])
        .arg(bucket.to_string())
        .arg("--backing")
        .arg(self.backing_arg())
        .arg("--cache")
        .arg(&self.cache);
        match procs::run_tool_within(&mut c, "tiercache make", limit)? {
            Some(t) => Ok(t.as_secs_f64()),
            None => Err(timeout("make", limit)),
        }
    }

    /// Changes a knob of the device (`sequential_cutoff`, `cache_mode`, ...).
    pub(super) fn set(&self, knob: &str, value: &str) -> Result<()> {
        self.tc.set(&self.admin(), LABEL, knob, value)
    }

    /// Spawns `tiercache serve` and waits until an NBD client completes its handshake.
    /// Returns the server and the wall time from spawn to the answer. Congestion bypass is
    /// off: these benches measure the cache's own paths (hits, fills, starts), and on a
    /// loaded machine a cache file slower than 20 ms per write would send misses around
    /// the cache instead of caching them (a CI run of the hits bench left a quarter of its
    /// warmed region uncached that way). `extra`: more options of `serve`.
    pub(super) fn serve(&self, limit: Duration, extra: &[&str]) -> Result<(Proc, f64)> {
        // A killed server leaves its sockets behind.
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(self.admin());
        let mut c = self.tc.command();
        c.arg("serve")
            .arg("--cache")
            .arg(&self.cache)
            .arg("--backing")
            .arg(self.backing_arg())
            .arg("--socket")
            .arg(&self.socket)
            .arg("--admin")
            .arg(self.admin())
            .args([
                "--congested-read-threshold-us",
                "0",
                "--congested-write-threshold-us",
                "0",
            ])
            .args(extra);
        let t = Instant::now();
        let mut server = Proc::spawn(&mut c, "tiercache serve", None)?;
        let answered = connect_loop(self.uri());
        let floor = memory_floor();
        loop {
            if answered.rx.recv_timeout(Duration::from_millis(5)).is_ok() {
                return Ok((server, t.elapsed().as_secs_f64()));
            }
            if let Some(how) = server.exited() {
                bail!("tiercache serve exited ({how}) before answering an NBD client");
            }
            if t.elapsed() > limit {
                return Err(timeout("start", limit));
            }
            if let Some(avail) = mem_available().filter(|a| *a < floor) {
                let rss = status_bytes(server.pid(), "VmRSS:").unwrap_or(0);
                server.kill();
                return Err(Stopped(format!(
                    "start stopped after {:.0} s: the machine had {} of memory left (server RSS {})",
                    t.elapsed().as_secs_f64(),
                    human(avail),
                    human(rss)
                ))
                .into());
            }
        }
    }
}

fn sparse(path: &Path, len: u64) -> Result<()> {
    std::fs::File::create(path)
        .and_then(|f| f.set_len(len))
        .with_context(|| format!("creating sparse {}", path.display()))
}

impl Drop for Devices {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn timeout(step: &str, limit: Duration) -> anyhow::Error {
    Stopped(format!(
        "timeout: {step} took longer than {} s",
        limit.as_secs()
    ))
    .into()
}

/// Tries an NBD handshake on `uri` every few milliseconds on a thread of its own (a handshake
/// that hangs cannot stall the caller's time limit); one message once it succeeds. The thread
/// stops when the returned value is dropped.
struct Answered {
    rx: mpsc::Receiver<()>,
    stop: Arc<AtomicBool>,
}

impl Drop for Answered {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn connect_loop(uri: String) -> Answered {
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let halt = stop.clone();
    std::thread::spawn(move || {
        while !halt.load(Ordering::SeqCst) {
            if blockdev::NbdDevice::connect(&uri).is_ok() {
                let _ = tx.send(());
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    Answered { rx, stop }
}

/// A field of `/proc/PID/status` given in kB (`VmHWM:`, `VmRSS:`), in bytes.
fn status_bytes(pid: u32, key: &str) -> Option<u64> {
    kib_field(
        &std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
        key,
    )
}

fn kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

fn mem_available() -> Option<u64> {
    kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable:",
    )
}

/// Available memory under which a starting server is killed: 5 % of RAM, at least 1 GiB.
fn memory_floor() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| kib_field(&m, "MemTotal:"))
        .unwrap_or(0);
    (total / 20).max(1 << 30)
}

/// The server's admin `stats`.
pub(super) fn stats(dev: &Devices) -> Result<serde_json::Value> {
    dev.tc.stats(&dev.admin())
}

pub(super) fn cached_bytes(dev: &Devices) -> Result<u64> {
    stats(dev)?["devices"][0]["cached_bytes"]
        .as_u64()
        .context("stats have no devices[0].cached_bytes")
}

fn in_use_pct(dev: &Devices) -> Result<u64> {
    stats(dev)?["cache"]["in_use"]
        .as_u64()
        .context("stats have no cache.in_use")
}

/// fio's 4 KiB random writes at QD16 on the export, `extra` saying how many and where.
fn randwrite(dev: &Devices, extra: &[String]) -> Result<fio::Measured> {
    let mut args: Vec<String> = vec![
        "--rw=randwrite".into(),
        format!("--bs={BLOCK}"),
        format!("--iodepth={QD}"),
    ];
    args.extend_from_slice(extra);
    fio::run(&Target::Nbd(dev.uri()), &args, None)
}

/// make, start, fill, kill -9, restart on one cache size, filling `row` as it goes.
fn size_row(
    tc: &Tiercache,
    row: &mut SizeRow,
    dir: &Path,
    fill: u64,
    limit: Duration,
) -> Result<()> {
    let dev = Devices::create(tc, dir, row.cache_bytes, row.backing_bytes)?;
    eprintln!("    make");
    row.make_s = Some(dev.make(row.bucket_bytes, limit)?);
    eprintln!("    start (empty)");
    let (mut server, start_s) = dev.serve(limit, &[])?;
    row.start_s = Some(start_s);
    row.start_peak_rss_bytes = status_bytes(server.pid(), "VmHWM:");
    let serving = status_bytes(server.pid(), "VmRSS:");
    row.serving_rss_bytes = serving;

    eprintln!("    fill {} of random 4 KiB writes", human(fill));
    // Aligned to 8 KiB, so no two writes are adjacent (fio then draws offsets with
    // replacement: a few land twice, which `cached_bytes` shows). Fixed seed: every run
    // writes the same offsets. fio stops at the step limit on its own.
    let m = randwrite(
        &dev,
        &[
            format!("--blockalign={}", 2 * BLOCK),
            format!("--io_size={fill}"),
            "--randrepeat=1".into(),
            "--randseed=4242".into(),
            format!("--runtime={}", limit.as_secs()),
        ],
    )?;
    row.fill_s = Some(m.runtime_s);
    row.fill_written_bytes = Some(m.ios * BLOCK);
    row.fill_iops = Some(m.iops);
    if m.ios * BLOCK < fill {
        row.notes
            .push(timeout("fill", limit).to_string() + " (the rest was measured after it)");
    }
    let cached = cached_bytes(&dev)?;
    row.cached_bytes = Some(cached);
    let filled = status_bytes(server.pid(), "VmRSS:");
    row.filled_rss_bytes = filled;
    if let (Some(before), Some(after)) = (serving, filled) {
        row.rss_growth_per_cached_block =
            (cached > 0).then(|| (after as f64 - before as f64) / (cached / BLOCK) as f64);
    }

    eprintln!("    kill -9, restart");
    server.kill();
    let (mut server, restart_s) = dev.serve(limit, &[])?;
    row.restart_s = Some(restart_s);
    row.restart_peak_rss_bytes = status_bytes(server.pid(), "VmHWM:");
    row.restart_cached_bytes = Some(cached_bytes(&dev)?);
    // The devices are deleted next: nothing to save.
    server.kill();
    Ok(())
}

/// 4 KiB random writes over 4× the cache until it is full, then a measured window: server
/// CPU time per write.
fn cpu_row(
    tc: &Tiercache,
    row: &mut CpuRow,
    dir: &Path,
    window_s: u64,
    limit: Duration,
) -> Result<()> {
    let dev = Devices::create(tc, dir, row.cache_bytes, row.backing_bytes)?;
    dev.make(row.bucket_bytes, limit)?;
    let (mut server, _) = dev.serve(limit, &[])?;
    eprintln!("    fill until {FULL_IN_USE_PCT} % of the buckets hold data");
    // In chunks of 1/16 of the cache (each its own seed), checking in_use between chunks.
    let chunk = (row.cache_bytes / 16).max(1 << 20) / BLOCK * BLOCK;
    let t = Instant::now();
    let mut written = 0;
    let mut seed = 1;
    let mut in_use = in_use_pct(&dev)?;
    while in_use < FULL_IN_USE_PCT {
        let left = limit.saturating_sub(t.elapsed()).as_secs();
        if left == 0 {
            row.to_full_written_bytes = Some(written);
            return Err(timeout("filling the cache", limit));
        }
        let m = randwrite(
            &dev,
            &[
                "--norandommap".into(),
                format!("--randseed={seed}"),
                format!("--io_size={chunk}"),
                format!("--runtime={left}"),
            ],
        )?;
        written += m.ios * BLOCK;
        seed += 1;
        in_use = in_use_pct(&dev)?;
    }
    row.to_full_written_bytes = Some(written);
    row.to_full_s = Some(t.elapsed().as_secs_f64());
    row.in_use_pct_before = Some(in_use);

    eprintln!("    measured window of {window_s} s");
    let pid = server.pid();
    let cpu0 = procs::cpu_seconds(pid).context("reading the server's CPU time")?;
    let m = randwrite(
        &dev,
        &[
            "--norandommap".into(),
            "--randseed=999".into(),
            "--time_based".into(),
            format!("--runtime={window_s}"),
        ],
    )?;
    let cpu = procs::cpu_seconds(pid).context("reading the server's CPU time")? - cpu0;
    row.in_use_pct_after = Some(in_use_pct(&dev)?);
    row.window_s = Some(m.runtime_s);
    row.writes = Some(m.ios);
    row.iops = Some(m.iops);
    row.server_cpu_s = Some(cpu);
    row.server_cpu_us_per_write = Some(cpu * 1e6 / m.ios.max(1) as f64);
    server.kill();
    Ok(())
}

fn mib(v: Option<u64>) -> String {
    opt(v.map(|b| b as f64 / (1 << 20) as f64), 0)
}

fn notes(n: &[String]) -> String {
    n.join("; ").replace('|', "/")
}

/// Writes scale.md and scale.json; returns the Markdown.
fn write(out: &Path, a: &ScaleArgs, sizes: &[SizeRow], cpu: &[CpuRow]) -> Result<String> {
    let (date, machine) = (report::date(), report::machine());
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let mut md = String::new();
    writeln!(
        md,
        "# tiercache bench: scale ({date})\n\nMachine: {machine}. Command: `{command}`.\n\
         Sparse cache and backing files (backing 4× the cache, at least 16 GiB) on the filesystem of `{}`; \
         fill: {} of random 4 KiB writes (8 KiB-aligned, QD{QD}) in writeback mode; \
         step limit {} s.\n",
        out.display(),
        human(a.fill),
        a.step_limit_s
    )?;
    if !sizes.is_empty() {
        writeln!(
            md,
            "| cache | backing | make s | start s | start peak RSS MiB | serving RSS MiB | fill s | fill IOPS | cached MiB | RSS after fill MiB | RSS B / cached block | restart s (kill -9) | restart peak RSS MiB | cached MiB after restart | notes |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        )?;
        for r in sizes {
            writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                human(r.cache_bytes),
                human(r.backing_bytes),
                opt(r.make_s, 2),
                opt(r.start_s, 2),
                mib(r.start_peak_rss_bytes),
                mib(r.serving_rss_bytes),
                opt(r.fill_s, 1),
                opt(r.fill_iops, 0),
                mib(r.cached_bytes),
                mib(r.filled_rss_bytes),
                opt(r.rss_growth_per_cached_block, 1),
                opt(r.restart_s, 2),
                mib(r.restart_peak_rss_bytes),
                mib(r.restart_cached_bytes),
                notes(&r.notes)
            )?;
        }
        writeln!(md)?;
    }
    if !cpu.is_empty() {
        writeln!(
            md,
            "CPU per write: 4 KiB random writes (QD{QD}) over the whole backing device until {FULL_IN_USE_PCT} % of the buckets hold data, then a {} s window.\n\n\
             | cache | bucket | written to fill MiB | fill s | in_use % (start/end) | window s | writes | IOPS | server CPU s | server CPU µs / write | notes |\n\
             |---|---|---|---|---|---|---|---|---|---|---|",
            a.cpu_window_s
        )?;
        for r in cpu {
            writeln!(
                md,
                "| {} | {} | {} | {} | {}/{} | {} | {} | {} | {} | {} | {} |",
                human(r.cache_bytes),
                human(r.bucket_bytes),
                mib(r.to_full_written_bytes),
                opt(r.to_full_s, 1),
                opt(r.in_use_pct_before.map(|v| v as f64), 0),
                opt(r.in_use_pct_after.map(|v| v as f64), 0),
                opt(r.window_s, 1),
                opt(r.writes.map(|v| v as f64), 0),
                opt(r.iops, 0),
                opt(r.server_cpu_s, 2),
                opt(r.server_cpu_us_per_write, 1),
                notes(&r.notes)
            )?;
        }
    }
    std::fs::write(out.join("scale.md"), &md)?;
    let json = serde_json::json!({
        "date": date,
        "machine": machine,
        "command": command,
        "params": {
            "caches": a.caches,
            "fill_bytes": a.fill,
            "cpu_cache_bytes": a.cpu_cache,
            "cpu_buckets": a.cpu_buckets,
            "cpu_window_s": a.cpu_window_s,
            "step_limit_s": a.step_limit_s,
            "queue_depth": QD,
            "full_in_use_pct": FULL_IN_USE_PCT,
        },
        "sizes": sizes,
        "cpu": cpu,
    });
    std::fs::write(out.join("scale.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_parse() {
        let status = "Name:\tt\nVmHWM:\t  169388 kB\nVmRSS:\t   13236 kB\n";
        assert_eq!(kib_field(status, "VmHWM:"), Some(169388 * 1024));
        assert_eq!(kib_field(status, "VmRSS:"), Some(13236 * 1024));
        assert_eq!(kib_field(status, "VmSwap:"), None);
    }

    #[test]
    fn backing_is_four_times_the_cache_and_at_least_16_gib() {
        assert_eq!(backing_for(64 << 20), 16 << 30);
        assert_eq!(backing_for(4 << 30), 16 << 30);
        assert_eq!(backing_for(64 << 30), 256 << 30);
        assert_eq!(backing_for(1 << 40), 4 << 40);
    }
}
