//! Opening devices named on the command line: a path (regular file or block device, O_DIRECT
//! where possible) or an NBD URI (`nbd+unix:///NAME?socket=PATH`, `nbd://HOST:PORT/NAME`,
//! `nbds://HOST:PORT/NAME?tls-certificates=DIR`) for a remote backing device; and refusing one
//! device named twice.
//!
//! Owns: which lock each command takes ([`Access`]) and the wording of a refused open (a
//! conflict with another owner stays recognisable: [`is_busy`]), and the "same device under
//! two names" check ([`ensure_distinct`]).
//!
//! Invariants: a missing path is a one-line "no such file or device" error, never a panic;
//! anything but a regular file or a block device (a FIFO, a socket, a directory, a character
//! device) is refused before it is opened, for every command (a FIFO opened to be read would
//! wait for a writer forever).
//! One owner per device: `serve`, `make` and `attach` open paths exclusively, `check` too
//! (its verdict on a device another process writes would be meaningless) — see
//! `blockdev::owner` — and the lock lives as long as the returned device; `show` reads headers
//! without a lock (it may print a header a running server is about to change). Devices are
//! compared by identity (file system and inode; device number for block devices), never by
//! spelling, so `./x`, symlinks, hard links and other nodes of one block device are caught.
//!
//! Fault model: remote NBD devices cannot be locked or identified beyond their URI (two
//! identical URIs are refused; two spellings of one remote export are not caught) — the
//! remote server decides who may use them.

use anyhow::{anyhow, bail, Context, Result};
use blockdev::owner::{Busy, Holder};
use blockdev::NbdDevice;
use blockdev::{BlockDevice, DeviceBusy, DeviceId, FileDevice, FileDeviceOptions, LockMode};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

/// What a command does with a device: decides read-only and the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// `serve`, `make`, `attach`: read-write, exclusive.
    Write,
    /// `check`: read-only, exclusive (nobody may write while it verifies).
    Check,
    /// `show`: read-only, unlocked.
    Inspect,
}

impl Access {
    fn options(self) -> FileDeviceOptions {
        let (read_only, lock) = match self {
            Access::Write => (false, LockMode::Exclusive),
            Access::Check => (true, LockMode::Exclusive),
            Access::Inspect => (true, LockMode::None),
        };
        FileDeviceOptions {
            read_only,
            lock,
            ..FileDeviceOptions::default()
        }
    }
}

/// Opens a file or block device.
pub fn open_path(path: &Path, access: Access) -> Result<Arc<dyn BlockDevice>> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{}: no such file or device", path.display())
        }
        Err(e) => return Err(anyhow!(e).context(format!("examining {}", path.display()))),
    };
    // Before any open: opening a FIFO read-only waits for a writer, forever.
    let kind = meta.file_type();
    if !(kind.is_file() || kind.is_block_device()) {
        bail!(
            "{}: neither a regular file nor a block device (it is {})",
            path.display(),
            kind_name(&kind)
        );
    }
    match FileDevice::open(path, access.options()) {
        Ok(dev) => Ok(Arc::new(dev)),
        Err(e) => Err(match DeviceBusy::of(&e) {
            Some(b) if b.busy == Busy::Locked(Holder::ThisProcess) => anyhow!(
                "{} is already open in this tiercache process (it is the cache device or an \
                 attached backing device)",
                b.path.display()
            ),
            // Kept as the typed error (same text), so callers can tell "another owner" from
            // "cannot be opened" (see [`is_busy`]).
            Some(b) => anyhow::Error::new(b.clone()),
            None => anyhow!(e).context(format!("opening {}", path.display())),
        }),
    }
}

/// What a path that is neither a regular file nor a block device is, for the refusal.
fn kind_name(kind: &std::fs::FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else {
        "not a device"
    }
}

/// Whether an open failed because another process (or this one) owns the device, as opposed
/// to the device being missing or unusable.
pub fn is_busy(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<DeviceBusy>())
}

fn is_uri(spec: &str) -> bool {
    blockdev::is_nbd_uri(spec)
}

/// Opens a path or an NBD URI.
pub fn open_spec(spec: &str, access: Access) -> Result<Arc<dyn BlockDevice>> {
    if is_uri(spec) {
        let dev = NbdDevice::connect(spec).with_context(|| format!("connecting to {spec}"))?;
        return Ok(Arc::new(dev));
    }
    open_path(Path::new(spec), access)
}

/// What a device spec names, for comparing specs.
#[derive(PartialEq, Eq)]
enum Ident {
    Local(DeviceId),
    Remote(String),
}

/// Refuses a cache device and backing devices (paths or NBD URIs) of which two are the same
/// device, naming both spellings. Paths that cannot be examined (missing) are left for the
/// open to report.
pub fn ensure_distinct(cache: &Path, backings: &[String]) -> Result<()> {
    let cache_spec = cache.to_string_lossy();
    let specs = std::iter::once(&*cache_spec).chain(backings.iter().map(String::as_str));
    let idents: Vec<(usize, &str, Ident)> = specs
        .enumerate()
        .filter_map(|(i, spec)| {
            let ident = if is_uri(spec) {
                Ident::Remote(spec.to_string())
            } else {
                Ident::Local(DeviceId::of_path(Path::new(spec)).ok()?)
            };
            Some((i, spec, ident))
        })
        .collect();
    for (n, (i, a, ident)) in idents.iter().enumerate() {
        if let Some((_, b, _)) = idents[n + 1..].iter().find(|(_, _, other)| other == ident) {
            let why = if *i == 0 {
                "the cache and backing devices must be different"
            } else {
                "each backing device can be attached once"
            };
            bail!("{a} and {b} are the same device ({why})");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_device_under_two_names_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let s = |n: &str| p(n).to_string_lossy().into_owned();
        for n in ["a", "b"] {
            std::fs::write(p(n), [0u8; 512]).unwrap();
        }
        std::os::unix::fs::symlink("a", p("link")).unwrap();
        ensure_distinct(&p("a"), &[s("b")]).unwrap();
        ensure_distinct(&p("a"), &[s("b"), s("missing")]).unwrap();
        let e = ensure_distinct(&p("a"), &[s("b"), s("link")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{} and {} are the same device (the cache and backing devices must be different)",
                s("a"),
                s("link")
            )
        );
        let e = ensure_distinct(&p("b"), &[s("a"), s("./link")]).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("are the same device (each backing device can be attached once)"),
            "{e}"
        );
        let uri = "nbd+unix:///x?socket=/s".to_string();
        ensure_distinct(&p("a"), std::slice::from_ref(&uri)).unwrap();
        assert!(ensure_distinct(&p("a"), &[uri.clone(), uri]).is_err());
    }
}
