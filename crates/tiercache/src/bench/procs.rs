//! The configurations under test, as running processes: the emulated disk, tiercache on top
//! of it, nbdkit's cache filter on top of it, or the fast file alone.
//!
//! Invariants: every process started here is owned by a [`Proc`] that sends SIGTERM and waits
//! when dropped, so no run leaves a server behind, even on error; every configuration reaches
//! the same emulated disk model over NBD, and every cache gets the same size.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process stopped (SIGTERM, then wait) when dropped.
pub struct Proc {
    child: Child,
    what: String,
}

impl Proc {
    fn spawn(cmd: &mut Command, what: &str) -> Result<Proc> {
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        Ok(Proc {
            child,
            what: what.to_string(),
        })
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is touched.
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

fn wait_for(path: &Path, what: &str) -> Result<()> {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("{what} did not come up (no {})", path.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn tiercache() -> Result<Command> {
    let mut c = Command::new(std::env::current_exe().context("finding the tiercache binary")?);
    c.env("RUST_LOG", "warn");
    Ok(c)
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
    _procs: Vec<Proc>,
}

/// Starts `config` with fresh devices in `dir`.
pub fn start(config: &str, dir: &Path, sizes: Sizes) -> Result<Running> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let disk = dir.join("disk.img");
    let hdd_sock = dir.join("hdd.sock");
    let hdd_uri = format!("nbd+unix:///disk?socket={}", hdd_sock.display());
    let emulate = |kind: &str, file: &Path, sock: &Path, extra: &[&str]| -> Result<Proc> {
        let mut c = tiercache()?;
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
        let p = Proc::spawn(&mut c, &format!("tiercache emulate {kind}"))?;
        wait_for(sock, "the emulated disk")?;
        Ok(p)
    };
    match config {
        "hdd" => Ok(Running {
            uri: hdd_uri,
            admin: None,
            _procs: vec![emulate("hdd", &disk, &hdd_sock, &[])?],
        }),
        "ssd" => {
            // The fast file alone, O_DIRECT, with no added latency.
            let sock = dir.join("ssd.sock");
            let p = emulate(
                "ssd",
                &dir.join("fast.img"),
                &sock,
                &["--latency-us", "0", "--transfer-mb-s", "1000000"],
            )?;
            Ok(Running {
                uri: format!("nbd+unix:///disk?socket={}", sock.display()),
                admin: None,
                _procs: vec![p],
            })
        }
        "nbdkit-cache" => {
            let hdd = emulate("hdd", &disk, &hdd_sock, &[])?;
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
            let kit = Proc::spawn(&mut c, "nbdkit")?;
            wait_for(&sock, "nbdkit")?;
            Ok(Running {
                uri: format!("nbd+unix:///?socket={}", sock.display()),
                admin: None,
                _procs: vec![kit, hdd],
            })
        }
        mode if mode.starts_with("tiercache-") => {
            let mode = mode.trim_start_matches("tiercache-");
            let hdd = emulate("hdd", &disk, &hdd_sock, &[])?;
            let cache = dir.join("cache.img");
            std::fs::File::create(&cache)?.set_len(sizes.cache_bytes)?;
            let out = tiercache()?
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
                .output()?;
            if !out.status.success() {
                bail!(
                    "tiercache make failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            let sock = dir.join("tc.sock");
            let mut c = tiercache()?;
            c.arg("serve")
                .arg("--cache")
                .arg(&cache)
                .args(["--backing", &hdd_uri, "--socket"])
                .arg(&sock);
            let tc = Proc::spawn(&mut c, "tiercache serve")?;
            let admin = crate::serve::admin_for(&sock);
            wait_for(&admin, "tiercache serve")?;
            let running = Running {
                uri: format!("nbd+unix:///data?socket={}", sock.display()),
                admin: Some(admin),
                _procs: vec![tc, hdd],
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
        if let Some(admin) = &self.admin {
            crate::admin::request(
                admin,
                &serde_json::json!({"cmd": "set", "device": "data", "knob": knob, "value": value}),
                &mut |_| {},
            )?;
        }
        Ok(())
    }

    /// tiercache's statistics (None for peers).
    pub fn stats(&self) -> Option<serde_json::Value> {
        let admin = self.admin.as_ref()?;
        crate::admin::request(admin, &serde_json::json!({"cmd": "stats"}), &mut |_| {}).ok()
    }
}
