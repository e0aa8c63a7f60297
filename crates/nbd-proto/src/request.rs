//! Transmission-phase requests: the 28-byte header codec and validation against what was
//! negotiated.
//!
//! Owns: the decision whether a request is acceptable, and which error code it gets if not
//! ([`TransmissionContext::validate`]), so that every embedder answers the same way.
//!
//! Invariants: a [`ValidRequest`] lies entirely inside the export, is aligned to the minimum
//! block size (or ends exactly at the end of the export), uses only flags that were advertised
//! and documented for its command, and a read or write is at most the maximum block size.
//!
//! Fault model: a bad magic is a [`ProtoError`] (the stream is lost). Everything else a client
//! can get wrong is an [`NbdErrno`] answered in the reply: unknown command or flag → `EINVAL`,
//! write/trim/zero on a read-only export → `EPERM`, past the end → `ENOSPC` for write and
//! write-zeroes and `EINVAL` otherwise (trim is only a hint), zero length → `EINVAL` (clients
//! should not send it; nbdkit answers the same), unaligned → `EINVAL`.

use crate::errors::{NbdErrno, ProtoError};
use crate::flags::{BlockSize, CommandFlags, TransmissionFlags};
use crate::server_handshake::Negotiated;
use crate::wire::{self, Decoded, Reader};

/// A request type; decoding is total, so unknown types are kept rather than rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Command {
    pub fn from_wire(value: u16) -> Command {
        match value {
            wire::CMD_READ => Command::Read,
            wire::CMD_WRITE => Command::Write,
            wire::CMD_DISC => Command::Disc,
            wire::CMD_FLUSH => Command::Flush,
            wire::CMD_TRIM => Command::Trim,
            wire::CMD_CACHE => Command::Cache,
            wire::CMD_WRITE_ZEROES => Command::WriteZeroes,
            wire::CMD_BLOCK_STATUS => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => wire::CMD_READ,
            Command::Write => wire::CMD_WRITE,
            Command::Disc => wire::CMD_DISC,
            Command::Flush => wire::CMD_FLUSH,
            Command::Trim => wire::CMD_TRIM,
            Command::Cache => wire::CMD_CACHE,
            Command::WriteZeroes => wire::CMD_WRITE_ZEROES,
            Command::BlockStatus => wire::CMD_BLOCK_STATUS,
            Command::Unknown(other) => other,
        }
    }
}

/// A request header as sent on the wire (write payload not included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request {
    pub flags: CommandFlags,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

impl Request {
    pub const HEADER_BYTES: usize = 28;

    /// Appends the 28-byte header; a write's payload must follow it.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&wire::REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.flags.0.to_be_bytes());
        out.extend_from_slice(&self.command.to_wire().to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        out.extend_from_slice(&self.length.to_be_bytes());
    }

    /// Decodes a header from the front of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Decoded<Request>, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(flags), Some(kind), Some(cookie), Some(offset), Some(length)) =
            (r.u32(), r.u16(), r.u16(), r.u64(), r.u64(), r.u32())
        else {
            return Ok(Decoded::Needed(Self::HEADER_BYTES));
        };
        if magic != wire::REQUEST_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: u64::from(wire::REQUEST_MAGIC),
                found: u64::from(magic),
            });
        }
        Ok(Decoded::Done {
            value: Request {
                flags: CommandFlags(flags),
                command: Command::from_wire(kind),
                cookie,
                offset,
                length,
            },
            consumed: Self::HEADER_BYTES,
        })
    }

    /// Bytes of payload that follow this header on the wire (the length of a write).
    pub fn payload_bytes(&self) -> u32 {
        if self.command == Command::Write {
            self.length
        } else {
            0
        }
    }
}

/// A request that passed validation, with its flags decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidRequest {
    Read {
        offset: u64,
        length: u32,
        /// Don't fragment: at most one content chunk.
        df: bool,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Disconnect,
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u32,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        fua: bool,
        no_hole: bool,
        fast: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
        context_id: u32,
    },
}

