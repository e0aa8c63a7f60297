//! Unix socket files that stay put: a live server's socket is never taken over, a stale one
//! is replaced, a non-socket is never removed, and shutdown neither needs the socket file nor
//! deletes somebody else's.

mod support;

use nbd_proto::Command;
use server::{BindAddr, Export, ExportRegistry, ServerConfig, ServerHandle};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::Duration;
use support::{pattern, MemExport, RawClient};

const MIB: u64 = 1024 * 1024;
/// A shutdown that has not returned after this long is taken as hung (never reached when
/// shutdown works; it only turns a hang into a failure).
const SHUTDOWN_HUNG: Duration = Duration::from_secs(20);

fn start(path: &Path) -> io::Result<ServerHandle> {
    let registry = ExportRegistry::new();
    registry
        .add(MemExport::new("d", MIB) as Arc<dyn Export>)
        .unwrap();
    server::start(
        &BindAddr::Unix(path.to_path_buf()),
        registry,
        ServerConfig::default(),
    )
}

/// Shuts `handle` down, failing the test if that hangs.
fn shutdown(handle: ServerHandle) {
    let (tx, rx) = mpsc::channel();
    let worker = thread::spawn(move || {
        handle.shutdown();
        tx.send(()).unwrap();
    });
    rx.recv_timeout(SHUTDOWN_HUNG).expect("shutdown hung");
    worker.join().unwrap();
}

/// Connects, writes and reads back a block.
fn check_serves(path: &Path) {
    let mut c = RawClient::connect_unix(path, "d", true).unwrap();
    let data = pattern(4096, 9);
    assert_eq!(
        c.call(Command::Write, 0, 8192, 4096, &data).unwrap().error,
        None
    );
    assert_eq!(
        c.call(Command::Read, 0, 8192, 4096, &[]).unwrap().data,
        data
    );
}

#[test]
fn a_second_server_on_a_live_socket_fails_and_the_first_stays() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let first = start(&path).unwrap();
    let err = start(&path).err().expect("the path is taken");
    assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
    let message = err.to_string();
    assert!(message.contains(path.to_str().unwrap()), "{message}");
    assert!(message.contains("another server is listening"), "{message}");
    check_serves(&path);
    // The failed attempt left nothing behind next to the socket.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    shutdown(first);
    assert!(!path.exists(), "the first server removed its socket");
}

#[test]
fn a_stale_socket_file_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    drop(UnixListener::bind(&path).unwrap());
    assert!(UnixStream::connect(&path).is_err(), "stale: nobody listens");
    let handle = start(&path).unwrap();
    check_serves(&path);
    shutdown(handle);
}

#[test]
fn a_regular_file_at_the_path_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    std::fs::write(&path, b"precious").unwrap();
    let err = start(&path).err().expect("not a socket");
    assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
    assert!(err.to_string().contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn shutdown_completes_when_the_socket_file_was_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nbd.sock");
    let handle = start(&path).unwrap();
    // A connection is open too: shutdown must close it as well.
    let mut c = RawClient::connect_unix(&path, "d", true).unwrap();
    std::fs::remove_file(&path).unwrap();
    shutdown(handle);
    let mut rest = Vec::new();
    assert_eq!(
        io::Read::read_to_end(&mut c.stream, &mut rest).unwrap_or(0),
        0
    );
}

#[test]
fn shutdown_leaves_a_replacement_alone() {
    let dir = tempfile::tempdir().unwrap();
    // Replaced by another server's socket.
    let path = dir.path().join("a.sock");
    let handle = start(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let theirs = UnixListener::bind(&path).unwrap();
    shutdown(handle);
    assert!(std::fs::symlink_metadata(&path)
        .unwrap()
        .file_type()
        .is_socket());
    let client = UnixStream::connect(&path).expect("their socket still works");
    drop((client, theirs));
    // Replaced by a regular file.
    let path = dir.path().join("b.sock");
    let handle = start(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, b"theirs").unwrap();
    shutdown(handle);
    assert_eq!(std::fs::read(&path).unwrap(), b"theirs");
}

#[test]
fn a_tcp_server_shuts_down_without_connecting_to_itself() {
    let registry = ExportRegistry::new();
    let handle = server::start(
        &BindAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        registry,
        ServerConfig::default(),
    )
    .unwrap();
    let server::LocalAddr::Tcp(addr) = handle.local_addr().clone() else {
        panic!("expected a TCP address")
    };
    shutdown(handle);
    assert!(std::net::TcpStream::connect(addr).is_err());
}
