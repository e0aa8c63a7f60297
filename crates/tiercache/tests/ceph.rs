//! tiercache in front of Ceph RBD (issue 24): a one-node cluster started by
//! `scripts/ceph/fixture.sh` (a monitor, one OSD with BlueStore on a file, an RBD image),
//! exported by qemu-nbd over a unix socket, cached by `tiercache serve` on two "hosts" (two
//! servers with cache devices of their own, `common::host`). One test, in steps, so the
//! cluster starts once (about 15 s, 150 MiB).
//!
//! Steps: fio with `--verify` in each cache mode, a cold pass (write and verify) and a warm one
//! (verify only, hits in writethrough and writeback); the OSD killed (-9) and restarted under
//! a verifying fio in writethrough (the client waits, no error, no wrong byte); writeback with
//! the OSD down (writes and flushes succeed from the cache, the dirty data stays, and is
//! written back once the OSD is back, after which the header says clean); qemu-nbd killed and
//! restarted after unflushed writes (the next flush fails, the one after succeeds, the data is
//! there); tiercache killed (-9) in writeback with writeback held back (nothing flushed is
//! lost); and the hand-over between the two hosts (clean detach and attach; a take-over
//! refused while the other holds dirty data, then given up with `--discard-dirty`).
//!
//! Needs ceph-mon, ceph-osd, ceph-common, qemu-nbd with qemu's rbd driver (qemu-block-extra),
//! fio and nbdsh: missing, a failure under CI=true and a printed skip otherwise. Seeds are
//! printed (`TIERCACHE_SEED=N`).
//!
//! Invariant: the test ends. Each step is named as it starts; every fio and nbdsh run, and
//! each start of the cluster, is bounded (`BOUND`), and a watchdog ends the whole test
//! process after `LIMIT` (it takes about a minute here), first printing the step, the
//! cluster's state and logs (`fixture.sh diag`), each server's `status` and the stacks of
//! every process the test started (gdb), so that a hang fails with its reason instead of
//! using up CI's time.

mod common;

use common::host::*;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/ceph/fixture.sh");
const MIB: u64 = 1 << 20;
/// The whole test, at most (the watchdog).
const LIMIT: Duration = Duration::from_secs(600);
/// One fio or nbdsh run, or the cluster's start, at most.
const BOUND: Duration = Duration::from_secs(240);
/// Starts of the cluster tried: a one-node Ceph that fails to come up is the fixture's
/// failure, not tiercache's, and is tried once more (each failure prints the cluster's state).
const START_ATTEMPTS: u32 = 2;

/// Writes a line to the process's stderr past the test harness's capture: the watchdog's
/// report must outlive its `exit` (captured output is printed only for a test that returns
/// failed), and a hang's steps must show without `--nocapture`.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// The step under way, for the watchdog's report.
static STEP: Mutex<String> = Mutex::new(String::new());

fn step(what: &str) {
    say!("ceph: step: {what}");
    *STEP.lock().unwrap() = what.to_string();
}

/// `cmd` (reading nothing) run to completion within `BOUND`: a hang fails the test.
fn bounded(cmd: &mut Command) -> Output {
    output_bounded(cmd.stdin(Stdio::null()), BOUND)
}

/// `bounded`, and it must succeed.
fn bounded_ok(cmd: &mut Command) -> Output {
    run_within(cmd.stdin(Stdio::null()), BOUND)
}

/// Ends the test process if the test has not finished within `LIMIT`, after printing what
/// was going on (see the module's invariant). Dropping it disarms it.
struct Watchdog {
    /// Dropped with the watchdog, which ends the thread's wait.
    _armed: mpsc::Sender<()>,
}

impl Watchdog {
    fn arm(dir: PathBuf) -> Watchdog {
        let (armed, disarmed) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if disarmed.recv_timeout(LIMIT) != Err(mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            say!(
                "ceph: the test has not ended within {LIMIT:?}; the step under way: {}",
                STEP.lock().unwrap()
            );
            diagnose(&dir);
            let _ = Command::new("bash")
                .arg(FIXTURE)
                .arg("stop")
                .arg(&dir)
                .status();
            // Every server, fio and nbdsh this test started (the daemons were stopped above).
            let _ = Command::new("pkill")
                .args(["-KILL", "-P", &std::process::id().to_string()])
                .status();
            say!("ceph: FAILED: the test hung (see above)");
            std::process::exit(101);
        });
        Watchdog { _armed: armed }
    }
}

