//! The CLI an operator expects, against the real binary and real NBD clients: `--json` on
//! every command, `stats` in human units (raw with `--bytes`), the admin socket found from
//! `TIERCACHE_ADMIN` or the config file, `stop` that returns once the server is gone, `status`
//! showing knobs, writeback as paused/delayed/idle/rate and occupancy that adds up, and quiet
//! logs for clients that simply disconnect.

mod common;

use common::*;
use serde_json::Value;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn json_of(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", stdout(o)))
}

fn status(f: &Fixture) -> Value {
    json_of(&f.tc_admin(&["status", "--json"]))
}

/// Runs qemu-io commands on the fixture's export; they must succeed.
fn qemu_io(f: &Fixture, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", "-t", "none"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(f.uri());
    let o = output_within(&mut c, Duration::from_secs(60)).expect("qemu-io hung");
    assert!(
        o.status.success() && !stdout(&o).contains("failed"),
        "qemu-io {cmds:?}: {}{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The subcommands `tiercache --help` lists.
fn subcommands() -> Vec<String> {
    let help = stdout(&run(tc().arg("--help")));
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect()
}

/// Commands that report nothing to parse: servers that run until stopped, and `generate`
/// (its output is a completion script or man pages).
const SERVERS: [&str; 5] = ["serve", "demo", "emulate", "bench", "generate"];

#[test]
fn every_reporting_command_takes_json_and_prints_valid_json() {
    if !have("qemu-io") {
        return;
    }
    let cmds = subcommands();
    assert!(cmds.len() > 10, "{cmds:?}");
    for c in &cmds {
        let help = stdout(&run(tc().arg(c).arg("--help")));
        assert_eq!(
            help.contains("--json"),
            !SERVERS.contains(&c.as_str()),
            "`tiercache {c}`: --json expected on every command but the servers {SERVERS:?}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    for (name, mib) in [("slow.img", 16), ("fast.img", 16)] {
        std::fs::File::create(dir.path().join(name))
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
    }
    let made = json_of(&run(tc()
        .args(["make", "--json", "--label", "data", "--backing"])
        .arg(dir.path().join("slow.img"))
        .arg("--cache")
        .arg(dir.path().join("fast.img"))));
    assert_eq!(made["backing"][0]["export"], "data", "{made}");
    assert!(made["cache"]["nbuckets"].as_u64().unwrap() > 0, "{made}");
    let mut f = Fixture { dir, server: None };
    for (img, kind) in [("fast.img", "cache"), ("slow.img", "backing")] {
        let shown = json_of(&run(tc().arg("show").arg("--json").arg(f.path(img))));
        assert_eq!(shown["type"], kind, "{shown}");
        let checked = json_of(&run(tc().arg("check").arg("--json").arg(f.path(img))));
        assert_eq!(checked["verdict"], "healthy", "{checked}");
        assert_eq!(checked["kind"], kind, "{checked}");
    }
    f.start();
    let s = status(&f);
    assert_eq!(s["devices"][0]["name"], "data");
    let stats = json_of(&f.tc_admin(&["stats", "--json"]));
    assert!(stats["devices"][0]["stats_total"]["cache_hits"].is_u64());
    let all = json_of(&f.tc_admin(&["get", "--json", "data"]));
    assert_eq!(all["knobs"]["cache_mode"], "writethrough", "{all}");
    let one = json_of(&f.tc_admin(&["get", "--json", "data", "sequential_cutoff"]));
    assert_eq!(one["value"], 4 << 20, "{one}");
    let set = json_of(&f.tc_admin(&["set", "--json", "data", "sequential_cutoff", "8M"]));
    assert_eq!(set["value"], 8 << 20, "{set}");
    let degraded = json_of(&f.tc_admin(&["degrade", "--json", "--reason", "test"]));
    assert_eq!(degraded["health"]["state"], "degraded", "{degraded}");
    let readmitted = json_of(&f.tc_admin(&["readmit", "--json"]));
    assert_eq!(readmitted["health"]["state"], "ok", "{readmitted}");
    let detached = json_of(&f.tc_admin(&["detach", "--json", "data"]));
    assert_eq!(detached["ok"], true, "{detached}");
    let slow = f.path("slow.img");
    let attached = json_of(&f.tc_admin(&["attach", "--json", slow.to_str().unwrap()]));
    assert_eq!(attached["name"], "data", "{attached}");
    qemu_io(&f, &["read 0 4k"]);
    let stopped = json_of(&f.tc_admin(&["stop", "--json"]));
    assert_eq!(stopped["stopped"], true, "{stopped}");
    assert!(stopped["pid"].is_u64(), "{stopped}");
    f.server.take().unwrap().wait().unwrap();
    // An error is still one line on stderr, never half a JSON document on stdout.
    let o = f.admin_cmd(&["status", "--json"]).output().unwrap();
    assert!(!o.status.success() && o.stdout.is_empty());
}

#[test]
fn stats_are_in_human_units_unless_asked_for_bytes() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start();
    f.tc_admin(&["set", "data", "sequential_cutoff", "0"]);
    qemu_io(&f, &["write -P 0x5a 0 3M"]);
    let human = stdout(&f.tc_admin(&["stats"]));
    let raw = stdout(&f.tc_admin(&["stats", "--bytes"]));
    let row = |text: &str, key: &str| -> String {
        text.lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in\n{text}"))
            .to_string()
    };
    // 3 MiB written through to both devices.
    assert!(
        row(&human, "backing_written_bytes").contains("3.0 MiB"),
        "{human}"
    );
    assert!(
        row(&raw, "backing_written_bytes").contains(&(3u64 << 20).to_string()),
        "{raw}"
    );
    assert!(!row(&human, "backing_written_bytes").contains("3145728"));
    assert!(row(&human, "cache_hit_ratio").contains('%'), "{human}");
    f.stop();
}

#[test]
fn the_admin_socket_comes_from_the_environment_or_the_config_file() {
    let mut f = Fixture::new(16, 16, false);
    f.start();
    // TIERCACHE_ADMIN alone.
    let o = run(tc()
        .args(["status", "--json"])
        .env("TIERCACHE_ADMIN", f.admin()));
    assert_eq!(json_of(&o)["devices"][0]["name"], "data");
    // The serve config file, whatever TIERCACHE_ADMIN says.
    let cfg = f.path("tiercache.toml");
    std::fs::write(
        &cfg,
        format!(
            "cache = {:?}\nsocket = {:?}\n",
            f.path("fast.img"),
            f.socket()
        ),
    )
    .unwrap();
    let o = run(tc()
        .args(["get", "data", "cache_mode", "--config"])
        .arg(&cfg)
        .env("TIERCACHE_ADMIN", f.path("nowhere")));
    assert_eq!(stdout(&o).trim(), "writethrough");
    // A wrong TIERCACHE_ADMIN is named in the error, with how to name the socket.
    let o = tc()
        .arg("status")
        .env("TIERCACHE_ADMIN", f.path("nowhere"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("nowhere") && err.contains("TIERCACHE_ADMIN"),
        "{err}"
    );
    f.stop();
}

#[test]
fn stop_returns_only_once_the_server_process_is_gone() {
    let mut f = Fixture::new(16, 16, false);
    for _ in 0..3 {
        f.start();
        let out = stdout(&f.tc_admin(&["stop"]));
        let mut child = f.server.take().unwrap();
        let exited = child.try_wait().unwrap();
        assert!(
            exited.is_some(),
            "`tiercache stop` returned ({out}) while the server still ran"
        );
        assert!(exited.unwrap().success());
        assert!(out.contains("stopped"), "{out}");
        assert!(!std::path::Path::new(&f.admin()).exists());
    }
    // --no-wait returns at once; the server still stops cleanly.
    f.start();
    let out = stdout(&f.tc_admin(&["stop", "--no-wait"]));
    assert!(out.contains("is stopping"), "{out}");
    let status = wait_for(f.server.as_mut().unwrap(), Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    f.server = None;
}

/// Polls `status` until `pred` holds for the device, or fails after `limit`.
fn wait_status(f: &Fixture, limit: Duration, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let d = status(f)["devices"][0].clone();
        if pred(&d) {
            return d;
        }
        assert!(t.elapsed() < limit, "{what}: still {d:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The device row of the `status` table.
fn status_row(f: &Fixture) -> (String, String) {
    let text = stdout(&f.tc_admin(&["status"]));
    let row = text
        .lines()
        .find(|l| l.starts_with("data "))
        .unwrap_or_else(|| panic!("no device row:\n{text}"))
        .to_string();
    (row, text)
}

#[test]
fn status_shows_knobs_and_writeback_paused_delayed_idle_with_its_rate() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(16, 16, true);
    f.start();
    f.tc_admin(&["set", "data", "sequential_cutoff", "0"]);
    f.tc_admin(&["set", "data", "writeback_running", "0"]);
    // 1 MiB dirty: below the 10 % target of this 16 MiB cache.
    qemu_io(&f, &["write -P 0x11 0 512k", "write -P 0x22 4M 512k"]);
    let d = status(&f)["devices"][0].clone();
    assert_eq!(d["dirty_bytes"], 1 << 20, "{d:#}");
    assert_eq!(d["writeback_state"], "paused", "{d:#}");
    // The rate controller: the target is 10 % of the cache's data blocks (metadata takes
    // the rest), 1 MiB is under it, so it does not push (negative error, no proportional
    // term).
    let c = &d["writeback_control"];
    let target = c["target_bytes"].as_u64().unwrap();
    assert!(target > 1 << 20 && target <= (16 << 20) / 10, "{d:#}");
    assert_eq!(c["proportional_pct"], 0.0, "{d:#}");
    assert_eq!(c["integral_pct"], 0.0, "{d:#}");
    assert_eq!(c["controlled"], false, "{d:#}");
    assert!(c["error"].as_f64().unwrap() < 0.0, "{d:#}");
    let (row, text) = status_row(&f);
    assert!(row.trim_end().ends_with("paused"), "{text}");
    assert!(
        text.contains(
            "sequential_cutoff 0, writeback_percent 10, writeback_delay 30, \
             writeback_running off"
        ),
        "{text}"
    );
    assert_eq!(
        stdout(&f.tc_admin(&["get", "data", "writeback_running"])).trim(),
        "off"
    );
    // Running again, but the dirty data is younger than writeback_delay (30 s).
    f.tc_admin(&["set", "data", "writeback_running", "1"]);
    let d = status(&f)["devices"][0].clone();
    assert_eq!(d["writeback_state"], "delayed", "{d:#}");
    assert!(status_row(&f).0.trim_end().ends_with("delayed"));
    // No delay: it drains, and what it wrote back shows as a rate for a few seconds.
    f.tc_admin(&["set", "data", "writeback_delay", "0"]);
    let d = wait_status(&f, Duration::from_secs(30), "draining", |d| {
        d["dirty_bytes"] == 0
    });
    assert_eq!(d["writeback_state"], "idle", "{d:#}");
    assert!(
        d["writeback_bytes_per_sec"].as_u64().unwrap() > 0,
        "no rate right after writing back 1 MiB: {d:#}"
    );
    assert!(status_row(&f).0.trim_end().ends_with("idle"));
    f.stop();
}

#[test]
fn occupancy_adds_up_to_the_cache_device() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(32, 16, true);
    f.start();
    f.tc_admin(&["set", "data", "sequential_cutoff", "0"]);
    f.tc_admin(&["set", "data", "writeback_running", "0"]);
    qemu_io(
        &f,
        &[
            "write -P 1 0 1M",
            "read 8M 2M",
            "write -P 2 16M 256k",
            // Stale data in buckets that stay in use: overwritten and discarded ranges.
            "write -P 3 0 512k",
            "discard 16M 128k",
        ],
    );
    let s = status(&f);
    let c = &s["cache"];
    let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("no {k}: {c}"));
    let fast = std::fs::metadata(f.path("fast.img")).unwrap().len();
    assert_eq!(n("total_bytes"), fast, "{c}");
    assert_eq!(
        n("unused_bytes") + n("clean_bytes") + n("dirty_bytes") + n("metadata_bytes"),
        n("total_bytes"),
        "the breakdown does not add up: {c}"
    );
    let d = &s["devices"][0];
    assert_eq!(d["dirty_bytes"], c["dirty_bytes"], "{s:#}");
    assert_eq!(
        d["cached_bytes"].as_u64().unwrap(),
        n("clean_bytes") + n("dirty_bytes"),
        "{s:#}"
    );
    assert!(n("dirty_bytes") > 0 && n("clean_bytes") > 0, "{c}");
    // The text shows the four parts with percentages that add up to 100, and says what
    // in_use counts.
    let text = stdout(&f.tc_admin(&["status"]));
    let pct_sum: f64 = ["dirty", "clean", "unused", "metadata"]
        .iter()
        .map(|part| {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(part))
                .unwrap_or_else(|| panic!("no {part} line:\n{text}"));
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields[fields.len() - 2].parse::<f64>().unwrap()
        })
        .sum();
    assert!((pct_sum - 100.0).abs() < 0.25, "{pct_sum}:\n{text}");
    assert!(
        text.contains("in_use") && text.contains("free list"),
        "{text}"
    );
    f.stop();
}

#[test]
fn clients_that_disconnect_are_not_logged_as_errors() {
    if !have("nbdinfo") {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    let log = f.path("serve.log");
    let mut cmd = f.serve_cmd();
    cmd.env("RUST_LOG", "info")
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
    f.start_cmd(cmd);
    for _ in 0..20 {
        run(Command::new("nbdinfo").arg(f.uri()));
        run(Command::new("nbdinfo")
            .arg("--list")
            .arg(format!("nbd+unix://?socket={}", f.socket().display())));
    }
    f.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("serving on"), "no INFO log at all:\n{text}");
    for noise in ["Broken pipe", "Connection reset", "ended:"] {
        assert!(!text.contains(noise), "{noise:?} logged:\n{text}");
    }
}

/// A backing device that grew: `resize` live, and a restart.
#[test]
fn a_grown_backing_device_is_taken_in_by_resize_and_at_restart() {
    if !have("nbdinfo") {
        return;
    }
    let size = |f: &Fixture| -> u64 {
        let o = run(Command::new("nbdinfo").arg("--size").arg(f.uri()));
        stdout(&o).trim().parse().unwrap()
    };
    let mut f = Fixture::new(16, 16, false);
    f.start();
    let before = size(&f);
    let grow = |f: &Fixture, mib: u64| {
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path("slow.img"))
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
    };
    grow(&f, 24);
    let r = json_of(&f.tc_admin(&["resize", "--json", "data"]));
    assert_eq!(r["old_size_bytes"], before, "{r}");
    assert_eq!(r["size_bytes"], before + (8 << 20), "{r}");
    assert_eq!(
        size(&f),
        before + (8 << 20),
        "a new client sees the old size"
    );
    f.stop();
    // Grown while stopped: picked up at the start.
    grow(&f, 32);
    f.start();
    assert_eq!(size(&f), before + (16 << 20));
    f.stop();
    let shown = json_of(&run(tc().arg("show").arg("--json").arg(f.path("slow.img"))));
    assert_eq!(shown["data_size"], before + (16 << 20), "{shown}");
}

/// Every change through the admin socket leaves a line in the server's log naming the client
/// (uid and pid), and for `set` the value before and after; refused changes too. Also: an
/// admin command pointed at the NBD socket says which socket to use, `status` of a set with
/// no volumes says so, and each listener's limits are logged once, naming it.
#[test]
fn admin_changes_leave_an_audit_trail_in_the_log() {
    let mut f = Fixture::new(16, 16, false);
    let log = f.path("serve.log");
    let mut cmd = f.serve_cmd();
    cmd.args([
        "--tcp",
        "0",
        "--shutdown-timeout",
        "30s",
        "--idle-timeout",
        "1m",
    ])
    .env("RUST_LOG", "info")
    .stderr(Stdio::from(std::fs::File::create(&log).unwrap()));
    f.start_cmd(cmd);
    f.tc_admin(&["set", "data", "writeback_percent", "25"]);
    f.tc_admin(&["set", "data", "cache_mode", "writeback"]);
    let o = f
        .admin_cmd(&["set", "data", "writeback_percent", "101"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("tiercache: writeback_percent 101 is out of range (0 to 100)"),
        "{err}"
    );
    f.tc_admin(&["clear-stats", "data"]);
    f.tc_admin(&["degrade", "--reason", "replacing it"]);
    f.tc_admin(&["readmit"]);
    let nbd = f.socket().display().to_string();
    let o = admin_cmd(&nbd, &["status"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("is an NBD socket") && err.contains(&format!("({})", f.admin())),
        "{err}"
    );
    f.tc_admin(&["detach", "data"]);
    let shown = stdout(&f.tc_admin(&["status"]));
    assert!(shown.contains("no volumes"), "{shown}");
    assert!(!shown.lines().any(|l| l.starts_with("DEVICE ")), "{shown}");
    f.stop();
    let text = std::fs::read_to_string(&log).unwrap();
    // SAFETY: getuid has no preconditions.
    let client = format!("admin client uid {} pid ", unsafe { libc::getuid() });
    for said in [
        "set writeback_percent of export 'data': 10 -> 25",
        "set cache_mode of export 'data': writethrough -> writeback",
        "set refused: writeback_percent 101 is out of range",
        "statistics of export 'data' cleared",
        "degrade, reason: replacing it",
        "readmit the cache device",
        "detach export 'data'",
        ") detached",
        ": stop",
    ] {
        assert!(
            text.lines()
                .any(|l| l.contains(" INFO ") && l.contains(&client) && l.contains(said)),
            "no INFO line by {client}... with {said:?}:\n{text}"
        );
    }
    // One line per listener, each naming its listener.
    let limits: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("serving at most"))
        .collect();
    assert_eq!(limits.len(), 2, "{text}");
    assert!(
        limits.iter().any(|l| l.contains(&format!("{nbd}: "))),
        "{text}"
    );
    assert!(
        limits.iter().any(|l| l.contains("tcp 127.0.0.1:0: ")),
        "{text}"
    );
}
