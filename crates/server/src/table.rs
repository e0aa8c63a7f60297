//! The live connections of a server: admission against the global and per-client connection
//! limits, idle tracking, and eviction of idle connections to make room for new ones.
//!
//! Owns: the table of connections (id → client, socket, [`Activity`], thread), each
//! connection's [`Activity`] (requests in flight, quiet since when, closing mark), and the
//! counters of refused, evicted and idle-closed connections.
//!
//! Idleness: a connection is idle when nothing is in flight — no request being read, executed
//! or answered — and nothing has arrived from its client for `idle_timeout`. The quiet clock
//! restarts when a request starts arriving and when the last reply in flight is written;
//! during the handshake, whenever bytes arrive. Idle connections are left alone while there
//! is room: real NBD clients keep connections idle for hours.
//!
//! Invariants: connections in the table ≤ `connections_max`, and per client ≤
//! `connections_per_client_max` (only the accept thread inserts, after [`Table::make_room`]).
//! A connection is evicted only after its idleness is confirmed under its activity lock,
//! which its reader takes when a request starts arriving: the eviction marks it closing there
//! and shuts its socket down, and a reader that then receives a request sees the mark and ends
//! without starting it — so no request is cut in the middle and no reply is lost. An evicted
//! connection keeps its place (and its descriptor is counted) until its thread has closed the
//! socket, so descriptors stay bounded; the newcomer waits for that.
//!
//! Fault model: a client may send a request exactly while its idle connection is evicted; it
//! then sees the connection close without a reply, as if the server had closed it a moment
//! earlier (which NBD clients handle anyway). If an evicted connection has not left within
//! [`EVICTION_WAIT`], the newcomer is refused: the accept thread never waits unboundedly.

use crate::net::{ClientKey, Stream};
use std::collections::HashMap;
use std::fmt;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest the accept thread waits for an evicted connection to close its socket.
pub(crate) const EVICTION_WAIT: Duration = Duration::from_secs(5);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// What one connection is doing, as far as idleness goes.
#[derive(Debug)]
pub(crate) struct Activity {
    state: Mutex<ActivityState>,
}

#[derive(Debug)]
struct ActivityState {
    in_flight: usize,
    /// Since when nothing was in flight and nothing arrived (meaningful when `in_flight == 0`).
    quiet_since: Instant,
    /// Closed as idle: no request may start.
    closing: bool,
}

impl ActivityState {
    /// How long the connection has been idle, if it is idle and open.
    fn idle_for(&self, now: Instant) -> Option<Duration> {
        (self.in_flight == 0 && !self.closing)
            .then(|| now.saturating_duration_since(self.quiet_since))
    }
}

/// A request of the connection between its first byte and its reply; ends on drop.
#[derive(Debug)]
pub(crate) struct InFlight<'a> {
    activity: &'a Activity,
    /// Requests in flight when this one started, itself included.
    started_with: usize,
}

impl InFlight<'_> {
    /// Requests in flight when this one started, itself included (saves the reader another
    /// hold of the activity lock per request).
    pub(crate) fn started_with(&self) -> usize {
        self.started_with
    }
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            state: Mutex::new(ActivityState {
                in_flight: 0,
                quiet_since: Instant::now(),
                closing: false,
            }),
        }
    }

    /// Bytes arrived outside a request (during the handshake).
    pub(crate) fn touch(&self) {
        lock(&self.state).quiet_since = Instant::now();
    }

    /// A request starts arriving; `None` if the connection was closed as idle meanwhile.
    pub(crate) fn begin_request(&self) -> Option<InFlight<'_>> {
        let mut state = lock(&self.state);
        if state.closing {
            return None;
        }
        state.in_flight += 1;
        Some(InFlight {
            activity: self,
            started_with: state.in_flight,
        })
    }

    /// Requests between their first byte and their reply.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }

    /// When the connection will have been idle for `after` if nothing arrives (and, with
    /// requests in flight, none ends before then either).
    pub(crate) fn idle_deadline(&self, after: Duration) -> Instant {
        let state = lock(&self.state);
        if state.in_flight == 0 {
            state.quiet_since + after
        } else {
            Instant::now() + after
        }
    }

    /// Marks the connection closing if it has been idle for at least `at_least`; the caller
    /// then closes it. No request can start once this returned true.
    pub(crate) fn close_if_idle(&self, at_least: Duration, now: Instant) -> bool {
        let mut state = lock(&self.state);
        let idle = state.idle_for(now).is_some_and(|idle| idle >= at_least);
        if idle {
            state.closing = true;
        }
        idle
    }

    fn idle_for(&self, now: Instant) -> Option<Duration> {
        lock(&self.state).idle_for(now)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.activity.state);
        state.in_flight -= 1;
        if state.in_flight == 0 {
            state.quiet_since = Instant::now();
        }
    }
}

