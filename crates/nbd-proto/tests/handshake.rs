//! Client and server handshakes driven against each other in memory, plus server answers to
//! hand-written option sequences (unknown options, bad lengths, listing, info, meta contexts).

use nbd_proto::wire;
use nbd_proto::*;

struct Catalog(Vec<ExportInfo>);

impl ExportCatalog for Catalog {
    fn list(&self) -> Vec<ExportListing> {
        self.0
            .iter()
            .map(|e| ExportListing {
                name: e.name.clone(),
                description: e.description.clone(),
            })
            .collect()
    }
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        self.0.iter().find(|e| e.name == name).cloned()
    }
}

fn caps() -> ExportCaps {
    ExportCaps {
        fast_zero: false,
        rotational: true,
        ..ExportCaps::ALL
    }
}

fn catalog() -> Catalog {
    Catalog(vec![
        ExportInfo {
            name: "disk0".into(),
            description: "first".into(),
            size_bytes: 1 << 30,
            caps: caps(),
            block_size: BlockSize::TIERCACHE,
        },
        ExportInfo {
            name: "disk1".into(),
            description: "second".into(),
            size_bytes: 4096,
            caps: ExportCaps {
                read_only: true,
                ..caps()
            },
            block_size: BlockSize::TIERCACHE,
        },
    ])
}

/// Runs both machines against each other, moving `step` bytes at a time.
fn run(
    config: ClientConfig,
    step: usize,
) -> (Result<ClientNegotiated, ProtoError>, Option<Negotiated>) {
    let (client, server, _) = run_tls(config, step, TlsMode::Off, false);
    (client, server)
}

/// Like [`run`] with a server in `mode` and a client that insists on TLS if `starttls`; an
/// acknowledged `NBD_OPT_STARTTLS` stands for a TLS handshake (both sides just go on). Also
/// returns whether each side saw the upgrade: (client, server).
fn run_tls(
    config: ClientConfig,
    step: usize,
    mode: TlsMode,
    starttls: bool,
) -> (
    Result<ClientNegotiated, ProtoError>,
    Option<Negotiated>,
    (bool, bool),
) {
    let cat = catalog();
    let mut server = ServerHandshake::with_tls(mode);
    let mut client = ClientHandshake::new(config);
    if starttls {
        client = client.with_starttls();
    }
    let mut server_done = None;
    let mut upgraded = (false, false);
    for _ in 0..10_000 {
        let to_client = server.take_output();
        for piece in to_client.chunks(step) {
            client.feed(piece);
        }
        match client.poll() {
            Ok(ClientEvent::Done(n)) => return (Ok(n), server_done, upgraded),
            Ok(ClientEvent::NeedInput) => {}
            Ok(ClientEvent::StartTls) => {
                assert!(!upgraded.0, "the client upgraded twice");
                upgraded.0 = true;
            }
            Err(e) => return (Err(e), server_done, upgraded),
        }
        let to_server = client.take_output();
        for piece in to_server.chunks(step) {
            server.feed(piece);
        }
        if server_done.is_none() {
            match server.poll(&cat) {
                Ok(ServerEvent::Done(n)) => server_done = Some(n),
                Ok(ServerEvent::NeedInput) => {}
                Ok(ServerEvent::StartTls { leftover }) => {
                    assert!(leftover.is_empty(), "the client waits for the reply");
                    assert!(!upgraded.1, "the server upgraded twice");
                    upgraded.1 = true;
                }
                other => panic!("server: {other:?}"),
            }
        }
    }
    panic!("handshake did not converge");
}

