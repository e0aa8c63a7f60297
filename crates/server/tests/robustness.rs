//! Robustness and lifecycle: hostile clients, concurrency, live export changes, graceful
//! shutdown, TCP. Driven with the `nbd-proto` client so every byte on the wire is controlled.

mod support;

use nbd_proto::{wire, Chunk, Command, CommandFlags, NbdErrno, Reply};
use rand::{Rng, SeedableRng};
use server::{BindAddr, Export, ExportRegistry, ServerConfig};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{pattern, MemExport, RawClient, TestServer};

const MIB: u64 = 1024 * 1024;

fn exports(list: Vec<Arc<MemExport>>) -> Vec<Arc<dyn Export>> {
    list.into_iter().map(|e| e as Arc<dyn Export>).collect()
}

#[test]
fn structured_client_exercises_every_command() {
    let disk = MemExport::new("disk0", 4 * MIB);
    let srv = TestServer::start(exports(vec![disk.clone()]));
    let mut c = RawClient::connect_unix(&srv.socket, "disk0", true).unwrap();
    assert!(c.negotiated.structured_replies);
    assert_eq!(c.negotiated.meta_contexts.len(), 1);
    assert_eq!(c.negotiated.size_bytes, 4 * MIB);
    let data = pattern(8192, 3);
    let r = c
        .call(Command::Write, CommandFlags::FUA, 4096, 8192, &data)
        .unwrap();
    assert_eq!(r.error, None);
    let r = c
        .call(Command::Read, CommandFlags::DF, 4096, 8192, &[])
        .unwrap();
    assert_eq!((r.error, r.data == data), (None, true));
    // FUA is accepted on every command once advertised, even where it means nothing.
    assert_eq!(
        c.call(Command::Flush, CommandFlags::FUA, 0, 0, &[])
            .unwrap()
            .error,
        None
    );
    assert_eq!(c.call(Command::Cache, 0, 0, 4096, &[]).unwrap().error, None);
    let r = c.call(Command::BlockStatus, 0, 0, 65536, &[]).unwrap();
    assert_eq!(r.extents, vec![(4096, 3), (8192, 0), (65536 - 12288, 3)]);
    let r = c
        .call(Command::BlockStatus, CommandFlags::REQ_ONE, 0, 65536, &[])
        .unwrap();
    assert_eq!(r.extents, vec![(4096, 3)]);
    assert_eq!(
        c.call(Command::Trim, CommandFlags::FUA, 4096, 4096, &[])
            .unwrap()
            .error,
        None
    );
    assert_eq!(
        disk.flushes.load(Ordering::Relaxed),
        2,
        "flush + trim with FUA"
    );
    let flags = CommandFlags::NO_HOLE | CommandFlags::FAST_ZERO | CommandFlags::FUA;
    assert_eq!(
        c.call(Command::WriteZeroes, flags, 8192, 4096, &[])
            .unwrap()
            .error,
        None
    );
    assert!(disk.contents()[4096..12288].iter().all(|&b| b == 0));
    // Errors come back as structured error chunks.
    let einval = Some(NbdErrno::Einval);
    assert_eq!(
        c.call(Command::Unknown(42), 0, 0, 0, &[]).unwrap().error,
        einval
    );
    assert_eq!(
        c.call(Command::Read, 1 << 7, 0, 512, &[]).unwrap().error,
        einval
    );
    assert_eq!(
        c.call(Command::Flush, CommandFlags::DF, 0, 0, &[])
            .unwrap()
            .error,
        einval
    );
    assert_eq!(
        c.call(Command::Flush, 0, 512, 0, &[]).unwrap().error,
        einval
    );
    assert_eq!(
        c.call(Command::Read, 0, 4 * MIB, 512, &[]).unwrap().error,
        einval
    );
    assert_eq!(
        c.call(Command::Read, 0, 0, 64 << 20, &[]).unwrap().error,
        einval
    );
    assert_eq!(
        c.call(Command::Write, 0, 100, 512, &[0; 512])
            .unwrap()
            .error,
        einval
    );
    assert_eq!(
        c.call(Command::Write, 0, 4 * MIB, 512, &[0; 512])
            .unwrap()
            .error,
        Some(NbdErrno::Enospc)
    );
    // The stream stayed in sync after every rejected write payload.
    let r = c.call(Command::Read, 0, 0, 512, &[]).unwrap();
    assert_eq!(r.error, None);
    c.send(Command::Disc, 0, 1, 0, 0, &[]).unwrap();
    let mut rest = Vec::new();
    c.stream.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "no reply to NBD_CMD_DISC");
}

