//! The cost model of one device, learned online: how long a request takes, as a fixed cost, a
//! cost per byte and a positioning cost that grows with the distance from where the previous
//! request ended (a seek). Pure: it is fed `(offset, len, elapsed)` observations and answers
//! estimates; it never does I/O or reads a clock. The engine keeps one per backing device and
//! one for the cache device (see `set::Backing::cost`, `cachedev`).
//!
//! Shape: requests fall into `BUCKETS` distance buckets (0: continues the previous request;
//! then (0, 64 KiB], and ×4 per bucket up to the last, which takes every longer distance).
//! Each bucket holds an exponentially weighted linear regression of time on length (weighted
//! means of x, y, x², xy, y²; the weight of a new sample is `1/n` for the first
//! `1/ALPHA` samples, then `ALPHA`). The cost per byte is the pooled within-bucket slope (the
//! buckets' covariances over their variances, so a positioning cost that differs between
//! buckets does not leak into it); a bucket's intercept is its mean time minus that slope times
//! its mean length. The fixed cost is the smallest intercept of a bucket with `MIN_SAMPLES`
//! samples, and a bucket's positioning cost is its intercept above that, less twice the
//! standard error of the difference (from each bucket's residual variance), so noise is not
//! taken for positioning. A disk seen only at
//! random distances thus counts its rotational delay as fixed until it also sees sequential
//! requests: the model underestimates positioning rather than inventing it.
//!
//! Invariants:
//! - bounded memory: two kinds (read, write) × `BUCKETS` fits plus a little state, whatever
//!   the number of requests; `observe` and `estimate` are O(`BUCKETS`) and allocate nothing;
//! - the ROTATIONAL flag only seeds: with fewer than `WARM_SAMPLES` usable samples a
//!   rotational device gets `ROTATIONAL_PRIOR`, a non-rotational one no positioning cost;
//!   past that, only observations count;
//! - the cost per byte is known (`Some`) only once the lengths seen varied enough
//!   (`MIN_XVAR`) to separate it from the fixed cost; it is then kept (and follows new
//!   samples while lengths keep varying) rather than forgotten when they stop varying;
//! - every estimate is finite and non-negative.

/// The service time of a request issued at `issued` and completed at `done`, when the latest
/// completion on the device seen before it was at `prev_done` (all in ns on one clock). A
/// device that serves one request at a time (a disk's actuator) started on this one when it
/// finished the one before, so the time before that was queueing behind others, not this
/// request's cost: under queue depth 8 it made a disk's cost per byte look 150× too high (the
/// miss fill then shrank to nothing). A completion already seen later than this one (threads
/// see completions out of order) says nothing, and the whole time counts. On a device that
/// serves several at once this is shorter than each request's own time; the fixed cost and
/// the cost per byte shrink together, so the decisions that compare them hold.
pub fn service_ns(issued: u64, done: u64, prev_done: u64) -> u64 {
    let from = if prev_done < done {
        issued.max(prev_done)
    } else {
        issued
    };
    done.saturating_sub(from)
}

/// Distance buckets: 0, (0, 64 KiB], (64 KiB, 256 KiB], … ×4 …, the last open-ended.
pub const BUCKETS: usize = 12;
/// Weight of a new sample once a bucket has `1/ALPHA` samples.
pub const ALPHA: f64 = 1.0 / 64.0;
/// A bucket's intercept counts once it has this many samples.
pub const MIN_SAMPLES: u32 = 4;
/// Usable samples (in buckets with `MIN_SAMPLES`) before observations replace the seed.
pub const WARM_SAMPLES: u32 = 16;
/// Σ weight × variance of lengths (bytes²) needed before the cost per byte is trusted: a few
/// requests whose lengths differ by tens of KiB.
pub const MIN_XVAR: f64 = 4.0 * 32768.0 * 32768.0;

