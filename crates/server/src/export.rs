//! The [`Export`] trait the server serves, and the live [`ExportRegistry`] of exports.
//!
//! Owns: which exports exist right now, and which connections use each one. Exports can be
//! added and removed while the server runs; removal hands back a [`Detached`] that can wait
//! until the last connection is gone, so the embedder can safely tear the export down.
//!
//! Removal and the clients still connected: from the moment an export is removed, no request
//! of its connections reaches it — every request read from then on is answered with
//! `NBD_ESHUTDOWN` (see `execute::admit`) — and each connection is closed once it has been
//! idle (nothing in flight, nothing arriving) for [`REMOVED_IDLE_CLOSE`], or after
//! [`REMOVED_CLOSE_MAX`] whatever it does, as a shutdown for reading: requests in flight are
//! answered first. So a client that is still sending is not cut off (for up to
//! `REMOVED_CLOSE_MAX`) with requests it sent unanswered: the kernel's NBD client waits
//! forever for the reply of a request it sent on a connection that then died (without a
//! timeout set, the default of `nbd-client`), which left the filesystem on `/dev/nbd0` and
//! its writers blocked after a `detach`; answered with errors, they fail.
//!
//! Invariants: export names are unique in the registry; once an entry is marked removed no new
//! connection can attach to it (both happen under the entry's lock); a connection attached to
//! an entry is counted until its lease is dropped.
//!
//! Fault model: exports report failures as `io::Error`, which the server turns into NBD error
//! replies; a panicking export is a programmer error: it is logged and the request gets an EIO
//! reply (the connection goes on).

use crate::net::Stream;
use crate::table::Activity;
use nbd_proto::{BlockSize, ExportCaps, ExportCatalog, ExportInfo, ExportListing, ValidRequest};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// A connection of a removed export idle this long is closed.
pub const REMOVED_IDLE_CLOSE: Duration = Duration::from_secs(1);
/// A connection of a removed export is closed this long after the removal at the latest.
pub const REMOVED_CLOSE_MAX: Duration = Duration::from_secs(30);

