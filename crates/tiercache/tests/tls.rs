//! TLS for network clients, end to end: `tiercache serve --tcp` with each `--tls` mode (and
//! `--tls-verify-peer`) against real clients — nbdinfo, nbdsh and nbdcopy (libnbd/gnutls),
//! qemu-img (qemu's tls-creds-x509) — with and without TLS, with trusted, missing and foreign
//! client certificates; and a second tiercache whose backing device is the first one's export
//! over `nbds://` (the remote backing client over TLS). Certificates are made at test time
//! (rcgen, `nbd_tls::testcerts`) in the directory layout libnbd, qemu and nbdkit share.
//!
//! The results are gathered into the TLS test matrix (client × server mode → result), printed
//! by `cargo test -p tiercache --test tls -- --nocapture` and in any failure. A missing tool is
//! a failure under CI=true and a printed skip otherwise.

use nbd_tls::testcerts::Pki;
use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

mod common;

use common::*;

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The server modes of the matrix: name and `serve` arguments.
fn mode_args(mode: &str, pki: &Pki) -> Vec<String> {
    let cert = |flag: &str, path: &Path| [flag.to_string(), path.display().to_string()];
    let mut args = Vec::new();
    if mode != "off" {
        args.extend(cert("--tls-cert", &pki.server_cert()));
        args.extend(cert("--tls-key", &pki.server_key()));
    }
    match mode {
        "off" => {}
        "on" => args.extend(["--tls".to_string(), "on".to_string()]),
        // Required is the default with a certificate.
        "require" => {}
        "require+verify-peer" => {
            args.push("--tls-verify-peer".into());
            args.extend(cert("--tls-ca", &pki.ca_cert()));
        }
        other => panic!("unknown mode {other}"),
    }
    args
}

/// One row of the matrix per client run.
#[derive(Default)]
struct Matrix {
    rows: Vec<(String, String, bool, Result<(), String>)>,
}

impl Matrix {
    /// Records a client run: `expect_ok`, and for a refusal the text its output (libnbd's
    /// debug log included, where the server's error message is) must have.
    fn record(&mut self, client: &str, mode: &str, expect_ok: bool, must_say: &str, o: Output) {
        let err = format!(
            "{}\n{}",
            String::from_utf8_lossy(&o.stderr),
            String::from_utf8_lossy(&o.stdout)
        );
        let got = if o.status.success() {
            Ok(())
        } else {
            // The client's own message, not its debug log.
            let line = err
                .lines()
                .find(|l| !l.trim().is_empty() && !l.starts_with("libnbd: debug"))
                .unwrap_or("");
            let line = line.split("libnbd: debug").next().unwrap_or(line);
            Err(line.to_string())
        };
        let mut pass = got.is_ok() == expect_ok;
        if !expect_ok && !err.to_lowercase().contains(&must_say.to_lowercase()) {
            pass = false;
        }
        let shown = match (&got, pass) {
            (Ok(()), _) => Ok(()),
            (Err(line), true) => Err(line.clone()),
            (Err(line), false) => Err(format!("{line} [expected it to mention {must_say:?}]")),
        };
        self.rows.push((client.into(), mode.into(), pass, shown));
    }

    fn table(&self) -> String {
        let mut t = String::from("TLS test matrix (client × server mode → result)\n");
        for (client, mode, pass, got) in &self.rows {
            let result = match got {
                Ok(()) => "works".to_string(),
                Err(msg) => format!("refused: {}", msg.chars().take(110).collect::<String>()),
            };
            let mark = if *pass { "ok  " } else { "FAIL" };
            writeln!(t, "{mark} {client:<44} × {mode:<20} → {result}").unwrap();
        }
        t
    }

    fn check(&self) {
        let table = self.table();
        println!("{table}");
        assert!(self.rows.iter().all(|r| r.2), "{table}");
    }
}

fn within(cmd: &mut Command) -> Output {
    output_within(cmd, Duration::from_secs(60)).unwrap_or_else(|| panic!("{cmd:?} hung"))
}

/// nbdinfo with libnbd's debug log, which carries the server's error messages (nbdinfo
/// itself prints only libnbd's reading of the error code: `NBD_REP_ERR_TLS_REQD` shows as
/// "Operation not supported").
fn nbdinfo(uri: &str) -> Output {
    within(Command::new("nbdinfo").env("LIBNBD_DEBUG", "1").arg(uri))
}

/// PATH with /usr/bin first: nbdsh runs `python3 -m nbd`, and the nbd module comes with
/// Debian's python3 (python3-libnbd), not with another python3 earlier on PATH.
fn debian_python_first() -> String {
    format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default())
}

