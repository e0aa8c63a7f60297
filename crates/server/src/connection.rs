//! One client connection: handshake, then the transmission phase served by a small pool of
//! interchangeable workers that each read, execute and answer their own requests.
//!
//! Threading ("leader/followers", as nbdkit does): every worker runs the same loop — take the
//! read lock, read one request (header, budget permit, payload), release the read lock,
//! execute the request, take the write lock and write the whole reply with one `writev`. A
//! request is executed and answered by the thread that read it, so it crosses no thread
//! between the socket and its reply; meanwhile another worker already waits for the next
//! request, so a slow request never holds up reading or answering pipelined ones. Workers are
//! started as needed: a worker that has just read a request and finds every worker busy starts
//! one more, up to `workers_per_connection` and while the server-wide `workers_max` has room
//! (otherwise the connection goes on with the workers it has); the connection thread is the
//! first worker.
//!
//! Quick requests (`Export::is_quick`: a cache hit, a write the cache absorbs) with no further
//! request already buffered are the exception: the worker that read one keeps the read lock
//! while it executes and answers it, and reads on. Handing the socket to another worker costs
//! a thread wake-up per request (about 20 µs of latency at queue depth 1 on a 2-core VM), more
//! than a quick request takes; a request the client sends meanwhile waits at most that long.
//! A request that may wait on a slow device is always handed over first.
//!
//! TLS: when the client sends `NBD_OPT_STARTTLS` (and the server offers TLS), the connection
//! thread runs the TLS handshake within the handshake deadline, and from then on the reading
//! side and every reply go through the connection's TLS session (`transport`): reads under the
//! read lock, replies under the write lock, the session's own lock never held across a socket
//! call (the rule of `nbd_tls`), so the threading below is unchanged. At the end, a connection
//! whose replies all went out sends TLS `close_notify` before the socket is shut down.
//!
//! Owns: the threads and buffers of one connection, its budget account, and the order of
//! teardown: reading stops (client disconnect, EOF, a protocol violation, a timeout, a failed
//! reply write, eviction, displacement or idle close, or a shutdown kick) and no worker reads
//! again; every worker finishes the request it holds and writes its reply; when all workers
//! have exited, the socket is shut down and the export lease released. When the client has
//! gone (a reply write failed, or the socket hung up: closed or reset, which `poll` reports —
//! checked when reading ends and before executing any request of more than
//! [`REUSE_BYTES_MAX`]), requests read but not yet executed are dropped instead: only those
//! already inside the export finish, and nobody is answered.
//!
//! Invariants: requests in flight ≤ `requests_in_flight_max` and ≤ `workers_per_connection`
//! (a worker holds one request at a time), and their buffers are budgeted by the server-wide
//! [`Budget`] (a permit is taken before a payload is read and released after the reply is
//! written); a request is in flight, for idleness ([`Activity`]), from its first byte to its
//! reply, and it only starts if the connection is not being closed as idle; at most one
//! thread reads the socket (the read lock) and at most one writes it (the write lock), and a
//! reply is written whole under one hold of the write lock, so replies never interleave; a
//! write payload larger than `BlockSize::TIERCACHE.max` is never read into memory (the
//! connection is dropped instead, since the stream cannot be resynchronised without consuming
//! it). Each worker reuses one I/O buffer, kept between requests only up to
//! [`REUSE_BYTES_MAX`], so memory outside the budget is bounded by workers × that plus the
//! connection's read buffer; a larger buffer is an anonymous mapping of its own, unmapped as
//! soon as its reply is written or dropped, so it goes back to the system (not to an allocator
//! arena) while its bytes are still budgeted. Read data and write payloads start at a
//! [`IO_ALIGN`]-aligned address, so an O_DIRECT export needs no bounce buffer.
//!
//! Deadlines (each enforced per system call, with the socket timeout set to the time left):
//! the whole handshake within `handshake_timeout`; the rest of a request within
//! `request_timeout` of its first byte, and a write's payload within `request_timeout` of its
//! permit; one whole reply within `reply_timeout` of taking the write lock; with
//! `idle_close_after`, the next request before the connection has been idle that long.
//!
//! Fault model: the client may send garbage, lie about lengths, stall, trickle, or vanish
//! mid-request. Each case ends in an error reply or in this connection closing; no panic, no
//! effect on other connections. Export errors become NBD error replies; a panicking export
//! becomes an EIO reply for that request (and an error log). A client that does not take a
//! reply within `reply_timeout` is cut off: the socket is shut down, reading ends, the
//! remaining replies are dropped, requests not yet executed are dropped unexecuted, and their
//! permits released.

