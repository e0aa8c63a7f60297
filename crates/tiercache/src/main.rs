//! The `tiercache` command: format, inspect and check tiercache devices, serve them, and talk
//! to a running server.
//!
//! Invariant: every failure is one line on stderr and a non-zero exit; no panic reaches the
//! user for bad input. All logic lives in the library crates; this file only sets the process
//! up (allocator, logging, SIGPIPE) and dispatches: the command line is `cli`'s, `make` is
//! `make`'s, `show` and `check` are `inspect`'s, the admin commands `client`'s, `serve`
//! `serve`'s.

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
mod inspect;
mod make;
mod metrics;
mod notify;
mod serve;
mod top;
mod ublk;
use tiercache_units as units;
mod without_cache;
mod writeback_meter;

use anyhow::{bail, Result};
use clap::CommandFactory;
use cli::{Cli, Cmd, EmulateKind, GenerateCmd};
use std::process::ExitCode;

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
    init_logging();
    let cli = cli::parse_args();
    if prints_only(&cli.cmd) {
        // Commands that only print end quietly when their reader goes away (`... | head`),
        // as Unix tools do; servers keep Rust's default (EPIPE as an error on the socket).
        // SAFETY: restoring a signal's default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match dispatch(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tiercache: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Logging to stderr with millisecond timestamps. rustls warns of every client that sends an
/// IP address as its TLS server name (libnbd and qemu do when they connect by address); the
/// server uses no server name, so that is no news. RUST_LOG overrides.
fn init_logging() {
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,rustls::msgs::handshake=error"),
    )
    .format_timestamp_millis()
    .init();
}

/// The commands that only print (to a reader that may go away).
fn prints_only(cmd: &Cmd) -> bool {
    matches!(
        cmd,
        Cmd::Show { .. }
            | Cmd::Status { .. }
            | Cmd::Stats { .. }
            | Cmd::Get { .. }
            | Cmd::Generate { .. }
            | Cmd::Top { .. }
    )
}

/// Runs one command; its exit code (`check` has its own), or the error to print.
fn dispatch(cmd: Cmd) -> Result<ExitCode> {
    let done = |r: Result<()>| r.map(|_| ExitCode::SUCCESS);
    match cmd {
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
            make::make(
                &backing,
                cache.as_deref(),
                bucket_size,
                block_size,
                writeback,
                &label,
                force,
            )
            .and_then(|made| make::print_made(&made, json)),
        ),
        Cmd::Show { path, json } => inspect::show(&path, json).map(|_| ExitCode::SUCCESS),
        Cmd::Check { path, data, json } => inspect::check(&path, data, json),
        Cmd::Generate { what } => match what {
            GenerateCmd::Completions { shell } => {
                generate::completions(Cli::command(), shell);
                Ok(ExitCode::SUCCESS)
            }
            GenerateCmd::Man { dir } => {
                generate::man(Cli::command(), &dir).map(|_| ExitCode::SUCCESS)
            }
        },
        cmd @ Cmd::Serve { .. } => serve_command(cmd).map(|_| ExitCode::SUCCESS),
        Cmd::Bench(args) => bench::run(&args).map(|_| ExitCode::SUCCESS),
        cmd @ Cmd::Emulate { .. } => emulate_command(cmd).map(|_| ExitCode::SUCCESS),
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
        } => top_command(&admin, once, interval).map(|_| ExitCode::SUCCESS),
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
        Cmd::ClearStats { admin, device } => done(
            admin
                .target()
                .and_then(|a| client::clear_stats(&a, &device)),
        ),
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
    }
}

/// `tiercache serve`: the command line's settings over the config file's, then the server.
fn serve_command(cmd: Cmd) -> Result<()> {
    let Cmd::Serve {
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
    } = cmd
    else {
        unreachable!("serve_command is only called with its own command")
    };
    let flags = serve::ServeConfig {
        cache: cache.unwrap_or_default(),
        backing,
        backing_file: None,
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
}

/// `tiercache emulate`: a device with a disk's or an SSD's timing, served over NBD.
fn emulate_command(cmd: Cmd) -> Result<()> {
    let Cmd::Emulate {
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
    } = cmd
    else {
        unreachable!("emulate_command is only called with its own command")
    };
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
}

/// `tiercache top`: one view (`--once`) or a live one of a running server.
fn top_command(admin: &cli::AdminArgs, once: bool, interval: f64) -> Result<()> {
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
}
