//! systemd's readiness protocol (`sd_notify`), for `Type=notify` units: `serve` says
//! `READY=1` once every socket listens, and `STOPPING=1` when it starts shutting down.
//!
//! The protocol is one datagram per state change to the unix socket named by `$NOTIFY_SOCKET`
//! (a path, or an abstract name written with a leading '@'). Without the variable (not run by
//! systemd) nothing is sent.
//!
//! Invariants: never blocks (the socket is non-blocking: a datagram to a socket nobody reads
//! fails at once instead of waiting) and never fails the caller: a message that cannot be sent
//! is logged as a warning, and systemd then times the start out and says so itself.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;

/// The environment variable systemd sets for `Type=notify` services.
pub const NOTIFY_SOCKET_ENV: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=VALUE` lines) to `$NOTIFY_SOCKET`, if set.
pub fn notify(state: &str) {
    let Some(socket) = std::env::var_os(NOTIFY_SOCKET_ENV) else {
        return;
    };
    if let Err(e) = send(&socket, state) {
        log::warn!(
            "could not notify systemd ({NOTIFY_SOCKET_ENV}={}): {e}",
            socket.to_string_lossy()
        );
    }
}

/// Sends one datagram to a notify socket given as a path or as `@abstract-name`.
fn send(socket: &OsStr, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    sock.set_nonblocking(true)?;
    let bytes = socket.as_bytes();
    let sent = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?
        }
        None if bytes.first() == Some(&b'/') => sock.send_to(state.as_bytes(), socket)?,
        None => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not an absolute path or an @abstract name",
            ))
        }
    };
    if sent != state.len() {
        return Err(io::Error::other("the datagram was cut short"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn receive(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn sends_to_a_path_and_to_an_abstract_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        assert_eq!(receive(&listener), "READY=1\nSTATUS=serving");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("tiercache-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        send(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        assert_eq!(receive(&listener), "STOPPING=1");
    }

    #[test]
    fn bad_or_absent_sockets_are_errors_not_hangs() {
        assert!(send(OsStr::new("relative/path"), "READY=1").is_err());
        let dir = tempfile::tempdir().unwrap();
        assert!(send(dir.path().join("nobody").as_os_str(), "READY=1").is_err());
    }
}
