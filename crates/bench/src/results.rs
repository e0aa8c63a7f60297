//! What a benchmark run measured, as plain data: one [`Row`] per workload step and
//! configuration, W6's [`Phase`]s, and the time [`Series`] sampled in a step. `report` turns
//! them into tables, ratios and charts; the workloads fill them.
//!
//! Invariant: data only (serialized as is into `results.json`); a ratio field is `None` until
//! `report::ratios` fills it from a reference row of the same run.

use super::procs::Disk;

/// One workload step run by one configuration.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Row {
    pub workload: String,
    pub step: String,
    pub config: String,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub mean_lat_us: f64,
    /// None where fio gives no percentile for the rows' span (W6's phases, which are
    /// differences of fio's cumulative reports).
    pub p99_lat_us: Option<f64>,
    pub hit_ratio_pct: Option<f64>,
    pub cache_written_mib: Option<f64>,
    pub seconds: f64,
    pub ratio_hdd: Option<f64>,
    pub ratio_ssd: Option<f64>,
    /// The slow disk the row ran on.
    pub disk: Disk,
    /// W6: which part of the run-until-steady the row covers.
    pub phase: Option<Phase>,
    /// Steps that ask for a flush after every write (`--fsync=1`): fio's syncs over its
    /// writes, i.e. NBD flushes per write (1.0 means one each).
    pub flushes_per_write: Option<f64>,
}

/// The parts of W6's run until steady.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// From the start to the first steady interval (the seconds column is the time to steady).
    WarmUp,
    /// The consecutive intervals that met the steadiness rule.
    Steady,
    /// The run reached its time cap without meeting the rule: its last intervals.
    NotSteady,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Series {
    pub workload: String,
    /// The step the series was sampled in.
    pub step: String,
    pub config: String,
    pub iops: Vec<(f64, f64)>,
    pub dirty_mib: Vec<(f64, f64)>,
    pub in_use_pct: Vec<(f64, f64)>,
}
