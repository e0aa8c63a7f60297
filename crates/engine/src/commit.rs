//! Commits and checkpoints: making journal entries durable (group commit, one record and one
//! cache flush per commit) and writing checkpoints (fuzzily, a chunk at a time).
//!
//! Invariants:
//! - commits are serialized by `commit_lock`; a commit first flushes the backing devices its
//!   entries owe a flush, then writes one record (both copies side by side, one write) and
//!   flushes the cache device once, which makes the record and the data it points to durable
//!   together (recovery checks the last record's data), then advances `durable_epoch`;
//! - group commit: a flush whose entries are durable returns at once; otherwise one flusher
//!   at a time (the leader) commits for all while the others wait, so a flush waits for at
//!   most the record being written when it arrived and one more;
//! - checkpoints are serialized by `ckpt_lock`, taken before `commit_lock`; a committer that
//!   holds `commit_lock` only try-locks it or waits for it with `commit_lock` released;
//! - a checkpoint's chunks are written with the state lock taken once per chunk and no commit
//!   lock; everything appended meanwhile is committed before the superblock points at it (see
//!   the convergence argument in `checkpoint`);
//! - a full journal ring is freed by a checkpoint: a running one finishes, else a whole one is
//!   written with requests held (logged: writes are outpacing checkpoints).

use crate::checkpoint;
use crate::format::Layout;
use crate::journal::{encode_record, Ring};
use crate::state::{Backing, Inner, State};
use crate::types::{DevId, Error, IoContext, Result};
use blockdev::BlockDevice;
use parking_lot::MutexGuard;
use std::sync::Arc;

impl State {
    /// Whether the journal since the last checkpoint calls for a new one: when it fills half
    /// the ring, or when replaying it would read more than the checkpoint itself (at least
    /// `CHECKPOINT_JOURNAL_MIN`). So a restart replays at most about as much journal as it
    /// loads checkpoint, and checkpoints cost at most about one byte per journal byte.
    pub fn checkpoint_due(&self) -> bool {
        let r = &self.journal.ring;
        let body = self.index.live_blocks * crate::format::CKPT_BLOCK_BYTES;
        r.used * 2 > r.len || r.used > body.max(CHECKPOINT_JOURNAL_MIN)
    }
}

impl Inner {
    /// A metadata write failed: the journal can no longer be trusted to record changes, so
    /// the set degrades (see `health`); what is durable on the cache device stays valid.
    fn metadata_failed(&self, e: &Error) {
        self.degrade(format!("writing metadata to the cache device failed: {e}"));
    }

