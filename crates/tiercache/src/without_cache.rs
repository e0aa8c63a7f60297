//! `serve --without-cache-if-missing`: when the cache device cannot be used (missing, an open
//! or read error, metadata that does not load), serve every backing device directly — a
//! pass-through export over its data area — instead of refusing to start. bcache cannot do
//! this; it is opt-in because the cache set's copies of whatever is written meanwhile go
//! stale.
//!
//! Owns: deciding from each backing header whether the device may be served without its
//! cache ([`prepare`]), the header change that records the cache set's copies as stale, the
//! pass-through device ([`DataArea`]), and what `status` reports about it.
//!
//! Invariants:
//! - a device is served only if its header says clean (the backing device holds its newest
//!   data), or the operator gave its dirty data up: `--without-cache-discard-dirty` now, or at
//!   an earlier start (the header already says `stale: all`);
//! - before its export exists — so before any client can write — every device's header says
//!   which of the cache set's copies are stale (`clean`; `all` when dirty data was given up;
//!   `all` is never lowered) and is durable (`BackingHeader::write` writes and flushes both
//!   copies). When the cache device is back, the engine's attach drops those copies before
//!   the device is served through the set (`engine::health`), so reads return what was
//!   written here, never an older cached copy;
//! - every header is read and judged before any is written: a refusal leaves every device
//!   as it was;
//! - exports have the names they have through the cache (label, else uuid), so clients
//!   connect the same way;
//! - a cache device that another process owns is not "missing": `serve` refuses as usual
//!   (the caller checks, see `devices::is_busy`).
//!
//! Fault model: a header that cannot be read or written stops the start before anything is
//! served. A crash while serving leaves the stale marks in place, which is what the next
//! attach needs. I/O errors of the pass-through export are the backing device's and reach
//! the client as NBD errors. The data given up with `--without-cache-discard-dirty` is lost
//! by design; nothing else in the cache set is at risk (nothing here writes to the cache
//! device).

use crate::export::DeviceExport;
use anyhow::{bail, Context, Result};
use blockdev::BlockDevice;
use engine::format::{BackingHeader, BackingState, StaleCopies};
use serde_json::{json, Value};
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

/// A server running without its cache device: why, and what it serves.
pub struct WithoutCache {
    /// The cache device that could not be used.
    pub cache: PathBuf,
    /// Why it could not be used (the open or load error).
    pub reason: String,
    pub volumes: Vec<DirectVolume>,
}

/// A backing device served directly.
pub struct DirectVolume {
    /// How it was named on the command line or in the config.
    pub spec: String,
    /// Export name: the label, else the uuid (as `engine::Volume::name`).
    pub name: String,
    /// Its header as written at start.
    pub header: BackingHeader,
    pub export: Arc<DeviceExport>,
}

/// Export name of a backing device: its label if it is a valid one, else its uuid — the same
/// rule as `engine::Volume::name`.
fn export_name(h: &BackingHeader) -> String {
    if engine::knobs::validate_label(&h.label).is_ok() {
        h.label.clone()
    } else {
        h.dev_uuid.to_string()
    }
}

fn stale_rank(s: StaleCopies) -> u8 {
    match s {
        StaleCopies::None => 0,
        StaleCopies::Clean => 1,
        StaleCopies::All => 2,
    }
}

pub fn stale_name(s: StaleCopies) -> &'static str {
    match s {
        StaleCopies::None => "none",
        StaleCopies::Clean => "clean",
        StaleCopies::All => "all",
    }
}

