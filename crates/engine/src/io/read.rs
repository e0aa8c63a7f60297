//! The read path below its stages (`plan`, which calls in here and is never called from
//! here): the lock-free hit and the check of cached blocks
//! (`lock_free_hit`, `verify_cached`, with `codec::first_bad_block`), the statistics
//! (`count_read`), and the slow path `read_inner` in its parts: the lookup and pins
//! (`look_up`, where a miss is planned: `plan_miss`), the reads (`read_miss`; holes through
//! readahead windows for a stream: `Holes::of`, `read_ahead`), the promotion (`promote`);
//! prefetch (NBD_CMD_CACHE).
//!
//! Invariants:
//! - cached blocks are read only while their bucket is pinned, and every block read from the
//!   cache is checked against its crc32c: a clean block that fails is dropped and re-read from
//!   the backing device, a dirty one is an error, never wrong data;
//! - a hit takes no lock every request shares: the index is looked up without the state lock,
//!   the pieces' buckets pinned, and the answer kept only if the index did not change
//!   meanwhile (`slots`' seqlock and `alloc`'s pin protocol); otherwise, and for a miss, the
//!   read takes the state lock once (lookup, pins, touch, and a copy of the expected crcs,
//!   which cannot change while the bucket is pinned). The cache read and the checksums run
//!   with no lock held, and the pins are dropped without the lock (`Inner::unpin`). A hit of
//!   up to 4 runs and 16 blocks allocates nothing: its blocks are read straight into the
//!   caller's buffer;
//! - a read miss is promoted only if no write touched its range while it was in flight
//!   (`cache_miss_collisions` counts the ones dropped); a miss inside a promotion in flight
//!   waits for it once (bounded) instead of reading the backing device again;
//! - sequential reads that bypass the cache are served through `readahead` windows only for
//!   blocks the index shows uncached.

use super::Volume;
use crate::alloc::WritePoint;
use crate::cachedev::Kind;
use crate::index::{Seg, Segs};
use crate::policy::{Bypass, CacheCosts, MissFacts, MissPlan, MissRead};
use crate::readahead;
use crate::state::{Promotion, State};
use crate::stats::Counters;
use crate::types::{CacheMode, DevId, Error, Result};
use crate::units::BackingBlock;
use blockdev::BlockDevice;

/// Expected crcs of the cached blocks of a request: up to 16 blocks without allocating.
pub(super) type Crcs = smallvec::SmallVec<[u32; 16]>;

/// The write points of the blocks `[run.0, run.1)` a miss read: the ones in `asked` (the
/// request's) with clean data, the miss fill's around them apart (see `alloc`). Non-empty
/// pieces, in block order.
fn fill_pieces(
    run: (BackingBlock, BackingBlock),
    asked: (BackingBlock, BackingBlock),
) -> impl Iterator<Item = (BackingBlock, BackingBlock, WritePoint)> {
    let cut = |b: BackingBlock| b.max(run.0).min(run.1);
    let (a0, a1) = (cut(asked.0), cut(asked.1));
    [
        (run.0, a0, WritePoint::Fill),
        (a0, a1, WritePoint::Clean),
        (a1, run.1, WritePoint::Fill),
    ]
    .into_iter()
    .filter(|(from, to, _)| to > from)
}

/// Pins the buckets of the cached `segs` under the state lock, touches them at `tick`, and
/// appends their blocks' expected crcs to `crcs` (a pinned block's crc cannot change).
fn pin_locked(st: &mut State, segs: &Segs, tick: u64, crcs: &mut Crcs) {
    for s in segs {
        if let Some(e) = s.ext {
            let bucket = st.index.bucket_of(e.cache_block);
            st.buckets.pin(bucket);
            st.buckets.touch(bucket, tick);
            crcs.extend((0..e.len).map(|i| st.index.crc(e.cache_block + i)));
        }
    }
}

/// Registers the promotion of `[b0, b1)` of `dev` (a miss with its fill), so a write that
/// overlaps it while in flight marks it collided; returns its id.
fn register_promotion(st: &mut State, dev: DevId, (b0, b1): (BackingBlock, BackingBlock)) -> u64 {
    let id = st.next_promotion;
    st.next_promotion += 1;
    let collided = false;
    st.promotions.insert(
        id,
        Promotion {
            dev,
            b0,
            b1,
            collided,
        },
    );
    id
}

