//! The admin protocol: live control of a running `tiercache serve` over a unix socket.
//!
//! One JSON object per line each way. A request names a command (`status`, `stats`, `set`,
//! `clear_stats`, `detach`, `attach`, `resize`, `readmit`, `degrade`, `stop`, `metrics`); the reply is
//! `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Long operations (detach) first send
//! progress lines `{"progress": {...}}`. `status` and `stats` carry the cache device's health
//! (`ok` or `degraded`, why and since when, failure counts, latency estimates), each volume's
//! knobs, and its writeback state and rate (measured by `writeback_meter`); `readmit` and
//! `degrade` reply with the health as it is after the change, `set` with the knob's value as
//! applied. `stop` replies with the server's pid and then keeps the connection open until the
//! process exits, so a client that waits for end-of-file knows the server is gone. `metrics`
//! returns everything the server measures (`crate::metrics::Sample`: counters, latency
//! histograms, occupancy, connections), which `tiercache top` samples every second.
//! A server running without its cache device (`serve --without-cache-if-missing`) answers
//! `status` with the volumes it serves directly and why the cache device is not in use,
//! `metrics` with what it can measure without the set, and `stop`; every other command needs
//! the cache set and gets an error saying so.
//!
//! Invariants: the socket is 0600 from the moment it exists (only its owner may control the
//! cache; the caller binds it with `server::bind_unix`); a malformed or unknown request gets an
//! error reply and never affects other clients; requests are bounded (64 KiB per line); at
//! most `ADMIN_CONNECTIONS_MAX` connections are open at once, each served by its own thread
//! and closed after `ADMIN_IDLE_TIMEOUT` of silence; at the limit a newcomer displaces the
//! connection idle longest, so a flood of admin connections costs a bounded number of threads
//! and descriptors and cannot lock the operator out; a stuck client cannot block the others.
//! A connection that asked to `stop` stays open (and counted) until the process exits.
//! Every command that changes something (`set`, `clear_stats`, `detach`, `attach`, `resize`,
//! `readmit`, `degrade`, `stop`) leaves one INFO line in the server's log, done or refused,
//! naming the client by the uid and pid of its socket's peer credentials (`SO_PEERCRED`) and,
//! for `set`, the value before and after.
//! `clear_stats` (bcache's clear_stats) resets what `status` and `stats` count for a volume,
//! by remembering the engine's counters at that moment ([`CLEARED`]) and subtracting them;
//! the engine's counters, and so the Prometheus counters and `top`, keep growing.

use crate::units::parse_size;
use crate::writeback_meter::{self, WritebackMeter};
use anyhow::{anyhow, bail, Context, Result};
use engine::{CacheMode, CacheSet, DevStatus, Knob, Volume};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAX_LINE_BYTES: u64 = 64 * 1024;

/// What the admin server needs from the process that serves exports.
pub trait Control: Send + Sync + 'static {
    /// The cache set, for a command (`what`) that needs it; an error saying why not when the
    /// server runs without its cache device.
    fn set(&self, what: &str) -> Result<&CacheSet>;
    /// Set when the server runs without its cache device.
    fn without_cache(&self) -> Option<&crate::without_cache::WithoutCache>;
    /// Called after a volume was attached or detached, so exports follow.
    fn volumes_changed(&self);
    /// Asks the process to shut down gracefully.
    fn stop(&self);
    /// Opens a backing device by path (for `attach`).
    fn open_backing(&self, path: &Path) -> Result<Arc<dyn blockdev::BlockDevice>>;
    /// Everything the server measures (`crate::metrics::Sample`), for `metrics`.
    fn metrics(&self) -> Result<Value>;
    /// Backing devices named at start that have not answered yet.
    fn pending(&self) -> Vec<Pending> {
        Vec::new()
    }
}

/// A backing device named for `serve` that did not answer yet: retried until it does.
#[derive(Clone, Debug)]
pub struct Pending {
    pub spec: String,
    /// Why the last try failed.
    pub error: String,
    /// Since when (seconds since the Unix epoch).
    pub since_unix: u64,
}

