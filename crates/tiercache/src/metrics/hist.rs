//! Latency histograms that many threads record into without a lock, and what is read out of
//! them: Prometheus buckets and, for `tiercache top`, percentiles over an interval.
//!
//! Invariants: the bucket bounds are fixed (`BOUNDS_US`, 5 µs to 10 s, then +Inf), so two
//! snapshots of one histogram subtract bucket by bucket; counts only grow (relaxed atomics:
//! a snapshot taken while requests complete may count a request in its bucket before its
//! time is in `sum_ns`, never the reverse order of two snapshots); recording costs three
//! relaxed atomic adds and allocates nothing. Memory: `BUCKETS + 1` words per histogram.

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the finite buckets, in microseconds (Prometheus `le`, inclusive).
pub const BOUNDS_US: [u64; 20] = [
    5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
];
/// Finite buckets plus +Inf.
pub const BUCKETS: usize = BOUNDS_US.len() + 1;

/// A histogram being recorded into.
#[derive(Default, Debug)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // The first bound at or above the value; +Inf past the last.
        let i = BOUNDS_US.partition_point(|&b| b * 1000 < ns);
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(ns, Relaxed);
    }

    pub fn snapshot(&self) -> HistSnapshot {
        HistSnapshot {
            buckets: self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            sum_ns: self.sum_ns.load(Relaxed),
        }
    }
}

/// A histogram's counts at one moment: per bucket (not cumulative; `BUCKETS` entries, the
/// last +Inf) and the sum of the observed times.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistSnapshot {
    pub buckets: Vec<u64>,
    pub sum_ns: u64,
}

impl HistSnapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns as f64 / 1e9
    }

    /// What was observed between `earlier` and `self` (two snapshots of one histogram).
    pub fn since(&self, earlier: &HistSnapshot) -> HistSnapshot {
        HistSnapshot {
            buckets: self
                .buckets
                .iter()
                .enumerate()
                .map(|(i, &n)| n.saturating_sub(earlier.buckets.get(i).copied().unwrap_or(0)))
                .collect(),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
        }
    }

    /// `self + other`, bucket by bucket.
    pub fn plus(&self, other: &HistSnapshot) -> HistSnapshot {
        let n = self.buckets.len().max(other.buckets.len());
        let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
        HistSnapshot {
            buckets: (0..n)
                .map(|i| at(&self.buckets, i) + at(&other.buckets, i))
                .collect(),
            sum_ns: self.sum_ns + other.sum_ns,
        }
    }

    /// The `q` quantile (0..=1) in seconds, interpolated linearly inside its bucket as
    /// Prometheus' `histogram_quantile` does; `None` without observations. A quantile in the
    /// +Inf bucket is reported as the largest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            if n > 0 && (below + n) as f64 >= rank {
                let Some(&upper) = BOUNDS_US.get(i) else {
                    return Some(BOUNDS_US[BOUNDS_US.len() - 1] as f64 / 1e6);
                };
                let lower = if i == 0 { 0 } else { BOUNDS_US[i - 1] };
                let frac = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
                return Some((lower as f64 + (upper - lower) as f64 * frac) / 1e6);
            }
            below += n;
        }
        Some(BOUNDS_US[BOUNDS_US.len() - 1] as f64 / 1e6)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_bucket_whose_bound_covers_them() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(5)); // le 5 µs, inclusive
        h.observe(Duration::from_nanos(5_001)); // le 10 µs
        h.observe(Duration::from_millis(1)); // le 1 ms
        h.observe(Duration::from_secs(11)); // +Inf
        let s = h.snapshot();
        assert_eq!(s.buckets.len(), BUCKETS);
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(
            s.buckets[BOUNDS_US.iter().position(|&b| b == 1000).unwrap()],
            1
        );
        assert_eq!(s.buckets[BUCKETS - 1], 1);
        assert_eq!(s.count(), 4);
        assert_eq!(s.sum_ns, 5_000 + 5_001 + 1_000_000 + 11_000_000_000);
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let h = Histogram::default();
        // 100 observations in (50, 100] µs.
        for _ in 0..100 {
            h.observe(Duration::from_micros(80));
        }
        let s = h.snapshot();
        let p50 = s.quantile(0.5).unwrap();
        assert!((p50 - 75e-6).abs() < 1e-9, "{p50}");
        assert!((s.quantile(1.0).unwrap() - 100e-6).abs() < 1e-9);
        // One slow outlier moves p99 only if it is past the 99th observation.
        h.observe(Duration::from_millis(40));
        let s2 = h.snapshot();
        assert!(s2.quantile(0.99).unwrap() <= 100e-6);
        assert!(s2.quantile(1.0).unwrap() > 25e-3);
        // Only what happened in between.
        let d = s2.since(&s);
        assert_eq!(d.count(), 1);
        assert!(d.quantile(0.5).unwrap() > 25e-3);
        assert_eq!(HistSnapshot::default().quantile(0.5), None);
        assert_eq!(s.plus(&d), s2);
    }
}
