//! Telling every client of a loss: an export counts the losses of acknowledged writes that
//! happened below it ([`Export::losses`]: a remote backing device that restarted with writes
//! it had not made durable, and that the cache could not write again), and each connection
//! (or ublk device) fails its next flush, or FUA write, once for each time that count grew
//! since it started or was last told. A client whose flush succeeds can then rely on it:
//! every write it had acknowledged before is durable, whichever client's flush met the loss
//! first (a flush covers every connection's writes under `NBD_FLAG_CAN_MULTI_CONN`, so every
//! connection open at the loss is told, whether it wrote or not).
//!
//! Invariants: the count is read after the flush (or FUA write) returned, so a loss that
//! happened before the flush completed is never missed; a connection is told of one loss
//! once (concurrent flushes on one connection: one of them fails); a connection opened after
//! a loss is not told of it.
//!
//! Fault model: none of its own.

use crate::Export;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What one connection has been told of its export's losses (see the module).
pub struct LossWatch {
    export: Arc<dyn Export>,
    seen: AtomicU64,
}

impl LossWatch {
    /// A connection (or block device) starting to use `export` now.
    pub fn new(export: Arc<dyn Export>) -> LossWatch {
        let seen = AtomicU64::new(export.losses());
        LossWatch { export, seen }
    }

    /// The result to answer a flush or FUA write that ended with `result`: an error if the
    /// export lost acknowledged writes since this connection was last told.
    pub fn check(&self, result: io::Result<()>) -> io::Result<()> {
        let now = self.export.losses();
        let before = self.seen.fetch_max(now, Ordering::SeqCst);
        if now <= before {
            return result;
        }
        result.and(Err(io::Error::other(
            "writes acknowledged earlier may be lost: the backing device failed a flush \
             (a remote server that restarted loses what it had not made durable) and the \
             cache held no copy to write again",
        )))
    }

    /// `check` for a request that promised durability (`durable`: a FUA write or trim),
    /// else `result` as it is.
    pub fn check_if(&self, durable: bool, result: io::Result<()>) -> io::Result<()> {
        if durable {
            self.check(result)
        } else {
            result
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An export that only counts losses.
    #[derive(Default)]
    struct Counting(AtomicU64);

    impl Counting {
        fn lose(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Export for Counting {
        fn name(&self) -> String {
            "counting".into()
        }
        fn description(&self) -> String {
            String::new()
        }
        fn size_bytes(&self) -> u64 {
            0
        }
        fn is_rotational(&self) -> bool {
            false
        }
        fn read_only(&self) -> bool {
            false
        }
        fn losses(&self) -> u64 {
            self.0.load(Ordering::SeqCst)
        }
        fn read(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Ok(())
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn trim(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> io::Result<()> {
            Ok(())
        }
        fn cache(&self, _: u64, _: u64) -> io::Result<()> {
            Ok(())
        }
        fn block_status(&self, _: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
            Ok(vec![(len, 0)])
        }
    }

    #[test]
    fn each_connection_is_told_once_and_a_new_one_not_at_all() {
        let export = Arc::new(Counting::default());
        let (a, b) = (
            LossWatch::new(export.clone()),
            LossWatch::new(export.clone()),
        );
        assert!(a.check(Ok(())).is_ok());
        export.lose();
        let c = LossWatch::new(export.clone());
        assert!(a.check(Ok(())).is_err(), "a is told");
        assert!(a.check(Ok(())).is_ok(), "once");
        assert!(b.check(Ok(())).is_err(), "b is told too");
        assert!(c.check(Ok(())).is_ok(), "c opened after the loss");
        export.lose();
        export.lose();
        assert!(c.check(Ok(())).is_err());
        assert!(c.check(Ok(())).is_ok(), "two losses, told once");
        let failed = a.check(Err(io::Error::other("flush failed")));
        assert_eq!(failed.unwrap_err().to_string(), "flush failed");
        assert!(a.check(Ok(())).is_ok(), "a failed flush told it");
    }
}