/// Longest a miss waits for a promotion in flight over its blocks before reading them itself.
const PROMOTION_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// The miss fill around a request `[b0, b1)`: the ranges `[p0, b0)` before it and `[b1, s1)`
/// after it, as `((p0, b0), (b1, s1))`.
type BlockRanges = ((BackingBlock, BackingBlock), (BackingBlock, BackingBlock));

/// How a read treats the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Read {
    /// Hits from the cache, misses promoted (unless the admission filter refuses them; never
    /// in a sequential stream, whose next requests read what its miss fills bring in: streams
    /// are `sequential_cutoff`'s to keep out).
    Cached { stream: bool },
    /// Hits from the cache, misses read from the backing device exactly (and why).
    Bypass(Bypass),
    /// Like `Bypass`, with misses served through readahead windows (a sequential stream).
    Ahead(Bypass),
    /// Like `Cached`, without counting in the hit statistics (NBD_CMD_CACHE).
    Prefetch,
}

/// How `read_segments` reads the uncached parts of a request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holes<'a> {
    /// Exactly the requested bytes.
    Exact,
    /// Whole blocks, returned for promotion.
    Fill,
    /// Like `Fill`, cut out of one backing read of `data` at byte `start` that spans them all.
    Span { start: u64, data: &'a [u8] },
    /// Through the readahead windows.
    Ahead,
}

impl<'a> Holes<'a> {
    /// The read-ahead part of a read: a promoted miss's holes come whole (cut out of `span`
    /// when it was read in one), a sequential stream around the cache (`Read::Ahead`) reads
    /// its holes through the readahead windows (`read_ahead`), any other read exactly.
    fn of(read: Read, span: &'a Option<(u64, Vec<u8>)>, promote: bool) -> Holes<'a> {
        match span {
            Some((start, data)) => Holes::Span {
                start: *start,
                data,
            },
            None if promote => Holes::Fill,
            None if matches!(read, Read::Ahead(_)) => Holes::Ahead,
            None => Holes::Exact,
        }
    }
}

/// A read past its lookup (`Volume::look_up`): the request's segments with the cached ones
/// pinned and their expected crcs, why it goes around the cache (`None`: through it; a miss
/// the policy sent around changes it), and a miss's promotion with the miss fill around it.
struct Looked {
    segs: Segs,
    crcs: Crcs,
    why: Option<Bypass>,
    /// A miss the admission filter kept out: served around the cache, counted as a miss.
    refused: bool,
    promo: Option<u64>,
    around: BlockRanges,
}

/// What a miss's plan asks of the mechanism, answered under the state lock (see
/// `policy::MissFacts`).
struct Facts<'a> {
    vol: &'a Volume,
    st: &'a State,
    b0: BackingBlock,
    b1: BackingBlock,
    len: u64,
    /// The promotion in flight found to cover the request, to wait for.
    covering: Option<u64>,
}

impl MissFacts for Facts<'_> {
    fn cache_congested(&mut self) -> bool {
        self.vol.cache_congested(Kind::Write, self.len)
    }

    fn promotion_in_flight(&mut self) -> bool {
        let dev = self.vol.backing.id;
        self.covering = self
            .st
            .promotions
            .iter()
            .find(|(_, p)| p.dev == dev && p.b0 <= self.b0 && self.b1 <= p.b1 && !p.collided)
            .map(|(id, _)| *id);
        self.covering.is_some()
    }

    fn cache_full(&mut self) -> bool {
        self.st.buckets.free_count() + self.st.buckets.pending_count()
            < 2 * self.vol.inner.reserve_buckets
    }

    fn fill_costs(&mut self) -> CacheCosts {
        self.vol.inner.cache.fill_costs()
    }
}

impl Volume {
    /// Counts a read of `len` bytes in the hit statistics (not a prefetch): a hit or a miss,
    /// through the cache or around it (`refused`: a miss the admission filter kept out counts
    /// as a miss through the cache), and why it went around.
    pub(super) fn count_read(&self, read: Read, len: u64, hit: bool, refused: bool) {
        let why = match read {
            Read::Bypass(why) | Read::Ahead(why) => Some(why),
            Read::Cached { .. } | Read::Prefetch => None,
        };
        self.count_read_as(why, len, hit, refused);
    }

