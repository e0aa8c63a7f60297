//! Operator mistakes against the real binary: bad knob and label values (through the CLI and
//! raw admin requests), knob persistence across clean and kill -9 restarts, config-file knobs,
//! admin connection floods, and devices that were never formatted.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;

/// The device list of `tiercache stats --json`.
fn devices(f: &Fixture) -> Vec<Value> {
    let o = f.tc_admin(&["stats", "--json"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["devices"].as_array().unwrap().clone()
}

fn knobs_of(d: &Value) -> Value {
    json!({
        "name": d["name"],
        "cache_mode": d["cache_mode"],
        "sequential_cutoff": d["sequential_cutoff"],
        "writeback_percent": d["writeback_percent"],
        "writeback_delay": d["writeback_delay"],
        "writeback_running": d["writeback_running"],
    })
}

/// One raw admin request, as any program on the socket could send it.
fn raw_admin(f: &Fixture, req: &Value) -> Value {
    let mut s = UnixStream::connect(f.admin()).unwrap();
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

fn export_names(f: &Fixture) -> Vec<String> {
    let o = run(Command::new("nbdinfo")
        .arg("--list")
        .arg("--json")
        .arg(format!("nbd+unix://?socket={}", f.socket().display())));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap().to_string())
        .collect()
}

fn assert_fails(mut cmd: Command, needle: &str) {
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{cmd:?} succeeded");
    assert!(
        err.contains(needle),
        "{cmd:?}: expected {needle:?} in {err}"
    );
}

#[test]
fn bad_labels_are_refused_and_the_export_stays() {
    if !have("nbdinfo") {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start();
    for bad in ["a\u{0}b", "", "has space", "../x", "-x", &"x".repeat(65)] {
        let r = raw_admin(
            &f,
            &json!({"cmd": "set", "device": "data", "knob": "label", "value": bad}),
        );
        assert_eq!(r["ok"], false, "label {bad:?} accepted: {r}");
        assert!(r["error"].as_str().unwrap().contains("label"), "{r}");
    }
    assert_fails(f.admin_cmd(&["set", "data", "label", ""]), "is empty");
    assert_eq!(export_names(&f), ["data"]);
    f.tc_admin(&["set", "data", "label", "vm-01.disk"]);
    assert_eq!(export_names(&f), ["vm-01.disk"]);
    f.stop();
    // The refused values never reached the header either.
    let o = run(tc().arg("show").arg(f.path("slow.img")));
    assert!(
        stdout(&o).contains("dev.label       vm-01.disk"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn every_knob_survives_restarts_and_bad_values_change_nothing() {
    let mut f = Fixture::new(16, 16, false);
    f.start();
    let set = [
        ("cache_mode", "writeback"),
        ("sequential_cutoff", "8M"),
        ("writeback_percent", "25"),
        ("writeback_delay", "5"),
        ("writeback_running", "0"),
    ];
    for (k, v) in set {
        f.tc_admin(&["set", "data", k, v]);
    }
    let want = json!({
        "name": "data",
        "cache_mode": "writeback",
        "sequential_cutoff": 8 << 20,
        "writeback_percent": 25,
        "writeback_delay": 5,
        "writeback_running": false,
    });
    assert_eq!(knobs_of(&devices(&f)[0]), want);
    for (k, v, needle) in [
        ("writeback_percent", "101", "out of range"),
        ("writeback_percent", "-1", "integer"),
        ("sequential_cutoff", "2G", "out of range"),
        ("writeback_delay", "100000", "out of range"),
        ("writeback_running", "maybe", "boolean"),
        ("cache_mode", "fast", "mode"),
        ("no_such_knob", "1", "possible values: cache_mode"),
    ] {
        assert_fails(f.admin_cmd(&["set", "data", k, v]), needle);
    }
    assert_eq!(
        knobs_of(&devices(&f)[0]),
        want,
        "a refused value changed a knob"
    );
    f.stop();
    f.start();
    assert_eq!(knobs_of(&devices(&f)[0]), want, "after a clean restart");
    f.kill9();
    f.start();
    assert_eq!(knobs_of(&devices(&f)[0]), want, "after kill -9");
    f.stop();
}

#[test]
fn config_file_knobs_are_applied_and_bad_ones_stop_the_start() {
    let mut f = Fixture::new(16, 16, false);
    let write_cfg = |f: &Fixture, volumes: &str| {
        let cfg = f.path("tiercache.toml");
        std::fs::write(
            &cfg,
            format!(
                "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\n{volumes}",
                f.path("fast.img"),
                f.path("slow.img"),
                f.socket()
            ),
        )
        .unwrap();
        cfg
    };
    let cfg = write_cfg(
        &f,
        "[volumes.data]\ncache_mode = \"writearound\"\nsequential_cutoff = \"1M\"\n\
         writeback_percent = 30\nwriteback_delay = 7\nwriteback_running = false\n",
    );
    let child = tc().arg("serve").arg("--config").arg(&cfg).spawn().unwrap();
    f.server = Some(child);
    wait_for_sockets(&f);
    assert_eq!(
        knobs_of(&devices(&f)[0]),
        json!({
            "name": "data",
            "cache_mode": "writearound",
            "sequential_cutoff": 1 << 20,
            "writeback_percent": 30,
            "writeback_delay": 7,
            "writeback_running": false,
        })
    );
    f.stop();
    for (volumes, needle) in [
        ("[volumes.data]\nwriteback_percent = 300\n", "out of range"),
        ("[volumes.data]\nlabel = \"bad label\"\n", "label"),
        ("[volumes.nosuch]\ncache_mode = \"none\"\n", "nosuch"),
        ("[volumes.data]\nturbo = true\n", "unknown knob"),
    ] {
        let cfg = write_cfg(&f, volumes);
        assert_fails(
            {
                let mut c = tc();
                c.arg("serve").arg("--config").arg(&cfg);
                c
            },
            needle,
        );
    }
    // Nothing of the refused configs was applied.
    f.start();
    assert_eq!(devices(&f)[0]["cache_mode"], "writearound");
    assert_eq!(devices(&f)[0]["writeback_percent"], 30);
    f.stop();
}

fn wait_for_sockets(f: &Fixture) {
    let t = std::time::Instant::now();
    while !(f.socket().exists() && std::path::Path::new(&f.admin()).exists()) {
        assert!(t.elapsed().as_secs() < 30, "server did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn count_dir(path: String) -> usize {
    std::fs::read_dir(path).unwrap().count()
}

#[test]
fn an_admin_connection_flood_cannot_lock_out_the_operator() {
    let mut f = Fixture::new(16, 16, false);
    f.start();
    let pid = f.server.as_ref().unwrap().id();
    let threads_before = count_dir(format!("/proc/{pid}/task"));
    // 300 connections that never send a request, kept open.
    let flood: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(f.admin()).unwrap())
        .collect();
    // The operator still gets through, every time.
    for _ in 0..5 {
        f.tc_admin(&["status"]);
    }
    let threads = count_dir(format!("/proc/{pid}/task"));
    let fds = count_dir(format!("/proc/{pid}/fd"));
    assert!(
        threads <= threads_before + 16,
        "{threads} threads (before the flood: {threads_before})"
    );
    assert!(fds < 100, "{fds} descriptors open during the flood");
    drop(flood);
    f.stop();
}

#[test]
fn unformatted_devices_are_reported_as_unformatted() {
    let dir = tempfile::tempdir().unwrap();
    let blank = dir.path().join("blank.img");
    std::fs::File::create(&blank)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    for args in [vec!["check"], vec!["show"]] {
        let mut c = tc();
        c.args(&args).arg(&blank);
        assert_fails(c, "not");
    }
    let mut c = tc();
    c.arg("check").arg(&blank);
    assert_fails(c, "not formatted by tiercache");
    let f = Fixture::new(16, 16, false);
    let mut c = tc();
    c.arg("serve")
        .arg("--cache")
        .arg(&blank)
        .arg("--backing")
        .arg(f.path("slow.img"))
        .arg("--socket")
        .arg(dir.path().join("s.sock"));
    assert_fails(c, "not a tiercache cache device");
}
