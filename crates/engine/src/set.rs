//! The cache set: formatting, opening (recovery), attaching and detaching backing devices,
//! and shutdown; the shared state (`Inner`, `State`). Commits and checkpoints live in
//! `commit`, the request paths in `io`, space management in `space`, writeback in
//! `writeback`, the threads in `background`.
//!
//! Invariants:
//! - `State` (index, buckets, pending journal entries) is changed only under its mutex, and
//!   every index change appends the matching journal entry in the same critical section, so
//!   replaying the journal in order reproduces the in-memory index exactly;
//! - commits are serialized by `commit_lock` and checkpoints by `ckpt_lock` (see `commit`);
//! - group commit (`commit_to`, in `commit`): a flush whose entries are durable already returns
//!   without a commit; otherwise one flusher at a time commits for all (the leader) while the
//!   others wait on a condition variable, so a flusher waits for at most the record being
//!   written when it arrived and one more, which covers it;
//! - a backing device's header says `Dirty` before any dirty entry for it can be durable, and
//!   says `Clean` only when the set holds no dirty data for it;
//! - an entry that drops dirty data (superseded by a write that went to the backing device)
//!   is written to the journal or a checkpoint only after that backing device was flushed
//!   (`JournalState::flush_backing_first`): the drop may happen in memory at once, its record
//!   waits for the data that replaced it, and one flush per commit covers many writes;
//! - after a metadata write fails the set is *failed*: every request gets an error (never
//!   stale data) until it is reopened, which runs recovery.

use crate::alloc::Buckets;
use crate::checkpoint::{self, Loaded};
use crate::clock::{Clock, SystemClock};
use crate::codec::Writer;
use crate::format::{
    detect_signature, BackingHeader, BackingState, Layout, StaleCopies, Superblock,
    BACKING_DATA_OFFSET, DEFAULT_BLOCK_SIZE, DEFAULT_BUCKET_SIZE, MAX_DEVS,
};
use crate::index::Index;
use crate::journal::{Entry, Ring};
use crate::knobs::Tunables;
use crate::policy::SeqDetector;
use crate::rangelock::RangeLocks;
use crate::stats::{Counters, History, Snapshot, Windows};
use crate::types::{CacheMode, DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, Bucket, CacheBlock, Gen};
use blockdev::BlockDevice;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use uuid::Uuid;

/// How long stopping waits for a background thread of a degraded set (one may be stuck in an
/// I/O of a hung cache device).
const STOP_WAIT_HUNG: std::time::Duration = std::time::Duration::from_secs(2);

/// Options for formatting a cache device.
#[derive(Clone, Debug)]
pub struct FormatOptions {
    pub block_size: u32,
    pub bucket_size: u32,
    pub label: String,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            bucket_size: DEFAULT_BUCKET_SIZE,
            label: String::new(),
        }
    }
}

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
}

impl Default for Config {
    fn default() -> Self {
        Config {
            background: true,
            gc_live_pct: 50,
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
    pub writeback: crate::writeback::WritebackPool,
    /// While degraded: what entries that may not be durable touched (see `health`).
    pub uncertain: Option<crate::health::Uncertain>,
    /// Recent read misses, for the admission filter.
    pub ghost: crate::admit::Ghost,
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
    pub(crate) seq: Mutex<SeqDetector>,
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
    pub(crate) writeback_error: Mutex<Option<WritebackError>>,
    /// The device's cost model, fed by every data read and write the engine sends it
    /// (clients' and writeback's; see `cost`). A leaf lock: nothing is locked under it.
    pub(crate) cost: Mutex<crate::cost::CostModel>,
    /// The clock of the device's completions (`timed`), and the latest completion on it in
    /// ns of that clock: what `cost::service_ns` needs to leave queueing out of the samples.
    io_epoch: std::time::Instant,
    last_done_ns: AtomicU64,
    /// Read misses so far (the miss fill's exploration alternates on it).
    pub(crate) misses: AtomicU64,
    /// How many of the blocks miss fills brought in were read later (the fill's benefit).
    pub(crate) fill_hits: crate::fillhits::FillHits,
    /// The writeback rate controller (see `policy::WritebackPi`): stepped by writeback
    /// passes, read by status. A leaf lock.
    pub(crate) writeback_pi: Mutex<crate::policy::WritebackPi>,
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
            next.write(&*self.dev)?;
            *h = next;
        }
        Ok(())
    }

