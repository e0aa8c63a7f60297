//! W6 until steady: one fio run watched through its periodic reports (`--status-interval`),
//! cut into fixed-length intervals, each with its IOPS and (for tiercache) its hit ratio from
//! the admin `stats` read at the interval's end; the run stops once the intervals are steady,
//! or at the scale's time cap. It yields a warm-up row (the start up to the steady intervals;
//! its seconds are the time to steady) and a steady row (the steady intervals), plus the time
//! series of every interval.
//!
//! Invariants: [`steady_start`] is a pure function of the series and the [`Rule`] (the
//! catalogue's, with the scale's parameters); the first
//! interval (fio's connection and cold start) is always warm-up, so a warm-up row always covers
//! at least one interval; the steady row covers exactly the intervals the rule accepted, or,
//! when the cap came first, the last `intervals` ones, marked [`Phase::NotSteady`] and named in a
//! notice; every figure is a difference of fio's cumulative counts (or tiercache's counters)
//! between interval ends.

use super::catalogue::{Rule, Step};
use super::fio::{self, Totals};
use super::procs::Running;
use super::results::{Phase, Row, Series};
use super::{cache_columns, occupancy, PairOut};
use anyhow::{bail, Result};

/// One interval's figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub iops: f64,
    /// None where the configuration has no hit counters (the peers).
    pub hit_pct: Option<f64>,
    /// The cache's `in_use` % at the interval's end; None for the peers.
    pub in_use_pct: Option<f64>,
}

/// The first interval of the earliest window of `rule.intervals` consecutive intervals, not
/// counting the first interval nor any before `first` (see `warm_min_s`), that the rule calls
/// steady; None while there is none.
pub fn steady_start(samples: &[Sample], rule: &Rule, first: usize) -> Option<usize> {
    let n = rule.intervals.max(1);
    (first.max(1)..(samples.len() + 1).saturating_sub(n))
        .find(|&s| steady(&samples[s..s + n], rule))
}

fn steady(window: &[Sample], rule: &Rule) -> bool {
    let spread = |v: &mut dyn Iterator<Item = f64>| {
        let (mut lo, mut hi, mut sum, mut n) = (f64::MAX, f64::MIN, 0.0, 0.0);
        for x in v {
            (lo, hi, sum, n) = (lo.min(x), hi.max(x), sum + x, n + 1.0);
        }
        (hi - lo, sum / n)
    };
    let (iops_spread, mean) = spread(&mut window.iter().map(|s| s.iops));
    let iops_ok = mean > 0.0 && iops_spread <= rule.iops_tolerance * mean;
    let settled = |v: Vec<f64>, tolerance: f64| match v.len() {
        0 => true,
        n if n == window.len() => spread(&mut v.into_iter()).0 <= tolerance,
        // Some intervals without the figure (no reads): not comparable, so not steady.
        _ => false,
    };
    let hits_ok = settled(
        window.iter().filter_map(|s| s.hit_pct).collect(),
        rule.hit_tolerance_pct,
    );
    let in_use_ok = settled(
        window.iter().filter_map(|s| s.in_use_pct).collect(),
        rule.in_use_tolerance_pct,
    );
    iops_ok && hits_ok && in_use_ok
}

/// The end of an interval: fio's cumulative counts and tiercache's stats then.
struct Boundary {
    totals: Totals,
    stats: Option<serde_json::Value>,
}