/// Checks every backing header, marks the cache set's copies stale in each (durably), and
/// returns the volumes to serve directly; refuses, changing nothing, if a device's newest data
/// is in the missing cache and `discard_dirty` does not give it up.
pub fn prepare(
    cache: PathBuf,
    reason: String,
    backings: Vec<(String, Arc<dyn BlockDevice>)>,
    discard_dirty: bool,
) -> Result<WithoutCache> {
    /// A device that may be served, and the stale mark its header needs first.
    struct Planned {
        spec: String,
        name: String,
        header: BackingHeader,
        dev: Arc<dyn BlockDevice>,
        needed: StaleCopies,
    }
    let mut plan: Vec<Planned> = Vec::new();
    let mut refused = Vec::new();
    for (spec, dev) in backings {
        let (header, notes) =
            BackingHeader::read(&*dev).with_context(|| format!("backing device {spec}"))?;
        for n in notes {
            log::warn!("{spec}: {n}");
        }
        let name = export_name(&header);
        if let Some(other) = plan.iter().find(|p| p.name == name) {
            bail!(
                "backing devices {} and {spec} would both be exported as '{name}'",
                other.spec
            );
        }
        let needed = match (header.state, header.stale) {
            (_, StaleCopies::All) => StaleCopies::All,
            (BackingState::Clean, _) => StaleCopies::Clean,
            (BackingState::Dirty, _) if discard_dirty => StaleCopies::All,
            (BackingState::Dirty, _) => {
                refused.push(format!(
                    "backing device {spec} (volume '{name}', uuid {}) is dirty: its newest data \
                     is in the cache device, which cannot be used. Served without it, the volume \
                     returns older data, and once it is written the cached dirty data must be \
                     discarded",
                    header.dev_uuid
                ));
                continue;
            }
        };
        plan.push(Planned {
            spec,
            name,
            header,
            dev,
            needed,
        });
    }
    if !refused.is_empty() {
        bail!(
            "{}. The cache device {} cannot be used: {reason}. Bring it back, or accept losing \
             the dirty data with --without-cache-discard-dirty (config: \
             without_cache_discard_dirty = true)",
            refused.join("; "),
            cache.display()
        );
    }
    let mut volumes = Vec::new();
    for Planned {
        spec,
        name,
        mut header,
        dev,
        needed,
    } in plan
    {
        let before = header.stale;
        if stale_rank(needed) > stale_rank(before) {
            header.stale = needed;
            header
                .write(&*dev)
                .with_context(|| format!("marking the cached copies of {spec} stale"))?;
        }
        let gave_up = if header.state == BackingState::Clean {
            ""
        } else if before == StaleCopies::All {
            "; its dirty data in the cache was given up at an earlier start \
             (--without-cache-discard-dirty) and will be dropped when the cache returns"
        } else {
            "; its dirty data in the cache is given up (--without-cache-discard-dirty) and will \
             be dropped when the cache returns"
        };
        log::warn!(
            "export '{name}' ({spec}, uuid {}) is served WITHOUT CACHE, directly from the \
             backing device: the cache device {} cannot be used ({reason}); the cache's copies \
             are marked stale ({}) and dropped when it is back{gave_up}",
            header.dev_uuid,
            cache.display(),
            stale_name(header.stale),
        );
        let area = DataArea {
            size: header.data_size,
            what: format!(
                "tiercache volume {} served without cache: {}",
                header.dev_uuid,
                dev.describe()
            ),
            dev,
        };
        volumes.push(DirectVolume {
            export: Arc::new(DeviceExport::new(Arc::new(area), name.clone())),
            spec,
            name,
            header,
        });
    }
    Ok(WithoutCache {
        cache,
        reason,
        volumes,
    })
}

impl WithoutCache {
    /// The error every admin command that needs the cache set gets.
    pub fn no_set_error(&self, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{what} needs the cache set, but this server runs without its cache device {} \
             ({}); restart `tiercache serve` with the cache device to use it",
            self.cache.display(),
            self.reason
        )
    }

    /// `status` reply: the missing cache device, and each volume as served without cache.
    pub fn status_json(&self) -> Value {
        let devices: Vec<Value> = self
            .volumes
            .iter()
            .map(|v| {
                let h = &v.header;
                json!({
                    "name": v.name,
                    "uuid": h.dev_uuid.to_string(),
                    "path": v.spec,
                    "size_bytes": h.data_size,
                    "state": "without cache",
                    "served_without_cache": true,
                    "backing_state": format!("{:?}", h.state).to_lowercase(),
                    "stale_copies": stale_name(h.stale),
                    "cache_mode": h.mode.name(),
                    "label": h.label,
                })
            })
            .collect();
        json!({
            "ok": true,
            "cache": null,
            "without_cache": {
                "cache": self.cache.to_string_lossy(),
                "reason": self.reason,
            },
            "devices": devices,
        })
    }

    /// Flushes every backing device (at shutdown; clients' flushes made their data durable
    /// already, this covers writes they never flushed).
    pub fn close(&self) -> Result<()> {
        for v in &self.volumes {
            v.export
                .dev
                .flush()
                .with_context(|| format!("flushing {}", v.spec))?;
        }
        Ok(())
    }
}

/// The data area of a backing device (from `BACKING_DATA_OFFSET`, `data_size` bytes): what
/// clients see, with the headers out of their reach.
#[derive(Debug)]
pub struct DataArea {
    dev: Arc<dyn BlockDevice>,
    size: u64,
    what: String,
}

