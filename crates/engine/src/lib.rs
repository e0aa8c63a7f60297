//! `engine`: the tiercache cache set — a crash-safe cache on a fast device in front of slow
//! backing devices.
//!
//! Layers inside (dependencies point down): `set`/`io`/`background` (mechanism) use `index`,
//! `alloc`, `journal`, `checkpoint`, `format` (state and its persistence), `policy` (pure
//! decisions), `stats`, `rangelock`, `clock`, `codec`. No sockets, no CLI parsing.
//!
//! The durability contract (see `docs/durability.md`): a write acknowledged without FUA may be
//! lost until the next flush; after `Volume::flush` returns, every write acknowledged before
//! it survives a crash of either device's volatile cache; a FUA write is durable when it
//! returns; a read never returns data that was not written.

mod alloc;
mod background;
mod check;
mod checkpoint;
pub mod clock;
mod codec;
pub mod format;
pub mod guard;
mod index;
mod io;
mod journal;
pub mod knobs;
pub mod policy;
mod rangelock;
mod readahead;
mod set;
pub mod stats;
mod types;

pub use check::{check_device, CheckReport};
pub use checkpoint::{load as load_metadata, Loaded};
pub use io::Volume;
pub use knobs::{
    Knob, Tunables, DEFAULT_SEQUENTIAL_CUTOFF, DEFAULT_WRITEBACK_DELAY_SECS,
    DEFAULT_WRITEBACK_PERCENT,
};
pub use set::{
    format_backing, Backing, CacheSet, Config, DevKnobs, DevStatus, FormatOptions, Occupancy,
    RecoveryReport,
};
pub use types::{CacheMode, DevId, Error, Result};
