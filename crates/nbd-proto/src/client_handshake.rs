//! Client side of the fixed-newstyle handshake, as a sans-I/O state machine.
//!
//! Owns: negotiating one export by name: optionally TLS first (`NBD_OPT_STARTTLS`, see
//! [`ClientHandshake::with_starttls`]), optional structured replies, optional metadata
//! contexts, then `NBD_OPT_GO` (falling back to `NBD_OPT_EXPORT_NAME` when the server answers
//! `NBD_REP_ERR_UNSUP`).
//!
//! TLS: with `with_starttls`, `NBD_OPT_STARTTLS` is the first option (the spec's advice for a
//! client that insists on TLS, so that nothing is negotiated in clear); its acknowledgement is
//! reported as [`ClientEvent::StartTls`] with no further option queued, the embedder runs the
//! TLS handshake, and the next [`poll`](ClientHandshake::poll) goes on over TLS. Any refusal of
//! `NBD_OPT_STARTTLS` is a [`ProtoError::Rejected`]: a client that asked for TLS never falls
//! back to clear text (the spec's defence against a downgrade).
//!
//! Invariants: at most one option is outstanding at a time (the spec forbids pipelining
//! options); every reply must name the option that is outstanding; the input buffer never holds
//! more than one option reply (at most [`wire::OPTION_REPLY_BYTES_MAX`] of data) plus one feed.
//!
//! Fault model: the server is untrusted. A framing violation, a reply for the wrong option, or
//! an error reply to `NBD_OPT_GO` other than "unsupported" returns a [`ProtoError`]; the
//! embedder then closes the connection. A refusal of structured replies or metadata contexts is
//! not an error: the result simply reports that they were not negotiated.

use crate::errors::ProtoError;
use crate::flags::{BlockSize, TransmissionFlags};
use crate::option::{InfoReply, OptionReply, OptionReplyKind, OptionRequest};
use crate::wire::{self, Decoded, Reader};

/// What the client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    pub export_name: String,
    pub structured_replies: bool,
    /// Metadata contexts to select (requires structured replies), e.g. `base:allocation`.
    pub meta_contexts: Vec<String>,
}

/// The result of a successful client handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientNegotiated {
    pub size_bytes: u64,
    pub flags: TransmissionFlags,
    pub block_size: Option<BlockSize>,
    pub structured_replies: bool,
    /// Selected metadata contexts as (id, name).
    pub meta_contexts: Vec<(u32, String)>,
    /// Bytes the server sent after the handshake (normally none).
    pub leftover: Vec<u8>,
}

/// What [`ClientHandshake::poll`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// Send the pending output, then feed more input.
    NeedInput,
    /// Transmission starts: send the pending output, then issue requests.
    Done(ClientNegotiated),
    /// The server acknowledged `NBD_OPT_STARTTLS`: send the pending output in clear, run the
    /// TLS handshake, then poll again and carry everything after over TLS.
    StartTls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Greeting,
    /// Waiting for the replies to this option.
    Awaiting(u32),
    /// Waiting for the size and flags after `NBD_OPT_EXPORT_NAME`.
    ExportNameData,
    /// `NBD_OPT_STARTTLS` was acknowledged; the next poll sends the first option over TLS.
    TlsStarted,
    Finished,
}

/// Client-side handshake state machine.
#[derive(Debug)]
pub struct ClientHandshake {
    config: ClientConfig,
    state: State,
    input: Vec<u8>,
    output: Vec<u8>,
    no_zeroes: bool,
    structured: bool,
    meta_tried: bool,
    meta_contexts: Vec<(u32, String)>,
    export: Option<(u64, TransmissionFlags)>,
    block_size: Option<BlockSize>,
    /// Send `NBD_OPT_STARTTLS` first and insist on it.
    starttls: bool,
}

impl ClientHandshake {
    pub fn new(config: ClientConfig) -> Self {
        ClientHandshake {
            config,
            state: State::Greeting,
            input: Vec::new(),
            output: Vec::new(),
            no_zeroes: false,
            structured: false,
            meta_tried: false,
            meta_contexts: Vec::new(),
            export: None,
            block_size: None,
            starttls: false,
        }
    }

    /// Starts with `NBD_OPT_STARTTLS` and fails unless the server acknowledges it.
    pub fn with_starttls(mut self) -> Self {
        self.starttls = true;
        self
    }

