//! The miss fill: how much a miss reads around itself ([`miss_fill_window`], from the backing
//! device's cost model and the measured benefit of fills) and whether a miss with several holes
//! is read in one backing read ([`span_holes`]).
//!
//! Invariant: pure; the same inputs give the same decisions.

use crate::cost::CostEstimate;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