/// The seed of a device that reports itself rotational (a 7200 rpm disk: half a revolution
/// fixed, 8 ms to position, 150 MB/s).
pub const ROTATIONAL_PRIOR: CostEstimate = CostEstimate {
    samples: 0,
    learned: false,
    fixed_ns: 4_200_000.0,
    per_byte_ns: Some(1e9 / 150e6),
    per_byte_low_ns: Some(1e9 / 150e6),
    seek_ns: 8_000_000.0,
    seek_by_bucket: [Some(8_000_000.0); BUCKETS],
};

/// The distance bucket of a request starting `distance` bytes from where the previous ended.
pub fn bucket(distance: u64) -> usize {
    if distance == 0 {
        return 0;
    }
    let log2 = 64 - (distance - 1).leading_zeros(); // ceil(log2(distance))
    if log2 <= 16 {
        1
    } else {
        (1 + (log2 - 16).div_ceil(2) as usize).min(BUCKETS - 1)
    }
}

/// The largest distance of bucket `b` (`u64::MAX` for the last).
pub fn bucket_limit(b: usize) -> u64 {
    match b {
        0 => 0,
        _ if b == BUCKETS - 1 => u64::MAX,
        _ => (64u64 << 10) << (2 * (b - 1)),
    }
}

/// An exponentially weighted linear regression of time (y, ns) on length (x, bytes).
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    n: u32,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    yy: f64,
}

impl Fit {
    fn add(&mut self, x: f64, y: f64) {
        self.n = self.n.saturating_add(1);
        let a = (1.0 / f64::from(self.n)).max(ALPHA);
        let mix = |m: &mut f64, v: f64| *m += a * (v - *m);
        mix(&mut self.x, x);
        mix(&mut self.y, y);
        mix(&mut self.xx, x * x);
        mix(&mut self.xy, x * y);
        mix(&mut self.yy, y * y);
    }

    /// Squared standard error of the intercept with `slope` (residual variance over the
    /// effective number of samples).
    fn intercept_var(&self, slope: f64) -> f64 {
        let var_y = (self.yy - self.y * self.y).max(0.0);
        let resid = var_y - 2.0 * slope * self.cov() + slope * slope * self.var_x();
        resid.max(0.0) / self.weight()
    }

    /// Effective number of samples behind the means.
    fn weight(&self) -> f64 {
        f64::from(self.n).min(1.0 / ALPHA)
    }

    fn var_x(&self) -> f64 {
        (self.xx - self.x * self.x).max(0.0)
    }

    fn cov(&self) -> f64 {
        self.xy - self.x * self.y
    }
}

/// What a request is, for the model (reads and writes cost differently on most devices).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    Read,
    Write,
}

#[derive(Clone, Debug, Default)]
struct Kind {
    fits: [Fit; BUCKETS],
    /// Recent share of requests per bucket (exponentially weighted), for the typical seek.
    share: [f64; BUCKETS],
    /// The last trusted cost per byte.
    per_byte: Option<f64>,
    /// Its standard error when it was taken.
    per_byte_se: f64,
}

/// The current estimates of one kind of request on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostEstimate {
    /// Samples behind the estimate (0: the seed).
    pub samples: u64,
    /// Whether the estimate comes from observations (not the seed).
    pub learned: bool,
    /// Time of an empty request that continues the previous one (ns).
    pub fixed_ns: f64,
    /// Transfer time per byte (ns); `None` until lengths varied enough to tell.
    pub per_byte_ns: Option<f64>,
    /// A low bound of it: less twice its standard error, at least 0 (positioning noise on a
    /// disk makes the slope uncertain for many samples; decisions that must not
    /// underestimate what a miss is worth in bytes use this).
    pub per_byte_low_ns: Option<f64>,
    /// Positioning cost of a typical request at the distances seen recently (ns).
    pub seek_ns: f64,
    /// Positioning cost per distance bucket (`None`: too few samples there).
    pub seek_by_bucket: [Option<f64>; BUCKETS],
}

impl CostEstimate {
    /// Positioning cost at `distance`: its bucket's, or the nearest shorter bucket's with
    /// samples, or the typical one.
    pub fn seek_at(&self, distance: u64) -> f64 {
        (0..=bucket(distance))
            .rev()
            .find_map(|b| self.seek_by_bucket[b])
            .unwrap_or(self.seek_ns)
    }

