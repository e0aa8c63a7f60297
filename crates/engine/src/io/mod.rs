//! The request paths of one backing device (a `Volume`): what every request shares
//! (bounds checks, the backing device, knobs and status), flush, discard, write-zeroes and
//! block status here. A read enters at `plan` (its stages: `Volume::read`, `plan_read`,
//! `Hit`, `AroundRead`) and goes down into `read` (the lock-free hit, the checksums, misses
//! and promotion, readahead); a write enters at `absorb` (`Volume::write`, `plan_write`,
//! `Absorb`, `AroundWrite`) and goes down into `write` (the range's writes, the index
//! insert). `direct` is the one shape of the four staged requests (their pieces, the devices'
//! descriptors, `Staged`); `around` serves a degraded set, `lost` repairs what a failed
//! backing flush may have lost. Imports between them run one way: `plan` → `read`,
//! `absorb` → `write`, both → `direct`, everything → this file.
//!
//! Invariants:
//! - every request is 512-byte aligned and inside the device, or rejected with `Invalid`;
//! - writes (and discard / write-zeroes) hold the range lock over the block-aligned range for
//!   as long as the backing device and the cache change, so overlapping writes are ordered the
//!   same way in both; reads take no range lock;
//! - dirty data leaves the index (overwritten by a bypass or writethrough write, zeroed,
//!   discarded) only after what supersedes it was written to the backing device, and the
//!   record of the drop reaches the journal only after that device was flushed (the commit
//!   flushes it, once for all such writes), so a crash can never expose data older than the
//!   dirty copy: before the record is durable, recovery still holds the dirty copy;
//! - every write to the backing device invalidates the readahead windows it overlaps after it
//!   completes.

mod absorb;
mod around;
mod direct;
mod lost;
mod plan;
mod read;
mod write;

pub use absorb::{Absorb, AroundWrite, SlowWrite, WritePlan};
pub use direct::{Piece, Staged, Unstaged};
pub use plan::{AroundRead, Hit, ReadPlan, SlowRead};

use crate::policy::WriteRoute as Route;

use crate::knobs::Knob;
use crate::state::{Backing, DevKnobs, DevStatus, Inner};
use crate::stats::Counters;
use crate::types::{CacheMode, Error, IoContext, Result};
use crate::units::BackingBlock;
use blockdev::BlockDevice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A backing device served through its cache set.
#[derive(Clone)]
pub struct Volume {
    pub(crate) inner: Arc<Inner>,
    pub(crate) backing: Arc<Backing>,
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume")
            .field("id", &self.backing.id)
            .field("uuid", &self.uuid())
            .field("mode", &self.mode())
            .finish()
    }
}

/// What the policy asks when it routes a request (see `policy::RouteFacts`).
struct RouteAnswers<'a> {
    vol: &'a Volume,
    len: u64,
    detaching: bool,
}

impl crate::policy::RouteFacts for RouteAnswers<'_> {
    fn mode(&self) -> CacheMode {
        self.vol.mode()
    }
    fn detaching(&self) -> bool {
        self.detaching
    }
    fn sequential_cutoff(&self) -> u64 {
        self.vol.backing.sequential_cutoff.load(Ordering::Relaxed)
    }
    fn cache_congested(&mut self, write: bool) -> bool {
        let kind = if write {
            crate::cachedev::Kind::Write
        } else {
            crate::cachedev::Kind::Read
        };
        self.vol.cache_congested(kind, self.len)
    }
    fn dirty_limit(&self) -> (u32, u64) {
        let inner = &*self.vol.inner;
        (
            inner.config.dirty_max_pct,
            u64::from(inner.layout.total_blocks()),
        )
    }
    fn dirty_blocks(&mut self) -> u64 {
        self.vol.inner.state.lock().index.dirty_blocks
    }
}

impl Volume {
    pub fn id(&self) -> crate::DevId {
        self.backing.id
    }