impl DataArea {
    fn at(&self, offset: u64, len: u64) -> io::Result<u64> {
        blockdev::check_range(self.size, offset, len)?;
        Ok(engine::format::BACKING_DATA_OFFSET + offset)
    }
}

impl BlockDevice for DataArea {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let at = self.at(offset, buf.len() as u64)?;
        self.dev.read_at(buf, at)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let at = self.at(offset, buf.len() as u64)?;
        self.dev.write_at(buf, at)
    }
    fn flush(&self) -> io::Result<()> {
        self.dev.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let at = self.at(offset, len)?;
        self.dev.discard(at, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let at = self.at(offset, len)?;
        self.dev.write_zeroes(at, len)
    }
    fn is_rotational(&self) -> bool {
        self.dev.is_rotational()
    }
    fn describe(&self) -> String {
        self.what.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blockdev::MemDevice;
    use engine::CacheMode;

    fn formatted(label: &str, state: BackingState, stale: StaleCopies) -> Arc<dyn BlockDevice> {
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 20));
        let mut h = engine::format_backing(&*dev, label, CacheMode::Writeback, false).unwrap();
        h.state = state;
        h.stale = stale;
        h.write(&*dev).unwrap();
        dev
    }

    fn header(dev: &Arc<dyn BlockDevice>) -> BackingHeader {
        BackingHeader::read(&**dev).unwrap().0
    }

    fn prep(devs: &[(&str, &Arc<dyn BlockDevice>)], discard: bool) -> Result<WithoutCache> {
        prepare(
            PathBuf::from("/gone/cache.img"),
            "no such file".into(),
            devs.iter()
                .map(|(s, d)| (s.to_string(), (*d).clone()))
                .collect(),
            discard,
        )
    }

    #[test]
    fn clean_devices_are_marked_stale_and_all_is_never_lowered() {
        let a = formatted("a", BackingState::Clean, StaleCopies::None);
        let b = formatted("", BackingState::Clean, StaleCopies::All);
        let w = prep(&[("a.img", &a), ("b.img", &b)], false).unwrap();
        assert_eq!(header(&a).stale, StaleCopies::Clean);
        assert_eq!(header(&b).stale, StaleCopies::All);
        let names: Vec<&str> = w.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["a", &header(&b).dev_uuid.to_string()]);
        // Already marked: nothing is rewritten.
        let seq = header(&a).seq;
        prep(&[("a.img", &a)], false).unwrap();
        assert_eq!(header(&a).seq, seq);
    }

    #[test]
    fn a_dirty_device_is_refused_and_nothing_is_written() {
        let clean = formatted("c", BackingState::Clean, StaleCopies::None);
        let dirty = formatted("d", BackingState::Dirty, StaleCopies::Clean);
        let before = (header(&clean), header(&dirty));
        let e = prep(&[("c.img", &clean), ("d.img", &dirty)], false)
            .err()
            .unwrap()
            .to_string();
        for needle in [
            "d.img",
            "'d'",
            "is dirty",
            "/gone/cache.img",
            "no such file",
            "--without-cache-discard-dirty",
        ] {
            assert!(e.contains(needle), "{needle:?} not in {e}");
        }
        assert_eq!((header(&clean), header(&dirty)), before);
        prep(&[("c.img", &clean), ("d.img", &dirty)], true).unwrap();
        assert_eq!(header(&dirty).stale, StaleCopies::All);
        assert_eq!(header(&dirty).state, BackingState::Dirty);
        // Given up before: served without asking again.
        prep(&[("d.img", &dirty)], false).unwrap();
    }

    #[test]
    fn the_export_is_the_data_area() {
        let dev = formatted("x", BackingState::Clean, StaleCopies::None);
        let w = prep(&[("x.img", &dev)], false).unwrap();
        let area = &w.volumes[0].export.dev;
        assert_eq!(area.size_bytes(), header(&dev).data_size);
        area.write_at(&[7u8; 512], 0).unwrap();
        let mut raw = [0u8; 512];
        dev.read_at(&mut raw, engine::format::BACKING_DATA_OFFSET)
            .unwrap();
        assert_eq!(raw, [7u8; 512]);
        assert!(area.write_at(&[0u8; 512], area.size_bytes()).is_err());
        // The headers are untouched.
        assert_eq!(header(&dev).label, "x");
    }
}
