//! `NbdDevice` over TLS (`nbds://`) against nbdkit (gnutls) with `--tls=require`: data through
//! several TLS connections at once, client certificates required or not, each kind of refusal
//! (server not trusted, client certificate missing or from another CA, a server without TLS,
//! a clear-text client where TLS is required), and reconnection over TLS after a restart.
//!
//! A missing nbdkit fails the tests under CI=true and is a printed skip otherwise.

mod common;
use blockdev::{BlockDevice, NbdDevice, NbdOptions};
use common::have_nbdkit;
use nbd_tls::testcerts::Pki;
use std::io;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// nbdkit's memory plugin on a TCP port of 127.0.0.1, with `tls_args`.
struct Nbdkit {
    dir: tempfile::TempDir,
    port: u16,
    tls_args: Vec<String>,
    child: Option<Child>,
}

impl Nbdkit {
    fn start(tls_args: &[&str]) -> Nbdkit {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut k = Nbdkit {
            dir: tempfile::tempdir().unwrap(),
            port,
            tls_args: tls_args.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        k.restart();
        k
    }

    fn restart(&mut self) {
        let pidfile = self.dir.path().join("nbdkit.pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new("nbdkit")
            .args(["-f", "-i", "127.0.0.1", "-p", &self.port.to_string(), "-P"])
            .arg(&pidfile)
            .args(&self.tls_args)
            .args(["memory", "64M"])
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nbdkit");
        self.child = Some(child);
        let t = Instant::now();
        while !pidfile.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "nbdkit did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `nbds://localhost:PORT/` with the client credentials of `dir`.
    fn uri(&self, dir: &Path) -> String {
        format!(
            "nbds://localhost:{}/?tls-certificates={}&timeout=10",
            self.port,
            dir.display()
        )
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        self.kill();
    }
}

fn pki() -> (tempfile::TempDir, Pki) {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::make(dir.path()).unwrap();
    (dir, pki)
}

fn tls_dir_arg(pki: &Pki) -> String {
    format!("--tls-certificates={}", pki.dir.display())
}

/// Each thread writes its own pattern to its own blocks, then reads them back.
fn writes_read_back(dev: &Arc<NbdDevice>) {
    let threads: Vec<_> = (0..6u8)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                for i in 0..20u64 {
                    let len = 4096 * (1 + (i as usize % 16));
                    let offset = (u64::from(t) * 64 + i * 3) << 16;
                    let data = vec![t.wrapping_mul(31).wrapping_add(i as u8); len];
                    dev.write_at(&data, offset).unwrap();
                    let mut back = vec![0u8; len];
                    dev.read_at(&mut back, offset).unwrap();
                    assert!(back == data, "thread {t} block {i} read back wrong");
                }
                dev.flush().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn connect_err(uri: &str) -> String {
    match NbdDevice::connect(uri) {
        Ok(_) => panic!("{uri}: connected"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn data_over_tls_on_several_connections_and_after_a_restart() {
    if !have_nbdkit() {
        return;
    }
    let (_d, pki) = pki();
    let mut k = Nbdkit::start(&["--tls=require", &tls_dir_arg(&pki)]);
    let dev = Arc::new(NbdDevice::connect(&k.uri(&pki.anonymous)).unwrap());
    assert!(
        dev.connections() > 1,
        "nbdkit's memory plugin is multi-conn"
    );
    writes_read_back(&dev);
    // A restart loses the memory disk; the device reconnects over TLS and reads work.
    k.kill();
    k.restart();
    let mut buf = vec![1u8; 4096];
    dev.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    Arc::try_unwrap(dev).unwrap().close().unwrap();
}

#[test]
fn client_certificates_when_the_server_verifies_them() {
    if !have_nbdkit() {
        return;
    }
    let (_d, pki) = pki();
    let k = Nbdkit::start(&["--tls=require", "--tls-verify-peer", &tls_dir_arg(&pki)]);
    let options = NbdOptions {
        connections: 1,
        ..NbdOptions::default()
    };
    let dev = Arc::new(NbdDevice::connect_with(&k.uri(&pki.dir), options).unwrap());
    writes_read_back(&dev);
    drop(dev);
    for dir in [&pki.anonymous, &pki.rogue] {
        let err = connect_err(&k.uri(dir));
        assert!(err.contains("TLS"), "{dir:?}: {err}");
    }
}

#[test]
fn refusals_say_why() {
    if !have_nbdkit() {
        return;
    }
    let (_d, pki) = pki();
    let k = Nbdkit::start(&["--tls=require", &tls_dir_arg(&pki)]);
    // A server certificate from a CA we do not trust.
    let err = connect_err(&k.uri(&pki.wrong_ca));
    assert!(err.contains("UnknownIssuer"), "{err}");
    // The certificate is for localhost, not for this name.
    let err = connect_err(&format!(
        "{}&tls-hostname=elsewhere.example",
        k.uri(&pki.dir)
    ));
    assert!(err.contains("not valid for name"), "{err}");
    // In clear against a server that requires TLS.
    let err = connect_err(&format!("nbd://localhost:{}/", k.port));
    assert!(err.contains("NBD_REP_ERR_TLS_REQD"), "{err}");
    // TLS against a server without it: refused, never continued in clear.
    let plain = Nbdkit::start(&["--tls=off"]);
    let err = connect_err(&plain.uri(&pki.dir));
    assert!(err.contains("NBD_OPT_STARTTLS"), "{err}");
    // Files that are not there.
    let err = NbdDevice::connect(&format!(
        "nbds://localhost:{}/?tls-ca=/nonexistent/ca.pem",
        k.port
    ))
    .unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
}
