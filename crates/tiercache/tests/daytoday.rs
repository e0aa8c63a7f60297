//! Day-to-day operation against the real binary and a real NBD client (qemu-io): a backing
//! device formatted alone (`make` without `--cache`) and attached to a running set, then named
//! at the next start; `serve --config FILE` with flags that override the file's keys; the demo
//! in a pipe (ends promptly, no panic) and warm on its second run; `clear-stats`.

mod common;

use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn json_of(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", stdout(o)))
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs qemu-io commands on `uri`; they must succeed.
fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", "-t", "none"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri);
    let o = output_within(&mut c, Duration::from_secs(60)).expect("qemu-io hung");
    assert!(
        o.status.success() && !stdout(&o).contains("failed") && !stdout(&o).contains("fail"),
        "qemu-io {cmds:?}: {}{}",
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

fn sized_file(path: &std::path::Path, mib: u64) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
}

#[test]
fn a_backing_device_made_alone_is_attached_to_a_running_set_and_named_at_restart() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start();
    let new = f.path("new.img");
    sized_file(&new, 32);
    // `make` without --cache, while the server holds the cache device.
    let o = run(tc()
        .args(["make", "--label", "extra", "--json", "--backing"])
        .arg(&new));
    let made = json_of(&o);
    assert!(made["cache"].is_null(), "{made}");
    assert_eq!(made["backing"][0]["export"], "extra", "{made}");
    let o = run(tc()
        .args(["make", "--label", "extra2", "--backing"])
        .arg(f.path("new.img"))
        .arg("--force"));
    assert!(
        stdout(&o).contains("tiercache attach"),
        "make alone says how to attach: {}",
        stdout(&o)
    );
    let shown = json_of(&run(tc().args(["show", "--json"]).arg(&new)));
    assert_eq!(shown["type"], "backing");
    assert!(shown["cset_uuid"].is_null(), "{shown}");
    assert_eq!(shown["dev_label"], "extra2");
    // Attach by a relative path, from the directory it is in.
    let o = run(f
        .admin_cmd(&["attach", "new.img"])
        .current_dir(f.dir.path()));
    assert!(stdout(&o).contains("'extra2'"), "{}", stdout(&o));
    let uri = format!("nbd+unix:///extra2?socket={}", f.socket().display());
    qemu_io(&uri, &["write -P 0x5c 1M 2M", "read -P 0x5c 1M 2M"]);
    // The data of the first volume is untouched, and both are listed.
    let status = json_of(&f.tc_admin(&["status", "--json"]));
    let names: Vec<&str> = status["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["data", "extra2"], "{status}");
    let shown = json_of(&run(tc().args(["show", "--json"]).arg(&new)));
    assert_eq!(shown["cset_uuid"], status["cache"]["set_uuid"], "{shown}");
    f.stop();
    // Named at the next start, it is served with its data.
    let mut cmd = f.serve_cmd();
    cmd.arg("--backing").arg(&new).stderr(Stdio::inherit());
    f.start_cmd(cmd);
    qemu_io(&uri, &["read -P 0x5c 1M 2M", "read -P 0 0 1M"]);
    f.stop();
}

#[test]
fn make_alone_checks_every_device_before_writing_and_prints_no_engine_info() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    sized_file(&a, 8);
    std::fs::write(&b, b"too small").unwrap();
    let o = tc()
        .args(["make", "--backing"])
        .arg(&a)
        .arg("--backing")
        .arg(&b)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("b.img"), "{}", stderr(&o));
    // a.img was not written: still all zeroes.
    assert!(std::fs::read(&a).unwrap().iter().all(|&x| x == 0));
    // A full make logs nothing at INFO (the engine's "recovered" line), whatever RUST_LOG.
    let c = dir.path().join("c.img");
    sized_file(&c, 16);
    let o = run(tc()
        .env("RUST_LOG", "info")
        .args(["make", "--backing"])
        .arg(&a)
        .arg("--cache")
        .arg(&c));
    assert!(!stderr(&o).contains("recovered"), "{}", stderr(&o));
    assert!(!stderr(&o).contains("INFO"), "{}", stderr(&o));
}