#[test]
fn go_with_structured_replies_and_base_allocation() {
    for step in [1, 3, 7, 4096] {
        let (client, server) = run(
            ClientConfig {
                export_name: "disk0".into(),
                structured_replies: true,
                meta_contexts: vec![BASE_ALLOCATION.into()],
            },
            step,
        );
        let client = client.expect("client negotiated");
        let server = server.expect("server negotiated");
        assert_eq!(client.size_bytes, 1 << 30);
        assert_eq!(client.flags, server.flags);
        assert!(client.flags.contains(TransmissionFlags::SEND_DF));
        assert!(client.flags.contains(TransmissionFlags::ROTATIONAL));
        assert_eq!(client.block_size, Some(BlockSize::TIERCACHE));
        assert!(client.structured_replies && server.structured_replies);
        assert_eq!(client.meta_contexts.len(), 1);
        assert_eq!(Some(client.meta_contexts[0].0), server.base_allocation_id);
        assert_eq!(server.export.name, "disk0");
        assert!(client.leftover.is_empty() && server.leftover.is_empty());
    }
}

#[test]
fn go_without_structured_replies() {
    let (client, server) = run(
        ClientConfig {
            export_name: "disk1".into(),
            structured_replies: false,
            meta_contexts: vec![BASE_ALLOCATION.into()],
        },
        5,
    );
    let client = client.unwrap();
    assert!(!client.structured_replies);
    assert!(client.meta_contexts.is_empty());
    assert!(client.flags.contains(TransmissionFlags::READ_ONLY));
    assert!(!client.flags.contains(TransmissionFlags::SEND_DF));
    assert_eq!(server.unwrap().base_allocation_id, None);
}

#[test]
fn go_for_unknown_export_is_rejected() {
    let (client, server) = run(
        ClientConfig {
            export_name: "nope".into(),
            structured_replies: true,
            meta_contexts: vec![],
        },
        64,
    );
    assert!(server.is_none());
    match client {
        Err(ProtoError::Rejected { reply_type, .. }) => {
            assert_eq!(reply_type, wire::REP_ERR_UNKNOWN)
        }
        other => panic!("expected rejection, got {other:?}"),
    }
}

/// Sends raw client bytes and collects every option reply the server produced.
fn server_replies(
    client_bytes: &[u8],
) -> (Vec<OptionReply>, Result<ServerEvent, ProtoError>, Vec<u8>) {
    let mut server = ServerHandshake::new();
    let greeting = server.take_output();
    assert_eq!(greeting.len(), ServerHandshake::GREETING_BYTES);
    server.feed(client_bytes);
    let event = server.poll(&catalog());
    let (replies, out) = decode_replies(server.take_output());
    (replies, event, out)
}

/// The option replies at the front of `out`, and what follows them.
fn decode_replies(mut out: Vec<u8>) -> (Vec<OptionReply>, Vec<u8>) {
    let mut replies = Vec::new();
    while let Ok(Decoded::Done { value, consumed }) = OptionReply::decode(&out) {
        replies.push(value);
        out.drain(..consumed);
    }
    (replies, out)
}

