//! Listening sockets and connected streams, unix or TCP, behind one type each.
//!
//! Owns: binding (unix socket files through [`crate::unix_socket`]), waking a blocked `accept`
//! without touching the socket file, telling clients apart (peer uid on unix sockets, peer IP
//! address on TCP), and socket I/O with a deadline.
//!
//! Invariants: a connection's socket is one descriptor, shared through an `Arc` by everyone who
//! reads, writes or kicks it (never duplicated), so it costs [`DESCRIPTORS_PER_CONNECTION`].
//! I/O with a deadline never outlasts it, however the peer trickles bytes: a read sets the
//! receive timeout to the time left before every system call (a read returns as soon as any
//! byte arrives, and the kernel bounds one call by that timeout); a write sends without
//! blocking and waits in `poll` for the time left (the send timeout cannot bound one call on
//! a unix socket). Only the receive timeout is a socket option, set only by the one reader of
//! a connection.
//!
//! Fault model: OS errors are returned to the caller as `io::Error`; a passed deadline is
//! `io::ErrorKind::TimedOut`.

use crate::unix_socket::{self, UnixSocketFile, UnixSocketPerms};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Descriptors one connection holds: its socket, shared (see the module invariants).
pub(crate) const DESCRIPTORS_PER_CONNECTION: u64 = 1;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// Where the server actually listens (a TCP port 0 is resolved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalAddr {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl LocalAddr {
    /// An NBD URI for `export` on this address (`nbd+unix:///NAME?socket=PATH` or
    /// `nbd://HOST:PORT/NAME`).
    pub fn uri(&self, export: &str) -> String {
        match self {
            LocalAddr::Unix(path) => format!("nbd+unix:///{export}?socket={}", path.display()),
            LocalAddr::Tcp(addr) => format!("nbd://{addr}/{export}"),
        }
    }
}

/// How a server offers TLS.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// The server's certificate and key, and the CA client certificates must chain to if it
    /// verifies them.
    pub credentials: nbd_tls::ServerTls,
    /// Refuse every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` until the client has
    /// upgraded (`NBD_REP_ERR_TLS_REQD`; the spec's FORCEDTLS). Otherwise clients may upgrade
    /// or stay in clear (SELECTIVETLS without TLS-only exports).
    pub required: bool,
}

/// The warning to log when serving TCP on `addr` with `tls`, or `None` for a loopback address
/// or when TLS is required and client certificates are verified.
pub fn tcp_exposure_warning(addr: &SocketAddr, tls: Option<&TlsConfig>) -> Option<String> {
    let ip = addr.ip().to_canonical();
    if ip.is_loopback() {
        return None;
    }
    let reach = if ip.is_unspecified() {
        "on every network interface".to_string()
    } else {
        format!("on {ip}")
    };
    let port = addr.port();
    let why = match tls {
        None => {
            "anyone who can reach this port can read and write the exported disks; there is no \
             TLS or authentication; bind 127.0.0.1 or use a unix socket unless the network is \
             trusted, or configure TLS with client certificates"
        }
        Some(tls) if !tls.required => {
            "TLS is optional: clients that do not start it are served in clear, and anyone who \
             can reach this port can read and write the exported disks; require TLS and verify \
             client certificates unless the network is trusted"
        }
        Some(tls) if !tls.credentials.verifies_clients() => {
            "TLS encrypts the traffic, but client certificates are not verified: anyone who can \
             reach this port can read and write the exported disks; verify client certificates \
             (a CA for them) unless the network is trusted"
        }
        Some(_) => return None,
    };
    Some(format!("serving NBD over TCP {reach} (port {port}): {why}"))
}

/// Who a connection comes from, for the per-client connection limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ClientKey {
    /// The peer process's user on a unix socket (`SO_PEERCRED`).
    Uid(u32),
    /// The peer's address on TCP (IPv4-mapped IPv6 addresses as IPv4).
    Ip(IpAddr),
}

impl std::fmt::Display for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientKey::Uid(uid) => write!(f, "uid {uid}"),
            ClientKey::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

