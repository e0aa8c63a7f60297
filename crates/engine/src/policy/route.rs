//! Where a request goes: the reasons for going around the cache ([`Bypass`]), read
//! admission ([`read_bypass`]) and the route of a write ([`route_write`]).
//!
//! Invariant: pure; the same inputs give the same decisions.

use crate::types::CacheMode;

/// Why a request, or a part of it, went around the cache. Each reason has its own counter of
/// bytes (`stats`: `bypassed_<reason>`), and `bypassed` (bcache's name) is their sum.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Bypass {
    /// A sequential stream past `sequential_cutoff` (bcache's rule).
    Sequential,
    /// The cache mode sends it around: writes in writearound and none, reads in none.
    Mode,
    /// Writeback with dirty data at `dirty_max_pct` of the cache.
    DirtyLimit,
    /// No room in the cache for it (every bucket pinned, dirty or being written).
    Full,
    /// The cache device is slower than its congestion threshold and than the backing device.
    Congested,
    /// A write of part of a block that is not cached (caching it would need a read first).
    Partial,
    /// The volume is being detached.
    Detaching,
    /// Zeroes (NBD_CMD_WRITE_ZEROES) go down as a zeroing command, never through the cache.
    Zeroes,
    /// A read miss the admission filter kept out of a full cache ([`admit_miss`]).
    Admission,
}

/// Whether a read's misses are promoted into the cache (read admission), or why not: not in
/// mode `None`, and not for a sequential stream past the cutoff (bcache's rule: the cache is
/// for random I/O).
pub fn read_bypass(mode: CacheMode, sequential: bool) -> Option<Bypass> {
    if mode == CacheMode::None {
        Some(Bypass::Mode)
    } else if sequential {
        Some(Bypass::Sequential)
    } else {
        None
    }
}

/// Where a write goes (write admission).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum WriteRoute {
    /// To the backing device only (what the cache held for it is dropped), and why.
    Bypass(Bypass),
    /// To the backing device and the cache (clean).
    Through,
    /// To the cache only (dirty, written back later).
    Back,
}

/// A write, as the route decision sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteShape {
    /// Part of a sequential stream past the cutoff.
    pub sequential: bool,
    /// Other streams past the cutoff run at the same time (`SeqDetector::concurrent`): the
    /// disk would seek between them.
    pub interleaved: bool,
    /// The client waits for it to be durable (FUA).
    pub sync: bool,
    /// Its stream reaches the disk out of order, and the disk is measured to pay positioning
    /// for requests a little off where the previous one ended (`near_requests_seek`).
    pub reordered: bool,
}