impl Pending {
    pub fn new(spec: String, error: String) -> Pending {
        let since_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Pending {
            spec,
            error,
            since_unix,
        }
    }
}

/// The backing devices the set knows but does not have (`missing`), and those named at start
/// that have not answered yet (`pending`), for `status`.
fn missing_json(set: &CacheSet, pending: &[Pending]) -> (Value, Value) {
    let missing = set
        .missing()
        .iter()
        .map(|m| {
            json!({
                "uuid": m.uuid.to_string(),
                "cached_bytes": m.cached_bytes,
                "dirty_bytes": m.dirty_bytes,
            })
        })
        .collect();
    let pending = pending
        .iter()
        .map(|p| json!({"backing": p.spec, "error": p.error, "since_unix": p.since_unix}))
        .collect();
    (Value::Array(missing), Value::Array(pending))
}

/// The engine's counters of each volume when its statistics were last cleared (one server per
/// process). A volume whose counters are below them (detached and attached again since) has
/// its entry dropped.
static CLEARED: Mutex<Option<HashMap<uuid::Uuid, engine::stats::Snapshot>>> = Mutex::new(None);

/// `s` with its statistics counted from the last `clear_stats` of the volume: the total less
/// the counters at the clear, and each window (five_minute, hour, day) the smaller, field by
/// field, of the window and that (for counters that only grow, the later start).
fn since_cleared(mut s: DevStatus) -> DevStatus {
    let mut cleared = CLEARED.lock().unwrap_or_else(|p| p.into_inner());
    let map = cleared.get_or_insert_with(HashMap::new);
    let Some(base) = map.get(&s.uuid).copied() else {
        return s;
    };
    let total = s.stats.total;
    if total
        .fields()
        .iter()
        .zip(base.fields())
        .any(|((_, t), (_, b))| *t < b)
    {
        map.remove(&s.uuid);
        return s;
    }
    let since = total.since(&base);
    let min = |w: &engine::stats::Snapshot| w.since(&w.since(&since));
    s.stats.five_minute = min(&s.stats.five_minute);
    s.stats.hour = min(&s.stats.hour);
    s.stats.day = min(&s.stats.day);
    s.stats.total = since;
    s
}

fn find(set: &CacheSet, name: &str) -> Result<Volume> {
    set.volumes()
        .into_iter()
        .find(|v| v.name() == name || v.uuid().to_string() == name)
        .ok_or_else(|| {
            let names: Vec<String> = set.volumes().iter().map(|v| v.name()).collect();
            anyhow!("no device named '{name}' (devices: {})", names.join(", "))
        })
}

fn parse_bool(v: &str) -> Result<bool> {
    match v {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" => Ok(false),
        _ => bail!("'{v}' is not a boolean (use 1/0, true/false, on/off)"),
    }
}

/// Parses a knob given as text (`tiercache set`, the config file); the engine checks its range
/// when it is applied.
pub fn parse_knob(knob: &str, value: &str) -> Result<Knob> {
    Ok(match knob {
        "cache_mode" => Knob::CacheMode(value.parse::<CacheMode>().map_err(|e| anyhow!(e))?),
        "sequential_cutoff" => Knob::SequentialCutoff(
            parse_size(value).map_err(|e| anyhow!("sequential_cutoff: {e}"))?,
        ),
        "writeback_percent" => {
            Knob::WritebackPercent(value.parse().map_err(|_| {
                anyhow!("writeback_percent must be an integer 0-100, got '{value}'")
            })?)
        }
        "writeback_delay" => Knob::WritebackDelaySecs(
            value
                .parse()
                .map_err(|_| anyhow!("writeback_delay must be whole seconds, got '{value}'"))?,
        ),
        "writeback_running" => Knob::WritebackRunning(parse_bool(value)?),
        "label" => Knob::Label(value.to_string()),
        _ => bail!("unknown knob '{knob}' (knobs: {})", Knob::NAMES.join(", ")),
    })
}

