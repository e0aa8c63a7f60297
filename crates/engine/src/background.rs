//! The background threads: writeback (paced by the writeback rate; it also runs the backing
//! headers' owner watch and dirty marks), maintenance (space, commits, checkpoints) and the
//! cache device's watchdog (`health`). The work itself lives in `space`, `writeback`, `owner`
//! and `health`; none of it runs while the set is degraded except the
//! watchdog.
//!
//! Invariants: every step a thread takes is bounded (see `space` and `writeback`), runs under
//! `contain` (a panic fails the set, not the process), and sleeps at most `BACKGROUND_PERIOD`
//! between checks of the stop flag, so stopping the set is prompt.

use crate::guard::{contain, Throttled};
use crate::policy::WritebackRate;
use crate::space::make_space;
use crate::state::Inner;
use crate::writeback::{current_rate, writeback_pass, WRITEBACK_SHARE_SLEEP_MAX};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BACKGROUND_PERIOD: Duration = Duration::from_millis(50);
const WATCHDOG_PERIOD: Duration = Duration::from_millis(100);
/// Longest wait between writeback passes that keep failing.
const WRITEBACK_BACKOFF_MAX: Duration = Duration::from_secs(60);

fn sleep(inner: &Inner, d: Duration) {
    let mut g = inner.wake.0.lock();
    if !inner.stop.load(Ordering::SeqCst) {
        inner.wake.1.wait_for(&mut g, d);
    }
}

/// Writeback loop. At `Full` rate it runs batch after batch; at `Share(p)` it sleeps after
/// each batch until the batch's time is `p` % of the time spent (re-checking the rate at
/// least every `WRITEBACK_SHARE_SLEEP_MAX`, so a surge of dirty data or an idle disk is
/// answered quickly); with nothing to do it polls every 100 ms. Passes that fail (a backing
/// device that refuses writes or flushes) are retried after 1 s, doubling to a minute.
pub fn writeback_thread(inner: &Arc<Inner>) {
    let mut owed = Duration::ZERO;
    let mut failures = 0u32;
    while !inner.stop.load(Ordering::SeqCst) {
        if inner.is_degraded() {
            sleep(inner, Duration::from_millis(100));
            continue;
        }
        // The backing headers' owner watch and dirty marks (`owner`): a read of each header
        // every `owner_check_ms`, a header write only at a transition.
        let _ = contain(inner, "owner", || {
            crate::owner::tick(inner);
            Ok(())
        });
        if !owed.is_zero() {
            if matches!(current_rate(inner), WritebackRate::Share(_)) {
                let t = Instant::now();
                sleep(inner, owed.min(WRITEBACK_SHARE_SLEEP_MAX));
                owed = owed.saturating_sub(t.elapsed());
                continue;
            }
            owed = Duration::ZERO;
        }
        let t = Instant::now();
        let res = contain(inner, "writeback", || writeback_pass(inner, false, None));
        if res.is_ok() {
            failures = 0;
        }
        match res {
            Ok((n, WritebackRate::Full)) if n > 0 => {}
            Ok((n, WritebackRate::Share(pct))) if n > 0 => {
                owed = t.elapsed() * (100 - pct) / pct;
            }
            Ok(_) => sleep(inner, Duration::from_millis(100)),
            Err(e) => {
                static LOG: Throttled = Throttled::new();
                LOG.log(log::Level::Error, format_args!("writeback: {e}"));
                // Backoff: 1 s after the first failure, doubling to a minute while it lasts.
                failures = failures.saturating_add(1);
                let backoff =
                    Duration::from_secs(1 << (failures - 1).min(6)).min(WRITEBACK_BACKOFF_MAX);
                sleep(inner, backoff);
                continue;
            }
        }
    }
}

/// Watchdog loop: checks the cache device for hung I/Os and failures no request path
/// checked (see `Inner::watch_cache_device`). A thread of its own, so a maintenance or
/// writeback step stuck in a hung I/O cannot stop it.
pub fn watchdog_thread(inner: &Arc<Inner>) {
    while !inner.stop.load(Ordering::SeqCst) {
        let _ = contain(inner, "watchdog", || {
            inner.watch_cache_device();
            Ok(())
        });
        sleep(inner, WATCHDOG_PERIOD);
    }
}

/// Maintenance loop: commits journal entries older than `journal_delay_ms`, checkpoints when
/// the journal ring is half full (a committer wakes it), keeps free
/// buckets in reserve, records statistics history.
pub fn maintenance_thread(inner: &Arc<Inner>) {
    while !inner.stop.load(Ordering::SeqCst) {
        let now = inner.now_ns();
        let due = inner
            .state
            .lock()
            .journal
            .oldest_pending_ns
            .is_some_and(|t| now.saturating_sub(t) >= inner.config.journal_delay_ms * 1_000_000);
        let res = contain(inner, "maintenance", || {
            if inner.is_degraded() {
                return Ok(());
            }
            if due {
                inner.commit_to(u64::MAX)?;
            }
            inner.checkpoint_if_due()?;
            make_space(inner, inner.reserve_buckets)?;
            Ok(())
        });
        if let Err(e) = res {
            static LOG: Throttled = Throttled::new();
            LOG.log(log::Level::Error, format_args!("maintenance: {e}"));
        }
        for b in inner.backings.read().values() {
            b.history.tick(now, &b.counters.snapshot());
        }
        sleep(inner, BACKGROUND_PERIOD);
    }
}
