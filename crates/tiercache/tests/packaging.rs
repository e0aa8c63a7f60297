//! What a packager and systemd rely on: man pages and shell completions generated from the
//! CLI definition, `--version` naming the commit, the systemd unit and example config in
//! contrib/systemd (and that it holds what the README says it does), and `serve`'s readiness
//! notification (`Type=notify`).

mod common;

use common::*;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

#[test]
fn man_pages_and_completions_come_from_the_cli_definition() {
    let dir = tempfile::tempdir().unwrap();
    run(tc().args(["generate", "man"]).arg(dir.path()));
    let page = |name: &str| {
        std::fs::read_to_string(dir.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let main = page("tiercache.1");
    assert!(
        main.starts_with(".ie") || main.contains(".TH"),
        "not roff:\n{main}"
    );
    for sub in [
        "serve", "status", "stats", "get", "set", "stop", "make", "resize",
    ] {
        assert!(main.contains(sub), "tiercache.1 does not mention {sub}");
        let sub_page = page(&format!("tiercache-{sub}.1"));
        assert!(sub_page.len() > 200, "tiercache-{sub}.1 is nearly empty");
    }
    assert!(page("tiercache-status.1").contains("json"));
    assert!(page("tiercache-stop.1").contains("no\\-wait"));
    // The generator is a command like the others (`--help` lists it), with its own page.
    assert!(page("tiercache.1").contains("generate"));
    assert!(page("tiercache-generate.1").contains("completions"));
    for shell in ["bash", "zsh", "fish"] {
        let script = stdout(&run(tc().args(["generate", "completions", shell])));
        for word in ["status", "resize", "serve", "json", "no-wait"] {
            assert!(script.contains(word), "{shell} completions lack {word}");
        }
    }
    if Command::new("bash").arg("--version").output().is_ok() {
        // The bash script at least parses.
        let script = stdout(&run(tc().args(["generate", "completions", "bash"])));
        let f = dir.path().join("tiercache.bash");
        std::fs::write(&f, script).unwrap();
        run(Command::new("bash").arg("-n").arg(&f));
    }
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = stdout(&run(tc().arg("--version")));
    let version = concat!("tiercache ", env!("CARGO_PKG_VERSION"));
    assert!(out.starts_with(version), "{out}");
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "--verify", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    match head {
        Ok(o) if o.status.success() => {
            let commit = stdout(&o).trim().to_string();
            assert_eq!(out.trim(), format!("{version} (commit {commit})"));
        }
        _ => {
            // Built outside a git checkout: the version alone, or a commit given by the
            // packager in TIERCACHE_COMMIT.
            eprintln!("SKIP: not a git checkout; checking the version only");
        }
    }
}

fn unit_text() -> String {
    std::fs::read_to_string(repo_file("contrib/systemd/tiercache.service")).unwrap()
}

/// The `KEY=VALUE` lines of one `[Section]` of a unit file.
fn section(unit: &str, name: &str) -> Vec<(String, String)> {
    unit.lines()
        .skip_while(|l| l.trim() != format!("[{name}]"))
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter(|l| !l.trim_start().starts_with('#') && l.contains('='))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect()
}

#[test]
fn the_systemd_unit_is_valid_and_runs_serve_as_a_notify_service() {
    let unit = unit_text();
    let service = section(&unit, "Service");
    let get = |k: &str| {
        service
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("[Service] has no {k}"))
    };
    assert_eq!(get("Type"), "notify");
    assert_eq!(get("RuntimeDirectory"), "tiercache");
    assert_eq!(get("KillSignal"), "SIGTERM");
    assert!(
        get("ExecStart").ends_with("tiercache serve --config /etc/tiercache/tiercache.toml"),
        "{}",
        get("ExecStart")
    );
    assert!(section(&unit, "Install")
        .contains(&("WantedBy".to_string(), "multi-user.target".to_string())));
    // What the README says is in the unit is (its "Memory" paragraph: away from the OOM
    // killer, since the kernel's writeback to /dev/ublkbN or /dev/nbd0 goes through it).
    let readme = std::fs::read_to_string(repo_file("README.md")).unwrap();
    let flat = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let said = flat
        .split_once("(`OOMScoreAdjust=")
        .and_then(|(_, rest)| rest.split_once("` in the unit)"))
        .map(|(value, _)| value)
        .expect("README names the unit's OOMScoreAdjust= as (`OOMScoreAdjust=N` in the unit)");
    assert_eq!(get("OOMScoreAdjust"), said, "README and the unit disagree");
    assert_eq!(
        said, "-1000",
        "the server must never be the OOM killer's choice"
    );
    // systemd's own checker (`.ci/run` installs it; under CI=true its absence is a failure).
    // It checks that ExecStart exists, so point it at this build.
    let have_analyze = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_analyze {
        test_support::unavailable("systemd-analyze (the keys alone were checked)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("tiercache.service");
    std::fs::write(
        &local,
        unit.replace("/usr/local/bin/tiercache", env!("CARGO_BIN_EXE_tiercache")),
    )
    .unwrap();
    let o = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&local)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    // verify exits 0 on many mistakes (an unknown Type= is "ignoring"): any complaint fails.
    assert!(
        o.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {err}"
    );
}

#[test]
fn the_example_config_parses_and_puts_the_sockets_under_run_tiercache() {
    let cfg = repo_file("contrib/systemd/tiercache.toml");
    let o = tc()
        .args(["status", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    if o.status.success() {
        // A tiercache unit runs on this machine with that very socket: the path is right.
        return;
    }
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("connecting to /run/tiercache/tiercache.sock.admin"),
        "{err}"
    );
}

/// One datagram, retried when a signal interrupts the wait (EINTR: a CI run failed on it
/// while the other tests of this binary were starting and stopping servers).
fn recv_datagram(sock: &UnixDatagram, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match sock.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

#[test]
fn serve_tells_systemd_when_it_is_ready_and_when_it_stops() {
    let mut f = Fixture::new(16, 16, false);
    let notify_path = f.path("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut cmd = f.serve_cmd();
    cmd.env("NOTIFY_SOCKET", &notify_path);
    f.server = Some(cmd.spawn().unwrap());
    let mut buf = [0u8; 512];
    let n = recv_datagram(&notify, &mut buf).expect("no READY=1 within 30 s");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    // Ready means every socket listens: clients may connect at once.
    assert!(f.socket().exists() && Path::new(&f.admin()).exists());
    f.tc_admin(&["status"]);
    f.stop();
    let n = recv_datagram(&notify, &mut buf).expect("no STOPPING=1");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
}

/// Every crate states the minimum Rust the workspace declares (clippy's `incompatible_msrv`,
/// denied in CI, checks the standard library's use against it only where it is declared), and
/// the README says it.
#[test]
fn every_crate_declares_the_workspace_minimum_rust() {
    let root = std::fs::read_to_string(repo_file("Cargo.toml")).unwrap();
    let msrv = root
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("the workspace declares rust-version")
        .trim_matches('"')
        .to_string();
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(repo_file("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("Cargo.toml"))
        .filter(|p| p.exists())
        .collect();
    manifests.sort();
    assert!(manifests.len() > 5, "crates not found: {manifests:?}");
    for m in &manifests {
        let text = std::fs::read_to_string(m).unwrap();
        assert!(
            text.lines().any(|l| l == "rust-version.workspace = true"),
            "{} does not inherit the workspace's rust-version",
            m.display()
        );
    }
    // fuzz/ is a workspace of its own: it must name the same version.
    let fuzz = std::fs::read_to_string(repo_file("fuzz/Cargo.toml")).unwrap();
    assert!(
        fuzz.lines()
            .any(|l| l == format!("rust-version = \"{msrv}\"")),
        "fuzz/Cargo.toml does not declare rust-version = \"{msrv}\""
    );
    let readme = std::fs::read_to_string(repo_file("README.md")).unwrap();
    assert!(
        readme.contains(&format!("Rust {msrv} or newer")),
        "the README does not state the minimum version (\"Rust {msrv} or newer\")"
    );
    let ci = std::fs::read_to_string(repo_file(".ci/run")).unwrap();
    assert!(
        ci.contains("-D clippy::incompatible_msrv"),
        ".ci/run does not deny clippy::incompatible_msrv"
    );
}
