//! One owner per device, end to end with the real binary: a second `serve`, `make`, `check` or
//! admin `attach` of a device another server (or this one) holds is refused with a message
//! naming the holder, and the holder keeps serving; one device under two names (`./x`,
//! symlink, hard link, another node of a block device) is refused as such and left untouched;
//! the locks go away with the server (stop, SIGTERM, kill -9).
//!
//! A missing tool (nbdinfo; losetup and root for block devices) is a failure under CI=true
//! and a printed skip otherwise.

mod common;

use common::{have, output_within, tc};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(20);

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `cmd` to completion (killed after [`DEADLINE`]: a server that should have been refused
/// but runs is a failure, not a hang).
fn finish(cmd: &mut Command) -> Output {
    output_within(cmd, DEADLINE)
        .unwrap_or_else(|| panic!("{cmd:?} still running after {DEADLINE:?}"))
}

fn ok(cmd: &mut Command) -> Output {
    let o = finish(cmd);
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    o
}

/// Runs `cmd`, which must fail cleanly; returns what it printed.
fn refused(cmd: &mut Command) -> String {
    common::refused_within(cmd, DEADLINE)
}

fn assert_contains(haystack: &str, needle: &str) {
    assert!(haystack.contains(needle), "'{needle}' not in: {haystack}");
}

/// A directory of device files.
struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir_in(std::env::temp_dir()).unwrap())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn file(&self, name: &str, mib: u64) -> PathBuf {
        let p = self.path(name);
        std::fs::File::create(&p)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        p
    }

    /// Formats `cache` and `backing` (created as files when missing) with export `label`.
    fn make(&self, cache: &str, backing: &str, label: &str) {
        for (name, mib) in [(cache, 8), (backing, 16)] {
            if !self.path(name).exists() {
                self.file(name, mib);
            }
        }
        ok(tc()
            .args(["make", "--bucket-size", "256k", "--label", label, "--cache"])
            .arg(self.path(cache))
            .arg("--backing")
            .arg(self.path(backing)));
    }
}

/// A running `tiercache serve`, killed on drop.
struct Server {
    child: Option<Child>,
    socket: PathBuf,
}

impl Server {
    fn start(cache: &Path, backing: &Path, socket: PathBuf) -> Server {
        let child = tc()
            .arg("serve")
            .arg("--cache")
            .arg(cache)
            .arg("--backing")
            .arg(backing)
            .arg("--socket")
            .arg(&socket)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting tiercache serve");
        let mut s = Server {
            child: Some(child),
            socket,
        };
        let start = Instant::now();
        while !Path::new(&s.admin()).exists() {
            if let Some(status) = s.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("tiercache serve exited with {status} instead of serving");
            }
            assert!(start.elapsed() < DEADLINE, "tiercache serve did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    fn admin(&self) -> String {
        format!("{}.admin", self.socket.display())
    }

    fn admin_cmd(&self, cmd: &str) -> Command {
        let mut c = tc();
        c.args([cmd, "--admin", &self.admin()]);
        c
    }

    /// The message a refused opener prints about a device this server holds.
    fn holds(&self, path: &Path) -> String {
        format!(
            "{} is in use by another tiercache (pid {}, tiercache serve",
            path.display(),
            self.pid()
        )
    }

    /// Still serving: the admin socket answers with export `label`, and so does NBD.
    fn assert_serving(&self, label: &str) {
        let status = text(&ok(&mut self.admin_cmd("status")).stdout);
        assert!(
            status.lines().any(|l| l.starts_with(label)),
            "no '{label}' in: {status}"
        );
        if have("nbdinfo") {
            let uri = format!("nbd+unix:///{label}?socket={}", self.socket.display());
            ok(Command::new("nbdinfo").arg("--size").arg(uri));
        }
    }

    /// `tiercache stop`; the server must exit 0.
    fn stop(mut self) {
        ok(&mut self.admin_cmd("stop"));
        let status = self.child.take().unwrap().wait().unwrap();
        assert!(status.success(), "server exited with {status}");
    }

    /// SIGTERM; the server must exit 0.
    fn terminate(mut self) {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child, not yet reaped; no memory is passed.
        assert_eq!(
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) },
            0
        );
        let status = child.wait().unwrap();
        assert!(status.success(), "server exited with {status} on SIGTERM");
    }

    fn kill9(mut self) {
        let mut child = self.child.take().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn show_uuids(path: &Path) -> Vec<String> {
    let out = text(&ok(tc().arg("show").arg(path)).stdout);
    let uuids: Vec<String> = out
        .lines()
        .filter(|l| l.starts_with("dev.uuid") || l.starts_with("cset.uuid"))
        .map(str::to_string)
        .collect();
    assert!(!uuids.is_empty(), "{out}");
    uuids
}

#[test]
fn a_second_serve_on_the_same_cache_is_refused_and_the_first_keeps_serving() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    d.make("fast2.img", "slow2.img", "other");
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    std::os::unix::fs::symlink(d.path("fast.img"), d.path("fast-link.img")).unwrap();
    for cache in ["fast.img", "fast-link.img"] {
        let err = refused(
            tc().arg("serve")
                .arg("--cache")
                .arg(d.path(cache))
                .arg("--backing")
                .arg(d.path("slow2.img"))
                .arg("--socket")
                .arg(d.path("b.sock")),
        );
        assert_contains(&err, &a.holds(&d.path(cache)));
        assert_contains(&err, "stop it first");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
        assert!(!d.path("b.sock").exists() && !d.path("b.sock.admin").exists());
    }
    a.assert_serving("data");
    a.stop();
}

