//! kill -9 durability of `tiercache serve`, round after round on the same devices.
//!
//! Each round a libnbd writer (`tests/scripts/kill9_writer.py`) writes self-describing 4 KiB
//! blocks with FUA, flushes, multi-block writes, sequential streams and several requests in
//! flight over several connections, and logs every write it sends and (fsync'ed) every write
//! that became durable. After a seeded random delay the server gets SIGKILL (then the writer),
//! is restarted on the same devices, and every block is read back and checked: each must decode
//! as a write issued for that block, no older than its last durable write, or be zeroes if no
//! write to it was ever durable; no read may fail. The next round goes on from there, so the
//! cache recovers from a state that was itself recovered. Rounds are mostly writeback, some
//! writethrough, switched live, with writeback, GC and the sequential cutoff made to run.
//! At the end the server must stop cleanly on SIGTERM and `tiercache check --data` must pass.
//!
//! TIERCACHE_KILL9_ROUNDS (default 20) and TIERCACHE_KILL9_SEED (default random) control the
//! run; the seed and the command to replay it are printed first. On failure the temporary
//! directory (devices, logs, server log) is kept and its path printed. Needs python3 with the
//! libnbd bindings (`import nbd`); a missing one is a failure under CI=true and a printed skip
//! otherwise.

mod common;

use common::{output_within, tc, wait_for};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/scripts/kill9_writer.py");
/// 4 KiB blocks the writer uses, from offset 0: 8 MiB, over half the cache, so with
/// overwrites the cache fills and buckets are reclaimed and compacted.
const BLOCKS: u64 = 2048;
const BACKING_MIB: u64 = 64;
const CACHE_MIB: u64 = 16;

