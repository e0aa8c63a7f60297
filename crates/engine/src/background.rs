//! Background work: block allocation with reclaim, copying GC, writeback, periodic commits.
//!
//! Invariants:
//! - reclaim only empties clean, closed, unpinned buckets (dirty data is never evicted before
//!   it is written back); an emptied bucket is reusable only after its generation bump is
//!   durable (see `alloc.rs`);
//! - foreground allocation never runs GC (GC takes range locks, and the foreground caller
//!   already holds one); when no bucket can be freed at once the caller writes around the
//!   cache instead of waiting, so a full cache never stalls a request;
//! - writeback holds the range lock while it checks that an extent is still the current dirty
//!   copy, reads it and writes it to the backing device, so it can never overwrite newer data
//!   written directly to the backing device; extents are journaled clean only after a flush
//!   of the backing device has covered them;
//! - every loop here is bounded (batch sizes, bucket counts) so one step takes bounded time.

use crate::alloc::WritePoint;
use crate::guard::{contain, Throttled};
use crate::journal::Entry;
use crate::policy::{writeback_rate, WritebackInputs, WritebackRate};
use crate::set::Inner;
use crate::stats::Counters;
use crate::types::{DevId, Error, IoContext, Result};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pending journal bytes after which a writer commits at once.
pub const JOURNAL_BUF_MAX: usize = 256 * 1024;
/// Most bytes one writeback batch handles.
const WRITEBACK_BATCH_BYTES: u64 = 4 << 20;
/// Most bytes one backing write of merged extents carries.
const WRITEBACK_RUN_BYTES: u64 = 1 << 20;
/// Most bytes of one batch while sharing the backing device with clients: small, so a
/// client waits behind little writeback at a time.
const WRITEBACK_SHARE_BYTES: u64 = 64 << 10;
/// Longest single sleep while paying off a shared batch, so a change of rate is seen soon.
const WRITEBACK_SHARE_SLEEP_MAX: Duration = Duration::from_millis(100);
/// Most buckets one space-management round empties.
const RECLAIM_MAX: usize = 16;
const BACKGROUND_PERIOD: Duration = Duration::from_millis(50);

/// Blocks granted by `alloc_blocks`; their bucket stays pinned until this is dropped (after
/// the index entry is inserted, or when the write is abandoned). Drop it without holding the
/// state lock.
pub struct Grant<'a> {
    inner: &'a Inner,
    pub cb: u32,
    pub n: u32,
}

impl Drop for Grant<'_> {
    fn drop(&mut self) {
        self.inner.unpin(self.inner.bucket_of(self.cb));
    }
}

/// Allocates up to `want` blocks at `point`, reclaiming clean buckets if none is free.
/// `Ok(None)`: the cache is full of dirty or pinned data right now; write around it.
pub fn alloc_blocks(inner: &Inner, point: WritePoint, want: u32) -> Result<Option<Grant<'_>>> {
    for _ in 0..2 {
        let tick = inner.next_tick();
        let granted = inner.state.lock().buckets.alloc(point, want, tick);
        if let Some((cb, n)) = granted {
            return Ok(Some(Grant { inner, cb, n }));
        }
        if reclaim(inner, 1, false)? == 0 {
            break;
        }
    }
    inner.wake_background();
    Ok(None)
}

/// Keeps `target` buckets free: reclaims clean buckets (least recently used first) and, when
/// allowed, compacts mostly-stale buckets. Returns buckets emptied.
pub fn make_space(inner: &Inner, target: usize) -> Result<usize> {
    reclaim(inner, target, true)
}

fn reclaim(inner: &Inner, target: usize, allow_gc: bool) -> Result<usize> {
    let mut emptied = 0;
    while emptied < RECLAIM_MAX {
        let victim = {
            let mut st = inner.state.lock();
            let st = &mut *st;
            if st.buckets.free_count() + st.buckets.pending_count() >= target {
                break;
            }
            let epoch = st.journal.appended_epoch;
            let victim =
                st.buckets
                    .reclaim_candidate(&st.index.bucket_live, &st.index.bucket_dirty, epoch);
            if let Some(b) = victim {
                retire_bucket(inner, st, b);
                emptied += 1;
            }
            victim
        };
        if victim.is_none() {
            if allow_gc && gc_one(inner)? {
                emptied += 1;
            } else {
                break;
            }
        }
    }
    let pending = inner.state.lock().buckets.pending_count();
    if emptied > 0 || pending > 0 {
        inner.commit_to(u64::MAX)?;
    }
    Ok(emptied)
}

