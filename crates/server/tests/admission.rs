//! Fair admission when the server is full (finding 3): connections from several TCP clients
//! (loopback addresses 127.0.0.x, which any local user can bind) that stay busy — requests in
//! flight, or small reads every few milliseconds, so none is ever idle — fill every place; a
//! newcomer from another client still gets in, by taking the place of a connection of the
//! client holding the most, and a busy connection so displaced answers its requests in flight
//! before it closes. Waits have generous safety deadlines that only turn a hang into a failure.

mod support;

use nbd_proto::Command;
use rand::{Rng, SeedableRng};
use server::{BindAddr, Export, ExportRegistry, ServerConfig, ServerHandle};
use std::io::{self, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};
use support::{pattern, read_request, recv_reply, GateExport, MemExport, RawClient, GATED_BELOW};

const MIB: u64 = 1024 * 1024;
/// How long a wait for the server may take before the test calls it hung.
const HUNG: Duration = Duration::from_secs(60);

struct TcpServer {
    handle: Option<ServerHandle>,
    addr: SocketAddr,
}

impl TcpServer {
    fn start(export: Arc<dyn Export>, config: ServerConfig) -> TcpServer {
        let registry = ExportRegistry::new();
        registry.add(export).unwrap();
        let bind = BindAddr::Tcp("127.0.0.1:0".parse().unwrap());
        let handle = server::start(&bind, registry, config).unwrap();
        let addr = match handle.local_addr() {
            server::LocalAddr::Tcp(addr) => *addr,
            other => panic!("{other:?}"),
        };
        TcpServer {
            handle: Some(handle),
            addr,
        }
    }

    fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        if let Some(handle) = self.handle.take() {
            handle.shutdown();
        }
    }
}

/// A TCP connection to `server` from the loopback address `source` (one client per address).
fn tcp_from(source: Ipv4Addr, server: SocketAddr) -> io::Result<TcpStream> {
    let SocketAddr::V4(server) = server else {
        panic!("IPv4 only")
    };
    let addr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor we own, with valid `sockaddr_in`s of the
    // stated length; the descriptor is handed to a `TcpStream` (which closes it) on every path.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let local = addr(source, 0);
        if libc::bind(fd, std::ptr::addr_of!(local).cast(), len) != 0 {
            return Err(io::Error::last_os_error());
        }
        let remote = addr(*server.ip(), server.port());
        if libc::connect(fd, std::ptr::addr_of!(remote).cast(), len) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// An NBD client from `source`; fails if the server closes the connection (refuses it).
fn client_from(source: Ipv4Addr, srv: &TcpServer, export: &str) -> io::Result<RawClient> {
    let stream = tcp_from(source, srv.addr)?;
    stream.set_read_timeout(Some(HUNG))?;
    RawClient::handshake(Box::new(stream), export, true)
}

/// A client's loopback address.
fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, n)
}

/// Polls `done` until it holds, failing after [`HUNG`].
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + HUNG;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// A connection that reads a small block every `every` until it fails (it was displaced) or
/// `stop` is set; returns how many reads it completed.
fn chatty(
    mut c: RawClient,
    offset: u64,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let mut done = 0;
        while !stop.load(Ordering::SeqCst) {
            match c.call(Command::Read, 0, offset, 4096, &[]) {
                Ok(r) if r.error.is_none() => done += 1,
                _ => break,
            }
            thread::sleep(every);
        }
        done
    })
}

/// Finding 3, reproduced small: two clients fill the server with connections that are never
/// idle — one client's each hold a read in flight (gated), the other's each send a small read
/// every 20 ms. Before fair admission, every newcomer was refused for as long as that went on.
#[test]
fn busy_clients_filling_the_server_cannot_lock_out_a_newcomer() {
    let export = GateExport::new("gate");
    export.inner.fill(&pattern(MIB as usize, 5));
    let config = ServerConfig {
        connections_max: 8,
        connections_per_client_max: 4,
        idle_timeout: Duration::from_secs(3600),
        ..ServerConfig::default()
    };
    let srv = TcpServer::start(Arc::clone(&export) as Arc<dyn Export>, config);
    // Client 127.0.0.2: four connections, each with a read in flight that waits on the gate.
    let mut gated: Vec<RawClient> = (0..4)
        .map(|i| {
            let mut c = client_from(ip(2), &srv, "gate").unwrap();
            let mut out = Vec::new();
            read_request(100 + i, 0, 4096, &mut out);
            c.stream.write_all(&out).unwrap();
            c
        })
        .collect();
    assert_eq!(export.wait_inside(4), 4);
    // Client 127.0.0.3: four connections reading every 20 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let chatters: Vec<_> = (0..4)
        .map(|_| {
            let c = client_from(ip(3), &srv, "gate").unwrap();
            chatty(c, GATED_BELOW, Duration::from_millis(20), Arc::clone(&stop))
        })
        .collect();
    assert_eq!(srv.handle().connection_count(), 8);
    // A newcomer from a third client gets in, and is served.
    let mut first = client_from(ip(4), &srv, "gate").expect("the first newcomer was refused");
    let r = first
        .call(Command::Read, 0, GATED_BELOW, 4096, &[])
        .unwrap();
    let expected = pattern(MIB as usize, 5);
    let at = GATED_BELOW as usize;
    assert_eq!(r.data, expected[at..at + 4096]);
    let stats = srv.handle().stats();
    assert_eq!(
        (stats.connections_displaced, stats.connections_refused),
        (1, 0),
        "{stats:?}"
    );
    // The chatty client lost its quietest connection (nothing in flight), not the gated ones.
    wait_until("a chatty connection has ended", || {
        chatters.iter().any(|t| t.is_finished())
    });
    // Now 127.0.0.2 holds the most (4, busy): a second newcomer drains one of its connections.
    let second = {
        let srv_addr = srv.addr;
        thread::spawn(move || {
            let stream = tcp_from(ip(5), srv_addr)?;
            stream.set_read_timeout(Some(HUNG))?;
            RawClient::handshake(Box::new(stream), "gate", true)
        })
    };
    wait_until("a busy connection is being drained", || {
        srv.handle().stats().connections_displaced == 2
    });
    export.open_gate();
    let mut second = second
        .join()
        .unwrap()
        .expect("the second newcomer was refused");
    assert_eq!(
        second.call(Command::Read, 0, 0, 4096, &[]).unwrap().data,
        expected[..4096]
    );
    // Every gated read was answered, the drained connection's included; then exactly that
    // one was closed.
    let mut closed = 0;
    for (i, c) in gated.iter_mut().enumerate() {
        let (cookie, error, data) = recv_reply(c);
        assert_eq!((cookie, error), (100 + i as u64, None));
        assert_eq!(data, expected[..4096]);
        if c.call(Command::Read, 0, GATED_BELOW, 4096, &[]).is_err() {
            closed += 1;
        }
    }
    assert_eq!(closed, 1, "one gated connection was drained and closed");
    stop.store(true, Ordering::SeqCst);
    for t in chatters {
        t.join().unwrap();
    }
    let stats = srv.handle().stats();
    assert_eq!(
        (stats.connections_evicted, stats.connections_refused),
        (0, 0),
        "{stats:?}"
    );
}

