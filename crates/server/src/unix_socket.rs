//! Unix socket files that stay put: binding with the final permissions set atomically, refusing
//! a path that a live server holds, and removing at shutdown only the socket we bound.
//!
//! Owns: the life of one socket *file* — probing the path, creating it, removing it. (The
//! listening socket itself belongs to whoever holds the returned `UnixListener`.)
//!
//! Invariants:
//! - [`bind_unix`] never unlinks or replaces a socket a server accepts connections on (it fails
//!   with `AddrInUse`), nor anything that is not a socket (it fails with `AlreadyExists`); it
//!   removes only a stale socket, one whose `connect` is refused;
//! - the socket appears at its path already carrying its final mode and owner, whatever the
//!   umask: it is bound in a fresh private (0700) directory next to the path, chmod-ed and
//!   chown-ed there, then moved into place with `renameat2(RENAME_NOREPLACE)` (or `link`, which
//!   also never replaces, on file systems without it); a server racing us for the same path
//!   makes one of us fail instead of clobbering the other;
//! - [`UnixSocketFile::remove_if_ours`] unlinks the path only while it still names the inode we
//!   bound (device and inode recorded before the move).
//!
//! Fault model: OS errors are returned as `io::Error` naming the path; the temporary directory
//! is removed on every way out of [`bind_unix`] (a crash can leave an empty `.NAME.PID.N`
//! directory behind). Two races are inherent to the file system API and remain: a stale socket
//! replaced by a live one between our probe and our unlink of it, and our socket replaced
//! between the identity check and the unlink in `remove_if_ours`. Both need another process to
//! clobber a path it found in use, which no server using this module does.

use std::ffi::{CString, OsStr};
use std::fs::{self, DirBuilder, Permissions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Mode of a socket unless configured otherwise: its owner and group may connect.
pub const SOCKET_MODE_DEFAULT: u32 = 0o660;
/// Permission bits a socket mode may have (no setuid, setgid or sticky bits).
const SOCKET_MODE_BITS: u32 = 0o777;
/// Mode of the private directory the socket is bound in before it is moved into place.
const TEMP_DIR_MODE: u32 = 0o700;
/// Names tried for the private directory before giving up (another may exist after a crash).
const TEMP_DIR_ATTEMPTS_MAX: u32 = 16;
/// The socket's name inside the private directory (short: `sun_path` holds 107 bytes).
const TEMP_SOCKET_NAME: &str = "s";

/// Permissions a unix socket file gets before it becomes reachable at its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnixSocketPerms {
    /// Permission bits (at most 0o777); default [`SOCKET_MODE_DEFAULT`] (0o660).
    pub mode: u32,
    /// Owner to give the socket (needs privilege unless it is our own uid); default: ours.
    pub uid: Option<u32>,
    /// Group to give the socket (needs privilege unless we are a member); default: ours.
    pub gid: Option<u32>,
}

impl Default for UnixSocketPerms {
    fn default() -> Self {
        UnixSocketPerms {
            mode: SOCKET_MODE_DEFAULT,
            uid: None,
            gid: None,
        }
    }
}

/// A socket file bound by [`bind_unix`]: its path and the identity of the inode we created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl UnixSocketFile {
    /// Where the socket was bound.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the path still names the socket we bound (not deleted, not replaced).
    pub fn is_in_place(&self) -> bool {
        fs::symlink_metadata(&self.path)
            .map(|meta| meta.dev() == self.dev && meta.ino() == self.ino)
            .unwrap_or(false)
    }

    /// Unlinks the path if it still names the socket we bound; `Ok(false)` if it is gone or now
    /// names something else (which is left alone). Call it while the listener is still open,
    /// so a server probing the path meanwhile sees it live and keeps off.
    pub fn remove_if_ours(&self) -> io::Result<bool> {
        if !self.is_in_place() {
            return Ok(false);
        }
        match fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(err) => Err(with_path(err, "could not remove", &self.path)),
        }
    }
}

