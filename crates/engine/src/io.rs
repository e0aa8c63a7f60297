//! The request paths of one backing device (a `Volume`): read, write, FUA, flush, discard,
//! write-zeroes, prefetch.
//!
//! Invariants:
//! - every request is 512-byte aligned and inside the device, or rejected with `Invalid`;
//! - writes (and discard / write-zeroes) hold the range lock over the block-aligned range for
//!   as long as the backing device and the cache change, so overlapping writes are ordered the
//!   same way in both; reads take no range lock;
//! - cached blocks are read only while their bucket is pinned, and every block read from the
//!   cache is checked against its crc32c: a clean block that fails is dropped and re-read from
//!   the backing device, a dirty one is an error, never wrong data;
//! - a read takes the state lock once on its way in (lookup, pins, touch, and a copy of the
//!   expected crcs, which cannot change while the bucket is pinned); the cache read and the
//!   checksums run with no lock held, and the pins are dropped without the lock
//!   (`Inner::unpin`, see the pin protocol in `alloc`). A hit of up to 4 runs and 16 blocks
//!   allocates nothing: its blocks are read straight into the caller's buffer;
//! - a read miss is promoted only if no write touched its range while it was in flight
//!   (`cache_miss_collisions` counts the ones dropped); a miss inside a promotion in flight
//!   waits for it once (bounded) instead of reading the backing device again;
//! - dirty data leaves the index (overwritten by a bypass or writethrough write, zeroed,
//!   discarded) only after what supersedes it was written to the backing device, and the
//!   record of the drop reaches the journal only after that device was flushed (the commit
//!   flushes it, once for all such writes), so a crash can never expose data older than the
//!   dirty copy: before the record is durable, recovery still holds the dirty copy;
//! - sequential reads that bypass the cache are served through `readahead` windows only for
//!   blocks the index shows uncached, and every write to the backing device invalidates the
//!   windows it overlaps after it completes;
//! - a sub-block write either merges into the cached block (read-modify-write, so a dirty
//!   block never loses its other sectors) or, when the block is not cached, goes straight to
//!   the backing device.

use crate::alloc::WritePoint;
use crate::format::BackingState;
use crate::index::{Seg, Segs};
use crate::knobs::Knob;
use crate::policy::is_sequential_bypass;
use crate::readahead;
use crate::set::{Backing, DevKnobs, DevStatus, Inner, Promotion};
use crate::stats::Counters;
use crate::types::{CacheMode, Error, IoContext, Result};
use blockdev::BlockDevice;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A backing device served through its cache set.
#[derive(Clone)]
pub struct Volume {
    pub(crate) inner: Arc<Inner>,
    pub(crate) backing: Arc<Backing>,
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volume")
            .field("id", &self.backing.id)
            .field("uuid", &self.uuid())
            .field("mode", &self.mode())
            .finish()
    }
}

/// Window of the miss fill on rotational backing devices (see `Volume::miss_fill`).
const MISS_FILL_BYTES: u64 = 64 << 10;
/// A bypassing stream of more than one request and at least this long is read ahead
/// (`readahead::WINDOW_BYTES` at a time).
const READAHEAD_AFTER_BYTES: u64 = 64 << 10;

/// Longest a miss waits for a promotion in flight over its blocks before reading them itself.
const PROMOTION_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// Expected crcs of the cached blocks of a request: up to 16 blocks without allocating.
type Crcs = smallvec::SmallVec<[u32; 16]>;

/// The first block of `data` (whole blocks of `bs` bytes) whose crc32c is not its entry in
/// `crcs`. Call it with no lock held.
pub(crate) fn first_bad_block(data: &[u8], crcs: &[u32], bs: u64) -> Option<u32> {
    debug_assert_eq!(data.len() as u64, crcs.len() as u64 * bs);
    data.chunks_exact(bs as usize)
        .zip(crcs)
        .position(|(d, &c)| crc32c::crc32c(d) != c)
        .map(|i| i as u32)
}

/// How a read treats the cache.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Hits from the cache, misses promoted.
    Cached,
    /// Hits from the cache, misses read from the backing device exactly.
    Bypass,
    /// Like `Bypass`, with misses served through readahead windows (a sequential stream).
    Ahead,
    /// Like `Cached`, without counting in the hit statistics (NBD_CMD_CACHE).
    Prefetch,
}

/// How `read_segments` reads the uncached parts of a request.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Holes<'a> {
    /// Exactly the requested bytes.
    Exact,
    /// Whole blocks, returned for promotion.
    Fill,
    /// Like `Fill`, cut out of one backing read of `data` at byte `start` that spans them all.
    Span { start: u64, data: &'a [u8] },
    /// Through the readahead windows.
    Ahead,
}

/// How a write uses the cache.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    Bypass,
    Through,
    Back,
}

impl Volume {
    pub fn id(&self) -> crate::DevId {
        self.backing.id
    }

    /// Exported size: the backing device minus its header.
    pub fn size_bytes(&self) -> u64 {
        self.backing.data_size
    }

    pub fn uuid(&self) -> uuid::Uuid {
        self.backing.uuid()
    }

    pub fn label(&self) -> String {
        self.backing.header.lock().label.clone()
    }

