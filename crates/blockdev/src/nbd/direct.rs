//! Connections of a remote device lent whole to a caller that carries one request on each
//! itself, with asynchronous I/O of its own (the io_uring data path): [`NbdDirect`]. The
//! request then crosses no thread of the device: no hand-over to a worker that waits, none
//! from the connection thread that reads the reply.
//!
//! Owns: the device's spare connections (idle or lent), their opening (one at a time, on a
//! thread of its own, when a caller found none idle), and the protocol of one request on a
//! lent connection (its header, the check of its reply).
//!
//! Invariants:
//! - offered only for a server that advertises `NBD_FLAG_CAN_MULTI_CONN` (a flush sent on a
//!   shared connection then covers what a spare one answered, and reads on any connection see
//!   writes answered on any) and only without TLS (records need the session's state); at most
//!   `spare_connections` (8 by default, `?spare-connections=N`) per device, on top of the
//!   shared ones, none with 0;
//! - a lent connection carries exactly one request: the caller sends [`NbdDirect::request`]
//!   (and a write's payload right after it), reads the 16-byte reply header and hands it to
//!   [`NbdDirect::reply`], reads the data `reply` says follows, then calls
//!   [`NbdDirect::done`]. Only a lease that reached `done` gives its connection back to the
//!   idle ones; any other end (an I/O error, a short transfer, a protocol violation, the
//!   deadline, the device's close, a lease dropped half way, an `NBD_ESHUTDOWN` reply, which
//!   is closed after an `NBD_CMD_DISC` as the spec asks) closes the connection, so a
//!   connection is never reused with part of another request's reply in it;
//! - a write is numbered in the device's durability bookkeeping from when it is lent until
//!   its reply is read; a lease that ends with its write sent and unanswered counts a loss
//!   (the next flush fails), as a shared connection that breaks with writes in flight does.
//!   A spare connection that breaks with nothing at stake counts nothing: the shared
//!   connections, each always reading, see a server restart themselves;
//! - a read whose lent connection broke (not an error reply, not the deadline; an
//!   `NBD_ESHUTDOWN` reply counts as broken: the read was not carried out) while no write is
//!   unflushed may be sent again by the caller on the shared connections
//!   ([`NbdDirect::may_resend`]), as those resend a read in flight on one that breaks; a
//!   write answered `NBD_ESHUTDOWN` counts as in flight on a broken connection;
//! - an idle connection the server closed (or sent anything on) is never lent: it is checked
//!   with a non-blocking peek when taken, and closed;
//! - at close, every spare connection's socket is shut down (idle and lent: the caller's
//!   operations on a lent one end with an error) and no new one is published.
//!
//! Fault model: the server is untrusted (a reply with another cookie or a structured reply
//! closes the connection and fails the request); a connection that cannot be opened is not
//! tried again for [`RETRY_AFTER`] (requests take the shared connections meanwhile).

use super::link::{disc_request, ServerShutdown, Sock};
use super::shared::{Live, Shared};
use super::spares::Spares;
use nbd_proto::{
    decode_reply, Command, CommandFlags, Decoded, NbdErrno, Reply, Request, SimpleReplyHeader,
    TransmissionFlags,
};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After a spare connection could not be opened, none is tried for this long.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// The key of the opening connection's socket in the device's `connecting` table.
const OPENING_KEY: usize = usize::MAX;

/// Spare connections that could not be opened, logged at most once a minute.
static OPEN_FAILED: lograte::Throttled = lograte::Throttled::new();

/// Where a lent request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Not sent yet: the connection can go back as it is.
    Lent,
    /// Its header was asked for (it may be on the wire).
    Sent,
    /// Its reply header was read and checked; a read's data may follow.
    Answered,
    /// Everything of it was read: the connection is clean.
    Done,
    /// The connection is no longer framed, or was shut down.
    Broken,
}

/// One request lent a connection of its own (see the module header).
#[derive(Debug)]
pub struct NbdDirect {
    shared: Arc<Shared>,
    id: u64,
    /// Taken back by the drop.
    sock: Option<Sock>,
    header: [u8; Request::HEADER_BYTES],
    cookie: u64,
    read_bytes: usize,
    write_seq: Option<u64>,
    deadline: Instant,
    stage: Stage,
    timed_out: bool,
    /// The server answered `NBD_ESHUTDOWN`: the connection is closed after an
    /// `NBD_CMD_DISC`, as the spec asks.
    disconnect: bool,
}

/// Why the device lends no connection at all, if it lends none (said once when it connects).
pub(super) fn lending_off(shared: &Shared) -> Option<&'static str> {
    if shared.options.spare_connections == 0 {
        Some("spare-connections=0")
    } else if shared.tls.is_some() {
        Some("the connection uses TLS")
    } else if !shared
        .export
        .flags
        .contains(TransmissionFlags::CAN_MULTI_CONN)
    {
        Some("the server does not advertise multi-conn")
    } else {
        None
    }
}

