//! Server-wide budgets shared by all connections: bytes held by requests in flight, and worker
//! threads beyond each connection's first.
//!
//! Owns: the back-pressure between reading requests and writing their replies. The worker that
//! reads a request takes a [`Permit`] for its buffers (write payload plus read reply) from its
//! connection's [`Account`] before reading the payload, and drops it once the reply is written
//! or dropped. Also the count of extra worker threads ([`ThreadBudget`]).
//!
//! Bytes: the total `bytes_max` is split into a guaranteed share of
//! `connection_reserved_bytes` for each of `connections_max` connections and a shared pool,
//! the rest. A connection holding `h` bytes in `n` permits may take a permit of `b` bytes when:
//! 1. `n < connection_count_max`, and one of:
//! 2. `h + b` fits in its guaranteed share — so a connection with small requests is never
//!    starved, whatever the others hold; or
//! 3. fair share: `h + b <= connection_bytes_max`, the `need` pool bytes it takes beyond its
//!    share are free, and its pool holding afterwards is at most what stays free for the others
//!    (so `k` greedy connections get at most `1 - 2^-k` of the pool between them, and each
//!    newcomer can still take half of what is left); or
//! 4. alone: it holds nothing and the pool is empty — for requests rule 3 can never admit
//!    (larger than the per-connection cap, or than half the pool), so no legal request
//!    deadlocks.
//!
//! Invariants: bytes held by all connections ≤ `bytes_max`, except while a rule-4 permit
//! larger than the pool exists (only possible when the limits are configured below twice the
//! largest request); at most `connections_max` accounts have a guaranteed share (later ones get
//! none, so the split stays within `bytes_max` even if more accounts exist); permits per
//! account ≤ `connection_count_max`; extra worker threads ≤ the thread budget's maximum.
//!
//! Fault model: none; a permit or a thread slot is returned when dropped, whatever path drops
//! it; a waiter wakes on every release and rechecks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The guaranteed shares take at most `bytes_max / RESERVED_SHARE_DIVISOR` in total; the rest
/// is the shared pool.
const RESERVED_SHARE_DIVISOR: usize = 2;

/// The limits of a [`Budget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BudgetLimits {
    /// Bytes held by all connections together.
    pub(crate) bytes_max: usize,
    /// Bytes held by one connection (rule 4 aside).
    pub(crate) connection_bytes_max: usize,
    /// Bytes each connection may always hold (rule 2).
    pub(crate) connection_reserved_bytes: usize,
    /// Connections with a guaranteed share.
    pub(crate) connections_max: usize,
    /// Permits held by one connection.
    pub(crate) connection_count_max: usize,
}

impl BudgetLimits {
    /// Limits whose guaranteed shares split `bytes_max / RESERVED_SHARE_DIVISOR` evenly among
    /// `connections_max` connections (each at most `connection_bytes_max`).
    pub(crate) fn new(
        bytes_max: usize,
        connection_bytes_max: usize,
        connections_max: usize,
        connection_count_max: usize,
    ) -> BudgetLimits {
        let reserved = bytes_max / RESERVED_SHARE_DIVISOR / connections_max.max(1);
        BudgetLimits {
            bytes_max,
            connection_bytes_max,
            connection_reserved_bytes: reserved.min(connection_bytes_max),
            connections_max,
            connection_count_max,
        }
    }

    fn pool_bytes_max(&self) -> usize {
        self.bytes_max
            .saturating_sub(self.connections_max * self.connection_reserved_bytes)
    }
}

/// Permits and bytes one account holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Used {
    count: usize,
    bytes: usize,
}

/// The part of `bytes` beyond a guaranteed share of `reserved`.
fn pool_part(bytes: usize, reserved: usize) -> usize {
    bytes.saturating_sub(reserved)
}

/// Rules 1–4 of the module header: whether an account holding `used`, with a guaranteed share
/// of `reserved`, may take `bytes` more while all accounts hold `pool_used` of the pool.
fn admits(
    limits: &BudgetLimits,
    pool_used: usize,
    used: Used,
    reserved: usize,
    bytes: usize,
) -> bool {
    if used.count >= limits.connection_count_max {
        return false;
    }
    let after = used.bytes.saturating_add(bytes);
    let need = pool_part(after, reserved) - pool_part(used.bytes, reserved);
    if need == 0 {
        return true;
    }
    let pool_free = limits.pool_bytes_max().saturating_sub(pool_used);
    let fair = after <= limits.connection_bytes_max
        && need <= pool_free
        && pool_part(after, reserved) <= pool_free - need;
    fair || (used.bytes == 0 && pool_used == 0)
}

