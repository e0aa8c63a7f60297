//! `engine`: the tiercache cache set — a crash-safe cache on a fast device in front of slow
//! backing devices.
//!
//! Layers inside, bottom first; a file imports only files below it (checked per file by
//! `crates/modgraph`'s test; `cargo run -p modgraph -- crates/engine` prints the graph):
//! - leaves: `types`, `units` (the numbering units: buckets, cache blocks, generations,
//!   backing blocks), `clock`, `codec`, `bitset`, `cost` (the online cost model), `seq`
//!   (stream detection), `readahead`;
//! - pure decisions and small state: `policy` (admission, replacement order, miss fill,
//!   writeback rate; driven alone by its tests), `admit` (the ghost history), `fillhits`,
//!   `knobs`, `degraded` (the degraded state's data), `rangelock`, `slots` (lock-free
//!   readable arrays), `unflushed` (client changes a backing device may still lose);
//! - state and its persistence: `index`, `alloc` (buckets, pins), `cachedev` (the cache
//!   device's timing and failures), `format`, `stats`, `journal`, `wbpool`, `checkpoint`;
//! - `state`: the shared state every mechanism works on (`Inner`, `State`, `Backing`,
//!   `Config`);
//! - mechanism: `guard`, `health` (stale copies, degrading, re-admission), `space`
//!   (allocation, reclaim, GC), `check`, `commit` (group commit, checkpoints), `writeback`,
//!   `background` (the threads), `io` (request paths: `io::plan` and `io::read` for reads,
//!   `io::absorb` and `io::write` for writes, `io::direct` the staged request's one shape;
//!   `io::lost` makes good what a failed backing flush may have lost);
//! - lifecycle: `set` (format, open and recovery, attach, detach, close); above it only
//!   `fuzzing`, whose entry points open a set.
//!
//! No sockets, no CLI parsing.
//!
//! The durability contract (see `docs/durability.md`): a write acknowledged without FUA may be
//! lost until the next flush; after `Volume::flush` returns, every write acknowledged before
//! it survives a crash of either device's volatile cache; a FUA write is durable when it
//! returns; a read never returns data that was not written.

mod admit;
mod alloc;
mod background;
mod bitset;
#[cfg(test)]
mod budget_test;
mod cachedev;
mod check;
mod checkpoint;
pub mod clock;
mod codec;
mod commit;
pub mod cost;
mod degraded;
mod fillhits;
pub mod format;
/// Fuzz entry points for the on-disk decoders (`fuzz/`, `tests/no_panic.rs`).
pub mod fuzzing;
pub mod guard;
mod health;
mod index;
mod io;
mod journal;
pub mod knobs;
mod owner;
pub mod policy;
mod rangelock;
mod readahead;
mod seq;
mod set;
mod slots;
mod space;
mod state;
pub mod stats;
mod types;
mod unflushed;
mod units;
mod wbpool;
mod writeback;

pub use check::{check_device, CheckReport};
pub use checkpoint::{load as load_metadata, Loaded};
pub use cost::DevCost;
pub use degraded::{Degraded, HealthReport};
pub use io::{
    Absorb, AroundRead, AroundWrite, Hit, Piece, ReadPlan, SlowRead, SlowWrite, Staged, Unstaged,
    Volume, WritePlan,
};
pub use knobs::{
    Knob, Tunables, DEFAULT_SEQUENTIAL_CUTOFF, DEFAULT_WRITEBACK_DELAY_SECS,
    DEFAULT_WRITEBACK_PERCENT,
};
pub use set::{
    check_format_backing, format_backing, AttachOptions, CacheSet, FormatOptions, MissingVolume,
    Occupancy, RecoveryReport,
};
pub use state::{
    Backing, Config, DevKnobs, DevStatus, WritebackError, DEFAULT_CACHE_IO_TIMEOUT_MS,
    DEFAULT_CONGESTED_READ_US, DEFAULT_CONGESTED_WRITE_US, DEFAULT_IO_ERROR_HALFLIFE,
    DEFAULT_IO_ERROR_LIMIT,
};
pub use types::{CacheMode, DevId, Error, Result};
/// The numbering units the public API (`policy`, `fuzzing`) speaks in.
pub use units::{BackingBlock, Bucket, CacheBlock, Gen};

/// The seed of a randomized test: `TIERCACHE_SEED` if set, else the clock; printed so a
/// failure can be replayed. Shared by the unit tests and `tests/common` (hence public, hidden).
#[doc(hidden)]
pub fn test_seed(test: &str) -> u64 {
    let seed = std::env::var("TIERCACHE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    eprintln!("{test}: seed={seed} (replay with TIERCACHE_SEED={seed})");
    seed
}