    /// Exported size: the backing device minus its header.
    pub fn size_bytes(&self) -> u64 {
        self.backing.data_size.load(Ordering::Relaxed)
    }

    pub fn uuid(&self) -> uuid::Uuid {
        self.backing.uuid()
    }

    pub fn label(&self) -> String {
        self.backing.header.lock().label.clone()
    }

    /// The export name: the label, or the uuid when there is none (or when a label written
    /// before labels were validated is not a usable name).
    pub fn name(&self) -> String {
        let l = self.label();
        if crate::knobs::validate_label(&l).is_ok() {
            l
        } else {
            self.uuid().to_string()
        }
    }

    pub fn is_rotational(&self) -> bool {
        self.backing.dev.is_rotational()
    }

    /// Whether a read of `len` bytes at `offset` will not wait on a slow device: the backing
    /// device is not rotational, or every block is cached right now (a hint for the server's
    /// threading; a block evicted meanwhile only makes the read slower).
    pub fn read_is_quick(&self, offset: u64, len: u64) -> bool {
        if !self.backing.dev.is_rotational() {
            return true;
        }
        if self.inner.is_degraded() {
            return false;
        }
        let (b0, b1) = BackingBlock::touched_by(offset, len, self.inner.block_size());
        crate::index::all_cached(&self.inner.index_reader, self.backing.id, b0, b1)
    }

    /// Whether a write of `len` bytes at `offset` will not wait on a slow device: the backing
    /// device is not rotational, or the device is in writeback mode and the write covers whole
    /// blocks (the cache absorbs it unless dirty data is at its limit).
    pub fn write_is_quick(&self, offset: u64, len: u64) -> bool {
        let bs = self.inner.block_size();
        !self.backing.dev.is_rotational()
            || (self.mode() == CacheMode::Writeback
                && !self.inner.is_degraded()
                && offset.is_multiple_of(bs)
                && len.is_multiple_of(bs))
    }

    pub fn mode(&self) -> CacheMode {
        self.backing.mode()
    }

    pub fn knobs(&self) -> DevKnobs {
        self.backing.knobs()
    }

    /// Changes one knob live. The value is validated first, then persisted in the backing
    /// header (both copies, flushed), and only then applied: a value that is refused, or whose
    /// header write fails, changes nothing.
    pub fn set_knob(&self, knob: Knob) -> Result<()> {
        crate::guard::contain(&self.inner, "set knob", || self.set_knob_unguarded(knob))
    }

    fn set_knob_unguarded(&self, knob: Knob) -> Result<()> {
        knob.validate()?;
        let b = &self.backing;
        if let Knob::Label(l) = &knob {
            let taken = self.inner.backings.read().values().find_map(|o| {
                let h = o.header.lock();
                (o.id != b.id && h.label == *l).then_some(h.dev_uuid)
            });
            if let Some(other) = taken {
                return Err(Error::Invalid(format!(
                    "label {l:?} is already the name of device {other}"
                )));
            }
        }
        b.update_header(|h| match &knob {
            Knob::CacheMode(m) => h.mode = *m,
            Knob::SequentialCutoff(v) => h.tunables.sequential_cutoff = *v,
            Knob::WritebackPercent(v) => h.tunables.writeback_percent = *v,
            Knob::WritebackDelaySecs(v) => h.tunables.writeback_delay_secs = *v,
            Knob::WritebackRunning(v) => h.tunables.writeback_running = *v,
            Knob::Label(l) => h.label = l.clone(),
        })?;
        match knob {
            Knob::CacheMode(m) => b.mode.store(m.code(), Ordering::SeqCst),
            Knob::SequentialCutoff(v) => b.sequential_cutoff.store(v, Ordering::Relaxed),
            Knob::WritebackPercent(v) => b.writeback_percent.store(u64::from(v), Ordering::Relaxed),
            Knob::WritebackDelaySecs(v) => b.writeback_delay_secs.store(v, Ordering::Relaxed),
            Knob::WritebackRunning(v) => b.writeback_running.store(v, Ordering::Relaxed),
            Knob::Label(_) => {}
        }
        self.inner.wake_background();
        Ok(())
    }

