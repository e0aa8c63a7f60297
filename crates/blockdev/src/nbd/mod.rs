//! `NbdDevice`: a remote block device reached over NBD (unix socket or TCP), using the client
//! side of `nbd-proto`. Used for remote backing devices and by the demo and benchmarks to
//! drive a server through a real NBD connection.
//!
//! URIs: `nbd+unix:///NAME?socket=PATH`, `nbd://HOST[:PORT]/NAME` (port 10809 by default) and
//! `nbds://HOST[:PORT]/NAME?tls-certificates=DIR` (TLS; see [`uri`] for `tls-ca`, `tls-cert`,
//! `tls-key`, `tls-hostname`), with optional query parameters `connections=N` (1–16, default
//! 4; used only when the server advertises multi-conn), `spare-connections=N` (0–64, default
//! 8: connections lent whole to requests their caller carries, see [`direct`]) and
//! `timeout=SECS` (1–3600, default 30). [`NbdDevice::connect_with`] takes the same as [`NbdOptions`] (the URI's parameters
//! win). TLS credentials are read once, at connect; reconnections use them again.
//!
//! Owns: the connections to one export ([`link`]), what callers and connection threads share
//! ([`shared`]: one thread per connection that reads its replies and reconnects it, close),
//! the durability bookkeeping ([`durability`]), and spare connections lent whole to a caller
//! ([`direct`], their data in [`spares`]). Imports run one way: `spares` ← `shared` ←
//! `direct` ← this file.
//!
//! Invariants:
//! - many requests are in flight on each connection at once (up to 64), each with its own
//!   cookie; the connection's thread hands each reply to the caller waiting for that cookie.
//!   Simple replies only (structured replies are not negotiated);
//! - with `NBD_FLAG_CAN_MULTI_CONN` the device opens N connections and spreads requests over
//!   them round robin; without it, one. A flush is sent on one connection: with multi-conn
//!   the server makes it cover the writes answered on every connection, and a flush is sent
//!   only after the replies of the writes it is counted as covering (the spec's rule for
//!   clients that use several connections);
//! - requests longer than the server's maximum block size are split; the device is read-only
//!   if the server says so and then refuses writes locally;
//! - every request is answered within the timeout: it waits at most that long for a
//!   connection, room on it, its send and its reply, then fails with `TimedOut`. A reply that
//!   arrives after its caller gave up is recognised by its cookie and dropped;
//! - dropping the device (or [`NbdDevice::close`]) sends `NBD_CMD_DISC`, shuts every socket
//!   down and stops the connection threads, whatever state the server is in.
//!
//! Fault model: a server error becomes the matching `io::Error`. A connection that breaks
//! (reset, EOF, a failed send, a protocol violation) is reconnected by its thread, with
//! backoff from 50 ms doubling to 5 s, for as long as the device lives; a reconnection must
//! find the same export (size, flags, block size). Requests issued meanwhile use the other
//! connections or wait for one (bounded by the timeout). A server that restarts loses the
//! writes it had answered but not flushed, and the client cannot tell a restart from a
//! network blip, so:
//! - **the reconnect rule**: if a connection breaks while some write (write, trim, write
//!   zeroes) has not been covered by a successful flush, every request in flight on it fails
//!   (`ConnectionAborted`), and the next flush sent fails too, even if the server completes
//!   it — so a caller that relies on flush never believes lost writes durable. That flush is
//!   still carried out (later writes are flushed by it) and the failure is reported once:
//!   the flush after it succeeds if nothing else was lost. Callers sharing the device must
//!   treat a failed flush as device-wide, as the [`BlockDevice`] fault model says. If every
//!   write had been flushed, nothing can have been lost: requests in flight are sent again
//!   on a working connection within their timeout and no flush fails;
//! - reads after a loss may return data older than the lost writes (what the server has);
//! - a hung server (no replies, connection open) makes requests time out; the connection is
//!   kept, so late replies can still free its slots. Over TCP, data unacknowledged for the
//!   timeout (`TCP_USER_TIMEOUT`) breaks the connection, so a vanished host is reconnected.

mod direct;
mod durability;
mod link;
mod shared;
mod spares;
mod uri;

