//! Small value types shared by the engine: identifiers, cache modes, the error type.
//!
//! Invariants: every on-disk code of an enum is parsed with a checked conversion
//! (`from_code`) that rejects unknown values. `DevId` keeps its number private like the
//! numbering units (buckets, cache blocks, generations, backing blocks), which are in `units`:
//! `DevId::new` and `DevId::get` for encodings, `idx` for the per-device tables, `Display`
//! prints the bare number.

use std::fmt;
use std::io;

/// Identifies a backing device inside a cache set (stable across restarts, stored on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevId(u32);

impl DevId {
    /// Device `n` (the number stored in its header and in journal entries).
    pub const fn new(n: u32) -> DevId {
        DevId(n)
    }

    /// The device's number, for encodings (journal, checkpoint, the packed owner).
    pub const fn get(self) -> u32 {
        self.0
    }

    /// For indexing the per-device tables (the index's counters).
    pub fn idx(self) -> usize {
        self.0 as usize
    }
}

/// The bare number, as messages printed it before `DevId` was a type.
impl fmt::Display for DevId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// How writes (and read misses) of a backing device use the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheMode {
    /// Writes go to the backing device and the cache; reads are cached.
    #[default]
    Writethrough,
    /// Writes go to the cache only (dirty) and are written back later; reads are cached.
    Writeback,
    /// Writes go to the backing device only (invalidating the cache); reads are cached.
    Writearound,
    /// Nothing new enters the cache; dirty data already there is still served.
    None,
}

impl CacheMode {
    pub const ALL: [CacheMode; 4] = [
        CacheMode::Writethrough,
        CacheMode::Writeback,
        CacheMode::Writearound,
        CacheMode::None,
    ];

    pub fn code(self) -> u8 {
        match self {
            CacheMode::Writethrough => 0,
            CacheMode::Writeback => 1,
            CacheMode::Writearound => 2,
            CacheMode::None => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Writethrough => "writethrough",
            CacheMode::Writeback => "writeback",
            CacheMode::Writearound => "writearound",
            CacheMode::None => "none",
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown cache mode '{s}' (expected writethrough, writeback, writearound or none)"))
    }
}

/// Errors of the engine. Operating errors only: programmer errors panic.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error from a device, with what the engine was doing.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A request the caller should not have made (unaligned, past the end, unknown device),
    /// or a value out of range (a knob, a geometry). The message says what is wrong and what
    /// is accepted, and is shown to operators as it is (no prefix: it often reaches them as
    /// the answer to `tiercache set` or `make`).
    #[error("{0}")]
    Invalid(String),
    /// Metadata on a device failed validation.
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
    /// The device holds no tiercache metadata at all (no copy carries our magic): it was never
    /// formatted, or something else overwrote every copy. Distinct from `Corrupt`, which means
    /// our metadata is there but damaged.
    #[error("{0}")]
    Unformatted(String),
    /// Cached data failed its checksum and no good copy exists (dirty data).
    #[error("data checksum mismatch on dirty data: {0}")]
    DataCorrupt(String),
    /// The operation conflicts with the current state (device attached elsewhere, ...).
    #[error("{0}")]
    State(String),
}

impl Error {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        match e {
            Error::Io { context, source } => {
                io::Error::new(source.kind(), format!("{context}: {source}"))
            }
            Error::Invalid(m) => io::Error::new(io::ErrorKind::InvalidInput, m),
            other => io::Error::other(other.to_string()),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand: run a device call and attach context to its error.
pub(crate) trait IoContext<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(what(), e))
    }
}
