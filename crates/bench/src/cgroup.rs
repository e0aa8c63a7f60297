//! Memory cgroups for the `+memlimit` configurations, so that RAM cannot pose as SSD: every
//! server process of such a configuration (emulated disk, `tiercache serve`, `nbdkit`) runs in
//! its own memory cgroup whose limit counts the page cache it brings in (cgroup v1
//! `memory.limit_in_bytes`, v2 `memory.max`; swap is limited to the same amount where the
//! kernel offers the knob).
//!
//! Invariants: a process enters its cgroup in the child between `fork` and `exec` (it writes
//! `0`, meaning "myself", to `cgroup.procs`), so nothing it allocates is ever charged
//! elsewhere; a [`MemCgroup`] removes its directory when dropped, and its owner drops it only
//! after the processes in it have exited; every directory created here is named
//! `tiercache-bench-PID-N`, so a leftover is recognisable.

use anyhow::{bail, Context, Result};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const V1_ROOT: &str = "/sys/fs/cgroup/memory";
const V2_ROOT: &str = "/sys/fs/cgroup";

/// Where memory cgroups are made, and with which limit.
#[derive(Debug)]
pub struct Limiter {
    parent: PathBuf,
    v2: bool,
    bytes: u64,
}

/// One memory cgroup, removed when dropped.
#[derive(Debug)]
pub struct MemCgroup {
    dir: PathBuf,
}

static NEXT: AtomicU64 = AtomicU64::new(0);

impl Limiter {
    /// Finds a usable memory controller and checks that a cgroup can be made there; the error
    /// says why the `+memlimit` configurations cannot run.
    pub fn probe(bytes: u64) -> std::result::Result<Limiter, String> {
        // SAFETY: geteuid(2) has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return Err("memory cgroups need root".into());
        }
        let v2 = std::fs::read_to_string(Path::new(V2_ROOT).join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|w| w == "memory"));
        let candidates: Vec<PathBuf> = if v2 {
            // The root is exempt from the "no processes in inner cgroups" rule, and memory
            // must be delegated to its children.
            let _ = std::fs::write(Path::new(V2_ROOT).join("cgroup.subtree_control"), "+memory");
            vec![PathBuf::from(V2_ROOT)]
        } else if Path::new(V1_ROOT).join("memory.limit_in_bytes").exists() {
            // Nest under our own cgroup when we may, so outer limits and accounting still hold.
            let own = std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|c| {
                    c.lines().find_map(|l| {
                        let mut f = l.splitn(3, ':');
                        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
                        ctrl.split(',')
                            .any(|c| c == "memory")
                            .then(|| path.trim_start_matches('/').to_string())
                    })
                })
                .filter(|p| !p.is_empty());
            let mut v = Vec::new();
            if let Some(own) = own {
                v.push(Path::new(V1_ROOT).join(own));
            }
            v.push(PathBuf::from(V1_ROOT));
            v
        } else {
            return Err(format!(
                "no memory cgroup controller (neither {V1_ROOT} nor memory in {V2_ROOT}/cgroup.controllers)"
            ));
        };
        let mut why = String::new();
        for parent in candidates {
            let l = Limiter { parent, v2, bytes };
            match l.create() {
                Ok(cg) => {
                    drop(cg);
                    return Ok(l);
                }
                Err(e) => why = format!("{e:#}"),
            }
        }
        Err(why)
    }

    /// Makes a fresh cgroup with the limit.
    pub fn create(&self) -> Result<MemCgroup> {
        let dir = self.parent.join(format!(
            "tiercache-bench-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir)
            .with_context(|| format!("creating memory cgroup {}", dir.display()))?;
        let cg = MemCgroup { dir };
        let (limit, swap, swap_value) = if self.v2 {
            ("memory.max", "memory.swap.max", 0)
        } else {
            // memsw counts memory + swap, so the same figure forbids swapping.
            (
                "memory.limit_in_bytes",
                "memory.memsw.limit_in_bytes",
                self.bytes,
            )
        };
        std::fs::write(cg.dir.join(limit), self.bytes.to_string())
            .with_context(|| format!("setting {} in {}", limit, cg.dir.display()))?;
        // Absent when the kernel has no swap accounting; nothing to limit then.
        let _ = std::fs::write(cg.dir.join(swap), swap_value.to_string());
        Ok(cg)
    }
}

impl MemCgroup {
    /// Makes `cmd`'s process join this cgroup before it executes anything.
    pub fn enter_on_spawn(&self, cmd: &mut Command) -> Result<()> {
        let procs = CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes())
            .context("cgroup path with a NUL byte")?;
        // SAFETY: the closure runs in the forked child before exec and only calls
        // async-signal-safe functions (open, write, close) on memory allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(err);
                }
                Ok(())
            });
        }
        Ok(())
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        // rmdir fails with EBUSY until the last member is reaped; callers have waited, so this
        // is only a grace period for the kernel.
        let t = Instant::now();
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if t.elapsed() > Duration::from_secs(5) => {
                    log::warn!("could not remove {}: {e}", self.dir.display());
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// Parses `--mem-limit` (MiB; 0 turns the `+memlimit` configurations off).
pub fn limit_bytes(mib: Option<u64>, cache_bytes: u64) -> Result<Option<u64>> {
    match mib {
        None => Ok(Some((cache_bytes / 2).max(64 << 20))),
        Some(0) => Ok(None),
        Some(m) if m < 32 => {
            bail!("--mem-limit {m}: at least 32 MiB (a server process needs room), or 0 for off")
        }
        Some(m) => m
            .checked_mul(1 << 20)
            .map(Some)
            .with_context(|| format!("--mem-limit {m}: too large")),
    }
}