/// Binds a unix stream socket at `path` with `perms` (see the module invariants): fails with
/// `AddrInUse` if a server listens there, `AlreadyExists` if the path is not a socket, and
/// replaces a stale socket file.
pub fn bind_unix(
    path: &Path,
    perms: &UnixSocketPerms,
) -> io::Result<(UnixListener, UnixSocketFile)> {
    if perms.mode & !SOCKET_MODE_BITS != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket mode {:#o} for {} has bits beyond {SOCKET_MODE_BITS:#o}",
                perms.mode,
                path.display()
            ),
        ));
    }
    let Some(name) = path.file_name() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} has no file name", path.display()),
        ));
    };
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    remove_stale(path)?;
    let temp = TempDir::create(parent, name)?;
    let temp_socket = temp.path.join(TEMP_SOCKET_NAME);
    let listener = UnixListener::bind(&temp_socket).map_err(|err| {
        with_path(
            err,
            &format!("could not bind a socket for {} at", path.display()),
            &temp_socket,
        )
    })?;
    fs::set_permissions(&temp_socket, Permissions::from_mode(perms.mode))
        .map_err(|err| with_path(err, "could not chmod", &temp_socket))?;
    if perms.uid.is_some() || perms.gid.is_some() {
        std::os::unix::fs::chown(&temp_socket, perms.uid, perms.gid)
            .map_err(|err| with_path(err, "could not chown", &temp_socket))?;
    }
    let meta = fs::symlink_metadata(&temp_socket)
        .map_err(|err| with_path(err, "could not stat", &temp_socket))?;
    move_into_place(&temp_socket, path)?;
    drop(temp);
    Ok((
        listener,
        UnixSocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        },
    ))
}

/// Checks, changing nothing, what [`bind_unix`] would refuse at `path` now: a path with no
/// file name, in a directory that does not exist, too long for a socket address, naming
/// something that is not a socket, or a socket a server listens on. A server checks its
/// paths this way before it opens its devices, so a mistake costs nothing.
pub fn check_unix_path(path: &Path) -> io::Result<()> {
    if path.file_name().is_none() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} has no file name", path.display()),
        ));
    }
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "socket path {}: the directory {} does not exist",
                path.display(),
                parent.display()
            ),
        ));
    }
    if is_stale(path)? {
        return Ok(());
    }
    // Nothing there: the probe checks the path's length (a stale socket was probed already).
    is_live(path).map(drop)
}

/// Removes `path` if it is a socket nobody listens on; refuses a live socket or a non-socket.
fn remove_stale(path: &Path) -> io::Result<()> {
    if !is_stale(path)? {
        return Ok(());
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(err) => Err(with_path(err, "could not remove the stale socket", path)),
    }
}

/// Whether `path` is a socket nobody listens on (false: nothing there); a live socket or a
/// non-socket is an error.
fn is_stale(path: &Path) -> io::Result<bool> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(with_path(err, "could not stat", path)),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            ),
        ));
    }
    if is_live(path)? {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "{}: another server is listening there; refusing to take over its socket",
                path.display()
            ),
        ));
    }
    Ok(true)
}

/// Whether a server accepts connections at the socket `path`. The probe never blocks: a full
/// backlog (`EAGAIN`) counts as live; a refusal or a vanished file as not live.
fn is_live(path: &Path) -> io::Result<bool> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let addr = SockAddr::unix(path).map_err(|e| with_path(e, "cannot probe", path))?;
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    match socket.connect(&addr) {
        Ok(()) => Ok(true),
        Err(err) => match err.raw_os_error() {
            Some(libc::EAGAIN) => Ok(true),
            Some(libc::ECONNREFUSED | libc::ENOENT) => Ok(false),
            _ => Err(with_path(err, "could not probe", path)),
        },
    }
}

