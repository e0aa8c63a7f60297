//! The `/metrics` endpoint of `serve --metrics ADDR:PORT`: a minimal HTTP/1.1 server for
//! Prometheus' scrapes (GET or HEAD `/metrics`; `/` says where the metrics are).
//!
//! Invariants: one thread serves one connection at a time and closes it after one reply
//! (`Connection: close`), so a flood of connections costs no threads or memory beyond one
//! request; a request head is read for at most `READ_TIMEOUT` and `REQUEST_HEAD_MAX` bytes,
//! a reply written for at most `WRITE_TIMEOUT`, after which the connection is dropped (a
//! client that never sends or never reads delays the next scrape by at most these); the
//! request body, headers and query string are ignored. Bound to loopback unless an address is
//! given; no authentication (like node_exporter without its web config) — a warning is
//! logged for other addresses.
//!
//! Why not an HTTP crate: see docs/decisions.md ("Metrics over a one-thread HTTP server").

use anyhow::{Context, Result};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a client may take to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a reply may take to be written.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request head read; a longer one gets 431.
pub const REQUEST_HEAD_MAX: usize = 8 << 10;

/// How long, and how much, is read after the reply before closing (see `serve_one`).
const LINGER: Duration = Duration::from_millis(100);
const LINGER_BYTES_MAX: u64 = 64 << 10;

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders the metrics text for one scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running endpoint.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
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
    /// [`shutdown`](Self::shutdown).
    pub fn start(addr: SocketAddr, render: Render) -> Result<MetricsServer> {
        let listener = TcpListener::bind(addr)
            .with_context(|| format!("binding the metrics address {addr}"))?;
        let addr = listener.local_addr()?;
        if !addr.ip().to_canonical().is_loopback() {
            log::warn!(
                "metrics on {addr}, beyond this machine: anyone who reaches it can read the \
                 volumes' names, sizes and activity (there is no authentication)"
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("tc-metrics".into())
                .spawn(move || {
                    for conn in listener.incoming() {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        match conn {
                            Ok(s) => {
                                if let Err(e) = serve_one(s, &render) {
                                    log::debug!("metrics connection: {e}");
                                }
                            }
                            Err(e) => {
                                static LOG: engine::guard::Throttled =
                                    engine::guard::Throttled::new();
                                LOG.log(log::Level::Warn, format_args!("metrics accept: {e}"));
                                std::thread::sleep(Duration::from_millis(100));
                            }
                        }
                    }
                })?
        };
        Ok(MetricsServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    /// Where it listens (with the port chosen when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits for the thread (a reply being written finishes first).
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept: connect to ourselves (an unspecified address means this host).
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
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
    Metrics { head_only: bool },
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
        "/metrics" => Route::Metrics { head_only },
        "/" => Route::Index { head_only },
        _ => Route::NotFound,
    }
}

/// Reads the request head: up to the blank line, `REQUEST_HEAD_MAX` bytes and `READ_TIMEOUT`.
fn read_head(s: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + READ_TIMEOUT;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Ok(Some(head));
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(head));
        }
        if head.len() > REQUEST_HEAD_MAX {
            return Ok(None);
        }
    }
}

fn serve_one(mut s: TcpStream, render: &Render) -> std::io::Result<()> {
    s.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let (status, content_type, body, head_only) = match read_head(&mut s)? {
        None => (
            "431 Request Header Fields Too Large",
            "text/plain",
            String::new(),
            false,
        ),
        Some(head) => match route(&head) {
            Route::Metrics { head_only } => ("200 OK", CONTENT_TYPE, render(), head_only),
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
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        reply.extend_from_slice(body.as_bytes());
    }
    s.write_all(&reply)?;
    let _ = s.shutdown(Shutdown::Write);
    // Read what the client still sends (a head cut short at the limit) for a moment before
    // closing: closing with unread input resets the connection, and the client could lose
    // the reply.
    s.set_read_timeout(Some(LINGER))?;
    let _ = std::io::copy(&mut (&mut s).take(LINGER_BYTES_MAX), &mut std::io::sink());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        let m = |head_only| Route::Metrics { head_only };
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
        s.write_all(req).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_one_connection_at_a_time_and_drops_silent_ones() {
        let srv = MetricsServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(|| "x_total 1\n# EOF\n".to_string()),
        )
        .unwrap();
        let addr = srv.addr();
        assert_ne!(addr.port(), 0);
        // A client that says nothing holds the server at most READ_TIMEOUT.
        let _silent = TcpStream::connect(addr).unwrap();
        let t = Instant::now();
        let r = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(t.elapsed() < READ_TIMEOUT + Duration::from_secs(2));
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"), "{r}");
        assert!(r.contains(CONTENT_TYPE), "{r}");
        assert!(r.ends_with("\r\n\r\nx_total 1\n# EOF\n"), "{r}");
        let r = get(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            r.contains("Content-Length: 16\r\n") && r.ends_with("\r\n\r\n"),
            "{r}"
        );
        assert!(get(addr, b"GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let long = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(10_000));
        assert!(get(addr, long.as_bytes()).starts_with("HTTP/1.1 431"));
        srv.shutdown();
        assert!(TcpStream::connect(addr).is_err());
    }
}