/// Parses, validates, persists and applies one knob change; errors say what is accepted.
pub fn set_knob(vol: &Volume, knob: &str, value: &str) -> Result<()> {
    Ok(vol.set_knob(parse_knob(knob, value)?)?)
}

pub fn status_json(s: &DevStatus, name: &str) -> Value {
    let stats = |w: &engine::stats::Snapshot| {
        let mut m = serde_json::Map::new();
        for (k, v) in w.fields() {
            m.insert(k.to_string(), json!(v));
        }
        m.insert("cache_hit_ratio".into(), json!(w.hit_ratio_pct()));
        Value::Object(m)
    };
    json!({
        "name": name,
        "uuid": s.uuid.to_string(),
        "size_bytes": s.size_bytes,
        "state": s.state,
        "dirty_bytes": s.dirty_bytes,
        "cached_bytes": s.cached_bytes,
        "cache_mode": s.knobs.cache_mode.name(),
        "sequential_cutoff": s.knobs.sequential_cutoff,
        "writeback_percent": s.knobs.writeback_percent,
        "writeback_delay": s.knobs.writeback_delay_secs,
        "writeback_running": s.knobs.writeback_running,
        "writeback_rate": s.writeback.describe(),
        "writeback_control": writeback_control_json(s),
        "writeback_state": writeback_meter::state(s),
        "writeback_error": s.writeback_error.as_ref().map(|e| json!({
            "error": e.error,
            "since_unix": e.since_unix,
            "failures": e.failures,
        })),
        "label": s.knobs.label,
        "stats_total": stats(&s.stats.total),
        "stats_five_minute": stats(&s.stats.five_minute),
        "stats_hour": stats(&s.stats.hour),
        "stats_day": stats(&s.stats.day),
        "cost": cost_json(&s.cost),
        "fill_read_share": s.fill_read_share.map(|r| (r * 1e4).round() / 1e4),
        "backing_connections": s.backing_links,
    })
}

/// The writeback rate controller behind `writeback_rate` (see engine `policy::WritebackPi`):
/// the dirty bytes it steers toward, the error (0 at the target, 1 at the dirty limit,
/// negative below the target), its proportional and integral terms (percentage points of the
/// busy disk's time) and whether its share is what applies now.
fn writeback_control_json(s: &DevStatus) -> Value {
    let c = &s.writeback_control;
    let round = |v: f64| (v * 100.0).round() / 100.0;
    json!({
        "target_bytes": s.writeback_target_bytes,
        "error": (c.error * 1e4).round() / 1e4,
        "proportional_pct": round(c.proportional_pct),
        "integral_pct": round(c.integral_pct),
        "controlled": c.controlled,
    })
}

/// A device's cost model (see engine `cost`): per kind, whether it is learned or the seed,
/// samples, the fixed cost (µs), the transfer cost (ns per byte; null until lengths varied),
/// the typical positioning cost (µs) and the positioning cost per distance bucket (µs, by the
/// bucket's largest distance in bytes; null for the last, open-ended one).
pub fn cost_json(c: &engine::DevCost) -> Value {
    let one = |e: &engine::cost::CostEstimate| {
        let round = |v: f64| (v * 100.0).round() / 100.0;
        let buckets: Vec<Value> = (0..engine::cost::BUCKETS)
            .filter_map(|b| {
                e.seek_by_bucket[b].map(|s| {
                    let limit = engine::cost::bucket_limit(b);
                    json!({
                        "distance_max": (limit != u64::MAX).then_some(limit),
                        "seek_us": round(s / 1e3),
                    })
                })
            })
            .collect();
        json!({
            "learned": e.learned,
            "samples": e.samples,
            "fixed_us": round(e.fixed_ns / 1e3),
            "ns_per_byte": e.per_byte_ns.map(|p| (p * 1e4).round() / 1e4),
            "ns_per_byte_low": e.per_byte_low_ns.map(|p| (p * 1e4).round() / 1e4),
            "seek_us": round(e.seek_ns / 1e3),
            "seek_by_distance": buckets,
        })
    };
    json!({"read": one(&c.read), "write": one(&c.write)})
}

