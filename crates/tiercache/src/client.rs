//! Client side of the admin commands: `status`, `stats`, `set`, `detach`, `attach`,
//! `readmit`, `degrade`, `stop`.
//! Each sends one request to the running server's admin socket and prints the answer.
//!
//! Invariant: printing only; every decision is the server's (so the CLI and the admin API
//! cannot disagree).

use crate::admin::request;
use crate::units::{human, iso_utc, span};
use anyhow::Result;
use serde_json::{json, Value};
use std::path::Path;

fn num(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("?")
}

pub fn status(admin: &Path, as_json: bool) -> Result<()> {
    let r = request(admin, &json!({"cmd": "status"}), &mut |_| {})?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    if let Some(w) = r.get("without_cache") {
        return status_without_cache(w, &r);
    }
    let c = &r["cache"];
    println!(
        "cache set {}: in_use {}%, {} dirty, {} clean, {} unused, {} metadata",
        text(c, "set_uuid"),
        num(c, "in_use"),
        human(num(c, "dirty_bytes")),
        human(num(c, "clean_bytes")),
        human(num(c, "unused_bytes")),
        human(num(c, "metadata_bytes"))
    );
    print_health(&r["health"]);
    println!(
        "{:<20} {:>10} {:<13} {:<10} {:>10} {:>10} {:>6} {:>9}",
        "DEVICE", "SIZE", "MODE", "STATE", "DIRTY", "CACHED", "HIT%", "WRITEBACK"
    );
    for d in r["devices"].as_array().into_iter().flatten() {
        println!(
            "{:<20} {:>10} {:<13} {:<10} {:>10} {:>10} {:>6} {:>9}",
            text(d, "name"),
            human(num(d, "size_bytes")),
            text(d, "cache_mode"),
            text(d, "state"),
            human(num(d, "dirty_bytes")),
            human(num(d, "cached_bytes")),
            num(&d["stats_total"], "cache_hit_ratio"),
            text(d, "writeback_rate")
        );
    }
    Ok(())
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

pub fn stats(admin: &Path, as_json: bool) -> Result<()> {
    let r = request(admin, &json!({"cmd": "stats"}), &mut |_| {})?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
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
                print!(" {:>16}", num(&d[w], &k));
            }
            println!();
        }
    }
    Ok(())
}

pub fn set(admin: &Path, device: &str, knob: &str, value: &str) -> Result<()> {
    request(
        admin,
        &json!({"cmd": "set", "device": device, "knob": knob, "value": value}),
        &mut |_| {},
    )?;
    println!("{device}: {knob} = {value}");
    Ok(())
}

pub fn detach(admin: &Path, device: &str) -> Result<()> {
    request(
        admin,
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
    println!("{device}: detached (all dirty data written back)");
    Ok(())
}

pub fn attach(admin: &Path, path: &Path) -> Result<()> {
    let r = request(
        admin,
        &json!({"cmd": "attach", "path": path.to_string_lossy()}),
        &mut |_| {},
    )?;
    println!(
        "{}: attached, exported as '{}'",
        path.display(),
        text(&r, "name")
    );
    Ok(())
}

pub fn readmit(admin: &Path) -> Result<()> {
    request(admin, &json!({"cmd": "readmit"}), &mut |_| {})?;
    println!(
        "cache device re-admitted: volumes are served through the cache again \
         (its clean copies were dropped as stale)"
    );
    Ok(())
}

pub fn degrade(admin: &Path, reason: &str) -> Result<()> {
    let r = request(
        admin,
        &json!({"cmd": "degrade", "reason": reason}),
        &mut |_| {},
    )?;
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

pub fn stop(admin: &Path) -> Result<()> {
    request(admin, &json!({"cmd": "stop"}), &mut |_| {})?;
    println!("server is stopping");
    Ok(())
}