fn uri(port: u16, tls_dir: Option<&Path>) -> String {
    match tls_dir {
        None => format!("nbd://localhost:{port}/data"),
        Some(d) => format!(
            "nbds://localhost:{port}/data?tls-certificates={}",
            d.display()
        ),
    }
}

fn qemu_img(pki_dir: &Path, port: u16, args: &[&str], image_opts_last: bool) -> Output {
    let object = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        pki_dir.display()
    );
    let opts = format!("driver=nbd,host=localhost,port={port},export=data,tls-creds=tls0");
    let mut c = Command::new("qemu-img");
    c.args(&args[..1]).args(["--object", &object]);
    if image_opts_last {
        c.args(&args[1..]).args(["--target-image-opts", &opts]);
    } else {
        c.args(["--image-opts", &opts]).args(&args[1..]);
    }
    within(&mut c)
}

#[test]
fn tls_matrix_with_real_clients() {
    if !(have("nbdinfo") && have("nbdsh") && have("nbdcopy") && have("qemu-img")) {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let pki = Pki::make(certs.path()).unwrap();
    let mut m = Matrix::default();
    let mut f = Fixture::new(64, 32, false);
    let src = f.path("src.raw");
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 % 253) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    for mode in ["off", "on", "require", "require+verify-peer"] {
        let port = free_port();
        let mut args = vec!["--tcp".to_string(), port.to_string()];
        args.extend(mode_args(mode, &pki));
        f.start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let tls_ok = mode != "off";
        let plain_ok = matches!(mode, "off" | "on");
        let anon_ok = matches!(mode, "on" | "require");
        // The server's NBD_REP_ERR_POLICY message to STARTTLS without TLS, and its
        // NBD_REP_ERR_TLS_REQD message to options before STARTTLS when TLS is required.
        let no_tls = "TLS is not enabled";
        let tls_reqd = "this server requires TLS";
        m.record(
            "nbdinfo nbd:// (clear text)",
            mode,
            plain_ok,
            tls_reqd,
            nbdinfo(&uri(port, None)),
        );
        m.record(
            "nbdinfo nbds:// with client cert",
            mode,
            tls_ok,
            no_tls,
            nbdinfo(&uri(port, Some(&pki.dir))),
        );
        m.record(
            "nbdinfo nbds:// without client cert",
            mode,
            anon_ok,
            if mode == "off" {
                no_tls
            } else {
                "TLS fatal alert"
            },
            nbdinfo(&uri(port, Some(&pki.anonymous))),
        );
        if mode == "require+verify-peer" {
            m.record(
                "nbdinfo nbds:// cert from another CA",
                mode,
                false,
                "TLS fatal alert",
                nbdinfo(&uri(port, Some(&pki.rogue))),
            );
        }
        if mode != "off" {
            m.record(
                "nbdinfo nbds:// server from unknown CA",
                mode,
                false,
                "certificate verification",
                nbdinfo(&uri(port, Some(&pki.wrong_ca))),
            );
        }
        if mode.starts_with("require") {
            let u = uri(port, Some(&pki.dir));
            m.record(
                "nbdsh pwrite/pread over nbds://",
                mode,
                true,
                "",
                within(
                    Command::new("nbdsh")
                        .env("PATH", debian_python_first())
                        .args([
                            "-c",
                            "h.set_uri_allow_local_file(True)",
                            "-c",
                            &format!("h.connect_uri({u:?})"),
                            "-c",
                            "buf = b'tls!' * 1024",
                            "-c",
                            "h.pwrite(buf, 1048576)",
                            "-c",
                            "h.flush()",
                            "-c",
                            "assert h.pread(4096, 1048576) == buf",
                            "-c",
                            "assert h.get_tls_negotiated()",
                        ]),
                ),
            );
            let back = f.path("back.raw");
            let _ = std::fs::remove_file(&back);
            m.record(
                "nbdcopy file → nbds://",
                mode,
                true,
                "",
                within(Command::new("nbdcopy").arg(&src).arg(&u)),
            );
            m.record(
                "nbdcopy nbds:// → file",
                mode,
                true,
                "",
                within(Command::new("nbdcopy").arg(&u).arg(&back)),
            );
            let copied = std::fs::read(&back).unwrap_or_default();
            assert!(
                copied.len() >= data.len() && copied[..data.len()] == data[..],
                "nbdcopy round trip over TLS differs ({mode})"
            );
            let info = qemu_img(&pki.dir, port, &["info"], false);
            assert!(
                !info.status.success()
                    || String::from_utf8_lossy(&info.stdout).contains("virtual size"),
                "{info:?}"
            );
            m.record("qemu-img info (tls-creds-x509)", mode, true, "", info);
            let qsrc = f.path("qsrc.raw");
            std::fs::write(&qsrc, &data[..4 << 20]).unwrap();
            m.record(
                "qemu-img convert file → nbd+TLS",
                mode,
                true,
                "",
                qemu_img(
                    &pki.dir,
                    port,
                    &["convert", "-n", "-f", "raw", qsrc.to_str().unwrap()],
                    true,
                ),
            );
            let qback = f.path("qback.raw");
            let _ = std::fs::remove_file(&qback);
            m.record(
                "qemu-img convert nbd+TLS → file",
                mode,
                true,
                "",
                qemu_img(
                    &pki.dir,
                    port,
                    &["convert", "-O", "raw", qback.to_str().unwrap()],
                    false,
                ),
            );
            let qcopied = std::fs::read(&qback).unwrap_or_default();
            assert!(
                qcopied.len() >= 4 << 20 && qcopied[..4 << 20] == data[..4 << 20],
                "qemu-img round trip over TLS differs ({mode})"
            );
        }
        if mode == "require+verify-peer" {
            m.record(
                "qemu-img info without client cert",
                mode,
                false,
                "Failed",
                qemu_img(&pki.anonymous, port, &["info"], false),
            );
        }
        f.stop();
    }
    m.check();
}

