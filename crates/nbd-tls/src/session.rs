//! One TLS session over a connected byte stream, shared by its reader and its writers.
//!
//! Owns: the rustls connection of one NBD connection ([`Session`]), the handshake, and the
//! two halves of the stream: [`TlsReader`] (decrypts; one thread at a time) and
//! [`Session::write_all`] (encrypts and sends; callers serialise).
//!
//! Invariants: those of the crate (see its docs): the state mutex is never held across a
//! socket call; records are taken from the state and written to the socket under the caller's
//! write lock, in order; a write encrypts at most [`WRITE_CHUNK_BYTES`] of plaintext per hold
//! of the state mutex, so a large reply does not keep the reader from decrypting for long;
//! `read_tls` is never handed an empty slice except to report the peer's EOF (rustls takes an
//! empty read for end of stream).
//!
//! Fault model: as the crate's. A socket error or deadline from the caller's stream is
//! returned as it is (a `TimedOut` stays a `TimedOut`), leaving the reader able to retry a
//! read; a TLS error is `InvalidData` and final.

use crate::config::{ClientTls, ServerTls};
use std::io::{self, IoSlice, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

/// Ciphertext a [`TlsReader`] reads from the socket at once (a few full records).
pub const CIPHERTEXT_BUFFER_BYTES: usize = 64 * 1024;
/// Plaintext encrypted per hold of the state mutex by [`Session::write_all`].
pub const WRITE_CHUNK_BYTES: usize = 256 * 1024;

/// A TLS error as an `io::Error`.
fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

/// The TLS state of one connection. See the crate docs for who may call what.
pub struct Session {
    conn: Mutex<rustls::Connection>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(")?;
        f.write_str(&self.describe())?;
        f.write_str(")")
    }
}

impl Session {
    fn new(mut conn: rustls::Connection) -> Session {
        // Plaintext is handed over in chunks of at most WRITE_CHUNK_BYTES and the records are
        // taken out right after, so rustls' own limit would only split a chunk.
        conn.set_buffer_limit(None);
        Session {
            conn: Mutex::new(conn),
        }
    }

    /// The server side of a new session.
    pub fn server(tls: &ServerTls) -> io::Result<Session> {
        let conn = rustls::ServerConnection::new(tls.config.clone()).map_err(tls_error)?;
        Ok(Session::new(conn.into()))
    }

    /// The client side of a new session.
    pub fn client(tls: &ClientTls) -> io::Result<Session> {
        let conn = rustls::ClientConnection::new(tls.config.clone(), tls.server_name.clone())
            .map_err(tls_error)?;
        Ok(Session::new(conn.into()))
    }

    fn lock(&self) -> io::Result<MutexGuard<'_, rustls::Connection>> {
        self.conn.lock().map_err(|_| {
            io::Error::other("the TLS session is unusable: a thread panicked while using it")
        })
    }

    /// Takes every record rustls has queued (under the state mutex) and writes them to `out`
    /// (without it). The caller holds its write lock across the call.
    pub fn flush(&self, out: &mut impl Write) -> io::Result<()> {
        let mut records = Vec::new();
        {
            let mut conn = self.lock()?;
            while conn.wants_write() {
                conn.write_tls(&mut records)?;
            }
        }
        out.write_all(&records)
    }

    /// Encrypts `parts` as one stream of plaintext, in order, and writes the records to `out`,
    /// together with any record queued before. The caller holds its write lock across the
    /// call; an error leaves the stream unusable.
    pub fn write_all(&self, out: &mut impl Write, parts: &[&[u8]]) -> io::Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut records = Vec::with_capacity(total.min(WRITE_CHUNK_BYTES) + 1024);
        let (mut part, mut at) = (0, 0);
        loop {
            let mut window: Vec<IoSlice<'_>> = Vec::with_capacity(parts.len());
            let mut taken = 0;
            while part < parts.len() && taken < WRITE_CHUNK_BYTES {
                let rest = &parts[part][at..];
                let n = rest.len().min(WRITE_CHUNK_BYTES - taken);
                if n > 0 {
                    window.push(IoSlice::new(&rest[..n]));
                }
                taken += n;
                at += n;
                if at == parts[part].len() {
                    part += 1;
                    at = 0;
                }
            }
            {
                let mut conn = self.lock()?;
                if taken > 0 {
                    let accepted = conn.writer().write_vectored(&window)?;
                    // Without a buffer limit rustls takes everything once the handshake is
                    // done; anything else would drop plaintext silently.
                    if accepted != taken {
                        return Err(io::Error::other(format!(
                            "TLS took {accepted} of {taken} bytes of plaintext"
                        )));
                    }
                }
                while conn.wants_write() {
                    conn.write_tls(&mut records)?;
                }
            }
            out.write_all(&records)?;
            records.clear();
            if part == parts.len() {
                return Ok(());
            }
        }
    }

    /// Ends the session politely: queues `close_notify` and writes it (with anything queued
    /// before). The caller holds its write lock; nothing may be written after.
    pub fn close(&self, out: &mut impl Write) -> io::Result<()> {
        self.lock()?.send_close_notify();
        self.flush(out)
    }

    /// Whether the peer presented a certificate (that verified) in the handshake.
    pub fn peer_has_certificate(&self) -> bool {
        self.lock()
            .map(|c| c.peer_certificates().is_some_and(|certs| !certs.is_empty()))
            .unwrap_or(false)
    }

    /// Protocol version and cipher suite, for logs ("TLSv1_3 TLS13_AES_256_GCM_SHA384").
    pub fn describe(&self) -> String {
        match self.lock() {
            Ok(c) => match (c.protocol_version(), c.negotiated_cipher_suite()) {
                (Some(version), Some(suite)) => format!("{version:?} {:?}", suite.suite()),
                _ => "handshaking".to_string(),
            },
            Err(_) => "unusable".to_string(),
        }
    }
}

