//! TLS through `NBD_OPT_STARTTLS`, with the server's own client side (`nbd-proto` + `nbd-tls`)
//! over TCP: every server mode against clients in clear, with TLS, with TLS and a trusted
//! client certificate, without one, and with one from another CA; the transmission phase over
//! TLS with requests answered out of order by several workers while the connection's reader
//! goes on; `NBD_OPT_EXPORT_NAME` before TLS on a server that requires it.

mod support;

use nbd_proto::Command;
use nbd_tls::testcerts::Pki;
use nbd_tls::ClientTls;
use server::{BindAddr, Export, ExportRegistry, ServerConfig, ServerHandle, ServerTls, TlsConfig};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use support::{pattern, GateExport, MemExport, RawClient, TlsIo, GATED_BELOW};

fn cookie(reply: &nbd_proto::Reply) -> u64 {
    match reply {
        nbd_proto::Reply::Simple { cookie, .. } | nbd_proto::Reply::Chunk { cookie, .. } => *cookie,
    }
}

fn pki() -> (tempfile::TempDir, Pki) {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path()).unwrap();
    (dir, pki)
}

/// The server's TLS settings: `None` for no TLS, else (required, verify client certificates).
fn tls_config(pki: &Pki, mode: Option<(bool, bool)>) -> Option<TlsConfig> {
    mode.map(|(required, verify)| {
        let ca = pki.ca_cert();
        TlsConfig {
            credentials: ServerTls::load(
                &pki.server_cert(),
                &pki.server_key(),
                verify.then_some(ca.as_path()),
            )
            .unwrap(),
            required,
        }
    })
}

fn start(export: Arc<dyn Export>, tls: Option<TlsConfig>) -> (ServerHandle, SocketAddr) {
    let registry = ExportRegistry::new();
    registry.add(export).unwrap();
    let config = ServerConfig {
        tls,
        handshake_timeout: Duration::from_secs(10),
        ..ServerConfig::default()
    };
    let handle = server::start(
        &BindAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        registry,
        config,
    )
    .unwrap();
    let server::LocalAddr::Tcp(addr) = handle.local_addr().clone() else {
        panic!("expected a TCP address")
    };
    (handle, addr)
}

/// A client whose credentials are those of `dir` (libnbd's layout): `None` for clear text.
fn connect(addr: SocketAddr, export: &str, tls_dir: Option<&Path>) -> io::Result<RawClient> {
    let stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
    let upgrade = match tls_dir {
        None => None,
        Some(dir) => {
            let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
            let identity = cert.exists().then_some((cert.as_path(), key.as_path()));
            let tls = ClientTls::load(&dir.join("ca-cert.pem"), identity, "localhost")?;
            Some(TlsIo::upgrade(
                stream.try_clone()?,
                stream.try_clone()?,
                tls,
            ))
        }
    };
    RawClient::handshake_upgrading(Box::new(stream), export, true, upgrade)
}

/// Writes then reads back a block; the error as a string if anything fails.
fn round_trip(client: io::Result<RawClient>) -> Result<(), String> {
    let mut c = client.map_err(|e| e.to_string())?;
    let data = pattern(8192, 5);
    let w = c
        .call(Command::Write, 0, 4096, 8192, &data)
        .map_err(|e| e.to_string())?;
    assert_eq!(w.error, None);
    let r = c
        .call(Command::Read, 0, 4096, 8192, &[])
        .map_err(|e| e.to_string())?;
    assert_eq!(r.data, data);
    Ok(())
}

/// Server TLS (`None`, or (required, verify peer)), client credentials (`None`: clear text),
/// and the error the client must see (`None`: it works).
type Case<'a> = (Option<(bool, bool)>, Option<&'a Path>, Option<&'a str>);