use crate::budget::{Account, Permit};
use crate::config::Shared;
use crate::execute::{admit, error_reply, execute, refusal};
use crate::export::Lease;
use crate::iobuf::{IoBuf, REUSE_BYTES_MAX};
use crate::net::{Deadlined, Stream};
use crate::table::{Activity, InFlight};
use crate::transport::{Incoming, Outgoing};
use crate::{Export, LossWatch};
use nbd_proto::{
    Decoded, NbdErrno, Request, ServerEvent, ServerHandshake, TlsMode, TransmissionContext,
    ValidRequest,
};
use nbd_tls::TlsReader;
use std::io::{self, BufReader, Read};
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, Scope};
use std::time::{Duration, Instant};

use crate::execute::PAYLOAD_BYTES_MAX;
/// Bytes read from the socket at once.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Bytes read from the socket at once during the handshake.
const HANDSHAKE_READ_BYTES: usize = 4096;
/// Longest wait to send TLS `close_notify` at the end of a connection (a few dozen bytes,
/// which the socket buffer normally takes at once).
const CLOSE_NOTIFY_WAIT: Duration = Duration::from_secs(1);

/// What to do about a client certificate the TLS handshake refused (`None`: the handshake
/// failed for another reason). rustls (webpki) accepts only X.509 version 3 certificates,
/// which GnuTLS and OpenSSL clients present without complaint in any version.
pub fn client_certificate_fix(handshake_error: &str) -> Option<&'static str> {
    if handshake_error.contains("UnsupportedCertVersion") {
        Some(
            "the client's certificate is X.509 version 1, and only version 3 is accepted: \
             issue it again as version 3 (openssl x509 -req ... -extfile FILE with \
             extendedKeyUsage = clientAuth; certtool and rcgen make version 3)",
        )
    } else if handshake_error.contains("invalid peer certificate") {
        Some(
            "the client's certificate must chain to the CA of --tls-ca, be current, and \
             allow clientAuth (extendedKeyUsage)",
        )
    } else {
        None
    }
}

/// Serves one connection until it ends; errors are logged, never propagated. A client that
/// hung up (its socket closed under a reply, as `nbdinfo` does after NBD_OPT_ABORT) is a normal
/// end, logged at debug level like a clean close; anything else is worth an info line.
pub(crate) fn serve(
    stream: &Arc<Stream>,
    id: u64,
    activity: &Arc<Activity>,
    shared: &Arc<Shared>,
    rings: Option<&crate::ring::Rings>,
) {
    match serve_inner(stream, id, activity, shared, rings) {
        Ok(()) => log::debug!("connection {id} closed"),
        Err(err) if client_hung_up(&err) => log::debug!("connection {id} closed: {err}"),
        Err(err) => log::info!("connection {id} ended: {err}"),
    }
}

/// Whether an error only says that the client closed its end.
fn client_hung_up(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

/// Names a passed deadline in an error.
fn timeout_context(err: io::Error, what: &str, limit: Duration) -> io::Error {
    if err.kind() == io::ErrorKind::TimedOut {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{what} took longer than {limit:?}"),
        )
    } else {
        err
    }
}