    /// Writes the backing device header with the given state if it differs.
    pub(crate) fn set_state(&self, state: BackingState) -> Result<()> {
        self.update_header(|h| h.state = state)
    }

    /// Flushes the backing device whatever it was sent (before a journal record that drops
    /// dirty data superseded by writes to it); on failure it stays marked as written.
    pub(crate) fn flush_now(&self) -> Result<()> {
        self.backing_written.store(false, Ordering::SeqCst);
        self.flush_counted().map_err(|e| {
            self.backing_written.store(true, Ordering::SeqCst);
            Error::io("flushing backing device", e)
        })
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
        let at = || self.io_epoch.elapsed().as_nanos() as u64;
        let issued = at();
        let r = io(&*self.dev);
        let done = at();
        let prev = self.last_done_ns.fetch_max(done, Ordering::Relaxed);
        if r.is_ok() {
            let ns = crate::cost::service_ns(issued, done, prev);
            self.cost.lock().observe(op, offset, len, ns);
        }
        r
    }

    /// The current read and write estimates of the device's cost model.
    pub fn cost(&self) -> DevCost {
        let m = self.cost.lock();
        DevCost {
            read: m.estimate(crate::cost::Op::Read),
            write: m.estimate(crate::cost::Op::Write),
        }
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
                    .map_or_else(crate::health::unix_now, |w| w.since_unix);
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
    pub touches: crate::alloc::Touches,
    pub commit_lock: Mutex<()>,
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
    pub health: crate::health::Health,
}

/// An open cache set. Dropping it without [`CacheSet::close`] is like a crash: nothing more is
/// written, and the next open recovers from the journal.
pub struct CacheSet {
    pub(crate) inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// What open found and how long recovery took.
#[derive(Clone, Debug)]
pub struct RecoveryReport {
    pub notes: Vec<String>,
    pub records_replayed: usize,
    pub entries_replayed: usize,
    pub cached_blocks: u64,
    pub dirty_blocks: u64,
    pub duration_ms: u64,
}

/// Occupancy of the cache device, like bcache's priority_stats.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub total_bytes: u64,
    pub unused_bytes: u64,
    pub clean_bytes: u64,
    pub dirty_bytes: u64,
    pub metadata_bytes: u64,
    /// Percentage of data buckets holding something (bcache's in_use).
    pub in_use_pct: u32,
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
}

/// A device's cost model estimates, for status.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DevCost {
    pub read: crate::cost::CostEstimate,
    pub write: crate::cost::CostEstimate,
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

/// Checks everything [`format_backing`] checks, writing nothing: the label, the device's
/// signatures (unless `force`), and its size (at least one block after the header; with a
/// cache of `block_size` blocks, at most [`crate::index::BLOCK_LIMIT`] of them). `make`
/// checks every device this way before it writes to any.
pub fn check_format_backing(
    dev: &dyn BlockDevice,
    label: &str,
    force: bool,
    block_size: u64,
) -> Result<()> {
    if !label.is_empty() {
        crate::knobs::validate_label(label)?;
    }
    refuse_if_signed(dev, force)?;
    if dev.size_bytes() < BACKING_DATA_OFFSET + 4096 {
        return Err(Error::Invalid(format!(
            "backing device of {} bytes is too small (needs at least {} bytes)",
            dev.size_bytes(),
            BACKING_DATA_OFFSET + 4096
        )));
    }
    check_backing_fits(dev.size_bytes() - BACKING_DATA_OFFSET, block_size)
}

/// A backing device of `data_size` bytes fits a cache of `block_size` blocks.
fn check_backing_fits(data_size: u64, block_size: u64) -> Result<()> {
    if data_size.div_ceil(block_size.max(1)) > crate::index::BLOCK_LIMIT {
        return Err(Error::Invalid(format!(
            "backing device of {data_size} bytes is too big for this cache: at most {} blocks of {block_size} bytes",
            crate::index::BLOCK_LIMIT,
        )));
    }
    Ok(())
}

/// Writes a fresh backing device header (the device is not yet part of any cache set).
pub fn format_backing(
    dev: &dyn BlockDevice,
    label: &str,
    mode: CacheMode,
    force: bool,
) -> Result<BackingHeader> {
    check_format_backing(dev, label, force, 512)?;
    let mut h = BackingHeader {
        seq: 0,
        dev_uuid: Uuid::new_v4(),
        set_uuid: Uuid::nil(),
        data_offset: BACKING_DATA_OFFSET,
        data_size: (dev.size_bytes() - BACKING_DATA_OFFSET) / 512 * 512,
        mode,
        state: BackingState::Clean,
        label: label.to_string(),
        tunables: Tunables::default(),
        stale: StaleCopies::None,
    };
    h.write(dev)?;
    Ok(h)
}

fn refuse_if_signed(dev: &dyn BlockDevice, force: bool) -> Result<()> {
    if force {
        return Ok(());
    }
    match detect_signature(dev)? {
        Some(what) => Err(Error::State(format!(
            "device already holds a {what} signature; use --force to overwrite it"
        ))),
        None => Ok(()),
    }
}

/// A backing device the set knows but has not attached ([`CacheSet::missing`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingVolume {
    pub uuid: Uuid,
    /// Bytes the cache holds for it.
    pub cached_bytes: u64,
    /// Of which dirty: written by its clients, not yet on the device.
    pub dirty_bytes: u64,
}