/// The connection limits a [`Table`] enforces.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TableLimits {
    pub(crate) connections_max: usize,
    pub(crate) connections_per_client_max: usize,
    pub(crate) idle_timeout: Duration,
}

/// Why a new connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The server is shutting down.
    Closed,
    /// At `connections_max`, and no connection idle.
    Full,
    /// The client is at `connections_per_client_max`, and none of its connections idle.
    ClientFull,
    /// An evicted connection did not close within [`EVICTION_WAIT`].
    EvictionStuck,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Closed => "the server is shutting down",
            Refusal::Full => "the connection limit is reached and no connection is idle",
            Refusal::ClientFull => {
                "the client's connection limit is reached and none of its connections is idle"
            }
            Refusal::EvictionStuck => "an idle connection closed to make room did not go away",
        })
    }
}

/// One live connection.
pub(crate) struct Entry {
    client: ClientKey,
    stream: Arc<Stream>,
    activity: Arc<Activity>,
    thread: JoinHandle<()>,
}

impl Entry {
    pub(crate) fn stream(&self) -> &Stream {
        &self.stream
    }

    pub(crate) fn into_thread(self) -> JoinHandle<()> {
        self.thread
    }

    pub(crate) fn thread_finished(&self) -> bool {
        self.thread.is_finished()
    }
}

#[derive(Default)]
struct Inner {
    entries: HashMap<u64, Entry>,
    per_client: HashMap<ClientKey, usize>,
    /// Set at shutdown: nothing is admitted any more.
    closed: bool,
}

/// Counters of a [`Table`], for observability.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) refused: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) idle_closed: AtomicU64,
}

/// The live connections of one server.
pub(crate) struct Table {
    inner: Mutex<Inner>,
    /// Signalled whenever a connection leaves.
    left: Condvar,
    limits: TableLimits,
    pub(crate) counters: Counters,
}

impl Table {
    pub(crate) fn new(limits: TableLimits) -> Table {
        Table {
            inner: Mutex::new(Inner::default()),
            left: Condvar::new(),
            limits,
            counters: Counters::default(),
        }
    }

    pub(crate) fn limits(&self) -> &TableLimits {
        &self.limits
    }

