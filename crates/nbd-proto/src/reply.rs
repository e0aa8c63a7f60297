//! Transmission-phase replies: simple replies and structured reply chunks.
//!
//! Owns: the byte layout of every reply and a total decoder for the client side.
//!
//! Invariants: encoders produce chunks whose length field matches their payload; the decoder
//! never buffers a chunk payload larger than the caller's `chunk_payload_max`; error chunks
//! always carry a non-zero error.
//!
//! Fault model: the server is untrusted when decoding. A chunk whose length contradicts its
//! type, an unknown non-error chunk type, or a bad magic is a [`ProtoError`] (the client must
//! hang up). An unknown chunk type with the error bit set is surfaced as
//! [`Chunk::UnknownError`], which fails the request but keeps the connection, as the spec asks.
//! A simple reply to a successful read is followed by the data, whose length only the caller
//! knows; [`decode_reply`] does not consume it.

use crate::errors::{NbdErrno, ProtoError};
use crate::wire::{self, len_u32, Decoded, Reader};

/// Header of a simple reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReplyHeader {
    pub error: u32,
    pub cookie: u64,
}

impl SimpleReplyHeader {
    pub const BYTES: usize = 16;

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&wire::SIMPLE_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.error.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
    }
}

/// Appends a simple reply header; for a successful read the caller appends the data.
pub fn encode_simple_reply(cookie: u64, error: Option<NbdErrno>, out: &mut Vec<u8>) {
    SimpleReplyHeader {
        error: error.map_or(0, NbdErrno::code),
        cookie,
    }
    .encode(out);
}

/// Header of a structured reply chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub length: u32,
}

impl ChunkHeader {
    pub const BYTES: usize = 20;

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&wire::STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.kind.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }
}

/// One block status descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u32,
    pub flags: u32,
}

/// A structured reply chunk with its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    None,
    OffsetData {
        offset: u64,
        data: Vec<u8>,
    },
    OffsetHole {
        offset: u64,
        length: u32,
    },
    BlockStatus {
        context_id: u32,
        extents: Vec<Extent>,
    },
    Error {
        error: u32,
        message: String,
    },
    ErrorOffset {
        error: u32,
        message: String,
        offset: u64,
    },
    /// An error chunk of a type this crate does not know.
    UnknownError {
        kind: u16,
        error: u32,
        message: String,
    },
}

impl Chunk {
    /// The chunk type on the wire.
    pub fn kind(&self) -> u16 {
        match self {
            Chunk::None => wire::REPLY_TYPE_NONE,
            Chunk::OffsetData { .. } => wire::REPLY_TYPE_OFFSET_DATA,
            Chunk::OffsetHole { .. } => wire::REPLY_TYPE_OFFSET_HOLE,
            Chunk::BlockStatus { .. } => wire::REPLY_TYPE_BLOCK_STATUS,
            Chunk::Error { .. } => wire::REPLY_TYPE_ERROR,
            Chunk::ErrorOffset { .. } => wire::REPLY_TYPE_ERROR_OFFSET,
            Chunk::UnknownError { kind, .. } => *kind,
        }
    }

    /// An error chunk for an errno, with a message for humans.
    pub fn error(errno: NbdErrno, message: &str) -> Chunk {
        Chunk::Error {
            error: errno.code(),
            message: message.to_string(),
        }
    }

