//! Codec for handshake options (client → server) and option replies (server → client).
//!
//! Owns: the byte layout of every option this crate understands and of every option reply.
//!
//! Invariants: [`OptionRequest::parse`] and [`OptionReply::decode`] are total; they bound every
//! count and string by the limits in [`crate::wire`] before allocating.
//!
//! Fault model: a syntactically invalid option is reported as `Err(reason)` by
//! [`OptionRequest::parse`] so that the server can answer `NBD_REP_ERR_INVALID` and continue;
//! a reply that breaks framing is a [`ProtoError`].

use crate::errors::ProtoError;
use crate::flags::{BlockSize, TransmissionFlags};
use crate::wire::{self, len_u32, put_str32, Decoded, Reader};

/// A handshake option sent by a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionRequest {
    ExportName(String),
    Abort,
    List,
    /// `NBD_OPT_STARTTLS`: upgrade the connection to TLS before anything else is negotiated.
    StartTls,
    Info {
        name: String,
        info_requests: Vec<u16>,
    },
    Go {
        name: String,
        info_requests: Vec<u16>,
    },
    StructuredReply,
    ListMetaContext {
        export: String,
        queries: Vec<String>,
    },
    SetMetaContext {
        export: String,
        queries: Vec<String>,
    },
    /// Any option this crate does not implement (answered with `NBD_REP_ERR_UNSUP`).
    Unknown {
        code: u32,
        data: Vec<u8>,
    },
}

impl OptionRequest {
    /// Bytes of the option header: magic, option code, data length.
    pub const HEADER_BYTES: usize = 16;

    pub fn code(&self) -> u32 {
        match self {
            OptionRequest::ExportName(_) => wire::OPT_EXPORT_NAME,
            OptionRequest::Abort => wire::OPT_ABORT,
            OptionRequest::List => wire::OPT_LIST,
            OptionRequest::StartTls => wire::OPT_STARTTLS,
            OptionRequest::Info { .. } => wire::OPT_INFO,
            OptionRequest::Go { .. } => wire::OPT_GO,
            OptionRequest::StructuredReply => wire::OPT_STRUCTURED_REPLY,
            OptionRequest::ListMetaContext { .. } => wire::OPT_LIST_META_CONTEXT,
            OptionRequest::SetMetaContext { .. } => wire::OPT_SET_META_CONTEXT,
            OptionRequest::Unknown { code, .. } => *code,
        }
    }

    /// Appends the option, header included.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut data = Vec::new();
        match self {
            OptionRequest::ExportName(name) => data.extend_from_slice(name.as_bytes()),
            OptionRequest::Abort
            | OptionRequest::List
            | OptionRequest::StartTls
            | OptionRequest::StructuredReply => {}
            OptionRequest::Info {
                name,
                info_requests,
            }
            | OptionRequest::Go {
                name,
                info_requests,
            } => {
                put_str32(&mut data, name);
                let count = u16::try_from(info_requests.len()).expect("too many info requests");
                data.extend_from_slice(&count.to_be_bytes());
                for info in info_requests {
                    data.extend_from_slice(&info.to_be_bytes());
                }
            }
            OptionRequest::ListMetaContext { export, queries }
            | OptionRequest::SetMetaContext { export, queries } => {
                put_str32(&mut data, export);
                data.extend_from_slice(&len_u32(queries.len()).to_be_bytes());
                for query in queries {
                    put_str32(&mut data, query);
                }
            }
            OptionRequest::Unknown { data: raw, .. } => data.extend_from_slice(raw),
        }
        out.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&self.code().to_be_bytes());
        out.extend_from_slice(&len_u32(data.len()).to_be_bytes());
        out.extend_from_slice(&data);
    }

    /// Parses the data of option `code`. `Err` carries a reason for `NBD_REP_ERR_INVALID`.
    pub fn parse(code: u32, data: &[u8]) -> Result<OptionRequest, &'static str> {
        let mut r = Reader::new(data);
        let request = match code {
            wire::OPT_EXPORT_NAME => {
                OptionRequest::ExportName(r.string(data.len()).ok_or("invalid export name")?)
            }
            wire::OPT_ABORT => OptionRequest::Abort,
            wire::OPT_LIST | wire::OPT_STARTTLS | wire::OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    return Err("option takes no data");
                }
                match code {
                    wire::OPT_LIST => OptionRequest::List,
                    wire::OPT_STARTTLS => OptionRequest::StartTls,
                    _ => OptionRequest::StructuredReply,
                }
            }
            wire::OPT_INFO | wire::OPT_GO => {
                let name_len = r.u32().ok_or("truncated name length")? as usize;
                let name = r.string(name_len).ok_or("invalid export name")?;
                let count = r.u16().ok_or("truncated info request count")?;
                if count > wire::INFO_REQUEST_COUNT_MAX {
                    return Err("too many info requests");
                }
                let mut info_requests = Vec::with_capacity(usize::from(count));
                for _ in 0..count {
                    info_requests.push(r.u16().ok_or("truncated info request")?);
                }
                if code == wire::OPT_INFO {
                    OptionRequest::Info {
                        name,
                        info_requests,
                    }
                } else {
                    OptionRequest::Go {
                        name,
                        info_requests,
                    }
                }
            }
            wire::OPT_LIST_META_CONTEXT | wire::OPT_SET_META_CONTEXT => {
                let name_len = r.u32().ok_or("truncated name length")? as usize;
                let export = r.string(name_len).ok_or("invalid export name")?;
                let count = r.u32().ok_or("truncated query count")?;
                if count > wire::META_QUERY_COUNT_MAX {
                    return Err("too many metadata context queries");
                }
                let mut queries = Vec::new();
                for _ in 0..count {
                    let len = r.u32().ok_or("truncated query length")? as usize;
                    queries.push(r.string(len).ok_or("invalid query")?);
                }
                if code == wire::OPT_LIST_META_CONTEXT {
                    OptionRequest::ListMetaContext { export, queries }
                } else {
                    OptionRequest::SetMetaContext { export, queries }
                }
            }
            _ => {
                return Ok(OptionRequest::Unknown {
                    code,
                    data: data.to_vec(),
                })
            }
        };
        if r.remaining() != 0 {
            return Err("trailing bytes in option data");
        }
        Ok(request)
    }
}

