//! The io_uring data path's own device reads (`Export::start_read` → `Direct`): data read
//! from a file in pieces lands at the right place of the reply, a finish that asks for a
//! second read gets it on a worker, a failed device read is an error reply, and a direct read
//! is answered while a request at a worker is still blocked behind it. Also: with
//! `DataPath::Threads` the same export is served by `Export::read` (no direct reads).
//! And requests carried on a connection lent by a remote device (`DirectIo::remote`): each
//! step of the exchange on the ring, replies that come in pieces, an error reply, a peer
//! that closes, one that breaks the framing, and one that never answers (ended at the lent
//! connection's deadline).
//!
//! Under `CI=true` io_uring must work (the runner's kernel has it); elsewhere a machine
//! without it skips these tests, saying so.

mod support;

use nbd_proto::NbdErrno;
use server::{DataPath, DeviceIo, DirectIo, Export, Finished, RemoteIo, ServerConfig, Start};
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use support::{pattern, read_request, recv_reply, RawClient, TestServer};

const SIZE: u64 = 4 << 20;
/// Reads at or past this offset are blocked at a worker until the gate opens.
const GATED_FROM: u64 = 3 << 20;
/// Reads of this offset are finished with `Again` (read once more on a worker).
const AGAIN_AT: u64 = 1 << 20;
/// Reads of this offset get a piece past the file's end (a failed device read).
const FAIL_AT: u64 = 2 << 20;

/// An export over a file whose reads are `Direct`, each 4 KiB block a piece of its own
/// (in reverse order, so the pieces complete in any order).
struct FileExport {
    file: File,
    gate: Mutex<bool>,
    opened: Condvar,
    whole_reads: AtomicU64,
    agains: AtomicU64,
    direct_writes: AtomicU64,
    /// Lent connections whose exchange ended whole (`done`) or failed (`failed`), and hanging
    /// peers that saw the server give up.
    lent_done: AtomicU64,
    lent_failed: AtomicU64,
    aborted_seen: AtomicU64,
}

impl FileExport {
    fn new(data: &[u8]) -> Arc<FileExport> {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(data).unwrap();
        Arc::new(FileExport {
            file,
            gate: Mutex::new(false),
            opened: Condvar::new(),
            whole_reads: AtomicU64::new(0),
            agains: AtomicU64::new(0),
            direct_writes: AtomicU64::new(0),
            lent_done: AtomicU64::new(0),
            lent_failed: AtomicU64::new(0),
            aborted_seen: AtomicU64::new(0),
        })
    }