impl CacheSet {
    /// Checks everything [`CacheSet::format`] checks, writing nothing: the layout the options
    /// give on this device, and its signatures (unless `force`).
    pub fn check_format(
        cache: &dyn BlockDevice,
        opts: &FormatOptions,
        force: bool,
    ) -> Result<Layout> {
        let layout = Layout::compute(cache.size_bytes(), opts.block_size, opts.bucket_size)?;
        if !opts.label.is_empty() {
            crate::knobs::validate_label(&opts.label)?;
        }
        refuse_if_signed(cache, force)?;
        Ok(layout)
    }

    /// Formats a cache device: superblocks, an empty checkpoint, an empty journal.
    pub fn format(cache: &dyn BlockDevice, opts: &FormatOptions, force: bool) -> Result<Uuid> {
        let layout = Self::check_format(cache, opts, force)?;
        let set_uuid = Uuid::new_v4();
        let sb = Superblock {
            seq: 1,
            set_uuid,
            dev_uuid: Uuid::new_v4(),
            layout: layout.clone(),
            ckpt_slot: 0,
            ckpt_seq: 1,
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            label: opts.label.clone(),
        };
        let ring = Ring {
            len: layout.journal_len,
            head: 0,
            used: 0,
            next_seq: 1,
        };
        let gens = vec![Gen(0); layout.nbuckets as usize];
        let image = checkpoint::encode_header(
            1,
            &checkpoint::Header {
                journal_pos: ring.head,
                journal_seq: ring.next_seq,
                devs: &BTreeMap::new(),
                gens: &gens,
                chunks: 0,
                body_bytes: 0,
            },
        );
        // Wipe the old journal's first block and the other checkpoint slot so nothing from a
        // previous format can be mistaken for ours.
        let zero = vec![0u8; 4096];
        cache
            .write_at(&zero, layout.journal_off)
            .ctx(|| "clearing journal".into())?;
        cache
            .write_at(&zero, layout.ckpt_offsets[1])
            .ctx(|| "clearing checkpoint slot".into())?;
        cache
            .write_at(&image, layout.ckpt_offsets[0])
            .ctx(|| "writing checkpoint".into())?;
        cache.flush().ctx(|| "flushing cache device".into())?;
        sb.write(cache)?;
        Ok(set_uuid)
    }