    /// Makes every journal entry appended up to `target` durable (group commit); `u64::MAX`:
    /// everything appended so far, always through a commit of its own (which also releases
    /// buckets whose generation bump became durable).
    ///
    /// One caller at a time writes the record (the leader, through `commit_locked`); the
    /// others wait on `group` without holding or spinning on any lock. When the leader is done
    /// every waiter wakes, those its record covered return at once, and one of the rest leads
    /// the next commit, which takes every entry appended by then. So a flusher that arrives
    /// while a record is being written waits for that one and then at most one more, and one
    /// that finds its entries durable already returns without waiting for anything.
    pub fn commit_to(&self, target: u64) -> Result<()> {
        if target == u64::MAX {
            let mut c = self.commit_lock.lock();
            return self.commit_locked(&mut c);
        }
        let durable = || self.state.lock().journal.durable_epoch >= target;
        if durable() {
            return Ok(());
        }
        let (lock, cv) = &self.group;
        let mut leading = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if durable() {
                return Ok(());
            }
            if !*leading {
                break;
            }
            leading = cv.wait(leading).unwrap_or_else(|e| e.into_inner());
        }
        *leading = true;
        drop(leading);
        // Clears the flag and wakes the waiters however the commit ends (a panic included).
        struct Lead<'a>(&'a (std::sync::Mutex<bool>, std::sync::Condvar));
        impl Drop for Lead<'_> {
            fn drop(&mut self) {
                *self.0 .0.lock().unwrap_or_else(|e| e.into_inner()) = false;
                self.0 .1.notify_all();
            }
        }
        let _lead = Lead(&self.group);
        let mut c = self.commit_lock.lock();
        if durable() {
            return Ok(());
        }
        self.commit_locked(&mut c)
    }

    /// Commits all pending entries (at least those appended before the call). Caller holds
    /// `commit_lock` (passed in: a full journal ring waits for a running checkpoint with the
    /// lock released). A backing device that fails the flush owed before the record fails
    /// this commit only (nothing is written; the next commit tries again), not the set.
    pub fn commit_locked(&self, commit: &mut MutexGuard<'_, ()>) -> Result<()> {
        self.check_failed()?;
        if self.is_degraded() {
            return Err(Error::State(
                "the cache set is degraded: nothing is committed to the cache device".into(),
            ));
        }
        loop {
            match self.write_record() {
                Ok(Record::Written) => break,
                Ok(Record::BackingFailed(e)) => return Err(e),
                Ok(Record::RingFull) => {
                    // The ring is full: a checkpoint frees it. One that is running finishes
                    // (it needs no commit lock until its end); else write one now, whole.
                    match self.ckpt_lock.try_lock() {
                        Some(_k) => {
                            static LOG: crate::guard::Throttled = crate::guard::Throttled::new();
                            LOG.log(
                                log::Level::Warn,
                                format_args!(
                                    "journal full: writing a whole checkpoint with requests held (writes are outpacing checkpoints)"
                                ),
                            );
                            self.checkpoint_whole()
                                .map_err(|f| self.checkpoint_failed(f))?;
                        }
                        None => MutexGuard::unlocked(commit, || drop(self.ckpt_lock.lock())),
                    }
                    self.check_failed()?;
                }
                Err(e) => {
                    self.metadata_failed(&e);
                    return Err(e);
                }
            }
        }
        if self.state.lock().checkpoint_due() {
            if self.config.background {
                self.wake_background();
            } else if let Some(_k) = self.ckpt_lock.try_lock() {
                self.checkpoint_fuzzy(commit, &mut || {})?;
            }
        }
        Ok(())
    }

    /// Flushes the given backing devices (those still attached).
    fn flush_backings(&self, devs: &[DevId]) -> Result<()> {
        if devs.is_empty() {
            return Ok(());
        }
        let backings: Vec<Arc<Backing>> = {
            let all = self.backings.read();
            devs.iter().filter_map(|d| all.get(d).cloned()).collect()
        };
        backings.iter().try_for_each(|b| b.flush_now())
    }

    /// Writes every pending entry as one record (caller holds `commit_lock`): first flushes
    /// the backing devices the entries owe a flush, then writes the record (both copies, one
    /// write) and flushes the cache device once, which makes the data the record points to
    /// and the record durable together (recovery checks the last record's data; see
    /// `journal::replay`). A failed backing flush or a full ring writes nothing.
    fn write_record(&self) -> Result<Record> {
        let (len, epoch, owed) = {
            let st = self.state.lock();
            let j = &st.journal;
            let owed: Vec<DevId> = j.flush_backing_first.keys().copied().collect();
            (j.buf.buf.len(), j.appended_epoch, owed)
        };
        if let Err(e) = self.flush_backings(&owed) {
            return Ok(Record::BackingFailed(e));
        }
        let (payload, pos, seq) = {
            let mut st = self.state.lock();
            let st = &mut *st;
            let j = &mut st.journal;
            if len == 0 {
                j.durable_to(epoch);
                st.buckets.release(j.durable_epoch);
                return Ok(Record::Written);
            }
            // Only what was appended before the backing flush above goes in this record.
            let rec_len = crate::journal::record_space(len);
            let Some((pos, cost)) = j.ring.reserve(rec_len) else {
                return Ok(Record::RingFull);
            };
            let payload: Vec<u8> = j.buf.buf.drain(..len).collect();
            if j.buf.buf.is_empty() {
                j.oldest_pending_ns = None;
            }
            j.flush_backing_first.retain(|_, e| *e > epoch);
            let seq = j.ring.next_seq;
            j.ring.advance(pos, rec_len, cost);
            (payload, pos, seq)
        };
        // Both copies, side by side, in one write (see `journal.rs` for why that is enough).
        let rec = encode_record(seq, &self.sb.lock().set_uuid, &payload);
        debug_assert_eq!(
            rec.len() as u64,
            crate::journal::record_space(payload.len())
        );
        self.cache
            .write_at(&rec, self.layout.journal_off + pos)
            .ctx(|| format!("writing journal record {seq}"))?;
        self.cache
            .flush()
            .ctx(|| "flushing journal record".into())?;
        let mut st = self.state.lock();
        st.journal.durable_to(epoch);
        st.buckets.release(epoch);
        Ok(Record::Written)
    }

    /// After a recovery that replayed journal records: writes an empty record, so the last
    /// record replayed is no longer the journal's last. Replay checks the data of the last
    /// record only (a commit a crash cut: durable while data it names is not), and that check
    /// holds only for the crash that cut it: once the set runs again, it may write into blocks
    /// that record named (freed since, or invalidated by a later entry of the same record),
    /// and a second crash before any new commit would find their data changed and drop a
    /// record that was whole — with every entry in it, such as the insert of a block's newer
    /// copy (the model test's seed 12791780051680594996: a stale clean copy served after the
    /// second crash). A ring too full for it gets a whole checkpoint instead.
    pub(crate) fn seal_journal(&self) -> Result<()> {
        let mut c = self.commit_lock.lock();
        let reserved = {
            let mut st = self.state.lock();
            let j = &mut st.journal;
            if !j.buf.buf.is_empty() {
                drop(st);
                return self.commit_locked(&mut c);
            }
            let rec_len = crate::journal::record_space(0);
            j.ring.reserve(rec_len).map(|(pos, cost)| {
                let seq = j.ring.next_seq;
                j.ring.advance(pos, rec_len, cost);
                (pos, seq)
            })
        };
        let Some((pos, seq)) = reserved else {
            // Lock order: `ckpt_lock` before `commit_lock`.
            drop(c);
            let _k = self.ckpt_lock.lock();
            let _c = self.commit_lock.lock();
            return self
                .checkpoint_whole()
                .map_err(|f| self.checkpoint_failed(f));
        };
        let rec = encode_record(seq, &self.sb.lock().set_uuid, &[]);
        self.cache
            .write_at(&rec, self.layout.journal_off + pos)
            .ctx(|| format!("writing journal record {seq}"))?;
        self.cache.flush().ctx(|| "flushing journal record".into())
    }

    /// Writes a checkpoint if one is due (see `State::checkpoint_due`; the background
    /// thread's duty; without background threads the committer does it).
    pub fn checkpoint_if_due(&self) -> Result<()> {
        let due = |inner: &Inner| inner.state.lock().checkpoint_due();
        if !due(self) {
            return Ok(());
        }
        let _k = self.ckpt_lock.lock();
        let mut c = self.commit_lock.lock();
        if !due(self) || self.is_degraded() {
            return Ok(());
        }
        self.check_failed()?;
        self.checkpoint_fuzzy(&mut c, &mut || {})
    }

    /// Writes a checkpoint now (callers outside the commit path).
    /// `between` runs after each chunk is written, with no engine lock held (tests use it to
    /// interleave requests with a checkpoint deterministically).
    pub fn checkpoint_now(&self, between: &mut dyn FnMut()) -> Result<()> {
        let _k = self.ckpt_lock.lock();
        let mut c = self.commit_lock.lock();
        self.check_failed()?;
        self.checkpoint_fuzzy(&mut c, between)
    }

    /// Writes a checkpoint that covers every entry appended so far, pending ones included
    /// (they are not written to the journal: the checkpoint supersedes them). For changes
    /// made to the index without entries (`health`): a pending entry from before such a change
    /// must not be replayed after it.
    pub fn checkpoint_covering_all(&self) -> Result<()> {
        let _k = self.ckpt_lock.lock();
        let _c = self.commit_lock.lock();
        self.check_failed()?;
        self.checkpoint_whole()
            .map_err(|f| self.checkpoint_failed(f))
    }

    /// Writes a fuzzy checkpoint (see `checkpoint.rs`). The caller holds `ckpt_lock` and
    /// `commit_lock`; the commit lock is released while the chunks are encoded and written, so
    /// client flushes go on, and the state lock is taken once per chunk.
    fn checkpoint_fuzzy(
        &self,
        commit: &mut MutexGuard<'_, ()>,
        between: &mut dyn FnMut(),
    ) -> Result<()> {
        self.checkpoint_fuzzy_inner(commit, between)
            .map_err(|f| self.checkpoint_failed(f))
    }

    /// A checkpoint that failed on the cache device degrades the set; one whose backing
    /// flush failed is just abandoned (its slot is not the current one).
    fn checkpoint_failed(&self, f: CkptFailed) -> Error {
        match f {
            CkptFailed::Cache(e) => {
                self.metadata_failed(&e);
                e
            }
            CkptFailed::Backing(e) => e,
        }
    }

    fn checkpoint_fuzzy_inner(
        &self,
        commit: &mut MutexGuard<'_, ()>,
        between: &mut dyn FnMut(),
    ) -> Result<(), CkptFailed> {
        // No record is being written (we hold the commit lock): the journal from the head on
        // holds every entry not yet reflected in the state.
        let (jpos, jseq, used_before, slot, seq) = {
            let st = self.state.lock();
            let j = &st.journal;
            (
                j.ring.head,
                j.ring.next_seq,
                j.ring.used,
                1 - j.ckpt_slot,
                j.ckpt_seq + 1,
            )
        };
        let (chunks, body_bytes) =
            MutexGuard::unlocked(commit, || self.write_chunks(slot, seq, between))?;
        // Every entry reflected in a chunk becomes durable before the checkpoint counts.
        match self.write_record()? {
            Record::Written => {}
            // The ring filled while the chunks were written: write the whole thing at once.
            Record::RingFull => return self.checkpoint_whole(),
            Record::BackingFailed(e) => return Err(CkptFailed::Backing(e)),
        }
        Ok(
            self.install(slot, seq, jpos, jseq, chunks, body_bytes, |ring| {
                ring.used -= used_before;
            })?,
        )
    }

    /// Writes a checkpoint with the state lock held throughout, so it covers every entry and
    /// the pending ones are dropped (the fallback when the journal ring is full). The caller
    /// holds `ckpt_lock` and `commit_lock`.
    fn checkpoint_whole(&self) -> Result<(), CkptFailed> {
        let mut st = self.state.lock();
        let owed: Vec<DevId> = st.journal.flush_backing_first.keys().copied().collect();
        self.flush_backings(&owed).map_err(CkptFailed::Backing)?;
        let (slot, seq) = (1 - st.journal.ckpt_slot, st.journal.ckpt_seq + 1);
        let (jpos, jseq) = (st.journal.ring.head, st.journal.ring.next_seq);
        let mut body = Body::default();
        let mut enc = checkpoint::ChunkEncoder::default();
        loop {
            let more = enc.add_next(&st.index, &st.buckets.gen, &mut body.cursor);
            if enc.full() || (!more && !enc.is_empty()) {
                self.write_chunk(&mut enc, slot, seq, &mut body)?;
            }
            if !more {
                break;
            }
        }
        let (chunks, body_bytes) = (body.chunks, body.bytes);
        let epoch = st.journal.appended_epoch;
        st.journal.buf.buf.clear();
        st.journal.oldest_pending_ns = None;
        st.journal.flush_backing_first.clear();
        drop(st);
        self.install(slot, seq, jpos, jseq, chunks, body_bytes, |ring| {
            ring.checkpointed()
        })?;
        let mut st = self.state.lock();
        st.journal.durable_to(epoch);
        st.buckets.release(epoch);
        Ok(())
    }

    /// Encodes and writes the body chunks of checkpoint `seq` into `slot`, taking the state
    /// lock per chunk. Returns the number of chunks and body bytes.
    fn write_chunks(&self, slot: u32, seq: u64, between: &mut dyn FnMut()) -> Result<(u64, u64)> {
        let mut body = Body::default();
        let mut enc = checkpoint::ChunkEncoder::default();
        loop {
            let mut more = true;
            {
                let st = self.state.lock();
                for _ in 0..self.config.checkpoint_buckets_per_lock.max(1) {
                    more = enc.add_next(&st.index, &st.buckets.gen, &mut body.cursor);
                    if !more || enc.full() {
                        break;
                    }
                }
            }
            if enc.full() || (!more && !enc.is_empty()) {
                self.write_chunk(&mut enc, slot, seq, &mut body)?;
            }
            if !more {
                return Ok((body.chunks, body.bytes));
            }
            between();
        }
    }

    /// Writes the encoder's chunk after the ones already written.
    fn write_chunk(
        &self,
        enc: &mut checkpoint::ChunkEncoder,
        slot: u32,
        seq: u64,
        body: &mut Body,
    ) -> Result<()> {
        let chunk = enc.finish(seq);
        let at = self.layout.ckpt_offsets[slot as usize]
            + Layout::ckpt_header_len(self.layout.nbuckets)
            + body.bytes;
        assert!(
            at + chunk.len() as u64
                <= self.layout.ckpt_offsets[slot as usize] + self.layout.ckpt_len,
            "checkpoint exceeds its slot"
        );
        self.cache
            .write_at(&chunk, at)
            .ctx(|| format!("writing checkpoint {seq}"))?;
        body.chunks += 1;
        body.bytes += chunk.len() as u64;
        Ok(())
    }

    /// Writes the header of checkpoint `seq` (generations and devices as of now), flushes,
    /// and switches the superblock to it; `ring` then adjusts the journal's used space.
    #[allow(clippy::too_many_arguments)]
    fn install(
        &self,
        slot: u32,
        seq: u64,
        jpos: u64,
        jseq: u64,
        chunks: u64,
        body_bytes: u64,
        ring: impl FnOnce(&mut Ring),
    ) -> Result<()> {
        let header = {
            let st = self.state.lock();
            checkpoint::encode_header(
                seq,
                &checkpoint::Header {
                    journal_pos: jpos,
                    journal_seq: jseq,
                    devs: &st.devs,
                    gens: &st.buckets.gen,
                    chunks,
                    body_bytes,
                },
            )
        };
        self.cache
            .write_at(&header, self.layout.ckpt_offsets[slot as usize])
            .ctx(|| format!("writing checkpoint {seq}"))?;
        self.cache.flush().ctx(|| "flushing checkpoint".into())?;
        {
            let mut sb = self.sb.lock();
            let mut next = sb.clone();
            next.seq += 1;
            next.ckpt_slot = slot;
            next.ckpt_seq = seq;
            next.write(&*self.cache)?;
            *sb = next;
        }
        let mut st = self.state.lock();
        st.journal.ckpt_slot = slot;
        st.journal.ckpt_seq = seq;
        ring(&mut st.journal.ring);
        Ok(())
    }
}

/// Journal bytes since the last checkpoint below which none is written for replay's sake.
const CHECKPOINT_JOURNAL_MIN: u64 = 16 << 20;

/// Where a checkpoint's body chunks stand while they are written.
#[derive(Default)]
struct Body {
    cursor: crate::units::Bucket,
    chunks: u64,
    bytes: u64,
}

/// Why a checkpoint failed: the cache device (the set degrades), or a backing device's
/// flush owed before it (only this checkpoint fails).
enum CkptFailed {
    Cache(Error),
    Backing(Error),
}

impl From<Error> for CkptFailed {
    fn from(e: Error) -> Self {
        CkptFailed::Cache(e)
    }
}

/// What `write_record` did.
enum Record {
    Written,
    /// The journal ring has no room; a checkpoint frees it.
    RingFull,
    /// A backing device failed the flush its dropped dirty data owes: this commit fails, not
    /// the set (nothing was written; the next commit tries again).
    BackingFailed(Error),
}