/// The reading half of a [`Session`] over `raw` (the socket, read with whatever deadline the
/// caller set): decrypted bytes come out of [`Read::read`]. One per session.
#[derive(Debug)]
pub struct TlsReader<R> {
    session: Arc<Session>,
    raw: R,
    ciphertext: Ciphertext,
    /// `raw` reported end of stream (and rustls was told).
    eof: bool,
}

/// Ciphertext read from the socket; `buf[start..end]` is not yet given to rustls.
#[derive(Debug)]
struct Ciphertext {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Ciphertext {
    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Gives buffered ciphertext to rustls, one `read_tls` at a time, until it is used up,
    /// plaintext is available, or (with `handshake`) the handshake is over.
    fn feed(&mut self, conn: &mut rustls::Connection, handshake: bool) -> io::Result<()> {
        while self.start < self.end {
            if handshake && !conn.is_handshaking() {
                return Ok(());
            }
            let n = conn.read_tls(&mut &self.buf[self.start..self.end])?;
            if n == 0 {
                // After the peer's close_notify rustls reads nothing more.
                self.start = self.end;
                return Ok(());
            }
            self.start += n;
            let state = conn.process_new_packets().map_err(tls_error)?;
            if !handshake && state.plaintext_bytes_to_read() > 0 {
                return Ok(());
            }
        }
        Ok(())
    }
}

impl<R: Read> TlsReader<R> {
    /// The reader of `session` over `raw`; `received` is ciphertext already read from the
    /// stream (bytes the peer sent right after the NBD option that started TLS).
    pub fn new(session: Arc<Session>, raw: R, received: &[u8]) -> TlsReader<R> {
        let mut buf = vec![0u8; CIPHERTEXT_BUFFER_BYTES.max(received.len())];
        buf[..received.len()].copy_from_slice(received);
        TlsReader {
            session,
            raw,
            ciphertext: Ciphertext {
                buf,
                start: 0,
                end: received.len(),
            },
            eof: false,
        }
    }

    pub fn session(&self) -> &Arc<Session> {
        &self.session
    }

    /// The stream underneath (to change its deadline, say). Reading it directly would
    /// desynchronise TLS.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.raw
    }

    /// Whether ciphertext is waiting that has not been decrypted yet (a hint that more
    /// plaintext may follow without reading the socket).
    pub fn has_buffered(&self) -> bool {
        !self.ciphertext.is_empty()
    }

    /// Runs the TLS handshake to its end, reading through `self` and writing to `out` (the
    /// same stream); single-threaded, before any other use of the session. A failed handshake
    /// sends the alert that explains it, then returns the error.
    pub fn handshake(&mut self, out: &mut impl Write) -> io::Result<()> {
        loop {
            self.session.flush(out)?;
            if !self.session.lock()?.is_handshaking() {
                return Ok(());
            }
            if self.ciphertext.is_empty() {
                self.read_raw()?;
                if self.eof {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection during the TLS handshake",
                    ));
                }
            }
            let fed = {
                let mut conn = self.session.lock()?;
                self.ciphertext.feed(&mut conn, true)
            };
            if let Err(e) = fed {
                // Best effort: the alert tells the peer why (a bad certificate, say).
                let _ = self.session.flush(out);
                return Err(e);
            }
        }
    }

    /// Reads ciphertext from the socket into the (empty) buffer; at end of stream tells
    /// rustls so.
    fn read_raw(&mut self) -> io::Result<()> {
        let c = &mut self.ciphertext;
        debug_assert!(c.is_empty(), "ciphertext left over");
        c.start = 0;
        c.end = 0;
        let n = self.raw.read(&mut c.buf)?;
        if n == 0 {
            self.eof = true;
            self.session.lock()?.read_tls(&mut io::empty())?;
        }
        c.end = n;
        Ok(())
    }
}

impl<R: Read> Read for TlsReader<R> {
    /// Decrypted bytes; `Ok(0)` after the peer's `close_notify`, `UnexpectedEof` when the
    /// stream ends without it.
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            {
                let mut conn = self.session.lock()?;
                loop {
                    match conn.reader().read(out) {
                        Ok(n) => return Ok(n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                    if self.ciphertext.is_empty() {
                        break;
                    }
                    self.ciphertext.feed(&mut conn, false)?;
                }
            }
            if self.eof {
                // rustls had been told and still had nothing to say: report the end.
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the TLS stream ended",
                ));
            }
            self.read_raw()?;
        }
    }
}
