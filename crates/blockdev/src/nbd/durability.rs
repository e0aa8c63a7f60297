//! Which acknowledged writes a flush has made durable, and whether a lost connection may have
//! lost some: the bookkeeping behind the reconnect rule of [`NbdDevice`](super::NbdDevice).
//!
//! Owns: a sequence number per write-type request (write, trim, write zeroes), the set still
//! in flight, the boundary below which every write is known durable, and the count of
//! connection losses that happened with writes not known durable (and of those reported).
//!
//! Invariants: `durable_below` only grows and never passes a write that was unanswered when
//! the flush covering it was sent (the spec: a flush covers the writes the server answered
//! before it; with several connections, those the client saw answered before sending it);
//! a write issued counts as "not known durable" from the moment it gets its number, so a
//! loss is never missed because a reply was in transit. The bookkeeping only errs towards
//! reporting a loss that did not happen (a write answered out of order behind an older one
//! is not counted as covered until the older one is answered too).
//!
//! Fault model: none of its own; it decides what a broken connection means for durability.

use std::collections::BTreeSet;

#[derive(Debug, Default)]
pub(super) struct Durability {
    /// The number the next write-type request gets.
    next_write: u64,
    /// Writes sent (or about to be) and not yet answered, including those whose caller gave
    /// up waiting: they may still be carried out.
    writes_in_flight: BTreeSet<u64>,
    /// Every write numbered below this is durable (a flush sent after its reply succeeded).
    durable_below: u64,
    /// Connection losses that happened while some write was not known durable.
    losses: u64,
    /// Of those, the ones a flush has reported.
    losses_reported: u64,
}

impl Durability {
    /// Numbers a write-type request about to be sent.
    pub fn begin_write(&mut self) -> u64 {
        let seq = self.next_write;
        self.next_write += 1;
        self.writes_in_flight.insert(seq);
        seq
    }

    /// The write has been answered (success or error) or its connection is gone.
    pub fn end_write(&mut self, seq: u64) {
        let was_in_flight = self.writes_in_flight.remove(&seq);
        assert!(was_in_flight, "write {seq} ended twice");
    }

    /// What a flush sent now covers: every write numbered below the returned value.
    pub fn flush_covers(&self) -> u64 {
        self.writes_in_flight
            .first()
            .copied()
            .unwrap_or(self.next_write)
    }

    /// A flush that covered writes below `covers` succeeded.
    pub fn flushed(&mut self, covers: u64) {
        self.durable_below = self.durable_below.max(covers);
    }

    /// Whether a write was issued that no successful flush has covered yet.
    pub fn unflushed(&self) -> bool {
        self.durable_below < self.next_write
    }

    /// A connection broke. If some write is not known durable, the server may have lost it
    /// (a restart loses what it had not flushed): count a loss for the next flush to report.
    /// Returns whether it did.
    pub fn connection_lost(&mut self) -> bool {
        let lost = self.unflushed();
        if lost {
            self.losses += 1;
        }
        lost
    }

    /// Whether a loss has not been reported yet; marks it reported (the caller fails a flush).
    pub fn take_unreported_loss(&mut self) -> bool {
        let unreported = self.losses != self.losses_reported;
        self.losses_reported = self.losses;
        unreported
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_covers_only_writes_answered_before_it_was_sent() {
        let mut d = Durability::default();
        assert!(!d.unflushed());
        let a = d.begin_write();
        let b = d.begin_write();
        d.end_write(b); // answered out of order: a is still in flight
        let covers = d.flush_covers();
        d.flushed(covers);
        assert!(
            d.unflushed(),
            "b is not counted durable while a is in flight"
        );
        d.end_write(a);
        let covers = d.flush_covers();
        let c = d.begin_write(); // sent while the flush is in flight: not covered
        d.flushed(covers);
        assert!(d.unflushed());
        d.end_write(c);
        let covers = d.flush_covers();
        d.flushed(covers);
        assert!(!d.unflushed());
    }

    #[test]
    fn a_loss_is_counted_only_with_unflushed_writes_and_reported_once() {
        let mut d = Durability::default();
        assert!(!d.connection_lost(), "nothing written: nothing to lose");
        assert!(!d.take_unreported_loss());
        let a = d.begin_write();
        d.end_write(a);
        assert!(d.connection_lost());
        assert!(d.take_unreported_loss());
        assert!(!d.take_unreported_loss(), "reported once");
        // The lost write stays not known durable until a flush covers it.
        assert!(d.connection_lost());
        let covers = d.flush_covers();
        d.flushed(covers);
        assert!(d.take_unreported_loss());
        assert!(!d.connection_lost());
        assert!(!d.take_unreported_loss());
        // A write still in flight when the connection breaks counts too.
        let b = d.begin_write();
        assert!(d.connection_lost());
        d.end_write(b);
        assert!(d.take_unreported_loss());
    }
}