fn client_flags() -> Vec<u8> {
    (wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec()
}

#[test]
fn unknown_and_invalid_options_do_not_end_haggling() {
    let mut bytes = client_flags();
    OptionRequest::Unknown {
        code: 0x1234,
        data: vec![9; 10],
    }
    .encode(&mut bytes);
    OptionRequest::Unknown {
        code: wire::OPT_STARTTLS,
        data: vec![],
    }
    .encode(&mut bytes);
    // NBD_OPT_LIST with data is invalid.
    OptionRequest::Unknown {
        code: wire::OPT_LIST,
        data: vec![1],
    }
    .encode(&mut bytes);
    // Meta contexts before structured replies are invalid.
    OptionRequest::SetMetaContext {
        export: "disk0".into(),
        queries: vec![BASE_ALLOCATION.into()],
    }
    .encode(&mut bytes);
    OptionRequest::List.encode(&mut bytes);
    OptionRequest::Info {
        name: "disk1".into(),
        info_requests: vec![wire::INFO_NAME, wire::INFO_DESCRIPTION],
    }
    .encode(&mut bytes);
    OptionRequest::Info {
        name: "missing".into(),
        info_requests: vec![],
    }
    .encode(&mut bytes);
    OptionRequest::Abort.encode(&mut bytes);
    let (replies, event, rest) = server_replies(&bytes);
    assert_eq!(event, Ok(ServerEvent::Aborted));
    assert!(rest.is_empty());
    let kinds: Vec<_> = replies.iter().map(|r| (r.option, r.kind.clone())).collect();
    let err = |option, reply_type| {
        move |k: &(u32, OptionReplyKind)| {
            k.0 == option
                && matches!(&k.1, OptionReplyKind::Error { reply_type: t, .. } if *t == reply_type)
        }
    };
    assert!(err(0x1234, wire::REP_ERR_UNSUP)(&kinds[0]));
    // A server without TLS refuses the upgrade by policy (the spec's NOTLS mode).
    assert!(err(wire::OPT_STARTTLS, wire::REP_ERR_POLICY)(&kinds[1]));
    assert!(err(wire::OPT_LIST, wire::REP_ERR_INVALID)(&kinds[2]));
    assert!(err(wire::OPT_SET_META_CONTEXT, wire::REP_ERR_INVALID)(
        &kinds[3]
    ));
    assert_eq!(
        kinds[4].1,
        OptionReplyKind::Server {
            name: "disk0".into(),
            description: "first".into()
        }
    );
    assert!(matches!(&kinds[5].1, OptionReplyKind::Server { name, .. } if name == "disk1"));
    assert_eq!(kinds[6].1, OptionReplyKind::Ack);
    let info: Vec<_> = kinds[7..11].iter().map(|k| k.1.clone()).collect();
    assert!(info.contains(&OptionReplyKind::Info(InfoReply::Name("disk1".into()))));
    assert!(info.contains(&OptionReplyKind::Info(InfoReply::Description(
        "second".into()
    ))));
    assert!(info.contains(&OptionReplyKind::Info(InfoReply::BlockSize(
        BlockSize::TIERCACHE
    ))));
    assert!(info.iter().any(|k| matches!(
        k,
        OptionReplyKind::Info(InfoReply::Export {
            size_bytes: 4096,
            ..
        })
    )));
    assert_eq!(kinds[11].1, OptionReplyKind::Ack);
    assert!(err(wire::OPT_INFO, wire::REP_ERR_UNKNOWN)(&kinds[12]));
    assert_eq!(kinds[13], (wire::OPT_ABORT, OptionReplyKind::Ack));
}

#[test]
fn meta_context_listing_and_selection() {
    let mut bytes = client_flags();
    OptionRequest::StructuredReply.encode(&mut bytes);
    OptionRequest::ListMetaContext {
        export: "disk0".into(),
        queries: vec![],
    }
    .encode(&mut bytes);
    OptionRequest::SetMetaContext {
        export: "disk0".into(),
        queries: vec!["qemu:dirty-bitmap:x".into()],
    }
    .encode(&mut bytes);
    OptionRequest::SetMetaContext {
        export: "disk0".into(),
        queries: vec![BASE_ALLOCATION.into()],
    }
    .encode(&mut bytes);
    OptionRequest::Go {
        name: "disk0".into(),
        info_requests: vec![],
    }
    .encode(&mut bytes);
    bytes.extend_from_slice(b"first request bytes");
    let (replies, event, _) = server_replies(&bytes);
    let kinds: Vec<_> = replies.into_iter().map(|r| r.kind).collect();
    assert_eq!(kinds[0], OptionReplyKind::Ack);
    assert!(
        matches!(&kinds[1], OptionReplyKind::MetaContext { name, .. } if name == BASE_ALLOCATION)
    );
    assert_eq!(kinds[2], OptionReplyKind::Ack);
    assert_eq!(
        kinds[3],
        OptionReplyKind::Ack,
        "unknown context selects nothing"
    );
    assert!(matches!(
        &kinds[4],
        OptionReplyKind::MetaContext { id: 1, .. }
    ));
    let Ok(ServerEvent::Done(n)) = event else {
        panic!("expected Done, got {event:?}")
    };
    assert_eq!(n.base_allocation_id, Some(1));
    assert_eq!(n.leftover, b"first request bytes");
}

#[test]
fn meta_context_for_other_export_is_dropped_at_go() {
    let mut bytes = client_flags();
    OptionRequest::StructuredReply.encode(&mut bytes);
    OptionRequest::SetMetaContext {
        export: "disk1".into(),
        queries: vec![BASE_ALLOCATION.into()],
    }
    .encode(&mut bytes);
    OptionRequest::Go {
        name: "disk0".into(),
        info_requests: vec![],
    }
    .encode(&mut bytes);
    let (_, event, _) = server_replies(&bytes);
    let Ok(ServerEvent::Done(n)) = event else {
        panic!("expected Done")
    };
    assert_eq!(n.base_allocation_id, None);
}

#[test]
fn export_name_with_and_without_zeroes() {
    for (flags, expected_len) in [
        (wire::FLAG_C_FIXED_NEWSTYLE, 134),
        (wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES, 10),
    ] {
        let mut bytes = flags.to_be_bytes().to_vec();
        OptionRequest::ExportName("disk1".into()).encode(&mut bytes);
        let (_, event, rest) = server_replies(&bytes);
        assert!(matches!(event, Ok(ServerEvent::Done(_))));
        assert_eq!(rest.len(), expected_len);
        assert_eq!(&rest[..8], &4096u64.to_be_bytes());
    }
    let mut bytes = client_flags();
    OptionRequest::ExportName("missing".into()).encode(&mut bytes);
    let (_, event, _) = server_replies(&bytes);
    assert_eq!(event, Err(ProtoError::UnknownExport("missing".into())));
}

#[test]
fn hostile_lengths_flags_and_magic_end_the_session() {
    let (_, event, _) = server_replies(&0x80u32.to_be_bytes());
    assert_eq!(event, Err(ProtoError::BadClientFlags(0x80)));

    let mut bytes = client_flags();
    bytes.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    bytes.extend_from_slice(&wire::OPT_GO.to_be_bytes());
    bytes.extend_from_slice(&u32::MAX.to_be_bytes());
    let (replies, event, _) = server_replies(&bytes);
    assert!(matches!(event, Err(ProtoError::TooLong { .. })));
    assert!(matches!(
        replies[0].kind,
        OptionReplyKind::Error {
            reply_type: wire::REP_ERR_TOO_BIG,
            ..
        }
    ));

    let mut bytes = client_flags();
    bytes.extend_from_slice(&[0x55; 16]);
    let (_, event, _) = server_replies(&bytes);
    assert!(matches!(event, Err(ProtoError::BadMagic { .. })));

    let mut bytes = client_flags();
    for _ in 0..=wire::OPTION_COUNT_MAX {
        OptionRequest::StructuredReply.encode(&mut bytes);
    }
    let (_, event, _) = server_replies(&bytes);
    assert_eq!(event, Err(ProtoError::TooManyOptions));
}

#[test]
fn client_falls_back_to_export_name_on_unsup_go() {
    let mut client = ClientHandshake::new(ClientConfig {
        export_name: "old".into(),
        structured_replies: false,
        meta_contexts: vec![],
    });
    let mut greeting = wire::NBD_MAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&wire::FLAG_FIXED_NEWSTYLE.to_be_bytes());
    client.feed(&greeting);
    assert_eq!(client.poll(), Ok(ClientEvent::NeedInput));
    let sent = client.take_output();
    assert_eq!(&sent[..4], &wire::FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
    let mut reply = Vec::new();
    OptionReply::new(
        wire::OPT_GO,
        OptionReplyKind::Error {
            reply_type: wire::REP_ERR_UNSUP,
            message: String::new(),
        },
    )
    .encode(&mut reply);
    client.feed(&reply);
    assert_eq!(client.poll(), Ok(ClientEvent::NeedInput));
    let sent = client.take_output();
    let mut expected = Vec::new();
    OptionRequest::ExportName("old".into()).encode(&mut expected);
    assert_eq!(sent, expected);
    let mut data = 8192u64.to_be_bytes().to_vec();
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&[0; 124]);
    client.feed(&data[..50]);
    assert_eq!(client.poll(), Ok(ClientEvent::NeedInput));
    client.feed(&data[50..]);
    let Ok(ClientEvent::Done(n)) = client.poll() else {
        panic!("expected done")
    };
    assert_eq!(n.size_bytes, 8192);
    assert_eq!(n.block_size, None);
    assert_eq!(client.poll(), Err(ProtoError::Finished));
}

