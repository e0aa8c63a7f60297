//! The listener, the accept loop, admission, and graceful shutdown.
//!
//! Owns: the server's configuration and shared state ([`Shared`]: budgets, connection table),
//! the accept thread, and the socket file of a unix listener.
//!
//! Invariants: after [`ServerHandle::shutdown`] returns, no connection thread is running,
//! every request that was read has been answered (or its client had gone or was cut off by a
//! timeout), and a unix socket file we bound has been removed — unless the path no longer
//! names it, in which case whatever is there is left alone. Shutdown never depends on the
//! socket file: the accept thread is woken by shutting the listening socket down. At most the
//! effective `connections_max` connections (the configured one lowered to fit the descriptor
//! limit) and `connections_per_client_max` per client are open; a newcomer beyond a limit
//! takes the place of an idle connection, or when the server is full of busy ones, of a
//! connection of the client holding the most if that holds two more than the newcomer's
//! client (see [`crate::table`]); else it is closed at once.
//!
//! Fault model: accept errors (e.g. out of descriptors) and refusals are logged at most once
//! per `ACCEPT_LOG_INTERVAL` with a count; after a resource error the loop pauses for
//! [`ACCEPT_ERROR_PAUSE`] instead of spinning. A connection's failure is confined to that
//! connection.

use crate::budget::{Budget, BudgetLimits, ThreadBudget};
use crate::config::{DataPath, ServerConfig, Shared};
use crate::connection;
use crate::export::ExportRegistry;
use crate::fd_limit;
use crate::net::{self, BindAddr, ClientKey, Listener, LocalAddr, Stream};
use crate::ring::Rings;
use crate::table::{Activity, Room, Table, TableLimits};
use crate::unix_socket::UnixSocketFile;
use lograte::Throttled;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long the accept loop pauses after running out of a resource (descriptors, memory).
pub(crate) const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How often a shutdown with a deadline looks whether a connection has finished.
const SHUTDOWN_POLL: Duration = Duration::from_millis(10);

/// A snapshot of a server's load and of what its limits did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Connections open now, including those still in the handshake.
    pub connections: usize,
    /// The connection limit in effect: the configured one, lowered to fit the descriptor limit.
    pub connections_max: usize,
    /// Connections closed at once on arrival so far (no room, or no thread for them).
    pub connections_refused: u64,
    /// Idle connections closed so far to make room for new ones.
    pub connections_evicted: u64,
    /// Connections that were not idle closed (or drained: their requests in flight answered
    /// first) so far to make room for a client holding at least two fewer connections than
    /// theirs, when the server was full.
    pub connections_displaced: u64,
    /// Connections closed so far for being idle longer than `idle_close_after`.
    pub connections_idle_closed: u64,
    /// Bytes of request and reply buffers held now (the budgeted part of memory).
    pub bytes_in_flight: usize,
    /// The most bytes of request and reply buffers held at once so far.
    pub bytes_in_flight_peak: usize,
    /// Worker threads running now beyond each connection's first (with io_uring: the
    /// worker pool's threads).
    pub workers_extra: usize,
    /// Event-loop threads of the io_uring data path (0: threads serve every connection).
    pub ring_threads: usize,
    /// Reads served so far by the io_uring data path's own device reads (cache hits read
    /// with no thread hand-over).
    pub direct_reads: u64,
    /// Writes carried out so far by the io_uring data path's own device writes (writes the
    /// cache absorbed with no thread hand-over).
    pub direct_writes: u64,
}

/// A running server.
pub struct ServerHandle {
    local: LocalAddr,
    shared: Arc<Shared>,
    /// The io_uring data path's event loops (`None`: threads serve every connection).
    rings: Option<Arc<Rings>>,
    listener: Arc<Listener>,
    socket_file: Option<UnixSocketFile>,
    accept_thread: JoinHandle<()>,
}

