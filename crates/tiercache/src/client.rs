//! Client side of the admin commands: `status`, `stats`, `get`, `set`, `detach`, `attach`,
//! `resize`, `readmit`, `degrade`, `stop`. Each sends one request to the running server's
//! admin socket and prints the answer: text for people, or with `--json` the server's reply
//! as one JSON document on stdout (progress lines, if any, go to stderr either way).
//!
//! Which admin socket: `--admin PATH`, else the `admin` (or `socket` + ".admin") of the
//! `serve` configuration named by `--config`, else `$TIERCACHE_ADMIN`, else that of
//! `/etc/tiercache/tiercache.toml` if the file exists (the systemd unit's), else
//! `/tmp/tiercache.sock.admin` (`serve`'s default).
//!
//! Invariant: printing only; every decision is the server's (so the CLI and the admin API
//! cannot disagree). The one exception is waiting: `stop` returns once the server process has
//! exited (it holds the admin connection open until then), unless told not to wait.

use crate::admin::{exchange, request};
use crate::units::{human, iso_utc, span};
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Environment variable naming the admin socket.
pub const ADMIN_ENV: &str = "TIERCACHE_ADMIN";
/// The configuration the systemd unit in contrib/systemd serves with.
pub const SYSTEM_CONFIG: &str = "/etc/tiercache/tiercache.toml";

/// Where to send admin requests, and how to print the answers.
pub struct Admin {
    pub socket: PathBuf,
    pub json: bool,
}

/// Finds the admin socket (see the module comment for the order).
pub fn admin_socket(
    admin: Option<&Path>,
    config: Option<&Path>,
    env: Option<OsString>,
    system_config: &Path,
) -> Result<PathBuf> {
    if let Some(a) = admin {
        return Ok(a.to_path_buf());
    }
    if let Some(c) = config {
        return Ok(crate::serve::ServeConfig::from_file(c)?.admin());
    }
    if let Some(e) = env.filter(|e| !e.is_empty()) {
        return Ok(PathBuf::from(e));
    }
    if system_config.exists() {
        return Ok(crate::serve::ServeConfig::from_file(system_config)?.admin());
    }
    Ok(crate::admin::admin_for(Path::new(
        crate::serve::DEFAULT_SOCKET,
    )))
}

fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("?")
}

fn print_json(v: &Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// A size as `set` accepts it back, exact: "4M", "512k", "1000".
fn size_knob(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "k")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A knob's value from a `status` device entry, as `set` accepts it back.
fn knob_text(d: &Value, knob: &str) -> String {
    match (knob, &d[knob]) {
        (_, Value::Null) => "-".into(),
        ("sequential_cutoff", v) => v.as_u64().map_or_else(|| v.to_string(), size_knob),
        (_, Value::Bool(b)) => if *b { "on" } else { "off" }.into(),
        (_, Value::String(s)) => s.clone(),
        (_, v) => v.to_string(),
    }
}

/// Knobs that the device table does not already show (mode) or name (label).
const KNOBS_BESIDE_TABLE: [&str; 4] = [
    "sequential_cutoff",
    "writeback_percent",
    "writeback_delay",
    "writeback_running",
];

/// Writeback as an operator reads it: paused, failing, idle, delayed, or the rate in MB/s.
fn writeback_text(d: &Value) -> String {
    match text(d, "writeback_state") {
        "running" => format!("{:.1} MB/s", num(d, "writeback_bytes_per_sec") as f64 / 1e6),
        s => s.to_string(),
    }
}

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        part as f64 * 100.0 / total as f64
    }
}

/// The cache device's space: four parts that add up to its size, then bcache's in_use
/// (a bucket count, which is what made "in_use 96 %" beside "0 B dirty, 0 B clean" puzzling).
fn print_occupancy(c: &Value) {
    let total = num(c, "total_bytes");
    println!("cache set {}: {}", text(c, "set_uuid"), human(total));
    for (what, k) in [
        ("dirty", "dirty_bytes"),
        ("clean", "clean_bytes"),
        ("unused", "unused_bytes"),
        ("metadata", "metadata_bytes"),
    ] {
        let v = num(c, k);
        println!("  {what:<9} {:>10} {:>6.1} %", human(v), pct(v, total));
    }
    println!(
        "  in_use {} % of buckets (bcache's figure: buckets not on the free list, also those \
         partly\n  filled or holding stale data, whose free and stale space counts as unused)",
        num(c, "in_use")
    );
    println!(
        "  admission {}, replacement {}",
        text(c, "admission"),
        text(c, "replacement")
    );
}