/// A piece of export information (`NBD_REP_INFO`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoReply {
    Export {
        size_bytes: u64,
        flags: TransmissionFlags,
    },
    Name(String),
    Description(String),
    BlockSize(BlockSize),
    /// An info type this crate does not know (clients ignore it).
    Unknown {
        info_type: u16,
    },
}

/// The body of an option reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionReplyKind {
    Ack,
    Server {
        name: String,
        description: String,
    },
    Info(InfoReply),
    MetaContext {
        id: u32,
        name: String,
    },
    /// Any reply type with bit 31 set; `message` is for humans.
    Error {
        reply_type: u32,
        message: String,
    },
}

/// One option reply: which option it answers and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub kind: OptionReplyKind,
}

impl OptionReply {
    /// Bytes of the reply header: magic, option, reply type, length.
    pub const HEADER_BYTES: usize = 20;

    pub fn new(option: u32, kind: OptionReplyKind) -> Self {
        OptionReply { option, kind }
    }

    /// Appends the reply, header included.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let mut data = Vec::new();
        let reply_type = match &self.kind {
            OptionReplyKind::Ack => wire::REP_ACK,
            OptionReplyKind::Server { name, description } => {
                put_str32(&mut data, name);
                data.extend_from_slice(description.as_bytes());
                wire::REP_SERVER
            }
            OptionReplyKind::Info(info) => {
                match info {
                    InfoReply::Export { size_bytes, flags } => {
                        data.extend_from_slice(&wire::INFO_EXPORT.to_be_bytes());
                        data.extend_from_slice(&size_bytes.to_be_bytes());
                        data.extend_from_slice(&flags.0.to_be_bytes());
                    }
                    InfoReply::Name(name) => {
                        data.extend_from_slice(&wire::INFO_NAME.to_be_bytes());
                        data.extend_from_slice(name.as_bytes());
                    }
                    InfoReply::Description(text) => {
                        data.extend_from_slice(&wire::INFO_DESCRIPTION.to_be_bytes());
                        data.extend_from_slice(text.as_bytes());
                    }
                    InfoReply::BlockSize(bs) => {
                        data.extend_from_slice(&wire::INFO_BLOCK_SIZE.to_be_bytes());
                        for v in [bs.min, bs.preferred, bs.max] {
                            data.extend_from_slice(&v.to_be_bytes());
                        }
                    }
                    InfoReply::Unknown { info_type } => {
                        data.extend_from_slice(&info_type.to_be_bytes())
                    }
                }
                wire::REP_INFO
            }
            OptionReplyKind::MetaContext { id, name } => {
                data.extend_from_slice(&id.to_be_bytes());
                data.extend_from_slice(name.as_bytes());
                wire::REP_META_CONTEXT
            }
            OptionReplyKind::Error {
                reply_type,
                message,
            } => {
                assert!(
                    reply_type & wire::REP_FLAG_ERROR != 0,
                    "error reply type without the error bit"
                );
                data.extend_from_slice(message.as_bytes());
                *reply_type
            }
        };
        out.extend_from_slice(&wire::OPTION_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&reply_type.to_be_bytes());
        out.extend_from_slice(&len_u32(data.len()).to_be_bytes());
        out.extend_from_slice(&data);
    }

    /// Decodes one option reply from the front of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Decoded<OptionReply>, ProtoError> {
        let mut r = Reader::new(buf);
        let (Some(magic), Some(option), Some(reply_type), Some(length)) =
            (r.u64(), r.u32(), r.u32(), r.u32())
        else {
            return Ok(Decoded::Needed(Self::HEADER_BYTES));
        };
        if magic != wire::OPTION_REPLY_MAGIC {
            return Err(ProtoError::BadMagic {
                expected: wire::OPTION_REPLY_MAGIC,
                found: magic,
            });
        }
        if length > wire::OPTION_REPLY_BYTES_MAX {
            return Err(ProtoError::TooLong {
                what: "option reply",
                length: u64::from(length),
                max: u64::from(wire::OPTION_REPLY_BYTES_MAX),
            });
        }
        let total = Self::HEADER_BYTES + length as usize;
        let Some(data) = r.bytes(length as usize) else {
            return Ok(Decoded::Needed(total));
        };
        let kind = Self::decode_kind(reply_type, data)?;
        Ok(Decoded::Done {
            value: OptionReply { option, kind },
            consumed: total,
        })
    }

    fn decode_kind(reply_type: u32, data: &[u8]) -> Result<OptionReplyKind, ProtoError> {
        let mut r = Reader::new(data);
        let kind = match reply_type {
            wire::REP_ACK => OptionReplyKind::Ack,
            wire::REP_SERVER => {
                let len = r
                    .u32()
                    .ok_or(ProtoError::Malformed("short NBD_REP_SERVER"))?;
                let name = r
                    .string(len as usize)
                    .ok_or(ProtoError::Malformed("bad export name in NBD_REP_SERVER"))?;
                let description = String::from_utf8_lossy(r.rest()).into_owned();
                OptionReplyKind::Server { name, description }
            }
            wire::REP_INFO => {
                let info_type = r.u16().ok_or(ProtoError::Malformed("short NBD_REP_INFO"))?;
                let info = match info_type {
                    wire::INFO_EXPORT => {
                        let (Some(size_bytes), Some(flags)) = (r.u64(), r.u16()) else {
                            return Err(ProtoError::Malformed("short NBD_INFO_EXPORT"));
                        };
                        InfoReply::Export {
                            size_bytes,
                            flags: TransmissionFlags(flags),
                        }
                    }
                    wire::INFO_NAME => InfoReply::Name(lossy_string(r.rest())?),
                    wire::INFO_DESCRIPTION => InfoReply::Description(lossy_string(r.rest())?),
                    wire::INFO_BLOCK_SIZE => {
                        let (Some(min), Some(preferred), Some(max)) = (r.u32(), r.u32(), r.u32())
                        else {
                            return Err(ProtoError::Malformed("short NBD_INFO_BLOCK_SIZE"));
                        };
                        InfoReply::BlockSize(BlockSize {
                            min,
                            preferred,
                            max,
                        })
                    }
                    _ => {
                        r.rest();
                        InfoReply::Unknown { info_type }
                    }
                };
                OptionReplyKind::Info(info)
            }
            wire::REP_META_CONTEXT => {
                let id = r
                    .u32()
                    .ok_or(ProtoError::Malformed("short NBD_REP_META_CONTEXT"))?;
                let name = lossy_string(r.rest())?;
                OptionReplyKind::MetaContext { id, name }
            }
            t if t & wire::REP_FLAG_ERROR != 0 => OptionReplyKind::Error {
                reply_type: t,
                message: lossy_string(r.rest())?,
            },
            _ => return Err(ProtoError::Malformed("unknown option reply type")),
        };
        if r.remaining() != 0 {
            return Err(ProtoError::Malformed("trailing bytes in option reply"));
        }
        Ok(kind)
    }
}

