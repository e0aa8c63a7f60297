//! Readahead for sequential reads that bypass the cache: a few small windows of backing-device
//! data in RAM, so a stream of small reads past the sequential cutoff costs one backing read
//! per window instead of one per request (the kernel does the same for block devices; over a
//! network backing device it saves a round trip per request).
//!
//! Invariants:
//! - bounded: at most `WINDOWS` windows of at most `WINDOW_BYTES` each per backing device;
//! - a window only ever holds what the backing device held at some moment after the window's
//!   read began: every write to the backing device (client write, zeroes, discard, writeback)
//!   calls [`ReadAhead::invalidate`] after it completes, which bumps the generation and drops
//!   overlapping windows, and a window read under an older generation is not inserted;
//! - callers serve window data only for blocks that the index shows as uncached at the time
//!   of the read, so dirty data in the cache always wins over the backing device's copy.

/// Bytes read ahead of a sequential stream at once (the kernel's default readahead).
pub const WINDOW_BYTES: u64 = 128 << 10;
/// Windows kept per backing device (concurrent sequential streams served well).
const WINDOWS: usize = 8;

struct Window {
    start: u64,
    data: Vec<u8>,
}

impl Window {
    fn end(&self) -> u64 {
        self.start + self.data.len() as u64
    }
}

/// Readahead windows of one backing device, by data-area byte offset.
#[derive(Default)]
pub struct ReadAhead {
    generation: u64,
    /// Most recently used last.
    windows: Vec<Window>,
}

impl ReadAhead {
    /// Copies `[offset, offset + out.len())` into `out` if one window holds all of it.
    pub fn get(&mut self, offset: u64, out: &mut [u8]) -> bool {
        let end = offset + out.len() as u64;
        let Some(i) = self
            .windows
            .iter()
            .position(|w| w.start <= offset && end <= w.end())
        else {
            return false;
        };
        let w = self.windows.remove(i);
        let at = (offset - w.start) as usize;
        out.copy_from_slice(&w.data[at..at + out.len()]);
        self.windows.push(w);
        true
    }

    /// The generation to pass to [`ReadAhead::insert`] for a read that starts now.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Keeps `data` read at `start` unless the backing device was written since `generation`.
    pub fn insert(&mut self, generation: u64, start: u64, data: Vec<u8>) {
        if generation != self.generation || data.is_empty() {
            return;
        }
        let end = start + data.len() as u64;
        self.windows.retain(|w| w.end() <= start || end <= w.start);
        if self.windows.len() == WINDOWS {
            self.windows.remove(0);
        }
        self.windows.push(Window { start, data });
    }

    /// Forgets everything overlapping `[from, to)`; call after writing it on the backing device.
    pub fn invalidate(&mut self, from: u64, to: u64) {
        self.generation += 1;
        self.windows.retain(|w| w.end() <= from || to <= w.start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serves_contained_ranges_and_drops_what_is_overwritten() {
        let mut ra = ReadAhead::default();
        let g = ra.generation();
        ra.insert(g, 4096, (0..8192u32).map(|i| i as u8).collect());
        let mut out = [0u8; 16];
        assert!(ra.get(4096 + 100, &mut out));
        assert_eq!(out[0], 100);
        assert!(!ra.get(4096 + 8190, &mut out), "past the window's end");
        assert!(!ra.get(0, &mut out), "before the window");
        ra.invalidate(0, 4097);
        assert!(!ra.get(4096 + 100, &mut out));
    }

    #[test]
    fn a_read_that_raced_a_write_is_not_kept() {
        let mut ra = ReadAhead::default();
        let g = ra.generation();
        // A write anywhere lands while the read is in flight.
        ra.invalidate(1 << 30, (1 << 30) + 1);
        ra.insert(g, 0, vec![1; 4096]);
        let mut out = [0u8; 512];
        assert!(!ra.get(0, &mut out));
        let g = ra.generation();
        ra.insert(g, 0, vec![1; 4096]);
        assert!(ra.get(0, &mut out));
    }

    #[test]
    fn keeps_a_bounded_number_of_windows() {
        let mut ra = ReadAhead::default();
        for i in 0..(WINDOWS as u64 + 3) {
            let g = ra.generation();
            ra.insert(g, i * 1_000_000, vec![7; 4096]);
        }
        assert_eq!(ra.windows.len(), WINDOWS);
        let mut out = [0u8; 4096];
        assert!(!ra.get(0, &mut out), "the oldest window was dropped");
        assert!(ra.get((WINDOWS as u64 + 2) * 1_000_000, &mut out));
    }
}
