//! The cache device's health: the degraded state (every volume served from its backing
//! device while the cache device fails), re-admission, and copies a cache set holds that no
//! longer match their backing device (dropped at attach; the backing header's `stale` field
//! says which).
//!
//! Invariants:
//! - degraded, nothing is read from or written to the cache device by requests, writeback or
//!   maintenance; a write reaches a backing device only after its header says its clean
//!   copies are stale, and never over a range that holds dirty data or whose journal entries
//!   may not be durable (`Uncertain`): so after any crash or re-admission the cache device's
//!   durable dirty copies are still the newest data of their ranges;
//! - a degraded read of a range with dirty data is an error, never older data from the
//!   backing device; a degraded flush of a device whose dirty data changed in entries that
//!   may not be durable is an error, never a promise the cache device cannot keep;
//! - re-admission drops the clean copies (stale), then writes a checkpoint of what the set
//!   holds (which makes every uncertain entry durable as memory has it), then clears the
//!   headers, and only then serves through the cache again;
//! - a backing device is written while its set is not in use (degraded, or served without
//!   its cache device) only after its header says which copies are stale, and the header
//!   says `StaleCopies::None` again only after a checkpoint without those copies is durable;
//!   so whatever crashes when, the next attach drops them before the device is served;
//! - the copies are dropped from memory without journal entries (one checkpoint instead of
//!   an entry per run; the header keeps the reason on record until it is durable). That
//!   checkpoint covers every entry appended before it, pending ones too, so no entry older
//!   than the drop (an insert of a copy now stale) is replayed after it.

use crate::degraded::{Degraded, HealthReport, Uncertain};
use crate::format::StaleCopies;
use crate::state::{Inner, JournalState};
use crate::types::{DevId, Result};
use crate::units::BackingBlock;
use std::sync::atomic::Ordering;

impl Inner {
    /// Drops the copies of `dev` that `stale` names and makes the drop durable with a
    /// checkpoint; returns the blocks dropped. Nothing is written when there were none.
    pub(crate) fn forget_stale_copies(&self, dev: DevId, stale: StaleCopies) -> Result<u64> {
        let all = match stale {
            StaleCopies::None => return Ok(0),
            StaleCopies::Clean => false,
            StaleCopies::All => true,
        };
        let n = self.state.lock().index.forget_copies(dev, all);
        if n > 0 {
            log::warn!(
                "dropped {n} {} cached blocks of backing device {} (it was written while the cache set was not in use)",
                if all { "clean and dirty" } else { "clean" },
                dev
            );
            self.checkpoint_covering_all()?;
        }
        Ok(n)
    }
}

impl Inner {
    /// Whether the set is degraded (requests go to the backing devices).
    pub(crate) fn is_degraded(&self) -> bool {
        self.health.degraded.load(Ordering::Acquire)
    }

    /// Called after a cache-device failure was counted (by `CacheDev`, or `note_error` for a
    /// checksum mismatch): degrades the set once the decayed count reaches the limit.
    pub(crate) fn after_cache_error(&self, what: &dyn std::fmt::Display) {
        let n = self.cache.error_count();
        let limit = self.config.io_error_limit;
        if n >= f64::from(limit.max(1)) || limit == 0 {
            self.degrade(format!(
                "{n:.1} cache device errors reached io_error_limit {limit}; last: {what}"
            ));
        }
    }

    /// Enters the degraded state (nothing if it is already): every backing device's header
    /// first says its clean copies are stale, then the ranges whose entries may not be
    /// durable are set aside, then requests go to the backing devices. A header that cannot
    /// be written fails the set instead (it could not be served without risking a stale
    /// copy later).
    pub(crate) fn degrade(&self, reason: String) {
        if self.is_degraded() {
            return;
        }
        let _t = self.health.transition.lock();
        if self.is_degraded() {
            return;
        }
        log::error!(
            "cache set degraded: {reason}; serving every volume from its backing device (dirty data stays on the cache device)"
        );
        let backings: Vec<_> = self.backings.read().values().cloned().collect();
        for b in &backings {
            let r = b.update_header(|h| {
                if h.stale == StaleCopies::None {
                    h.stale = StaleCopies::Clean;
                }
            });
            if let Err(e) = r {
                self.fail(&crate::Error::State(format!(
                    "{reason}, and the header of backing device {} could not be marked: {e}",
                    b.id
                )));
                return;
            }
        }
        {
            let mut st = self.state.lock();
            st.uncertain = Some(uncertain_of(&st.journal));
            self.health.degraded.store(true, Ordering::Release);
        }
        *self.health.info.lock() = Some(Degraded {
            reason,
            since_unix: crate::clock::unix_now(),
        });
        self.wake_background();
    }

