//! One volume's policy as an object: the state its decisions learn from — the sequential
//! stream detector, the backing device's cost model, the measured benefit of miss fills, the
//! miss count, the writeback rate controller, and (shared with the set's other volumes,
//! [`SetPolicy`]) the admission history — and the decisions made from that state. The
//! mechanism (`io`, `writeback`) reports what happened (`observe_*`, `note_*`) and asks for
//! decisions; it holds none of this state itself and reaches into none of it. Each request
//! is routed by the policy ([`VolumePolicy::route_read`], [`VolumePolicy::route_write`]:
//! through the cache or around it and why, read ahead or not, around a congested cache
//! device), which notes it in the stream detector on the way and asks the mechanism's
//! [`RouteFacts`] as it needs them. A read that finds uncached blocks asks [`VolumePolicy::plan_miss`] for a [`MissPlan`] (around the
//! cache and why, wait for a promotion in flight, or promote with a fill window) and carries
//! it out; the facts the plan needs come from the mechanism through [`MissFacts`], asked
//! only when the decision needs them.
//!
//! Invariants: every lock here is a leaf (nothing is locked under it), so the mechanism may
//! ask under the state lock; a decision takes each lock once and does no I/O. The decisions
//! are the pure functions of the other policy files applied to this state, so their tests
//! cover the rules and `tests/behaviour.rs` the wiring.

use super::{
    admit_miss, is_sequential_bypass, miss_fill_window, near_requests_seek, read_bypass,
    route_write, span_holes, writeback_rate, Admission, Bypass, CacheCosts, Seen, SeqDetector,
    SetPolicy, WriteRoute, WriteShape, WritebackDecision, WritebackInputs, WritebackPi,
    STREAM_OVERLAP_NS,
};
use crate::cost::{CostEstimate, CostModel, DevCost, Op};
use crate::fillhits::FillHits;
use crate::types::{CacheMode, DevId};
use crate::units::BackingBlock;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The decisions a volume's policy takes from its state: the engine's are the defaults
/// ([`Measured`]: the pure functions of the other policy files); a test can drive the engine
/// with decisions of its own (`Config::decisions`), overriding those it scripts, to check
/// what the mechanism does with each answer.
pub trait Decisions: Send + Sync + 'static {
    /// Whether a request continuing a stream of `stream_bytes` goes around the cache.
    fn sequential_bypass(&self, stream_bytes: u64, cutoff: u64) -> bool {
        is_sequential_bypass(stream_bytes, cutoff)
    }
    /// Whether a read miss is promoted into the cache (see `admit_miss`).
    fn admit_miss(
        &self,
        admission: Admission,
        full: bool,
        earlier: u8,
        fill_share: Option<f64>,
    ) -> bool {
        admit_miss(admission, full, earlier, fill_share)
    }
    /// The miss-fill window in blocks (see `miss_fill_window`).
    fn fill_window(
        &self,
        backing: &CostEstimate,
        cache: &CacheCosts,
        fill_share: Option<f64>,
        block_size: u64,
        miss_no: u64,
    ) -> u64 {
        miss_fill_window(backing, cache, fill_share, block_size, miss_no)
    }
    /// Whether a miss with `holes` uncached runs is read in one backing read (see
    /// `span_holes`).
    fn span_holes(&self, backing: &CostEstimate, holes: u64, gap_bytes: u64) -> bool {
        span_holes(backing, holes, gap_bytes)
    }
}

/// The engine's decisions (the trait's own): by measurement (the cost models, the fills'
/// benefit) and bcache's rules where no measurement decides.
#[derive(Clone, Copy, Debug, Default)]
pub struct Measured;

impl Decisions for Measured {}

/// A stream of more than one request and at least this long that goes around the cache is
/// read ahead (`readahead::WINDOW_BYTES` at a time).
pub const READAHEAD_AFTER_BYTES: u64 = 64 << 10;

