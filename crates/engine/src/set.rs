//! The cache set's lifecycle: formatting, opening (recovery), attaching and detaching backing
//! devices, and shutdown. The shared state it builds (`Inner`, `State`, `Backing`) is in
//! `state`; commits and checkpoints live in `commit`, the request paths in `io`, space
//! management in `space`, writeback in `writeback`, the threads in `background`.
//!
//! Invariants:
//! - commits are serialized by `commit_lock` and checkpoints by `ckpt_lock` (see `commit`);
//! - group commit (`commit_to`, in `commit`): a flush whose entries are durable already returns
//!   without a commit; otherwise one flusher at a time commits for all (the leader) while the
//!   others wait on a condition variable, so a flusher waits for at most the record being
//!   written when it arrived and one more, which covers it;
//! - a backing device's header says `Dirty` before any dirty entry for it can be durable, and
//!   says `Clean` only when the set holds no dirty data for it;
//! - a backing device is attached under the id the set knows it by (a device known to the set
//!   never gets a second id), and one the set holds data for that is not attached is
//!   `missing` (dirty data of a missing device is never evicted);
//! - after a metadata write fails the set is *failed*: every request gets an error (never
//!   stale data) until it is reopened, which runs recovery.

use crate::alloc::Buckets;
use crate::checkpoint::{self, Loaded};
use crate::codec::Writer;
use crate::format::{
    detect_signature, BackingHeader, BackingState, Layout, StaleCopies, Superblock,
    BACKING_DATA_OFFSET, DEFAULT_BLOCK_SIZE, DEFAULT_BUCKET_SIZE, MAX_DEVS,
};
use crate::journal::{Entry, Ring};
use crate::knobs::Tunables;
use crate::rangelock::RangeLocks;
use crate::state::{grown_data_size, Backing, Config, Inner, JournalState, State};
use crate::stats::{Counters, History, Snapshot};
use crate::types::{CacheMode, DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, Gen};
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

/// An open cache set. Dropping it without [`CacheSet::close`] is like a crash: nothing more is
/// written, and the next open recovers from the journal.
pub struct CacheSet {
    pub(crate) inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// How [`CacheSet::attach_with`] treats a backing device whose header names another cache
/// set (a disk handed over from another host). By default it is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttachOptions {
    /// Take the device over when its owner's header says it holds no dirty data for it (the
    /// operator guarantees that owner is stopped for good). After writing its own name into
    /// the header, the attach waits twice `Config::owner_check_ms`, so that an owner still
    /// serving it notices and gives it up before this set serves it.
    pub take_over: bool,
    /// With `take_over`: take it over even when the owner's header says it holds dirty data,
    /// giving that data up (the device serves what it holds, older data where the owner's
    /// cache had newer).
    pub discard_dirty: bool,
}