/// Lends a spare connection for one request, if one is idle; else starts opening one (when
/// allowed) for a later request and returns `None`: this one takes the shared connections.
pub(super) fn lend(
    shared: &Arc<Shared>,
    command: Command,
    offset: u64,
    len: usize,
) -> Option<NbdDirect> {
    let export = &shared.export;
    let write = command == Command::Write;
    if lending_off(shared).is_some()
        || !matches!(command, Command::Read | Command::Write)
        || len == 0
        || len as u64 > export.max_request_bytes
        || (write && export.flags.contains(TransmissionFlags::READ_ONLY))
        || crate::check_range(export.size / 512 * 512, offset, len as u64).is_err()
    {
        return None;
    }
    let (id, sock, cookie) = {
        let mut s = shared.spares.lock();
        if shared.closed.load(Ordering::SeqCst) {
            return None;
        }
        let (id, sock) = loop {
            let Some((id, sock)) = s.idle.pop() else {
                open_one(shared, &mut s);
                return None;
            };
            if still_open(&sock) {
                break (id, sock);
            }
            // The server closed it while it was idle (a restart): never lent, closed here.
            sock.shutdown();
            s.all.remove(&id);
        };
        s.next_cookie += 1;
        (id, sock, s.next_cookie)
    };
    let mut header = Vec::with_capacity(Request::HEADER_BYTES);
    Request {
        flags: CommandFlags(0),
        command,
        cookie,
        offset,
        length: len as u32,
    }
    .encode(&mut header);
    Some(NbdDirect {
        write_seq: write.then(|| shared.durability.lock().begin_write()),
        shared: Arc::clone(shared),
        id,
        sock: Some(sock),
        header: header.try_into().expect("a request header is 28 bytes"),
        cookie,
        read_bytes: if write { 0 } else { len },
        deadline: Instant::now() + shared.options.timeout,
        stage: Stage::Lent,
        timed_out: false,
        disconnect: false,
    })
}

/// Whether an idle connection is still open and silent: a server that closed it (it
/// restarted, or dropped idle clients) would fail the request lent it, which the shared
/// connections would have sent again. One non-blocking peek.
fn still_open(sock: &Sock) -> bool {
    let mut byte = 0u8;
    // SAFETY: a valid socket descriptor owned by `sock`, and a one-byte buffer alive for the
    // call.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
}

/// Starts opening a spare connection on a thread of its own, unless one is being opened,
/// the device has its share, or the last attempt failed less than [`RETRY_AFTER`] ago.
fn open_one(shared: &Arc<Shared>, s: &mut Spares) {
    if s.opening
        || s.all.len() >= shared.options.spare_connections
        || s.retry_at.is_some_and(|t| Instant::now() < t)
    {
        return;
    }
    s.opening = true;
    *shared.threads_live.lock() += 1;
    let sh = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("nbd-spare-open".into())
        .spawn(move || {
            let live = Live(sh);
            let opened = open_spare(&live.0);
            publish(&live.0, opened);
        });
    if spawned.is_err() {
        *shared.threads_live.lock() -= 1;
        s.opening = false;
        s.retry_at = Some(Instant::now() + RETRY_AFTER);
    }
}

/// Connects and negotiates one more connection to the same export, without TLS.
fn open_spare(shared: &Shared) -> io::Result<Sock> {
    shared
        .open_again(OPENING_KEY, None)?
        .into_plain()
        .ok_or_else(|| io::Error::other("a spare connection negotiated TLS"))
}

/// Publishes an opened spare connection (or notes the failure).
fn publish(shared: &Shared, opened: io::Result<Sock>) {
    let mut s = shared.spares.lock();
    s.opening = false;
    let closed = shared.closed.load(Ordering::SeqCst);
    match opened.and_then(|sock| Ok((sock.try_clone()?, sock))) {
        Ok((clone, sock)) if !closed => {
            s.next_id += 1;
            let id = s.next_id;
            s.all.insert(id, clone);
            s.idle.push((id, sock));
        }
        Ok((_, sock)) => sock.shutdown(),
        Err(_) if closed => {}
        Err(e) => {
            s.retry_at = Some(Instant::now() + RETRY_AFTER);
            OPEN_FAILED.log(
                log::Level::Warn,
                format!(
                    "{}: opening a spare connection failed ({e}); requests use the shared \
                     connections, retrying in {RETRY_AFTER:?}",
                    shared.uri
                ),
            );
        }
    }
}

impl NbdDirect {
    /// The connection's socket: the request is sent and its reply read on it.
    pub fn fd(&self) -> RawFd {
        self.sock.as_ref().expect("held until the drop").as_raw_fd()
    }

