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
//! one more, up to `workers_per_connection`; the connection thread is the first worker.
//!
//! Owns: the threads and buffers of one connection, and the order of teardown: reading stops
//! (client disconnect, EOF, a protocol violation, a failed reply write, or a shutdown kick)
//! and no worker reads again; every worker finishes the request it holds and writes its reply;
//! when all workers have exited, the socket is closed and the export lease released.
//!
//! Invariants: requests in flight ≤ `requests_in_flight_max` and ≤ `workers_per_connection`
//! (a worker holds one request at a time), and their buffers ≤ `bytes_in_flight_max`
//! (enforced by [`Budget`]; a permit is taken before a payload is read and released after the
//! reply is written); at most one thread reads the socket (the read lock) and at most one
//! writes it (the write lock), and a reply is written whole under one hold of the write lock,
//! so replies never interleave; a write payload larger than `BlockSize::TIERCACHE.max` is never
//! read into memory (the connection is dropped instead, since the stream cannot be
//! resynchronised without consuming it). Each worker reuses one I/O buffer, kept between
//! requests only up to [`REUSE_BYTES_MAX`], so memory outside the budget is bounded by
//! workers × that; read data and write payloads start at a [`IO_ALIGN`]-aligned address, so an
//! O_DIRECT export needs no bounce buffer.
//!
//! Fault model: the client may send garbage, lie about lengths, stall, or vanish mid-request.
//! Each case ends in an error reply or in this connection closing; no panic, no effect on other
//! connections. Export errors become NBD error replies; a panicking export becomes an EIO reply
//! for that request (and an error log). A client that stops reading replies is cut off by the
//! write timeout: the write fails, the socket is shut down, reading ends, and the remaining
//! replies are dropped.

use crate::budget::{Budget, Permit};
use crate::export::{ExportRegistry, Lease};
use crate::net::Stream;
use crate::server::ServerConfig;
use crate::Export;
use nbd_proto::{
    encode_offset_data_header, encode_simple_reply, BlockSize, Chunk, Decoded, Extent, NbdErrno,
    Request, ServerEvent, ServerHandshake, TransmissionContext, ValidRequest,
};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, Scope};

/// Largest write payload read into memory; anything larger drops the connection.
const PAYLOAD_BYTES_MAX: u32 = BlockSize::TIERCACHE.max;
/// Most extents returned for one block status request (the spec lets us return fewer).
const EXTENT_COUNT_MAX: usize = 1024;
/// Bytes read from the socket at once.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Alignment of the data part of every worker buffer (a page: enough for O_DIRECT).
const IO_ALIGN: usize = 4096;
/// A worker keeps its I/O buffer between requests only up to this size.
const REUSE_BYTES_MAX: usize = 256 * 1024;

/// Serves one connection until it ends; errors are logged, never propagated.
pub(crate) fn serve(stream: Stream, id: u64, registry: &ExportRegistry, config: &ServerConfig) {
    match serve_inner(stream, id, registry, config) {
        Ok(()) => log::debug!("connection {id} closed"),
        Err(err) => log::info!("connection {id} ended: {err}"),
    }
}

fn serve_inner(
    mut stream: Stream,
    id: u64,
    registry: &ExportRegistry,
    config: &ServerConfig,
) -> io::Result<()> {
    stream.set_read_timeout(Some(config.handshake_timeout))?;
    stream.set_write_timeout(Some(config.reply_timeout))?;
    let mut hs = ServerHandshake::new();
    let mut buf = vec![0u8; 4096];
    let negotiated = loop {
        let event = hs.poll(registry);
        stream.write_all(&hs.take_output())?;
        match event.map_err(io::Error::from)? {
            ServerEvent::Done(negotiated) => break negotiated,
            ServerEvent::Aborted => return Ok(()),
            ServerEvent::NeedInput => {}
        }
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        hs.feed(&buf[..n]);
    };
    stream.set_read_timeout(None)?;
    let Some(lease) = registry.attach(&negotiated.export.name, id, stream.try_clone()?) else {
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
    let reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        io::Cursor::new(negotiated.leftover).chain(stream.try_clone()?),
    );
    transmission(reader, stream, lease, ctx, config)
}

