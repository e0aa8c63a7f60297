//! What a backing device's header says about the cache set that owns it, kept true while the
//! set runs, so that another host can decide from the header alone whether it may take the
//! device over (`attach` with `AttachOptions::take_over`, in `set`): the dirty mark and the
//! dirty amount recorded with it, and the watch that gives a device up once its header names
//! another set.
//!
//! Invariants:
//! - the header says `Dirty` before any dirty entry for the device can be durable: a write
//!   routed to writeback holds a `DirtyWriter` from before it looks at the header until its
//!   insert is done, and writes the mark (with the write's size as the first amount) when the
//!   header says `Clean` (`dirty_write`); a staged write (`io::absorb`) holds one from its plan
//!   to its insert and is absorbed only if the header already says `Dirty`;
//! - the header says `Clean` only when the set holds no dirty data for the device, no
//!   `DirtyWriter` is live, the journal records that cleaned it are durable and the device
//!   was flushed since (`sync_dirty_mark`); the check of the writer count and the dirty count
//!   and the header write happen under the header lock, which a writer takes after counting
//!   itself, so a first dirty write either is seen or sees `Clean` and marks it again;
//! - header writes stay rare: one per transition (no dirty data → some, and back), one amount
//!   update at most every `AMOUNT_PERIOD_NS` (10 s) and only when the amount doubled or halved, and one
//!   at close and detach;
//! - a device whose header on disk names another set (taken over by another host) is given up
//!   for good: it leaves the attached devices (no writeback touches it again), every request
//!   on its volume fails, naming the set that took it, and nothing more is written to its
//!   header. The header is read every `Config::owner_check_ms` and before each dirty mark;
//!   this is a watch, not a fence (a request already past its check still reaches the device).

use crate::format::{BackingHeader, BackingState};
use crate::state::{Backing, Inner};
use crate::types::{Error, Result};
use crate::units::human;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Least time between two updates of a dirty amount already recorded (ns): with the rule
/// that the amount must have doubled or halved, a growing amount costs one header write per
/// doubling, and no workload more than one per 10 s.
const AMOUNT_PERIOD_NS: u64 = 10_000_000_000;

/// A write that may put dirty data in the cache, counted while it runs (see the invariants).
pub(crate) struct DirtyWriter(Arc<Backing>);