/// What the mechanism knows about a request when the policy routes it (each asked only when
/// the decision needs it).
pub trait RouteFacts {
    /// The volume's cache mode now.
    fn mode(&self) -> CacheMode;
    /// Whether the volume is being detached.
    fn detaching(&self) -> bool;
    /// The volume's sequential cutoff (bytes).
    fn sequential_cutoff(&self) -> u64;
    /// Whether the cache device is slower than its congestion threshold for a request of
    /// this size, reading (`write` false) or writing, and slower than the backing device
    /// (counts the congestion when it is).
    fn cache_congested(&mut self, write: bool) -> bool;
    /// The dirty limit: `dirty_max_pct` and the cache's blocks.
    fn dirty_limit(&self) -> (u32, u64);
    /// Dirty blocks in the cache now (costs a lock).
    fn dirty_blocks(&mut self) -> u64;
}

/// How a read treats the cache, as routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadRoute {
    /// Hits from the cache, misses planned by [`VolumePolicy::plan_miss`] (`stream`: the
    /// request continues a stream).
    Cached { stream: bool },
    /// Hits from the cache, misses read from the backing device exactly, and why.
    Bypass(Bypass),
    /// Like `Bypass`, misses served through readahead windows (a stream).
    Ahead(Bypass),
}

/// The policy's route for a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRouting {
    pub route: ReadRoute,
    /// The cache device is congested for reads: the backing device serves the request
    /// unless part of it is dirty.
    pub around_congestion: bool,
    /// What the stream detector saw.
    pub seen: Seen,
}

/// The policy's route for a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteRouting {
    pub route: WriteRoute,
    /// What the stream detector saw.
    pub seen: Seen,
}

/// How a read that found uncached blocks treats the cache (reads that go around it by their
/// route do not ask: their misses are read from the backing device as they are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissRead {
    /// A client's read outside any stream: admitted by the admission history.
    Random,
    /// A client's read continuing a stream below the cutoff: promoted (its next requests read
    /// what its fill brings in).
    Stream,
    /// A prefetch (NBD_CMD_CACHE): promoted, whatever the cache device's speed.
    Prefetch,
}

/// What the mechanism knows about a miss, asked by [`VolumePolicy::plan_miss`] only when its
/// decision needs it (each may cost a measurement or a lookup).
pub trait MissFacts {
    /// Whether writing to the cache device now is slower than its congestion threshold and
    /// than the backing device (counts the congestion when it is).
    fn cache_congested(&mut self) -> bool;
    /// Whether a promotion covering the request's blocks is in flight.
    fn promotion_in_flight(&mut self) -> bool;
    /// Whether the cache is full (a promotion would evict something).
    fn cache_full(&mut self) -> bool;
    /// The cache device's costs, for the fill window.
    fn fill_costs(&mut self) -> CacheCosts;
}

/// The policy's answer to a read miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissPlan {
    /// Read the uncached blocks from the backing device, promote nothing, for this reason
    /// (`Congested`, or `Admission`: a miss the history keeps out, counted as a miss).
    Around(Bypass),
    /// Wait for the promotion in flight over these blocks, then look again (once: a second
    /// plan for the same request is made with `waited`).
    Wait,
    /// Promote the miss, with the blocks of the enclosing `window` (1: none) around it.
    Promote { window: u64 },
}

/// The policy of one volume (see the module comment).
pub struct VolumePolicy {
    decisions: Arc<dyn Decisions>,
    /// The admission history, shared by the set's volumes.
    set: Arc<SetPolicy>,
    seq: Mutex<SeqDetector>,
    cost: Mutex<CostModel>,
    /// Read misses so far (the miss fill's exploration alternates on it).
    misses: AtomicU64,
    /// How many of the blocks miss fills brought in were read later (the fill's benefit).
    fill_hits: FillHits,
    /// The writeback rate controller: stepped by writeback passes, read by status.
    writeback_pi: Mutex<WritebackPi>,
}