    fn count_read_as(&self, why: Option<Bypass>, len: u64, hit: bool, refused: bool) {
        let c = &self.backing.counters;
        Counters::add(
            match (why.is_some() && !refused, hit) {
                (false, true) => &c.cache_hits,
                (false, false) => &c.cache_misses,
                (true, true) => &c.cache_bypass_hits,
                (true, false) => &c.cache_bypass_misses,
            },
            1,
        );
        if let Some(why) = why {
            c.bypass(why, len);
        }
    }

    /// Prefetches a range into the cache (NBD_CMD_CACHE).
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<()> {
        crate::guard::contain(&self.inner, "prefetch", || {
            self.prefetch_unguarded(offset, len)
        })
    }

    fn prefetch_unguarded(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        let cache_use = self.backing.cache_use();
        if self.mode() == CacheMode::None || self.inner.is_degraded() || cache_use.detaching() {
            // Nothing would be kept: the hint is honoured by doing nothing.
            return Ok(());
        }
        let chunk = 1u64 << 20;
        let mut buf = vec![0u8; chunk.min(len) as usize];
        let mut at = 0;
        while at < len {
            let n = chunk.min(len - at) as usize;
            self.read_inner(offset + at, &mut buf[..n], Read::Prefetch, false)?;
            at += n as u64;
        }
        Ok(())
    }

    /// A read through the cache (or around it, by `read`), in three parts: the blocks looked
    /// up and the cached ones pinned (`look_up`: the lock-free hit, else under the state lock,
    /// where a miss is planned), the data read (`read_miss`: cached pieces from the cache,
    /// holes from the backing device or through readahead windows, with the miss fill around
    /// them), then the pins dropped, the read counted and a miss promoted (`promote`).
    /// `tried_fast`: the plan already tried the lock-free hit for this request.
    pub(super) fn read_inner(
        &self,
        offset: u64,
        buf: &mut [u8],
        read: Read,
        tried_fast: bool,
    ) -> Result<()> {
        let prefetch = read == Read::Prefetch;
        let inner = &*self.inner;
        let (b0, b1) = BackingBlock::touched_by(offset, buf.len() as u64, inner.block_size());
        let tick = inner.next_tick();
        let looked = self.look_up(
            read,
            (b0, b1),
            buf.len() as u64,
            tick,
            prefetch || tried_fast,
        );
        let (segs, promo, around) = (&looked.segs, looked.promo, looked.around);
        let hit = segs.iter().all(|s| s.ext.is_some());
        if !prefetch {
            for s in segs.iter().filter(|s| s.ext.is_some()) {
                self.backing.policy.note_read(s.block, s.block + s.len);
            }
        }
        let result = self.read_miss(
            offset,
            buf,
            read,
            (segs, &looked.crcs),
            promo.is_some(),
            around,
        );
        for s in segs {
            if let Some(e) = s.ext {
                inner.unpin(inner.bucket_of(e.cache_block));
            }
        }
        let fills = match result {
            Ok(f) => f,
            Err(e) => {
                if let Some(id) = promo {
                    inner.state.lock().promotions.remove(&id);
                    inner.promoted.notify_all();
                }
                Counters::add(&self.backing.counters.io_errors, 1);
                return Err(e);
            }
        };
        if !prefetch {
            self.count_read_as(looked.why, buf.len() as u64, hit, looked.refused);
        }
        if let Some(id) = promo {
            let ((p0, _), (s0, s1)) = around;
            self.backing.policy.note_filled(p0, b0);
            self.backing.policy.note_filled(s0, s1);
            self.promote(id, fills, (b0, b1));
        }
        Ok(())
    }

