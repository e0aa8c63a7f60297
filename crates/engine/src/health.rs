//! Copies a backing device's cache set holds that no longer match it: dropping them at
//! attach (the backing header's `stale` field says which).
//!
//! Invariants:
//! - a backing device is written while its set is not in use (degraded, or served without
//!   its cache device) only after its header says which copies are stale, and the header
//!   says `StaleCopies::None` again only after a checkpoint without those copies is durable;
//!   so whatever crashes when, the next attach drops them before the device is served;
//! - the copies are dropped from memory without journal entries (one checkpoint instead of
//!   an entry per run; the header keeps the reason on record until it is durable).

use crate::format::StaleCopies;
use crate::set::Inner;
use crate::types::{DevId, Result};

impl Inner {
    /// Drops the copies of `dev` that `stale` names and makes the drop durable with a
    /// checkpoint; returns the blocks dropped. Nothing is written when there were none.
    pub(crate) fn forget_stale_copies(&self, dev: DevId, stale: StaleCopies) -> Result<u64> {
        let all = match stale {
            StaleCopies::None => return Ok(0),
            StaleCopies::Clean => false,
            StaleCopies::All => true,
        };
        let n = self.state.lock().index.forget_copies(dev, all);
        if n > 0 {
            log::warn!(
                "dropped {n} {} cached blocks of backing device {} (it was written while the cache set was not in use)",
                if all { "clean and dirty" } else { "clean" },
                dev.0
            );
            self.checkpoint_now(&mut || {})?;
        }
        Ok(n)
    }
}