    /// Appends the chunk, header included.
    pub fn encode(&self, cookie: u64, done: bool, out: &mut Vec<u8>) {
        let mut payload = Vec::new();
        let put_error = |error: u32, message: &str, payload: &mut Vec<u8>| {
            assert!(error != 0, "error chunk with zero error");
            let message = truncate(message);
            let len = u16::try_from(message.len()).expect("message truncated to 4096 bytes");
            payload.extend_from_slice(&error.to_be_bytes());
            payload.extend_from_slice(&len.to_be_bytes());
            payload.extend_from_slice(message.as_bytes());
        };
        match self {
            Chunk::None => {}
            Chunk::OffsetData { offset, data } => {
                payload.extend_from_slice(&offset.to_be_bytes());
                payload.extend_from_slice(data);
            }
            Chunk::OffsetHole { offset, length } => {
                payload.extend_from_slice(&offset.to_be_bytes());
                payload.extend_from_slice(&length.to_be_bytes());
            }
            Chunk::BlockStatus {
                context_id,
                extents,
            } => {
                payload.extend_from_slice(&context_id.to_be_bytes());
                for e in extents {
                    payload.extend_from_slice(&e.length.to_be_bytes());
                    payload.extend_from_slice(&e.flags.to_be_bytes());
                }
            }
            Chunk::Error { error, message } | Chunk::UnknownError { error, message, .. } => {
                put_error(*error, message, &mut payload)
            }
            Chunk::ErrorOffset {
                error,
                message,
                offset,
            } => {
                put_error(*error, message, &mut payload);
                payload.extend_from_slice(&offset.to_be_bytes());
            }
        }
        ChunkHeader {
            flags: if done { wire::REPLY_FLAG_DONE } else { 0 },
            kind: self.kind(),
            cookie,
            length: len_u32(payload.len()),
        }
        .encode(out);
        out.extend_from_slice(&payload);
    }
}

fn truncate(message: &str) -> &str {
    let mut end = message.len().min(wire::STRING_BYTES_MAX);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    &message[..end]
}

/// Appends the header of an `OFFSET_DATA` chunk carrying `data_bytes` of data; the caller
/// appends exactly that many bytes (so reads can land directly in the output buffer).
pub fn encode_offset_data_header(
    cookie: u64,
    done: bool,
    offset: u64,
    data_bytes: u32,
    out: &mut Vec<u8>,
) {
    assert!(data_bytes > 0, "OFFSET_DATA must carry at least one byte");
    ChunkHeader {
        flags: if done { wire::REPLY_FLAG_DONE } else { 0 },
        kind: wire::REPLY_TYPE_OFFSET_DATA,
        cookie,
        length: data_bytes
            .checked_add(8)
            .expect("OFFSET_DATA chunk longer than u32"),
    }
    .encode(out);
    out.extend_from_slice(&offset.to_be_bytes());
}

/// A decoded reply message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A simple reply. If it answers a successful read, the data follows in the stream.
    Simple {
        cookie: u64,
        error: Option<NbdErrno>,
    },
    /// One structured chunk; `done` marks the last chunk of its request.
    Chunk {
        cookie: u64,
        done: bool,
        chunk: Chunk,
    },
}

/// Decodes one reply from the front of `buf`; chunk payloads over `chunk_payload_max` are
/// rejected before being buffered.
pub fn decode_reply(buf: &[u8], chunk_payload_max: u32) -> Result<Decoded<Reply>, ProtoError> {
    let mut r = Reader::new(buf);
    let Some(magic) = r.u32() else {
        return Ok(Decoded::Needed(4));
    };
    match magic {
        wire::SIMPLE_REPLY_MAGIC => {
            let (Some(error), Some(cookie)) = (r.u32(), r.u64()) else {
                return Ok(Decoded::Needed(SimpleReplyHeader::BYTES));
            };
            Ok(Decoded::Done {
                value: Reply::Simple {
                    cookie,
                    error: NbdErrno::from_wire(error),
                },
                consumed: SimpleReplyHeader::BYTES,
            })
        }
        wire::STRUCTURED_REPLY_MAGIC => {
            let (Some(flags), Some(kind), Some(cookie), Some(length)) =
                (r.u16(), r.u16(), r.u64(), r.u32())
            else {
                return Ok(Decoded::Needed(ChunkHeader::BYTES));
            };
            if length > chunk_payload_max {
                return Err(ProtoError::TooLong {
                    what: "reply chunk",
                    length: u64::from(length),
                    max: u64::from(chunk_payload_max),
                });
            }
            let total = ChunkHeader::BYTES + length as usize;
            let Some(payload) = r.bytes(length as usize) else {
                return Ok(Decoded::Needed(total));
            };
            let done = flags & wire::REPLY_FLAG_DONE != 0;
            let chunk = decode_chunk(kind, payload)?;
            if chunk == Chunk::None && !done {
                return Err(ProtoError::Malformed("NONE chunk without DONE flag"));
            }
            Ok(Decoded::Done {
                value: Reply::Chunk {
                    cookie,
                    done,
                    chunk,
                },
                consumed: total,
            })
        }
        other => Err(ProtoError::BadMagic {
            expected: u64::from(wire::STRUCTURED_REPLY_MAGIC),
            found: u64::from(other),
        }),
    }
}

