//! W3's filesystem: ext4 on a loop device over `nbdfuse`'s file view of an NBD export, the
//! way a user without the kernel NBD client puts a filesystem on the device.
//!
//! Invariants: each layer (nbdfuse, the loop device, the mount) is owned by a guard that undoes
//! it when dropped, and [`Ext4`] holds them so they drop in reverse order of creation
//! (unmount, detach the loop device, unmount FUSE and stop nbdfuse), also on error; a layer
//! that fails to come up undoes the layers below it the same way. Nothing here leaves a mount
//! or a loop device behind unless the kernel refuses to release it (then a warning names it).

use super::procs::{on_path, run_tool};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tools W3 needs, besides root.
const TOOLS: [&str; 5] = ["nbdfuse", "losetup", "mkfs.ext4", "mount", "umount"];

/// Why W3 cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("W3 skipped: it needs root (loop devices, mount)".into());
    }
    let mut missing: Vec<&str> = TOOLS.into_iter().filter(|t| !on_path(t)).collect();
    if !on_path("fusermount3") && !on_path("fusermount") {
        missing.push("fusermount3");
    }
    (!missing.is_empty()).then(|| {
        format!(
            "W3 skipped: {} not installed (Debian: apt-get install nbdfuse fuse3 mount e2fsprogs)",
            missing.join(", ")
        )
    })
}

/// The mount points under `dir` (from /proc/mounts): wiping `dir` while one exists would
/// delete files inside the mounted filesystem.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let dir = dir.to_string_lossy().trim_end_matches('/').to_string();
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        // /proc/mounts escapes spaces as \040; our scratch paths have none to compare.
        .filter(|m| *m == dir || m.starts_with(&format!("{dir}/")))
        .map(str::to_string)
        .collect()
}

/// `nbdfuse DIR URI`: the export as the file `DIR/nbd`.
struct Fuse {
    dir: PathBuf,
    child: Child,
}

impl Fuse {
    fn start(uri: &str, dir: &Path, log: &Path) -> Result<Fuse> {
        std::fs::create_dir_all(dir)?;
        let child = Command::new("nbdfuse")
            .arg(dir)
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .context("starting nbdfuse")?;
        let mut fuse = Fuse {
            dir: dir.to_path_buf(),
            child,
        };
        let t = Instant::now();
        while !fuse.file().exists() {
            if let Ok(Some(status)) = fuse.child.try_wait() {
                bail!(
                    "nbdfuse exited ({status}): {}",
                    std::fs::read_to_string(log).unwrap_or_default().trim()
                );
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("nbdfuse did not show {} within 20 s", fuse.file().display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(fuse)
    }

    fn file(&self) -> PathBuf {
        self.dir.join("nbd")
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        // Unmounting makes nbdfuse exit; a kill is the fallback.
        let tool = if on_path("fusermount3") {
            "fusermount3"
        } else {
            "fusermount"
        };
        let _ = Command::new(tool)
            .arg("-u")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        log::warn!("nbdfuse did not exit after unmounting; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new(tool)
            .args(["-u", "-z"])
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
    }
}

/// A loop device over a file.
struct Loop {
    dev: String,
}

impl Loop {
    /// `losetup --find --show --direct-io=on FILE`, or without direct I/O when the kernel
    /// refuses it for this file; the flag says which.
    fn attach(file: &Path) -> Result<(Loop, bool)> {
        let attach = |direct: bool| {
            let mut c = Command::new("losetup");
            c.args(["--find", "--show"]);
            if direct {
                c.arg("--direct-io=on");
            }
            run_tool(c.arg(file), "losetup").map(|out| Loop {
                dev: out.trim().to_string(),
            })
        };
        match attach(true) {
            Ok(l) => Ok((l, true)),
            Err(e) => {
                log::info!("losetup refused direct I/O ({e:#}); attaching without it");
                Ok((attach(false)?, false))
            }
        }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if let Err(e) = retry(|| {
            run_tool(
                Command::new("losetup").args(["-d", &self.dev]),
                "losetup -d",
            )
        }) {
            log::warn!("{} stays attached: {e:#}", self.dev);
        }
    }
}

/// A mounted filesystem.
struct Mount {
    dir: PathBuf,
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = retry(|| run_tool(Command::new("umount").arg(&self.dir), "umount")) {
            log::warn!("{e:#}; detaching {} lazily", self.dir.display());
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Tries `f` a few times over about two seconds (a device can stay busy for a moment after
/// its last user has gone).
fn retry(mut f: impl FnMut() -> Result<String>) -> Result<String> {
    let mut last = None;
    for _ in 0..10 {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(last.expect("at least one attempt"))
}

/// A fresh ext4 filesystem over an export, mounted. Fields drop in declaration order, which
/// is the reverse of the order they were set up in.
pub struct Ext4 {
    mount: Mount,
    _lo: Loop,
    _fuse: Fuse,
    /// Whether the loop device does direct I/O to the FUSE file (no page cache in between).
    pub direct_io: bool,
}

impl Ext4 {
    /// nbdfuse the export at `uri` under `dir/fuse`, attach a loop device, `mkfs.ext4` it
    /// (inode tables and journal initialised now, so no lazy-init thread writes during the
    /// run) and mount it at `dir/mnt`.
    pub fn create(uri: &str, dir: &Path) -> Result<Ext4> {
        let fuse = Fuse::start(uri, &dir.join("fuse"), &dir.join("nbdfuse.log"))?;
        let (lo, direct_io) = Loop::attach(&fuse.file())?;
        run_tool(
            Command::new("mkfs.ext4")
                .args(["-F", "-q", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
                .arg(&lo.dev),
            "mkfs.ext4",
        )?;
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt)?;
        run_tool(Command::new("mount").arg(&lo.dev).arg(&mnt), "mount")?;
        Ok(Ext4 {
            mount: Mount { dir: mnt },
            _lo: lo,
            _fuse: fuse,
            direct_io,
        })
    }

    /// Where the filesystem is mounted.
    pub fn dir(&self) -> &Path {
        &self.mount.dir
    }
}