/// Drops a clean bucket's entries, bumps its generation (journaled) and queues it for reuse.
fn retire_bucket(inner: &Inner, st: &mut crate::set::State, b: u32) {
    let dirty = st.index.drop_bucket(b);
    assert_eq!(dirty, 0, "reclaim must never drop dirty data");
    let now = inner.now_ns();
    let gen = st.buckets.gen[b as usize].wrapping_add(1);
    st.log(&Entry::BucketGen { bucket: b, gen }, now);
    let tag = st.journal.appended_epoch;
    assert_eq!(st.buckets.retire(b, tag), gen);
}

/// Copying GC of the emptiest closed bucket: moves its live extents (clean and dirty) to the
/// open buckets, then retires it. Returns whether a bucket was emptied.
fn gc_one(inner: &Inner) -> Result<bool> {
    let (b, entries) = {
        let mut st = inner.state.lock();
        let st = &mut *st;
        let epoch = st.journal.appended_epoch;
        let Some(b) =
            st.buckets
                .gc_candidate(&st.index.bucket_live, inner.config.gc_live_pct, epoch)
        else {
            return Ok(false);
        };
        st.buckets.pin(b);
        (b, st.index.entries_in_bucket(b))
    };
    let moved = (|| -> Result<bool> {
        for (dev, s, e) in entries {
            let _g = inner.ranges.lock(dev, s, s + u64::from(e.len));
            if !inner
                .state
                .lock()
                .index
                .maps_to(dev, s, e.len, e.cache_block)
            {
                continue;
            }
            let Some(data) = read_verified(inner, dev, s, e)? else {
                return Ok(false);
            };
            let bs = inner.block_size() as usize;
            let mut done = 0u32;
            while done < e.len {
                let dirty_now = inner.state.lock().index.lookup(
                    dev,
                    s + u64::from(done),
                    s + u64::from(done) + 1,
                )[0]
                .ext
                .is_some_and(|x| x.dirty);
                let point = if dirty_now {
                    WritePoint::Dirty
                } else {
                    WritePoint::Clean
                };
                let Some(grant) = alloc_blocks(inner, point, e.len - done)? else {
                    return Ok(false);
                };
                let (cb, n) = (grant.cb, grant.n);
                let chunk = &data[done as usize * bs..(done + n) as usize * bs];
                let off = inner.layout.block_offset(cb);
                inner
                    .cache
                    .write_at(chunk, off)
                    .ctx(|| format!("GC writing cache at {off}"))?;
                let mut st = inner.state.lock();
                let from = s + u64::from(done);
                if st.index.maps_to(dev, from, n, e.cache_block + done) {
                    // Writeback may have cleaned part of the run since it was collected: each
                    // piece keeps its own state (a dirty block moved as clean would be lost).
                    let now = inner.now_ns();
                    for seg in st.index.lookup(dev, from, from + u64::from(n)) {
                        let old = seg.ext.expect("maps_to: every block is cached");
                        let at = (seg.block - from) as u32;
                        let crcs: Vec<u32> = (0..old.len)
                            .map(|i| st.index.crc(old.cache_block + i))
                            .collect();
                        let ext = crate::index::Extent {
                            len: old.len,
                            cache_block: cb + at,
                            dirty: old.dirty,
                        };
                        st.insert_extent(dev, seg.block, ext, crcs, now);
                    }
                }
                done += n;
            }
        }
        Ok(true)
    })();
    let mut st = inner.state.lock();
    let durable = st.journal.durable_epoch;
    st.buckets.unpin(b, durable);
    let emptied = moved?
        && st.index.bucket_live[b as usize] == 0
        && st.buckets.state[b as usize] == crate::alloc::BucketState::Closed;
    if emptied {
        retire_bucket(inner, &mut st, b);
    }
    Ok(emptied)
}