fn serve_inner(
    stream: &Arc<Stream>,
    id: u64,
    activity: &Arc<Activity>,
    shared: &Arc<Shared>,
    rings: Option<&crate::ring::Rings>,
) -> io::Result<()> {
    let config = &shared.config;
    let registry = &shared.registry;
    let deadline = Some(Instant::now() + config.handshake_timeout);
    let mut incoming = Incoming::Plain(Deadlined::new(stream, deadline));
    let mut outgoing = Outgoing::Plain;
    let tls_mode = match &config.tls {
        None => TlsMode::Off,
        Some(tls) if tls.required => TlsMode::Require,
        Some(_) => TlsMode::On,
    };
    let mut hs = ServerHandshake::with_tls(tls_mode);
    let mut buf = vec![0u8; HANDSHAKE_READ_BYTES];
    let handshake = |err| timeout_context(err, "the handshake", config.handshake_timeout);
    let negotiated = loop {
        let event = hs.poll(registry);
        outgoing
            .write_all(stream, deadline, &[&hs.take_output()])
            .map_err(handshake)?;
        match event.map_err(io::Error::from)? {
            ServerEvent::Done(negotiated) => break negotiated,
            ServerEvent::Aborted => {
                // The client ends TLS too; ours is a courtesy.
                let _ = outgoing.close(stream, Instant::now() + CLOSE_NOTIFY_WAIT);
                return Ok(());
            }
            ServerEvent::StartTls { leftover } => {
                let tls = config
                    .tls
                    .as_ref()
                    .expect("the handshake acknowledges STARTTLS only when TLS is configured");
                let session = Arc::new(nbd_tls::Session::server(&tls.credentials)?);
                let mut reader = TlsReader::new(
                    Arc::clone(&session),
                    Deadlined::new(stream, deadline),
                    &leftover,
                );
                reader
                    .handshake(&mut Deadlined::new(stream, deadline))
                    .map_err(|e| {
                        let e = timeout_context(e, "the TLS handshake", config.handshake_timeout);
                        if let Some(fix) = client_certificate_fix(&e.to_string()) {
                            // The client sees only "TLS fatal alert": the reason and the fix
                            // are for the operator.
                            log::warn!("connection {id}: client certificate refused ({e}): {fix}");
                        }
                        io::Error::new(e.kind(), format!("TLS handshake: {e}"))
                    })?;
                log::debug!(
                    "connection {id}: TLS {}{}",
                    session.describe(),
                    if session.peer_has_certificate() {
                        ", client certificate verified"
                    } else {
                        ""
                    }
                );
                incoming = Incoming::Tls(reader);
                outgoing = Outgoing::Tls(session);
                continue;
            }
            ServerEvent::NeedInput => {}
        }
        let n = match incoming.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(handshake(err)),
        };
        activity.touch();
        hs.feed(&buf[..n]);
    };
    let Some(lease) = registry.attach(
        &negotiated.export.name,
        id,
        Arc::clone(stream),
        Arc::clone(activity),
    ) else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "export removed during handshake",
        ));
    };
    let ctx = TransmissionContext::from_negotiated(&negotiated);
    log::debug!(
        "connection {id}: export {:?}, structured {}, flags {:#x}",
        negotiated.export.name,
        ctx.structured_replies,
        ctx.flags.0
    );
    if let (Some(rings), Incoming::Plain(_), Outgoing::Plain) = (rings, &incoming, &outgoing) {
        // The io_uring data path serves the transmission phase; this thread waits for it.
        let outcome = Arc::new(crate::ring::Outcome::default());
        rings.adopt(crate::ring::Adopted {
            id,
            stream: Arc::clone(stream),
            leftover: negotiated.leftover,
            export: Arc::clone(lease.export()),
            removed: Arc::clone(lease.removed()),
            watch: Arc::new(LossWatch::new(Arc::clone(lease.export()))),
            ctx,
            activity: Arc::clone(activity),
            shared: Arc::clone(shared),
            outcome: Arc::clone(&outcome),
        });
        let result = outcome.wait();
        stream.shutdown(Shutdown::Both);
        return result;
    }
    incoming.set_deadline(None);
    let reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        io::Cursor::new(negotiated.leftover).chain(incoming),
    );
    transmission(reader, stream, outgoing, &lease, ctx, activity, shared)
}

/// The socket's reading side: bytes left over from the handshake, then the socket (through
/// TLS if the client started it).
type RequestReader<'a> = BufReader<io::Chain<io::Cursor<Vec<u8>>, Incoming<'a>>>;