pub use direct::NbdDirect;
use uri::CONNECTIONS_MAX;
pub use uri::{is_nbd_uri, parse_uri, NbdOptions, Target, TlsParams};

use crate::{check_range, BlockDevice};
use durability::Durability;
use link::{Link, Req};
use nbd_proto::{Command, TransmissionFlags};
use parking_lot::{Condvar, Mutex};
use shared::{run_connection, Shared};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::Arc;

/// A remote device's connections at one moment ([`NbdDevice::links`]); serialized as is in
/// metrics samples and `status --json`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NbdLinks {
    /// Shared connections the device keeps, and of those connected now (the others are
    /// being reconnected).
    pub shared: usize,
    pub shared_up: usize,
    /// Spare connections open for requests around the cache, and of those lent to one now.
    pub spare_open: usize,
    pub spare_lent: usize,
}

/// A remote block device over one or more NBD connections.
pub struct NbdDevice {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NbdDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdDevice")
            .field("uri", &self.shared.uri)
            .field("export", &self.shared.export)
            .field("options", &self.shared.options)
            .finish()
    }
}

impl NbdDevice {
    /// Connects with the default options (or those in the URI) and negotiates the export.
    pub fn connect(uri: &str) -> io::Result<NbdDevice> {
        Self::connect_with(uri, NbdOptions::default())
    }

    /// Connects with `options`, overridden by the URI's query parameters. Fails at once if
    /// the server cannot be reached (no retry at connect time).
    pub fn connect_with(uri: &str, options: NbdOptions) -> io::Result<NbdDevice> {
        assert!(
            (1..=CONNECTIONS_MAX).contains(&options.connections)
                && options.spare_connections <= uri::SPARE_CONNECTIONS_MAX
                && !options.timeout.is_zero(),
            "bad NbdOptions {options:?}"
        );
        let (target, options) = parse_uri(uri, options)?;
        let context = |e: io::Error| io::Error::new(e.kind(), format!("{uri}: {e}"));
        let tls = match &target {
            Target::Tcp { tls: Some(t), .. } => Some(t.load().map_err(context)?),
            _ => None,
        };
        let (sock, export) =
            link::open(&target, tls.as_ref(), options.timeout, |_| Ok(())).map_err(context)?;
        let count = if export.flags.contains(TransmissionFlags::CAN_MULTI_CONN) {
            options.connections
        } else {
            1
        };
        let mut socks = vec![sock];
        while socks.len() < count {
            let (sock, other) =
                link::open(&target, tls.as_ref(), options.timeout, |_| Ok(())).map_err(context)?;
            if other != export {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{uri}: the export changed between connections"),
                ));
            }
            socks.push(sock);
        }
        let mut links = Vec::new();
        for sock in socks {
            links.push(Link::new(sock)?);
        }
        let shared = Arc::new(Shared {
            uri: uri.to_string(),
            target,
            tls,
            options,
            export,
            links: Mutex::new(links.iter().map(|(l, _)| Some(l.clone())).collect()),
            links_changed: Condvar::new(),
            connecting: Mutex::new(HashMap::new()),
            next: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            durability: Mutex::new(Durability::default()),
            spares: Mutex::new(spares::Spares::default()),
            threads_live: Mutex::new(0),
            thread_exited: Condvar::new(),
        });
        // From here on, dropping the device closes the connections and stops the threads.
        let device = NbdDevice {
            shared: shared.clone(),
        };
        for (index, (link, reader)) in links.into_iter().enumerate() {
            *shared.threads_live.lock() += 1;
            let s = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("nbd-conn-{index}"))
                .spawn(move || run_connection(s, index, link, reader));
            if let Err(e) = spawned {
                *shared.threads_live.lock() -= 1;
                return Err(e);
            }
        }
        match direct::lending_off(&shared) {
            None => log::info!(
                "{uri}: {count} connection(s); requests around the cache go on up to {} \
                 more, opened as they are needed",
                options.spare_connections
            ),
            Some(why) => log::info!(
                "{uri}: {count} connection(s); no spare connections for requests around the \
                 cache ({why})"
            ),
        }
        Ok(device)
    }

    pub fn read_only(&self) -> bool {
        self.flags().contains(TransmissionFlags::READ_ONLY)
    }

    /// Connections opened (the option, or 1 when the server does not advertise multi-conn).
    pub fn connections(&self) -> usize {
        self.shared.links.lock().len()
    }

    /// The device's connections now.
    pub fn links(&self) -> NbdLinks {
        let (shared, shared_up) = {
            let links = self.shared.links.lock();
            (links.len(), links.iter().filter(|l| l.is_some()).count())
        };
        let (spare_open, spare_lent) = self.shared.spares.lock().counts();
        NbdLinks {
            shared,
            shared_up,
            spare_open,
            spare_lent,
        }
    }

    /// The options in force (the URI's parameters applied).
    pub fn options(&self) -> NbdOptions {
        self.shared.options
    }

    /// Closes every connection and waits (at most 5 s) for the connection threads to exit;
    /// an error names the ones still running (they exit on their own). Dropping the device
    /// does the same and logs that error.
    pub fn close(self) -> io::Result<()> {
        self.shared.close()
    }

    fn flags(&self) -> TransmissionFlags {
        self.shared.export.flags
    }

    /// Splits `[offset, offset + len)` into requests the server accepts.
    fn chunks(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u32)> {
        let max = self.shared.export.max_request_bytes;
        (0..len.div_ceil(max)).map(move |i| (offset + i * max, (len - i * max).min(max) as u32))
    }

    fn writable(&self) -> io::Result<()> {
        if self.read_only() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is read-only", self.shared.uri),
            ));
        }
        Ok(())
    }

    fn request(
        &self,
        command: Command,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        self.shared.request(
            Req {
                command,
                offset,
                length,
            },
            payload,
            &mut [],
        )
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        if let Err(e) = self.shared.close() {
            log::warn!("{e}");
        }
    }
}

