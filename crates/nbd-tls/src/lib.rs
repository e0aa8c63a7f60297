//! TLS for NBD connections, with rustls: what `NBD_OPT_STARTTLS` upgrades a connection to.
//!
//! Owns: credentials read from PEM files ([`ServerTls`], [`ClientTls`]), and one TLS session
//! per connection ([`Session`]) shared by the thread that reads the connection
//! ([`TlsReader`]) and the threads that write it ([`Session::write_all`]). Which bytes are in
//! clear and when the upgrade happens is the NBD handshake's business (`nbd-proto`); this
//! crate only runs TLS over a byte stream the caller hands it.
//!
//! Invariants (the sharing rule, which lets a blocking reader and several writers use one
//! rustls connection at once):
//! - the rustls state is behind one mutex that is held only for work in memory (encrypting,
//!   decrypting, queueing records), never across a socket call: a reader blocked in `recv`
//!   never holds up a writer, and a writer blocked in `send` never holds up decryption;
//! - records leave the state only through [`Session::write_all`], [`Session::flush`] and
//!   [`Session::close`], whose callers hold the connection's own write lock from the moment
//!   the records are taken until they are on the socket. So the socket carries the records in
//!   the order rustls made them (TLS sequence numbers), and a reply is never split by another;
//! - one reader at a time per session (the caller's read lock): a [`TlsReader`] owns the
//!   ciphertext received but not yet given to rustls, and the reader never writes. Records
//!   the reader's processing makes rustls queue (a TLS 1.3 KeyUpdate answer, an alert) go out
//!   with the next write;
//! - memory outside the callers' budgets: per session rustls' buffers (16 KiB of received
//!   plaintext, a record being reassembled, at most 64 KiB during the handshake) and the
//!   reader's [`CIPHERTEXT_BUFFER_BYTES`]; per write, the records of at most
//!   [`WRITE_CHUNK_BYTES`] of plaintext at a time.
//!
//! Fault model: the peer is untrusted. A TLS error (a bad record, a certificate that does not
//! verify, an alert from the peer) is an `io::Error` of kind `InvalidData` naming the cause;
//! during the handshake the alert that explains it is sent first. A failed or partial write
//! leaves the stream unusable: the caller must stop using it (NBD servers and clients shut the
//! socket down). A session whose mutex was poisoned by a panic is unusable and reports so.

mod config;
mod session;
#[cfg(feature = "test-certs")]
pub mod testcerts;

pub use config::{ClientTls, ServerTls};
pub use session::{Session, TlsReader, CIPHERTEXT_BUFFER_BYTES, WRITE_CHUNK_BYTES};
