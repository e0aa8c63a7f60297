//! What the hits workload measures, as data: each scale's sizes ([`Params`]), the shape of
//! each row ([`Shape`]: the read rows, the writeback row, the passthrough rows), the columns'
//! keys, and what a run found ([`Measured`]: its points, rows and the CPUs it fixed). The
//! runner (the parent module) fills them; `table` writes them out.
//!
//! Invariant: data and pure functions only; a column key names one server in every table and
//! in `hits.json`.

use crate::fio;
use crate::Scale;
use serde::Serialize;
use std::collections::BTreeMap;

/// Bucket size of the cache (`make`'s default).
pub(super) const BUCKET: u64 = 512 << 10;

/// Sizes and step length of one scale.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Params {
    /// The cached region of the export (reads), and the region read and written around the
    /// cache (passthrough).
    pub(super) region_bytes: u64,
    /// The region written in writeback (once per tiercache column), a quarter of the other.
    pub(super) write_bytes: u64,
    /// The cache file: the region, room for two passes of writeback writes, and 16 MiB, so
    /// nothing is evicted.
    pub(super) cache_bytes: u64,
    /// The backing file: two regions (read, passthrough), the written one, and 1 MiB for
    /// tiercache's header.
    pub(super) backing_bytes: u64,
    /// The cache file of the tiercache in front of the NBD export (passthrough only).
    pub(super) remote_cache_bytes: u64,
    pub(super) step_ms: u64,
}

pub(super) fn params(scale: Scale) -> Params {
    let (region, step_ms) = match scale {
        Scale::Tiny => (16 << 20, 500),
        Scale::Quick => (256 << 20, 5000),
        Scale::Full => (1 << 30, 30_000),
    };
    let write = region / 4;
    Params {
        region_bytes: region,
        write_bytes: write,
        cache_bytes: region + 2 * write + (16 << 20),
        backing_bytes: 2 * region + write + (1 << 20),
        remote_cache_bytes: 32 << 20,
        step_ms,
    }
}

/// Where the server and fio run during a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Place {
    /// Wherever the kernel's scheduler puts them (a sync wake-up of one by the other tends
    /// to pull both onto one CPU).
    Scheduler,
    /// The server's threads on one CPU, fio on another (a client in a VM on its own cores).
    Apart,
    /// Both on one CPU.
    Together,
}

/// The shape of one fio run: a row of a table.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct Shape {
    pub(super) row: &'static str,
    pub(super) rw: &'static str,
    pub(super) bs: &'static str,
    /// fio jobs: with the nbd engine, each its own connection.
    pub(super) numjobs: u32,
    /// Queue depth per job.
    pub(super) iodepth: u32,
    pub(super) place: Place,
}

impl Shape {
    pub(super) const fn new(
        row: &'static str,
        rw: &'static str,
        bs: &'static str,
        jobs: u32,
        qd: u32,
    ) -> Self {
        Shape {
            row,
            rw,
            bs,
            numjobs: jobs,
            iodepth: qd,
            place: Place::Scheduler,
        }
    }

    pub(super) const fn placed(self, row: &'static str, place: Place) -> Self {
        Shape { row, place, ..self }
    }

    /// Reported in IOPS (4 KiB) rather than bandwidth.
    pub(super) fn small(&self) -> bool {
        self.bs == "4k"
    }
}

pub(super) const QD32: Shape = Shape::new("QD32, 1 connection", "randread", "4k", 1, 32);
/// The rows of the read table. QD32 on one connection is also run with the CPUs fixed: which
/// CPUs the scheduler picks moves it by half (see `docs/benchmarks.md`).
pub(super) const READ_ROWS: [Shape; 6] = [
    Shape::new("QD1, 1 connection", "randread", "4k", 1, 1),
    QD32,
    QD32.placed(
        "QD32, 1 connection, server and fio on two CPUs",
        Place::Apart,
    ),
    QD32.placed(
        "QD32, 1 connection, server and fio on one CPU",
        Place::Together,
    ),
    Shape::new("4 connections × QD8", "randread", "4k", 4, 8),
    Shape::new(
        "128 KiB sequential, QD8, 1 connection",
        "read",
        "128k",
        1,
        8,
    ),
];
/// The writeback writes.
pub(super) const WRITE_ROW: Shape = Shape::new(
    "4 KiB random writes, QD32, 1 connection",
    "randwrite",
    "4k",
    1,
    32,
);
/// The passthrough rows.
pub(super) const PASS_READ: Shape = Shape::new("4 KiB random reads, QD1", "randread", "4k", 1, 1);
pub(super) const PASS_WRITE: Shape =
    Shape::new("4 KiB random writes, QD1", "randwrite", "4k", 1, 1);

