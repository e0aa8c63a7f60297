//! Carrying out one validated request against an [`Export`] and encoding its reply: shared by
//! the thread model (`connection`) and the io_uring data path (`ring`).
//!
//! Invariants: every request gets exactly one reply (a read's data follows its header, error
//! replies are structured when structured replies were negotiated, as reads require); export
//! errors become NBD errors through `NbdErrno::from_io_error`.

use crate::iobuf::IoBuf;
use crate::{Export, LossWatch};
use nbd_proto::{
    encode_offset_data_header, encode_simple_reply, Chunk, Extent, NbdErrno, Request,
    TransmissionContext, ValidRequest,
};
use std::sync::atomic::{AtomicBool, Ordering};

/// A received request as both data paths start it: validated, and refused with
/// `NBD_ESHUTDOWN` once its export has been removed (`removed`, see `export`), so that no
/// request reaches an export after its removal while every one is still answered. A
/// disconnect is always let through.
pub(crate) fn admit(
    ctx: &TransmissionContext,
    request: &Request,
    removed: &AtomicBool,
) -> Result<ValidRequest, NbdErrno> {
    match ctx.validate(request) {
        Ok(ValidRequest::Disconnect) => Ok(ValidRequest::Disconnect),
        Ok(_) if removed.load(Ordering::Acquire) => Err(NbdErrno::Eshutdown),
        other => other,
    }
}

/// The message of the error reply to a request `admit` refused.
pub(crate) fn refusal(errno: NbdErrno) -> &'static str {
    match errno {
        NbdErrno::Eshutdown => "the export was removed (detached)",
        _ => "invalid request",
    }
}

/// Most extents returned for one block status request (the spec lets us return fewer).
const EXTENT_COUNT_MAX: usize = 1024;

/// Runs one validated request against the export; leaves the reply's header (or whole reply)
/// in `head` and returns how many bytes of `buf` (the read data) follow it.
pub(crate) fn execute(
    export: &dyn Export,
    watch: &LossWatch,
    ctx: &TransmissionContext,
    cookie: u64,
    request: ValidRequest,
    buf: &mut IoBuf,
    head: &mut Vec<u8>,
) -> usize {
    let outcome = match request {
        ValidRequest::Read { offset, length, .. } => {
            let result = export.read(offset, buf.slice(length as usize));
            return read_reply(ctx, cookie, offset, length, result, head);
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
        } => watch.check_if(fua, export.write(offset, buf.data(length as usize), fua)),
        ValidRequest::Flush => watch.check(export.flush()),
        ValidRequest::Trim {
            offset,
            length,
            fua,
        } => {
            if length == 0 {
                Ok(())
            } else {
                let r = export.trim(offset, u64::from(length)).and_then(|()| {
                    if fua {
                        export.flush()
                    } else {
                        Ok(())
                    }
                });
                watch.check_if(fua, r)
            }
        }
        ValidRequest::WriteZeroes {
            offset,
            length,
            fua,
            no_hole,
            ..
        } => watch.check_if(
            fua,
            export.write_zeroes(offset, u64::from(length), fua, no_hole),
        ),
        ValidRequest::Cache { offset, length } => export.cache(offset, u64::from(length)),
        ValidRequest::Disconnect => unreachable!("the reader handles disconnect"),
    };
    simple_reply(ctx, cookie, outcome, head);
    0
}

/// The reply to a request without data (all but reads and block status) that ended with
/// `result`.
pub(crate) fn simple_reply(
    ctx: &TransmissionContext,
    cookie: u64,
    result: std::io::Result<()>,
    head: &mut Vec<u8>,
) {
    match result {
        Ok(()) => encode_simple_reply(cookie, None, head),
        Err(err) => error_reply(
            ctx,
            cookie,
            NbdErrno::from_io_error(&err),
            &err.to_string(),
            head,
        ),
    }
}

/// The reply to a read of `length` bytes at `offset` that ended with `result`: its header (or
/// whole error reply) in `head`; returns how many data bytes follow the header.
pub(crate) fn read_reply(
    ctx: &TransmissionContext,
    cookie: u64,
    offset: u64,
    length: u32,
    result: std::io::Result<()>,
    head: &mut Vec<u8>,
) -> usize {
    match result {
        Ok(()) => {
            if ctx.structured_replies {
                // The data is read completely before anything is sent, so the one data chunk
                // can carry the DONE flag.
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
    }
}

/// Largest write payload read into memory; anything larger drops the connection.
pub(crate) const PAYLOAD_BYTES_MAX: u32 = nbd_proto::BlockSize::TIERCACHE.max;

/// The bytes a request's budget permit covers: a write's payload; a read's reply and what the
/// export may copy to carry it out.
pub(crate) fn permit_bytes(export: &dyn Export, request: &nbd_proto::Request) -> usize {
    let reply_bytes = match request.command {
        nbd_proto::Command::Read => {
            let len = u64::from(request.length.min(PAYLOAD_BYTES_MAX));
            len + export
                .read_working_bytes(len)
                .min(u64::from(PAYLOAD_BYTES_MAX))
        }
        _ => 0,
    };
    request.payload_bytes() as usize + reply_bytes as usize
}

/// An error reply: a structured error chunk when negotiated (required for reads), else simple.
pub(crate) fn error_reply(
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