    /// The hit part of a read of `[b0, b1)` (`len` bytes): looks the blocks up and pins the
    /// cached ones' buckets (touched at `tick`), their crcs copied with the pins. Lock-free
    /// when every block is cached (unless `skip_fast`: a prefetch, or the plan tried it),
    /// else under the state lock, where a miss through the cache is planned (`plan_miss`):
    /// it waits once for a promotion in flight over it, goes around the cache, or registers
    /// its promotion with the miss fill around it.
    fn look_up(
        &self,
        read: Read,
        (b0, b1): (BackingBlock, BackingBlock),
        len: u64,
        tick: u64,
        skip_fast: bool,
    ) -> Looked {
        let why = match read {
            Read::Bypass(why) | Read::Ahead(why) => Some(why),
            Read::Cached { .. } | Read::Prefetch => None,
        };
        // Expected crcs of the cached blocks, copied with the pins in one critical section (a
        // pinned block's crc cannot change), so blocks are verified outside the lock.
        let mut crcs = Crcs::new();
        let fast = if skip_fast {
            None
        } else {
            self.lock_free_hit(b0, b1, &mut crcs)
        };
        match fast {
            Some(segs) => Looked {
                segs,
                crcs,
                why,
                refused: false,
                promo: None,
                around: ((b0, b0), (b1, b1)),
            },
            None => self.look_up_locked(read, why, (b0, b1), len, tick),
        }
    }

    /// `look_up` under the state lock (see there).
    fn look_up_locked(
        &self,
        read: Read,
        why: Option<Bypass>,
        (b0, b1): (BackingBlock, BackingBlock),
        len: u64,
        tick: u64,
    ) -> Looked {
        let inner = &*self.inner;
        let dev = self.backing.id;
        let mut waited = false;
        loop {
            let mut st = inner.state.lock();
            let segs = st.index.lookup(dev, b0, b1);
            let (mut why, mut refused, mut window) = (why, false, 1);
            let mut miss = why.is_none() && segs.iter().any(|s| s.ext.is_none());
            if miss {
                let (plan, covering) = self.plan_miss(&st, read, waited, (b0, b1), len);
                match plan {
                    MissPlan::Wait => {
                        // A miss wholly inside a promotion in flight (concurrent readers of
                        // one window, e.g. a sequential stream at queue depth > 1) waits for
                        // it, then reads the cache, instead of reading the backing device
                        // again. Once only: a promotion that collided or failed leaves the
                        // blocks uncached and this read fetches them itself.
                        let id = covering.expect("a promotion in flight");
                        waited = true;
                        inner.promoted.wait_while_for(
                            &mut st,
                            |st| st.promotions.contains_key(&id),
                            PROMOTION_WAIT_MAX,
                        );
                        continue;
                    }
                    MissPlan::Around(reason) => {
                        // Congested: promoting would wait on the slow cache device (cached
                        // pieces still come from the cache). Admission: kept out of a full
                        // cache, counted as a miss.
                        (miss, why) = (false, Some(reason));
                        refused = reason == Bypass::Admission;
                    }
                    MissPlan::Promote { window: w } => window = w,
                }
            }
            let around = if miss {
                self.miss_fill(&st.index, b0, b1, window)
            } else {
                ((b0, b0), (b1, b1))
            };
            let mut crcs = Crcs::new();
            pin_locked(&mut st, &segs, tick, &mut crcs);
            let promo = miss.then(|| register_promotion(&mut st, dev, (around.0 .0, around.1 .1)));
            return Looked {
                segs,
                crcs,
                why,
                refused,
                promo,
                around,
            };
        }
    }

    /// The policy's plan for a miss of `[b0, b1)` through the cache (`waited`: it already
    /// waited for a promotion in flight), asked under the state lock; with `Wait`, the
    /// promotion in flight to wait for.
    fn plan_miss(
        &self,
        st: &State,
        read: Read,
        waited: bool,
        (b0, b1): (BackingBlock, BackingBlock),
        len: u64,
    ) -> (MissPlan, Option<u64>) {
        let kind = match read {
            Read::Prefetch => MissRead::Prefetch,
            Read::Cached { stream: true } => MissRead::Stream,
            _ => MissRead::Random,
        };
        let mut facts = Facts {
            vol: self,
            st,
            b0,
            b1,
            len,
            covering: None,
        };
        let bs = self.inner.block_size();
        let dev = self.backing.id;
        let plan = self
            .backing
            .policy
            .plan_miss(kind, waited, dev, b0, bs, &mut facts);
        (plan, facts.covering)
    }

