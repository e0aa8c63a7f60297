//! `blockdev`: the block device abstraction every other tiercache crate builds on.
//!
//! Owns: the [`BlockDevice`] trait and its implementations — [`MemDevice`] (in memory),
//! [`FileDevice`] (regular file or block device, O_DIRECT where possible) — and the wrappers
//! [`fault`] (seeded EIO, latency, crash with lost and torn writes) and [`latency`] (HDD and
//! SSD timing models), and [`NbdDevice`] (a remote device over NBD); and [`owner`]: one owner
//! per device file (locks taken by every [`FileDevice`] open, [`DeviceBusy`] naming the
//! holder of a refused one) and [`DeviceId`] (whether two paths name the same device).
//! Nothing here knows about caching.
//!
//! Invariants every implementation keeps:
//! - offsets and lengths are multiples of [`SECTOR_SIZE`] (512 bytes) and lie inside
//!   `size_bytes()`; anything else is rejected with `ErrorKind::InvalidInput`, never panics;
//! - a write that returned `Ok` is visible to every later read (read-your-writes);
//! - a write is *durable* (survives a crash) only once a later `flush` has returned `Ok`;
//! - `write_zeroes` makes the range read back as zeroes; `discard` makes the contents of the
//!   range unspecified until rewritten (implementations here read back zeroes or old data).
//!
//! Fault model: every call may fail with an `io::Error`; callers must treat a failed write as
//! "any subset of the sectors may have been written" and a failed flush as "nothing since the
//! previous successful flush is known durable".

use std::fmt::Debug;
use std::io;

pub mod fault;
mod file;
pub mod hooked;
pub mod latency;
mod mem;
mod nbd;
pub mod owner;

pub use file::{FileDevice, FileDeviceOptions};
pub use mem::MemDevice;
pub use nbd::{
    is_nbd_uri, parse_uri, NbdDevice, NbdDirect, NbdLinks, NbdOptions, Target, TlsParams,
};
pub use owner::{DeviceBusy, DeviceId, LockMode};

/// The unit of addressing for every device: offsets and lengths are multiples of this.
pub const SECTOR_SIZE: u64 = 512;

/// A device addressed in bytes, with sector-aligned offsets and lengths.
///
/// Implementations are thread-safe: many requests may be in flight at once from different
/// threads. Requests that overlap have no ordering guarantee among themselves.
pub trait BlockDevice: Send + Sync + Debug {
    /// Usable size in bytes (a multiple of [`SECTOR_SIZE`]).
    fn size_bytes(&self) -> u64;

    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Writes `buf` at `offset`. Not durable until the next successful [`flush`](Self::flush).
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;

    /// Makes every write that completed before this call durable.
    fn flush(&self) -> io::Result<()>;

    /// Hints that the range is unused; its contents are unspecified until rewritten.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Makes the range read back as zeroes.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        let zeroes = vec![0u8; ZERO_CHUNK_BYTES.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64);
            self.write_at(&zeroes[..n as usize], offset + done)?;
            done += n;
        }
        Ok(())
    }

    /// True when the device is a spinning disk (seeks are expensive).
    fn is_rotational(&self) -> bool {
        false
    }

    /// Looks at the device's size again (a file or block device that grew) and returns it;
    /// `size_bytes` reports it from then on. Devices whose size cannot change keep theirs;
    /// wrappers forward the call.
    fn refresh_size(&self) -> io::Result<u64> {
        Ok(self.size_bytes())
    }

    /// A short human-readable description ("file /path (O_DIRECT)", "memory 64 MiB", ...).
    fn describe(&self) -> String;

    /// A descriptor the caller may read or write `len` bytes at `offset` through itself (with
    /// asynchronous I/O such as io_uring), with a buffer aligned to 4 KiB, instead of calling
    /// [`read_at`](Self::read_at) or [`write_at`](Self::write_at); it stays open as long as the
    /// device. `None` (the default): I/O must go through those calls (a device that is not a
    /// plain file or adds behaviour of its own). A wrapper that only observes forwards it and
    /// accounts the I/O in [`direct_done`](Self::direct_done).
    fn direct_fd(&self, _offset: u64, _len: usize) -> Option<std::os::fd::RawFd> {
        None
    }

    /// A connection of a remote device lent whole for one read (`write` false) or write of
    /// `len` bytes at `offset`, which the caller carries out itself on its socket (see
    /// [`NbdDirect`]); `None` (the default): I/O goes through the calls, as for `direct_fd`.
    /// A wrapper that only observes forwards it and accounts the I/O in
    /// [`direct_done`](Self::direct_done).
    fn direct_nbd(&self, _write: bool, _offset: u64, _len: usize) -> Option<NbdDirect> {
        None
    }

    /// A remote device's connections now (`None`, the default: not a remote device). A
    /// wrapper forwards it.
    fn nbd_links(&self) -> Option<NbdLinks> {
        None
    }

    /// A read (`write` false) or write of `len` bytes at `offset` that the caller made itself
    /// through [`direct_fd`](Self::direct_fd) or [`direct_nbd`](Self::direct_nbd) has ended after `took` (`ok`: whole and without
    /// error). Wrappers that count or time I/O account it here as if it had gone through
    /// `read_at` or `write_at`.
    fn direct_done(
        &self,
        _write: bool,
        _offset: u64,
        _len: usize,
        _took: std::time::Duration,
        _ok: bool,
    ) {
    }
}

/// Largest buffer the default `write_zeroes` allocates.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;

/// Validates that `[offset, offset + len)` is sector aligned and inside a device of `size` bytes.
pub fn check_range(size: u64, offset: u64, len: u64) -> io::Result<()> {
    if !offset.is_multiple_of(SECTOR_SIZE) || !len.is_multiple_of(SECTOR_SIZE) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unaligned request: offset {offset} length {len} (must be multiples of {SECTOR_SIZE})"),
        ));
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("request past the end: offset {offset} length {len} device size {size}"),
        )),
    }
}

impl<T: BlockDevice + ?Sized> BlockDevice for std::sync::Arc<T> {
    fn size_bytes(&self) -> u64 {
        (**self).size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        (**self).write_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        (**self).flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        (**self).discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        (**self).write_zeroes(offset, len)
    }
    fn is_rotational(&self) -> bool {
        (**self).is_rotational()
    }
    fn refresh_size(&self) -> io::Result<u64> {
        (**self).refresh_size()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn direct_fd(&self, offset: u64, len: usize) -> Option<std::os::fd::RawFd> {
        (**self).direct_fd(offset, len)
    }
    fn direct_nbd(&self, write: bool, offset: u64, len: usize) -> Option<NbdDirect> {
        (**self).direct_nbd(write, offset, len)
    }
    fn nbd_links(&self) -> Option<NbdLinks> {
        (**self).nbd_links()
    }
    fn direct_done(
        &self,
        write: bool,
        offset: u64,
        len: usize,
        took: std::time::Duration,
        ok: bool,
    ) {
        (**self).direct_done(write, offset, len, took, ok)
    }
}
