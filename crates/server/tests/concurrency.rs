//! The per-connection threading: workers that read, execute and answer their own requests.
//! A slow request must not hold up a fast one, concurrency stays within
//! `workers_per_connection`, a panicking export is answered with EIO, a client that stops
//! reading is cut off by the reply timeout, and buffers reach the export aligned for O_DIRECT.
//! No timing asserts: slow requests are held by a gate the test opens.

mod support;

use nbd_proto::{Chunk, Command, NbdErrno, Reply};
use server::{Export, ServerConfig};
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use support::{pattern, MemExport, RawClient, TestServer};

const MIB: u64 = 1024 * 1024;
/// Reads starting below this offset wait for the gate.
const GATED_BELOW: u64 = 64 * 1024;
/// A gate never opened by a broken test still opens after this, so the server can shut down.
const GATE_TIMEOUT: Duration = Duration::from_secs(20);

/// Wraps a [`MemExport`]: reads below [`GATED_BELOW`] wait until the gate opens; reads at offset
/// [`PANIC_AT`] panic; counts requests inside the export and whether buffers were aligned.
struct GateExport {
    inner: Arc<MemExport>,
    open: Mutex<bool>,
    opened: Condvar,
    inside: Mutex<usize>,
    inside_changed: Condvar,
    inside_max: AtomicUsize,
    misaligned: AtomicBool,
}

const PANIC_AT: u64 = MIB;

impl GateExport {
    fn new(name: &str) -> Arc<GateExport> {
        Arc::new(GateExport {
            inner: MemExport::new(name, 4 * MIB),
            open: Mutex::new(false),
            opened: Condvar::new(),
            inside: Mutex::new(0),
            inside_changed: Condvar::new(),
            inside_max: AtomicUsize::new(0),
            misaligned: AtomicBool::new(false),
        })
    }

    fn open_gate(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    /// Waits until `n` requests are inside the export (at most 20 s).
    fn wait_inside(&self, n: usize) -> usize {
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
        if len >= 4096 && ptr as usize % 4096 != 0 {
            self.misaligned.store(true, Ordering::SeqCst);
        }
    }
}

impl Export for GateExport {
    fn name(&self) -> String {
        self.inner.name()
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

fn start(export: &Arc<GateExport>, config: ServerConfig) -> TestServer {
    TestServer::start_with(vec![Arc::clone(export) as Arc<dyn Export>], config)
}

fn read_request(cookie: u64, offset: u64, length: u32, out: &mut Vec<u8>) {
    nbd_proto::Request {
        flags: nbd_proto::CommandFlags(0),
        command: Command::Read,
        cookie,
        offset,
        length,
    }
    .encode(out);
}

/// Receives one whole structured reply: (cookie, error, data).
fn recv_reply(c: &mut RawClient) -> (u64, Option<NbdErrno>, Vec<u8>) {
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

#[test]
fn a_slow_request_does_not_hold_up_pipelined_ones() {
    let export = GateExport::new("gate");
    export.inner.fill(&pattern(2 * MIB as usize, 5));
    let srv = start(&export, ServerConfig::default());
    let mut c = RawClient::connect_unix(&srv.socket, "gate", true).unwrap();
    // Both requests in one write: the slow one first.
    let mut out = Vec::new();
    read_request(1, 0, 4096, &mut out);
    read_request(2, GATED_BELOW, 4096, &mut out);
    c.stream.write_all(&out).unwrap();
    let (cookie, error, data) = recv_reply(&mut c);
    assert_eq!(
        (cookie, error),
        (2, None),
        "the fast read is answered first"
    );
    let expected = pattern(2 * MIB as usize, 5);
    let fast = GATED_BELOW as usize;
    assert_eq!(data, expected[fast..fast + 4096]);
    // A request sent while the slow one runs (the reader is never busy executing).
    assert_eq!(export.wait_inside(1), 1);
    out.clear();
    read_request(3, 2 * GATED_BELOW, 4096, &mut out);
    c.stream.write_all(&out).unwrap();
    let (cookie, error, _) = recv_reply(&mut c);
    assert_eq!((cookie, error), (3, None));
    export.open_gate();
    let (cookie, error, data) = recv_reply(&mut c);
    assert_eq!((cookie, error), (1, None));
    assert_eq!(data, expected[..4096]);
}

#[test]
fn concurrency_reaches_but_never_exceeds_the_worker_count() {
    let export = GateExport::new("gate");
    let config = ServerConfig {
        workers_per_connection: 3,
        ..ServerConfig::default()
    };
    let srv = start(&export, config);
    let mut c = RawClient::connect_unix(&srv.socket, "gate", true).unwrap();
    let mut out = Vec::new();
    for i in 0..8 {
        read_request(i, i * 4096, 4096, &mut out);
    }
    c.stream.write_all(&out).unwrap();
    assert_eq!(export.wait_inside(3), 3, "workers are started as needed");
    export.open_gate();
    let mut cookies: Vec<u64> = (0..8).map(|_| recv_reply(&mut c).0).collect();
    cookies.sort_unstable();
    assert_eq!(cookies, (0..8).collect::<Vec<_>>());
    assert_eq!(export.inside_max.load(Ordering::SeqCst), 3);
}

#[test]
fn a_panicking_export_gets_an_eio_reply_and_the_connection_goes_on() {
    let export = GateExport::new("gate");
    export.open_gate();
    let srv = start(&export, ServerConfig::default());
    let mut c = RawClient::connect_unix(&srv.socket, "gate", true).unwrap();
    let r = c.call(Command::Read, 0, PANIC_AT, 4096, &[]).unwrap();
    assert_eq!(r.error, Some(NbdErrno::Eio));
    let r = c
        .call(Command::Read, 0, PANIC_AT + 4096, 4096, &[])
        .unwrap();
    assert_eq!(r.error, None);
    srv.shutdown();
}

#[test]
fn buffers_reach_the_export_page_aligned() {
    let export = GateExport::new("gate");
    export.open_gate();
    let srv = start(&export, ServerConfig::default());
    for structured in [true, false] {
        let mut c = RawClient::connect_unix(&srv.socket, "gate", structured).unwrap();
        for (i, len) in [4096u32, 512, 65536, 3 * 4096, 1 << 20]
            .into_iter()
            .enumerate()
        {
            let offset = 2 * MIB + i as u64 * MIB / 8;
            let data = pattern(len as usize, i as u64);
            let r = c.call(Command::Write, 0, offset, len, &data).unwrap();
            assert_eq!(r.error, None);
            let r = c.call(Command::Read, 0, offset, len, &[]).unwrap();
            assert_eq!((r.error, r.data == data), (None, true));
        }
    }
    assert!(!export.misaligned.load(Ordering::SeqCst));
}

#[test]
fn a_client_that_stops_reading_is_cut_off_by_the_reply_timeout() {
    let export = GateExport::new("gate");
    export.open_gate();
    let config = ServerConfig {
        reply_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let srv = start(&export, config);
    let mut c = RawClient::connect_unix(&srv.socket, "gate", true).unwrap();
    // 64 MiB of replies, far more than a socket buffers; never read.
    let mut out = Vec::new();
    for i in 0..64 {
        read_request(i, 2 * MIB, 1 << 20, &mut out);
    }
    c.stream.write_all(&out).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while srv.handle().connection_count() > 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(srv.handle().connection_count(), 0, "connection was dropped");
    // The connection is gone although its client is still there, not reading.
    drop(c);
}