/// Binds `bind` and serves the exports of `registry` (which may change at any time). Fails
/// if the configuration has a zero limit, if the descriptor limit leaves no room for a single
/// connection, or if the address cannot be bound — in particular, with `AddrInUse`, if another
/// server listens on the unix socket path.
pub fn start(
    bind: &BindAddr,
    registry: ExportRegistry,
    config: ServerConfig,
) -> io::Result<ServerHandle> {
    config.check()?;
    // Each listener has its own limits and event loops: its log lines say which it is.
    let what = match bind {
        BindAddr::Unix(p) => p.display().to_string(),
        BindAddr::Tcp(a) => format!("tcp {a}"),
    };
    let connections_max = connections_max_for_descriptors(&what, config.connections_max)?;
    let (listener, local, socket_file) = Listener::bind(bind, &config.socket_perms)?;
    if let LocalAddr::Tcp(addr) = &local {
        if let Some(warning) = net::tcp_exposure_warning(addr, config.tls.as_ref()) {
            log::warn!("{warning}");
        }
    }
    let ring_workers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let rings = start_rings(&what, &config, &ring_workers)?.map(Arc::new);
    let shared = Arc::new(Shared {
        budget: Budget::new(BudgetLimits::new(
            config.bytes_in_flight_max,
            config.connection_bytes_in_flight_max,
            connections_max,
            config.requests_in_flight_max,
        )),
        threads: ThreadBudget::new(config.workers_max),
        table: Table::new(TableLimits {
            connections_max,
            connections_per_client_max: config.connections_per_client_max,
            idle_timeout: config.idle_timeout,
        }),
        config,
        registry: registry.clone(),
        stopping: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        ring_threads: rings.as_ref().map_or(0, |r| r.count()),
        ring_workers,
        direct_reads: AtomicU64::new(0),
        direct_writes: AtomicU64::new(0),
    });
    let listener = Arc::new(listener);
    let accept_thread = {
        let shared = Arc::clone(&shared);
        let listener = Arc::clone(&listener);
        let rings = rings.clone();
        thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&listener, &shared, rings.as_ref()))
    };
    let accept_thread = match accept_thread {
        Ok(thread) => thread,
        Err(err) => {
            if let Some(file) = &socket_file {
                let _ = file.remove_if_ours();
            }
            if let Some(rings) = &rings {
                rings.stop(None);
            }
            return Err(err);
        }
    };
    Ok(ServerHandle {
        local,
        rings,
        shared,
        listener,
        socket_file,
        accept_thread,
    })
}

/// The io_uring data path as `config.data_path` asks: `None` for threads, or where io_uring
/// is unavailable under `Auto` (logged once, with why).
fn start_rings(
    what: &str,
    config: &ServerConfig,
    workers: &Arc<std::sync::atomic::AtomicUsize>,
) -> io::Result<Option<Rings>> {
    if config.data_path == DataPath::Threads {
        log::info!("{what}: data path: threads (leader/followers per connection)");
        return Ok(None);
    }
    let count = if config.ring_threads > 0 {
        config.ring_threads
    } else {
        thread::available_parallelism().map_or(1, |n| n.get())
    };
    match Rings::start(count, config.workers_max, Arc::clone(workers)) {
        Ok(rings) => {
            log::info!(
                "{what}: data path: io_uring, {} event loop(s){}",
                rings.count(),
                if config.tls.is_some() {
                    " (TLS connections: threads)"
                } else {
                    ""
                }
            );
            Ok(Some(rings))
        }
        Err(err) if config.data_path == DataPath::Auto => {
            log::warn!(
                "{what}: io_uring is not available ({err}): serving through threads (slower on \
                 fast devices; see kernel.io_uring_disabled and the container's seccomp profile)"
            );
            Ok(None)
        }
        Err(err) => Err(io::Error::new(
            err.kind(),
            format!("the io_uring data path was asked for but is not available: {err}"),
        )),
    }
}