#[test]
fn serve_flags_override_the_config_file() {
    let mut f = Fixture::new(16, 16, false);
    let cfg = f.path("tiercache.toml");
    let file_socket = f.path("from-file.sock");
    std::fs::write(
        &cfg,
        format!(
            "cache = {:?}\nbacking = [{:?}]\nsocket = {:?}\nadmission = \"all\"\n\
             replacement = \"fifo\"\n[volumes.data]\nsequential_cutoff = \"1M\"\n",
            f.path("fast.img"),
            f.path("slow.img"),
            file_socket
        ),
    )
    .unwrap();
    // --socket and --admission from the command line, the rest from the file.
    let mut cmd = tc();
    cmd.arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--socket")
        .arg(f.socket())
        .args(["--admission", "ghost"])
        .stderr(Stdio::inherit());
    f.start_cmd(cmd);
    assert!(
        !file_socket.exists(),
        "the flag's socket replaces the file's"
    );
    let status = json_of(&f.tc_admin(&["status", "--json"]));
    assert_eq!(status["cache"]["admission"], "ghost", "flag: {status}");
    assert_eq!(status["cache"]["replacement"], "fifo", "file: {status}");
    assert_eq!(
        status["devices"][0]["sequential_cutoff"],
        1 << 20,
        "the file's [volumes]: {status}"
    );
    f.stop();
    // The case: the cache device is gone, and the operator says so for this start
    // without editing the file.
    std::fs::rename(f.path("fast.img"), f.path("fast.img.away")).unwrap();
    let mut cmd = tc();
    cmd.arg("serve")
        .arg("--config")
        .arg(&cfg)
        .arg("--socket")
        .arg(f.socket())
        .arg("--without-cache-if-missing")
        .stderr(Stdio::inherit());
    f.start_cmd(cmd);
    let status = json_of(&f.tc_admin(&["status", "--json"]));
    assert!(
        status.to_string().contains("without"),
        "served without its cache: {status}"
    );
    f.stop();
    // Neither the file nor a flag names a cache device: one line saying what to give.
    std::fs::write(&cfg, "socket = \"/tmp/x.sock\"\n").unwrap();
    let o = tc()
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--cache"), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
}

/// Reads `n` lines of a child's stdout, then closes it.
fn read_lines_then_close(child: &mut std::process::Child, n: usize) -> Vec<String> {
    let out = child.stdout.take().unwrap();
    let mut r = BufReader::new(out);
    let mut lines = Vec::new();
    for _ in 0..n {
        let mut l = String::new();
        if r.read_line(&mut l).unwrap() == 0 {
            break;
        }
        lines.push(l);
    }
    lines
}

