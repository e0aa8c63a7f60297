//! The policy seam: every decision the engine makes about *what* to cache and *when* to work,
//! as pure functions and state machines it calls (as dm-cache separates policy from target).
//! Admission: sequential stream detection ([`SeqDetector`], from `seq`), [`read_bypass`],
//! [`route_write`] (each way around the cache has its [`Bypass`] reason); the miss fill
//! ([`miss_fill_window`], [`span_holes`]; both read the backing device's `cost` model);
//! admission of misses into a full cache ([`admit_miss`]); replacement ([`reclaim_rank`]); the
//! writeback rate ([`writeback_rate`]). The tests here drive each one alone.
//!
//! Invariants: the same inputs give the same decisions (no I/O, no clock of their own: time
//! is passed in). Stream detection is `seq`'s, re-exported here.

use crate::cost::CostEstimate;
pub use crate::seq::{
    is_sequential_bypass, Seen, SeqDetector, SEQ_REORDERED_WITHIN, SEQ_REORDER_NS,
    SEQ_REORDER_REQUESTS, SEQ_SLOTS, SEQ_WINDOW_NS, STREAM_OVERLAP_NS,
};
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

/// The most a miss fill reads around a miss.
pub const MISS_FILL_MAX_BYTES: u64 = 256 << 10;
/// The fill tried while the backing device's cost per byte is still unknown (every other
/// miss, so the model sees two lengths and can tell transfer from fixed cost), and the one
/// that keeps measuring the fills' benefit while it says filling does not pay.
pub const MISS_FILL_EXPLORE_BYTES: u64 = 64 << 10;
/// While the fills' benefit says they do not pay, one miss in this many still fills
/// `MISS_FILL_EXPLORE_BYTES` (else nothing would measure a workload that changed).
pub const MISS_FILL_EXPLORE_EVERY: u64 = 16;
/// Positioning below this is not taken for positioning by `seek_bound` (noise of the fit).
pub const SEEK_FLOOR_NS: f64 = 50_000.0;

/// Whether a device is measured to pay positioning for a request that starts a little off
/// (up to 64 KiB) from where the previous one ended: a stream that reaches it out of order
/// then pays a seek for most requests (a disk without a write cache, a model serving requests
/// in arrival order). Unmeasured: no.
pub fn near_requests_seek(est: &CostEstimate) -> bool {
    est.seek_by_bucket[1].is_some_and(|s| s >= SEEK_FLOOR_NS && s >= est.fixed_ns / 4.0)
}

/// Whether the model says positioning matters on a device.
pub fn seek_bound(est: &CostEstimate) -> bool {
    est.seek_ns >= SEEK_FLOOR_NS && est.seek_ns >= est.fixed_ns / 4.0
}

/// The share of filled blocks assumed read later before `MIN_RESOLVED` outcomes are known
/// (see `fillhits`): enough for a full window where a miss costs far more than a hit (a disk),
/// a quarter window where it costs a little more (flash behind a faster cache); either at
/// most `MISS_FILL_EXPLORE_BYTES` until measured.
pub const FILL_HITS_PRIOR: f64 = 0.1;

/// What the cache device costs a miss fill: a read of a block from it (what a hit on a filled
/// block costs instead of a miss) and its write cost per byte (the fill's promotion).
#[derive(Clone, Copy, Debug)]
pub struct CacheCosts {
    pub read: CostEstimate,
    pub write_per_byte_ns: f64,
}

/// The share of filled blocks that must be read later for a fill to pay: a filled block costs
/// its transfer from the backing device and its write to the cache now, and saves, when read,
/// a later miss's fixed, positioning and transfer cost less a hit's. 1 (never) when a hit
/// saves nothing.
pub fn fill_breakeven(backing: &CostEstimate, cache: &CacheCosts, block_size: u64) -> f64 {
    let bs = block_size as f64;
    let p = backing.per_byte_ns.unwrap_or(0.0);
    let cost = bs * (p + cache.write_per_byte_ns);
    let saved = backing.time_ns(block_size, u64::MAX) - cache.read.time_ns(block_size, u64::MAX);
    if saved <= cost {
        1.0
    } else {
        cost / saved
    }
}

