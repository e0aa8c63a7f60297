//! `make`: formatting a cache device and backing devices and attaching them (make-bcache),
//! or backing devices alone for a later `attach`; and what it prints.
//!
//! Owns: the labels of backing devices formatted together (`label`, or `label-N` for
//! several) and the JSON document describing what was made.
//!
//! Invariants: every device is opened and checked before any is written, so a `make` that
//! fails has changed nothing; a device named twice is refused; the formats themselves are the
//! engine's (`CacheSet::format`, `engine::format_backing`).

use crate::devices::{self, Access};
use crate::units::human;
use anyhow::{bail, Context, Result};
use engine::{CacheMode, CacheSet, Config, FormatOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// Formats and attaches the devices (the cache set's `Config` without background threads)
/// and returns what was made, for [`print_made`].
pub fn make(
    backing: &[PathBuf],
    cache: Option<&Path>,
    bucket_size: u64,
    block_size: u64,
    writeback: bool,
    label: &str,
    force: bool,
) -> Result<Value> {
    let to_u32 = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| anyhow::anyhow!("{what} {v} is too large"))
    };
    let opts = FormatOptions {
        block_size: to_u32(block_size, "block size")?,
        bucket_size: to_u32(bucket_size, "bucket size")?,
        label: String::new(),
    };
    let specs: Vec<String> = backing
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let Some(cache) = cache else {
        return make_backing_alone(backing, &specs, block_size, writeback, label, force);
    };
    devices::ensure_distinct(cache, &specs)?;
    let cache_dev = devices::open_path(cache, Access::Write)?;
    let backing_devs = specs
        .iter()
        .map(|s| devices::open_spec(s, Access::Write))
        .collect::<Result<Vec<_>>>()?;
    let mode = if writeback {
        CacheMode::Writeback
    } else {
        CacheMode::Writethrough
    };
    let labels = labels_of(backing.len(), label);
    // Check everything before writing anything: a `make` that fails has changed nothing.
    CacheSet::check_format(&*cache_dev, &opts, force)
        .with_context(|| format!("{}", cache.display()))?;
    for ((p, d), l) in backing.iter().zip(&backing_devs).zip(&labels) {
        engine::check_format_backing(&**d, l, force, block_size)
            .with_context(|| format!("{}", p.display()))?;
    }
    let set_uuid = CacheSet::format(&*cache_dev, &opts, force)
        .with_context(|| format!("{}", cache.display()))?;
    for ((p, d), l) in backing.iter().zip(&backing_devs).zip(&labels) {
        engine::format_backing(&**d, l, mode, force).with_context(|| format!("{}", p.display()))?;
    }
    // Opening the set just formatted logs the engine's "recovered" line at INFO, which is no
    // news to someone who ran `make`: only warnings are shown meanwhile.
    let level = log::max_level();
    log::set_max_level(log::LevelFilter::Warn.min(level));
    let opened = CacheSet::open(
        cache_dev,
        Config {
            background: false,
            ..Config::default()
        },
    );
    log::set_max_level(level);
    let (set, _) = opened?;
    let mut made = Vec::new();
    for (p, d) in backing.iter().zip(backing_devs) {
        let vol = set
            .attach(d)
            .with_context(|| format!("attaching {}", p.display()))?;
        made.push(json!({
            "path": p,
            "uuid": vol.uuid().to_string(),
            "export": vol.name(),
            "size_bytes": vol.size_bytes(),
            "cache_mode": vol.mode().name(),
        }));
    }
    let l = set.layout().clone();
    set.close()?;
    Ok(json!({
        "cache": {
            "path": cache,
            "set_uuid": set_uuid.to_string(),
            "nbuckets": l.nbuckets,
            "bucket_size": l.bucket_size,
            "block_size": l.block_size,
            "cache_bytes": u64::from(l.nbuckets) * u64::from(l.bucket_size),
        },
        "backing": made,
    }))
}

/// The label of each of `n` backing devices formatted together: `label`, or `label-N` when
/// there are several.
fn labels_of(n: usize, label: &str) -> Vec<String> {
    (0..n)
        .map(|i| {
            if n > 1 && !label.is_empty() {
                format!("{label}-{i}")
            } else {
                label.to_string()
            }
        })
        .collect()
}

/// `make --backing X` without `--cache` (make-bcache -B): backing headers that name no cache
/// set, for `attach` into a running one. Checks every device before writing any.
fn make_backing_alone(
    backing: &[PathBuf],
    specs: &[String],
    block_size: u64,
    writeback: bool,
    label: &str,
    force: bool,
) -> Result<Value> {
    for (i, s) in specs.iter().enumerate() {
        if specs[..i].contains(s) {
            bail!("{s} is named twice");
        }
    }
    let devs = specs
        .iter()
        .map(|s| devices::open_spec(s, Access::Write))
        .collect::<Result<Vec<_>>>()?;
    let labels = labels_of(backing.len(), label);
    for ((p, d), l) in backing.iter().zip(&devs).zip(&labels) {
        engine::check_format_backing(&**d, l, force, block_size)
            .with_context(|| format!("{}", p.display()))?;
    }
    let mode = if writeback {
        CacheMode::Writeback
    } else {
        CacheMode::Writethrough
    };
    let mut made = Vec::new();
    for ((p, d), l) in backing.iter().zip(&devs).zip(&labels) {
        let h = engine::format_backing(&**d, l, mode, force)
            .with_context(|| format!("{}", p.display()))?;
        made.push(json!({
            "path": p,
            "uuid": h.dev_uuid.to_string(),
            "export": if h.label.is_empty() { h.dev_uuid.to_string() } else { h.label.clone() },
            "size_bytes": h.data_size,
            "cache_mode": mode.name(),
        }));
    }
    Ok(json!({"cache": null, "backing": made}))
}

/// What `make` made, as JSON or as a line per device.
pub fn print_made(made: &Value, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(made)?);
        return Ok(());
    }
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let t = |v: &Value, k: &str| v[k].as_str().unwrap_or("?").to_string();
    for b in made["backing"].as_array().into_iter().flatten() {
        println!(
            "backing {}: uuid {} export '{}' {} mode {}",
            t(b, "path"),
            t(b, "uuid"),
            t(b, "export"),
            human(n(b, "size_bytes")),
            t(b, "cache_mode")
        );
    }
    let c = &made["cache"];
    if c.is_null() {
        println!(
            "not attached to a cache set: `tiercache attach PATH` takes a device into a \
             running server's set"
        );
        return Ok(());
    }
    println!(
        "cache {}: set {} {} buckets of {} ({} of cache space), block size {}",
        t(c, "path"),
        t(c, "set_uuid"),
        n(c, "nbuckets"),
        human(n(c, "bucket_size")),
        human(n(c, "cache_bytes")),
        human(n(c, "block_size"))
    );
    Ok(())
}
