//! The degraded state's data: whether and why the set is degraded (`Health`, `Degraded`),
//! what it cannot serve from the backing devices alone (`Uncertain`), and the report
//! `status` shows (`HealthReport`). The transitions and the rules they keep are in `health`,
//! which works on these through `state::Inner`.
//!
//! Invariants: see `health`; `Uncertain` only grows while the set is degraded (ranges merge
//! with their last neighbour, so a run of adjacent entries costs one range).

use crate::types::DevId;
use crate::units::BackingBlock;
use parking_lot::Mutex;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64};

/// Why and since when the set is degraded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Degraded {
    pub reason: String,
    /// Seconds since the Unix epoch.
    pub since_unix: u64,
}

/// The cache device's health as `status` shows it.
#[derive(Clone, Debug, Default)]
pub struct HealthReport {
    /// `Some` while the set serves its volumes from their backing devices.
    pub degraded: Option<Degraded>,
    /// Cache-device failures since open (I/O errors, timeouts, checksum mismatches).
    pub errors_total: u64,
    /// The decayed failure count compared with `io_error_limit`.
    pub error_count: f64,
    pub io_error_limit: u32,
    /// Recent cache-device latency (µs; 0: no recent sample).
    pub read_latency_us: u64,
    pub write_latency_us: u64,
    /// The cache device's cost model (see `cost`).
    pub cost: Option<crate::cost::DevCost>,
}

/// The set's health: degraded or not, and the lock that orders entering the state.
#[derive(Default)]
pub(crate) struct Health {
    pub(crate) degraded: AtomicBool,
    pub(crate) info: Mutex<Option<Degraded>>,
    /// Serializes entering and leaving the degraded state.
    pub(crate) transition: Mutex<()>,
    /// Cache-device failures the watchdog has already compared with the limit.
    pub(crate) errors_seen: AtomicU64,
}

/// What a degraded set cannot serve from the backing device alone: ranges that entries not
/// yet durable left less dirty in memory than on the cache device (a restart or re-admission
/// could bring an older dirty copy back there, so nothing may be written over them), and
/// devices with dirty data inserted or dropped by entries not yet durable (their flushes
/// cannot be honoured by flushing the backing device).
#[derive(Default, Debug)]
pub(crate) struct Uncertain {
    pub(crate) ranges: Vec<(DevId, BackingBlock, BackingBlock)>,
    pub(crate) unsafe_devs: BTreeSet<DevId>,
}

impl Uncertain {
    pub fn note_dirty(&mut self, dev: DevId) {
        self.unsafe_devs.insert(dev);
    }

    pub fn note_less_dirty(
        &mut self,
        dev: DevId,
        b0: BackingBlock,
        b1: BackingBlock,
        dropped: bool,
    ) {
        if dropped {
            self.unsafe_devs.insert(dev);
        }
        if let Some(last) = self.ranges.last_mut() {
            if last.0 == dev && last.1 <= b1 && b0 <= last.2 {
                last.1 = last.1.min(b0);
                last.2 = last.2.max(b1);
                return;
            }
        }
        self.ranges.push((dev, b0, b1));
    }

    pub(crate) fn overlaps(&self, dev: DevId, b0: BackingBlock, b1: BackingBlock) -> bool {
        self.ranges
            .iter()
            .any(|&(d, r0, r1)| d == dev && r0 < b1 && b0 < r1)
    }

    pub(crate) fn is_unsafe(&self, dev: DevId) -> bool {
        self.unsafe_devs.contains(&dev)
    }
}