#[test]
fn simple_replies_carry_read_data() {
    let disk = MemExport::new("disk0", MIB);
    disk.fill(&pattern(4096, 5));
    let srv = TestServer::start(exports(vec![disk]));
    let mut c = RawClient::connect_unix(&srv.socket, "disk0", false).unwrap();
    assert!(!c.negotiated.structured_replies);
    assert!(c.negotiated.meta_contexts.is_empty());
    let r = c.call(Command::Read, 0, 0, 4096, &[]).unwrap();
    assert_eq!(r.data, pattern(4096, 5));
    let r = c.call(Command::BlockStatus, 0, 0, 4096, &[]).unwrap();
    assert_eq!(r.error, Some(NbdErrno::Einval));
    let r = c
        .call(Command::Read, CommandFlags::DF, 0, 4096, &[])
        .unwrap();
    assert_eq!(r.error, Some(NbdErrno::Einval));
}

#[test]
fn pipelined_requests_get_every_reply() {
    let disk = MemExport::new("disk0", 8 * MIB);
    let srv = TestServer::start(exports(vec![disk.clone()]));
    let mut c = RawClient::connect_unix(&srv.socket, "disk0", true).unwrap();
    let count = 200u64;
    let mut out = Vec::new();
    for i in 0..count {
        nbd_proto::Request {
            flags: CommandFlags(0),
            command: Command::Write,
            cookie: i,
            offset: i * 32768,
            length: 32768,
        }
        .encode(&mut out);
        out.extend_from_slice(&vec![i as u8; 32768]);
    }
    c.stream.write_all(&out).unwrap();
    let mut seen = vec![false; count as usize];
    for _ in 0..count {
        let (reply, _) = c.recv(|_| 0).unwrap();
        let Reply::Simple {
            cookie,
            error: None,
        } = reply
        else {
            panic!("unexpected {reply:?}")
        };
        assert!(
            !std::mem::replace(&mut seen[cookie as usize], true),
            "duplicate reply"
        );
    }
    let contents = disk.contents();
    for i in 0..count as usize {
        assert!(contents[i * 32768..(i + 1) * 32768]
            .iter()
            .all(|&b| b == i as u8));
    }
}