    /// Picks up a backing device that grew: looks at its size again, records the new data
    /// size in its header (both copies, flushed), and serves it from then on (clients that
    /// connect afterwards see it). Returns the size served, in bytes. A device that did not
    /// grow keeps its size; one too big for the cache's index is refused.
    pub fn resize(&self) -> Result<u64> {
        crate::guard::contain(&self.inner, "resize", || {
            let b = &self.backing;
            let old = self.size_bytes();
            let new = crate::state::grown_data_size(&*b.dev, old)?;
            if new == old {
                return Ok(old);
            }
            let blocks = new.div_ceil(self.inner.block_size());
            if blocks > crate::index::BLOCK_LIMIT {
                return Err(Error::Invalid(format!(
                    "backing device of {new} bytes is too big for this cache: at most {} blocks of {} bytes",
                    crate::index::BLOCK_LIMIT,
                    self.inner.block_size()
                )));
            }
            b.update_header(|h| h.data_size = new)?;
            b.data_size.store(new, Ordering::SeqCst);
            log::info!("backing device {} grew from {old} to {new} bytes", b.id);
            Ok(new)
        })
    }

    /// Switches the cache mode live (see [`Volume::set_knob`]).
    pub fn set_mode(&self, mode: CacheMode) -> Result<()> {
        self.set_knob(Knob::CacheMode(mode))
    }

    pub fn set_sequential_cutoff(&self, bytes: u64) -> Result<()> {
        self.set_knob(Knob::SequentialCutoff(bytes))
    }

    pub fn set_writeback_percent(&self, pct: u32) -> Result<()> {
        self.set_knob(Knob::WritebackPercent(pct))
    }

    pub fn set_writeback_delay_secs(&self, secs: u64) -> Result<()> {
        self.set_knob(Knob::WritebackDelaySecs(secs))
    }

    pub fn set_writeback_running(&self, on: bool) -> Result<()> {
        self.set_knob(Knob::WritebackRunning(on))
    }

    pub fn set_label(&self, label: &str) -> Result<()> {
        self.set_knob(Knob::Label(label.to_string()))
    }

    /// Status and statistics of this device.
    pub fn status(&self) -> DevStatus {
        let b = &self.backing;
        let bs = self.inner.block_size();
        let (dirty, cached) = {
            let st = self.inner.state.lock();
            (
                st.index.dev_dirty_blocks(b.id),
                st.index.dev_live_blocks(b.id),
            )
        };
        let now = self.inner.now_ns();
        let snap = b.counters.snapshot();
        b.history.tick(now, &snap);
        let writeback = crate::writeback::device_rate(&self.inner, b);
        DevStatus {
            id: b.id,
            uuid: b.uuid(),
            knobs: b.knobs(),
            size_bytes: b.data_size.load(Ordering::Relaxed),
            dirty_bytes: dirty * bs,
            cached_bytes: cached * bs,
            state: if self.inner.is_degraded() {
                "degraded"
            } else if b.detaching.load(Ordering::Relaxed) {
                "detaching"
            } else if dirty > 0 {
                "dirty"
            } else {
                "clean"
            },
            writeback: writeback.rate,
            writeback_control: writeback,
            writeback_target_bytes: writeback.target_blocks * bs,
            writeback_error: b.writeback_error.lock().clone(),
            stats: b.history.windows(now, &snap),
            cost: b.cost(),
            fill_read_share: b.policy.fill_read_share(),
            backing_links: b.dev.nbd_links(),
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.check_failed()?;
        if let Some(why) = self.backing.taken_over() {
            return Err(Error::State(why));
        }
        if !offset.is_multiple_of(512) || !len.is_multiple_of(512) {
            return Err(Error::Invalid(format!(
                "offset {offset} and length {len} must be multiples of 512"
            )));
        }
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.size_bytes())
        {
            return Err(Error::Invalid(format!(
                "request at {offset} of {len} bytes ends past the device size {}",
                self.size_bytes()
            )));
        }
        if self.backing.detaching.load(Ordering::Relaxed)
            && !self.inner.backings.read().contains_key(&self.backing.id)
        {
            return Err(Error::State("device has been detached".into()));
        }
        Ok(())
    }