impl VolumePolicy {
    /// A fresh policy for a backing device that says whether it is rotational (the cost
    /// model's prior until it has measured the device).
    pub fn new(
        rotational: bool,
        decisions: Arc<dyn Decisions>,
        set: Arc<SetPolicy>,
    ) -> VolumePolicy {
        VolumePolicy {
            decisions,
            set,
            seq: Mutex::new(SeqDetector::default()),
            cost: Mutex::new(CostModel::new(rotational)),
            misses: AtomicU64::new(0),
            fill_hits: FillHits::default(),
            writeback_pi: Mutex::new(WritebackPi::default()),
        }
    }

    // ----- outcomes the mechanism reports -----

    /// A data read or write of the backing device took `ns` of service time.
    pub fn observe_io(&self, op: Op, offset: u64, len: u64, ns: u64) {
        self.cost.lock().observe(op, offset, len, ns);
    }

    /// A client request of `len` bytes at `offset` arrived at `now_ns`: what it continues
    /// (every routed request, and those that are not routed: zeroes, trims).
    pub fn observe_request(&self, offset: u64, len: u64, now_ns: u64) -> Seen {
        self.seq.lock().observe_stream(offset, len, now_ns)
    }

    /// Cached blocks `[b0, b1)` were read (a filled block read later counts for the fill).
    pub fn note_read(&self, b0: BackingBlock, b1: BackingBlock) {
        self.fill_hits.note_read(b0, b1);
    }

    /// A miss fill brought blocks `[b0, b1)` in.
    pub fn note_filled(&self, b0: BackingBlock, b1: BackingBlock) {
        self.fill_hits.note_filled(b0, b1);
    }

    // ----- decisions -----

    /// Routes a client read of `len` bytes at `offset` arriving at `now_ns` (noting it in the
    /// stream detector): around the cache while detaching, in mode `none` and for a stream
    /// past the cutoff (`read_bypass`), read ahead when such a stream is long
    /// (`READAHEAD_AFTER_BYTES`); and whether the cache device is congested for it.
    pub fn route_read(
        &self,
        offset: u64,
        len: u64,
        now_ns: u64,
        facts: &mut impl RouteFacts,
    ) -> ReadRouting {
        let seen = self.observe_request(offset, len, now_ns);
        let why = if facts.detaching() {
            Some(Bypass::Detaching)
        } else {
            let sequential = self.sequential_bypass(seen.bytes, facts.sequential_cutoff());
            read_bypass(facts.mode(), sequential)
        };
        let streaming = seen.bytes > len && seen.bytes >= READAHEAD_AFTER_BYTES;
        let route = match why {
            Some(why) if streaming => ReadRoute::Ahead(why),
            Some(why) => ReadRoute::Bypass(why),
            None => ReadRoute::Cached { stream: streaming },
        };
        ReadRouting {
            route,
            around_congestion: facts.cache_congested(false),
            seen,
        }
    }

    /// Routes a client write of `len` bytes at `offset` arriving at `now_ns` (`fua`: the
    /// client waits for it to be durable), noting it in the stream detector: the write's
    /// shape (a stream past the cutoff, interleaved with others, reordered on its way) and
    /// `route_write`; a write through the cache goes around a congested cache device. A
    /// stream sent around the cache goes around it over dirty blocks too (as bcache does
    /// unless partial RAID stripes are expensive): the mechanism drops the dirty copies, their
    /// record waiting for one backing flush per commit, and the disk gets the whole stream.
    pub fn route_write(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        now_ns: u64,
        facts: &mut impl RouteFacts,
    ) -> WriteRouting {
        let seen = self.observe_request(offset, len, now_ns);
        let cutoff = facts.sequential_cutoff();
        let sequential = self.sequential_bypass(seen.bytes, cutoff);
        let shape = WriteShape {
            sequential,
            interleaved: sequential
                && self.concurrent_streams(cutoff, now_ns, STREAM_OVERLAP_NS) > 1,
            sync: fua,
            reordered: sequential && seen.reordered && self.reordering_costs_seeks(),
        };
        let (pct, total) = facts.dirty_limit();
        let mode = facts.mode();
        let detaching = facts.detaching();
        let mut route = route_write(mode, detaching, shape, pct, total, || facts.dirty_blocks());
        if route == WriteRoute::Through && facts.cache_congested(true) {
            // The slow cache device would hold the write up; the backing device has it.
            route = WriteRoute::Bypass(Bypass::Congested);
        }
        WriteRouting { route, seen }
    }

