//! Statistics with bcache's names: per-device counters, totals and time windows.
//!
//! Invariants: counters only grow (relaxed atomics; a snapshot may mix values from requests
//! in flight but never goes backwards); windows (`five_minute`, `hour`, `day`) are differences
//! between the live counters and a per-minute history of at most `HISTORY_MINUTES` snapshots,
//! so memory is bounded.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const HISTORY_MINUTES: usize = 24 * 60 + 1;

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Live counters (atomics) of one backing device.
        #[derive(Default, Debug)]
        pub struct Counters { $(pub $name: AtomicU64,)* }

        /// A point-in-time copy of [`Counters`].
        #[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
        pub struct Snapshot { $(pub $name: u64,)* }

        impl Counters {
            pub fn snapshot(&self) -> Snapshot {
                Snapshot { $($name: self.$name.load(Relaxed),)* }
            }
        }

        impl Snapshot {
            /// `self - earlier`, field by field.
            pub fn since(&self, earlier: &Snapshot) -> Snapshot {
                Snapshot { $($name: self.$name.saturating_sub(earlier.$name),)* }
            }
            /// `self + other`, field by field.
            pub fn plus(&self, other: &Snapshot) -> Snapshot {
                Snapshot { $($name: self.$name + other.$name,)* }
            }
            /// `(name, value)` pairs in declaration order, for display and JSON.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters!(
    cache_hits,
    cache_misses,
    cache_bypass_hits,
    cache_bypass_misses,
    cache_miss_collisions,
    bypassed,
    cache_read_bytes,
    cache_written_bytes,
    backing_read_bytes,
    backing_written_bytes,
    writeback_bytes,
    checksum_repairs,
    io_errors,
    // Cache-device failures this device's requests met and served from the backing device.
    cache_io_errors,
    // Requests sent to the backing device because the cache device was slow (congested).
    congested,
    // Bytes served by the backing device alone while the cache set was degraded.
    degraded_bytes,
    // Bytes that went around the cache, by reason (`policy::Bypass`); `bypassed` is their sum.
    bypassed_sequential,
    bypassed_mode,
    bypassed_dirty_limit,
    bypassed_full,
    bypassed_congested,
    bypassed_partial,
    bypassed_detaching,
    bypassed_zeroes,
    bypassed_admission,
    // Bytes of the device's cached data that copying GC moved to other buckets (the cache's
    // own write amplification).
    gc_moved_bytes,
);

impl Counters {
    /// Counts `bytes` that went around the cache for `why`, in its counter and in `bypassed`.
    pub fn bypass(&self, why: crate::policy::Bypass, bytes: u64) {
        use crate::policy::Bypass as B;
        Self::add(&self.bypassed, bytes);
        Self::add(
            match why {
                B::Sequential => &self.bypassed_sequential,
                B::Mode => &self.bypassed_mode,
                B::DirtyLimit => &self.bypassed_dirty_limit,
                B::Full => &self.bypassed_full,
                B::Congested => &self.bypassed_congested,
                B::Partial => &self.bypassed_partial,
                B::Detaching => &self.bypassed_detaching,
                B::Zeroes => &self.bypassed_zeroes,
                B::Admission => &self.bypassed_admission,
            },
            bytes,
        );
    }

    pub fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Relaxed);
    }
}

impl Snapshot {
    /// Hits over hits plus misses, in percent (bypassed requests not counted, like bcache).
    pub fn hit_ratio_pct(&self) -> u64 {
        let total = self.cache_hits + self.cache_misses;
        (self.cache_hits * 100).checked_div(total).unwrap_or(0)
    }
}

/// Totals and the three time windows of one device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Windows {
    pub total: Snapshot,
    pub five_minute: Snapshot,
    pub hour: Snapshot,
    pub day: Snapshot,
}

/// Per-minute history that turns totals into windows.
#[derive(Default)]
pub struct History {
    minutes: Mutex<VecDeque<(u64, Snapshot)>>,
}

impl History {
    /// Records the totals at the start of each minute (call as often as convenient).
    pub fn tick(&self, now_ns: u64, current: &Snapshot) {
        let minute = now_ns / 60_000_000_000;
        let mut h = self.minutes.lock();
        if h.back().is_none_or(|&(m, _)| m < minute) {
            h.push_back((minute, *current));
            while h.len() > HISTORY_MINUTES {
                h.pop_front();
            }
        }
    }

    pub fn windows(&self, now_ns: u64, current: &Snapshot) -> Windows {
        let minute = now_ns / 60_000_000_000;
        let h = self.minutes.lock();
        let since = |mins: u64| {
            let start = minute.saturating_sub(mins);
            let base = h
                .iter()
                .find(|&&(m, _)| m >= start)
                .map(|&(_, s)| s)
                .unwrap_or(*current);
            current.since(&base)
        };
        Windows {
            total: *current,
            five_minute: since(5),
            hour: since(60),
            day: since(24 * 60),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_subtract_history() {
        let c = Counters::default();
        let h = History::default();
        let min = 60_000_000_000u64;
        h.tick(0, &c.snapshot());
        Counters::add(&c.cache_hits, 10);
        h.tick(10 * min, &c.snapshot());
        Counters::add(&c.cache_hits, 5);
        Counters::add(&c.cache_misses, 5);
        let w = h.windows(12 * min, &c.snapshot());
        assert_eq!(w.total.cache_hits, 15);
        assert_eq!(w.five_minute.cache_hits, 5);
        assert_eq!(w.hour.cache_hits, 15);
        assert_eq!(w.total.hit_ratio_pct(), 75);
    }
}
