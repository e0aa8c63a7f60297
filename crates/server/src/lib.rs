//! NBD server for tiercache: serves a live catalog of [`Export`]s over unix sockets and TCP.
//!
//! Owns: listening (unix socket files that stay put: [`bind_unix`]), per-connection handshake
//! and transmission, bounded resources, graceful shutdown. It contains no cache logic:
//! everything below the [`Export`] trait belongs to the embedder (the engine), and all protocol
//! decisions are delegated to the sans-I/O `nbd-proto`.
//!
//! Invariants:
//! - every request is validated by `nbd_proto::TransmissionContext::validate` before an export
//!   sees it, so exports only get in-range, aligned, advertised operations;
//! - at most one thread reads a connection's socket and at most one writes it at a time, and
//!   each reply is written whole;
//! - a unix socket path a live server listens on is never taken over (a second server fails
//!   with `AddrInUse`), a non-socket is never removed, the socket file gets its mode and owner
//!   before it appears at its path (the umask does not matter), and shutdown removes it only
//!   if the path still names the socket we bound — and never needs the file to wake up;
//! - binding TCP to a non-loopback address logs a warning ([`tcp_exposure_warning`]) unless
//!   TLS is required and client certificates are verified (without TLS anyone who reaches the
//!   port reads and writes the disks; with TLS but no client verification, anyone still can,
//!   encrypted);
//! - with TLS ([`TlsConfig`]): after the client's `NBD_OPT_STARTTLS` the rest of the handshake
//!   and the whole transmission phase go through one TLS session per connection, shared by the
//!   connection's reading worker and its replying workers under the rule of `nbd_tls` (the
//!   session's state lock is never held across a socket call; records are taken and written
//!   under the write lock, so replies stay whole and in order). With `required`, a client that
//!   does not upgrade gets `NBD_REP_ERR_TLS_REQD` for every option and cannot reach an export.
//!
//! Limits (fields of [`ServerConfig`], defaults in brackets), all enforced per server:
//! - connections: `connections_max` [256] at once, lowered at start so that they fit under the
//!   descriptor limit (raised to the hard limit first; one descriptor per connection plus 64
//!   reserved); `connections_per_client_max` [32] per client (peer uid on unix sockets, peer IP
//!   on TCP). A newcomer beyond either limit takes the place of an *idle* connection (of that
//!   client, for the per-client limit); when the server is full and none is idle, of a
//!   connection of the client holding the most if that holds at least two more than the
//!   newcomer's (a busy one is drained: its requests in flight are answered first); else it is
//!   closed at once (the rule and its bound: `table`). Idle: nothing in flight and nothing
//!   received for `idle_timeout` [30 s]; idle connections are not closed while there is room,
//!   except after `idle_close_after` [never];
//! - memory: `bytes_in_flight_max` [256 MiB] of request and reply buffers for all connections
//!   together — half of it split into a guaranteed share per connection, so small requests are
//!   never starved, the rest shared by a fair-share rule, so a few connections cannot take it
//!   all — and `connection_bytes_in_flight_max` [64 MiB] per connection (a single larger legal
//!   request is still served alone, so nothing deadlocks); `requests_in_flight_max` [64]
//!   requests per connection. Outside the budget: a 256 KiB read buffer per connection and an
//!   I/O buffer of at most 256 KiB kept per worker thread (larger buffers are mapped for one
//!   request and unmapped once it is answered, so freed memory goes back to the system); a
//!   client that has gone (failed reply write, hung-up socket) gets none of its queued
//!   requests executed;
//!   With TLS, each connection also holds its TLS session (rustls' buffers, up to 64 KiB during
//!   the handshake, and a 64 KiB ciphertext buffer), and a worker writing a reply holds the
//!   records of at most 256 KiB of it at a time;
//! - threads: `workers_per_connection` [16] per connection, and `workers_max` [256] extra
//!   workers (beyond each connection's first thread) for all connections together;
//! - time: the whole handshake within `handshake_timeout` [30 s]; the rest of a request within
//!   `request_timeout` [30 s] of its first byte, a write's payload within `request_timeout` of
//!   its buffer being granted; one whole reply within `reply_timeout` [30 s] (a client that does
//!   not read its replies is cut off and its buffers released).
//!
//! Counters of what the limits did are in [`ServerHandle::stats`].
//!
//! Fault model: clients are untrusted. Bad input becomes an NBD error reply or a dropped
//! connection; it never panics the server or disturbs other connections beyond the limits
//! above. Events a client can cause at will (refusals, accept errors) are logged at a bounded
//! rate. Export I/O errors become error replies mapped by `nbd_proto::NbdErrno::from_io_error`.

mod budget;
mod config;
mod connection;
mod execute;
mod export;
mod fd_limit;
mod iobuf;
mod net;
mod ring;
mod server;
mod table;
mod told;
mod transport;
mod unix_socket;

pub use config::{DataPath, ServerConfig};
pub use export::{
    Detached, DeviceIo, DirectIo, Export, ExportRegistry, Finished, RemoteIo, Rest, Start,
};
pub use nbd_proto::ValidRequest;
pub use nbd_tls::ServerTls;
pub use net::{peer_cred, tcp_exposure_warning, BindAddr, LocalAddr, TlsConfig};
pub use server::{start, ServerHandle, ServerStats, StatsView};
pub use told::LossWatch;
pub use unix_socket::{
    bind_unix, check_unix_path, UnixSocketFile, UnixSocketPerms, SOCKET_MODE_DEFAULT,
};
