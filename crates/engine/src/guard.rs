//! Containment of the unexpected: a panic inside the engine, and errors that repeat.
//!
//! Owns: [`contain`], which every public entry point that changes or reads cache state runs
//! its work through (client I/O, knob changes, attach/detach, the background loops), and
//! [`Throttled`], the log line that says an error once and then counts its repeats.
//!
//! Invariants:
//! - a panic caught by `contain` marks the set *failed* before `contain` returns, so no later
//!   request is served from state the panic may have left half-updated, and no later commit or
//!   checkpoint writes that state (both check `failed` first): the metadata on the cache
//!   device stays what the last successful commit wrote, which recovery reads on restart;
//! - a `Throttled` writes at most one line per `THROTTLE_PERIOD` per call site, and the line
//!   after a quiet spell says how many occurrences it stands for, so an error that repeats in
//!   a loop cannot flood the log (one write-back retry loop once wrote 436 MB in 10 minutes).
//!
//! Fault model: the panic payload is untrusted text (shown, never parsed); a panic while the
//! failed flag itself is being set cannot happen (it is a plain mutex assignment).

use crate::set::Inner;
use crate::types::{Error, Result};
use parking_lot::Mutex;
use std::any::Any;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Runs `f`; a panic inside it fails the set and becomes an error for the caller.
pub(crate) fn contain<T>(inner: &Inner, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(res) => res,
        Err(payload) => {
            let why = format!(
                "internal error (panic) in {what}: {}; nothing more is written to the cache \
                 device and its journal is intact: restart to recover",
                panic_message(&*payload)
            );
            inner.fail(&Error::State(why.clone()));
            Err(Error::State(why))
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// At most one log line per call site in this period.
pub const THROTTLE_PERIOD: Duration = Duration::from_secs(60);

/// A log line for an error that may repeat: the first occurrence is logged at once, later
/// ones only once `THROTTLE_PERIOD` has passed since the last line, with the count of those
/// not logged. Use one per call site (`static`).
pub struct Throttled {
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
    pub const fn new() -> Throttled {
        Throttled {
            state: Mutex::new(None),
        }
    }

    /// Logs `msg` at `level` unless a line was logged less than `THROTTLE_PERIOD` ago;
    /// returns whether it logged.
    pub fn log(&self, level: log::Level, msg: impl Display) -> bool {
        self.log_at(Instant::now(), level, msg)
    }

    fn log_at(&self, now: Instant, level: log::Level, msg: impl Display) -> bool {
        let mut st = self.state.lock();
        match &mut *st {
            Some(s) if now.duration_since(s.logged_at) < THROTTLE_PERIOD => {
                s.suppressed += 1;
                false
            }
            Some(s) => {
                let n = std::mem::take(&mut s.suppressed);
                let secs = now.duration_since(s.logged_at).as_secs();
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

    #[test]
    fn throttled_logs_once_per_period_and_counts() {
        let t = Throttled::new();
        let t0 = Instant::now();
        assert!(t.log_at(t0, log::Level::Error, "x"));
        for i in 1..1000 {
            assert!(!t.log_at(t0 + Duration::from_millis(i), log::Level::Error, "x"));
        }
        assert_eq!(t.state.lock().as_ref().unwrap().suppressed, 999);
        assert!(t.log_at(t0 + THROTTLE_PERIOD, log::Level::Error, "x"));
        assert_eq!(t.state.lock().as_ref().unwrap().suppressed, 0);
    }

    #[test]
    fn panic_messages() {
        let s: Box<dyn Any + Send> = Box::new("static");
        assert_eq!(panic_message(&*s), "static");
        let s: Box<dyn Any + Send> = Box::new(String::from("owned"));
        assert_eq!(panic_message(&*s), "owned");
        let s: Box<dyn Any + Send> = Box::new(7u8);
        assert_eq!(panic_message(&*s), "(no message)");
    }
}