    /// Appends bytes received from the server. Call [`poll`](Self::poll) after each feed.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
    }

    /// Takes the bytes to send to the server.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.output)
    }

    /// Processes as much buffered input as possible.
    pub fn poll(&mut self) -> Result<ClientEvent, ProtoError> {
        let result = self.step_all();
        if result.is_err() {
            self.state = State::Finished;
        }
        result
    }

    fn step_all(&mut self) -> Result<ClientEvent, ProtoError> {
        loop {
            match self.state {
                State::Finished => return Err(ProtoError::Finished),
                State::Greeting => {
                    let mut r = Reader::new(&self.input);
                    let (Some(magic), Some(opt_magic), Some(flags)) = (r.u64(), r.u64(), r.u16())
                    else {
                        return Ok(ClientEvent::NeedInput);
                    };
                    if magic != wire::NBD_MAGIC {
                        return Err(ProtoError::BadMagic {
                            expected: wire::NBD_MAGIC,
                            found: magic,
                        });
                    }
                    if opt_magic != wire::IHAVEOPT {
                        return Err(ProtoError::BadMagic {
                            expected: wire::IHAVEOPT,
                            found: opt_magic,
                        });
                    }
                    if flags & wire::FLAG_FIXED_NEWSTYLE == 0 {
                        return Err(ProtoError::NotFixedNewstyle);
                    }
                    self.input.drain(..18);
                    self.no_zeroes = flags & wire::FLAG_NO_ZEROES != 0;
                    let mut client_flags = wire::FLAG_C_FIXED_NEWSTYLE;
                    if self.no_zeroes {
                        client_flags |= wire::FLAG_C_NO_ZEROES;
                    }
                    self.output.extend_from_slice(&client_flags.to_be_bytes());
                    if self.starttls {
                        self.send(OptionRequest::StartTls);
                    } else {
                        self.send_first();
                    }
                }
                State::TlsStarted => self.send_first(),
                State::Awaiting(option) => {
                    let (reply, consumed) = match OptionReply::decode(&self.input)? {
                        Decoded::Needed(_) => return Ok(ClientEvent::NeedInput),
                        Decoded::Done { value, consumed } => (value, consumed),
                    };
                    self.input.drain(..consumed);
                    if reply.option != option {
                        return Err(ProtoError::Malformed("reply for an option not sent"));
                    }
                    if let Some(event) = self.on_reply(option, reply.kind)? {
                        return Ok(event);
                    }
                }
                State::ExportNameData => {
                    let needed = if self.no_zeroes { 10 } else { 134 };
                    let mut r = Reader::new(&self.input);
                    let (Some(size_bytes), Some(flags)) = (r.u64(), r.u16()) else {
                        return Ok(ClientEvent::NeedInput);
                    };
                    if self.input.len() < needed {
                        return Ok(ClientEvent::NeedInput);
                    }
                    self.input.drain(..needed);
                    self.export = Some((size_bytes, TransmissionFlags(flags)));
                    return self.finish().map(ClientEvent::Done);
                }
            }
        }
    }

    /// Sends the first option of the negotiation proper (after TLS, if any).
    fn send_first(&mut self) {
        if self.config.structured_replies {
            self.send(OptionRequest::StructuredReply);
        } else {
            self.send_next();
        }
    }

    /// Sends the next option after structured replies were settled.
    fn send_next(&mut self) {
        if self.structured && !self.meta_tried && !self.config.meta_contexts.is_empty() {
            self.meta_tried = true;
            self.send(OptionRequest::SetMetaContext {
                export: self.config.export_name.clone(),
                queries: self.config.meta_contexts.clone(),
            });
        } else {
            self.send(OptionRequest::Go {
                name: self.config.export_name.clone(),
                info_requests: vec![wire::INFO_BLOCK_SIZE],
            });
        }
    }

    fn send(&mut self, request: OptionRequest) {
        self.state = match request {
            OptionRequest::ExportName(_) => State::ExportNameData,
            ref other => State::Awaiting(other.code()),
        };
        request.encode(&mut self.output);
    }

    fn on_reply(
        &mut self,
        option: u32,
        kind: OptionReplyKind,
    ) -> Result<Option<ClientEvent>, ProtoError> {
        match (option, kind) {
            (wire::OPT_STARTTLS, OptionReplyKind::Ack) => {
                if !self.input.is_empty() {
                    // A TLS server speaks only after the client's hello.
                    return Err(ProtoError::Malformed(
                        "data after the NBD_OPT_STARTTLS reply",
                    ));
                }
                self.state = State::TlsStarted;
                return Ok(Some(ClientEvent::StartTls));
            }
            (wire::OPT_STRUCTURED_REPLY, OptionReplyKind::Ack) => {
                self.structured = true;
                self.send_next();
            }
            (wire::OPT_STRUCTURED_REPLY, OptionReplyKind::Error { .. }) => self.send_next(),
            (wire::OPT_SET_META_CONTEXT, OptionReplyKind::MetaContext { id, name }) => {
                if self.meta_contexts.len() >= wire::META_QUERY_COUNT_MAX as usize {
                    return Err(ProtoError::Malformed("too many metadata contexts"));
                }
                self.meta_contexts.push((id, name));
            }
            (wire::OPT_SET_META_CONTEXT, OptionReplyKind::Ack) => self.send_next(),
            (wire::OPT_SET_META_CONTEXT, OptionReplyKind::Error { .. }) => {
                self.meta_contexts.clear();
                self.send_next();
            }
            (wire::OPT_GO, OptionReplyKind::Info(info)) => match info {
                InfoReply::Export { size_bytes, flags } => {
                    self.export = Some((size_bytes, flags));
                }
                InfoReply::BlockSize(bs) => self.block_size = Some(bs),
                InfoReply::Name(_) | InfoReply::Description(_) | InfoReply::Unknown { .. } => {}
            },
            (wire::OPT_GO, OptionReplyKind::Ack) => {
                return self.finish().map(|n| Some(ClientEvent::Done(n)))
            }
            (
                wire::OPT_GO,
                OptionReplyKind::Error {
                    reply_type: wire::REP_ERR_UNSUP,
                    ..
                },
            ) => {
                self.send(OptionRequest::ExportName(self.config.export_name.clone()));
            }
            (
                option,
                OptionReplyKind::Error {
                    reply_type,
                    message,
                },
            ) => {
                return Err(ProtoError::Rejected {
                    option,
                    reply_type,
                    message,
                })
            }
            _ => return Err(ProtoError::Malformed("unexpected option reply")),
        }
        Ok(None)
    }

    fn finish(&mut self) -> Result<ClientNegotiated, ProtoError> {
        let Some((size_bytes, flags)) = self.export else {
            return Err(ProtoError::Malformed(
                "NBD_OPT_GO acknowledged without export info",
            ));
        };
        self.state = State::Finished;
        Ok(ClientNegotiated {
            size_bytes,
            flags,
            block_size: self.block_size,
            structured_replies: self.structured,
            meta_contexts: std::mem::take(&mut self.meta_contexts),
            leftover: std::mem::take(&mut self.input),
        })
    }
}
