//! `serve --metrics` and `tiercache top` against the real binary and a real NBD client
//! (qemu-io): the counters move as the I/O says, histograms are complete, every line of the
//! exposition parses and its names are well-formed; both formats pass their readers'
//! checks (classic: `promtool check metrics`; OpenMetrics: the strict parser here and, when
//! installed, Python's prometheus_client); scrapes are answered while hundreds of slow clients
//! trickle requests at the endpoint; `top --once` shows the volume with plausible numbers in
//! 80 columns, and the numbers `status`/`stats` give over the same interval; the io_uring
//! data path's own requests to a remote backing device counted, and ended when it hangs.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn admin(f: &Fixture, req: &Value) -> Value {
    let mut s = UnixStream::connect(f.admin()).unwrap();
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    v
}

/// The `Accept` header of Prometheus' scrapes (2.x): OpenMetrics preferred.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,\
    application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// An HTTP GET of /metrics with `accept` (`None`: no Accept header): the reply's
/// Content-Type and body. It must be a 200 and come within `limit` (a hang guard).
fn get_metrics(addr: &str, accept: Option<&str>, limit: Duration) -> (String, String) {
    let deadline = Instant::now() + limit;
    let sa: SocketAddr = addr.parse().unwrap();
    let mut s = TcpStream::connect_timeout(&sa, limit)
        .unwrap_or_else(|e| panic!("connecting to {addr} within {limit:?}: {e}"));
    s.set_write_timeout(Some(limit)).unwrap();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n{accept}\r\n").unwrap();
    let mut reply = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no whole reply within {limit:?}");
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) => panic!("reading the reply within {limit:?}: {e}"),
        }
    }
    let reply = String::from_utf8(reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .expect("a Content-Type")
        .to_string();
    (content_type, body.to_string())
}

/// A scrape as Prometheus sends it: OpenMetrics.
fn scrape(addr: &str) -> String {
    let (content_type, body) = get_metrics(addr, Some(PROMETHEUS_ACCEPT), Duration::from_secs(10));
    assert_eq!(content_type, OPENMETRICS);
    body
}

type Labels = BTreeMap<String, String>;

/// Parses the text format strictly: comments are HELP/TYPE/UNIT/EOF, every sample belongs to
/// a family declared before it, names and label names are well-formed, values are numbers.
fn parse(text: &str) -> Vec<(String, Labels, f64)> {
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let mut families: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if let Some(c) = line.strip_prefix("# ") {
            let mut parts = c.splitn(3, ' ');
            let (kind, name) = (parts.next().unwrap(), parts.next().unwrap_or(""));
            match kind {
                "EOF" => {
                    assert!(lines.peek().is_none(), "text after # EOF");
                    return samples;
                }
                "TYPE" => {
                    let t = parts.next().unwrap();
                    assert!(
                        ["counter", "gauge", "histogram", "info"].contains(&t),
                        "{line}"
                    );
                    assert!(name_ok(name), "bad family name {name}");
                    assert!(
                        families.insert(name.into(), t.into()).is_none(),
                        "{name} twice"
                    );
                }
                "HELP" | "UNIT" => assert!(name_ok(name), "{line}"),
                _ => panic!("unexpected comment: {line}"),
            }
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("NAME VALUE");
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value of {line}"));
        let (name, labels) = match series.split_once('{') {
            None => (series, Labels::new()),
            Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}').unwrap())),
        };
        assert!(name_ok(name), "bad name in {line}");
        for k in labels.keys() {
            assert!(name_ok(k), "bad label name in {line}");
        }
        let family = families
            .iter()
            .find(|(f, t)| {
                let sfx: &[&str] = match t.as_str() {
                    "counter" => &["_total"],
                    "histogram" => &["_bucket", "_sum", "_count"],
                    "info" => &["_info"],
                    _ => &[""],
                };
                sfx.iter().any(|s| name == format!("{f}{s}"))
            })
            .unwrap_or_else(|| panic!("{name} belongs to no declared family"));
        assert!(family.0.starts_with("tiercache_"), "{name}");
        if family.1 == "counter" {
            assert!(name.ends_with("_total"));
        }
        samples.push((name.to_string(), labels, value));
    }
    panic!("no # EOF at the end");
}