    /// The miss part of a read: reads `segs` into `buf` (the cached ones from the cache,
    /// checked against `crcs`, the holes from the backing device) and, for a miss that is
    /// promoted (`promote`), returns the whole-block data to promote: the request's and the
    /// miss fill's `around` it. Uncached blocks next to a miss come along, in offset order; a
    /// request that is one hole is read together with them in a single backing read (one
    /// seek, even when other requests are queued on the disk).
    fn read_miss(
        &self,
        offset: u64,
        buf: &mut [u8],
        read: Read,
        (segs, crcs): (&[Seg], &[u32]),
        promote: bool,
        around: BlockRanges,
    ) -> Result<Vec<(BackingBlock, Vec<u8>)>> {
        let bs = self.inner.block_size();
        let ((p0, p1), (s0, s1)) = around;
        if promote && segs.len() == 1 && segs[0].ext.is_none() {
            return self.read_one_hole(offset, buf, around);
        }
        let span = if promote {
            self.read_span(segs, around)?
        } else {
            None
        };
        let range = |b0: BackingBlock, b1: BackingBlock| -> Result<Vec<u8>> {
            let (from, to) = (b0.offset(bs), b1.offset(bs));
            if let Some((start, d)) = &span {
                return Ok(d[(from - start) as usize..(to - start) as usize].to_vec());
            }
            let mut d = vec![0u8; (to - from) as usize];
            self.backing_read(&mut d, from)?;
            Ok(d)
        };
        let mut fills = Vec::new();
        if p1 > p0 {
            fills.push((p0, range(p0, p1)?));
        }
        let holes = Holes::of(read, &span, promote);
        fills.extend(self.read_segments(segs, crcs, offset, buf, holes)?);
        if s1 > s0 {
            fills.push((s0, range(s0, s1)?));
        }
        Ok(fills)
    }

    /// A promoted miss that is one hole: one backing read from the miss fill's first block
    /// to its last (`around`), the request cut out of it; returns the whole blocks.
    fn read_one_hole(
        &self,
        offset: u64,
        buf: &mut [u8],
        around: BlockRanges,
    ) -> Result<Vec<(BackingBlock, Vec<u8>)>> {
        let bs = self.inner.block_size();
        let ((p0, _), (b1, s1)) = around;
        let end = offset + buf.len() as u64;
        let from = p0.offset(bs);
        let to = if s1 > b1 {
            s1.offset(bs)
        } else {
            b1.offset(bs).min(self.size_bytes())
        };
        let mut d = vec![0u8; (to - from) as usize];
        self.backing_read(&mut d, from)?;
        buf.copy_from_slice(&d[(offset - from) as usize..(end - from) as usize]);
        d.truncate((d.len() as u64 / bs * bs) as usize);
        Ok(if d.is_empty() {
            Vec::new()
        } else {
            vec![(p0, d)]
        })
    }

    /// A promoted miss with several holes between cached blocks: one backing read from the
    /// first uncached block to the last (with the miss fill `around`) when the cost model
    /// says the cached gaps' transfer costs less than the reads saved (one seek, as the bare
    /// disk would do), the cached blocks' stale copies in it ignored: `(its offset, data)`.
    fn read_span(&self, segs: &[Seg], around: BlockRanges) -> Result<Option<(u64, Vec<u8>)>> {
        let bs = self.inner.block_size();
        let ((p0, p1), (s0, s1)) = around;
        let hole_count = segs.iter().filter(|s| s.ext.is_none()).count() as u64;
        let first_hole = segs.iter().position(|s| s.ext.is_none()).unwrap_or(0);
        let last_hole = segs.iter().rposition(|s| s.ext.is_none()).unwrap_or(0);
        let gap_bytes: u64 = segs[first_hole..=last_hole.max(first_hole)]
            .iter()
            .filter(|s| s.ext.is_some())
            .map(|s| s.len * bs)
            .sum();
        let mut hole_segs = segs.iter().filter(|s| s.ext.is_none());
        Ok(match (hole_segs.next(), hole_segs.next_back()) {
            (Some(first), Some(last)) if self.backing.policy.span_holes(hole_count, gap_bytes) => {
                let from = if p1 > p0 { p0 } else { first.block }.offset(bs);
                let to = if s1 > s0 { s1 } else { last.block + last.len }
                    .offset(bs)
                    .min(self.size_bytes());
                let mut d = vec![0u8; (to - from) as usize];
                self.backing_read(&mut d, from)?;
                Some((from, d))
            }
            _ => None,
        })
    }