/// Reads an extent from the cache (bucket pinned by the caller or range-locked) and checks
/// it. A clean extent that fails is dropped (`None`); a dirty one is an error.
fn read_verified(
    inner: &Inner,
    dev: DevId,
    block: u64,
    e: crate::index::Extent,
) -> Result<Option<Vec<u8>>> {
    let bs = inner.block_size() as usize;
    let mut data = vec![0u8; e.len as usize * bs];
    let off = inner.layout.block_offset(e.cache_block);
    inner
        .cache
        .read_at(&mut data, off)
        .ctx(|| format!("reading cache at {off}"))?;
    // The crcs cannot change while the extent is pinned or range-locked: copy them under the
    // lock, check outside it.
    let crcs: smallvec::SmallVec<[u32; 16]> = {
        let st = inner.state.lock();
        (0..e.len)
            .map(|i| st.index.crc(e.cache_block + i))
            .collect()
    };
    let bad = crate::io::first_bad_block(&data, &crcs, inner.block_size());
    match bad {
        None => Ok(Some(data)),
        Some(i) if e.dirty => Err(Error::DataCorrupt(format!(
            "device {} block {} (cache block {})",
            dev.0,
            block + u64::from(i),
            e.cache_block + i
        ))),
        Some(_) => {
            let now = inner.now_ns();
            inner
                .state
                .lock()
                .invalidate(dev, block, block + u64::from(e.len), now);
            Ok(None)
        }
    }
}

/// Dirty blocks collected for writeback, sorted by backing position: a pass takes the next
/// ones in that order (an elevator sweep over what the pool holds), and an exhausted pool is
/// refilled from the buckets holding dirty data, in cache order from where the last refill
/// stopped. So a pass costs what it writes back plus, once per `WRITEBACK_POOL_BLOCKS`
/// blocks, a refill that visits only dirty buckets: never a scan of the whole cache.
#[derive(Default)]
pub(crate) struct WritebackPool {
    pool: Vec<(DevId, u64, crate::index::Extent)>,
    pos: usize,
    cursor: u32,
}

/// Most dirty blocks one refill of the writeback pool collects (bounded work under the state
/// lock, bounded memory: 16K runs at most).
const WRITEBACK_POOL_BLOCKS: u64 = 16 * 1024;

impl WritebackPool {
    /// The next runs of at most `budget` blocks in all, of device `only` if given and of
    /// devices `wanted` accepts, that are still dirty where the pool found them.
    pub fn next_batch(
        &mut self,
        index: &crate::index::Index,
        budget: u64,
        only: Option<DevId>,
        wanted: impl Fn(DevId) -> bool,
    ) -> Vec<(DevId, u64, crate::index::Extent)> {
        let mut out = Vec::new();
        let mut taken = 0u64;
        let mut refilled = false;
        loop {
            while self.pos < self.pool.len() && taken < budget {
                let (d, s, e) = self.pool[self.pos];
                self.pos += 1;
                if only.is_some_and(|o| o != d)
                    || !wanted(d)
                    || !index.dirty_at(d, s, e.len, e.cache_block)
                {
                    continue;
                }
                out.push((d, s, e));
                taken += u64::from(e.len);
            }
            if taken >= budget || refilled {
                return out;
            }
            self.pool = index.dirty_runs(&mut self.cursor, WRITEBACK_POOL_BLOCKS, only);
            self.pool.sort_unstable_by_key(|(d, s, _)| (*d, *s));
            self.pos = 0;
            refilled = true;
        }
    }
}

/// Cache blocks whose buckets a writeback pass pinned; unpinned when dropped.
struct Pins<'a>(Vec<u32>, &'a Inner);

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        for &cb in &self.0 {
            self.1.unpin(self.1.bucket_of(cb));
        }
    }
}

/// One writeback pass. `force` ignores the rate policy; `only` restricts it to one device.
/// Returns blocks written back.
pub fn writeback_batch(inner: &Inner, force: bool, only: Option<DevId>) -> Result<u64> {
    Ok(writeback_pass(inner, force, only)?.0)
}