    /// Opens a formatted cache device, recovering its state from checkpoint and journal.
    pub fn open(cache: Arc<dyn BlockDevice>, config: Config) -> Result<(CacheSet, RecoveryReport)> {
        let started = Instant::now();
        let Loaded {
            sb,
            index,
            gens,
            devs,
            ring,
            notes,
            records_replayed,
            entries_replayed,
            dropped_record,
        } = checkpoint::load(&*cache)?;
        let mut notes = notes;
        if let Some(d) = &dropped_record {
            notes.push(d.what());
        }
        if let Some(d) = dropped_record {
            // Erase the dropped record (the first block of both copies) so a new record with
            // its sequence can never be mistaken for it; see `journal::replay`.
            let zero = vec![0u8; crate::format::META_BLOCK as usize];
            for at in [d.pos, d.pos + d.copy_len] {
                cache
                    .write_at(&zero, sb.layout.journal_off + at)
                    .ctx(|| "erasing a dropped journal record".into())?;
            }
            cache.flush().ctx(|| "flushing cache device".into())?;
        }
        let layout = sb.layout.clone();
        let mut buckets = Buckets::new(gens, &index.bucket_live, layout.blocks_per_bucket());
        buckets.set_replacement(config.replacement);
        let report = RecoveryReport {
            notes,
            records_replayed,
            entries_replayed,
            cached_blocks: index.live_blocks,
            dirty_blocks: index.dirty_blocks,
            duration_ms: started.elapsed().as_millis() as u64,
        };
        let reserve_buckets = (layout.nbuckets as usize / 32).clamp(2, 64);
        let state = State {
            index,
            buckets,
            journal: JournalState {
                buf: Writer::default(),
                appended_epoch: 0,
                durable_epoch: 0,
                oldest_pending_ns: None,
                ring,
                ckpt_slot: sb.ckpt_slot,
                ckpt_seq: sb.ckpt_seq,
                flush_backing_first: BTreeMap::new(),
                less_dirty: Vec::new(),
                dirty_insert_epoch: BTreeMap::new(),
            },
            devs,
            promotions: HashMap::new(),
            next_promotion: 0,
            writeback: Default::default(),
            uncertain: None,
            ghost: crate::admit::Ghost::new(
                u64::from(layout.nbuckets) * u64::from(layout.blocks_per_bucket()),
            ),
        };
        let pins = state.buckets.pins();
        let index_reader = state.index.reader();
        let touches = state.buckets.touches();
        let cache = Arc::new(crate::cachedev::CacheDev::new(
            cache,
            std::time::Duration::from_millis(config.cache_io_timeout_ms),
            config.io_error_halflife,
        ));
        let inner = Arc::new(Inner {
            cache,
            layout,
            sb: Mutex::new(sb),
            state: Mutex::new(state),
            pins,
            index_reader,
            touches,
            commit_lock: Mutex::new(()),
            group: (std::sync::Mutex::new(false), std::sync::Condvar::new()),
            ckpt_lock: Mutex::new(()),
            ranges: RangeLocks::default(),
            backings: RwLock::new(HashMap::new()),
            config,
            failed: Mutex::new(None),
            is_failed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
            promoted: Condvar::new(),
            tick: AtomicU64::new(0),
            reserve_buckets,
            health: Default::default(),
        });
        log::info!(
            "cache set {} recovered in {} ms: {} records, {} entries replayed, {} blocks cached ({} dirty)",
            inner.sb.lock().set_uuid,
            report.duration_ms,
            report.records_replayed,
            report.entries_replayed,
            report.cached_blocks,
            report.dirty_blocks
        );
        let set = CacheSet {
            inner,
            threads: Mutex::new(Vec::new()),
        };
        if set.inner.config.background {
            set.start_background();
        }
        Ok((set, report))
    }

