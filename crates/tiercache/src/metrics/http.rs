//! The `/metrics` endpoint of `serve --metrics ADDR:PORT`: a minimal HTTP/1.1 server for
//! Prometheus' scrapes (GET or HEAD `/metrics`, answered in the format the `Accept` header
//! asks for, see `prom::Format::negotiate`; `/` says where the metrics are).
//!
//! One thread serves every connection from a `poll` loop over nonblocking sockets, so a client
//! that is slow to send its request or to read its reply holds a slot, never the thread: the
//! requests of other clients are read and answered while it waits.
//!
//! Invariants:
//! - at most `MAX_CONNECTIONS` connections are open; a newcomer past that closes the oldest
//!   connection that has had its reply (lingering), else the oldest still sending its request,
//!   else the oldest one being answered (`evict`), so a flood of connections costs at most
//!   that many sockets and buffers and a scraper's fresh connection is never the one dropped;
//! - each connection has one deadline for its current phase: the whole request head within
//!   `READ_TIMEOUT` of the accept (at most `REQUEST_HEAD_MAX` bytes, else 431), the whole reply
//!   written within `WRITE_TIMEOUT` of the request, then at most `LINGER` (and
//!   `LINGER_BYTES_MAX` bytes) of reading before the close; past its deadline it is closed;
//! - a connection holds its request head (at most `REQUEST_HEAD_MAX` bytes) or one reply, so
//!   the memory is bounded by `MAX_CONNECTIONS` replies;
//! - each connection gets one reply (`Connection: close`); the request body and query string
//!   are ignored, of the headers only `Accept` is read;
//! - no accept, read or write blocks the thread; only rendering a scrape's reply takes it
//!   (the sample locks the engine's state briefly, like `status`).
//!
//! Bound to loopback unless an address is given; no authentication (like node_exporter without
//! its web config) — a warning is logged for other addresses.
//!
//! Why not an HTTP crate, and why one polling thread: see docs/decisions.md ("Metrics over a
//! one-thread HTTP server").

use super::prom::Format;
use anyhow::{Context, Result};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most connections open at once (see the module header for which one a newcomer closes).
pub const MAX_CONNECTIONS: usize = 16;
/// Longest a client may take, from its connection's accept, to send its whole request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a reply may take to be written, all of it.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head read; a longer one gets 431.
pub const REQUEST_HEAD_MAX: usize = 8 << 10;

/// How long, and how much, is read after the reply before closing (see `Phase::Lingering`).
const LINGER: Duration = Duration::from_millis(100);
const LINGER_BYTES_MAX: u64 = 64 << 10;
/// Most connections accepted between two polls: a connection accepted in one batch has its
/// request read before `MAX_CONNECTIONS` newer ones can push it out.
const ACCEPT_BATCH: usize = MAX_CONNECTIONS / 2;
/// How long accepting pauses after an error other than a lost connection (out of descriptors).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Renders the metrics text for one scrape, in the format asked for.
pub type Render = Arc<dyn Fn(Format) -> String + Send + Sync>;

/// A running endpoint.
pub struct MetricsServer {
    addr: SocketAddr,
    /// The thread stops when this is closed (`shutdown`, or the server dropped).
    wake: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
}

/// Parses `--metrics`: `ADDR:PORT`, or a port alone for 127.0.0.1.
pub fn parse_addr(s: &str) -> Result<SocketAddr> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse()
        .with_context(|| format!("metrics address '{s}' is not like 127.0.0.1:9563 or a port"))
}

impl MetricsServer {
    /// Binds `addr` (port 0: any free port; see [`addr`](Self::addr)) and serves until
    /// [`shutdown`](Self::shutdown) (or until dropped).
    pub fn start(addr: SocketAddr, render: Render) -> Result<MetricsServer> {
        let listener = TcpListener::bind(addr)
            .with_context(|| format!("binding the metrics address {addr}"))?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        if !addr.ip().to_canonical().is_loopback() {
            log::warn!(
                "metrics on {addr}, beyond this machine: anyone who reaches it can read the \
                 volumes' names, sizes and activity (there is no authentication)"
            );
        }
        let (wake, woken) = UnixStream::pair()?;
        let thread = std::thread::Builder::new()
            .name("tc-metrics".into())
            .spawn(move || serve(listener, woken, render))?;
        Ok(MetricsServer {
            addr,
            wake: Some(wake),
            thread: Some(thread),
        })
    }

