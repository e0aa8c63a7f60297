//! The writeback throughput `status` shows, per volume: bytes written back per second over
//! the last few seconds, measured from the engine's `writeback_bytes` counter, and the
//! writeback *state* an operator reads first (`paused`, `failing`, `idle`, `delayed`,
//! `running`).
//!
//! Invariants: memory is bounded (at most `SAMPLES_MAX` samples per volume; volumes no longer
//! attached are forgotten at the next sample); a rate never comes from a counter that went
//! backwards (a volume detached and attached again starts over at 0); the sampler holds no
//! lock of the engine beyond one `status()` call per volume per `SAMPLE_INTERVAL`.

use engine::{CacheSet, DevStatus};
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// How often the sampler reads the counters.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// The rate is an average over (up to) this long.
pub const WINDOW: Duration = Duration::from_secs(5);
/// Samples kept per volume: the window and one older, to span it.
const SAMPLES_MAX: usize = 8;

/// Recent `(when, writeback_bytes)` samples per volume.
#[derive(Default)]
pub struct WritebackMeter {
    samples: Mutex<HashMap<Uuid, VecDeque<(Instant, u64)>>>,
}

impl WritebackMeter {
    /// Records every attached volume's counter (called every `SAMPLE_INTERVAL`).
    pub fn sample(&self, set: &CacheSet) {
        let now = Instant::now();
        let current: Vec<(Uuid, u64)> = set
            .volumes()
            .iter()
            .map(|v| (v.uuid(), v.status().stats.total.writeback_bytes))
            .collect();
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples.retain(|uuid, _| current.iter().any(|(u, _)| u == uuid));
        for (uuid, bytes) in current {
            let q = samples.entry(uuid).or_default();
            if q.back().is_some_and(|&(_, last)| bytes < last) {
                q.clear();
            }
            q.push_back((now, bytes));
            while q.len() > SAMPLES_MAX || (q.len() > 2 && now.duration_since(q[1].0) >= WINDOW) {
                q.pop_front();
            }
        }
    }

    /// Bytes written back per second for `uuid`, from its oldest sample inside the window
    /// (or just before it) to `bytes_now`; 0 before there is a sample.
    pub fn bytes_per_sec(&self, uuid: Uuid, bytes_now: u64) -> u64 {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let Some(&(t0, b0)) = samples.get(&uuid).and_then(|q| q.front()) else {
            return 0;
        };
        rate(b0, bytes_now, Instant::now().duration_since(t0))
    }
}

/// Bytes per second from `before` to `after` over `elapsed` (0 if the counter went backwards
/// or no time passed).
fn rate(before: u64, after: u64, elapsed: Duration) -> u64 {
    let secs = elapsed.as_secs_f64();
    if after < before || secs < 0.001 {
        return 0;
    }
    ((after - before) as f64 / secs) as u64
}

/// What writeback is doing on a volume, most pressing first: `paused` (writeback_running is
/// off; a detach still writes back), `failing` (writes to the backing device keep failing),
/// `idle` (no dirty data), `delayed` (dirty data younger than writeback_delay, below the
/// target), `running` (writing back; see the rate).
pub fn state(s: &DevStatus) -> &'static str {
    if s.state == "detaching" {
        "running"
    } else if !s.knobs.writeback_running {
        "paused"
    } else if s.writeback_error.is_some() {
        "failing"
    } else if s.dirty_bytes == 0 {
        "idle"
    } else if s.writeback == engine::policy::WritebackRate::Idle {
        "delayed"
    } else {
        "running"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_never_come_from_a_counter_that_went_back() {
        assert_eq!(rate(0, 10_000_000, Duration::from_secs(2)), 5_000_000);
        assert_eq!(rate(10, 5, Duration::from_secs(2)), 0);
        assert_eq!(rate(0, 5, Duration::ZERO), 0);
    }
}