    /// Estimated time of a request of `len` bytes `distance` bytes from the previous one
    /// (an unknown cost per byte counts as 0).
    pub fn time_ns(&self, len: u64, distance: u64) -> f64 {
        self.fixed_ns + self.seek_at(distance) + self.per_byte_ns.unwrap_or(0.0) * len as f64
    }
}

/// The model of one device: read and write fits, and where the previous request ended.
#[derive(Clone, Debug)]
pub struct CostModel {
    rotational: bool,
    last_end: u64,
    samples: u64,
    read: Kind,
    write: Kind,
}

impl CostModel {
    /// A model seeded by the device's ROTATIONAL flag.
    pub fn new(rotational: bool) -> CostModel {
        CostModel {
            rotational,
            last_end: 0,
            samples: 0,
            read: Kind::default(),
            write: Kind::default(),
        }
    }

    /// Records that a request of `len` bytes at `offset` took `ns`. Requests are taken in
    /// the order they are observed (under concurrency: completion order; the caller passes
    /// the service time, see [`service_ns`], where the device serves one at a time).
    pub fn observe(&mut self, op: Op, offset: u64, len: u64, ns: u64) {
        let b = bucket(offset.abs_diff(self.last_end));
        self.last_end = offset.saturating_add(len);
        self.samples += 1;
        let k = match op {
            Op::Read => &mut self.read,
            Op::Write => &mut self.write,
        };
        k.fits[b].add(len as f64, ns as f64);
        for (i, s) in k.share.iter_mut().enumerate() {
            *s += ALPHA * (f64::from(u8::from(i == b)) - *s);
        }
        let (mut cov, mut var, mut weight) = (0.0, 0.0, 0.0);
        for f in k.fits.iter().filter(|f| f.n >= 2) {
            cov += f.weight() * f.cov();
            var += f.weight() * f.var_x();
            weight += f.weight();
        }
        if var >= MIN_XVAR {
            let slope = cov / var;
            // Pooled residual variance over the lengths' spread: the slope's squared error.
            let resid: f64 = k
                .fits
                .iter()
                .filter(|f| f.n >= 2)
                .map(|f| f.weight() * f.intercept_var(slope) * f.weight())
                .sum();
            k.per_byte = Some(slope.max(0.0));
            k.per_byte_se = (resid / weight / var).max(0.0).sqrt();
        }
    }

    /// Observations so far (both kinds).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The current estimate for `op`.
    pub fn estimate(&self, op: Op) -> CostEstimate {
        let k = match op {
            Op::Read => &self.read,
            Op::Write => &self.write,
        };
        let per_byte = k.per_byte;
        let per_byte_low = per_byte.map(|p| (p - 2.0 * k.per_byte_se).max(0.0));
        let slope = per_byte.unwrap_or(0.0);
        let intercept: [Option<f64>; BUCKETS] = std::array::from_fn(|b| {
            let f = &k.fits[b];
            (f.n >= MIN_SAMPLES).then(|| (f.y - slope * f.x).max(0.0))
        });
        let usable: u32 = k
            .fits
            .iter()
            .filter(|f| f.n >= MIN_SAMPLES)
            .map(|f| f.n)
            .fold(0u32, u32::saturating_add);
        let samples = k.fits.iter().map(|f| u64::from(f.n)).sum();
        if usable < WARM_SAMPLES {
            if self.rotational {
                return CostEstimate {
                    samples,
                    ..ROTATIONAL_PRIOR
                };
            }
            let fixed = intercept
                .iter()
                .flatten()
                .fold(f64::INFINITY, |a, &b| a.min(b));
            return CostEstimate {
                samples,
                learned: false,
                fixed_ns: if fixed.is_finite() { fixed } else { 0.0 },
                per_byte_ns: per_byte,
                per_byte_low_ns: per_byte_low,
                seek_ns: 0.0,
                seek_by_bucket: [None; BUCKETS],
            };
        }
        let (fixed, fixed_var) = (0..BUCKETS)
            .filter_map(|b| intercept[b].map(|i| (i, k.fits[b].intercept_var(slope))))
            .fold((f64::INFINITY, 0.0), |a, b| if b.0 < a.0 { b } else { a });
        // A bucket's positioning is its intercept above the fixed cost, less twice the
        // standard error of that difference: noise (a loaded host, a disk's rotation) is not
        // taken for positioning.
        let seek_by_bucket: [Option<f64>; BUCKETS] = std::array::from_fn(|b| {
            intercept[b].map(|i| {
                let se = (k.fits[b].intercept_var(slope) + fixed_var).sqrt();
                (i - fixed - 2.0 * se).max(0.0)
            })
        });
        // The typical seek: buckets other than 0 weighted by how often requests land there.
        let (mut sum, mut weight) = (0.0, 0.0);
        for (s, share) in seek_by_bucket.iter().zip(k.share).skip(1) {
            if let Some(s) = s {
                sum += share * s;
                weight += share;
            }
        }
        CostEstimate {
            samples,
            learned: true,
            fixed_ns: fixed,
            per_byte_ns: per_byte,
            per_byte_low_ns: per_byte_low,
            seek_ns: if weight > 0.0 { sum / weight } else { 0.0 },
            seek_by_bucket,
        }
    }
}