#[test]
fn a_second_serve_sharing_only_a_backing_device_is_refused() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    d.make("fast2.img", "slow2.img", "other");
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    let err = refused(
        tc().arg("serve")
            .arg("--cache")
            .arg(d.path("fast2.img"))
            .arg("--backing")
            .arg(d.path("slow.img"))
            .arg("--socket")
            .arg(d.path("b.sock")),
    );
    assert_contains(&err, &a.holds(&d.path("slow.img")));
    a.assert_serving("data");
    // The refused server let go of its own cache device on the way out.
    let b = Server::start(&d.path("fast2.img"), &d.path("slow2.img"), d.path("b.sock"));
    b.assert_serving("other");
    b.stop();
    a.stop();
}

#[test]
fn make_on_devices_in_use_is_refused_and_changes_nothing() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    let (fast_ids, slow_ids) = (
        show_uuids(&d.path("fast.img")),
        show_uuids(&d.path("slow.img")),
    );
    let fresh = d.file("fresh.img", 16);
    let make = |cache: &Path, backing: &Path| {
        refused(
            tc().args(["make", "--force", "--bucket-size", "256k", "--cache"])
                .arg(cache)
                .arg("--backing")
                .arg(backing),
        )
    };
    // Both in use; only the cache; only the backing device (the fresh file is the other).
    let err = make(&d.path("fast.img"), &d.path("slow.img"));
    assert_contains(&err, &a.holds(&d.path("fast.img")));
    let err = make(&d.path("fast.img"), &fresh);
    assert_contains(&err, &a.holds(&d.path("fast.img")));
    let err = make(&fresh, &d.path("slow.img"));
    assert_contains(&err, &a.holds(&d.path("slow.img")));
    assert!(
        std::fs::read(&fresh).unwrap().iter().all(|&b| b == 0),
        "a refused make wrote to the device it could open"
    );
    assert_eq!(show_uuids(&d.path("fast.img")), fast_ids);
    assert_eq!(show_uuids(&d.path("slow.img")), slow_ids);
    a.assert_serving("data");
    a.stop();
    for dev in ["fast.img", "slow.img"] {
        ok(tc().arg("check").arg(d.path(dev)));
    }
}

/// `make` checks every argument and every device before it writes anything: a bad label, a
/// backing device too small, or a signature without `--force` on any device leaves all of
/// them as they were — also an existing cache set whose backing device holds its data.
#[test]
fn a_make_that_fails_has_changed_nothing() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    let images = |names: &[&str]| -> Vec<Vec<u8>> {
        names
            .iter()
            .map(|n| std::fs::read(d.path(n)).unwrap())
            .collect()
    };
    d.file("b3.img", 16);
    d.file("tiny.img", 0);
    std::fs::write(d.path("tiny.img"), [0u8; 4096]).unwrap();
    let all = ["fast.img", "slow.img", "b3.img", "tiny.img"];
    let before = images(&all);
    let make = |extra: &[&str], cache: &str, backing: &[&str]| {
        let mut c = tc();
        c.args(["make", "--bucket-size", "256k"]).args(extra);
        c.arg("--cache").arg(d.path(cache));
        for b in backing {
            c.arg("--backing").arg(d.path(b));
        }
        refused(&mut c)
    };
    // Over the existing set, forced: the label is bad, or the second backing device too small.
    let err = make(
        &["--force", "--label", "bad label"],
        "fast.img",
        &["b3.img"],
    );
    assert_contains(&err, "label");
    let err = make(&["--force"], "fast.img", &["b3.img", "tiny.img"]);
    assert_contains(&err, "too small");
    // Not forced: the cache holds a tiercache, then the backing device does.
    let err = make(&[], "b3.img", &["slow.img"]);
    assert_contains(&err, "signature");
    assert!(images(&all) == before, "a refused make changed a device");
    // Blank devices, a bad label: neither is formatted.
    d.file("blank-cache.img", 16);
    d.file("blank-backing.img", 16);
    let err = make(
        &["--label", "bad/label"],
        "blank-cache.img",
        &["blank-backing.img"],
    );
    assert_contains(&err, "label");
    for n in ["blank-cache.img", "blank-backing.img"] {
        assert!(
            std::fs::read(d.path(n)).unwrap().iter().all(|&b| b == 0),
            "a refused make wrote to {n}"
        );
    }
    // The set still takes its backing device.
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    a.assert_serving("data");
    a.stop();
}