    pub fn set_uuid(&self) -> Uuid {
        self.inner.sb.lock().set_uuid
    }

    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    pub fn superblock(&self) -> Superblock {
        self.inner.sb.lock().clone()
    }

    /// Attaches a backing device (formatted with [`format_backing`]) and returns its volume.
    pub fn attach(&self, dev: Arc<dyn BlockDevice>) -> Result<crate::Volume> {
        crate::guard::contain(&self.inner, "attach", || self.attach_unguarded(dev))
    }

    fn attach_unguarded(&self, dev: Arc<dyn BlockDevice>) -> Result<crate::Volume> {
        let inner = &self.inner;
        inner.check_failed()?;
        if inner.is_degraded() {
            return Err(Error::State(
                "the cache set is degraded: re-admit the repaired cache device before attaching"
                    .into(),
            ));
        }
        let (mut header, notes) = BackingHeader::read(&*dev)?;
        for n in notes {
            log::warn!("{n}");
        }
        // A device that grew while it was not served is picked up now.
        let grown = grown_data_size(&*dev, header.data_size)?;
        if grown > header.data_size {
            log::info!(
                "backing device {} grew from {} to {} data bytes",
                header.dev_uuid,
                header.data_size,
                grown
            );
            header.data_size = grown;
            header.write(&*dev)?;
        }
        let set_uuid = self.set_uuid();
        check_backing_fits(header.data_size, inner.block_size())?;
        if inner
            .backings
            .read()
            .values()
            .any(|b| b.uuid() == header.dev_uuid)
        {
            return Err(Error::State(format!(
                "backing device {} is already attached",
                header.dev_uuid
            )));
        }
        let known = {
            let st = inner.state.lock();
            st.devs
                .iter()
                .find(|(_, u)| **u == header.dev_uuid)
                .map(|(d, _)| *d)
        };
        let id = match known {
            Some(id) if header.set_uuid == set_uuid => {
                if header.stale != StaleCopies::None {
                    inner.forget_stale_copies(id, header.stale)?;
                    let dirty = inner.state.lock().index.dev_dirty_blocks(id) > 0;
                    header.stale = StaleCopies::None;
                    if !dirty {
                        header.state = BackingState::Clean;
                    }
                    header.write(&*dev)?;
                }
                id
            }
            _ => {
                if header.set_uuid == set_uuid && header.state == BackingState::Dirty {
                    return Err(Error::State(format!(
                        "backing device {} is marked dirty for this cache set, but the cache holds no record of it; its dirty data is lost",
                        header.dev_uuid
                    )));
                }
                if !header.set_uuid.is_nil() && header.set_uuid != set_uuid {
                    return Err(Error::State(format!(
                        "backing device {} belongs to cache set {}; detach it there first",
                        header.dev_uuid, header.set_uuid
                    )));
                }
                let mut drop_all = None;
                let id = {
                    let mut st = inner.state.lock();
                    // Known to the set but its header names no set: an attach stopped (a
                    // crash) between the AttachDev commit and the header write, so nothing was
                    // ever cached for it. It joins under that id again: a second id for the
                    // same uuid would leave `known` finding the stale one after the next
                    // restart, hiding everything cached under the new one.
                    let id = match known {
                        // Whatever the set still holds for it is stale (the device may have
                        // been served elsewhere since); normally there is nothing.
                        Some(id) => {
                            if st.index.dev_live_blocks(id) > 0 {
                                drop_all = Some(id);
                            }
                            id
                        }
                        None => (0..MAX_DEVS as u32)
                            .map(DevId)
                            .find(|d| !st.devs.contains_key(d))
                            .ok_or_else(|| {
                                Error::State("too many backing devices in this cache set".into())
                            })?,
                    };
                    st.devs.insert(id, header.dev_uuid);
                    let now = inner.now_ns();
                    st.log(
                        &Entry::AttachDev {
                            dev: id,
                            uuid: header.dev_uuid,
                        },
                        now,
                    );
                    id
                };
                if let Some(id) = drop_all {
                    inner.forget_stale_copies(id, StaleCopies::All)?;
                }
                let mut c = inner.commit_lock.lock();
                inner.commit_locked(&mut c)?;
                header.set_uuid = set_uuid;
                header.state = BackingState::Clean;
                header.stale = StaleCopies::None;
                header.write(&*dev)?;
                id
            }
        };
        let dirty = inner.state.lock().index.dev_dirty_blocks(id);
        let t = header.tunables;
        let dev_rotational = dev.is_rotational();
        let backing = Arc::new(Backing {
            id,
            data_size: AtomicU64::new(header.data_size),
            mode: AtomicU8::new(header.mode.code()),
            dev,
            header: Mutex::new(header),
            sequential_cutoff: AtomicU64::new(t.sequential_cutoff),
            writeback_percent: AtomicU64::new(u64::from(t.writeback_percent)),
            writeback_delay_secs: AtomicU64::new(t.writeback_delay_secs),
            writeback_running: AtomicBool::new(t.writeback_running),
            detaching: AtomicBool::new(false),
            cache_users: AtomicU64::new(0),
            seq: Mutex::new(SeqDetector::default()),
            counters: Counters::default(),
            history: History::default(),
            backing_written: AtomicBool::new(false),
            dirty_since_ns: AtomicU64::new(inner.now_ns()),
            client_backing_ns: AtomicU64::new(0),
            client_stream_ns: AtomicU64::new(0),
            readahead: Mutex::default(),
            flush_failures: AtomicU64::new(0),
            writeback_error: Mutex::new(None),
            cost: Mutex::new(crate::cost::CostModel::new(dev_rotational)),
            io_epoch: std::time::Instant::now(),
            last_done_ns: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            fill_hits: crate::fillhits::FillHits::default(),
            writeback_pi: Mutex::new(crate::policy::WritebackPi::default()),
        });
        if dirty > 0 {
            backing.set_state(BackingState::Dirty)?;
        }
        inner.backings.write().insert(id, backing.clone());
        Ok(crate::Volume {
            inner: inner.clone(),
            backing,
        })
    }