fn parse_labels(s: &str) -> Labels {
    let mut out = Labels::new();
    let mut chars = s.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        assert_eq!(chars.next(), Some('"'), "label {key} in {s}");
        let mut value = String::new();
        loop {
            match chars.next().expect("unterminated label value") {
                '\\' => value.push(match chars.next().unwrap() {
                    'n' => '\n',
                    c => c,
                }),
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key, value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    out
}

/// The value of the one sample named `name` whose labels include `want`.
fn value(samples: &[(String, Labels, f64)], name: &str, want: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && want
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.2)
        .collect();
    assert_eq!(found.len(), 1, "{name} {want:?}: {found:?}");
    found[0]
}

/// `qemu-io` running `cmds` on the fixture's export, not started yet.
fn qemu_io_cmd(f: &Fixture, cmds: &[&str]) -> Command {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(f.uri());
    c
}

/// Runs `cmds` with `qemu-io` on the fixture's export; each must succeed (qemu-io exits 0
/// when a command fails, and says "failed").
fn qemu_io(f: &Fixture, cmds: &[&str]) -> Output {
    let o = run(&mut qemu_io_cmd(f, cmds));
    let out = stdout(&o) + &String::from_utf8_lossy(&o.stderr);
    assert!(!out.contains("failed"), "qemu-io {cmds:?}: {out}");
    o
}

fn metrics_address(f: &Fixture) -> String {
    let r = admin(f, &json!({"cmd": "metrics"}));
    r["metrics"]["metrics_address"]
        .as_str()
        .expect("the server reports where /metrics is")
        .to_string()
}

#[test]
fn counters_follow_real_client_io() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(64, 32, false);
    // Port 0: the server picks a free one and reports it. No congestion: a cache device
    // slower than 2 ms per read on a busy machine would send the re-read to the backing
    // device (a bypass here; neither hit nor miss to the engine).
    f.start_with(&[
        "--metrics",
        "127.0.0.1:0",
        "--congested-read-threshold-us",
        "0",
    ]);
    let addr = metrics_address(&f);
    assert!(
        addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"),
        "{addr}"
    );
    let before = parse(&scrape(&addr));
    let vol = [("volume", "data")];
    let get = |s: &[_], name: &str, extra: &[(&str, &str)]| {
        let mut want = vol.to_vec();
        want.extend_from_slice(extra);
        value(s, name, &want)
    };

    // A miss, then a hit of the same MiB; a writethrough write; a bypassed write.
    qemu_io(&f, &["read 0 1M", "read 0 1M", "write -P 7 4M 64k"]);
    f.tc_admin(&["set", "data", "cache_mode", "writearound"]);
    qemu_io(&f, &["write -P 8 8M 64k"]);
    let after = parse(&scrape(&addr));
    let delta =
        |name: &str, extra: &[(&str, &str)]| get(&after, name, extra) - get(&before, name, extra);
    let req = |op, result| [("op", op), ("result", result)];
    assert_eq!(delta("tiercache_volume_cache_hits_total", &[]), 1.0);
    assert_eq!(delta("tiercache_volume_cache_misses_total", &[]), 1.0);
    assert_eq!(
        delta("tiercache_volume_requests_total", &req("read", "hit")),
        1.0
    );
    assert_eq!(
        delta("tiercache_volume_requests_total", &req("read", "miss")),
        1.0
    );
    assert_eq!(
        delta("tiercache_volume_requests_total", &req("read", "bypass")),
        0.0
    );
    assert_eq!(
        delta("tiercache_volume_request_bytes_total", &req("read", "hit")),
        1048576.0
    );
    assert_eq!(
        delta(
            "tiercache_volume_requests_total",
            &req("write", "writethrough")
        ),
        1.0
    );
    assert_eq!(
        delta("tiercache_volume_requests_total", &req("write", "bypass")),
        1.0
    );
    assert_eq!(
        delta(
            "tiercache_volume_request_bytes_total",
            &req("write", "bypass")
        ),
        65536.0
    );
    assert_eq!(delta("tiercache_volume_bypassed_bytes_total", &[]), 65536.0);
    assert_eq!(
        delta("tiercache_volume_requests_total", &req("read", "error")),
        0.0
    );

    // Histograms: every bucket, cumulative, +Inf equal to the count and to the requests.
    let buckets: Vec<(f64, f64)> = after
        .iter()
        .filter(|(n, l, _)| {
            n == "tiercache_volume_request_duration_seconds_bucket"
                && l["volume"] == "data"
                && l["op"] == "read"
                && l["result"] == "hit"
        })
        .map(|(_, l, v)| {
            let le = if l["le"] == "+Inf" {
                f64::INFINITY
            } else {
                l["le"].parse().unwrap()
            };
            (le, *v)
        })
        .collect();
    assert_eq!(buckets.len(), 21, "{buckets:?}");
    assert!(buckets
        .windows(2)
        .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    let count = get(
        &after,
        "tiercache_volume_request_duration_seconds_count",
        &req("read", "hit"),
    );
    assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, count));
    assert_eq!(
        count,
        get(
            &after,
            "tiercache_volume_requests_total",
            &req("read", "hit")
        )
    );
    assert!(
        get(
            &after,
            "tiercache_volume_request_duration_seconds_sum",
            &req("read", "hit")
        ) > 0.0
    );

    // The devices under the cache: the backing device was read for the miss, both flushed.
    let dev = |role: &str, op: &str, name: &str| value(&after, name, &[("role", role), ("op", op)]);
    assert!(
        dev(
            "backing",
            "read",
            "tiercache_device_io_duration_seconds_count"
        ) >= 1.0
    );
    assert!(dev("backing", "read", "tiercache_device_io_bytes_total") >= 1048576.0);
    assert!(
        dev(
            "cache",
            "write",
            "tiercache_device_io_duration_seconds_count"
        ) >= 1.0
    );
    assert_eq!(
        dev("cache", "read", "tiercache_device_io_errors_total"),
        0.0
    );

    // The cache set: the occupancy adds up; healthy; the MiB read is cached.
    let occ = |kind| {
        value(
            &after,
            "tiercache_cache_set_occupancy_bytes",
            &[("kind", kind)],
        )
    };
    let size = value(&after, "tiercache_cache_set_size_bytes", &[]);
    assert_eq!(
        occ("unused") + occ("clean") + occ("dirty") + occ("metadata"),
        size
    );
    assert!(occ("clean") >= 1048576.0);
    assert_eq!(value(&after, "tiercache_cache_set_degraded", &[]), 0.0);
    assert_eq!(value(&after, "tiercache_cache_set_errors_total", &[]), 0.0);
    assert!(get(&after, "tiercache_volume_cached_bytes", &[]) >= 1048576.0);
    assert_eq!(
        get(&after, "tiercache_volume_state", &[("state", "clean")]),
        1.0
    );
    assert_eq!(
        get(
            &after,
            "tiercache_volume_info",
            &[("cache_mode", "writearound")]
        ),
        1.0
    );
    // The NBD listener: qemu-io has gone (the server notices within moments).
    let sock = format!("unix:{}", f.socket().display());
    let connections = |s: &[_]| value(s, "tiercache_connections", &[("listener", &sock)]);
    let t = std::time::Instant::now();
    while connections(&parse(&scrape(&addr))) != 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a connection stays open"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(value(&after, "tiercache_connections_max", &[("listener", &sock)]) > 0.0);
    f.stop();
}

