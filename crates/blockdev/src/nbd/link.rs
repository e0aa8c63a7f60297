//! One NBD connection in the transmission phase: the handshake that opens it, the table of
//! requests in flight on it, the sending side (any caller thread) and the reading side (the
//! connection's thread), and what happens to the requests in flight when it breaks.
//!
//! Owns: [`open`] (connect + handshake, every step bounded by the timeout), [`Link`] (one
//! established connection), [`Outcome`] (what a caller gets for a request).
//!
//! Invariants:
//! - cookies are unique per link (a counter), and every request is in the table from before
//!   its first byte is sent until its reply is read or the link breaks; a reply whose cookie
//!   is not in the table is a protocol violation that breaks the link, so a reply can never
//!   be handed to another request;
//! - a caller that stops waiting (timeout) leaves its entry in the table, marked abandoned:
//!   the late reply (and a read's data) is read and dropped. Abandoned entries count towards
//!   [`IN_FLIGHT_MAX`] until then;
//! - a request is written whole under the writer lock; a send that fails or times out part
//!   way breaks the link (the stream is no longer framed);
//! - over TLS (`nbds://`), `NBD_OPT_STARTTLS` is the first option and its refusal (or a TLS
//!   handshake that fails: an untrusted server certificate, a client certificate the server
//!   refuses) fails the connection attempt; nothing is ever sent in clear after it. One TLS
//!   session per connection is shared by the reading side and the senders under the rule of
//!   `nbd_tls`: records are encrypted and sent under the writer lock, the session's own lock is
//!   never held across a socket call;
//! - an entry leaves the table only with its caller's outcome set, under the table's lock.
//!
//! Fault model: the server is untrusted (framing violations, unknown cookies, structured
//! replies that were not negotiated break the link, never panic). A broken link answers each
//! request in flight with [`Outcome::Retry`] when no write is at stake (see `durability`),
//! with an error otherwise; it is never used again. A server that is shutting down answers
//! with `NBD_ESHUTDOWN` ([`ServerShutdown`]): that request was not carried out and is sent
//! again ([`Outcome::Retry`]), and the spec has the client disconnect: the link ends as a
//! broken one does (the others in flight by the rule above), after an `NBD_CMD_DISC` (the
//! stream is still framed), and the connection is opened again.

use super::durability::Durability;
use super::uri::Target;
use nbd_proto::{
    decode_reply, ClientConfig, ClientEvent, ClientHandshake, Command, CommandFlags, Decoded,
    NbdErrno, Reply, Request, TransmissionFlags,
};
use nbd_tls::{ClientTls, Session, TlsReader};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests one connection carries at once, abandoned ones included.
pub(super) const IN_FLIGHT_MAX: usize = 64;
/// Buffer of the reading side: many small replies per `read`.
const READ_BUFFER_BYTES: usize = 64 << 10;
/// Longest `close` waits for the writer lock to send `NBD_CMD_DISC`.
const DISC_WAIT: Duration = Duration::from_millis(100);
/// Largest request the client sends, whatever the server allows (the spec's common limit).
const REQUEST_BYTES_MAX: u64 = 32 << 20;

/// Why a link ended when the server answered `NBD_ESHUTDOWN`: it is shutting down, the
/// request was not carried out, and the client must disconnect (`NBD_CMD_DISC`).
#[derive(Debug)]
pub(super) struct ServerShutdown;

impl std::fmt::Display for ServerShutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server is shutting down (it answered NBD_ESHUTDOWN)")
    }
}

impl std::error::Error for ServerShutdown {}

impl ServerShutdown {
    pub(super) fn error() -> io::Error {
        io::Error::new(io::ErrorKind::ConnectionAborted, ServerShutdown)
    }

    /// Whether `e` is a link's end by [`ServerShutdown`].
    pub(super) fn is(e: &io::Error) -> bool {
        e.get_ref()
            .is_some_and(|inner| inner.is::<ServerShutdown>())
    }
}