/// A peer-supplied string for display; bounded, invalid UTF-8 replaced.
fn lossy_string(raw: &[u8]) -> Result<String, ProtoError> {
    if raw.len() > wire::STRING_BYTES_MAX {
        return Err(ProtoError::TooLong {
            what: "string",
            length: raw.len() as u64,
            max: wire::STRING_BYTES_MAX as u64,
        });
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(req: OptionRequest) {
        let mut buf = Vec::new();
        req.encode(&mut buf);
        let mut r = Reader::new(&buf);
        assert_eq!(r.u64(), Some(wire::IHAVEOPT));
        let code = r.u32().unwrap();
        let len = r.u32().unwrap() as usize;
        assert_eq!(r.remaining(), len);
        assert_eq!(OptionRequest::parse(code, r.rest()), Ok(req));
    }

    #[test]
    fn every_option_round_trips() {
        round_trip_request(OptionRequest::ExportName("disk0".into()));
        round_trip_request(OptionRequest::Abort);
        round_trip_request(OptionRequest::List);
        round_trip_request(OptionRequest::StartTls);
        round_trip_request(OptionRequest::StructuredReply);
        round_trip_request(OptionRequest::Info {
            name: "a".into(),
            info_requests: vec![wire::INFO_NAME, wire::INFO_BLOCK_SIZE],
        });
        round_trip_request(OptionRequest::Go {
            name: String::new(),
            info_requests: vec![],
        });
        round_trip_request(OptionRequest::ListMetaContext {
            export: "x".into(),
            queries: vec!["base:".into()],
        });
        round_trip_request(OptionRequest::SetMetaContext {
            export: "x".into(),
            queries: vec!["base:allocation".into(), "qemu:dirty".into()],
        });
        round_trip_request(OptionRequest::Unknown {
            code: 99,
            data: vec![1, 2, 3],
        });
    }

    #[test]
    fn invalid_option_data_is_rejected() {
        assert!(OptionRequest::parse(wire::OPT_LIST, &[0]).is_err());
        assert!(OptionRequest::parse(wire::OPT_GO, &[0, 0, 0, 9, b'a']).is_err());
        assert!(OptionRequest::parse(wire::OPT_GO, &[0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(OptionRequest::parse(wire::OPT_EXPORT_NAME, &[0xff]).is_err());
        assert!(OptionRequest::parse(wire::OPT_EXPORT_NAME, &[b'a', 0]).is_err());
        let mut huge_count = vec![0, 0, 0, 0];
        huge_count.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(OptionRequest::parse(wire::OPT_SET_META_CONTEXT, &huge_count).is_err());
    }

    #[test]
    fn every_reply_round_trips() {
        let kinds = vec![
            OptionReplyKind::Ack,
            OptionReplyKind::Server {
                name: "disk".into(),
                description: "a disk".into(),
            },
            OptionReplyKind::Info(InfoReply::Export {
                size_bytes: 1 << 40,
                flags: TransmissionFlags(0x1ff),
            }),
            OptionReplyKind::Info(InfoReply::Name("n".into())),
            OptionReplyKind::Info(InfoReply::Description("d".into())),
            OptionReplyKind::Info(InfoReply::BlockSize(BlockSize::TIERCACHE)),
            OptionReplyKind::Info(InfoReply::Unknown { info_type: 77 }),
            OptionReplyKind::MetaContext {
                id: 7,
                name: "base:allocation".into(),
            },
            OptionReplyKind::Error {
                reply_type: wire::REP_ERR_UNSUP,
                message: "nope".into(),
            },
        ];
        for kind in kinds {
            let reply = OptionReply::new(wire::OPT_GO, kind);
            let mut buf = Vec::new();
            reply.encode(&mut buf);
            for cut in 0..buf.len() {
                assert!(matches!(
                    OptionReply::decode(&buf[..cut]),
                    Ok(Decoded::Needed(n)) if n > cut
                ));
            }
            assert_eq!(
                OptionReply::decode(&buf),
                Ok(Decoded::Done {
                    value: reply,
                    consumed: buf.len()
                })
            );
        }
    }

    #[test]
    fn reply_framing_errors() {
        let mut buf = Vec::new();
        OptionReply::new(1, OptionReplyKind::Ack).encode(&mut buf);
        buf[0] ^= 1;
        assert!(matches!(
            OptionReply::decode(&buf),
            Err(ProtoError::BadMagic { .. })
        ));
        let mut long = Vec::new();
        long.extend_from_slice(&wire::OPTION_REPLY_MAGIC.to_be_bytes());
        long.extend_from_slice(&1u32.to_be_bytes());
        long.extend_from_slice(&wire::REP_ACK.to_be_bytes());
        long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(
            OptionReply::decode(&long),
            Err(ProtoError::TooLong { .. })
        ));
    }
}