pub(crate) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    /// Binds `addr`; for a unix socket also returns the socket file to remove at shutdown.
    pub(crate) fn bind(
        addr: &BindAddr,
        perms: &UnixSocketPerms,
    ) -> io::Result<(Listener, LocalAddr, Option<UnixSocketFile>)> {
        match addr {
            BindAddr::Unix(path) => {
                let (listener, file) = unix_socket::bind_unix(path, perms)?;
                Ok((
                    Listener::Unix(listener),
                    LocalAddr::Unix(path.clone()),
                    Some(file),
                ))
            }
            BindAddr::Tcp(addr) => {
                let listener = TcpListener::bind(addr)?;
                let local = listener.local_addr()?;
                Ok((Listener::Tcp(listener), LocalAddr::Tcp(local), None))
            }
        }
    }

    pub(crate) fn accept(&self) -> io::Result<(Stream, ClientKey)> {
        match self {
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                let uid = peer_uid(&s)?;
                Ok((Stream::Unix(s), ClientKey::Uid(uid)))
            }
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), ClientKey::Ip(peer.ip().to_canonical())))
            }
        }
    }

    /// Makes a blocked (and every later) `accept` fail at once, without connecting to the
    /// socket: `shutdown(2)` on a listening socket does this on Linux, for unix and TCP alike.
    pub(crate) fn wake(&self) -> io::Result<()> {
        let fd = match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        };
        // SAFETY: `fd` is owned by `self`, which is borrowed (so open) for the whole call;
        // `shutdown` touches no memory of ours.
        if unsafe { libc::shutdown(fd, libc::SHUT_RDWR) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    peer_cred(stream).map(|c| c.uid)
}

/// The credentials of the process at the other end of a unix socket (`SO_PEERCRED`): its pid
/// as this process's pid namespace numbers it, its uid and gid.
pub fn peer_cred(stream: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and `len` is the size of `cred`; the
    // descriptor is owned by `stream`, borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(cred)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Time left until `deadline`, or `TimedOut` once it has passed.
pub(crate) fn time_left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
    } else {
        Ok(left)
    }
}

#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    /// Shuts down one or both directions; errors (e.g. already closed) are irrelevant here.
    pub(crate) fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }

    /// Whether the peer has closed the connection for good (or it failed): `poll` reports
    /// `POLLHUP` or `POLLERR` — both directions shut down, a reset, or a send to a peer that
    /// closed. A peer that only shut down its sending side (a half-close, after which it may
    /// still read replies) does not count. One non-blocking system call.
    pub(crate) fn hung_up(&self) -> bool {
        let mut poll_fd = libc::pollfd {
            fd: self.as_raw_fd(),
            events: 0,
            revents: 0,
        };
        // SAFETY: `poll_fd` is one valid, writable `pollfd` for the duration of the call; the
        // descriptor is kept open by `self`. A zero timeout never blocks.
        let ready = unsafe { libc::poll(&mut poll_fd, 1, 0) };
        ready > 0 && poll_fd.revents & (libc::POLLHUP | libc::POLLERR) != 0
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// A [`Stream`] read or written with an optional deadline for each call.
pub(crate) struct Deadlined<'a> {
    stream: &'a Stream,
    /// Applies to every later call; change it at will.
    pub(crate) deadline: Option<Instant>,
    /// Whether the socket may have a receive timeout set (saves clearing it before every read
    /// without a deadline).
    read_timeout_set: bool,
}

impl<'a> Deadlined<'a> {
    pub(crate) fn new(stream: &'a Stream, deadline: Option<Instant>) -> Deadlined<'a> {
        Deadlined {
            stream,
            deadline,
            read_timeout_set: true,
        }
    }
}

/// `WouldBlock` is how an expired socket timeout surfaces; report it as a timeout.
fn timed_out(err: io::Error) -> io::Error {
    if err.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
    } else {
        err
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.deadline.is_some() || self.read_timeout_set {
            let timeout = self.deadline.map(time_left).transpose()?;
            self.stream.set_read_timeout(timeout)?;
            self.read_timeout_set = timeout.is_some();
        }
        let result = match self.stream {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        };
        result.map_err(timed_out)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)])
    }

    /// Forwarded so replies go out with one `writev`-like call (the default writes only the
    /// first buffer). With a deadline, sends without blocking and waits in `poll` for the time
    /// left: a blocked send's `SO_SNDTIMEO` restarts for every chunk on a unix socket, so a
    /// reader taking a little at a time could stretch one call indefinitely.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let Some(deadline) = self.deadline else {
            return match self.stream {
                Stream::Unix(s) => (&*s).write_vectored(bufs),
                Stream::Tcp(s) => (&*s).write_vectored(bufs),
            };
        };
        let fd = self.stream.as_raw_fd();
        time_left(deadline)?;
        loop {
            match send_nowait(fd, bufs) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                    wait_writable(fd, time_left(deadline)?)?;
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                result => return result,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One `sendmsg` of `bufs` that does not block (nor raise SIGPIPE).
fn send_nowait(fd: RawFd, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: all zeroes is a valid `msghdr`: no address, no control data, no buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is guaranteed ABI-compatible with `iovec`; the kernel only reads through it.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast::<libc::iovec>();
    msg.msg_iovlen = bufs.len() as _;
    // SAFETY: `msg` points at `bufs.len()` valid iovecs borrowed for the duration of the call;
    // `fd` is a socket kept open by the borrowed stream.
    let sent = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if sent < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(sent as usize)
    }
}