/// The seed of a randomized test: `TIERCACHE_ADMISSION_SEED` to replay one, else a new one;
/// printed either way.
fn seed() -> u64 {
    let seed = std::env::var("TIERCACHE_ADMISSION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("admission seed {seed} (replay: TIERCACHE_ADMISSION_SEED={seed})");
    seed
}

/// Real sockets, seeded: hostile clients fill the server with connections that are idle,
/// chatty (a small read every few ms) or pipelining (several reads always outstanding), and
/// reconnect whenever they lose one; well-behaved newcomers from fresh addresses arrive one
/// after another. Each gets in on its first try and is served.
#[test]
fn newcomers_get_in_whatever_the_hostile_clients_do() {
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let disk = MemExport::new("d", 8 * MIB);
    disk.fill(&pattern(MIB as usize, 6));
    let hostile = rng.gen_range(2..=4u8);
    let per_client = rng.gen_range(3..=5usize);
    let config = ServerConfig {
        connections_max: hostile as usize * per_client,
        connections_per_client_max: per_client,
        idle_timeout: Duration::from_secs(3600),
        ..ServerConfig::default()
    };
    let srv = TcpServer::start(Arc::clone(&disk) as Arc<dyn Export>, config);
    let stop = Arc::new(AtomicBool::new(false));
    let mut keep = Vec::new();
    let mut threads = Vec::new();
    for h in 0..hostile {
        for _ in 0..per_client {
            let c = client_from(ip(10 + h), &srv, "d").unwrap();
            let every = Duration::from_millis(rng.gen_range(1..30));
            match rng.gen_range(0..3) {
                0 => keep.push(c),
                1 => threads.push(chatty(c, 4096, every, Arc::clone(&stop))),
                _ => {
                    // Pipelining: keeps `depth` reads outstanding; reconnects when displaced.
                    let depth = rng.gen_range(2..=8u64);
                    let (stop, addr) = (Arc::clone(&stop), srv.addr);
                    let mut c = c;
                    threads.push(thread::spawn(move || {
                        let mut done = 0;
                        while !stop.load(Ordering::SeqCst) {
                            let mut out = Vec::new();
                            for cookie in 0..depth {
                                read_request(cookie, 8192, 4096, &mut out);
                            }
                            let ok = c.stream.write_all(&out).is_ok()
                                && (0..depth).all(|_| c.recv(|_| 0).is_ok());
                            if ok {
                                done += 1;
                                continue;
                            }
                            // Displaced: try to get back in (refused unless it is two behind).
                            let again = tcp_from(ip(10 + h), addr).and_then(|s| {
                                s.set_read_timeout(Some(HUNG))?;
                                RawClient::handshake(Box::new(s), "d", true)
                            });
                            match again {
                                Ok(again) => c = again,
                                Err(_) => thread::sleep(every),
                            }
                        }
                        done
                    }));
                }
            }
        }
    }
    assert_eq!(
        srv.handle().connection_count(),
        hostile as usize * per_client
    );
    let newcomers = rng.gen_range(1..=hostile);
    let expected = pattern(MIB as usize, 6);
    let mut served = Vec::new();
    for n in 0..newcomers {
        thread::sleep(Duration::from_millis(rng.gen_range(0..50)));
        let mut c = client_from(ip(100 + n), &srv, "d")
            .unwrap_or_else(|e| panic!("seed {seed}: newcomer {n} was refused: {e}"));
        let r = c.call(Command::Read, 0, 0, 4096, &[]).unwrap();
        assert_eq!(r.data, expected[..4096], "seed {seed}");
        served.push(c);
    }
    let stats = srv.handle().stats();
    assert!(
        stats.connections_displaced >= u64::from(newcomers),
        "seed {seed}: {stats:?}"
    );
    stop.store(true, Ordering::SeqCst);
    drop(keep);
    drop(served);
    for t in threads {
        t.join().unwrap();
    }
}
