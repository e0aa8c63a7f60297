//! Offline verification of a device's metadata (and optionally cached data), for
//! `tiercache check`. Reuses the recovery loader, so "check passes" means "open will succeed".
//!
//! Invariants: never writes to the device; every problem found is reported with where it is;
//! `damaged` is true for anything a user should know about, `fatal` only when open would fail.

use crate::checkpoint::load;
use crate::format::{BackingHeader, Superblock};
use crate::types::{Error, Result};
use blockdev::BlockDevice;

/// What `check` found.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// "cache" or "backing".
    pub kind: &'static str,
    /// Facts worth printing (sizes, counts).
    pub facts: Vec<(String, String)>,
    /// Problems found; empty when the device is healthy.
    pub problems: Vec<String>,
    /// True when the device cannot be used (open would refuse).
    pub fatal: bool,
}

/// Checks a cache device (superblocks, checkpoint, journal, index; data with `verify_data`)
/// or a backing device (header copies).
pub fn check_device(dev: &dyn BlockDevice, verify_data: bool) -> Result<CheckReport> {
    let cache_sb = Superblock::read(dev);
    if let Err(sb_err) = &cache_sb {
        let backing = BackingHeader::read(dev);
        if matches!(sb_err, Error::Unformatted(_)) && matches!(backing, Err(Error::Unformatted(_)))
        {
            return Err(Error::Unformatted(
                "not formatted by tiercache (neither a cache superblock nor a backing header \
                 found); `tiercache make` formats it"
                    .into(),
            ));
        }
        if let Ok((h, notes)) = backing {
            return Ok(CheckReport {
                kind: "backing",
                facts: vec![
                    ("uuid".into(), h.dev_uuid.to_string()),
                    (
                        "cache set".into(),
                        if h.set_uuid.is_nil() {
                            "none".into()
                        } else {
                            h.set_uuid.to_string()
                        },
                    ),
                    ("state".into(), format!("{:?}", h.state).to_lowercase()),
                    ("data bytes".into(), h.data_size.to_string()),
                ],
                problems: notes,
                fatal: false,
            });
        }
    }
    let mut report = CheckReport {
        kind: "cache",
        ..CheckReport::default()
    };
    let loaded = match load(dev) {
        Ok(l) => l,
        Err(e) => {
            report.problems.push(e.to_string());
            report.fatal = true;
            return Ok(report);
        }
    };
    report.problems.extend(loaded.notes.iter().cloned());
    // The newest journal record whose data never reached the device is what an ordinary
    // crash or power loss leaves (the write it recorded was never acknowledged as durable):
    // open drops it, as designed. A fact, not damage.
    let unclean = loaded.dropped_record.as_ref().map(|d| d.what());
    if let Err(e) = loaded.index.check_invariants() {
        report.problems.push(format!("index invariant broken: {e}"));
        report.fatal = true;
    }
    let l = &loaded.sb.layout;
    let bs = u64::from(l.block_size);
    report.facts = vec![
        ("cache set".into(), loaded.sb.set_uuid.to_string()),
        (
            "buckets".into(),
            format!("{} x {} bytes", l.nbuckets, l.bucket_size),
        ),
        ("backing devices".into(), loaded.devs.len().to_string()),
        (
            "index entries".into(),
            loaded.index.entry_count().to_string(),
        ),
        (
            "cached bytes".into(),
            (loaded.index.live_blocks * bs).to_string(),
        ),
        (
            "dirty bytes".into(),
            (loaded.index.dirty_blocks * bs).to_string(),
        ),
        (
            "journal records replayed".into(),
            loaded.records_replayed.to_string(),
        ),
    ];
    if let Some(u) = unclean {
        report.facts.push((
            "after an unclean shutdown".into(),
            format!("{u} (expected)"),
        ));
    }
    if verify_data {
        let mut bad = 0u64;
        let mut buf = Vec::new();
        for (dev_id, block, e) in loaded.index.runs() {
            buf.resize((u64::from(e.len) * bs) as usize, 0);
            dev.read_at(&mut buf, l.cache_block_offset(e.cache_block))
                .map_err(|err| crate::Error::io("reading cached data", err))?;
            for i in 0..e.len {
                let chunk = &buf[(u64::from(i) * bs) as usize..(u64::from(i + 1) * bs) as usize];
                if crc32c::crc32c(chunk) != loaded.index.crc(e.cache_block + i) {
                    bad += 1;
                    if bad <= 20 {
                        report.problems.push(format!(
                            "{} block {} of device {} (cache block {}) fails its checksum{}",
                            if e.dirty { "dirty" } else { "clean" },
                            block + u64::from(i),
                            dev_id,
                            e.cache_block + i,
                            if e.dirty {
                                ": this data is lost"
                            } else {
                                ": will be re-read from the backing device"
                            }
                        ));
                    }
                }
            }
        }
        report
            .facts
            .push(("data blocks failing checksum".into(), bad.to_string()));
    }
    Ok(report)
}