#[test]
fn each_mode_against_each_client() {
    let (_dir, pki) = pki();
    let anonymous = Some(pki.anonymous.as_path());
    let trusted = Some(pki.dir.as_path());
    let rogue = Some(pki.rogue.as_path());
    let cases: [Case; 11] = [
        (None, None, None),
        (None, trusted, Some("NBD_REP_ERR_POLICY")),
        (Some((false, false)), None, None),
        (Some((false, false)), anonymous, None),
        (Some((true, false)), None, Some("NBD_REP_ERR_TLS_REQD")),
        (Some((true, false)), anonymous, None),
        (Some((true, false)), trusted, None),
        (Some((true, true)), None, Some("NBD_REP_ERR_TLS_REQD")),
        (Some((true, true)), anonymous, Some("")),
        (Some((true, true)), rogue, Some("")),
        (Some((true, true)), trusted, None),
    ];
    for (mode, client, expected) in cases {
        let (handle, addr) = start(MemExport::new("d", 1 << 20), tls_config(&pki, mode));
        let result = round_trip(connect(addr, "d", client));
        let what = format!("server {mode:?}, client {client:?}: {result:?}");
        match expected {
            None => assert!(result.is_ok(), "{what}"),
            Some(text) => {
                let err = result.expect_err(&what);
                assert!(err.contains(text), "{what}");
            }
        }
        handle.shutdown();
    }
}

#[test]
fn export_name_before_tls_ends_the_session_when_tls_is_required() {
    let (_dir, pki) = pki();
    let (handle, addr) = start(
        MemExport::new("d", 1 << 20),
        tls_config(&pki, Some((true, false))),
    );
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = (nbd_proto::wire::FLAG_C_FIXED_NEWSTYLE)
        .to_be_bytes()
        .to_vec();
    nbd_proto::OptionRequest::ExportName("d".into()).encode(&mut out);
    s.write_all(&out).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(
        all.len(),
        18,
        "the greeting, then the hang-up: no export data in clear"
    );
    handle.shutdown();
}

#[test]
fn transmission_over_tls_with_replies_out_of_order() {
    let (_dir, pki) = pki();
    let disk = GateExport::new("g");
    let (handle, addr) = start(disk.clone(), tls_config(&pki, Some((true, true))));
    let mut c = connect(addr, "g", Some(&pki.dir)).unwrap();
    assert!(c.negotiated.structured_replies, "negotiated after STARTTLS");
    // A read that waits in the export holds one worker; everything else overtakes it.
    c.send(Command::Read, 0, 1, 0, 4096, &[]).unwrap();
    const N: u64 = 40;
    let block = |i: u64| GATED_BELOW + i * 16384;
    let data = |i: u64| pattern(16384, 100 + i);
    for i in 0..N {
        c.send(Command::Write, 0, 1000 + i, block(i), 16384, &data(i))
            .unwrap();
    }
    let mut written = 0;
    while written < N {
        let (reply, _) = c.recv(|_| 0).unwrap();
        assert_ne!(cookie(&reply), 1, "the gated read cannot have finished");
        written += 1;
    }
    for i in 0..N {
        c.send(Command::Read, 0, 2000 + i, block(i), 16384, &[])
            .unwrap();
    }
    let mut read = vec![Vec::new(); N as usize];
    let mut done = 0;
    while done < N {
        let (reply, _) = c.recv(|_| 0).unwrap();
        let nbd_proto::Reply::Chunk {
            cookie,
            done: last,
            chunk,
        } = reply
        else {
            panic!("structured replies were negotiated: {reply:?}")
        };
        assert!((2000..2000 + N).contains(&cookie), "cookie {cookie}");
        if let nbd_proto::Chunk::OffsetData { data, .. } = chunk {
            read[(cookie - 2000) as usize].extend_from_slice(&data);
        }
        if last {
            done += 1;
        }
    }
    for i in 0..N {
        assert!(
            read[i as usize] == data(i),
            "block {i} read back wrong over TLS"
        );
    }
    assert!(disk.inside_max.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    disk.open_gate();
    let (reply, _) = c.recv(|_| 0).unwrap();
    assert_eq!(cookie(&reply), 1);
    drop(c);
    handle.shutdown();
}
