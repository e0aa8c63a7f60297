//! Sequential stream detection (bcache's `sequential_cutoff` and the stream-aware rules built
//! on it): which recent stream a request continues, how long that stream is, and whether its
//! requests arrive out of order.
//!
//! A request continues a stream tracked in the last `SEQ_WINDOW_NS` when it starts where the
//! stream's contiguous run ended, or a little past that end (`SEQ_REORDER_REQUESTS` of its own
//! length, as many requests at most: requests sent in order at a queue depth, or over several
//! connections, are executed out of order); those join the run when the requests between
//! arrive (a request that reaches the detector before the stream's first one starts a stream
//! of its own, so a stream can lose its first few requests).
//!
//! Invariants: at most `SEQ_SLOTS` streams of at most `SEQ_REORDER_REQUESTS` requests ahead
//! each (bounded memory, per backing device); no I/O and no clock of its own (time is passed
//! in), so the same requests give the same answers; only the contiguous run grows a stream,
//! so neither rewriting one block nor skipping every other block makes a stream; interleaved
//! sequential streams are each recognised.

/// Streams tracked per backing device (bcache tracks 128 recent I/Os).
pub const SEQ_SLOTS: usize = 128;
/// A stream idle for longer than this starts over (bcache: 5 s).
pub const SEQ_WINDOW_NS: u64 = 5_000_000_000;

/// How far past a stream's end, in lengths of the request, a request may start and still be
/// taken for one of the stream sent early, and how many such requests a stream holds: a
/// client's requests sent in order at a queue depth up to this, or spread over connections,
/// reach the detector out of order by less than that.
pub const SEQ_REORDER_REQUESTS: u64 = 16;
/// How long a request past a stream's end waits for those between (as does the
/// `SEQ_REORDER_REQUESTS` count): requests a client sent together reach the detector within a
/// worker's wake-up of each other.
pub const SEQ_REORDER_NS: u64 = 20_000_000;

#[derive(Clone, Copy, Debug)]
struct Ahead {
    offset: u64,
    end: u64,
    at_ns: u64,
    seen: u64,
}

#[derive(Clone, Debug)]
struct Stream {
    /// Where the stream's contiguous run ends.
    end: u64,
    /// The detector's request count at the stream's last request that came ahead of its run
    /// (0: none yet).
    ahead_at: u64,
    /// Bytes of the contiguous run.
    bytes: u64,
    last_ns: u64,
    /// Requests that started past `end` (at most `SEQ_REORDER_REQUESTS`, none further than
    /// that many of their own lengths): they join the run once the requests between arrive.
    /// A stream's length is its run's: a request ahead of it adds only itself. Each with the
    /// time it came and the detector's request count then: it is dropped once
    /// `SEQ_REORDER_NS` or 2 × `SEQ_REORDER_REQUESTS` requests passed without those between
    /// (a scattered scan of a region is not a stream).
    ahead: Vec<Ahead>,
}

impl Stream {
    /// Moves the run's end over the requests ahead that it now reaches.
    fn absorb(&mut self) {
        while let Some(i) = self.ahead.iter().position(|a| a.offset <= self.end) {
            let a = self.ahead.swap_remove(i);
            if a.end > self.end {
                self.bytes = self.bytes.saturating_add(a.end - a.offset.max(self.end));
                self.end = a.end;
            }
        }
    }
}

/// A stream whose last request that came ahead of its run is at most this many requests old
/// arrives out of order (`Seen::reordered`).
pub const SEQ_REORDERED_WITHIN: u64 = 4 * SEQ_REORDER_REQUESTS;

/// What the detector says of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Sequential bytes of its stream, this request included.
    pub bytes: u64,
    /// The stream's requests reach the detector out of order (one came ahead of the run
    /// within the last `SEQ_REORDERED_WITHIN` requests): they reach the disk so too.
    pub reordered: bool,
}

#[derive(Default, Debug)]
pub struct SeqDetector {
    streams: Vec<Stream>,
    /// Requests observed.
    seen: u64,
}

impl SeqDetector {
    /// Records a request and returns how many sequential bytes its stream has seen, including
    /// this request (the tests' shorthand for `observe_stream`).
    #[cfg(test)]
    pub fn observe(&mut self, offset: u64, len: u64, now_ns: u64) -> u64 {
        self.observe_stream(offset, len, now_ns).bytes
    }