/// The cache device's health: `ok` or `degraded` (why, since when), its failures (since
/// start, and the decayed count compared with `io_error_limit`), its latency estimates (µs; 0:
/// no recent I/O).
fn health_json(set: &CacheSet) -> Value {
    let h = set.health();
    let degraded = h.degraded.as_ref();
    json!({
        "state": if degraded.is_some() { "degraded" } else { "ok" },
        "reason": degraded.map(|d| d.reason.clone()),
        "since_unix": degraded.map(|d| d.since_unix),
        "since": degraded.map(|d| crate::units::iso_utc(d.since_unix)),
        "errors_total": h.errors_total,
        "error_count": (h.error_count * 100.0).round() / 100.0,
        "io_error_limit": h.io_error_limit,
        "read_latency_us": h.read_latency_us,
        "write_latency_us": h.write_latency_us,
        "cost": h.cost.as_ref().map(cost_json),
    })
}

/// Longest reason `degrade` accepts (it is logged and shown by every `status`).
const DEGRADE_REASON_MAX_BYTES: usize = 512;

fn cache_json(set: &CacheSet) -> Value {
    let o = set.occupancy();
    let (admission, replacement) = set.policies();
    json!({
        "admission": admission.name(),
        "replacement": replacement.name(),
        "set_uuid": set.set_uuid().to_string(),
        "total_bytes": o.total_bytes,
        "unused_bytes": o.unused_bytes,
        "clean_bytes": o.clean_bytes,
        "dirty_bytes": o.dirty_bytes,
        "metadata_bytes": o.metadata_bytes,
        "in_use": o.in_use_pct,
    })
}

/// The commands that change something, logged with the client that asked ([`handle`]).
const CHANGES: [&str; 8] = [
    "set",
    "clear_stats",
    "detach",
    "attach",
    "resize",
    "readmit",
    "degrade",
    "stop",
];

/// An admin client as the log names it: "admin client uid U pid P", from the socket's peer
/// credentials.
fn client_name(stream: &UnixStream) -> String {
    match server::peer_cred(stream) {
        Ok(c) => format!("admin client uid {} pid {}", c.uid, c.pid),
        Err(e) => format!("admin client (credentials unknown: {e})"),
    }
}

/// A knob's value as `status` reports it, for the log: strings without quotes.
fn knob_value(vol: &Volume, knob: &str) -> String {
    match &status_json(&vol.status(), &vol.name())[knob] {
        Value::String(s) => s.clone(),
        v => v.to_string(),
    }
}

/// Handles one request from `who` ([`client_name`]); `send` writes intermediate lines
/// (progress). What changes is logged at INFO (see the module comment).
fn handle(
    ctl: &dyn Control,
    meter: &WritebackMeter,
    req: &Value,
    who: &str,
    send: &mut dyn FnMut(Value),
) -> Result<Value> {
    let cmd = str_field(req, "cmd")?;
    let r = Request { ctl, req, cmd, who };
    match cmd {
        "status" | "stats" => cmd_status(&r, meter),
        "readmit" => cmd_readmit(&r),
        "degrade" => cmd_degrade(&r),
        "set" => cmd_set(&r),
        "clear_stats" => cmd_clear_stats(&r),
        "detach" => cmd_detach(&r, send),
        "attach" => cmd_attach(&r),
        "resize" => cmd_resize(&r),
        "stop" => {
            log::info!("{who}: stop");
            ctl.stop();
            Ok(json!({"ok": true, "pid": std::process::id()}))
        }
        "metrics" => Ok(json!({"ok": true, "metrics": ctl.metrics()?})),
        other => {
            bail!(
                "unknown command '{other}' (commands: status, stats, set, clear_stats, detach, \
                 attach, resize, readmit, degrade, stop, metrics)"
            )
        }
    }
}