/// What the transmission phase of one connection agreed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmissionContext {
    pub size_bytes: u64,
    pub flags: TransmissionFlags,
    pub structured_replies: bool,
    pub base_allocation_id: Option<u32>,
    pub block_size: BlockSize,
}

impl TransmissionContext {
    pub fn from_negotiated(negotiated: &Negotiated) -> Self {
        TransmissionContext {
            size_bytes: negotiated.export.size_bytes,
            flags: negotiated.flags,
            structured_replies: negotiated.structured_replies,
            base_allocation_id: negotiated.base_allocation_id,
            block_size: negotiated.export.block_size,
        }
    }

    /// Checks a request against the spec and the negotiated flags.
    pub fn validate(&self, req: &Request) -> Result<ValidRequest, NbdErrno> {
        use TransmissionFlags as T;
        let advertised = |flag| self.flags.contains(flag);
        let (command_flags, needed_flag) = match req.command {
            Command::Unknown(_) => return Err(NbdErrno::Einval),
            Command::Read => (CommandFlags::DF, None),
            Command::Write | Command::Disc => (0, None),
            Command::Flush => (0, Some(T::SEND_FLUSH)),
            Command::Trim => (0, Some(T::SEND_TRIM)),
            Command::Cache => (0, Some(T::SEND_CACHE)),
            Command::WriteZeroes => (
                CommandFlags::NO_HOLE | CommandFlags::FAST_ZERO,
                Some(T::SEND_WRITE_ZEROES),
            ),
            Command::BlockStatus => (CommandFlags::REQ_ONE, None),
        };
        let mut allowed = command_flags | CommandFlags::FUA;
        for (flag, needs) in [
            (CommandFlags::FUA, T::SEND_FUA),
            (CommandFlags::DF, T::SEND_DF),
            (CommandFlags::FAST_ZERO, T::SEND_FAST_ZERO),
        ] {
            if !advertised(needs) {
                allowed &= !flag;
            }
        }
        if req.flags.0 & !allowed != 0 {
            return Err(NbdErrno::Einval);
        }
        if needed_flag.is_some_and(|flag| !advertised(flag)) {
            return Err(NbdErrno::Einval);
        }
        let writes = matches!(
            req.command,
            Command::Write | Command::Trim | Command::WriteZeroes
        );
        if writes && advertised(T::READ_ONLY) {
            return Err(NbdErrno::Eperm);
        }
        let (offset, length) = (req.offset, req.length);
        match req.command {
            Command::Disc => return Ok(ValidRequest::Disconnect),
            Command::Flush if offset != 0 || length != 0 => return Err(NbdErrno::Einval),
            Command::Flush => return Ok(ValidRequest::Flush),
            _ => {}
        }
        let context_id = match (req.command, self.base_allocation_id) {
            (Command::BlockStatus, None) => return Err(NbdErrno::Einval),
            (_, id) => id.unwrap_or(0),
        };
        let in_bounds = offset
            .checked_add(u64::from(length))
            .is_some_and(|end| end <= self.size_bytes);
        if !in_bounds {
            let writes_data = matches!(req.command, Command::Write | Command::WriteZeroes);
            return Err(if writes_data {
                NbdErrno::Enospc
            } else {
                NbdErrno::Einval
            });
        }
        if length == 0 {
            return Err(NbdErrno::Einval);
        }
        if matches!(req.command, Command::Read | Command::Write) && length > self.block_size.max {
            return Err(NbdErrno::Einval);
        }
        let min = u64::from(self.block_size.min);
        let ends_at_eof = offset + u64::from(length) == self.size_bytes;
        if offset % min != 0 || (u64::from(length) % min != 0 && !ends_at_eof) {
            return Err(NbdErrno::Einval);
        }
        let flag = |f| req.flags.contains(f);
        Ok(match req.command {
            Command::Read => ValidRequest::Read {
                offset,
                length,
                df: flag(CommandFlags::DF),
            },
            Command::Write => ValidRequest::Write {
                offset,
                length,
                fua: flag(CommandFlags::FUA),
            },
            Command::Trim => ValidRequest::Trim {
                offset,
                length,
                fua: flag(CommandFlags::FUA),
            },
            Command::Cache => ValidRequest::Cache { offset, length },
            Command::WriteZeroes => ValidRequest::WriteZeroes {
                offset,
                length,
                fua: flag(CommandFlags::FUA),
                no_hole: flag(CommandFlags::NO_HOLE),
                fast: flag(CommandFlags::FAST_ZERO),
            },
            Command::BlockStatus => ValidRequest::BlockStatus {
                offset,
                length,
                req_one: flag(CommandFlags::REQ_ONE),
                context_id,
            },
            Command::Disc | Command::Flush | Command::Unknown(_) => {
                unreachable!("handled before the range checks")
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flags::ExportCaps;

    const SIZE: u64 = 1 << 20;

    fn caps() -> ExportCaps {
        ExportCaps::ALL
    }

    fn ctx(caps: ExportCaps, structured: bool) -> TransmissionContext {
        TransmissionContext {
            size_bytes: SIZE,
            flags: caps.transmission_flags(structured),
            structured_replies: structured,
            base_allocation_id: structured.then_some(1),
            block_size: BlockSize::TIERCACHE,
        }
    }

    fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags: CommandFlags(flags),
            command,
            cookie: 7,
            offset,
            length,
        }
    }

    #[test]
    fn header_round_trips_and_rejects_bad_magic() {
        let r = req(Command::WriteZeroes, CommandFlags::NO_HOLE, 4096, 512);
        let mut buf = Vec::new();
        r.encode(&mut buf);
        assert_eq!(buf.len(), Request::HEADER_BYTES);
        for cut in 0..buf.len() {
            assert_eq!(Request::decode(&buf[..cut]), Ok(Decoded::Needed(28)));
        }
        assert_eq!(
            Request::decode(&buf),
            Ok(Decoded::Done {
                value: r,
                consumed: 28
            })
        );
        buf[3] ^= 0xff;
        assert!(Request::decode(&buf).is_err());
        let unknown = req(Command::Unknown(42), 0, 0, 0);
        let mut buf = Vec::new();
        unknown.encode(&mut buf);
        assert!(matches!(
            Request::decode(&buf),
            Ok(Decoded::Done { value, .. }) if value == unknown
        ));
        assert_eq!(req(Command::Write, 0, 0, 99).payload_bytes(), 99);
        assert_eq!(req(Command::Read, 0, 0, 99).payload_bytes(), 0);
    }

    #[test]
    fn accepts_every_command_with_its_flags() {
        let c = ctx(caps(), true);
        let ok = |r: Request| c.validate(&r).expect("valid");
        assert_eq!(
            ok(req(Command::Read, CommandFlags::DF, 0, 4096)),
            ValidRequest::Read {
                offset: 0,
                length: 4096,
                df: true
            }
        );
        assert_eq!(
            ok(req(Command::Write, CommandFlags::FUA, 512, 512)),
            ValidRequest::Write {
                offset: 512,
                length: 512,
                fua: true
            }
        );
        assert_eq!(ok(req(Command::Flush, 0, 0, 0)), ValidRequest::Flush);
        assert_eq!(ok(req(Command::Disc, 0, 0, 0)), ValidRequest::Disconnect);
        assert!(matches!(
            ok(req(Command::Trim, CommandFlags::FUA, 0, 1024)),
            ValidRequest::Trim { fua: true, .. }
        ));
        assert!(matches!(
            ok(req(Command::Cache, 0, 0, 1024)),
            ValidRequest::Cache { .. }
        ));
        assert!(matches!(
            ok(req(
                Command::WriteZeroes,
                CommandFlags::NO_HOLE | CommandFlags::FAST_ZERO,
                0,
                1024
            )),
            ValidRequest::WriteZeroes {
                no_hole: true,
                fast: true,
                fua: false,
                ..
            }
        ));
        assert!(matches!(
            ok(req(Command::BlockStatus, CommandFlags::REQ_ONE, 0, 1024)),
            ValidRequest::BlockStatus {
                req_one: true,
                context_id: 1,
                ..
            }
        ));
        // FUA is valid on every command once advertised.
        assert_eq!(
            ok(req(Command::Flush, CommandFlags::FUA, 0, 0)),
            ValidRequest::Flush
        );
    }

    #[test]
    fn rejects_per_spec() {
        let c = ctx(caps(), true);
        let err = |r: Request| c.validate(&r).expect_err("invalid");
        assert_eq!(err(req(Command::Unknown(99), 0, 0, 0)), NbdErrno::Einval);
        assert_eq!(err(req(Command::Read, 1 << 9, 0, 512)), NbdErrno::Einval);
        assert_eq!(
            err(req(Command::Read, CommandFlags::REQ_ONE, 0, 512)),
            NbdErrno::Einval
        );
        assert_eq!(
            err(req(Command::Write, CommandFlags::DF, 0, 512)),
            NbdErrno::Einval
        );
        assert_eq!(err(req(Command::Read, 0, SIZE, 512)), NbdErrno::Einval);
        assert_eq!(err(req(Command::Write, 0, SIZE, 512)), NbdErrno::Enospc);
        assert_eq!(
            err(req(Command::Trim, 0, SIZE - 512, 1024)),
            NbdErrno::Einval
        );
        for command in [Command::Read, Command::Write, Command::Trim, Command::Cache] {
            assert_eq!(err(req(command, 0, 0, 0)), NbdErrno::Einval);
            assert_eq!(err(req(command, 0, SIZE, 0)), NbdErrno::Einval);
        }
        assert_eq!(
            err(req(Command::WriteZeroes, 0, u64::MAX, 512)),
            NbdErrno::Enospc
        );
        assert_eq!(
            err(req(Command::BlockStatus, 0, SIZE, 512)),
            NbdErrno::Einval
        );
        assert_eq!(err(req(Command::BlockStatus, 0, 0, 0)), NbdErrno::Einval);
        assert_eq!(err(req(Command::Flush, 0, 1, 0)), NbdErrno::Einval);
        assert_eq!(err(req(Command::Read, 0, 1, 512)), NbdErrno::Einval);
        assert_eq!(err(req(Command::Read, 0, 0, 100)), NbdErrno::Einval);
        let big = BlockSize::TIERCACHE.max + 512;
        let mut huge = ctx(caps(), true);
        huge.size_bytes = 1 << 40;
        assert_eq!(
            huge.validate(&req(Command::Read, 0, 0, big)),
            Err(NbdErrno::Einval)
        );

        let simple = ctx(caps(), false);
        assert_eq!(
            simple.validate(&req(Command::Read, CommandFlags::DF, 0, 512)),
            Err(NbdErrno::Einval)
        );
        assert_eq!(
            simple.validate(&req(Command::BlockStatus, 0, 0, 512)),
            Err(NbdErrno::Einval)
        );
        let ro = ctx(
            ExportCaps {
                read_only: true,
                trim: false,
                ..caps()
            },
            false,
        );
        assert_eq!(
            ro.validate(&req(Command::Write, 0, 0, 512)),
            Err(NbdErrno::Eperm)
        );
        assert_eq!(
            ro.validate(&req(Command::Trim, 0, 0, 512)),
            Err(NbdErrno::Einval)
        );
        assert!(ro.validate(&req(Command::Read, 0, 0, 512)).is_ok());
    }

    #[test]
    fn unaligned_tail_is_allowed_at_end_of_export() {
        let mut c = ctx(caps(), false);
        c.size_bytes = 1000;
        assert!(c.validate(&req(Command::Read, 0, 512, 488)).is_ok());
        assert_eq!(
            c.validate(&req(Command::Read, 0, 0, 488)),
            Err(NbdErrno::Einval)
        );
    }
}
