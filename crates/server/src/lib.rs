//! NBD server for tiercache: serves a live catalog of [`Export`]s over unix sockets and TCP.
//!
//! Owns: listening, per-connection handshake and transmission, bounded concurrency, graceful
//! shutdown. It contains no cache logic: everything below the [`Export`] trait belongs to the
//! embedder (the engine), and all protocol decisions are delegated to the sans-I/O `nbd-proto`.
//!
//! Invariants: every request is validated by `nbd_proto::TransmissionContext::validate` before
//! an export sees it, so exports only get in-range, aligned, advertised operations; each
//! connection has bounded requests and bytes in flight, at most one thread reading its socket
//! and at most one writing it at a time (each reply written whole).
//!
//! Fault model: clients are untrusted. Bad input becomes an NBD error reply or a dropped
//! connection; it never panics the server or disturbs other connections. Export I/O errors
//! become error replies mapped by `nbd_proto::NbdErrno::from_io_error`.

mod budget;
mod connection;
mod export;
mod net;
mod server;

pub use export::{Detached, Export, ExportRegistry};
pub use net::{BindAddr, LocalAddr};
pub use server::{start, ServerConfig, ServerHandle};