/// The bytes of `NBD_CMD_DISC`.
pub(super) fn disc_request() -> Vec<u8> {
    let mut out = Vec::with_capacity(Request::HEADER_BYTES);
    Request {
        flags: CommandFlags(0),
        command: Command::Disc,
        cookie: 0,
        offset: 0,
        length: 0,
    }
    .encode(&mut out);
    out
}

/// A connected socket of either kind.
#[derive(Debug)]
pub(super) enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn connect(target: &Target, timeout: Duration) -> io::Result<Sock> {
        match target {
            Target::Unix { socket, .. } => Ok(Sock::Unix(connect_unix(
                std::path::Path::new(socket),
                timeout,
            )?)),
            Target::Tcp { addr, .. } => {
                let mut last = None;
                for a in addr.to_socket_addrs()? {
                    match TcpStream::connect_timeout(&a, timeout) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            set_tcp_user_timeout(&s, timeout);
                            return Ok(Sock::Tcp(s));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, format!("{addr}: no address"))
                }))
            }
        }
    }

    pub(super) fn try_clone(&self) -> io::Result<Sock> {
        Ok(match self {
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
        })
    }

    /// Ends every read and send on the socket, in every thread (errors ignored: an already
    /// closed socket is the goal).
    pub(super) fn shutdown(&self) {
        let _ = match self {
            Sock::Unix(s) => s.shutdown(Shutdown::Both),
            Sock::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Sock::Tcp(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }
}

impl std::os::fd::AsRawFd for Sock {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            Sock::Unix(s) => s.as_raw_fd(),
            Sock::Tcp(s) => s.as_raw_fd(),
        }
    }
}

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.read(buf),
            Sock::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.write(buf),
            Sock::Tcp(s) => s.write(buf),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.write_vectored(bufs),
            Sock::Tcp(s) => s.write_vectored(bufs),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Connects to the unix socket at `path` within `timeout`. A blocking `connect` waits for
/// as long as the server's queue of connections not yet accepted is full (a server that
/// stopped accepting: stopped, or at its connection limit with a small backlog); a
/// non-blocking one is told so (`EAGAIN`), and is tried again until the deadline.
fn connect_unix(path: &std::path::Path, timeout: Duration) -> io::Result<UnixStream> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let addr = SockAddr::unix(path)?;
    let deadline = Instant::now() + timeout;
    loop {
        // A new socket each try (socket2 makes it close-on-exec).
        let sock = Socket::new(Domain::UNIX, Type::STREAM, None)?;
        sock.set_nonblocking(true)?;
        match sock.connect(&addr) {
            Ok(()) => {
                sock.set_nonblocking(false)?;
                return Ok(UnixStream::from(std::os::fd::OwnedFd::from(sock)));
            }
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{}: the server accepted no connection within {timeout:?} (its queue \
                         of connections waiting to be accepted is full)",
                        path.display()
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

/// Data sent and not acknowledged by the peer for `timeout` aborts the connection, so a
/// server host that vanished (no reset ever comes) breaks the link instead of leaving every
/// request to time out on it forever. Best effort: without it only requests time out.
fn set_tcp_user_timeout(s: &TcpStream, timeout: Duration) {
    use std::os::fd::AsRawFd;
    let ms = libc::c_uint::try_from(timeout.as_millis()).unwrap_or(libc::c_uint::MAX);
    // SAFETY: a valid socket descriptor owned by `s`, and a pointer to a c_uint of the size
    // passed, alive for the call.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_USER_TIMEOUT,
            (&ms as *const libc::c_uint).cast(),
            std::mem::size_of::<libc::c_uint>() as libc::socklen_t,
        );
    }
}

/// A connection the handshake left in transmission: its socket, and its TLS session (with
/// the reading side's state) when TLS was started.
pub(super) struct Opened {
    sock: Sock,
    tls: Option<TlsReader<Sock>>,
}

impl Opened {
    /// The socket of a connection without TLS; `None` over TLS (its records need the session).
    pub(super) fn into_plain(self) -> Option<Sock> {
        self.tls.is_none().then_some(self.sock)
    }
}

/// The reading side of a connection: the socket, or TLS over it.
#[derive(Debug)]
pub(super) enum Incoming {
    Plain(Sock),
    Tls(TlsReader<Sock>),
}