    /// Notes a failed cache-device I/O of this device's request (the request goes on without
    /// the cache where it can): counted, logged without flooding, and checked against the
    /// set's error limit.
    fn cache_failed(&self, e: &Error) {
        Counters::add(&self.backing.counters.cache_io_errors, 1);
        static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
        LOG.log(
            log::Level::Warn,
            format_args!("cache device failure, served without the cache: {e}"),
        );
        self.inner.after_cache_error(e);
    }

    /// Whether requests of `kind` should avoid the cache device now (it is slower than its
    /// congestion threshold and than the request would take on the backing device: its cost
    /// model's time for the request behind the I/Os already under way there, see
    /// `backing_wait_ns`; see `cachedev`); counted when they do.
    fn cache_congested(&self, kind: crate::cachedev::Kind, len: u64) -> bool {
        let c = &self.inner.config;
        let threshold = match kind {
            crate::cachedev::Kind::Read => c.congested_read_threshold_us,
            _ => c.congested_write_threshold_us,
        };
        let congested = self.inner.cache.congested(kind, threshold, len, || {
            let op = match kind {
                crate::cachedev::Kind::Read => crate::cost::Op::Read,
                _ => crate::cost::Op::Write,
            };
            let queued = self.backing.io_in_flight.load(Ordering::Relaxed);
            backing_wait_ns(self.backing.policy.expected_ns(op, len), queued)
        });
        if congested {
            Counters::add(&self.backing.counters.congested, 1);
        }
        congested
    }

    /// Feeds the sequential detector with a request the policy does not route (zeroes, a
    /// trim).
    fn note_io(&self, offset: u64, len: u64) {
        let now = self.inner.now_ns();
        let seen = self.backing.policy.observe_request(offset, len, now);
        self.note_stream(seen, now);
    }

    /// Stamps when a client last ran a long stream (writeback yields to it).
    fn note_stream(&self, seen: crate::policy::Seen, now: u64) {
        if seen.bytes >= crate::policy::WRITEBACK_STREAM_BYTES {
            self.backing
                .client_stream_ns
                .store(now.max(1), Ordering::Relaxed);
        }
    }

    /// Routes a read or a write through the policy (see `policy::VolumePolicy::route_read`
    /// and `route_write`), answering its questions (`RouteFacts`).
    fn routing(&self, len: u64, detaching: bool) -> (RouteAnswers<'_>, u64) {
        let now = self.inner.now_ns();
        (
            RouteAnswers {
                vol: self,
                len,
                detaching,
            },
            now,
        )
    }

    /// Runs a client I/O on the backing device, stamping when clients last used it (before
    /// and after, so a long request counts as use all along) for writeback to yield to.
    fn on_backing<T>(&self, io: impl FnOnce(&dyn BlockDevice) -> T) -> T {
        let stamp = || {
            self.backing
                .client_backing_ns
                .store(self.inner.now_ns(), Ordering::Relaxed)
        };
        stamp();
        let r = io(&*self.backing.dev);
        stamp();
        r
    }

