//! Bounded resources against hostile or careless clients: idle connections make room for
//! newcomers instead of locking them out, busy connections are never evicted, per-client
//! limits, stalled requests and handshakes, and clients that do not read their replies — all
//! while a well-behaved client keeps being served. Behaviour is asserted, not speed: waits
//! have generous safety deadlines that only turn a hang into a failure.

mod support;

use nbd_proto::{wire, Command};
use server::{Export, ServerConfig};
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command as Process;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{
    pattern, read_request, recv_reply, require, run_ok, GateExport, MemExport, RawClient,
    TestServer, GATED_BELOW,
};

const MIB: u64 = 1024 * 1024;
/// The largest NBD read.
const READ_BYTES_MAX: u32 = 32 << 20;
/// How long a wait for the server may take before the test calls it hung.
const HUNG: Duration = Duration::from_secs(30);

fn mem_server(size_bytes: u64, config: ServerConfig) -> (Arc<MemExport>, TestServer) {
    let disk = MemExport::new("d", size_bytes);
    disk.fill(&pattern(MIB as usize, 1));
    let srv = TestServer::start_with(vec![Arc::clone(&disk) as Arc<dyn Export>], config);
    (disk, srv)
}

fn connect(srv: &TestServer, export: &str) -> io::Result<RawClient> {
    RawClient::connect_unix(&srv.socket, export, true)
}

/// Writes and reads back a few blocks, checking the data.
fn exercise(c: &mut RawClient, seed: u64) {
    for i in 0..4u64 {
        let offset = (2 + i) * MIB;
        let data = pattern(16384, seed * 100 + i);
        let written = c.call(Command::Write, 0, offset, 16384, &data).unwrap();
        assert_eq!(written.error, None);
        assert_eq!(
            c.call(Command::Read, 0, offset, 16384, &[]).unwrap().data,
            data
        );
    }
    let r = c.call(Command::Read, 0, 4096, 4096, &[]).unwrap();
    assert_eq!(r.data, pattern(MIB as usize, 1)[4096..8192]);
}

/// Polls `done` until it holds, failing after [`HUNG`].
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + HUNG;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// Reads until the server closes the connection; fails if it does not within the client's
/// read timeout.
fn assert_closed_by_server(stream: &mut dyn Read) {
    let mut sink = Vec::new();
    match stream.read_to_end(&mut sink) {
        Ok(_) => {}
        Err(err) => assert_eq!(
            err.kind(),
            io::ErrorKind::ConnectionReset,
            "the server did not close the connection: {err}"
        ),
    }
}

#[test]
fn idle_connections_make_room_for_a_newcomer() {
    let config = ServerConfig {
        connections_max: 8,
        idle_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(8 * MIB, config);
    let idle: Vec<RawClient> = (0..8).map(|_| connect(&srv, "d").unwrap()).collect();
    assert_eq!(srv.handle().connection_count(), 8);
    thread::sleep(Duration::from_millis(300));
    let mut good = connect(&srv, "d").expect("an idle connection made room");
    exercise(&mut good, 1);
    let stats = srv.handle().stats();
    assert_eq!(stats.connections_evicted, 1, "{stats:?}");
    assert_eq!(stats.connections_refused, 0, "{stats:?}");
    assert_eq!(stats.connections, 8, "{stats:?}");
    // A real client gets a place the same way.
    if require("nbdinfo", &["--version"]) {
        let out = run_ok(Process::new("nbdinfo").arg("--size").arg(srv.uri("d")));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "8388608");
        assert_eq!(srv.handle().stats().connections_evicted, 2);
        // The well-behaved client was not the one evicted (it was not idle long enough).
        exercise(&mut good, 2);
    }
    drop(idle);
}