/// A block device served over NBD. Offsets and lengths passed in are already validated: inside
/// the export, aligned to 512 bytes (or ending at the end of an export whose size is not a
/// multiple of 512), and never longer than 32 MiB for reads and writes.
pub trait Export: Send + Sync + 'static {
    fn name(&self) -> String;
    fn description(&self) -> String;
    fn size_bytes(&self) -> u64;
    fn is_rotational(&self) -> bool;
    fn read_only(&self) -> bool;
    /// Whether write-zeroes is always fast (advertises `NBD_FLAG_SEND_FAST_ZERO`).
    fn can_fast_zero(&self) -> bool {
        false
    }
    /// Whether flush and FUA are visible across connections (advertises `CAN_MULTI_CONN`).
    fn can_multi_conn(&self) -> bool {
        true
    }
    /// Whether serving `request` waits on no slow device (a cache hit, a write the cache
    /// absorbs, a device measured fast). The connection then executes it on the thread that
    /// read it without first waking another to read on; a wrong `true` delays a request sent
    /// meanwhile by this one's time, a wrong `false` costs a thread hand-over.
    fn is_quick(&self, _request: &ValidRequest) -> bool {
        false
    }
    /// Memory a read of `length` bytes may hold while it runs beyond its reply buffer (a copy
    /// the export makes, such as a cache's miss fill). The server takes it from the request
    /// budget (`bytes_in_flight_max`) with the reply, so the budget bounds what requests in
    /// flight hold, not just the server's own buffers.
    fn read_working_bytes(&self, _length: u64) -> u64 {
        0
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Starts a read of `len` bytes at `offset` for a server that does its own asynchronous
    /// I/O (the io_uring data path; see [`Start`]). Called on the data path's event-loop
    /// thread, so it must not block. The default: the whole read through [`Export::read`], on
    /// a worker thread.
    fn start_read(&self, _offset: u64, _len: usize) -> Start {
        Start::Whole
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()>;
    /// Starts a write of `len` bytes at `offset` on the io_uring data path (see [`Start`]);
    /// called on the event-loop thread, so it must not block. The default: the whole write
    /// through [`Export::write`], on a worker thread.
    fn start_write(&self, _offset: u64, _len: usize, _fua: bool) -> Start {
        Start::Whole
    }
    fn flush(&self) -> io::Result<()>;
    /// How many times writes this export had acknowledged were lost below it for good (see
    /// [`LossWatch`](crate::LossWatch)): a count that only grows. Each connection fails its
    /// next flush or FUA write once after it grew. The default: nothing is ever lost.
    fn losses(&self) -> u64 {
        0
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()>;
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, no_hole: bool) -> io::Result<()>;
    /// Prefetch hint.
    fn cache(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Consecutive extents from `offset` as (length in bytes, `NBD_STATE_*` flags); may cover
    /// less than `len` but must not be empty.
    fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>>;
}

/// How a read or write goes on the io_uring data path ([`Export::start_read`],
/// [`Export::start_write`]).
pub enum Start {
    /// Through [`Export::read`] or [`Export::write`], on a worker thread.
    Whole,
    /// The rest of the request, decided already (the export noted it), on a worker thread:
    /// it may block.
    Rest(Rest),
    /// Device I/O the server submits itself, then [`DirectIo::finish`].
    Direct(Box<dyn DirectIo>),
    /// The request fails at once.
    Failed(io::Error),
}

/// The rest of a request, run on a worker thread with the request's buffer (a read's reply
/// data to fill, a write's payload).
pub type Rest = Box<dyn FnOnce(&mut [u8]) -> io::Result<()> + Send>;

/// One device I/O of a [`DirectIo`]: `len` bytes at `offset` of its descriptor, to or from
/// the request's buffer at `buf_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceIo {
    pub offset: u64,
    pub buf_offset: usize,
    pub len: usize,
}

/// A request the server carries out with its own asynchronous I/O: every [`DeviceIo`]
/// through [`DirectIo::fd`] (reads into the reply buffer, or with [`DirectIo::writes`] writes
/// from the payload; 4 KiB-aligned), then `finish`. Dropping it unfinished (its connection
/// went away) abandons it.
pub trait DirectIo: Send {
    /// The descriptor; open at least as long as `self` lives.
    fn fd(&self) -> std::os::fd::RawFd;
    fn pieces(&self) -> &[DeviceIo];
    /// Whether the pieces are written (from the buffer) rather than read (into it).
    fn writes(&self) -> bool {
        false
    }
    /// A connection of a remote device lent for this one request: the server sends the
    /// request on it and reads its reply ([`RemoteIo`]) instead of doing the pieces at `fd`.
    fn remote(&mut self) -> Option<&mut dyn RemoteIo> {
        None
    }
    /// After every piece ended: `result` is the first error among them (`Ok` if all were
    /// whole). Checks and accounts the request; `Again`: the rest must be done the slow way,
    /// on a worker thread, with the same buffer.
    fn finish(self: Box<Self>, buf: &mut [u8], result: io::Result<()>) -> Finished;
}

/// One NBD request on a connection lent whole to the server (the export's remote backing
/// device), on the descriptor [`DirectIo::fd`]: the server sends [`RemoteIo::request`] (a
/// write's payload, the request's buffer, right after it), reads the reply header (16
/// bytes), hands it to [`RemoteIo::reply`], reads the data it says follows into the buffer
/// and calls [`RemoteIo::done`]; an operation on the socket that fails or ends short ends
/// the request with [`RemoteIo::failed`]. Past [`RemoteIo::deadline`] the server calls
/// [`RemoteIo::abort`], which makes its operations end. Then, in every case,
/// [`DirectIo::finish`].
pub trait RemoteIo {
    /// The request's header (28 bytes), to send first.
    fn request(&mut self) -> &[u8];
    /// `Ok(n)`: the request succeeded and `n` bytes of data follow; `Err`: it failed.
    fn reply(&mut self, header: &[u8]) -> io::Result<usize>;
    /// Everything of the reply was read.
    fn done(&mut self);
    fn deadline(&self) -> std::time::Instant;
    fn abort(&mut self);
    /// The connection is broken (an operation ended with `res`: a negative errno, 0 for the
    /// peer's end; or `-EPROTO`, the reply broke the protocol): never reused. Returns the
    /// request's error.
    fn failed(&mut self, res: i32) -> io::Error;
}

/// What a finished [`DirectIo`] leaves to do.
pub enum Finished {
    /// Done: a read's data is in the buffer (or the request failed).
    Done(io::Result<()>),
    /// The rest, on a worker thread.
    Again(Rest),
}

/// Builds what a client learns about an export during the handshake.
pub(crate) fn export_info(export: &dyn Export) -> ExportInfo {
    let read_only = export.read_only();
    ExportInfo {
        name: export.name(),
        description: export.description(),
        size_bytes: export.size_bytes(),
        caps: ExportCaps {
            read_only,
            flush: true,
            fua: true,
            trim: !read_only,
            write_zeroes: !read_only,
            fast_zero: export.can_fast_zero(),
            cache: true,
            multi_conn: export.can_multi_conn(),
            rotational: export.is_rotational(),
        },
        block_size: BlockSize::TIERCACHE,
    }
}

struct Entry {
    export: Arc<dyn Export>,
    /// Set once, under the state's lock, when the export is removed: read under that lock by
    /// `attach` (no connection attaches afterwards), and by the connections for every request
    /// they receive.
    removed: Arc<AtomicBool>,
    state: Mutex<EntryState>,
    idle: Condvar,
}

#[derive(Default)]
struct EntryState {
    /// Connection id → its socket (shared, not duplicated) and activity, to close it once it
    /// is idle after a removal.
    connections: HashMap<u64, (Arc<Stream>, Arc<Activity>)>,
}

impl Entry {
    fn lock(&self) -> MutexGuard<'_, EntryState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The set of exports a server offers; cheap to clone, shared by all clones.
#[derive(Clone, Default)]
pub struct ExportRegistry {
    entries: Arc<RwLock<BTreeMap<String, Arc<Entry>>>>,
}

impl ExportRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Entry>>> {
        self.entries.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Entry>>> {
        self.entries.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds an export under `export.name()`; fails with `AlreadyExists` if the name is taken.
    pub fn add(&self, export: Arc<dyn Export>) -> io::Result<()> {
        let name = export.name();
        if name.len() > nbd_proto::wire::STRING_BYTES_MAX || name.contains('\0') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "export name must be at most 4096 bytes without NUL",
            ));
        }
        let mut entries = self.write();
        if entries.contains_key(&name) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("export {name:?} already exists"),
            ));
        }
        entries.insert(
            name,
            Arc::new(Entry {
                export,
                removed: Arc::new(AtomicBool::new(false)),
                state: Mutex::new(EntryState::default()),
                idle: Condvar::new(),
            }),
        );
        Ok(())
    }

    /// Removes an export: new clients can no longer open it, requests of its current
    /// connections are refused from now on (`NBD_ESHUTDOWN`), and each connection is closed
    /// once idle (see the module's header) by a thread of its own.
    pub fn remove(&self, name: &str) -> Option<Detached> {
        let entry = self.write().remove(name)?;
        let state = entry.lock();
        entry.removed.store(true, Ordering::SeqCst);
        drop(state);
        let closer = Arc::clone(&entry);
        let spawned = std::thread::Builder::new()
            .name("export-close".into())
            .spawn(move || close_when_idle(&closer));
        if let Err(err) = spawned {
            log::warn!("export {name:?} removed: closing its connections now ({err})");
            for (stream, _) in entry.lock().connections.values() {
                stream.shutdown(Shutdown::Read);
            }
        }
        Some(Detached { entry })
    }

    /// The export registered under `name`.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Export>> {
        self.read().get(name).map(|e| Arc::clone(&e.export))
    }

    /// Names of all exports, sorted.
    pub fn names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Registers connection `id` as a user of export `name`.
    pub(crate) fn attach(
        &self,
        name: &str,
        id: u64,
        stream: Arc<Stream>,
        activity: Arc<Activity>,
    ) -> Option<Lease> {
        let entry = Arc::clone(self.read().get(name)?);
        let mut state = entry.lock();
        if entry.removed.load(Ordering::SeqCst) {
            return None;
        }
        state.connections.insert(id, (stream, activity));
        drop(state);
        Some(Lease { entry, id })
    }
}