    fn backing_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Counters::add(&self.backing.counters.backing_read_bytes, buf.len() as u64);
        let at = self.backing.data_offset() + offset;
        let len = buf.len() as u64;
        self.on_backing(|_| {
            self.backing
                .timed(crate::cost::Op::Read, at, len, |d| d.read_at(buf, at))
        })
        .ctx(|| format!("reading backing device at {offset}"))
    }

    /// Runs a client I/O that changes `[offset, offset + len)` of the backing device (write,
    /// zeroes, discard; `io` gets the device and the absolute offset). Afterwards, whatever
    /// the outcome, readahead windows over the range are dropped and the device is marked
    /// written for the deferred flush.
    fn change_backing(
        &self,
        offset: u64,
        len: u64,
        io: impl FnOnce(&dyn BlockDevice, u64) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let (b0, b1) = BackingBlock::touched_by(offset, len, self.inner.block_size());
        let token = self.backing.unflushed.lock().begin(b0, b1);
        let r = self.on_backing(|d| io(d, self.backing.data_offset() + offset));
        self.backing.unflushed.lock().end(token, r.is_ok());
        self.backing
            .readahead
            .lock()
            .invalidate(offset, offset + len);
        self.backing.backing_written.store(true, Ordering::SeqCst);
        r
    }

    fn backing_write(&self, data: &[u8], offset: u64) -> Result<()> {
        let len = data.len() as u64;
        Counters::add(&self.backing.counters.backing_written_bytes, len);
        self.change_backing(offset, len, |_, at| {
            self.backing
                .timed(crate::cost::Op::Write, at, len, |d| d.write_at(data, at))
        })
        .ctx(|| format!("writing backing device at {offset}"))
    }

    // ----- reads -----

    /// Makes every write acknowledged before this call durable.
    pub fn flush(&self) -> Result<()> {
        crate::guard::contain(&self.inner, "flush", || self.flush_unguarded())
    }

    fn flush_unguarded(&self) -> Result<()> {
        self.inner.check_failed()?;
        if let Some(why) = self.backing.taken_over() {
            return Err(Error::State(why));
        }
        self.flush_repairing()
    }

    fn flush_once(&self) -> Result<()> {
        if self.inner.is_degraded() {
            return self.degraded_flush();
        }
        let target = self.inner.state.lock().journal.appended_epoch;
        if let Err(e) = self.inner.commit_to(target) {
            // A commit that failed degraded the set (or found it degraded): the flush is
            // honoured as a degraded set honours it, or fails.
            if self.inner.is_degraded() {
                return self.degraded_flush();
            }
            return Err(e);
        }
        // Deferred flush: the backing device is flushed only if something reached it.
        self.backing.flush_if_written()
    }

    /// Discards a range: the cache forgets the blocks it covers and the discard is passed down.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        crate::guard::contain(&self.inner, "discard", || {
            self.discard_unguarded(offset, len)
        })
    }

    fn discard_unguarded(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.inner.is_degraded() {
            return self.degraded_change(offset, len, None, true);
        }
        self.note_io(offset, len);
        let inner = &*self.inner;
        let bs = inner.block_size();
        let (b0, b1) = BackingBlock::touched_by(offset, len, bs);
        let _guard = inner.ranges.lock(self.backing.id, b0, b1);
        self.change_backing(offset, len, |d, at| d.discard(at, len))
            .ctx(|| format!("discarding backing device at {offset}"))?;
        // Only blocks wholly inside the range are dropped: a partly discarded dirty block
        // still holds live sectors.
        let (f0, f1) = (
            BackingBlock::ceil_of_offset(offset, bs),
            BackingBlock::of_offset(offset + len, bs),
        );
        let now = inner.now_ns();
        let mut st = inner.state.lock();
        st.collide(self.backing.id, b0, b1);
        if f1 > f0 {
            st.invalidate(self.backing.id, f0, f1, now);
        }
        Ok(())
    }

    /// Makes a range read back as zeroes; with `fua`, durably.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        crate::guard::contain(&self.inner, "write zeroes", || {
            self.write_zeroes_unguarded(offset, len, fua)
        })
    }

    fn write_zeroes_unguarded(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.inner.is_degraded() {
            self.degraded_change(offset, len, None, false)?;
        } else {
            self.note_io(offset, len);
            let why = crate::policy::Bypass::Zeroes;
            self.backing.counters.bypass(why, len);
            self.write_range(offset, len, None, Route::Bypass(why))?;
        }
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Fraction of `[offset, offset + len)` held in the cache, as cached ranges (for
    /// block-status style reporting): `(offset, len, dirty)`.
    pub fn cached_ranges(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>> {
        crate::guard::contain(&self.inner, "cached ranges", || {
            self.cached_ranges_unguarded(offset, len)
        })
    }

    fn cached_ranges_unguarded(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>> {
        self.check(offset, len)?;
        if self.inner.is_degraded() {
            return Ok(Vec::new());
        }
        let bs = self.inner.block_size();
        let (b0, b1) = BackingBlock::touched_by(offset, len, bs);
        let segs = self
            .inner
            .state
            .lock()
            .index
            .lookup(self.backing.id, b0, b1);
        Ok(segs
            .into_iter()
            .filter_map(|s| s.ext.map(|e| (s.block.offset(bs), s.len * bs, e.dirty)))
            .collect())
    }
}

/// How long a request the backing device's cost model expects to take `service_ns` would
/// take there now, behind the `queued` data I/Os under way on it: the cache device's latency
/// it is compared with (`cachedev::CacheDev::congested`) includes the cache's own queue, so
/// the backing device's must include its queue too. Leaving it out sent every cached 512 KiB
/// read of a sequential stream at depth 4 to the disk, whatever its queue (Linux 6.12 under
/// qemu, `/dev/nbd0` and `/dev/ublkb0`: warm 1 MiB reads at 1.0-1.4x the disk alone, from
/// the cache since at 1.8-4.3x).
fn backing_wait_ns(service_ns: u64, queued: u64) -> u64 {
    service_ns.saturating_mul(queued.saturating_add(1))
}

/// A request under way that may put data of its device into the cache (a write, a read that
/// may promote), counted so a detach can wait for those that started before it (see
/// `CacheSet::detach`). Taken before the request reads `detaching`, given back at once when
/// it finds it set (the request then keeps out of the cache), so the count drains.
/// It owns a reference to the device so that a staged read can carry it to the thread that
/// finishes the request.
pub(crate) struct CacheUse(Option<Arc<Backing>>);

impl std::fmt::Debug for CacheUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.detaching() {
            "CacheUse(detaching)"
        } else {
            "CacheUse"
        })
    }
}