/// The miss-fill window in blocks (1: no fill), from the backing device's read cost model, the
/// cache device's costs and the measured share of filled blocks read later (`fill_hits`,
/// `None` before enough fills).
///
/// By cost: a miss pays the device's fixed and positioning cost once, so its uncached
/// neighbours come along up to where their extra transfer costs as much as that (what a later
/// miss on them would pay), at most `MISS_FILL_MAX_BYTES`; nothing where transfer dominates.
/// The fixed cost counts, not only the positioning the model could tell apart: a disk seen
/// only at random offsets has its seeks in its fixed cost. The cost per byte used is the
/// model's low bound, so an uncertain slope (positioning noise) does not shrink the window.
/// By benefit: the whole window while `fill_hits` (or `FILL_HITS_PRIOR`, then at most
/// `MISS_FILL_EXPLORE_BYTES`: a wrong guess costs little) is at least 4×
/// `fill_breakeven`, a quarter of it between 1× and 4×, and below that nothing but one
/// `MISS_FILL_EXPLORE_BYTES` fill every `MISS_FILL_EXPLORE_EVERY` misses (while a hit saves
/// anything at all).
/// `miss_no` counts misses: while the cost per byte is unknown, every other miss tries
/// `MISS_FILL_EXPLORE_BYTES`. The window is a power of two.
pub fn miss_fill_window(
    backing: &CostEstimate,
    cache: &CacheCosts,
    fill_hits: Option<f64>,
    block_size: u64,
    miss_no: u64,
) -> u64 {
    let explore = || {
        if MISS_FILL_EXPLORE_BYTES > block_size {
            MISS_FILL_EXPLORE_BYTES
        } else {
            0
        }
    };
    let miss_cost = backing.fixed_ns + backing.seek_ns;
    let breakeven = fill_breakeven(backing, cache, block_size);
    let bytes = match backing.per_byte_low_ns {
        _ if breakeven >= 1.0 && backing.per_byte_ns.is_some() => 0,
        None if miss_no.is_multiple_of(2) => explore(),
        None => 0,
        Some(p) => {
            let cap = if p > 0.0 {
                (miss_cost / p).min(MISS_FILL_MAX_BYTES as f64) as u64
            } else {
                MISS_FILL_MAX_BYTES
            };
            let by_benefit = match fill_hits.unwrap_or(FILL_HITS_PRIOR) {
                h if h >= 4.0 * breakeven => cap,
                h if h >= breakeven => cap / 4,
                _ if miss_no.is_multiple_of(MISS_FILL_EXPLORE_EVERY) => cap.min(explore()),
                _ => 0,
            };
            match fill_hits {
                Some(_) => by_benefit,
                None => by_benefit.min(explore()),
            }
        }
    };
    let blocks = (bytes / block_size).min(MISS_FILL_MAX_BYTES / block_size);
    if blocks < 2 {
        1
    } else {
        1 << (63 - blocks.leading_zeros())
    }
}

/// Whether a miss with `holes` uncached runs among cached blocks is read in one backing read
/// over all of them (re-reading `gap_bytes` of cached blocks) rather than one read per hole:
/// when the transfer of the gaps costs less than the fixed and positioning costs of the reads
/// saved. An unknown cost per byte decides by `seek_bound`.
pub fn span_holes(est: &CostEstimate, holes: u64, gap_bytes: u64) -> bool {
    if holes < 2 {
        return false;
    }
    let saved = holes - 1;
    match est.per_byte_ns {
        Some(p) => {
            let per_read = est.fixed_ns + est.seek_at(gap_bytes / saved);
            p * gap_bytes as f64 <= saved as f64 * per_read
        }
        None => seek_bound(est),
    }
}

/// Which read misses a full cache admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// A miss enters a full cache only if its block missed before within the ghost history
    /// (`admit::Ghost`, about one cache's worth of misses): one-hit wonders and one-pass scans
    /// stay out and evict nothing (2Q's ghost queue, kept as TinyLFU's sketch).
    #[default]
    Ghost,
    /// Every miss enters (bcache's rule).
    All,
}

impl Admission {
    pub const ALL: [Admission; 2] = [Admission::Ghost, Admission::All];

    pub fn name(self) -> &'static str {
        match self {
            Admission::Ghost => "ghost",
            Admission::All => "all",
        }
    }

    pub fn parse(s: &str) -> Option<Admission> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// A measured share of miss-filled blocks read later (`fillhits`) at or above which every
/// miss of the device is admitted: its misses are local (a stream, or reads that move through
/// a region), so what one brings in is read soon, in the same pass.
pub const ADMIT_FILL_SHARE: f64 = 0.5;

/// Whether a read miss is promoted (`earlier`: the ghost history's count of the block's
/// earlier misses; `fill_share`: the device's measured share of miss-filled blocks read
/// later, None until measured). While the cache has room nothing is refused: a promotion then
/// evicts nothing, and refusing would only slow the warm-up. Nor where misses are measured to
/// be local (`ADMIT_FILL_SHARE`): the filter is for one-time reads scattered over the disk,
/// and refusing a stream's misses would refuse their fills, which the stream reads next.
pub fn admit_miss(
    policy: Admission,
    cache_full: bool,
    earlier: u8,
    fill_share: Option<f64>,
) -> bool {
    match policy {
        Admission::All => true,
        Admission::Ghost => {
            !cache_full || earlier > 0 || fill_share.is_some_and(|s| s >= ADMIT_FILL_SHARE)
        }
    }
}

/// Which clean bucket a full cache gives up (bcache's `cache_replacement_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Replacement {
    /// Least recently used: the bucket whose last read or write is oldest.
    #[default]
    Lru,
    /// First in, first out: the bucket opened longest ago, whatever was read since.
    Fifo,
    /// A bucket at random.
    Random,
}

impl Replacement {
    pub const ALL: [Replacement; 3] = [Replacement::Lru, Replacement::Fifo, Replacement::Random];