/// Parses a count as `top` prints it ("12", "3.4k", "1.2M").
fn count(s: &str) -> f64 {
    match s.strip_suffix('k') {
        Some(k) => k.parse::<f64>().unwrap() * 1e3,
        None => match s.strip_suffix('M') {
            Some(m) => m.parse::<f64>().unwrap() * 1e6,
            None => s.parse().unwrap_or_else(|_| panic!("not a count: {s}")),
        },
    }
}

#[test]
fn top_once_shows_each_volume_with_plausible_numbers() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(64, 32, false);
    f.start_with(&["--congested-read-threshold-us", "0"]); // see the test above
    qemu_io(&f, &["read 0 1M"]); // now cached
                                 // Re-read it over and over while top takes its two samples.
    let stop = AtomicBool::new(false);
    let out = std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                qemu_io(&f, &["read 0 1M"; 20]);
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        let out = f.tc_admin(&["top", "--once"]);
        stop.store(true, Ordering::SeqCst);
        out
    });
    let text = stdout(&out);
    println!("{text}");
    for l in text.lines() {
        assert!(l.chars().count() <= 80, "wider than 80 columns: {l}");
    }
    let lines: Vec<&str> = text.lines().collect();
    let head = lines.iter().position(|l| l.starts_with("VOLUME")).unwrap();
    let cols: Vec<&str> = lines[head].split_whitespace().collect();
    assert_eq!(cols[..3], ["VOLUME", "MODE", "HIT%"]);
    let row: Vec<&str> = lines[head + 1].split_whitespace().collect();
    assert_eq!(row[..2], ["data", "wt"], "{text}");
    // HIT% R hit R miss R byp R MiB/s W wb W wt W byp W MiB/s
    let hit_pct: f64 = row[2].parse().unwrap();
    assert!((90.0..=100.0).contains(&hit_pct), "{text}");
    let reads_hit = count(row[3]);
    assert!(reads_hit >= 1.0, "{text}");
    assert_eq!(count(row[4]), 0.0, "{text}");
    assert_eq!(count(row[5]), 0.0, "{text}");
    let read_mib_s: f64 = row[6].parse().unwrap();
    // Every read is 1 MiB: MiB/s and reads/s agree (within rounding of the printout).
    let reads: f64 = row[3..6].iter().map(|c| count(c)).sum();
    assert!((read_mib_s - reads).abs() <= 0.5 + reads * 0.01, "{text}");
    for w in &row[7..] {
        assert_eq!(count(w), 0.0, "{text}");
    }
    assert!(
        lines[head + 2].contains("lat read p50 ") && lines[head + 2].contains(" p99 "),
        "{text}"
    );
    assert!(lines[head + 3].contains("dirty 0B"), "{text}");
    assert!(text.contains("health ok"), "{text}");
    f.stop();
}

