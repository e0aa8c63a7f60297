//! Error types: the protocol's error codes ([`NbdErrno`]) and connection-fatal decode errors
//! ([`ProtoError`]).
//!
//! Owns: the mapping between `std::io::Error` and NBD error codes, in both directions.
//!
//! Invariants: an [`NbdErrno`] is always one of the codes the spec allows on the wire; unknown
//! codes from a peer are mapped to `EINVAL` only when decoded with [`NbdErrno::from_wire`].
//!
//! Fault model: [`NbdErrno`] is answered to the peer and the connection goes on;
//! a [`ProtoError`] means the byte stream cannot be trusted any more and the connection must end.

use std::fmt;
use std::io;

/// The error values the NBD protocol allows in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NbdErrno {
    Eperm,
    Eio,
    Enomem,
    Einval,
    Enospc,
    Eoverflow,
    Enotsup,
    Eshutdown,
}

impl NbdErrno {
    /// The value sent on the wire.
    pub fn code(self) -> u32 {
        match self {
            NbdErrno::Eperm => 1,
            NbdErrno::Eio => 5,
            NbdErrno::Enomem => 12,
            NbdErrno::Einval => 22,
            NbdErrno::Enospc => 28,
            NbdErrno::Eoverflow => 75,
            NbdErrno::Enotsup => 95,
            NbdErrno::Eshutdown => 108,
        }
    }

    /// Decodes a wire value; `None` for zero (success). Unknown non-zero values become `EINVAL`,
    /// as the spec asks clients to treat them.
    pub fn from_wire(code: u32) -> Option<NbdErrno> {
        Some(match code {
            0 => return None,
            1 => NbdErrno::Eperm,
            5 => NbdErrno::Eio,
            12 => NbdErrno::Enomem,
            28 => NbdErrno::Enospc,
            75 => NbdErrno::Eoverflow,
            95 => NbdErrno::Enotsup,
            108 => NbdErrno::Eshutdown,
            _ => NbdErrno::Einval,
        })
    }

    /// Maps an I/O error from an export to the code the client sees. The OS error number wins
    /// over the kind, so that `EDQUOT`/`EFBIG` become `ENOSPC` and `EROFS` becomes `EPERM`.
    /// Never `ESHUTDOWN`: that one tells the client this server is shutting down (the spec has
    /// the client disconnect), which only the server itself decides; an export's error that
    /// says so of another server (a remote backing device going away, a broken pipe) is `EIO`.
    pub fn from_io_error(err: &io::Error) -> NbdErrno {
        if let Some(errno) = err.raw_os_error() {
            match errno {
                libc::EPERM | libc::EACCES | libc::EROFS => return NbdErrno::Eperm,
                libc::ENOMEM => return NbdErrno::Enomem,
                libc::EINVAL => return NbdErrno::Einval,
                libc::ENOSPC | libc::EDQUOT | libc::EFBIG => return NbdErrno::Enospc,
                libc::EOVERFLOW => return NbdErrno::Eoverflow,
                libc::ENOTSUP | libc::ENOSYS => return NbdErrno::Enotsup,
                _ => return NbdErrno::Eio,
            }
        }
        NbdErrno::from_io_kind(err.kind())
    }

    /// Maps an `io::ErrorKind`; anything not listed is `EIO`.
    pub fn from_io_kind(kind: io::ErrorKind) -> NbdErrno {
        match kind {
            io::ErrorKind::PermissionDenied => NbdErrno::Eperm,
            io::ErrorKind::OutOfMemory => NbdErrno::Enomem,
            io::ErrorKind::InvalidInput | io::ErrorKind::InvalidData => NbdErrno::Einval,
            io::ErrorKind::WriteZero => NbdErrno::Enospc,
            io::ErrorKind::Unsupported => NbdErrno::Enotsup,
            _ => NbdErrno::Eio,
        }
    }

    /// The `io::Error` a client-side user sees for this code.
    pub fn to_io_error(self) -> io::Error {
        let errno = match self {
            NbdErrno::Eperm => libc::EPERM,
            NbdErrno::Eio => libc::EIO,
            NbdErrno::Enomem => libc::ENOMEM,
            NbdErrno::Einval => libc::EINVAL,
            NbdErrno::Enospc => libc::ENOSPC,
            NbdErrno::Eoverflow => libc::EOVERFLOW,
            NbdErrno::Enotsup => libc::ENOTSUP,
            NbdErrno::Eshutdown => libc::ESHUTDOWN,
        };
        io::Error::from_raw_os_error(errno)
    }
}

impl fmt::Display for NbdErrno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            NbdErrno::Eperm => "EPERM",
            NbdErrno::Eio => "EIO",
            NbdErrno::Enomem => "ENOMEM",
            NbdErrno::Einval => "EINVAL",
            NbdErrno::Enospc => "ENOSPC",
            NbdErrno::Eoverflow => "EOVERFLOW",
            NbdErrno::Enotsup => "ENOTSUP",
            NbdErrno::Eshutdown => "ESHUTDOWN",
        };
        f.write_str(name)
    }
}