/// One request being handled: the server it asks, what it asks, and who asks.
struct Request<'a> {
    ctl: &'a dyn Control,
    req: &'a Value,
    cmd: &'a str,
    who: &'a str,
}

impl<'a> Request<'a> {
    /// A string field of the request, or an error naming it.
    fn field(&self, k: &str) -> Result<&'a str> {
        str_field(self.req, k)
    }

    /// The cache set, or an error saying why this command cannot run without it.
    fn set(&self) -> Result<&'a CacheSet> {
        self.ctl.set(&format!("'{}'", self.cmd))
    }
}

/// A string field of a request, or an error naming it.
fn str_field<'a>(req: &'a Value, k: &str) -> Result<&'a str> {
    req.get(k)
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("request needs a string field '{k}'"))
}

/// `status` and `stats`: the cache, its health, each volume (counted since its `clear_stats`), and
/// the devices missing or pending; without the cache set, `status` says what is served directly.
fn cmd_status(r: &Request, meter: &WritebackMeter) -> Result<Value> {
    if let (Some(w), "status") = (r.ctl.without_cache(), r.cmd) {
        return Ok(w.status_json());
    }
    let set = r.set()?;
    let devices: Vec<Value> = set
        .volumes()
        .iter()
        .map(|v| {
            let s = since_cleared(v.status());
            let mut d = status_json(&s, &v.name());
            d["writeback_bytes_per_sec"] =
                json!(meter.bytes_per_sec(s.uuid, s.stats.total.writeback_bytes));
            d
        })
        .collect();
    let (missing, pending) = missing_json(set, &r.ctl.pending());
    Ok(json!({
        "ok": true,
        "cache": cache_json(set),
        "health": health_json(set),
        "devices": devices,
        "missing": missing,
        "pending": pending,
    }))
}

/// `readmit`: takes the cache device back into use; the health after it.
fn cmd_readmit(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    log::info!("{who}: readmit the cache device");
    if let Err(e) = set.readmit() {
        if set.health().degraded.is_some() {
            bail!(
                "re-admitting the cache device failed; the cache set stays degraded \
                 (every volume is served from its backing device): {e}"
            );
        }
        return Err(e.into());
    }
    Ok(json!({"ok": true, "health": health_json(set)}))
}

/// `degrade`: serves every volume from its backing device, for the reason given; the health
/// after it.
fn cmd_degrade(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let reason = r.field("reason")?.trim();
    if reason.is_empty() || reason.len() > DEGRADE_REASON_MAX_BYTES {
        bail!("degrade needs a reason of 1 to {DEGRADE_REASON_MAX_BYTES} bytes");
    }
    let already = set.health().degraded.is_some();
    log::info!("{who}: degrade, reason: {reason}");
    set.degrade(reason);
    if set.health().degraded.is_none() {
        bail!(
            "the cache set could not be degraded (a backing device's header could not \
             be marked; see the server's log)"
        );
    }
    Ok(json!({"ok": true, "already_degraded": already, "health": health_json(set)}))
}

/// `set`: changes one knob of a volume; the value as applied, as `status` reports it.
fn cmd_set(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let vol = find(set, r.field("device")?)?;
    let knob = r.field("knob")?;
    let (name, old) = (vol.name(), knob_value(&vol, knob));
    set_knob(&vol, knob, r.field("value")?)?;
    log::info!(
        "{who}: set {knob} of export '{name}': {old} -> {}",
        knob_value(&vol, knob)
    );
    if knob == "label" {
        r.ctl.volumes_changed();
    }
    Ok(json!({
        "ok": true,
        "device": vol.name(),
        "knob": knob,
        // As `status` reports it: sizes in bytes, booleans as booleans.
        "value": status_json(&vol.status(), &vol.name())[knob],
    }))
}

/// `clear_stats`: what `status` and `stats` count for a volume starts again from zero.
fn cmd_clear_stats(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let vol = find(set, r.field("device")?)?;
    let now = vol.status().stats.total;
    CLEARED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(vol.uuid(), now);
    log::info!("{who}: statistics of export '{}' cleared", vol.name());
    Ok(json!({"ok": true, "device": vol.name()}))
}