fn transmission(
    reader: impl Read + Send,
    stream: Stream,
    lease: Lease,
    ctx: TransmissionContext,
    config: &ServerConfig,
) -> io::Result<()> {
    let conn = Connection {
        read: Mutex::new(ReadSide {
            reader,
            open: true,
            result: Ok(()),
            workers: 1,
        }),
        write: Mutex::new(WriteSide {
            stream,
            result: Ok(()),
        }),
        busy: AtomicUsize::new(0),
        budget: Budget::new(config.requests_in_flight_max, config.bytes_in_flight_max),
        ctx,
        export: lease.export().as_ref(),
        workers_max: config.workers_per_connection.max(1),
    };
    // The scope returns once every worker has exited, i.e. reading has ended and every request
    // read has been answered (or its reply dropped because the socket failed).
    thread::scope(|scope| conn.work(scope));
    let Connection { read, write, .. } = conn;
    let read = read.into_inner().unwrap_or_else(|p| p.into_inner());
    let write = write.into_inner().unwrap_or_else(|p| p.into_inner());
    write.stream.shutdown(Shutdown::Both);
    drop(lease);
    read.result.and(write.result)
}

/// The reading half of a connection, behind the read lock.
struct ReadSide<R> {
    reader: R,
    /// False once reading has ended; no worker reads again.
    open: bool,
    /// Why reading ended: `Ok` on a clean end (DISC or EOF between requests).
    result: io::Result<()>,
    /// Workers started so far (including the connection thread).
    workers: usize,
}

/// The writing half of a connection, behind the write lock.
struct WriteSide {
    stream: Stream,
    /// The first write error; once set, replies are dropped.
    result: io::Result<()>,
}

/// What the workers of one connection share.
struct Connection<'a, R> {
    read: Mutex<ReadSide<R>>,
    write: Mutex<WriteSide>,
    /// Workers holding a request (read but not yet answered).
    busy: AtomicUsize,
    budget: Arc<Budget>,
    ctx: TransmissionContext,
    export: &'a dyn Export,
    workers_max: usize,
}

/// A request read from the socket, with the budget it holds until its reply is written. A
/// write payload is in the reading worker's buffer.
enum Next {
    Run {
        cookie: u64,
        request: ValidRequest,
        permit: Permit,
    },
    Reject {
        cookie: u64,
        errno: NbdErrno,
        permit: Permit,
    },
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<'env, R: Read + Send> Connection<'env, R> {
    /// One worker: reads, executes and answers requests until reading ends.
    fn work<'scope>(&'env self, scope: &'scope Scope<'scope, 'env>) {
        let mut buf = IoBuf::default();
        let mut head = Vec::with_capacity(64);
        while let Some(next) = self.next_request(scope, &mut buf) {
            head.clear();
            let (data_bytes, permit) = match next {
                Next::Run {
                    cookie,
                    request,
                    permit,
                } => {
                    let run =
                        || execute(self.export, &self.ctx, cookie, request, &mut buf, &mut head);
                    match catch_unwind(AssertUnwindSafe(run)) {
                        Ok(data_bytes) => (data_bytes, permit),
                        Err(_) => {
                            log::error!("the export panicked serving request {cookie:#x}");
                            head.clear();
                            error_reply(
                                &self.ctx,
                                cookie,
                                NbdErrno::Eio,
                                "internal error",
                                &mut head,
                            );
                            (0, permit)
                        }
                    }
                }
                Next::Reject {
                    cookie,
                    errno,
                    permit,
                } => {
                    error_reply(&self.ctx, cookie, errno, "invalid request", &mut head);
                    (0, permit)
                }
            };
            self.send(&head, buf.data(data_bytes));
            drop(permit);
            self.busy.fetch_sub(1, Ordering::SeqCst);
            buf.shrink();
        }
    }

