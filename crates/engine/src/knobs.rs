//! Per-device knobs (bcache's sysfs names): their defaults, their valid ranges, and the one
//! validation every value passes before it is applied in memory or persisted in the backing
//! header — whether it comes from `tiercache set`, the config file or `make --label`.
//!
//! Invariants: the ranges and the label alphabet here are the only definition of what is
//! valid; a value that fails validation changes nothing, in memory or on disk; a label that
//! passes is non-empty, at most `LABEL_BYTES` bytes of `[A-Za-z0-9._-]`, starts with a letter
//! or digit and is not a UUID, so it is always a usable NBD export name that cannot be taken
//! for an option, a hidden file or another device's uuid-derived name.
//!
//! Fault model: values come from operators and config files (untrusted); labels already on a
//! device may predate these rules and are re-checked where they are used as names.

use crate::types::{CacheMode, Error, Result};

/// Bytes a label may have (the backing header and superblock give it this much room).
pub const LABEL_BYTES: usize = 64;

pub const DEFAULT_SEQUENTIAL_CUTOFF: u64 = 4 << 20;
pub const DEFAULT_WRITEBACK_PERCENT: u32 = 10;
pub const DEFAULT_WRITEBACK_DELAY_SECS: u64 = 30;
pub const DEFAULT_WRITEBACK_RUNNING: bool = true;

/// Largest `sequential_cutoff` (0 turns the cutoff off; 1 GiB is far past any stream worth
/// keeping out of the cache).
pub const SEQUENTIAL_CUTOFF_MAX: u64 = 1 << 30;
pub const WRITEBACK_PERCENT_MAX: u32 = 100;
/// Longest `writeback_delay`: one day.
pub const WRITEBACK_DELAY_SECS_MAX: u64 = 86_400;

/// The tunable knobs of one device that live in its backing header besides mode and label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tunables {
    pub sequential_cutoff: u64,
    pub writeback_percent: u32,
    pub writeback_delay_secs: u64,
    pub writeback_running: bool,
}

impl Default for Tunables {
    fn default() -> Self {
        Tunables {
            sequential_cutoff: DEFAULT_SEQUENTIAL_CUTOFF,
            writeback_percent: DEFAULT_WRITEBACK_PERCENT,
            writeback_delay_secs: DEFAULT_WRITEBACK_DELAY_SECS,
            writeback_running: DEFAULT_WRITEBACK_RUNNING,
        }
    }
}

/// One knob change, already parsed; [`Knob::validate`] checks its range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Knob {
    CacheMode(CacheMode),
    SequentialCutoff(u64),
    WritebackPercent(u32),
    WritebackDelaySecs(u64),
    WritebackRunning(bool),
    Label(String),
}

impl Knob {
    /// The knobs' names, as `tiercache set` and the config file spell them.
    pub const NAMES: [&'static str; 6] = [
        "cache_mode",
        "sequential_cutoff",
        "writeback_percent",
        "writeback_delay",
        "writeback_running",
        "label",
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Knob::CacheMode(_) => "cache_mode",
            Knob::SequentialCutoff(_) => "sequential_cutoff",
            Knob::WritebackPercent(_) => "writeback_percent",
            Knob::WritebackDelaySecs(_) => "writeback_delay",
            Knob::WritebackRunning(_) => "writeback_running",
            Knob::Label(_) => "label",
        }
    }

    /// Checks the value's range (or alphabet); `Error::Invalid` says what is accepted.
    pub fn validate(&self) -> Result<()> {
        let range = |what: &str, v: u64, max: u64, unit: &str| {
            if v > max {
                Err(Error::Invalid(format!(
                    "{what} {v} is out of range (0 to {max}{unit})"
                )))
            } else {
                Ok(())
            }
        };
        match self {
            Knob::CacheMode(_) | Knob::WritebackRunning(_) => Ok(()),
            Knob::SequentialCutoff(v) => {
                range("sequential_cutoff", *v, SEQUENTIAL_CUTOFF_MAX, " bytes")
            }
            Knob::WritebackPercent(v) => range(
                "writeback_percent",
                u64::from(*v),
                u64::from(WRITEBACK_PERCENT_MAX),
                "",
            ),
            Knob::WritebackDelaySecs(v) => {
                range("writeback_delay", *v, WRITEBACK_DELAY_SECS_MAX, " seconds")
            }
            Knob::Label(l) => validate_label(l),
        }
    }
}

/// Checks a label (see the module invariants).
pub fn validate_label(label: &str) -> Result<()> {
    let bad = |why: String| Err(Error::Invalid(format!("label {label:?} {why}")));
    if label.is_empty() {
        return bad("is empty (a device needs a name to be exported by)".into());
    }
    if label.len() > LABEL_BYTES {
        return bad(format!("is longer than {LABEL_BYTES} bytes"));
    }
    if let Some(c) = label
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return bad(format!(
            "contains {c:?}; use letters, digits, '.', '_' and '-'"
        ));
    }
    if !label.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return bad("must start with a letter or digit".into());
    }
    if uuid::Uuid::parse_str(label).is_ok() {
        return bad("looks like a uuid (export names of unlabelled devices are uuids)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for ok in ["data", "vm-01", "a", "A.b_c-9", &"x".repeat(LABEL_BYTES)] {
            validate_label(ok).unwrap_or_else(|e| panic!("{ok:?} refused: {e}"));
        }
        for bad in [
            "",
            "a\0b",
            "with space",
            "slash/",
            "-opt",
            ".hidden",
            "é",
            "new\nline",
            &"x".repeat(LABEL_BYTES + 1),
            "6f1c1a52-1d3b-4a6e-9a57-1e0a6c1f2b3d",
        ] {
            assert!(
                matches!(validate_label(bad), Err(Error::Invalid(_))),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn ranges() {
        assert!(Knob::SequentialCutoff(SEQUENTIAL_CUTOFF_MAX)
            .validate()
            .is_ok());
        assert!(Knob::SequentialCutoff(SEQUENTIAL_CUTOFF_MAX + 1)
            .validate()
            .is_err());
        assert!(Knob::WritebackPercent(100).validate().is_ok());
        assert!(Knob::WritebackPercent(101).validate().is_err());
        assert!(Knob::WritebackDelaySecs(WRITEBACK_DELAY_SECS_MAX)
            .validate()
            .is_ok());
        assert!(Knob::WritebackDelaySecs(WRITEBACK_DELAY_SECS_MAX + 1)
            .validate()
            .is_err());
        assert!(Knob::Label("ok".into()).validate().is_ok());
        assert!(Knob::Label(String::new()).validate().is_err());
    }
}