    /// The export name: the label, or the uuid when there is none (or when a label written
    /// before labels were validated is not a usable name).
    pub fn name(&self) -> String {
        let l = self.label();
        if crate::knobs::validate_label(&l).is_ok() {
            l
        } else {
            self.uuid().to_string()
        }
    }

    pub fn is_rotational(&self) -> bool {
        self.backing.dev.is_rotational()
    }

    pub fn mode(&self) -> CacheMode {
        self.backing.mode()
    }

    pub fn knobs(&self) -> DevKnobs {
        self.backing.knobs()
    }

    /// Changes one knob live. The value is validated first, then persisted in the backing
    /// header (both copies, flushed), and only then applied: a value that is refused, or whose
    /// header write fails, changes nothing.
    pub fn set_knob(&self, knob: Knob) -> Result<()> {
        crate::guard::contain(&self.inner, "set knob", || self.set_knob_unguarded(knob))
    }

    fn set_knob_unguarded(&self, knob: Knob) -> Result<()> {
        knob.validate()?;
        let b = &self.backing;
        if let Knob::Label(l) = &knob {
            let taken = self.inner.backings.read().values().find_map(|o| {
                let h = o.header.lock();
                (o.id != b.id && h.label == *l).then_some(h.dev_uuid)
            });
            if let Some(other) = taken {
                return Err(Error::Invalid(format!(
                    "label {l:?} is already the name of device {other}"
                )));
            }
        }
        b.update_header(|h| match &knob {
            Knob::CacheMode(m) => h.mode = *m,
            Knob::SequentialCutoff(v) => h.tunables.sequential_cutoff = *v,
            Knob::WritebackPercent(v) => h.tunables.writeback_percent = *v,
            Knob::WritebackDelaySecs(v) => h.tunables.writeback_delay_secs = *v,
            Knob::WritebackRunning(v) => h.tunables.writeback_running = *v,
            Knob::Label(l) => h.label = l.clone(),
        })?;
        match knob {
            Knob::CacheMode(m) => b.mode.store(m.code(), Ordering::SeqCst),
            Knob::SequentialCutoff(v) => b.sequential_cutoff.store(v, Ordering::Relaxed),
            Knob::WritebackPercent(v) => b.writeback_percent.store(u64::from(v), Ordering::Relaxed),
            Knob::WritebackDelaySecs(v) => b.writeback_delay_secs.store(v, Ordering::Relaxed),
            Knob::WritebackRunning(v) => b.writeback_running.store(v, Ordering::Relaxed),
            Knob::Label(_) => {}
        }
        self.inner.wake_background();
        Ok(())
    }

    /// Switches the cache mode live (see [`Volume::set_knob`]).
    pub fn set_mode(&self, mode: CacheMode) -> Result<()> {
        self.set_knob(Knob::CacheMode(mode))
    }

    pub fn set_sequential_cutoff(&self, bytes: u64) -> Result<()> {
        self.set_knob(Knob::SequentialCutoff(bytes))
    }

    pub fn set_writeback_percent(&self, pct: u32) -> Result<()> {
        self.set_knob(Knob::WritebackPercent(pct))
    }

    pub fn set_writeback_delay_secs(&self, secs: u64) -> Result<()> {
        self.set_knob(Knob::WritebackDelaySecs(secs))
    }

    pub fn set_writeback_running(&self, on: bool) -> Result<()> {
        self.set_knob(Knob::WritebackRunning(on))
    }

    pub fn set_label(&self, label: &str) -> Result<()> {
        self.set_knob(Knob::Label(label.to_string()))
    }

    /// Status and statistics of this device.
    pub fn status(&self) -> DevStatus {
        let b = &self.backing;
        let bs = self.inner.block_size();
        let (dirty, cached) = {
            let st = self.inner.state.lock();
            (
                st.index.dev_dirty_blocks(b.id),
                st.index.dev_live_blocks(b.id),
            )
        };
        let now = self.inner.now_ns();
        let snap = b.counters.snapshot();
        b.history.tick(now, &snap);
        let writeback = crate::background::device_rate(&self.inner, b);
        DevStatus {
            id: b.id,
            uuid: b.uuid(),
            knobs: b.knobs(),
            size_bytes: b.data_size,
            dirty_bytes: dirty * bs,
            cached_bytes: cached * bs,
            state: if b.detaching.load(Ordering::Relaxed) {
                "detaching"
            } else if dirty > 0 {
                "dirty"
            } else {
                "clean"
            },
            writeback,
            stats: b.history.windows(now, &snap),
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.check_failed()?;
        if !offset.is_multiple_of(512) || !len.is_multiple_of(512) {
            return Err(Error::Invalid(format!(
                "offset {offset} and length {len} must be multiples of 512"
            )));
        }
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.backing.data_size)
        {
            return Err(Error::Invalid(format!(
                "request at {offset} of {len} bytes ends past the device size {}",
                self.backing.data_size
            )));
        }
        if self.backing.detaching.load(Ordering::Relaxed)
            && !self.inner.backings.read().contains_key(&self.backing.id)
        {
            return Err(Error::State("device has been detached".into()));
        }
        Ok(())
    }