impl CacheUse {
    /// A use that holds nothing (what a request that already gave its use away keeps).
    pub(crate) fn none() -> CacheUse {
        CacheUse(None)
    }

    /// The device is being detached: keep out of the cache.
    pub(crate) fn detaching(&self) -> bool {
        self.0.is_none()
    }
}

impl Drop for CacheUse {
    fn drop(&mut self) {
        if let Some(b) = &self.0 {
            b.cache_users.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Backing {
    pub(crate) fn cache_use(self: &Arc<Self>) -> CacheUse {
        // SeqCst on both sides: either this request sees `detaching`, or the detach sees
        // this request in `cache_users` and waits for it.
        self.cache_users.fetch_add(1, Ordering::SeqCst);
        if self.detaching.load(Ordering::SeqCst) {
            self.cache_users.fetch_sub(1, Ordering::SeqCst);
            CacheUse(None)
        } else {
            CacheUse(Some(Arc::clone(self)))
        }
    }

    pub(crate) fn data_offset(&self) -> u64 {
        crate::format::BACKING_DATA_OFFSET
    }
}

#[cfg(test)]
mod tests {
    use super::backing_wait_ns;

    #[test]
    fn a_request_for_the_backing_device_waits_behind_the_ios_under_way_there() {
        assert_eq!(backing_wait_ns(8_000_000, 0), 8_000_000);
        assert_eq!(backing_wait_ns(8_000_000, 3), 32_000_000);
        assert_eq!(backing_wait_ns(u64::MAX / 2, 5), u64::MAX);
    }
}
