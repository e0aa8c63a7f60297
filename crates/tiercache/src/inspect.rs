//! The device inspection commands: `show` (a cache device's superblock or a backing
//! device's header) and `check` (every piece of metadata, and with `--data` every cached
//! block's checksum), as text or `--json`.
//!
//! Owns: what these commands print and `check`'s exit status (0 healthy, 1 damaged but
//! usable, 2 unusable).
//!
//! Invariants: reading only — nothing here writes a device. `show` opens without a lock
//! (`Access::Inspect`), so it works beside a running server (what it prints may be about to
//! change); `check` locks the device (`Access::Check`): its verdict on a device another
//! process writes would be meaningless. The verdicts are the engine's (`check_device`).

use crate::devices::{self, Access};
use crate::units::human;
use crate::without_cache;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::process::ExitCode;

fn print_json(v: &Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// `show`: the superblock of a cache device or the header of a backing device.
pub fn show(path: &Path, as_json: bool) -> Result<()> {
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

/// `check`: the device's facts and problems; the exit status is the verdict.
pub fn check(path: &Path, data: bool, as_json: bool) -> Result<ExitCode> {
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