fn decode_chunk(kind: u16, payload: &[u8]) -> Result<Chunk, ProtoError> {
    let mut r = Reader::new(payload);
    let chunk = match kind {
        wire::REPLY_TYPE_NONE => Chunk::None,
        wire::REPLY_TYPE_OFFSET_DATA => {
            let offset = r.u64().ok_or(ProtoError::Malformed("short OFFSET_DATA"))?;
            if r.remaining() == 0 {
                return Err(ProtoError::Malformed("OFFSET_DATA without data"));
            }
            Chunk::OffsetData {
                offset,
                data: r.rest().to_vec(),
            }
        }
        wire::REPLY_TYPE_OFFSET_HOLE => {
            let (Some(offset), Some(length)) = (r.u64(), r.u32()) else {
                return Err(ProtoError::Malformed("short OFFSET_HOLE"));
            };
            if length == 0 {
                return Err(ProtoError::Malformed("empty OFFSET_HOLE"));
            }
            Chunk::OffsetHole { offset, length }
        }
        wire::REPLY_TYPE_BLOCK_STATUS => {
            let context_id = r.u32().ok_or(ProtoError::Malformed("short BLOCK_STATUS"))?;
            if r.remaining() == 0 || !r.remaining().is_multiple_of(8) {
                return Err(ProtoError::Malformed("BLOCK_STATUS length not 4 + 8n"));
            }
            let mut extents = Vec::with_capacity(r.remaining() / 8);
            while let (Some(length), Some(flags)) = (r.u32(), r.u32()) {
                extents.push(Extent { length, flags });
            }
            Chunk::BlockStatus {
                context_id,
                extents,
            }
        }
        k if k & wire::REPLY_TYPE_FLAG_ERROR != 0 => {
            let (Some(error), Some(message_len)) = (r.u32(), r.u16()) else {
                return Err(ProtoError::Malformed("short error chunk"));
            };
            if error == 0 {
                return Err(ProtoError::Malformed("error chunk with zero error"));
            }
            let raw = r
                .bytes(usize::from(message_len))
                .ok_or(ProtoError::Malformed("error message longer than chunk"))?;
            let message = String::from_utf8_lossy(raw).into_owned();
            match k {
                wire::REPLY_TYPE_ERROR => Chunk::Error { error, message },
                wire::REPLY_TYPE_ERROR_OFFSET => {
                    let offset = r.u64().ok_or(ProtoError::Malformed("short ERROR_OFFSET"))?;
                    Chunk::ErrorOffset {
                        error,
                        message,
                        offset,
                    }
                }
                _ => {
                    r.rest();
                    Chunk::UnknownError {
                        kind: k,
                        error,
                        message,
                    }
                }
            }
        }
        _ => return Err(ProtoError::Malformed("unknown structured reply type")),
    };
    if r.remaining() != 0 {
        return Err(ProtoError::Malformed("trailing bytes in reply chunk"));
    }
    Ok(chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u32 = 1 << 20;

    fn round_trip(chunk: Chunk, done: bool) {
        let mut buf = Vec::new();
        chunk.encode(99, done, &mut buf);
        for cut in 0..buf.len() {
            assert!(matches!(
                decode_reply(&buf[..cut], MAX),
                Ok(Decoded::Needed(n)) if n > cut
            ));
        }
        assert_eq!(
            decode_reply(&buf, MAX),
            Ok(Decoded::Done {
                value: Reply::Chunk {
                    cookie: 99,
                    done,
                    chunk
                },
                consumed: buf.len()
            })
        );
    }

    #[test]
    fn every_chunk_round_trips() {
        round_trip(Chunk::None, true);
        round_trip(
            Chunk::OffsetData {
                offset: 4096,
                data: vec![1, 2, 3],
            },
            false,
        );
        round_trip(
            Chunk::OffsetHole {
                offset: 0,
                length: 512,
            },
            true,
        );
        round_trip(
            Chunk::BlockStatus {
                context_id: 1,
                extents: vec![
                    Extent {
                        length: 4096,
                        flags: wire::STATE_HOLE | wire::STATE_ZERO,
                    },
                    Extent {
                        length: 512,
                        flags: 0,
                    },
                ],
            },
            true,
        );
        round_trip(Chunk::error(NbdErrno::Eio, "disk on fire"), true);
        round_trip(
            Chunk::ErrorOffset {
                error: NbdErrno::Eio.code(),
                message: String::new(),
                offset: 1024,
            },
            false,
        );
        round_trip(
            Chunk::UnknownError {
                kind: 0x8123,
                error: 5,
                message: "x".into(),
            },
            true,
        );
    }

    #[test]
    fn simple_reply_and_offset_data_header() {
        let mut buf = Vec::new();
        encode_simple_reply(5, Some(NbdErrno::Enospc), &mut buf);
        assert_eq!(
            decode_reply(&buf, MAX),
            Ok(Decoded::Done {
                value: Reply::Simple {
                    cookie: 5,
                    error: Some(NbdErrno::Enospc)
                },
                consumed: 16
            })
        );
        let mut buf = Vec::new();
        encode_offset_data_header(3, true, 512, 4, &mut buf);
        buf.extend_from_slice(b"abcd");
        let mut expected = Vec::new();
        Chunk::OffsetData {
            offset: 512,
            data: b"abcd".to_vec(),
        }
        .encode(3, true, &mut expected);
        assert_eq!(buf, expected);
    }

    #[test]
    fn malformed_chunks_are_errors() {
        let header = |kind: u16, flags: u16, payload: &[u8]| {
            let mut buf = Vec::new();
            ChunkHeader {
                flags,
                kind,
                cookie: 1,
                length: payload.len() as u32,
            }
            .encode(&mut buf);
            buf.extend_from_slice(payload);
            decode_reply(&buf, MAX)
        };
        assert!(header(wire::REPLY_TYPE_NONE, 0, &[]).is_err());
        assert!(header(wire::REPLY_TYPE_NONE, 1, &[0]).is_err());
        assert!(header(wire::REPLY_TYPE_OFFSET_DATA, 1, &[0; 8]).is_err());
        assert!(header(wire::REPLY_TYPE_OFFSET_HOLE, 1, &[0; 12]).is_err());
        assert!(header(wire::REPLY_TYPE_BLOCK_STATUS, 1, &[0; 8]).is_err());
        assert!(header(wire::REPLY_TYPE_ERROR, 1, &[0, 0, 0, 5, 0, 9]).is_err());
        assert!(header(wire::REPLY_TYPE_ERROR, 1, &[0, 0, 0, 0, 0, 0]).is_err());
        assert!(header(77, 1, &[]).is_err());
        let mut huge = Vec::new();
        ChunkHeader {
            flags: 0,
            kind: 1,
            cookie: 0,
            length: MAX + 1,
        }
        .encode(&mut huge);
        assert!(matches!(
            decode_reply(&huge, MAX),
            Err(ProtoError::TooLong { .. })
        ));
        assert!(decode_reply(&[0xde, 0xad, 0xbe, 0xef], MAX).is_err());
    }
}