    /// Whether a request continuing a stream of `stream_bytes` goes around the cache by the
    /// sequential cutoff.
    fn sequential_bypass(&self, stream_bytes: u64, cutoff: u64) -> bool {
        self.decisions.sequential_bypass(stream_bytes, cutoff)
    }

    /// How many streams past `cutoff` ran within `window_ns` before `now_ns`.
    fn concurrent_streams(&self, cutoff: u64, now_ns: u64, window_ns: u64) -> usize {
        self.seq.lock().concurrent(cutoff, now_ns, window_ns)
    }

    /// Whether a stream reaching the disk out of order costs it a seek per request.
    fn reordering_costs_seeks(&self) -> bool {
        near_requests_seek(&self.estimate(Op::Write))
    }

    /// The plan for a read of `read` kind whose first block `block` of device `dev` (and
    /// maybe others) is not cached: around a congested cache device (not for a prefetch);
    /// else, unless it `waited` already, wait for a promotion in flight over it; else a
    /// client's random read is recorded in the admission history and kept out of a full cache
    /// unless admitted (`admit_miss`); else promoted with the fill window
    /// (`miss_fill_window`, which counts the miss).
    pub fn plan_miss(
        &self,
        read: MissRead,
        waited: bool,
        dev: DevId,
        block: BackingBlock,
        block_size: u64,
        facts: &mut impl MissFacts,
    ) -> MissPlan {
        if read != MissRead::Prefetch && facts.cache_congested() {
            return MissPlan::Around(Bypass::Congested);
        }
        if !waited && facts.promotion_in_flight() {
            return MissPlan::Wait;
        }
        if read == MissRead::Random {
            let earlier = self.set.record_miss(dev, block);
            let admitted = self.decisions.admit_miss(
                self.set.admission(),
                facts.cache_full(),
                earlier,
                self.fill_hits.ratio(),
            );
            if !admitted {
                return MissPlan::Around(Bypass::Admission);
            }
        }
        MissPlan::Promote {
            window: self.fill_window(&facts.fill_costs(), block_size),
        }
    }

    /// The miss-fill window for the next miss, in blocks (1: no fill); counts the miss.
    fn fill_window(&self, cache: &CacheCosts, block_size: u64) -> u64 {
        let miss_no = self.misses.fetch_add(1, Ordering::Relaxed);
        let est = self.estimate(Op::Read);
        self.decisions
            .fill_window(&est, cache, self.fill_hits.ratio(), block_size, miss_no)
    }

    /// Whether a miss with `holes` uncached runs is read in one backing read over the
    /// `gap_bytes` of cached blocks between them.
    pub fn span_holes(&self, holes: u64, gap_bytes: u64) -> bool {
        self.decisions
            .span_holes(&self.estimate(Op::Read), holes, gap_bytes)
    }

    /// What the backing device is expected to take for a request of `len` bytes (ns).
    pub fn expected_ns(&self, op: Op, len: u64) -> u64 {
        let e = self.estimate(op);
        (e.fixed_ns + e.seek_ns + e.per_byte_ns.unwrap_or(0.0) * len as f64) as u64
    }

    /// The writeback decision from `inputs`: stepping the controller (a writeback pass) or
    /// only reading it (status).
    pub fn writeback(
        &self,
        inputs: &WritebackInputs,
        now_ns: u64,
        step: bool,
    ) -> WritebackDecision {
        let mut pi = self.writeback_pi.lock();
        if step {
            pi.step(inputs, now_ns)
        } else {
            writeback_rate(inputs, &pi)
        }
    }

    // ----- what status shows -----

    /// The cost model's current estimate for `op`.
    pub fn estimate(&self, op: Op) -> CostEstimate {
        self.cost.lock().estimate(op)
    }

