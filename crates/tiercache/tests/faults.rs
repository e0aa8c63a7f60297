//! What disks do, seen by real NBD clients (qemu-io, fio): a cache device that fails or turns
//! slow under a running `tiercache serve` (issue 11).
//!
//! The cache device is a file that nbdfuse exposes from nbdkit's memory plugin behind a filter
//! the test controls while the server runs:
//! - the error filter (`error-rate=1 error-file=TRIGGER`): every request fails with EIO while
//!   the trigger file exists;
//! - the rate filter (`rate-file=RATE`): the bandwidth is read from a file the test rewrites,
//!   so the device turns slow and fast again at run time. nbdkit 1.32's delay filter has no
//!   such switch (its delays are fixed at start), and a device slow from the start would
//!   never hold cached data to read around.
//!
//! What must hold:
//! - writethrough: a failing cache device costs clients nothing (fio verifies every block,
//!   zero errors); the set degrades, says why in `status`, `readmit` puts the repaired device
//!   back, and reads never return a cached copy older than a write made meanwhile;
//! - writeback: only what the failed device alone holds (dirty ranges) fails, with EIO; other
//!   ranges read, write and flush; after `readmit` the dirty data reads back and is written
//!   back to the backing device;
//! - slow: cached clean reads go to the backing device while the cache device is slower than
//!   `congested_read_threshold_us` (`congested` counts them, their latency is the backing
//!   device's), and through the cache again once it is fast;
//! - a degraded server stops promptly with the cache device still failing, and the next
//!   start (device repaired) serves what was written while degraded, not stale copies.
//!
//! A missing tool is a failure under CI=true and a printed skip otherwise. Each test prints
//! its steps (shown when it fails). Times are hang guards only.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The cache device: nbdkit's memory plugin of this size.
const CACHE_BYTES: u64 = 32 << 20;
/// Longest any one client command may take (a hung server fails the test, not hangs it).
const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// Prints a step with the time since the test started (shown when a test fails).
struct Steps(Instant);

impl Steps {
    fn new() -> Steps {
        Steps(Instant::now())
    }
    fn step(&self, what: &str) {
        println!("[{:6.2}s] {what}", self.0.elapsed().as_secs_f64());
    }
}

