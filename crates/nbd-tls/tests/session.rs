//! TLS sessions over socket pairs: handshakes with each kind of credential (trusted, none,
//! rogue, untrusted server, wrong name), reading and writing one session from several threads
//! at once (the sharing rule of the crate docs), large writes, clean and unclean ends, and
//! credential files that do not load.

use nbd_tls::testcerts::Pki;
use nbd_tls::{ClientTls, ServerTls, Session, TlsReader, WRITE_CHUNK_BYTES};
use rand::{Rng, SeedableRng};
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread;

fn pki() -> (tempfile::TempDir, Pki) {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path()).unwrap();
    (dir, pki)
}

fn server_tls(pki: &Pki, verify: bool) -> ServerTls {
    let ca = pki.ca_cert();
    ServerTls::load(
        &pki.server_cert(),
        &pki.server_key(),
        verify.then_some(ca.as_path()),
    )
    .unwrap()
}

/// A client that trusts `dir/ca-cert.pem` and presents `dir/client-*.pem` if they exist.
fn client_tls(dir: &Path, name: &str) -> ClientTls {
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    let identity = cert.exists().then_some((cert.as_path(), key.as_path()));
    ClientTls::load(&dir.join("ca-cert.pem"), identity, name).unwrap()
}

/// One end of a connection after the handshake.
struct End {
    reader: TlsReader<UnixStream>,
    stream: UnixStream,
}

fn start(session: Session, stream: UnixStream) -> io::Result<End> {
    let mut reader = TlsReader::new(Arc::new(session), stream.try_clone()?, &[]);
    reader.handshake(&mut &stream)?;
    Ok(End { reader, stream })
}

/// Both handshakes over a socket pair; each side's result.
fn connect(server: &ServerTls, client: &ClientTls) -> (io::Result<End>, io::Result<End>) {
    let (a, b) = UnixStream::pair().unwrap();
    let server = Session::server(server).unwrap();
    let s = thread::spawn(move || start(server, a));
    let c = start(Session::client(client).unwrap(), b);
    // A refused client learns it at its first read (TLS 1.3 checks its certificate last).
    let c = c.and_then(|end| {
        end.reader.session().flush(&mut &end.stream)?;
        Ok(end)
    });
    (s.join().unwrap(), c)
}

/// Writes one framed message: id, length, payload.
fn send(end_session: &Session, stream: &UnixStream, id: u32, payload: &[u8]) {
    let mut head = id.to_be_bytes().to_vec();
    head.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    end_session
        .write_all(&mut &*stream, &[&head, payload])
        .unwrap();
}

fn recv(reader: &mut impl Read) -> Option<(u32, Vec<u8>)> {
    let mut head = [0u8; 8];
    if let Err(e) = reader.read_exact(&mut head) {
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
        return None;
    }
    let id = u32::from_be_bytes(head[..4].try_into().unwrap());
    let mut payload = vec![0u8; u32::from_be_bytes(head[4..].try_into().unwrap()) as usize];
    reader.read_exact(&mut payload).unwrap();
    Some((id, payload))
}

fn answer(payload: &[u8]) -> Vec<u8> {
    payload.iter().rev().map(|b| b ^ 0x5a).collect()
}

#[test]
fn one_reader_and_many_writers_share_a_session_both_ways() {
    let (_dir, pki) = pki();
    let (server, client) = connect(&server_tls(&pki, true), &client_tls(&pki.dir, "localhost"));
    let (mut server, mut client) = (server.unwrap(), client.unwrap());
    assert!(server.reader.session().peer_has_certificate());
    assert!(server.reader.session().describe().contains("TLS"));
    const MESSAGES: u32 = 300;
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    // Server: one reader hands each message to one of four writers, which answer it under
    // a shared write lock while the reader goes on reading.
    let server_thread = thread::spawn(move || {
        let session = server.reader.session().clone();
        let stream = server.stream.try_clone().unwrap();
        let write_lock = Arc::new(Mutex::new(()));
        let (tx, rx) = std::sync::mpsc::channel::<(u32, Vec<u8>)>();
        let rx = Arc::new(Mutex::new(rx));
        let writers: Vec<_> = (0..4)
            .map(|_| {
                let (session, stream, lock, rx) = (
                    session.clone(),
                    stream.try_clone().unwrap(),
                    write_lock.clone(),
                    rx.clone(),
                );
                thread::spawn(move || loop {
                    let Ok((id, payload)) = rx.lock().unwrap().recv() else {
                        return;
                    };
                    let _held = lock.lock().unwrap();
                    send(&session, &stream, id, &answer(&payload));
                })
            })
            .collect();
        let mut count = 0;
        while let Some(message) = recv(&mut server.reader) {
            tx.send(message).unwrap();
            count += 1;
        }
        drop(tx);
        for w in writers {
            w.join().unwrap();
        }
        count
    });
    // Client: one thread sends while this one reads the answers.
    let sent: Vec<Vec<u8>> = {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..MESSAGES)
            .map(|i| {
                let len = match i % 10 {
                    0 => rng.gen_range(WRITE_CHUNK_BYTES..3 * WRITE_CHUNK_BYTES),
                    _ => rng.gen_range(0..20_000),
                };
                (0..len).map(|_| rng.gen()).collect()
            })
            .collect()
    };
    let sender = {
        let session = client.reader.session().clone();
        let stream = client.stream.try_clone().unwrap();
        let sent = sent.clone();
        thread::spawn(move || {
            for (id, payload) in sent.iter().enumerate() {
                send(&session, &stream, id as u32, payload);
            }
        })
    };
    let mut seen = vec![false; sent.len()];
    for _ in 0..MESSAGES {
        let (id, payload) = recv(&mut client.reader).expect("an answer per message");
        assert!(!seen[id as usize], "answer {id} twice");
        seen[id as usize] = true;
        assert!(
            payload == answer(&sent[id as usize]),
            "answer {id} corrupted"
        );
    }
    sender.join().unwrap();
    // A clean end: close_notify reads as end of stream on the other side.
    client.reader.session().close(&mut &client.stream).unwrap();
    assert_eq!(server_thread.join().unwrap(), MESSAGES);
}