    /// Where it listens (with the port chosen when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits for the thread; open connections are closed, replies being
    /// written cut short.
    pub fn shutdown(mut self) {
        drop(self.wake.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("metrics thread panicked");
            }
        }
    }
}

/// What to answer to a request head.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool, format: Format },
    Index { head_only: bool },
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

fn route(head: &[u8]) -> Route {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Route::BadRequest;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") {
        return Route::BadRequest;
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Route::MethodNotAllowed,
    };
    match target.split('?').next().unwrap_or("") {
        "/metrics" => Route::Metrics {
            head_only,
            format: Format::negotiate(&accept(head)),
        },
        "/" => Route::Index { head_only },
        _ => Route::NotFound,
    }
}

/// The values of every `Accept` header of a request head, joined by commas (empty: none).
fn accept(head: &[u8]) -> String {
    String::from_utf8_lossy(head)
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("accept")
                .then(|| value.trim().to_string())
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The whole reply to a request head (`None`: longer than `REQUEST_HEAD_MAX`).
fn respond(head: Option<&[u8]>, render: &Render) -> Vec<u8> {
    let (status, content_type, body, head_only) = match head {
        None => (
            "431 Request Header Fields Too Large",
            "text/plain",
            String::new(),
            false,
        ),
        Some(head) => match route(head) {
            Route::Metrics { head_only, format } => {
                ("200 OK", format.content_type(), render(format), head_only)
            }
            Route::Index { head_only } => (
                "200 OK",
                "text/plain; charset=utf-8",
                "tiercache: metrics are at /metrics\n".to_string(),
                head_only,
            ),
            Route::NotFound => ("404 Not Found", "text/plain", "not found\n".into(), false),
            Route::MethodNotAllowed => (
                "405 Method Not Allowed",
                "text/plain",
                "only GET and HEAD\n".into(),
                false,
            ),
            Route::BadRequest => ("400 Bad Request", "text/plain", String::new(), false),
        },
    };
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Vary: Accept\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        reply.extend_from_slice(body.as_bytes());
    }
    reply
}

/// Where a connection is in its one exchange.
enum Phase {
    /// Receiving the request head (what came so far).
    Reading(Vec<u8>),
    /// Sending the reply (`sent` bytes of it so far).
    Writing { reply: Vec<u8>, sent: usize },
    /// The reply is sent and our side shut down: what the client still sends (a head cut
    /// short at the limit) is read for a moment before closing, because closing with unread
    /// input resets the connection and the client could lose the reply.
    Lingering { drained: u64 },
}

struct Conn {
    stream: TcpStream,
    phase: Phase,
    /// When the current phase must be over (see the module header).
    deadline: Instant,
}

impl Conn {
    fn events(&self) -> libc::c_short {
        match self.phase {
            Phase::Writing { .. } => libc::POLLOUT,
            Phase::Reading(_) | Phase::Lingering { .. } => libc::POLLIN,
        }
    }

    /// Which connection `evict` closes first: lowest rank, then oldest.
    fn rank(&self) -> u8 {
        match self.phase {
            Phase::Lingering { .. } => 0,
            Phase::Reading(_) => 1,
            Phase::Writing { .. } => 2,
        }
    }

