//! Server side of the fixed-newstyle handshake, as a sans-I/O state machine.
//!
//! Owns: option haggling from the greeting to the start of transmission (or an abort). The set
//! of exports is not owned here: the embedder answers through [`ExportCatalog`], consulted at the
//! moment each option is processed, so exports may come and go while clients negotiate.
//!
//! Invariants: the greeting is queued by [`ServerHandshake::new`]; every option gets exactly one
//! final reply (except `NBD_OPT_EXPORT_NAME`, which has none but the export data); the input
//! buffer never holds more than one option (at most [`wire::OPTION_DATA_BYTES_MAX`] of data) plus
//! what the embedder fed since the last [`ServerHandshake::poll`]; at most
//! [`wire::OPTION_COUNT_MAX`] options are answered per connection.
//!
//! TLS (the spec's "TLS support" section) is decided by the [`TlsMode`] the embedder gives:
//! `Off` is the spec's NOTLS (`NBD_OPT_STARTTLS` answered `NBD_REP_ERR_POLICY`), `Require` is
//! FORCEDTLS (before the upgrade every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` is
//! answered `NBD_REP_ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME`, which cannot be answered with an
//! error, ends the session), `On` is SELECTIVETLS with no TLS-only export (the client may
//! upgrade or not). The machine only haggles: after it acknowledges `NBD_OPT_STARTTLS` it
//! reports [`ServerEvent::StartTls`], the embedder sends the acknowledgement in clear, runs the
//! TLS handshake, and from then on feeds decrypted bytes and encrypts the output.
//!
//! Invariants (TLS): `NBD_OPT_STARTTLS` is acknowledged at most once per connection (a second
//! one gets `NBD_REP_ERR_INVALID`); nothing negotiated before it (structured replies, a
//! metadata context) survives it, as the spec requires; `NBD_REP_ERR_TLS_REQD` is never sent
//! once TLS is active, nor in `Off` or `On` mode.
//!
//! Fault model: unknown options get `NBD_REP_ERR_UNSUP`, malformed ones `NBD_REP_ERR_INVALID`,
//! unknown export names `NBD_REP_ERR_UNKNOWN`, and haggling continues. Bad magic, bad client
//! flags, an option length over the limit (answered `NBD_REP_ERR_TOO_BIG` first), too many
//! options, `NBD_OPT_EXPORT_NAME` for a missing export, or `NBD_OPT_EXPORT_NAME` before TLS in
//! `Require` mode return a [`ProtoError`]: the embedder sends the pending output and hangs up.

use crate::errors::ProtoError;
use crate::flags::{BlockSize, ExportCaps, TransmissionFlags};
use crate::option::{InfoReply, OptionReply, OptionReplyKind, OptionRequest};
use crate::wire::{self, Reader};
use crate::BASE_ALLOCATION;

/// Context id the server assigns to `base:allocation`.
const BASE_ALLOCATION_ID: u32 = 1;

/// Everything a client learns about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size_bytes: u64,
    pub caps: ExportCaps,
    pub block_size: BlockSize,
}

/// One line of `NBD_OPT_LIST`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportListing {
    pub name: String,
    pub description: String,
}

/// The embedder's answer to "which exports exist?"; asked during each option, never cached.
pub trait ExportCatalog {
    fn list(&self) -> Vec<ExportListing>;
    fn lookup(&self, name: &str) -> Option<ExportInfo>;
}

/// The result of a successful handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub export: ExportInfo,
    /// The flags sent to the client; the transmission phase must honour exactly these.
    pub flags: TransmissionFlags,
    pub structured_replies: bool,
    /// Context id of `base:allocation` if the client selected it for this export.
    pub base_allocation_id: Option<u32>,
    /// Bytes the client sent after the final option (the start of the first request).
    pub leftover: Vec<u8>,
}

/// Whether (and how) a server offers TLS; the spec's NOTLS, SELECTIVETLS and FORCEDTLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is refused with `NBD_REP_ERR_POLICY`.
    #[default]
    Off,
    /// TLS at the client's choice: every export is served with or without it.
    On,
    /// TLS before anything else: other options are refused with `NBD_REP_ERR_TLS_REQD`.
    Require,
}

/// What [`ServerHandshake::poll`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// Send the pending output, then feed more input.
    NeedInput,
    /// The client asked for TLS and was acknowledged: send the pending output in clear, run
    /// the TLS handshake (starting with `leftover`, bytes the client sent after the option,
    /// which belong to the TLS stream), then feed decrypted bytes and encrypt all output.
    StartTls { leftover: Vec<u8> },
    /// Transmission starts: send the pending output, then serve requests.
    Done(Negotiated),
    /// The client sent `NBD_OPT_ABORT`: send the pending output (its ACK), then close.
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    Finished,
}

/// Server-side handshake state machine. Drive it with [`feed`](Self::feed),
/// [`poll`](Self::poll) and [`take_output`](Self::take_output).
#[derive(Debug)]
pub struct ServerHandshake {
    state: State,
    input: Vec<u8>,
    output: Vec<u8>,
    no_zeroes: bool,
    structured: bool,
    /// Export name the last `NBD_OPT_SET_META_CONTEXT` applied to, if it selected anything.
    meta_export: Option<String>,
    option_count: u32,
    tls_mode: TlsMode,
    /// Set when `NBD_OPT_STARTTLS` was acknowledged.
    tls_active: bool,
}