/// A FIFO, a socket or a directory is no device: every command refuses it at once (a FIFO
/// opened for reading would wait for a writer forever).
#[test]
fn fifos_and_directories_are_refused_by_every_command() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    let fifo = d.path("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo failed");
    let dir = d.path("subdir");
    std::fs::create_dir(&dir).unwrap();
    for (odd, what) in [(&fifo, "a FIFO"), (&dir, "a directory")] {
        for args in [vec!["check"], vec!["check", "--data"], vec!["show"]] {
            let err = refused(tc().args(&args).arg(odd));
            assert_contains(&err, what);
        }
        let err = refused(
            tc().args(["make", "--force", "--cache"])
                .arg(odd)
                .arg("--backing")
                .arg(d.path("slow2.img")),
        );
        assert_contains(&err, what);
        let err = refused(
            tc().args(["serve", "--cache"])
                .arg(d.path("fast.img"))
                .arg("--backing")
                .arg(odd)
                .arg("--socket")
                .arg(d.path("s.sock")),
        );
        assert_contains(&err, what);
    }
}

#[test]
fn check_of_a_device_in_use_is_refused() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    for dev in ["fast.img", "slow.img"] {
        let err = refused(tc().args(["check", "--data"]).arg(d.path(dev)));
        assert_contains(&err, &a.holds(&d.path(dev)));
    }
    a.assert_serving("data");
    a.stop();
    for dev in ["fast.img", "slow.img"] {
        ok(tc().args(["check", "--data"]).arg(d.path(dev)));
    }
}

#[test]
fn one_file_under_two_names_is_refused_and_left_untouched() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    std::os::unix::fs::symlink("fast.img", d.path("fast-link.img")).unwrap();
    std::fs::hard_link(d.path("fast.img"), d.path("fast-hard.img")).unwrap();
    std::os::unix::fs::symlink("slow.img", d.path("slow-link.img")).unwrap();
    std::fs::hard_link(d.path("slow.img"), d.path("slow-hard.img")).unwrap();
    let images =
        || ["fast.img", "slow.img"].map(|n| std::fs::read(d.path(n)).expect("reading a device"));
    let before = images();
    let in_dir = |args: &[&str]| {
        let mut c = tc();
        c.current_dir(d.0.path()).args(args);
        refused(&mut c)
    };
    const CACHE_VS_BACKING: &str =
        "are the same device (the cache and backing devices must be different)";
    const BACKING_TWICE: &str = "are the same device (each backing device can be attached once)";
    for (alias, slow_alias) in [
        ("./fast.img", "./slow.img"),
        ("fast-link.img", "slow-link.img"),
        ("fast-hard.img", "slow-hard.img"),
    ] {
        let err = in_dir(&["make", "--force", "--cache", "fast.img", "--backing", alias]);
        assert_eq!(
            err.trim(),
            format!("tiercache: fast.img and {alias} {CACHE_VS_BACKING}")
        );
        let err = in_dir(&[
            "serve",
            "--socket",
            "s.sock",
            "--cache",
            "fast.img",
            "--backing",
            alias,
        ]);
        assert_eq!(
            err.trim(),
            format!("tiercache: fast.img and {alias} {CACHE_VS_BACKING}")
        );
        let err = in_dir(&[
            "make",
            "--force",
            "--cache",
            "fast.img",
            "--backing",
            "slow.img",
            "--backing",
            slow_alias,
        ]);
        assert_eq!(
            err.trim(),
            format!("tiercache: slow.img and {slow_alias} {BACKING_TWICE}")
        );
        let err = in_dir(&[
            "serve",
            "--socket",
            "s.sock",
            "--cache",
            "fast.img",
            "--backing",
            "slow.img",
            "--backing",
            slow_alias,
        ]);
        assert_eq!(
            err.trim(),
            format!("tiercache: slow.img and {slow_alias} {BACKING_TWICE}")
        );
    }
    assert!(images() == before, "a refused command changed a device");
    assert!(!d.path("s.sock").exists());
}

