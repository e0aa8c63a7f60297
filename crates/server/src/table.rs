//! The live connections of a server: admission against the global and per-client connection
//! limits, idle tracking, and closing connections to make room for new ones — idle ones
//! (eviction) and, when the server is full, connections of the client holding the most
//! (displacement), so that no set of clients can lock others out.
//!
//! Owns: the table of connections (id → client, socket, [`Activity`], thread), each
//! connection's [`Activity`] (requests in flight, whether one is being received, quiet since
//! when, closing mark), the admission rule ([`decide`], a pure function of what the table
//! holds), and the counters of refused, evicted, displaced and idle-closed connections.
//!
//! Idleness: a connection is idle when nothing is in flight — no request being read, executed
//! or answered — and nothing has arrived from its client for `idle_timeout`. The quiet clock
//! restarts when a request starts arriving and when the last reply in flight is written;
//! during the handshake, whenever bytes arrive. Idle connections are left alone while there
//! is room: real NBD clients keep connections idle for hours.
//!
//! Admission ([`decide`]): a client's *count* is its connections not already closing. A
//! newcomer from a client `C` holding `n_C` is admitted at once while both limits have room.
//! At its client's limit it may only take the place of one of its own idle connections. When
//! the server is full it takes, in this order: the longest-idle idle connection of the
//! heaviest client holding at least `n_C` (so a lightly used client's idle connection is not
//! closed for a heavier one); else, if the heaviest client holds `n_H ≥ n_C + 2`, one of that
//! client's connections — the one with nothing in flight that has been quiet longest, else the
//! one with the fewest requests in flight (*displacement*). After a displacement `C` holds
//! `n_C + 1 ≤ n_H - 1`: no client is pushed below the newcomer, so the displaced client cannot
//! take the place back and displacement cannot ping-pong. Bound: a newcomer is refused only
//! when every client holds at most `n_C + 1` (and none of those holding `n_C` or more has an
//! idle connection) — a client holding no connection is refused only when every connection
//! belongs to a different client; one holding fewer than `connections_max / k - 1` whenever
//! fewer than `k` clients share the server.
//!
//! Invariants: connections in the table ≤ `connections_max`, and per client ≤
//! `connections_per_client_max` (only the accept thread inserts, after [`Table::make_room`];
//! a closing connection keeps its place, and its descriptor, until its thread has closed the
//! socket, so descriptors stay bounded; the newcomer waits for that). A connection is closed
//! for room only after its state is checked again under its activity lock, which its reader
//! takes when a request starts arriving and when it has been received: the closing mark set
//! there stops any further request from starting, so no request is cut in the middle and no
//! reply is lost. An idle or quiet one (nothing in flight) has its socket shut down at once. A
//! busy one is drained: its reading side is shut down when no request is being received (else
//! its reader stops after the one it is receiving), its requests in flight are executed and
//! answered, then it closes.
//!
//! Fault model: a client may send a request exactly while its quiet connection is closed; it
//! then sees the connection close without a reply, as if the server had closed it a moment
//! earlier (which NBD clients handle anyway). A drained connection whose client does not take
//! its replies (or finish sending the request it started) within [`EVICTION_WAIT`] is cut off
//! like one that exceeds the reply timeout; if it has still not left [`EVICTION_WAIT`] after
//! that (its export holds a request), the newcomer is refused: the accept thread never waits
//! unboundedly.