    /// A read while the cache device's reads are slower than `congested_read_threshold_us`
    /// (see `cachedev`): served by the backing device unless part of it is dirty (then the
    /// cache device has the only current copy). `None`: not congested, or dirty.
    pub(super) fn read_around_congestion(&self, offset: u64, buf: &mut [u8]) -> Option<Result<()>> {
        let (b0, b1) = BackingBlock::touched_by(offset, buf.len() as u64, self.inner.block_size());
        let dirty = self
            .inner
            .state
            .lock()
            .index
            .any_overlapping(self.backing.id, b0, b1, |e| e.dirty);
        if dirty {
            return None;
        }
        self.backing
            .counters
            .bypass(Bypass::Congested, buf.len() as u64);
        Some(self.backing_read(buf, offset))
    }

    /// A hit found and pinned without the state lock: every block of `[b0, b1)` cached, each
    /// piece's bucket pinned and the blocks' crcs in `crcs`, checked against the index's
    /// seqlock after the pins (see `slots` and `alloc`). `None` (nothing pinned, `crcs` empty):
    /// a miss, or the index changed meanwhile; the locked path decides.
    pub(super) fn lock_free_hit(
        &self,
        b0: BackingBlock,
        b1: BackingBlock,
        crcs: &mut Crcs,
    ) -> Option<Segs> {
        let inner = &*self.inner;
        let reader = &inner.index_reader;
        let Some((seq, segs)) = crate::index::lookup_hit(reader, self.backing.id, b0, b1, crcs)
        else {
            crcs.clear();
            return None;
        };
        let buckets = || {
            segs.iter()
                .filter_map(|s| s.ext.map(|e| inner.bucket_of(e.cache_block)))
        };
        buckets().for_each(|b| inner.pins.pin_unlocked(b));
        if reader.valid(seq) {
            buckets().for_each(|b| inner.touches.note(b));
            return Some(segs);
        }
        buckets().for_each(|b| inner.unpin(b));
        crcs.clear();
        None
    }

    /// The miss fill: the uncached blocks around `[b0, b1)` up to the enclosing window of
    /// `window` blocks (the policy's, `MissPlan::Promote`) are read and promoted too. Returns
    /// the extra ranges before and after the request (empty when the window is one block or
    /// the neighbours are cached).
    fn miss_fill(
        &self,
        index: &crate::index::Index,
        b0: BackingBlock,
        b1: BackingBlock,
        window: u64,
    ) -> BlockRanges {
        let bs = self.inner.block_size();
        if window <= 1 {
            return ((b0, b0), (b1, b1));
        }
        // The enclosing window (aligning is arithmetic on the raw block numbers).
        let dev_blocks = self.size_bytes() / bs;
        let w0 = BackingBlock::new(b0.get() / window * window);
        let w1 = BackingBlock::new((b1.get().div_ceil(window) * window).min(dev_blocks)).max(b1);
        let before = index.lookup(self.backing.id, w0, b0);
        let p0 = match before.last() {
            Some(s) if s.ext.is_none() => s.block,
            _ => b0,
        };
        let after = index.lookup(self.backing.id, b1, w1);
        let s1 = match after.first() {
            Some(s) if s.ext.is_none() => s.block + s.len,
            _ => b1,
        };
        ((p0, b0), (b1, s1))
    }

