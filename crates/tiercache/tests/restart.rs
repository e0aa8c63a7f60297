//! The flush contract for every client when a remote backing device restarts: two nbdsh
//! clients of one export, over a real nbdkit whose cache filter (`cache=writeback`) keeps
//! writes in memory until a flush, as a network disk's server does. Client 1 writes OLD and
//! flushes, writes NEW, the nbdkit is killed (-9) and started again, losing NEW; then each
//! client flushes (client 1 first sends a FUA write in the FUA variant).
//!
//! A third client, which wrote nothing, flushes over and over before the other two: it is
//! told once, and cannot take their reports away.
//!
//! Checked, in every cache mode, on both data paths (and on a sparse 1 TiB cache device in
//! two modes): a client whose flush (or FUA write)
//! succeeds can rely on it: NEW is on the backing device's file, which holds exactly what
//! nbdkit flushed (or, in writeback, in the cache); a client is told of a loss once; where
//! the cache holds a copy of what was lost (writethrough, writeback) nothing is lost and no
//! flush fails, and where it does not (none, writearound) both clients are told.
//!
//! External tools: nbdkit and nbdsh (python3-libnbd); missing, a failure under CI=true and a
//! printed skip otherwise.

mod common;

use common::host::{have_nbdsh, nbdsh};
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};
use test_support::have;

/// Where the backing data starts in the backing file (after tiercache's header).
const DATA_OFFSET: u64 = 8192;

/// `nbdkit --filter=cache file slow.img cache=writeback` on `kit.sock`, accepting: writes
/// are held in nbdkit's memory until a flush, and a kill loses them.
fn volatile_nbdkit(f: &Fixture) -> Child {
    f.nbdkit_on_backing(&["--filter=cache"], &["cache=writeback"])
}

fn wait_file(p: &Path, child: &mut Child, what: &str) {
    let t = Instant::now();
    while !p.exists() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("{what}: the clients exited with {s} first");
        }
        assert!(t.elapsed() < Duration::from_secs(120), "{what}: timed out");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One run on a cache device of `cache_mib` (a sparse file); returns the clients' outcomes.
fn run_once(data_path: &str, mode: &str, fua: bool, cache_mib: u64) -> Value {
    let what = format!(
        "{mode} on {data_path}{}, cache {cache_mib} MiB",
        if fua { ", FUA" } else { "" }
    );
    let mut f = Fixture::new(16, cache_mib, false);
    let mut kit = volatile_nbdkit(&f);
    let remote = format!("nbd+unix:///?socket={}", f.path("kit.sock").display());
    let mut cmd = tc();
    cmd.arg("serve")
        .arg("--cache")
        .arg(f.path("fast.img"))
        .args(["--backing", &remote, "--data-path", data_path, "--socket"])
        .arg(f.socket())
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(f.path("serve.log")).unwrap());
    f.start_cmd(cmd);
    f.tc_admin(&["set", "data", "cache_mode", mode]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/scripts/two_clients_restart.py"
    );
    let mut clients = nbdsh(&["-c", &format!("exec(open({script:?}).read())")])
        .env("URI", f.uri())
        .env("DIR", f.dir.path())
        .env("FUA", if fua { "1" } else { "0" })
        .spawn()
        .unwrap();
    wait_file(&f.path("ready"), &mut clients, &what);
    kit.kill().unwrap();
    kit.wait().unwrap();
    let mut kit = volatile_nbdkit(&f);
    std::fs::File::create(f.path("go")).unwrap();
    let status = wait_for(&mut clients, Duration::from_secs(180))
        .unwrap_or_else(|| panic!("{what}: the clients did not finish"));
    assert!(status.success(), "{what}: the clients failed: {status}");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(f.path("result.json")).unwrap()).unwrap();
    eprintln!("{what}: {r}");
    let ok = |k: &str| r[k].as_str().is_some_and(|v| v == "ok");
    // What nbdkit made durable: its file (both servers killed first, nbdkit dropping what it
    // did not flush, tiercache flushing nothing more).
    f.kill9();
    kit.kill().unwrap();
    kit.wait().unwrap();
    let file = std::fs::read(f.path("slow.img")).unwrap();
    let on_disk = file[DATA_OFFSET as usize];
    let c1_first = if fua { "c1_fua" } else { "c1_flush" };
    for first in ["c2_flush", c1_first] {
        if ok(first) && mode != "writeback" {
            assert_eq!(
                on_disk, 0x22,
                "{what}: {first} succeeded but the backing device lacks NEW: {r}"
            );
        }
    }
    assert!(
        ok("c1_flush_again") && ok("c2_flush_again"),
        "{what}: a client was told of one loss twice: {r}"
    );
    let c3 = r["c3_flushes"]
        .as_array()
        .expect("the third client's flushes");
    assert!(
        c3[1..].iter().all(|v| v == "ok"),
        "{what}: the third client was told more than once: {r}"
    );
    match mode {
        "writethrough" | "writeback" => {
            // The cache had NEW: nothing is lost, nothing to report.
            for k in ["c2_flush", c1_first, "c1_flush"] {
                assert!(ok(k), "{what}: {k} failed though the cache held NEW: {r}");
            }
            assert_eq!(r["read"], "22", "{what}: {r}");
        }
        _ => {
            // No copy: NEW is gone, and every client open at the loss is told.
            assert!(
                !ok("c2_flush") && !ok(c1_first),
                "{what}: a client was not told of the loss: {r}"
            );
            assert_eq!(on_disk, 0x11, "{what}: {r}");
        }
    }
    r
}

#[test]
fn every_client_is_told_of_a_loss_at_a_restarted_backing_device() {
    if !(have("nbdkit") && have_nbdsh()) {
        return;
    }
    for data_path in ["auto", "threads"] {
        for mode in ["writethrough", "writeback", "writearound", "none"] {
            for fua in [false, true] {
                run_once(data_path, mode, fua, 16);
            }
        }
    }
    // At a real size: a sparse 1 TiB cache device.
    for mode in ["writethrough", "none"] {
        run_once("auto", mode, false, 1 << 20);
    }
}