impl Drop for DirtyWriter {
    fn drop(&mut self) {
        self.0.dirty_writers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How a header names its owner: the set's uuid, and the host it ran on when recorded.
pub(crate) fn owner_name(h: &BackingHeader) -> String {
    if h.owner_host.is_empty() {
        format!("cache set {}", h.set_uuid)
    } else {
        format!("cache set {} on host '{}'", h.set_uuid, h.owner_host)
    }
}

/// What a header says about the dirty data its owner holds.
pub(crate) fn dirty_amount(h: &BackingHeader) -> String {
    match (h.state, h.dirty_bytes) {
        (BackingState::Clean, _) => "no dirty data for it".into(),
        (BackingState::Dirty, Some(n)) => format!(
            "dirty data for it ({} when it last recorded the amount; it may hold more now)",
            human(n)
        ),
        (BackingState::Dirty, None) => {
            "dirty data for it (how much is not recorded: the header predates the amount)".into()
        }
    }
}

/// Counts a write that may put dirty data of `b` in the cache from now until the guard is
/// dropped, which must be after its insert. Taken before the write looks at the header's
/// dirty mark: the staged write (`io::absorb`) takes it and goes on only if the header already
/// says dirty; `dirty_write` marks it.
pub(crate) fn dirty_writer(b: &Arc<Backing>) -> DirtyWriter {
    b.dirty_writers.fetch_add(1, Ordering::SeqCst);
    DirtyWriter(b.clone())
}

/// Counts a write that is about to put `bytes` of dirty data of `b` in the cache, marking
/// the header dirty first if it says clean. The returned guard must live until the insert is
/// done.
pub(crate) fn dirty_write(b: &Arc<Backing>, inner: &Inner, bytes: u64) -> Result<DirtyWriter> {
    let guard = dirty_writer(b);
    b.mark_dirty(inner, bytes)?;
    Ok(guard)
}

impl Backing {
    /// Writes the dirty mark if the header says clean (see `dirty_write`).
    fn mark_dirty(&self, inner: &Inner, bytes: u64) -> Result<()> {
        let mut h = self.header.lock();
        if h.state != BackingState::Dirty {
            // Rare (no dirty data → some): the header on disk is read first, so a device
            // another set took over never gets a dirty mark, nor dirty data, from this one.
            if let Some(why) = self.other_owner(&h)? {
                drop(h);
                self.give_up(inner, &why);
                return Err(Error::State(why));
            }
            let mut next = h.clone();
            next.state = BackingState::Dirty;
            next.dirty_bytes = Some(bytes);
            self.write_header(&mut next)?;
            *h = next;
            self.amount_written_ns
                .store(inner.now_ns(), Ordering::Relaxed);
        }
        Ok(())
    }

    /// Why requests on this device fail, if another set took it over.
    pub(crate) fn taken_over(&self) -> Option<String> {
        if !self.lost.load(Ordering::Acquire) {
            return None;
        }
        self.lost_why.lock().clone()
    }

    /// Whether another set owns the device now: reads the header on disk and compares its
    /// owner with `ours` (the in-memory header); `Some(why)` if it changed.
    fn other_owner(&self, ours: &BackingHeader) -> Result<Option<String>> {
        let (disk, _) = BackingHeader::read(&*self.dev)?;
        if disk.set_uuid == ours.set_uuid {
            return Ok(None);
        }
        Ok(Some(format!(
            "backing device {} was taken over by {}: this cache set no longer serves it",
            ours.dev_uuid,
            if disk.set_uuid.is_nil() {
                "nobody (its header names no cache set)".to_string()
            } else {
                owner_name(&disk)
            }
        )))
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Gives the device up for good (see the invariants). Takes the attached devices' lock:
    /// never called with the header lock held (`close` takes them in the other order).
    fn give_up(&self, inner: &Inner, why: &str) {
        if self.lost.swap(true, Ordering::AcqRel) {
            return;
        }
        *self.lost_why.lock() = Some(why.to_string());
        log::error!("{why}");
        inner.backings.write().remove(&self.id);
    }
}

/// One round of the watch over every attached device (the writeback thread runs it): the
/// owner check when it is due, then the dirty mark. Errors are logged, not returned: a device
/// that cannot be read now is checked again next round.
pub(crate) fn tick(inner: &Inner) {
    let backings: Vec<Arc<Backing>> = inner.backings.read().values().cloned().collect();
    let now = inner.now_ns();
    let period = inner.config.owner_check_ms.saturating_mul(1_000_000);
    for b in backings {
        if b.detaching.load(Ordering::SeqCst) || inner.is_degraded() {
            continue;
        }
        let last = b.owner_checked_ns.load(Ordering::Relaxed);
        if period > 0 && now.saturating_sub(last) >= period {
            b.owner_checked_ns.store(now, Ordering::Relaxed);
            let ours = b.header.lock().clone();
            match b.other_owner(&ours) {
                Ok(None) => {}
                Ok(Some(why)) => {
                    b.give_up(inner, &why);
                    continue;
                }
                // Unreadable now (a store that is down): checked again next round.
                Err(_) => {}
            }
        }
        if let Err(e) = sync_dirty_mark(inner, &b) {
            static LOG: lograte::Throttled = lograte::Throttled::new();
            LOG.log(
                log::Level::Warn,
                format_args!("updating the dirty mark of backing device {}: {e}", b.id),
            );
        }
    }
}

/// Brings the header's dirty mark and amount in step with what the set holds (see the
/// invariants for when it writes).
pub(crate) fn sync_dirty_mark(inner: &Inner, b: &Backing) -> Result<()> {
    let bs = inner.block_size();
    let dirty_now = || inner.state.lock().index.dev_dirty_blocks(b.id) * bs;
    let (state, recorded) = {
        let h = b.header.lock();
        (h.state, h.dirty_bytes)
    };
    if state != BackingState::Dirty {
        return Ok(());
    }
    let dirty = dirty_now();
    if dirty == 0 {
        if b.dirty_writers.load(Ordering::SeqCst) > 0 {
            return Ok(());
        }
        // What cleaned it durable first: the journal records, and the device's own writes.
        inner.commit_to(u64::MAX)?;
        b.flush_if_written()?;
        let mut h = b.header.lock();
        if b.dirty_writers.load(Ordering::SeqCst) > 0 || dirty_now() > 0 || b.is_lost() {
            return Ok(());
        }
        let mut next = h.clone();
        next.state = BackingState::Clean;
        next.dirty_bytes = Some(0);
        b.write_header(&mut next)?;
        *h = next;
        return Ok(());
    }
    let now = inner.now_ns();
    let due = now.saturating_sub(b.amount_written_ns.load(Ordering::Relaxed)) >= AMOUNT_PERIOD_NS;
    let off = recorded.is_none_or(|r| dirty > r.saturating_mul(2) || dirty.saturating_mul(2) < r);
    if due && off && !b.is_lost() {
        b.update_header(|h| h.dirty_bytes = Some(dirty))?;
        b.amount_written_ns.store(now, Ordering::Relaxed);
    }
    Ok(())
}