impl Read for Incoming {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Incoming::Plain(s) => s.read(buf),
            Incoming::Tls(r) => r.read(buf),
        }
    }
}

/// What the connection's thread reads replies from.
pub(super) type Replies = BufReader<Incoming>;

/// What the handshake settled; a reconnection must find the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Export {
    pub size: u64,
    pub flags: TransmissionFlags,
    /// Largest request sent: the server's maximum block size, at most 32 MiB, a multiple of
    /// 512.
    pub max_request_bytes: u64,
}

/// An error reading the NBD handshake over TLS. With TLS 1.3 the server checks the client's
/// certificate after the client has finished its TLS handshake, so a refused certificate
/// shows up here, as an alert or a connection the server just closed.
fn after_tls(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        return e; // a timeout, reported as such
    }
    io::Error::new(
        e.kind(),
        format!(
            "after the TLS handshake: {e} (a server that requires a client certificate ends \
             the connection here if it does not accept ours: see tls-certificates, tls-cert \
             and tls-key)"
        ),
    )
}

/// A handshake read or send that found nothing for `timeout` reports `WouldBlock`.
fn handshake_error(e: io::Error, timeout: Duration) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the server did not answer the handshake within {timeout:?}"),
        )
    } else {
        e
    }
}

/// Connects and negotiates the export (simple replies only), over TLS with `tls`; each step
/// waits at most `timeout`. `connected` sees the socket before the handshake starts (so a
/// closing device can shut it down) and may refuse to go on.
pub(super) fn open(
    target: &Target,
    tls: Option<&ClientTls>,
    timeout: Duration,
    connected: impl FnOnce(&Sock) -> io::Result<()>,
) -> io::Result<(Opened, Export)> {
    let mut sock = Sock::connect(target, timeout)?;
    connected(&sock)?;
    sock.set_timeouts(Some(timeout), Some(timeout))?;
    let export_name = match target {
        Target::Unix { export, .. } | Target::Tcp { export, .. } => export.clone(),
    };
    let mut hs = ClientHandshake::new(ClientConfig {
        export_name,
        structured_replies: false,
        meta_contexts: Vec::new(),
    });
    if tls.is_some() {
        hs = hs.with_starttls();
    }
    let mut reader: Option<TlsReader<Sock>> = None;
    let negotiated = loop {
        let event = hs.poll().map_err(io::Error::from)?;
        let out = hs.take_output();
        match &reader {
            None => sock.write_all(&out),
            Some(r) => r.session().write_all(&mut sock, &[&out]),
        }
        .map_err(|e| handshake_error(e, timeout))?;
        match event {
            ClientEvent::Done(n) => break n,
            ClientEvent::StartTls => {
                let tls = tls.expect("STARTTLS is sent only with TLS settings");
                let session = Arc::new(Session::client(tls)?);
                let mut r = TlsReader::new(session, sock.try_clone()?, &[]);
                r.handshake(&mut sock).map_err(|e| {
                    let e = handshake_error(e, timeout);
                    io::Error::new(e.kind(), format!("TLS handshake: {e}"))
                })?;
                log::debug!("TLS with {}: {}", tls.server_name(), r.session().describe());
                reader = Some(r);
            }
            ClientEvent::NeedInput => {
                let mut buf = [0u8; 4096];
                let got = match &mut reader {
                    None => sock.read(&mut buf),
                    Some(r) => r.read(&mut buf).map_err(after_tls),
                }
                .map_err(|e| handshake_error(e, timeout))?;
                if got == 0 {
                    let e = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection during the handshake",
                    );
                    return Err(if reader.is_some() { after_tls(e) } else { e });
                }
                hs.feed(&buf[..got]);
            }
        }
    };
    if !negotiated.leftover.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the server sent data before any request",
        ));
    }
    // The reading side waits for replies as long as it takes (callers time out, not the
    // connection); a send that cannot progress for `timeout` fails and breaks the link.
    sock.set_timeouts(None, Some(timeout))?;
    let max = negotiated
        .block_size
        .map(|b| u64::from(b.max))
        .unwrap_or(REQUEST_BYTES_MAX)
        .clamp(4096, REQUEST_BYTES_MAX);
    Ok((
        Opened { sock, tls: reader },
        Export {
            size: negotiated.size_bytes,
            flags: negotiated.flags,
            max_request_bytes: max / 512 * 512,
        },
    ))
}

