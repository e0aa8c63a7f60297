//! The `tiercache` command: format, inspect and check tiercache devices.
//!
//! Invariant: every failure is one line on stderr and a non-zero exit; no panic reaches the
//! user for bad input. All logic lives in the library crates; this file only calls them on
//! the command line `cli` parsed, and prints.

mod access;
mod admin;
mod bench;
mod cli;
mod client;
mod demo;
mod devices;
mod emulate;
mod export;
mod generate;
mod metrics;
mod notify;
mod serve;
mod top;
mod ublk;
use tiercache_units as units;
mod without_cache;
mod writeback_meter;

use anyhow::{bail, Context, Result};
use clap::CommandFactory;
use cli::{Cli, Cmd, EmulateKind, GenerateCmd};
use devices::Access;
use engine::{CacheMode, CacheSet, Config, FormatOptions};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use units::human;

fn make(
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
fn print_made(made: &Value, as_json: bool) -> Result<()> {
    if as_json {
        return print_json(made);
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

fn print_json(v: &Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

fn show(path: &Path, as_json: bool) -> Result<()> {
    // Headers only, without a lock: `show` works beside a running server (what it prints may
    // be about to change).
    let dev = devices::open_spec(&path.to_string_lossy(), Access::Inspect)?;
    let read = engine::format::Superblock::read(&*dev);
    if let Err(e @ engine::Error::State(_)) = &read {
        // A cache device in a format this version does not read: say so, not "unknown".
        bail!("{}: {e}", path.display());
    }
    if let Ok((sb, notes)) = read {
        let l = &sb.layout;
        if as_json {
            return print_json(&json!({
                "type": "cache",
                "sb_seq": sb.seq,
                "sb_version": engine::format::FORMAT_VERSION,
                "dev_uuid": sb.dev_uuid.to_string(),
                "cset_uuid": sb.set_uuid.to_string(),
                "dev_size": l.device_size,
                "block_size": l.block_size,
                "bucket_size": l.bucket_size,
                "nbuckets": l.nbuckets,
                "journal": {"offset": l.journal_off, "length": l.journal_len},
                "checkpoints": {"offsets": l.ckpt_offsets, "length": l.ckpt_len},
                "checkpoint": {"slot": sb.ckpt_slot, "seq": sb.ckpt_seq},
                "data_offset": l.data_off,
                "warnings": notes,
            }));
        }
        println!("type            cache device");
        println!("sb.seq          {}", sb.seq);
        println!("sb.version      {}", engine::format::FORMAT_VERSION);
        println!("dev.uuid        {}", sb.dev_uuid);
        println!("cset.uuid       {}", sb.set_uuid);
        println!(
            "dev.size        {} ({})",
            l.device_size,
            human(l.device_size)
        );
        println!("block_size      {}", l.block_size);
        println!("bucket_size     {}", l.bucket_size);
        println!("nbuckets        {}", l.nbuckets);
        println!(
            "journal         offset {} length {} (a ring; each record twice, side by side)",
            l.journal_off, l.journal_len
        );
        println!(
            "checkpoints     offsets {} {} length {}",
            l.ckpt_offsets[0], l.ckpt_offsets[1], l.ckpt_len
        );
        println!("checkpoint      slot {} seq {}", sb.ckpt_slot, sb.ckpt_seq);
        println!("data            offset {}", l.data_off);
        for n in notes {
            println!("warning         {n}");
        }
        return Ok(());
    }
    match engine::format::BackingHeader::read(&*dev) {
        Ok((h, notes)) if as_json => print_json(&json!({
            "type": "backing",
            "sb_seq": h.seq,
            "dev_uuid": h.dev_uuid.to_string(),
            "dev_label": h.label,
            "cset_uuid": (!h.set_uuid.is_nil()).then(|| h.set_uuid.to_string()),
            "cset_host": h.owner_host,
            "data_offset": h.data_offset,
            "data_size": h.data_size,
            "cache_mode": h.mode.name(),
            "state": format!("{:?}", h.state).to_lowercase(),
            "dirty_bytes": h.dirty_bytes,
            "stale_copies": without_cache::stale_name(h.stale),
            "warnings": notes,
        })),
        Ok((h, notes)) => {
            println!("type            backing device");
            println!("sb.seq          {}", h.seq);
            println!("dev.uuid        {}", h.dev_uuid);
            println!(
                "dev.label       {}",
                if h.label.is_empty() {
                    "(empty)"
                } else {
                    &h.label
                }
            );
            println!(
                "cset.uuid       {}",
                if h.set_uuid.is_nil() {
                    "(detached)".to_string()
                } else {
                    h.set_uuid.to_string()
                }
            );
            if !h.owner_host.is_empty() {
                println!("cset.host       {}", h.owner_host);
            }
            println!("dev.data_offset {}", h.data_offset);
            println!("dev.data_size   {} ({})", h.data_size, human(h.data_size));
            println!("cache_mode      {}", h.mode);
            println!(
                "state           {}",
                match (h.state, h.dirty_bytes) {
                    (engine::format::BackingState::Dirty, Some(n)) =>
                        format!("dirty ({} when the cache set last recorded it)", human(n)),
                    (state, _) => format!("{state:?}").to_lowercase(),
                }
            );
            println!(
                "stale_copies    {} (cached copies the next attach drops)",
                without_cache::stale_name(h.stale)
            );
            for n in notes {
                println!("warning         {n}");
            }
            Ok(())
        }
        Err(_) => bail!(
            "{}: not a tiercache cache or backing device",
            path.display()
        ),
    }
}

fn check(path: &Path, data: bool, as_json: bool) -> Result<ExitCode> {
    let dev = devices::open_spec(&path.to_string_lossy(), Access::Check)?;
    let r = engine::check_device(&*dev, data).with_context(|| path.display().to_string())?;
    let code = match (r.problems.is_empty(), r.fatal) {
        (true, _) => 0,
        (false, false) => 1,
        (false, true) => 2,
    };
    if as_json {
        let facts: serde_json::Map<String, Value> =
            r.facts.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let verdict = ["healthy", "damaged but recoverable", "unusable"][usize::from(code)];
        print_json(&json!({
            "path": path,
            "kind": r.kind,
            "facts": facts,
            "problems": r.problems,
            "verdict": verdict,
            "exit_status": code,
        }))?;
        return Ok(ExitCode::from(code));
    }
    println!("{}: tiercache {} device", path.display(), r.kind);
    for (k, v) in &r.facts {
        println!("  {k}: {v}");
    }
    if r.problems.is_empty() {
        println!("  ok: no problems found");
        return Ok(ExitCode::SUCCESS);
    }
    for p in &r.problems {
        eprintln!("{}: {}", path.display(), p);
    }
    Ok(if r.fatal {
        eprintln!(
            "{}: damaged beyond use: open will refuse this device",
            path.display()
        );
        ExitCode::from(2)
    } else {
        eprintln!(
            "{}: damaged, but recoverable from redundant copies",
            path.display()
        );
        ExitCode::from(1)
    })
}

/// Makes glibc give large buffers back to the system when they are freed. By default it serves
/// allocations over 128 KiB by mmap at first, but raises that threshold to the size of each
/// such buffer freed (up to 32 MiB), after which request-sized buffers come from the heap and
/// stay resident when freed: a server that handled a burst of 32 MiB requests kept hundreds
/// of MiB after its clients left. A fixed threshold turns that adjustment off.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

fn main() -> ExitCode {
    return_freed_memory();
    // rustls warns of every client that sends an IP address as its TLS server name (libnbd
    // and qemu do when they connect by address); the server uses no server name, so that is
    // no news. RUST_LOG overrides.
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,rustls::msgs::handshake=error"),
    )
    .format_timestamp_millis()
    .init();
    let cli = cli::parse_args();
    if matches!(
        cli.cmd,
        Cmd::Show { .. }
            | Cmd::Status { .. }
            | Cmd::Stats { .. }
            | Cmd::Get { .. }
            | Cmd::Generate { .. }
            | Cmd::Top { .. }
    ) {
        // Commands that only print end quietly when their reader goes away (`... | head`),
        // as Unix tools do; servers keep Rust's default (EPIPE as an error on the socket).
        // SAFETY: restoring a signal's default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let done = |r: Result<()>| r.map(|_| ExitCode::SUCCESS);
    let res = match cli.cmd {
        Cmd::Make {
            backing,
            cache,
            bucket_size,
            block_size,
            writeback,
            label,
            force,
            json,
        } => done(
            make(
                &backing,
                cache.as_deref(),
                bucket_size,
                block_size,
                writeback,
                &label,
                force,
            )
            .and_then(|made| print_made(&made, json)),
        ),
        Cmd::Show { path, json } => show(&path, json).map(|_| ExitCode::SUCCESS),
        Cmd::Check { path, data, json } => check(&path, data, json),
        Cmd::Generate { what } => match what {
            GenerateCmd::Completions { shell } => {
                generate::completions(Cli::command(), shell);
                Ok(ExitCode::SUCCESS)
            }
            GenerateCmd::Man { dir } => {
                generate::man(Cli::command(), &dir).map(|_| ExitCode::SUCCESS)
            }
        },
        Cmd::Serve {
            cache,
            backing,
            socket,
            tcp,
            admin,
            metrics,
            ublk,
            ublk_queues,
            ublk_first_id,
            limits,
            health,
            tls,
            without_cache_if_missing,
            without_cache_discard_dirty,
            allow_missing,
            take_over,
            discard_dirty,
            config,
        } => (|| {
            let flags = serve::ServeConfig {
                cache: cache.unwrap_or_default(),
                backing,
                socket,
                tcp,
                admin,
                socket_mode: limits.socket_mode,
                socket_owner: limits.socket_owner,
                socket_group: limits.socket_group,
                idle_timeout: limits.idle_timeout,
                idle_close_after: limits.idle_close_after,
                max_connections: limits.max_connections,
                max_connections_per_client: limits.max_connections_per_client,
                request_memory: limits.request_memory,
                shutdown_timeout: limits.shutdown_timeout,
                data_path: limits.data_path,
                ring_threads: limits.ring_threads,
                io_error_limit: health.io_error_limit,
                io_error_halflife: health.io_error_halflife,
                cache_io_timeout_ms: health.cache_io_timeout_ms,
                congested_read_threshold_us: health.congested_read_threshold_us,
                congested_write_threshold_us: health.congested_write_threshold_us,
                admission: health.admission,
                replacement: health.replacement,
                volumes: Default::default(),
                without_cache_if_missing,
                without_cache_discard_dirty,
                allow_missing,
                tls: tls.tls,
                tls_cert: tls.tls_cert,
                tls_key: tls.tls_key,
                tls_verify_peer: tls.tls_verify_peer,
                tls_ca: tls.tls_ca,
                metrics,
                ublk,
                ublk_queues,
                ublk_first_id,
                take_over,
                discard_dirty,
            };
            let cfg = match config {
                Some(f) => serve::ServeConfig::from_file(&f)?.overridden_by(flags),
                None => flags,
            };
            if cfg.cache.as_os_str().is_empty() {
                bail!("no cache device: give --cache DEVICE, or `cache = \"DEVICE\"` in --config FILE");
            }
            serve::serve(&cfg, |_| {})
        })()
        .map(|_| ExitCode::SUCCESS),
        Cmd::Bench(args) => bench::run(&args).map(|_| ExitCode::SUCCESS),
        Cmd::Emulate {
            kind,
            file,
            size,
            socket,
            name,
            track_to_track_ms,
            full_stroke_ms,
            rpm,
            transfer_mb_s,
            latency_us,
            seed,
            rotational,
        } => (|| {
            let model = match kind {
                EmulateKind::Hdd => emulate::hdd_model(
                    track_to_track_ms,
                    full_stroke_ms,
                    rpm,
                    transfer_mb_s.unwrap_or(180.0),
                    seed,
                ),
                EmulateKind::Ssd => emulate::ssd_model(latency_us, transfer_mb_s.unwrap_or(1500.0)),
            };
            emulate::run(
                emulate::device(&file, size, model, rotational)?,
                &socket,
                &name,
            )
        })()
        .map(|_| ExitCode::SUCCESS),
        Cmd::Demo {
            dir,
            size,
            no_serve,
        } => demo::run(&dir, size, no_serve).map(|_| ExitCode::SUCCESS),
        Cmd::Status { admin } => done(admin.target().and_then(|a| client::status(&a))),
        Cmd::Stats { admin, bytes } => done(admin.target().and_then(|a| client::stats(&a, bytes))),
        Cmd::Get {
            admin,
            device,
            knob,
        } => done(
            admin
                .target()
                .and_then(|a| client::get(&a, &device, knob.as_deref())),
        ),
        Cmd::Top {
            admin,
            once,
            interval,
        } => (|| {
            if !(0.1..=60.0).contains(&interval) {
                bail!("--interval must be between 0.1 and 60 seconds");
            }
            let interval = std::time::Duration::from_secs_f64(interval);
            if admin.json && !once {
                bail!("--json needs --once (the live view is for a terminal)");
            }
            let socket = admin.target()?.socket;
            if once {
                top::once(&socket, interval, admin.json)
            } else {
                top::live(&socket, interval)
            }
        })()
        .map(|_| ExitCode::SUCCESS),
        Cmd::Set {
            admin,
            device,
            knob,
            value,
        } => done(
            admin
                .target()
                .and_then(|a| client::set(&a, &device, &knob, &value)),
        ),
        Cmd::ClearStats { admin, device } => {
            done(admin.target().and_then(|a| client::clear_stats(&a, &device)))
        }
        Cmd::Detach { admin, device } => {
            done(admin.target().and_then(|a| client::detach(&a, &device)))
        }
        Cmd::Attach {
            admin,
            path,
            take_over,
            discard_dirty,
        } => done(
            admin
                .target()
                .and_then(|a| client::attach(&a, &path, take_over, discard_dirty)),
        ),
        Cmd::Resize { admin, device } => {
            done(admin.target().and_then(|a| client::resize(&a, &device)))
        }
        Cmd::Stop { admin, no_wait } => {
            done(admin.target().and_then(|a| client::stop(&a, no_wait)))
        }
        Cmd::Readmit { admin } => done(admin.target().and_then(|a| client::readmit(&a))),
        Cmd::Degrade { admin, reason } => {
            done(admin.target().and_then(|a| client::degrade(&a, &reason)))
        }
    };
    match res {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tiercache: {e:#}");
            ExitCode::from(2)
        }
    }
}