impl BlockDevice for NbdDevice {
    fn size_bytes(&self) -> u64 {
        self.shared.export.size / 512 * 512
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        for (off, n) in self.chunks(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            self.shared.request(
                Req {
                    command: Command::Read,
                    offset: off,
                    length: n,
                },
                &[],
                &mut buf[at..at + n as usize],
            )?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, buf.len() as u64)?;
        self.writable()?;
        for (off, n) in self.chunks(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            self.request(Command::Write, off, n, &buf[at..at + n as usize])?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.flags().contains(TransmissionFlags::SEND_FLUSH) {
            return self.request(Command::Flush, 0, 0, &[]);
        }
        // No flush on the server: what it answered is as durable as it gets, but a lost
        // connection is still reported.
        let mut d = self.shared.durability.lock();
        let covers = d.flush_covers();
        d.flushed(covers);
        if d.take_unreported_loss() {
            return Err(link::lost_writes(&self.shared.uri));
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        self.writable()?;
        if !self.flags().contains(TransmissionFlags::SEND_TRIM) {
            return Ok(()); // a hint the server does not take
        }
        for (off, n) in self.chunks(offset, len) {
            self.request(Command::Trim, off, n, &[])?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size_bytes(), offset, len)?;
        self.writable()?;
        if !self.flags().contains(TransmissionFlags::SEND_WRITE_ZEROES) {
            let zero = vec![0u8; self.shared.export.max_request_bytes.min(len) as usize];
            for (off, n) in self.chunks(offset, len) {
                self.request(Command::Write, off, n, &zero[..n as usize])?;
            }
            return Ok(());
        }
        for (off, n) in self.chunks(offset, len) {
            self.request(Command::WriteZeroes, off, n, &[])?;
        }
        Ok(())
    }

    fn is_rotational(&self) -> bool {
        self.flags().contains(TransmissionFlags::ROTATIONAL)
    }

    fn describe(&self) -> String {
        format!("nbd {}", self.shared.uri)
    }

    fn direct_nbd(&self, write: bool, offset: u64, len: usize) -> Option<NbdDirect> {
        let command = if write { Command::Write } else { Command::Read };
        direct::lend(&self.shared, command, offset, len)
    }

    fn nbd_links(&self) -> Option<NbdLinks> {
        Some(self.links())
    }
}