/// The rate of every attached device (restricted to `only`) that has writeback to do.
fn device_rates(
    inner: &Inner,
    st: &crate::set::State,
    backings: &[Arc<crate::set::Backing>],
    force: bool,
    only: Option<DevId>,
) -> Vec<(DevId, WritebackRate)> {
    let now = inner.now_ns();
    let total = u64::from(inner.layout.total_blocks());
    backings
        .iter()
        .filter(|b| only.is_none_or(|d| d == b.id))
        .map(|b| {
            let rate = if force {
                WritebackRate::Full
            } else {
                writeback_rate(&WritebackInputs {
                    running: b.writeback_running.load(Ordering::Relaxed),
                    detaching: b.detaching.load(Ordering::Relaxed),
                    dirty_blocks: st.index.dev_dirty_blocks(b.id),
                    total_blocks: total,
                    writeback_percent: b.writeback_percent.load(Ordering::Relaxed),
                    dirty_max_pct: u64::from(inner.config.dirty_max_pct),
                    dirty_age_ns: now.saturating_sub(b.dirty_since_ns.load(Ordering::Relaxed)),
                    delay_ns: b
                        .writeback_delay_secs
                        .load(Ordering::Relaxed)
                        .saturating_mul(1_000_000_000),
                    backing_quiet_ns: now
                        .saturating_sub(b.client_backing_ns.load(Ordering::Relaxed)),
                    stream_quiet_ns: match b.client_stream_ns.load(Ordering::Relaxed) {
                        0 => u64::MAX,
                        t => now.saturating_sub(t),
                    },
                })
            };
            (b.id, rate)
        })
        .filter(|(_, r)| *r != WritebackRate::Idle)
        .collect()
}

fn strongest(rates: &[(DevId, WritebackRate)]) -> WritebackRate {
    rates
        .iter()
        .map(|r| r.1)
        .max()
        .unwrap_or(WritebackRate::Idle)
}

/// The writeback rate that applies to one device now (for its status).
pub(crate) fn device_rate(inner: &Inner, b: &Arc<crate::set::Backing>) -> WritebackRate {
    let st = inner.state.lock();
    device_rates(inner, &st, std::slice::from_ref(b), false, None)
        .first()
        .map_or(WritebackRate::Idle, |(_, r)| *r)
}

/// The strongest writeback rate that applies now, without writing anything back.
fn current_rate(inner: &Inner) -> WritebackRate {
    let backings: Vec<_> = inner.backings.read().values().cloned().collect();
    let st = inner.state.lock();
    strongest(&device_rates(inner, &st, &backings, false, None))
}