/// A python3 that can `import nbd`: $TIERCACHE_PYTHON, python3 on PATH, or /usr/bin/python3
/// (a python from pyenv or a venv on PATH may not see the distribution's python3-libnbd).
fn python_with_nbd() -> Option<String> {
    let mut candidates: Vec<String> = std::env::var("TIERCACHE_PYTHON").into_iter().collect();
    candidates.extend(["python3".to_string(), "/usr/bin/python3".to_string()]);
    for py in &candidates {
        let ok = Command::new(py)
            .args(["-c", "import nbd"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return Some(py.clone());
        }
    }
    test_support::unavailable(&format!(
        "python3 with the libnbd bindings (python3-libnbd) among {candidates:?}"
    ));
    None
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// The devices, the logs, the server and the writer of one run. Dropped while panicking, it
/// keeps the directory and says where it is.
struct Run {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    python: String,
    seed: u64,
    rounds: u64,
    round: u64,
    server: Option<Child>,
    writer: Option<Child>,
}

impl Run {
    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    fn socket(&self) -> PathBuf {
        self.file("nbd.sock")
    }

    fn admin(&self) -> PathBuf {
        self.file("nbd.sock.admin")
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///data?socket={}", self.socket().display())
    }

    fn replay(&self) -> String {
        format!(
            "TIERCACHE_KILL9_SEED={} TIERCACHE_KILL9_ROUNDS={} cargo test -p tiercache --test kill9 -- --nocapture",
            self.seed, self.rounds
        )
    }

    /// Fails the test with everything needed to look into it.
    fn fail(&self, what: &str) -> ! {
        panic!(
            "kill9 FAILED in round {} (seed {}): {what}\nserver log (tail):\n{}\nreplay: {}",
            self.round,
            self.seed,
            tail(&self.file("serve.log"), 15),
            self.replay()
        );
    }

    fn log_file(&self, name: &str) -> std::fs::File {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.file(name))
            .unwrap()
    }

    fn make(&self) {
        for (name, mib) in [("slow.img", BACKING_MIB), ("fast.img", CACHE_MIB)] {
            std::fs::File::create(self.file(name))
                .unwrap()
                .set_len(mib << 20)
                .unwrap();
        }
        let o = tc()
            .args(["make", "--label", "data", "--bucket-size", "256k"])
            .arg("--backing")
            .arg(self.file("slow.img"))
            .arg("--cache")
            .arg(self.file("fast.img"))
            .arg("--writeback")
            .output()
            .unwrap();
        if !o.status.success() {
            self.fail(&format!("make failed: {}", text(&o)));
        }
    }

    /// Starts the server; only ever called with no server running on these devices.
    fn start_server(&mut self) {
        assert!(self.server.is_none());
        // A killed server leaves both sockets behind; wait for the new ones.
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_file(self.admin());
        let log = self.log_file("serve.log");
        let child = Command::new(env!("CARGO_BIN_EXE_tiercache"))
            .env("RUST_LOG", "info")
            .arg("serve")
            .arg("--cache")
            .arg(self.file("fast.img"))
            .arg("--backing")
            .arg(self.file("slow.img"))
            .arg("--socket")
            .arg(self.socket())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting tiercache serve");
        self.server = Some(child);
        let t = Instant::now();
        while !(self.socket().exists() && self.admin().exists()) {
            if let Some(s) = self.server.as_mut().unwrap().try_wait().unwrap() {
                self.server = None;
                self.fail(&format!("the server exited at start ({s})"));
            }
            if t.elapsed() > Duration::from_secs(30) {
                self.fail("the server did not start within 30 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL and reap, so the devices are free before anything else opens them.
    fn kill_server(&mut self) {
        let mut c = self.server.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    fn admin_cmd(&self, args: &[&str]) -> String {
        let mut c = tc();
        c.arg(args[0])
            .arg("--admin")
            .arg(self.admin())
            .args(&args[1..]);
        let Some(o) = output_within(&mut c, Duration::from_secs(60)) else {
            self.fail(&format!("tiercache {args:?} did not finish within 60 s"));
        };
        if !o.status.success() {
            self.fail(&format!("tiercache {args:?} failed: {}", text(&o)));
        }
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn set(&self, knob: &str, value: &str) {
        self.admin_cmd(&["set", "data", knob, value]);
    }

    fn stats(&self) -> serde_json::Value {
        let s = self.admin_cmd(&["stats", "--json"]);
        serde_json::from_str(&s).unwrap_or_else(|e| self.fail(&format!("stats: {e}: {s}")))
    }

    /// Runs the verifier against the restarted server; returns its summary line.
    fn verify(&self) -> String {
        let mut c = Command::new(&self.python);
        c.arg(SCRIPT)
            .arg("--verify")
            .arg(self.uri())
            .arg(self.file("durable.log"))
            .args(["--seed", &self.seed.to_string()])
            .args(["--blocks", &BLOCKS.to_string()]);
        let Some(o) = output_within(&mut c, Duration::from_secs(120)) else {
            self.fail("the verifier did not finish within 120 s (reads hang?)");
        };
        let out = text(&o);
        if !o.status.success() {
            self.fail(&format!(
                "the verifier found blocks that break the durability contract \
                 (or could not run):\n{out}\nlogs: {} ('block seq', fsync'ed when durable) \
                 and {}.issued ('seq first_block count', before sending)",
                self.file("durable.log").display(),
                self.file("durable.log").display()
            ));
        }
        out.lines()
            .find(|l| l.starts_with("kill9-verify:"))
            .unwrap_or("")
            .to_string()
    }

    /// Writes sent in `round` (sequence numbers are round << 32 + n).
    fn issued_in_round(&self, round: u64) -> usize {
        std::fs::read_to_string(self.file("durable.log.issued"))
            .unwrap_or_default()
            .lines()
            .filter(|l| {
                l.split(' ')
                    .next()
                    .and_then(|s| s.parse::<u64>().ok())
                    .map(|seq| seq >> 32)
                    == Some(round)
            })
            .count()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        for c in [self.writer.take(), self.server.take()]
            .into_iter()
            .flatten()
        {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            if let Some(d) = self.dir.take() {
                let p = d.keep();
                eprintln!(
                    "kill9: kept {} (slow.img, fast.img, durable.log, durable.log.issued, serve.log, writer.log)",
                    p.display()
                );
            }
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, got '{v}'"))
    })
}

#[test]
fn kill_9_never_loses_a_durable_write() {
    let Some(python) = python_with_nbd() else {
        return;
    };
    let rounds = env_u64("TIERCACHE_KILL9_ROUNDS").unwrap_or(20);
    let seed = env_u64("TIERCACHE_KILL9_SEED").unwrap_or_else(|| rand::random::<u32>() as u64);
    let dir = tempfile::Builder::new()
        .prefix("tiercache-kill9-")
        .tempdir_in(std::env::temp_dir())
        .unwrap();
    let mut run = Run {
        path: dir.path().to_path_buf(),
        dir: Some(dir),
        python,
        seed,
        rounds,
        round: 0,
        server: None,
        writer: None,
    };
    eprintln!(
        "kill9: seed {seed}, {rounds} rounds, dir {}\nkill9: replay with: {}",
        run.path.display(),
        run.replay()
    );
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed);
    run.make();
    run.start_server();
    let mut mode = "writeback";
    for round in 0..rounds {
        run.round = round;
        // Knobs other than the mode live in memory only: set them after every start.
        let new_mode = if rng.gen_bool(0.75) {
            "writeback"
        } else {
            "writethrough"
        };
        if new_mode != mode {
            run.set("cache_mode", new_mode);
            mode = new_mode;
        }
        let delay_wb = rng.gen_bool(0.5);
        if delay_wb {
            run.set("writeback_delay", "0");
        }
        let pct = [0, 5, 10, 10][rng.gen_range(0..4)];
        run.set("writeback_percent", &pct.to_string());
        let cutoff = ["64k", "256k", "4M", "4M"][rng.gen_range(0..4)];
        run.set("sequential_cutoff", cutoff);
        let fua = [0.0, 0.05, 0.3][rng.gen_range(0..3)];
        let flush_every = rng.gen_range(2..=32u32);
        let multi = [0.05, 0.2][rng.gen_range(0..2)];
        let seq_runs = [0.0, 0.01, 0.05][rng.gen_range(0..3)];
        let depth = [1, 4, 8, 8, 16][rng.gen_range(0..5)];
        let conns = rng.gen_range(1..=3u32);
        let kill_after = Duration::from_millis(rng.gen_range(300..=2000));
        // Some rounds also switch the mode live under the writer, before the kill.
        let switch_at = rng
            .gen_bool(0.25)
            .then(|| Duration::from_millis(rng.gen_range(100..=kill_after.as_millis() as u64)));
        let start_mode = mode;
        let log = run.log_file("writer.log");
        run.writer = Some(
            Command::new(&run.python)
                .arg(SCRIPT)
                .arg(run.uri())
                .arg(run.file("durable.log"))
                .args(["--seed", &seed.to_string()])
                .args(["--round", &round.to_string()])
                .args(["--blocks", &BLOCKS.to_string()])
                .args(["--fua", &fua.to_string()])
                .args(["--flush-every", &flush_every.to_string()])
                .args(["--multi", &multi.to_string()])
                .args(["--seq-runs", &seq_runs.to_string()])
                .args(["--depth", &depth.to_string()])
                .args(["--conns", &conns.to_string()])
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("starting the writer"),
        );
        if let Some(at) = switch_at {
            std::thread::sleep(at);
            mode = if mode == "writeback" {
                "writethrough"
            } else {
                "writeback"
            };
            run.set("cache_mode", mode);
            std::thread::sleep(kill_after - at);
        } else {
            std::thread::sleep(kill_after);
        }
        if let Some(s) = run.writer.as_mut().unwrap().try_wait().unwrap() {
            run.writer = None;
            run.fail(&format!(
                "the writer stopped while the server was up ({s}):\n{}",
                tail(&run.file("writer.log"), 10)
            ));
        }
        let stats = run.stats();
        let total = &stats["devices"][0]["stats_total"];
        let (wb, bypassed) = (
            total["writeback_bytes"].as_u64().unwrap_or(0),
            total["bypassed"].as_u64().unwrap_or(0),
        );
        run.kill_server();
        let mut w = run.writer.take().unwrap();
        let _ = w.kill();
        w.wait().unwrap();
        let issued = run.issued_in_round(round);
        run.start_server();
        let summary = run.verify();
        let cache = &run.stats()["cache"];
        let modes = match switch_at {
            Some(at) => format!("{start_mode}, {mode} at {} ms", at.as_millis()),
            None => start_mode.to_string(),
        };
        eprintln!(
            "kill9: round {round:>3} [{modes}; wb_delay {} wb_percent {pct} cutoff {cutoff}; \
             fua {fua} flush_every {flush_every} depth {depth} conns {conns}] killed at {} ms \
             after {issued} writes ({} KiB written back, {} KiB bypassed); restarted with {} KiB \
             dirty, {}% in use; verify {}",
            if delay_wb { "0" } else { "30" },
            kill_after.as_millis(),
            wb >> 10,
            bypassed >> 10,
            cache["dirty_bytes"].as_u64().unwrap_or(0) >> 10,
            cache["in_use"],
            summary.trim_start_matches("kill9-verify: ")
        );
        if issued == 0 {
            eprintln!("kill9: warning: round {round} sent no writes before the kill");
        }
    }
    // A clean stop on SIGTERM, a clean check, and the data still there after a warm start.
    run.round = rounds;
    let pid = run.server.as_ref().unwrap().id() as libc::pid_t;
    // SAFETY: kill(2) on our own child, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let mut c = run.server.take().unwrap();
    match wait_for(&mut c, Duration::from_secs(60)) {
        Some(s) if s.success() => {}
        Some(s) => run.fail(&format!("the server exited with {s} on SIGTERM")),
        None => {
            run.server = Some(c);
            run.fail("the server did not stop within 60 s of SIGTERM");
        }
    }
    let o = tc()
        .args(["check", "--data"])
        .arg(run.file("fast.img"))
        .output()
        .unwrap();
    if !o.status.success() {
        run.fail(&format!(
            "tiercache check --data fast.img exited with {}: {}",
            o.status,
            text(&o)
        ));
    }
    run.start_server();
    let summary = run.verify();
    run.admin_cmd(&["stop"]);
    let mut c = run.server.take().unwrap();
    assert!(
        c.wait().unwrap().success(),
        "the server did not stop cleanly"
    );
    eprintln!(
        "kill9: after SIGTERM, check --data and a warm start | {}\nkill9: seed {seed}: {rounds} rounds passed in {:.1} s",
        summary.trim_start_matches("kill9-verify: "),
        started.elapsed().as_secs_f64()
    );
}