fn set_deadline(reader: &mut RequestReader<'_>, deadline: Option<Instant>) {
    reader.get_mut().get_mut().1.set_deadline(deadline);
}

fn transmission(
    reader: RequestReader<'_>,
    stream: &Stream,
    outgoing: Outgoing,
    lease: &Lease,
    ctx: TransmissionContext,
    activity: &Arc<Activity>,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let conn = Connection {
        read: Mutex::new(ReadSide {
            reader,
            open: true,
            result: Ok(()),
            workers: 1,
        }),
        write: Mutex::new(Ok(())),
        gone: AtomicBool::new(false),
        stream,
        outgoing,
        account: shared.budget.account(),
        activity,
        shared,
        ctx,
        export: lease.export().as_ref(),
        watch: LossWatch::new(Arc::clone(lease.export())),
        removed: lease.removed(),
    };
    // The scope returns once every worker has exited, i.e. reading has ended and every request
    // read has been answered (or its reply dropped because the socket failed).
    thread::scope(|scope| conn.work(scope));
    let Connection {
        read,
        write,
        outgoing,
        ..
    } = conn;
    let read = read.into_inner().unwrap_or_else(|p| p.into_inner());
    let write = write.into_inner().unwrap_or_else(|p| p.into_inner());
    if write.is_ok() {
        // The spec: after NBD_CMD_DISC the server closes TLS, then the connection.
        let _ = outgoing.close(stream, Instant::now() + CLOSE_NOTIFY_WAIT);
    }
    stream.shutdown(Shutdown::Both);
    read.result.and(write)
}

/// The reading half of a connection, behind the read lock.
struct ReadSide<'a> {
    reader: RequestReader<'a>,
    /// False once reading has ended; no worker reads again.
    open: bool,
    /// Why reading ended: `Ok` on a clean end (DISC, EOF between requests, idle close).
    result: io::Result<()>,
    /// Workers started so far (including the connection thread).
    workers: usize,
}

/// What the workers of one connection share.
struct Connection<'a> {
    read: Mutex<ReadSide<'a>>,
    /// The first write error; once set, replies are dropped. Held while writing a reply.
    write: Mutex<io::Result<()>>,
    /// The client is known to have gone (a reply could not be written, or the socket hung up):
    /// nothing more is read, and requests read but not yet executed are dropped unexecuted.
    gone: AtomicBool,
    stream: &'a Stream,
    /// How replies reach the socket (in clear or through TLS); used under the write lock.
    outgoing: Outgoing,
    account: Arc<Account>,
    activity: &'a Arc<Activity>,
    shared: &'a Shared,
    ctx: TransmissionContext,
    export: &'a dyn Export,
    /// What this connection was told of losses below the export.
    watch: LossWatch,
    /// Set once the export is removed: requests are refused from then on.
    removed: &'a std::sync::atomic::AtomicBool,
}

