//! The policy seam: every decision the engine makes about *what* to cache and *when* to work,
//! as pure functions and state machines it calls (as dm-cache separates policy from target).
//! Admission: sequential stream detection ([`SeqDetector`], from `seq`), [`read_bypass`],
//! [`route_write`] (each way around the cache has its [`Bypass`] reason); the miss fill
//! ([`miss_fill_window`], [`span_holes`]; both read the backing device's `cost` model);
//! admission of misses into a full cache ([`admit_miss`], from the set's shared history,
//! [`SetPolicy`]); replacement ([`reclaim_rank`], from the order's state, [`ReplacementOrder`]); the
//! writeback rate ([`writeback_rate`]). The tests here drive each one alone.
//!
//! Invariants: the same inputs give the same decisions (no I/O, no clock of their own: time
//! is passed in). Stream detection is `seq`'s, re-exported here.

pub use crate::seq::{
    is_sequential_bypass, Seen, SeqDetector, SEQ_REORDERED_WITHIN, SEQ_REORDER_NS,
    SEQ_REORDER_REQUESTS, SEQ_SLOTS, SEQ_WINDOW_NS, STREAM_OVERLAP_NS,
};

mod admission;
mod fill;
mod replacement;
mod route;
mod shared;
mod volume;
mod writeback;

pub use admission::*;
pub use fill::*;
pub use replacement::*;
pub use route::*;
pub use shared::SetPolicy;
pub use volume::{
    Decisions, Measured, MissFacts, MissPlan, MissRead, ReadRoute, ReadRouting, RouteFacts,
    VolumePolicy, WriteRouting, READAHEAD_AFTER_BYTES,
};
pub use writeback::*;