    pub fn name(self) -> &'static str {
        match self {
            Replacement::Lru => "lru",
            Replacement::Fifo => "fifo",
            Replacement::Random => "random",
        }
    }

    pub fn parse(s: &str) -> Option<Replacement> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Whether reads keep a bucket (its stamp moves on a use); under fifo and random the
    /// stamp is the tick the bucket was opened.
    pub fn tracks_use(self) -> bool {
        self == Replacement::Lru
    }
}

/// The replacement order of clean buckets: smallest reclaimed first. Empty buckets first,
/// then by `policy`: `stamp` is the tick of the last use (lru) or of the bucket's opening
/// (fifo); random orders by a hash of the bucket and `salt` (a new order per scan).
pub fn reclaim_rank(
    policy: Replacement,
    bucket: u32,
    live_blocks: u32,
    stamp: u64,
    salt: u64,
) -> (bool, u64) {
    let key = match policy {
        Replacement::Lru | Replacement::Fifo => stamp,
        Replacement::Random => {
            let mut z = (u64::from(bucket) << 32 ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z ^= z >> 29;
            z.wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 1
        }
    };
    (live_blocks > 0, key)
}

/// How hard writeback should work on one device.
///
/// Ordered by strength: when several devices share the writeback thread, the strongest rate
/// sets the batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum WritebackRate {
    /// Nothing to do (no dirty data, writeback stopped, or still inside writeback_delay).
    Idle,
    /// Clients are using the backing device: writeback may take this percentage (1..=99) of
    /// its time and sleeps for the rest, so foreground I/O keeps the disk's actuator.
    Share(u32),
    /// The backing device is idle or the device is being detached: as fast as possible.
    Full,
}

impl WritebackRate {
    /// For status output: `idle`, `N%` (of the busy disk's time) or `full`.
    pub fn describe(&self) -> String {
        match self {
            WritebackRate::Idle => "idle".into(),
            WritebackRate::Share(p) => format!("{p}%"),
            WritebackRate::Full => "full".into(),
        }
    }
}

/// Inputs of the writeback decision for one device.
pub struct WritebackInputs {
    pub running: bool,
    pub detaching: bool,
    pub dirty_blocks: u64,
    pub total_blocks: u64,
    pub writeback_percent: u64,
    /// Dirty data may fill at most this percentage of the cache (then writes bypass it).
    pub dirty_max_pct: u64,
    pub dirty_age_ns: u64,
    pub delay_ns: u64,
    /// Time since a client request last reached the backing device (a miss, a bypass or a
    /// writethrough write); cache hits leave the disk free and do not count.
    pub backing_quiet_ns: u64,
    /// Time since a request that continues a sequential stream of at least
    /// `WRITEBACK_STREAM_BYTES` started.
    pub stream_quiet_ns: u64,
}

/// Below the target, writeback runs at full speed only after the backing device has been
/// left alone by clients this long (bcache: full speed when idle).
pub const WRITEBACK_IDLE_NS: u64 = 1_000_000_000;
/// Above the target, the backing device counts as busy if a client used it this recently.
pub const WRITEBACK_BUSY_NS: u64 = 100_000_000;
/// Share of the backing device's time writeback takes below the target while clients use it.
pub const WRITEBACK_TRICKLE_PCT: u32 = 2;
/// The controller's minimum share over the target (bcache's `writeback_rate_minimum`).
pub const WRITEBACK_TARGET_PCT: u32 = 2;
/// The most of a busy backing device's time writeback takes, even at the dirty limit
/// (bcache's rate bound). Clients keep most of the disk because nothing they do gets slower
/// than the bare disk when the cache is full of dirty data (writes then go around the cache,
/// reads that find no room are not promoted), while random dirty data drains at only the
/// disk's random-write rate, so taking the disk from clients would cost them much and gain
/// little.
pub const WRITEBACK_BUSY_MAX_PCT: u32 = 25;
/// A client stream this long, on a busy backing device, keeps writeback at the trickle share
/// whatever the dirty level: every writeback batch would move the head out of the stream and
/// cost it a seek back, and draining does not help a stream (past the cutoff it bypasses the
/// cache anyway), so the disk stays with the work it does best.
pub const WRITEBACK_STREAM_BYTES: u64 = 1 << 20;
/// Integral gain: percentage points of share the integral term gains per second per unit of
/// error (the error is 0 at the target and 1 at the dirty limit), so dirty data held a
/// quarter of the way to the limit by a steady client load adds 0.05 points a second (the
/// whole range in about eight minutes). bcache: `writeback_rate_i_term_inverse`.
pub const WRITEBACK_I_PCT_PER_S: f64 = 0.2;
/// Longest time one controller step integrates over: a step after a long pause (writeback
/// stopped, the set idle) counts as this long, so a gap cannot throw the integral to a bound.
pub const WRITEBACK_STEP_MAX_NS: u64 = 1_000_000_000;

/// The writeback rate controller of one device (bcache's PI controller, in shares of the
/// busy disk's time): its integral term and when it last stepped. `writeback_rate` reads it,
/// `step` advances it; status only reads it, so looking does not change what writeback does.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WritebackPi {
    /// The integral term, percentage points of share, in `[0, WRITEBACK_BUSY_MAX_PCT −
    /// WRITEBACK_TARGET_PCT]`.
    pub integral_pct: f64,
    last_ns: Option<u64>,
    /// The error at the last step.
    last_error: f64,
}

