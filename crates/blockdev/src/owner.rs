//! Device ownership: one owner per device file, and device identity.
//!
//! Owns: the locking policy of [`FileDevice`](crate::FileDevice) opens ([`LockMode`]), the
//! error a refused open returns ([`DeviceBusy`], naming the holder when it can be found), and
//! [`DeviceId`], which says whether two paths name the same device.
//!
//! How a device is locked: `flock(LOCK_EX|LOCK_NB)` (or `LOCK_SH` for [`LockMode::Shared`]) on
//! the opened descriptor. flock locks belong to the open file description, so they conflict
//! across processes *and* between two opens in one process; the kernel releases them when the
//! last descriptor of the open closes — on drop, on exit, on `kill -9`. A block device opened
//! with [`LockMode::Exclusive`] is also opened `O_EXCL`, the kernel's exclusive claim: it
//! fails with EBUSY while the device is mounted, used by md/LVM/device mapper, or claimed
//! through another node or one of its partitions — things a flock on one node cannot see.
//!
//! Finding the holder: flock locks are listed in `/proc/locks` with the pid that took them and
//! the inode as `MAJOR:MINOR:INODE` (major and minor of the holding filesystem in hex, the
//! inode in decimal) — matched against `fstat` of our own descriptor (for a block device node,
//! the node's inode). The holder's command comes from `/proc/PID/cmdline`.
//!
//! Invariants: a refused open leaves nothing behind (its descriptor is closed; nothing was
//! written); a [`DeviceBusy`] is always returned for a conflict, with the holder
//! [`Holder::Unknown`] when `/proc` does not say (another pid namespace, no procfs).
//!
//! Fault model: locks are advisory — they stop other tiercache processes (and other flock
//! users), not a program that writes the file without locking. Two different nodes of one
//! block device do not share flock locks (the `O_EXCL` claim covers that). On NFS, flock is
//! emulated with byte-range locks that do not conflict within one process. Remote NBD devices
//! are not files and cannot be locked here: their server decides who may use them.

use std::fmt;
use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// How a [`FileDevice`](crate::FileDevice) open claims its device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LockMode {
    /// The only open of the device anywhere: `flock(LOCK_EX)`, and `O_EXCL` for block
    /// devices. The default — every open that writes, and checks whose result depends on
    /// nobody else writing.
    #[default]
    Exclusive,
    /// Shared with other shared opens, refused while an exclusive one exists and vice versa:
    /// `flock(LOCK_SH)`. Block devices are not claimed with `O_EXCL` (the kernel's claim is
    /// exclusive only).
    Shared,
    /// No lock: for reads that tolerate a concurrent writer (printing headers), and tests
    /// that deliberately open a device twice.
    None,
}

/// What a device is, independent of the path that names it: two paths name the same device
/// exactly when their identities are equal (`./x`, symlinks and hard links to a file; any
/// node of a block device).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceId {
    /// A regular file (or anything that is not a block device): its filesystem and inode.
    File { dev: u64, ino: u64 },
    /// A block device: its device number, whichever node names it.
    Block { rdev: u64 },
}

impl DeviceId {
    /// The identity of the device at `path` (symlinks followed).
    pub fn of_path(path: &Path) -> io::Result<DeviceId> {
        Ok(DeviceId::of_metadata(&std::fs::metadata(path)?))
    }

    pub(crate) fn of_metadata(meta: &Metadata) -> DeviceId {
        if meta.file_type().is_block_device() {
            DeviceId::Block { rdev: meta.rdev() }
        } else {
            DeviceId::File {
                dev: meta.dev(),
                ino: meta.ino(),
            }
        }
    }
}

/// Who holds a device whose open was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// This process: the device is already open here.
    ThisProcess,
    /// Another process; `command` is its command line (program file name and arguments),
    /// empty when unreadable.
    Process { pid: u32, command: String },
    /// Not found in `/proc/locks` (another pid namespace, or no procfs).
    Unknown,
}

/// Why an open was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Busy {
    /// Another open holds a conflicting flock lock.
    Locked(Holder),
    /// The kernel refused the exclusive claim of a block device (EBUSY) and no flock holder
    /// was found: mounted, used by md/LVM/device mapper, or opened `O_EXCL` elsewhere.
    Claimed,
}

/// The error of an open refused because the device has another owner. It is carried inside
/// the `io::Error` that [`FileDevice::open`](crate::FileDevice::open) returns; get it back
/// with [`DeviceBusy::of`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceBusy {
    pub path: PathBuf,
    pub busy: Busy,
}

impl DeviceBusy {
    /// The `DeviceBusy` inside `e`, if `e` is one.
    pub fn of(e: &io::Error) -> Option<&DeviceBusy> {
        e.get_ref()?.downcast_ref::<DeviceBusy>()
    }
}

