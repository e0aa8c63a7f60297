//! The admin protocol: live control of a running `tiercache serve` over a unix socket.
//!
//! One JSON object per line each way. A request names a command (`status`, `stats`, `set`,
//! `detach`, `attach`, `stop`); the reply is `{"ok": true, ...}` or `{"ok": false, "error":
//! "..."}`. Long operations (detach) first send progress lines `{"progress": {...}}`.
//!
//! Invariants: the socket is created with permissions 0600 (only its owner may control the
//! cache); a malformed or unknown request gets an error reply and never affects other
//! clients; requests are bounded (64 KiB per line) and each connection is served by its own
//! thread, so a stuck client cannot block the others.

use crate::units::parse_size;
use anyhow::{anyhow, bail, Context, Result};
use engine::{CacheMode, CacheSet, DevStatus, Volume};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAX_LINE_BYTES: u64 = 64 * 1024;

/// The knobs `set` accepts, with bcache's sysfs names.
pub const KNOBS: [&str; 6] = [
    "cache_mode",
    "sequential_cutoff",
    "writeback_percent",
    "writeback_delay",
    "writeback_running",
    "label",
];

/// What the admin server needs from the process that serves exports.
pub trait Control: Send + Sync + 'static {
    fn set(&self) -> &CacheSet;
    /// Called after a volume was attached or detached, so exports follow.
    fn volumes_changed(&self);
    /// Asks the process to shut down gracefully.
    fn stop(&self);
    /// Opens a backing device by path (for `attach`).
    fn open_backing(&self, path: &Path) -> Result<Arc<dyn blockdev::BlockDevice>>;
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

/// Applies one knob change; errors say what is accepted.
pub fn set_knob(vol: &Volume, knob: &str, value: &str) -> Result<()> {
    match knob {
        "cache_mode" => vol.set_mode(value.parse::<CacheMode>().map_err(|e| anyhow!(e))?)?,
        "sequential_cutoff" => {
            vol.set_sequential_cutoff(parse_size(value).map_err(|e| anyhow!(e))?)
        }
        "writeback_percent" => {
            let pct: u32 = value.parse().map_err(|_| {
                anyhow!("writeback_percent must be an integer 0-100, got '{value}'")
            })?;
            vol.set_writeback_percent(pct)?
        }
        "writeback_delay" => vol.set_writeback_delay_secs(
            value
                .parse()
                .map_err(|_| anyhow!("writeback_delay must be whole seconds, got '{value}'"))?,
        ),
        "writeback_running" => vol.set_writeback_running(parse_bool(value)?),
        "label" => vol.set_label(value)?,
        _ => bail!("unknown knob '{knob}' (knobs: {})", KNOBS.join(", ")),
    }
    Ok(())
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
        "label": s.knobs.label,
        "stats_total": stats(&s.stats.total),
        "stats_five_minute": stats(&s.stats.five_minute),
        "stats_hour": stats(&s.stats.hour),
        "stats_day": stats(&s.stats.day),
    })
}

fn cache_json(set: &CacheSet) -> Value {
    let o = set.occupancy();
    json!({
        "set_uuid": set.set_uuid().to_string(),
        "total_bytes": o.total_bytes,
        "unused_bytes": o.unused_bytes,
        "clean_bytes": o.clean_bytes,
        "dirty_bytes": o.dirty_bytes,
        "metadata_bytes": o.metadata_bytes,
        "in_use": o.in_use_pct,
    })
}

/// Handles one request; `send` writes intermediate lines (progress).
fn handle(ctl: &dyn Control, req: &Value, send: &mut dyn FnMut(Value)) -> Result<Value> {
    let set = ctl.set();
    let field = |k: &str| {
        req.get(k)
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("request needs a string field '{k}'"))
    };
    match field("cmd")? {
        "status" | "stats" => {
            let devices: Vec<Value> = set
                .volumes()
                .iter()
                .map(|v| status_json(&v.status(), &v.name()))
                .collect();
            Ok(json!({"ok": true, "cache": cache_json(set), "devices": devices}))
        }
        "set" => {
            let vol = find(set, field("device")?)?;
            set_knob(&vol, field("knob")?, field("value")?)?;
            if field("knob")? == "label" {
                ctl.volumes_changed();
            }
            Ok(json!({"ok": true}))
        }
        "detach" => {
            let vol = find(set, field("device")?)?;
            let mut last = u64::MAX;
            set.detach(&vol, &mut |remaining, total| {
                if remaining != last {
                    last = remaining;
                    send(json!({"progress": {"dirty_bytes": remaining, "total_bytes": total}}));
                }
            })?;
            ctl.volumes_changed();
            Ok(json!({"ok": true}))
        }
        "attach" => {
            let path = PathBuf::from(field("path")?);
            let dev = ctl.open_backing(&path)?;
            let vol = set
                .attach(dev)
                .with_context(|| format!("attaching {}", path.display()))?;
            ctl.volumes_changed();
            Ok(json!({"ok": true, "name": vol.name()}))
        }
        "stop" => {
            ctl.stop();
            Ok(json!({"ok": true}))
        }
        other => {
            bail!("unknown command '{other}' (commands: status, stats, set, detach, attach, stop)")
        }
    }
}

fn serve_conn(ctl: &dyn Control, stream: UnixStream) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        let n = (&mut reader).take(MAX_LINE_BYTES).read_line(&mut line)?;
        if n == 0 {
            return Ok(());
        }
        let mut out = Vec::new();
        let reply = match serde_json::from_str::<Value>(&line) {
            Ok(req) => handle(ctl, &req, &mut |v| out.push(v)),
            Err(e) => Err(anyhow!("malformed request: {e}")),
        };
        for v in out {
            writeln!(writer, "{v}")?;
        }
        let reply = reply.unwrap_or_else(|e| json!({"ok": false, "error": format!("{e:#}")}));
        writeln!(writer, "{reply}")?;
    }
}

/// Listens on `path` (created 0600) until the process exits; one thread per connection.
pub fn listen(path: &Path, ctl: Arc<dyn Control>) -> Result<()> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!("{} is in use by a running tiercache", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    std::thread::Builder::new()
        .name("tc-admin".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let ctl = ctl.clone();
                let _ = std::thread::Builder::new()
                    .name("tc-admin-conn".into())
                    .spawn(move || {
                        if let Err(e) = serve_conn(&*ctl, stream) {
                            log::debug!("admin connection: {e}");
                        }
                    });
            }
        })?;
    Ok(())
}

/// Client side: sends one request, calls `progress` for progress lines, returns the reply.
pub fn request(path: &Path, req: &Value, progress: &mut dyn FnMut(&Value)) -> Result<Value> {
    let mut stream = UnixStream::connect(path).with_context(|| {
        format!(
            "connecting to {} (is `tiercache serve` running? use --admin to name its socket)",
            path.display()
        )
    })?;
    writeln!(stream, "{req}")?;
    let mut reader = BufReader::new(stream);
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
            return Ok(v);
        }
        bail!(
            "{}",
            v.get("error")
                .and_then(Value::as_str)
                .unwrap_or("the server reported an error")
        );
    }
}