/// Closes the connections of a removed export: each once it has been idle for
/// `REMOVED_IDLE_CLOSE`, the rest `REMOVED_CLOSE_MAX` after the removal; returns when none
/// is left or at that deadline.
fn close_when_idle(entry: &Entry) {
    let deadline = Instant::now() + REMOVED_CLOSE_MAX;
    let mut state = entry.lock();
    loop {
        if state.connections.is_empty() {
            return;
        }
        let now = Instant::now();
        let late = now >= deadline;
        for (stream, activity) in state.connections.values() {
            if late || activity.close_if_idle(REMOVED_IDLE_CLOSE, now) {
                stream.shutdown(Shutdown::Read);
            }
        }
        if late {
            return;
        }
        // Woken when a connection goes; otherwise looks again soon.
        state = entry
            .idle
            .wait_timeout(state, Duration::from_millis(100))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

impl ExportCatalog for ExportRegistry {
    fn list(&self) -> Vec<ExportListing> {
        self.read()
            .values()
            .map(|e| ExportListing {
                name: e.export.name(),
                description: e.export.description(),
            })
            .collect()
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        self.read()
            .get(name)
            .map(|e| export_info(e.export.as_ref()))
    }
}

/// A connection's claim on an export; unregisters on drop.
pub(crate) struct Lease {
    entry: Arc<Entry>,
    id: u64,
}

impl Lease {
    pub(crate) fn export(&self) -> &Arc<dyn Export> {
        &self.entry.export
    }

    /// Set once the export is removed (see `execute::admit`).
    pub(crate) fn removed(&self) -> &Arc<AtomicBool> {
        &self.entry.removed
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = self.entry.lock();
        state.connections.remove(&self.id);
        drop(state);
        self.entry.idle.notify_all();
    }
}

/// An export removed from the registry whose connections may still be draining.
pub struct Detached {
    entry: Arc<Entry>,
}

impl Detached {
    /// Connections still using the export.
    pub fn connection_count(&self) -> usize {
        self.entry.lock().connections.len()
    }

    /// Waits until no connection uses the export, then returns it; on timeout returns `self`.
    pub fn wait_idle(self, timeout: Duration) -> Result<Arc<dyn Export>, Detached> {
        let deadline = Instant::now() + timeout;
        let mut state = self.entry.lock();
        while !state.connections.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                return Err(self);
            }
            state = self
                .entry
                .idle
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(state);
        Ok(Arc::clone(&self.entry.export))
    }
}

impl std::fmt::Debug for Detached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Detached")
            .field("name", &self.entry.export.name())
            .field("connections", &self.connection_count())
            .finish()
    }
}
