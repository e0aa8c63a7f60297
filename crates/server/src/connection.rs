//! One client connection: handshake, then the transmission phase with a reader, a bounded pool
//! of workers and a single reply writer.
//!
//! Owns: the threads and buffers of one connection, and the order of teardown: the reader stops
//! (client disconnect, EOF, a protocol violation, or a shutdown kick), the workers finish every
//! accepted request, the writer sends every reply, then the socket is closed.
//!
//! Invariants: requests in flight ≤ `requests_in_flight_max` and their buffers ≤
//! `bytes_in_flight_max` (enforced by [`Budget`]); only the writer thread writes to the socket
//! after the handshake; a write payload larger than `BlockSize::TIERCACHE.max` is never read
//! into memory (the connection is dropped instead, since the stream cannot be resynchronised
//! without consuming it).
//!
//! Fault model: the client may send garbage, lie about lengths, stall, or vanish mid-request.
//! Each case ends in an error reply or in this connection closing; no panic, no effect on other
//! connections. Export errors become NBD error replies. A client that stops reading replies is
//! cut off by the write timeout.

use crate::budget::{Budget, Permit};
use crate::export::{ExportRegistry, Lease};
use crate::net::Stream;
use crate::server::ServerConfig;
use nbd_proto::{
    encode_offset_data_header, encode_simple_reply, BlockSize, Chunk, Decoded, Extent, NbdErrno,
    Request, ServerEvent, ServerHandshake, TransmissionContext, ValidRequest,
};
use std::io::{self, BufReader, Read, Write};
use std::net::Shutdown;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread;

/// Largest write payload read into memory; anything larger drops the connection.
const PAYLOAD_BYTES_MAX: u32 = BlockSize::TIERCACHE.max;
/// Most extents returned for one block status request (the spec lets us return fewer).
const EXTENT_COUNT_MAX: usize = 1024;
/// Bytes read from the socket at once.
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// A reply ready to be written, with the budget it holds until written.
struct Outgoing {
    bytes: Vec<u8>,
    _permit: Permit,
}

/// An accepted request for a worker.
struct Job {
    cookie: u64,
    request: ValidRequest,
    payload: Vec<u8>,
    permit: Permit,
}

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
    mut reader: impl Read,
    stream: Stream,
    lease: Lease,
    ctx: TransmissionContext,
    config: &ServerConfig,
) -> io::Result<()> {
    let budget = Budget::new(config.requests_in_flight_max, config.bytes_in_flight_max);
    let (reply_tx, reply_rx) = sync_channel::<Outgoing>(config.requests_in_flight_max);
    let (job_tx, job_rx) = sync_channel::<Job>(config.requests_in_flight_max);
    let writer_stream = stream.try_clone()?;
    let writer = thread::Builder::new()
        .name("nbd-writer".into())
        .spawn(move || write_replies(writer_stream, reply_rx))?;
    let job_rx = Arc::new(Mutex::new(job_rx));
    let mut workers = Vec::with_capacity(config.workers_per_connection);
    for _ in 0..config.workers_per_connection {
        let job_rx = Arc::clone(&job_rx);
        let reply_tx = reply_tx.clone();
        let export = Arc::clone(lease.export());
        workers.push(
            thread::Builder::new()
                .name("nbd-worker".into())
                .spawn(move || work(export.as_ref(), &ctx, &job_rx, &reply_tx))?,
        );
    }
    let result = read_requests(&mut reader, &ctx, &budget, &job_tx, &reply_tx);
    drop(job_tx);
    for worker in workers {
        if worker.join().is_err() {
            log::error!("an export panicked in a worker thread");
        }
    }
    drop(reply_tx);
    let written = writer
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("reply writer panicked")));
    stream.shutdown(Shutdown::Both);
    drop(lease);
    result.and(written)
}

