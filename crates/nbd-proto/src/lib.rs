//! Sans-I/O implementation of the NBD protocol (NetworkBlockDevice `doc/proto.md`).
//!
//! Owns: the wire format (big-endian), the fixed-newstyle handshake as two state machines
//! ([`ServerHandshake`], [`ClientHandshake`]) that are fed bytes and produce bytes, and the
//! transmission-phase codecs ([`Request`], [`Reply`], [`Chunk`]) with request validation
//! ([`TransmissionContext::validate`]).
//!
//! Invariants: nothing in this crate touches a socket, a file or a clock; every decoder is
//! total (it returns [`Decoded::Needed`], a value, or a [`ProtoError`], and never panics on any
//! input); no decoder allocates more than a named maximum, whatever length the peer claims.
//!
//! Fault model: the peer is untrusted. Malformed input that the protocol lets us answer becomes
//! an error reply (`NBD_REP_ERR_*` during the handshake, an [`NbdErrno`] during transmission);
//! input that makes the stream impossible to resynchronise becomes a [`ProtoError`], after which
//! the embedder must send any pending output and drop the connection.

mod client_handshake;
mod errors;
mod flags;
pub mod fuzzing;
mod option;
mod reply;
mod request;
mod server_handshake;
pub mod wire;

pub use client_handshake::{ClientConfig, ClientEvent, ClientHandshake, ClientNegotiated};
pub use errors::{NbdErrno, ProtoError};
pub use flags::{BlockSize, CommandFlags, ExportCaps, TransmissionFlags};
pub use option::{InfoReply, OptionReply, OptionReplyKind, OptionRequest};
pub use reply::{
    decode_reply, encode_offset_data_header, encode_simple_reply, Chunk, ChunkHeader, Extent,
    Reply, SimpleReplyHeader,
};
pub use request::{Command, Request, TransmissionContext, ValidRequest};
pub use server_handshake::{
    ExportCatalog, ExportInfo, ExportListing, Negotiated, ServerEvent, ServerHandshake, TlsMode,
};
pub use wire::Decoded;

/// The only metadata context this implementation knows.
pub const BASE_ALLOCATION: &str = "base:allocation";