impl fmt::Display for DeviceBusy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        match &self.busy {
            Busy::Locked(Holder::ThisProcess) => {
                write!(f, "{path} is already open in this process")
            }
            Busy::Locked(Holder::Process { pid, command }) => {
                let who = if command == "tiercache" || command.starts_with("tiercache ") {
                    "another tiercache"
                } else {
                    "another process"
                };
                if command.is_empty() {
                    write!(f, "{path} is in use by {who} (pid {pid}); stop it first")
                } else {
                    write!(
                        f,
                        "{path} is in use by {who} (pid {pid}, {command}); stop it first"
                    )
                }
            }
            Busy::Locked(Holder::Unknown) => write!(
                f,
                "{path} is locked by another process (its pid is not in /proc/locks); stop it first"
            ),
            Busy::Claimed => write!(
                f,
                "{path} is busy: the kernel refused an exclusive open (mounted, used by \
                 md/LVM/device mapper, or already opened exclusively, perhaps through another \
                 node or a partition)"
            ),
        }
    }
}

impl std::error::Error for DeviceBusy {}

fn busy(path: &Path, busy: Busy) -> io::Error {
    io::Error::other(DeviceBusy {
        path: path.to_path_buf(),
        busy,
    })
}

/// Whether an open in `mode` also claims a block device with `O_EXCL`.
pub(crate) fn claims_block_device(mode: LockMode) -> bool {
    mode == LockMode::Exclusive
}

/// Takes the lock `mode` on `file` (opened from `path`, whose metadata is `meta`); a conflict
/// is a [`DeviceBusy`].
pub(crate) fn lock(file: &File, meta: &Metadata, path: &Path, mode: LockMode) -> io::Result<()> {
    let op = match mode {
        LockMode::Exclusive => libc::LOCK_EX,
        LockMode::Shared => libc::LOCK_SH,
        LockMode::None => return Ok(()),
    };
    loop {
        // SAFETY: flock on a descriptor we own; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => {
                return Err(busy(path, Busy::Locked(holder_of(meta))));
            }
            _ => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("locking {}: {e}", path.display()),
                ))
            }
        }
    }
}

/// The error for an `O_EXCL` open of the block device at `path` that failed with EBUSY: the
/// flock holder of the same node when there is one (another tiercache), else [`Busy::Claimed`].
pub(crate) fn claim_refused(path: &Path) -> io::Error {
    let holder = std::fs::metadata(path)
        .map(|m| holder_of(&m))
        .unwrap_or(Holder::Unknown);
    match holder {
        Holder::Unknown => busy(path, Busy::Claimed),
        h => busy(path, Busy::Locked(h)),
    }
}

/// The holder of the flock lock on the inode `meta` describes, from `/proc/locks`.
fn holder_of(meta: &Metadata) -> Holder {
    let dev = meta.dev();
    let find = || {
        read_proc_locks()
            .map(|text| flock_holders(&text, libc::major(dev), libc::minor(dev), meta.ino()))
            .unwrap_or_default()
    };
    // A read of /proc/locks that takes several `read` calls can skip a line when other locks
    // come and go in between (seq_file keeps its place by position); the conflicting lock
    // was there a moment ago, so look again before giving up.
    let mut pids = find();
    for _ in 1..PROC_LOCKS_TRIES {
        if !pids.is_empty() {
            break;
        }
        pids = find();
    }
    let me = std::process::id();
    if pids.contains(&me) {
        return Holder::ThisProcess;
    }
    match pids.first() {
        Some(&pid) => Holder::Process {
            pid,
            command: command_of(pid).unwrap_or_default(),
        },
        None => Holder::Unknown,
    }
}

/// How many times `/proc/locks` is read before a holder is declared unknown.
const PROC_LOCKS_TRIES: usize = 3;
/// The buffer `/proc/locks` is read into: large enough that one `read` returns all of it on
/// any machine short of thousands of locks (each line is about 50 bytes).
const PROC_LOCKS_READ_BYTES: usize = 1 << 20;