/// A request read from the socket, with the budget it holds until its reply is written. A
/// write payload is in the reading worker's buffer.
struct Next {
    cookie: u64,
    /// The request, or why it is rejected.
    action: Result<ValidRequest, NbdErrno>,
    permit: Permit,
    in_flight: InFlight,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<'a> Connection<'a> {
    /// One worker: reads, executes and answers requests until reading ends.
    fn work<'scope, 'env: 'scope>(&'env self, scope: &'scope Scope<'scope, 'env>)
    where
        'a: 'env,
    {
        let mut buf = IoBuf::default();
        let mut head = Vec::with_capacity(64);
        // The read lock, kept across a quick request (see `next_request`).
        let mut held: Option<MutexGuard<'env, ReadSide<'a>>> = None;
        loop {
            let mut read = held.take().unwrap_or_else(|| lock(&self.read));
            let Some(next) = self.next_request(&mut read, &mut buf) else {
                break;
            };
            if self.client_gone(&next) {
                // Nobody will read its reply: drop it unexecuted (releasing its budget), and
                // the next round ends reading.
                drop(read);
                buf.shrink();
                drop(next);
                continue;
            }
            if self.keeps_reading(&read, &next) {
                held = Some(read);
            } else {
                self.hand_over(scope, &mut read, &next);
                drop(read);
            }
            head.clear();
            let cookie = next.cookie;
            let data_bytes = match next.action {
                Ok(request) => {
                    let run = || {
                        execute(
                            self.export,
                            &self.watch,
                            &self.ctx,
                            cookie,
                            request,
                            &mut buf,
                            &mut head,
                        )
                    };
                    catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|_| {
                        log::error!("the export panicked serving request {cookie:#x}");
                        head.clear();
                        error_reply(
                            &self.ctx,
                            cookie,
                            NbdErrno::Eio,
                            "internal error",
                            &mut head,
                        );
                        0
                    })
                }
                Err(errno) => {
                    error_reply(&self.ctx, cookie, errno, refusal(errno), &mut head);
                    0
                }
            };
            self.send(&head, buf.data(data_bytes));
            // Free a large buffer while its bytes are still budgeted, then the budget, then
            // (last) the request's place in flight: an idle connection holds no permit.
            buf.shrink();
            drop(next.permit);
            drop(next.in_flight);
        }
    }

    /// Whether the worker that read `next` executes it still holding the read lock: when the
    /// export says it is quick (waits on no slow device) and no further request is already
    /// buffered. Then no other worker needs to be woken to read meanwhile, which at queue
    /// depth 1 saves a thread hand-over per request; a request the client sends meanwhile
    /// waits at most for this quick one.
    fn keeps_reading(&self, read: &ReadSide<'_>, next: &Next) -> bool {
        read.reader.buffer().is_empty()
            && !read.reader.get_ref().get_ref().1.has_buffered()
            && match &next.action {
                Ok(request) => self.export.is_quick(request),
                Err(_) => true,
            }
    }