    /// Reads the next request under the read lock, starting another worker when every worker
    /// is busy; `None` once reading has ended.
    fn next_request<'scope>(
        &'env self,
        scope: &'scope Scope<'scope, 'env>,
        buf: &mut IoBuf,
    ) -> Option<Next> {
        let mut read = lock(&self.read);
        if !read.open {
            return None;
        }
        match read_request(&mut read.reader, &self.ctx, &self.budget, buf) {
            Ok(Some(next)) => {
                let busy = self.busy.fetch_add(1, Ordering::SeqCst) + 1;
                if busy >= read.workers && read.workers < self.workers_max {
                    let started = thread::Builder::new()
                        .name("nbd-worker".into())
                        .spawn_scoped(scope, move || self.work(scope));
                    match started {
                        Ok(_) => read.workers += 1,
                        // Serve with the workers we have.
                        Err(err) => log::warn!("could not start a worker: {err}"),
                    }
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

    /// Writes one reply whole; after a failed write, drops it.
    fn send(&self, head: &[u8], data: &[u8]) {
        let mut write = lock(&self.write);
        if write.result.is_err() {
            return;
        }
        if let Err(err) = write_all_two(&mut write.stream, head, data) {
            // Stop reading requests too: nobody will see their replies.
            write.stream.shutdown(Shutdown::Both);
            write.result = Err(err);
        }
    }
}

/// Reads one request; `Ok(None)` on a clean end (DISC or EOF between requests).
fn read_request(
    reader: &mut impl Read,
    ctx: &TransmissionContext,
    budget: &Arc<Budget>,
    buf: &mut IoBuf,
) -> io::Result<Option<Next>> {
    let mut header = [0u8; Request::HEADER_BYTES];
    if !read_header(reader, &mut header)? {
        return Ok(None);
    }
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
    let reply_bytes = match request.command {
        nbd_proto::Command::Read => request.length.min(PAYLOAD_BYTES_MAX),
        _ => 0,
    };
    let permit = budget.acquire(payload_bytes as usize + reply_bytes as usize);
    reader.read_exact(buf.slice(payload_bytes as usize))?;
    Ok(match ctx.validate(&request) {
        Ok(ValidRequest::Disconnect) => None,
        Ok(request_valid) => Some(Next::Run {
            cookie: request.cookie,
            request: request_valid,
            permit,
        }),
        Err(errno) => Some(Next::Reject {
            cookie: request.cookie,
            errno,
            permit,
        }),
    })
}

/// Fills `header`; `Ok(false)` on EOF before its first byte, an error on EOF inside it.
fn read_header(reader: &mut impl Read, header: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < header.len() {
        match reader.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes `a` then `b` completely, both in one `writev` when the socket takes them.
fn write_all_two(out: &mut impl Write, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let written = if a.is_empty() {
            out.write(b)
        } else {
            out.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
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

/// A worker's reusable I/O buffer whose data part starts at an [`IO_ALIGN`]-aligned address.
#[derive(Default)]
struct IoBuf(Vec<u8>);

impl IoBuf {
    fn start(&self) -> usize {
        let misalignment = self.0.as_ptr() as usize % IO_ALIGN;
        (IO_ALIGN - misalignment) % IO_ALIGN
    }

    /// `len` aligned bytes to fill; their contents are unspecified.
    fn slice(&mut self, len: usize) -> &mut [u8] {
        if len == 0 {
            return &mut [];
        }
        if self.0.len() < len + IO_ALIGN {
            // Replace rather than grow: the old contents need not be kept.
            self.0 = vec![0; len + IO_ALIGN];
        }
        let start = self.start();
        &mut self.0[start..start + len]
    }

    /// The first `len` bytes last handed out by [`IoBuf::slice`].
    fn data(&self, len: usize) -> &[u8] {
        if len == 0 {
            return &[];
        }
        let start = self.start();
        &self.0[start..start + len]
    }

    /// Frees a buffer too large to keep between requests.
    fn shrink(&mut self) {
        if self.0.len() > REUSE_BYTES_MAX + IO_ALIGN {
            self.0 = Vec::new();
        }
    }
}

/// Runs one validated request against the export; leaves the reply's header (or whole reply)
/// in `head` and returns how many bytes of `buf` (the read data) follow it.
fn execute(
    export: &dyn Export,
    ctx: &TransmissionContext,
    cookie: u64,
    request: ValidRequest,
    buf: &mut IoBuf,
    head: &mut Vec<u8>,
) -> usize {
    let outcome = match request {
        ValidRequest::Read { offset, length, .. } => {
            let data = buf.slice(length as usize);
            return match export.read(offset, data) {
                Ok(()) => {
                    if ctx.structured_replies {
                        // The data is read completely before anything is sent, so the one
                        // data chunk can carry the DONE flag.
                        encode_offset_data_header(cookie, true, offset, length, head);
                    } else {
                        encode_simple_reply(cookie, None, head);
                    }
                    length as usize
                }
                Err(err) => {
                    let errno = NbdErrno::from_io_error(&err);
                    error_reply(ctx, cookie, errno, &err.to_string(), head);
                    0
                }
            };
        }
        ValidRequest::BlockStatus {
            offset,
            length,
            req_one,
            context_id,
        } => {
            block_status_reply(
                export, ctx, cookie, offset, length, req_one, context_id, head,
            );
            return 0;
        }
        ValidRequest::Write {
            offset,
            length,
            fua,
        } => export.write(offset, buf.data(length as usize), fua),
        ValidRequest::Flush => export.flush(),
        ValidRequest::Trim {
            offset,
            length,
            fua,
        } => {
            if length == 0 {
                Ok(())
            } else {
                export.trim(offset, u64::from(length)).and_then(|()| {
                    if fua {
                        export.flush()
                    } else {
                        Ok(())
                    }
                })
            }
        }
        ValidRequest::WriteZeroes {
            offset,
            length,
            fua,
            no_hole,
            ..
        } => export.write_zeroes(offset, u64::from(length), fua, no_hole),
        ValidRequest::Cache { offset, length } => export.cache(offset, u64::from(length)),
        ValidRequest::Disconnect => unreachable!("the reader handles disconnect"),
    };
    match outcome {
        Ok(()) => encode_simple_reply(cookie, None, head),
        Err(err) => error_reply(
            ctx,
            cookie,
            NbdErrno::from_io_error(&err),
            &err.to_string(),
            head,
        ),
    }
    0
}

/// An error reply: a structured error chunk when negotiated (required for reads), else simple.
fn error_reply(
    ctx: &TransmissionContext,
    cookie: u64,
    errno: NbdErrno,
    message: &str,
    out: &mut Vec<u8>,
) {
    if ctx.structured_replies {
        Chunk::error(errno, message).encode(cookie, true, out);
    } else {
        encode_simple_reply(cookie, Some(errno), out);
    }
}

#[allow(clippy::too_many_arguments)]
fn block_status_reply(
    export: &dyn Export,
    ctx: &TransmissionContext,
    cookie: u64,
    offset: u64,
    length: u32,
    req_one: bool,
    context_id: u32,
    out: &mut Vec<u8>,
) {
    let extents = match export.block_status(offset, u64::from(length)) {
        Ok(extents) => extents,
        Err(err) => {
            let errno = NbdErrno::from_io_error(&err);
            return error_reply(ctx, cookie, errno, &err.to_string(), out);
        }
    };
    let limit = if req_one { 1 } else { EXTENT_COUNT_MAX };
    let mut remaining = u64::from(length);
    let mut out_extents: Vec<Extent> = Vec::new();
    for (len, flags) in extents {
        let len = len.min(remaining);
        if len == 0 {
            continue;
        }
        remaining -= len;
        // `len <= length <= u32::MAX`, so the conversion cannot fail.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        let count = out_extents.len();
        match out_extents.last_mut() {
            Some(last) if last.flags == flags => last.length += len,
            _ if count == limit => break,
            _ => out_extents.push(Extent { length: len, flags }),
        }
        if remaining == 0 {
            break;
        }
    }
    if out_extents.is_empty() {
        // An export that reports nothing: status 0 ("allocated, unknown contents") is always
        // a safe answer.
        out_extents.push(Extent { length, flags: 0 });
    }
    Chunk::BlockStatus {
        context_id,
        extents: out_extents,
    }
    .encode(cookie, true, out);
}