#[derive(Debug, Default)]
struct AccountState {
    used: Used,
    reserved: usize,
}

#[derive(Debug, Default)]
struct State {
    accounts: HashMap<u64, AccountState>,
    next_id: u64,
    /// Accounts that have a guaranteed share.
    reserved_accounts: usize,
    /// Bytes held beyond the guaranteed shares.
    pool_used: usize,
    held_bytes: usize,
    held_bytes_peak: usize,
    /// Threads waiting in `acquire`: a release wakes them only if there are any (a wake is
    /// a syscall, and releases happen once per request).
    waiters: usize,
}

/// The bytes budget of one server.
#[derive(Debug)]
pub(crate) struct Budget {
    state: Mutex<State>,
    released: Condvar,
    limits: BudgetLimits,
}

/// One connection's side of the [`Budget`]; drop it after its permits.
#[derive(Debug)]
pub(crate) struct Account {
    budget: Arc<Budget>,
    id: u64,
}

/// One request's bytes; returns them on drop.
#[derive(Debug)]
pub(crate) struct Permit {
    account: Arc<Account>,
    bytes: usize,
}

impl Permit {
    /// The bytes this permit holds.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Budget {
    pub(crate) fn new(limits: BudgetLimits) -> Arc<Budget> {
        assert!(
            limits.bytes_max > 0
                && limits.connection_bytes_max > 0
                && limits.connection_count_max > 0,
            "budget limits must be positive"
        );
        Arc::new(Budget {
            state: Mutex::new(State::default()),
            released: Condvar::new(),
            limits,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens an account for a new connection.
    pub(crate) fn account(self: &Arc<Self>) -> Arc<Account> {
        let mut state = self.lock();
        let id = state.next_id;
        state.next_id += 1;
        let reserved = if state.reserved_accounts < self.limits.connections_max {
            state.reserved_accounts += 1;
            self.limits.connection_reserved_bytes
        } else {
            0
        };
        state.accounts.insert(
            id,
            AccountState {
                used: Used::default(),
                reserved,
            },
        );
        Arc::new(Account {
            budget: Arc::clone(self),
            id,
        })
    }

    /// Bytes held by all permits now.
    pub(crate) fn bytes_held(&self) -> usize {
        self.lock().held_bytes
    }

    /// The most bytes ever held at once.
    pub(crate) fn bytes_held_peak(&self) -> usize {
        self.lock().held_bytes_peak
    }
}

impl Account {
    /// Takes a permit if the rules allow it now.
    fn take(self: &Arc<Self>, state: &mut State, bytes: usize) -> Option<Permit> {
        let limits = &self.budget.limits;
        let pool_used = state.pool_used;
        let account = state.accounts.get_mut(&self.id)?;
        if !admits(limits, pool_used, account.used, account.reserved, bytes) {
            return None;
        }
        let pool_before = pool_part(account.used.bytes, account.reserved);
        account.used.count += 1;
        account.used.bytes += bytes;
        let pool_after = pool_part(account.used.bytes, account.reserved);
        state.pool_used += pool_after - pool_before;
        state.held_bytes += bytes;
        state.held_bytes_peak = state.held_bytes_peak.max(state.held_bytes);
        Some(Permit {
            account: Arc::clone(self),
            bytes,
        })
    }

    /// Blocks until the rules allow a permit of `bytes`.
    pub(crate) fn acquire(self: &Arc<Self>, bytes: usize) -> Permit {
        let budget = &self.budget;
        let mut state = budget.lock();
        loop {
            if let Some(permit) = self.take(&mut state, bytes) {
                return permit;
            }
            state.waiters += 1;
            state = budget
                .released
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
            state.waiters -= 1;
        }
    }

    /// Takes a permit of `bytes` if the rules allow it now.
    pub(crate) fn try_acquire(self: &Arc<Self>, bytes: usize) -> Option<Permit> {
        self.take(&mut self.budget.lock(), bytes)
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        let mut state = self.budget.lock();
        if let Some(account) = state.accounts.remove(&self.id) {
            debug_assert_eq!(
                account.used,
                Used::default(),
                "permits outlive their account"
            );
            if account.reserved > 0 {
                state.reserved_accounts -= 1;
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let budget = &self.account.budget;
        let mut state = budget.lock();
        if let Some(account) = state.accounts.get_mut(&self.account.id) {
            let pool_before = pool_part(account.used.bytes, account.reserved);
            account.used.count -= 1;
            account.used.bytes -= self.bytes;
            let pool_after = pool_part(account.used.bytes, account.reserved);
            state.pool_used -= pool_before - pool_after;
            state.held_bytes -= self.bytes;
        }
        let waiters = state.waiters > 0;
        drop(state);
        if waiters {
            budget.released.notify_all();
        }
    }
}

/// Worker threads beyond each connection's first, shared by all connections.
#[derive(Debug)]
pub(crate) struct ThreadBudget {
    used: AtomicUsize,
    max: usize,
}

/// One extra worker thread's place; returned on drop.
#[derive(Debug)]
pub(crate) struct ThreadSlot(Arc<ThreadBudget>);

impl ThreadBudget {
    pub(crate) fn new(max: usize) -> Arc<ThreadBudget> {
        Arc::new(ThreadBudget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// A slot if fewer than the maximum are taken; never blocks.
    pub(crate) fn try_take(self: &Arc<Self>) -> Option<ThreadSlot> {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                (used < self.max).then_some(used + 1)
            })
            .ok()
            .map(|_| ThreadSlot(Arc::clone(self)))
    }

    /// Slots taken now.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }
}

impl Drop for ThreadSlot {
    fn drop(&mut self) {
        self.0.used.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::time::Duration;

    const KIB: usize = 1024;
    const MIB: usize = 1024 * KIB;

    /// 256 MiB total, 64 MiB per connection, 256 connections: 512 KiB guaranteed each, a
    /// 128 MiB pool (the server defaults).
    fn defaults() -> BudgetLimits {
        BudgetLimits::new(256 * MIB, 64 * MIB, 256, 64)
    }

    #[test]
    fn limits_split_the_total() {
        let limits = defaults();
        assert_eq!(limits.connection_reserved_bytes, 512 * KIB);
        assert_eq!(limits.pool_bytes_max(), 128 * MIB);
        // The guaranteed share never exceeds the per-connection cap.
        let few = BudgetLimits::new(256 * MIB, MIB, 2, 64);
        assert_eq!(few.connection_reserved_bytes, MIB);
        assert_eq!(few.pool_bytes_max(), 254 * MIB);
    }

    #[test]
    fn rules_in_isolation() {
        let limits = defaults();
        let r = limits.connection_reserved_bytes;
        let idle = Used::default();
        // 1: the count limit.
        let full = Used {
            count: 64,
            bytes: 0,
        };
        assert!(!admits(&limits, 0, full, r, 4 * KIB));
        // 2: the guaranteed share is granted even with the pool exhausted.
        assert!(admits(&limits, 128 * MIB, idle, r, 4 * KIB));
        let some = Used {
            count: 3,
            bytes: r - 4 * KIB,
        };
        assert!(admits(&limits, 128 * MIB, some, r, 4 * KIB));
        assert!(!admits(&limits, 128 * MIB, some, r, 8 * KIB));
        // 3: fair share: a 32 MiB read needs twice its pool part free.
        let need = 32 * MIB - r;
        assert!(admits(&limits, 128 * MIB - 2 * need, idle, r, 32 * MIB));
        assert!(!admits(
            &limits,
            128 * MIB - 2 * need + 1,
            idle,
            r,
            32 * MIB
        ));
        // 3: the per-connection cap.
        let holding = Used {
            count: 2,
            bytes: 48 * MIB,
        };
        assert!(!admits(&limits, 0, holding, r, 17 * MIB));
        assert!(admits(&limits, 0, holding, r, 16 * MIB));
        // 4: a request larger than the cap (or half the pool) goes alone, and only alone.
        let small = BudgetLimits::new(8 * MIB, 2 * MIB, 4, 64);
        let r = small.connection_reserved_bytes;
        assert!(admits(&small, 0, idle, r, 32 * MIB));
        assert!(!admits(&small, 1, idle, r, 32 * MIB));
        let one = Used {
            count: 1,
            bytes: 4 * KIB,
        };
        assert!(!admits(&small, 0, one, r, 32 * MIB));
    }

    #[test]
    fn greedy_connections_leave_room_for_others() {
        let budget = Budget::new(defaults());
        let mut permits = Vec::new();
        // Sixteen hostile connections each take as much as they can: 32 MiB reads, then
        // 1 MiB, then 4 KiB ones.
        let hostile: Vec<_> = (0..16).map(|_| budget.account()).collect();
        for bytes in [32 * MIB, MIB, 4 * KIB] {
            for account in &hostile {
                while let Some(p) = account.try_acquire(bytes) {
                    permits.push(p);
                }
            }
        }
        let held = budget.bytes_held();
        assert!(held <= 256 * MIB, "{held}");
        // The first two got two and one 32 MiB reads (then the fair share stops them).
        assert!(held >= 96 * MIB, "{held}");
        // A newcomer still gets its guaranteed share, in small reads.
        let good = budget.account();
        let share = defaults().connection_reserved_bytes;
        let small: Vec<_> = (0..share / (64 * KIB))
            .map(|_| good.try_acquire(64 * KIB))
            .collect();
        assert!(
            small.iter().all(Option::is_some),
            "held {}",
            budget.bytes_held()
        );
        drop((small, permits));
        assert_eq!(budget.bytes_held(), 0);
        assert!(budget.bytes_held_peak() <= 256 * MIB);
        // With the hostile ones gone, the newcomer gets a 32 MiB read.
        assert!(good.try_acquire(32 * MIB).is_some());
    }

    #[test]
    fn random_traffic_never_exceeds_the_total() {
        let limits = BudgetLimits::new(64 * MIB, 16 * MIB, 16, 8);
        let budget = Budget::new(limits);
        let seed = 0x5eed_b0d6;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let accounts: Vec<_> = (0..16).map(|_| budget.account()).collect();
        let mut held: Vec<Vec<Permit>> = (0..16).map(|_| Vec::new()).collect();
        for _ in 0..20_000 {
            let i = rng.gen_range(0..16);
            if rng.gen_bool(0.5) {
                let bytes = rng.gen_range(1..=(16 * MIB));
                if let Some(p) = accounts[i].try_acquire(bytes) {
                    held[i].push(p);
                }
            } else if !held[i].is_empty() {
                let k = rng.gen_range(0..held[i].len());
                held[i].swap_remove(k);
            }
            let total: usize = held.iter().flatten().map(|p| p.bytes).sum();
            assert_eq!(budget.bytes_held(), total, "seed {seed:#x}");
            assert!(total <= limits.bytes_max, "seed {seed:#x}: {total}");
            for (account, permits) in held.iter().enumerate() {
                let bytes: usize = permits.iter().map(|p| p.bytes).sum();
                assert!(permits.len() <= 8);
                assert!(bytes <= limits.connection_bytes_max, "account {account}");
            }
        }
        drop(held);
        assert_eq!(budget.bytes_held(), 0);
        assert_eq!(budget.lock().pool_used, 0);
    }

    #[test]
    fn accounts_beyond_the_maximum_get_no_share() {
        let budget = Budget::new(BudgetLimits::new(4 * MIB, 4 * MIB, 2, 8));
        let a = budget.account();
        let b = budget.account();
        let c = budget.account();
        let shares: Vec<usize> = [&a, &b, &c]
            .iter()
            .map(|x| budget.lock().accounts[&x.id].reserved)
            .collect();
        assert_eq!(shares, vec![MIB, MIB, 0]);
        drop(a);
        // A freed share goes to the next account.
        let d = budget.account();
        assert_eq!(budget.lock().accounts[&d.id].reserved, MIB);
        drop((b, c, d));
    }

    #[test]
    fn a_waiter_gets_its_permit_on_release() {
        let budget = Budget::new(BudgetLimits::new(MIB, MIB, 1, 2));
        let account = budget.account();
        let a = account.acquire(KIB);
        let b = account.acquire(KIB);
        assert!(account.try_acquire(KIB).is_none(), "count limit reached");
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let account = Arc::clone(&account);
            std::thread::spawn(move || {
                let p = account.acquire(KIB);
                tx.send(()).unwrap();
                drop(p);
            })
        };
        drop(b);
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        waiter.join().unwrap();
        drop(a);
        // Alone, a permit larger than the whole budget is granted.
        drop(account.acquire(4 * MIB));
        assert_eq!(budget.bytes_held(), 0);
    }

    #[test]
    fn thread_slots_are_bounded_and_returned() {
        let threads = ThreadBudget::new(2);
        let a = threads.try_take().unwrap();
        let b = threads.try_take().unwrap();
        assert!(threads.try_take().is_none());
        assert_eq!(threads.used(), 2);
        drop(a);
        let c = threads.try_take().unwrap();
        drop((b, c));
        assert_eq!(threads.used(), 0);
    }
}