/// Like `writeback_batch`, also returning the strongest rate that applied.
fn writeback_pass(inner: &Inner, force: bool, only: Option<DevId>) -> Result<(u64, WritebackRate)> {
    inner.check_failed()?;
    let bs = inner.block_size();
    let backings: Vec<_> = inner.backings.read().values().cloned().collect();
    let (rates, entries) = {
        let mut st = inner.state.lock();
        let rates = device_rates(inner, &st, &backings, force, only);
        let best = strongest(&rates);
        if best == WritebackRate::Idle {
            return Ok((0, WritebackRate::Idle));
        }
        let budget = if best == WritebackRate::Full {
            WRITEBACK_BATCH_BYTES
        } else {
            WRITEBACK_SHARE_BYTES
        } / bs;
        let st = &mut *st;
        let entries = st
            .writeback
            .next_batch(&st.index, budget, only, |d| rates.iter().any(|r| r.0 == d));
        (rates, entries)
    };
    let best = strongest(&rates);
    // Merge backing-contiguous neighbours into runs.
    let mut runs: Vec<Vec<(DevId, u64, crate::index::Extent)>> = Vec::new();
    for x in entries {
        match runs.last_mut() {
            Some(run)
                if {
                    let (d, s, e) = run.last().unwrap();
                    *d == x.0
                        && s + u64::from(e.len) == x.1
                        && (x.1 + u64::from(x.2.len) - run[0].1) * bs <= WRITEBACK_RUN_BYTES
                } =>
            {
                run.push(x)
            }
            _ => runs.push(vec![x]),
        }
    }
    let mut written = Vec::new();
    let mut touched = BTreeSet::new();
    let mut pins = Pins(Vec::new(), inner);
    let pass_start = inner.now_ns();
    for (i, run) in runs.into_iter().enumerate() {
        // A full-speed pass ends early once a client needs the disk (the next pass runs at
        // the client-aware rate) or the set is stopping, so neither waits behind megabytes of
        // seeks; it always writes at least one run, so it makes progress.
        if i > 0
            && !force
            && (inner.stop.load(Ordering::SeqCst)
                || (best == WritebackRate::Full
                    && backings
                        .iter()
                        .any(|b| b.client_backing_ns.load(Ordering::Relaxed) > pass_start)))
        {
            break;
        }
        let dev = run[0].0;
        let Some(backing) = backings.iter().find(|b| b.id == dev) else {
            continue;
        };
        let (r0, r1) = (
            run[0].1,
            run.last().map(|(_, s, e)| s + u64::from(e.len)).unwrap(),
        );
        let _g = inner.ranges.lock(dev, r0, r1);
        // Keep only the pieces that are still the current dirty copy, and pin them.
        let live: Vec<_> = {
            let mut st = inner.state.lock();
            let live: Vec<_> = run
                .into_iter()
                .filter(|(d, s, e)| st.index.dirty_at(*d, *s, e.len, e.cache_block))
                .collect();
            for (_, _, e) in &live {
                let b = st.index.bucket_of(e.cache_block);
                st.buckets.pin(b);
            }
            live
        };
        let mut result = Ok(());
        // Contiguous sub-runs are written with one backing write each.
        let mut pending: Option<(u64, Vec<u8>)> = None;
        let mut ok_pieces = Vec::new();
        for &(d, s, e) in &live {
            match read_verified(inner, d, s, e) {
                Ok(Some(data)) => {
                    match &mut pending {
                        Some((at, buf)) if *at + buf.len() as u64 == s * bs => {
                            buf.extend_from_slice(&data)
                        }
                        _ => {
                            if let Some((at, buf)) = pending.take() {
                                result = result.and(write_backing(backing, at, &buf));
                            }
                            pending = Some((s * bs, data));
                        }
                    }
                    ok_pieces.push((d, s, e));
                }
                Ok(None) => {}
                Err(err) => {
                    static LOG: Throttled = Throttled::new();
                    LOG.log(
                        log::Level::Error,
                        format_args!("writeback skipped unreadable dirty data: {err}"),
                    );
                    Counters::add(&backing.counters.io_errors, 1);
                }
            }
        }
        if let Some((at, buf)) = pending.take() {
            result = result.and(write_backing(backing, at, &buf));
        }
        // The pins stay until the pieces are marked clean (`pins` is released at the end of
        // the pass): a bucket emptied and reused meanwhile could map the same block to the
        // same cache block again with new dirty data, which `mark_clean` would then take for
        // what was written back (an ABA the full-cache test caught as a stale read).
        pins.0.extend(live.iter().map(|(_, _, e)| e.cache_block));
        result?;
        touched.insert(dev);
        written.extend(ok_pieces);
    }
    for dev in &touched {
        let b = backings
            .iter()
            .find(|b| b.id == *dev)
            .expect("touched device is attached");
        b.dev
            .flush()
            .ctx(|| "flushing backing device after writeback".into())?;
    }
    let mut blocks = 0;
    {
        let mut st = inner.state.lock();
        let now = inner.now_ns();
        for (dev, s, e) in &written {
            let n = st.index.mark_clean(*dev, *s, e.len, e.cache_block);
            if n > 0 {
                st.log(
                    &Entry::MarkClean {
                        dev: *dev,
                        block: *s,
                        len: e.len,
                        cache_block: e.cache_block,
                    },
                    now,
                );
            }
            blocks += n;
            if let Some(b) = backings.iter().find(|b| b.id == *dev) {
                Counters::add(&b.counters.writeback_bytes, n * bs);
            }
        }
    }
    Ok((blocks, best))
}