/// `detach`: writes back a volume's dirty data (progress lines through `send`), then detaches it.
fn cmd_detach(r: &Request, send: &mut dyn FnMut(Value)) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let vol = find(set, r.field("device")?)?;
    let (name, uuid) = (vol.name(), vol.uuid());
    log::info!("{who}: detach export '{name}' ({uuid}): writing back its dirty data");
    let mut last = u64::MAX;
    set.detach(&vol, &mut |remaining, total| {
        if remaining != last {
            last = remaining;
            send(json!({"progress": {"dirty_bytes": remaining, "total_bytes": total}}));
        }
    })?;
    log::info!("{who}: export '{name}' ({uuid}) detached");
    r.ctl.volumes_changed();
    Ok(json!({"ok": true}))
}

/// `attach`: opens a backing device and attaches it (taking it over if asked).
fn cmd_attach(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let path = PathBuf::from(r.field("path")?);
    let flag = |k: &str| r.req.get(k).and_then(|v| v.as_bool()).unwrap_or(false);
    let opts = engine::AttachOptions {
        take_over: flag("take_over"),
        discard_dirty: flag("take_over") && flag("discard_dirty"),
    };
    let dev = r.ctl.open_backing(&path)?;
    let vol = set
        .attach_with(dev, opts)
        .with_context(|| format!("attaching {}", path.display()))?;
    log::info!(
        "{who}: attached {}{} as export '{}' ({}, {} bytes, mode {})",
        path.display(),
        match (opts.take_over, opts.discard_dirty) {
            (false, _) => "",
            (true, false) => " (--take-over)",
            (true, true) => " (--take-over --discard-dirty)",
        },
        vol.name(),
        vol.uuid(),
        vol.size_bytes(),
        vol.mode()
    );
    r.ctl.volumes_changed();
    Ok(json!({"ok": true, "name": vol.name()}))
}

/// `resize`: takes in what a volume's backing device grew by.
fn cmd_resize(r: &Request) -> Result<Value> {
    let who = r.who;
    let set = r.set()?;
    let vol = find(set, r.field("device")?)?;
    let old = vol.size_bytes();
    let new = grow(&vol)?;
    if new != old {
        log::info!(
            "{who}: export '{}' resized from {old} to {new} bytes",
            vol.name()
        );
    } else {
        log::info!(
            "{who}: resize of export '{}': still {new} bytes",
            vol.name()
        );
    }
    // Clients that connect from now on are told the new size (the export reads it at
    // every handshake); connected ones keep the size they negotiated.
    Ok(json!({
        "ok": true,
        "device": vol.name(),
        "old_size_bytes": old,
        "size_bytes": new,
    }))
}

/// Re-reads the size of a volume's backing device and takes in what it grew by (the backing
/// header records the new size); returns the volume's size after it.
fn grow(vol: &Volume) -> Result<u64> {
    Ok(vol.resize()?)
}

/// The admin socket that goes with an NBD socket.
pub fn admin_for(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".admin");
    PathBuf::from(s)
}

/// Most admin connections served at once. A newcomer over the limit closes the connection
/// that has waited longest for its next request; when every connection is running a request,
/// the newcomer gets an error line instead.
pub const ADMIN_CONNECTIONS_MAX: usize = 8;
/// An admin connection that sends nothing for this long is closed.
pub const ADMIN_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest a reply line may take to be written (a client that stops reading is dropped).
pub const ADMIN_WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// The open admin connections: a clone of each socket (to close it when evicted) and, while
/// it waits for a request, since when.
#[derive(Default)]
struct Conns {
    next_id: u64,
    open: HashMap<u64, (UnixStream, Option<Instant>)>,
}

type SharedConns = Arc<Mutex<Conns>>;

fn lock(conns: &SharedConns) -> std::sync::MutexGuard<'_, Conns> {
    conns.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers a new connection, evicting the longest-idle one at the limit; `None` when every