/// Waits until `fd` is writable (or in error, which the next send reports), at most
/// `timeout` (rounded up to a millisecond).
fn wait_writable(fd: RawFd, timeout: Duration) -> io::Result<()> {
    let mut poll_fd = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    let timeout_ms = timeout.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
    // SAFETY: `poll_fd` is one valid, writable `pollfd` for the duration of the call.
    if unsafe { libc::poll(&mut poll_fd, 1, timeout_ms) } < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_exposure_warning_only_off_loopback() {
        for quiet in ["127.0.0.1:10809", "[::1]:10809", "[::ffff:127.0.0.1]:1"] {
            assert_eq!(
                tcp_exposure_warning(&quiet.parse().unwrap(), None),
                None,
                "{quiet}"
            );
        }
        let all = tcp_exposure_warning(&"0.0.0.0:10809".parse().unwrap(), None).unwrap();
        assert!(all.contains("every network interface"), "{all}");
        assert!(all.contains("read and write"), "{all}");
        assert!(all.contains("no TLS or authentication"), "{all}");
        assert!(all.contains("127.0.0.1"), "{all}");
        let one = tcp_exposure_warning(&"[2001:db8::1]:10809".parse().unwrap(), None).unwrap();
        assert!(
            one.contains("2001:db8::1") && one.contains("10809"),
            "{one}"
        );
        assert!(tcp_exposure_warning(&"[::]:1".parse().unwrap(), None).is_some());
    }

    #[test]
    fn deadlined_read_times_out_and_write_goes_through() {
        let (a, b) = UnixStream::pair().unwrap();
        let (a, b) = (Stream::Unix(a), Stream::Unix(b));
        let soon = Instant::now() + Duration::from_millis(20);
        let mut buf = [0u8; 4];
        let err = Deadlined::new(&a, Some(soon)).read(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let later = Some(Instant::now() + Duration::from_secs(10));
        Deadlined::new(&b, later).write_all(b"ping").unwrap();
        Deadlined::new(&a, later).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        // A passed deadline fails before any system call.
        let past = Some(Instant::now() - Duration::from_millis(1));
        let err = Deadlined::new(&b, past).write(b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[test]
    fn tcp_exposure_warning_says_what_tls_leaves_open() {
        let dir = tempfile::tempdir().unwrap();
        let pki = nbd_tls::testcerts::Pki::make(dir.path()).unwrap();
        let load = |verify: bool| {
            let ca = pki.ca_cert();
            crate::ServerTls::load(
                &pki.server_cert(),
                &pki.server_key(),
                verify.then_some(ca.as_path()),
            )
            .unwrap()
        };
        let addr: SocketAddr = "0.0.0.0:10809".parse().unwrap();
        let tls = |verify, required| TlsConfig {
            credentials: load(verify),
            required,
        };
        let optional = tcp_exposure_warning(&addr, Some(&tls(true, false))).unwrap();
        assert!(optional.contains("TLS is optional"), "{optional}");
        let anonymous = tcp_exposure_warning(&addr, Some(&tls(false, true))).unwrap();
        assert!(anonymous.contains("not verified"), "{anonymous}");
        assert_eq!(tcp_exposure_warning(&addr, Some(&tls(true, true))), None);
    }
}
