//! Writeback: dirty data written to the backing devices in backing order, at the rate the
//! policy allows, and marked clean once a backing flush covers it.
//!
//! Invariants:
//! - writeback holds the range lock while it looks up the current dirty copies of a run's
//!   blocks, reads them and writes them to the backing device, so it can never overwrite
//!   newer data written directly to the backing device; extents are journaled clean only
//!   after a flush of the backing device has covered them, and only where the index still
//!   maps the block to the cache block that was written back (a copy moved or replaced
//!   meanwhile stays dirty, and a later pass writes it back);
//! - copying GC may move a dirty block between the moment a pass collects it and the moment
//!   the pass takes its range lock (the pass then writes back the moved copy), or after the
//!   pass wrote it back and released the lock but before it marked it clean (the moved copy
//!   stays dirty): so a pass that cleans nothing has not necessarily failed, and
//!   `drain_dirty` fails only on dirty data it could not read;
//! - a run may bridge a gap between dirty pieces with the cache's clean copies of the gap
//!   (`plan_runs`, when the write cost model says the transfer costs less than another
//!   positioning): under the run's range lock a clean copy holds what the backing device
//!   holds, so writing it changes nothing there; only dirty pieces are marked clean, and a
//!   piece evicted or unreadable since splits the write instead;
//! - batches are swept in backing order, on from where the previous sweep ended (C-SCAN);
//! - a pass keeps its pins until its pieces are marked clean (see `Pins`);
//! - a pass handles at most `WRITEBACK_BATCH_BYTES`, and a refill of the pool visits only
//!   buckets holding dirty data, so one step takes bounded time.

use crate::guard::Throttled;
use crate::journal::Entry;
use crate::policy::{WritebackDecision, WritebackInputs, WritebackRate};
use crate::space::read_verified;
use crate::state::Inner;
use crate::stats::Counters;
use crate::types::{DevId, Error, IoContext, Result};
use crate::units::{BackingBlock, CacheBlock};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Most bytes one writeback batch handles.
const WRITEBACK_BATCH_BYTES: u64 = 4 << 20;
/// Most bytes one backing write of merged extents carries.
const WRITEBACK_RUN_BYTES: u64 = 1 << 20;
/// Most bytes of one batch while sharing the backing device with clients: small, so a
/// client waits behind little writeback at a time.
const WRITEBACK_SHARE_BYTES: u64 = 64 << 10;
/// Longest single sleep while paying off a shared batch, so a change of rate is seen soon.
pub(crate) const WRITEBACK_SHARE_SLEEP_MAX: Duration = Duration::from_millis(100);

/// Cache blocks whose buckets a writeback pass pinned; unpinned when dropped.
struct Pins<'a>(Vec<CacheBlock>, &'a Inner);

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

/// The policy's inputs for one device now.
fn inputs(inner: &Inner, st: &crate::state::State, b: &crate::state::Backing) -> WritebackInputs {
    let now = inner.now_ns();
    WritebackInputs {
        running: b.writeback_running.load(Ordering::Relaxed),
        detaching: b.detaching.load(Ordering::Relaxed),
        dirty_blocks: st.index.dev_dirty_blocks(b.id),
        total_blocks: u64::from(inner.layout.total_blocks()),
        writeback_percent: b.writeback_percent.load(Ordering::Relaxed),
        dirty_max_pct: u64::from(inner.config.dirty_max_pct),
        dirty_age_ns: now.saturating_sub(b.dirty_since_ns.load(Ordering::Relaxed)),
        delay_ns: b
            .writeback_delay_secs
            .load(Ordering::Relaxed)
            .saturating_mul(1_000_000_000),
        backing_quiet_ns: now.saturating_sub(b.client_backing_ns.load(Ordering::Relaxed)),
        stream_quiet_ns: match b.client_stream_ns.load(Ordering::Relaxed) {
            0 => u64::MAX,
            t => now.saturating_sub(t),
        },
    }
}

/// The rate of every attached device (restricted to `only`) that has writeback to do.
/// `step` advances each device's rate controller to now (the writeback pass does; status
/// and the writeback thread's pacing only read it).
fn device_rates(
    inner: &Inner,
    st: &crate::state::State,
    backings: &[Arc<crate::state::Backing>],
    force: bool,
    step: bool,
    only: Option<DevId>,
) -> Vec<(DevId, WritebackRate)> {
    backings
        .iter()
        .filter(|b| only.is_none_or(|d| d == b.id))
        .map(|b| {
            let rate = if force {
                WritebackRate::Full
            } else {
                device_decision(inner, st, b, step).rate
            };
            (b.id, rate)
        })
        .filter(|(_, r)| *r != WritebackRate::Idle)
        .collect()
}