use crate::net::{ClientKey, Stream};
use std::collections::HashMap;
use std::fmt;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest the accept thread waits for a connection closed for room to close its socket (and,
/// for a drained one, again after cutting it off).
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
    /// A request is being received (between its first byte and its last).
    receiving: bool,
    /// Since when nothing was in flight and nothing arrived (meaningful when `in_flight == 0`).
    quiet_since: Instant,
    /// Closed as idle or for room: no request may start.
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
pub(crate) struct InFlight {
    activity: Arc<Activity>,
    /// Requests in flight when this one started, itself included.
    started_with: usize,
}

impl InFlight {
    /// Requests in flight when this one started, itself included (saves the reader another
    /// hold of the activity lock per request).
    pub(crate) fn started_with(&self) -> usize {
        self.started_with
    }

    /// The request has been received whole; false if the connection is closing meanwhile
    /// (displaced while it arrived): then the reader reads nothing more after it.
    pub(crate) fn received(&self) -> bool {
        let mut state = lock(&self.activity.state);
        state.receiving = false;
        !state.closing
    }
}

/// How a connection closed for room goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closing {
    /// Nothing was in flight: its socket is shut down at once.
    Quiet,
    /// Requests in flight are answered first; `receiving`: one is still arriving, and its
    /// reader stops after it (otherwise the reading side is shut down at once).
    Draining { receiving: bool },
}

