//! What `serve` does at start when its devices or options are not what the cache set expects,
//! end to end with the real binary:
//! - a backing device the set holds dirty data of, left out of `serve`, refuses the start
//!   (naming it); `--allow-missing` serves the others and lists it as missing (status,
//!   metrics) until `attach` brings it back with its data;
//! - a remote backing device that does not answer does not keep the local volumes down: they
//!   are served at once, and the remote one as soon as it answers;
//! - every option mistake is refused before any device is opened: the cache device is not
//!   touched (its superblock sequence stays), also for a socket another server listens on;
//! - mistakes are one line.
//!
//! A missing tool (qemu-io, nbdkit) is a failure under CI=true and a printed skip otherwise.

mod common;

use common::{have, output_within, run, stdout, tc, wait_for_nbdkit};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Hang guard for one command.
const LIMIT: Duration = Duration::from_secs(60);

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn finish(cmd: &mut Command) -> Output {
    output_within(cmd, LIMIT).unwrap_or_else(|| panic!("{cmd:?} hung"))
}

/// Runs `cmd`, which must fail cleanly (no panic); returns what it printed.
fn refused(cmd: &mut Command) -> String {
    common::refused_within(cmd, LIMIT)
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Dir {
        Dir(tempfile::tempdir_in(std::env::temp_dir()).unwrap())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }

    fn file(&self, name: &str, mib: u64) -> PathBuf {
        let p = self.path(name);
        std::fs::File::create(&p)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        p
    }

    /// `fast.img` with `slow.img` and `other.img` attached, in writeback (exports `data-0`,
    /// `data-1`).
    fn make_two(&self) {
        self.file("fast.img", 32);
        self.file("slow.img", 16);
        self.file("other.img", 16);
        run(tc()
            .args([
                "make",
                "--writeback",
                "--bucket-size",
                "256k",
                "--label",
                "data",
            ])
            .arg("--cache")
            .arg(self.path("fast.img"))
            .arg("--backing")
            .arg(self.path("slow.img"))
            .arg("--backing")
            .arg(self.path("other.img")));
    }

    fn sock(&self) -> PathBuf {
        self.path("nbd.sock")
    }

    fn admin(&self) -> String {
        format!("{}.admin", self.sock().display())
    }

    fn serve(&self, backings: &[&str], extra: &[&str]) -> Command {
        let mut c = tc();
        c.arg("serve").arg("--cache").arg(self.path("fast.img"));
        for b in backings {
            if b.contains("://") {
                c.args(["--backing", b]);
            } else {
                c.arg("--backing").arg(self.path(b));
            }
        }
        c.arg("--socket").arg(self.sock()).args(extra);
        c
    }

    /// Starts a server and waits for its admin socket.
    fn start(&self, mut cmd: Command) -> Server {
        let _ = std::fs::remove_file(self.sock());
        let _ = std::fs::remove_file(self.admin());
        let child = cmd.stderr(Stdio::inherit()).spawn().unwrap();
        let mut server = Server {
            child: Some(child),
            admin: self.admin(),
        };
        let t = Instant::now();
        while !Path::new(&self.admin()).exists() {
            if let Some(s) = server.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("serve exited with {s}");
            }
            assert!(t.elapsed() < LIMIT, "serve did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.sock().display())
    }

    fn qemu_io(&self, export: &str, cmd: &str) -> String {
        let o = finish(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, &self.uri(export)]));
        let t = text(&o);
        assert!(
            o.status.success() && !t.contains("failed"),
            "qemu-io {cmd} on {export}: {t}"
        );
        t
    }

    /// The cache superblock's sequence number (`show --json`).
    fn sb_seq(&self) -> u64 {
        let o = run(tc().args(["show", "--json"]).arg(self.path("fast.img")));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        v["sb_seq"].as_u64().unwrap()
    }
}

struct Server {
    child: Option<Child>,
    admin: String,
}

impl Server {
    fn admin_json(&self, cmd: &str, args: &[&str]) -> Value {
        let o = run(tc()
            .arg(cmd)
            .args(["--admin", &self.admin, "--json"])
            .args(args));
        serde_json::from_str(&stdout(&o)).unwrap()
    }