#[test]
fn admin_attach_of_an_open_device_is_refused_and_the_server_keeps_working() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    d.make("fast2.img", "slow2.img", "other");
    std::os::unix::fs::symlink("slow.img", d.path("slow-link.img")).unwrap();
    let a = Server::start(&d.path("fast.img"), &d.path("slow.img"), d.path("a.sock"));
    let attach = |s: &Server, dev: &str| {
        let mut c = s.admin_cmd("attach");
        c.arg(d.path(dev));
        c
    };
    // Its own cache device, its attached backing device (by its name and through a symlink).
    for dev in ["fast.img", "slow.img", "slow-link.img"] {
        let err = refused(&mut attach(&a, dev));
        assert_contains(
            &err,
            &format!(
                "{} is already open in this tiercache process (it is the cache device or an \
                 attached backing device)",
                d.path(dev).display()
            ),
        );
    }
    // A device another server holds.
    let b = Server::start(&d.path("fast2.img"), &d.path("slow2.img"), d.path("b.sock"));
    let err = refused(&mut attach(&a, "slow2.img"));
    assert_contains(&err, &b.holds(&d.path("slow2.img")));
    a.assert_serving("data");
    b.stop();
    // Detaching closes the device: attaching it again works.
    ok(a.admin_cmd("detach").arg("data"));
    ok(&mut attach(&a, "slow.img"));
    a.assert_serving("data");
    a.stop();
}

#[test]
fn locks_go_away_with_the_server_on_stop_sigterm_and_kill_9() {
    let d = Dir::new();
    d.make("fast.img", "slow.img", "data");
    let (fast, slow, sock) = (d.path("fast.img"), d.path("slow.img"), d.path("a.sock"));
    Server::start(&fast, &slow, sock.clone()).stop();
    Server::start(&fast, &slow, sock.clone()).terminate();
    let killed = Server::start(&fast, &slow, sock.clone());
    killed.kill9();
    // A killed server leaves its sockets behind; the kernel released its locks.
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(d.path("a.sock.admin"));
    let s = Server::start(&fast, &slow, sock);
    s.assert_serving("data");
    s.stop();
}

/// A loop device over a file, detached on drop.
struct Loop(String);

impl Loop {
    fn new(file: &Path) -> Loop {
        let o = ok(Command::new("losetup").args(["-f", "--show"]).arg(file));
        Loop(text(&o.stdout).trim().to_string())
    }

    fn path(&self) -> &Path {
        Path::new(&self.0)
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).status();
    }
}

#[test]
fn block_devices_are_compared_by_device_number_and_claimed_exclusively() {
    if !test_support::have_root("loop devices and mknod for the block device test") {
        return;
    }
    if !have("losetup") {
        return;
    }
    let d = Dir::new();
    let fast = Loop::new(&d.file("fast.img", 8));
    let slow = Loop::new(&d.file("slow.img", 16));
    // Another node of the cache device.
    let alias = d.path("fast-alias");
    let rdev = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(fast.path()).unwrap().rdev()
    };
    ok(Command::new("mknod")
        .arg(&alias)
        .arg("b")
        .args([libc::major(rdev).to_string(), libc::minor(rdev).to_string()]));
    let err = refused(
        tc().args(["make", "--cache"])
            .arg(fast.path())
            .arg("--backing")
            .arg(&alias),
    );
    assert_contains(
        &err,
        &format!(
            "{} and {} are the same device",
            fast.path().display(),
            alias.display()
        ),
    );
    ok(tc()
        .args([
            "make",
            "--bucket-size",
            "256k",
            "--label",
            "data",
            "--cache",
        ])
        .arg(fast.path())
        .arg("--backing")
        .arg(slow.path()));
    let a = Server::start(fast.path(), slow.path(), d.path("a.sock"));
    // Through the same node: the flock holder is named.
    let err = refused(tc().arg("check").arg(fast.path()));
    assert_contains(&err, &a.holds(fast.path()));
    // Through another node: the kernel's exclusive claim refuses it.
    d.make("fast2.img", "slow2.img", "other");
    let err = refused(
        tc().arg("serve")
            .arg("--cache")
            .arg(d.path("fast2.img"))
            .arg("--backing")
            .arg(&alias)
            .arg("--socket")
            .arg(d.path("b.sock")),
    );
    assert_contains(
        &err,
        &format!(
            "{} is busy: the kernel refused an exclusive open",
            alias.display()
        ),
    );
    a.assert_serving("data");
    a.stop();
    ok(tc().arg("check").arg(&alias));
}