#[test]
fn client_rejects_bad_greeting_and_stray_replies() {
    let mut client = ClientHandshake::new(ClientConfig {
        export_name: String::new(),
        structured_replies: true,
        meta_contexts: vec![],
    });
    client.feed(&[0u8; 18]);
    assert!(matches!(client.poll(), Err(ProtoError::BadMagic { .. })));

    let mut client = ClientHandshake::new(ClientConfig {
        export_name: String::new(),
        structured_replies: true,
        meta_contexts: vec![],
    });
    let mut greeting = wire::NBD_MAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&0u16.to_be_bytes());
    client.feed(&greeting);
    assert_eq!(client.poll(), Err(ProtoError::NotFixedNewstyle));

    let mut client = ClientHandshake::new(ClientConfig {
        export_name: String::new(),
        structured_replies: true,
        meta_contexts: vec![],
    });
    greeting.truncate(16);
    greeting.extend_from_slice(&wire::FLAG_FIXED_NEWSTYLE.to_be_bytes());
    client.feed(&greeting);
    client.poll().unwrap();
    let mut stray = Vec::new();
    OptionReply::new(wire::OPT_LIST, OptionReplyKind::Ack).encode(&mut stray);
    client.feed(&stray);
    assert!(matches!(client.poll(), Err(ProtoError::Malformed(_))));
}

