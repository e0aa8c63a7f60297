//! The per-connection threading: workers that read, execute and answer their own requests.
//! A slow request must not hold up a fast one, concurrency stays within
//! `workers_per_connection`, a panicking export is answered with EIO, a client that stops
//! reading is cut off by the reply timeout, and buffers reach the export aligned for O_DIRECT.
//! No timing asserts: slow requests are held by a gate the test opens.

mod support;

use nbd_proto::{Command, NbdErrno};
use server::{DataPath, Export, ServerConfig};
use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{
    pattern, read_request, recv_reply, GateExport, RawClient, TestServer, GATED_BELOW, PANIC_AT,
};

const MIB: u64 = 1024 * 1024;

fn start(export: &Arc<GateExport>, config: ServerConfig) -> TestServer {
    TestServer::start_with(vec![Arc::clone(export) as Arc<dyn Export>], config)
}

#[test]
fn a_slow_request_does_not_hold_up_pipelined_ones() {
    slow_request_does_not_hold_up_others(false);
}

/// The same with every other request quick: a quick request is executed by the worker that
/// read it, but a slow one is still handed over, so later requests are read meanwhile.
#[test]
fn a_slow_request_does_not_hold_up_quick_ones() {
    slow_request_does_not_hold_up_others(true);
}

fn slow_request_does_not_hold_up_others(quick: bool) {
    let export = GateExport::new("gate");
    export.quick.store(quick, Ordering::SeqCst);
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

/// Requests sent one at a time: quick ones are served by the worker that read them (no
/// other worker is started to read meanwhile, no thread hand-over per request); requests
/// that are not quick start a second worker to read while they run.
#[test]
fn quick_requests_one_at_a_time_need_no_second_worker() {
    for quick in [true, false] {
        let export = GateExport::new("gate");
        export.quick.store(quick, Ordering::SeqCst);
        // The thread model's hand-over rule (the io_uring data path has no per-connection
        // workers: `ring.rs`).
        let config = ServerConfig {
            data_path: DataPath::Threads,
            ..ServerConfig::default()
        };
        let srv = start(&export, config);
        let mut c = RawClient::connect_unix(&srv.socket, "gate", true).unwrap();
        for i in 0..20u64 {
            let mut out = Vec::new();
            read_request(i, GATED_BELOW + i * 4096, 4096, &mut out);
            c.stream.write_all(&out).unwrap();
            assert_eq!(recv_reply(&mut c).0, i);
        }
        let extra = srv.handle().stats().workers_extra;
        if quick {
            assert_eq!(extra, 0, "a quick request started a worker");
        } else {
            // At least one; a reply can reach the client before its request has left the
            // in-flight count, so the next one may count two busy workers and start a third.
            assert!(extra >= 1, "requests that are not quick started no worker");
        }
    }
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

#[test]
fn extra_workers_are_capped_across_connections() {
    let export = GateExport::new("gate");
    let config = ServerConfig {
        workers_per_connection: 8,
        workers_max: 1,
        data_path: DataPath::Threads,
        ..ServerConfig::default()
    };
    let srv = start(&export, config);
    let mut clients: Vec<RawClient> = (0..2)
        .map(|_| RawClient::connect_unix(&srv.socket, "gate", true).unwrap())
        .collect();
    for (n, c) in clients.iter_mut().enumerate() {
        let mut out = Vec::new();
        for i in 0..4u64 {
            read_request(i, (n as u64 * 4 + i) * 4096, 4096, &mut out);
        }
        c.stream.write_all(&out).unwrap();
    }
    // Each connection's own thread, plus the one extra worker there is for both.
    assert_eq!(export.wait_inside(3), 3);
    assert_eq!(srv.handle().stats().workers_extra, 1);
    // Room for a wrongly uncapped server to start more before the gate opens.
    thread::sleep(Duration::from_millis(100));
    export.open_gate();
    for c in &mut clients {
        let mut cookies: Vec<u64> = (0..4).map(|_| recv_reply(c).0).collect();
        cookies.sort_unstable();
        assert_eq!(cookies, vec![0, 1, 2, 3], "no request is lost or stuck");
    }
    assert_eq!(export.inside_max.load(Ordering::SeqCst), 3);
}
