//! The state a remote device's callers and its connection threads share ([`Shared`]): the
//! shared connections, their reconnection (backoff, the export checked unchanged), the
//! round robin, the durability bookkeeping, and close; and each connection's thread
//! ([`run_connection`]). [`NbdDevice`](super::NbdDevice) is a handle on it; lent
//! connections ([`direct`](super::direct)) reach it through the same `Arc`.
//!
//! Invariants: those of the device (see the parent module): a connection slot is `None`
//! exactly while its thread reconnects it; after `closed` is set (under the links lock) no
//! link is published and no handshake starts; `threads_live` counts every connection and
//! spare-opening thread until it returns or unwinds ([`Live`]), and `close` waits for it to
//! reach 0 for at most [`CLOSE_WAIT`].

use super::durability::Durability;
use super::link::{self, Export, Link, Outcome, Replies, Req, Sock, Waited};
use super::spares::Spares;
use super::uri::{NbdOptions, Target};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// First wait before reconnecting a broken connection; doubled after each failed attempt.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait between reconnection attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Longest `close` waits for the connection threads to exit.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Failed reconnection attempts, logged at most once a minute.
static RECONNECT_FAILED: lograte::Throttled = lograte::Throttled::new();

/// What the device's callers and its connection threads share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) uri: String,
    pub(super) target: Target,
    /// The TLS settings of an `nbds://` URI, loaded at connect.
    pub(super) tls: Option<nbd_tls::ClientTls>,
    pub(super) options: NbdOptions,
    pub(super) export: Export,
    /// One slot per connection, `None` while it reconnects.
    pub(super) links: Mutex<Vec<Option<Arc<Link>>>>,
    /// Signalled when a link comes back, and at close.
    pub(super) links_changed: Condvar,
    /// Sockets of connection attempts in their handshake, by connection (shut down at close).
    pub(super) connecting: Mutex<HashMap<usize, Sock>>,
    /// Round-robin position.
    pub(super) next: AtomicUsize,
    pub(super) closed: AtomicBool,
    pub(super) durability: Mutex<Durability>,
    /// Connections lent whole to callers that carry a request themselves ([`direct`]).
    pub(super) spares: Mutex<Spares>,
    pub(super) threads_live: Mutex<usize>,
    pub(super) thread_exited: Condvar,
}

