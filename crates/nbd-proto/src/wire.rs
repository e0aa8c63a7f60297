//! Wire constants of the NBD protocol and a bounds-checked big-endian reader.
//!
//! Owns: every magic number and numeric code this crate puts on or reads from the wire, and the
//! named size limits that bound what a decoder may buffer.
//!
//! Invariants: [`Reader`] never indexes out of bounds; every read returns `None` when the buffer
//! is too short, so a decoder built on it cannot panic.
//!
//! Fault model: none of its own; it only turns short buffers into `None`.

/// `NBDMAGIC`, first 8 bytes sent by a newstyle server.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, sent by the server after `NBDMAGIC` and by the client before every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client wants no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// The spec's name of an option code, for messages (`None` for codes this crate does not know).
pub fn option_name(code: u32) -> Option<&'static str> {
    Some(match code {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        _ => return None,
    })
}

/// The spec's name of an option error reply type, for messages.
pub fn reply_error_name(reply_type: u32) -> Option<&'static str> {
    Some(match reply_type {
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP",
        REP_ERR_POLICY => "NBD_REP_ERR_POLICY",
        REP_ERR_INVALID => "NBD_REP_ERR_INVALID",
        REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM",
        REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD",
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN",
        REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN",
        REP_ERR_BLOCK_SIZE_REQD => "NBD_REP_ERR_BLOCK_SIZE_REQD",
        REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG",
        _ => return None,
    })
}

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// Bit set in every option error reply type.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Structured reply flag: this is the last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Bit set in every error chunk type.
pub const REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_FLAG_ERROR | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_FLAG_ERROR | 2;

/// `base:allocation` state: the extent is a hole.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` state: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// Longest string (export name, description, query, message) the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;
/// Largest option payload a server accepts; larger claims get `NBD_REP_ERR_TOO_BIG` and a
/// disconnect, never an allocation.
pub const OPTION_DATA_BYTES_MAX: u32 = 64 * 1024;
/// Largest option reply payload a client accepts.
pub const OPTION_REPLY_BYTES_MAX: u32 = 64 * 1024;
/// Most options a server answers in one handshake before it hangs up (denial of service bound).
pub const OPTION_COUNT_MAX: u32 = 1024;
/// Most metadata context queries accepted in one option.
pub const META_QUERY_COUNT_MAX: u32 = 256;
/// Most info requests accepted in one `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const INFO_REQUEST_COUNT_MAX: u16 = 64;

/// Result of a decoder that works on a growing buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded<T> {
    /// The buffer is a valid prefix; at least this many bytes in total are needed.
    Needed(usize),
    /// A complete value, which took `consumed` bytes from the front of the buffer.
    Done { value: T, consumed: usize },
}

/// Cursor over a byte slice; every read is bounds-checked and big-endian.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let out = &self.buf[self.pos..];
        self.pos = self.buf.len();
        out
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    /// A string of `n` bytes that must be UTF-8, NUL-free and at most [`STRING_BYTES_MAX`].
    pub(crate) fn string(&mut self, n: usize) -> Option<String> {
        if n > STRING_BYTES_MAX {
            return None;
        }
        let raw = self.bytes(n)?;
        if raw.contains(&0) {
            return None;
        }
        String::from_utf8(raw.to_vec()).ok()
    }
}

/// Appends a length-prefixed (u32) string.
pub(crate) fn put_str32(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&len_u32(s.len()).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Converts a length the caller built to u32; callers keep lengths far below 4 GiB.
pub(crate) fn len_u32(n: usize) -> u32 {
    u32::try_from(n).expect("encoded length exceeds u32: caller broke a size limit")
}
