//! The state every mechanism of a cache set works on: `Inner` (the set's devices, locks and
//! configuration), `State` (index, buckets, pending journal entries, under one mutex) and
//! `Backing` (one attached backing device). It sits below the mechanisms (`io`, `space`,
//! `writeback`, `commit`, `health`, `background`) and the lifecycle (`set`), which import it;
//! it imports none of them.
//!
//! Invariants:
//! - `State` (index, buckets, pending journal entries) is changed only under its mutex, and
//!   every index change appends the matching journal entry in the same critical section
//!   (`State::log`, `insert_extent`, `invalidate`), so replaying the journal in order
//!   reproduces the in-memory index exactly;
//! - an entry that drops dirty data (superseded by a write that went to the backing device)
//!   is written to the journal or a checkpoint only after that backing device was flushed
//!   (`JournalState::flush_backing_first`): the drop may happen in memory at once, its record
//!   waits for the data that replaced it, and one flush per commit covers many writes;
//! - lock order: `ckpt_lock` before `commit_lock` before `group` before `state`; `backings`
//!   (read) may be taken under `state`; a `Backing`'s `cost`, `seq`, `readahead` and
//!   `writeback_pi` are leaf locks (see docs/architecture.md).

use crate::alloc::Buckets;
use crate::clock::{Clock, SystemClock};
use crate::codec::Writer;
use crate::cost::DevCost;
use crate::format::{BackingHeader, BackingState, Layout, Superblock, BACKING_DATA_OFFSET};
use crate::index::Index;
use crate::journal::{Entry, Ring};
use crate::rangelock::RangeLocks;
use crate::stats::{Counters, History, Windows};
use crate::types::{CacheMode, DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock};
use blockdev::BlockDevice;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use uuid::Uuid;

/// Cache-device failures tolerated before the set degrades (bcache's default).
pub const DEFAULT_IO_ERROR_LIMIT: u32 = 8;
/// Cache-device I/Os over which the failure count halves.
pub const DEFAULT_IO_ERROR_HALFLIFE: u64 = 100_000;
/// Longest a cache-device I/O may take (the Linux SCSI layer's default command timeout).
pub const DEFAULT_CACHE_IO_TIMEOUT_MS: u64 = 30_000;
/// bcache's congestion thresholds.
pub const DEFAULT_CONGESTED_READ_US: u64 = 2_000;
pub const DEFAULT_CONGESTED_WRITE_US: u64 = 20_000;