#[test]
fn stream_end_without_close_notify_is_unexpected() {
    let (_dir, pki) = pki();
    let (server, client) = connect(
        &server_tls(&pki, false),
        &client_tls(&pki.anonymous, "localhost"),
    );
    let (mut server, client) = (server.unwrap(), client.unwrap());
    send(client.reader.session(), &client.stream, 7, b"hello");
    client.stream.shutdown(std::net::Shutdown::Both).unwrap();
    assert_eq!(recv(&mut server.reader), Some((7, b"hello".to_vec())));
    let err = server.reader.read(&mut [0u8; 10]).unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    assert!(!server.reader.session().peer_has_certificate());
}

fn refused(result: io::Result<End>) -> String {
    match result {
        Ok(mut end) => {
            // The failure shows at the first read.
            let err = end.reader.read(&mut [0u8; 1]).unwrap_err();
            err.to_string()
        }
        Err(e) => e.to_string(),
    }
}

#[test]
fn clients_without_a_trusted_certificate_are_refused_when_verifying() {
    let (_dir, pki) = pki();
    let verifying = server_tls(&pki, true);
    for dir in [&pki.anonymous, &pki.rogue] {
        let (server, client) = connect(&verifying, &client_tls(dir, "localhost"));
        let server_err = server.err().expect("the server refuses").to_string();
        assert!(server_err.contains("TLS"), "{dir:?}: {server_err}");
        let client_err = refused(client);
        assert!(
            client_err.to_lowercase().contains("certificate") || client_err.contains("alert"),
            "{dir:?}: {client_err}"
        );
    }
    // Without verification, an anonymous client is fine.
    let (server, client) = connect(
        &server_tls(&pki, false),
        &client_tls(&pki.anonymous, "localhost"),
    );
    assert!(server.is_ok() && client.is_ok());
}

#[test]
fn clients_refuse_an_untrusted_or_misnamed_server() {
    let (_dir, pki) = pki();
    let server = server_tls(&pki, false);
    for (dir, name, why) in [
        (&pki.wrong_ca, "localhost", "UnknownIssuer"),
        (&pki.dir, "otherhost", "not valid for name"),
    ] {
        let (s, c) = connect(&server, &client_tls(dir, name));
        let err = c.err().expect("the client refuses").to_string();
        assert!(err.contains(why), "{name}: {err}");
        assert!(s.is_err(), "the server sees the alert");
    }
    // An IP address works when the certificate names it.
    let (s, c) = connect(&server, &client_tls(&pki.dir, "127.0.0.1"));
    assert!(s.is_ok() && c.is_ok());
}

#[test]
fn credential_files_that_do_not_load_are_named() {
    let (dir, pki) = pki();
    let missing = dir.path().join("missing.pem");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a pem file\n").unwrap();
    let cases = [
        ServerTls::load(&missing, &pki.server_key(), None).unwrap_err(),
        ServerTls::load(&garbage, &pki.server_key(), None).unwrap_err(),
        ServerTls::load(&pki.server_cert(), &garbage, None).unwrap_err(),
        // The client's key does not match the server's certificate.
        ServerTls::load(&pki.server_cert(), &pki.client_key(), None).unwrap_err(),
        ServerTls::load(&pki.server_cert(), &pki.server_key(), Some(&garbage)).unwrap_err(),
        ClientTls::load(&missing, None, "localhost").unwrap_err(),
        ClientTls::load(&pki.ca_cert(), None, "not a name!").unwrap_err(),
    ];
    for (i, err) in cases.iter().enumerate() {
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "case {i}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains("missing.pem")
                || msg.contains("garbage.pem")
                || msg.contains("server-cert.pem")
                || msg.contains("not a name!"),
            "case {i} names no file: {msg}"
        );
    }
}

#[test]
fn a_writer_stuck_on_a_full_socket_does_not_stop_the_reader() {
    let (_dir, pki) = pki();
    let (server, client) = connect(&server_tls(&pki, false), &client_tls(&pki.dir, "localhost"));
    let (mut server, mut client) = (server.unwrap(), client.unwrap());
    // The client reads nothing yet, so this send blocks once the socket buffers are full,
    // part way through a record batch.
    let big = vec![0xabu8; 16 << 20];
    let writer = {
        let session = server.reader.session().clone();
        let stream = server.stream.try_clone().unwrap();
        let big = big.clone();
        thread::spawn(move || send(&session, &stream, 1, &big))
    };
    thread::sleep(std::time::Duration::from_millis(200));
    assert!(!writer.is_finished(), "the socket should be full");
    send(client.reader.session(), &client.stream, 2, b"ping");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = thread::spawn(move || {
        tx.send(recv(&mut server.reader)).unwrap();
        server
    });
    let got = rx
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the reader decrypts while a writer is blocked in send");
    assert_eq!(got, Some((2, b"ping".to_vec())));
    assert_eq!(recv(&mut client.reader), Some((1, big)));
    writer.join().unwrap();
    drop(reader.join().unwrap());
}