    /// Both estimates, for status.
    pub fn cost(&self) -> DevCost {
        let m = self.cost.lock();
        DevCost {
            read: m.estimate(Op::Read),
            write: m.estimate(Op::Write),
        }
    }

    /// The measured share of miss-filled blocks read later (None until measured).
    pub fn fill_read_share(&self) -> Option<f64> {
        self.fill_hits.ratio()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Facts the test sets, and which of them the plan asked.
    #[derive(Default)]
    struct Script {
        congested: bool,
        in_flight: bool,
        full: bool,
        asked: Vec<&'static str>,
    }

    impl MissFacts for Script {
        fn cache_congested(&mut self) -> bool {
            self.asked.push("congested");
            self.congested
        }
        fn promotion_in_flight(&mut self) -> bool {
            self.asked.push("in_flight");
            self.in_flight
        }
        fn cache_full(&mut self) -> bool {
            self.asked.push("full");
            self.full
        }
        fn fill_costs(&mut self) -> CacheCosts {
            self.asked.push("costs");
            CacheCosts {
                read: CostModel::new(false).estimate(Op::Read),
                write_per_byte_ns: 0.0,
            }
        }
    }

    /// Route facts the test sets, and which were asked.
    struct Volume {
        mode: CacheMode,
        detaching: bool,
        congested: bool,
        dirty: u64,
        asked: Vec<&'static str>,
    }

    impl RouteFacts for Volume {
        fn mode(&self) -> CacheMode {
            self.mode
        }
        fn detaching(&self) -> bool {
            self.detaching
        }
        fn sequential_cutoff(&self) -> u64 {
            1 << 20
        }
        fn cache_congested(&mut self, write: bool) -> bool {
            self.asked.push(if write {
                "write congested"
            } else {
                "read congested"
            });
            self.congested
        }
        fn dirty_limit(&self) -> (u32, u64) {
            (50, 1000)
        }
        fn dirty_blocks(&mut self) -> u64 {
            self.asked.push("dirty");
            self.dirty
        }
    }

    fn volume(mode: CacheMode) -> Volume {
        Volume {
            mode,
            detaching: false,
            congested: false,
            dirty: 0,
            asked: Vec::new(),
        }
    }

    #[test]
    fn reads_are_routed_by_detach_mode_and_stream_and_told_of_congestion() {
        let p = policy();
        let mut v = volume(CacheMode::Writethrough);
        let r = p.route_read(0, 4096, 1_000, &mut v);
        assert_eq!(r.route, ReadRoute::Cached { stream: false });
        assert!(!r.around_congestion);
        v.congested = true;
        assert!(p.route_read(1 << 30, 4096, 2_000, &mut v).around_congestion);
        v.congested = false;
        v.detaching = true;
        assert_eq!(
            p.route_read(3 << 30, 4096, 3_000, &mut v).route,
            ReadRoute::Bypass(Bypass::Detaching)
        );
        let mut v = volume(CacheMode::None);
        assert_eq!(
            p.route_read(5 << 30, 4096, 4_000, &mut v).route,
            ReadRoute::Bypass(Bypass::Mode)
        );
        // A stream: cached below the cutoff (read ahead past 64 KiB), around it past it.
        let mut v = volume(CacheMode::Writeback);
        let chunk = 128 << 10;
        let routes: Vec<ReadRoute> = (0..16u64)
            .map(|i| {
                p.route_read(i * chunk, chunk, 10_000 + i * 1_000, &mut v)
                    .route
            })
            .collect();
        assert_eq!(routes[0], ReadRoute::Cached { stream: false });
        assert_eq!(routes[1], ReadRoute::Cached { stream: true });
        assert_eq!(routes[15], ReadRoute::Ahead(Bypass::Sequential));
    }

    #[test]
    fn writes_are_routed_by_mode_dirty_limit_and_congestion() {
        let p = policy();
        let mut v = volume(CacheMode::Writeback);
        assert_eq!(
            p.route_write(0, 4096, false, 1_000, &mut v).route,
            WriteRoute::Back
        );
        v.dirty = 500;
        assert_eq!(
            p.route_write(1 << 30, 4096, false, 2_000, &mut v).route,
            WriteRoute::Bypass(Bypass::DirtyLimit)
        );
        let mut v = volume(CacheMode::Writeback);
        v.congested = true;
        assert_eq!(
            p.route_write(2 << 30, 4096, false, 2_500, &mut v).route,
            WriteRoute::Back
        );
        assert_eq!(
            v.asked,
            ["dirty"],
            "a write into the cache alone is not sent around a congested cache"
        );
        let mut v = volume(CacheMode::Writethrough);
        v.congested = true;
        assert_eq!(
            p.route_write(3 << 30, 4096, false, 3_000, &mut v).route,
            WriteRoute::Bypass(Bypass::Congested)
        );
        assert_eq!(v.asked, ["write congested"], "the dirty count is not asked");
        let mut v = volume(CacheMode::Writearound);
        assert_eq!(
            p.route_write(5 << 30, 4096, false, 4_000, &mut v).route,
            WriteRoute::Bypass(Bypass::Mode)
        );
    }

    fn policy() -> VolumePolicy {
        VolumePolicy::new(
            false,
            Arc::new(Measured),
            Arc::new(SetPolicy::new(Admission::Ghost, 1 << 16)),
        )
    }

    fn plan(
        p: &VolumePolicy,
        read: MissRead,
        waited: bool,
        block: u64,
        f: &mut Script,
    ) -> MissPlan {
        p.plan_miss(
            read,
            waited,
            DevId::new(1),
            BackingBlock::new(block),
            4096,
            f,
        )
    }

    #[test]
    fn a_congested_cache_sends_misses_around_it_except_a_prefetch() {
        let p = policy();
        for read in [MissRead::Random, MissRead::Stream] {
            let mut f = Script {
                congested: true,
                ..Script::default()
            };
            assert_eq!(
                plan(&p, read, false, 7, &mut f),
                MissPlan::Around(Bypass::Congested)
            );
            assert_eq!(f.asked, ["congested"], "nothing else is asked");
        }
        let mut f = Script {
            congested: true,
            ..Script::default()
        };
        assert!(matches!(
            plan(&p, MissRead::Prefetch, false, 7, &mut f),
            MissPlan::Promote { .. }
        ));
        assert!(!f.asked.contains(&"congested"));
    }

    #[test]
    fn a_miss_inside_a_promotion_in_flight_waits_for_it_once() {
        let p = policy();
        let mut f = Script {
            in_flight: true,
            ..Script::default()
        };
        assert_eq!(plan(&p, MissRead::Random, false, 7, &mut f), MissPlan::Wait);
        let mut f = Script {
            in_flight: true,
            ..Script::default()
        };
        assert!(matches!(
            plan(&p, MissRead::Random, true, 7, &mut f),
            MissPlan::Promote { .. }
        ));
        assert!(
            !f.asked.contains(&"in_flight"),
            "a waited read does not wait again"
        );
    }

    #[test]
    fn a_full_cache_admits_a_random_miss_only_the_second_time_and_a_stream_always() {
        let p = policy();
        let mut f = Script {
            full: true,
            ..Script::default()
        };
        assert_eq!(
            plan(&p, MissRead::Random, false, 9, &mut f),
            MissPlan::Around(Bypass::Admission)
        );
        assert!(matches!(
            plan(&p, MissRead::Random, false, 9, &mut f),
            MissPlan::Promote { .. }
        ));
        // A stream's miss is promoted without asking the history or the room.
        let mut f = Script {
            full: true,
            ..Script::default()
        };
        assert!(matches!(
            plan(&p, MissRead::Stream, false, 100, &mut f),
            MissPlan::Promote { .. }
        ));
        assert!(!f.asked.contains(&"full"));
        // With room, a first miss is promoted.
        let mut f = Script::default();
        assert!(matches!(
            plan(&p, MissRead::Random, false, 200, &mut f),
            MissPlan::Promote { .. }
        ));
    }
}