    /// Before executing a request that may be slow with the read lock released: starts
    /// another worker when every worker is busy, so someone reads while it runs.
    fn hand_over<'scope, 'env: 'scope>(
        &'env self,
        scope: &'scope Scope<'scope, 'env>,
        read: &mut ReadSide<'a>,
        next: &Next,
    ) where
        'a: 'env,
    {
        let workers_max = self.shared.config.workers_per_connection;
        // Every worker was busy when this request started arriving (this one included).
        if next.in_flight.started_with() >= read.workers && read.workers < workers_max {
            // Without a slot, serve with the workers we have.
            if let Some(slot) = self.shared.threads.try_take() {
                let started = thread::Builder::new()
                    .name("nbd-worker".into())
                    .spawn_scoped(scope, move || {
                        let _slot = slot;
                        self.work(scope)
                    });
                match started {
                    Ok(_) => read.workers += 1,
                    Err(err) => log::warn!("could not start a worker: {err}"),
                }
            }
        }
    }

    /// Whether the client has gone, so `next` is not worth executing: a reply write failed
    /// earlier, or (checked with one `poll` for requests moving more than [`REUSE_BYTES_MAX`]
    /// bytes, where the system call costs nothing next to the copy) the socket hung up.
    fn client_gone(&self, next: &Next) -> bool {
        if self.gone.load(Ordering::Relaxed) {
            return true;
        }
        if next.permit.bytes() > REUSE_BYTES_MAX && self.stream.hung_up() {
            self.gone.store(true, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Reads the next request (the caller holds the read lock); `None` once reading has ended,
    /// or once the client has gone (see [`Connection::gone`]).
    fn next_request(&self, read: &mut ReadSide<'a>, buf: &mut IoBuf) -> Option<Next> {
        if read.open && self.gone.load(Ordering::Relaxed) {
            read.open = false;
        }
        if !read.open {
            return None;
        }
        let outcome = self.read_request(&mut read.reader, buf);
        if !matches!(outcome, Ok(Some(_))) && self.stream.hung_up() {
            // EOF or an error because the client closed its socket (not merely its sending
            // side): the requests other workers have read but not executed are dropped too.
            self.gone.store(true, Ordering::Relaxed);
        }
        match outcome {
            Ok(Some(next)) => {
                if !next.in_flight.received() {
                    // Displaced while this one arrived: it is answered, nothing more is read.
                    read.open = false;
                }
                Some(next)
            }
            Ok(None) => {
                read.open = false;
                None
            }
            Err(err) => {
                read.open = false;
                read.result = Err(err);
                None
            }
        }
    }

    /// Reads one request; `Ok(None)` on a clean end (DISC, EOF between requests, or the
    /// connection closed as idle).
    fn read_request(
        &self,
        reader: &mut RequestReader<'_>,
        buf: &mut IoBuf,
    ) -> io::Result<Option<Next>> {
        let request_timeout = self.shared.config.request_timeout;
        let late = |err| timeout_context(err, "receiving a request", request_timeout);
        let mut header = [0u8; Request::HEADER_BYTES];
        let Some(first) = self.wait_for_request(reader, &mut header)? else {
            return Ok(None);
        };
        let Some(in_flight) = self.activity.begin_request() else {
            // Closed as idle to make room for another connection just as this one arrived.
            return Ok(None);
        };
        set_deadline(reader, Some(Instant::now() + request_timeout));
        reader.read_exact(&mut header[first..]).map_err(late)?;
        let request = match Request::decode(&header).map_err(io::Error::from)? {
            Decoded::Done { value, .. } => value,
            Decoded::Needed(_) => unreachable!("a full header was read"),
        };
        let payload_bytes = request.payload_bytes();
        if payload_bytes > PAYLOAD_BYTES_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("write payload of {payload_bytes} bytes exceeds the maximum"),
            ));
        }
        let permit = self
            .account
            .acquire(crate::execute::permit_bytes(self.export, &request));
        set_deadline(reader, Some(Instant::now() + request_timeout));
        reader
            .read_exact(buf.slice(payload_bytes as usize))
            .map_err(late)?;
        let action = match admit(&self.ctx, &request, self.removed) {
            Ok(ValidRequest::Disconnect) => return Ok(None),
            other => other,
        };
        Ok(Some(Next {
            cookie: request.cookie,
            action,
            permit,
            in_flight,
        }))
    }

    /// Waits for the first bytes of the next request header, filling `header` from its start:
    /// how many arrived, or `None` on EOF or when the connection was closed for having been
    /// idle `idle_close_after`.
    fn wait_for_request(
        &self,
        reader: &mut RequestReader<'_>,
        header: &mut [u8],
    ) -> io::Result<Option<usize>> {
        let idle_close_after = self.shared.config.idle_close_after;
        loop {
            set_deadline(
                reader,
                idle_close_after.map(|after| self.activity.idle_deadline(after)),
            );
            match reader.read(header) {
                Ok(0) => return Ok(None),
                Ok(n) => return Ok(Some(n)),
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) if err.kind() == io::ErrorKind::TimedOut => {
                    let Some(after) = idle_close_after else {
                        return Err(err);
                    };
                    if self.activity.close_if_idle(after, Instant::now()) {
                        let counters = &self.shared.table.counters;
                        counters.idle_closed.fetch_add(1, Ordering::Relaxed);
                        log::debug!("closing a connection idle for {after:?}");
                        return Ok(None);
                    }
                    // Not idle long enough (a request was in flight): wait on.
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// Writes one reply whole within `reply_timeout`; after a failed write, drops it.
    fn send(&self, head: &[u8], data: &[u8]) {
        let mut result = lock(&self.write);
        if result.is_err() {
            return;
        }
        let reply_timeout = self.shared.config.reply_timeout;
        let deadline = Some(Instant::now() + reply_timeout);
        if let Err(err) = self
            .outgoing
            .write_all(self.stream, deadline, &[head, data])
        {
            // Stop reading requests too, and drop those read but not executed: nobody will see
            // their replies.
            self.gone.store(true, Ordering::Relaxed);
            self.stream.shutdown(Shutdown::Both);
            *result = Err(timeout_context(err, "writing a reply", reply_timeout));
        }
    }
}