/// Prints the cluster's state, each server's `status`, and the stacks of the processes this
/// test started. Each probe bounded: any of them may be what hangs.
fn diagnose(dir: &Path) {
    let show = |what: &str, cmd: &mut Command| {
        cmd.stdin(Stdio::null());
        match output_within(cmd, Duration::from_secs(90)) {
            Some(o) => say!(
                "ceph: --- {what}\n{}{}",
                stdout(&o),
                String::from_utf8_lossy(&o.stderr)
            ),
            None => say!("ceph: --- {what}: did not end within 90 s"),
        }
    };
    show(
        "fixture.sh diag",
        Command::new("bash").arg(FIXTURE).arg("diag").arg(dir),
    );
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.to_string_lossy().ends_with(".sock.admin") {
            show(
                &format!("status of {}", p.display()),
                &mut admin_cmd(&p.to_string_lossy(), &["status"]),
            );
        }
    }
    show(
        "processes",
        Command::new("ps").args(["-eo", "pid,ppid,stat,wchan:30,etime,args"]),
    );
    let children = Command::new("pgrep")
        .args(["-P", &std::process::id().to_string()])
        .output()
        .map(|o| stdout(&o))
        .unwrap_or_default();
    let gdb = Command::new("gdb").arg("--version").output().is_ok();
    if !gdb {
        say!("ceph: no gdb here: no stacks");
    }
    for pid in children.split_whitespace().filter(|_| gdb) {
        show(
            &format!("the stacks of pid {pid}"),
            Command::new("gdb").args(["-batch", "-p", pid, "-ex", "thread apply all bt 30"]),
        );
    }
}

/// The cluster of `fixture.sh`, stopped when dropped (also when a step panics).
struct Ceph {
    dir: tempfile::TempDir,
    uri: String,
    /// Armed while the cluster runs.
    _watchdog: Watchdog,
}

impl Ceph {
    fn start() -> Option<Ceph> {
        let tools = ["ceph-mon", "ceph-osd", "ceph", "rbd", "qemu-nbd", "fio"];
        if !(tools.iter().all(|t| have(t)) && have_nbdsh()) {
            return None;
        }
        let probe =
            bounded(Command::new("qemu-img").args(["info", "rbd:none/none:conf=/dev/null"]));
        if String::from_utf8_lossy(&probe.stderr).contains("Unknown protocol") {
            unavailable("qemu's rbd driver (qemu-block-extra)");
            return None;
        }
        step("starting the cluster");
        for attempt in 1..=START_ATTEMPTS {
            let t = Instant::now();
            let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
            let mut ceph = Ceph {
                _watchdog: Watchdog::arm(dir.path().to_path_buf()),
                dir,
                uri: String::new(),
            };
            let out = output_within(
                Command::new("bash")
                    .arg(FIXTURE)
                    .arg("start")
                    .arg(ceph.dir.path())
                    .arg("256M")
                    .stdin(Stdio::null()),
                BOUND,
            );
            match out {
                Some(out) => {
                    say!("{}", String::from_utf8_lossy(&out.stderr).trim_end());
                    if out.status.success() {
                        let env = stdout(&out);
                        let uri = env
                            .lines()
                            .find_map(|l| l.strip_prefix("NBD_URI="))
                            .unwrap_or_else(|| panic!("no NBD_URI in {env}"));
                        say!("ceph: cluster and export up in {:?}", t.elapsed());
                        ceph.uri = format!("{uri}&timeout=20");
                        return Some(ceph);
                    }
                }
                None => {
                    say!("ceph: fixture.sh start did not end within {BOUND:?}");
                    diagnose(ceph.dir.path());
                }
            }
            assert!(
                attempt < START_ATTEMPTS,
                "the cluster did not start in {START_ATTEMPTS} attempts (see above)"
            );
            // Dropping it stops what the failed start left running.
            say!(
                "ceph: the cluster did not start (attempt {attempt}; its state is above); \
                 once more in a new directory"
            );
        }
        unreachable!("the last attempt returns or panics")
    }

    fn fixture(&self, what: &str) {
        let t = Instant::now();
        bounded_ok(
            Command::new("bash")
                .arg(FIXTURE)
                .arg(what)
                .arg(self.dir.path()),
        );
        say!("ceph: {what} took {:?}", t.elapsed());
    }

    fn rss(&self) -> String {
        stdout(&bounded_ok(
            Command::new("bash")
                .arg(FIXTURE)
                .arg("rss")
                .arg(self.dir.path()),
        ))
    }
}

impl Drop for Ceph {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(FIXTURE)
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}

/// fio on the export `uri`: random writes of `bs` over `[offset, offset + size)` with a crc32c
/// in every block, then a read of all of it checking each (`verify_only`: the read alone).
fn fio(uri: &str, offset: u64, size: u64, bs: &str, seed: u64, verify_only: bool) -> Output {
    let mut c = Command::new("fio");
    c.args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        &format!("--bs={bs}"),
        &format!("--offset={offset}"),
        &format!("--size={size}"),
        "--iodepth=8",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--do_verify=1",
        &format!("--randseed={seed}"),
        "--output-format=terse",
        "--verify_state_save=0",
    ]);
    if verify_only {
        c.arg("--verify_only");
    }
    bounded(&mut c)
}

