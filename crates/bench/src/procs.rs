//! The configurations under test, as running processes: the emulated disk, tiercache on top
//! of it, nbdkit's cache filter on top of it, or the fast file alone; each optionally with
//! every server process in a memory cgroup (the `+memlimit` variants) and/or over an emulated
//! disk that does not report itself rotational (the `+nonrot` variants).
//!
//! Invariants: every process started here is owned by a [`Proc`] that sends SIGTERM and waits
//! when dropped (or is SIGKILLed and reaped by [`Running::discard`] once a pair's devices are
//! thrown away), so no run leaves a server behind, even on error, and only then removes the
//! process's memory cgroup; every configuration reaches the same emulated disk model over NBD
//! (a `+nonrot` one the same model with only its ROTATIONAL flag cleared), and every cache gets
//! the same size.

use super::cgroup::{Limiter, MemCgroup};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process stopped (SIGTERM, then wait) when dropped.
pub struct Proc {
    child: Child,
    what: String,
    /// Dropped after `child` has been waited for (Drop::drop runs before the fields drop).
    _cgroup: Option<MemCgroup>,
}

impl Proc {
    /// Starts `cmd` with its output discarded, in a fresh memory cgroup when `limit` is given.
    pub fn spawn(cmd: &mut Command, what: &str, limit: Option<&Limiter>) -> Result<Proc> {
        let cgroup = limit.map(Limiter::create).transpose()?;
        if let Some(cg) = &cgroup {
            cg.enter_on_spawn(cmd)?;
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        Ok(Proc {
            child,
            what: what.to_string(),
            _cgroup: cgroup,
        })
    }

    /// SIGKILL and wait: for a process whose devices are thrown away next, so a graceful stop
    /// has nothing to save (or, in the scale workload, to crash it on purpose).
    pub fn kill(&mut self) {
        if self.exited().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// The process id (for reading /proc/PID).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended, if it has (an error to ask counts as ended: it cannot be
    /// signalled any more).
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) => Some(status.to_string()),
            Err(e) => Some(e.to_string()),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        // SAFETY: kill(2) on our own child's pid, not yet reaped; no memory is touched.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        log::warn!("{} did not stop on SIGTERM; killing it", self.what);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a one-shot tool to completion; a failure is an error carrying the tool's stderr.
/// Returns its stdout.
pub fn run_tool(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Like [`run_tool`], with a time limit: the tool is killed (SIGKILL) and reaped once it runs
/// out of time. Returns its wall time, or None when it ran out of time.
pub fn run_tool_within(cmd: &mut Command, what: &str, limit: Duration) -> Result<Option<Duration>> {
    use std::io::Read;
    let t = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {what}"))?;
    let mut pipe = child.stderr.take().context("stderr pipe")?;
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t.elapsed();
    if !status.success() {
        let err = stderr.join().unwrap_or_default();
        bail!("{what} failed ({status}): {}", err.trim());
    }
    Ok(Some(took))
}

/// Whether `tool` is an executable file in a `PATH` directory.
pub fn on_path(tool: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|d| {
            std::fs::metadata(d.join(tool)).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
        })
    })
}

/// Whether `tool` can be used, for the optional columns of a report (`package`: the Debian
/// package that has it). A missing tool is an error under `CI=true` (CI installs every tool, so
/// a missing one there is a broken CI script, not a reason to leave columns out); elsewhere it
/// adds a notice saying which columns are n/a, and returns false.
pub fn optional_tool(
    tool: &str,
    package: &str,
    columns: &str,
    notices: &mut Vec<String>,
) -> Result<bool> {
    if on_path(tool) {
        return Ok(true);
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        bail!("{tool} is required under CI=true (Debian: apt-get install {package})");
    }
    notices.push(format!(
        "{columns} n/a: {tool} is not installed (Debian: apt-get install {package})"
    ));
    Ok(false)
}

/// Starts `cmd`, a server that creates `sock` (its Unix socket, or another file it creates
/// once it serves) when it is up, and waits up to 30 s for it. A stale `sock` is removed
/// first; a server that exits before creating it is an error saying how it exited.
pub fn listen(cmd: &mut Command, what: &str, sock: &Path, limit: Option<&Limiter>) -> Result<Proc> {
    let _ = std::fs::remove_file(sock);
    let mut p = Proc::spawn(cmd, what, limit)?;
    let t = Instant::now();
    while !sock.exists() {
        if let Some(how) = p.exited() {
            bail!("{what} exited ({how}) before creating {}", sock.display());
        }
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{what} did not come up (no {})", sock.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(p)
}

/// utime + stime of a process (all its threads), in seconds.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = stat_ticks(&stat)?;
    // SAFETY: sysconf(3) has no preconditions and touches no memory.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 / hz as f64)
}