/// The writeback decision for one device, with its controller terms; `step` advances the
/// controller to now.
fn device_decision(
    inner: &Inner,
    st: &crate::state::State,
    b: &crate::state::Backing,
    step: bool,
) -> WritebackDecision {
    let i = inputs(inner, st, b);
    b.policy.writeback(&i, inner.now_ns(), step)
}

fn strongest(rates: &[(DevId, WritebackRate)]) -> WritebackRate {
    rates
        .iter()
        .map(|r| r.1)
        .max()
        .unwrap_or(WritebackRate::Idle)
}

/// The writeback decision that applies to one device now, with its controller terms (for
/// its status; it does not step the controller).
pub(crate) fn device_rate(inner: &Inner, b: &crate::state::Backing) -> WritebackDecision {
    let st = inner.state.lock();
    device_decision(inner, &st, b, false)
}

/// The strongest writeback rate that applies now, without writing anything back.
pub(crate) fn current_rate(inner: &Inner) -> WritebackRate {
    let backings: Vec<_> = inner.backings.read().values().cloned().collect();
    let st = inner.state.lock();
    strongest(&device_rates(inner, &st, &backings, false, false, None))
}

/// Like `writeback_batch`, also returning the strongest rate that applied.
pub(crate) fn writeback_pass(
    inner: &Inner,
    force: bool,
    only: Option<DevId>,
) -> Result<(u64, WritebackRate)> {
    let pass = run_pass(inner, force, only)?;
    Ok((pass.cleaned, pass.rate))
}

/// What one writeback pass did.
struct Pass {
    /// Blocks marked clean.
    cleaned: u64,
    /// The strongest rate that applied.
    rate: WritebackRate,
    /// Dirty blocks the pass collected.
    collected: u64,
    /// Dirty blocks it found unreadable (counted in `io_errors`, left dirty).
    unreadable: u64,
}

fn run_pass(inner: &Inner, force: bool, only: Option<DevId>) -> Result<Pass> {
    inner.check_failed()?;
    if inner.is_degraded() {
        return Err(crate::Error::State(
            "the cache set is degraded: dirty data waits on the cache device until it is re-admitted"
                .into(),
        ));
    }
    let backings: Vec<_> = inner.backings.read().values().cloned().collect();
    let Some(Batch {
        rate: best,
        collected,
        runs,
    }) = collect_batch(inner, &backings, force, only)
    else {
        return Ok(Pass {
            cleaned: 0,
            rate: WritebackRate::Idle,
            collected: 0,
            unreadable: 0,
        });
    };
    let mut unreadable = 0;
    let mut written = Vec::new();
    let mut touched = BTreeSet::new();
    let mut pins = Pins(Vec::new(), inner);
    let pass_start = inner.now_ns();
    // A flush that fails after this pass wrote something (a client's, say) means what the
    // pass wrote may be lost even if its own flush succeeds: nothing is marked clean then.
    let flush_failures: Vec<(DevId, u64)> = backings
        .iter()
        .map(|b| (b.id, b.flush_failures.load(Ordering::SeqCst)))
        .collect();
    for (i, run) in runs.into_iter().enumerate() {
        // A full-speed pass ends early once a client needs the disk (the next pass runs at
        // the client-aware rate) or the set is stopping, so neither waits behind megabytes of
        // seeks; it always writes at least one run, so it makes progress.
        if i > 0 && !force && yields(inner, &backings, best, pass_start) {
            break;
        }
        let dev = run[0].0;
        let Some(backing) = backings.iter().find(|b| b.id == dev) else {
            continue;
        };
        let done = write_run(inner, backing, &run, &mut pins)?;
        unreadable += done.unreadable;
        touched.insert(dev);
        written.extend(done.dirty_written);
    }
    flush_touched(&backings, &touched, &flush_failures)?;
    Ok(Pass {
        cleaned: mark_written_clean(inner, &backings, &written),
        rate: best,
        collected,
        unreadable,
    })
}