/// Run-time configuration of an open cache set.
#[derive(Clone)]
pub struct Config {
    /// Run writeback, reclaim, GC and periodic commits on background threads. Tests that need
    /// determinism turn this off and call the `*_step` methods themselves.
    pub background: bool,
    /// Copying GC compacts closed buckets with at most this percentage of live blocks.
    pub gc_live_pct: u32,
    /// Dirty data may fill at most this percentage of the cache; above it writes bypass.
    pub dirty_max_pct: u32,
    /// Background commit interval for journal entries no client flush has committed.
    pub journal_delay_ms: u64,
    /// Most buckets a checkpoint encodes per hold of the state lock (at most one chunk's
    /// worth in any case). Tests set 1 so checkpoints of small caches are fuzzy too.
    pub checkpoint_buckets_per_lock: u32,
    pub clock: Arc<dyn Clock>,
    /// Cache-device failures (I/O errors, timeouts, checksum mismatches), decayed, past which
    /// the set becomes degraded (bcache's `io_error_limit`; 0: the first failure does it).
    pub io_error_limit: u32,
    /// Cache-device I/Os after which the failure count halves (bcache's `io_error_halflife`;
    /// 0: it never decays).
    pub io_error_halflife: u64,
    /// A cache-device I/O that takes longer than this has failed; one still in flight after
    /// it makes the set degraded (0: no limit).
    pub cache_io_timeout_ms: u64,
    /// Clean reads avoid the cache device while its reads take longer than this on average
    /// (bcache's `congested_read_threshold_us`; 0: never).
    pub congested_read_threshold_us: u64,
    /// Writes that need not go to the cache device (all but writeback) avoid it while its
    /// writes take longer than this (bcache's `congested_write_threshold_us`; 0: never).
    pub congested_write_threshold_us: u64,
    /// Which read misses a full cache admits (`policy::Admission`).
    pub admission: crate::policy::Admission,
    /// Which clean bucket a full cache gives up (`policy::Replacement`).
    pub replacement: crate::policy::Replacement,
    /// The decisions every volume's policy takes ([`crate::policy::Measured`]; tests may
    /// script their own to check what the mechanism does with each answer).
    pub decisions: Arc<dyn crate::policy::Decisions>,
    /// How often each attached backing device's header is read to see whether another set
    /// took it over (0: never; see `owner`). A take-over waits twice this before it serves.
    pub owner_check_ms: u64,
    /// This host's name, recorded in the header of every backing device the set owns (a
    /// refused attach on another host names it). At most `LABEL_BYTES`; empty: not recorded.
    pub host_name: String,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            background: true,
            gc_live_pct: 75,
            dirty_max_pct: 90,
            journal_delay_ms: 100,
            checkpoint_buckets_per_lock: u32::MAX,
            clock: Arc::new(SystemClock::default()),
            io_error_limit: DEFAULT_IO_ERROR_LIMIT,
            io_error_halflife: DEFAULT_IO_ERROR_HALFLIFE,
            cache_io_timeout_ms: DEFAULT_CACHE_IO_TIMEOUT_MS,
            congested_read_threshold_us: DEFAULT_CONGESTED_READ_US,
            congested_write_threshold_us: DEFAULT_CONGESTED_WRITE_US,
            admission: Default::default(),
            replacement: Default::default(),
            decisions: Arc::new(crate::policy::Measured),
            owner_check_ms: 1000,
            host_name: String::new(),
        }
    }
}

/// Per-device tunables, with bcache's sysfs names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevKnobs {
    pub cache_mode: CacheMode,
    pub sequential_cutoff: u64,
    pub writeback_percent: u32,
    pub writeback_delay_secs: u64,
    pub writeback_running: bool,
    pub label: String,
}

/// Pending journal entries and the epochs that say how much of them is durable.
pub(crate) struct JournalState {
    pub buf: Writer,
    pub appended_epoch: u64,
    pub durable_epoch: u64,
    pub oldest_pending_ns: Option<u64>,
    pub ring: Ring,
    pub ckpt_slot: u32,
    pub ckpt_seq: u64,
    /// Backing devices to flush before the next record or checkpoint is written, each with
    /// the epoch of its latest entry that dropped dirty data.
    pub flush_backing_first: BTreeMap<DevId, u64>,
    /// Entries not yet durable that left a range less dirty in memory than on the cache
    /// device (dirty data dropped, or written back): `(epoch, dev, b0, b1, dropped)`. A set
    /// degraded meanwhile must not let writes reach those ranges (see `health`).
    pub less_dirty: Vec<(u64, DevId, BackingBlock, BackingBlock, bool)>,
    /// The epoch of each device's latest entry inserting dirty data.
    pub dirty_insert_epoch: BTreeMap<DevId, u64>,
}

impl JournalState {
    /// Entries up to `epoch` are durable.
    pub fn durable_to(&mut self, epoch: u64) {
        self.durable_epoch = self.durable_epoch.max(epoch);
        let d = self.durable_epoch;
        self.less_dirty.retain(|e| e.0 > d);
    }
}

/// A read miss being promoted; a write that overlaps it while in flight marks it collided.
pub(crate) struct Promotion {
    pub dev: DevId,
    pub b0: BackingBlock,
    pub b1: BackingBlock,
    pub collided: bool,
}

