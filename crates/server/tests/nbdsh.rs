//! Protocol-level behaviour checked with libnbd (python bindings), and a differential test
//! against `nbdkit memory` running the same scripted command sequence.

mod support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};
use support::{python_with_nbd, require, run_python, MemExport, TestServer};

const MIB: u64 = 1024 * 1024;

#[test]
fn libnbd_protocol_script() {
    let Some(python) = python_with_nbd() else {
        return;
    };
    let srv = TestServer::start(vec![
        MemExport::new("disk0", 4 * MIB),
        MemExport::with_mode("ro", MIB, true),
    ]);
    let out = run_python(&python, "protocol.py", &[srv.socket.to_str().unwrap()]);
    assert!(out.contains("ALL OK"), "{out}");
}

/// Kills the child on drop.
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn same_answers_as_nbdkit_memory() {
    let Some(python) = python_with_nbd() else {
        return;
    };
    if !require("nbdkit", &["--version"]) {
        return;
    }
    let srv = TestServer::start(vec![MemExport::new("", 8 * MIB)]);
    let kit_sock = srv.dir.path().join("nbdkit.sock");
    let kit = Reaper(
        Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(&kit_sock)
            .args(["memory", "8M"])
            .spawn()
            .expect("spawn nbdkit"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !kit_sock.exists() {
        assert!(
            Instant::now() < deadline,
            "nbdkit did not create its socket"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ours = run_python(&python, "sequence.py", &[srv.socket.to_str().unwrap()]);
    let theirs = run_python(&python, "sequence.py", &[kit_sock.to_str().unwrap()]);
    drop(kit);
    assert!(ours.lines().count() > 40, "{ours}");
    for (n, (a, b)) in ours.lines().zip(theirs.lines()).enumerate() {
        assert_eq!(a, b, "line {n} differs:\nours:\n{ours}\nnbdkit:\n{theirs}");
    }
    assert_eq!(ours.lines().count(), theirs.lines().count());
}