fn config(name: &str) -> ClientConfig {
    ClientConfig {
        export_name: name.into(),
        structured_replies: true,
        meta_contexts: vec![BASE_ALLOCATION.into()],
    }
}

#[test]
fn tls_client_against_each_server_mode() {
    for step in [1, 7, 4096] {
        for mode in [TlsMode::On, TlsMode::Require] {
            let (client, server, upgraded) = run_tls(config("disk0"), step, mode, true);
            let client = client.expect("negotiated over TLS");
            let server = server.expect("server negotiated");
            assert_eq!(upgraded, (true, true), "{mode:?}");
            // Everything negotiated after the upgrade counts.
            assert!(client.structured_replies && server.structured_replies);
            assert_eq!(Some(client.meta_contexts[0].0), server.base_allocation_id);
        }
        // A server without TLS refuses, and a client that asked for TLS does not go on.
        let (client, server, upgraded) = run_tls(config("disk0"), step, TlsMode::Off, true);
        assert_eq!(upgraded, (false, false));
        assert!(server.is_none());
        match client {
            Err(ProtoError::Rejected {
                option: wire::OPT_STARTTLS,
                reply_type: wire::REP_ERR_POLICY,
                ..
            }) => {}
            other => panic!("expected the STARTTLS refusal, got {other:?}"),
        }
    }
}

#[test]
fn plain_client_against_each_server_mode() {
    for mode in [TlsMode::Off, TlsMode::On] {
        let (client, _, upgraded) = run_tls(config("disk0"), 5, mode, false);
        assert!(client.expect("plain negotiation").structured_replies);
        assert_eq!(upgraded, (false, false));
    }
    // FORCEDTLS: structured replies are refused (the client goes on without them), then GO
    // is refused with the error that names TLS.
    let (client, server, _) = run_tls(config("disk0"), 5, TlsMode::Require, false);
    assert!(server.is_none());
    match client {
        Err(
            e @ ProtoError::Rejected {
                option: wire::OPT_GO,
                reply_type: wire::REP_ERR_TLS_REQD,
                ..
            },
        ) => assert!(e.to_string().contains("NBD_REP_ERR_TLS_REQD"), "{e}"),
        other => panic!("expected NBD_REP_ERR_TLS_REQD, got {other:?}"),
    }
}