pub fn status(a: &Admin) -> Result<()> {
    let r = request(&a.socket, &json!({"cmd": "status"}), &mut |_| {})?;
    if a.json {
        return print_json(&r);
    }
    if let Some(w) = r.get("without_cache") {
        return status_without_cache(w, &r);
    }
    print_occupancy(&r["cache"]);
    print_health(&r["health"]);
    let none = |k: &str| r[k].as_array().is_none_or(Vec::is_empty);
    if none("devices") && none("missing") {
        println!(
            "no volumes: no backing device is attached to this cache set (`tiercache attach \
             DEVICE` adds one formatted by `tiercache make --backing DEVICE`)"
        );
    } else {
        println!(
            "{:<20} {:>10} {:<13} {:<10} {:>10} {:>10} {:>6} {:>10}",
            "DEVICE", "SIZE", "MODE", "STATE", "DIRTY", "CACHED", "HIT%", "WRITEBACK"
        );
    }
    for d in r["devices"].as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>10} {:<13} {:<10} {:>10} {:>10} {:>6} {:>10}",
            text(d, "name"),
            human(num(d, "size_bytes")),
            text(d, "cache_mode"),
            text(d, "state"),
            human(num(d, "dirty_bytes")),
            human(num(d, "cached_bytes")),
            num(&d["stats_total"], "cache_hit_ratio"),
            writeback_text(d)
        );
        let knobs: Vec<String> = KNOBS_BESIDE_TABLE
            .iter()
            .map(|k| format!("{k} {}", knob_text(d, k)))
            .collect();
        println!("  {}", knobs.join(", "));
        if let Some(line) = connections_text(&d["backing_connections"]) {
            println!("  {line}");
        }
        if let Some(e) = d.get("writeback_error").filter(|e| !e.is_null()) {
            println!(
                "  writeback failing since {} ({} passes): {}",
                iso_utc(num(e, "since_unix")),
                num(e, "failures"),
                text(e, "error")
            );
        }
    }
    for m in r["missing"].as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>10} {:<13} {:<10} {:>10} {:>10}",
            text(m, "uuid"),
            "?",
            "-",
            "MISSING",
            human(num(m, "dirty_bytes")),
            human(num(m, "cached_bytes")),
        );
        println!(
            "  known to this cache set but not attached{}; `tiercache attach DEVICE` brings it back",
            if num(m, "dirty_bytes") > 0 {
                ": its newest data (the dirty bytes) is only in this cache"
            } else {
                ""
            }
        );
    }
    for p in r["pending"].as_array().into_iter().flatten() {
        println!(
            "backing device {} has not answered since {}; retried until it does: {}",
            text(p, "backing"),
            iso_utc(num(p, "since_unix")),
            text(p, "error")
        );
    }
    Ok(())
}

/// A remote backing device's connections (`status --json`'s `backing_connections`), or
/// None for a local device.
fn connections_text(c: &Value) -> Option<String> {
    if c.is_null() {
        return None;
    }
    let (shared, up) = (num(c, "shared"), num(c, "shared_up"));
    let down = match shared.saturating_sub(up) {
        0 => String::new(),
        n => format!(" ({n} being reconnected)"),
    };
    Some(format!(
        "backing device over NBD: {up} of {shared} connection(s) up{down}; {} spare \
         connection(s) open for requests around the cache, {} lent now",
        num(c, "spare_open"),
        num(c, "spare_lent")
    ))
}

/// The cache device's health, one line when it is ok, two when the set is degraded.
fn print_health(h: &Value) {
    let latency = |k: &str| match num(h, k) {
        0 => "-".to_string(),
        us => format!("{us} us"),
    };
    let counts = format!(
        "cache device errors {} (decayed {:.1}, limit {}), latency read {} / write {}",
        num(h, "errors_total"),
        h.get("error_count").and_then(Value::as_f64).unwrap_or(0.0),
        num(h, "io_error_limit"),
        latency("read_latency_us"),
        latency("write_latency_us")
    );
    if text(h, "state") != "degraded" {
        println!("health: {}, {counts}", text(h, "state"));
        return;
    }
    let since = num(h, "since_unix");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(since, |d| d.as_secs());
    println!(
        "health: DEGRADED since {} ({} ago): {}",
        iso_utc(since),
        span(now.saturating_sub(since)),
        text(h, "reason")
    );
    println!(
        "  every volume is served from its backing device; {counts}; \
         `tiercache readmit` once the cache device is repaired"
    );
}