/// Raises the descriptor limit and lowers `configured` to what fits under it (logged, for
/// the listener `what`).
fn connections_max_for_descriptors(what: &str, configured: usize) -> io::Result<usize> {
    let soft = match fd_limit::raise_nofile_limit() {
        Ok(soft) => soft,
        Err(err) => {
            log::warn!(
                "could not read the descriptor limit ({err}); keeping connections_max {configured}"
            );
            return Ok(configured);
        }
    };
    let effective = fd_limit::effective_connections_max(configured, soft);
    if effective == 0 {
        return Err(io::Error::other(format!(
            "the descriptor limit {soft} leaves no room for connections; raise it (ulimit -n)"
        )));
    }
    if effective < configured {
        log::warn!(
            "{what}: serving at most {effective} connections (not {configured}): the descriptor limit is {soft}"
        );
    } else {
        log::info!("{what}: serving at most {effective} connections (descriptor limit {soft})");
    }
    Ok(effective)
}

/// Shortest time between two log lines of one kind of accept event.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The accept thread's log limiters, one per kind of event.
struct AcceptLogs {
    errors: Throttled,
    refusals: Throttled,
    evictions: Throttled,
}

impl Default for AcceptLogs {
    fn default() -> Self {
        AcceptLogs {
            errors: Throttled::with_period(ACCEPT_LOG_INTERVAL),
            refusals: Throttled::with_period(ACCEPT_LOG_INTERVAL),
            evictions: Throttled::with_period(ACCEPT_LOG_INTERVAL),
        }
    }
}

fn accept_loop(listener: &Listener, shared: &Arc<Shared>, rings: Option<&Arc<Rings>>) {
    let mut logs = AcceptLogs::default();
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match accepted {
            Ok((stream, client)) => admit(stream, client, shared, rings, &mut logs),
            Err(err) => {
                let exhausted = matches!(
                    err.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                logs.errors
                    .log(log::Level::Warn, format_args!("accept failed: {err}"));
                if exhausted {
                    // Unparked by shutdown.
                    thread::park_timeout(ACCEPT_ERROR_PAUSE);
                }
            }
        }
    }
}