/// What the kernel says a process waits in ("hrtimer_nanosleep": a sleep).
fn wchan(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default()
}

#[test]
fn top_shows_what_status_and_stats_say_over_the_same_interval() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(64, 32, true);
    f.start_with(&["--congested-read-threshold-us", "0"]);
    qemu_io(&f, &["read 0 1M"]); // cached: read again, hits
    let status = |f: &Fixture| -> Value {
        serde_json::from_slice(&f.tc_admin(&["status", "--json"]).stdout).unwrap()
    };
    let total = |s: &Value, k: &str| s["devices"][0]["stats_total"][k].as_u64().unwrap();
    // Writeback paused: dirty data stays where the workload leaves it.
    f.tc_admin(&["set", "data", "writeback_running", "0"]);
    // top's interval must hold the whole workload: it starts once top has its first sample
    // (top is asleep), and the run counts only if top still sleeps when it is done.
    let mut interval = 4;
    let (before, top, after) = loop {
        let before = status(&f);
        let mut child = f
            .admin_cmd(&[
                "top",
                "--once",
                "--json",
                "--interval",
                &interval.to_string(),
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while wchan(child.id()) != "hrtimer_nanosleep" {
            assert!(t.elapsed() < Duration::from_secs(30), "top never sleeps");
            std::thread::sleep(Duration::from_millis(5));
        }
        qemu_io(
            &f,
            &[
                "read 0 1M",
                "read 0 512k",
                "read 8M 1M",
                "write -P 7 16M 512k",
            ],
        );
        let inside = wchan(child.id()) == "hrtimer_nanosleep";
        let status_top = wait_for(&mut child, Duration::from_secs(120)).expect("top hangs");
        assert!(status_top.success());
        let mut out = String::new();
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let after = status(&f);
        if inside {
            break (before, serde_json::from_str::<Value>(&out).unwrap(), after);
        }
        interval *= 2;
        assert!(interval <= 60, "the workload never fit in top's interval");
    };
    println!("{top:#}");
    let v = &top["volumes"][0];
    let d = |k: &str| total(&after, k) - total(&before, k);
    let (hits, misses) = (d("cache_hits"), d("cache_misses"));
    assert!(
        hits > 0 && misses > 0,
        "the workload hits and misses: {after}"
    );
    assert_eq!(
        v["read_counts"],
        json!([
            hits,
            misses,
            d("cache_bypass_hits") + d("cache_bypass_misses")
        ]),
        "{v}"
    );
    assert_eq!(v["hit_ratio_pct"], hits * 100 / (hits + misses), "{v}");
    assert_eq!(v["writeback_bytes"], d("writeback_bytes"), "{v}");
    let dev = &after["devices"][0];
    for k in ["dirty_bytes", "cached_bytes"] {
        assert_eq!(v[k], dev[k], "{k}: top {v} status {dev}");
    }
    assert_eq!(v["writeback"], dev["writeback_state"], "{v} {dev}");
    assert_eq!(v["writeback"], "paused");
    // The dirty trend is the change of dirty data over the interval.
    let dirty_change = dev["dirty_bytes"].as_f64().unwrap()
        - before["devices"][0]["dirty_bytes"].as_f64().unwrap();
    assert!(dirty_change > 0.0);
    let shown = v["dirty_per_s"].as_f64().unwrap() * top["interval_seconds"].as_f64().unwrap();
    assert!((shown - dirty_change).abs() < 1.0, "{shown} {dirty_change}");
    for k in [
        "dirty_bytes",
        "clean_bytes",
        "unused_bytes",
        "metadata_bytes",
    ] {
        assert_eq!(top["cache"][k], after["cache"][k], "{k}");
    }
    // Written back, nothing is dirty: `status` says idle, and top shows no rate for it.
    f.tc_admin(&["set", "data", "writeback_running", "1"]);
    let t = Instant::now();
    while status(&f)["devices"][0]["writeback_state"] != "idle" {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "writeback never ends"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = stdout(&f.tc_admin(&["top", "--once", "--interval", "0.2"]));
    println!("{text}");
    assert!(text.contains(" wb idle  cached "), "{text}");
    for l in text.lines() {
        assert!(l.chars().count() <= 78 && !l.ends_with('~'), "{l}");
    }
    f.stop();
}

#[test]
fn a_metrics_port_in_use_stops_the_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let f = Fixture::new(16, 16, false);
    let o = output_within(
        f.serve_cmd().args(["--metrics", &port]),
        Duration::from_secs(30),
    )
    .expect("serve exits");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("metrics on 127.0.0.1:{port}")) && err.contains("in use"),
        "{err}"
    );
    // A bad address is refused before any device is opened.
    let o = output_within(
        f.serve_cmd().args(["--metrics", "localhost"]),
        Duration::from_secs(30),
    )
    .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("metrics address 'localhost'"));
}

