//! The io_uring data path's own device reads (`Export::start_read` → `Direct`): data read
//! from a file in pieces lands at the right place of the reply, a finish that asks for a
//! second read gets it on a worker, a failed device read is an error reply, and a direct read
//! is answered while a request at a worker is still blocked behind it. Also: with
//! `DataPath::Threads` the same export is served by `Export::read` (no direct reads).
//!
//! Under `CI=true` io_uring must work (the runner's kernel has it); elsewhere a machine
//! without it skips these tests, saying so.

mod support;

use nbd_proto::NbdErrno;
use server::{DataPath, DeviceIo, DirectIo, Export, Finished, ServerConfig, Start};
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
        })
    }

    fn open_gate(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

struct Direct {
    fd: std::os::fd::RawFd,
    reads: Vec<DeviceIo>,
    offset: u64,
    export: Arc<FileExport>,
    write: bool,
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
        }))
    }
    fn start_write(&self, offset: u64, len: usize, _fua: bool) -> Start {
        let reads = blocks_backwards(offset, len);
        Start::Direct(Box::new(Direct {
            fd: self.0.file.as_raw_fd(),
            reads,
            offset,
            export: Arc::clone(&self.0),
            write: true,
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