#[test]
fn the_demo_in_a_pipe_ends_promptly_without_a_panic() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    for no_serve in [true, false] {
        for keep in [2, 9] {
            // `demo | head -N`: the reader goes after N lines, early or mid-workload.
            let mut c = tc();
            c.args(["demo", "--size", "64M", "--dir"])
                .arg(dir.path().join("demo"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if no_serve {
                c.arg("--no-serve");
            }
            let mut child = c.spawn().unwrap();
            let lines = read_lines_then_close(&mut child, keep);
            assert_eq!(lines.len(), keep, "{lines:?}");
            let status = wait_for(&mut child, Duration::from_secs(120));
            if status.is_none() {
                let _ = child.kill();
                panic!("the demo hangs after its reader went (no_serve {no_serve}, head -{keep})");
            }
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            assert!(!err.contains("panicked"), "{err}");
            assert!(status.unwrap().success(), "{err}");
        }
    }
}

#[test]
fn the_demo_stops_on_sigterm_without_a_backtrace_and_its_cache_stays_warm() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let first_pass_ratio = |out: &str| -> u64 {
        let l = out
            .lines()
            .find(|l| l.trim_start().starts_with("1 ") && l.trim_end().ends_with('%'))
            .unwrap_or_else(|| panic!("no pass 1 in:\n{out}"));
        l.split_whitespace()
            .last()
            .unwrap()
            .trim_end_matches('%')
            .parse()
            .unwrap()
    };
    // A serving demo, stopped by SIGTERM once it says so.
    let mut child = tc()
        .args(["demo", "--size", "64M", "--dir"])
        .arg(dir.path().join("demo"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = String::new();
    let mut r = BufReader::new(child.stdout.take().unwrap());
    while !out.contains("Press Ctrl-C") {
        let mut l = String::new();
        assert!(r.read_line(&mut l).unwrap() > 0, "demo ended early:\n{out}");
        out.push_str(&l);
    }
    assert!(!out.contains("last run"), "a first run is cold:\n{out}");
    let cold = first_pass_ratio(&out);
    unsafe { libc_kill(child.id() as i32, 15) };
    let status = wait_for(&mut child, Duration::from_secs(60)).expect("demo ignores SIGTERM");
    let mut err = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    // The next run reuses the devices, and its first pass hits what the last run cached.
    let o = run(tc()
        .args(["demo", "--no-serve", "--size", "64M", "--dir"])
        .arg(dir.path().join("demo")));
    let warm_out = stdout(&o);
    assert!(warm_out.contains("last run"), "{warm_out}");
    let warm = first_pass_ratio(&warm_out);
    assert!(
        warm >= 90 && warm > cold,
        "pass 1 hit ratio: cold {cold}%, warm {warm}%\n{warm_out}"
    );
    // Another size is another demo: formatted afresh (cold).
    let o = run(tc()
        .args(["demo", "--no-serve", "--size", "80M", "--dir"])
        .arg(dir.path().join("demo")));
    assert!(!stdout(&o).contains("last run"), "{}", stdout(&o));
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[test]
fn clear_stats_resets_what_stats_count_for_one_volume() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(32, 16, false);
    // No congestion: on a busy machine a cache read slower than 2 ms would send the re-read
    // to the backing device (a bypass, neither hit nor miss).
    f.start_with(&["--congested-read-threshold-us", "0"]);
    let uri = f.uri();
    qemu_io(&uri, &["read 0 1M", "read 0 1M"]);
    let stats = |f: &Fixture| json_of(&f.tc_admin(&["stats", "--json", "--bytes"]));
    let before = stats(&f);
    let dev = &before["devices"][0];
    assert!(
        dev["stats_total"]["cache_misses"].as_u64().unwrap() > 0,
        "{dev}"
    );
    assert!(
        dev["stats_five_minute"]["cache_hits"].as_u64().unwrap() > 0,
        "{dev}"
    );
    let o = f.tc_admin(&["clear-stats", "data"]);
    assert!(
        stdout(&o).contains("data: statistics cleared"),
        "{}",
        stdout(&o)
    );
    let after = stats(&f);
    for w in ["total", "five_minute", "hour", "day"] {
        let s = &after["devices"][0][format!("stats_{w}")];
        for (k, v) in s.as_object().unwrap() {
            assert_eq!(v.as_u64(), Some(0), "{w}.{k} after clear-stats: {s}");
        }
    }
    // Counting goes on from there: one more 1 MiB read of cached data.
    qemu_io(&uri, &["read 0 1M"]);
    let again = stats(&f);
    for w in ["total", "five_minute"] {
        let s = &again["devices"][0][format!("stats_{w}")];
        assert!(s["cache_hits"].as_u64().unwrap() > 0, "{s}");
        assert_eq!(s["cache_misses"], 0, "{s}");
        assert_eq!(s["cache_read_bytes"], 1 << 20, "{s}");
        assert_eq!(s["cache_hit_ratio"], 100, "{s}");
    }
    // An unknown volume is an error naming the ones there are.
    let o = f.admin_cmd(&["clear-stats", "nosuch"]).output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("devices: data"), "{}", stderr(&o));
    f.stop();
}

#[test]
fn help_man_pages_and_completions_document_knobs_and_arguments() {
    let help = stdout(&run(tc().args(["set", "--help"])));
    for want in [
        "<VOLUME>",
        "<KNOB>",
        "The knob to change",
        "[possible values: cache_mode, sequential_cutoff",
        "KNOB               VALUES",
        "writeback_delay    seconds, 0 to 86400",
    ] {
        assert!(help.contains(want), "set --help lacks {want:?}:\n{help}");
    }
    let o = tc().args(["set", "data", "nosuch", "1"]).output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("possible values"), "{}", stderr(&o));
    for cmd in ["show", "check", "attach", "detach", "clear-stats", "get"] {
        let help = stdout(&run(tc().args([cmd, "--help"])));
        let args: Vec<&str> = help
            .lines()
            .skip_while(|l| !l.starts_with("Arguments:"))
            .skip(1)
            .take_while(|l| !l.is_empty())
            .collect();
        assert!(!args.is_empty(), "{cmd} --help lists no arguments:\n{help}");
        // "  <DEVICE>  A cache or ..." or "  <DEVICE>" with its description on the next lines.
        let is_arg = |l: &str| l.trim_start().starts_with('<') || l.trim_start().starts_with('[');
        for (n, a) in args.iter().enumerate().filter(|(_, l)| is_arg(l)) {
            let described = a.split_whitespace().count() > 1
                || args.get(n + 1).is_some_and(|next| !is_arg(next));
            assert!(
                described,
                "{cmd}: argument without a description: {a}\n{help}"
            );
        }
    }
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    run(tc().args(["generate", "man"]).arg(dir.path()));
    let man = std::fs::read_to_string(dir.path().join("tiercache-set.1")).unwrap();
    for want in [
        "writeback_percent",
        "86400",
        "writethrough",
        "The knob to change",
    ] {
        assert!(man.contains(want), "tiercache-set.1 lacks {want}");
    }
    assert!(dir.path().join("tiercache-clear-stats.1").exists());
    let bash = stdout(&run(tc().args(["generate", "completions", "bash"])));
    assert!(
        bash.contains("cache_mode sequential_cutoff writeback_percent writeback_delay writeback_running label"),
        "bash completion of knob names"
    );
}