/// `promtool check metrics` on `text`: its complaints, if any (it reads the classic format).
fn promtool(text: &str) -> Result<(), String> {
    let mut c = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running promtool");
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if o.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("promtool: {}: {said}", o.status))
    }
}

/// A Python with prometheus_client's OpenMetrics parser (Debian: python3-prometheus-client),
/// if there is one; its absence fails under CI=true (.ci/run installs it) and is a printed skip
/// otherwise.
fn python_with_openmetrics_parser() -> Option<&'static str> {
    let found = ["python3", "/usr/bin/python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import prometheus_client.openmetrics.parser"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        test_support::unavailable("python3 with prometheus_client (python3-prometheus-client)");
    }
    found
}

/// Python prometheus_client's strict OpenMetrics parser on `text`.
fn python_openmetrics(py: &str, text: &str) -> Result<(), String> {
    let mut c = Command::new(py)
        .args([
            "-c",
            "import sys\n\
             from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
             print(len(list(text_string_to_metric_families(sys.stdin.read()))))",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

#[test]
fn each_format_passes_its_readers_checks() {
    if !have("promtool") {
        return;
    }
    let mut f = Fixture::new(16, 16, false);
    f.start_with(&["--metrics", "127.0.0.1:0"]);
    let addr = metrics_address(&f);
    let limit = Duration::from_secs(10);
    // Scrapers that do not ask for OpenMetrics get the classic format, which promtool reads
    // and lints.
    let mut classic = String::new();
    for accept in [
        None,
        Some("*/*"),
        Some("text/plain;version=0.0.4"),
        Some("application/openmetrics-text;q=0.3,text/plain"),
    ] {
        let (content_type, body) = get_metrics(&addr, accept, limit);
        assert_eq!(content_type, CLASSIC, "Accept: {accept:?}");
        promtool(&body).unwrap_or_else(|e| panic!("Accept: {accept:?}: {e}"));
        assert!(body.contains("# TYPE tiercache_volume_info gauge\n"));
        assert!(body.contains("tiercache_volume_info{volume=\"data\","));
        assert!(body.contains("# TYPE tiercache_volume_requests_total counter\n"));
        assert!(!body.contains("# EOF") && !body.contains("# UNIT"));
        classic = body;
    }
    // promtool does find fault: a gauge declared a counter lacks `_total`.
    let broken = classic.replace(
        "# TYPE tiercache_uptime_seconds gauge",
        "# TYPE tiercache_uptime_seconds counter",
    );
    assert_ne!(broken, classic);
    assert!(promtool(&broken).is_err());

    // Prometheus' own request gets OpenMetrics: the strict parser here, and Python's.
    let om = scrape(&addr);
    let samples = parse(&om);
    assert_eq!(
        value(&samples, "tiercache_volume_info", &[("volume", "data")]),
        1.0
    );
    if let Some(py) = python_with_openmetrics_parser() {
        python_openmetrics(py, &om).unwrap();
        // It finds fault too: OpenMetrics ends in `# EOF`.
        assert!(python_openmetrics(py, om.strip_suffix("# EOF\n").unwrap()).is_err());
    }
    f.stop();
}

/// Slow HTTP clients until `stop`: `target` connections to `addr`, each sending a request
/// head one byte a second and never finishing it; one the server closes is opened again at
/// its next byte. `rounds` counts the passes over all of them.
fn trickle(addr: &str, target: &AtomicUsize, rounds: &AtomicUsize, stop: &AtomicBool) {
    let head = b"GET /metrics HTTP/1.1\r\nHost: slow\r\nX-Slow: ";
    let sa: SocketAddr = addr.parse().unwrap();
    let mut conns: Vec<Option<(TcpStream, usize)>> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        conns.resize_with(target.load(Ordering::SeqCst), || None);
        for slot in conns.iter_mut() {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            if slot.is_none() {
                *slot = TcpStream::connect_timeout(&sa, Duration::from_secs(1))
                    .ok()
                    .map(|s| (s, 0));
            }
            if let Some((s, sent)) = slot {
                let byte = head.get(*sent).copied().unwrap_or(b'a');
                if s.write_all(&[byte]).is_ok() {
                    *sent += 1;
                } else {
                    *slot = None;
                }
            }
        }
        rounds.fetch_add(1, Ordering::SeqCst);
        for _ in 0..10 {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Sets the flag when dropped, on a panic too (the slow clients' thread must end for the
/// test to end).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn scrapes_are_answered_while_slow_clients_trickle() {
    let mut f = Fixture::new(16, 16, false);
    f.start_with(&["--metrics", "127.0.0.1:0"]);
    let addr = metrics_address(&f);
    let target = AtomicUsize::new(0);
    let rounds = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let _stop = SetOnDrop(&stop);
        s.spawn(|| trickle(&addr, &target, &rounds, &stop));
        for n in [8, 500] {
            target.store(n, Ordering::SeqCst);
            // Two whole passes: every slow client connected and trickling for a second or
            // more (the wait is a hang guard; the scrapes are what is tested).
            let r0 = rounds.load(Ordering::SeqCst);
            let t = Instant::now();
            while rounds.load(Ordering::SeqCst) < r0 + 3 && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(50));
            }
            for _ in 0..3 {
                // Prometheus' default scrape timeout is 10 s: a generous bound for a reply
                // that takes milliseconds.
                let t = Instant::now();
                let samples = parse(&scrape(&addr));
                eprintln!("{n} slow clients: scraped in {:?}", t.elapsed());
                assert!(value(&samples, "tiercache_uptime_seconds", &[]) > 0.0);
                assert_eq!(
                    value(&samples, "tiercache_volume_info", &[("volume", "data")]),
                    1.0
                );
                let (content_type, body) = get_metrics(&addr, None, Duration::from_secs(10));
                assert_eq!(content_type, CLASSIC);
                assert!(body.contains("\ntiercache_uptime_seconds "), "{body}");
            }
        }
    });
    f.stop();
}

/// `--data-path`: on `uring` the hits of a real client are read, and its writes the cache
/// absorbs written, by the io_uring event loops (`tiercache_direct_reads_total`,
/// `tiercache_direct_writes_total`; data verified by qemu-io's pattern check); on `threads`
/// none are and no event loop runs; a wrong value is refused before anything opens.
/// Under CI=true a kernel without io_uring fails this test (`uring` does not start).
#[test]
fn hits_are_read_by_the_data_path_asked_for() {
    if !have("qemu-io") {
        return;
    }
    let f = Fixture::new(64, 32, true);
    let err = refused_within(
        f.serve_cmd().args(["--data-path", "fast"]),
        Duration::from_secs(30),
    );
    assert!(err.contains("unknown data path \"fast\""), "{err}");
    drop(f);
    for path in ["uring", "threads"] {
        let mut f = Fixture::new(64, 32, true);
        f.start_with(&[
            "--metrics",
            "127.0.0.1:0",
            "--congested-read-threshold-us",
            "0",
            "--data-path",
            path,
        ]);
        let addr = metrics_address(&f);
        qemu_io(
            &f,
            &[
                "write -P 0x5a 0 1M",
                "write -P 0x5b 1M 64k",
                "write -P 0x5c 8M 64k",
                "read -P 0x5a 0 1M",
                "read -P 0x5a 256k 4k",
                "read -P 0x5a 512k 64k",
                "read -P 0x5b 1M 64k",
            ],
        );
        let s = parse(&scrape(&addr));
        let sum = |name: &str| -> f64 {
            s.iter()
                .filter(|(n, _, _)| n == name)
                .map(|(_, _, v)| v)
                .sum()
        };
        let (direct, writes, loops) = (
            sum("tiercache_direct_reads_total"),
            sum("tiercache_direct_writes_total"),
            sum("tiercache_io_uring_event_loops"),
        );
        if path == "uring" {
            assert!(direct >= 4.0, "{path}: {direct} direct reads");
            // The first write marks the device dirty (a header write: a worker's job), the
            // next two are absorbed on the ring (their FUA flush — qemu-io's default — on a
            // worker).
            assert!(writes >= 2.0, "{path}: {writes} direct writes");
            assert!(loops >= 1.0, "{path}: {loops} event loops");
        } else {
            assert_eq!((direct, writes, loops), (0.0, 0.0, 0.0), "{path}");
        }
        f.stop();
    }
}

/// Reads and writes around the cache on a remote backing device (nbdkit serving the
/// fixture's backing file) are carried on the io_uring data path's lent connections:
/// `direct_reads` and `direct_writes` count them and fio's verify finds its data; a remote
/// device that stops answering fails such a read within its timeout, and one that answers
/// again serves the next.
/// `serve` with the nbdkit export of `Fixture::nbdkit_on_backing` as its backing device (URI query
/// `query`) and metrics on a free port, in `cache_mode none`; its log (warnings, and the NBD
/// client's news) goes to `serve.log`.
fn serve_on_nbdkit(f: &mut Fixture, query: &str) {
    let remote = format!(
        "nbd+unix:///?socket={}&{query}",
        f.path("kit.sock").display()
    );
    let mut cmd = tc();
    cmd.arg("serve")
        .arg("--cache")
        .arg(f.path("fast.img"))
        .args(["--backing", &remote, "--socket"])
        .arg(f.socket())
        .args(["--metrics", "127.0.0.1:0"])
        .env("RUST_LOG", "warn,blockdev::nbd=info")
        .stderr(std::fs::File::create(f.path("serve.log")).unwrap());
    f.start_cmd(cmd);
    f.tc_admin(&["set", "data", "cache_mode", "none"]);
}

/// `serve` in front of a fresh `nbdkit file` (see [`serve_on_nbdkit`]), and that nbdkit.
fn served_on_nbdkit(query: &str) -> (Fixture, Child) {
    let mut f = Fixture::new(64, 32, false);
    let kit = f.nbdkit_on_backing(&[], &[]);
    serve_on_nbdkit(&mut f, query);
    (f, kit)
}

/// `tiercache_device_nbd_connections` of the one backing device: shared up, shared down,
/// spare idle, spare lent.
fn remote_links(s: &[(String, Labels, f64)]) -> [f64; 4] {
    ["shared_up", "shared_down", "spare_idle", "spare_lent"].map(|state| {
        value(
            s,
            "tiercache_device_nbd_connections",
            &[("role", "backing"), ("state", state)],
        )
    })
}

/// `status --json`'s `backing_connections` of the one device (shared, shared up, spare
/// open, spare lent), checked against what `status` prints.
fn status_links(f: &Fixture) -> [u64; 4] {
    let s: Value = serde_json::from_slice(&f.tc_admin(&["status", "--json"]).stdout).unwrap();
    let c = &s["devices"][0]["backing_connections"];
    let links = ["shared", "shared_up", "spare_open", "spare_lent"]
        .map(|k| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}")));
    let text = stdout(&f.tc_admin(&["status"]));
    let line = format!(
        "backing device over NBD: {} of {} connection(s) up; {} spare connection(s) open for \
         requests around the cache, {} lent now",
        links[1], links[0], links[2], links[3]
    );
    assert!(text.contains(&line), "no '{line}' in:\n{text}");
    links
}

/// What the server logged of its remote device's connections.
fn connections_logged(f: &Fixture) -> String {
    let log = std::fs::read_to_string(f.path("serve.log")).unwrap();
    log.lines()
        .filter(|l| l.contains("connection(s)"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `spare-connections=0` turns lending off: the server says so once, and every request
/// around the cache takes the shared connections (none is counted as carried on the ring).
#[test]
fn spare_connections_zero_carries_requests_around_the_cache_on_the_shared_connections() {
    if !(have("nbdkit") && have("qemu-io")) {
        return;
    }
    let (mut f, mut kit) = served_on_nbdkit("spare-connections=0");
    let addr = metrics_address(&f);
    let logged = connections_logged(&f);
    assert!(
        logged.contains("4 connection(s); no spare connections for requests around the cache (spare-connections=0)"),
        "{logged}"
    );
    qemu_io(&f, &["write -P 0x5a 1M 256k", "read -P 0x5a 1M 256k"]);
    let s = parse(&scrape(&addr));
    for name in [
        "tiercache_direct_reads_total",
        "tiercache_direct_writes_total",
    ] {
        assert_eq!(value(&s, name, &[]), 0.0, "{name}");
    }
    assert_eq!(remote_links(&s), [4.0, 0.0, 0.0, 0.0]);
    assert_eq!(status_links(&f), [4, 4, 0, 0]);
    f.stop();
    let _ = kit.kill();
    let _ = kit.wait();
}

#[test]
fn requests_around_the_cache_on_a_remote_device_are_carried_on_the_ring() {
    if !(have("nbdkit") && have("fio") && have("qemu-io")) {
        return;
    }
    let (mut f, mut kit) = served_on_nbdkit("timeout=2");
    let addr = metrics_address(&f);
    let logged = connections_logged(&f);
    assert!(
        logged.contains("4 connection(s); requests around the cache go on up to 8 more"),
        "{logged}"
    );
    let o = run(Command::new("fio").args([
        "--name=around",
        "--ioengine=nbd",
        &format!("--uri={}", f.uri()),
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--iodepth=4",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
    ]));
    assert!(stdout(&o).contains("err= 0"), "fio: {}", stdout(&o));
    let s = parse(&scrape(&addr));
    let (reads, writes) = (
        value(&s, "tiercache_direct_reads_total", &[]),
        value(&s, "tiercache_direct_writes_total", &[]),
    );
    println!("direct reads {reads}, direct writes {writes}, of 4096 each");
    // The spare connections fio's requests were lent are open and idle again; the shared
    // ones are all up.
    let [up, down, idle, lent] = remote_links(&s);
    assert!(
        up == 4.0 && down == 0.0 && (1.0..=8.0).contains(&idle) && lent == 0.0,
        "nbd connections: {up} up, {down} down, {idle} spare idle, {lent} spare lent"
    );
    // `status` says the same.
    let [shared, shared_up, open, lent_now] = status_links(&f);
    assert!(
        shared == 4 && shared_up == 4 && (1..=8).contains(&open) && lent_now == 0,
        "status: {shared_up} of {shared} up, {open} spare open, {lent_now} lent"
    );
    // The first requests take the shared connections while spare ones are opened.
    assert!(
        reads > 1024.0 && writes > 1024.0,
        "direct reads {reads} and writes {writes} of 4096 each"
    );
    // A remote device that stops answering: the read fails within its timeout (2 s), at
    // most a few times over, and nothing waits for it afterwards.
    run(Command::new("kill").args(["-STOP", &kit.id().to_string()]));
    let o = output_within(
        &mut qemu_io_cmd(&f, &["read 8M 4k"]),
        Duration::from_secs(60),
    )
    .expect("a read of a hung remote device did not end");
    let out = stdout(&o) + &String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() || out.contains("failed"),
        "a read of a hung remote device succeeded: {out}"
    );
    run(Command::new("kill").args(["-CONT", &kit.id().to_string()]));
    qemu_io(&f, &["read 8M 4k"]);
    f.stop();
    let _ = kit.kill();
    let _ = kit.wait();
}

/// A remote server that shuts down gracefully (nbdkit on SIGTERM: it answers NBD_ESHUTDOWN
/// and waits for its clients to leave) is left, so it exits, and the one started in its place
/// serves: reads around the cache across the change succeed, and writes after it. Before,
/// every request failed for as long as the old server waited, which was for ever, and the
/// clients were told that tiercache itself was shutting down.
#[test]
fn a_remote_server_that_shuts_down_is_left_and_its_successor_serves() {
    if !(have("nbdkit") && have("qemu-io")) {
        return;
    }
    let (mut f, mut kit) = served_on_nbdkit("timeout=20");
    qemu_io(&f, &["write -P 0x41 0 256k", "flush"]);
    // SAFETY: kill(2) on the pid of our own child, not waited for yet.
    assert_eq!(unsafe { libc::kill(kit.id() as i32, libc::SIGTERM) }, 0);
    let mut old = kit;
    let _ = std::fs::remove_file(f.path("kit.sock"));
    kit = f.nbdkit_on_backing(&[], &[]);
    // Reads until every connection to the old server has learnt of its shutdown (nbdkit
    // answers normally until its signal handler ran) and it has exited; each one succeeds:
    // nothing was unflushed, so a read the old server refused is sent again.
    let t = Instant::now();
    while old.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the old nbdkit did not exit"
        );
        qemu_io(&f, &["read -P 0x41 0 256k"]);
    }
    qemu_io(
        &f,
        &[
            "write -P 0x42 2M 64k",
            "flush",
            "read -P 0x42 2M 64k",
            "read -P 0x41 0 256k",
        ],
    );
    let logged = std::fs::read_to_string(f.path("serve.log")).unwrap();
    assert!(logged.contains("NBD_ESHUTDOWN"), "{logged}");
    f.stop();
    let _ = kit.kill();
    let _ = kit.wait();
}

/// A read around the cache in flight on a lent connection when the remote server is killed
/// and started again is sent again on the shared connections (nothing was at stake) and
/// succeeds, as a read in flight on a shared connection does.
#[test]
fn a_remote_read_on_the_ring_survives_a_server_restart() {
    if !(have("nbdkit") && have("qemu-io")) {
        return;
    }
    let mut f = Fixture::new(64, 32, false);
    let delayed = |f: &Fixture| f.nbdkit_on_backing(&["--filter=delay"], &["rdelay=1"]);
    let mut kit = delayed(&f);
    serve_on_nbdkit(&mut f, "timeout=20");
    let addr = metrics_address(&f);
    // The first read opens a spare connection; the next ones are lent it.
    let direct = || value(&parse(&scrape(&addr)), "tiercache_direct_reads_total", &[]);
    let t = Instant::now();
    while direct() < 1.0 {
        assert!(t.elapsed() < Duration::from_secs(30), "no read was lent");
        qemu_io(&f, &["read 0 4k"]);
    }
    let reader = qemu_io_cmd(&f, &["read 1M 4k"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kit.kill().unwrap();
    kit.wait().unwrap();
    let mut kit = delayed(&f);
    let o = reader.wait_with_output().unwrap();
    assert!(
        o.status.success() && stdout(&o).contains("read 4096/4096"),
        "a read in flight across the restart failed: {}",
        stdout(&o)
    );
    f.stop();
    let _ = kit.kill();
    let _ = kit.wait();
}