    /// Records a request: its stream's length, and whether the stream's requests arrive out
    /// of order.
    pub fn observe_stream(&mut self, offset: u64, len: u64, now_ns: u64) -> Seen {
        self.seen += 1;
        let seen = self.seen;
        let waiting = |a: &Ahead| {
            now_ns.saturating_sub(a.at_ns) <= SEQ_REORDER_NS
                && seen - a.seen <= 2 * SEQ_REORDER_REQUESTS
        };
        let live = |s: &Stream| now_ns.saturating_sub(s.last_ns) <= SEQ_WINDOW_NS;
        let end = offset.saturating_add(len);
        let reach = len.max(1).saturating_mul(SEQ_REORDER_REQUESTS);
        // Exactly where a stream's run ended (two can end there, one having caught up with
        // the other: the longer continues); else a little past a run's end, the nearest.
        let exact = (0..self.streams.len())
            .filter(|&i| live(&self.streams[i]) && self.streams[i].end == offset)
            .max_by_key(|&i| self.streams[i].bytes);
        let ahead = || {
            (0..self.streams.len())
                .filter(|&i| {
                    let s = &self.streams[i];
                    live(s)
                        && offset > s.end
                        && offset - s.end <= reach
                        && (s.ahead.iter().filter(|a| waiting(a)).count() as u64)
                            < SEQ_REORDER_REQUESTS
                })
                .min_by_key(|&i| offset - self.streams[i].end)
        };
        // A request ahead counts its own length on top of the run (not the others ahead: a
        // client skipping every other block would add them up).
        let mut extra = 0;
        // Requests ahead that waited too long are dropped where they are looked at: in the
        // stream this request continues (nothing else reads them).
        let i = if let Some(i) = exact {
            let s = &mut self.streams[i];
            s.ahead.retain(waiting);
            s.end = end;
            s.bytes = s.bytes.saturating_add(len);
            s.absorb();
            i
        } else if let Some(i) = ahead() {
            let s = &mut self.streams[i];
            s.ahead.retain(waiting);
            s.ahead_at = seen;
            s.ahead.push(Ahead {
                offset,
                end,
                at_ns: now_ns,
                seen,
            });
            extra = len;
            i
        } else {
            let fresh = Stream {
                ahead_at: 0,
                end,
                bytes: len,
                last_ns: now_ns,
                ahead: Vec::new(),
            };
            if self.streams.len() < SEQ_SLOTS {
                self.streams.push(fresh);
                self.streams.len() - 1
            } else {
                let oldest = (0..self.streams.len())
                    .min_by_key(|&i| self.streams[i].last_ns)
                    .expect("slots are full");
                self.streams[oldest] = fresh;
                oldest
            }
        };
        self.streams[i].last_ns = now_ns;
        let s = &self.streams[i];
        Seen {
            bytes: s.bytes.saturating_add(extra),
            reordered: s.ahead_at > 0 && seen - s.ahead_at <= SEQ_REORDERED_WITHIN,
        }
    }

    /// How many streams longer than `min_bytes` saw a request in the last `window_ns`
    /// (the one that just did included).
    pub fn concurrent(&self, min_bytes: u64, now_ns: u64, window_ns: u64) -> usize {
        self.streams
            .iter()
            .filter(|s| s.bytes > min_bytes && now_ns.saturating_sub(s.last_ns) <= window_ns)
            .count()
    }
}

/// Streams past the cutoff that saw requests within this long of each other run at the same
/// time: one actuator serves them by seeking from one to the other.
pub const STREAM_OVERLAP_NS: u64 = 250_000_000;