pub(crate) struct State {
    pub index: Index,
    pub buckets: Buckets,
    pub journal: JournalState,
    pub devs: BTreeMap<DevId, Uuid>,
    pub promotions: HashMap<u64, Promotion>,
    pub next_promotion: u64,
    pub writeback: crate::wbpool::WritebackPool,
    /// While degraded: what entries that may not be durable touched (see `health`).
    pub uncertain: Option<crate::degraded::Uncertain>,
}

impl State {
    /// Appends a journal entry (call in the same critical section as the index change).
    pub fn log(&mut self, entry: &Entry, now_ns: u64) {
        entry.encode(&mut self.journal.buf);
        self.journal.appended_epoch += 1;
        match *entry {
            Entry::Insert {
                dev, dirty: true, ..
            } => {
                let epoch = self.journal.appended_epoch;
                self.journal.dirty_insert_epoch.insert(dev, epoch);
                if let Some(u) = &mut self.uncertain {
                    u.note_dirty(dev);
                }
            }
            Entry::MarkClean {
                dev, block, len, ..
            } => self.less_dirty(dev, block, block + u64::from(len), false),
            _ => {}
        }
        self.journal.oldest_pending_ns.get_or_insert(now_ns);
    }

    /// Marks every in-flight promotion overlapping the range as collided.
    pub fn collide(&mut self, dev: DevId, b0: BackingBlock, b1: BackingBlock) {
        for p in self.promotions.values_mut() {
            if p.dev == dev && p.b0 < b1 && b0 < p.b1 {
                p.collided = true;
            }
        }
    }

    /// Maps backing blocks to freshly written cache blocks (journaled). The cache data must
    /// already be written; it becomes durable with the next commit.
    pub fn insert_extent(
        &mut self,
        dev: DevId,
        block: BackingBlock,
        ext: crate::index::Extent,
        crcs: Vec<u32>,
        now_ns: u64,
    ) {
        // A clean copy over dirty blocks (a writethrough write) drops dirty data the same way
        // an invalidation does: the backing device holds the new data, not yet flushed.
        let drops_dirty = !ext.dirty
            && self
                .index
                .any_overlapping(dev, block, block + u64::from(ext.len), |e| e.dirty);
        self.index.insert(dev, block, ext, &crcs);
        let gen = self.buckets.gen[self.index.bucket_of(ext.cache_block).idx()];
        self.log(
            &Entry::Insert {
                dev,
                block,
                len: ext.len,
                cache_block: ext.cache_block,
                gen,
                dirty: ext.dirty,
                crcs,
            },
            now_ns,
        );
        if drops_dirty {
            self.owe_backing_flush(dev, block, block + u64::from(ext.len));
        }
    }

    /// Notes that the entry just appended dropped dirty data of `dev` in `[b0, b1)`.
    fn owe_backing_flush(&mut self, dev: DevId, b0: BackingBlock, b1: BackingBlock) {
        let epoch = self.journal.appended_epoch;
        self.journal.flush_backing_first.insert(dev, epoch);
        self.less_dirty(dev, b0, b1, true);
    }

    /// Notes that the entry just appended left `[b0, b1)` less dirty than before (`dropped`:
    /// dirty data dropped; else written back).
    fn less_dirty(&mut self, dev: DevId, b0: BackingBlock, b1: BackingBlock, dropped: bool) {
        let epoch = self.journal.appended_epoch;
        self.journal.less_dirty.push((epoch, dev, b0, b1, dropped));
        if let Some(u) = &mut self.uncertain {
            u.note_less_dirty(dev, b0, b1, dropped);
        }
    }

    /// Drops a range from the index (journaled) if anything is cached there. Dropping dirty
    /// data is for a range the backing device was just written over: its entry waits for a
    /// flush of that device (see `flush_backing_first`).
    pub fn invalidate(&mut self, dev: DevId, b0: BackingBlock, b1: BackingBlock, now_ns: u64) {
        self.collide(dev, b0, b1);
        if self.index.any_overlapping(dev, b0, b1, |_| true) {
            let drops_dirty = self.index.any_overlapping(dev, b0, b1, |e| e.dirty);
            self.index.remove_range(dev, b0, b1);
            self.log(
                &Entry::Invalidate {
                    dev,
                    block: b0,
                    len: b1 - b0,
                },
                now_ns,
            );
            if drops_dirty {
                self.owe_backing_flush(dev, b0, b1);
            }
        }
    }
}

