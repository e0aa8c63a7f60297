//! One volume's policy as an object: the state its decisions learn from — the sequential
//! stream detector, the backing device's cost model, the measured benefit of miss fills, the
//! miss count, the writeback rate controller — and the decisions made from that state. The
//! mechanism (`io`, `writeback`) reports what happened (`observe_*`, `note_*`) and asks for
//! decisions; it holds none of this state itself and reaches into none of it.
//!
//! Invariants: every lock here is a leaf (nothing is locked under it), so the mechanism may
//! ask under the state lock; a decision takes each lock once and does no I/O. The decisions
//! are the pure functions of the other policy files applied to this state, so their tests
//! cover the rules and `tests/behaviour.rs` the wiring.

use super::{
    admit_miss, is_sequential_bypass, miss_fill_window, near_requests_seek, span_holes,
    writeback_rate, Admission, CacheCosts, Seen, SeqDetector, WritebackDecision, WritebackInputs,
    WritebackPi,
};
use crate::cost::{CostEstimate, CostModel, DevCost, Op};
use crate::fillhits::FillHits;
use crate::units::BackingBlock;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The decisions a volume's policy takes from its state: the engine's are [`Measured`] (the
/// pure functions of the other policy files); a test can drive the engine with decisions of
/// its own (`Config::decisions`) to check what the mechanism does with each answer.
pub trait Decisions: Send + Sync + 'static {
    /// Whether a request continuing a stream of `stream_bytes` goes around the cache.
    fn sequential_bypass(&self, stream_bytes: u64, cutoff: u64) -> bool;
    /// Whether a read miss is promoted into the cache (see `admit_miss`).
    fn admit_miss(
        &self,
        admission: Admission,
        full: bool,
        earlier: u8,
        fill_share: Option<f64>,
    ) -> bool;
    /// The miss-fill window in blocks (see `miss_fill_window`).
    fn fill_window(
        &self,
        backing: &CostEstimate,
        cache: &CacheCosts,
        fill_share: Option<f64>,
        block_size: u64,
        miss_no: u64,
    ) -> u64;
    /// Whether a miss with `holes` uncached runs is read in one backing read (see
    /// `span_holes`).
    fn span_holes(&self, backing: &CostEstimate, holes: u64, gap_bytes: u64) -> bool;
}

/// The engine's decisions: by measurement (the cost models, the fills' benefit) and bcache's
/// rules where no measurement decides.
#[derive(Clone, Copy, Debug, Default)]
pub struct Measured;

impl Decisions for Measured {
    fn sequential_bypass(&self, stream_bytes: u64, cutoff: u64) -> bool {
        is_sequential_bypass(stream_bytes, cutoff)
    }
    fn admit_miss(
        &self,
        admission: Admission,
        full: bool,
        earlier: u8,
        fill_share: Option<f64>,
    ) -> bool {
        admit_miss(admission, full, earlier, fill_share)
    }
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
    fn span_holes(&self, backing: &CostEstimate, holes: u64, gap_bytes: u64) -> bool {
        span_holes(backing, holes, gap_bytes)
    }
}

/// The policy of one volume (see the module comment).
pub struct VolumePolicy {
    decisions: Arc<dyn Decisions>,
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
    pub fn new(rotational: bool, decisions: Arc<dyn Decisions>) -> VolumePolicy {
        VolumePolicy {
            decisions,
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

    /// A client request of `len` bytes at `offset` arrived at `now_ns`: what it continues.
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

    /// Whether a request continuing a stream of `stream_bytes` goes around the cache by the
    /// sequential cutoff.
    pub fn sequential_bypass(&self, stream_bytes: u64, cutoff: u64) -> bool {
        self.decisions.sequential_bypass(stream_bytes, cutoff)
    }

    /// How many streams past `cutoff` ran within `window_ns` before `now_ns`.
    pub fn concurrent_streams(&self, cutoff: u64, now_ns: u64, window_ns: u64) -> usize {
        self.seq.lock().concurrent(cutoff, now_ns, window_ns)
    }

    /// Whether a stream reaching the disk out of order costs it a seek per request.
    pub fn reordering_costs_seeks(&self) -> bool {
        near_requests_seek(&self.estimate(Op::Write))
    }

    /// Whether a read miss is promoted into a cache that is `full`, for a block that missed
    /// `earlier` times before (the set's ghost history).
    pub fn admit_miss(&self, admission: Admission, full: bool, earlier: u8) -> bool {
        self.decisions
            .admit_miss(admission, full, earlier, self.fill_hits.ratio())
    }

    /// The miss-fill window for the next miss, in blocks (1: no fill); counts the miss.
    pub fn fill_window(&self, cache: &CacheCosts, block_size: u64) -> u64 {
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
