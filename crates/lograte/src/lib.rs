//! `lograte`: log lines for events that can repeat at will — an error retried in a loop, a
//! client refused again and again — so that they cannot flood the log.
//!
//! Owns: [`Throttled`], one per call site (usually a `static`).
//!
//! Invariants: a `Throttled` writes at most one line per period; the first occurrence is
//! logged at once, and the next line written after a quiet spell says how many occurrences
//! were not logged in between.
//!
//! Fault model: none; a poisoned mutex (a panicking logger) is taken over, never propagated.

use std::fmt::Display;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The period of [`Throttled::new`]: one line a minute.
pub const THROTTLE_PERIOD: Duration = Duration::from_secs(60);

/// A log line for an error that may repeat: the first occurrence is logged at once, later
/// ones only once `THROTTLE_PERIOD` has passed since the last line, with the count of those
/// not logged. Use one per call site (`static`).
pub struct Throttled {
    period: Duration,
    state: Mutex<Option<ThrottleState>>,
}

struct ThrottleState {
    logged_at: Instant,
    suppressed: u64,
}

impl Default for Throttled {
    fn default() -> Self {
        Self::new()
    }
}

impl Throttled {
    /// At most one line per `THROTTLE_PERIOD`.
    pub const fn new() -> Throttled {
        Throttled::with_period(THROTTLE_PERIOD)
    }

    /// At most one line per `period`.
    pub const fn with_period(period: Duration) -> Throttled {
        Throttled {
            period,
            state: Mutex::new(None),
        }
    }

    /// Logs `msg` at `level` unless a line was logged less than `THROTTLE_PERIOD` ago;
    /// returns whether it logged.
    pub fn log(&self, level: log::Level, msg: impl Display) -> bool {
        self.log_at(Instant::now(), level, msg)
    }

    fn log_at(&self, now: Instant, level: log::Level, msg: impl Display) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &mut *st {
            Some(s) if now.saturating_duration_since(s.logged_at) < self.period => {
                s.suppressed += 1;
                false
            }
            Some(s) => {
                let n = std::mem::take(&mut s.suppressed);
                let secs = now.saturating_duration_since(s.logged_at).as_secs();
                s.logged_at = now;
                if n > 0 {
                    log::log!(
                        level,
                        "{msg} (repeated {n} more times in the last {secs} s, not logged)"
                    );
                } else {
                    log::log!(level, "{msg}");
                }
                true
            }
            None => {
                *st = Some(ThrottleState {
                    logged_at: now,
                    suppressed: 0,
                });
                log::log!(level, "{msg}");
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suppressed(t: &Throttled) -> u64 {
        t.state.lock().unwrap().as_ref().unwrap().suppressed
    }

    #[test]
    fn logs_once_per_period_and_counts_the_rest() {
        let t = Throttled::with_period(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(t.log_at(t0, log::Level::Error, "x"));
        for i in 1..1000 {
            assert!(!t.log_at(t0 + Duration::from_millis(i), log::Level::Error, "x"));
        }
        assert_eq!(suppressed(&t), 999);
        assert!(t.log_at(t0 + Duration::from_secs(10), log::Level::Error, "x"));
        assert_eq!(suppressed(&t), 0);
        assert!(!t.log_at(t0 + Duration::from_secs(11), log::Level::Error, "x"));
        assert!(t.log_at(t0 + Duration::from_secs(30), log::Level::Error, "x"));
    }
}
