//! How hard writeback works: the rate ([`writeback_rate`]) and the PI controller toward
//! `writeback_percent` ([`WritebackPi`]).
//!
//! Invariant: pure; the same inputs give the same decisions.

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
}
