//! A server's configuration ([`ServerConfig`]: limits, timeouts, socket permissions, TLS) and
//! what its accept thread and every connection share ([`Shared`]). Below both `server` (which
//! builds them) and `connection` (which reads them).
//!
//! Invariants: a `ServerConfig` that passed `check` has no zero limit; `Shared` is built once
//! per listener and outlives every connection thread of it.

use crate::budget::{Budget, ThreadBudget};
use crate::export::ExportRegistry;
use crate::net::TlsConfig;
use crate::table::Table;
use crate::unix_socket::UnixSocketPerms;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1024 * 1024;

/// Limits and timeouts of a server. Memory outside `bytes_in_flight_max`: per connection a
/// 256 KiB read buffer, per worker thread an I/O buffer kept up to 256 KiB between requests
/// (larger buffers are mapped per request and unmapped once answered, and are budgeted).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most threads serving one connection (each reads, executes and answers one request at a
    /// time; started as needed, the connection's own thread being the first), so also the most
    /// requests one connection executes at once. Default 16.
    pub workers_per_connection: usize,
    /// Worker threads beyond each connection's first, all connections together. A connection
    /// that cannot get another keeps serving with the ones it has. Default 256.
    pub workers_max: usize,
    /// Requests read but not yet answered, per connection. Default 64.
    pub requests_in_flight_max: usize,
    /// Request and reply buffers held at once by all connections together: half of it is
    /// split into a guaranteed share per connection, the rest is shared by a fair-share rule
    /// (see the crate docs). Default 256 MiB.
    pub bytes_in_flight_max: usize,
    /// Request and reply buffers held at once by one connection; a single larger request is
    /// still served when the connection holds nothing else. Default 64 MiB.
    pub connection_bytes_in_flight_max: usize,
    /// Connections open at once, lowered at start so that they fit under the process's
    /// descriptor limit (see [`ServerStats::connections_max`]). Default 256.
    pub connections_max: usize,
    /// Connections open at once from one client: one user (peer uid) on a unix socket, one IP
    /// address on TCP. Default 32.
    pub connections_per_client_max: usize,
    /// Longest a handshake may take, from accept to the start of transmission. Default 30 s.
    pub handshake_timeout: Duration,
    /// A connection with nothing in flight that has received nothing for this long is idle:
    /// it is closed when a newcomer needs its place (at `connections_max`, or at
    /// `connections_per_client_max` for its client), and only then. When the server is full and
    /// none is idle, a newcomer still takes the place of a connection of the client holding
    /// the most, if that holds at least two more than the newcomer's client. Default 30 s.
    pub idle_timeout: Duration,
    /// Closes a connection idle this long even when there is room. Default `None` (never:
    /// NBD clients such as the kernel and qemu keep connections idle for hours).
    pub idle_close_after: Option<Duration>,
    /// Longest wait for the rest of a request after its first byte, and for a write's payload
    /// after its buffer was granted; a client that does not send it is disconnected. Default
    /// 30 s.
    pub request_timeout: Duration,
    /// Longest time to write one whole reply; a client that does not take it in time is
    /// disconnected and its buffers released. Default 30 s.
    pub reply_timeout: Duration,
    /// Mode and owner of a unix socket file. Default 0660, our own uid and gid.
    pub socket_perms: UnixSocketPerms,
    /// TLS through `NBD_OPT_STARTTLS`. Default `None`: `NBD_OPT_STARTTLS` is refused with
    /// `NBD_REP_ERR_POLICY`.
    pub tls: Option<TlsConfig>,
    /// How the transmission phase of plain (non-TLS) connections is served. Default
    /// [`DataPath::Auto`].
    pub data_path: DataPath,
    /// Event-loop threads of the io_uring data path, connections spread over them. Default 0:
    /// one per CPU the process may run on.
    pub ring_threads: usize,
}

/// The data path of plain connections (TLS connections are always served by threads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataPath {
    /// io_uring where the kernel allows it, else threads (logged once at start).
    #[default]
    Auto,
    /// io_uring; the server does not start without it.
    Uring,
    /// Threads per connection (leader/followers), no io_uring.
    Threads,
}

impl std::str::FromStr for DataPath {
    type Err = String;
    fn from_str(s: &str) -> Result<DataPath, String> {
        match s {
            "auto" => Ok(DataPath::Auto),
            "uring" | "io_uring" => Ok(DataPath::Uring),
            "threads" => Ok(DataPath::Threads),
            other => Err(format!(
                "unknown data path {other:?} (expected auto, uring or threads)"
            )),
        }
    }
}

impl std::fmt::Display for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataPath::Auto => "auto",
            DataPath::Uring => "uring",
            DataPath::Threads => "threads",
        })
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers_per_connection: 16,
            workers_max: 256,
            requests_in_flight_max: 64,
            bytes_in_flight_max: 256 * MIB,
            connection_bytes_in_flight_max: 64 * MIB,
            connections_max: 256,
            connections_per_client_max: 32,
            handshake_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            idle_close_after: None,
            request_timeout: Duration::from_secs(30),
            reply_timeout: Duration::from_secs(30),
            socket_perms: UnixSocketPerms::default(),
            tls: None,
            data_path: DataPath::Auto,
            ring_threads: 0,
        }
    }
}

impl ServerConfig {
    pub(crate) fn check(&self) -> io::Result<()> {
        let limits = [
            ("workers_per_connection", self.workers_per_connection),
            ("requests_in_flight_max", self.requests_in_flight_max),
            ("bytes_in_flight_max", self.bytes_in_flight_max),
            (
                "connection_bytes_in_flight_max",
                self.connection_bytes_in_flight_max,
            ),
            ("connections_max", self.connections_max),
            (
                "connections_per_client_max",
                self.connections_per_client_max,
            ),
        ];
        match limits.iter().find(|(_, value)| *value == 0) {
            Some((name, _)) => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("server limit {name} must be positive"),
            )),
            None => Ok(()),
        }
    }
}

/// What the accept thread and every connection share.
pub(crate) struct Shared {
    pub(crate) config: ServerConfig,
    pub(crate) registry: ExportRegistry,
    pub(crate) budget: Arc<Budget>,
    pub(crate) threads: Arc<ThreadBudget>,
    pub(crate) table: Table,
    pub(crate) stopping: AtomicBool,
    pub(crate) next_id: AtomicU64,
    /// Event-loop threads of the io_uring data path (0: every connection is served by
    /// threads); the loops themselves are the server's (`ServerHandle`), not shared here.
    pub(crate) ring_threads: usize,
    /// Worker threads of the io_uring data path's pool now.
    pub(crate) ring_workers: Arc<std::sync::atomic::AtomicUsize>,
    /// Reads served by the io_uring data path's direct device reads so far.
    pub(crate) direct_reads: AtomicU64,
    /// Writes absorbed so far by the io_uring data path's own device writes.
    pub(crate) direct_writes: AtomicU64,
}