/// A tiercache whose backing device is another tiercache's export over `nbds://`, with client
/// certificates verified: data written through the first reaches the second over TLS.
#[test]
fn remote_backing_device_over_tls() {
    if !(have("nbdcopy") && have("nbdinfo")) {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let pki = Pki::make(certs.path()).unwrap();
    let mut remote = Fixture::new(64, 16, false);
    let port = free_port();
    let mut args = vec!["--tcp".to_string(), port.to_string()];
    args.extend(mode_args("require+verify-peer", &pki));
    remote.start_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let local = tempfile::tempdir().unwrap();
    let fast = local.path().join("fast.img");
    std::fs::File::create(&fast)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let backing = uri(port, Some(&pki.dir)).replace("/data?", "/data?timeout=10&");
    // Without a client certificate the remote refuses, and make says so.
    let anon = uri(port, Some(&pki.anonymous));
    let o = tc()
        .args([
            "make",
            "--label",
            "net",
            "--bucket-size",
            "256k",
            "--backing",
            &anon,
        ])
        .arg("--cache")
        .arg(&fast)
        .output()
        .unwrap();
    assert!(
        !o.status.success(),
        "make over TLS without a client certificate"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("TLS"), "{err}");
    run(tc()
        .args([
            "make",
            "--label",
            "net",
            "--bucket-size",
            "256k",
            "--backing",
            &backing,
        ])
        .arg("--cache")
        .arg(&fast));
    let socket = local.path().join("local.sock");
    let mut server = tc()
        .args(["serve", "--backing", &backing, "--cache"])
        .arg(&fast)
        .arg("--socket")
        .arg(&socket)
        .spawn()
        .unwrap();
    let admin = format!("{}.admin", socket.display());
    let t = std::time::Instant::now();
    while !Path::new(&admin).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "local server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let local_uri = format!("nbd+unix:///net?socket={}", socket.display());
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i * 13 % 241) as u8).collect();
    let src = local.path().join("src.raw");
    std::fs::write(&src, &data).unwrap();
    run(Command::new("nbdcopy").arg(&src).arg(&local_uri));
    run(tc().args(["stop", "--admin", &admin]));
    assert!(server.wait().unwrap().success());
    // Writethrough: the data is on the remote export, after the local volume's header.
    let remote_copy = local.path().join("remote.raw");
    run(Command::new("nbdcopy")
        .arg(uri(port, Some(&pki.dir)))
        .arg(&remote_copy));
    let remote_bytes = std::fs::read(&remote_copy).unwrap();
    let header = remote_bytes.len() - (remote_bytes.len() / 4096 * 4096);
    let found = remote_bytes
        .windows(64)
        .position(|w| w == &data[..64])
        .expect("the data written through the local cache reached the remote");
    assert!(found >= header);
    assert!(remote_bytes[found..found + data.len()] == data[..]);
    remote.stop();
}

