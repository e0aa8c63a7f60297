//! `tiercache demo`: the quickstart. Creates a slow and a fast file-backed device in a
//! directory (the slow one behind the HDD latency model, so caching visibly matters), formats
//! them, serves them, drives a short random-read workload through a real NBD connection so
//! the hit ratio and latency improve pass by pass, then keeps serving and prints how to
//! connect, until Ctrl-C.
//!
//! Invariant: the demo only ever writes inside its own directory; it re-formats devices there
//! on every run, so a run never depends on a previous one.

use crate::serve::{serve_devices, Running, ServeConfig};
use crate::units::human;
use anyhow::{Context, Result};
use blockdev::latency::{HddModel, LatencyDevice, Model};
use blockdev::{BlockDevice, FileDevice, FileDeviceOptions, NbdDevice};
use engine::{CacheMode, CacheSet, FormatOptions};
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const EXPORT: &str = "demo";
const PASSES: usize = 5;
const READS_PER_PASS: usize = 400;
const HOT_SET_BYTES: u64 = 32 << 20;

pub fn run(dir: &Path, size: u64, no_serve: bool) -> Result<()> {
    if size < 64 << 20 {
        anyhow::bail!("--size must be at least 64M (got {})", human(size));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    let slow_path = dir.join("slow.img");
    let fast_path = dir.join("fast.img");
    let socket = dir.join("nbd.sock");
    let fast_size = (size / 4).max(64 << 20);
    let slow = FileDevice::create(&slow_path, size).context("creating the slow device")?;
    let fast = FileDevice::create(&fast_path, fast_size).context("creating the fast device")?;
    CacheSet::format(&fast, &FormatOptions::default(), true)?;
    engine::format_backing(&slow, EXPORT, CacheMode::Writethrough, true)?;
    drop((slow, fast));
    println!("tiercache demo in {}", dir.display());
    println!(
        "  slow device: {} ({}, behind an emulated 7200 rpm disk: ~8 ms per random read)",
        slow_path.display(),
        human(size)
    );
    println!(
        "  fast device: {} ({}, the cache)",
        fast_path.display(),
        human(fast_size)
    );
    let slow: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(
        FileDevice::open(&slow_path, FileDeviceOptions::default())?,
        Model::Hdd(HddModel::default()),
    ));
    let fast: Arc<dyn BlockDevice> =
        Arc::new(FileDevice::open(&fast_path, FileDeviceOptions::default())?);
    let cfg = ServeConfig {
        cache: fast_path.clone(),
        backing: vec![slow_path.to_string_lossy().into_owned()],
        socket: Some(socket.clone()),
        ..ServeConfig::default()
    };
    let admin = cfg.admin();
    serve_devices(&cfg, fast, vec![slow], move |running| {
        if let Err(e) = workload(running, &socket) {
            eprintln!("demo workload failed: {e:#}");
            running.request_stop();
            return;
        }
        if no_serve {
            running.request_stop();
            return;
        }
        let uri = format!("nbd+unix:///{EXPORT}?socket={}", socket.display());
        println!();
        println!("Still serving. Connect with any NBD client, for example:");
        println!("  nbdinfo '{uri}'");
        println!("  qemu-img info '{uri}'");
        println!(
            "  nbdfuse {}/mnt '{uri}' &   # then losetup + mkfs.ext4 + mount",
            dir.display()
        );
        println!(
            "  sudo nbd-client -unix {} /dev/nbd0 -name {EXPORT}",
            socket.display()
        );
        let tc = command_name();
        println!("Watch it:   {tc} status --admin {}", admin.display());
        println!(
            "Tune it:    {tc} set --admin {} {EXPORT} cache_mode writeback",
            admin.display()
        );
        println!("Press Ctrl-C to stop (the cache is saved and stays warm for the next run).");
    })
}

/// How to run this binary again: "tiercache" if that name on $PATH is this binary, else its
/// full path (after `cargo run` it is under target/, not on $PATH).
fn command_name() -> String {
    let Ok(exe) = std::env::current_exe().and_then(|p| p.canonicalize()) else {
        return "tiercache".into();
    };
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| dir.join("tiercache").canonicalize().ok().as_ref() == Some(&exe))
    });
    if on_path {
        "tiercache".into()
    } else {
        exe.display().to_string()
    }
}

/// Random 4 KiB reads over a hot set, pass after pass, through a real NBD connection.
fn workload(running: &Arc<Running>, socket: &Path) -> Result<()> {
    let uri = format!("nbd+unix:///{EXPORT}?socket={}", socket.display());
    let dev = NbdDevice::connect(&uri).with_context(|| format!("connecting to {uri}"))?;
    let vol = running
        .set()
        .context("the demo serves through its cache set")?
        .volumes()
        .into_iter()
        .find(|v| v.name() == EXPORT)
        .context("the demo export is missing")?;
    vol.set_sequential_cutoff(0)?;
    let blocks = HOT_SET_BYTES.min(dev.size_bytes()) / 4096;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut buf = vec![0u8; 4096];
    println!();
    println!(
        "Reading {READS_PER_PASS} random 4 KiB blocks per pass from a {} hot set over NBD:",
        human(HOT_SET_BYTES)
    );
    println!("  pass     IOPS   mean latency   hit ratio (this pass)");
    let mut base = vol.status().stats.total;
    for pass in 1..=PASSES {
        let start = Instant::now();
        for _ in 0..READS_PER_PASS {
            let b = rng.gen_range(0..blocks);
            dev.read_at(&mut buf, b * 4096)?;
        }
        let secs = start.elapsed().as_secs_f64();
        let now = vol.status().stats.total;
        let delta = now.since(&base);
        base = now;
        println!(
            "  {pass:>4} {:>8.0} {:>11.2} ms {:>10}%",
            READS_PER_PASS as f64 / secs,
            secs * 1000.0 / READS_PER_PASS as f64,
            delta.hit_ratio_pct()
        );
    }
    Ok(())
}
