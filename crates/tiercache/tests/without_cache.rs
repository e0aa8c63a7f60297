//! `serve --without-cache-if-missing` against the real binary and real NBD clients (qemu-io,
//! nbdinfo): a missing cache device no longer stops the server when asked, the backing
//! devices are served directly under their usual names, and — the durability point — when
//! the cache device comes back, reads return what was written without it, never the cache's
//! older copies (clean ones, and dirty ones given up with `--without-cache-discard-dirty`).

mod common;

use common::*;
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const KIB64: u64 = 64 << 10;

/// Writes `len` bytes of `byte` at `offset` through NBD, then flushes.
fn write(f: &Fixture, byte: u8, offset: u64, len: u64) {
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        &format!("write -P {byte} {offset} {len}"),
        "-c",
        "flush",
        &f.uri(),
    ]));
}

/// Asserts that `[offset, offset + len)` reads as `byte` through NBD.
fn assert_reads(f: &Fixture, byte: u8, offset: u64, len: u64, why: &str) {
    // qemu-io exits non-zero when the pattern does not match.
    let o = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            &format!("read -P {byte} {offset} {len}"),
            &f.uri(),
        ])
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(
        o.status.success() && !out.contains("Pattern verification failed"),
        "{why}: [{offset}, +{len}) should read {byte:#x}: {out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn status_json(f: &Fixture) -> Value {
    serde_json::from_slice(&f.tc_admin(&["status", "--json"]).stdout).unwrap()
}

/// `tiercache show` of the backing device.
fn show(f: &Fixture) -> String {
    stdout(&run(tc().arg("show").arg(f.path("slow.img"))))
}

fn assert_fails(mut cmd: Command, needles: &[&str]) -> String {
    let o = output_within(&mut cmd, Duration::from_secs(60)).expect("the command hung");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{cmd:?} succeeded");
    for n in needles {
        assert!(err.contains(n), "{cmd:?}: expected {n:?} in {err}");
    }
    err
}

/// Moves the cache device away (kept, to bring it back later).
fn take_cache_away(f: &Fixture) {
    std::fs::rename(f.path("fast.img"), f.path("fast.kept")).unwrap();
}

fn bring_cache_back(f: &Fixture) {
    std::fs::rename(f.path("fast.kept"), f.path("fast.img")).unwrap();
}