/// A writeback decision with the controller terms behind it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WritebackDecision {
    pub rate: WritebackRate,
    /// The dirty level the controller steers toward (`writeback_percent` of the cache).
    pub target_blocks: u64,
    /// How far dirty data is from the target: 0 at the target, 1 at the dirty limit (more
    /// counts as 1); below the target, −1 with nothing dirty.
    pub error: f64,
    /// The proportional term, percentage points of share (0 at or below the target).
    pub proportional_pct: f64,
    /// The integral term, percentage points of share.
    pub integral_pct: f64,
    /// Whether the controller's share is the rate that applies (over the target, clients on
    /// the disk, no stream), rather than full speed, the trickle or nothing.
    pub controlled: bool,
}

impl WritebackPi {
    /// Advances the controller to `now_ns` and returns the decision that applies then.
    ///
    /// The integral grows by the error over the time since the last step only while the
    /// controller's share is what applies, is below `WRITEBACK_BUSY_MAX_PCT` and is not
    /// enough (the error did not fall since the last step): no wind-up while the rate is
    /// bounded, while dirty data is already coming down (a drain from the limit would
    /// otherwise leave a large integral behind at the target), at full speed on an idle
    /// disk, under a stream's trickle, in a pause or a detach. bcache integrates only while
    /// writeback keeps up with its rate, for the same reason. It shrinks by the error at or
    /// below the target (as bcache unwinds) and stays within its bounds.
    pub fn step(&mut self, i: &WritebackInputs, now_ns: u64) -> WritebackDecision {
        let d = writeback_rate(i, self);
        let dt = self
            .last_ns
            .map_or(0, |t| now_ns.saturating_sub(t).min(WRITEBACK_STEP_MAX_NS));
        self.last_ns = Some(now_ns);
        let grow = d.error > 0.0
            && d.error >= self.last_error
            && d.controlled
            && d.proportional_pct + self.integral_pct < integral_max();
        self.last_error = d.error;
        if grow || d.error <= 0.0 {
            let delta = WRITEBACK_I_PCT_PER_S * d.error * dt as f64 / 1e9;
            self.integral_pct = (self.integral_pct + delta).clamp(0.0, integral_max());
        }
        writeback_rate(i, self)
    }
}

fn integral_max() -> f64 {
    f64::from(WRITEBACK_BUSY_MAX_PCT - WRITEBACK_TARGET_PCT)
}