    /// The backing devices this set knows (it may hold their data) that are not attached
    /// now: left out of a `serve`, or not reachable yet. A missing device with dirty data has
    /// its newest data only here.
    pub fn missing(&self) -> Vec<MissingVolume> {
        let attached: Vec<DevId> = self.inner.backings.read().keys().copied().collect();
        let st = self.inner.state.lock();
        let bs = self.inner.block_size();
        st.devs
            .iter()
            .filter(|(d, _)| !attached.contains(d))
            .map(|(d, uuid)| MissingVolume {
                uuid: *uuid,
                cached_bytes: st.index.dev_live_blocks(*d) * bs,
                dirty_bytes: st.index.dev_dirty_blocks(*d) * bs,
            })
            .collect()
    }

    /// The volumes currently attached.
    pub fn volumes(&self) -> Vec<crate::Volume> {
        let mut v: Vec<_> = self
            .inner
            .backings
            .read()
            .values()
            .map(|b| crate::Volume {
                inner: self.inner.clone(),
                backing: b.clone(),
            })
            .collect();
        v.sort_by_key(|v| v.backing.id);
        v
    }

    /// Writes back every dirty block of the volume (reporting `(remaining, total)` dirty bytes
    /// as it goes), then removes it from the set and marks its header detached and clean.
    pub fn detach(&self, vol: &crate::Volume, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        crate::guard::contain(&self.inner, "detach", || {
            self.detach_unguarded(vol, progress)
        })
    }