impl Default for ServerHandshake {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerHandshake {
    /// Bytes of the server greeting.
    pub const GREETING_BYTES: usize = 18;

    /// A new handshake without TLS ([`TlsMode::Off`]), with the greeting already queued.
    pub fn new() -> Self {
        Self::with_tls(TlsMode::Off)
    }

    /// A new handshake offering TLS as `tls_mode` says, with the greeting already queued.
    pub fn with_tls(tls_mode: TlsMode) -> Self {
        let mut output = Vec::with_capacity(Self::GREETING_BYTES);
        output.extend_from_slice(&wire::NBD_MAGIC.to_be_bytes());
        output.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
        let flags = wire::FLAG_FIXED_NEWSTYLE | wire::FLAG_NO_ZEROES;
        output.extend_from_slice(&flags.to_be_bytes());
        ServerHandshake {
            state: State::ClientFlags,
            input: Vec::new(),
            output,
            no_zeroes: false,
            structured: false,
            meta_export: None,
            option_count: 0,
            tls_mode,
            tls_active: false,
        }
    }

    /// Whether `NBD_OPT_STARTTLS` was acknowledged (all later traffic is encrypted).
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// Appends bytes received from the client. Call [`poll`](Self::poll) after each feed.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.input.extend_from_slice(bytes);
    }