/// The writeback decision (bcache: `writeback_percent` target, `writeback_delay` before
/// starting on new dirty data, full speed when idle, a PI rate in between). Unlike bcache,
/// being over the target does not mean draining flat out while clients wait on the same
/// disk: the controller sets the share of the busy disk writeback takes, `WRITEBACK_TARGET_PCT`
/// plus a proportional term (linear in the error, reaching `WRITEBACK_BUSY_MAX_PCT` at the
/// dirty limit) plus the integral `pi` holds, within `[WRITEBACK_TARGET_PCT,
/// WRITEBACK_BUSY_MAX_PCT]`; a client stream (`WRITEBACK_STREAM_BYTES`) keeps it at the
/// trickle, and with no client on the disk it is full speed. At or below the target the
/// controller does not push: the rate is the trickle while clients use the disk, full
/// speed once it is idle, after `writeback_delay`. Pure: same inputs, same decision.
pub fn writeback_rate(i: &WritebackInputs, pi: &WritebackPi) -> WritebackDecision {
    let target_pct = i.writeback_percent.min(100);
    let total = i.total_blocks as f64;
    let (target, limit) = (
        total * target_pct as f64 / 100.0,
        total * i.dirty_max_pct.max(target_pct + 1) as f64 / 100.0,
    );
    let dirty = i.dirty_blocks as f64;
    // Over the target exactly as the integers say (no rounding at the boundary).
    let over =
        u128::from(i.dirty_blocks) * 100 > u128::from(i.total_blocks) * u128::from(target_pct);
    let error = if over {
        ((dirty - target) / (limit - target)).min(1.0)
    } else if target > 0.0 {
        (dirty - target) / target
    } else {
        0.0
    };
    let proportional = f64::from(WRITEBACK_BUSY_MAX_PCT - WRITEBACK_TARGET_PCT) * error.max(0.0);
    let decision = |rate, controlled| WritebackDecision {
        rate,
        target_blocks: target as u64,
        error,
        proportional_pct: proportional,
        integral_pct: pi.integral_pct,
        controlled,
    };
    if i.dirty_blocks == 0 || (!i.running && !i.detaching) {
        return decision(WritebackRate::Idle, false);
    }
    if i.detaching {
        return decision(WritebackRate::Full, false);
    }
    if over {
        if i.backing_quiet_ns >= WRITEBACK_BUSY_NS {
            return decision(WritebackRate::Full, false);
        }
        if i.stream_quiet_ns < WRITEBACK_BUSY_NS {
            return decision(WritebackRate::Share(WRITEBACK_TRICKLE_PCT), false);
        }
        let share = (f64::from(WRITEBACK_TARGET_PCT) + proportional + pi.integral_pct)
            .round()
            .clamp(
                f64::from(WRITEBACK_TARGET_PCT),
                f64::from(WRITEBACK_BUSY_MAX_PCT),
            );
        return decision(WritebackRate::Share(share as u32), true);
    }
    if i.dirty_age_ns < i.delay_ns {
        return decision(WritebackRate::Idle, false);
    }
    if i.backing_quiet_ns >= WRITEBACK_IDLE_NS {
        decision(WritebackRate::Full, false)
    } else {
        decision(WritebackRate::Share(WRITEBACK_TRICKLE_PCT), false)
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

    fn est(fixed_us: f64, per_byte_ns: Option<f64>, seek_us: f64) -> CostEstimate {
        CostEstimate {
            samples: 100,
            learned: true,
            fixed_ns: fixed_us * 1e3,
            per_byte_ns,
            per_byte_low_ns: per_byte_ns,
            seek_ns: seek_us * 1e3,
            seek_by_bucket: [Some(seek_us * 1e3); crate::cost::BUCKETS],
        }
    }

    /// A cache device of 20 µs per request and 0.5 ns/B.
    const CACHE: CacheCosts = CacheCosts {
        read: CostEstimate {
            samples: 100,
            learned: true,
            fixed_ns: 20_000.0,
            per_byte_ns: Some(0.5),
            per_byte_low_ns: Some(0.5),
            seek_ns: 0.0,
            seek_by_bucket: [None; crate::cost::BUCKETS],
        },
        write_per_byte_ns: 0.5,
    };

    #[test]
    fn miss_fill_follows_the_cost_model() {
        // Filled blocks all read later: the cost alone decides.
        let w = |e: &CostEstimate, miss_no| miss_fill_window(e, &CACHE, Some(1.0), 4096, miss_no);
        // A disk: 8 ms positioning against 5.5 ns/B: the whole bounded window.
        assert_eq!(w(&est(100.0, Some(5.5), 8000.0), 1), 64);
        // The same disk seen only at random offsets: its seeks are in its fixed cost, and
        // count the same.
        assert_eq!(w(&est(8100.0, Some(5.5), 0.0), 1), 64);
        // A miss worth ~60 KiB of transfer: 8 blocks (rounded down to a power of two).
        assert_eq!(w(&est(100.0, Some(5.0), 200.0), 1), 8);
        // Transfer dominates (40 µs per request, 10 ns/B): nothing extra.
        assert_eq!(w(&est(40.0, Some(10.0), 0.0), 1), 1);
        // Unknown cost per byte: every other miss explores, whatever the device.
        assert_eq!(w(&est(100.0, None, 8000.0), 0), 16);
        assert_eq!(w(&est(100.0, None, 8000.0), 1), 1);
        assert_eq!(w(&est(80.0, None, 0.0), 0), 16);
        // Bounded, and never below one block.
        assert_eq!(w(&est(100.0, Some(0.0), 8000.0), 1), 64);
        assert_eq!(
            miss_fill_window(&est(100.0, Some(5.5), 8000.0), &CACHE, None, 1 << 20, 1),
            1
        );
        // The seed of a rotational device fills at once.
        assert_eq!(w(&crate::cost::ROTATIONAL_PRIOR, 1), 64);
        // A backing device no slower than the cache: a hit saves nothing, so no fill.
        assert_eq!(w(&est(20.0, Some(0.5), 0.0), 0), 1);
        assert_eq!(
            fill_breakeven(&est(20.0, Some(0.5), 0.0), &CACHE, 4096),
            1.0
        );
    }

    #[test]
    fn miss_fill_follows_the_measured_benefit_of_fills() {
        // Flash behind the cache: 80 µs per request, 0.67 ns/B.
        let flash = est(80.0, Some(0.67), 0.0);
        let breakeven = fill_breakeven(&flash, &CACHE, 4096);
        assert!((0.05..0.1).contains(&breakeven), "{breakeven}");
        let w = |h: Option<f64>, miss_no| miss_fill_window(&flash, &CACHE, h, 4096, miss_no);
        // Filled blocks well used: the window the cost allows (116 KiB).
        assert_eq!(w(Some(0.5), 1), 16);
        // Barely worth it, or not measured yet: a quarter.
        assert_eq!(w(Some(1.5 * breakeven), 1), 4);
        assert_eq!(w(None, 1), 4);
        // Not worth it (random reads over a large span): nothing, but one explorer in 16.
        assert_eq!(w(Some(0.01), 1), 1);
        assert_eq!(w(Some(0.01), 15), 1);
        assert_eq!(w(Some(0.01), 16), 16);
        // On a disk, a miss costs so much that even a low share pays, and the prior fills.
        let disk = est(8100.0, Some(5.5), 0.0);
        assert!(fill_breakeven(&disk, &CACHE, 4096) < 0.005);
        assert_eq!(miss_fill_window(&disk, &CACHE, Some(0.02), 4096, 1), 64);
        assert_eq!(
            miss_fill_window(&disk, &CACHE, None, 4096, 1),
            16,
            "64 KiB until measured"
        );
    }

    #[test]
    fn holes_are_spanned_when_the_gaps_cost_less_than_the_reads_saved() {
        let disk = est(100.0, Some(5.5), 8000.0);
        assert!(span_holes(&disk, 3, 128 << 10));
        assert!(!span_holes(&disk, 2, 64 << 20));
        assert!(!span_holes(&disk, 1, 0));
        let flash = est(80.0, Some(0.67), 0.0);
        assert!(
            span_holes(&flash, 2, 8192),
            "one request saved is worth 8 KiB"
        );
        assert!(!span_holes(&flash, 2, 1 << 20));
        assert!(!span_holes(&est(80.0, None, 0.0), 3, 4096));
    }

    #[test]
    fn empty_buckets_go_first_then_by_stamp_or_at_random() {
        for policy in [Replacement::Lru, Replacement::Fifo] {
            let mut b = [(3, 10), (0, 50), (1, 5), (0, 7)];
            b.sort_by_key(|&(live, used)| reclaim_rank(policy, 0, live, used, 0));
            assert_eq!(b, [(0, 7), (0, 50), (1, 5), (3, 10)]);
        }
        // Random: empty ones still first; the rest in an order that changes with the salt
        // and ignores the stamps.
        let order = |salt: u64| {
            let mut b: Vec<u32> = (0..64).collect();
            b.sort_by_key(|&i| reclaim_rank(Replacement::Random, i, u32::from(i != 9), 7, salt));
            b
        };
        let (a, b) = (order(1), order(2));
        assert_eq!((a[0], b[0]), (9, 9));
        assert_ne!(a, b);
        for r in Replacement::ALL {
            assert_eq!(Replacement::parse(r.name()), Some(r));
        }
        assert_eq!(Replacement::parse("arc"), None);
    }

    #[test]
    fn a_full_cache_admits_a_miss_only_when_it_missed_before() {
        assert!(
            admit_miss(Admission::Ghost, false, 0, None),
            "room: no eviction"
        );
        assert!(
            !admit_miss(Admission::Ghost, true, 0, None),
            "a one-hit wonder"
        );
        assert!(
            !admit_miss(Admission::Ghost, true, 0, Some(0.1)),
            "scattered misses"
        );
        assert!(
            admit_miss(Admission::Ghost, true, 0, Some(0.9)),
            "local misses"
        );
        assert!(admit_miss(Admission::Ghost, true, 1, None));
        assert!(admit_miss(Admission::All, true, 0, None));
        for a in Admission::ALL {
            assert_eq!(Admission::parse(a.name()), Some(a));
        }
    }

    fn wb_inputs() -> WritebackInputs {
        WritebackInputs {
            running: true,
            detaching: false,
            dirty_blocks: 5,
            total_blocks: 100,
            writeback_percent: 10,
            dirty_max_pct: 90,
            dirty_age_ns: 0,
            delay_ns: 30,
            backing_quiet_ns: 0,
            stream_quiet_ns: u64::MAX,
        }
    }

    #[test]
    fn writeback_rate_follows_target_delay_idleness_and_urgency() {
        let base = wb_inputs();
        let rate = |f: &dyn Fn(&mut WritebackInputs)| {
            let mut i = WritebackInputs { ..base };
            f(&mut i);
            writeback_rate(&i, &WritebackPi::default()).rate
        };
        // Below the target: nothing inside the delay, a trickle while clients use the disk,
        // full speed once it has been quiet.
        assert_eq!(rate(&|_| {}), WritebackRate::Idle);
        assert_eq!(
            rate(&|i| i.dirty_age_ns = 31),
            WritebackRate::Share(WRITEBACK_TRICKLE_PCT)
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_age_ns = 31;
                i.backing_quiet_ns = WRITEBACK_IDLE_NS;
            }),
            WritebackRate::Full
        );
        // Above the target (with no integral yet): the share grows linearly from the minimum
        // to the bound at the limit, and a quiet disk gets full speed at once.
        assert_eq!(
            rate(&|i| i.dirty_blocks = 11),
            WritebackRate::Share(WRITEBACK_TARGET_PCT)
        );
        assert_eq!(rate(&|i| i.dirty_blocks = 30), WritebackRate::Share(8));
        assert_eq!(rate(&|i| i.dirty_blocks = 50), WritebackRate::Share(14));
        assert_eq!(rate(&|i| i.dirty_blocks = 89), WritebackRate::Share(25));
        assert_eq!(
            rate(&|i| i.dirty_blocks = 100),
            WritebackRate::Share(WRITEBACK_BUSY_MAX_PCT)
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 11;
                i.backing_quiet_ns = WRITEBACK_BUSY_NS;
            }),
            WritebackRate::Full
        );
        // A client streaming on the busy disk keeps writeback at the trickle, even at the
        // limit; a stream that stopped, or a quiet disk, does not.
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 100;
                i.stream_quiet_ns = WRITEBACK_BUSY_NS - 1;
            }),
            WritebackRate::Share(WRITEBACK_TRICKLE_PCT)
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 100;
                i.stream_quiet_ns = WRITEBACK_BUSY_NS;
            }),
            WritebackRate::Share(WRITEBACK_BUSY_MAX_PCT)
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 100;
                i.stream_quiet_ns = 0;
                i.backing_quiet_ns = WRITEBACK_BUSY_NS;
            }),
            WritebackRate::Full
        );
        let mut last = WritebackRate::Idle;
        for d in 11..=100 {
            let r = rate(&|i| i.dirty_blocks = d);
            assert!(
                r >= last,
                "rate must not fall as dirty data grows ({d}: {r:?})"
            );
            last = r;
        }
        // A limit at or under the target still gives a sane rate above the target.
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 20;
                i.dirty_max_pct = 5;
            }),
            WritebackRate::Share(WRITEBACK_BUSY_MAX_PCT)
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 11;
                i.running = false;
            }),
            WritebackRate::Idle
        );
        assert_eq!(
            rate(&|i| {
                i.running = false;
                i.detaching = true;
            }),
            WritebackRate::Full
        );
        assert_eq!(
            rate(&|i| {
                i.dirty_blocks = 0;
                i.detaching = true;
            }),
            WritebackRate::Idle
        );
        // writeback_percent 0: anything dirty is over the target.
        assert_eq!(
            rate(&|i| {
                i.writeback_percent = 0;
                i.dirty_blocks = 1;
                i.backing_quiet_ns = WRITEBACK_BUSY_NS;
            }),
            WritebackRate::Full
        );
    }

    /// A device whose clients always use the disk: dirty data grows by `inflow` blocks a
    /// second and writeback drains `FULL` blocks a second times its share. Runs the
    /// controller in 100 ms steps for `secs` and calls `each` after every step.
    const FULL: f64 = 140.0;
    fn simulate(
        pi: &mut WritebackPi,
        now: &mut u64,
        dirty: &mut f64,
        inflow: f64,
        secs: u64,
        mut each: impl FnMut(&WritebackDecision, f64),
    ) {
        let mut i = WritebackInputs {
            total_blocks: 10_000,
            delay_ns: 0,
            ..wb_inputs()
        };
        for _ in 0..secs * 10 {
            i.dirty_blocks = dirty.round() as u64;
            let d = pi.step(&i, *now);
            let share = match d.rate {
                WritebackRate::Idle => 0.0,
                WritebackRate::Share(p) => f64::from(p) / 100.0,
                WritebackRate::Full => 1.0,
            };
            // Past the dirty limit writes go around the cache.
            *dirty = (*dirty + (inflow - FULL * share) * 0.1).clamp(0.0, 9_000.0);
            *now += 100_000_000;
            each(&d, *dirty);
        }
    }

    #[test]
    fn the_controller_converges_on_the_target_under_a_steady_load() {
        // 10 blocks/s in needs a 7 % share: proportional alone would settle a fifth of the
        // way to the limit (about 2,800 blocks); the integral brings it to the target.
        let (mut pi, mut now, mut dirty) = (WritebackPi::default(), 0, 1_000.0);
        simulate(&mut pi, &mut now, &mut dirty, 10.0, 3600, |d, _| {
            assert!(d.integral_pct >= 0.0 && d.integral_pct <= integral_max());
        });
        assert!(
            (dirty - 1_000.0).abs() < 150.0,
            "dirty {dirty} after an hour, integral {}",
            pi.integral_pct
        );
        let d = writeback_rate(
            &WritebackInputs {
                dirty_blocks: dirty as u64 + 1,
                total_blocks: 10_000,
                ..wb_inputs()
            },
            &pi,
        );
        assert!(
            matches!(d.rate, WritebackRate::Share(6..=10)),
            "{d:?}: about the share that matches the load (7 %; whole percents dither)"
        );
        // Without the integral the same load holds far more dirty data.
        let mut p_only = 1_000.0f64;
        let (mut pi2, mut now2) = (WritebackPi::default(), 0);
        simulate(&mut pi2, &mut now2, &mut p_only, 10.0, 60, |_, _| {});
        pi2.integral_pct = 0.0;
        for _ in 0..3600 {
            simulate(&mut pi2, &mut now2, &mut p_only, 10.0, 1, |_, _| {});
            pi2.integral_pct = 0.0;
        }
        assert!(p_only > 2_000.0, "proportional only: {p_only}");
    }

    #[test]
    fn the_integral_does_not_wind_up_while_the_rate_is_bounded() {
        // A surge writeback cannot keep up with (50 blocks/s against 35 at the bound): the
        // share reaches the bound and the integral stops growing once the proportional term
        // and it reach the bound (what it gained on the way up stays, and is spent later).
        let (mut pi, mut now, mut dirty) = (WritebackPi::default(), 0, 1_000.0);
        let mut at_bound = 0;
        let mut last_integral = 0.0;
        simulate(&mut pi, &mut now, &mut dirty, 50.0, 1800, |d, _| {
            if d.rate == WritebackRate::Share(WRITEBACK_BUSY_MAX_PCT) {
                at_bound += 1;
            }
            if d.proportional_pct + last_integral >= integral_max() {
                assert!(d.integral_pct <= last_integral + 1e-9, "{d:?}");
            }
            last_integral = d.integral_pct;
        });
        assert!(at_bound > 10_000, "the surge saturates the rate");
        let wound = pi.integral_pct;
        assert!(wound <= integral_max(), "integral {wound}");
        // The surge ends: the share falls with the error, writeback stops pushing at the
        // target (never drains below it on a busy disk beyond the trickle), and the integral
        // unwinds there.
        let mut below = 0;
        // 3 blocks/s: a little more than the trickle drains (2.8).
        let mut max_after = 0.0f64;
        simulate(&mut pi, &mut now, &mut dirty, 3.0, 3600, |d, _| {
            max_after = max_after.max(d.integral_pct);
            if d.error <= 0.0 {
                below += 1;
                assert!(!d.controlled, "{d:?}");
                assert!(d.proportional_pct == 0.0, "{d:?}");
                assert!(
                    d.rate <= WritebackRate::Share(WRITEBACK_TRICKLE_PCT),
                    "{d:?}"
                );
            }
        });
        assert!(below > 0, "reached the target");
        assert!(
            dirty > 900.0,
            "the trickle alone does not drain far below: {dirty}"
        );
        // Coming down from the limit does not add to the integral (dirty data is falling);
        // only the dither at the target may add a little.
        assert!(max_after <= wound + 0.5, "{max_after} > {wound}");
    }

    #[test]
    fn the_share_stays_within_its_bounds_and_full_speed_waits_for_nothing() {
        for integral in [0.0, 3.0, integral_max(), 1e9] {
            let pi = WritebackPi {
                integral_pct: integral,
                ..WritebackPi::default()
            };
            for dirty in 0..=100 {
                for quiet in [0, WRITEBACK_BUSY_NS, WRITEBACK_IDLE_NS] {
                    let i = WritebackInputs {
                        dirty_blocks: dirty,
                        dirty_age_ns: 31,
                        backing_quiet_ns: quiet,
                        ..wb_inputs()
                    };
                    let d = writeback_rate(&i, &pi);
                    if let WritebackRate::Share(p) = d.rate {
                        assert!((WRITEBACK_TARGET_PCT..=WRITEBACK_BUSY_MAX_PCT).contains(&p));
                    }
                    if dirty > 10 && quiet >= WRITEBACK_BUSY_NS {
                        assert_eq!(d.rate, WritebackRate::Full, "idle disk, dirty high");
                    }
                    if dirty <= 10 {
                        assert!(!d.controlled && d.proportional_pct == 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn the_controller_steps_by_time_and_status_does_not_step_it() {
        let i = WritebackInputs {
            dirty_blocks: 50,
            ..wb_inputs()
        };
        let mut pi = WritebackPi::default();
        pi.step(&i, 1_000);
        assert_eq!(pi.integral_pct, 0.0, "the first step has no interval");
        let before = pi;
        let _ = writeback_rate(&i, &pi);
        assert_eq!(pi, before, "reading the rate leaves the controller alone");
        // An hour's gap counts as `WRITEBACK_STEP_MAX_NS`.
        pi.step(&i, 1_000 + 3_600_000_000_000);
        let one_step = WRITEBACK_I_PCT_PER_S * 0.5 * WRITEBACK_STEP_MAX_NS as f64 / 1e9;
        assert!((pi.integral_pct - one_step).abs() < 1e-9, "{pi:?}");
        // Paused, at full speed on an idle disk, or under a stream's trickle it holds.
        for f in [
            &(|i: &mut WritebackInputs| i.running = false) as &dyn Fn(&mut WritebackInputs),
            &|i| i.backing_quiet_ns = WRITEBACK_BUSY_NS,
            &|i| i.stream_quiet_ns = 0,
        ] {
            let mut j = WritebackInputs { ..i };
            f(&mut j);
            let held = pi.integral_pct;
            pi.step(&j, pi.last_ns.unwrap() + 500_000_000);
            assert_eq!(pi.integral_pct, held);
        }
        // Nothing dirty: it unwinds, and never below 0.
        let clean = WritebackInputs {
            dirty_blocks: 0,
            ..wb_inputs()
        };
        for _ in 0..100 {
            pi.step(&clean, pi.last_ns.unwrap() + 1_000_000_000);
        }
        assert_eq!(pi.integral_pct, 0.0);
    }

    #[test]
    fn a_disk_that_seeks_for_near_requests_is_told_from_one_that_does_not() {
        let mut disk = est(100.0, Some(5.5), 4700.0);
        assert!(near_requests_seek(&disk));
        disk.seek_by_bucket[1] = Some(20_000.0); // a write cache absorbs it
        assert!(!near_requests_seek(&disk));
        disk.seek_by_bucket[1] = None; // never measured
        assert!(!near_requests_seek(&disk));
        // Positioning small next to the fixed cost (a network disk): not seeking.
        assert!(!near_requests_seek(&est(2000.0, Some(1.0), 100.0)));
    }
}