/// Column keys (JSON) of the read and write tables.
pub(super) const TC: &str = "tiercache";
pub(super) const TC_THREADS: &str = "tiercache_threads";
pub(super) const KIT_FILE: &str = "nbdkit_file";
pub(super) const QEMU: &str = "qemu_nbd";
pub(super) const KIT_MEM: &str = "nbdkit_memory";
pub(super) const RAW: &str = "raw";

/// One fio run, and the server's CPU time over it.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Point {
    #[serde(flatten)]
    pub(super) fio: fio::Measured,
    /// Server utime + stime over the run / I/Os (None: no server, i.e. fio on the file).
    pub(super) server_cpu_us_per_io: Option<f64>,
    pub(super) command: String,
}

/// A column of the read table, in order.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Column {
    pub(super) key: &'static str,
    pub(super) name: String,
}

/// One row of the read table.
#[derive(Clone, Debug, Serialize)]
pub(super) struct ReadRow {
    #[serde(flatten)]
    pub(super) shape: Shape,
    /// fio's figures by column key, for the columns that ran.
    pub(super) points: BTreeMap<&'static str, Point>,
    /// Per tiercache column: hits / (hits + misses) over its run, from its stats, and misses.
    pub(super) hit_pct: BTreeMap<&'static str, f64>,
    pub(super) misses: BTreeMap<&'static str, u64>,
    /// tiercache's IOPS over each other column's (the bandwidth ratio too: same block size).
    pub(super) tiercache_over: BTreeMap<&'static str, f64>,
}

/// One server of the writeback write table.
#[derive(Clone, Debug, Serialize)]
pub(super) struct WriteRow {
    pub(super) key: &'static str,
    pub(super) server: String,
    pub(super) point: Option<Point>,
    /// This IOPS / raw IOPS.
    pub(super) over_raw: Option<f64>,
    /// tiercache: its dirty bytes after the run, from its stats.
    pub(super) dirty_after_bytes: Option<u64>,
}

/// One row of the passthrough table: tiercache against its backing device alone.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PassRow {
    pub(super) backing: &'static str,
    #[serde(flatten)]
    pub(super) shape: Shape,
    pub(super) tiercache_mode: &'static str,
    /// fio on the backing device itself.
    pub(super) alone: Option<Point>,
    pub(super) tiercache: Option<Point>,
    /// tiercache's mean and p50 latency minus the device's, µs.
    pub(super) added_mean_us: Option<f64>,
    pub(super) added_p50_us: Option<f64>,
}

/// One NBD file server against tiercache's local writearound write.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PeerRow {
    pub(super) server: String,
    pub(super) point: Point,
    /// tiercache's mean latency minus this one's, µs.
    pub(super) tiercache_minus_us: f64,
}

/// The CPUs of the rows that fix them.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Cpus {
    /// The server's, and raw fio's: of the first two CPUs this process may use, the one where
    /// fio on the cache file alone (QD32 random reads) ran faster (the device's completions
    /// are handled on one CPU; a thread that waits for them elsewhere pays a wake-up across).
    pub(super) server: usize,
    /// fio's over NBD in the "two CPUs" rows (None: a machine with one CPU).
    pub(super) client: Option<usize>,
    /// That probe: (CPU, raw IOPS).
    pub(super) probe: Vec<(usize, f64)>,
}

/// What the workload measured.
pub(super) struct Measured {
    pub(super) cached_after_warm: u64,
    pub(super) cpus: Cpus,
    pub(super) columns: Vec<Column>,
    pub(super) reads: Vec<ReadRow>,
    pub(super) writes: Vec<WriteRow>,
    pub(super) passthrough: Vec<PassRow>,
    pub(super) peers: Vec<PeerRow>,
}