    /// Takes the bytes to send to the client.
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.output)
    }

    /// Processes as much buffered input as possible.
    pub fn poll(&mut self, catalog: &dyn ExportCatalog) -> Result<ServerEvent, ProtoError> {
        loop {
            match self.state {
                State::Finished => return Err(ProtoError::Finished),
                State::ClientFlags => {
                    let Some(flags) = Reader::new(&self.input).u32() else {
                        return Ok(ServerEvent::NeedInput);
                    };
                    self.input.drain(..4);
                    let known = wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES;
                    if flags & !known != 0 {
                        self.state = State::Finished;
                        return Err(ProtoError::BadClientFlags(flags));
                    }
                    self.no_zeroes = flags & wire::FLAG_C_NO_ZEROES != 0;
                    self.state = State::Options;
                }
                State::Options => match self.next_option(catalog) {
                    Ok(Some(event)) => return Ok(event),
                    Ok(None) => {}
                    Err(err) => {
                        self.state = State::Finished;
                        return Err(err);
                    }
                },
            }
        }
    }

    /// Handles one complete option; `Ok(None)` means "keep going".
    fn next_option(
        &mut self,
        catalog: &dyn ExportCatalog,
    ) -> Result<Option<ServerEvent>, ProtoError> {
        let mut r = Reader::new(&self.input);
        let (Some(magic), Some(code), Some(length)) = (r.u64(), r.u32(), r.u32()) else {
            return Ok(Some(ServerEvent::NeedInput));
        };
        if magic != wire::IHAVEOPT {
            return Err(ProtoError::BadMagic {
                expected: wire::IHAVEOPT,
                found: magic,
            });
        }
        if length > wire::OPTION_DATA_BYTES_MAX {
            self.reply_error(code, wire::REP_ERR_TOO_BIG, "option data too long");
            return Err(ProtoError::TooLong {
                what: "option data",
                length: u64::from(length),
                max: u64::from(wire::OPTION_DATA_BYTES_MAX),
            });
        }
        let Some(data) = r.bytes(length as usize) else {
            return Ok(Some(ServerEvent::NeedInput));
        };
        self.option_count += 1;
        if self.option_count > wire::OPTION_COUNT_MAX {
            return Err(ProtoError::TooManyOptions);
        }
        let parsed = OptionRequest::parse(code, data);
        self.input
            .drain(..OptionRequest::HEADER_BYTES + length as usize);
        if self.tls_mode == TlsMode::Require && !self.tls_active {
            match code {
                wire::OPT_STARTTLS | wire::OPT_ABORT => {}
                // It cannot be answered with an error: the spec says to end the session.
                wire::OPT_EXPORT_NAME => return Err(ProtoError::TlsRequired),
                _ => {
                    self.reply_error(
                        code,
                        wire::REP_ERR_TLS_REQD,
                        "this server requires TLS: send NBD_OPT_STARTTLS first",
                    );
                    return Ok(None);
                }
            }
        }
        let request = match parsed {
            Ok(request) => request,
            Err(reason) => {
                self.reply_error(code, wire::REP_ERR_INVALID, reason);
                return Ok(None);
            }
        };
        self.handle(request, catalog)
    }

    fn handle(
        &mut self,
        request: OptionRequest,
        catalog: &dyn ExportCatalog,
    ) -> Result<Option<ServerEvent>, ProtoError> {
        let code = request.code();
        match request {
            OptionRequest::ExportName(name) => {
                let Some(export) = catalog.lookup(&name) else {
                    return Err(ProtoError::UnknownExport(name));
                };
                let flags = export.caps.transmission_flags(self.structured);
                self.output
                    .extend_from_slice(&export.size_bytes.to_be_bytes());
                self.output.extend_from_slice(&flags.0.to_be_bytes());
                if !self.no_zeroes {
                    self.output.extend_from_slice(&[0u8; 124]);
                }
                return Ok(Some(self.finish(export, flags)));
            }
            OptionRequest::Abort => {
                self.reply(code, OptionReplyKind::Ack);
                self.state = State::Finished;
                return Ok(Some(ServerEvent::Aborted));
            }
            OptionRequest::StartTls => {
                if self.tls_mode == TlsMode::Off {
                    self.reply_error(code, wire::REP_ERR_POLICY, "TLS is not enabled here");
                } else if self.tls_active {
                    self.reply_error(code, wire::REP_ERR_INVALID, "TLS is already active");
                } else {
                    self.reply(code, OptionReplyKind::Ack);
                    // The spec: nothing negotiated before the upgrade is kept.
                    self.structured = false;
                    self.meta_export = None;
                    self.tls_active = true;
                    let leftover = std::mem::take(&mut self.input);
                    return Ok(Some(ServerEvent::StartTls { leftover }));
                }
            }
            OptionRequest::List => {
                for listing in catalog.list() {
                    self.reply(
                        code,
                        OptionReplyKind::Server {
                            name: listing.name,
                            description: listing.description,
                        },
                    );
                }
                self.reply(code, OptionReplyKind::Ack);
            }
            OptionRequest::Info {
                name,
                info_requests,
            }
            | OptionRequest::Go {
                name,
                info_requests,
            } => {
                let Some(export) = catalog.lookup(&name) else {
                    self.reply_error(code, wire::REP_ERR_UNKNOWN, "no such export");
                    return Ok(None);
                };
                let flags = export.caps.transmission_flags(self.structured);
                self.send_info(code, &export, flags, &info_requests);
                self.reply(code, OptionReplyKind::Ack);
                if code == wire::OPT_GO {
                    return Ok(Some(self.finish(export, flags)));
                }
            }
            OptionRequest::StructuredReply => {
                self.structured = true;
                self.reply(code, OptionReplyKind::Ack);
            }
            OptionRequest::ListMetaContext { export, queries }
            | OptionRequest::SetMetaContext { export, queries } => {
                let set = code == wire::OPT_SET_META_CONTEXT;
                if !self.structured {
                    self.reply_error(
                        code,
                        wire::REP_ERR_INVALID,
                        "structured replies not negotiated",
                    );
                    return Ok(None);
                }
                if catalog.lookup(&export).is_none() {
                    self.reply_error(code, wire::REP_ERR_UNKNOWN, "no such export");
                    return Ok(None);
                }
                let selected = if set {
                    queries.iter().any(|q| q == BASE_ALLOCATION)
                } else {
                    queries.is_empty()
                        || queries.iter().any(|q| q == BASE_ALLOCATION || q == "base:")
                };
                if set {
                    self.meta_export = selected.then_some(export);
                }
                if selected {
                    let id = if set { BASE_ALLOCATION_ID } else { 0 };
                    self.reply(
                        code,
                        OptionReplyKind::MetaContext {
                            id,
                            name: BASE_ALLOCATION.to_string(),
                        },
                    );
                }
                self.reply(code, OptionReplyKind::Ack);
            }
            OptionRequest::Unknown { .. } => {
                self.reply_error(code, wire::REP_ERR_UNSUP, "option not supported");
            }
        }
        Ok(None)
    }

    fn send_info(
        &mut self,
        code: u32,
        export: &ExportInfo,
        flags: TransmissionFlags,
        info_requests: &[u16],
    ) {
        let mut infos = vec![
            InfoReply::Export {
                size_bytes: export.size_bytes,
                flags,
            },
            InfoReply::BlockSize(export.block_size),
        ];
        if info_requests.contains(&wire::INFO_NAME) {
            infos.push(InfoReply::Name(export.name.clone()));
        }
        if info_requests.contains(&wire::INFO_DESCRIPTION) {
            infos.push(InfoReply::Description(export.description.clone()));
        }
        for info in infos {
            self.reply(code, OptionReplyKind::Info(info));
        }
    }

    fn finish(&mut self, export: ExportInfo, flags: TransmissionFlags) -> ServerEvent {
        self.state = State::Finished;
        let base_allocation_id = (self.meta_export.as_deref() == Some(export.name.as_str()))
            .then_some(BASE_ALLOCATION_ID);
        ServerEvent::Done(Negotiated {
            export,
            flags,
            structured_replies: self.structured,
            base_allocation_id,
            leftover: std::mem::take(&mut self.input),
        })
    }

    fn reply(&mut self, option: u32, kind: OptionReplyKind) {
        OptionReply::new(option, kind).encode(&mut self.output);
    }

    fn reply_error(&mut self, option: u32, reply_type: u32, message: &str) {
        self.reply(
            option,
            OptionReplyKind::Error {
                reply_type,
                message: message.to_string(),
            },
        );
    }
}