    /// Reads every segment into `buf` (`crcs`: those of the cached blocks, in order); returns
    /// whole-block data of the holes to promote.
    fn read_segments(
        &self,
        segs: &[Seg],
        mut crcs: &[u32],
        offset: u64,
        buf: &mut [u8],
        holes: Holes,
    ) -> Result<Vec<(BackingBlock, Vec<u8>)>> {
        let want_fills = matches!(holes, Holes::Fill | Holes::Span { .. });
        let bs = self.inner.block_size();
        let end = offset + buf.len() as u64;
        let mut fills = Vec::new();
        for s in segs {
            let (seg_start, seg_end) = (s.block.offset(bs), (s.block + s.len).offset(bs));
            let data = match s.ext {
                Some(e) => {
                    let (expected, rest) = crcs.split_at(e.len as usize);
                    crcs = rest;
                    let whole = offset <= seg_start && seg_end <= end;
                    let mut bounce = Vec::new();
                    let out = if whole {
                        // The common case: straight into the caller's buffer, no copy.
                        &mut buf[(seg_start - offset) as usize..(seg_end - offset) as usize]
                    } else {
                        bounce.resize((seg_end - seg_start) as usize, 0);
                        &mut bounce[..]
                    };
                    if !self.read_cached(s.block, e, expected, out)? {
                        // Clean block failed its checksum: dropped, read the backing device.
                        let n = (seg_end.min(self.size_bytes()) - seg_start) as usize;
                        self.backing_read(&mut out[..n], seg_start)?;
                    }
                    if whole {
                        continue;
                    }
                    bounce
                }
                None => {
                    // Read whole blocks when promoting (the seek is paid anyway), else exactly
                    // what was asked.
                    let (from, to) = if want_fills {
                        (seg_start, seg_end.min(self.size_bytes()))
                    } else {
                        (seg_start.max(offset), seg_end.min(end))
                    };
                    let mut d = match holes {
                        Holes::Ahead => {
                            self.read_ahead(
                                from,
                                &mut buf[(from - offset) as usize..(to - offset) as usize],
                            )?;
                            continue;
                        }
                        Holes::Span { start, data } => {
                            data[(from - start) as usize..(to - start) as usize].to_vec()
                        }
                        _ => {
                            let mut d = vec![0u8; (to - from) as usize];
                            self.backing_read(&mut d, from)?;
                            d
                        }
                    };
                    let copy_from = seg_start.max(offset);
                    let copy_to = seg_end.min(end);
                    buf[(copy_from - offset) as usize..(copy_to - offset) as usize]
                        .copy_from_slice(
                            &d[(copy_from - from) as usize..(copy_to - from) as usize],
                        );
                    if want_fills {
                        // Only whole blocks are cached; a partial last block (device end) is not.
                        let whole = d.len() as u64 / bs * bs;
                        if whole > 0 {
                            d.truncate(whole as usize);
                            fills.push((s.block, d));
                        }
                    }
                    continue;
                }
            };
            let copy_from = seg_start.max(offset);
            let copy_to = seg_end.min(end);
            buf[(copy_from - offset) as usize..(copy_to - offset) as usize].copy_from_slice(
                &data[(copy_from - seg_start) as usize..(copy_to - seg_start) as usize],
            );
        }
        Ok(fills)
    }

    /// Reads uncached data of a sequential stream from a readahead window, or reads a new
    /// window from the backing device (see `readahead`'s invariants). Windows are aligned to
    /// `WINDOW_BYTES`, so a stream whose holes are scattered between cached blocks still reads
    /// the disk in back-to-back windows (no seek between them) rather than one window per
    /// hole, each a seek away from the last.
    fn read_ahead(&self, from: u64, out: &mut [u8]) -> Result<()> {
        let ra = &self.backing.readahead;
        let generation = {
            let mut r = ra.lock();
            if r.get(from, out) {
                return Ok(());
            }
            r.generation()
        };
        let start = from / readahead::WINDOW_BYTES * readahead::WINDOW_BYTES;
        let end = from + out.len() as u64;
        let to = (start + readahead::WINDOW_BYTES)
            .max(end)
            .min(self.size_bytes());
        let mut d = vec![0u8; (to - start) as usize];
        self.backing_read(&mut d, start)?;
        let at = (from - start) as usize;
        out.copy_from_slice(&d[at..at + out.len()]);
        ra.lock().insert(generation, start, d);
        Ok(())
    }

    /// Reads cached extent `e` (its bucket pinned by the caller) into `out` (`e.len` blocks)
    /// and verifies every block against `crcs` (copied from the index with the pin), with no
    /// lock held. `Ok(false)`: a clean block failed its checksum and the extent was dropped
    /// from the index (`out` then holds nothing useful).
    pub(super) fn read_cached(
        &self,
        block: BackingBlock,
        e: crate::index::Extent,
        crcs: &[u32],
        out: &mut [u8],
    ) -> Result<bool> {
        let inner = &*self.inner;
        let off = inner.layout.cache_block_offset(e.cache_block);
        Counters::add(&self.backing.counters.cache_read_bytes, out.len() as u64);
        if let Err(err) = inner.cache.read_at(out, off) {
            let err = Error::io(format!("reading cache device at {off}"), err);
            self.cache_failed(&err);
            if e.dirty {
                // The cache device holds the only current copy.
                return Err(err);
            }
            self.drop_copy(block, e);
            return Ok(false);
        }
        self.verify_cached(block, e, crcs, out)
    }