/// The dirty data a pass collected, in runs, and the strongest rate that applied.
struct Batch {
    rate: WritebackRate,
    /// Dirty blocks collected.
    collected: u64,
    runs: Vec<Run>,
}

/// Collects the next batch of dirty data from the devices whose rate lets writeback run, and
/// plans its runs; `None` when every rate is idle.
fn collect_batch(
    inner: &Inner,
    backings: &[Arc<crate::state::Backing>],
    force: bool,
    only: Option<DevId>,
) -> Option<Batch> {
    let bs = inner.block_size();
    // Each device's write cost model, for bridging gaps (taken before the state lock).
    let write_costs: Vec<(DevId, crate::cost::CostEstimate)> = backings
        .iter()
        .filter(|b| only.is_none_or(|d| d == b.id))
        .map(|b| (b.id, b.policy.estimate(crate::cost::Op::Write)))
        .collect();
    let mut st = inner.state.lock();
    let rates = device_rates(inner, &st, backings, force, true, only);
    let best = strongest(&rates);
    if best == WritebackRate::Idle {
        return None;
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
    let collected = entries.iter().map(|(_, _, e)| u64::from(e.len)).sum();
    let index = &st.index;
    let runs = plan_runs(entries, bs, |d, from, to| {
        write_costs
            .iter()
            .any(|(c, est)| *c == d && crate::policy::span_holes(est, 2, (to - from) * bs))
            && index
                .lookup(d, from, to)
                .iter()
                .all(|seg| seg.ext.is_some())
    });
    Some(Batch {
        rate: best,
        collected,
        runs,
    })
}

/// Whether a pass stops before its next run: the set is stopping, or the pass runs at full
/// speed and a client has used a backing device since it started.
fn yields(
    inner: &Inner,
    backings: &[Arc<crate::state::Backing>],
    rate: WritebackRate,
    pass_start: u64,
) -> bool {
    inner.stop.load(Ordering::SeqCst)
        || (rate == WritebackRate::Full
            && backings
                .iter()
                .any(|b| b.client_backing_ns.load(Ordering::Relaxed) > pass_start))
}

/// What writing one run back did.
struct RunWritten {
    /// The dirty pieces written (to mark clean once a flush covers them).
    dirty_written: Vec<(DevId, BackingBlock, crate::index::Extent)>,
    /// Dirty blocks found unreadable.
    unreadable: u64,
}

/// Writes one run back under its range lock: the current copies of its blocks, pinned into
/// `pins`, read and written to the backing device in contiguous pieces.
fn write_run(
    inner: &Inner,
    backing: &crate::state::Backing,
    run: &Run,
    pins: &mut Pins,
) -> Result<RunWritten> {
    let dev = run[0].0;
    let (r0, r1) = (
        run[0].1,
        run.last().map(|(_, s, e)| *s + u64::from(e.len)).unwrap(),
    );
    let _g = inner.ranges.lock(dev, r0, r1);
    let live = pin_live(inner, dev, r0, r1);
    let (result, done) = copy_live(inner, backing, &live);
    // The pins stay until the pieces are marked clean (`pins` is released at the end of
    // the pass): a bucket emptied and reused meanwhile could map the same block to the
    // same cache block again with new dirty data, which `mark_clean` would then take for
    // what was written back (an ABA the full-cache test caught as a stale read).
    pins.0.extend(live.iter().map(|(_, _, e)| e.cache_block));
    if result.is_err() {
        backing.writeback_result(&result);
    }
    result?;
    Ok(done)
}

/// The current copies of a run's blocks, pinned: GC may have moved a piece to other cache
/// blocks since it was collected (it held the range lock meanwhile), and writes may have
/// cleaned, dropped or replaced pieces. Dirty copies are written back; clean ones (only in the
/// gaps of a bridged run: the rest of a run was dirty) hold what the backing device holds and
/// are written only to join their neighbours into one write; a hole (evicted since) splits
/// the write.
fn pin_live(inner: &Inner, dev: DevId, r0: BackingBlock, r1: BackingBlock) -> Run {
    let mut st = inner.state.lock();
    let live: Run = st
        .index
        .lookup(dev, r0, r1)
        .into_iter()
        .filter_map(|seg| seg.ext.map(|x| (dev, seg.block, x)))
        .collect();
    for (_, _, e) in &live {
        let b = st.index.bucket_of(e.cache_block);
        st.buckets.pin(b);
    }
    live
}

/// Reads the live pieces and writes them to the backing device, contiguous sub-runs with one
/// backing write each. Returns the first write error (if any) and what was written.
fn copy_live(
    inner: &Inner,
    backing: &crate::state::Backing,
    live: &Run,
) -> (Result<()>, RunWritten) {
    let bs = inner.block_size();
    let mut result = Ok(());
    let mut pending: Option<(u64, Vec<u8>)> = None;
    let mut done = RunWritten {
        dirty_written: Vec::new(),
        unreadable: 0,
    };
    for &(d, s, e) in live {
        match read_verified(inner, d, s, e) {
            Ok(Some(data)) => {
                match &mut pending {
                    Some((at, buf)) if *at + buf.len() as u64 == s.offset(bs) => {
                        buf.extend_from_slice(&data)
                    }
                    _ => {
                        if let Some((at, buf)) = pending.take() {
                            result = result.and(write_backing(backing, at, &buf));
                        }
                        pending = Some((s.offset(bs), data));
                    }
                }
                if e.dirty {
                    done.dirty_written.push((d, s, e));
                }
            }
            Ok(None) => {}
            // A clean gap piece that cannot be read splits the write (the cache device's
            // wrapper counted the error); it holds nothing to write back.
            Err(_) if !e.dirty => {}
            Err(err) => {
                static LOG: Throttled = Throttled::new();
                LOG.log(
                    log::Level::Error,
                    format_args!("writeback skipped unreadable dirty data: {err}"),
                );
                Counters::add(&backing.counters.io_errors, 1);
                done.unreadable += u64::from(e.len);
            }
        }
    }
    if let Some((at, buf)) = pending.take() {
        result = result.and(write_backing(backing, at, &buf));
    }
    (result, done)
}

/// Flushes every device the pass wrote to; fails when that flush, or any other flush of the
/// device since the pass began (`flush_failures` counts them), failed.
fn flush_touched(
    backings: &[Arc<crate::state::Backing>],
    touched: &BTreeSet<DevId>,
    flush_failures: &[(DevId, u64)],
) -> Result<()> {
    for dev in touched {
        let b = backings
            .iter()
            .find(|b| b.id == *dev)
            .expect("touched device is attached");
        let before = flush_failures
            .iter()
            .find(|f| f.0 == *dev)
            .map_or(0, |f| f.1);
        let r = b
            .flush_counted()
            .ctx(|| "flushing backing device after writeback".into())
            .and_then(|()| {
                if b.flush_failures.load(Ordering::SeqCst) == before {
                    Ok(())
                } else {
                    Err(crate::Error::State(format!(
                        "a flush of backing device {} failed during writeback, so what writeback wrote may be lost; its data stays dirty and is written again",
                        dev
                    )))
                }
            });
        b.writeback_result(&r);
        r?;
    }
    Ok(())
}

/// Marks the written dirty pieces clean (where the index still maps them to the cache blocks
/// written back) and journals it; returns the blocks marked clean.
fn mark_written_clean(
    inner: &Inner,
    backings: &[Arc<crate::state::Backing>],
    written: &[(DevId, BackingBlock, crate::index::Extent)],
) -> u64 {
    let bs = inner.block_size();
    let mut blocks = 0;
    let mut st = inner.state.lock();
    let now = inner.now_ns();
    for (dev, s, e) in written {
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
    blocks
}

/// One backing range a pass writes: the batch's dirty pieces in it, sorted.
type Run = Vec<(DevId, BackingBlock, crate::index::Extent)>;

/// Groups a batch's dirty pieces (sorted by device and block) into runs of at most
/// `WRITEBACK_RUN_BYTES`, each locked as one range and written with as few backing writes as
/// its cached blocks allow. A piece joins the run before it when it continues it, or when
/// `bridge(dev, from, to)` says the gap between them is worth writing too: the cache holds
/// all of it (clean copies are what the backing device holds) and the device's write cost
/// model says transferring it costs less than the positioning another write would pay.
fn plan_runs(
    entries: Run,
    bs: u64,
    bridge: impl Fn(DevId, BackingBlock, BackingBlock) -> bool,
) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for x in entries {
        let joins = runs.last().is_some_and(|run| {
            let (d, s, e) = run.last().expect("runs are not empty");
            let end = *s + u64::from(e.len);
            *d == x.0
                && end <= x.1
                && (x.1 + u64::from(x.2.len) - run[0].1) * bs <= WRITEBACK_RUN_BYTES
                && (end == x.1 || bridge(*d, end, x.1))
        });
        match runs.last_mut() {
            Some(run) if joins => run.push(x),
            _ => runs.push(vec![x]),
        }
    }
    runs
}

fn write_backing(b: &crate::state::Backing, at: u64, buf: &[u8]) -> Result<()> {
    let abs = b.data_offset() + at;
    let r = b
        .timed(crate::cost::Op::Write, abs, buf.len() as u64, |d| {
            d.write_at(buf, abs)
        })
        .ctx(|| format!("writeback to backing device at {at}"));
    b.readahead.lock().invalidate(at, at + buf.len() as u64);
    r
}

/// Writes back every dirty block of `dev`, reporting `(remaining, total)` dirty bytes.
///
/// A pass that cleans nothing has not necessarily failed: the writeback thread (or a client
/// write going around the cache) may have cleaned or dropped the same blocks while this pass
/// waited for their range locks, and copying GC may have moved a block after this pass wrote
/// it back and before it marked it clean (the moved copy is still dirty; the next pass writes
/// it back from there). So only a pass that found dirty data it could not read and saw no
/// progress is an error (reported with `io_errors` counted and logged), or one that found no
/// dirty data of the device at all while the count says there is some (a broken index, which
/// no retry would get past). Every other pass that cleaned nothing is followed by another:
/// each one means another thread changed the blocks it collected in that very window. With
/// the device's writes going around the cache, only GC does that to dirty blocks, and GC
/// moves a block again only once the bucket it moved it to has filled, closed and become
/// sparse in turn.
pub fn drain_dirty(inner: &Inner, dev: DevId, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
    let bs = inner.block_size();
    let total = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
    loop {
        let remaining = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
        progress(remaining, total);
        if remaining == 0 {
            break;
        }
        let pass = run_pass(inner, true, Some(dev))?;
        if pass.cleaned > 0 {
            continue;
        }
        let now = inner.state.lock().index.dev_dirty_blocks(dev) * bs;
        if now < remaining {
            continue;
        }
        if pass.unreadable > 0 {
            return Err(Error::State(format!(
                "{remaining} dirty bytes of device {} cannot be written back ({} bytes of unreadable cache data)",
                dev,
                pass.unreadable * bs
            )));
        }
        if pass.collected == 0 {
            return Err(Error::State(format!(
                "{remaining} dirty bytes of device {} are counted but not found in the cache index",
                dev
            )));
        }
    }
    let mut c = inner.commit_lock.lock();
    inner.commit_locked(&mut c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::Extent;

    #[test]
    fn runs_join_neighbours_and_bridge_only_what_the_bridge_allows_up_to_the_bound() {
        let piece = |d: u32, b: u64| {
            (
                DevId::new(d),
                BackingBlock::new(b),
                Extent {
                    len: 1,
                    cache_block: CacheBlock::new(0),
                    dirty: true,
                },
            )
        };
        let entries = vec![
            piece(0, 0),
            piece(0, 1),   // continues
            piece(0, 4),   // a gap of 3 the bridge allows
            piece(0, 10),  // a gap of 5 it does not
            piece(0, 300), // past 1 MiB from the run's start at 10 (4 KiB blocks)
            piece(0, 302), // a gap of 1 it allows
            piece(1, 303), // another device
        ];
        let runs = plan_runs(entries, 4096, |d, from, to| {
            assert_eq!(d, DevId::new(0));
            to - from <= 3
        });
        let starts: Vec<Vec<u64>> = runs
            .iter()
            .map(|r| r.iter().map(|x| x.1.get()).collect())
            .collect();
        assert_eq!(starts, [vec![0, 1, 4], vec![10], vec![300, 302], vec![303]]);
        // Without bridging only contiguous pieces join, and never past the bound.
        let long: Vec<_> = (0..300).map(|b| piece(0, b)).collect();
        let runs = plan_runs(long, 4096, |_, _, _| panic!("no gap to bridge"));
        assert_eq!(runs.iter().map(Vec::len).collect::<Vec<_>>(), [256, 44]);
    }
}
