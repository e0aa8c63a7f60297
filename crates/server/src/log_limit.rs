//! Rate-limited logging for events a client can trigger at will (refused and evicted
//! connections, accept failures), so a flood of them cannot flood the log.
//!
//! Owns: when a message of one kind may be logged.
//!
//! Invariants: at most one message per [`LOG_INTERVAL`] per limiter; the first event is always
//! logged, and the next logged message counts the events suppressed in between.
//!
//! Fault model: none (pure bookkeeping).

use std::time::{Duration, Instant};

/// Shortest time between two messages of one limiter.
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub(crate) struct LogLimiter {
    last: Option<Instant>,
    suppressed: u64,
}

impl LogLimiter {
    /// Whether to log an event happening at `now`: `Some(events suppressed since the last
    /// message)`, or `None` to stay quiet.
    pub(crate) fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < LOG_INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// Logs `$($arg)*` at `$level` if `$limiter` allows, noting how many were suppressed.
macro_rules! log_limited {
    ($limiter:expr, $level:expr, $($arg:tt)*) => {
        if let Some(suppressed) = $limiter.allow(std::time::Instant::now()) {
            if suppressed == 0 {
                log::log!($level, $($arg)*);
            } else {
                log::log!($level, "{} ({suppressed} more since the last such message)", format_args!($($arg)*));
            }
        }
    };
}
pub(crate) use log_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_per_interval_counting_the_rest() {
        let mut limiter = LogLimiter::default();
        let t0 = Instant::now();
        assert_eq!(limiter.allow(t0), Some(0));
        for i in 1..100 {
            assert_eq!(limiter.allow(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(limiter.allow(t0 + LOG_INTERVAL), Some(99));
        assert_eq!(limiter.allow(t0 + LOG_INTERVAL), None);
        assert_eq!(limiter.allow(t0 + 3 * LOG_INTERVAL), Some(1));
    }
}
