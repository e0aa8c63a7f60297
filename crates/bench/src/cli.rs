//! The command line of `tiercache bench`: what a run runs ([`BenchArgs`]; how big,
//! [`Scale`], is the catalogue's).

use crate::catalogue::Scale;
use crate::scale;
use std::path::PathBuf;

/// Options of `tiercache bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// How big and long: tiny (smoke), quick (minutes), full (long).
    #[arg(long, value_enum, default_value = "quick")]
    pub(crate) scale: Scale,
    /// Workloads to run, comma separated (W1..W7; default all), or `scale` alone: the engine
    /// at real size (the --scale-* options; writes scale.md and scale.json), or `hits` alone:
    /// cached reads, writeback writes and passthrough I/O against fio on the file, nbdkit
    /// memory, qemu-nbd and nbdkit file (sized by --scale; writes hits.md and hits.json).
    #[arg(long, value_delimiter = ',')]
    pub(crate) workloads: Vec<String>,
    /// Configurations, comma separated, each run on every selected workload (default: hdd,
    /// ssd, tiercache-writethrough, tiercache-writeback, tiercache-writearound, nbdkit-cache,
    /// plus tiercache-writeback+memlimit and nbdkit-cache+memlimit on W1, W5 and W6, and hdd,
    /// tiercache-writethrough, tiercache-writeback and nbdkit-cache +nonrot on W1 and W5).
    /// NAME+memlimit runs NAME with every server process in a memory cgroup; NAME+nonrot runs
    /// it over the emulated disk started with --rotational false (compared with hdd+nonrot).
    #[arg(long, value_delimiter = ',')]
    pub(crate) configs: Vec<String>,
    /// An extra argument for every `tiercache serve` of the tiercache-* configurations, to
    /// compare settings (repeat it: --serve-arg=--replacement=fifo
    /// --serve-arg=--admission=all).
    #[arg(long = "serve-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) serve_args: Vec<String>,
    /// An extra argument for every `tiercache make` of the tiercache-* configurations (repeat
    /// it: --make-arg=--bucket-size=64K).
    #[arg(long = "make-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) make_args: Vec<String>,
    /// Memory limit in MiB, page cache included, of each server process of a +memlimit
    /// configuration (default: half the cache size, at least 64 MiB; 0 leaves them out).
    #[arg(long = "mem-limit", value_name = "MiB")]
    pub(crate) mem_limit: Option<u64>,
    /// Longest W6 runs waiting for a steady state, in seconds (default: the scale's; 40 s at
    /// quick, where the 128 MiB caches fill in about 25 s).
    #[arg(long = "w6-cap", value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(4..=3600))]
    pub(crate) w6_cap: Option<u64>,
    /// W6's steady window, in intervals (default: the scale's; 4 at quick). A longer window
    /// with --w6-warm-min measures a later, steadier state than quick's.
    #[arg(long = "w6-intervals", value_name = "N", value_parser = clap::value_parser!(u64).range(1..=600))]
    pub(crate) w6_intervals: Option<u64>,
    /// Seconds before which no W6 window of a configuration with a cache starts (default: the
    /// scale's; 25 s at quick).
    #[arg(long = "w6-warm-min", value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub(crate) w6_warm_min: Option<u64>,
    /// Directory for results.md, results.json, plots and scratch devices.
    #[arg(long, default_value = "bench-results")]
    pub(crate) out: PathBuf,
    #[command(flatten)]
    pub(crate) scale_workload: scale::ScaleArgs,
}