/// connection is busy.
fn admit(conns: &SharedConns, stream: &UnixStream) -> Option<u64> {
    let mut c = lock(conns);
    if c.open.len() >= ADMIN_CONNECTIONS_MAX {
        let oldest = c
            .open
            .iter()
            .filter_map(|(id, (_, idle))| idle.map(|t| (t, *id)))
            .min()?
            .1;
        if let Some((s, _)) = c.open.remove(&oldest) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
    let clone = stream.try_clone().ok()?;
    let id = c.next_id;
    c.next_id += 1;
    c.open.insert(id, (clone, Some(Instant::now())));
    Some(id)
}

/// Marks a connection idle (waiting for a request) or busy; false if it was evicted.
fn mark(conns: &SharedConns, id: u64, idle: bool) -> bool {
    match lock(conns).open.get_mut(&id) {
        Some(entry) => {
            entry.1 = idle.then(Instant::now);
            true
        }
        None => false,
    }
}

fn serve_conn(
    ctl: &dyn Control,
    meter: &WritebackMeter,
    stream: UnixStream,
    conns: &SharedConns,
    id: u64,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(ADMIN_IDLE_TIMEOUT))?;
    stream.set_write_timeout(Some(ADMIN_WRITE_TIMEOUT))?;
    let who = client_name(&stream);
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if !mark(conns, id, true) {
            return Ok(());
        }
        let n = (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line)?;
        if n == 0 || !mark(conns, id, false) {
            return Ok(());
        }
        // Progress lines go out as they come; a failed write ends the connection afterwards.
        let mut progress_result = Ok(());
        let req = serde_json::from_str::<Value>(&line);
        let reply = match &req {
            Ok(req) => handle(ctl, meter, req, &who, &mut |v| {
                if progress_result.is_ok() {
                    progress_result = writeln!(writer, "{v}");
                }
            }),
            Err(e) => Err(anyhow!("malformed request: {e}")),
        };
        if let (Ok(req), Err(e)) = (&req, &reply) {
            if let Some(cmd) = req["cmd"].as_str().filter(|c| CHANGES.contains(c)) {
                log::info!("{who}: {cmd} refused: {e:#}");
            }
        }
        progress_result?;
        let stopping = reply.is_ok() && req.is_ok_and(|r| r["cmd"] == "stop");
        let reply = reply.unwrap_or_else(|e| json!({"ok": false, "error": format!("{e:#}")}));
        writeln!(writer, "{reply}")?;
        if stopping {
            // Hold the connection (reading nothing, so no idle timeout) until the server has
            // shut down ([`stopped`]) or the process exits: the client's end-of-file means
            // "stopped".
            if let Ok(s) = writer.try_clone() {
                STOPPING.lock().unwrap_or_else(|p| p.into_inner()).push(s);
            }
            let _held = (reader, writer);
            loop {
                std::thread::park();
            }
        }
    }
}

/// The connections of `stop` requests, held until the server has shut down.
static STOPPING: std::sync::Mutex<Vec<UnixStream>> = std::sync::Mutex::new(Vec::new());

