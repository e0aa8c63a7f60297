//! `tiercache demo`: the quickstart. Creates a slow and a fast file-backed device in a
//! directory (the slow one behind the HDD latency model, so caching visibly matters), formats
//! them, serves them, drives a short random-read workload through a real NBD connection so
//! the hit ratio and latency improve pass by pass, then keeps serving and prints how to
//! connect, until Ctrl-C.
//!
//! Invariants: the demo only ever writes inside its own directory. It reuses the devices
//! there when they are its own (the slow device's header names the fast device's cache set
//! and the export `demo`, and the size asked for is the slow device's size), so the cache a
//! run leaves stays warm for the next; anything else there under its file names is formatted
//! again. Output that cannot be written (stdout a pipe whose reader has gone, as in `demo |
//! head`) ends the demo quietly and promptly: the server is stopped, nothing panics.

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
    let reused = own_devices(&slow_path, &fast_path, size);
    if !reused {
        let slow = FileDevice::create(&slow_path, size).context("creating the slow device")?;
        let fast = FileDevice::create(&fast_path, fast_size).context("creating the fast device")?;
        CacheSet::format(&fast, &FormatOptions::default(), true)?;
        engine::format_backing(&slow, EXPORT, CacheMode::Writethrough, true)?;
        drop((slow, fast));
    }
    let fast_size = std::fs::metadata(&fast_path)?.len();
    let said = (|| -> std::io::Result<()> {
        say(format_args!("tiercache demo in {}", dir.display()))?;
        say(format_args!(
            "  slow device: {} ({}, behind an emulated 7200 rpm disk: ~8 ms per random read)",
            slow_path.display(),
            human(size)
        ))?;
        say(format_args!(
            "  fast device: {} ({}, the cache)",
            fast_path.display(),
            human(fast_size)
        ))?;
        if reused {
            say(format_args!(
                "  (the devices of the last run, with its cache: delete them to start cold)"
            ))?;
        }
        Ok(())
    })();
    if said.is_err() {
        // Nobody reads any more (`demo | head`): nothing to show.
        return Ok(());
    }
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
            if !is_gone(&e) {
                eprintln!("demo workload failed: {e:#}");
            }
            running.request_stop();
            return;
        }
        if no_serve {
            running.request_stop();
            return;
        }
        if connect_hints(&dir, &socket, &admin).is_err() {
            running.request_stop();
        }
    })
}

/// Whether the slow and fast device files are the ones an earlier demo made, of the size
/// asked for now: the slow device's header names the export `demo` and the fast device's
/// cache set. Anything unreadable or different is not.
fn own_devices(slow_path: &Path, fast_path: &Path, size: u64) -> bool {
    let open = |p: &Path| FileDevice::open(p, FileDeviceOptions::default()).ok();
    let (Some(slow), Some(fast)) = (open(slow_path), open(fast_path)) else {
        return false;
    };
    let (Ok((sb, _)), Ok((h, _))) = (
        engine::format::Superblock::read(&fast),
        engine::format::BackingHeader::read(&slow),
    ) else {
        return false;
    };
    slow.size_bytes() == size && h.label == EXPORT && h.set_uuid == sb.set_uuid
}

/// One line on stdout; an error when it cannot be written (the reader has gone).
fn say(line: std::fmt::Arguments) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// Whether an error is stdout gone (a broken pipe), which ends the demo without a word.
fn is_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// How to connect to the demo while it keeps serving. Every line indented by two spaces
/// between "Still serving." and "Press Ctrl-C" is one shell command, to be pasted as it is
/// and run in order (tests/docs_commands.rs runs each one): the filesystem goes on a
/// directory the hints create inside the demo's own (`nbdfuse DIR URI` puts the export at
/// DIR/nbd; a DIR that does not exist would make nbdfuse mount over the demo's directory,
/// hiding its sockets from every later command).
fn connect_hints(dir: &Path, socket: &Path, admin: &Path) -> std::io::Result<()> {
    let uri = shell_word(&format!("nbd+unix:///{EXPORT}?socket={}", socket.display()));
    let [mnt, fs, nbd, sock, admin] = [
        dir.join("mnt"),
        dir.join("fs"),
        dir.join("mnt/nbd"),
        socket.to_path_buf(),
        admin.to_path_buf(),
    ]
    .map(|p| shell_word(&p.display().to_string()));
    let tc = shell_word(&command_name());
    say(format_args!(""))?;
    say(format_args!(
        "Still serving. Connect with any NBD client, for example:"
    ))?;
    say(format_args!("  nbdinfo {uri}"))?;
    say(format_args!("  qemu-img info {uri}"))?;
    say(format_args!(
        "As root, mount it as ext4 (nbdfuse shows the export as the file {nbd}):"
    ))?;
    say(format_args!("  mkdir -p {mnt} {fs}"))?;
    say(format_args!("  nbdfuse {mnt} {uri} &"))?;
    say(format_args!(
        "  mkfs.ext4 -F -q {nbd} && mount -o loop {nbd} {fs}"
    ))?;
    say(format_args!(
        "Or, as root, through the kernel's NBD client (after modprobe nbd):"
    ))?;
    say(format_args!(
        "  nbd-client -unix {sock} /dev/nbd0 -name {EXPORT}"
    ))?;
    say(format_args!("Watch it:"))?;
    say(format_args!("  {tc} status --admin {admin}"))?;
    say(format_args!("Tune it:"))?;
    say(format_args!(
        "  {tc} set --admin {admin} {EXPORT} cache_mode writeback"
    ))?;
    say(format_args!(
        "Before stopping it, undo what you mounted (as root):"
    ))?;
    say(format_args!("  umount {fs} && fusermount3 -uz {mnt}"))?;
    say(format_args!("  nbd-client -d /dev/nbd0"))?;
    say(format_args!(
        "Press Ctrl-C to stop (the cache is saved, and the next run in {} starts warm).",
        dir.display()
    ))
}

/// `word` as one shell word: as it is when it holds nothing the shell would change, else in
/// single quotes.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+:=,@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
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
    say(format_args!(""))?;
    say(format_args!(
        "Reading {READS_PER_PASS} random 4 KiB blocks per pass from a {} hot set over NBD:",
        human(HOT_SET_BYTES)
    ))?;
    say(format_args!(
        "  pass     IOPS   mean latency   hit ratio (this pass)"
    ))?;
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
        say(format_args!(
            "  {pass:>4} {:>8.0} {:>11.2} ms {:>10}%",
            READS_PER_PASS as f64 / secs,
            secs * 1000.0 / READS_PER_PASS as f64,
            delta.hit_ratio_pct()
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::shell_word;

    #[test]
    fn a_shell_word_reads_back_as_the_same_word() {
        assert_eq!(shell_word("/tmp/demo/mnt"), "/tmp/demo/mnt");
        assert_eq!(
            shell_word("nbd+unix:///demo?socket=/t/nbd.sock"),
            "'nbd+unix:///demo?socket=/t/nbd.sock'"
        );
        for word in ["/a b/c", "it's", "$HOME", "", "a'b'c"] {
            let o = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_word(word)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&o.stdout), word);
        }
    }
}
