//! The process's descriptor limit and the connection limit it allows.
//!
//! Owns: raising the soft `RLIMIT_NOFILE` to the hard limit at server start, and the rule that
//! turns a descriptor limit into an effective connection limit.
//!
//! Invariants: `effective_connections_max(c, soft) * DESCRIPTORS_PER_CONNECTION +
//! DESCRIPTORS_RESERVED < soft` whenever the result is positive, and the result never exceeds
//! `c`. (Each server of a process computes this for itself; several servers in one process
//! share the limit, so their embedder should divide it between them.)
//!
//! Fault model: a failure to read or raise the limit is reported to the caller, which keeps the
//! configured limit and logs.

use crate::net::DESCRIPTORS_PER_CONNECTION;
use std::io;

/// Descriptors left for everything but connections: listeners, logs, the embedder's devices
/// and admin socket, and what libraries open.
pub(crate) const DESCRIPTORS_RESERVED: u64 = 64;

/// The most connections that fit under the soft descriptor limit `nofile_soft`, at most
/// `configured` (0 if not even one fits).
pub(crate) fn effective_connections_max(configured: usize, nofile_soft: u64) -> usize {
    // Strictly below the limit: the highest usable descriptor number is `nofile_soft - 1`.
    let for_connections = nofile_soft.saturating_sub(DESCRIPTORS_RESERVED + 1);
    let fit = for_connections / DESCRIPTORS_PER_CONNECTION;
    configured.min(usize::try_from(fit).unwrap_or(usize::MAX))
}

/// Raises the soft descriptor limit to the hard limit; returns the soft limit now in effect.
pub(crate) fn raise_nofile_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit` for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `raised` is a valid `rlimit` for the duration of the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        } else {
            // E.g. a hard limit of "unlimited" above the kernel's `nr_open`: keep the soft one.
            log::debug!(
                "could not raise the descriptor limit to {}: {}",
                limit.rlim_max,
                io::Error::last_os_error()
            );
        }
    }
    Ok(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_fit_below_the_descriptor_limit() {
        // The usual default soft limit: 1024 - 64 reserved - 1.
        assert_eq!(effective_connections_max(10_000, 1024), 959);
        assert_eq!(
            effective_connections_max(256, 1024),
            256,
            "configured is lower"
        );
        assert_eq!(effective_connections_max(256, 66), 1);
        assert_eq!(effective_connections_max(256, 65), 0, "not even one fits");
        assert_eq!(effective_connections_max(256, 0), 0);
        assert_eq!(effective_connections_max(7, u64::MAX), 7, "unlimited");
        for soft in [66u64, 100, 1024, 4096, 1 << 20] {
            let n = effective_connections_max(usize::MAX, soft) as u64;
            assert!(n * DESCRIPTORS_PER_CONNECTION + DESCRIPTORS_RESERVED < soft);
            assert!((n + 1) * DESCRIPTORS_PER_CONNECTION + DESCRIPTORS_RESERVED >= soft);
        }
    }

    #[test]
    fn raising_keeps_a_usable_limit() {
        let soft = raise_nofile_limit().unwrap();
        assert!(soft >= 64, "soft limit {soft}");
        // Idempotent once raised.
        assert_eq!(raise_nofile_limit().unwrap(), soft);
    }
}