/// A violation that ends the connection: the peer broke a MUST of the protocol, or the server
/// refused something it cannot answer with an error reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtoError {
    /// A magic number did not match.
    BadMagic { expected: u64, found: u64 },
    /// The client set flags the server did not offer.
    BadClientFlags(u32),
    /// The server does not speak fixed newstyle.
    NotFixedNewstyle,
    /// A length field is larger than the named maximum.
    TooLong {
        what: &'static str,
        length: u64,
        max: u64,
    },
    /// The peer sent too many options.
    TooManyOptions,
    /// A message is internally inconsistent.
    Malformed(&'static str),
    /// `NBD_OPT_EXPORT_NAME` named an export that does not exist (cannot be answered).
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires TLS (cannot be answered).
    TlsRequired,
    /// The server answered an option with an error the client cannot continue from.
    Rejected {
        option: u32,
        reply_type: u32,
        message: String,
    },
    /// The handshake was used after it finished or failed.
    Finished,
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::BadMagic { expected, found } => {
                write!(f, "bad magic: expected {expected:#x}, found {found:#x}")
            }
            ProtoError::BadClientFlags(flags) => write!(f, "unsupported client flags {flags:#x}"),
            ProtoError::NotFixedNewstyle => f.write_str("server does not speak fixed newstyle"),
            ProtoError::TooLong { what, length, max } => {
                write!(f, "{what} length {length} exceeds maximum {max}")
            }
            ProtoError::TooManyOptions => f.write_str("too many options in one handshake"),
            ProtoError::Malformed(what) => write!(f, "malformed message: {what}"),
            ProtoError::UnknownExport(name) => write!(f, "unknown export {name:?}"),
            ProtoError::TlsRequired => f.write_str(
                "the client chose an export with NBD_OPT_EXPORT_NAME before starting TLS, \
                 which this server requires",
            ),
            ProtoError::Rejected {
                option,
                reply_type,
                message,
            } => {
                match crate::wire::option_name(*option) {
                    Some(name) => write!(f, "server rejected {name}")?,
                    None => write!(f, "server rejected option {option}")?,
                }
                match crate::wire::reply_error_name(*reply_type) {
                    Some(name) => write!(f, " with {name}: {message}"),
                    None => write!(f, " with reply {reply_type:#x}: {message}"),
                }
            }
            ProtoError::Finished => f.write_str("handshake already finished"),
        }
    }
}

impl std::error::Error for ProtoError {}

impl From<ProtoError> for io::Error {
    fn from(err: ProtoError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [NbdErrno; 8] = [
        NbdErrno::Eperm,
        NbdErrno::Eio,
        NbdErrno::Enomem,
        NbdErrno::Einval,
        NbdErrno::Enospc,
        NbdErrno::Eoverflow,
        NbdErrno::Enotsup,
        NbdErrno::Eshutdown,
    ];

    #[test]
    fn wire_codes_round_trip() {
        for e in ALL {
            assert_eq!(NbdErrno::from_wire(e.code()), Some(e));
            let back = if e == NbdErrno::Eshutdown {
                NbdErrno::Eio // an export's error never says this server is shutting down
            } else {
                e
            };
            assert_eq!(NbdErrno::from_io_error(&e.to_io_error()), back);
        }
        assert_eq!(NbdErrno::from_wire(0), None);
        assert_eq!(NbdErrno::from_wire(4242), Some(NbdErrno::Einval));
    }

    #[test]
    fn io_kinds_and_os_errors_map() {
        let kind = |k| NbdErrno::from_io_error(&io::Error::from(k));
        assert_eq!(kind(io::ErrorKind::PermissionDenied), NbdErrno::Eperm);
        assert_eq!(kind(io::ErrorKind::InvalidInput), NbdErrno::Einval);
        assert_eq!(kind(io::ErrorKind::Unsupported), NbdErrno::Enotsup);
        assert_eq!(kind(io::ErrorKind::OutOfMemory), NbdErrno::Enomem);
        assert_eq!(kind(io::ErrorKind::Other), NbdErrno::Eio);
        assert_eq!(kind(io::ErrorKind::ConnectionAborted), NbdErrno::Eio);
        assert_eq!(kind(io::ErrorKind::BrokenPipe), NbdErrno::Eio);
        let os = |n| NbdErrno::from_io_error(&io::Error::from_raw_os_error(n));
        assert_eq!(os(libc::EDQUOT), NbdErrno::Enospc);
        assert_eq!(os(libc::EFBIG), NbdErrno::Enospc);
        assert_eq!(os(libc::EROFS), NbdErrno::Eperm);
        assert_eq!(os(libc::EBADF), NbdErrno::Eio);
    }
}
