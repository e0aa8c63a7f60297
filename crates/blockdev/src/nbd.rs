//! `NbdDevice`: a remote block device reached over NBD (unix socket or TCP), using the client
//! side of `nbd-proto`. Used for remote backing devices and by the demo and benchmarks to
//! drive a server through a real NBD connection.
//!
//! URIs: `nbd+unix:///NAME?socket=PATH` and `nbd://HOST:PORT/NAME` (port 10809 by default).
//!
//! Invariants: one request is on the wire at a time per connection (the connection mutex is
//! held from sending a request to reading its whole reply), so replies cannot be confused;
//! requests longer than the server's maximum block size are split; the device is read-only
//! if the server says so and then refuses writes locally. Simple replies only.
//!
//! Fault model: a server error becomes the matching `io::Error`; a broken connection or a
//! protocol violation is an error for that request and every later one (no silent reconnect,
//! which could reorder writes around a flush).

use crate::{check_range, BlockDevice};
use nbd_proto::{
    decode_reply, ClientConfig, ClientEvent, ClientHandshake, Command, CommandFlags, Decoded,
    Reply, Request, TransmissionFlags,
};
use parking_lot::Mutex;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;

trait Stream: Read + Write + Send + std::fmt::Debug {}
impl<T: Read + Write + Send + std::fmt::Debug> Stream for T {}

#[derive(Debug)]
struct Conn {
    stream: Box<dyn Stream>,
    next_cookie: u64,
    broken: bool,
}

#[derive(Debug)]
pub struct NbdDevice {
    uri: String,
    conn: Mutex<Conn>,
    size: u64,
    flags: TransmissionFlags,
    max_request_bytes: u64,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Where an NBD URI points.
#[derive(Debug, PartialEq, Eq)]
pub enum Target {
    Unix { socket: String, export: String },
    Tcp { addr: String, export: String },
}

/// Parses `nbd+unix:///NAME?socket=PATH` or `nbd://HOST[:PORT]/NAME`.
pub fn parse_uri(uri: &str) -> io::Result<Target> {
    if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        let (path, query) = rest
            .split_once('?')
            .ok_or_else(|| invalid(format!("{uri}: missing ?socket=PATH")))?;
        let export = path.strip_prefix('/').unwrap_or(path).to_string();
        let socket = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("socket="))
            .ok_or_else(|| invalid(format!("{uri}: missing socket=PATH")))?;
        return Ok(Target::Unix {
            socket: socket.to_string(),
            export,
        });
    }
    if let Some(rest) = uri.strip_prefix("nbd://") {
        let (host, export) = rest.split_once('/').unwrap_or((rest, ""));
        if host.is_empty() {
            return Err(invalid(format!("{uri}: missing host")));
        }
        let addr = if host.contains(':') {
            host.to_string()
        } else {
            format!("{host}:10809")
        };
        return Ok(Target::Tcp {
            addr,
            export: export.to_string(),
        });
    }
    Err(invalid(format!(
        "'{uri}' is not an NBD URI (nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME)"
    )))
}

