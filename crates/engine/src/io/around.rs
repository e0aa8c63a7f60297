//! Requests of a degraded set (see `health`): straight to the backing device, except what
//! only the failed cache device holds.
//!
//! Invariants:
//! - nothing here reads or writes the cache device or changes the index; writes take the
//!   range lock and mark overlapping promotions collided, as in normal operation, so
//!   requests already under way when the set degraded cannot cache what a write replaced;
//! - a read of a range with dirty data, and a write, discard or write-zeroes over a range
//!   with dirty data or entries that may not be durable, fail with an error that says why;
//!   everything else is served as in mode `none`;
//! - a flush flushes the backing device, and fails for a device whose dirty data changed
//!   in entries that may not be durable (that promise is the cache device's to keep).

use super::Volume;
use crate::stats::Counters;
use crate::types::{Error, IoContext, Result};
use crate::units::BackingBlock;

impl Volume {
    fn refuse_degraded(&self, what: &str, offset: u64, len: u64) -> Error {
        Error::State(format!(
            "cannot {what} {len} bytes at {offset} of device {}: the cache set is degraded and \
             the cache device holds the only current copy of part of this range (dirty data); \
             re-admit the repaired cache device to reach it",
            self.backing.id
        ))
    }

    pub(super) fn degraded_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (b0, b1) = BackingBlock::touched_by(offset, buf.len() as u64, self.inner.block_size());
        if self.inner.degraded_blocks(self.backing.id, b0, b1, false) {
            Counters::add(&self.backing.counters.io_errors, 1);
            return Err(self.refuse_degraded("read", offset, buf.len() as u64));
        }
        Counters::add(&self.backing.counters.degraded_bytes, buf.len() as u64);
        self.backing_read(buf, offset)
    }

    /// A write (`Some(data)`), write-zeroes (`None`) or discard (`discard`).
    pub(super) fn degraded_change(
        &self,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
        discard: bool,
    ) -> Result<()> {
        let inner = &*self.inner;
        let (b0, b1) = BackingBlock::touched_by(offset, len, inner.block_size());
        let _guard = inner.ranges.lock(self.backing.id, b0, b1);
        inner.state.lock().collide(self.backing.id, b0, b1);
        if inner.degraded_blocks(self.backing.id, b0, b1, true) {
            Counters::add(&self.backing.counters.io_errors, 1);
            return Err(self.refuse_degraded("change", offset, len));
        }
        Counters::add(&self.backing.counters.degraded_bytes, len);
        match (data, discard) {
            (_, true) => self
                .change_backing(offset, len, |d, at| d.discard(at, len))
                .ctx(|| format!("discarding backing device at {offset}")),
            (Some(d), false) => self.backing_write(d, offset),
            (None, false) => self.backing_zero(offset, len),
        }
    }

    pub(super) fn degraded_flush(&self) -> Result<()> {
        if !self.inner.degraded_flush_ok(self.backing.id) {
            return Err(Error::State(format!(
                "cannot flush device {}: the cache set is degraded and writes to it that only \
                 the cache device recorded are not durable; re-admit the repaired cache device",
                self.backing.id
            )));
        }
        self.backing.flush_now()
    }
}
