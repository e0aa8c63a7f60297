//! Helpers shared by the tests that run the real `tiercache` binary: finding external tools
//! (a missing tool fails under CI=true and is a printed skip otherwise), running commands, and
//! a `Fixture` of device files formatted by `tiercache make` with a server over them.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses a different subset
pub use test_support::{ci, have, is_root, unavailable};

pub mod host;

pub fn tc() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tiercache"));
    c.env("RUST_LOG", "warn");
    c
}

/// `tiercache ARGS[0] --admin ADMIN ARGS[1..]`: an admin command against the server whose
/// admin socket is `admin`.
pub fn admin_cmd(admin: &str, args: &[&str]) -> Command {
    let mut c = tc();
    c.args(&args[..1])
        .arg("--admin")
        .arg(admin)
        .args(&args[1..]);
    c
}

pub fn run(cmd: &mut Command) -> Output {
    let o = cmd.output().expect("spawning a command");
    assert_succeeded(cmd, &o);
    o
}

/// `run`, bounded: a command that hangs fails the test, naming it, instead of hanging it.
pub fn run_within(cmd: &mut Command, limit: Duration) -> Output {
    let o = output_bounded(cmd, limit);
    assert_succeeded(cmd, &o);
    o
}

fn assert_succeeded(cmd: &Command, o: &Output) {
    assert!(
        o.status.success(),
        "{:?} failed: {}\n{}",
        cmd,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Device files formatted by `tiercache make`, and a server over them.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub server: Option<Child>,
}

impl Fixture {
    pub fn new(backing_mib: u64, cache_mib: u64, writeback: bool) -> Fixture {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        for (name, mib) in [("slow.img", backing_mib), ("fast.img", cache_mib)] {
            std::fs::File::create(dir.path().join(name))
                .unwrap()
                .set_len(mib << 20)
                .unwrap();
        }
        Fixture::make(dir, writeback)
    }

    /// Formats `slow.img` and `fast.img`, which must exist in `dir`, with `tiercache make`.
    pub fn make(dir: tempfile::TempDir, writeback: bool) -> Fixture {
        let mut make = tc();
        make.args([
            "make",
            "--label",
            "data",
            "--bucket-size",
            "256k",
            "--backing",
        ])
        .arg(dir.path().join("slow.img"))
        .arg("--cache")
        .arg(dir.path().join("fast.img"));
        if writeback {
            make.arg("--writeback");
        }
        run(&mut make);
        Fixture { dir, server: None }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn socket(&self) -> PathBuf {
        self.path("nbd.sock")
    }

    pub fn admin(&self) -> String {
        format!("{}.admin", self.socket().display())
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///data?socket={}", self.socket().display())
    }

    pub fn start(&mut self) {
        self.start_with(&[]);
    }

    /// `tiercache serve` on the fixture's devices and socket, not yet started.
    pub fn serve_cmd(&self) -> Command {
        let mut c = tc();
        c.arg("serve")
            .arg("--cache")
            .arg(self.path("fast.img"))
            .arg("--backing")
            .arg(self.path("slow.img"))
            .arg("--socket")
            .arg(self.socket());
        c
    }

    /// Starts `serve` on the fixture's devices with extra arguments and waits until both
    /// sockets exist.
    pub fn start_with(&mut self, extra: &[&str]) {
        let mut cmd = self.serve_cmd();
        cmd.args(extra).stderr(Stdio::inherit());
        self.start_cmd(cmd);
    }

    /// Starts a server command (`serve_cmd` with changes) and waits until both sockets exist.
    pub fn start_cmd(&mut self, mut cmd: Command) {
        // A killed server leaves both sockets behind; wait for the new ones.
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_file(self.admin());
        let child = cmd.spawn().expect("starting tiercache serve");
        self.server = Some(child);
        let t = Instant::now();
        while !(self.socket().exists() && Path::new(&self.admin()).exists()) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs an admin command (`status`, `set ...`) against the server; it must succeed.
    pub fn tc_admin(&self, args: &[&str]) -> Output {
        run(&mut self.admin_cmd(args))
    }

    /// The command line of an admin command, to run it expecting failure.
    pub fn admin_cmd(&self, args: &[&str]) -> Command {
        admin_cmd(&self.admin(), args)
    }

    /// Graceful stop through the admin socket; the server must exit 0.
    pub fn stop(&mut self) {
        self.tc_admin(&["stop"]);
        let status = self.server.take().unwrap().wait().unwrap();
        assert!(status.success(), "server exited with {status}");
    }

    /// `nbdkit [FILTERS] file slow.img [PARAMS]` on `kit.sock` in the fixture's directory (the
    /// fixture's backing device, served remote), started and accepting connections.
    pub fn nbdkit_on_backing(&self, filters: &[&str], params: &[&str]) -> Child {
        let pidfile = self.path("kit.pid");
        let _ = std::fs::remove_file(&pidfile);
        let _ = std::fs::remove_file(self.path("kit.sock"));
        let kit = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-P"])
            .arg(&pidfile)
            .arg("-U")
            .arg(self.path("kit.sock"))
            .args(filters)
            .arg("file")
            .arg(self.path("slow.img"))
            .args(params)
            .spawn()
            .unwrap();
        wait_for_nbdkit(&pidfile);
        kit
    }

    pub fn kill9(&mut self) {
        let mut c = self.server.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `cmd`, which must fail cleanly (a non-zero exit, no panic) within `limit`; returns
/// what it printed, stdout then stderr.
pub fn refused_within(cmd: &mut Command, limit: Duration) -> String {
    let o = output_bounded(cmd, limit);
    let said = format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success(), "{cmd:?} succeeded: {said}");
    assert!(!said.contains("panicked"), "{cmd:?} panicked: {said}");
    said
}

/// Runs a command to completion like `Command::output`, but kills it after `limit` (a hung
/// server must fail the test, not hang it); `None` then.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Option<Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let status = wait_for(&mut child, limit);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    status.map(|status| Output {
        status,
        stdout,
        stderr,
    })
}

/// `output_within`, where a command that does not end within `limit` fails the test.
pub fn output_bounded(cmd: &mut Command, limit: Duration) -> Output {
    output_within(cmd, limit).unwrap_or_else(|| panic!("{cmd:?} hung for {limit:?}"))
}

/// Waits for a child for at most `limit`.
pub fn wait_for(c: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let t = Instant::now();
    loop {
        if let Some(s) = c.try_wait().unwrap() {
            return Some(s);
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most 20 s) until nbdkit has written `pidfile`, which it does once it accepts
/// connections.
pub fn wait_for_nbdkit(pidfile: &Path) {
    let t = Instant::now();
    while std::fs::metadata(pidfile).map_or(true, |m| m.len() == 0) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "nbdkit did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