    fn open_gate(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// Requests at or past this offset (and below `GATED_FROM`) go to a fake remote device on a
/// connection lent for each (`Lent`); what the peer does is chosen by the 4 KiB block the
/// request starts in (`Peer`).
const REMOTE_FROM: u64 = (5 << 20) / 2;

/// What the fake remote device does with a request, by block from `REMOTE_FROM`.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Peer {
    /// Answers at once, header and data in one write.
    Answers,
    /// Answers in three writes: part of the header, the rest of it with part of the data,
    /// the rest of the data.
    InPieces,
    /// An error reply.
    Fails,
    /// Closes the connection without answering.
    Closes,
    /// Never answers.
    Hangs,
    /// An error reply with bytes after it (the stream is no longer framed), in one write.
    Garbles,
}

impl Peer {
    fn at(offset: u64) -> Peer {
        match (offset - REMOTE_FROM) / 4096 % 8 {
            1 => Peer::InPieces,
            2 => Peer::Fails,
            3 => Peer::Closes,
            4 => Peer::Hangs,
            5 => Peer::Garbles,
            _ => Peer::Answers,
        }
    }
}

/// How long a lent connection's request may take (the hanging peer's).
const LENT_DEADLINE: std::time::Duration = std::time::Duration::from_millis(300);

/// The fake protocol on a lent connection: a 28-byte request header (`R` or `W`, the
/// offset, the length), a write's payload, then a 16-byte reply header (byte 0: 0 for
/// success, 5 for EIO) and a read's data.
struct Lent {
    sock: std::os::unix::net::UnixStream,
    header: Vec<u8>,
    deadline: std::time::Instant,
    export: Arc<FileExport>,
}

impl Lent {
    /// Lends a connection whose peer, on a thread, acts as `Peer::at(offset)` says over the
    /// export's file.
    fn new(export: &Arc<FileExport>, offset: u64, len: usize, write: bool) -> Lent {
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut header = vec![if write { b'W' } else { b'R' }; 28];
        header[8..16].copy_from_slice(&offset.to_le_bytes());
        header[16..24].copy_from_slice(&(len as u64).to_le_bytes());
        let ex = Arc::clone(export);
        std::thread::spawn(move || {
            use std::io::Read;
            let mut req = vec![0u8; 28 + if write { len } else { 0 }];
            if theirs.read_exact(&mut req).is_err() {
                return;
            }
            let peer = Peer::at(offset);
            let mut reply = vec![0u8; 16];
            let answers = !matches!(peer, Peer::Fails | Peer::Garbles);
            if write && answers {
                ex.file.write_all_at(&req[28..], offset).unwrap();
            }
            if !write && answers {
                reply.resize(16 + len, 0);
                ex.file.read_exact_at(&mut reply[16..], offset).unwrap();
            }
            let pause = || std::thread::sleep(std::time::Duration::from_millis(20));
            match peer {
                Peer::Answers => theirs.write_all(&reply).unwrap(),
                Peer::InPieces => {
                    let cut = if write { 16 } else { 16 + len / 2 };
                    theirs.write_all(&reply[..7]).unwrap();
                    pause();
                    theirs.write_all(&reply[7..cut]).unwrap();
                    pause();
                    theirs.write_all(&reply[cut..]).unwrap();
                }
                Peer::Fails => {
                    reply[0] = 5;
                    theirs.write_all(&reply[..16]).unwrap();
                }
                Peer::Garbles => {
                    reply.truncate(16);
                    reply[0] = 5;
                    reply.extend_from_slice(b"garbage!");
                    theirs.write_all(&reply).unwrap();
                }
                Peer::Closes => {}
                Peer::Hangs => {
                    // Until the server shuts its end down at the deadline.
                    let _ = theirs.read(&mut [0u8; 1]);
                    ex.aborted_seen.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        Lent {
            sock: ours,
            header,
            deadline: std::time::Instant::now() + LENT_DEADLINE,
            export: Arc::clone(export),
        }
    }
}

impl RemoteIo for Lent {
    fn request(&mut self) -> &[u8] {
        &self.header
    }
    fn reply(&mut self, header: &[u8]) -> io::Result<usize> {
        assert_eq!(header.len(), 16);
        let len = u64::from_le_bytes(self.header[16..24].try_into().unwrap()) as usize;
        match header[0] {
            0 if self.header[0] == b'R' => Ok(len),
            0 => Ok(0),
            _ => Err(io::Error::from_raw_os_error(5)), // EIO
        }
    }
    fn done(&mut self) {
        self.export.lent_done.fetch_add(1, Ordering::SeqCst);
    }
    fn deadline(&self) -> std::time::Instant {
        self.deadline
    }
    fn abort(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
    fn failed(&mut self, res: i32) -> io::Error {
        self.export.lent_failed.fetch_add(1, Ordering::SeqCst);
        io::Error::other(format!("the lent connection failed ({res})"))
    }
}

struct Direct {
    fd: std::os::fd::RawFd,
    reads: Vec<DeviceIo>,
    offset: u64,
    export: Arc<FileExport>,
    write: bool,
    lent: Option<Lent>,
}

impl DirectIo for Direct {
    fn fd(&self) -> std::os::fd::RawFd {
        self.fd
    }
    fn pieces(&self) -> &[DeviceIo] {
        &self.reads
    }
    fn writes(&self) -> bool {
        self.write
    }
    fn remote(&mut self) -> Option<&mut dyn RemoteIo> {
        self.lent.as_mut().map(|l| l as &mut dyn RemoteIo)
    }
    fn finish(self: Box<Self>, buf: &mut [u8], result: io::Result<()>) -> Finished {
        if self.write {
            self.export.direct_writes.fetch_add(1, Ordering::SeqCst);
            return Finished::Done(result);
        }
        if self.offset == AGAIN_AT {
            // Spoil the data, then ask for it again: the worker must bring the right bytes.
            buf.fill(0xEE);
            self.export.agains.fetch_add(1, Ordering::SeqCst);
            let export = Arc::clone(&self.export);
            let offset = self.offset;
            return Finished::Again(Box::new(move |buf| export.file.read_exact_at(buf, offset)));
        }
        Finished::Done(result)
    }
}

struct Shared(Arc<FileExport>);

/// Each 4 KiB block of `[offset, offset + len)` a piece of its own, last first (so they
/// complete in any order).
fn blocks_backwards(offset: u64, len: usize) -> Vec<DeviceIo> {
    (0..len / 4096)
        .map(|i| DeviceIo {
            offset: offset + (i * 4096) as u64,
            buf_offset: i * 4096,
            len: 4096,
        })
        .rev()
        .collect()
}

impl Export for Shared {
    fn name(&self) -> String {
        "file".into()
    }
    fn description(&self) -> String {
        String::new()
    }
    fn size_bytes(&self) -> u64 {
        SIZE
    }
    fn is_rotational(&self) -> bool {
        false
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.whole_reads.fetch_add(1, Ordering::SeqCst);
        if offset >= GATED_FROM {
            let mut open = self.0.gate.lock().unwrap();
            while !*open {
                open = self.0.opened.wait(open).unwrap();
            }
        }
        self.0.file.read_exact_at(buf, offset)
    }
    fn start_read(&self, offset: u64, len: usize) -> Start {
        if offset >= GATED_FROM {
            return Start::Whole;
        }
        if offset >= REMOTE_FROM {
            return self.lend(offset, len, false);
        }
        let mut reads = blocks_backwards(offset, len);
        if offset == FAIL_AT {
            reads[0].offset = 1 << 40;
        }
        Start::Direct(Box::new(Direct {
            fd: self.0.file.as_raw_fd(),
            reads,
            offset,
            export: Arc::clone(&self.0),
            write: false,
            lent: None,
        }))
    }
    fn start_write(&self, offset: u64, len: usize, _fua: bool) -> Start {
        if (REMOTE_FROM..GATED_FROM).contains(&offset) {
            return self.lend(offset, len, true);
        }
        let reads = blocks_backwards(offset, len);
        Start::Direct(Box::new(Direct {
            fd: self.0.file.as_raw_fd(),
            reads,
            offset,
            export: Arc::clone(&self.0),
            write: true,
            lent: None,
        }))
    }
    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> io::Result<()> {
        self.0.file.write_all_at(data, offset)
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _o: u64, _l: u64, _fua: bool, _nh: bool) -> io::Result<()> {
        Ok(())
    }
    fn cache(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn block_status(&self, _offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        Ok(vec![(len, 0)])
    }
}

impl Shared {
    /// A request on a connection lent for it (see `Lent`).
    fn lend(&self, offset: u64, len: usize, write: bool) -> Start {
        let lent = Lent::new(&self.0, offset, len, write);
        Start::Direct(Box::new(Direct {
            fd: std::os::fd::AsRawFd::as_raw_fd(&lent.sock),
            reads: vec![DeviceIo {
                offset,
                buf_offset: 0,
                len,
            }],
            offset,
            export: Arc::clone(&self.0),
            write,
            lent: Some(lent),
        }))
    }
}

/// A server on the given data path, or `None` (said) where io_uring is unavailable outside CI.
fn serve(export: &Arc<FileExport>, data_path: DataPath) -> Option<TestServer> {
    let config = ServerConfig {
        data_path,
        ring_threads: 2,
        ..ServerConfig::default()
    };
    let exports = vec![Arc::new(Shared(Arc::clone(export))) as Arc<dyn Export>];
    let start = std::panic::AssertUnwindSafe(|| TestServer::start_with(exports, config));
    match std::panic::catch_unwind(start) {
        Ok(srv) => Some(srv),
        Err(_) if data_path == DataPath::Uring => {
            test_support::unavailable("io_uring (the server did not start on it)");
            None
        }
        Err(e) => std::panic::resume_unwind(e),
    }
}

#[test]
fn direct_reads_land_in_place_and_a_blocked_request_holds_none_up() {
    let data = pattern(SIZE as usize, 11);
    let export = FileExport::new(&data);
    let Some(srv) = serve(&export, DataPath::Uring) else {
        return;
    };
    assert_eq!(srv.handle().stats().ring_threads, 2);
    let mut c = RawClient::connect_unix(&srv.socket, "file", true).unwrap();
    // A read blocked at a worker first, then 32 direct reads behind it, all in one write.
    let mut out = Vec::new();
    read_request(1000, GATED_FROM, 8192, &mut out);
    let reads: Vec<(u64, u64, u32)> = (0..32u64)
        .map(|i| {
            (
                i,
                (i * 37 % 200) * 4096 + 4 * 4096,
                4096 * (1 + (i % 4) as u32),
            )
        })
        .collect();
    for &(cookie, offset, len) in &reads {
        read_request(cookie, offset, len, &mut out);
    }
    c.stream.write_all(&out).unwrap();
    for _ in &reads {
        let (cookie, error, got) = recv_reply(&mut c);
        assert_ne!(
            cookie, 1000,
            "the blocked read was answered before the direct ones"
        );
        let &(_, offset, len) = reads.iter().find(|r| r.0 == cookie).unwrap();
        assert_eq!(error, None, "cookie {cookie}");
        assert!(
            got == data[offset as usize..][..len as usize],
            "wrong data for cookie {cookie} (offset {offset}, {len} bytes)"
        );
    }
    export.open_gate();
    let (cookie, error, got) = recv_reply(&mut c);
    assert_eq!((cookie, error), (1000, None));
    assert!(got == data[GATED_FROM as usize..][..8192]);
    assert_eq!(srv.handle().stats().direct_reads, 32);
    assert_eq!(export.whole_reads.load(Ordering::SeqCst), 1);
}

#[test]
fn a_direct_read_read_again_or_failed_is_answered_right() {
    let data = pattern(SIZE as usize, 12);
    let export = FileExport::new(&data);
    let Some(srv) = serve(&export, DataPath::Uring) else {
        return;
    };
    let mut c = RawClient::connect_unix(&srv.socket, "file", true).unwrap();
    let mut out = Vec::new();
    read_request(1, AGAIN_AT, 16384, &mut out);
    read_request(2, FAIL_AT, 8192, &mut out);
    read_request(3, 0, 4096, &mut out);
    c.stream.write_all(&out).unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (cookie, error, got) = recv_reply(&mut c);
        match cookie {
            1 => {
                assert_eq!(error, None);
                assert!(got == data[AGAIN_AT as usize..][..16384], "read again");
            }
            2 => assert_eq!(error, Some(NbdErrno::Eio), "a failed device read is EIO"),
            3 => assert!(got == data[..4096]),
            other => panic!("unexpected cookie {other}"),
        }
        seen.push(cookie);
    }
    seen.sort();
    assert_eq!(seen, [1, 2, 3]);
    assert_eq!(export.agains.load(Ordering::SeqCst), 1);
    // The connection goes on after the error.
    let mut out = Vec::new();
    read_request(4, 8192, 4096, &mut out);
    c.stream.write_all(&out).unwrap();
    let (cookie, error, got) = recv_reply(&mut c);
    assert_eq!((cookie, error), (4, None));
    assert!(got == data[8192..][..4096]);
}

/// Direct writes: pieces written from the payload in any order land in place, and a direct
/// read of them afterwards sees them.
#[test]
fn direct_writes_land_in_place() {
    let data = pattern(SIZE as usize, 14);
    let export = FileExport::new(&data);
    let Some(srv) = serve(&export, DataPath::Uring) else {
        return;
    };
    let mut c = RawClient::connect_unix(&srv.socket, "file", true).unwrap();
    let payload = pattern(16384, 99);
    let written = c
        .call(nbd_proto::Command::Write, 0, 40960, 16384, &payload)
        .unwrap();
    assert_eq!(written.error, None);
    let mut out = Vec::new();
    read_request(7, 40960 - 4096, 16384 + 8192, &mut out);
    c.stream.write_all(&out).unwrap();
    let (cookie, error, got) = recv_reply(&mut c);
    assert_eq!((cookie, error), (7, None));
    assert!(got[..4096] == data[40960 - 4096..40960], "the block before");
    assert!(got[4096..4096 + 16384] == payload[..], "the written blocks");
    assert!(
        got[4096 + 16384..] == data[40960 + 16384..][..4096],
        "the block after"
    );
    assert_eq!(export.direct_writes.load(Ordering::SeqCst), 1);
    assert_eq!(srv.handle().stats().direct_writes, 1);
}

#[test]
fn the_thread_model_serves_the_same_export_through_read() {
    let data = pattern(SIZE as usize, 13);
    let export = FileExport::new(&data);
    let srv = serve(&export, DataPath::Threads).expect("threads always start");
    assert_eq!(srv.handle().stats().ring_threads, 0);
    let mut c = RawClient::connect_unix(&srv.socket, "file", true).unwrap();
    let mut out = Vec::new();
    read_request(1, 4096, 8192, &mut out);
    c.stream.write_all(&out).unwrap();
    let (cookie, error, got) = recv_reply(&mut c);
    assert_eq!((cookie, error), (1, None));
    assert!(got == data[4096..][..8192]);
    assert_eq!(srv.handle().stats().direct_reads, 0);
    assert_eq!(export.whole_reads.load(Ordering::SeqCst), 1);
}

/// Reads and writes on lent connections: every kind of peer in one batch on one connection,
/// each answered as its peer did (data in place, EIO, an error for a closed or silent peer),
/// the silent one at the lent connection's deadline; the connection goes on after.
#[test]
fn requests_on_lent_connections_are_carried_on_the_ring() {
    let data = pattern(SIZE as usize, 15);
    let export = FileExport::new(&data);
    let Some(srv) = serve(&export, DataPath::Uring) else {
        return;
    };
    let mut c = RawClient::connect_unix(&srv.socket, "file", true).unwrap();
    let block = |i: u64| REMOTE_FROM + i * 4096;
    // Writes first, one at a time: an answering peer and one answering in pieces.
    for (i, seed) in [(0u64, 21u64), (1, 22)] {
        let payload = pattern(4096, seed);
        let w = c
            .call(nbd_proto::Command::Write, 0, block(8 + i), 4096, &payload)
            .unwrap();
        assert_eq!(w.error, None, "write to block {}", 8 + i);
        let mut back = vec![0u8; 4096];
        export.file.read_exact_at(&mut back, block(8 + i)).unwrap();
        assert!(
            back == payload,
            "the peer got the payload of block {}",
            8 + i
        );
    }
    let failed_write = c
        .call(
            nbd_proto::Command::Write,
            0,
            block(2),
            4096,
            &pattern(4096, 23),
        )
        .unwrap();
    assert_eq!(failed_write.error, Some(NbdErrno::Eio));
    // Reads of every kind of peer, sent together.
    let started = std::time::Instant::now();
    let mut out = Vec::new();
    for i in 0..6u64 {
        read_request(100 + i, block(i), 8192, &mut out);
    }
    c.stream.write_all(&out).unwrap();
    let data = {
        let mut d = vec![0u8; SIZE as usize];
        export.file.read_exact_at(&mut d, 0).unwrap();
        d
    };
    let mut answered = Vec::new();
    for _ in 0..6 {
        let (cookie, error, got) = recv_reply(&mut c);
        let at = block(cookie - 100) as usize;
        match Peer::at(at as u64) {
            Peer::Answers | Peer::InPieces => {
                assert_eq!(error, None, "cookie {cookie}");
                assert!(got == data[at..at + 8192], "data of cookie {cookie}");
            }
            Peer::Fails => assert_eq!(error, Some(NbdErrno::Eio), "cookie {cookie}"),
            Peer::Closes | Peer::Hangs | Peer::Garbles => {
                assert!(error.is_some(), "cookie {cookie} answered without a reply")
            }
        }
        answered.push(cookie);
    }
    assert_eq!(
        answered.last(),
        Some(&104),
        "the silent peer's read is answered last, at its deadline"
    );
    assert!(started.elapsed() >= LENT_DEADLINE);
    // Carried whole: 2 writes and 2 reads (an error reply is not `done`: the real lease
    // settles that in `reply`); broken: the closed, the silent and the garbling peer's.
    assert_eq!(export.lent_done.load(Ordering::SeqCst), 4);
    assert_eq!(export.lent_failed.load(Ordering::SeqCst), 3);
    let t = std::time::Instant::now();
    while export.aborted_seen.load(Ordering::SeqCst) == 0 {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the silent peer's connection was never shut down"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (cookie, error, got) = {
        let mut out = Vec::new();
        read_request(7, 4096, 4096, &mut out);
        c.stream.write_all(&out).unwrap();
        recv_reply(&mut c)
    };
    assert_eq!((cookie, error), (7, None));
    assert!(got == data[4096..8192]);
}
