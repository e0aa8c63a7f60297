//! Which client changes a backing device may have lost: the ranges clients' writes, zeroes
//! and discards changed on it since the last flush that covered them, so that when a flush
//! of the device fails (a remote server that restarted and lost what it had not made
//! durable, a disk that dropped its cache) the engine knows what to write again from the
//! cache and what it must report as lost (see `io::lost` and `docs/durability.md`).
//!
//! Owns: the changes in flight and those done and not yet covered by a successful flush,
//! each done one numbered in completion order; how many of the device's failed flushes have
//! been dealt with.
//!
//! Invariants:
//! - a change is entered before it is sent to the device and numbered when it completes, so
//!   a change is never missing from the set while the device may hold it unflushed;
//! - a flush removes only changes numbered below what `covers` returned before it was sent
//!   (their completions came before it, so it covers them), and only if no flush of the
//!   device failed meanwhile or before without being dealt with (`flushed`): a failed flush
//!   may mean every change not yet covered is gone, whoever's flush it was;
//! - memory is bounded: past `DONE_MAX` done changes they are merged into the one range that
//!   spans them (what is written again or reported then covers more blocks, never fewer).
//!
//! Fault model: none of its own; it records, the caller decides.

use crate::units::BackingBlock;
use std::collections::BTreeMap;

/// Done changes kept apart before they are merged into one span.
pub(crate) const DONE_MAX: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Change {
    b0: BackingBlock,
    b1: BackingBlock,
    /// Completion number; `None` while the change is in flight.
    done: Option<u64>,
}

#[derive(Debug, Default)]
pub(crate) struct Unflushed {
    /// Changes by the token `begin` gave them.
    changes: BTreeMap<u64, Change>,
    next_token: u64,
    /// The number the next completion gets.
    next_done: u64,
    done_count: usize,
    /// The device's failed flushes dealt with so far (see `Backing::flush_failures`).
    handled_failures: u64,
}

impl Unflushed {
    /// A change of blocks `[b0, b1)` is about to be sent to the device.
    pub fn begin(&mut self, b0: BackingBlock, b1: BackingBlock) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        self.changes.insert(token, Change { b0, b1, done: None });
        token
    }

    /// The change `token` completed: `ok`, the device acknowledged it (it is now unflushed
    /// data the device may lose); else it failed and its sender was told.
    pub fn end(&mut self, token: u64, ok: bool) {
        if !ok {
            self.changes.remove(&token);
            return;
        }
        // In-flight changes are never merged nor taken, so the token is there.
        let Some(c) = self.changes.get_mut(&token) else {
            debug_assert!(false, "change {token} ended twice");
            return;
        };
        c.done = Some(self.next_done);
        self.next_done += 1;
        self.done_count += 1;
        if self.done_count > DONE_MAX {
            self.merge_done();
        }
    }

    /// Merges every done change into one spanning them (keeps memory bounded).
    fn merge_done(&mut self) {
        let mut span: Option<Change> = None;
        self.changes.retain(|_, c| {
            let Some(done) = c.done else { return true };
            span = Some(match span {
                None => *c,
                Some(s) => Change {
                    b0: s.b0.min(c.b0),
                    b1: s.b1.max(c.b1),
                    done: Some(s.done.unwrap_or(0).max(done)),
                },
            });
            false
        });
        if let Some(s) = span {
            let token = self.next_token;
            self.next_token += 1;
            self.changes.insert(token, s);
            self.done_count = 1;
        }
    }

    /// What a flush sent now covers: every change numbered below the returned value.
    pub fn covers(&self) -> u64 {
        self.next_done
    }

    /// A flush that covered changes below `covers` succeeded, and `failures` is the count of
    /// the device's failed flushes both before it was sent and now: drops what it covered,
    /// unless a failed flush is still to be dealt with.
    pub fn flushed(&mut self, covers: u64, failures: u64) {
        if failures != self.handled_failures {
            return;
        }
        let before = self.changes.len();
        self.changes
            .retain(|_, c| c.done.is_none_or(|d| d >= covers));
        self.done_count -= before - self.changes.len();
    }

    /// If the device's failed flushes (`failures`) include some not dealt with yet: marks
    /// them dealt with and returns every change the device may have lost (done ones leave
    /// the set; those in flight stay, and are returned too: the caller waits for them). The
    /// ranges come sorted and merged.
    pub fn take_lost(&mut self, failures: u64) -> Option<Vec<(BackingBlock, BackingBlock)>> {
        if failures == self.handled_failures {
            return None;
        }
        self.handled_failures = failures;
        let mut ranges: Vec<(BackingBlock, BackingBlock)> =
            self.changes.values().map(|c| (c.b0, c.b1)).collect();
        self.changes.retain(|_, c| c.done.is_none());
        self.done_count = 0;
        ranges.sort_unstable();
        let mut merged: Vec<(BackingBlock, BackingBlock)> = Vec::with_capacity(ranges.len());
        for (b0, b1) in ranges {
            match merged.last_mut() {
                Some(last) if b0 <= last.1 => last.1 = last.1.max(b1),
                _ => merged.push((b0, b1)),
            }
        }
        Some(merged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(n: u64) -> BackingBlock {
        BackingBlock::new(n)
    }

    #[test]
    fn a_flush_drops_only_what_completed_before_it_was_sent() {
        let mut u = Unflushed::default();
        let a = u.begin(b(0), b(1));
        let c = u.begin(b(10), b(11));
        u.end(a, true);
        let covers = u.covers();
        u.end(c, true); // completed after the flush was sent
        let d = u.begin(b(20), b(21)); // in flight
        u.flushed(covers, 0);
        assert_eq!(u.take_lost(1), Some(vec![(b(10), b(11)), (b(20), b(21))]));
        assert_eq!(u.take_lost(1), None, "dealt with once");
        u.end(d, true);
        assert_eq!(u.take_lost(2), Some(vec![(b(20), b(21))]));
    }

    #[test]
    fn a_failed_flush_not_dealt_with_keeps_everything() {
        let mut u = Unflushed::default();
        let a = u.begin(b(0), b(4));
        u.end(a, true);
        let covers = u.covers();
        // A flush failed (count 1) before ours succeeded: nothing may be dropped.
        u.flushed(covers, 1);
        assert_eq!(u.take_lost(1), Some(vec![(b(0), b(4))]));
        let x = u.begin(b(2), b(3));
        u.end(x, false);
        assert_eq!(u.take_lost(2), Some(vec![]), "a failed change is not kept");
    }

    #[test]
    fn many_changes_are_merged_into_one_span() {
        let mut u = Unflushed::default();
        for i in 0..(DONE_MAX as u64 + 10) {
            let t = u.begin(b(i * 4), b(i * 4 + 1));
            u.end(t, true);
        }
        assert!(u.changes.len() <= DONE_MAX);
        let lost = u.take_lost(1).unwrap();
        let covered: u64 = lost.iter().map(|(a, z)| z.get() - a.get()).sum();
        assert!(lost.first().unwrap().0 == b(0));
        assert!(lost.last().unwrap().1 == b((DONE_MAX as u64 + 9) * 4 + 1));
        assert!(covered >= DONE_MAX as u64 + 10);
    }
}