/// What `plan_attach` decided.
struct Plan {
    header: BackingHeader,
    notes: Vec<String>,
    /// The data size the device has room for now (bigger than the header's if it grew).
    grown: u64,
    /// The id this set knows the device by, if any.
    known: Option<DevId>,
    /// The header as its previous owner left it, when this attach takes it over.
    taken_from: Option<BackingHeader>,
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
        dirty_bytes: None,
        owner_host: String::new(),
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

/// A backing device the set knows but has not attached ([`CacheSet::missing`]), or, for
/// [`CacheSet::open_checked`], one it holds data of.
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
        let gens = vec![Gen::new(0); layout.nbuckets as usize];
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
        CacheSet::open_checked(cache, config, |_| Ok(()))
    }

    /// Like `open`, with `check` first: it sees every backing device the set holds data of
    /// (its uuid, bytes cached and dirty), read from the device without writing anything,
    /// and an error from it refuses the open before recovery writes to the cache device (a
    /// refused start changes nothing).
    pub fn open_checked(
        cache: Arc<dyn BlockDevice>,
        config: Config,
        check: impl FnOnce(&[MissingVolume]) -> Result<()>,
    ) -> Result<(CacheSet, RecoveryReport)> {
        let started = Instant::now();
        let loaded = checkpoint::load(&*cache)?;
        let bs = u64::from(loaded.sb.layout.block_size);
        let known: Vec<MissingVolume> = loaded
            .devs
            .iter()
            .map(|(d, uuid)| MissingVolume {
                uuid: *uuid,
                cached_bytes: loaded.index.dev_live_blocks(*d) * bs,
                dirty_bytes: loaded.index.dev_dirty_blocks(*d) * bs,
            })
            .collect();
        check(&known)?;
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
        } = loaded;
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
        };
        let policy = Arc::new(crate::policy::SetPolicy::new(
            config.admission,
            u64::from(layout.nbuckets) * u64::from(layout.blocks_per_bucket()),
        ));
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
            gc_lock: Mutex::new(()),
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
            policy,
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
        if report.records_replayed > 0 {
            inner.seal_journal()?;
        }
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
        self.attach_with(dev, AttachOptions::default())
    }

    /// Attaches a backing device, taking it over from another cache set if `opts` say so
    /// (see [`AttachOptions`]). Everything is checked before anything is written.
    pub fn attach_with(
        &self,
        dev: Arc<dyn BlockDevice>,
        opts: AttachOptions,
    ) -> Result<crate::Volume> {
        crate::guard::contain(&self.inner, "attach", || self.attach_unguarded(dev, opts))
    }

    /// Checks whether [`CacheSet::attach_with`] would take the device, writing nothing: its
    /// header, the set's state, and whether another set owns it (and may give it up). `serve`
    /// checks every device this way before it attaches any.
    pub fn check_attach(&self, dev: &dyn BlockDevice, opts: AttachOptions) -> Result<()> {
        self.plan_attach(dev, opts).map(|_| ())
    }

    /// Whether `dev` is a device this set served that another set has taken over since (its
    /// header names that set): this set's copies of it are stale.
    pub fn taken_from_us(&self, dev: &dyn BlockDevice) -> bool {
        let Ok((header, _)) = BackingHeader::read(dev) else {
            return false;
        };
        let known = (self.inner.state.lock().devs.values()).any(|u| *u == header.dev_uuid);
        known && !header.set_uuid.is_nil() && header.set_uuid != self.set_uuid()
    }

    /// Reads the header and decides what attaching means (see `check_attach`).
    fn plan_attach(&self, dev: &dyn BlockDevice, opts: AttachOptions) -> Result<Plan> {
        let inner = &self.inner;
        inner.check_failed()?;
        if inner.is_degraded() {
            return Err(Error::State(
                "the cache set is degraded: re-admit the repaired cache device before attaching"
                    .into(),
            ));
        }
        let (header, notes) = BackingHeader::read(dev)?;
        let set_uuid = self.set_uuid();
        let grown = grown_data_size(dev, header.data_size)?;
        check_backing_fits(grown.max(header.data_size), inner.block_size())?;
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
        let mut taken_from = None;
        if !(known.is_some() && header.set_uuid == set_uuid) {
            if header.set_uuid == set_uuid && header.state == BackingState::Dirty {
                return Err(Error::State(format!(
                    "backing device {} is marked dirty for this cache set, but the cache holds no record of it; its dirty data is lost",
                    header.dev_uuid
                )));
            }
            if !header.set_uuid.is_nil() && header.set_uuid != set_uuid {
                let owner = crate::owner::owner_name(&header);
                if !opts.take_over && known.is_some() {
                    // This set served it before: the other set took it over, and what this
                    // one holds of it is stale.
                    return Err(Error::State(format!(
                        "backing device {} was taken over by {owner}: what this cache set holds of it is stale and is never written to it; leave it out of --backing (--allow-missing serves the others meanwhile)",
                        header.dev_uuid
                    )));
                }
                if !opts.take_over {
                    return Err(Error::State(format!(
                        "backing device {} belongs to {owner}; detach it there first (if that host is gone for good, --take-over takes it: see docs/deploy.md)",
                        header.dev_uuid
                    )));
                }
                // Dirty, unless that set's dirty data was already given up (the device was
                // served without its cache device, `--without-cache-discard-dirty`).
                let holds_dirty =
                    header.state == BackingState::Dirty && header.stale != StaleCopies::All;
                if holds_dirty && !opts.discard_dirty {
                    return Err(Error::State(format!(
                        "backing device {} belongs to {owner}, which holds {}: its newest data is only in that cache. Detach it there; if that host and its cache device are gone for good, --take-over --discard-dirty gives that data up",
                        header.dev_uuid,
                        crate::owner::dirty_amount(&header)
                    )));
                }
                taken_from = Some(header.clone());
            }
        }
        Ok(Plan {
            header,
            notes,
            grown,
            known,
            taken_from,
        })
    }

    fn attach_unguarded(
        &self,
        dev: Arc<dyn BlockDevice>,
        opts: AttachOptions,
    ) -> Result<crate::Volume> {
        let inner = &self.inner;
        let Plan {
            mut header,
            notes,
            grown,
            known,
            taken_from,
        } = self.plan_attach(&*dev, opts)?;
        for n in notes {
            log::warn!("{n}");
        }
        // A device that grew while it was not served is picked up now.
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
        let id = match known {
            Some(id) if header.set_uuid == self.set_uuid() => {
                self.rejoin(id, &mut header, &*dev)?;
                id
            }
            _ => self.join(known, taken_from.as_ref(), &mut header, &*dev)?,
        };
        let dirty = inner.state.lock().index.dev_dirty_blocks(id);
        let backing = Arc::new(new_backing(inner, id, dev, header));
        if dirty > 0 {
            backing.update_header(|h| {
                h.state = BackingState::Dirty;
                h.dirty_bytes = Some(dirty * inner.block_size());
            })?;
        }
        inner.backings.write().insert(id, backing.clone());
        Ok(crate::Volume {
            inner: inner.clone(),
            backing,
        })
    }

    /// A device this set already holds as `id` comes back: stale copies the header names are
    /// forgotten, and the header names this host as its owner (clean when nothing is dirty).
    fn rejoin(&self, id: DevId, header: &mut BackingHeader, dev: &dyn BlockDevice) -> Result<()> {
        let inner = &self.inner;
        let owner_host = inner.config.host_name.clone();
        if header.stale != StaleCopies::None || header.owner_host != owner_host {
            if header.stale != StaleCopies::None {
                inner.forget_stale_copies(id, header.stale)?;
            }
            let dirty = inner.state.lock().index.dev_dirty_blocks(id) > 0;
            header.stale = StaleCopies::None;
            header.owner_host = owner_host;
            if !dirty {
                header.state = BackingState::Clean;
                header.dirty_bytes = Some(0);
            }
            header.write(dev)?;
        }
        Ok(())
    }

    /// A device joins the set (new to it, taken over, or known from an attach a crash cut
    /// short): it gets an id, the attach is committed, then the header names this set and host
    /// (clean, no stale copies). A device taken over is served only once the set it was taken
    /// from has had time to see that.
    fn join(
        &self,
        known: Option<DevId>,
        taken_from: Option<&BackingHeader>,
        header: &mut BackingHeader,
        dev: &dyn BlockDevice,
    ) -> Result<DevId> {
        let inner = &self.inner;
        if let Some(from) = taken_from {
            log::warn!(
                "backing device {}: taking it over from {}, which holds {}{}",
                header.dev_uuid,
                crate::owner::owner_name(from),
                crate::owner::dirty_amount(from),
                if from.state == BackingState::Dirty {
                    "; that data is given up (--discard-dirty)"
                } else {
                    ""
                }
            );
        }
        let (id, drop_all) = self.assign_id(known, header.dev_uuid)?;
        if let Some(id) = drop_all {
            inner.forget_stale_copies(id, StaleCopies::All)?;
        }
        let mut c = inner.commit_lock.lock();
        inner.commit_locked(&mut c)?;
        header.set_uuid = self.set_uuid();
        header.owner_host = inner.config.host_name.clone();
        header.state = BackingState::Clean;
        header.dirty_bytes = Some(0);
        header.stale = StaleCopies::None;
        header.write(dev)?;
        drop(c);
        if taken_from.is_some() && inner.config.owner_check_ms > 0 {
            // A set that still serves the device (it must not: see docs/deploy.md)
            // reads the header every owner_check_ms and gives the device up when it
            // sees this one's name there; this set serves it only after that.
            std::thread::sleep(std::time::Duration::from_millis(
                inner.config.owner_check_ms.saturating_mul(2) + 200,
            ));
        }
        Ok(id)
    }

    /// The id a joining device gets, journaled (`AttachDev`), and the id whose stale copies
    /// must be forgotten first, if any.
    fn assign_id(&self, known: Option<DevId>, uuid: Uuid) -> Result<(DevId, Option<DevId>)> {
        let inner = &self.inner;
        let mut drop_all = None;
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
                .map(DevId::new)
                .find(|d| !st.devs.contains_key(d))
                .ok_or_else(|| Error::State("too many backing devices in this cache set".into()))?,
        };
        st.devs.insert(id, uuid);
        let now = inner.now_ns();
        st.log(&Entry::AttachDev { dev: id, uuid }, now);
        Ok((id, drop_all))
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
                st.invalidate(b.id, BackingBlock::new(0), crate::index::BLOCK_END, now);
                st.devs.remove(&b.id);
                st.log(&Entry::DetachDev { dev: b.id }, now);
            }
            {
                let mut c = inner.commit_lock.lock();
                inner.commit_locked(&mut c)?;
            }
            b.update_header(|h| {
                h.set_uuid = Uuid::nil();
                h.owner_host.clear();
                h.state = BackingState::Clean;
                h.dirty_bytes = Some(0);
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
    pub fn health(&self) -> crate::degraded::HealthReport {
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
            st.index.heap_bytes() + st.buckets.heap_bytes() + self.inner.policy.heap_bytes(),
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
                        b.id
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
            b.update_header(|h| {
                h.state = if dirty > 0 {
                    BackingState::Dirty
                } else {
                    BackingState::Clean
                };
                h.dirty_bytes = Some(dirty * inner.block_size());
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

/// A newly attached volume's state: its header's tunables, fresh counters and policy.
fn new_backing(
    inner: &Inner,
    id: DevId,
    dev: Arc<dyn BlockDevice>,
    header: BackingHeader,
) -> Backing {
    let t = header.tunables;
    let dev_rotational = dev.is_rotational();
    Backing {
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
        policy: crate::policy::VolumePolicy::new(
            dev_rotational,
            inner.config.decisions.clone(),
            inner.policy.clone(),
        ),
        counters: Counters::default(),
        history: History::default(),
        backing_written: AtomicBool::new(false),
        dirty_since_ns: AtomicU64::new(inner.now_ns()),
        client_backing_ns: AtomicU64::new(0),
        client_stream_ns: AtomicU64::new(0),
        readahead: Mutex::default(),
        flush_failures: AtomicU64::new(0),
        unflushed: Mutex::new(crate::unflushed::Unflushed::default()),
        losses_reported: AtomicU64::new(0),
        writeback_error: Mutex::new(None),
        io_epoch: std::time::Instant::now(),
        last_done_ns: AtomicU64::new(0),
        io_in_flight: AtomicU64::new(0),
        dirty_writers: AtomicU64::new(0),
        amount_written_ns: AtomicU64::new(inner.now_ns()),
        owner_checked_ns: AtomicU64::new(inner.now_ns()),
        lost: AtomicBool::new(false),
        lost_why: Mutex::new(None),
    }
}

impl Drop for CacheSet {
    fn drop(&mut self) {
        self.stop_background();
    }
}
