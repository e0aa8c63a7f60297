//! [`Sample`]: everything a running server measures, at one moment, as plain data — the set
//! ([`SetSample`]), each volume ([`VolumeSample`], its writeback [`WritebackSample`]), each
//! device and each NBD listener ([`ListenerSample`]). The parent module takes it; `prom`
//! renders it for Prometheus and the admin request `metrics` returns it as JSON.
//!
//! Invariants: data only, serializable both ways (`top` reads it back from the JSON); the
//! state names a gauge family enumerates ([`VOLUME_STATES`], [`WRITEBACK_STATES`]) are the
//! only values the matching `state` fields take.

use super::device::DeviceSample;
use super::volume::SeriesSample;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Everything a server measures, at one moment (the admin request `metrics` returns it as
/// JSON; `/metrics` renders it for Prometheus).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the server started (monotonic: rates divide by its differences).
    pub uptime_seconds: f64,
    /// Upper bounds of every histogram's finite buckets (µs); one more bucket is +Inf.
    pub bucket_bounds_us: Vec<u64>,
    pub cache_set: Option<SetSample>,
    /// Why the server runs without its cache device, if it does.
    pub without_cache: Option<String>,
    pub volumes: Vec<VolumeSample>,
    pub devices: Vec<DeviceSample>,
    pub listeners: Vec<ListenerSample>,
    /// Where `/metrics` is served (`serve --metrics`).
    pub metrics_address: Option<String>,
}

/// The cache set: occupancy (bcache's priority_stats), health, counters summed over volumes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SetSample {
    pub uuid: String,
    pub total_bytes: u64,
    pub unused_bytes: u64,
    pub clean_bytes: u64,
    pub dirty_bytes: u64,
    pub metadata_bytes: u64,
    pub in_use_pct: u32,
    /// Backing devices the set holds data for that are not attached (`status` lists them).
    #[serde(default)]
    pub missing_volumes: u64,
    /// Their dirty data: held only in the cache until they are attached.
    #[serde(default)]
    pub missing_dirty_bytes: u64,
    /// Why the set is degraded, while it is.
    pub degraded: Option<String>,
    pub errors_total: u64,
    pub error_count: f64,
    pub io_error_limit: u32,
    pub read_latency_us: u64,
    pub write_latency_us: u64,
    pub counters: BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeSample {
    pub name: String,
    pub uuid: String,
    pub backing_device: Option<String>,
    pub size_bytes: u64,
    /// `clean`, `dirty`, `detaching` or `degraded`.
    pub state: String,
    pub cache_mode: String,
    pub dirty_bytes: u64,
    pub cached_bytes: u64,
    pub writeback: WritebackSample,
    /// The engine's counters since the volume was attached (bcache's names).
    pub counters: BTreeMap<String, u64>,
    /// Client requests by operation and result (see `volume`).
    pub requests: Vec<SeriesSample>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WritebackSample {
    /// The `writeback_running` knob.
    pub running: bool,
    /// `idle`, `N%` (of a busy backing device's time) or `full`.
    pub rate: String,
    /// The same as a fraction: 0 idle, 1 full.
    pub share: f64,
    /// The last writeback failure, while writeback keeps failing.
    pub error: Option<String>,
    /// Writeback passes failed in a row.
    pub failures: u32,
    /// The writeback state `status` shows (`writeback_meter::state`): `paused`, `failing`,
    /// `idle` (nothing dirty), `delayed` or `running`.
    #[serde(default)]
    pub status: String,
}

impl WritebackSample {
    /// One word: `paused`, `failing`, `idle`, `active` or `full`.
    pub fn state(&self) -> &'static str {
        if !self.running {
            "paused"
        } else if self.error.is_some() {
            "failing"
        } else if self.share >= 1.0 {
            "full"
        } else if self.share > 0.0 {
            "active"
        } else {
            "idle"
        }
    }
}

/// Writeback states, as `WritebackSample::state` names them.
pub const WRITEBACK_STATES: [&str; 5] = ["idle", "active", "full", "paused", "failing"];
/// Volume states, as `Volume::status` names them.
pub const VOLUME_STATES: [&str; 4] = ["clean", "dirty", "detaching", "degraded"];

/// One NBD listener's connections (`server::ServerStats`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ListenerSample {
    pub listener: String,
    pub connections: u64,
    pub connections_max: u64,
    pub refused: u64,
    pub evicted: u64,
    #[serde(default)]
    pub displaced: u64,
    pub idle_closed: u64,
    pub bytes_in_flight: u64,
    pub workers_extra: u64,
    /// Event-loop threads of the io_uring data path (0: threads serve every connection).
    #[serde(default)]
    pub ring_threads: u64,
    /// Reads served by the io_uring data path's own cache-device reads.
    #[serde(default)]
    pub direct_reads: u64,
    /// Writes absorbed by the io_uring data path's own cache-device writes.
    #[serde(default)]
    pub direct_writes: u64,
}

impl ListenerSample {
    pub(super) fn of(name: &str, s: &server::ServerStats) -> ListenerSample {
        ListenerSample {
            listener: name.to_string(),
            connections: s.connections as u64,
            connections_max: s.connections_max as u64,
            refused: s.connections_refused,
            evicted: s.connections_evicted,
            displaced: s.connections_displaced,
            idle_closed: s.connections_idle_closed,
            bytes_in_flight: s.bytes_in_flight as u64,
            workers_extra: s.workers_extra as u64,
            ring_threads: s.ring_threads as u64,
            direct_reads: s.direct_reads,
            direct_writes: s.direct_writes,
        }
    }
}