    /// One request on the admin socket, as `tiercache top` sends it.
    fn request(&self, req: &Value) -> Value {
        use std::io::{BufRead, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&self.admin).unwrap();
        writeln!(s, "{req}").unwrap();
        let mut line = String::new();
        std::io::BufReader::new(s).read_line(&mut line).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["ok"], true, "{v}");
        v
    }

    fn admin(&self, cmd: &str, args: &[&str]) -> String {
        stdout(&run(tc()
            .arg(cmd)
            .args(["--admin", &self.admin])
            .args(args)))
    }

    fn stop(mut self) {
        self.admin("stop", &[]);
        let mut c = self.child.take().unwrap();
        let s = common::wait_for(&mut c, LIMIT).expect("the server did not stop");
        assert!(s.success(), "the server exited with {s}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn exports(s: &Server) -> Vec<String> {
    let status = s.admin_json("status", &[]);
    status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_backing_device_left_out_with_dirty_data_is_never_silent() {
    if !have("qemu-io") {
        return;
    }
    let d = Dir::new();
    d.make_two();
    let s = d.start(d.serve(&["slow.img", "other.img"], &[]));
    s.admin("set", &["data-1", "writeback_running", "false"]);
    d.qemu_io("data-1", "write -P 0xab 0 4M");
    s.stop();
    // Left out: refused, naming the device and its dirty data, before anything is written:
    // the cache device and both backing devices are byte for byte as they were.
    let images =
        || ["fast.img", "slow.img", "other.img"].map(|f| std::fs::read(d.path(f)).unwrap());
    let before = images();
    let err = refused(&mut d.serve(&["slow.img"], &[]));
    assert!(images() == before, "a refused start changed a device");
    assert!(
        err.contains("dirty") && err.contains("--allow-missing") && err.contains("4.0 MiB"),
        "{err}"
    );
    let other = run(tc().args(["show", "--json"]).arg(d.path("other.img")));
    let uuid = serde_json::from_str::<Value>(&stdout(&other)).unwrap()["dev_uuid"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        err.contains(&uuid),
        "the refusal does not name {uuid}: {err}"
    );
    // Allowed: served without it, and it is listed as missing with its dirty data.
    let s = d.start(d.serve(&["slow.img"], &["--allow-missing"]));
    assert_eq!(exports(&s), vec!["data-0".to_string()]);
    let status = s.admin_json("status", &[]);
    let missing = status["missing"].as_array().unwrap();
    assert_eq!(missing.len(), 1, "{status}");
    assert_eq!(missing[0]["uuid"], uuid.as_str());
    assert_eq!(missing[0]["dirty_bytes"], 4u64 << 20);
    let human = s.admin("status", &[]);
    assert!(
        human.contains("MISSING") && human.contains(&uuid),
        "{human}"
    );
    let metrics = s.request(&serde_json::json!({"cmd": "metrics"}))["metrics"].clone();
    assert_eq!(metrics["cache_set"]["missing_volumes"], 1, "{metrics}");
    assert_eq!(metrics["cache_set"]["missing_dirty_bytes"], 4u64 << 20);
    // Attached again: no longer missing, and its newest data is there.
    s.admin("attach", &[d.path("other.img").to_str().unwrap()]);
    let status = s.admin_json("status", &[]);
    assert!(status["missing"].as_array().unwrap().is_empty(), "{status}");
    d.qemu_io("data-1", "read -P 0xab 0 4M");
    s.stop();
}

/// Starts `nbdkit file FILE` on `sock`; returns it once its pid file is written.
fn nbdkit_file(d: &Dir, file: &str, sock: &Path) -> Child {
    let pidfile = d.path("kit.pid");
    let _ = std::fs::remove_file(&pidfile);
    let kit = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-P"])
        .arg(&pidfile)
        .arg("-U")
        .arg(sock)
        .arg("file")
        .arg(d.path(file))
        .spawn()
        .unwrap();
    wait_for_nbdkit(&pidfile);
    kit
}

#[test]
fn an_unreachable_remote_backing_device_keeps_no_other_volume_down() {
    if !(have("qemu-io") && have("nbdkit")) {
        return;
    }
    let d = Dir::new();
    d.make_two();
    let kit_sock = d.path("kit.sock");
    let remote = format!("nbd+unix:///?socket={}&timeout=2", kit_sock.display());
    // The remote device's server is not running: the local volume is served anyway.
    let s = d.start(d.serve(&["slow.img", &remote], &[]));
    assert_eq!(exports(&s), vec!["data-0".to_string()]);
    d.qemu_io("data-0", "write -P 0x11 0 64k");
    let status = s.admin_json("status", &[]);
    let pending = status["pending"].as_array().unwrap();
    assert_eq!(pending.len(), 1, "{status}");
    assert_eq!(pending[0]["backing"], remote.as_str());
    // Once it answers, it is attached and exported.
    let mut kit = nbdkit_file(&d, "other.img", &kit_sock);
    let t = Instant::now();
    while exports(&s).len() < 2 {
        assert!(
            t.elapsed() < LIMIT,
            "the remote volume was not served after its server came up"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        exports(&s),
        vec!["data-0".to_string(), "data-1".to_string()]
    );
    let status = s.admin_json("status", &[]);
    assert!(status["pending"].as_array().unwrap().is_empty(), "{status}");
    d.qemu_io("data-1", "write -P 0x22 0 64k");
    d.qemu_io("data-1", "read -P 0x22 0 64k");
    d.qemu_io("data-0", "read -P 0x11 0 64k");
    s.stop();
    let _ = kit.kill();
    let _ = kit.wait();
}

#[test]
fn option_mistakes_are_refused_before_the_cache_is_opened() {
    let d = Dir::new();
    d.make_two();
    let seq = d.sb_seq();
    let both = ["slow.img", "other.img"];
    let cert = d.path("missing-cert.pem");
    let cert = cert.to_str().unwrap();
    let config = d.path("bad.toml");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tcp", "abc"], "abc"),
        (vec!["--tcp", "127.0.0.1:99999"], "99999"),
        (vec!["--socket-mode", "0999"], "socket mode"),
        (vec!["--socket-mode", "0440"], "socket mode"),
        (vec!["--socket-owner", "no-such-user-here"], "no such user"),
        (vec!["--socket-owner", "4294967295"], "4294967295"),
        (vec!["--socket-group", "4294967295"], "4294967295"),
        (vec!["--max-connections", "0"], "max_connections"),
        (vec!["--max-connections", "-5"], "-5"),
        (vec!["--request-memory", "99999T"], "memory"),
        (vec!["--request-memory", "1k"], "too small"),
        (vec!["--idle-timeout", "0"], "idle_timeout"),
        (
            vec!["--tcp", "0", "--tls-cert", cert, "--tls-key", cert],
            "missing-cert.pem",
        ),
        (vec!["--metrics", "nowhere"], "nowhere"),
        (vec!["--admin", "/no/such/dir/x.admin"], "does not exist"),
        (vec!["--io-error-limit", "99999999"], "io_error_limit"),
    ];
    for (extra, needle) in &cases {
        let err = refused(&mut d.serve(&both, extra));
        assert!(
            err.contains(needle),
            "serve {extra:?}: '{needle}' not in: {err}"
        );
        assert_eq!(
            err.trim().lines().count(),
            1,
            "serve {extra:?}: not one line: {err}"
        );
    }
    // A config file with a TOML mistake, or a bad knob value: one line, with where it is.
    std::fs::write(&config, "cache = \"x\"\nbacking = [\n").unwrap();
    let err = refused(tc().arg("serve").arg("--config").arg(&config));
    assert!(err.contains("bad.toml:"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "not one line: {err}");
    std::fs::write(
        &config,
        format!(
            "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\n[volumes.data-0]\nsequential_cutoff = \"lots\"\n",
            d.path("fast.img"),
            d.path("slow.img"),
            d.sock()
        ),
    )
    .unwrap();
    let err = refused(tc().arg("serve").arg("--config").arg(&config));
    assert!(err.contains("sequential_cutoff"), "{err}");
    // A socket another server listens on.
    d.file("fast2.img", 16);
    d.file("slow2.img", 16);
    run(tc()
        .args(["make", "--bucket-size", "256k", "--cache"])
        .arg(d.path("fast2.img"))
        .arg("--backing")
        .arg(d.path("slow2.img")));
    let mut other = tc();
    other
        .arg("serve")
        .arg("--cache")
        .arg(d.path("fast2.img"))
        .arg("--backing")
        .arg(d.path("slow2.img"))
        .arg("--socket")
        .arg(d.sock());
    let s = d.start(other);
    let err = refused(&mut d.serve(&both, &[]));
    assert!(err.contains("another server is listening"), "{err}");
    s.stop();
    assert_eq!(
        d.sb_seq(),
        seq,
        "a refused start opened and checkpointed the cache set"
    );
}

/// A device the set knows, left out of the config file's `backing` list, is said to be left
/// out of that list (where the operator would add it), not out of `--backing`.
#[test]
fn a_device_left_out_of_the_config_file_is_named_as_left_out_of_it() {
    let d = Dir::new();
    d.make_two();
    let config = d.path("serve.toml");
    std::fs::write(
        &config,
        format!(
            "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\n",
            d.path("fast.img"),
            d.path("slow.img"),
            d.sock()
        ),
    )
    .unwrap();
    let log = d.path("serve.log");
    let mut cmd = tc();
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .stderr(std::fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    let t = Instant::now();
    while !Path::new(&d.admin()).exists() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!(
                "serve exited with {s}: {}",
                std::fs::read_to_string(&log).unwrap()
            );
        }
        assert!(t.elapsed() < LIMIT, "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    run(tc().args(["stop", "--admin", &d.admin()]));
    assert!(child.wait().unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(&format!(
            "is not in the `backing` list of {}",
            config.display()
        )),
        "{text}"
    );
    assert!(!text.contains("--backing"), "{text}");
}