fn write_backing(b: &crate::set::Backing, at: u64, buf: &[u8]) -> Result<()> {
    let r = b
        .dev
        .write_at(buf, b.data_offset() + at)
        .ctx(|| format!("writeback to backing device at {at}"));
    b.readahead.lock().invalidate(at, at + buf.len() as u64);
    r
}

/// Writes back every dirty block of `dev`, reporting `(remaining, total)` dirty bytes.
pub fn drain_dirty(inner: &Inner, dev: DevId, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
    let bs = inner.block_size();
    let total = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
    loop {
        let remaining = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
        progress(remaining, total);
        if remaining == 0 {
            break;
        }
        if writeback_batch(inner, true, Some(dev))? == 0 {
            // A pass that wrote nothing is a failure only if nobody else made progress: the
            // writeback thread (or a client write going around the cache) may have cleaned or
            // dropped these very blocks while this pass waited for their range locks.
            let now = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
            if now < remaining {
                continue;
            }
            return Err(Error::State(format!(
                "{remaining} dirty bytes of device {} cannot be written back (unreadable cache data)",
                dev.0
            )));
        }
    }
    let mut c = inner.commit_lock.lock();
    inner.commit_locked(&mut c)
}

fn sleep(inner: &Inner, d: Duration) {
    let mut g = inner.wake.0.lock();
    if !inner.stop.load(Ordering::SeqCst) {
        inner.wake.1.wait_for(&mut g, d);
    }
}

/// Writeback loop. At `Full` rate it runs batch after batch; at `Share(p)` it sleeps after
/// each batch until the batch's time is `p` % of the time spent (re-checking the rate at
/// least every `WRITEBACK_SHARE_SLEEP_MAX`, so a surge of dirty data or an idle disk is
/// answered quickly); with nothing to do it polls every 100 ms.
pub fn writeback_thread(inner: &Arc<Inner>) {
    let mut owed = Duration::ZERO;
    while !inner.stop.load(Ordering::SeqCst) {
        if !owed.is_zero() {
            if matches!(current_rate(inner), WritebackRate::Share(_)) {
                let t = Instant::now();
                sleep(inner, owed.min(WRITEBACK_SHARE_SLEEP_MAX));
                owed = owed.saturating_sub(t.elapsed());
                continue;
            }
            owed = Duration::ZERO;
        }
        let t = Instant::now();
        match contain(inner, "writeback", || writeback_pass(inner, false, None)) {
            Ok((n, WritebackRate::Full)) if n > 0 => {}
            Ok((n, WritebackRate::Share(pct))) if n > 0 => {
                owed = t.elapsed() * (100 - pct) / pct;
            }
            Ok(_) => sleep(inner, Duration::from_millis(100)),
            Err(e) => {
                static LOG: Throttled = Throttled::new();
                LOG.log(log::Level::Error, format_args!("writeback: {e}"));
                sleep(inner, Duration::from_secs(1));
            }
        }
    }
}

/// Maintenance loop: commits journal entries older than `journal_delay_ms`, checkpoints when
/// the journal ring is half full (a committer wakes it), keeps free
/// buckets in reserve, records statistics history.
pub fn maintenance_thread(inner: &Arc<Inner>) {
    while !inner.stop.load(Ordering::SeqCst) {
        let now = inner.now_ns();
        let due = inner
            .state
            .lock()
            .journal
            .oldest_pending_ns
            .is_some_and(|t| now.saturating_sub(t) >= inner.config.journal_delay_ms * 1_000_000);
        let res = contain(inner, "maintenance", || {
            if due {
                inner.commit_to(u64::MAX)?;
            }
            inner.checkpoint_if_due()?;
            make_space(inner, inner.reserve_buckets)?;
            Ok(())
        });
        if let Err(e) = res {
            static LOG: Throttled = Throttled::new();
            LOG.log(log::Level::Error, format_args!("maintenance: {e}"));
        }
        for b in inner.backings.read().values() {
            b.history.tick(now, &b.counters.snapshot());
        }
        sleep(inner, BACKGROUND_PERIOD);
    }
}