/// TLS settings that cannot take effect stop `serve` with a message naming the fix.
#[test]
fn tls_settings_are_checked_at_start() {
    let certs = tempfile::tempdir().unwrap();
    let pki = Pki::make(certs.path()).unwrap();
    let f = Fixture::new(8, 8, false);
    let (cert, key, ca) = (pki.server_cert(), pki.server_key(), pki.ca_cert());
    let (cert, key, ca) = (
        cert.to_str().unwrap(),
        key.to_str().unwrap(),
        ca.to_str().unwrap(),
    );
    let port = free_port().to_string();
    let cases: [(&[&str], &str); 6] = [
        (&["--tls-cert", cert, "--tls-key", key], "needs tcp"),
        (
            &["--tcp", &port, "--tls", "require"],
            "needs the server's certificate",
        ),
        (
            &["--tcp", &port, "--tls", "on"],
            "needs the server's certificate",
        ),
        (&["--tcp", &port, "--tls-cert", cert], "--tls-key"),
        (
            &[
                "--tcp",
                &port,
                "--tls-verify-peer",
                "--tls-cert",
                cert,
                "--tls-key",
                key,
            ],
            "--tls-ca",
        ),
        (
            &["--tcp", &port, "--tls-cert", ca, "--tls-key", key],
            "TLS certificate",
        ),
    ];
    for (args, says) in cases {
        let o = output_within(f.serve_cmd().args(args), Duration::from_secs(30))
            .expect("serve returns");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} started");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // The same keys in a config file.
    let toml = f.path("tls.toml");
    std::fs::write(
        &toml,
        format!(
            "cache = \"{}\"\nbacking = [\"{}\"]\nsocket = \"{}\"\ntcp = \"{port}\"\n\
             tls = \"require\"\ntls_cert = \"{cert}\"\ntls_key = \"{key}\"\n\
             tls_verify_peer = true\n",
            f.path("fast.img").display(),
            f.path("slow.img").display(),
            f.socket().display()
        ),
    )
    .unwrap();
    let o = output_within(
        tc().args(["serve", "--config"]).arg(&toml),
        Duration::from_secs(30),
    )
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("tls_ca"), "{err}");
}

/// Runs a shell command line (openssl); it must succeed.
fn sh(line: &str) {
    let o = within(Command::new("sh").arg("-c").arg(line));
    assert!(
        o.status.success(),
        "{line}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn an_x509_v1_client_certificate_is_refused_with_the_fix_at_warn() {
    if !(have("nbdinfo") && have("openssl")) {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let pki = Pki::make(certs.path()).unwrap();
    // A client CA and a version 1 client certificate it signs (no extensions: version 1).
    let d = certs.path().join("v1");
    std::fs::create_dir(&d).unwrap();
    let p = |n: &str| d.join(n).display().to_string();
    sh(&format!(
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
         -subj /CN=v1-ca -keyout {} -out {} && \
         openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
         -subj /CN=v1-client -keyout {} -out {} && \
         openssl x509 -req -in {} -CA {} -CAkey {} -set_serial 7 -days 2 -out {}",
        p("client-ca.key"),
        p("client-ca.pem"),
        p("client-key.pem"),
        p("client.csr"),
        p("client.csr"),
        p("client-ca.pem"),
        p("client-ca.key"),
        p("client-cert.pem"),
    ));
    let text = within(
        Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(p("client-cert.pem")),
    );
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("Version: 1"),
        "openssl made a version 3 certificate"
    );
    std::fs::copy(pki.ca_cert(), d.join("ca-cert.pem")).unwrap();
    let mut f = Fixture::new(16, 16, false);
    let log = f.path("serve.log");
    let port = free_port();
    let mut cmd = f.serve_cmd();
    cmd.args(["--tcp", &port.to_string(), "--tls-verify-peer", "--tls-ca"])
        .arg(p("client-ca.pem"))
        .arg("--tls-cert")
        .arg(pki.server_cert())
        .arg("--tls-key")
        .arg(pki.server_key())
        .stderr(std::fs::File::create(&log).unwrap());
    f.start_cmd(cmd);
    let o = nbdinfo(&uri(port, Some(&d)));
    assert!(!o.status.success(), "a v1 client certificate is refused");
    f.stop();
    let log = std::fs::read_to_string(&log).unwrap();
    let warn = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("client certificate refused"))
        .unwrap_or_else(|| panic!("no WARN about the client certificate:\n{log}"));
    assert!(
        warn.contains("X.509 version 1") && warn.contains("version 3"),
        "{warn}"
    );
}

/// A client that connects by IP address (libnbd sends it as the TLS server name, which TLS
/// does not allow) is served, and the server's log says nothing about it at its default level
/// (rustls warned of every such client).
#[test]
fn a_client_that_connects_by_ip_address_leaves_no_warning() {
    if !have("nbdinfo") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let pki = Pki::make(certs.path()).unwrap();
    let mut f = Fixture::new(16, 16, false);
    let port = free_port();
    let log = f.path("serve.log");
    let mut cmd = f.serve_cmd();
    cmd.env_remove("RUST_LOG")
        .args(["--tcp", &port.to_string()])
        .args(mode_args("require", &pki))
        .stderr(std::fs::File::create(&log).unwrap());
    f.start_cmd(cmd);
    let o = nbdinfo(&format!(
        "nbds://127.0.0.1:{port}/data?tls-certificates={}",
        pki.dir.display()
    ));
    assert!(
        o.status.success(),
        "nbdinfo by IP address: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    f.stop();
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("serving on") && !logged.contains("WARN"),
        "the server's log: {logged}"
    );
}