/// `status` of a server running without its cache device.
fn status_without_cache(w: &Value, r: &Value) -> Result<()> {
    println!(
        "cache device {}: NOT IN USE ({})",
        text(w, "cache"),
        text(w, "reason")
    );
    println!("every volume is served without cache, directly from its backing device");
    println!(
        "{:<20} {:>10} {:<13} {:<14} {:<10} {:<6} PATH",
        "DEVICE", "SIZE", "MODE", "STATE", "HEADER", "STALE"
    );
    for d in r["devices"].as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>10} {:<13} {:<14} {:<10} {:<6} {}",
            text(d, "name"),
            human(num(d, "size_bytes")),
            text(d, "cache_mode"),
            text(d, "state"),
            text(d, "backing_state"),
            text(d, "stale_copies"),
            text(d, "path")
        );
    }
    Ok(())
}

/// `tiercache get DEVICE [KNOB]`: the knobs of one device, from `status`.
pub fn get(a: &Admin, device: &str, knob: Option<&str>) -> Result<()> {
    let r = request(&a.socket, &json!({"cmd": "status"}), &mut |_| {})?;
    let devices = r["devices"].as_array().cloned().unwrap_or_default();
    let d = devices
        .iter()
        .find(|d| text(d, "name") == device || text(d, "uuid") == device)
        .ok_or_else(|| {
            let names: Vec<&str> = devices.iter().map(|d| text(d, "name")).collect();
            anyhow!("no device named '{device}' (devices: {})", names.join(", "))
        })?;
    let names = engine::Knob::NAMES;
    if let Some(k) = knob {
        if !names.contains(&k) {
            bail!("unknown knob '{k}' (knobs: {})", names.join(", "));
        }
        if a.json {
            return print_json(&json!({"device": d["name"], "knob": k, "value": d[k]}));
        }
        println!("{}", knob_text(d, k));
        return Ok(());
    }
    if a.json {
        let knobs: serde_json::Map<String, Value> = names
            .iter()
            .map(|k| (k.to_string(), d[*k].clone()))
            .collect();
        return print_json(&json!({"device": d["name"], "uuid": d["uuid"], "knobs": knobs}));
    }
    for k in names {
        println!("{k:<18} {}", knob_text(d, k));
    }
    Ok(())
}

/// A counter of `stats` for people: sizes in binary units, the hit ratio in percent, counts
/// as they are; with `bytes`, every value raw.
fn stat_text(key: &str, v: u64, bytes: bool) -> String {
    if bytes {
        v.to_string()
    } else if key.ends_with("_bytes") || key.starts_with("bypassed") {
        human(v)
    } else if key == "cache_hit_ratio" {
        format!("{v} %")
    } else {
        v.to_string()
    }
}