/// Moves the bound socket to `to` without ever replacing what is there.
fn move_into_place(from: &Path, to: &Path) -> io::Result<()> {
    let from_c = c_path(from)?;
    let to_c = c_path(to)?;
    // SAFETY: both pointers are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    let result = if rc == 0 {
        Ok(())
    } else {
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // No RENAME_NOREPLACE on this file system: a hard link never replaces either (the
            // temporary name goes with its directory).
            Some(libc::EINVAL | libc::ENOSYS) => fs::hard_link(from, to),
            _ => Err(err),
        }
    };
    result.map_err(|err| {
        if err.kind() == io::ErrorKind::AlreadyExists {
            io::Error::new(
                io::ErrorKind::AddrInUse,
                format!(
                    "{} was created by someone else while we were binding it",
                    to.display()
                ),
            )
        } else {
            with_path(err, "could not move the socket into place at", to)
        }
    })
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("path {} contains a NUL byte", path.display()),
        )
    })
}

fn with_path(err: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(err.kind(), format!("{what} {}: {err}", path.display()))
}

/// A private directory next to the socket path; removed, with anything left in it by us, on
/// drop.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn create(parent: &Path, name: &OsStr) -> io::Result<TempDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let mut last_err = None;
        for _ in 0..TEMP_DIR_ATTEMPTS_MAX {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let mut dir_name = std::ffi::OsString::from(".");
            dir_name.push(name);
            dir_name.push(format!(".{}.{n}", std::process::id()));
            let path = parent.join(dir_name);
            match DirBuilder::new().mode(TEMP_DIR_MODE).create(&path) {
                Ok(()) => {
                    let dir = TempDir { path };
                    // The umask may have taken bits away; only we can reach the directory
                    // meanwhile, so restoring them is safe.
                    fs::set_permissions(&dir.path, Permissions::from_mode(TEMP_DIR_MODE))
                        .map_err(|err| with_path(err, "could not chmod", &dir.path))?;
                    return Ok(dir);
                }
                Err(err) if err.kind() == io::ErrorKind::AlreadyExists => last_err = Some(err),
                Err(err) => return Err(with_path(err, "could not create", &path)),
            }
        }
        let err = last_err.unwrap_or_else(|| io::ErrorKind::AlreadyExists.into());
        Err(with_path(
            err,
            "could not create a private directory in",
            parent,
        ))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let socket = self.path.join(TEMP_SOCKET_NAME);
        if let Err(err) = fs::remove_file(&socket) {
            if err.kind() != io::ErrorKind::NotFound {
                log::warn!("could not remove {}: {err}", socket.display());
            }
        }
        if let Err(err) = fs::remove_dir(&self.path) {
            log::warn!("could not remove {}: {err}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binds_with_the_mode_and_removes_only_its_own_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.sock");
        let perms = UnixSocketPerms {
            mode: 0o600,
            ..UnixSocketPerms::default()
        };
        let (listener, file) = bind_unix(&path, &perms).unwrap();
        let meta = fs::symlink_metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Only the socket is left in the directory: the private directory is gone.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(file.is_in_place());
        // A second bind sees the live listener.
        let err = bind_unix(&path, &perms).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        // Replaced by someone else: not ours any more, left alone.
        fs::remove_file(&path).unwrap();
        fs::write(&path, b"theirs").unwrap();
        assert!(!file.is_in_place());
        assert!(!file.remove_if_ours().unwrap());
        assert_eq!(fs::read(&path).unwrap(), b"theirs");
        fs::remove_file(&path).unwrap();
        drop(listener);
    }

    #[test]
    fn rejects_bad_modes_and_long_paths() {
        let dir = tempfile::tempdir().unwrap();
        let perms = UnixSocketPerms {
            mode: 0o4660,
            ..UnixSocketPerms::default()
        };
        let err = bind_unix(&dir.path().join("x"), &perms).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let long = dir.path().join("x".repeat(200));
        assert!(bind_unix(&long, &UnixSocketPerms::default()).is_err());
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left");
    }
}
