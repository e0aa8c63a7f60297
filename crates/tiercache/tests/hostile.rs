//! Hostile neighbours and operator mistakes around the sockets, against the real binary: a
//! second server on a live socket path, shutdown after the socket file is gone, socket modes
//! under umask 000, idle connections filling the server, clients that never read their
//! replies, and an exposed TCP address.

mod common;

use common::*;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A connection that completed the NBD handshake for export `data` by hand (fixed newstyle,
/// NBD_OPT_EXPORT_NAME), so the test controls every byte it sends and reads afterwards.
fn handshaken(socket: &std::path::Path) -> std::io::Result<UnixStream> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello)?;
    assert_eq!(&hello[..16], b"NBDMAGICIHAVEOPT", "not an NBD server");
    s.write_all(&3u32.to_be_bytes())?; // FIXED_NEWSTYLE | NO_ZEROES
    s.write_all(b"IHAVEOPT")?;
    s.write_all(&1u32.to_be_bytes())?; // NBD_OPT_EXPORT_NAME
    s.write_all(&4u32.to_be_bytes())?;
    s.write_all(b"data")?;
    let mut info = [0u8; 10]; // export size, transmission flags
    s.read_exact(&mut info)?;
    Ok(s)
}

/// An NBD_CMD_READ request.
fn read_request(cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut r = Vec::with_capacity(28);
    r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r
}

/// Waits for `child` to exit (a hang fails the test instead of hanging it).
fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    wait_for(child, Duration::from_secs(60)).unwrap_or_else(|| panic!("{what} did not exit"))
}

fn sigterm(child: &Child) {
    // SAFETY: sending a signal to our own child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
}

/// A good client: writes a pattern and reads it back through qemu-io.
fn good_client_round_trip(f: &Fixture, pattern: u8) {
    let o = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        &format!("write -P {pattern} 1M 64k"),
        "-c",
        &format!("read -P {pattern} 1M 64k"),
        &f.uri(),
    ]));
    assert!(
        !stdout(&o).contains("Pattern verification failed"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn a_second_server_on_a_live_socket_is_refused_and_the_first_keeps_serving() {
    if !(have("nbdinfo") && have("qemu-io")) {
        return;
    }
    let mut a = Fixture::new(16, 16, false);
    a.start();
    let b = Fixture::new(16, 16, false);
    for admin in [b.admin(), a.admin()] {
        let o = tc()
            .arg("serve")
            .arg("--cache")
            .arg(b.path("fast.img"))
            .arg("--backing")
            .arg(b.path("slow.img"))
            .arg("--socket")
            .arg(a.socket())
            .arg("--admin")
            .arg(&admin)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "second server started");
        assert!(
            err.contains("another server is listening"),
            "unexpected message: {err}"
        );
    }
    // The first server is untouched: reachable, and it stops on SIGTERM.
    good_client_round_trip(&a, 0x5a);
    a.tc_admin(&["status"]);
    // Its devices were released by the refused second server's clean exit: b can serve now.
    let mut b = b;
    b.start();
    b.stop();
    a.stop();
}

#[test]
fn shutdown_does_not_need_the_socket_file() {
    let mut f = Fixture::new(16, 16, false);
    f.start();
    std::fs::remove_file(f.socket()).unwrap();
    std::fs::write(f.socket(), b"somebody else's file").unwrap();
    let mut child = f.server.take().unwrap();
    sigterm(&child);
    let st = wait_exit(&mut child, "server after SIGTERM");
    assert!(st.success(), "{st}");
    assert_eq!(
        std::fs::read(f.socket()).unwrap(),
        b"somebody else's file",
        "the server removed a file that was not its socket"
    );
    assert!(
        !std::path::Path::new(&f.admin()).exists(),
        "admin socket left behind"
    );
}

fn mode_of(path: &std::path::Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn sockets_are_private_whatever_the_umask() {
    for (extra, nbd_mode) in [("", 0o660), ("--socket-mode 0600", 0o600)] {
        let f = Fixture::new(16, 16, false);
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "umask 000; exec {} serve --cache {} --backing {} --socket {} {extra}",
                env!("CARGO_BIN_EXE_tiercache"),
                f.path("fast.img").display(),
                f.path("slow.img").display(),
                f.socket().display()
            ))
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !(f.socket().exists() && std::path::Path::new(&f.admin()).exists()) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(mode_of(&f.socket()), nbd_mode, "NBD socket ({extra})");
        assert_eq!(mode_of(std::path::Path::new(&f.admin())), 0o600, "admin");
        sigterm(&child);
        assert!(wait_exit(&mut child, "server").success());
    }
}

#[test]
fn idle_connections_cannot_lock_out_a_well_behaved_client() {
    if !(have("nbdinfo") && have("qemu-io")) {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start_with(&[
        "--max-connections",
        "8",
        "--max-connections-per-client",
        "1000",
        "--idle-timeout",
        "1",
    ]);
    // Fill every slot (and more) with connections that handshake and then say nothing.
    let idle: Vec<UnixStream> = (0..40)
        .filter_map(|_| handshaken(&f.socket()).ok())
        .collect();
    assert!(
        idle.len() >= 8,
        "only {} idle connections got in",
        idle.len()
    );
    std::thread::sleep(Duration::from_millis(1500));
    // The server is full of idle connections; a real client still gets in and works.
    run(Command::new("nbdinfo").arg(f.uri()));
    good_client_round_trip(&f, 0x3c);
    drop(idle);
    f.stop();
}

#[test]
fn clients_that_never_read_their_replies_hold_bounded_memory() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(72, 16, false);
    f.start_with(&["--request-memory", "64M"]);
    let pid = f.server.as_ref().unwrap().id();
    // Eight connections each ask for 32 MiB reads as fast as they can and never read a byte.
    let hostile: Vec<UnixStream> = (0..8).map(|_| handshaken(&f.socket()).unwrap()).collect();
    let senders: Vec<_> = hostile
        .iter()
        .map(|s| {
            let mut s = s.try_clone().unwrap();
            std::thread::spawn(move || {
                s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
                let mut sent = 0u64;
                for cookie in 0..64u64 {
                    if s.write_all(&read_request(cookie, 0, 32 << 20)).is_err() {
                        break;
                    }
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    // A well-behaved client still gets its small requests answered, correctly.
    for p in 1..=5u8 {
        good_client_round_trip(&f, p);
    }
    for s in senders {
        s.join().unwrap();
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hwm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    eprintln!(
        "server peak RSS with 8 never-reading clients and --request-memory 64M: {hwm_kib} KiB"
    );
    // 64 MiB of request memory, plus per-connection read buffers and per-worker I/O buffers,
    // plus the program itself; without a total budget this was 8 x 128 MiB and more.
    assert!(
        hwm_kib < 320 * 1024,
        "server peak RSS {hwm_kib} KiB with 8 never-reading clients"
    );
    drop(hostile);
    f.stop();
}

#[test]
fn tcp_on_a_non_loopback_address_warns() {
    let f = Fixture::new(16, 16, false);
    let mut child = f
        .serve_cmd()
        .args(["--tcp", "0.0.0.0:0"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !std::path::Path::new(&f.admin()).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    sigterm(&child);
    assert!(wait_exit(&mut child, "server").success());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        err.contains("every network interface") && err.contains("no TLS"),
        "no exposure warning: {err}"
    );
}