    /// Makes room for a new connection from `client`, evicting the longest-idle idle
    /// connection (of that client when it is at its limit, else of anyone) while a limit is
    /// reached; returns how many were evicted, or why there is no room.
    pub(crate) fn make_room(&self, client: ClientKey) -> Result<u64, Refusal> {
        let limits = &self.limits;
        let mut evicted = 0;
        let mut inner = lock(&self.inner);
        loop {
            if inner.closed {
                return Err(Refusal::Closed);
            }
            let of_client = inner.per_client.get(&client).copied().unwrap_or(0);
            let client_full = of_client >= limits.connections_per_client_max;
            if !client_full && inner.entries.len() < limits.connections_max {
                return Ok(evicted);
            }
            let now = Instant::now();
            let victim = inner
                .entries
                .iter()
                .filter(|(_, entry)| !client_full || entry.client == client)
                .filter_map(|(&id, entry)| {
                    let idle = entry.activity.idle_for(now)?;
                    (idle >= limits.idle_timeout).then_some((idle, id))
                })
                .max();
            let Some((_, id)) = victim else {
                return Err(if client_full {
                    Refusal::ClientFull
                } else {
                    Refusal::Full
                });
            };
            let entry = &inner.entries[&id];
            if !entry.activity.close_if_idle(limits.idle_timeout, now) {
                // A request started meanwhile; look again.
                continue;
            }
            entry.stream.shutdown(Shutdown::Both);
            evicted += 1;
            self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            let deadline = now + EVICTION_WAIT;
            while inner.entries.contains_key(&id) && !inner.closed {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Refusal::EvictionStuck);
                }
                inner = self
                    .left
                    .wait_timeout(inner, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }

    /// Adds connection `id` with the thread `spawn` starts for it (under the table lock, so the
    /// thread cannot try to leave before it is in); `Ok(false)` if the table is closed.
    pub(crate) fn insert(
        &self,
        id: u64,
        client: ClientKey,
        stream: Arc<Stream>,
        activity: Arc<Activity>,
        spawn: impl FnOnce() -> std::io::Result<JoinHandle<()>>,
    ) -> std::io::Result<bool> {
        let mut inner = lock(&self.inner);
        if inner.closed {
            return Ok(false);
        }
        let thread = spawn()?;
        *inner.per_client.entry(client).or_insert(0) += 1;
        inner.entries.insert(
            id,
            Entry {
                client,
                stream,
                activity,
                thread,
            },
        );
        Ok(true)
    }

    /// Connection `id` has ended (its socket is closed once its entry is dropped here).
    pub(crate) fn remove(&self, id: u64) {
        let mut inner = lock(&self.inner);
        if let Some(entry) = inner.entries.remove(&id) {
            if let Some(count) = inner.per_client.get_mut(&entry.client) {
                *count -= 1;
                if *count == 0 {
                    inner.per_client.remove(&entry.client);
                }
            }
        }
        drop(inner);
        self.left.notify_all();
    }

    /// Connections in the table.
    pub(crate) fn len(&self) -> usize {
        lock(&self.inner).entries.len()
    }

    /// Closes the table for good and hands out every connection in it.
    pub(crate) fn close(&self) -> Vec<(u64, Entry)> {
        let mut inner = lock(&self.inner);
        inner.closed = true;
        inner.per_client.clear();
        let entries = inner.entries.drain().collect();
        drop(inner);
        self.left.notify_all();
        entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    const CLIENT_A: ClientKey = ClientKey::Uid(1000);
    const CLIENT_B: ClientKey = ClientKey::Uid(1001);

    /// A table entry whose thread leaves the table once its socket is shut down.
    fn add(table: &Arc<Table>, id: u64, client: ClientKey) -> (Arc<Activity>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let reader = ours.try_clone().unwrap();
        let activity = Arc::new(Activity::new());
        let inserted = table.insert(
            id,
            client,
            Arc::new(Stream::Unix(ours)),
            Arc::clone(&activity),
            || {
                let table = Arc::clone(table);
                Ok(std::thread::spawn(move || {
                    let _ = std::io::Read::read(&mut &reader, &mut [0u8; 1]);
                    drop(reader);
                    table.remove(id);
                }))
            },
        );
        assert!(inserted.unwrap());
        (activity, theirs)
    }

    fn table(connections_max: usize, per_client_max: usize, idle_ms: u64) -> Arc<Table> {
        Arc::new(Table::new(TableLimits {
            connections_max,
            connections_per_client_max: per_client_max,
            idle_timeout: Duration::from_millis(idle_ms),
        }))
    }

    #[test]
    fn activity_tracks_requests_and_idleness() {
        let activity = Activity::new();
        let later = Instant::now() + Duration::from_secs(60);
        assert!(activity.idle_for(later).unwrap() >= Duration::from_secs(59));
        let request = activity.begin_request().unwrap();
        assert_eq!(activity.in_flight(), 1);
        assert_eq!(activity.idle_for(later), None, "a request is in flight");
        assert!(!activity.close_if_idle(Duration::ZERO, later));
        drop(request);
        assert!(activity.close_if_idle(Duration::from_secs(1), later));
        assert!(
            activity.begin_request().is_none(),
            "closing: no request starts"
        );
        assert_eq!(activity.idle_for(later), None, "already closing");
    }

    #[test]
    fn evicts_the_longest_idle_and_only_idle_ones() {
        let table = table(2, 10, 0);
        let (first, _a) = add(&table, 1, CLIENT_A);
        let (second, _b) = add(&table, 2, CLIENT_B);
        second.touch();
        // Both are idle (timeout 0); the first one longest.
        assert_eq!(table.make_room(CLIENT_B), Ok(1));
        assert_eq!(table.len(), 1);
        assert!(first.begin_request().is_none(), "evicted");
        let (_third, _c) = add(&table, 3, CLIENT_B);
        // With a request in flight on each, nothing can be evicted.
        let _busy2 = second.begin_request().unwrap();
        let _busy3 = _third.begin_request().unwrap();
        assert_eq!(table.make_room(CLIENT_A), Err(Refusal::Full));
        assert_eq!(table.counters.evicted.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_per_client_limit_evicts_only_that_clients_connections() {
        let table = table(10, 1, 0);
        let (a, _a) = add(&table, 1, CLIENT_A);
        let (b, _b) = add(&table, 2, CLIENT_B);
        a.touch();
        b.touch();
        // B is at its limit: its own idle connection goes, not A's (idle longer).
        assert_eq!(table.make_room(CLIENT_B), Ok(1));
        assert!(b.begin_request().is_none());
        assert!(a.begin_request().is_some());
        let (_b2, _b2s) = add(&table, 3, CLIENT_B);
        let _busy = _b2.begin_request().unwrap();
        assert_eq!(table.make_room(CLIENT_B), Err(Refusal::ClientFull));
        assert_eq!(table.make_room(ClientKey::Uid(7)), Ok(0));
        for (_, entry) in table.close() {
            entry.stream().shutdown(Shutdown::Both);
            entry.into_thread().join().unwrap();
        }
        assert_eq!(table.make_room(CLIENT_A), Err(Refusal::Closed));
    }

    #[test]
    fn quiet_but_not_long_enough_is_not_idle() {
        let table = table(1, 1, 3_600_000);
        let (_a, _s) = add(&table, 1, CLIENT_A);
        assert_eq!(table.make_room(CLIENT_A), Err(Refusal::ClientFull));
        assert_eq!(table.make_room(CLIENT_B), Err(Refusal::Full));
    }
}