fn fio_ok(uri: &str, offset: u64, size: u64, bs: &str, seed: u64, verify_only: bool, what: &str) {
    let o = fio(uri, offset, size, bs, seed, verify_only);
    assert!(
        o.status.success(),
        "{what}: fio failed: {}\n{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The shared disk's entry in `status --json` on host `h`.
fn volume(h: &Host) -> Value {
    let s: Value = serde_json::from_str(&stdout(&h.tc_admin(&["status", "--json"]))).unwrap();
    s["devices"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == SHARED))
        .cloned()
        .unwrap_or_else(|| panic!("no volume {SHARED} in {s}"))
}

fn hits(h: &Host) -> u64 {
    let v = volume(h);
    v["stats_total"]["cache_hits"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cache_hits in {v}"))
}

fn dirty_bytes(h: &Host) -> u64 {
    let v = volume(h);
    v["dirty_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no dirty_bytes in {v}"))
}

#[test]
fn tiercache_in_front_of_ceph_rbd() {
    let Some(ceph) = Ceph::start() else { return };
    let seed = engine::test_seed("ceph");
    let dir = ceph.dir.path();
    run(tc().args(["make", "--label", SHARED, "--backing", &ceph.uri]));
    let mut a = Host::new(dir, "a", 64, &ceph.uri);
    a.start(true, &[]);

    // 1. Every mode, cold then warm, each on a region of its own.
    for (i, mode) in ["writethrough", "writeback", "writearound", "none"]
        .iter()
        .enumerate()
    {
        step(&format!("1. fio with verify in {mode}"));
        a.tc_admin(&["set", SHARED, "cache_mode", mode]);
        let off = i as u64 * 16 * MIB;
        let t = Instant::now();
        fio_ok(&a.uri(), off, 8 * MIB, "16k", seed + i as u64, false, mode);
        let cold = t.elapsed();
        let before = hits(&a);
        let t = Instant::now();
        fio_ok(&a.uri(), off, 8 * MIB, "16k", seed + i as u64, true, mode);
        let warm_hits = hits(&a) - before;
        eprintln!(
            "ceph: {mode}: cold pass {cold:?}, warm pass {:?} with {warm_hits} hits",
            t.elapsed()
        );
        if ["writethrough", "writeback"].contains(mode) {
            assert!(warm_hits > 0, "{mode}: the warm pass hit nothing");
        }
    }
    eprintln!("ceph: after the modes: {}", ceph.rss().replace('\n', ", "));

    // 2. The OSD killed and restarted under a verifying writer (writethrough: every write
    // reaches RBD): the client waits, sees no error and no wrong byte.
    step("2. the OSD killed and restarted under fio");
    a.tc_admin(&["set", SHARED, "cache_mode", "writethrough"]);
    let off = 64 * MIB;
    let uri = a.uri();
    let t = Instant::now();
    let writer = std::thread::spawn(move || fio(&uri, off, 16 * MIB, "16k", seed + 10, false));
    std::thread::sleep(Duration::from_secs(2));
    ceph.fixture("osd-kill");
    std::thread::sleep(Duration::from_secs(3));
    ceph.fixture("osd-start");
    let o = writer.join().unwrap();
    assert!(
        o.status.success(),
        "fio across an OSD restart: {}\n{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    eprintln!(
        "ceph: fio across the OSD's kill and restart took {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(120));

    // 3. Writeback with the OSD down: writes and flushes are served by the cache; the dirty
    // data stays until the OSD is back, then is written back and the header says clean.
    // Knobs are kept in the backing header, and the first dirty write marks it dirty: both
    // need the store, so they come before it stops.
    step("3. writeback with the OSD down");
    a.tc_admin(&["set", SHARED, "cache_mode", "writeback"]);
    a.tc_admin(&["set", SHARED, "writeback_delay", "5"]);
    write_at(dir, &a.uri(), 80 * MIB, &pattern(seed + 19, 4096));
    assert_eq!(header(&ceph.uri)["state"], "dirty");
    ceph.fixture("osd-stop");
    let data = pattern(seed + 20, 4 * MIB as usize);
    let t = Instant::now();
    write_at(dir, &a.uri(), 80 * MIB, &data);
    eprintln!(
        "ceph: 4 MiB written and flushed with the OSD down in {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < Duration::from_secs(15));
    assert_holds(&a.uri(), 80 * MIB, &data, "writeback with the OSD down");
    // Past writeback_delay: writeback has started, and waits on the store.
    std::thread::sleep(Duration::from_secs(7));
    assert!(
        dirty_bytes(&a) >= 4 * MIB,
        "dirty data left the cache with the OSD down"
    );
    ceph.fixture("osd-start");
    let t = Instant::now();
    header_until(&ceph.uri, Duration::from_secs(120), |h| {
        h["state"] == "clean"
    });
    assert_eq!(dirty_bytes(&a), 0);
    eprintln!(
        "ceph: writeback done {:?} after the OSD's restart",
        t.elapsed()
    );

    // 4. qemu-nbd killed and restarted after writes it answered but nobody flushed: the next
    // flush writes them again from the cache's copies (writethrough) and succeeds, or, for
    // what the cache had no copy of, fails once; the one after succeeds, and the data reads
    // back (the contract itself is tested in `restart.rs`).
    step("4. qemu-nbd killed and restarted after unflushed writes");
    a.tc_admin(&["set", SHARED, "cache_mode", "writethrough"]);
    let data = pattern(seed + 30, MIB as usize);
    let f = dir.join("unflushed.bin");
    std::fs::write(&f, &data).unwrap();
    let script = format!(
        "import time, subprocess\n\
         h.pwrite(open({f:?}, 'rb').read(), {off})\n\
         subprocess.run(['bash', {FIXTURE:?}, 'nbd-kill', {d:?}], check=True)\n\
         subprocess.run(['bash', {FIXTURE:?}, 'nbd-start', {d:?}], check=True)\n\
         try:\n    h.flush()\n    print('first flush: ok')\n\
         except nbd.Error as e:\n    print('first flush: failed', e)\n\
         h.flush()\n\
         print('second flush: ok')\n",
        f = f.display().to_string(),
        off = 96 * MIB,
        d = dir.display().to_string(),
    );
    let o = bounded_ok(&mut nbdsh(&["-u", &a.uri(), "-c", &script]));
    let said = stdout(&o);
    eprintln!("ceph: qemu-nbd restart: {said}");
    assert!(said.contains("first flush: "), "{said}");
    assert!(said.contains("second flush: ok"), "{said}");
    assert_holds(&a.uri(), 96 * MIB, &data, "after the export's restart");

    // 5. tiercache killed in writeback with writeback held back: nothing flushed is lost.
    step("5. tiercache killed in writeback");
    a.tc_admin(&["set", SHARED, "cache_mode", "writeback"]);
    a.tc_admin(&["set", SHARED, "writeback_running", "0"]);
    let data = pattern(seed + 40, 4 * MIB as usize);
    write_at(dir, &a.uri(), 112 * MIB, &data);
    a.kill9();
    a.start(true, &[]);
    assert!(dirty_bytes(&a) >= 4 * MIB);
    assert_holds(&a.uri(), 112 * MIB, &data, "after kill -9 in writeback");

    // 6. Hand-over: a clean detach on A, attach on B with no option: every write A
    // acknowledged (the dirty ones included) is there.
    step("6. the hand-over from A to B");
    let t = Instant::now();
    a.tc_admin(&["detach", SHARED]);
    eprintln!("ceph: detach on A (4 MiB dirty) took {:?}", t.elapsed());
    a.stop();
    let mut b = Host::new(dir, "b", 64, &ceph.uri);
    b.start(false, &[]);
    b.tc_admin(&["attach", &ceph.uri]);
    assert_holds(&b.uri(), 112 * MIB, &data, "B after A's detach");
    fio_ok(
        &b.uri(),
        0,
        8 * MIB,
        "16k",
        seed,
        true,
        "B: A's writethrough region",
    );
    fio_ok(
        &b.uri(),
        16 * MIB,
        8 * MIB,
        "16k",
        seed + 1,
        true,
        "B: A's writeback region",
    );

    // B holds dirty data and is gone: A's take-over is refused, naming B's set and the
    // amount, until A gives that data up.
    step("7. B gone with dirty data: A's take-over");
    b.tc_admin(&["set", SHARED, "cache_mode", "writeback"]);
    b.tc_admin(&["set", SHARED, "writeback_running", "0"]);
    let newer = pattern(seed + 50, 2 * MIB as usize);
    write_at(dir, &b.uri(), 112 * MIB, &newer);
    b.kill9();
    a.start(false, &[]);
    let said = refused_within(&mut a.attach_cmd(&["--take-over"]), Duration::from_secs(60));
    assert!(
        said.contains(&b.set_uuid()) && said.contains("dirty data"),
        "{said}"
    );
    a.tc_admin(&["attach", "--take-over", "--discard-dirty", &ceph.uri]);
    assert_holds(
        &a.uri(),
        112 * MIB,
        &data,
        "A after giving B's dirty data up",
    );
    step("8. A stops");
    a.stop();
    eprintln!("ceph: at the end: {}", ceph.rss().replace('\n', ", "));
}