/// Drives a server in `mode` with `before` (client flags and options in clear); after an
/// acknowledged STARTTLS, feeds `after` as the decrypted stream. Returns every reply, the
/// StartTls leftover if any, and the final event.
fn tls_session(
    mode: TlsMode,
    before: &[u8],
    after: &[u8],
) -> (
    Vec<OptionReply>,
    Option<Vec<u8>>,
    Result<ServerEvent, ProtoError>,
) {
    let mut server = ServerHandshake::with_tls(mode);
    server.take_output();
    server.feed(before);
    let mut event = server.poll(&catalog());
    let (mut replies, rest) = decode_replies(server.take_output());
    assert!(rest.is_empty(), "only option replies before the upgrade");
    let mut leftover = None;
    if let Ok(ServerEvent::StartTls { leftover: l }) = &event {
        assert!(server.tls_active());
        leftover = Some(l.clone());
        server.feed(after);
        event = server.poll(&catalog());
        let (more, _) = decode_replies(server.take_output());
        replies.extend(more);
    }
    (replies, leftover, event)
}

fn error_type(reply: &OptionReply) -> Option<u32> {
    match reply.kind {
        OptionReplyKind::Error { reply_type, .. } => Some(reply_type),
        _ => None,
    }
}

#[test]
fn forced_tls_refuses_everything_but_starttls_and_abort() {
    let mut bytes = client_flags();
    OptionRequest::List.encode(&mut bytes);
    OptionRequest::StructuredReply.encode(&mut bytes);
    OptionRequest::Go {
        name: "disk0".into(),
        info_requests: vec![],
    }
    .encode(&mut bytes);
    OptionRequest::Info {
        name: "disk0".into(),
        info_requests: vec![],
    }
    .encode(&mut bytes);
    OptionRequest::Unknown {
        code: 0x4321,
        data: vec![],
    }
    .encode(&mut bytes);
    OptionRequest::Abort.encode(&mut bytes);
    let (replies, leftover, event) = tls_session(TlsMode::Require, &bytes, &[]);
    assert_eq!(event, Ok(ServerEvent::Aborted));
    assert!(leftover.is_none());
    let types: Vec<_> = replies.iter().map(error_type).collect();
    assert_eq!(
        types,
        [Some(wire::REP_ERR_TLS_REQD); 5]
            .iter()
            .copied()
            .chain([None])
            .collect::<Vec<_>>()
    );
    assert_eq!(replies[5].kind, OptionReplyKind::Ack);

    // NBD_OPT_EXPORT_NAME cannot be refused with an error: the session ends.
    let mut bytes = client_flags();
    OptionRequest::ExportName("disk0".into()).encode(&mut bytes);
    let (replies, _, event) = tls_session(TlsMode::Require, &bytes, &[]);
    assert!(replies.is_empty());
    assert_eq!(event, Err(ProtoError::TlsRequired));
}