    fn detach_unguarded(
        &self,
        vol: &crate::Volume,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let inner = &self.inner;
        let b = &vol.backing;
        if inner.is_degraded() {
            return Err(Error::State(
                "the cache set is degraded: re-admit the repaired cache device before detaching (its dirty data and records are on it)".into(),
            ));
        }
        b.detaching.store(true, Ordering::SeqCst);
        // Requests that decided to use the cache before they could see `detaching` finish
        // first: a write that chose writeback would otherwise add dirty data after the drain.
        while b.cache_users.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let res = (|| {
            crate::writeback::drain_dirty(inner, b.id, progress)?;
            vol.flush()?;
            // Clean before the DetachDev record can be durable: a crash between that record
            // and the header write below would otherwise leave a header saying dirty for a set
            // with no record of the device, which attach refuses (its data is all written
            // back). Writes bypass the cache while detaching, so nothing makes it dirty again.
            b.set_state(BackingState::Clean)?;
            {
                let mut st = inner.state.lock();
                let now = inner.now_ns();
                st.invalidate(b.id, BackingBlock(0), crate::index::BLOCK_END, now);
                st.devs.remove(&b.id);
                st.log(&Entry::DetachDev { dev: b.id }, now);
            }
            {
                let mut c = inner.commit_lock.lock();
                inner.commit_locked(&mut c)?;
            }
            b.update_header(|h| {
                h.set_uuid = Uuid::nil();
                h.state = BackingState::Clean;
            })
        })();
        if res.is_err() {
            b.detaching.store(false, Ordering::SeqCst);
            return res;
        }
        inner.backings.write().remove(&b.id);
        Ok(())
    }

    /// The cache device's health: degraded or not (why, since when), failures, latency.
    pub fn health(&self) -> crate::health::HealthReport {
        self.inner.health_report()
    }

    /// Re-admits a repaired cache device to a degraded set (see `health`): its clean copies
    /// are dropped, what the set holds is checkpointed, and volumes are served through the
    /// cache again. Fails, and the set stays degraded, if the device still fails.
    pub fn readmit(&self) -> Result<()> {
        crate::guard::contain(&self.inner, "readmit", || self.inner.readmit())
    }

    /// Degrades the set by hand (an operator who distrusts the cache device; tests).
    pub fn degrade(&self, reason: &str) {
        self.inner.degrade(format!("by request: {reason}"));
    }

    /// Cache device occupancy.
    pub fn occupancy(&self) -> Occupancy {
        let l = &self.inner.layout;
        let st = self.inner.state.lock();
        let bs = u64::from(l.block_size);
        let data = u64::from(l.nbuckets) * u64::from(l.bucket_size);
        let used_buckets = st.buckets.in_use_count();
        Occupancy {
            total_bytes: l.device_size,
            dirty_bytes: st.index.dirty_blocks * bs,
            clean_bytes: (st.index.live_blocks - st.index.dirty_blocks) * bs,
            unused_bytes: data - st.index.live_blocks * bs,
            metadata_bytes: l.device_size - data,
            in_use_pct: (used_buckets * 100 / l.nbuckets as usize) as u32,
        }
    }

    /// Which read misses a full cache admits, and which clean buckets it gives up.
    pub fn policies(&self) -> (crate::policy::Admission, crate::policy::Replacement) {
        (self.inner.config.admission, self.inner.config.replacement)
    }

    /// Counters summed over every attached device.
    pub fn totals(&self) -> Snapshot {
        self.volumes().iter().fold(Snapshot::default(), |acc, v| {
            acc.plus(&v.backing.counters.snapshot())
        })
    }

    /// Cached blocks and the heap bytes of the index and bucket tables (for reports).
    pub fn index_memory(&self) -> (usize, u64) {
        let st = self.inner.state.lock();
        (
            st.index.entry_count(),
            st.index.heap_bytes() + st.buckets.heap_bytes() + st.ghost.heap_bytes(),
        )
    }