    fn phase_name(&self) -> &'static str {
        ["lingering", "reading its request", "writing its reply"][usize::from(self.rank())]
    }

    /// Does what can be done without blocking; `Ok(false)` when the connection is finished.
    fn progress(&mut self, render: &Render) -> io::Result<bool> {
        loop {
            match &mut self.phase {
                Phase::Reading(head) => {
                    let mut buf = [0u8; 1024];
                    // Some(fits): the head is complete (`false`: too long).
                    let complete = loop {
                        match self.stream.read(&mut buf) {
                            // End of input: what came is the head.
                            Ok(0) => break Some(true),
                            Ok(n) => {
                                let from = head.len().saturating_sub(3);
                                head.extend_from_slice(&buf[..n]);
                                let new = &head[from..];
                                if new.windows(4).any(|w| w == b"\r\n\r\n")
                                    || new.windows(2).any(|w| w == b"\n\n")
                                {
                                    break Some(true);
                                }
                                if head.len() > REQUEST_HEAD_MAX {
                                    break Some(false);
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break None,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    };
                    let Some(fits) = complete else {
                        return Ok(true);
                    };
                    let reply = respond(fits.then_some(&head[..]), render);
                    self.phase = Phase::Writing { reply, sent: 0 };
                    self.deadline = Instant::now() + WRITE_TIMEOUT;
                }
                Phase::Writing { reply, sent } => {
                    while *sent < reply.len() {
                        match self.stream.write(&reply[*sent..]) {
                            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                            Ok(n) => *sent += n,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    }
                    let _ = self.stream.shutdown(Shutdown::Write);
                    self.phase = Phase::Lingering { drained: 0 };
                    self.deadline = Instant::now() + LINGER;
                }
                Phase::Lingering { drained } => {
                    let mut buf = [0u8; 4096];
                    loop {
                        match self.stream.read(&mut buf) {
                            Ok(0) => return Ok(false),
                            Ok(n) => {
                                *drained += n as u64;
                                if *drained >= LINGER_BYTES_MAX {
                                    return Ok(false);
                                }
                            }
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
            }
        }
    }
}

fn pollfd(fd: libc::c_int, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// `poll`'s timeout until `until` (rounded up to a millisecond; -1: none).
fn poll_timeout(until: Option<Instant>, now: Instant) -> libc::c_int {
    until.map_or(-1, |t| {
        let ms = t.saturating_duration_since(now).as_micros().div_ceil(1000);
        libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
    })
}

/// Closes one connection to make room for a newcomer (see the module header).
fn evict(conns: &mut VecDeque<Conn>) {
    static LOG: engine::guard::Throttled = engine::guard::Throttled::new();
    let Some((i, _)) = conns.iter().enumerate().min_by_key(|(i, c)| (c.rank(), *i)) else {
        return;
    };
    if let Some(c) = conns.remove(i) {
        LOG.log(
            log::Level::Warn,
            format_args!(
                "metrics: {MAX_CONNECTIONS} connections open; closed the oldest one {} to \
                 make room",
                c.phase_name()
            ),
        );
    }
}

/// Accepts what is waiting, up to `ACCEPT_BATCH`; `Some(until)` to pause accepting after an
/// error.
fn accept_some(
    listener: &TcpListener,
    conns: &mut VecDeque<Conn>,
    render: &Render,
) -> Option<Instant> {
    for _ in 0..ACCEPT_BATCH {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                ) =>
            {
                continue
            }
            Err(e) => {
                static LOG: engine::guard::Throttled = engine::guard::Throttled::new();
                LOG.log(log::Level::Warn, format_args!("metrics accept: {e}"));
                return Some(Instant::now() + ACCEPT_PAUSE);
            }
        };
        if let Err(e) = stream.set_nonblocking(true) {
            log::debug!("metrics connection: {e}");
            continue;
        }
        if conns.len() >= MAX_CONNECTIONS {
            evict(conns);
        }
        let mut c = Conn {
            stream,
            phase: Phase::Reading(Vec::new()),
            deadline: Instant::now() + READ_TIMEOUT,
        };
        // A scraper's request is usually here by now: answer it before newer connections
        // can push this one out.
        match c.progress(render) {
            Ok(true) => conns.push_back(c),
            Ok(false) => {}
            Err(e) => log::debug!("metrics connection: {e}"),
        }
    }
    None
}

/// The server's thread: polls the listener and every connection until `woken` is closed.
fn serve(listener: TcpListener, woken: UnixStream, render: Render) {
    // In accept order: the front is the oldest.
    let mut conns: VecDeque<Conn> = VecDeque::new();
    let mut accept_paused: Option<Instant> = None;
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_CONNECTIONS + 2);
    loop {
        let now = Instant::now();
        if accept_paused.is_some_and(|t| t <= now) {
            accept_paused = None;
        }
        fds.clear();
        fds.push(pollfd(woken.as_raw_fd(), libc::POLLIN));
        // A negative descriptor is skipped by poll.
        let listen_fd = if accept_paused.is_some() {
            -1
        } else {
            listener.as_raw_fd()
        };
        fds.push(pollfd(listen_fd, libc::POLLIN));
        fds.extend(
            conns
                .iter()
                .map(|c| pollfd(c.stream.as_raw_fd(), c.events())),
        );
        let next = conns.iter().map(|c| c.deadline).chain(accept_paused).min();
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the whole call.
        let n = unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                poll_timeout(next, now),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                static LOG: engine::guard::Throttled = engine::guard::Throttled::new();
                LOG.log(log::Level::Warn, format_args!("metrics poll: {e}"));
                std::thread::sleep(ACCEPT_PAUSE);
            }
            continue;
        }
        if fds[0].revents != 0 {
            return; // shut down: the other end of `woken` is closed
        }
        // `fds[2..]` are the connections, in the order of `conns`.
        let mut ready = fds[2..].iter().map(|f| f.revents != 0);
        conns.retain_mut(|c| {
            if !ready.next().unwrap_or(false) {
                return true;
            }
            c.progress(&render).unwrap_or_else(|e| {
                log::debug!("metrics connection: {e}");
                false
            })
        });
        let now = Instant::now();
        conns.retain(|c| {
            let alive = c.deadline > now;
            if !alive {
                log::debug!("metrics connection closed: too slow {}", c.phase_name());
            }
            alive
        });
        if fds[1].revents != 0 {
            accept_paused = accept_some(&listener, &mut conns, &render);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        let m = |head_only| Route::Metrics {
            head_only,
            format: Format::Classic,
        };
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), m(false));
        assert_eq!(route(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), m(false));
        assert_eq!(route(b"HEAD /metrics HTTP/1.1\r\n\r\n"), m(true));
        assert_eq!(
            route(b"GET / HTTP/1.1\r\n\r\n"),
            Route::Index { head_only: false }
        );
        assert_eq!(route(b"GET /x HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(
            route(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Route::MethodNotAllowed
        );
        for bad in [
            &b""[..],
            b"GET\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET /metrics HTTP/2\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"\xff\xfe /metrics HTTP/1.1\r\n\r\n",
        ] {
            assert_eq!(route(bad), Route::BadRequest, "{bad:?}");
        }
    }

    #[test]
    fn the_format_follows_every_accept_header() {
        let om = |head: &[u8]| match route(head) {
            Route::Metrics { format, .. } => format == Format::OpenMetrics,
            r => panic!("{r:?}"),
        };
        assert!(om(
            b"GET /metrics HTTP/1.1\r\naccept: application/openmetrics-text\r\n\r\n"
        ));
        // Header names in any case, several headers, values past the head's end ignored.
        assert!(om(
            b"GET /metrics HTTP/1.1\nACCEPT: text/plain;q=0.5\nAccept: \
                     application/openmetrics-text;version=1.0.0\n\n"
        ));
        assert!(!om(
            b"GET /metrics HTTP/1.1\r\nX-Accept: application/openmetrics-text\r\n\r\n"
        ));
        assert!(!om(
            b"GET /metrics HTTP/1.1\r\n\r\nAccept: application/openmetrics-text\r\n\r\n"
        ));
        assert_eq!(
            accept(b"GET / HTTP/1.1\r\nAccept: a/b\r\nHost: x\r\naccept:c/d ; q=1\r\n\r\n"),
            "a/b,c/d ; q=1"
        );
    }

    #[test]
    fn a_bare_port_means_loopback() {
        assert_eq!(
            parse_addr("9563").unwrap(),
            "127.0.0.1:9563".parse().unwrap()
        );
        assert_eq!(parse_addr("[::1]:0").unwrap(), "[::1]:0".parse().unwrap());
        assert!(parse_addr("localhost:9563").is_err());
        assert!(parse_addr("70000").is_err());
    }

    fn get(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        // A hang guard, not a timing assertion.
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(req).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// What the server closed: a read returns end of input or an error (reset), not a timeout.
    fn closed_by_server(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        match s.read(&mut [0u8; 64]) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }

    fn test_server(body: impl Fn(Format) -> String + Send + Sync + 'static) -> MetricsServer {
        MetricsServer::start("127.0.0.1:0".parse().unwrap(), Arc::new(body)).unwrap()
    }

    #[test]
    fn answers_in_the_format_asked_for_and_stops() {
        let srv = test_server(|f| match f {
            Format::OpenMetrics => "x_total 1\n# EOF\n".to_string(),
            Format::Classic => "x_total 1\n".to_string(),
        });
        let addr = srv.addr();
        assert_ne!(addr.port(), 0);
        let r = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(
            r.contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"),
            "{r}"
        );
        assert!(r.ends_with("\r\n\r\nx_total 1\n"), "{r}");
        let r = get(
            addr,
            b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n",
        );
        assert!(r.contains(Format::OpenMetrics.content_type()), "{r}");
        assert!(r.ends_with("\r\n\r\nx_total 1\n# EOF\n"), "{r}");
        let r = get(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            r.contains("Content-Length: 10\r\n") && r.ends_with("\r\n\r\n"),
            "{r}"
        );
        assert!(get(addr, b"GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let long = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(10_000));
        assert!(get(addr, long.as_bytes()).starts_with("HTTP/1.1 431"));
        srv.shutdown();
        assert!(TcpStream::connect(addr).is_err());
    }

    #[test]
    fn scrapes_are_answered_while_slow_clients_wait_and_the_oldest_give_way() {
        // A reply far larger than the socket buffers: a client that does not read it holds
        // its connection in the middle of the write.
        let big = "x".repeat(32 << 20);
        let srv = test_server(move |_| big.clone());
        let addr = srv.addr();
        let req = b"GET /metrics HTTP/1.1\r\n\r\n";
        // One that asks and does not read, one that sends half a head and stops, one silent.
        let mut not_reading = TcpStream::connect(addr).unwrap();
        not_reading.write_all(req).unwrap();
        let mut half = TcpStream::connect(addr).unwrap();
        half.write_all(b"GET /metr").unwrap();
        let mut silent = TcpStream::connect(addr).unwrap();
        // Each of them waits: other scrapes are answered meanwhile, in full.
        for _ in 0..2 {
            let r = get(addr, req);
            assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{}", &r[..100]);
            assert!(r.ends_with(&"x".repeat(1000)) && r.len() > 32 << 20);
        }
        // Past the bound, the clients still sending their heads give way, oldest first; the
        // one being answered stays while there are others to close.
        let newer: Vec<TcpStream> = (0..MAX_CONNECTIONS - 1)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        assert!(closed_by_server(&mut half));
        assert!(closed_by_server(&mut silent));
        let r = get(addr, req);
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{}", &r[..100]);
        // The reply cut short by a close would end early.
        drop(newer);
        not_reading
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut whole = Vec::new();
        not_reading.read_to_end(&mut whole).unwrap();
        assert!(whole.len() > 32 << 20, "{}", whole.len());
        srv.shutdown();
    }

    #[test]
    fn a_client_slower_than_the_deadline_is_closed() {
        let srv = test_server(|_| String::new());
        let mut s = TcpStream::connect(srv.addr()).unwrap();
        let t = Instant::now();
        // A byte at a time, each well within the deadline, the whole head never.
        let closed = loop {
            if s.write_all(b"a").is_err() {
                break true;
            }
            std::thread::sleep(Duration::from_millis(200));
            if t.elapsed() > READ_TIMEOUT * 10 {
                break false;
            }
        };
        assert!(closed, "a trickling client outlived the request deadline");
        assert!(t.elapsed() >= READ_TIMEOUT);
        srv.shutdown();
    }
}