#[test]
fn hostile_clients_do_not_disturb_a_good_one() {
    let disk = MemExport::new("disk0", 4 * MIB);
    let srv = TestServer::start(exports(vec![disk]));
    let stop = Arc::new(AtomicBool::new(false));
    let socket = srv.socket.clone();
    let good = {
        let stop = Arc::clone(&stop);
        let socket = socket.clone();
        thread::spawn(move || {
            let mut c = RawClient::connect_unix(&socket, "disk0", true).unwrap();
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) || rounds < 50 {
                let data = pattern(4096, rounds);
                let offset = (rounds % 512) * 4096;
                assert_eq!(
                    c.call(Command::Write, 0, offset, 4096, &data)
                        .unwrap()
                        .error,
                    None
                );
                assert_eq!(
                    c.call(Command::Read, 0, offset, 4096, &[]).unwrap().data,
                    data
                );
                rounds += 1;
            }
            rounds
        })
    };
    let seed = 0x9a7b_a9e5;
    eprintln!("hostile client seed {seed:#x}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let handshake_prefix = |structured: bool| -> Vec<u8> {
        let mut v = (wire::FLAG_C_FIXED_NEWSTYLE | wire::FLAG_C_NO_ZEROES)
            .to_be_bytes()
            .to_vec();
        if structured {
            nbd_proto::OptionRequest::StructuredReply.encode(&mut v);
        }
        nbd_proto::OptionRequest::Go {
            name: "disk0".into(),
            info_requests: vec![],
        }
        .encode(&mut v);
        v
    };
    for round in 0..60 {
        let mut bytes: Vec<u8> = match round % 6 {
            // Pure noise.
            0 => (0..rng.gen_range(1..4096)).map(|_| rng.gen()).collect(),
            // Valid client flags, then noise as options.
            1 => {
                let mut v = 1u32.to_be_bytes().to_vec();
                v.extend((0..rng.gen_range(1..2048)).map(|_| rng.gen::<u8>()));
                v
            }
            // An option claiming 4 GiB of data.
            2 => {
                let mut v = 1u32.to_be_bytes().to_vec();
                v.extend_from_slice(&wire::IHAVEOPT.to_be_bytes());
                v.extend_from_slice(&wire::OPT_GO.to_be_bytes());
                v.extend_from_slice(&u32::MAX.to_be_bytes());
                v
            }
            // Valid handshake, then noise as requests.
            3 => {
                let mut v = handshake_prefix(true);
                v.extend((0..rng.gen_range(1..4096)).map(|_| rng.gen::<u8>()));
                v
            }
            // Valid handshake, then a write that lies about its length and hangs up.
            4 => {
                let mut v = handshake_prefix(rng.gen());
                nbd_proto::Request {
                    flags: CommandFlags(0),
                    command: Command::Write,
                    cookie: 1,
                    offset: 0,
                    length: rng.gen_range(4096..(64 << 20)),
                }
                .encode(&mut v);
                v.extend_from_slice(&[0xee; 1000]);
                v
            }
            // Valid handshake, then valid-looking headers with random fields.
            _ => {
                let mut v = handshake_prefix(rng.gen());
                for _ in 0..50 {
                    nbd_proto::Request {
                        flags: CommandFlags(rng.gen()),
                        command: Command::from_wire(rng.gen_range(0..10)),
                        cookie: rng.gen(),
                        offset: rng.gen_range(0..8 * MIB),
                        length: rng.gen_range(0..(1 << 16)),
                    }
                    .encode(&mut v);
                }
                v
            }
        };
        if bytes.is_empty() {
            bytes.push(0);
        }
        let mut s = UnixStream::connect(&socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // The server may hang up at any point; errors are expected.
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = good.join().expect("good client failed");
    assert!(rounds >= 50);
    // Every hostile connection was cleaned up.
    let deadline = Instant::now() + Duration::from_secs(10);
    while srv.handle().connection_count() > 0 {
        assert!(
            Instant::now() < deadline,
            "connections leaked: {}",
            srv.handle().connection_count()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn concurrent_clients_on_several_exports() {
    let a = MemExport::new("a", 8 * MIB);
    let b = MemExport::new("b", 8 * MIB);
    let srv = TestServer::start(exports(vec![a.clone(), b.clone()]));
    thread::scope(|s| {
        for t in 0..8u64 {
            let socket = &srv.socket;
            s.spawn(move || {
                let name = if t % 2 == 0 { "a" } else { "b" };
                let mut c = RawClient::connect_unix(socket, name, t % 3 != 0).unwrap();
                for i in 0..32u64 {
                    let offset = t * MIB + i * 16384;
                    let data = pattern(16384, t * 1000 + i);
                    assert_eq!(
                        c.call(Command::Write, 0, offset, 16384, &data)
                            .unwrap()
                            .error,
                        None
                    );
                    assert_eq!(
                        c.call(Command::Read, 0, offset, 16384, &[]).unwrap().data,
                        data
                    );
                }
                assert_eq!(c.call(Command::Flush, 0, 0, 0, &[]).unwrap().error, None);
            });
        }
    });
    for t in 0..8u64 {
        let disk = if t % 2 == 0 { &a } else { &b };
        let contents = disk.contents();
        let i = 31;
        let offset = (t * MIB + i * 16384) as usize;
        assert_eq!(
            contents[offset..offset + 16384],
            pattern(16384, t * 1000 + i)[..]
        );
    }
}

/// An export whose writes take a while, to have requests in flight at shutdown.
struct SlowExport(Arc<MemExport>, Duration);

impl Export for SlowExport {
    fn name(&self) -> String {
        self.0.name()
    }
    fn description(&self) -> String {
        self.0.description()
    }
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn is_rotational(&self) -> bool {
        true
    }
    fn read_only(&self) -> bool {
        false
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.0.read(offset, buf)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        thread::sleep(self.1);
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.0.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.0.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64, fua: bool, no_hole: bool) -> io::Result<()> {
        self.0.write_zeroes(offset, len, fua, no_hole)
    }
    fn cache(&self, _: u64, _: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(28))
    }
    fn block_status(&self, _: u64, _: u64) -> io::Result<Vec<(u64, u32)>> {
        Err(io::Error::other("no map"))
    }
}

#[test]
fn export_errors_become_error_replies() {
    let inner = MemExport::new("slow", MIB);
    let srv = TestServer::start(vec![Arc::new(SlowExport(inner, Duration::ZERO))]);
    let mut c = RawClient::connect_unix(&srv.socket, "slow", true).unwrap();
    assert!(c
        .negotiated
        .flags
        .contains(nbd_proto::TransmissionFlags::ROTATIONAL));
    assert!(!c
        .negotiated
        .flags
        .contains(nbd_proto::TransmissionFlags::SEND_FAST_ZERO));
    assert_eq!(
        c.call(Command::Cache, 0, 0, 512, &[]).unwrap().error,
        Some(NbdErrno::Enospc)
    );
    assert_eq!(
        c.call(Command::BlockStatus, 0, 0, 512, &[]).unwrap().error,
        Some(NbdErrno::Eio)
    );
    let r = c
        .call(Command::WriteZeroes, CommandFlags::FAST_ZERO, 0, 512, &[])
        .unwrap();
    assert_eq!(
        r.error,
        Some(NbdErrno::Einval),
        "FAST_ZERO was not advertised"
    );
    assert_eq!(c.call(Command::Read, 0, 0, 512, &[]).unwrap().error, None);
}

#[test]
fn shutdown_answers_requests_in_flight() {
    let inner = MemExport::new("slow", 4 * MIB);
    let srv = TestServer::start(vec![Arc::new(SlowExport(
        inner.clone(),
        Duration::from_millis(150),
    ))]);
    let mut c = RawClient::connect_unix(&srv.socket, "slow", true).unwrap();
    let idle = RawClient::connect_unix(&srv.socket, "slow", false).unwrap();
    for i in 0..8u64 {
        c.send(Command::Write, 0, i, i * 4096, 4096, &[i as u8 + 1; 4096])
            .unwrap();
    }
    thread::sleep(Duration::from_millis(50));
    let socket = srv.socket.clone();
    let started = Instant::now();
    let shutdown = thread::spawn(move || srv.shutdown());
    let mut cookies = Vec::new();
    for _ in 0..8 {
        match c.recv(|_| 0).unwrap() {
            (
                Reply::Simple {
                    cookie,
                    error: None,
                },
                _,
            ) => cookies.push(cookie),
            other => panic!("unexpected {other:?}"),
        }
    }
    cookies.sort_unstable();
    assert_eq!(cookies, (0..8).collect::<Vec<_>>());
    shutdown.join().unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    let contents = inner.contents();
    assert!((0..8).all(|i| contents[i * 4096] == i as u8 + 1));
    // Then the connections are closed and the socket is gone.
    let mut rest = Vec::new();
    assert_eq!(c.stream.read_to_end(&mut rest).unwrap_or(0), 0);
    drop(idle);
    assert!(!socket.exists());
    assert!(UnixStream::connect(&socket).is_err());
}

#[test]
fn exports_are_added_and_removed_live() {
    let a = MemExport::new("a", MIB);
    let srv = TestServer::start(exports(vec![a.clone()]));
    let registry = srv.handle().registry().clone();
    assert!(RawClient::connect_unix(&srv.socket, "b", true).is_err());
    registry.add(MemExport::new("b", 2 * MIB)).unwrap();
    assert!(
        registry.add(MemExport::new("b", MIB)).is_err(),
        "duplicate name"
    );
    assert_eq!(registry.names(), vec!["a", "b"]);
    let mut cb = RawClient::connect_unix(&srv.socket, "b", true).unwrap();
    assert_eq!(cb.negotiated.size_bytes, 2 * MIB);
    let mut ca = RawClient::connect_unix(&srv.socket, "a", true).unwrap();
    assert_eq!(ca.call(Command::Read, 0, 0, 512, &[]).unwrap().error, None);

    let writes = a.writes.load(Ordering::SeqCst);
    let detached = registry.remove("a").expect("a was registered");
    // The client of `a` is answered from now on, but nothing reaches the export: a write is
    // refused with ESHUTDOWN (the kernel's client fails it instead of waiting for a reply on
    // a connection that died), and so is a read.
    let w = ca.call(Command::Write, 0, 0, 512, &[7u8; 512]).unwrap();
    assert_eq!(w.error, Some(NbdErrno::Eshutdown));
    let r = ca.call(Command::Read, 0, 0, 512, &[]).unwrap();
    assert_eq!(r.error, Some(NbdErrno::Eshutdown));
    assert_eq!(
        a.writes.load(Ordering::SeqCst),
        writes,
        "no write reached the removed export"
    );
    // Once idle, it is closed; the client of `b` is not.
    let mut rest = Vec::new();
    assert_eq!(ca.stream.read_to_end(&mut rest).unwrap_or(0), 0);
    let export = detached
        .wait_idle(Duration::from_secs(10))
        .expect("connections drained");
    assert_eq!(export.name(), "a");
    assert_eq!(cb.call(Command::Read, 0, 0, 512, &[]).unwrap().error, None);
    let err = RawClient::connect_unix(&srv.socket, "a", true)
        .err()
        .expect("a is gone");
    assert!(err.to_string().contains("rejected"), "{err}");
    assert!(registry.remove("a").is_none());
}

#[test]
fn oversized_write_drops_only_that_connection() {
    let srv = TestServer::start(exports(vec![MemExport::new("d", MIB)]));
    let mut good = RawClient::connect_unix(&srv.socket, "d", true).unwrap();
    let mut bad = RawClient::connect_unix(&srv.socket, "d", true).unwrap();
    bad.send(Command::Write, 0, 1, 0, (32 << 20) + 512, &[])
        .unwrap();
    let mut rest = Vec::new();
    let _ = bad.stream.read_to_end(&mut rest);
    assert!(rest.is_empty());
    assert_eq!(
        good.call(Command::Read, 0, 0, 512, &[]).unwrap().error,
        None
    );
}

#[test]
fn silent_handshake_times_out() {
    let config = ServerConfig {
        handshake_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let srv = TestServer::start_with(exports(vec![MemExport::new("d", MIB)]), config);
    let mut s = UnixStream::connect(&srv.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    assert_eq!(all.len(), 18, "greeting, then hang-up");
}

#[test]
fn tcp_listener_serves_the_same_exports() {
    let registry = ExportRegistry::new();
    registry.add(MemExport::new("t", MIB)).unwrap();
    let handle = server::start(
        &BindAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        registry,
        ServerConfig::default(),
    )
    .unwrap();
    let server::LocalAddr::Tcp(addr) = handle.local_addr().clone() else {
        panic!("expected a TCP address")
    };
    assert!(handle.local_addr().uri("t").starts_with("nbd://127.0.0.1:"));
    let stream = std::net::TcpStream::connect(addr).unwrap();
    let mut c = RawClient::handshake(Box::new(stream), "t", true).unwrap();
    let data = pattern(4096, 77);
    assert_eq!(
        c.call(Command::Write, 0, 0, 4096, &data).unwrap().error,
        None
    );
    assert_eq!(c.call(Command::Read, 0, 0, 4096, &[]).unwrap().data, data);
    drop(c);
    handle.shutdown();
    assert!(std::net::TcpStream::connect(addr).is_err());
}

#[test]
fn in_flight_limits_hold_with_a_tiny_budget() {
    let config = ServerConfig {
        workers_per_connection: 1,
        requests_in_flight_max: 2,
        bytes_in_flight_max: 4096,
        ..ServerConfig::default()
    };
    let disk = MemExport::new("d", 4 * MIB);
    let srv = TestServer::start_with(exports(vec![disk]), config);
    let mut c = RawClient::connect_unix(&srv.socket, "d", true).unwrap();
    let mut lens = HashMap::new();
    let mut out = Vec::new();
    for i in 0..64u64 {
        nbd_proto::Request {
            flags: CommandFlags(0),
            command: Command::Read,
            cookie: i,
            offset: i * 65536,
            length: 65536,
        }
        .encode(&mut out);
        lens.insert(i, 65536usize);
    }
    c.stream.write_all(&out).unwrap();
    let mut got = 0;
    let mut data_bytes = 0;
    while got < 64 {
        let (reply, _) = c.recv(|_| 0).unwrap();
        if let Reply::Chunk { done, chunk, .. } = reply {
            if let Chunk::OffsetData { data, .. } = chunk {
                data_bytes += data.len();
            }
            got += usize::from(done);
        }
    }
    assert_eq!(data_bytes, 64 * 65536);
    assert_eq!(lens.len(), 64);
}