    /// Checks cached extent `e` of `block`, read into `out`, against `crcs`: `Ok(true)` if
    /// every block matches; a clean block that does not is logged and counted, the extent
    /// dropped from the index (`Ok(false)`: read the backing device instead); a dirty one is
    /// `DataCorrupt`.
    pub(super) fn verify_cached(
        &self,
        block: BackingBlock,
        e: crate::index::Extent,
        crcs: &[u32],
        out: &[u8],
    ) -> Result<bool> {
        let inner = &*self.inner;
        let Some(i) = crate::codec::first_bad_block(out, crcs, inner.block_size()) else {
            return Ok(true);
        };
        let what = format!(
            "device {} block {} (cache block {})",
            self.backing.id,
            block + u64::from(i),
            e.cache_block + i
        );
        if e.dirty {
            Counters::add(&self.backing.counters.io_errors, 1);
            {
                static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
                LOG.log(
                    log::Level::Error,
                    format_args!("checksum mismatch on dirty data: {what}"),
                );
            }
            return Err(Error::DataCorrupt(what));
        }
        {
            static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
            LOG.log(
                log::Level::Warn,
                format_args!(
                    "checksum mismatch on clean cached data, re-reading from the backing \
                     device: {what}"
                ),
            );
        }
        Counters::add(&self.backing.counters.checksum_repairs, 1);
        inner.cache.note_error();
        inner.after_cache_error(&format_args!("checksum mismatch on clean data: {what}"));
        self.drop_copy(block, e);
        Ok(false)
    }

    /// Drops the clean copy `e` of `block` (unreadable, or failed its checksum) if the index
    /// still maps it there; the caller re-reads the backing device.
    pub(super) fn drop_copy(&self, block: BackingBlock, e: crate::index::Extent) {
        let inner = &*self.inner;
        let mut st = inner.state.lock();
        if st
            .index
            .maps_to(self.backing.id, block, e.len, e.cache_block)
        {
            let now = inner.now_ns();
            st.invalidate(self.backing.id, block, block + u64::from(e.len), now);
        }
    }

    /// Inserts read-miss data into the cache unless a write overlapped it meanwhile: the
    /// blocks of `asked` (the request's) with the clean data, the rest (the miss fill's) at
    /// their own write point.
    fn promote(
        &self,
        id: u64,
        fills: Vec<(BackingBlock, Vec<u8>)>,
        asked: (BackingBlock, BackingBlock),
    ) {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let pieces = fills.iter().flat_map(|(block, data)| {
            let end = *block + data.len() as u64 / bs;
            fill_pieces((*block, end), asked).map(move |(from, to, point)| {
                let range = ((from - *block) * bs) as usize..((to - *block) * bs) as usize;
                (from, &data[range], point)
            })
        });
        for (block, data, point) in pieces {
            if inner
                .state
                .lock()
                .promotions
                .get(&id)
                .is_none_or(|p| p.collided)
            {
                break;
            }
            if let Err(e) = self.cache_insert(block, data, point, Some(id)) {
                self.cache_failed(&e);
                break;
            }
        }
        let p = inner.state.lock().promotions.remove(&id);
        inner.promoted.notify_all();
        if p.is_some_and(|p| p.collided) {
            Counters::add(&self.backing.counters.cache_miss_collisions, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_keeps_the_blocks_asked_for_apart_from_their_neighbours() {
        let b = BackingBlock::new;
        let pieces = |run: (u64, u64), asked: (u64, u64)| {
            fill_pieces((b(run.0), b(run.1)), (b(asked.0), b(asked.1)))
                .map(|(f, t, p)| (f.get(), t.get(), p))
                .collect::<Vec<_>>()
        };
        use WritePoint::{Clean, Fill};
        assert_eq!(
            pieces((0, 16), (5, 7)),
            [(0, 5, Fill), (5, 7, Clean), (7, 16, Fill)]
        );
        assert_eq!(pieces((0, 16), (0, 16)), [(0, 16, Clean)]);
        // Pieces of a fill wholly before or after the request.
        assert_eq!(pieces((0, 4), (8, 9)), [(0, 4, Fill)]);
        assert_eq!(pieces((9, 16), (8, 9)), [(9, 16, Fill)]);
        assert_eq!(pieces((3, 10), (0, 5)), [(3, 5, Clean), (5, 10, Fill)]);
    }
}
