//! Client requests of one volume as the export layer sees them: counted, measured and timed
//! per operation and result.
//!
//! The result of a read or write is which devices served it, from this thread's device
//! [`Tally`] before and after the request (the engine does a request's device I/O on the
//! calling thread; see `device`):
//! - read: `hit` (no backing-device I/O: served from the cache), `miss` (the backing device
//!   was read and the data put in the cache), `bypass` (the backing device alone: a
//!   sequential stream past the cutoff, a congested or degraded cache, a miss not promoted);
//! - write: `writeback` (the cache device alone), `writethrough` (both), `bypass` (the
//!   backing device alone: writearound, the cutoff, the dirty limit, a partial block not
//!   cached);
//! - flush, trim, write_zeroes, cache (prefetch): `done`;
//! - any operation that failed: `error`.
//!
//! This is close to, but not the same as, the engine's own per-request classification
//! (bcache's `cache_hits`, `cache_misses`, `cache_bypass_*`, exported unchanged beside it): a
//! read that waited for another request to bring its blocks in is a miss to the engine and a
//! hit here; a bypassed read of cached blocks is a bypass hit there and a hit here.
//!
//! Invariants: every request ends in exactly one series (so the series of an operation add
//! up to its requests); the set of series is fixed (`SERIES`); recording allocates nothing.

use super::device::{tally, Tally};
use super::hist::{HistSnapshot, Histogram};
use serde::{Deserialize, Serialize};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Every (operation, result) pair a request can end in.
pub const SERIES: [(Op, &str); 16] = [
    (Op::Read, "hit"),
    (Op::Read, "miss"),
    (Op::Read, "bypass"),
    (Op::Read, "error"),
    (Op::Write, "writeback"),
    (Op::Write, "writethrough"),
    (Op::Write, "bypass"),
    (Op::Write, "error"),
    (Op::Flush, "done"),
    (Op::Flush, "error"),
    (Op::Trim, "done"),
    (Op::Trim, "error"),
    (Op::WriteZeroes, "done"),
    (Op::WriteZeroes, "error"),
    (Op::Cache, "done"),
    (Op::Cache, "error"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
            Op::Cache => "cache",
        }
    }
}

#[derive(Default, Debug)]
struct Series {
    latency: Histogram,
    bytes: AtomicU64,
}

/// The requests of one volume.
#[derive(Default, Debug)]
pub struct VolumeMetrics {
    series: [Series; SERIES.len()],
}

/// A request under way: when it started and the thread's tally then.
pub struct Timer {
    start: Instant,
    tally: Tally,
}

impl Timer {
    /// The same request's timer, continued on the calling thread (the tally is per thread:
    /// a request that moves to another thread is judged by what it did there).
    pub fn here(self) -> Timer {
        Timer {
            start: self.start,
            tally: tally(),
        }
    }
}

/// One series at one moment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SeriesSample {
    pub op: String,
    pub result: String,
    /// Bytes the requests asked for (0 for flush).
    pub bytes: u64,
    /// Completion times; its count is the number of requests.
    pub latency: HistSnapshot,
}

fn index(op: Op, result: &str) -> usize {
    SERIES
        .iter()
        .position(|&(o, r)| o == op && r == result)
        .expect("every (op, result) a request ends in is in SERIES")
}

/// Which devices served a read or write (see the module header).
fn result_of(op: Op, d: &Tally) -> &'static str {
    match op {
        Op::Read if d.backing_read == 0 => "hit",
        Op::Read if d.cache_written > 0 => "miss",
        Op::Read => "bypass",
        Op::Write => match (d.cache_written > 0, d.backing_written > 0) {
            (true, false) => "writeback",
            (true, true) => "writethrough",
            (false, _) => "bypass",
        },
        _ => "done",
    }
}

impl VolumeMetrics {
    pub fn start(&self) -> Timer {
        Timer {
            start: Instant::now(),
            tally: tally(),
        }
    }

    /// Records a finished request of `bytes` bytes (`t` started on this thread, or moved to
    /// it with [`Timer::here`]).
    pub fn finish<T>(&self, t: Timer, op: Op, bytes: u64, r: &io::Result<T>) {
        self.finish_as(t, op, bytes, r.is_ok());
    }

    /// [`VolumeMetrics::finish`] of a request that succeeded (`ok`) or failed.
    pub fn finish_as(&self, t: Timer, op: Op, bytes: u64, ok: bool) {
        let elapsed = t.start.elapsed();
        let result = if ok {
            result_of(op, &tally().since(&t.tally))
        } else {
            "error"
        };
        let s = &self.series[index(op, result)];
        s.latency.observe(elapsed);
        s.bytes.fetch_add(bytes, Relaxed);
    }

    pub fn sample(&self) -> Vec<SeriesSample> {
        SERIES
            .iter()
            .zip(&self.series)
            .map(|(&(op, result), s)| SeriesSample {
                op: op.name().to_string(),
                result: result.to_string(),
                bytes: s.bytes.load(Relaxed),
                latency: s.latency.snapshot(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(backing_read: u64, backing_written: u64, cache_written: u64) -> Tally {
        Tally {
            backing_read,
            backing_written,
            cache_read: 0,
            cache_written,
        }
    }

    #[test]
    fn results_follow_the_devices_that_served_the_request() {
        assert_eq!(result_of(Op::Read, &t(0, 0, 0)), "hit");
        assert_eq!(result_of(Op::Read, &t(4096, 0, 4096)), "miss");
        assert_eq!(result_of(Op::Read, &t(4096, 0, 0)), "bypass");
        assert_eq!(result_of(Op::Write, &t(0, 0, 4096)), "writeback");
        assert_eq!(result_of(Op::Write, &t(0, 4096, 4096)), "writethrough");
        assert_eq!(result_of(Op::Write, &t(0, 4096, 0)), "bypass");
        assert_eq!(result_of(Op::Flush, &t(0, 0, 0)), "done");
        for (op, r) in SERIES {
            assert_eq!(SERIES[index(op, r)], (op, r));
        }
    }

    #[test]
    fn every_request_lands_in_one_series() {
        let m = VolumeMetrics::default();
        m.finish(m.start(), Op::Read, 4096, &Ok(()));
        m.finish(
            m.start(),
            Op::Read,
            512,
            &Err::<(), _>(io::Error::other("x")),
        );
        m.finish(m.start(), Op::Flush, 0, &Ok(()));
        let s = m.sample();
        let find = |op: &str, r: &str| s.iter().find(|x| x.op == op && x.result == r).unwrap();
        assert_eq!(find("read", "hit").latency.count(), 1);
        assert_eq!(find("read", "hit").bytes, 4096);
        assert_eq!(find("read", "error").bytes, 512);
        assert_eq!(find("flush", "done").latency.count(), 1);
        assert_eq!(s.iter().map(|x| x.latency.count()).sum::<u64>(), 3);
    }
}