    /// Whether a degraded set must refuse a request over `[b0, b1)` of `dev`: a write when
    /// the range holds dirty data or may have entries that are not durable; a read when it
    /// holds dirty data (the cache device has the only current copy).
    pub(crate) fn degraded_blocks(
        &self,
        dev: DevId,
        b0: BackingBlock,
        b1: BackingBlock,
        write: bool,
    ) -> bool {
        let st = self.state.lock();
        st.index.any_overlapping(dev, b0, b1, |e| e.dirty)
            || (write
                && st
                    .uncertain
                    .as_ref()
                    .is_some_and(|u| u.overlaps(dev, b0, b1)))
    }

    /// Whether a degraded set can honour a flush of `dev` by flushing the backing device: no
    /// dirty data of it was written, or dropped, by entries that may not be durable.
    pub(crate) fn degraded_flush_ok(&self, dev: DevId) -> bool {
        let st = self.state.lock();
        !st.uncertain.as_ref().is_some_and(|u| u.is_unsafe(dev))
    }

    /// Leaves the degraded state, if the cache device answers again: clean copies (stale
    /// now) are dropped, a checkpoint of what the set holds is written, and the backing
    /// headers stop saying their copies are stale. On failure the set stays degraded.
    pub(crate) fn readmit(&self) -> Result<()> {
        if !self.is_degraded() {
            return Err(crate::Error::State(
                "the cache set is not degraded: nothing to re-admit".into(),
            ));
        }
        let backings: Vec<_> = self.backings.read().values().cloned().collect();
        {
            let mut st = self.state.lock();
            for b in &backings {
                st.index.forget_copies(b.id, false);
            }
        }
        self.cache.reset_errors();
        self.health
            .errors_seen
            .store(self.cache.total_errors(), Ordering::SeqCst);
        self.checkpoint_covering_all()?;
        for b in &backings {
            b.update_header(|h| {
                if h.stale == StaleCopies::Clean {
                    h.stale = StaleCopies::None;
                }
            })?;
        }
        let _t = self.health.transition.lock();
        {
            let mut st = self.state.lock();
            st.uncertain = None;
            self.health.degraded.store(false, Ordering::Release);
        }
        *self.health.info.lock() = None;
        log::warn!("cache device re-admitted: volumes are served through the cache again");
        self.wake_background();
        Ok(())
    }

    pub(crate) fn health_report(&self) -> HealthReport {
        let (r, w) = self.cache.latency_us();
        HealthReport {
            degraded: self.health.info.lock().clone(),
            errors_total: self.cache.total_errors(),
            error_count: self.cache.error_count(),
            io_error_limit: self.config.io_error_limit,
            read_latency_us: r,
            write_latency_us: w,
            cost: Some(self.cache.cost()),
        }
    }

    /// The watchdog's check: a cache-device I/O in flight longer than the timeout degrades
    /// the set; one in flight long enough to matter counts toward congestion; failures that
    /// no request path checked (writeback, GC) are compared with the limit.
    pub(crate) fn watch_cache_device(&self) {
        self.cache.note_stuck();
        if self.is_degraded() {
            return;
        }
        if let Some(age) = self.cache.hung() {
            self.degrade(format!(
                "a cache device I/O has not completed in {} ms (cache_io_timeout {} ms)",
                age.as_millis(),
                self.config.cache_io_timeout_ms
            ));
        } else {
            let total = self.cache.total_errors();
            if total > self.health.errors_seen.swap(total, Ordering::SeqCst) {
                self.after_cache_error(&"failures counted in the background");
            }
        }
    }
}

/// From the journal's entries that are not durable.
fn uncertain_of(j: &JournalState) -> Uncertain {
    let mut u = Uncertain::default();
    for &(_, dev, b0, b1, dropped) in &j.less_dirty {
        u.note_less_dirty(dev, b0, b1, dropped);
    }
    for (&dev, &epoch) in &j.dirty_insert_epoch {
        if epoch > j.durable_epoch {
            u.note_dirty(dev);
        }
    }
    u
}
