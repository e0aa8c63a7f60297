//! Test support: an in-memory [`Export`] and a gated wrapper of it, a server on a temporary unix socket, and gating for
//! external tools (a missing tool fails the test under `CI=true`, and is skipped with a notice
//! otherwise).
#![allow(dead_code)] // Each test binary uses a different part of this module.

use server::{BindAddr, Export, ExportRegistry, ServerConfig, ServerHandle, ValidRequest};
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Granularity of the allocation map of [`MemExport`].
pub const MAP_BLOCK_BYTES: u64 = 4096;
const STATE_HOLE: u32 = 1;
const STATE_ZERO: u32 = 2;

/// A RAM disk with a per-4 KiB allocation map (data, zero, or hole+zero).
pub struct MemExport {
    name: String,
    read_only: bool,
    data: RwLock<(Vec<u8>, Vec<u32>)>,
    pub flushes: AtomicU64,
    pub writes: AtomicU64,
}

impl MemExport {
    pub fn new(name: &str, size_bytes: u64) -> Arc<MemExport> {
        Self::with_mode(name, size_bytes, false)
    }

    pub fn with_mode(name: &str, size_bytes: u64, read_only: bool) -> Arc<MemExport> {
        let blocks = size_bytes.div_ceil(MAP_BLOCK_BYTES) as usize;
        Arc::new(MemExport {
            name: name.to_string(),
            read_only,
            data: RwLock::new((
                vec![0; size_bytes as usize],
                vec![STATE_HOLE | STATE_ZERO; blocks],
            )),
            flushes: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        })
    }

    pub fn contents(&self) -> Vec<u8> {
        self.data.read().unwrap().0.clone()
    }

    pub fn fill(&self, bytes: &[u8]) {
        let mut d = self.data.write().unwrap();
        d.0[..bytes.len()].copy_from_slice(bytes);
        let last = bytes.len().div_ceil(MAP_BLOCK_BYTES as usize);
        d.1[..last].iter_mut().for_each(|s| *s = 0);
    }

    fn mark(map: &mut [u32], offset: u64, len: u64, state: u32, whole_blocks_only: bool) {
        let (mut first, mut last) = (
            offset / MAP_BLOCK_BYTES,
            (offset + len).div_ceil(MAP_BLOCK_BYTES),
        );
        if whole_blocks_only {
            first = offset.div_ceil(MAP_BLOCK_BYTES);
            last = (offset + len) / MAP_BLOCK_BYTES;
        }
        for s in map.iter_mut().take(last as usize).skip(first as usize) {
            *s = state;
        }
    }
}

impl Export for MemExport {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn description(&self) -> String {
        format!("in-memory test export {}", self.name)
    }
    fn size_bytes(&self) -> u64 {
        self.data.read().unwrap().0.len() as u64
    }
    fn is_rotational(&self) -> bool {
        false
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn can_fast_zero(&self) -> bool {
        true
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let d = self.data.read().unwrap();
        buf.copy_from_slice(&d.0[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> io::Result<()> {
        let mut d = self.data.write().unwrap();
        d.0[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Self::mark(&mut d.1, offset, data.len() as u64, 0, false);
        self.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len, false, false)
    }
    fn write_zeroes(&self, offset: u64, len: u64, _fua: bool, no_hole: bool) -> io::Result<()> {
        let mut d = self.data.write().unwrap();
        d.0[offset as usize..(offset + len) as usize].fill(0);
        let state = if no_hole {
            STATE_ZERO
        } else {
            STATE_HOLE | STATE_ZERO
        };
        // Partially covered blocks stay allocated (data).
        Self::mark(&mut d.1, offset, len, 0, false);
        Self::mark(&mut d.1, offset, len, state, true);
        Ok(())
    }
    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        let d = self.data.read().unwrap();
        let end = offset + len;
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let block = pos / MAP_BLOCK_BYTES;
            let next = ((block + 1) * MAP_BLOCK_BYTES).min(end);
            out.push((next - pos, d.1[block as usize]));
            pos = next;
        }
        Ok(out)
    }
}

/// A server on a temporary unix socket; shut down on drop.
pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    handle: Option<ServerHandle>,
}

impl TestServer {
    pub fn start(exports: Vec<Arc<dyn Export>>) -> TestServer {
        Self::start_with(exports, ServerConfig::default())
    }