pub fn stats(a: &Admin, bytes: bool) -> Result<()> {
    let r = request(&a.socket, &json!({"cmd": "stats"}), &mut |_| {})?;
    if a.json {
        return print_json(&r);
    }
    for d in r["devices"].as_array().into_iter().flatten() {
        println!("{} ({}):", text(d, "name"), text(d, "uuid"));
        let windows = [
            "stats_total",
            "stats_five_minute",
            "stats_hour",
            "stats_day",
        ];
        print!("  {:<24}", "");
        for w in windows {
            print!(" {:>16}", w.trim_start_matches("stats_"));
        }
        println!();
        let keys: Vec<String> = d["stats_total"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        for k in keys {
            print!("  {k:<24}");
            for w in windows {
                print!(" {:>16}", stat_text(&k, num(&d[w], &k), bytes));
            }
            println!();
        }
    }
    Ok(())
}

pub fn set(a: &Admin, device: &str, knob: &str, value: &str) -> Result<()> {
    let r = request(
        &a.socket,
        &json!({"cmd": "set", "device": device, "knob": knob, "value": value}),
        &mut |_| {},
    )?;
    if a.json {
        return print_json(&r);
    }
    let applied = json!({ knob: r["value"] });
    println!(
        "{}: {knob} = {}",
        text(&r, "device"),
        knob_text(&applied, knob)
    );
    Ok(())
}

pub fn detach(a: &Admin, device: &str) -> Result<()> {
    let r = request(
        &a.socket,
        &json!({"cmd": "detach", "device": device}),
        &mut |p| {
            let (rem, total) = (num(p, "dirty_bytes"), num(p, "total_bytes"));
            let pct = ((total - rem) * 100).checked_div(total).unwrap_or(100);
            eprintln!(
                "writing back: {} of {} dirty data left ({pct}% done)",
                human(rem),
                human(total)
            );
        },
    )?;
    if a.json {
        return print_json(&r);
    }
    println!("{device}: detached (all dirty data written back)");
    Ok(())
}

pub fn clear_stats(a: &Admin, device: &str) -> Result<()> {
    let r = request(
        &a.socket,
        &json!({"cmd": "clear_stats", "device": device}),
        &mut |_| {},
    )?;
    if a.json {
        return print_json(&r);
    }
    println!("{}: statistics cleared", text(&r, "device"));
    Ok(())
}

pub fn attach(a: &Admin, path: &Path, take_over: bool, discard_dirty: bool) -> Result<()> {
    // The server opens the path from its own working directory (/ under systemd): a relative
    // path is made absolute here, where the operator typed it. An NBD URI is sent as it is.
    let spec = path.to_string_lossy();
    let path = if path.is_relative() && !blockdev::is_nbd_uri(&spec) {
        std::env::current_dir()?.join(path)
    } else {
        path.to_path_buf()
    };
    let r = request(
        &a.socket,
        &json!({
            "cmd": "attach",
            "path": path.to_string_lossy(),
            "take_over": take_over,
            "discard_dirty": discard_dirty,
        }),
        &mut |_| {},
    )?;
    if a.json {
        return print_json(&r);
    }
    println!(
        "{}: attached, exported as '{}'",
        path.display(),
        text(&r, "name")
    );
    Ok(())
}

pub fn resize(a: &Admin, device: &str) -> Result<()> {
    let r = request(
        &a.socket,
        &json!({"cmd": "resize", "device": device}),
        &mut |_| {},
    )?;
    if a.json {
        return print_json(&r);
    }
    let (old, new) = (num(&r, "old_size_bytes"), num(&r, "size_bytes"));
    if old == new {
        println!("{}: size unchanged ({})", text(&r, "device"), human(new));
    } else {
        println!(
            "{}: {} -> {} (clients that connect from now on see the new size)",
            text(&r, "device"),
            human(old),
            human(new)
        );
    }
    Ok(())
}

pub fn readmit(a: &Admin) -> Result<()> {
    let r = request(&a.socket, &json!({"cmd": "readmit"}), &mut |_| {})?;
    if a.json {
        return print_json(&r);
    }
    println!(
        "cache device re-admitted: volumes are served through the cache again \
         (its clean copies were dropped as stale)"
    );
    Ok(())
}

pub fn degrade(a: &Admin, reason: &str) -> Result<()> {
    let r = request(
        &a.socket,
        &json!({"cmd": "degrade", "reason": reason}),
        &mut |_| {},
    )?;
    if a.json {
        return print_json(&r);
    }
    let h = &r["health"];
    if r["already_degraded"] == json!(true) {
        println!(
            "the cache set was already degraded (since {}): {}",
            iso_utc(num(h, "since_unix")),
            text(h, "reason")
        );
    } else {
        println!(
            "cache set degraded: every volume is served from its backing device; \
             `tiercache readmit` puts the cache device back in service"
        );
    }
    Ok(())
}

/// How long a server that has closed its admin connection may take to disappear as a process.
const EXIT_AFTER_CLOSE_MAX: Duration = Duration::from_secs(10);

/// A descriptor that becomes readable once process `pid` has exited as a whole (every thread,
/// so its parent can reap it); `None` if it is already gone. `/proc/PID/stat` is no substitute:
/// it says `Z` as soon as the main thread is done, while other threads may still be tearing down.
/// Opened before the process is told to go, so its pid cannot be reused meanwhile.
fn watch_process(pid: libc::pid_t) -> Result<Option<std::os::fd::OwnedFd>> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ESRCH) {
            return Ok(None);
        }
        bail!("cannot watch the server process {pid}: {e}");
    }
    let fd = i32::try_from(fd)?;
    // SAFETY: a descriptor pidfd_open just returned, owned here alone.
    Ok(Some(unsafe {
        <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
    }))
}