/// One request as the caller describes it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Req {
    pub command: Command,
    pub offset: u64,
    pub length: u32,
}

impl Req {
    fn is_write(&self) -> bool {
        matches!(
            self.command,
            Command::Write | Command::Trim | Command::WriteZeroes
        )
    }
}

/// What a caller gets for a request.
#[derive(Debug)]
pub(super) enum Outcome {
    /// The server's answer: a read's data (empty for other commands), or its error; or the
    /// error of a broken link that had writes at stake, or of a flush that reports a loss.
    Reply(io::Result<Vec<u8>>),
    /// Not answered and nothing is at stake (never sent, or in flight on a link that broke
    /// while every write was flushed): send it again on another link.
    Retry,
    /// No answer by the deadline, waiting for this.
    TimedOut(Waited),
}

/// What a timed-out request was waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Waited {
    /// A free slot on the link ([`IN_FLIGHT_MAX`] requests in flight).
    Room,
    /// The writer lock (another request's send was stuck); not sent.
    Send,
    /// The reply.
    Reply,
}

#[derive(Debug, Default)]
struct Waiter {
    outcome: Mutex<Option<Outcome>>,
    ready: Condvar,
}

impl Waiter {
    fn complete(&self, outcome: Outcome) {
        *self.outcome.lock() = Some(outcome);
        self.ready.notify_one();
    }
}

#[derive(Debug)]
struct Entry {
    /// Bytes of data that follow a successful reply (reads).
    read_bytes: usize,
    /// The durability number of a write-type request.
    write_seq: Option<u64>,
    /// For a flush: the writes it covers (`Durability::flush_covers` when it was sent).
    flush_covers: Option<u64>,
    /// `None` once the caller stopped waiting.
    waiter: Option<Arc<Waiter>>,
}

#[derive(Debug, Default)]
struct Pending {
    entries: HashMap<u64, Entry>,
    next_cookie: u64,
    broken: bool,
}

/// One established connection.
#[derive(Debug)]
pub(super) struct Link {
    /// Shut down to end the reading side's wait and every send.
    sock: Sock,
    writer: Mutex<Sock>,
    /// The TLS session, when TLS was started: requests are encrypted under the writer lock.
    tls: Option<Arc<Session>>,
    pending: Mutex<Pending>,
    room: Condvar,
}

/// The error of every request in flight on a broken link while writes were at stake.
fn lost_in_flight(uri: &str, cause: &io::Error) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!(
            "{uri}: the connection was lost with this request in flight ({cause}) and writes not \
             yet flushed, which the server may have lost; not sent again"
        ),
    )
}

/// The error of the flush that reports a lost connection.
pub(super) fn lost_writes(uri: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        format!(
            "{uri}: a connection to the server was lost while writes were not yet flushed; the \
             server may have lost them (a restart drops what it had not flushed)"
        ),
    )
}

impl Link {
    /// A link over an open connection, and the reading side for the connection's thread.
    pub(super) fn new(opened: Opened) -> io::Result<(Arc<Link>, Replies)> {
        let Opened { sock, tls } = opened;
        let session = tls.as_ref().map(|r| Arc::clone(r.session()));
        let incoming = match tls {
            None => Incoming::Plain(sock.try_clone()?),
            Some(reader) => Incoming::Tls(reader),
        };
        let reader = BufReader::with_capacity(READ_BUFFER_BYTES, incoming);
        let link = Link {
            writer: Mutex::new(sock.try_clone()?),
            tls: session,
            sock,
            pending: Mutex::new(Pending::default()),
            room: Condvar::new(),
        };
        Ok((Arc::new(link), reader))
    }

    pub(super) fn shutdown(&self) {
        self.sock.shutdown();
    }