    /// Starts a server; a configuration on the default data path (`Auto`) takes the one
    /// `TIERCACHE_DATA_PATH` names, so the suite runs on either (CI runs it both ways).
    pub fn start_with(exports: Vec<Arc<dyn Export>>, mut config: ServerConfig) -> TestServer {
        if config.data_path == server::DataPath::Auto {
            if let Ok(path) = std::env::var("TIERCACHE_DATA_PATH") {
                config.data_path = path.parse().expect("TIERCACHE_DATA_PATH");
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbd.sock");
        let registry = ExportRegistry::new();
        for e in exports {
            registry.add(e).unwrap();
        }
        let handle = server::start(&BindAddr::Unix(socket.clone()), registry, config).unwrap();
        TestServer {
            dir,
            socket,
            handle: Some(handle),
        }
    }

    pub fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }

    pub fn uri(&self, export: &str) -> String {
        self.handle().local_addr().uri(export)
    }

    pub fn shutdown(mut self) {
        self.handle.take().unwrap().shutdown();
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.shutdown();
        }
    }
}

/// True if `program` runs; else fails under `CI=true` or prints a skip.
pub fn require(program: &str, probe_args: &[&str]) -> bool {
    test_support::runs(program, probe_args)
}

/// A python interpreter that can `import nbd` (python3-libnbd), if any.
pub fn python_with_nbd() -> Option<String> {
    for candidate in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(candidate)
            .args(["-c", "import nbd"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Some(candidate.to_string());
        }
    }
    test_support::unavailable("python3 with the nbd module (python3-libnbd)");
    None
}

/// Runs a command and panics with its output unless it succeeds.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a python script from `tests/scripts` with the given arguments.
pub fn run_python(python: &str, script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/scripts")
        .join(script);
    let out = run_ok(Command::new(python).arg(path).args(args));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Byte stream for [`RawClient`].
pub trait Io: io::Read + io::Write + Send {}
impl<T: io::Read + io::Write + Send> Io for T {}

/// Turns a connection into TLS after `NBD_OPT_STARTTLS` was acknowledged.
pub type Upgrade = Box<dyn FnOnce() -> io::Result<Box<dyn Io>>>;

/// A TLS client stream for [`RawClient`]: reads through the session's reader, writes through
/// the session (one thread, so no write lock is needed).
pub struct TlsIo<S: io::Read> {
    reader: nbd_tls::TlsReader<S>,
    writer: S,
}

impl<S: io::Read + io::Write + Send + 'static> TlsIo<S> {
    /// The client side of TLS over a socket (two handles to it), handshake done.
    pub fn connect(reader: S, mut writer: S, tls: &nbd_tls::ClientTls) -> io::Result<TlsIo<S>> {
        let session = Arc::new(nbd_tls::Session::client(tls)?);
        let mut reader = nbd_tls::TlsReader::new(session, reader, &[]);
        reader.handshake(&mut writer)?;
        Ok(TlsIo { reader, writer })
    }

    /// An [`Upgrade`] to TLS over `socket`.
    pub fn upgrade(socket: S, clone: S, tls: nbd_tls::ClientTls) -> Upgrade {
        Box::new(move || Ok(Box::new(TlsIo::connect(socket, clone, &tls)?) as Box<dyn Io>))
    }
}

impl<S: io::Read> io::Read for TlsIo<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl<S: io::Read + io::Write> io::Write for TlsIo<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.reader
            .session()
            .write_all(&mut self.writer, &[buf])
            .map(|()| buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A minimal NBD client built on `nbd-proto`'s client side, for tests that need exact control
/// over the bytes on the wire.
pub struct RawClient {
    pub stream: Box<dyn Io>,
    pub negotiated: nbd_proto::ClientNegotiated,
    input: Vec<u8>,
}

impl RawClient {
    pub fn connect_unix(path: &Path, export: &str, structured: bool) -> io::Result<RawClient> {
        let stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
        Self::handshake(Box::new(stream), export, structured)
    }

    pub fn handshake(stream: Box<dyn Io>, export: &str, structured: bool) -> io::Result<RawClient> {
        Self::handshake_upgrading(stream, export, structured, None)
    }

    /// The handshake; with `upgrade`, `NBD_OPT_STARTTLS` comes first and, once acknowledged,
    /// `upgrade` gives the stream to use from then on (TLS over the same socket).
    pub fn handshake_upgrading(
        mut stream: Box<dyn Io>,
        export: &str,
        structured: bool,
        mut upgrade: Option<Upgrade>,
    ) -> io::Result<RawClient> {
        use nbd_proto::{ClientConfig, ClientEvent, ClientHandshake};
        let mut hs = ClientHandshake::new(ClientConfig {
            export_name: export.to_string(),
            structured_replies: structured,
            meta_contexts: vec![nbd_proto::BASE_ALLOCATION.to_string()],
        });
        if upgrade.is_some() {
            hs = hs.with_starttls();
        }
        let mut buf = [0u8; 4096];
        loop {
            let event = hs.poll().map_err(io::Error::from)?;
            stream.write_all(&hs.take_output())?;
            match event {
                ClientEvent::Done(negotiated) => {
                    return Ok(RawClient {
                        stream,
                        input: negotiated.leftover.clone(),
                        negotiated,
                    })
                }
                ClientEvent::StartTls => {
                    let upgrade = upgrade.take().expect("STARTTLS only when asked for");
                    stream = upgrade()?;
                    continue;
                }
                ClientEvent::NeedInput => {}
            }
            let n = stream.read(&mut buf)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            hs.feed(&buf[..n]);
        }
    }

    pub fn send(
        &mut self,
        command: nbd_proto::Command,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        let mut out = Vec::new();
        nbd_proto::Request {
            flags: nbd_proto::CommandFlags(flags),
            command,
            cookie,
            offset,
            length,
        }
        .encode(&mut out);
        out.extend_from_slice(payload);
        self.stream.write_all(&out)
    }

    fn fill(&mut self, at_least: usize) -> io::Result<()> {
        let mut buf = vec![0u8; 64 * 1024];
        while self.input.len() < at_least {
            let n = self.stream.read(&mut buf)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.input.extend_from_slice(&buf[..n]);
        }
        Ok(())
    }

    /// Receives one reply; `simple_read_len` gives the data length that follows a successful
    /// simple reply with that cookie (0 if none).
    pub fn recv(
        &mut self,
        simple_read_len: impl Fn(u64) -> usize,
    ) -> io::Result<(nbd_proto::Reply, Vec<u8>)> {
        use nbd_proto::{decode_reply, Decoded, Reply};
        loop {
            match decode_reply(&self.input, 64 << 20).map_err(io::Error::from)? {
                Decoded::Needed(n) => self.fill(n)?,
                Decoded::Done { value, consumed } => {
                    self.input.drain(..consumed);
                    let mut data = Vec::new();
                    if let Reply::Simple {
                        cookie,
                        error: None,
                    } = value
                    {
                        let n = simple_read_len(cookie);
                        self.fill(n)?;
                        data = self.input.drain(..n).collect();
                    }
                    return Ok((value, data));
                }
            }
        }
    }

    /// Sends one request and collects its whole reply: (error, data chunks flattened, extents).
    pub fn call(
        &mut self,
        command: nbd_proto::Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<CallResult> {
        use nbd_proto::{Chunk, NbdErrno, Reply};
        let cookie = 0xc0ffee;
        self.send(command, flags, cookie, offset, length, payload)?;
        let read_len = if command == nbd_proto::Command::Read {
            length as usize
        } else {
            0
        };
        let mut result = CallResult::default();
        loop {
            let (reply, data) = self.recv(|_| read_len)?;
            match reply {
                Reply::Simple { cookie: c, error } => {
                    assert_eq!(c, cookie);
                    result.error = error;
                    result.data = data;
                    return Ok(result);
                }
                Reply::Chunk {
                    cookie: c,
                    done,
                    chunk,
                } => {
                    assert_eq!(c, cookie);
                    match chunk {
                        Chunk::OffsetData { offset: o, data } => {
                            assert_eq!(o, offset + result.data.len() as u64);
                            result.data.extend_from_slice(&data);
                        }
                        Chunk::BlockStatus { extents, .. } => {
                            result.extents = extents.iter().map(|e| (e.length, e.flags)).collect()
                        }
                        Chunk::Error { error, .. } => result.error = NbdErrno::from_wire(error),
                        Chunk::None => {}
                        other => panic!("unexpected chunk {other:?}"),
                    }
                    if done {
                        return Ok(result);
                    }
                }
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct CallResult {
    pub error: Option<nbd_proto::NbdErrno>,
    pub data: Vec<u8>,
    pub extents: Vec<(u32, u32)>,
}

/// Reads starting below this offset wait for the gate of a [`GateExport`].
pub const GATED_BELOW: u64 = 64 * 1024;
/// A gate never opened by a broken test still opens after this, so the server can shut down.
pub const GATE_TIMEOUT: Duration = Duration::from_secs(20);

/// Wraps a [`MemExport`]: reads below [`GATED_BELOW`] wait until the gate opens; reads at offset
/// [`PANIC_AT`] panic; counts requests inside the export and whether buffers were aligned.
pub struct GateExport {
    pub inner: Arc<MemExport>,
    open: Mutex<bool>,
    opened: Condvar,
    inside: Mutex<usize>,
    inside_changed: Condvar,
    pub inside_max: AtomicUsize,
    pub misaligned: AtomicBool,
    /// When set, every request but a gated read says it is quick (`Export::is_quick`).
    pub quick: AtomicBool,
}

/// Reads of a [`GateExport`] at this offset panic.
pub const PANIC_AT: u64 = 1024 * 1024;

impl GateExport {
    /// A 4 MiB gated export.
    pub fn new(name: &str) -> Arc<GateExport> {
        Arc::new(GateExport {
            inner: MemExport::new(name, 4 * 1024 * 1024),
            open: Mutex::new(false),
            opened: Condvar::new(),
            inside: Mutex::new(0),
            inside_changed: Condvar::new(),
            inside_max: AtomicUsize::new(0),
            misaligned: AtomicBool::new(false),
            quick: AtomicBool::new(false),
        })
    }

    pub fn open_gate(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    /// Waits until `n` requests are inside the export (at most 20 s).
    pub fn wait_inside(&self, n: usize) -> usize {
        let deadline = Instant::now() + GATE_TIMEOUT;
        let mut inside = self.inside.lock().unwrap();
        while *inside < n && Instant::now() < deadline {
            inside = self
                .inside_changed
                .wait_timeout(inside, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        *inside
    }

    fn enter(&self) {
        let mut inside = self.inside.lock().unwrap();
        *inside += 1;
        self.inside_max.fetch_max(*inside, Ordering::SeqCst);
        self.inside_changed.notify_all();
    }

    fn leave(&self) {
        *self.inside.lock().unwrap() -= 1;
        self.inside_changed.notify_all();
    }

    fn check_aligned(&self, ptr: *const u8, len: usize) {
        if len >= 4096 && !(ptr as usize).is_multiple_of(4096) {
            self.misaligned.store(true, Ordering::SeqCst);
        }
    }
}

impl Export for GateExport {
    fn name(&self) -> String {
        self.inner.name()
    }
    fn is_quick(&self, request: &ValidRequest) -> bool {
        let gated = matches!(*request, ValidRequest::Read { offset, .. } if offset < GATED_BELOW);
        self.quick.load(Ordering::SeqCst) && !gated
    }
    fn description(&self) -> String {
        self.inner.description()
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn is_rotational(&self) -> bool {
        false
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check_aligned(buf.as_ptr(), buf.len());
        assert_ne!(offset, PANIC_AT, "test export panics here on purpose");
        self.enter();
        if offset < GATED_BELOW {
            let deadline = Instant::now() + GATE_TIMEOUT;
            let mut open = self.open.lock().unwrap();
            while !*open && Instant::now() < deadline {
                open = self
                    .opened
                    .wait_timeout(open, Duration::from_millis(50))
                    .unwrap()
                    .0;
            }
        }
        let result = self.inner.read(offset, buf);
        self.leave();
        result
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.check_aligned(data.as_ptr(), data.len());
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, no_hole: bool) -> io::Result<()> {
        self.inner.write_zeroes(offset, len, fua, no_hole)
    }
    fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.cache(offset, len)
    }
    fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        self.inner.block_status(offset, len)
    }
}

/// Appends an `NBD_CMD_READ` request to `out`.
pub fn read_request(cookie: u64, offset: u64, length: u32, out: &mut Vec<u8>) {
    nbd_proto::Request {
        flags: nbd_proto::CommandFlags(0),
        command: nbd_proto::Command::Read,
        cookie,
        offset,
        length,
    }
    .encode(out);
}

/// Receives one whole structured reply: (cookie, error, data).
pub fn recv_reply(c: &mut RawClient) -> (u64, Option<nbd_proto::NbdErrno>, Vec<u8>) {
    use nbd_proto::{Chunk, NbdErrno, Reply};
    let mut data = Vec::new();
    loop {
        let (reply, _) = c.recv(|_| 0).unwrap();
        let Reply::Chunk {
            cookie,
            done,
            chunk,
        } = reply
        else {
            panic!("expected structured replies, got {reply:?}")
        };
        let mut error = None;
        match chunk {
            Chunk::OffsetData { data: d, .. } => data.extend_from_slice(&d),
            Chunk::Error { error: e, .. } => error = NbdErrno::from_wire(e),
            Chunk::None => {}
            other => panic!("unexpected chunk {other:?}"),
        }
        if done {
            return (cookie, error, data);
        }
    }
}