/// A backing I/O the caller makes itself (see `Backing::io_start`), counted in
/// `Backing::io_in_flight` until dropped.
pub(crate) struct IoUnderWay {
    /// When it was issued (`Backing::io_issued`).
    pub(crate) issued_ns: u64,
    backing: Arc<Backing>,
}

impl Drop for IoUnderWay {
    fn drop(&mut self) {
        self.backing.io_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One attached backing device.
pub struct Backing {
    pub id: DevId,
    pub dev: Arc<dyn BlockDevice>,
    pub(crate) header: Mutex<BackingHeader>,
    /// Bytes served (the device minus its header); grows with `Volume::resize`.
    pub(crate) data_size: AtomicU64,
    pub(crate) mode: AtomicU8,
    pub(crate) sequential_cutoff: AtomicU64,
    pub(crate) writeback_percent: AtomicU64,
    pub(crate) writeback_delay_secs: AtomicU64,
    pub(crate) writeback_running: AtomicBool,
    pub(crate) detaching: AtomicBool,
    /// Requests under way that may put this device's data into the cache (`io::CacheUse`).
    pub(crate) cache_users: AtomicU64,
    /// The volume's policy: stream detection, the device's cost model (fed by every data read
    /// and write the engine sends it, clients' and writeback's; see `cost`), the fills'
    /// measured benefit, the writeback controller (see `policy::VolumePolicy`).
    pub(crate) policy: crate::policy::VolumePolicy,
    pub(crate) counters: Counters,
    pub(crate) history: History,
    /// Something was written to the backing device since its last flush.
    pub(crate) backing_written: AtomicBool,
    /// When this device last went from no dirty data to some (writeback_delay starts there).
    pub(crate) dirty_since_ns: AtomicU64,
    /// When a client request last started or finished an I/O on the backing device
    /// (writeback's own I/O excluded): writeback yields while this is recent.
    pub(crate) client_backing_ns: AtomicU64,
    /// When a request continuing a long sequential stream last started (writeback keeps out
    /// of a busy disk's way while one runs); 0: never.
    pub(crate) client_stream_ns: AtomicU64,
    /// Readahead windows for sequential reads that bypass the cache.
    pub(crate) readahead: Mutex<crate::readahead::ReadAhead>,
    /// Failed flushes of the device so far: writes it was sent before a failed flush may be
    /// lost even if a later flush succeeds (an NBD server that restarted, a disk that
    /// dropped its cache), so whoever needs its writes durable checks this did not move.
    pub(crate) flush_failures: AtomicU64,
    /// Clients' changes sent to the device and not yet covered by a successful flush, and
    /// which failed flushes have been dealt with (`io::lost`).
    pub(crate) unflushed: Mutex<crate::unflushed::Unflushed>,
    /// Losses of acknowledged client writes that the cache could not write again (no copy):
    /// each connection's next flush reports them once (`Volume::losses`).
    pub(crate) losses_reported: AtomicU64,
    pub(crate) writeback_error: Mutex<Option<WritebackError>>,
    /// The clock of the device's completions (`timed`), and the latest completion on it in
    /// ns of that clock: what `cost::service_ns` needs to leave queueing out of the samples.
    pub(crate) io_epoch: std::time::Instant,
    pub(crate) last_done_ns: AtomicU64,
    /// Data I/Os under way on the device (`timed`, `IoUnderWay`): a request sent to it now
    /// waits behind them (see `Volume::cache_congested`).
    pub(crate) io_in_flight: AtomicU64,
    /// Writes between their look at the header's dirty mark and their dirty insert (see
    /// `owner`).
    pub(crate) dirty_writers: AtomicU64,
    /// When the header's dirty amount was last written, and the owner last checked (ns of
    /// `Inner::now_ns`).
    pub(crate) amount_written_ns: AtomicU64,
    pub(crate) owner_checked_ns: AtomicU64,
    /// Another set took the device over: it is given up for good (`owner`), and why.
    pub(crate) lost: AtomicBool,
    pub(crate) lost_why: Mutex<Option<String>>,
}

impl Backing {
    pub fn mode(&self) -> CacheMode {
        CacheMode::from_code(self.mode.load(Ordering::Relaxed)).expect("valid mode code")
    }

    pub fn uuid(&self) -> Uuid {
        self.header.lock().dev_uuid
    }

    pub fn knobs(&self) -> DevKnobs {
        DevKnobs {
            cache_mode: self.mode(),
            sequential_cutoff: self.sequential_cutoff.load(Ordering::Relaxed),
            writeback_percent: self.writeback_percent.load(Ordering::Relaxed) as u32,
            writeback_delay_secs: self.writeback_delay_secs.load(Ordering::Relaxed),
            writeback_running: self.writeback_running.load(Ordering::Relaxed),
            label: self.header.lock().label.clone(),
        }
    }

    /// Applies `change` to the header and writes it (both copies), unless it changes
    /// nothing. The in-memory header changes only once the write succeeded.
    pub(crate) fn update_header(&self, change: impl FnOnce(&mut BackingHeader)) -> Result<()> {
        let mut h = self.header.lock();
        let mut next = h.clone();
        change(&mut next);
        if next != *h {
            self.write_header(&mut next)?;
            *h = next;
        }
        Ok(())
    }

    /// Writes `header` (both copies, then a flush of the device). A failure counts as a
    /// failed flush (`flush_failures`): the device may have lost what it was sent before.
    pub(crate) fn write_header(&self, header: &mut BackingHeader) -> Result<()> {
        header.write(&*self.dev).inspect_err(|_| {
            self.flush_failures.fetch_add(1, Ordering::SeqCst);
        })
    }

    /// Writes the backing device header with the given state if it differs.
    pub(crate) fn set_state(&self, state: BackingState) -> Result<()> {
        self.update_header(|h| h.state = state)
    }

    /// Flushes the backing device whatever it was sent (before a journal record that drops
    /// dirty data superseded by writes to it); on failure it stays marked as written.
    pub(crate) fn flush_now(&self) -> Result<()> {
        self.backing_written.store(false, Ordering::SeqCst);
        let failures = self.flush_failures.load(Ordering::SeqCst);
        let covers = self.unflushed.lock().covers();
        self.flush_counted().map_err(|e| {
            self.backing_written.store(true, Ordering::SeqCst);
            Error::io("flushing backing device", e)
        })?;
        // Covered, unless some flush failed before or meanwhile: then what it may have lost
        // is still to be written again or reported (`io::lost`).
        if self.flush_failures.load(Ordering::SeqCst) == failures {
            self.unflushed.lock().flushed(covers, failures);
        }
        Ok(())
    }

    /// Flushes the device, counting a failure in `flush_failures`.
    /// Runs a data read or write of `len` bytes at absolute `offset` on the device, timing
    /// its service time (`cost::service_ns`) into the cost model (failures are not samples).
    pub(crate) fn timed<T>(
        &self,
        op: crate::cost::Op,
        offset: u64,
        len: u64,
        io: impl FnOnce(&dyn BlockDevice) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        struct Counted<'a>(&'a AtomicU64);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.io_in_flight.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(&self.io_in_flight);
        let issued = self.io_issued();
        let r = io(&*self.dev);
        drop(counted);
        self.io_done(op, offset, len, issued, r.is_ok());
        r
    }

    /// An I/O the caller makes itself starts now: issued now (`io_issued`), and counted in
    /// `io_in_flight` until the returned value is dropped.
    pub(crate) fn io_start(self: &Arc<Self>) -> IoUnderWay {
        self.io_in_flight.fetch_add(1, Ordering::Relaxed);
        IoUnderWay {
            issued_ns: self.io_issued(),
            backing: Arc::clone(self),
        }
    }

    /// When an I/O timed for the cost model is issued (see `timed`; for a caller that makes
    /// the I/O itself, with `io_done` after it).
    pub(crate) fn io_issued(&self) -> u64 {
        self.io_epoch.elapsed().as_nanos() as u64
    }

    /// An I/O issued at `issued` (`io_issued`) is done: its service time is the cost model's
    /// sample if it succeeded. Returns how long it took since it was issued (ns).
    pub(crate) fn io_done(
        &self,
        op: crate::cost::Op,
        offset: u64,
        len: u64,
        issued: u64,
        ok: bool,
    ) -> u64 {
        let done = self.io_issued();
        let prev = self.last_done_ns.fetch_max(done, Ordering::Relaxed);
        if ok {
            let ns = crate::cost::service_ns(issued, done, prev);
            self.policy.observe_io(op, offset, len, ns);
        }
        done.saturating_sub(issued)
    }

    /// The current read and write estimates of the device's cost model.
    pub fn cost(&self) -> DevCost {
        self.policy.cost()
    }

    pub(crate) fn flush_counted(&self) -> std::io::Result<()> {
        self.dev.flush().inspect_err(|_| {
            self.flush_failures.fetch_add(1, Ordering::SeqCst);
        })
    }

    /// Notes how a writeback pass over this device ended.
    pub(crate) fn writeback_result(&self, r: &Result<()>) {
        let mut w = self.writeback_error.lock();
        match r {
            Ok(()) => *w = None,
            Err(e) => {
                let failures = w.as_ref().map_or(0, |w| w.failures) + 1;
                let since_unix = w
                    .as_ref()
                    .map_or_else(crate::clock::unix_now, |w| w.since_unix);
                *w = Some(WritebackError {
                    error: e.to_string(),
                    since_unix,
                    failures,
                });
            }
        }
    }

    /// Flushes the backing device if anything was written to it since its last flush (the
    /// deferred flush); on failure the device stays marked as written.
    pub(crate) fn flush_if_written(&self) -> Result<()> {
        if self.backing_written.load(Ordering::SeqCst) {
            self.flush_now()?;
        }
        Ok(())
    }
}

pub(crate) struct Inner {
    /// Every I/O to the cache device goes through this (timing, failures; see `cachedev`).
    pub cache: Arc<crate::cachedev::CacheDev>,
    pub layout: Layout,
    pub sb: Mutex<Superblock>,
    pub state: Mutex<State>,
    /// The pin counts of `state.buckets`, shared so readers drop pins without the lock.
    pub pins: crate::alloc::Pins,
    /// Lock-free readers of `state.index` and the uses they record (see `slots`).
    pub index_reader: crate::slots::IndexReader,
    pub touches: crate::policy::Touches,
    pub commit_lock: Mutex<()>,
    /// Held by the one GC round at a time (see `space`): a round can then always finish
    /// moving a bucket into the reserve clients leave it. Lock order: before range locks
    /// (a round from a client's write only try-locks them) and the state lock.
    pub gc_lock: Mutex<()>,
    /// Group commit (`commit_to`): whether a leader is committing for the waiters, and the
    /// condition they wait on. std's, whose `notify_all` wakes every waiter at once. Lock
    /// order: `group` before `state`; it is never held while `commit_lock` is taken.
    pub group: (std::sync::Mutex<bool>, std::sync::Condvar),
    /// Serializes checkpoints. Lock order: `ckpt_lock` before `commit_lock`; a committer that
    /// holds `commit_lock` only ever try-locks it, or waits for it with `commit_lock` released.
    pub ckpt_lock: Mutex<()>,
    pub ranges: RangeLocks,
    pub backings: RwLock<HashMap<DevId, Arc<Backing>>>,
    pub config: Config,
    pub failed: Mutex<Option<String>>,
    /// Set (after `failed`) once the set has failed: requests check it without the lock.
    pub is_failed: AtomicBool,
    pub stop: AtomicBool,
    pub wake: (Mutex<()>, Condvar),
    /// Signalled (with `state`) whenever a promotion leaves `State::promotions`.
    pub promoted: Condvar,
    pub tick: AtomicU64,
    pub reserve_buckets: usize,
    pub health: crate::degraded::Health,
    /// The policy state the volumes share (the admission history): each volume's policy
    /// holds it too.
    pub policy: Arc<crate::policy::SetPolicy>,
}

/// A snapshot of one backing device's status.
#[derive(Clone, Debug)]
pub struct DevStatus {
    pub id: DevId,
    pub uuid: Uuid,
    pub knobs: DevKnobs,
    pub size_bytes: u64,
    pub dirty_bytes: u64,
    pub cached_bytes: u64,
    pub state: &'static str,
    /// How hard writeback works on the device right now (bcache's writeback_rate).
    pub writeback: crate::policy::WritebackRate,
    /// The rate controller behind it: target, error, proportional and integral terms.
    pub writeback_control: crate::policy::WritebackDecision,
    /// The controller's target in bytes (`writeback_percent` of the cache).
    pub writeback_target_bytes: u64,
    /// The last writeback failure on this device while it keeps failing (the dirty data
    /// stays dirty and is retried with backoff): what failed, since when (Unix seconds), and
    /// how many passes failed in a row.
    pub writeback_error: Option<WritebackError>,
    pub stats: Windows,
    /// The backing device's cost model now (see `cost`).
    pub cost: DevCost,
    /// The share of blocks brought in by miss fills that were read later (see `fillhits`);
    /// None until enough fills are resolved.
    pub fill_read_share: Option<f64>,
    /// The connections of a remote (NBD) backing device now; None for a local one.
    pub backing_links: Option<blockdev::NbdLinks>,
}

/// A writeback that keeps failing on one backing device (see `DevStatus::writeback_error`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WritebackError {
    pub error: String,
    pub since_unix: u64,
    pub failures: u32,
}