/// A device's cost model estimates, for status.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DevCost {
    pub read: CostEstimate,
    pub write: CostEstimate,
}

#[cfg(test)]
mod tests {
    #[test]
    fn service_time_leaves_out_queueing_behind_earlier_requests() {
        // Alone: the whole time.
        assert_eq!(service_ns(100, 150, 20), 50);
        // Queued behind a request that completed at 130: served from then.
        assert_eq!(service_ns(100, 150, 130), 20);
        // Eight issued at once on a one-actuator disk, 10 each: every one costs 10.
        let mut prev = 0;
        for k in 1..=8 {
            let done = 10 * k;
            assert_eq!(service_ns(0, done, prev), 10);
            prev = done;
        }
        // A later completion already seen: no information, the whole time.
        assert_eq!(service_ns(100, 150, 160), 50);
        assert_eq!(service_ns(100, 150, 150), 50);
    }

    use super::*;

    /// A deterministic pseudo-random sequence (splitmix64; no clock, no RNG crate).
    fn lcg(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Feeds `n` requests at pseudo-random offsets of a `size`-byte device, with lengths
    /// alternating 4 KiB and 64 KiB, timed by `cost(len, distance)`.
    fn feed(m: &mut CostModel, n: usize, size: u64, cost: impl Fn(u64, u64) -> f64) {
        let mut s = 7;
        let mut last_end = 0u64;
        for i in 0..n {
            let len = if i % 2 == 0 { 4096 } else { 65536 };
            let off = lcg(&mut s) % (size / 4096) * 4096;
            let d = off.abs_diff(last_end);
            m.observe(Op::Read, off, len, cost(len, d) as u64);
            last_end = off + len;
        }
    }

    #[test]
    fn buckets_grow_by_four_from_64k() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(65536), 1);
        assert_eq!(bucket(65537), 2);
        assert_eq!(bucket(256 << 10), 2);
        assert_eq!(bucket((256 << 10) + 1), 3);
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
        for b in 1..BUCKETS - 1 {
            assert_eq!(bucket(bucket_limit(b)), b);
            assert_eq!(bucket(bucket_limit(b) + 1), b + 1);
        }
    }

    #[test]
    fn a_seek_bound_device_is_fitted() {
        // 0.1 ms fixed, 5.5 ns/B (180 MB/s), seek 0.5 + 14.5 × sqrt(distance / size) ms.
        let size = 1u64 << 30;
        let seek = |d: u64| {
            if d == 0 {
                0.0
            } else {
                500_000.0 + 14_500_000.0 * (d as f64 / size as f64).sqrt()
            }
        };
        let mut m = CostModel::new(false);
        feed(&mut m, 2000, size, |len, d| {
            100_000.0 + 5.5 * len as f64 + seek(d)
        });
        let e = m.estimate(Op::Read);
        assert!(e.learned);
        let pb = e.per_byte_ns.unwrap();
        // Positioning varies within a bucket (×2 across a ×4 range of distance), which is
        // noise to the per-byte fit over the last ~`1/ALPHA` samples of each bucket.
        assert!(pb > 2.5 && pb < 10.0, "{e:?}");
        // Random distances only: the fixed cost is the nearest bucket's, the typical seek is
        // the growth above it, several ms.
        assert!(e.seek_ns > 2_000_000.0, "{e:?}");
        assert!(e.seek_at(512 << 20) > e.seek_at(1 << 20), "{e:?}");
        let t = e.time_ns(4096, 512 << 20);
        let truth = 100_000.0 + 5.5 * 4096.0 + seek(512 << 20);
        assert!((t - truth).abs() / truth < 0.15, "{t} vs {truth}");
    }

    #[test]
    fn a_transfer_bound_device_has_no_seek() {
        // 80 µs fixed, 0.67 ns/B, no positioning: the seek comes out ~0.
        let mut m = CostModel::new(false);
        feed(&mut m, 500, 1 << 30, |len, _| 80_000.0 + 0.67 * len as f64);
        let e = m.estimate(Op::Read);
        assert!(e.learned);
        assert!((e.per_byte_ns.unwrap() - 0.67).abs() < 0.05, "{e:?}");
        assert!((e.fixed_ns - 80_000.0).abs() < 2_000.0, "{e:?}");
        assert!(e.seek_ns < 2_000.0, "{e:?}");
        // Writes were never seen: their estimate is the (non-rotational) seed.
        let w = m.estimate(Op::Write);
        assert!(!w.learned && w.seek_ns == 0.0 && w.per_byte_ns.is_none());
    }

    #[test]
    fn the_rotational_flag_only_seeds() {
        let mut m = CostModel::new(true);
        assert_eq!(m.estimate(Op::Read), ROTATIONAL_PRIOR);
        feed(&mut m, 500, 1 << 30, |len, _| 80_000.0 + 0.67 * len as f64);
        let e = m.estimate(Op::Read);
        assert!(e.learned && e.seek_ns < 2_000.0, "{e:?}");
        assert_eq!(m.samples(), 500);
    }

    #[test]
    fn the_cost_per_byte_needs_varied_lengths_and_is_kept() {
        let mut m = CostModel::new(false);
        let mut s = 3;
        for _ in 0..100 {
            let off = lcg(&mut s) % 1000 * 4096;
            m.observe(Op::Read, off, 4096, 1_000_000);
        }
        assert_eq!(m.estimate(Op::Read).per_byte_ns, None);
        m.observe(Op::Read, 0, 4096, 1_000_000);
        m.observe(Op::Read, 1 << 20, 262144, 1_000_000 + 2 * 258048);
        let pb = m.estimate(Op::Read).per_byte_ns.expect("two lengths seen");
        assert!(pb > 0.0);
        for _ in 0..1000 {
            let off = lcg(&mut s) % 1000 * 4096;
            m.observe(Op::Read, off, 4096, 1_000_000);
        }
        assert!(m.estimate(Op::Read).per_byte_ns.is_some(), "kept");
    }

    #[test]
    fn estimates_stay_finite_on_odd_input() {
        let mut m = CostModel::new(false);
        for i in 0..100u64 {
            m.observe(Op::Write, i * 4096, 0, 0);
            m.observe(Op::Write, u64::MAX - 5, 1 << 20, u64::MAX / 2);
        }
        let e = m.estimate(Op::Write);
        assert!(e.fixed_ns.is_finite() && e.fixed_ns >= 0.0, "{e:?}");
        assert!(e.seek_ns.is_finite() && e.seek_ns >= 0.0, "{e:?}");
        assert!(e.per_byte_ns.is_none_or(|p| p.is_finite() && p >= 0.0));
    }
}