#[test]
fn a_silent_handshake_counts_as_idle() {
    let config = ServerConfig {
        connections_max: 1,
        idle_timeout: Duration::from_millis(100),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(MIB, config);
    let mut silent = UnixStream::connect(&srv.socket).unwrap();
    silent.set_read_timeout(Some(HUNG)).unwrap();
    let mut greeting = [0u8; 18];
    silent.read_exact(&mut greeting).unwrap();
    thread::sleep(Duration::from_millis(200));
    let mut good = connect(&srv, "d").expect("the silent handshake made room");
    assert_closed_by_server(&mut silent);
    assert_eq!(
        good.call(Command::Read, 0, 0, 4096, &[]).unwrap().error,
        None
    );
    assert_eq!(srv.handle().stats().connections_evicted, 1);
}

#[test]
fn busy_connections_are_never_evicted() {
    let export = GateExport::new("gate");
    export.inner.fill(&pattern(MIB as usize, 3));
    let config = ServerConfig {
        connections_max: 2,
        idle_timeout: Duration::from_millis(100),
        ..ServerConfig::default()
    };
    let srv = TestServer::start_with(vec![Arc::clone(&export) as Arc<dyn Export>], config);
    let mut busy = connect(&srv, "gate").unwrap();
    let mut out = Vec::new();
    read_request(7, 0, 4096, &mut out);
    busy.stream.write_all(&out).unwrap();
    assert_eq!(export.wait_inside(1), 1);
    let mut idle = connect(&srv, "gate").unwrap();
    // Both have been quiet past the idle timeout; only one is idle.
    thread::sleep(Duration::from_millis(200));
    let mut newcomer = connect(&srv, "gate").expect("the idle connection made room");
    let r = newcomer
        .call(Command::Read, 0, GATED_BELOW, 4096, &[])
        .unwrap();
    let expected = pattern(MIB as usize, 3);
    let at = GATED_BELOW as usize;
    assert_eq!(r.data, expected[at..at + 4096]);
    assert_closed_by_server(&mut idle.stream);
    export.open_gate();
    let (cookie, error, data) = recv_reply(&mut busy);
    assert_eq!((cookie, error), (7, None));
    assert_eq!(data, expected[..4096]);
    assert_eq!(srv.handle().stats().connections_evicted, 1);
}

#[test]
fn the_per_client_limit_refuses_when_no_connection_is_idle() {
    let config = ServerConfig {
        connections_per_client_max: 4,
        idle_timeout: Duration::from_secs(3600),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(8 * MIB, config);
    let mut clients: Vec<RawClient> = (0..4).map(|_| connect(&srv, "d").unwrap()).collect();
    assert!(connect(&srv, "d").is_err(), "a fifth one from the same uid");
    let stats = srv.handle().stats();
    assert_eq!(
        (stats.connections_refused, stats.connections_evicted),
        (1, 0)
    );
    for (i, c) in clients.iter_mut().enumerate() {
        exercise(c, i as u64);
    }
    // A place freed is a place for the next one.
    clients.pop();
    wait_until("the connection has gone", || {
        srv.handle().connection_count() == 3
    });
    exercise(&mut connect(&srv, "d").unwrap(), 9);
}

#[test]
fn idle_close_after_closes_only_idle_connections() {
    let export = GateExport::new("gate");
    let config = ServerConfig {
        idle_close_after: Some(Duration::from_millis(300)),
        ..ServerConfig::default()
    };
    let srv = TestServer::start_with(vec![Arc::clone(&export) as Arc<dyn Export>], config);
    let mut busy = connect(&srv, "gate").unwrap();
    let mut out = Vec::new();
    read_request(1, 0, 4096, &mut out);
    busy.stream.write_all(&out).unwrap();
    assert_eq!(export.wait_inside(1), 1);
    let mut idle = connect(&srv, "gate").unwrap();
    assert_closed_by_server(&mut idle.stream);
    // The busy one has been in flight longer than idle_close_after, and stays.
    export.open_gate();
    assert_eq!(recv_reply(&mut busy).0, 1);
    let r = busy.call(Command::Read, 0, 8192, 4096, &[]).unwrap();
    assert_eq!(r.error, None);
    assert!(srv.handle().stats().connections_idle_closed >= 1);
}

#[test]
fn stalled_requests_are_cut_off_after_request_timeout() {
    let config = ServerConfig {
        request_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(8 * MIB, config);
    let mut waiting = connect(&srv, "d").unwrap();
    // A write whose payload stops short.
    let mut short = connect(&srv, "d").unwrap();
    short
        .send(Command::Write, 0, 1, 0, 4096, &[0xab; 100])
        .unwrap();
    assert_closed_by_server(&mut short.stream);
    // Half a header.
    let mut half = connect(&srv, "d").unwrap();
    half.stream
        .write_all(&[0x25, 0x60, 0x95, 0x13, 0, 0])
        .unwrap();
    assert_closed_by_server(&mut half.stream);
    // Waiting between requests is not a stalled request: that one still works.
    exercise(&mut waiting, 3);
}

#[test]
fn a_trickled_handshake_is_cut_off_by_handshake_timeout() {
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(MIB, config);
    let mut s = UnixStream::connect(&srv.socket).unwrap();
    s.set_read_timeout(Some(HUNG)).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    let mut prefix = (wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    prefix.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
    prefix.extend_from_slice(&wire::OPT_GO.to_be_bytes());
    prefix.extend_from_slice(&1000u32.to_be_bytes());
    s.write_all(&prefix).unwrap();
    // One byte of option data every 50 ms: each read is quick, the whole handshake is not.
    let trickle_bytes = 200;
    let finished = Arc::new(AtomicBool::new(false));
    let trickler = {
        let mut s = s.try_clone().unwrap();
        let finished = Arc::clone(&finished);
        thread::spawn(move || {
            for _ in 0..trickle_bytes {
                if s.write_all(&[0]).is_err() {
                    return;
                }
                thread::sleep(Duration::from_millis(50));
            }
            finished.store(true, Ordering::SeqCst);
        })
    };
    assert_closed_by_server(&mut s);
    assert!(
        !finished.load(Ordering::SeqCst),
        "the server waited for the whole trickle"
    );
    drop(s);
    trickler.join().unwrap();
}

/// Connections that each pipeline `count` reads of 32 MiB and never read the replies.
fn never_reading_clients(srv: &TestServer, connections: usize, count: u64) -> Vec<RawClient> {
    (0..connections)
        .map(|_| {
            let mut c = connect(srv, "d").unwrap();
            let mut out = Vec::new();
            for i in 0..count {
                read_request(i, 0, READ_BYTES_MAX, &mut out);
            }
            c.stream.write_all(&out).unwrap();
            c
        })
        .collect()
}

fn budget_config(reply_timeout: Duration) -> ServerConfig {
    ServerConfig {
        bytes_in_flight_max: 128 << 20,
        connections_max: 16,
        reply_timeout,
        ..ServerConfig::default()
    }
}

#[test]
fn never_reading_clients_stay_within_the_budget() {
    let config = budget_config(Duration::from_secs(60));
    let bytes_max = config.bytes_in_flight_max;
    let (_disk, srv) = mem_server(64 * MIB, config);
    let mut good = connect(&srv, "d").unwrap();
    let hostile = never_reading_clients(&srv, 4, 8);
    wait_until("the hostile clients hold a 32 MiB read", || {
        srv.handle().stats().bytes_in_flight >= READ_BYTES_MAX as usize
    });
    // Small reads still complete while they are stuck.
    let expected = pattern(MIB as usize, 1);
    for i in 0..16usize {
        let r = good
            .call(Command::Read, 0, i as u64 * 4096, 4096, &[])
            .unwrap();
        assert_eq!(r.data, expected[i * 4096..(i + 1) * 4096]);
    }
    let stats = srv.handle().stats();
    assert!(
        stats.bytes_in_flight >= READ_BYTES_MAX as usize,
        "still stuck: {stats:?}"
    );
    assert!(stats.bytes_in_flight_peak <= bytes_max, "{stats:?}");
    // Gone clients release everything.
    drop(hostile);
    wait_until("the budget is released", || {
        let stats = srv.handle().stats();
        stats.bytes_in_flight == 0 && stats.connections == 1
    });
    assert!(srv.handle().stats().bytes_in_flight_peak <= bytes_max);
    exercise(&mut good, 4);
}

#[test]
fn never_reading_clients_are_cut_off_by_the_reply_timeout() {
    let config = budget_config(Duration::from_millis(500));
    let bytes_max = config.bytes_in_flight_max;
    let (_disk, srv) = mem_server(64 * MIB, config);
    // Kept open, never read.
    let hostile = never_reading_clients(&srv, 3, 4);
    wait_until("every hostile connection is cut off", || {
        let stats = srv.handle().stats();
        stats.connections == 0 && stats.bytes_in_flight == 0
    });
    let stats = srv.handle().stats();
    assert!(
        stats.bytes_in_flight_peak >= READ_BYTES_MAX as usize,
        "{stats:?}"
    );
    assert!(stats.bytes_in_flight_peak <= bytes_max, "{stats:?}");
    drop(hostile);
}

#[test]
fn a_client_that_trickle_reads_a_reply_is_cut_off() {
    let config = ServerConfig {
        reply_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    };
    let (_disk, srv) = mem_server(16 * MIB, config);
    let mut c = connect(&srv, "d").unwrap();
    let length = 8 << 20;
    let mut out = Vec::new();
    read_request(1, 0, length, &mut out);
    c.stream.write_all(&out).unwrap();
    // 4 KiB every 10 ms: each write makes progress, the whole reply would take 20 s.
    let mut received = 0usize;
    let mut buf = [0u8; 4096];
    loop {
        match c.stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => received += n,
        }
        assert!(
            received < length as usize,
            "the whole reply was written to a trickling reader"
        );
        thread::sleep(Duration::from_millis(10));
    }
    wait_until("the connection is gone", || {
        srv.handle().connection_count() == 0
    });
}