    /// Makes everything durable, writes a checkpoint, marks clean backing devices clean, and
    /// stops background threads. Dirty data stays in the cache (it is safe there). Requests
    /// made after this get an error.
    pub fn close(&self) -> Result<()> {
        self.stop_background();
        let inner = &self.inner;
        inner.check_failed()?;
        if inner.is_degraded() {
            // Nothing more can be written to the cache device; what it holds durably is
            // consistent (see `health`), and the backing headers say their clean copies
            // are stale. The backing devices get the flush a normal close gives them.
            let mut res = Ok(());
            for b in inner.backings.read().values() {
                if !inner.degraded_flush_ok(b.id) {
                    log::warn!(
                        "backing device {}: writes acknowledged since its last successful flush that only the failed cache device recorded are lost (a restart serves the last flushed state there)",
                        b.id.0
                    );
                }
                res = res.and(b.flush_if_written());
            }
            *inner.failed.lock() = Some("the cache set was closed".into());
            inner.is_failed.store(true, Ordering::Release);
            return res;
        }
        for b in inner.backings.read().values() {
            b.flush_if_written()?;
        }
        inner.checkpoint_now(&mut || {})?;
        for b in inner.backings.read().values() {
            let dirty = inner.state.lock().index.dev_dirty_blocks(b.id);
            b.set_state(if dirty > 0 {
                BackingState::Dirty
            } else {
                BackingState::Clean
            })?;
        }
        *inner.failed.lock() = Some("the cache set was closed".into());
        inner.is_failed.store(true, Ordering::Release);
        Ok(())
    }

    fn start_background(&self) {
        let mut threads = self.threads.lock();
        for (name, f) in [
            (
                "tc-writeback",
                crate::background::writeback_thread as fn(&Arc<Inner>),
            ),
            (
                "tc-maint",
                crate::background::maintenance_thread as fn(&Arc<Inner>),
            ),
            (
                "tc-watchdog",
                crate::background::watchdog_thread as fn(&Arc<Inner>),
            ),
        ] {
            let inner = self.inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(name.into())
                    .spawn(move || f(&inner))
                    .expect("spawning a background thread"),
            );
        }
    }

    /// Stops the background threads. A thread stuck in an I/O of a hung cache device (the
    /// set is degraded then) is left behind after `STOP_WAIT_HUNG` rather than waited for.
    fn stop_background(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.wake_background();
        let started = Instant::now();
        for t in self.threads.lock().drain(..) {
            while !t.is_finished()
                && (started.elapsed() < STOP_WAIT_HUNG || !self.inner.is_degraded())
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                log::warn!("a background thread is stuck in a cache device I/O; leaving it behind");
            }
        }
    }

    /// Runs one writeback batch now (tests and tools); returns blocks written back.
    pub fn writeback_step(&self, force: bool) -> Result<u64> {
        crate::writeback::writeback_batch(&self.inner, force, None)
    }

    /// Runs one round of space management (reclaim / GC) now; returns buckets freed.
    pub fn maintenance_step(&self) -> Result<usize> {
        crate::space::make_space(&self.inner, self.inner.reserve_buckets)
    }

    /// Commits pending journal entries now.
    pub fn commit(&self) -> Result<()> {
        let mut c = self.inner.commit_lock.lock();
        self.inner.commit_locked(&mut c)
    }

    /// Writes a checkpoint now.
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint_now(&mut || {})
    }

    /// Writes a checkpoint, calling `between` after each chunk with no engine lock held
    /// (tests interleave requests with checkpoints through it; see `Config::checkpoint_chunk_bytes`).
    pub fn checkpoint_interleaved(&self, between: &mut dyn FnMut()) -> Result<()> {
        self.inner.checkpoint_now(between)
    }

    /// Verifies the in-memory index invariants (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let st = self.inner.state.lock();
        st.index.check_invariants()?;
        st.buckets.check_invariants()
    }
}

impl Drop for CacheSet {
    fn drop(&mut self) {
        self.stop_background();
    }
}