    /// Tells the server we are leaving (best effort, not waiting long for the writer lock),
    /// then shuts the socket down.
    pub(super) fn disconnect(&self) {
        if let Some(mut w) = self.writer.try_lock_for(DISC_WAIT) {
            if send(&mut w, self.tls.as_deref(), &disc_request(), &[]).is_ok() {
                if let Some(session) = &self.tls {
                    // The spec: the client ends TLS after NBD_CMD_DISC.
                    let _ = session.close(&mut *w);
                }
            }
        }
        self.shutdown();
    }

    /// Sends one request (with `payload` for a write) and waits for its outcome until
    /// `deadline`.
    pub(super) fn exchange(
        &self,
        durability: &Mutex<Durability>,
        req: &Req,
        payload: &[u8],
        deadline: Instant,
    ) -> Outcome {
        let (cookie, waiter) = {
            let mut p = self.pending.lock();
            loop {
                if p.broken {
                    return Outcome::Retry;
                }
                if p.entries.len() < IN_FLIGHT_MAX {
                    break;
                }
                if self.room.wait_until(&mut p, deadline).timed_out() {
                    return Outcome::TimedOut(Waited::Room);
                }
            }
            p.next_cookie += 1;
            let cookie = p.next_cookie;
            let (write_seq, flush_covers) = {
                let mut d = durability.lock();
                (
                    req.is_write().then(|| d.begin_write()),
                    (req.command == Command::Flush).then(|| d.flush_covers()),
                )
            };
            let waiter = Arc::new(Waiter::default());
            let read_bytes = if req.command == Command::Read {
                req.length as usize
            } else {
                0
            };
            p.entries.insert(
                cookie,
                Entry {
                    read_bytes,
                    write_seq,
                    flush_covers,
                    waiter: Some(waiter.clone()),
                },
            );
            (cookie, waiter)
        };
        let mut header = Vec::with_capacity(Request::HEADER_BYTES);
        Request {
            flags: CommandFlags(0),
            command: req.command,
            cookie,
            offset: req.offset,
            length: req.length,
        }
        .encode(&mut header);
        match self.writer.try_lock_until(deadline) {
            Some(mut w) => {
                if send(&mut w, self.tls.as_deref(), &header, payload).is_err() {
                    // Part of the request may be on the wire: the stream is no longer framed.
                    // The reading side then answers every request in flight, this one too.
                    drop(w);
                    self.shutdown();
                }
            }
            None => {
                if self.withdraw(durability, cookie) {
                    return Outcome::TimedOut(Waited::Send);
                }
                // The link broke meanwhile and already answered for it.
            }
        }
        let mut o = waiter.outcome.lock();
        loop {
            if let Some(outcome) = o.take() {
                return outcome;
            }
            if waiter.ready.wait_until(&mut o, deadline).timed_out() {
                break;
            }
        }
        drop(o);
        let mut p = self.pending.lock();
        if let Some(e) = p.entries.get_mut(&cookie) {
            e.waiter = None; // a late reply is read and dropped
            return Outcome::TimedOut(Waited::Reply);
        }
        drop(p);
        // Answered between the timeout and taking the table's lock.
        let outcome = waiter.outcome.lock().take();
        outcome.expect("an entry leaves the table only with its outcome set")
    }

    /// Removes a request that was never sent; false if the link already answered for it.
    fn withdraw(&self, durability: &Mutex<Durability>, cookie: u64) -> bool {
        let mut p = self.pending.lock();
        let Some(e) = p.entries.remove(&cookie) else {
            return false;
        };
        if let Some(seq) = e.write_seq {
            durability.lock().end_write(seq);
        }
        self.room.notify_all();
        true
    }

    /// The connection thread's loop: reads replies and hands each to its caller until the
    /// connection fails; returns why.
    pub(super) fn read_replies(
        &self,
        r: &mut Replies,
        durability: &Mutex<Durability>,
        uri: &str,
    ) -> io::Error {
        loop {
            if let Err(e) = self.read_reply(r, durability, uri) {
                return e;
            }
        }
    }