/// Whether process `pid`'s main thread has exited (`/proc/PID/stat` says `Z`, though other
/// threads may remain).
fn main_thread_exited(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which is in parentheses and may hold spaces.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// Waits for a [`watch_process`] descriptor to say the process has exited, for at most `max`:
/// true once it has; false when its main thread has been gone for [`HELD_AFTER`] while the
/// process is not (a thread held by the kernel in a device I/O); an error when it still runs.
fn wait_exited(pidfd: &std::os::fd::OwnedFd, pid: libc::pid_t, max: Duration) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(pidfd),
        events: libc::POLLIN,
        revents: 0,
    };
    let started = Instant::now();
    let mut main_gone_since = None;
    loop {
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&raw mut pfd, 1, 100) } {
            n if n > 0 => return Ok(true),
            0 => {}
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => bail!(
                "waiting for the server process {pid}: {}",
                std::io::Error::last_os_error()
            ),
        }
        if main_thread_exited(pid) {
            let since = *main_gone_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= HELD_AFTER {
                return Ok(false);
            }
        }
        if started.elapsed() >= max {
            bail!("the server closed its admin socket, but its process {pid} still runs");
        }
    }
}

/// How long a process whose main thread has exited may take to be gone before a thread of it
/// counts as held by the kernel (the other threads end within milliseconds otherwise).
const HELD_AFTER: Duration = Duration::from_secs(2);

pub fn stop(a: &Admin, no_wait: bool) -> Result<()> {
    let (mut r, mut conn) = exchange(&a.socket, &json!({"cmd": "stop"}), &mut |_| {})?;
    let pid = r["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
    if !no_wait {
        // The server holds this connection until its process exits: end-of-file (or a reset)
        // means it is on its way out. Then wait for the process itself, by the pid the kernel
        // gives for the socket's peer.
        // The pid as this process's pid namespace numbers it (the pid a server reports of
        // itself is wrong from inside another namespace).
        let peer = server::peer_cred(conn.get_ref())
            .ok()
            .map(|c| c.pid)
            .filter(|&p| p > 0);
        let pidfd = match peer {
            Some(p) => watch_process(p)?,
            None => None,
        };
        let mut sink = [0u8; 256];
        while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
        if let (Some(p), Some(fd)) = (peer, pidfd) {
            if !wait_exited(&fd, p, EXIT_AFTER_CLOSE_MAX)? {
                // Done but not gone: its main thread has exited (the leader is a zombie) while
                // the kernel holds another thread in an I/O of a hung device, and with it the
                // process and its device locks, until the device answers.
                eprintln!(
                    "tiercache: the server has shut down, but the kernel still holds its \
                     process {p} in an I/O of a hung device (its device locks go when the \
                     device answers or is removed)"
                );
                r["held_by_kernel"] = json!(true);
            }
        }
    }
    r["stopped"] = json!(!no_wait);
    if a.json {
        return print_json(&r);
    }
    let who = pid.map_or_else(String::new, |p| format!(" (pid {p})"));
    if no_wait {
        println!("server{who} is stopping");
    } else {
        println!("server{who} stopped");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_socket_comes_from_flag_config_env_system_config_default_in_that_order() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("c.toml");
        std::fs::write(&cfg, "cache = \"/x\"\nsocket = \"/run/t/n.sock\"\n").unwrap();
        let sys = dir.path().join("system.toml");
        std::fs::write(&sys, "cache = \"/x\"\nadmin = \"/run/t/sys.admin\"\n").unwrap();
        let none = dir.path().join("absent.toml");
        let env = || Some(OsString::from("/env.admin"));
        let flag = Some(Path::new("/flag.admin"));
        let pick = |a, c, e, s: &Path| admin_socket(a, c, e, s).unwrap();
        assert_eq!(
            pick(flag, Some(&cfg), env(), &sys),
            Path::new("/flag.admin")
        );
        assert_eq!(
            pick(None, Some(&cfg), env(), &sys),
            Path::new("/run/t/n.sock.admin")
        );
        assert_eq!(pick(None, None, env(), &sys), Path::new("/env.admin"));
        assert_eq!(pick(None, None, None, &sys), Path::new("/run/t/sys.admin"));
        assert_eq!(
            pick(None, None, Some(OsString::new()), &none),
            Path::new("/tmp/tiercache.sock.admin")
        );
        assert!(admin_socket(None, Some(&none), None, &none).is_err());
    }

    #[test]
    fn sizes_print_as_set_reads_them() {
        for (bytes, s) in [
            (4 << 20, "4M"),
            (512 << 10, "512k"),
            (1000, "1000"),
            (0, "0"),
        ] {
            assert_eq!(size_knob(bytes), s);
            assert_eq!(crate::units::parse_size(s), Ok(bytes));
        }
        assert_eq!(stat_text("cache_read_bytes", 1536, false), "1.5 KiB");
        assert_eq!(stat_text("cache_read_bytes", 1536, true), "1536");
        assert_eq!(stat_text("cache_hits", 1536, false), "1536");
    }
}