#[test]
fn starttls_rules_data_repeat_leftover_and_reset_state() {
    // With data: invalid, and haggling goes on (still before TLS).
    let mut bytes = client_flags();
    OptionRequest::Unknown {
        code: wire::OPT_STARTTLS,
        data: vec![1, 2],
    }
    .encode(&mut bytes);
    OptionRequest::Abort.encode(&mut bytes);
    let (replies, _, event) = tls_session(TlsMode::Require, &bytes, &[]);
    assert_eq!(error_type(&replies[0]), Some(wire::REP_ERR_INVALID));
    assert_eq!(event, Ok(ServerEvent::Aborted));

    // SELECTIVETLS: structured replies asked in clear are dropped by the upgrade; bytes sent
    // after STARTTLS belong to TLS; a second STARTTLS is invalid; no TLS_REQD after it.
    let mut before = client_flags();
    OptionRequest::StructuredReply.encode(&mut before);
    OptionRequest::StartTls.encode(&mut before);
    before.extend_from_slice(b"\x16\x03\x01 hello");
    let mut after = Vec::new();
    OptionRequest::StartTls.encode(&mut after);
    OptionRequest::List.encode(&mut after);
    OptionRequest::Go {
        name: "disk0".into(),
        info_requests: vec![],
    }
    .encode(&mut after);
    let (replies, leftover, event) = tls_session(TlsMode::On, &before, &after);
    assert_eq!(leftover.as_deref(), Some(&b"\x16\x03\x01 hello"[..]));
    assert_eq!(replies[0].kind, OptionReplyKind::Ack); // structured replies, in clear
    assert_eq!(
        (replies[1].option, &replies[1].kind),
        (wire::OPT_STARTTLS, &OptionReplyKind::Ack)
    );
    assert_eq!(
        (replies[2].option, error_type(&replies[2])),
        (wire::OPT_STARTTLS, Some(wire::REP_ERR_INVALID))
    );
    assert!(replies[3..]
        .iter()
        .all(|r| error_type(r) != Some(wire::REP_ERR_TLS_REQD)));
    let Ok(ServerEvent::Done(n)) = event else {
        panic!("expected GO to succeed, got {event:?}")
    };
    assert!(
        !n.structured_replies,
        "negotiated before STARTTLS, so forgotten"
    );
}

#[test]
fn client_starttls_is_first_and_refusal_is_final() {
    let mut greeting = wire::NBD_MAGIC.to_be_bytes().to_vec();
    greeting.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&wire::FLAG_FIXED_NEWSTYLE.to_be_bytes());
    for refusal in [
        wire::REP_ERR_UNSUP,
        wire::REP_ERR_POLICY,
        wire::REP_ERR_INVALID,
    ] {
        let mut client = ClientHandshake::new(config("disk0")).with_starttls();
        client.feed(&greeting);
        assert_eq!(client.poll(), Ok(ClientEvent::NeedInput));
        let sent = client.take_output();
        let mut expected = wire::FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        OptionRequest::StartTls.encode(&mut expected);
        assert_eq!(sent, expected, "STARTTLS comes before any other option");
        let mut reply = Vec::new();
        OptionReply::new(
            wire::OPT_STARTTLS,
            OptionReplyKind::Error {
                reply_type: refusal,
                message: "no".into(),
            },
        )
        .encode(&mut reply);
        client.feed(&reply);
        let err = client.poll().unwrap_err();
        assert!(err.to_string().contains("NBD_OPT_STARTTLS"), "{err}");
        assert!(client.take_output().is_empty(), "nothing more in clear");
    }
    // Acknowledged: nothing else is queued until the embedder has run TLS and polls again.
    let mut client = ClientHandshake::new(config("disk0")).with_starttls();
    client.feed(&greeting);
    client.poll().unwrap();
    client.take_output();
    let mut ack = Vec::new();
    OptionReply::new(wire::OPT_STARTTLS, OptionReplyKind::Ack).encode(&mut ack);
    client.feed(&ack);
    assert_eq!(client.poll(), Ok(ClientEvent::StartTls));
    assert!(client.take_output().is_empty());
    assert_eq!(client.poll(), Ok(ClientEvent::NeedInput));
    let mut expected = Vec::new();
    OptionRequest::StructuredReply.encode(&mut expected);
    assert_eq!(client.take_output(), expected);
    // Bytes after the acknowledgement would be in clear where TLS must start: refused.
    let mut client = ClientHandshake::new(config("disk0")).with_starttls();
    client.feed(&greeting);
    client.poll().unwrap();
    ack.push(0x16);
    client.feed(&ack);
    assert!(matches!(client.poll(), Err(ProtoError::Malformed(_))));
}