impl Shared {
    fn timed_out(&self, what: &str) -> io::Error {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{}: {what} within {:?}", self.uri, self.options.timeout),
        )
    }

    /// One request, answered within the timeout; a read's data goes to `read_into`.
    pub(super) fn request(&self, req: Req, payload: &[u8], read_into: &mut [u8]) -> io::Result<()> {
        let deadline = Instant::now() + self.options.timeout;
        loop {
            let link = self.pick_link(deadline)?;
            match link.exchange(&self.durability, &req, payload, deadline) {
                Outcome::Reply(reply) => {
                    let data = reply?;
                    assert_eq!(data.len(), read_into.len(), "reply data of another size");
                    read_into.copy_from_slice(&data);
                    return Ok(());
                }
                Outcome::Retry => continue,
                Outcome::TimedOut(Waited::Room) => {
                    return Err(self.timed_out("no room on the connection (requests in flight)"))
                }
                Outcome::TimedOut(Waited::Send) => {
                    return Err(self.timed_out("the request could not be sent"))
                }
                Outcome::TimedOut(Waited::Reply) => return Err(self.timed_out("no reply")),
            }
        }
    }

    /// The next connection that is up, round robin; waits for one until `deadline`.
    fn pick_link(&self, deadline: Instant) -> io::Result<Arc<Link>> {
        let mut links = self.links.lock();
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    format!("{}: closed", self.uri),
                ));
            }
            let n = links.len();
            let start = self.next.fetch_add(1, Ordering::Relaxed);
            if let Some(link) = (0..n).find_map(|i| links[(start + i) % n].clone()) {
                return Ok(link);
            }
            if self
                .links_changed
                .wait_until(&mut links, deadline)
                .timed_out()
            {
                return Err(self.timed_out("not connected (reconnecting)"));
            }
        }
    }

    /// Waits `delay` unless the device closes first; true if it did.
    fn sleep_unless_closed(&self, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        let mut links = self.links.lock();
        while !self.closed.load(Ordering::SeqCst) {
            if self.links_changed.wait_until(&mut links, until).timed_out() {
                return self.closed.load(Ordering::SeqCst);
            }
        }
        true
    }

    /// Connects and negotiates one more connection to the export (over TLS with `tls`), its
    /// socket registered under `key` in `connecting` during the handshake (a close shuts it
    /// down); fails if the device is closed or the server offers another export now.
    pub(super) fn open_again(
        &self,
        key: usize,
        tls: Option<&nbd_tls::ClientTls>,
    ) -> io::Result<link::Opened> {
        let opened = link::open(&self.target, tls, self.options.timeout, |sock| {
            let mut connecting = self.connecting.lock();
            if self.closed.load(Ordering::SeqCst) {
                return Err(io::Error::new(io::ErrorKind::NotConnected, "closed"));
            }
            connecting.insert(key, sock.try_clone()?);
            Ok(())
        });
        self.connecting.lock().remove(&key);
        let (opened, export) = opened?;
        if export != self.export {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the export changed: {export:?}, was {:?}", self.export),
            ));
        }
        Ok(opened)
    }

    /// Reconnects connection `index`, with backoff, until it works or the device closes.
    fn reconnect(&self, index: usize) -> Option<(Arc<Link>, Replies)> {
        let mut delay = BACKOFF_MIN;
        for attempt in 1u64.. {
            if self.sleep_unless_closed(delay) {
                return None;
            }
            let linked = self
                .open_again(index, self.tls.as_ref())
                .and_then(Link::new);
            match linked {
                Ok((link, reader)) => {
                    let mut links = self.links.lock();
                    if self.closed.load(Ordering::SeqCst) {
                        link.shutdown();
                        return None;
                    }
                    links[index] = Some(link.clone());
                    drop(links);
                    self.links_changed.notify_all();
                    log::info!(
                        "{}: connection {index} is back (attempt {attempt})",
                        self.uri
                    );
                    return Some((link, reader));
                }
                Err(e) if self.closed.load(Ordering::SeqCst) => {
                    log::debug!("{}: reconnecting at close: {e}", self.uri);
                    return None;
                }
                Err(e) => {
                    RECONNECT_FAILED.log(
                        log::Level::Warn,
                        format!(
                            "{}: reconnecting connection {index} failed (attempt {attempt}): {e}; \
                             retrying, at most every {BACKOFF_MAX:?}",
                            self.uri
                        ),
                    );
                }
            }
            delay = (delay * 2).min(BACKOFF_MAX);
        }
        unreachable!("attempts are counted by u64")
    }

    /// Takes link `index` out of use if it is still `link`.
    fn unpublish(&self, index: usize, link: &Arc<Link>) {
        let mut links = self.links.lock();
        if links[index].as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
            links[index] = None;
        }
    }

    pub(super) fn close(&self) -> io::Result<()> {
        if !self.closed.swap(true, Ordering::SeqCst) {
            // Under the lock the reconnecting threads check `closed` with: none publishes a
            // link or starts a handshake after this.
            let links = self.links.lock();
            for link in links.iter().flatten() {
                link.disconnect();
            }
            for sock in self.connecting.lock().values() {
                sock.shutdown();
            }
            self.spares.lock().shutdown_all();
            self.links_changed.notify_all();
        }
        let deadline = Instant::now() + CLOSE_WAIT;
        let mut live = self.threads_live.lock();
        while *live > 0 {
            if self
                .thread_exited
                .wait_until(&mut live, deadline)
                .timed_out()
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{}: {} connection thread(s) still running {CLOSE_WAIT:?} after close",
                        self.uri, *live
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Counts a connection thread as running until it returns (or unwinds).
pub(super) struct Live(pub(super) Arc<Shared>);

impl Drop for Live {
    fn drop(&mut self) {
        *self.0.threads_live.lock() -= 1;
        self.0.thread_exited.notify_all();
    }
}

/// A connection's thread: reads replies; when the connection breaks, answers the requests in
/// flight (see the reconnect rule) and reconnects; exits when the device closes.
pub(super) fn run_connection(
    shared: Arc<Shared>,
    index: usize,
    mut link: Arc<Link>,
    mut reader: Replies,
) {
    let live = Live(shared);
    let shared = &live.0;
    loop {
        let cause = link.read_replies(&mut reader, &shared.durability, &shared.uri);
        if link::ServerShutdown::is(&cause) {
            // The spec: a client answered NBD_ESHUTDOWN disconnects (the stream is framed).
            link.disconnect();
            shared.spares.lock().leave_idle();
        } else {
            link.shutdown();
        }
        shared.unpublish(index, &link);
        let lost = link.fail(&shared.durability, &shared.uri, &cause);
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        log::warn!(
            "{}: connection {index} lost ({cause}); reconnecting{}",
            shared.uri,
            if lost {
                "; writes not yet flushed may be lost, the next flush will fail"
            } else {
                ""
            }
        );
        match shared.reconnect(index) {
            Some((l, r)) => (link, reader) = (l, r),
            None => return,
        }
    }
}