impl NbdDevice {
    /// Connects and negotiates the export named in the URI.
    pub fn connect(uri: &str) -> io::Result<NbdDevice> {
        let (mut stream, export): (Box<dyn Stream>, String) = match parse_uri(uri)? {
            Target::Unix { socket, export } => (Box::new(UnixStream::connect(&socket)?), export),
            Target::Tcp { addr, export } => {
                let s = TcpStream::connect(&addr)?;
                s.set_nodelay(true)?;
                (Box::new(s), export)
            }
        };
        let mut hs = ClientHandshake::new(ClientConfig {
            export_name: export,
            structured_replies: false,
            meta_contexts: Vec::new(),
        });
        let negotiated = loop {
            let event = hs.poll().map_err(io::Error::from)?;
            stream.write_all(&hs.take_output())?;
            match event {
                ClientEvent::Done(n) => break n,
                ClientEvent::NeedInput => {
                    let mut buf = [0u8; 4096];
                    let got = stream.read(&mut buf)?;
                    if got == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("{uri}: server closed the connection during the handshake"),
                        ));
                    }
                    hs.feed(&buf[..got]);
                }
            }
        };
        let max = negotiated
            .block_size
            .map(|b| u64::from(b.max))
            .unwrap_or(32 << 20)
            .clamp(4096, 32 << 20);
        Ok(NbdDevice {
            uri: uri.to_string(),
            conn: Mutex::new(Conn {
                stream,
                next_cookie: 1,
                broken: false,
            }),
            size: negotiated.size_bytes,
            flags: negotiated.flags,
            max_request_bytes: max / 512 * 512,
        })
    }

    pub fn read_only(&self) -> bool {
        self.flags.contains(TransmissionFlags::READ_ONLY)
    }

    /// Sends one request (and payload) and waits for its reply; for reads, fills `read_into`.
    fn request(
        &self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        read_into: &mut [u8],
    ) -> io::Result<()> {
        let mut c = self.conn.lock();
        if c.broken {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("{}: connection lost earlier", self.uri),
            ));
        }
        let cookie = c.next_cookie;
        c.next_cookie += 1;
        let res = (|| {
            let mut out = Vec::with_capacity(Request::HEADER_BYTES + payload.len());
            Request {
                flags: CommandFlags(flags),
                command,
                cookie,
                offset,
                length,
            }
            .encode(&mut out);
            out.extend_from_slice(payload);
            c.stream.write_all(&out)?;
            let mut header = [0u8; 16];
            c.stream.read_exact(&mut header)?;
            match decode_reply(&header, 0).map_err(io::Error::from)? {
                Decoded::Done {
                    value: Reply::Simple { cookie: got, error },
                    ..
                } => {
                    if got != cookie {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "reply for another request",
                        ));
                    }
                    match error {
                        Some(e) => Ok(Err(e.to_io_error())),
                        None => {
                            c.stream.read_exact(read_into)?;
                            Ok(Ok(()))
                        }
                    }
                }
                _ => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "unexpected reply from the server",
                )),
            }
        })();
        match res {
            Ok(r) => r,
            Err(e) => {
                c.broken = true;
                Err(e)
            }
        }
    }

    /// Splits `[offset, offset + len)` into requests the server accepts.
    fn chunks(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u32)> {
        let max = self.max_request_bytes;
        (0..len.div_ceil(max)).map(move |i| (offset + i * max, (len - i * max).min(max) as u32))
    }

    fn writable(&self) -> io::Result<()> {
        if self.read_only() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is read-only", self.uri),
            ));
        }
        Ok(())
    }
}

impl BlockDevice for NbdDevice {
    fn size_bytes(&self) -> u64 {
        self.size / 512 * 512
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        for (off, n) in self.chunks(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            self.request(Command::Read, 0, off, n, &[], &mut buf[at..at + n as usize])?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        self.writable()?;
        for (off, n) in self.chunks(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            self.request(
                Command::Write,
                0,
                off,
                n,
                &buf[at..at + n as usize],
                &mut [],
            )?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.flags.contains(TransmissionFlags::SEND_FLUSH) {
            self.request(Command::Flush, 0, 0, 0, &[], &mut [])?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        self.writable()?;
        if !self.flags.contains(TransmissionFlags::SEND_TRIM) {
            return Ok(()); // a hint the server does not take
        }
        for (off, n) in self.chunks(offset, len) {
            self.request(Command::Trim, 0, off, n, &[], &mut [])?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        self.writable()?;
        if !self.flags.contains(TransmissionFlags::SEND_WRITE_ZEROES) {
            let zero = vec![0u8; self.max_request_bytes.min(len) as usize];
            for (off, n) in self.chunks(offset, len) {
                self.request(Command::Write, 0, off, n, &zero[..n as usize], &mut [])?;
            }
            return Ok(());
        }
        for (off, n) in self.chunks(offset, len) {
            self.request(Command::WriteZeroes, 0, off, n, &[], &mut [])?;
        }
        Ok(())
    }

    fn is_rotational(&self) -> bool {
        self.flags.contains(TransmissionFlags::ROTATIONAL)
    }

    fn describe(&self) -> String {
        format!("nbd {}", self.uri)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_or_explain() {
        assert_eq!(
            parse_uri("nbd+unix:///disk?socket=/tmp/s.sock").unwrap(),
            Target::Unix {
                socket: "/tmp/s.sock".into(),
                export: "disk".into()
            }
        );
        assert_eq!(
            parse_uri("nbd://127.0.0.1/x").unwrap(),
            Target::Tcp {
                addr: "127.0.0.1:10809".into(),
                export: "x".into()
            }
        );
        assert_eq!(
            parse_uri("nbd://localhost:2000/").unwrap(),
            Target::Tcp {
                addr: "localhost:2000".into(),
                export: "".into()
            }
        );
        assert!(parse_uri("nbd+unix:///x").is_err());
        assert!(parse_uri("http://x").is_err());
        assert!(parse_uri("nbd:///x").is_err());
    }
}