/// Serves a new connection if there is room (made by evicting idle ones if need be), else
/// closes it.
fn admit(
    stream: Stream,
    client: ClientKey,
    shared: &Arc<Shared>,
    rings: Option<&Arc<Rings>>,
    logs: &mut AcceptLogs,
) {
    let table = &shared.table;
    let refused = |logs: &mut AcceptLogs, why: &dyn std::fmt::Display| {
        table.counters.refused.fetch_add(1, Ordering::Relaxed);
        logs.refusals.log(
            log::Level::Warn,
            format_args!("refused a connection from {client}: {why}"),
        );
    };
    match table.make_room(client) {
        Ok(Room {
            evicted: 0,
            displaced: 0,
        }) => {}
        Ok(Room { evicted, displaced }) => {
            logs.evictions.log(
                log::Level::Info,
                format_args!(
                    "closed {evicted} idle connection(s) and {displaced} of a client holding \
                     more to make room for one from {client}"
                ),
            );
        }
        Err(refusal) => return refused(logs, &refusal),
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let stream = Arc::new(stream);
    let activity = Arc::new(Activity::new());
    let spawn = {
        let (shared, stream, activity, rings) = (
            Arc::clone(shared),
            Arc::clone(&stream),
            Arc::clone(&activity),
            rings.cloned(),
        );
        move || {
            thread::Builder::new()
                .name(format!("nbd-conn-{id}"))
                .spawn(move || {
                    connection::serve(&stream, id, &activity, &shared, rings.as_deref());
                    // Closes the socket (ours is the last reference but the table's) and frees
                    // the place; at shutdown the entry was already taken and is joined.
                    drop(stream);
                    shared.table.remove(id);
                })
        }
    };
    match table.insert(id, client, stream, activity, spawn) {
        Ok(true) => {}
        Ok(false) => refused(logs, &crate::table::Refusal::Closed),
        Err(err) => refused(logs, &format!("could not start its thread: {err}")),
    }
}

impl ServerHandle {
    /// Where the server listens.
    pub fn local_addr(&self) -> &LocalAddr {
        &self.local
    }

    /// The live export catalog; add or remove exports through it at any time.
    pub fn registry(&self) -> &ExportRegistry {
        &self.shared.registry
    }

    /// Connections currently open.
    pub fn connection_count(&self) -> usize {
        self.shared.table.len()
    }

    /// Current load and what the limits did so far.
    pub fn stats(&self) -> ServerStats {
        stats_of(&self.shared)
    }

    /// A handle that reads [`stats`](Self::stats) from elsewhere (a metrics exporter), also
    /// after shutdown (the final values then).
    pub fn stats_view(&self) -> StatsView {
        StatsView(Arc::clone(&self.shared))
    }

    /// Stops accepting, stops reading new requests, answers every request already read, closes
    /// all connections and returns. Clients that stop reading their replies are cut off by the
    /// reply timeout. Works whatever happened to the socket file meanwhile.
    pub fn shutdown(self) {
        self.shutdown_within(None);
    }

    /// Like [`ServerHandle::shutdown`], but waits at most `limit` for the requests already
    /// read: a connection still executing one then (a request stuck in a hung device) has its
    /// socket shut down, so its client sees the connection end and its unanswered requests
    /// fail, and its thread is left behind. Returns how many connections were abandoned.
    pub fn shutdown_within(self, limit: Option<Duration>) -> usize {
        let started = Instant::now();
        self.shared.stopping.store(true, Ordering::SeqCst);
        // While the listener is still open, so a server probing the path sees it live.
        if let Some(file) = &self.socket_file {
            match file.remove_if_ours() {
                Ok(true) => {}
                Ok(false) => log::warn!(
                    "{} no longer is our socket (removed or replaced); leaving it alone",
                    file.path().display()
                ),
                Err(err) => log::warn!("{err}"),
            }
        }
        if let Err(err) = self.listener.wake() {
            log::error!("could not wake the accept thread: {err}");
        }
        // Closing the table also ends a wait for an evicted connection in the accept thread.
        let connections = self.shared.table.close();
        self.accept_thread.thread().unpark();
        if self.accept_thread.join().is_err() {
            log::error!("accept thread panicked");
        }
        for (_, entry) in &connections {
            entry.stream().shutdown(Shutdown::Read);
        }
        let mut abandoned = 0;
        for (id, entry) in connections {
            if let Some(limit) = limit {
                while !entry.thread_finished() && started.elapsed() < limit {
                    std::thread::sleep(SHUTDOWN_POLL);
                }
                if !entry.thread_finished() {
                    log::warn!(
                        "connection {id}: a request still runs after the shutdown deadline \
                         ({limit:?}; a hung device?): its connection is closed without its \
                         reply and the request abandoned"
                    );
                    entry.stream().shutdown(Shutdown::Both);
                    abandoned += 1;
                    continue;
                }
            }
            if entry.into_thread().join().is_err() {
                log::error!("connection {id} thread panicked");
            }
        }
        if let Some(rings) = &self.rings {
            rings.stop(limit.map(|limit| started + limit));
        }
        abandoned
    }
}

/// A clonable reader of a server's [`ServerStats`] (see [`ServerHandle::stats_view`]).
#[derive(Clone)]
pub struct StatsView(Arc<Shared>);

impl StatsView {
    pub fn stats(&self) -> ServerStats {
        stats_of(&self.0)
    }
}

fn stats_of(shared: &Shared) -> ServerStats {
    let counters = &shared.table.counters;
    ServerStats {
        connections: shared.table.len(),
        connections_max: shared.table.limits().connections_max,
        connections_refused: counters.refused.load(Ordering::Relaxed),
        connections_evicted: counters.evicted.load(Ordering::Relaxed),
        connections_displaced: counters.displaced.load(Ordering::Relaxed),
        connections_idle_closed: counters.idle_closed.load(Ordering::Relaxed),
        bytes_in_flight: shared.budget.bytes_held(),
        bytes_in_flight_peak: shared.budget.bytes_held_peak(),
        workers_extra: shared.threads.used() + shared.ring_workers.load(Ordering::Relaxed),
        ring_threads: shared.ring_threads,
        direct_reads: shared.direct_reads.load(Ordering::Relaxed),
        direct_writes: shared.direct_writes.load(Ordering::Relaxed),
    }
}
