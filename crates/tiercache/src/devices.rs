//! Opening devices named on the command line: a path (regular file or block device, O_DIRECT
//! where possible) or an NBD URI (`nbd+unix:///NAME?socket=PATH`, `nbd://HOST:PORT/NAME`) for a
//! remote backing device.
//!
//! Invariant: a missing path is a one-line "no such file or device" error, never a panic.

use anyhow::{bail, Context, Result};
use blockdev::{BlockDevice, FileDevice, FileDeviceOptions, NbdDevice};
use std::path::Path;
use std::sync::Arc;

/// Opens a file or block device.
pub fn open_path(path: &Path, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
    if !path.exists() {
        bail!("{}: no such file or device", path.display());
    }
    let dev = FileDevice::open(
        path,
        FileDeviceOptions {
            read_only,
            ..FileDeviceOptions::default()
        },
    )
    .with_context(|| format!("opening {}", path.display()))?;
    Ok(Arc::new(dev))
}

/// Opens a path or an NBD URI.
pub fn open_spec(spec: &str, read_only: bool) -> Result<Arc<dyn BlockDevice>> {
    if spec.starts_with("nbd://") || spec.starts_with("nbd+unix://") {
        let dev = NbdDevice::connect(spec).with_context(|| format!("connecting to {spec}"))?;
        return Ok(Arc::new(dev));
    }
    open_path(Path::new(spec), read_only)
}
