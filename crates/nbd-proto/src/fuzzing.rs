//! Entry points that feed arbitrary bytes to every decoder; shared by the cargo-fuzz targets
//! (`fuzz/`), the stable-toolchain fallback runner and the property tests.
//!
//! Owns: nothing but the driving loops. Each function must return normally for every input;
//! a panic here is a bug in a decoder.
//!
//! Invariants checked: a decoder that reports `Done { consumed }` consumed at least one byte and
//! no more than it was given; `Needed(n)` asks for more than it has.
//!
//! Fault model: the input is hostile by construction.

use crate::option::OptionReply;
use crate::reply::decode_reply;
use crate::request::Request;
use crate::server_handshake::{ExportCatalog, ExportInfo, ExportListing, ServerHandshake};
use crate::wire::Decoded;
use crate::{BlockSize, ClientConfig, ClientHandshake, ExportCaps, TransmissionContext};

struct OneExport;

impl ExportCatalog for OneExport {
    fn list(&self) -> Vec<ExportListing> {
        vec![ExportListing {
            name: "fuzz".into(),
            description: "fuzz export".into(),
        }]
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        (name == "fuzz" || name.is_empty()).then(|| ExportInfo {
            name: "fuzz".into(),
            description: "fuzz export".into(),
            size_bytes: 1 << 20,
            caps: ExportCaps::ALL,
            block_size: BlockSize::TIERCACHE,
        })
    }
}

/// Splits the input into feeds of varying size (first byte picks the chunking).
fn feeds(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let step = usize::from(data.first().copied().unwrap_or(0) % 32) + 1;
    data.get(1..).unwrap_or(&[]).chunks(step)
}

/// Server handshake fed with client bytes; on success the leftover is decoded as requests.
/// Bits 5–6 of the first byte pick the TLS mode; after an acknowledged `NBD_OPT_STARTTLS` the
/// rest of the input stands for the decrypted stream.
pub fn server_handshake(data: &[u8]) {
    let tls_mode = match data.first().map_or(0, |b| (b >> 5) % 3) {
        0 => crate::TlsMode::Off,
        1 => crate::TlsMode::On,
        _ => crate::TlsMode::Require,
    };
    let mut hs = ServerHandshake::with_tls(tls_mode);
    for feed in feeds(data) {
        hs.feed(feed);
        match hs.poll(&OneExport) {
            Ok(crate::ServerEvent::NeedInput | crate::ServerEvent::StartTls { .. }) => {
                hs.take_output();
            }
            Ok(crate::ServerEvent::Done(negotiated)) => {
                let ctx = TransmissionContext::from_negotiated(&negotiated);
                requests_with(&negotiated.leftover, &ctx);
                return;
            }
            Ok(crate::ServerEvent::Aborted) | Err(_) => return,
        }
    }
}

/// Client handshake fed with server bytes (bit 6 of the first byte asks for TLS first; after
/// `NBD_OPT_STARTTLS` is acknowledged the rest stands for the decrypted stream).
pub fn client_handshake(data: &[u8]) {
    let mut hs = ClientHandshake::new(ClientConfig {
        export_name: "fuzz".into(),
        structured_replies: data.first().is_some_and(|b| b & 1 == 1),
        meta_contexts: vec![crate::BASE_ALLOCATION.into()],
    });
    if data.first().is_some_and(|b| b & 0x40 != 0) {
        hs = hs.with_starttls();
    }
    for feed in feeds(data) {
        hs.feed(feed);
        match hs.poll() {
            Ok(crate::ClientEvent::NeedInput | crate::ClientEvent::StartTls) => {
                hs.take_output();
            }
            Ok(crate::ClientEvent::Done(_)) | Err(_) => return,
        }
    }
}

/// Request headers decoded back to back and validated.
pub fn requests(data: &[u8]) {
    let negotiated_ctx = TransmissionContext {
        size_bytes: u64::from(data.first().copied().unwrap_or(0)) << 12,
        flags: crate::TransmissionFlags(u16::from_be_bytes([
            data.get(1).copied().unwrap_or(0),
            data.get(2).copied().unwrap_or(0),
        ])),
        structured_replies: data.get(3).is_some_and(|b| b & 1 == 1),
        base_allocation_id: data.get(3).and_then(|b| (b & 2 == 2).then_some(1)),
        block_size: BlockSize::TIERCACHE,
    };
    requests_with(data.get(4..).unwrap_or(&[]), &negotiated_ctx);
}

fn requests_with(mut data: &[u8], ctx: &TransmissionContext) {
    loop {
        match Request::decode(data) {
            Ok(Decoded::Done { value, consumed }) => {
                assert!(consumed > 0 && consumed <= data.len());
                if let Ok(valid) = ctx.validate(&value) {
                    check_valid(ctx, &valid);
                }
                let payload = value.payload_bytes() as usize;
                let Some(rest) = data
                    .get(consumed..)
                    .and_then(|d| d.get(payload.min(d.len())..))
                else {
                    return;
                };
                data = rest;
            }
            Ok(Decoded::Needed(n)) => {
                assert!(n > data.len());
                return;
            }
            Err(_) => return,
        }
    }
}

fn check_valid(ctx: &TransmissionContext, valid: &crate::ValidRequest) {
    use crate::ValidRequest as V;
    let range = match *valid {
        V::Read { offset, length, .. }
        | V::Write { offset, length, .. }
        | V::Trim { offset, length, .. }
        | V::Cache { offset, length }
        | V::WriteZeroes { offset, length, .. }
        | V::BlockStatus { offset, length, .. } => Some((offset, length)),
        V::Disconnect | V::Flush => None,
    };
    if let Some((offset, length)) = range {
        assert!(offset + u64::from(length) <= ctx.size_bytes);
    }
}

/// Replies decoded back to back, as a client would.
pub fn replies(mut data: &[u8]) {
    let max = 1 << 16;
    loop {
        match decode_reply(data, max) {
            Ok(Decoded::Done { consumed, .. }) => {
                assert!(consumed > 0 && consumed <= data.len());
                data = &data[consumed..];
            }
            Ok(Decoded::Needed(n)) => {
                assert!(n > data.len());
                break;
            }
            Err(_) => break,
        }
    }
    if let Ok(Decoded::Done { consumed, .. }) = OptionReply::decode(data) {
        assert!(consumed <= data.len());
    }
}