/// `/proc/locks` in as few `read` calls as possible (one, normally), so that the kernel's
/// listing is as close to one snapshot as it offers.
fn read_proc_locks() -> io::Result<String> {
    use std::io::Read;
    let mut f = File::open("/proc/locks")?;
    let mut buf = vec![0u8; PROC_LOCKS_READ_BYTES];
    let mut len = 0;
    loop {
        let n = f.read(&mut buf[len..])?;
        if n == 0 {
            break;
        }
        len += n;
        if len == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
    }
    buf.truncate(len);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The pids holding flock locks on inode `ino` of the filesystem `major:minor`, from the text
/// of `/proc/locks`. Lines look like `3: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF`
/// (major and minor in hex); waiters (`3: -> FLOCK ...`), POSIX and OFD locks are skipped, and
/// so is pid 0 (a holder outside our pid namespace on older kernels).
pub(crate) fn flock_holders(proc_locks: &str, major: u32, minor: u32, ino: u64) -> Vec<u32> {
    let parse = |line: &str| -> Option<u32> {
        let mut f = line.split_whitespace();
        f.next()?; // "N:"
        if f.next()? != "FLOCK" {
            return None;
        }
        f.next()?; // ADVISORY
        f.next()?; // READ or WRITE
        let pid: u32 = f.next()?.parse().ok()?;
        let mut id = f.next()?.split(':');
        let maj = u32::from_str_radix(id.next()?, 16).ok()?;
        let min = u32::from_str_radix(id.next()?, 16).ok()?;
        let i: u64 = id.next()?.parse().ok()?;
        (pid != 0 && (maj, min, i) == (major, minor, ino)).then_some(pid)
    };
    proc_locks.lines().filter_map(parse).collect()
}

/// Longest command line quoted in a message, in characters.
const MAX_COMMAND_CHARS: usize = 120;

/// `pid`'s command line as "PROGRAM ARGS..." (the program without its directory), shortened
/// to [`MAX_COMMAND_CHARS`]; `None` when unreadable or empty (a kernel thread, or gone).
pub(crate) fn command_of(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let mut args = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned());
    let program = args.next()?;
    let program = program.rsplit('/').next().unwrap_or(&program).to_string();
    let command = std::iter::once(program)
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ");
    Some(if command.chars().count() > MAX_COMMAND_CHARS {
        let cut: String = command.chars().take(MAX_COMMAND_CHARS).collect();
        format!("{cut}...")
    } else {
        command
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
1: POSIX  ADVISORY  WRITE 700 fe:00:4242 0 EOF
2: FLOCK  ADVISORY  WRITE 12345 fe:00:4242 0 EOF
2: -> FLOCK  ADVISORY  WRITE 555 fe:00:4242 0 EOF
3: FLOCK  ADVISORY  READ 600 08:01:4242 0 EOF
4: FLOCK  ADVISORY  READ 601 00:2a:99 0 EOF
4: FLOCK  ADVISORY  READ 602 00:2a:99 0 EOF
5: OFDLCK ADVISORY  WRITE -1 fe:00:4242 0 EOF
6: FLOCK  ADVISORY  WRITE 0 fe:00:4242 0 EOF
garbage
";

    #[test]
    fn proc_locks_lines_are_matched_on_hex_device_and_inode() {
        // The holder, not the POSIX lock, the waiter, the OFD lock or pid 0.
        assert_eq!(flock_holders(SAMPLE, 0xfe, 0, 4242), vec![12345]);
        // Another filesystem with the same inode number.
        assert_eq!(flock_holders(SAMPLE, 8, 1, 4242), vec![600]);
        // Major and minor are hex: 00:2a is 0:42.
        assert_eq!(flock_holders(SAMPLE, 0, 42, 99), vec![601, 602]);
        assert!(flock_holders(SAMPLE, 0, 0x2a, 98).is_empty());
        assert!(flock_holders(SAMPLE, 8, 1, 99).is_empty());
        assert!(flock_holders("", 8, 1, 99).is_empty());
    }

    #[test]
    fn messages_name_the_holder() {
        let m = |busy| {
            DeviceBusy {
                path: PathBuf::from("cache.img"),
                busy,
            }
            .to_string()
        };
        assert_eq!(
            m(Busy::Locked(Holder::Process {
                pid: 12345,
                command: "tiercache serve --cache cache.img".into()
            })),
            "cache.img is in use by another tiercache (pid 12345, tiercache serve --cache \
             cache.img); stop it first"
        );
        assert_eq!(
            m(Busy::Locked(Holder::Process {
                pid: 7,
                command: "dd if=/dev/zero".into()
            })),
            "cache.img is in use by another process (pid 7, dd if=/dev/zero); stop it first"
        );
        assert_eq!(
            m(Busy::Locked(Holder::Process {
                pid: 7,
                command: String::new()
            })),
            "cache.img is in use by another process (pid 7); stop it first"
        );
        assert_eq!(
            m(Busy::Locked(Holder::ThisProcess)),
            "cache.img is already open in this process"
        );
        assert!(m(Busy::Locked(Holder::Unknown)).contains("locked by another process"));
        assert!(m(Busy::Claimed).contains("mounted"));
    }

    #[test]
    fn command_lines_drop_the_directory_and_are_bounded() {
        let me = command_of(std::process::id()).expect("our own command line");
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_name().unwrap().to_string_lossy();
        assert!(me.starts_with(&*name), "{me} vs {name}");
        assert!(me.chars().count() <= MAX_COMMAND_CHARS + 3, "{me}");
        assert_eq!(command_of(0), None);
    }
}