/// The route of a write: around the cache while the device is being detached and in
/// writearound/none modes; in writeback mode around it once dirty data fills `dirty_max_pct`
/// % of the cache (`dirty_blocks` is asked only then, or for a sequential write, as it costs
/// a lock). A sequential stream past the cutoff goes around the cache when the disk serves it
/// well: in writeback mode, a sequential write of one of several streams running at once
/// (`interleaved`: one actuator seeks between them) or one the disk would make durable at the
/// cost of a flush each (`sync`) is absorbed by the cache under the same dirty limit as other
/// writes (bcache absorbs sync writes only below 70 % in use, `cutoff_writeback_sync`;
/// measured on W4's interleaved streams, that cut left them at 3.0× the disk against 4.3×).
pub fn route_write(
    mode: CacheMode,
    detaching: bool,
    shape: WriteShape,
    dirty_max_pct: u32,
    total_blocks: u64,
    dirty_blocks: impl FnOnce() -> u64,
) -> WriteRoute {
    if detaching {
        return WriteRoute::Bypass(Bypass::Detaching);
    }
    let under = |pct: u32, dirty: u64| dirty * 100 < total_blocks * u64::from(pct);
    match mode {
        CacheMode::Writearound | CacheMode::None => WriteRoute::Bypass(Bypass::Mode),
        CacheMode::Writeback if shape.sequential => {
            if (shape.sync || shape.interleaved || shape.reordered)
                && under(dirty_max_pct, dirty_blocks())
            {
                WriteRoute::Back
            } else {
                WriteRoute::Bypass(Bypass::Sequential)
            }
        }
        _ if shape.sequential => WriteRoute::Bypass(Bypass::Sequential),
        CacheMode::Writethrough => WriteRoute::Through,
        CacheMode::Writeback => {
            if under(dirty_max_pct, dirty_blocks()) {
                WriteRoute::Back
            } else {
                WriteRoute::Bypass(Bypass::DirtyLimit)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_admitted_unless_sequential_or_mode_none() {
        assert_eq!(read_bypass(CacheMode::Writeback, false), None);
        assert_eq!(read_bypass(CacheMode::Writearound, false), None);
        assert_eq!(
            read_bypass(CacheMode::Writethrough, true),
            Some(Bypass::Sequential)
        );
        assert_eq!(read_bypass(CacheMode::None, false), Some(Bypass::Mode));
        assert_eq!(read_bypass(CacheMode::None, true), Some(Bypass::Mode));
    }

    #[test]
    fn writes_route_by_mode_stream_detach_and_dirty_share() {
        let never = || -> u64 { panic!("dirty count asked outside writeback") };
        let seq = |sequential: bool| WriteShape {
            sequential,
            ..WriteShape::default()
        };
        let r = |m, det, sequential| route_write(m, det, seq(sequential), 70, 100, never);
        assert_eq!(
            r(CacheMode::Writethrough, false, false),
            WriteRoute::Through
        );
        let around = WriteRoute::Bypass;
        assert_eq!(
            r(CacheMode::Writearound, false, false),
            around(Bypass::Mode)
        );
        assert_eq!(r(CacheMode::None, false, false), around(Bypass::Mode));
        assert_eq!(
            r(CacheMode::Writethrough, false, true),
            around(Bypass::Sequential)
        );
        assert_eq!(
            r(CacheMode::Writeback, true, false),
            around(Bypass::Detaching)
        );
        let wb = |dirty| route_write(CacheMode::Writeback, false, seq(false), 70, 100, || dirty);
        assert_eq!(wb(69), WriteRoute::Back);
        assert_eq!(wb(70), around(Bypass::DirtyLimit));
    }

    #[test]
    fn writeback_absorbs_sequential_writes_the_disk_would_not_serve_as_a_stream() {
        let wb = |shape, dirty_pct: u64| {
            route_write(CacheMode::Writeback, false, shape, 90, 100, || dirty_pct)
        };
        let shape = |interleaved, sync| WriteShape {
            sequential: true,
            interleaved,
            sync,
            reordered: false,
        };
        // One stream the disk follows: around the cache, as bcache does.
        assert_eq!(
            wb(shape(false, false), 0),
            WriteRoute::Bypass(Bypass::Sequential)
        );
        // Interleaved streams (the disk seeks between them), or a flush per write: absorbed
        // under the dirty limit.
        assert_eq!(wb(shape(true, false), 89), WriteRoute::Back);
        assert_eq!(wb(shape(false, true), 89), WriteRoute::Back);
        assert_eq!(
            wb(shape(true, false), 90),
            WriteRoute::Bypass(Bypass::Sequential)
        );
        // A stream that reaches a disk out of order where that costs it seeks: the same.
        let reordered = WriteShape {
            reordered: true,
            ..shape(false, false)
        };
        assert_eq!(wb(reordered, 89), WriteRoute::Back);
        assert_eq!(wb(reordered, 90), WriteRoute::Bypass(Bypass::Sequential));
        // The dirty limit is the knob's.
        let low = route_write(
            CacheMode::Writeback,
            false,
            shape(true, true),
            50,
            100,
            || 60,
        );
        assert_eq!(low, WriteRoute::Bypass(Bypass::Sequential));
        // Other modes: a stream is a stream.
        let wt = route_write(
            CacheMode::Writethrough,
            false,
            shape(true, true),
            90,
            100,
            || panic!("dirty count asked outside writeback"),
        );
        assert_eq!(wt, WriteRoute::Bypass(Bypass::Sequential));
    }
}
