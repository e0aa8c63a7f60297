//! A connection's byte stream as the protocol sees it: the socket itself, or TLS over it once
//! the client sent `NBD_OPT_STARTTLS` (see `nbd_tls` for the session).
//!
//! Owns: the reading side ([`Incoming`], used by one thread at a time under the connection's
//! read lock) and the writing side ([`Outgoing`], used under the connection's write lock),
//! each with the deadline of the socket call in progress.
//!
//! Invariants: with TLS, every byte after the acknowledgement of `NBD_OPT_STARTTLS` goes
//! through the session in both directions; the session's records are taken and written under
//! the connection's write lock (the caller's), so replies keep their order on the wire and a
//! reader blocked in `recv` never holds up a reply (the session's own lock is never held
//! across a socket call). A reply is written whole or the stream is unusable, as in clear.
//!
//! Fault model: socket errors and passed deadlines surface as from [`Deadlined`]; TLS errors
//! are `InvalidData` and end the connection.

use crate::net::{Deadlined, Stream};
use nbd_tls::{Session, TlsReader};
use std::io::{self, Read, Write};
use std::sync::Arc;
use std::time::Instant;

/// The reading side of a connection.
pub(crate) enum Incoming<'a> {
    Plain(Deadlined<'a>),
    Tls(TlsReader<Deadlined<'a>>),
}

impl Incoming<'_> {
    /// The deadline of every later socket read.
    pub(crate) fn set_deadline(&mut self, deadline: Option<Instant>) {
        match self {
            Incoming::Plain(d) => d.deadline = deadline,
            Incoming::Tls(r) => r.get_mut().deadline = deadline,
        }
    }

    /// Whether bytes already received wait below the caller's buffer (TLS records not yet
    /// decrypted); a hint, as for a buffered reader.
    pub(crate) fn has_buffered(&self) -> bool {
        match self {
            Incoming::Plain(_) => false,
            Incoming::Tls(r) => r.has_buffered(),
        }
    }
}

impl Read for Incoming<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Incoming::Plain(d) => d.read(buf),
            Incoming::Tls(r) => r.read(buf),
        }
    }
}

/// The writing side of a connection: how bytes reach the socket.
#[derive(Debug, Clone)]
pub(crate) enum Outgoing {
    Plain,
    Tls(Arc<Session>),
}

impl Outgoing {
    /// Writes `parts` in order, whole, by `deadline` (the caller holds the write lock).
    pub(crate) fn write_all(
        &self,
        stream: &Stream,
        deadline: Option<Instant>,
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let mut out = Deadlined::new(stream, deadline);
        match self {
            Outgoing::Plain => match parts {
                [one] => out.write_all(one),
                [a, b] => write_all_two(&mut out, a, b),
                _ => parts.iter().try_for_each(|p| out.write_all(p)),
            },
            Outgoing::Tls(session) => session.write_all(&mut out, parts),
        }
    }

    /// Ends TLS politely (`close_notify`) by `deadline`; nothing to do in clear.
    pub(crate) fn close(&self, stream: &Stream, deadline: Instant) -> io::Result<()> {
        match self {
            Outgoing::Plain => Ok(()),
            Outgoing::Tls(session) => session.close(&mut Deadlined::new(stream, Some(deadline))),
        }
    }
}

/// Writes `a` then `b` completely, both in one `writev` when the socket takes them.
fn write_all_two(out: &mut impl Write, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let written = if a.is_empty() {
            out.write(b)
        } else {
            out.write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)])
        };
        match written {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                let from_a = n.min(a.len());
                a = &a[from_a..];
                b = &b[n - from_a..];
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
