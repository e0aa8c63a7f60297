//! Pure policy state machines: sequential stream detection (what to bypass).
//!
//! Invariants: the detector holds at most `SEQ_SLOTS` streams (bounded memory, no I/O, no
//! clock of its own: time is passed in), and the same inputs give the same decisions.
//! A request continues a stream when it starts exactly where a stream tracked in the last
//! `SEQ_WINDOW_NS` ended, so interleaved sequential streams are each recognised.

/// Streams tracked per backing device (bcache tracks 128 recent I/Os).
pub const SEQ_SLOTS: usize = 128;
/// A stream idle for longer than this starts over (bcache: 5 s).
pub const SEQ_WINDOW_NS: u64 = 5_000_000_000;

#[derive(Clone, Copy, Debug)]
struct Stream {
    end: u64,
    bytes: u64,
    last_ns: u64,
}

#[derive(Default, Debug)]
pub struct SeqDetector {
    streams: Vec<Stream>,
}

impl SeqDetector {
    /// Records a request and returns how many sequential bytes its stream has seen, including
    /// this request.
    pub fn observe(&mut self, offset: u64, len: u64, now_ns: u64) -> u64 {
        let live = |s: &Stream| now_ns.saturating_sub(s.last_ns) <= SEQ_WINDOW_NS;
        if let Some(s) = self.streams.iter_mut().find(|s| s.end == offset && live(s)) {
            s.end = offset + len;
            s.bytes = s.bytes.saturating_add(len);
            s.last_ns = now_ns;
            return s.bytes;
        }
        let fresh = Stream {
            end: offset + len,
            bytes: len,
            last_ns: now_ns,
        };
        if self.streams.len() < SEQ_SLOTS {
            self.streams.push(fresh);
        } else {
            let oldest = (0..self.streams.len())
                .min_by_key(|&i| self.streams[i].last_ns)
                .expect("slots are full");
            self.streams[oldest] = fresh;
        }
        len
    }
}

/// Whether a request should bypass the cache for being part of a long sequential stream.
pub fn is_sequential_bypass(stream_bytes: u64, cutoff_bytes: u64) -> bool {
    cutoff_bytes > 0 && stream_bytes > cutoff_bytes
}

/// How hard writeback should work on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum WritebackRate {
    /// Nothing to do (no dirty data, writeback stopped, or still inside writeback_delay).
    Idle,
    /// Below the target: write back slowly, leaving the disk to clients.
    Trickle,
    /// Above the target, the device is idle, or it is being detached: as fast as possible.
    Full,
}

/// Inputs of the writeback decision for one device.
pub struct WritebackInputs {
    pub running: bool,
    pub detaching: bool,
    pub dirty_blocks: u64,
    pub total_blocks: u64,
    pub writeback_percent: u64,
    pub dirty_age_ns: u64,
    pub delay_ns: u64,
    pub idle_ns: u64,
}

/// Idle time after which the backing device is considered free for full-speed writeback.
pub const WRITEBACK_IDLE_NS: u64 = 1_000_000_000;

/// The writeback decision (bcache: `writeback_percent` target, `writeback_delay` before
/// starting on new dirty data, full speed when idle).
pub fn writeback_rate(i: &WritebackInputs) -> WritebackRate {
    if i.dirty_blocks == 0 {
        return WritebackRate::Idle;
    }
    if i.detaching {
        return WritebackRate::Full;
    }
    if !i.running {
        return WritebackRate::Idle;
    }
    if i.dirty_blocks * 100 > i.total_blocks * i.writeback_percent {
        return WritebackRate::Full;
    }
    if i.dirty_age_ns < i.delay_ns {
        return WritebackRate::Idle;
    }
    if i.idle_ns >= WRITEBACK_IDLE_NS {
        WritebackRate::Full
    } else {
        WritebackRate::Trickle
    }
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
    fn writeback_rate_follows_target_delay_and_idleness() {
        let base = WritebackInputs {
            running: true,
            detaching: false,
            dirty_blocks: 5,
            total_blocks: 100,
            writeback_percent: 10,
            dirty_age_ns: 0,
            delay_ns: 30,
            idle_ns: 0,
        };
        assert_eq!(writeback_rate(&base), WritebackRate::Idle);
        assert_eq!(
            writeback_rate(&WritebackInputs {
                dirty_age_ns: 31,
                ..base
            }),
            WritebackRate::Trickle
        );
        assert_eq!(
            writeback_rate(&WritebackInputs {
                dirty_age_ns: 31,
                idle_ns: WRITEBACK_IDLE_NS,
                ..base
            }),
            WritebackRate::Full
        );
        assert_eq!(
            writeback_rate(&WritebackInputs {
                dirty_blocks: 11,
                ..base
            }),
            WritebackRate::Full
        );
        assert_eq!(
            writeback_rate(&WritebackInputs {
                dirty_blocks: 11,
                running: false,
                ..base
            }),
            WritebackRate::Idle
        );
        assert_eq!(
            writeback_rate(&WritebackInputs {
                running: false,
                detaching: true,
                ..base
            }),
            WritebackRate::Full
        );
        assert_eq!(
            writeback_rate(&WritebackInputs {
                dirty_blocks: 0,
                detaching: true,
                ..base
            }),
            WritebackRate::Idle
        );
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