    fn read_reply(
        &self,
        r: &mut Replies,
        durability: &Mutex<Durability>,
        uri: &str,
    ) -> io::Result<()> {
        let mut header = [0u8; 16];
        r.read_exact(&mut header).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(e.kind(), "the server closed the connection")
            } else {
                e
            }
        })?;
        let (cookie, error) = match decode_reply(&header, 0).map_err(io::Error::from)? {
            Decoded::Done {
                value: Reply::Simple { cookie, error },
                ..
            } => (cookie, error),
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a structured reply, which was not negotiated",
                ))
            }
        };
        let unknown = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a reply for cookie {cookie}, which is not in flight"),
            )
        };
        let read_bytes = match self.pending.lock().entries.get(&cookie) {
            Some(e) => e.read_bytes,
            None => return Err(unknown()),
        };
        if error == Some(NbdErrno::Eshutdown) {
            // Not carried out: sent again on another connection. The link's end answers the
            // others in flight by the reconnect rule.
            let mut p = self.pending.lock();
            if let Some(entry) = p.entries.remove(&cookie) {
                if let Some(seq) = entry.write_seq {
                    durability.lock().end_write(seq);
                }
                if let Some(w) = entry.waiter {
                    w.complete(Outcome::Retry);
                }
            }
            return Err(ServerShutdown::error());
        }
        let mut data = Vec::new();
        if error.is_none() && read_bytes > 0 {
            data.resize(read_bytes, 0);
            r.read_exact(&mut data)?;
        }
        let mut p = self.pending.lock();
        let was_full = p.entries.len() >= IN_FLIGHT_MAX;
        // Gone only if withdrawn: a reply to a request never sent.
        let entry = p.entries.remove(&cookie).ok_or_else(unknown)?;
        let result = {
            let mut d = durability.lock();
            if let Some(seq) = entry.write_seq {
                d.end_write(seq);
            }
            match (error, entry.flush_covers) {
                (Some(e), _) => Err(e.to_io_error()),
                (None, Some(covers)) => {
                    d.flushed(covers);
                    // Only a caller that hears it counts as told.
                    if entry.waiter.is_some() && d.take_unreported_loss() {
                        Err(lost_writes(uri))
                    } else {
                        Ok(data)
                    }
                }
                (None, None) => Ok(data),
            }
        };
        if let Some(w) = entry.waiter {
            w.complete(Outcome::Reply(result));
        }
        if was_full {
            self.room.notify_all();
        }
        Ok(())
    }

    /// The link is broken (`cause`): nothing is sent on it any more, and each request in
    /// flight is answered — `Retry` if every write was flushed, an error otherwise (and a loss
    /// is counted for the next flush to report). Returns whether a loss was counted.
    pub(super) fn fail(
        &self,
        durability: &Mutex<Durability>,
        uri: &str,
        cause: &io::Error,
    ) -> bool {
        self.shutdown();
        let mut p = self.pending.lock();
        p.broken = true;
        let entries = std::mem::take(&mut p.entries);
        let mut d = durability.lock();
        // Before the writes in flight end: they count as not flushed.
        let lost = d.connection_lost();
        for e in entries.into_values() {
            if let Some(seq) = e.write_seq {
                d.end_write(seq);
            }
            if let Some(w) = e.waiter {
                w.complete(if lost {
                    Outcome::Reply(Err(lost_in_flight(uri, cause)))
                } else {
                    Outcome::Retry
                });
            }
        }
        drop(d);
        drop(p);
        self.room.notify_all();
        lost
    }
}

/// Writes a request header and its payload, in one `writev` when the socket takes it, or
/// encrypted through `tls`.
fn send(w: &mut Sock, tls: Option<&Session>, header: &[u8], payload: &[u8]) -> io::Result<()> {
    if let Some(session) = tls {
        return session.write_all(w, &[header, payload]);
    }
    let n = loop {
        match w.write_vectored(&[IoSlice::new(header), IoSlice::new(payload)]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    if n < header.len() {
        w.write_all(&header[n..])?;
        w.write_all(payload)
    } else {
        w.write_all(&payload[n - header.len()..])
    }
}