/// Waits until a server started by the test listens on both sockets.
fn wait_for_sockets(f: &Fixture) {
    let t = std::time::Instant::now();
    while !(f.socket().exists() && std::path::Path::new(&f.admin()).exists()) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn export_size(f: &Fixture) -> u64 {
    let o = run(Command::new("nbdinfo").arg("--size").arg(f.uri()));
    stdout(&o).trim().parse().unwrap()
}

#[test]
fn writes_without_the_cache_win_over_its_clean_copies_when_it_returns() {
    if !(have("qemu-io") && have("nbdinfo")) {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start();
    let size = export_size(&f);
    write(&f, 0xaa, 0, MIB);
    assert_reads(&f, 0xaa, 0, MIB, "written through the cache");
    let cached = status_json(&f)["devices"][0]["cached_bytes"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= MIB,
        "the data should be cached clean: {cached} bytes"
    );
    f.stop();
    take_cache_away(&f);

    f.start_with(&["--without-cache-if-missing"]);
    assert_eq!(export_size(&f), size, "same export, same size");
    assert_reads(&f, 0xaa, 0, MIB, "written through the cache");
    write(&f, 0xbb, 0, KIB64);
    assert_reads(&f, 0xbb, 0, KIB64, "written without the cache");
    let s = stdout(&f.tc_admin(&["status"]));
    assert!(
        s.contains("NOT IN USE") && s.contains("no such file"),
        "{s}"
    );
    assert!(s.contains("without cache"), "{s}");
    let j = status_json(&f);
    let d = &j["devices"][0];
    assert_eq!(d["name"], "data", "{j}");
    assert_eq!(d["served_without_cache"], true, "{j}");
    assert_eq!(d["stale_copies"], "clean", "{j}");
    assert!(
        j["without_cache"]["reason"]
            .as_str()
            .unwrap()
            .contains("no such file"),
        "{j}"
    );
    // Commands that need the cache set say why they cannot run.
    for args in [
        vec!["stats"],
        vec!["set", "data", "cache_mode", "writeback"],
        vec!["detach", "data"],
    ] {
        assert_fails(f.admin_cmd(&args), &["needs the cache set", "fast.img"]);
    }
    let mut attach = f.admin_cmd(&["attach"]);
    attach.arg(f.path("slow.img"));
    assert_fails(attach, &["needs the cache set"]);
    assert!(show(&f).contains("stale_copies    clean"), "{}", show(&f));
    f.stop();

    // The cache device is back: the copy of the first 64 KiB it holds is stale and dropped.
    bring_cache_back(&f);
    f.start();
    assert_reads(&f, 0xbb, 0, KIB64, "a stale cached copy was served");
    assert_reads(&f, 0xaa, KIB64, MIB - KIB64, "not rewritten");
    let d = &status_json(&f)["devices"][0];
    assert_eq!(d["state"], "clean", "{d}");
    assert!(show(&f).contains("stale_copies    none"), "{}", show(&f));
    f.stop();
}

#[test]
fn a_missing_cache_stops_the_start_unless_asked_and_a_busy_one_always() {
    if !have("flock") {
        return;
    }
    let f = Fixture::new(16, 16, false);
    let header = show(&f);
    take_cache_away(&f);
    assert_fails(f.serve_cmd(), &["fast.img: no such file or device"]);
    // --without-cache-discard-dirty alone is not an opt-in.
    let mut c = f.serve_cmd();
    c.arg("--without-cache-discard-dirty");
    assert_fails(c, &["--without-cache-if-missing"]);
    assert_eq!(
        show(&f),
        header,
        "a refused start wrote to the backing device"
    );

    // A cache device another process holds is not missing.
    bring_cache_back(&f);
    let mut holder = Command::new("flock")
        .arg(f.path("fast.img"))
        .args(["sleep", "60"])
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    loop {
        let free = Command::new("flock")
            .arg("-n")
            .arg(f.path("fast.img"))
            .arg("true")
            .status()
            .unwrap()
            .success();
        if !free {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "flock did not lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut c = f.serve_cmd();
    c.arg("--without-cache-if-missing");
    assert_fails(c, &["in use by another process"]);
    holder.kill().unwrap();
    holder.wait().unwrap();
    assert_eq!(show(&f), header);
}

#[test]
fn the_config_file_keys_do_what_the_options_do() {
    let mut f = Fixture::new(16, 16, false);
    take_cache_away(&f);
    let config = |keys: &str| {
        let cfg = f.path("tiercache.toml");
        std::fs::write(
            &cfg,
            format!(
                "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\n{keys}",
                f.path("fast.img"),
                f.path("slow.img"),
                f.socket()
            ),
        )
        .unwrap();
        let mut c = tc();
        c.arg("serve").arg("--config").arg(cfg);
        c
    };
    assert_fails(
        config("without_cache_discard_dirty = true\n"),
        &["needs --without-cache-if-missing"],
    );
    assert_fails(config(""), &["no such file or device"]);
    f.server = Some(config("without_cache_if_missing = true\n").spawn().unwrap());
    wait_for_sockets(&f);
    let s = stdout(&f.tc_admin(&["status"]));
    assert!(
        s.contains("NOT IN USE") && s.contains("without cache"),
        "{s}"
    );
    f.stop();
}

#[test]
fn a_cache_device_whose_metadata_does_not_load_counts_as_missing() {
    if !(have("qemu-io") && have("nbdinfo")) {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    std::fs::write(f.path("fast.img"), vec![0u8; 16 << 20]).unwrap();
    f.start_with(&["--without-cache-if-missing"]);
    write(&f, 0x11, 0, KIB64);
    assert_reads(&f, 0x11, 0, KIB64, "written without the cache");
    let j = status_json(&f);
    assert!(
        j["without_cache"]["reason"]
            .as_str()
            .unwrap()
            .contains("not a tiercache cache device"),
        "{j}"
    );
    f.stop();
}

#[test]
fn dirty_data_is_given_up_only_when_asked_and_dropped_when_the_cache_returns() {
    if !(have("qemu-io") && have("nbdinfo")) {
        return;
    }
    let mut f = Fixture::new(16, 16, true);
    f.start();
    f.tc_admin(&["set", "data", "writeback_running", "0"]);
    write(&f, 0xd1, 0, MIB);
    let d = &status_json(&f)["devices"][0];
    assert_eq!(d["dirty_bytes"].as_u64(), Some(MIB), "{d}");
    f.kill9();
    assert!(show(&f).contains("state           dirty"), "{}", show(&f));
    take_cache_away(&f);

    let header = show(&f);
    let mut c = f.serve_cmd();
    c.arg("--without-cache-if-missing");
    let slow = f.path("slow.img").display().to_string();
    assert_fails(
        c,
        &[
            &slow,
            "volume 'data'",
            "is dirty",
            "newest data is in the cache device",
            "returns older data",
            "must be discarded",
            "--without-cache-discard-dirty",
        ],
    );
    assert_eq!(
        show(&f),
        header,
        "a refused start wrote to the backing device"
    );

    f.start_with(&[
        "--without-cache-if-missing",
        "--without-cache-discard-dirty",
    ]);
    assert_reads(&f, 0, 0, MIB, "the backing device's older data");
    write(&f, 0xe2, 0, KIB64);
    let d = &status_json(&f)["devices"][0];
    assert_eq!(d["backing_state"], "dirty", "{d}");
    assert_eq!(d["stale_copies"], "all", "{d}");
    f.stop();

    // Given up once: the next start without the cache needs no override, and says why.
    let log = std::fs::File::create(f.path("serve.log")).unwrap();
    let _ = std::fs::remove_file(f.socket());
    let _ = std::fs::remove_file(f.admin());
    let child = f
        .serve_cmd()
        .arg("--without-cache-if-missing")
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    f.server = Some(child);
    wait_for_sockets(&f);
    assert_reads(&f, 0xe2, 0, KIB64, "written without the cache");
    f.stop();
    let log = std::fs::read_to_string(f.path("serve.log")).unwrap();
    assert!(
        log.contains("'data'") && log.contains("given up at an earlier start"),
        "{log}"
    );

    // The cache device is back: its dirty copies are dropped, the header is clean again.
    bring_cache_back(&f);
    f.start();
    assert_reads(&f, 0xe2, 0, KIB64, "a given-up dirty copy was served");
    assert_reads(
        &f,
        0,
        KIB64,
        MIB - KIB64,
        "a given-up dirty copy was served",
    );
    let d = &status_json(&f)["devices"][0];
    assert_eq!(d["dirty_bytes"].as_u64(), Some(0), "{d}");
    assert_eq!(d["state"], "clean", "{d}");
    f.stop();
    let h = show(&f);
    assert!(
        h.contains("state           clean") && h.contains("stale_copies    none"),
        "{h}"
    );
}