/// utime + stime (fields 14 and 15) of a `/proc/PID/stat` line, in clock ticks. The command
/// name (field 2) may hold spaces and parentheses, so fields are counted after its last ')'.
fn stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// What the harness needs of the tiercache it measures, handed over by the `tiercache` binary
/// that runs it (this crate links none of tiercache's internals: it runs the binary, and speaks
/// the admin protocol through the client the binary lends it).
#[derive(Clone)]
pub struct Tiercache {
    /// The `tiercache` binary, run as `emulate`, `make` and `serve`.
    pub exe: PathBuf,
    /// The client side of the admin protocol: one request to the admin socket at the path,
    /// and the server's reply (an error when it answers `{"ok": false, ...}`).
    pub admin_request: fn(&Path, &serde_json::Value) -> Result<serde_json::Value>,
    /// Extra arguments for the tiercache-* configurations' `serve` (`--serve-arg`).
    pub serve_args: Vec<String>,
    /// Extra arguments for the tiercache-* configurations' `make` (`--make-arg`).
    pub make_args: Vec<String>,
}

impl Tiercache {
    /// The binary as a command (its servers log warnings only).
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.env("RUST_LOG", "warn");
        c
    }

    /// The admin `stats` of the server whose admin socket is `admin`.
    pub fn stats(&self, admin: &Path) -> Result<serde_json::Value> {
        (self.admin_request)(admin, &serde_json::json!({"cmd": "stats"}))
    }

    /// Changes a knob of the device `device` through the admin socket `admin`.
    pub fn set(&self, admin: &Path, device: &str, knob: &str, value: &str) -> Result<()> {
        (self.admin_request)(
            admin,
            &serde_json::json!({"cmd": "set", "device": device, "knob": knob, "value": value}),
        )?;
        Ok(())
    }
}

/// The admin socket the harness gives a `tiercache serve` listening on NBD socket `socket`
/// (passed as `--admin`, so the harness never relies on the server's default).
pub fn admin_socket(socket: &Path) -> PathBuf {
    socket.with_extension("admin")
}

/// Creates `path` with `bytes` of non-zero data on disk (no holes, no unwritten extents),
/// synced, so reads of it cost real I/O.
pub fn write_whole_file(path: &Path, bytes: u64) -> Result<()> {
    use std::io::Write;
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut chunk = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in chunk.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
    }
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all()
        .with_context(|| format!("syncing {}", path.display()))?;
    Ok(())
}

/// The configurations, in report order.
pub const CONFIGS: [&str; 6] = [
    "hdd",
    "ssd",
    "tiercache-writethrough",
    "tiercache-writeback",
    "tiercache-writearound",
    "nbdkit-cache",
];

/// Appended to a configuration's name: the same configuration with every server process in a
/// memory cgroup.
pub const MEMLIMIT: &str = "+memlimit";

/// Appended to a configuration's name: the same configuration over the same emulated disk
/// started with `--rotational false`, so that the disk does not report itself rotational.
pub const NONROT: &str = "+nonrot";

/// The `+memlimit` variants run by default (where reads can be served from RAM).
pub const MEMLIMIT_CONFIGS: [&str; 2] = ["tiercache-writeback", "nbdkit-cache"];

/// The `+nonrot` variants run by default (on the seek-bound workloads): the disk alone, as the
/// reference of their ratios, and the caches.
pub const NONROT_CONFIGS: [&str; 4] = [
    "hdd",
    "tiercache-writethrough",
    "tiercache-writeback",
    "nbdkit-cache",
];

/// The slow disk a configuration runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disk {
    /// The emulated HDD, reporting ROTATIONAL.
    #[default]
    Rotational,
    /// The same emulated HDD with `--rotational false`.
    NonRotational,
    /// No slow disk: the `ssd` configuration, the fast file alone.
    None,
}

impl Disk {
    /// For reports.
    pub fn describe(self) -> &'static str {
        match self {
            Disk::Rotational => "rotational",
            Disk::NonRotational => "non-rotational",
            Disk::None => "none (fast file)",
        }
    }

    /// The configuration whose rows are the `×hdd` reference of rows on this disk: the disk
    /// alone, of the same kind (the `ssd` rows compare with the rotational one).
    pub fn hdd_reference(self) -> String {
        match self {
            Disk::NonRotational => format!("hdd{NONROT}"),
            Disk::Rotational | Disk::None => "hdd".into(),
        }
    }
}