/// Runs W6's step `s` (whose arguments bound the run to `rule.cap_s`) until steady.
pub fn run(
    running: &Running,
    target: &fio::Target,
    w: &str,
    c: &str,
    s: &Step,
    rule: &Rule,
) -> Result<PairOut> {
    let mut bounds = vec![Boundary {
        totals: Totals::default(),
        stats: running.stats(),
    }];
    let mut samples = Vec::new();
    let mut start = None;
    let cached = c.starts_with("tiercache-") || c.starts_with("nbdkit-cache");
    let first = if cached {
        (rule.warm_min_s / rule.interval_s.max(1)) as usize
    } else {
        0
    };
    fio::run_watched(target, &s.args, rule.interval_s, |t| {
        let prev = bounds.last().expect("the start is a boundary");
        let dt = t.runtime_s - prev.totals.runtime_s;
        // The final report after a short remainder: too short an interval to compare.
        if dt < rule.interval_s as f64 / 2.0 {
            return Ok(true);
        }
        let stats = running.stats();
        samples.push(Sample {
            iops: (t.ios - prev.totals.ios) as f64 / dt,
            hit_pct: cache_columns(&prev.stats, &stats).0,
            in_use_pct: stats.as_ref().map(|v| occupancy(v).1),
        });
        bounds.push(Boundary { totals: *t, stats });
        start = steady_start(&samples, rule, first);
        Ok(start.is_none())
    })?;
    if samples.len() < 2 {
        bail!(
            "fio reported {} interval(s) of {} s; W6 needs at least 2",
            samples.len(),
            rule.interval_s
        );
    }
    let n = rule.intervals.max(1);
    let (from, phase) = match start {
        Some(i) => (i, Phase::Steady),
        None => (samples.len().saturating_sub(n).max(1), Phase::NotSteady),
    };
    let last = bounds.len() - 1;
    let mut out = PairOut::default();
    if phase == Phase::NotSteady {
        out.notices.push(format!(
            "{w} on {c}: not steady within {} s ({n} consecutive {} s intervals within {:.0} % IOPS, {} hit % points, {} in_use points); its steady row is its last {} interval(s)",
            rule.cap_s,
            rule.interval_s,
            rule.iops_tolerance * 100.0,
            rule.hit_tolerance_pct,
            rule.in_use_tolerance_pct,
            last - from
        ));
    }
    let row = |a: &Boundary, b: &Boundary, phase: Phase, what: &str| {
        let dt = (b.totals.runtime_s - a.totals.runtime_s).max(1e-9);
        let ios = b.totals.ios - a.totals.ios;
        let (hit_ratio_pct, cache_written_mib) = cache_columns(&a.stats, &b.stats);
        Row {
            workload: w.to_string(),
            step: format!("{} ({what})", s.name),
            config: c.to_string(),
            iops: ios as f64 / dt,
            bw_mib_s: (b.totals.bytes - a.totals.bytes) as f64 / dt / (1 << 20) as f64,
            mean_lat_us: (b.totals.lat_ns - a.totals.lat_ns) / (ios.max(1) as f64) / 1000.0,
            hit_ratio_pct,
            cache_written_mib,
            // The warm-up row's span starts at 0: its seconds are the time to steady.
            seconds: dt,
            phase: Some(phase),
            ..Row::default()
        }
    };
    out.rows
        .push(row(&bounds[0], &bounds[from], Phase::WarmUp, "warm-up"));
    out.rows
        .push(row(&bounds[from], &bounds[last], phase, "steady"));
    let at = |b: &Boundary| b.totals.runtime_s;
    let occ: Vec<(f64, (f64, f64))> = bounds
        .iter()
        .filter_map(|b| Some((at(b), occupancy(b.stats.as_ref()?))))
        .collect();
    out.series.push(Series {
        workload: w.to_string(),
        step: s.name.clone(),
        config: c.to_string(),
        iops: bounds[1..]
            .iter()
            .zip(&samples)
            .map(|(b, x)| (at(b), x.iops))
            .collect(),
        dirty_mib: occ.iter().map(|(t, o)| (*t, o.0)).collect(),
        in_use_pct: occ.iter().map(|(t, o)| (*t, o.1)).collect(),
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Rule = Rule {
        interval_s: 1,
        intervals: 3,
        iops_tolerance: 0.10,
        hit_tolerance_pct: 2.0,
        in_use_tolerance_pct: 2.0,
        warm_min_s: 0,
        cap_s: 60,
    };

    fn iops(v: &[f64]) -> Vec<Sample> {
        v.iter()
            .map(|&iops| Sample {
                iops,
                hit_pct: None,
                in_use_pct: None,
            })
            .collect()
    }

    #[test]
    fn steady_once_n_intervals_agree_never_counting_the_first() {
        // Flat from the start: the first interval is still warm-up.
        assert_eq!(steady_start(&iops(&[100.0; 4]), &RULE, 0), Some(1));
        assert_eq!(steady_start(&iops(&[100.0; 3]), &RULE, 0), None);
        // Rising, then flat within 10 % of the mean.
        let rising = iops(&[100.0, 300.0, 600.0, 900.0, 1000.0, 950.0, 1040.0, 990.0]);
        assert_eq!(steady_start(&rising, &RULE, 0), Some(4));
        // One outlier in every window of three.
        let noisy = iops(&[500.0, 500.0, 500.0, 700.0, 500.0, 500.0, 700.0, 500.0]);
        assert_eq!(steady_start(&noisy, &RULE, 0), None);
        assert_eq!(
            steady_start(&iops(&[0.0; 6]), &RULE, 0),
            None,
            "no I/O is not steady"
        );
        assert_eq!(steady_start(&[], &RULE, 0), None);
        let one = Rule {
            intervals: 1,
            ..RULE
        };
        assert_eq!(steady_start(&iops(&[1.0, 5.0]), &one, 0), Some(1));
    }

    #[test]
    fn hit_ratio_must_settle_too_where_there_is_one() {
        let s = |iops, hit| Sample {
            iops,
            hit_pct: Some(hit),
            in_use_pct: Some(97.0),
        };
        let warming = [
            s(1000.0, 10.0),
            s(1000.0, 40.0),
            s(1000.0, 60.0),
            s(1000.0, 70.0),
            s(1000.0, 71.0),
            s(1000.0, 72.5),
            s(1000.0, 72.0),
        ];
        assert_eq!(steady_start(&warming, &RULE, 0), Some(4));
        // An interval without reads has no hit ratio: its windows are not steady.
        let mut gap = warming.to_vec();
        gap[4].hit_pct = None;
        assert_eq!(steady_start(&gap, &RULE, 0), None);
        gap.push(s(1000.0, 72.0));
        assert_eq!(steady_start(&gap, &RULE, 0), Some(5));
    }

    #[test]
    fn a_cache_still_filling_is_not_steady_however_flat_its_rate() {
        let s = |in_use| Sample {
            iops: 1000.0,
            hit_pct: Some(80.0),
            in_use_pct: Some(in_use),
        };
        let filling: Vec<Sample> = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]
            .map(s)
            .to_vec();
        assert_eq!(steady_start(&filling, &RULE, 0), None);
        let mut full = filling.clone();
        full.extend([96.0, 97.0, 97.0, 96.5].map(s));
        assert_eq!(steady_start(&full, &RULE, 0), Some(9));
        assert_eq!(
            steady_start(&full, &RULE, 11),
            None,
            "not before warm_min_s"
        );
        full.push(s(96.0));
        assert_eq!(steady_start(&full, &RULE, 11), Some(11));
    }
}
