//! Listening sockets and connected streams, unix or TCP, behind one type each.
//!
//! Owns: binding (including removal of a stale unix socket file, never of any other file) and
//! the socket operations the server needs: clone, shutdown, timeouts.
//!
//! Invariants: a unix socket path is removed only if it is a socket.
//!
//! Fault model: OS errors are returned to the caller as `io::Error`.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

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

pub(crate) enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    pub(crate) fn bind(addr: &BindAddr) -> io::Result<(Listener, LocalAddr)> {
        match addr {
            BindAddr::Unix(path) => {
                if let Ok(meta) = std::fs::symlink_metadata(path) {
                    if meta.file_type().is_socket() {
                        std::fs::remove_file(path)?;
                    }
                }
                let listener = UnixListener::bind(path)?;
                Ok((Listener::Unix(listener), LocalAddr::Unix(path.clone())))
            }
            BindAddr::Tcp(addr) => {
                let listener = TcpListener::bind(addr)?;
                let local = listener.local_addr()?;
                Ok((Listener::Tcp(listener), LocalAddr::Tcp(local)))
            }
        }
    }

    pub(crate) fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Stream::Tcp(s))
            }
        }
    }
}

/// Connects to `addr` (used to wake the accept loop at shutdown).
pub(crate) fn connect(addr: &LocalAddr) -> io::Result<Stream> {
    match addr {
        LocalAddr::Unix(path) => UnixStream::connect(path).map(Stream::Unix),
        LocalAddr::Tcp(addr) => TcpStream::connect(addr).map(Stream::Tcp),
    }
}

#[derive(Debug)]
pub(crate) enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Tcp(s) => s.try_clone().map(Stream::Tcp),
        }
    }

    /// Shuts down one or both directions; errors (e.g. already closed) are irrelevant here.
    pub(crate) fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        };
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }

    /// Forwarded so replies go out with one `writev` (the default writes only the first
    /// buffer).
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write_vectored(bufs),
            Stream::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}
