//! A counting budget for requests and bytes in flight on one connection.
//!
//! Owns: the back-pressure between reading requests and writing their replies: the worker
//! that reads a request takes a permit before reading its payload and drops it once the reply
//! is written.
//!
//! Invariants: at most `count_max` permits exist at once and their bytes sum to at most
//! `bytes_max`, except that one permit may exceed `bytes_max` alone when nothing else is in
//! flight (so an oversized-but-legal request cannot deadlock).
//!
//! Fault model: none; a permit is released when dropped, whatever path drops it.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

#[derive(Debug)]
pub(crate) struct Budget {
    used: Mutex<Used>,
    released: Condvar,
    count_max: usize,
    bytes_max: usize,
}

#[derive(Debug, Default)]
struct Used {
    count: usize,
    bytes: usize,
}

/// One request's share of the budget; returns it on drop.
#[derive(Debug)]
pub(crate) struct Permit {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Budget {
    pub(crate) fn new(count_max: usize, bytes_max: usize) -> Arc<Budget> {
        assert!(
            count_max > 0 && bytes_max > 0,
            "budget limits must be positive"
        );
        Arc::new(Budget {
            used: Mutex::new(Used::default()),
            released: Condvar::new(),
            count_max,
            bytes_max,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Used> {
        self.used
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Blocks until the request fits.
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize) -> Permit {
        let mut used = self.lock();
        while used.count >= self.count_max
            || (used.count > 0 && used.bytes + bytes > self.bytes_max)
        {
            used = self
                .released
                .wait(used)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        used.count += 1;
        used.bytes += bytes;
        Permit {
            budget: Arc::clone(self),
            bytes,
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut used = self.budget.lock();
        used.count -= 1;
        used.bytes -= self.bytes;
        drop(used);
        self.budget.released.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn blocks_until_released() {
        let budget = Budget::new(2, 100);
        let a = budget.acquire(60);
        let b = budget.acquire(30);
        let (tx, rx) = std::sync::mpsc::channel();
        let b2 = Arc::clone(&budget);
        let waiter = std::thread::spawn(move || {
            let p = b2.acquire(50);
            tx.send(()).unwrap();
            drop(p);
        });
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        drop(b);
        assert!(
            rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "bytes still over"
        );
        drop(a);
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        waiter.join().unwrap();
        // Alone, an oversized permit is granted.
        drop(budget.acquire(1000));
    }
}