/// Whether a request should bypass the cache for being part of a long sequential stream.
pub fn is_sequential_bypass(stream_bytes: u64, cutoff_bytes: u64) -> bool {
    cutoff_bytes > 0 && stream_bytes > cutoff_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_streams_are_each_detected() {
        let mut d = SeqDetector::default();
        let mut a = 0u64;
        let mut b = 1u64 << 30;
        let mut last = (0, 0);
        for i in 0..64 {
            last.0 = d.observe(a, 65536, i);
            last.1 = d.observe(b, 65536, i);
            a += 65536;
            b += 65536;
        }
        assert_eq!(last, (64 * 65536, 64 * 65536));
        assert!(is_sequential_bypass(last.0, 4 << (20 - 1)));
        assert!(!is_sequential_bypass(last.0, 0));
    }

    #[test]
    fn a_stream_that_catches_up_with_a_short_one_keeps_its_length() {
        let mut d = SeqDetector::default();
        d.observe(8192, 4096, 0); // a lone request ending at 12288
        d.observe(0, 4096, 1);
        d.observe(4096, 4096, 2);
        assert_eq!(d.observe(8192, 4096, 3), 12288);
        assert_eq!(d.observe(12288, 4096, 4), 16384);
    }

    #[test]
    fn a_stream_executed_out_of_order_is_still_one_stream() {
        // Queue depth 8: each run of 8 requests sent in order reaches the detector shuffled.
        for (len, order) in [
            (4096u64, [3, 0, 7, 1, 5, 2, 6, 4]),
            (65536, [7, 6, 5, 4, 3, 2, 1, 0]),
            (131072, [1, 0, 3, 2, 5, 4, 7, 6]),
        ] {
            let mut d = SeqDetector::default();
            let (mut last, mut t) = (0, 0);
            for run in 0..64u64 {
                for &k in &order {
                    t += 1;
                    last = d.observe((run * 8 + k) * len, len, t);
                }
            }
            // At most the first run is lost to a second stream.
            assert!(last >= (64 - 1) * 8 * len, "{len}: {last}");
        }
    }

    #[test]
    fn neither_rewriting_a_block_nor_skipping_every_other_one_makes_a_stream() {
        let mut d = SeqDetector::default();
        assert_eq!(d.observe(0, 4096, 0), 4096);
        assert_eq!(d.observe(4096, 4096, 1), 8192);
        for t in 2..1000 {
            assert_eq!(d.observe(4096, 4096, t), 4096);
        }
        let mut d = SeqDetector::default();
        for b in 0..1000u64 {
            assert!(d.observe(b * 8192, 4096, b) <= 8192);
        }
        // A request ahead joins the run when the one before it comes, once.
        let mut d = SeqDetector::default();
        d.observe(0, 4096, 0);
        assert_eq!(d.observe(8192, 4096, 1), 8192);
        assert_eq!(d.observe(4096, 4096, 2), 12288);
        assert_eq!(d.observe(4096, 4096, 3), 4096, "the gap is filled");
        assert_eq!(d.observe(12288, 4096, 4), 16384);
        // Too far ahead is another stream.
        let far = 16384 + (SEQ_REORDER_REQUESTS + 1) * 4096;
        assert_eq!(d.observe(far, 4096, 5), 4096);
        // A request ahead waits so long for those between.
        assert_eq!(d.observe(20480, 4096, 6), 20480);
        assert_eq!(d.observe(16384, 4096, 7 + SEQ_REORDER_NS), 20480);
        assert_eq!(d.observe(20480, 4096, 8 + SEQ_REORDER_NS), 24576);
    }

    #[test]
    fn a_stream_out_of_order_is_told_from_one_in_order() {
        let mut d = SeqDetector::default();
        let in_order: Vec<Seen> = (0..64u64)
            .map(|b| d.observe_stream(b * 4096, 4096, b))
            .collect();
        assert!(in_order.iter().all(|s| !s.reordered));
        assert_eq!(in_order[63].bytes, 64 * 4096);
        let mut d = SeqDetector::default();
        let mut last = None;
        for run in 0..8u64 {
            for k in [1, 0, 3, 2, 5, 4, 7, 6] {
                last = Some(d.observe_stream((1 << 30) + (run * 8 + k) * 4096, 4096, run));
            }
        }
        // (The first request sent came second: it started a stream of its own.)
        assert_eq!(
            last,
            Some(Seen {
                bytes: 63 * 4096,
                reordered: true
            })
        );
        // Back in order for a while: no longer out of order.
        for b in 64..64 + SEQ_REORDERED_WITHIN + 1 {
            last = Some(d.observe_stream((1 << 30) + b * 4096, 4096, 10));
        }
        assert!(!last.unwrap().reordered);
    }

    #[test]
    fn a_scattered_scan_of_a_region_is_not_a_stream() {
        // Every block of a region once, in a scrambled order, with no time passing: requests
        // ahead wait for those between only so many requests.
        let mut d = SeqDetector::default();
        let longest = (0..2000u64)
            .map(|i| d.observe((i * 7919 % 2000) * 4096, 4096, 0))
            .max();
        assert!(longest < Some(64 << 10), "{longest:?}");
    }

    #[test]
    fn random_requests_stay_short_and_old_streams_expire() {
        let mut d = SeqDetector::default();
        for i in 0..1000u64 {
            assert_eq!(d.observe((i * 7919 % 1000) * 1_000_000, 4096, i), 4096);
        }
        let mut d = SeqDetector::default();
        d.observe(0, 4096, 0);
        assert_eq!(d.observe(4096, 4096, SEQ_WINDOW_NS + 1), 4096);
    }
}