impl Activity {
    pub(crate) fn new() -> Activity {
        Activity {
            state: Mutex::new(ActivityState {
                in_flight: 0,
                receiving: false,
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
    pub(crate) fn begin_request(self: &Arc<Self>) -> Option<InFlight> {
        let mut state = lock(&self.state);
        if state.closing {
            return None;
        }
        state.in_flight += 1;
        state.receiving = true;
        Some(InFlight {
            activity: Arc::clone(self),
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

    /// Marks the connection closing whatever it is doing (the caller then closes or drains
    /// it as the result says); `None` if it already was.
    pub(crate) fn close_for_room(&self) -> Option<Closing> {
        let mut state = lock(&self.state);
        if state.closing {
            return None;
        }
        state.closing = true;
        Some(if state.in_flight == 0 {
            Closing::Quiet
        } else {
            Closing::Draining {
                receiving: state.receiving,
            }
        })
    }

    #[cfg(test)]
    fn idle_for(&self, now: Instant) -> Option<Duration> {
        lock(&self.state).idle_for(now)
    }

    /// What admission sees of this connection now.
    fn load(&self, now: Instant) -> Load {
        let state = lock(&self.state);
        if state.closing {
            Load::Closing
        } else if state.in_flight == 0 {
            Load::Quiet(now.saturating_duration_since(state.quiet_since))
        } else {
            Load::Busy(state.in_flight)
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut state = lock(&self.activity.state);
        state.in_flight -= 1;
        state.receiving = false;
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
    /// At `connections_max`, no connection idle, and no client holding two more than the
    /// newcomer's.
    Full,
    /// The client is at `connections_per_client_max`, and none of its connections idle.
    ClientFull,
    /// A connection closed for room did not go away in time (see the module's fault model).
    EvictionStuck,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Closed => "the server is shutting down",
            Refusal::Full => {
                "the connection limit is reached, no connection is idle and no client holds two \
                 more connections than this one's"
            }
            Refusal::ClientFull => {
                "the client's connection limit is reached and none of its connections is idle"
            }
            Refusal::EvictionStuck => "a connection closed to make room did not go away",
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

/// What admission sees of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Load {
    /// Already closing: leaving, and counted for nobody.
    Closing,
    /// Nothing in flight, quiet for this long.
    Quiet(Duration),
    /// This many requests in flight.
    Busy(usize),
}

/// One connection as [`decide`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnView<C> {
    pub(crate) id: u64,
    pub(crate) client: C,
    pub(crate) load: Load,
}

/// What to do about a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// There is room.
    Admit,
    /// Close this idle connection, then decide again.
    Evict(u64),
    /// Close (or drain) this connection of the heaviest client, then decide again.
    Displace(u64),
    Refuse(Refusal),
}

/// How many connections were closed to make room for one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Room {
    pub(crate) evicted: u64,
    pub(crate) displaced: u64,
}

/// The admission rule of the module header, for a newcomer from `client` given the
/// connections in the table: pure, so it can be tested on its own for many rounds.
pub(crate) fn decide<C: Copy + Eq + std::hash::Hash>(
    client: C,
    conns: &[ConnView<C>],
    limits: &TableLimits,
) -> Decision {
    let mut held: HashMap<C, usize> = HashMap::new();
    let mut counted: HashMap<C, usize> = HashMap::new();
    for conn in conns {
        *held.entry(conn.client).or_insert(0) += 1;
        if conn.load != Load::Closing {
            *counted.entry(conn.client).or_insert(0) += 1;
        }
    }
    let count = |c: &C| counted.get(c).copied().unwrap_or(0);
    let idle_for = |conn: &ConnView<C>| match conn.load {
        Load::Quiet(quiet) if quiet >= limits.idle_timeout => Some(quiet),
        _ => None,
    };
    let client_full = held.get(&client).copied().unwrap_or(0) >= limits.connections_per_client_max;
    if !client_full && conns.len() < limits.connections_max {
        return Decision::Admit;
    }
    if client_full {
        // Only the client's own idle connections make room under its own limit.
        return conns
            .iter()
            .filter(|conn| conn.client == client)
            .filter_map(|conn| Some((idle_for(conn)?, conn.id)))
            .max()
            .map_or(Decision::Refuse(Refusal::ClientFull), |(_, id)| {
                Decision::Evict(id)
            });
    }
    let ours = count(&client);
    // Idle connections of clients holding at least as many as the newcomer's: the heaviest
    // client's first, then the longest idle.
    let idle = conns
        .iter()
        .filter(|conn| count(&conn.client) >= ours)
        .filter_map(|conn| Some(((count(&conn.client), idle_for(conn)?), conn.id)))
        .max();
    if let Some((_, id)) = idle {
        return Decision::Evict(id);
    }
    // Displacement from the heaviest client, if it holds two more than the newcomer's; its
    // quietest connection (nothing in flight, quiet longest), else its least busy one. Ties
    // between equally heavy clients go to the smallest id, so the choice is deterministic.
    let victim = conns
        .iter()
        .filter(|conn| count(&conn.client) >= ours + 2)
        .filter_map(|conn| {
            let preference = match conn.load {
                Load::Closing => return None,
                Load::Quiet(quiet) => (1, usize::MAX, quiet),
                Load::Busy(in_flight) => (0, usize::MAX - in_flight, Duration::ZERO),
            };
            Some((
                (count(&conn.client), preference, std::cmp::Reverse(conn.id)),
                conn.id,
            ))
        })
        .max();
    match victim {
        Some((_, id)) => Decision::Displace(id),
        None => Decision::Refuse(Refusal::Full),
    }
}

/// Counters of a [`Table`], for observability.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) refused: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) displaced: AtomicU64,
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

    /// Makes room for a new connection from `client` by the rule of [`decide`], closing one
    /// connection at a time and waiting for it to leave; returns how many were closed, or why
    /// there is no room.
    pub(crate) fn make_room(&self, client: ClientKey) -> Result<Room, Refusal> {
        let limits = &self.limits;
        let mut room = Room::default();
        let mut inner = lock(&self.inner);
        loop {
            if inner.closed {
                return Err(Refusal::Closed);
            }
            let now = Instant::now();
            let views: Vec<ConnView<ClientKey>> = inner
                .entries
                .iter()
                .map(|(&id, entry)| ConnView {
                    id,
                    client: entry.client,
                    load: entry.activity.load(now),
                })
                .collect();
            let (id, idle) = match decide(client, &views, limits) {
                Decision::Admit => return Ok(room),
                Decision::Refuse(refusal) => return Err(refusal),
                Decision::Evict(id) => (id, true),
                Decision::Displace(id) => (id, false),
            };
            let entry = &inner.entries[&id];
            let closing = if idle {
                // Idle when looked at; confirmed under its activity lock.
                entry
                    .activity
                    .close_if_idle(limits.idle_timeout, now)
                    .then_some(Closing::Quiet)
            } else {
                entry.activity.close_for_room()
            };
            let Some(closing) = closing else {
                // A request started meanwhile; look again.
                continue;
            };
            match closing {
                Closing::Quiet => entry.stream.shutdown(Shutdown::Both),
                // Wakes the reader waiting for the next request; replies still go out.
                Closing::Draining { receiving: false } => entry.stream.shutdown(Shutdown::Read),
                // Its reader stops once the request it receives is in.
                Closing::Draining { receiving: true } => {}
            }
            if idle {
                room.evicted += 1;
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            } else {
                room.displaced += 1;
                self.counters.displaced.fetch_add(1, Ordering::Relaxed);
            }
            inner = self.wait_gone(inner, id, now + EVICTION_WAIT);
            if inner.entries.contains_key(&id) && !inner.closed {
                // A drained connection whose client does not take its replies: cut it off.
                inner.entries[&id].stream.shutdown(Shutdown::Both);
                inner = self.wait_gone(inner, id, Instant::now() + EVICTION_WAIT);
                if inner.entries.contains_key(&id) && !inner.closed {
                    return Err(Refusal::EvictionStuck);
                }
            }
        }
    }

    /// Waits until connection `id` has left the table (or the table is closed), at most until
    /// `deadline`.
    fn wait_gone<'a>(
        &self,
        mut inner: MutexGuard<'a, Inner>,
        id: u64,
        deadline: Instant,
    ) -> MutexGuard<'a, Inner> {
        while inner.entries.contains_key(&id) && !inner.closed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            inner = self
                .left
                .wait_timeout(inner, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        inner
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
        let activity = Arc::new(Activity::new());
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
        assert_eq!(table.make_room(CLIENT_B), Ok(evicted(1)));
        assert_eq!(table.len(), 1);
        assert!(first.begin_request().is_none(), "evicted");
        let (_third, _c) = add(&table, 3, CLIENT_B);
        // With a request in flight on each, nothing can be evicted, and B, holding both, is
        // not two ahead of itself.
        let _busy2 = second.begin_request().unwrap();
        let _busy3 = _third.begin_request().unwrap();
        assert_eq!(table.make_room(CLIENT_B), Err(Refusal::Full));
        assert_eq!(table.counters.evicted.load(Ordering::Relaxed), 1);
    }

    fn evicted(n: u64) -> Room {
        Room {
            evicted: n,
            displaced: 0,
        }
    }

    fn displaced(n: u64) -> Room {
        Room {
            evicted: 0,
            displaced: n,
        }
    }

    /// Finding 3's lockout, in small: every place is held by busy connections (requests in
    /// flight, or quiet for less than the idle timeout) of a few clients; a newcomer from
    /// another client still gets in, taking the quietest connection of the heaviest client.
    #[test]
    fn a_full_server_of_busy_connections_still_admits_a_lighter_client() {
        let table = table(6, 4, 3_600_000);
        let heavy = ClientKey::Uid(10);
        let light = ClientKey::Uid(11);
        let mut held = Vec::new();
        for id in 0..4 {
            held.push(add(&table, id, heavy));
        }
        for id in 4..6 {
            held.push(add(&table, id, light));
        }
        // All of them have requests in flight but one of the heavy client's, which is only
        // quiet (far from idle).
        let busy: Vec<_> = held
            .iter()
            .enumerate()
            .filter(|(id, _)| *id != 2)
            .map(|(_, (activity, _))| activity.begin_request().unwrap())
            .collect();
        for request in &busy {
            assert!(request.received());
        }
        let newcomer = ClientKey::Uid(12);
        assert_eq!(table.make_room(newcomer), Ok(displaced(1)));
        assert!(held[2].0.begin_request().is_none(), "the quiet one went");
        assert_eq!(table.len(), 5);
        let (_n, _ns) = add(&table, 6, newcomer);
        // The heavy client (3) is not two ahead of the light one (2): no displacement for it.
        assert_eq!(table.make_room(light), Err(Refusal::Full));
        // A second newcomer drains a busy connection of the heavy client.
        assert_eq!(table.make_room(ClientKey::Uid(13)), Ok(displaced(1)));
        assert_eq!(table.counters.displaced.load(Ordering::Relaxed), 2);
        assert_eq!(table.counters.evicted.load(Ordering::Relaxed), 0);
        let closed = held[..4]
            .iter()
            .filter(|(activity, _)| activity.begin_request().is_none())
            .count();
        assert_eq!(closed, 2, "two of the heavy client's connections closed");
        drop(busy);
    }

    #[test]
    fn a_connection_displaced_while_receiving_stops_after_that_request() {
        let activity = Arc::new(Activity::new());
        let request = activity.begin_request().unwrap();
        assert_eq!(
            activity.close_for_room(),
            Some(Closing::Draining { receiving: true })
        );
        assert_eq!(activity.close_for_room(), None, "already closing");
        assert!(!request.received(), "the reader stops after this one");
        drop(request);
        assert!(activity.begin_request().is_none());
        let quiet = Arc::new(Activity::new());
        assert_eq!(quiet.close_for_room(), Some(Closing::Quiet));
        let busy = Arc::new(Activity::new());
        let request = busy.begin_request().unwrap();
        assert!(request.received());
        assert_eq!(
            busy.close_for_room(),
            Some(Closing::Draining { receiving: false })
        );
    }

    /// The seed of a randomized test: `TIERCACHE_ADMISSION_SEED` to replay one, else a new
    /// one; printed either way.
    fn seed() -> u64 {
        let seed = std::env::var("TIERCACHE_ADMISSION_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(rand::random);
        println!("admission seed {seed} (replay: TIERCACHE_ADMISSION_SEED={seed})");
        seed
    }

    /// A table as [`decide`] sees it, for simulation.
    struct Sim {
        limits: TableLimits,
        conns: Vec<ConnView<u32>>,
        next_id: u64,
    }

    impl Sim {
        fn count(&self, client: u32) -> usize {
            self.conns
                .iter()
                .filter(|c| c.client == client && c.load != Load::Closing)
                .count()
        }

        fn counts(&self) -> HashMap<u32, usize> {
            let mut counts = HashMap::new();
            for c in self.conns.iter().filter(|c| c.load != Load::Closing) {
                *counts.entry(c.client).or_insert(0) += 1;
            }
            counts
        }

        fn is_idle(&self, load: Load) -> bool {
            matches!(load, Load::Quiet(q) if q >= self.limits.idle_timeout)
        }

        /// One newcomer from `client`, with `load` once admitted: applies the decisions (a
        /// closed connection leaves at once) and checks every one against the rule. Returns
        /// whether it was admitted.
        fn connect(&mut self, client: u32, load: Load, seed: u64) -> bool {
            let mut closed = 0;
            loop {
                let ours = self.count(client);
                let held = self.conns.iter().filter(|c| c.client == client).count();
                let client_full = held >= self.limits.connections_per_client_max;
                let counts = self.counts();
                let heaviest = counts.values().copied().max().unwrap_or(0);
                match decide(client, &self.conns, &self.limits) {
                    Decision::Admit => {
                        assert!(
                            self.conns.len() < self.limits.connections_max,
                            "seed {seed}"
                        );
                        assert!(!client_full, "seed {seed}");
                        self.conns.push(ConnView {
                            id: self.next_id,
                            client,
                            load,
                        });
                        self.next_id += 1;
                        assert!(closed <= 1, "seed {seed}: {closed} closed for one newcomer");
                        return true;
                    }
                    Decision::Evict(id) => {
                        let at = self.conns.iter().position(|c| c.id == id).unwrap();
                        let victim = self.conns[at];
                        assert!(self.is_idle(victim.load), "seed {seed}: {victim:?}");
                        assert!(self.count(victim.client) >= ours, "seed {seed}");
                        if client_full {
                            assert_eq!(victim.client, client, "seed {seed}");
                        }
                        self.conns.remove(at);
                    }
                    Decision::Displace(id) => {
                        let at = self.conns.iter().position(|c| c.id == id).unwrap();
                        let victim = self.conns[at];
                        let theirs = self.count(victim.client);
                        assert!(!client_full, "seed {seed}");
                        assert_ne!(victim.load, Load::Closing, "seed {seed}");
                        assert!(theirs >= ours + 2, "seed {seed}: {theirs} vs {ours}");
                        assert_eq!(theirs, heaviest, "seed {seed}: not the heaviest");
                        assert!(
                            !self
                                .conns
                                .iter()
                                .any(|c| self.is_idle(c.load) && self.count(c.client) >= ours),
                            "seed {seed}: displaced while an idle one could go"
                        );
                        // Their quietest connection, if any has nothing in flight.
                        let quietest = self
                            .conns
                            .iter()
                            .filter(|c| self.count(c.client) == heaviest)
                            .filter_map(|c| match c.load {
                                Load::Quiet(q) => Some(q),
                                _ => None,
                            })
                            .max();
                        if let Some(q) = quietest {
                            assert_eq!(victim.load, Load::Quiet(q), "seed {seed}");
                        }
                        self.conns.remove(at);
                    }
                    Decision::Refuse(Refusal::ClientFull) => {
                        assert!(client_full, "seed {seed}");
                        assert!(
                            !self
                                .conns
                                .iter()
                                .any(|c| c.client == client && self.is_idle(c.load)),
                            "seed {seed}"
                        );
                        return false;
                    }
                    Decision::Refuse(Refusal::Full) => {
                        assert!(!client_full, "seed {seed}");
                        assert!(self.conns.len() >= self.limits.connections_max);
                        // The bound: refused only when no client is two ahead.
                        assert!(heaviest <= ours + 1, "seed {seed}: {heaviest} vs {ours}");
                        assert!(
                            !self
                                .conns
                                .iter()
                                .any(|c| self.is_idle(c.load) && self.count(c.client) >= ours),
                            "seed {seed}"
                        );
                        return false;
                    }
                    Decision::Refuse(other) => panic!("seed {seed}: {other:?}"),
                }
                closed += 1;
                assert!(closed <= 2, "seed {seed}: the loop does not converge");
            }
        }
    }

    fn random_load(rng: &mut impl rand::Rng, idle_timeout: Duration) -> Load {
        match rng.gen_range(0..10) {
            0 => Load::Closing,
            1..=2 => Load::Quiet(idle_timeout + Duration::from_millis(rng.gen_range(0..60_000))),
            3..=5 => Load::Quiet(Duration::from_millis(
                rng.gen_range(0..idle_timeout.as_millis() as u64),
            )),
            _ => Load::Busy(rng.gen_range(1..=16)),
        }
    }

    /// The admission rule against random tables: many clients, idle, quiet, busy and closing
    /// connections, clients connecting and leaving at random, and hostile clients reconnecting
    /// as fast as they can. Every decision is checked against the rule, and a well-behaved
    /// client always gets its connections on the first try while the bound allows them.
    #[test]
    fn admission_rule_random_rounds() {
        use rand::{Rng, SeedableRng};
        let seed = seed();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for round in 0..400 {
            let connections_max = rng.gen_range(2..=64);
            let limits = TableLimits {
                connections_max,
                connections_per_client_max: rng.gen_range(1..=connections_max),
                idle_timeout: Duration::from_secs(30),
            };
            let mut sim = Sim {
                limits,
                conns: Vec::new(),
                next_id: 0,
            };
            let clients = rng.gen_range(1..=12u32);
            for _ in 0..300 {
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let client = rng.gen_range(0..clients);
                        let load = random_load(&mut rng, limits.idle_timeout);
                        sim.connect(client, load, seed);
                    }
                    5..=6 if !sim.conns.is_empty() => {
                        let at = rng.gen_range(0..sim.conns.len());
                        sim.conns.remove(at);
                    }
                    7..=8 if !sim.conns.is_empty() => {
                        let at = rng.gen_range(0..sim.conns.len());
                        sim.conns[at].load = random_load(&mut rng, limits.idle_timeout);
                    }
                    _ => {
                        // A client never seen before: refused only if every connection is
                        // of a different client, or if its own limit is zero (it is not).
                        let fresh = 1000 + round;
                        let admitted = sim.connect(fresh, Load::Busy(1), seed);
                        let counts = sim.counts();
                        assert!(
                            admitted || counts.values().all(|&n| n <= 1),
                            "seed {seed}: a fresh client was refused: {counts:?}"
                        );
                        sim.conns.retain(|c| c.client != fresh);
                    }
                }
            }
        }
    }

    /// Finding 3's flood: `k` hostile clients fill the server with busy connections and
    /// reconnect at once whenever they lose one; a well-behaved client asks for `w`
    /// connections one at a time, interleaved at random with the hostile reconnects. It gets
    /// each on its first try as long as `connections_max - (w - 1) >= k * (w + 1)` (the
    /// heaviest hostile client then always holds two more than it).
    #[test]
    fn a_well_behaved_client_gets_in_despite_a_flood() {
        use rand::{Rng, SeedableRng};
        let seed = seed();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..200 {
            let hostile = rng.gen_range(1..=8u32);
            let per_client = rng.gen_range(2..=32);
            let connections_max = (hostile as usize * per_client).min(256);
            let limits = TableLimits {
                connections_max,
                connections_per_client_max: per_client,
                idle_timeout: Duration::from_secs(30),
            };
            let mut sim = Sim {
                limits,
                conns: Vec::new(),
                next_id: 0,
            };
            let busy = |rng: &mut rand::rngs::StdRng| {
                if rng.gen_bool(0.5) {
                    Load::Busy(rng.gen_range(1..=4))
                } else {
                    Load::Quiet(Duration::from_millis(rng.gen_range(0..10_000)))
                }
            };
            for client in 0..hostile {
                while sim.connect(client, busy(&mut rng), seed) {}
            }
            let good = 99;
            let k = hostile as usize;
            let w = (1..=per_client)
                .take_while(|w| connections_max - (w - 1) >= k * (w + 1))
                .last()
                .unwrap_or(0);
            for _ in 0..w {
                for _ in 0..rng.gen_range(0..2 * k) {
                    let client = rng.gen_range(0..hostile);
                    sim.connect(client, busy(&mut rng), seed);
                    let at = rng.gen_range(0..sim.conns.len());
                    sim.conns[at].load = busy(&mut rng);
                }
                let had = sim.count(good);
                assert!(
                    sim.connect(good, busy(&mut rng), seed),
                    "seed {seed}: refused holding {had} of {w} (k {k}, max {connections_max}): {:?}",
                    sim.counts()
                );
            }
        }
    }

    #[test]
    fn the_per_client_limit_evicts_only_that_clients_connections() {
        let table = table(10, 1, 0);
        let (a, _a) = add(&table, 1, CLIENT_A);
        let (b, _b) = add(&table, 2, CLIENT_B);
        a.touch();
        b.touch();
        // B is at its limit: its own idle connection goes, not A's (idle longer).
        assert_eq!(table.make_room(CLIENT_B), Ok(evicted(1)));
        assert!(b.begin_request().is_none());
        assert!(a.begin_request().is_some());
        let (_b2, _b2s) = add(&table, 3, CLIENT_B);
        let _busy = _b2.begin_request().unwrap();
        assert_eq!(table.make_room(CLIENT_B), Err(Refusal::ClientFull));
        assert_eq!(table.make_room(ClientKey::Uid(7)), Ok(Room::default()));
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