    /// The request's header, to send first (a write's payload follows it). Asking for it
    /// counts the request as sent.
    pub fn request(&mut self) -> &[u8] {
        if self.stage == Stage::Lent {
            self.stage = Stage::Sent;
        }
        &self.header
    }

    /// Bytes of a reply header.
    pub const REPLY_HEADER_BYTES: usize = SimpleReplyHeader::BYTES;

    /// Checks the reply header read whole after the request: `Ok(n)`, the request succeeded
    /// and `n` bytes of data follow (a read's); `Err`, the server's error (the connection
    /// stays framed) or a protocol violation (the connection is closed at the end).
    pub fn reply(&mut self, header: &[u8]) -> io::Result<usize> {
        let decoded = decode_reply(header, 0);
        let error = match decoded {
            Ok(Decoded::Done {
                value: Reply::Simple { cookie, error },
                ..
            }) if cookie == self.cookie && self.stage == Stage::Sent => error,
            _ => {
                self.stage = Stage::Broken;
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{}: a reply that is not the simple reply of request {} on its \
                         spare connection",
                        self.shared.uri, self.cookie
                    ),
                ));
            }
        };
        if error == Some(NbdErrno::Eshutdown) {
            // Not carried out, and the server is going: a read may be sent again elsewhere
            // (`may_resend`), a write counts as one a broken connection had in flight.
            self.stage = Stage::Broken;
            self.disconnect = true;
            if let Some(seq) = self.write_seq.take() {
                let mut d = self.shared.durability.lock();
                d.connection_lost();
                d.end_write(seq);
            }
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                format!("{}: {}", self.shared.uri, ServerShutdown),
            ));
        }
        self.stage = Stage::Answered;
        if let Some(seq) = self.write_seq.take() {
            self.shared.durability.lock().end_write(seq);
        }
        match error {
            None => Ok(self.read_bytes),
            Some(e) => {
                self.stage = Stage::Done;
                Err(e.to_io_error())
            }
        }
    }

    /// The request was carried out whole (its reply and data read): the connection goes
    /// back to the idle ones when the lease ends.
    pub fn done(&mut self) {
        if self.stage == Stage::Answered {
            self.stage = Stage::Done;
        }
    }

    /// Whether the request may be sent again on another connection after it failed: a read
    /// whose connection broke (not the server's error reply, not the deadline) while no
    /// write of the device is unflushed — the rule by which the shared connections resend a
    /// request in flight on a connection that breaks.
    pub fn may_resend(&self) -> bool {
        self.read_bytes > 0
            && self.stage == Stage::Broken
            && !self.timed_out
            && !self.shared.durability.lock().unflushed()
    }

    /// When the request must have been answered (the device's timeout from its lending).
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// The deadline passed: shuts the connection down, so the caller's operations on it end.
    pub fn abort(&mut self) {
        self.timed_out = true;
        self.stage = Stage::Broken;
        if let Some(sock) = &self.sock {
            sock.shutdown();
        }
    }

    /// The connection broke: an operation on it ended with `res` (a negative errno, or 0 for
    /// the peer's end), or the reply broke the protocol (`-EPROTO`). It is closed when the
    /// lease ends; the request fails with the returned error (a read may be resent, see
    /// [`NbdDirect::may_resend`]).
    pub fn failed(&mut self, res: i32) -> io::Error {
        self.stage = Stage::Broken;
        if self.timed_out {
            return io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{}: no reply within {:?}",
                    self.shared.uri, self.shared.options.timeout
                ),
            );
        }
        let cause = if res < 0 {
            io::Error::from_raw_os_error(-res)
        } else {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            )
        };
        io::Error::new(cause.kind(), format!("{}: {cause}", self.shared.uri))
    }
}

impl Drop for NbdDirect {
    fn drop(&mut self) {
        let sh = &self.shared;
        if let Some(seq) = self.write_seq.take() {
            let mut d = sh.durability.lock();
            if self.stage != Stage::Lent {
                // Sent (or partly) and never answered: the server may have it, or lose it.
                d.connection_lost();
            }
            d.end_write(seq);
        }
        let Some(sock) = self.sock.take() else {
            return;
        };
        let mut s = sh.spares.lock();
        if matches!(self.stage, Stage::Lent | Stage::Done) && !sh.closed.load(Ordering::SeqCst) {
            s.idle.push((self.id, sock));
            return;
        }
        let mut sock = sock;
        if self.disconnect {
            // Best effort: nothing else is in flight on it, so 28 bytes fit its buffer.
            let _ = sock.write_all(&disc_request());
        }
        sock.shutdown();
        s.all.remove(&self.id);
    }
}