/// Whether the tools these tests drive are installed (under CI=true they must be).
fn tools() -> bool {
    let all = ["nbdkit", "nbdfuse", "fusermount3", "qemu-io", "fio"]
        .iter()
        .all(|t| have(t));
    if !all {
        return false;
    }
    for filter in ["error", "rate", "pause"] {
        let ok = Command::new("nbdkit")
            .args([&format!("--filter={filter}"), "null", "--dump-plugin"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            return test_support::unavailable(&format!("nbdkit's {filter} filter"));
        }
    }
    true
}

/// How the cache device misbehaves.
enum Filter {
    /// Every request fails while the trigger file exists.
    Error,
    /// Bandwidth (bits per second) from the rate file; unlimited until it exists.
    Rate,
    /// Requests wait while paused through the control socket (`pause-control=PAUSE`): a
    /// hung device that answers again once resumed.
    Pause,
}

/// The cache device `fast.img`: nbdkit (memory plugin behind a filter) mounted over the file
/// by nbdfuse. Dropping it unmounts and stops both.
struct FaultyCache {
    kit: Child,
    fuse: Option<Child>,
    mount: PathBuf,
    log: PathBuf,
}

impl FaultyCache {
    fn start(dir: &Path, filter: &Filter) -> FaultyCache {
        let (sock, pidfile, log) = (
            dir.join("kit.sock"),
            dir.join("kit.pid"),
            dir.join("kit.log"),
        );
        let logfile = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .unwrap()
        };
        let mut kit = Command::new("nbdkit");
        kit.args(["-f", "--exit-with-parent", "-P"])
            .arg(&pidfile)
            .arg("-U")
            .arg(&sock);
        match filter {
            Filter::Error => kit
                .args(["--filter=error", "memory", &CACHE_BYTES.to_string()])
                .arg("error-rate=1")
                .arg(format!("error-file={}", dir.join("TRIGGER").display())),
            Filter::Pause => kit
                .args(["--filter=pause", "memory", &CACHE_BYTES.to_string()])
                .arg(format!("pause-control={}", dir.join("PAUSE").display())),
            Filter::Rate => kit
                .args(["--filter=rate", "memory", &CACHE_BYTES.to_string()])
                .arg(format!("rate-file={}", dir.join("RATE").display()))
                // A bucket smaller than one request: every request waits, even after idling
                // (the default holds 2 s worth, so a probe now and then would be fast).
                .arg("burstiness=0.01"),
        };
        let kit = kit.stderr(logfile()).spawn().expect("starting nbdkit");
        let t = Instant::now();
        wait_for_nbdkit(&pidfile);
        // nbdfuse mounts over a regular file: the cache device is a file, as with any user's.
        let mount = dir.join("fast.img");
        std::fs::File::create(&mount).unwrap();
        let fuse = Command::new("nbdfuse")
            .arg(&mount)
            .arg(format!("nbd+unix:///?socket={}", sock.display()))
            .stderr(logfile())
            .spawn()
            .expect("starting nbdfuse");
        let mut cache = FaultyCache {
            kit,
            fuse: Some(fuse),
            mount,
            log,
        };
        while std::fs::metadata(&cache.mount).map_or(0, |m| m.len()) != CACHE_BYTES {
            if t.elapsed() > Duration::from_secs(20) {
                let log = cache.log_tail();
                cache.stop();
                panic!("nbdfuse did not mount the cache device: {log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        cache
    }

    /// The last lines nbdkit and nbdfuse wrote (they log every injected error).
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Unmounts the device and stops nbdfuse and nbdkit (idempotent).
    fn stop(&mut self) {
        if let Some(mut fuse) = self.fuse.take() {
            let unmounted = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.mount)
                .status()
                .is_ok_and(|s| s.success());
            if !unmounted {
                let _ = Command::new("fusermount3")
                    .arg("-uz")
                    .arg(&self.mount)
                    .status();
            }
            if wait_for(&mut fuse, Duration::from_secs(10)).is_none() {
                let _ = fuse.kill();
                let _ = fuse.wait();
            }
        }
        let _ = self.kit.kill();
        let _ = self.kit.wait();
    }
}

impl Drop for FaultyCache {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A `tiercache make`d fixture whose cache device is a `FaultyCache`. Dropping it stops the
/// server, then the cache device, then removes the files (in that order: the mount must go
/// before its directory, and the server before its cache device).
struct Rig {
    f: Fixture,
    cache: FaultyCache,
    steps: Steps,
}

impl Rig {
    fn new(filter: Filter, writeback: bool) -> Rig {
        let steps = Steps::new();
        steps.step("starting nbdkit and nbdfuse for the cache device, tiercache make");
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        std::fs::File::create(dir.path().join("slow.img"))
            .unwrap()
            .set_len(64 * MIB)
            .unwrap();
        let cache = FaultyCache::start(dir.path(), &filter);
        let f = Fixture::make(dir, writeback);
        Rig { f, cache, steps }
    }

    fn step(&self, what: &str) {
        self.steps.step(what);
    }

    /// Starts `serve` with extra options; every write is cached (no sequential cutoff: the
    /// tests write megabytes at once), and reads are not routed around a slow cache device
    /// unless the test sets its own threshold (the FUSE-backed cache device of a loaded
    /// machine can be slower than the default 2 ms, which would keep reads off the failing
    /// device these tests watch).
    fn serve(&mut self, extra: &[&str]) {
        self.step(&format!("tiercache serve {extra:?}"));
        let mut args = extra.to_vec();
        if !args.contains(&"--congested-read-threshold-us") {
            args.extend(["--congested-read-threshold-us", "0"]);
        }
        self.f.start_with(&args);
        self.f.tc_admin(&["set", "data", "sequential_cutoff", "0"]);
    }

    fn trigger(&self) -> PathBuf {
        self.f.path("TRIGGER")
    }

    /// Makes every cache-device request fail (error filter).
    fn fail_cache(&self) {
        self.step("cache device fails from now on (TRIGGER created)");
        std::fs::write(self.trigger(), b"").unwrap();
    }

    fn repair_cache(&self) {
        self.step("cache device repaired (TRIGGER removed)");
        std::fs::remove_file(self.trigger()).unwrap();
    }

    /// Pauses (`b'p'`) or resumes (`b'r'`) the cache device (pause filter): paused, every
    /// new request waits, as on a hung device.
    fn pause_control(&self, command: u8) {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(self.f.path("PAUSE")).unwrap();
        s.write_all(&[command]).unwrap();
        let mut reply = [0u8; 1];
        s.read_exact(&mut reply).unwrap();
        assert_eq!(reply[0], command.to_ascii_uppercase(), "pause filter reply");
    }

    /// Sets the cache device's bandwidth (rate filter), atomically as nbdkit asks.
    fn set_rate(&self, bits_per_sec: &str) {
        let tmp = self.f.path("RATE.new");
        std::fs::write(&tmp, bits_per_sec).unwrap();
        std::fs::rename(&tmp, self.f.path("RATE")).unwrap();
    }

    /// Runs qemu-io commands on the export (`-t none`: no FUA unless asked, no host cache);
    /// returns whether every command succeeded, and what it printed.
    fn qemu_io(&self, cmds: &[&str]) -> (bool, String) {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw", "-t", "none"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        c.arg(self.f.uri());
        let o = output_within(&mut c, COMMAND_LIMIT)
            .unwrap_or_else(|| panic!("qemu-io {cmds:?} hung for {COMMAND_LIMIT:?}"));
        let out = format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr));
        (o.status.success() && !out.contains("failed"), out)
    }

    /// qemu-io commands that must all succeed (pattern checks included).
    fn io_ok(&self, why: &str, cmds: &[&str]) {
        self.step(&format!("{why}: {cmds:?} must succeed"));
        let (ok, out) = self.qemu_io(cmds);
        assert!(
            ok,
            "{why}: {cmds:?} failed:\n{out}\ncache device log:\n{}",
            self.cache.log_tail()
        );
    }

    /// A qemu-io command that must fail with EIO.
    fn io_eio(&self, why: &str, cmd: &str) {
        self.step(&format!("{why}: {cmd:?} must fail with EIO"));
        let (ok, out) = self.qemu_io(&[cmd]);
        assert!(
            !ok && out.contains("Input/output error"),
            "{why}: {cmd:?} should fail with EIO:\n{out}"
        );
    }

    fn status(&self) -> Value {
        serde_json::from_slice(&self.f.tc_admin(&["status", "--json"]).stdout).unwrap()
    }

    fn health(&self) -> Value {
        self.status()["health"].clone()
    }

    fn counters(&self) -> Value {
        self.status()["devices"][0]["stats_total"].clone()
    }

    fn counter(&self, name: &str) -> u64 {
        let c = self.counters();
        c[name]
            .as_u64()
            .unwrap_or_else(|| panic!("no counter {name}: {c}"))
    }

    /// Waits (bounded) until the set says it is degraded; returns its health.
    fn wait_degraded(&self) -> Value {
        self.step("the cache set must be degraded");
        let t = Instant::now();
        loop {
            let h = self.health();
            if h["state"] == "degraded" {
                return h;
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the set did not degrade with its cache device failing: {h}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `tiercache readmit`, which must succeed and leave the set healthy.
    fn readmit(&self) {
        self.step("tiercache readmit must succeed");
        let out = stdout(&self.f.tc_admin(&["readmit"]));
        assert!(out.contains("re-admitted"), "{out}");
        let h = self.health();
        assert_eq!(h["state"], "ok", "after readmit: {h}");
    }

    /// fio over the export with the given job options; it must exit 0 with no error in any
    /// job. Returns fio's JSON report.
    fn fio(&self, why: &str, args: &[&str]) -> Value {
        self.step(&format!("{why}: fio {args:?} must report no error"));
        let mut c = Command::new("fio");
        c.args([
            "--name=job",
            "--ioengine=nbd",
            &format!("--uri={}", self.f.uri()),
            "--output-format=json",
        ])
        .args(args);
        let o = output_within(&mut c, COMMAND_LIMIT)
            .unwrap_or_else(|| panic!("{why}: fio hung for {COMMAND_LIMIT:?}"));
        let out = stdout(&o);
        let report = out
            .find("\n{")
            .map(|i| &out[i + 1..])
            .or_else(|| out.starts_with('{').then_some(&out[..]))
            .and_then(|j| serde_json::from_str::<Value>(j).ok());
        let errors: Vec<u64> = report
            .as_ref()
            .and_then(|r| r["jobs"].as_array())
            .map(|jobs| {
                jobs.iter()
                    .map(|j| j["error"].as_u64().unwrap_or(1))
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            o.status.success() && !errors.is_empty() && errors.iter().all(|&e| e == 0),
            "{why}: fio failed (job errors {errors:?}):\n{out}\n{}\ncache device log:\n{}",
            String::from_utf8_lossy(&o.stderr),
            self.cache.log_tail()
        );
        report.unwrap()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        if let Some(mut c) = self.f.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.cache.stop();
    }
}

/// fio's verified random writes over `[16M, 48M)` (two jobs of 16 MiB, flushes among them);
/// `verify_only` reads back what the same job wrote.
fn fio_job(verify_only: bool) -> Vec<&'static str> {
    let mut a = vec![
        "--rw=randwrite",
        "--bs=4k",
        "--offset=16m",
        "--size=16m",
        "--offset_increment=16m",
        "--numjobs=2",
        "--iodepth=8",
        "--fsync=64",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        "--verify_state_save=0",
    ];
    if verify_only {
        a.push("--verify_only");
    }
    a
}

#[test]
fn a_failing_cache_device_in_writethrough_costs_clients_nothing() {
    if !tools() {
        return;
    }
    let mut r = Rig::new(Filter::Error, false);
    r.serve(&[]);
    r.io_ok(
        "data cached before the failure",
        &["write -P 0xa1 0 8M", "flush", "read -P 0xa1 0 8M"],
    );
    let cached = r.status()["devices"][0]["cached_bytes"].as_u64().unwrap();
    assert!(cached >= 8 * MIB, "8 MiB should be cached: {cached}");
    assert_eq!(r.health()["state"], "ok");

    // The device fails while fio writes (once a few of its megabytes are through).
    let written = r.counter("backing_written_bytes");
    std::thread::scope(|s| {
        let fio = s.spawn(|| {
            r.fio(
                "writes and reads, the cache device failing",
                &fio_job(false),
            )
        });
        let t = Instant::now();
        while r.counter("backing_written_bytes") < written + 4 * MIB && !fio.is_finished() {
            assert!(t.elapsed() < COMMAND_LIMIT, "fio wrote nothing");
            std::thread::sleep(Duration::from_millis(20));
        }
        r.fail_cache();
        fio.join().unwrap();
    });
    r.io_ok(
        "cached data is read from the backing device",
        &["read -P 0xa1 0 8M"],
    );
    let h = r.wait_degraded();
    let reason = h["reason"].as_str().unwrap();
    assert!(
        reason.contains("Input/output error") || reason.contains("io_error_limit"),
        "the reason should say what failed: {h}"
    );
    assert!(h["since_unix"].as_u64().unwrap() > 0, "{h}");
    assert!(h["errors_total"].as_u64().unwrap() > 0, "{h}");
    let c = r.counters();
    assert!(
        c["cache_io_errors"].as_u64().unwrap() > 0 && c["degraded_bytes"].as_u64().unwrap() > 0,
        "failures should be counted and degraded requests served: {c}"
    );
    let text = stdout(&r.f.tc_admin(&["status"]));
    assert!(
        text.contains("health: DEGRADED since") && text.contains("tiercache readmit"),
        "{text}"
    );
    assert!(text.contains(" degraded "), "the device row: {text}");
    // Overwrites a range the cache device holds a (now stale) clean copy of.
    r.io_ok("a write while degraded", &["write -P 0xb2 0 1M", "flush"]);

    r.step("readmit must fail while the cache device still fails");
    let o = r.f.admin_cmd(&["readmit"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("stays degraded"),
        "readmit of a failing device: {err}"
    );
    assert_eq!(r.health()["state"], "degraded");

    r.repair_cache();
    r.readmit();
    let text = stdout(&r.f.tc_admin(&["status"]));
    assert!(text.contains("health: ok"), "{text}");
    r.fio("what fio wrote while degraded", &fio_job(true));
    r.io_ok(
        "no stale cached copy after readmit",
        &["read -P 0xb2 0 1M", "read -P 0xa1 1M 7M"],
    );
    r.step("the cache serves reads again");
    let hits = r.counter("cache_hits");
    let t = Instant::now();
    while r.counter("cache_hits") <= hits {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no cache hit after readmit: {}",
            r.counters()
        );
        r.io_ok("reading a range twice", &["read -P 0xb2 0 1M"]);
    }
    r.f.stop();
}

#[test]
fn a_failing_cache_device_in_writeback_fails_only_the_dirty_ranges() {
    if !tools() {
        return;
    }
    let mut r = Rig::new(Filter::Error, true);
    // The first failure degrades the set, so the test knows when it is degraded.
    r.serve(&["--io-error-limit", "1"]);
    assert_eq!(r.health()["io_error_limit"], 1);
    r.f.tc_admin(&["set", "data", "writeback_running", "0"]);
    r.io_ok(
        "dirty data, flushed",
        &[
            "write -P 0xd1 0 1M",
            "flush",
            "write -P 0xc3 32M 1M",
            "flush",
        ],
    );
    let d = &r.status()["devices"][0];
    assert_eq!(d["dirty_bytes"].as_u64(), Some(2 * MIB), "{d}");

    r.fail_cache();
    r.io_eio(
        "the dirty range's only copy is on the failed device",
        "read 0 4k",
    );
    r.wait_degraded();
    for cmd in ["read 0 1M", "read 512k 4k", "read 1536 512", "read 32M 64k"] {
        r.io_eio("a read of dirty data while degraded", cmd);
    }
    r.io_eio(
        "a write over dirty data while degraded",
        "write -P 0xee 4k 4k",
    );
    r.io_ok(
        "ranges without dirty data read while degraded",
        &["read -P 0 1M 7M", "read -P 0 40M 1M"],
    );
    r.io_ok(
        "ranges without dirty data are written and flushed while degraded",
        &[
            "write -P 0xe2 8M 1M",
            "write -f -P 0xe3 12M 4k",
            "flush",
            "read -P 0xe2 8M 1M",
            "read -P 0xe3 12M 4k",
        ],
    );
    assert!(r.counter("io_errors") > 0, "{}", r.counters());

    r.repair_cache();
    r.readmit();
    r.io_ok(
        "the dirty data is back, the failed write changed nothing",
        &[
            "read -P 0xd1 0 1M",
            "read -P 0xc3 32M 1M",
            "read -P 0xe2 8M 1M",
            "read -P 0xe3 12M 4k",
        ],
    );
    r.step("detach writes the dirty data back to the backing device");
    r.f.tc_admin(&["detach", "data"]);
    r.f.stop();
    let raw = std::fs::read(r.f.path("slow.img")).unwrap();
    // The backing device's data starts after its 8 KiB header.
    let at = |off: u64, len: u64| &raw[(8192 + off) as usize..(8192 + off + len) as usize];
    for (byte, off, len) in [
        (0xd1u8, 0, MIB),
        (0xc3, 32 * MIB, MIB),
        (0xe2, 8 * MIB, MIB),
        (0xe3, 12 * MIB, 4096),
    ] {
        assert!(
            at(off, len).iter().all(|&b| b == byte),
            "the backing device should hold {byte:#x} at [{off}, +{len})"
        );
    }
}

/// fio's random 4 KiB reads of the first 8 MiB for `secs`; returns (reads, median and mean
/// completion latency in µs).
fn timed_reads(r: &Rig, why: &str, secs: u32) -> (u64, f64, f64) {
    let j = r.fio(
        why,
        &[
            "--rw=randread",
            "--bs=4k",
            "--size=8m",
            &format!("--runtime={secs}"),
            "--time_based",
        ],
    );
    let read = &j["jobs"][0]["read"];
    let clat = &read["clat_ns"];
    let p50 = clat["percentile"]["50.000000"].as_f64().unwrap() / 1000.0;
    let mean = clat["mean"].as_f64().unwrap() / 1000.0;
    let n = read["total_ios"].as_u64().unwrap();
    r.step(&format!("{n} reads, median {p50:.0} us, mean {mean:.0} us"));
    (n, p50, mean)
}

#[test]
fn a_slow_cache_device_is_read_around() {
    if !tools() {
        return;
    }
    // About 150 ms per 4 KiB request at 640 kbit/s with a bucket smaller than one request
    // (measured below): slower than the threshold, which is well above what a local FUSE file
    // takes when fast, even on a loaded machine, and slower than the engine's probe interval
    // (100 ms after the previous probe is expected to end, one request goes to the cache
    // device anyway, to notice when it recovers). Before probes were spaced from their
    // expected end, every request at this speed was a probe and none went around.
    const SLOW: &str = "640K";
    const THRESHOLD_US: u64 = 10_000;
    let mut r = Rig::new(Filter::Rate, false);
    r.serve(&["--congested-read-threshold-us", &THRESHOLD_US.to_string()]);
    r.io_ok(
        "data cached while the device is fast",
        &["write -P 0x5a 0 8M", "flush", "read -P 0x5a 0 8M"],
    );
    let cached = r.status()["devices"][0]["cached_bytes"].as_u64().unwrap();
    assert!(cached >= 8 * MIB, "8 MiB should be cached: {cached}");
    let (_, fast_p50, _) = timed_reads(&r, "cached reads, fast cache device", 2);

    r.step(&format!("cache device slow: {SLOW}bit/s"));
    r.set_rate(SLOW);
    let t = Instant::now();
    let slow_4k_us = loop {
        // A direct read of the device itself says when nbdkit has taken the new rate.
        let start = Instant::now();
        let o = Command::new("dd")
            .arg(format!("if={}", r.f.path("fast.img").display()))
            .args([
                "of=/dev/null",
                "bs=4k",
                "count=1",
                "skip=4000",
                "iflag=direct",
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let took = start.elapsed().as_micros() as f64;
        if took > 2.5 * THRESHOLD_US as f64 {
            break took;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the cache device did not turn slow: a 4 KiB read takes {took} us"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    r.step(&format!(
        "a 4 KiB read of the cache device takes {slow_4k_us:.0} us"
    ));
    let congested = r.counter("congested");
    let health_during = std::thread::scope(|s| {
        let h = s.spawn(|| {
            std::thread::sleep(Duration::from_secs(1));
            r.health()
        });
        let (n, p50, mean) = timed_reads(&r, "cached reads, slow cache device", 3);
        assert!(
            p50 < slow_4k_us / 10.0 && mean < slow_4k_us / 4.0,
            "reads waited for the slow cache device: {n} reads, median {p50:.0} us, mean \
             {mean:.0} us (fast cache device: median {fast_p50:.0} us; a 4 KiB cache read now \
             takes {slow_4k_us:.0} us)"
        );
        h.join().unwrap()
    });
    let went_around = r.counter("congested") - congested;
    assert!(went_around > 0, "no read went around: {}", r.counters());
    assert!(
        health_during["read_latency_us"].as_u64().unwrap() > THRESHOLD_US,
        "status should show the slow reads: {health_during}"
    );
    assert_eq!(health_during["state"], "ok", "slow is not failed");
    // Small reads: one may be the probe, and a megabyte takes seconds at this rate.
    r.io_ok(
        "data read around the cache",
        &[
            "read -P 0x5a 0 4k",
            "read -P 0x5a 4M 16k",
            "read -P 0x5a 8188k 4k",
        ],
    );

    r.step("cache device fast again");
    r.set_rate("100G");
    let t = Instant::now();
    while r.health()["read_latency_us"].as_u64().unwrap() > THRESHOLD_US {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the latency estimate did not recover: {}",
            r.health()
        );
        r.io_ok("a read lets a probe through", &["read 0 4k"]);
        std::thread::sleep(Duration::from_millis(100));
    }
    let (hits, congested) = (r.counter("cache_hits"), r.counter("congested"));
    let (n, _, _) = timed_reads(&r, "cached reads, fast cache device again", 2);
    let (hits, congested) = (
        r.counter("cache_hits") - hits,
        r.counter("congested") - congested,
    );
    assert!(
        hits * 2 > n,
        "reads should be served by the cache again: {hits} hits and {congested} went around \
         of {n} reads"
    );
    r.f.stop();
}

#[test]
fn a_restart_after_degradation_serves_the_writes_made_meanwhile() {
    if !tools() {
        return;
    }
    let mut r = Rig::new(Filter::Error, false);
    r.serve(&[]);
    r.io_ok(
        "data cached before the failure",
        &["write -P 0xa1 0 4M", "flush", "read -P 0xa1 0 4M"],
    );
    r.fail_cache();
    r.io_ok("cached data read while failing", &["read -P 0xa1 0 4M"]);
    r.wait_degraded();
    r.io_ok(
        "writes over cached (now stale) copies while degraded",
        &["write -P 0xb2 0 1M", "write -P 0xb3 3M 4k", "flush"],
    );

    r.step("stop with the cache device still failing");
    let t = Instant::now();
    r.f.tc_admin(&["stop"]);
    let mut server = r.f.server.take().unwrap();
    let status = wait_for(&mut server, Duration::from_secs(60));
    if status.is_none() {
        let _ = server.kill();
        let _ = server.wait();
    }
    let status = status.expect("a degraded server did not stop within 60 s");
    r.step(&format!("stopped in {:?}: {status}", t.elapsed()));
    assert!(status.success(), "serve exited with {status}");
    let header = stdout(&run(tc().arg("show").arg(r.f.path("slow.img"))));
    assert!(header.contains("stale_copies    clean"), "{header}");

    r.repair_cache();
    r.step("start again with the cache device repaired");
    r.serve(&[]);
    assert_eq!(r.health()["state"], "ok");
    r.io_ok(
        "the writes made while degraded, not the cached copies",
        &[
            "read -P 0xb2 0 1M",
            "read -P 0xa1 1M 2M",
            "read -P 0xb3 3M 4k",
            "read -P 0xa1 3149824 1044480",
        ],
    );
    let header = stdout(&run(tc().arg("show").arg(r.f.path("slow.img"))));
    assert!(header.contains("stale_copies    none"), "{header}");
    r.f.stop();
}

/// A cache device that hangs (every request waits for hours) does not hang the shutdown: the
/// request stuck in it is abandoned after `--shutdown-timeout` (its client's connection
/// closes), the set, degraded by then, is closed without the hung device, and the process
/// exits 0; the next start, the device answering again, serves every flushed write.
#[test]
fn a_hung_cache_device_does_not_hang_the_shutdown() {
    if !tools() {
        return;
    }
    const SHUTDOWN_TIMEOUT_SECS: u64 = 3;
    let mut r = Rig::new(Filter::Pause, false);
    r.serve(&[
        "--cache-io-timeout-ms",
        "1000",
        "--shutdown-timeout",
        &SHUTDOWN_TIMEOUT_SECS.to_string(),
    ]);
    r.io_ok(
        "data cached while the device answers",
        &["write -P 0x3c 0 4M", "flush", "read -P 0x3c 0 4M"],
    );
    r.step("cache device hung (paused)");
    r.pause_control(b'p');
    // A client reads cached data: its request goes to the hung device and stays there.
    let mut stuck = Command::new("qemu-io")
        .args(["-f", "raw", "-t", "none", "-c", "read -P 0x3c 0 64k"])
        .arg(r.f.uri())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    r.wait_degraded();
    r.io_ok("reads around the hung device", &["read -P 0x3c 1M 1M"]);
    r.step("stop with a request stuck in the hung cache device");
    let t = Instant::now();
    let stop = output_within(&mut r.f.admin_cmd(&["stop"]), COMMAND_LIMIT)
        .expect("tiercache stop hung behind a hung cache device");
    let took = t.elapsed();
    let said = format!("{}{}", stdout(&stop), String::from_utf8_lossy(&stop.stderr));
    r.step(&format!("tiercache stop returned in {took:?}: {said}"));
    assert!(stop.status.success(), "tiercache stop failed: {said}");
    // The kernel may hold the process (a thread in a FUSE read) until the device answers.
    r.step("the device answers again (resumed)");
    r.pause_control(b'r');
    let mut server = r.f.server.take().unwrap();
    let status = wait_for(&mut server, COMMAND_LIMIT);
    if status.is_none() {
        let _ = server.kill();
        let _ = server.wait();
    }
    let status = status.expect("serve did not exit once the device answered");
    assert!(status.success(), "serve exited with {status}");
    let _ = stuck.kill();
    let _ = stuck.wait();
    r.step("start again");
    r.serve(&[]);
    r.io_ok("the flushed data", &["read -P 0x3c 0 4M"]);
    r.f.stop();
}

#[test]
fn the_failure_limits_are_options_and_config_keys() {
    let steps = Steps::new();
    let mut f = Fixture::new(16, 16, false);
    steps.step("out-of-range values stop the start before anything is opened");
    for (args, needle) in [
        (
            ["--cache-io-timeout-ms", "50"],
            "cache_io_timeout_ms 50 is too short",
        ),
        (
            ["--congested-read-threshold-us", "10000001"],
            "congested_read_threshold_us 10000001 is too large",
        ),
        (
            ["--io-error-limit", "1000001"],
            "io_error_limit 1000001 is too large",
        ),
    ] {
        let mut c = f.serve_cmd();
        c.args(args);
        let o = output_within(&mut c, COMMAND_LIMIT).expect("serve hung");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }

    steps.step("config keys reach the cache set");
    let cfg = f.path("tiercache.toml");
    let config = |keys: &str| {
        std::fs::write(
            &cfg,
            format!(
                "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\n{keys}",
                f.path("fast.img"),
                f.path("slow.img"),
                f.socket()
            ),
        )
        .unwrap();
        let mut c = tc();
        c.arg("serve").arg("--config").arg(&cfg);
        c
    };
    let o = output_within(
        &mut config("congested_write_threshold_us = 20000000\n"),
        COMMAND_LIMIT,
    )
    .expect("serve hung");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("congested_write_threshold_us"),
        "{err}"
    );
    let o =
        output_within(&mut config("replacement = \"arc\"\n"), COMMAND_LIMIT).expect("serve hung");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("replacement \"arc\" is not one of"),
        "{err}"
    );
    f.server = Some(
        config(
            "io_error_limit = 3\nio_error_halflife = 0\ncache_io_timeout_ms = 0\n\
             congested_read_threshold_us = 0\ncongested_write_threshold_us = 500\n\
             admission = \"all\"\nreplacement = \"fifo\"\n",
        )
        .spawn()
        .unwrap(),
    );
    let t = Instant::now();
    while !Path::new(&f.admin()).exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let j: Value = serde_json::from_slice(&f.tc_admin(&["status", "--json"]).stdout).unwrap();
    assert_eq!(j["health"]["io_error_limit"], 3, "{j}");
    assert_eq!(j["health"]["state"], "ok", "{j}");
    assert_eq!(
        (&j["cache"]["admission"], &j["cache"]["replacement"]),
        (&json!("all"), &json!("fifo")),
        "{j}"
    );
    let text = stdout(&f.tc_admin(&["status"]));
    assert!(
        text.contains("health: ok")
            && text.contains("limit 3")
            && text.contains("admission all, replacement fifo"),
        "{text}"
    );

    steps.step("degrade by request, then readmit");
    let out = stdout(&f.tc_admin(&["degrade", "--reason", "replacing the SSD"]));
    assert!(out.contains("cache set degraded"), "{out}");
    let j: Value = serde_json::from_slice(&f.tc_admin(&["status", "--json"]).stdout).unwrap();
    let h = &j["health"];
    assert_eq!(h["state"], "degraded", "{j}");
    assert_eq!(h["reason"], "by request: replacing the SSD", "{j}");
    assert!(h["since"].as_str().unwrap().ends_with('Z'), "{j}");
    assert_eq!(j["devices"][0]["state"], "degraded", "{j}");
    let out = stdout(&f.tc_admin(&["degrade", "--reason", "again"]));
    assert!(
        out.contains("already degraded") && out.contains("replacing the SSD"),
        "{out}"
    );
    let o = f.admin_cmd(&["degrade", "--reason", " "]).output().unwrap();
    assert!(!o.status.success(), "an empty reason is refused");
    f.tc_admin(&["readmit"]);
    let o = f.admin_cmd(&["readmit"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("not degraded"),
        "readmit of a healthy set: {err}"
    );
    f.stop();
}
