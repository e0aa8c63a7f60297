//! What a failed flush of the backing device may have lost, made good: client writes the
//! device acknowledged but had not made durable (a remote NBD server that restarted, a disk
//! that dropped its volatile cache) are written to it again from the cache's copies, and
//! what the cache holds no copy of is reported to every client connection once.
//!
//! Invariants:
//! - after a failed flush of the device, whoever's it was (a client's, writeback's, the
//!   journal's), no flush of this volume succeeds before every change the device may have
//!   lost (`unflushed`) has been written again from the cache or counted in
//!   `losses_reported`: `Volume::flush` repairs first and flushes again after a failure;
//! - a block is written again from its copy under the range lock, so the copy is the data
//!   the last acknowledged write left (a client write over it waits or has finished); a clean
//!   copy is never left over data the device lacks once its flush succeeds;
//! - dirty copies need nothing: the cache holds them durably and writeback writes them;
//! - a block without a usable copy (mode `none`, a write around the cache, a discard, zeroes,
//!   a copy that fails its checksum, a degraded set) counts as lost: `losses_reported` grows,
//!   and the server fails each connection's next flush or FUA write once (`Volume::losses`).
//!
//! Fault model: a write again that fails counts its blocks as lost; the flush that follows
//! fails or is retried (`FLUSH_TRIES`).

use super::Volume;
use crate::guard::Throttled;
use crate::types::Result;
use crate::units::BackingBlock;
use std::sync::atomic::Ordering;

/// Flushes a client's flush sends at most, when flushes of the device fail meanwhile.
const FLUSH_TRIES: u32 = 3;

impl Volume {
    /// A client's flush (after its checks, `Volume::flush`): a failed flush of the backing
    /// device (this one's, another client's, writeback's) may have lost writes acknowledged
    /// before it, so they are written again from the cache and the flush is sent again, at
    /// most `FLUSH_TRIES` times while flushes keep failing meanwhile.
    pub(super) fn flush_repairing(&self) -> Result<()> {
        let mut tries = 0;
        loop {
            self.repair_losses();
            let failures = self.backing.flush_failures.load(Ordering::SeqCst);
            let r = self.flush_once();
            let failed_meanwhile = self.backing.flush_failures.load(Ordering::SeqCst) != failures;
            tries += 1;
            if !failed_meanwhile || tries == FLUSH_TRIES {
                return r;
            }
        }
    }

    /// How many times acknowledged writes to this volume were lost for good below the cache
    /// (see the module): a count that only grows. A server fails each connection's next flush
    /// (or FUA write) once after the count passed what the connection last saw.
    pub fn losses(&self) -> u64 {
        self.backing.losses_reported.load(Ordering::SeqCst)
    }

    /// If a flush of the backing device failed since the last call: writes again what it may
    /// have lost and the cache has copies of, and counts a loss if some had none.
    pub(super) fn repair_losses(&self) {
        let failures = self.backing.flush_failures.load(Ordering::SeqCst);
        let Some(ranges) = self.backing.unflushed.lock().take_lost(failures) else {
            return;
        };
        let (mut again, mut lost) = (0u64, 0u64);
        for (b0, b1) in ranges {
            let (a, l) = self.write_copies_again(b0, b1);
            again += a;
            lost += l;
        }
        let bs = self.inner.block_size();
        static LOG: Throttled = Throttled::new();
        if lost > 0 {
            self.backing.losses_reported.fetch_add(1, Ordering::SeqCst);
            LOG.log(
                log::Level::Error,
                format_args!(
                    "volume {}: a flush of the backing device failed, so writes it had \
                     acknowledged may be lost; {} of them written again from the cache, {} \
                     that the cache holds no copy of reported to every client's next flush",
                    self.name(),
                    crate::units::human(again * bs),
                    crate::units::human(lost * bs),
                ),
            );
        } else if again > 0 {
            LOG.log(
                log::Level::Warn,
                format_args!(
                    "volume {}: a flush of the backing device failed; the {} of writes it may \
                     have lost were written again from the cache",
                    self.name(),
                    crate::units::human(again * bs),
                ),
            );
        }
    }

    /// Writes the cache's clean copies of `[b0, b1)` to the backing device again. Returns
    /// the blocks written again and those it has no usable copy of.
    fn write_copies_again(&self, b0: BackingBlock, b1: BackingBlock) -> (u64, u64) {
        let inner = &*self.inner;
        let dev = self.backing.id;
        let blocks = b1.get() - b0.get();
        if inner.is_degraded() {
            return (0, blocks);
        }
        let bs = inner.block_size();
        let _guard = inner.ranges.lock(dev, b0, b1);
        let (segs, crcs) = {
            let mut st = inner.state.lock();
            let segs = st.index.lookup(dev, b0, b1);
            let mut crcs = Vec::new();
            for s in &segs {
                if let Some(e) = s.ext.filter(|e| !e.dirty) {
                    let bucket = st.index.bucket_of(e.cache_block);
                    st.buckets.pin(bucket);
                    crcs.extend((0..e.len).map(|i| st.index.crc(e.cache_block + i)));
                }
            }
            (segs, crcs)
        };
        let (mut again, mut lost) = (0u64, 0u64);
        let mut crcs = &crcs[..];
        for s in &segs {
            match s.ext {
                None => lost += s.len,
                Some(e) if e.dirty => {}
                Some(e) => {
                    let (expected, rest) = crcs.split_at(e.len as usize);
                    crcs = rest;
                    let mut buf = vec![0u8; (u64::from(e.len) * bs) as usize];
                    let read = self.read_cached(s.block, e, expected, &mut buf);
                    inner.unpin(inner.bucket_of(e.cache_block));
                    let written = match read {
                        Ok(true) => self.backing_write(&buf, s.block.offset(bs)).is_ok(),
                        _ => false,
                    };
                    if written {
                        again += u64::from(e.len);
                    } else {
                        lost += u64::from(e.len);
                    }
                }
            }
        }
        (again, lost)
    }
}
