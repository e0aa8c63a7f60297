//! The writeback pool: the dirty runs a writeback pass takes next, in backing order (see
//! [`WritebackPool`]). Data only, below `state` (which holds one) and `writeback` (which
//! takes from it).
//!
//! Invariants: a run is handed out only if the index still says it is dirty where the pool
//! found it; a refill visits at most `WRITEBACK_POOL_BLOCKS` dirty blocks.

use crate::index::{Extent, Index};
use crate::types::DevId;
use crate::units::{BackingBlock, Bucket};

/// Dirty blocks collected for writeback, sorted by backing position: a pass takes the next
/// ones in that order (an elevator sweep over what the pool holds), and an exhausted pool is
/// refilled from the buckets holding dirty data, in cache order from where the last refill
/// stopped, and swept from where the previous sweep ended (one direction, wrapping once, as
/// C-SCAN does), so a refill does not send the head back to the start of the disk. So a pass
/// costs what it writes back plus, once per `WRITEBACK_POOL_BLOCKS` blocks, a refill that
/// visits only dirty buckets: never a scan of the whole cache.
#[derive(Default)]
pub(crate) struct WritebackPool {
    pool: Vec<(DevId, BackingBlock, Extent)>,
    pos: usize,
    cursor: Bucket,
    /// Where the last block taken ended (the sweep goes on from there).
    head: Option<(DevId, BackingBlock)>,
}

/// Most dirty blocks one refill of the writeback pool collects (bounded work under the state
/// lock, bounded memory: 16K runs at most).
const WRITEBACK_POOL_BLOCKS: u64 = 16 * 1024;

impl WritebackPool {
    /// The next runs of at most `budget` blocks in all, of device `only` if given and of
    /// devices `wanted` accepts, that are still dirty where the pool found them.
    pub fn next_batch(
        &mut self,
        index: &Index,
        budget: u64,
        only: Option<DevId>,
        wanted: impl Fn(DevId) -> bool,
    ) -> Vec<(DevId, BackingBlock, Extent)> {
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
                self.head = Some((d, s + u64::from(e.len)));
                taken += u64::from(e.len);
            }
            if taken >= budget || refilled {
                return out;
            }
            self.pool = index.dirty_runs(&mut self.cursor, WRITEBACK_POOL_BLOCKS, only);
            self.pool.sort_unstable_by_key(|(d, s, _)| (*d, *s));
            if let Some(head) = self.head {
                let ahead = self.pool.partition_point(|(d, s, _)| (*d, *s) < head);
                self.pool.rotate_left(ahead);
            }
            self.pos = 0;
            refilled = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Extent, Index};
    use crate::units::CacheBlock;

    #[test]
    fn a_refilled_pool_sweeps_on_from_where_the_last_sweep_ended() {
        // 16 buckets of 4 blocks; dirty blocks scattered over the backing device, in a cache
        // order unlike their backing order.
        let mut ix = Index::new(16, 4);
        let d = DevId::new(0);
        let at = [900u64, 100, 500, 300, 700, 200, 800, 400];
        for (i, &b) in at.iter().enumerate() {
            let ext = Extent {
                len: 1,
                cache_block: CacheBlock::new(i as u32 * 4),
                dirty: true,
            };
            ix.insert(d, BackingBlock::new(b), ext, &[0]);
        }
        let mut pool = WritebackPool::default();
        let blocks = |v: Vec<(DevId, BackingBlock, Extent)>| -> Vec<u64> {
            v.iter().map(|x| x.1.get()).collect()
        };
        // The first pool sweeps up from the lowest block.
        assert_eq!(
            blocks(pool.next_batch(&ix, 3, None, |_| true)),
            [100, 200, 300]
        );
        // The pool used up with the sweep ended at 501: the refill (the same blocks, still
        // dirty) sweeps on from there and wraps to the start once.
        pool.pos = pool.pool.len();
        pool.head = Some((d, BackingBlock::new(501)));
        assert_eq!(
            blocks(pool.next_batch(&ix, 8, None, |_| true)),
            [700, 800, 900, 100, 200, 300, 400, 500]
        );
    }
}