/// The server has shut down (requests finished or abandoned, cache set saved): the clients
/// that asked it to stop see their connection end now, even if the process itself cannot
/// exit yet (a thread held by the kernel in an I/O of a hung device keeps it, and its
/// descriptors, until the device answers).
pub fn stopped() {
    for s in STOPPING.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// Serves admin requests on `listener` until the process exits, one thread per connection,
/// at most `ADMIN_CONNECTIONS_MAX` of them (see [`admit`]).
pub fn listen(listener: UnixListener, ctl: Arc<dyn Control>) -> Result<()> {
    let conns = SharedConns::default();
    let meter = Arc::new(WritebackMeter::default());
    if ctl.without_cache().is_none() {
        // Served without the cache device there is no writeback to measure, for good.
        let (sampler_ctl, sampler_meter) = (ctl.clone(), meter.clone());
        std::thread::Builder::new()
            .name("tc-wb-meter".into())
            .spawn(move || loop {
                if let Ok(set) = sampler_ctl.set("writeback sampling") {
                    sampler_meter.sample(set);
                }
                std::thread::sleep(writeback_meter::SAMPLE_INTERVAL);
            })?;
    }
    std::thread::Builder::new()
        .name("tc-admin".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let stream = match stream {
                    Ok(s) => s,
                    Err(e) => {
                        static LOG: engine::guard::Throttled = engine::guard::Throttled::new();
                        LOG.log(log::Level::Warn, format_args!("admin accept: {e}"));
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                };
                let Some(id) = admit(&conns, &stream) else {
                    refuse_busy(stream);
                    continue;
                };
                let ctl = ctl.clone();
                let meter = meter.clone();
                let thread_conns = conns.clone();
                let spawned = std::thread::Builder::new()
                    .name("tc-admin-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve_conn(&*ctl, &meter, stream, &thread_conns, id) {
                            log::debug!("admin connection: {e}");
                        }
                        lock(&thread_conns).open.remove(&id);
                    });
                if let Err(e) = spawned {
                    log::warn!("admin connection: cannot start a thread: {e}");
                    lock(&conns).open.remove(&id);
                }
            }
        })?;
    Ok(())
}

/// Tells a client over the connection limit why it is turned away (best effort: a fresh
/// socket's buffer holds the line, and the timeout bounds the rare case where it does not).
fn refuse_busy(mut stream: UnixStream) {
    static LOG: engine::guard::Throttled = engine::guard::Throttled::new();
    LOG.log(
        log::Level::Warn,
        format_args!("admin connection refused: {ADMIN_CONNECTIONS_MAX} already open"),
    );
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let reply = json!({"ok": false, "error": format!(
        "the server is busy: {ADMIN_CONNECTIONS_MAX} admin connections are open; try again"
    )});
    let _ = writeln!(stream, "{reply}");
}

/// Client side: sends one request, calls `progress` for progress lines, returns the reply.
pub fn request(path: &Path, req: &Value, progress: &mut dyn FnMut(&Value)) -> Result<Value> {
    exchange(path, req, progress).map(|(v, _)| v)
}

/// Like [`request`], also returning the connection, to wait for the server to close it.
pub fn exchange(
    path: &Path,
    req: &Value,
    progress: &mut dyn FnMut(&Value),
) -> Result<(Value, BufReader<UnixStream>)> {
    let mut stream = UnixStream::connect(path).with_context(|| {
        format!(
            "connecting to {} (is `tiercache serve` running? name its admin socket with \
             --admin, --config or TIERCACHE_ADMIN)",
            path.display()
        )
    })?;
    // One write: an NBD server that took the first bytes for its handshake may close the
    // socket before a second one.
    let wrote = stream.write_all(format!("{req}\n").as_bytes());
    let mut reader = BufReader::new(stream);
    // An NBD server greets first, in one write: the socket is the NBD one, not its admin
    // socket (a reply that is not JSON would say nothing useful). Its greeting is there to
    // read even when it closed the socket before the request was written.
    let greeting = nbd_proto::wire::NBD_MAGIC.to_be_bytes();
    if reader.fill_buf().is_ok_and(|b| b.starts_with(&greeting)) {
        bail!(
            "{} is an NBD socket (it answered with the NBD greeting), not a tiercache admin \
             socket: the admin socket is the one `serve --admin` names, by default the NBD \
             socket's path with \".admin\" appended ({})",
            path.display(),
            admin_for(path).display()
        );
    }
    wrote?;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            bail!("the server closed the admin connection without a reply");
        }
        let v: Value = serde_json::from_str(&line).context("malformed reply from the server")?;
        if let Some(p) = v.get("progress") {
            progress(p);
            continue;
        }
        if v.get("ok") == Some(&json!(true)) {
            return Ok((v, reader));
        }
        bail!(
            "{}",
            v.get("error")
                .and_then(Value::as_str)
                .unwrap_or("the server reported an error")
        );
    }
}