/// A configuration name parsed: a base from [`CONFIGS`] and its modifiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config<'a> {
    pub base: &'a str,
    /// `+memlimit`: every server process in a memory cgroup.
    pub memlimit: bool,
    /// `+nonrot`: the emulated disk does not report itself rotational.
    pub nonrot: bool,
}

impl Config<'_> {
    pub fn disk(&self) -> Disk {
        match (self.base, self.nonrot) {
            ("ssd", _) => Disk::None,
            (_, true) => Disk::NonRotational,
            (_, false) => Disk::Rotational,
        }
    }
}

/// Parses `name`: a base from [`CONFIGS`] followed by modifiers ([`MEMLIMIT`], [`NONROT`]) in
/// any order, each at most once. An unknown base or modifier is an error listing the known
/// names; so is `+nonrot` on `ssd`, which has no emulated disk.
pub fn parse_config(name: &str) -> Result<Config<'_>> {
    let mut parts = name.split('+');
    let base = parts.next().unwrap_or_default();
    let known = || {
        format!(
            "known: {}, each optionally with {MEMLIMIT} and/or {NONROT}",
            CONFIGS.join(", ")
        )
    };
    if !CONFIGS.contains(&base) {
        bail!("unknown configuration '{name}' ({})", known());
    }
    let mut c = Config {
        base,
        memlimit: false,
        nonrot: false,
    };
    for m in parts {
        let flag = match format!("+{m}").as_str() {
            MEMLIMIT => &mut c.memlimit,
            NONROT => &mut c.nonrot,
            _ => bail!("unknown configuration '{name}' ({})", known()),
        };
        if *flag {
            bail!("configuration '{name}' repeats +{m}");
        }
        *flag = true;
    }
    if c.nonrot && base == "ssd" {
        bail!("configuration '{name}': ssd has no emulated disk, so {NONROT} means nothing");
    }
    Ok(c)
}

/// Sizes shared by every configuration of a run.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub disk_bytes: u64,
    pub cache_bytes: u64,
}

/// One configuration, running: where fio connects, and tiercache's admin socket if any.
pub struct Running {
    pub uri: String,
    pub admin: Option<PathBuf>,
    pub tc: Tiercache,
    procs: Vec<Proc>,
}

/// Starts `config` with fresh devices in `dir`; with `limit` (given for `+memlimit`), every
/// server process runs in its own memory cgroup; with `+nonrot`, the emulated disk is started
/// with `--rotational false`.
pub fn start(
    tc: &Tiercache,
    config: &Config,
    dir: &Path,
    sizes: Sizes,
    limit: Option<&Limiter>,
) -> Result<Running> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let disk = dir.join("disk.img");
    let hdd_sock = dir.join("hdd.sock");
    let hdd_uri = format!("nbd+unix:///disk?socket={}", hdd_sock.display());
    let emulate = |kind: &str, file: &Path, sock: &Path, extra: &[&str]| -> Result<Proc> {
        let mut c = tc.command();
        c.args([
            "emulate",
            kind,
            "--size",
            &sizes.disk_bytes.to_string(),
            "--file",
        ])
        .arg(file)
        .arg("--socket")
        .arg(sock)
        .args(extra);
        listen(&mut c, &format!("tiercache emulate {kind}"), sock, limit)
    };
    let hdd_flags: &[&str] = if config.nonrot {
        &["--rotational", "false"]
    } else {
        &[]
    };
    match config.base {
        "hdd" => Ok(Running {
            uri: hdd_uri,
            admin: None,
            tc: tc.clone(),
            procs: vec![emulate("hdd", &disk, &hdd_sock, hdd_flags)?],
        }),
        "ssd" => {
            // The fast file alone, O_DIRECT, with no added latency. Written in full first: a
            // sparse file's holes read back without touching the disk, which would make the
            // reference impossibly fast.
            let sock = dir.join("ssd.sock");
            let fast = dir.join("fast.img");
            write_whole_file(&fast, sizes.disk_bytes)?;
            let p = emulate(
                "ssd",
                &fast,
                &sock,
                &["--latency-us", "0", "--transfer-mb-s", "1000000"],
            )?;
            Ok(Running {
                uri: format!("nbd+unix:///disk?socket={}", sock.display()),
                admin: None,
                tc: tc.clone(),
                procs: vec![p],
            })
        }
        "nbdkit-cache" => {
            let hdd = emulate("hdd", &disk, &hdd_sock, hdd_flags)?;
            let sock = dir.join("kit.sock");
            let mut c = Command::new("nbdkit");
            c.arg("--foreground")
                .arg("-U")
                .arg(&sock)
                .arg("--filter=cache")
                .arg("nbd")
                .arg(format!("socket={}", hdd_sock.display()))
                .arg("export=disk")
                .arg("cache=writeback")
                .arg("cache-on-read=true")
                .arg(format!("cache-max-size={}", sizes.cache_bytes));
            let kit = listen(&mut c, "nbdkit", &sock, limit)?;
            Ok(Running {
                uri: format!("nbd+unix:///?socket={}", sock.display()),
                admin: None,
                tc: tc.clone(),
                procs: vec![kit, hdd],
            })
        }
        mode if mode.starts_with("tiercache-") => {
            let mode = mode.trim_start_matches("tiercache-");
            let hdd = emulate("hdd", &disk, &hdd_sock, hdd_flags)?;
            // Written in full, like the `ssd` row's file: the cache stands for an SSD, where a
            // first write to a block costs what any write does. In a sparse file it also
            // allocates the block, and the next flush commits that allocation (measured: twice
            // the flush time of W4's sync writes).
            let cache = dir.join("cache.img");
            write_whole_file(&cache, sizes.cache_bytes)?;
            run_tool(
                tc.command()
                    .args([
                        "make",
                        "--force",
                        "--label",
                        "data",
                        "--backing",
                        &hdd_uri,
                        "--cache",
                    ])
                    .arg(&cache)
                    .args(&tc.make_args),
                "tiercache make",
            )?;
            let sock = dir.join("tc.sock");
            let admin = admin_socket(&sock);
            let mut c = tc.command();
            c.arg("serve")
                .arg("--cache")
                .arg(&cache)
                .args(["--backing", &hdd_uri, "--socket"])
                .arg(&sock)
                .arg("--admin")
                .arg(&admin)
                .args(&tc.serve_args);
            let server = listen(&mut c, "tiercache serve", &admin, limit)?;
            let running = Running {
                uri: format!("nbd+unix:///data?socket={}", sock.display()),
                admin: Some(admin),
                tc: tc.clone(),
                procs: vec![server, hdd],
            };
            running.set("cache_mode", mode)?;
            Ok(running)
        }
        other => bail!(
            "unknown configuration '{other}' (known: {})",
            CONFIGS.join(", ")
        ),
    }
}