impl Inner {
    pub fn now_ns(&self) -> u64 {
        self.config.clock.now_ns()
    }

    pub fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The bucket holding cache block `cb` (no lock needed: the layout is fixed).
    pub fn bucket_of(&self, cb: CacheBlock) -> Bucket {
        cb.bucket(self.layout.blocks_per_bucket())
    }

    /// Drops a pin on bucket `b` without the state lock, taking it only to free a retired
    /// bucket on its last unpin (see the pin protocol in `alloc`). Call without holding the
    /// state lock.
    pub fn unpin(&self, b: Bucket) {
        if self.pins.unpin(b) {
            let mut st = self.state.lock();
            let durable = st.journal.durable_epoch;
            st.buckets.free_unpinned(b, durable);
        }
    }

    pub fn check_failed(&self) -> Result<()> {
        if !self.is_failed.load(Ordering::Acquire) {
            return Ok(());
        }
        match &*self.failed.lock() {
            Some(why) => Err(Error::State(why.clone())),
            None => Ok(()),
        }
    }

    pub(crate) fn fail(&self, why: &Error) {
        let mut f = self.failed.lock();
        if f.is_none() {
            log::error!("cache set failed: {why}");
            *f = Some(format!("cache set failed: {why}; reopen it to recover"));
            self.is_failed.store(true, Ordering::Release);
        }
    }

    pub fn block_size(&self) -> u64 {
        u64::from(self.layout.block_size)
    }

    pub fn wake_background(&self) {
        self.wake.1.notify_all();
    }
}

/// The data size a backing device of its current size has room for, if more than `old`
/// (else `old`: a device never shrinks under its data).
pub(crate) fn grown_data_size(dev: &dyn BlockDevice, old: u64) -> Result<u64> {
    let size = dev
        .refresh_size()
        .ctx(|| "reading the backing device's size".into())?;
    Ok(((size.saturating_sub(BACKING_DATA_OFFSET)) / 512 * 512).max(old))
}