    /// Feeds the sequential detector; returns the length of the stream the request continues.
    fn note_io(&self, offset: u64, len: u64) -> u64 {
        let now = self.inner.now_ns();
        let stream = self.backing.seq.lock().observe(offset, len, now);
        if stream >= crate::policy::WRITEBACK_STREAM_BYTES {
            self.backing
                .client_stream_ns
                .store(now.max(1), Ordering::Relaxed);
        }
        stream
    }

    fn seq_bypass(&self, stream_bytes: u64) -> bool {
        is_sequential_bypass(
            stream_bytes,
            self.backing.sequential_cutoff.load(Ordering::Relaxed),
        )
    }

    /// Runs a client I/O on the backing device, stamping when clients last used it (before
    /// and after, so a long request counts as use all along) for writeback to yield to.
    fn on_backing<T>(&self, io: impl FnOnce(&dyn BlockDevice) -> T) -> T {
        let stamp = || {
            self.backing
                .client_backing_ns
                .store(self.inner.now_ns(), Ordering::Relaxed)
        };
        stamp();
        let r = io(&*self.backing.dev);
        stamp();
        r
    }

    fn backing_read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        Counters::add(&self.backing.counters.backing_read_bytes, buf.len() as u64);
        self.on_backing(|d| d.read_at(buf, self.backing.data_offset() + offset))
            .ctx(|| format!("reading backing device at {offset}"))
    }

    /// Runs a client I/O that changes `[offset, offset + len)` of the backing device (write,
    /// zeroes, discard; `io` gets the device and the absolute offset). Afterwards, whatever
    /// the outcome, readahead windows over the range are dropped and the device is marked
    /// written for the deferred flush.
    fn change_backing(
        &self,
        offset: u64,
        len: u64,
        io: impl FnOnce(&dyn BlockDevice, u64) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let r = self.on_backing(|d| io(d, self.backing.data_offset() + offset));
        self.backing
            .readahead
            .lock()
            .invalidate(offset, offset + len);
        self.backing.backing_written.store(true, Ordering::SeqCst);
        r
    }

    fn backing_write(&self, data: &[u8], offset: u64) -> Result<()> {
        let len = data.len() as u64;
        Counters::add(&self.backing.counters.backing_written_bytes, len);
        self.change_backing(offset, len, |d, at| d.write_at(data, at))
            .ctx(|| format!("writing backing device at {offset}"))
    }

    // ----- reads -----

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        crate::guard::contain(&self.inner, "read", || self.read_unguarded(offset, buf))
    }

    fn read_unguarded(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let stream = self.note_io(offset, buf.len() as u64);
        let bypass = self.mode() == CacheMode::None || self.seq_bypass(stream);
        let len = buf.len() as u64;
        let read = if bypass && stream > len && stream >= READAHEAD_AFTER_BYTES {
            Read::Ahead
        } else if bypass {
            Read::Bypass
        } else {
            Read::Cached
        };
        self.read_inner(offset, buf, read)
    }

    /// Prefetches a range into the cache (NBD_CMD_CACHE).
    pub fn prefetch(&self, offset: u64, len: u64) -> Result<()> {
        crate::guard::contain(&self.inner, "prefetch", || {
            self.prefetch_unguarded(offset, len)
        })
    }

    fn prefetch_unguarded(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        if self.mode() == CacheMode::None {
            // Nothing would be kept: the hint is honoured by doing nothing.
            return Ok(());
        }
        let chunk = 1u64 << 20;
        let mut buf = vec![0u8; chunk.min(len) as usize];
        let mut at = 0;
        while at < len {
            let n = chunk.min(len - at) as usize;
            self.read_inner(offset + at, &mut buf[..n], Read::Prefetch)?;
            at += n as u64;
        }
        Ok(())
    }

    fn read_inner(&self, offset: u64, buf: &mut [u8], read: Read) -> Result<()> {
        let bypass = matches!(read, Read::Bypass | Read::Ahead);
        let prefetch = read == Read::Prefetch;
        let inner = &*self.inner;
        let dev = self.backing.id;
        let bs = inner.block_size();
        let end = offset + buf.len() as u64;
        let (b0, b1) = (offset / bs, end.div_ceil(bs));
        let tick = inner.next_tick();
        let mut waited = false;
        // Expected crcs of the cached blocks, copied with the pins in one critical section (a
        // pinned block's crc cannot change), so blocks are verified outside the lock.
        let mut crcs = Crcs::new();
        let fast = if prefetch {
            None
        } else {
            self.lock_free_hit(b0, b1, &mut crcs)
        };
        let (segs, promo, around) = if let Some(segs) = fast {
            (segs, None, ((b0, b0), (b1, b1)))
        } else {
            loop {
                let mut st = inner.state.lock();
                let segs = st.index.lookup(dev, b0, b1);
                let miss = !bypass && segs.iter().any(|s| s.ext.is_none());
                // A miss wholly inside a promotion in flight (concurrent readers of one window,
                // e.g. a sequential stream at queue depth > 1) waits for it, then reads the
                // cache, instead of reading the backing device again. Once only: a promotion that
                // collided or failed leaves the blocks uncached and this read fetches them itself.
                if miss && !waited {
                    let covering = st
                        .promotions
                        .iter()
                        .find(|(_, p)| p.dev == dev && p.b0 <= b0 && b1 <= p.b1 && !p.collided)
                        .map(|(id, _)| *id);
                    if let Some(id) = covering {
                        waited = true;
                        inner.promoted.wait_while_for(
                            &mut st,
                            |st| st.promotions.contains_key(&id),
                            PROMOTION_WAIT_MAX,
                        );
                        continue;
                    }
                }
                let around = if miss {
                    self.miss_fill(&st.index, b0, b1)
                } else {
                    ((b0, b0), (b1, b1))
                };
                for s in &segs {
                    if let Some(e) = s.ext {
                        let bucket = st.index.bucket_of(e.cache_block);
                        st.buckets.pin(bucket);
                        st.buckets.touch(bucket, tick);
                        crcs.extend((0..e.len).map(|i| st.index.crc(e.cache_block + i)));
                    }
                }
                let promo = miss.then(|| {
                    let id = st.next_promotion;
                    st.next_promotion += 1;
                    st.promotions.insert(
                        id,
                        Promotion {
                            dev,
                            b0: around.0 .0,
                            b1: around.1 .1,
                            collided: false,
                        },
                    );
                    id
                });
                break (segs, promo, around);
            }
        };
        let hit = segs.iter().all(|s| s.ext.is_some());
        // Uncached blocks next to a miss come along, in offset order; a request that is one
        // hole is read together with them in a single backing read (one seek, even when other
        // requests are queued on the disk).
        let result = (|| {
            let ((p0, p1), (s0, s1)) = around;
            if promo.is_some() && segs.len() == 1 && segs[0].ext.is_none() {
                let from = p0 * bs;
                let to = if s1 > s0 {
                    s1 * bs
                } else {
                    (b1 * bs).min(self.size_bytes())
                };
                let mut d = vec![0u8; (to - from) as usize];
                self.backing_read(&mut d, from)?;
                buf.copy_from_slice(&d[(offset - from) as usize..(end - from) as usize]);
                d.truncate((d.len() as u64 / bs * bs) as usize);
                return Ok(if d.is_empty() {
                    Vec::new()
                } else {
                    vec![(p0, d)]
                });
            }
            // A miss with several holes between cached blocks, on a rotational device: one
            // backing read from the first uncached block to the last (one seek, as the bare
            // disk would do), the cached blocks' stale copies in it ignored.
            let mut hole_segs = segs.iter().filter(|s| s.ext.is_none());
            let span = match (hole_segs.next(), hole_segs.next_back()) {
                (Some(first), Some(last))
                    if promo.is_some() && self.backing.dev.is_rotational() =>
                {
                    let from = if p1 > p0 { p0 } else { first.block } * bs;
                    let to = (if s1 > s0 { s1 } else { last.block + last.len } * bs)
                        .min(self.size_bytes());
                    let mut d = vec![0u8; (to - from) as usize];
                    self.backing_read(&mut d, from)?;
                    Some((from, d))
                }
                _ => None,
            };
            let range = |b0: u64, b1: u64| -> Result<Vec<u8>> {
                let (from, to) = (b0 * bs, b1 * bs);
                if let Some((start, d)) = &span {
                    return Ok(d[(from - start) as usize..(to - start) as usize].to_vec());
                }
                let mut d = vec![0u8; (to - from) as usize];
                self.backing_read(&mut d, from)?;
                Ok(d)
            };
            let mut fills = Vec::new();
            if p1 > p0 {
                fills.push((p0, range(p0, p1)?));
            }
            let holes = match &span {
                Some((start, data)) => Holes::Span {
                    start: *start,
                    data,
                },
                None if promo.is_some() => Holes::Fill,
                None if read == Read::Ahead => Holes::Ahead,
                None => Holes::Exact,
            };
            fills.extend(self.read_segments(&segs, &crcs, offset, buf, holes)?);
            if s1 > s0 {
                fills.push((s0, range(s0, s1)?));
            }
            Ok(fills)
        })();
        for s in &segs {
            if let Some(e) = s.ext {
                inner.unpin(inner.bucket_of(e.cache_block));
            }
        }
        let fills = match result {
            Ok(f) => f,
            Err(e) => {
                if let Some(id) = promo {
                    inner.state.lock().promotions.remove(&id);
                    inner.promoted.notify_all();
                }
                Counters::add(&self.backing.counters.io_errors, 1);
                return Err(e);
            }
        };
        if !prefetch {
            let c = &self.backing.counters;
            Counters::add(
                match (bypass, hit) {
                    (false, true) => &c.cache_hits,
                    (false, false) => &c.cache_misses,
                    (true, true) => &c.cache_bypass_hits,
                    (true, false) => &c.cache_bypass_misses,
                },
                1,
            );
            if bypass {
                Counters::add(&c.bypassed, buf.len() as u64);
            }
        }
        if let Some(id) = promo {
            self.promote(id, fills);
        }
        Ok(())
    }

    /// A hit found and pinned without the state lock: every block of `[b0, b1)` cached, each
    /// piece's bucket pinned and the blocks' crcs in `crcs`, checked against the index's
    /// seqlock after the pins (see `slots` and `alloc`). `None` (nothing pinned, `crcs` empty):
    /// a miss, or the index changed meanwhile; the locked path decides.
    fn lock_free_hit(&self, b0: u64, b1: u64, crcs: &mut Crcs) -> Option<Segs> {
        let inner = &*self.inner;
        let reader = &inner.index_reader;
        let Some((seq, segs)) = crate::index::lookup_hit(reader, self.backing.id, b0, b1, crcs)
        else {
            crcs.clear();
            return None;
        };
        let buckets = || {
            segs.iter()
                .filter_map(|s| s.ext.map(|e| inner.bucket_of(e.cache_block)))
        };
        buckets().for_each(|b| inner.pins.pin_unlocked(b));
        if reader.valid(seq) {
            buckets().for_each(|b| inner.touches.note(b));
            return Some(segs);
        }
        buckets().for_each(|b| inner.unpin(b));
        crcs.clear();
        None
    }

    /// The miss fill: on a rotational backing device a miss costs the seek, not the bytes, so
    /// the uncached blocks around `[b0, b1)` up to the enclosing `MISS_FILL_BYTES`-aligned
    /// window are read and promoted too. Returns the extra ranges before and after the request
    /// (empty when the device is not rotational or the neighbours are cached).
    fn miss_fill(&self, index: &crate::index::Index, b0: u64, b1: u64) -> ((u64, u64), (u64, u64)) {
        let bs = self.inner.block_size();
        let window = MISS_FILL_BYTES / bs;
        if !self.backing.dev.is_rotational() || window <= 1 {
            return ((b0, b0), (b1, b1));
        }
        let dev_blocks = self.size_bytes() / bs;
        let w0 = b0 / window * window;
        let w1 = (b1.div_ceil(window) * window).min(dev_blocks).max(b1);
        let before = index.lookup(self.backing.id, w0, b0);
        let p0 = match before.last() {
            Some(s) if s.ext.is_none() => s.block,
            _ => b0,
        };
        let after = index.lookup(self.backing.id, b1, w1);
        let s1 = match after.first() {
            Some(s) if s.ext.is_none() => s.block + s.len,
            _ => b1,
        };
        ((p0, b0), (b1, s1))
    }

    /// Reads every segment into `buf` (`crcs`: those of the cached blocks, in order); returns
    /// whole-block data of the holes to promote.
    fn read_segments(
        &self,
        segs: &[Seg],
        mut crcs: &[u32],
        offset: u64,
        buf: &mut [u8],
        holes: Holes,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        let want_fills = matches!(holes, Holes::Fill | Holes::Span { .. });
        let bs = self.inner.block_size();
        let end = offset + buf.len() as u64;
        let mut fills = Vec::new();
        for s in segs {
            let (seg_start, seg_end) = (s.block * bs, (s.block + s.len) * bs);
            let data = match s.ext {
                Some(e) => {
                    let (expected, rest) = crcs.split_at(e.len as usize);
                    crcs = rest;
                    let whole = offset <= seg_start && seg_end <= end;
                    let mut bounce = Vec::new();
                    let out = if whole {
                        // The common case: straight into the caller's buffer, no copy.
                        &mut buf[(seg_start - offset) as usize..(seg_end - offset) as usize]
                    } else {
                        bounce.resize((seg_end - seg_start) as usize, 0);
                        &mut bounce[..]
                    };
                    if !self.read_cached(s.block, e, expected, out)? {
                        // Clean block failed its checksum: dropped, read the backing device.
                        let n = (seg_end.min(self.size_bytes()) - seg_start) as usize;
                        self.backing_read(&mut out[..n], seg_start)?;
                    }
                    if whole {
                        continue;
                    }
                    bounce
                }
                None => {
                    // Read whole blocks when promoting (the seek is paid anyway), else exactly
                    // what was asked.
                    let (from, to) = if want_fills {
                        (seg_start, seg_end.min(self.size_bytes()))
                    } else {
                        (seg_start.max(offset), seg_end.min(end))
                    };
                    let mut d = match holes {
                        Holes::Ahead => {
                            self.read_ahead(
                                from,
                                &mut buf[(from - offset) as usize..(to - offset) as usize],
                            )?;
                            continue;
                        }
                        Holes::Span { start, data } => {
                            data[(from - start) as usize..(to - start) as usize].to_vec()
                        }
                        _ => {
                            let mut d = vec![0u8; (to - from) as usize];
                            self.backing_read(&mut d, from)?;
                            d
                        }
                    };
                    let copy_from = seg_start.max(offset);
                    let copy_to = seg_end.min(end);
                    buf[(copy_from - offset) as usize..(copy_to - offset) as usize]
                        .copy_from_slice(
                            &d[(copy_from - from) as usize..(copy_to - from) as usize],
                        );
                    if want_fills {
                        // Only whole blocks are cached; a partial last block (device end) is not.
                        let whole = d.len() as u64 / bs * bs;
                        if whole > 0 {
                            d.truncate(whole as usize);
                            fills.push((s.block, d));
                        }
                    }
                    continue;
                }
            };
            let copy_from = seg_start.max(offset);
            let copy_to = seg_end.min(end);
            buf[(copy_from - offset) as usize..(copy_to - offset) as usize].copy_from_slice(
                &data[(copy_from - seg_start) as usize..(copy_to - seg_start) as usize],
            );
        }
        Ok(fills)
    }

    /// Reads uncached data of a sequential stream from a readahead window, or reads a new
    /// window from the backing device (see `readahead`'s invariants). Windows are aligned to
    /// `WINDOW_BYTES`, so a stream whose holes are scattered between cached blocks still reads
    /// the disk in back-to-back windows (no seek between them) rather than one window per
    /// hole, each a seek away from the last.
    fn read_ahead(&self, from: u64, out: &mut [u8]) -> Result<()> {
        let ra = &self.backing.readahead;
        let generation = {
            let mut r = ra.lock();
            if r.get(from, out) {
                return Ok(());
            }
            r.generation()
        };
        let start = from / readahead::WINDOW_BYTES * readahead::WINDOW_BYTES;
        let end = from + out.len() as u64;
        let to = (start + readahead::WINDOW_BYTES)
            .max(end)
            .min(self.size_bytes());
        let mut d = vec![0u8; (to - start) as usize];
        self.backing_read(&mut d, start)?;
        let at = (from - start) as usize;
        out.copy_from_slice(&d[at..at + out.len()]);
        ra.lock().insert(generation, start, d);
        Ok(())
    }

    /// Reads cached extent `e` (its bucket pinned by the caller) into `out` (`e.len` blocks)
    /// and verifies every block against `crcs` (copied from the index with the pin), with no
    /// lock held. `Ok(false)`: a clean block failed its checksum and the extent was dropped
    /// from the index (`out` then holds nothing useful).
    fn read_cached(
        &self,
        block: u64,
        e: crate::index::Extent,
        crcs: &[u32],
        out: &mut [u8],
    ) -> Result<bool> {
        let inner = &*self.inner;
        let off = inner.layout.block_offset(e.cache_block);
        Counters::add(&self.backing.counters.cache_read_bytes, out.len() as u64);
        inner
            .cache
            .read_at(out, off)
            .ctx(|| format!("reading cache device at {off}"))?;
        let Some(i) = first_bad_block(out, crcs, inner.block_size()) else {
            return Ok(true);
        };
        let what = format!(
            "device {} block {} (cache block {})",
            self.backing.id.0,
            block + u64::from(i),
            e.cache_block + i
        );
        if e.dirty {
            Counters::add(&self.backing.counters.io_errors, 1);
            {
                static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
                LOG.log(
                    log::Level::Error,
                    format_args!("checksum mismatch on dirty data: {what}"),
                );
            }
            return Err(Error::DataCorrupt(what));
        }
        {
            static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
            LOG.log(
                log::Level::Warn,
                format_args!(
                    "checksum mismatch on clean cached data, re-reading from the backing \
                     device: {what}"
                ),
            );
        }
        Counters::add(&self.backing.counters.checksum_repairs, 1);
        let mut st = inner.state.lock();
        if st
            .index
            .maps_to(self.backing.id, block, e.len, e.cache_block)
        {
            let now = inner.now_ns();
            st.invalidate(self.backing.id, block, block + u64::from(e.len), now);
        }
        Ok(false)
    }

    /// Inserts read-miss data into the cache unless a write overlapped it meanwhile.
    fn promote(&self, id: u64, fills: Vec<(u64, Vec<u8>)>) {
        let inner = &*self.inner;
        for (block, data) in fills {
            if inner
                .state
                .lock()
                .promotions
                .get(&id)
                .is_none_or(|p| p.collided)
            {
                break;
            }
            if let Err(e) = self.cache_insert(block, &data, false, Some(id)) {
                {
                    static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
                    LOG.log(log::Level::Warn, format_args!("promotion failed: {e}"));
                }
                break;
            }
        }
        let p = inner.state.lock().promotions.remove(&id);
        inner.promoted.notify_all();
        if p.is_some_and(|p| p.collided) {
            Counters::add(&self.backing.counters.cache_miss_collisions, 1);
        }
    }

    /// Writes whole blocks to the cache and inserts them (dirty or clean). With `promotion`,
    /// the insert is skipped if that promotion collided. Returns the number of leading blocks
    /// stored (fewer than given when the cache has no room).
    fn cache_insert(
        &self,
        block: u64,
        data: &[u8],
        dirty: bool,
        promotion: Option<u64>,
    ) -> Result<u64> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let nblocks = data.len() as u64 / bs;
        let point = if dirty {
            WritePoint::Dirty
        } else {
            WritePoint::Clean
        };
        let mut done = 0u64;
        while done < nblocks {
            let want = (nblocks - done).min(u64::from(u32::MAX)) as u32;
            let Some(grant) = crate::background::alloc_blocks(inner, point, want)? else {
                break;
            };
            let (cb, n) = (grant.cb, grant.n);
            let chunk = &data[(done * bs) as usize..((done + u64::from(n)) * bs) as usize];
            let off = inner.layout.block_offset(cb);
            Counters::add(
                &self.backing.counters.cache_written_bytes,
                chunk.len() as u64,
            );
            inner
                .cache
                .write_at(chunk, off)
                .ctx(|| format!("writing cache device at {off}"))?;
            let crcs: Vec<u32> = chunk.chunks(bs as usize).map(crc32c::crc32c).collect();
            let mut st = inner.state.lock();
            if let Some(id) = promotion {
                if st.promotions.get(&id).is_none_or(|p| p.collided) {
                    drop(st);
                    return Ok(done);
                }
            }
            let dev = self.backing.id;
            let b = block + done;
            let ext = crate::index::Extent {
                len: n,
                cache_block: cb,
                dirty,
            };
            st.collide(dev, b, b + u64::from(n));
            if let Some(id) = promotion {
                // Our own insert must not mark our own promotion collided.
                st.promotions
                    .get_mut(&id)
                    .expect("promotion registered")
                    .collided = false;
            }
            let now = inner.now_ns();
            st.insert_extent(dev, b, ext, crcs, now);
            let pending = st.journal.buf.buf.len();
            drop(st);
            drop(grant);
            done += u64::from(n);
            if pending > crate::background::JOURNAL_BUF_MAX {
                inner.commit_to(u64::MAX)?;
            }
        }
        Ok(done)
    }

    // ----- writes -----

    /// Writes `data` at `offset`; with `fua` it is durable when this returns.
    pub fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        crate::guard::contain(&self.inner, "write", || {
            self.write_unguarded(offset, data, fua)
        })
    }

    fn write_unguarded(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let len = data.len() as u64;
        let stream = self.note_io(offset, len);
        let route = self.route(self.seq_bypass(stream));
        if route == Route::Bypass {
            Counters::add(&self.backing.counters.bypassed, len);
        }
        self.write_range(offset, len, Some(data), route)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Where a write goes, from the mode, the bypass decision and the dirty limit. A
    /// sequential stream past the cutoff goes around the cache in every mode, over dirty
    /// blocks too (as bcache does unless partial RAID stripes are expensive): the dirty copies
    /// are dropped, their record waiting for one backing flush per commit, and the disk gets
    /// the whole stream, without holes.
    fn route(&self, seq_bypass: bool) -> Route {
        if self.backing.detaching.load(Ordering::Relaxed) {
            return Route::Bypass;
        }
        match self.mode() {
            CacheMode::Writearound | CacheMode::None => Route::Bypass,
            _ if seq_bypass => Route::Bypass,
            CacheMode::Writethrough => Route::Through,
            CacheMode::Writeback => {
                let dirty = self.inner.state.lock().index.dirty_blocks;
                let total = u64::from(self.inner.layout.total_blocks());
                if dirty * 100 >= total * u64::from(self.inner.config.dirty_max_pct) {
                    Route::Bypass
                } else {
                    Route::Back
                }
            }
        }
    }

    /// Writes `data` (or zeroes when `None`) over `[offset, offset + len)` along `route`.
    fn write_range(&self, offset: u64, len: u64, data: Option<&[u8]>, route: Route) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let end = offset + len;
        let (b0, b1) = (offset / bs, end.div_ceil(bs));
        let _guard = inner.ranges.lock(self.backing.id, b0, b1);
        inner.state.lock().collide(self.backing.id, b0, b1);
        let piece =
            |from: u64, to: u64| data.map(|d| &d[(from - offset) as usize..(to - offset) as usize]);
        // Head and tail blocks that the request covers only partly.
        let head_partial = !offset.is_multiple_of(bs) || end < (b0 + 1) * bs;
        let tail_partial = b1 - 1 > b0 && !end.is_multiple_of(bs);
        let full0 = if head_partial { b0 + 1 } else { b0 };
        let full1 = if tail_partial { b1 - 1 } else { b1 };
        if head_partial {
            self.write_partial(
                b0,
                offset,
                end.min((b0 + 1) * bs),
                piece(offset, end.min((b0 + 1) * bs)),
                route,
            )?;
        }
        if full1 > full0 {
            self.write_blocks(full0, piece(full0 * bs, full1 * bs), full1 - full0, route)?;
        }
        if tail_partial {
            let from = (b1 - 1) * bs;
            self.write_partial(b1 - 1, from, end, piece(from, end), route)?;
        }
        Ok(())
    }

    /// A write covering `[from, to)` inside block `block` but not the whole block.
    fn write_partial(
        &self,
        block: u64,
        from: u64,
        to: u64,
        data: Option<&[u8]>,
        route: Route,
    ) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let block_end = ((block + 1) * bs).min(self.size_bytes());
        let (seg, crc) = {
            let mut st = inner.state.lock();
            let seg = st.index.lookup(self.backing.id, block, block + 1)[0];
            let crc = seg.ext.map(|e| {
                let bucket = st.index.bucket_of(e.cache_block);
                st.buckets.pin(bucket);
                st.index.crc(e.cache_block)
            });
            (seg, crc)
        };
        let cached = match (seg.ext, crc) {
            (Some(e), Some(crc)) => {
                let mut whole = vec![0u8; bs as usize];
                let r = self.read_cached(block, e, &[crc], &mut whole);
                inner.unpin(inner.bucket_of(e.cache_block));
                r?.then_some(whole)
            }
            _ => None,
        };
        match cached {
            Some(mut whole) if block_end == (block + 1) * bs => {
                let at = (from - block * bs) as usize;
                let n = (to - from) as usize;
                match data {
                    Some(d) => whole[at..at + n].copy_from_slice(d),
                    None => whole[at..at + n].fill(0),
                }
                self.write_blocks(block, Some(&whole), 1, route)
            }
            _ => {
                // Not cached (or the device's partial last block): straight to the backing
                // device; anything cached for the block is stale now.
                match data {
                    Some(d) => self.backing_write(d, from)?,
                    None => self.backing_zero(from, to - from)?,
                }
                let now = inner.now_ns();
                inner
                    .state
                    .lock()
                    .invalidate(self.backing.id, block, block + 1, now);
                Ok(())
            }
        }
    }

    fn backing_zero(&self, offset: u64, len: u64) -> Result<()> {
        Counters::add(&self.backing.counters.backing_written_bytes, len);
        self.change_backing(offset, len, |d, at| d.write_zeroes(at, len))
            .ctx(|| format!("zeroing backing device at {offset}"))
    }

    /// Writes whole blocks `[block, block + n)` (data, or zeroes when `None`) along `route`.
    fn write_blocks(&self, block: u64, data: Option<&[u8]>, n: u64, route: Route) -> Result<()> {
        let inner = &*self.inner;
        let bs = inner.block_size();
        let dev = self.backing.id;
        let (from, len) = (block * bs, n * bs);
        let data = match (data, route) {
            (None, Route::Bypass) | (None, _) => {
                // Zeroes always go down as a zeroing command, never through the cache.
                self.backing_zero(from, len)?;
                let now = inner.now_ns();
                inner.state.lock().invalidate(dev, block, block + n, now);
                return Ok(());
            }
            (Some(d), _) => d,
        };
        if route != Route::Back {
            self.backing_write(data, from)?;
        }
        let stored = match route {
            Route::Bypass => 0,
            Route::Through => self.cache_insert(block, data, false, None)?,
            Route::Back => {
                if self.backing.header.lock().state != BackingState::Dirty {
                    self.backing.set_state(BackingState::Dirty)?;
                }
                if inner.state.lock().index.dev_dirty_blocks(dev) == 0 {
                    self.backing
                        .dirty_since_ns
                        .store(inner.now_ns(), Ordering::Relaxed);
                }
                self.cache_insert(block, data, true, None)?
            }
        };
        if stored < n {
            // No room in the cache for the rest: write it around (writeback) and drop any
            // stale copy.
            let rest = &data[(stored * bs) as usize..];
            if route == Route::Back {
                self.backing_write(rest, from + stored * bs)?;
            }
            let now = inner.now_ns();
            inner
                .state
                .lock()
                .invalidate(dev, block + stored, block + n, now);
        }
        Ok(())
    }

    /// Makes every write acknowledged before this call durable.
    pub fn flush(&self) -> Result<()> {
        crate::guard::contain(&self.inner, "flush", || self.flush_unguarded())
    }

    fn flush_unguarded(&self) -> Result<()> {
        self.inner.check_failed()?;
        let target = self.inner.state.lock().journal.appended_epoch;
        self.inner.commit_to(target)?;
        // Deferred flush: the backing device is flushed only if something reached it.
        self.backing.flush_if_written()
    }

    /// Discards a range: the cache forgets the blocks it covers and the discard is passed down.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        crate::guard::contain(&self.inner, "discard", || {
            self.discard_unguarded(offset, len)
        })
    }

    fn discard_unguarded(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.note_io(offset, len);
        let inner = &*self.inner;
        let bs = inner.block_size();
        let (b0, b1) = (offset / bs, (offset + len).div_ceil(bs));
        let _guard = inner.ranges.lock(self.backing.id, b0, b1);
        self.change_backing(offset, len, |d, at| d.discard(at, len))
            .ctx(|| format!("discarding backing device at {offset}"))?;
        // Only blocks wholly inside the range are dropped: a partly discarded dirty block
        // still holds live sectors.
        let (f0, f1) = (offset.div_ceil(bs), (offset + len) / bs);
        let now = inner.now_ns();
        let mut st = inner.state.lock();
        st.collide(self.backing.id, b0, b1);
        if f1 > f0 {
            st.invalidate(self.backing.id, f0, f1, now);
        }
        Ok(())
    }

    /// Makes a range read back as zeroes; with `fua`, durably.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        crate::guard::contain(&self.inner, "write zeroes", || {
            self.write_zeroes_unguarded(offset, len, fua)
        })
    }

    fn write_zeroes_unguarded(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.note_io(offset, len);
        self.write_range(offset, len, None, Route::Bypass)?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Fraction of `[offset, offset + len)` held in the cache, as cached ranges (for
    /// block-status style reporting): `(offset, len, dirty)`.
    pub fn cached_ranges(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>> {
        crate::guard::contain(&self.inner, "cached ranges", || {
            self.cached_ranges_unguarded(offset, len)
        })
    }

    fn cached_ranges_unguarded(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>> {
        self.check(offset, len)?;
        let bs = self.inner.block_size();
        let segs = self.inner.state.lock().index.lookup(
            self.backing.id,
            offset / bs,
            (offset + len).div_ceil(bs),
        );
        Ok(segs
            .into_iter()
            .filter_map(|s| s.ext.map(|e| (s.block * bs, s.len * bs, e.dirty)))
            .collect())
    }
}

impl Backing {
    pub(crate) fn data_offset(&self) -> u64 {
        crate::format::BACKING_DATA_OFFSET
    }
}
