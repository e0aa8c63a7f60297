//! A memory device that calls back on its I/O, for tests: what a test needs to hold a request
//! at a point, count what reaches a device or record requests, without writing (and
//! delegating every method of) a device of its own. The callbacks are a [`Hooks`] value the
//! device dereferences to, so a test reads its state as fields of the device.
//!
//! Invariants: every request reaches the memory device (the hooks observe and delay, they
//! never change data or results); `after_*` hooks run after the memory device served the
//! request, `before_*` ones before.

use crate::{BlockDevice, MemDevice};
use std::io;
use std::ops::Deref;

/// What a [`Hooked`] device calls on its I/O (each does nothing unless overridden).
pub trait Hooks: Send + Sync + std::fmt::Debug + 'static {
    fn after_read(&self, _offset: u64, _len: usize) {}
    fn before_write(&self, _offset: u64, _len: usize) {}
    fn after_write(&self, _offset: u64, _len: usize) {}
    fn before_flush(&self) {}
}

/// A [`MemDevice`] of a given size whose I/O goes through `H`'s callbacks.
#[derive(Debug)]
pub struct Hooked<H> {
    inner: MemDevice,
    hooks: H,
    rotational: bool,
    name: &'static str,
}

impl<H: Hooks> Hooked<H> {
    pub fn new(bytes: u64, name: &'static str, hooks: H) -> Hooked<H> {
        Hooked {
            inner: MemDevice::new(bytes),
            hooks,
            rotational: false,
            name,
        }
    }

    /// The memory device under the hooks (I/O there calls no hook).
    pub fn inner(&self) -> &MemDevice {
        &self.inner
    }

    /// The same, reporting itself rotational (or not).
    pub fn rotational(mut self, rotational: bool) -> Hooked<H> {
        self.rotational = rotational;
        self
    }
}

impl<H> Deref for Hooked<H> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.hooks
    }
}

impl<H: Hooks> BlockDevice for Hooked<H> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let r = self.inner.read_at(buf, offset);
        self.hooks.after_read(offset, buf.len());
        r
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.hooks.before_write(offset, buf.len());
        let r = self.inner.write_at(buf, offset);
        self.hooks.after_write(offset, buf.len());
        r
    }
    fn flush(&self) -> io::Result<()> {
        self.hooks.before_flush();
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn is_rotational(&self) -> bool {
        self.rotational
    }
    fn describe(&self) -> String {
        self.name.into()
    }
}