/// Reads requests until disconnect; returns `Ok` on a clean end (DISC or EOF between requests).
fn read_requests(
    reader: &mut impl Read,
    ctx: &TransmissionContext,
    budget: &Arc<Budget>,
    jobs: &SyncSender<Job>,
    replies: &SyncSender<Outgoing>,
) -> io::Result<()> {
    let mut header = [0u8; Request::HEADER_BYTES];
    loop {
        if !read_header(reader, &mut header)? {
            return Ok(());
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
        let mut payload = vec![0u8; payload_bytes as usize];
        reader.read_exact(&mut payload)?;
        match ctx.validate(&request) {
            Ok(ValidRequest::Disconnect) => return Ok(()),
            Ok(valid) => {
                let job = Job {
                    cookie: request.cookie,
                    request: valid,
                    payload,
                    permit,
                };
                if jobs.send(job).is_err() {
                    return Err(io::Error::other("all workers stopped"));
                }
            }
            Err(errno) => {
                let bytes = error_reply(ctx, request.cookie, errno, "invalid request");
                if replies
                    .send(Outgoing {
                        bytes,
                        _permit: permit,
                    })
                    .is_err()
                {
                    return Err(io::Error::other("reply writer stopped"));
                }
            }
        }
    }
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

fn write_replies(mut stream: Stream, replies: Receiver<Outgoing>) -> io::Result<()> {
    let mut result = Ok(());
    for reply in replies {
        if result.is_ok() {
            result = stream.write_all(&reply.bytes);
            if result.is_err() {
                // Stop reading requests too: nobody will see their replies.
                stream.shutdown(Shutdown::Both);
            }
        }
    }
    result
}

fn work(
    export: &dyn crate::Export,
    ctx: &TransmissionContext,
    jobs: &Mutex<Receiver<Job>>,
    replies: &SyncSender<Outgoing>,
) {
    loop {
        let job = {
            let rx = jobs.lock().unwrap_or_else(|p| p.into_inner());
            rx.recv()
        };
        let Ok(job) = job else { return };
        let bytes = execute(export, ctx, job.cookie, job.request, &job.payload);
        if replies
            .send(Outgoing {
                bytes,
                _permit: job.permit,
            })
            .is_err()
        {
            return;
        }
    }
}

/// Runs one validated request against the export and encodes its reply.
fn execute(
    export: &dyn crate::Export,
    ctx: &TransmissionContext,
    cookie: u64,
    request: ValidRequest,
    payload: &[u8],
) -> Vec<u8> {
    let outcome = match request {
        ValidRequest::Read { offset, length, .. } => {
            return read_reply(export, ctx, cookie, offset, length)
        }
        ValidRequest::BlockStatus {
            offset,
            length,
            req_one,
            context_id,
        } => return block_status_reply(export, ctx, cookie, offset, length, req_one, context_id),
        ValidRequest::Write { offset, fua, .. } => export.write(offset, payload, fua),
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
        Ok(()) => {
            let mut out = Vec::with_capacity(nbd_proto::SimpleReplyHeader::BYTES);
            encode_simple_reply(cookie, None, &mut out);
            out
        }
        Err(err) => error_reply(ctx, cookie, NbdErrno::from_io_error(&err), &err.to_string()),
    }
}

/// An error reply: a structured error chunk when negotiated (required for reads), else simple.
fn error_reply(ctx: &TransmissionContext, cookie: u64, errno: NbdErrno, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if ctx.structured_replies {
        Chunk::error(errno, message).encode(cookie, true, &mut out);
    } else {
        encode_simple_reply(cookie, Some(errno), &mut out);
    }
    out
}

fn read_reply(
    export: &dyn crate::Export,
    ctx: &TransmissionContext,
    cookie: u64,
    offset: u64,
    length: u32,
) -> Vec<u8> {
    let mut out = Vec::new();
    let data_bytes = length as usize;
    out.reserve_exact(nbd_proto::ChunkHeader::BYTES + 8 + data_bytes);
    if ctx.structured_replies {
        // The data is read completely before anything is sent, so the one data chunk can
        // carry the DONE flag.
        encode_offset_data_header(cookie, true, offset, length, &mut out);
    } else {
        encode_simple_reply(cookie, None, &mut out);
    }
    let start = out.len();
    out.resize(start + data_bytes, 0);
    match export.read(offset, &mut out[start..]) {
        Ok(()) => out,
        Err(err) => error_reply(ctx, cookie, NbdErrno::from_io_error(&err), &err.to_string()),
    }
}

fn block_status_reply(
    export: &dyn crate::Export,
    ctx: &TransmissionContext,
    cookie: u64,
    offset: u64,
    length: u32,
    req_one: bool,
    context_id: u32,
) -> Vec<u8> {
    let extents = match export.block_status(offset, u64::from(length)) {
        Ok(extents) => extents,
        Err(err) => {
            return error_reply(ctx, cookie, NbdErrno::from_io_error(&err), &err.to_string())
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
    let mut out = Vec::new();
    Chunk::BlockStatus {
        context_id,
        extents: out_extents,
    }
    .encode(cookie, true, &mut out);
    out
}