impl Running {
    /// Changes a tiercache knob (no-op for peers).
    pub fn set(&self, knob: &str, value: &str) -> Result<()> {
        match &self.admin {
            Some(admin) => self.tc.set(admin, "data", knob, value),
            None => Ok(()),
        }
    }

    /// Stops every server process at once with SIGKILL, once the pair's measurements are done
    /// and its devices are about to be wiped: a graceful stop would save nothing and measure
    /// nothing. Errors still stop them gracefully, through `Drop`.
    pub fn discard(mut self) {
        for p in &mut self.procs {
            p.kill();
        }
    }

    /// The server processes that have exited, with how (a memory cgroup's OOM killer shows
    /// here as "signal: 9"); empty while all run.
    pub fn exited(&mut self) -> Vec<String> {
        self.procs
            .iter_mut()
            .filter_map(|p| p.exited().map(|how| format!("{} exited ({how})", p.what)))
            .collect()
    }

    /// tiercache's statistics (None for peers).
    pub fn stats(&self) -> Option<serde_json::Value> {
        let admin = self.admin.as_ref()?;
        self.tc.stats(admin).ok()
    }
}

/// The CPUs this process may run on, lowest first.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is an empty set; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error()).context("sched_getaffinity");
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: `i` is below CPU_SETSIZE, the set's capacity.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect())
}

/// Sets the CPUs every thread of process `pid` may run on (threads it starts later inherit
/// their creator's). A thread that ended meanwhile is skipped.
pub fn set_cpus(pid: u32, cpus: &[usize]) -> Result<()> {
    // SAFETY: as in `allowed_cpus`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: CPU_SET checks nothing: `c` comes from `allowed_cpus`, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let dir = format!("/proc/{pid}/task");
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))? {
        let Some(tid) = entry?
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: `set` is a live cpu_set_t of the size passed.
        if unsafe { libc::sched_setaffinity(tid, std::mem::size_of_val(&set), &set) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::ESRCH) {
                return Err(err).with_context(|| format!("pinning thread {tid} of {pid}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_parse() {
        let stat = "4242 (tier cache) (x)) S 1 2 3 4 5 6 7 8 9 10 150 25 0 0 20 0 9";
        assert_eq!(stat_ticks(stat), Some(175));
        assert_eq!(stat_ticks("garbage"), None);
    }
}
