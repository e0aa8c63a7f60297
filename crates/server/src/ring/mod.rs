//! The io_uring data path: the transmission phase of plain (non-TLS) connections served by a
//! few event-loop threads ("reactors", one io_uring each) instead of threads per connection.
//!
//! A connection's thread runs the handshake as before, then hands the connection to the
//! reactor serving the fewest ([`Rings::adopt`]) and waits for its outcome; the teardown that
//! follows (lease, socket, table) is unchanged. On its reactor the connection is a state
//! machine (`conn`): one `recv` at a time fills its read buffer, requests are decoded from it,
//! and each is started at once:
//! - a read or write the export can carry out on a descriptor ([`crate::Export::start_read`],
//!   [`crate::Export::start_write`] → `Direct`: a cache hit, a write the cache absorbs, a
//!   read or write around the cache on a backing file) is read into its reply buffer or
//!   written from its payload with io_uring, finished (checksums, index, statistics) on the
//!   reactor and answered, with no thread hand-over; one around the cache on a remote NBD
//!   device is sent and answered on a connection the device lends it (`remote`);
//! - anything that may block (a miss, a write around the cache the plan could not stage, a
//!   flush, a trim, block status, the rest of a direct request that needs more) goes to the
//!   server-wide worker
//!   pool (`pool`) and comes back to the reactor as a finished reply, so a miss waiting on a
//!   slow disk never holds up the hits behind it;
//! - replies are sent by the reactor, many in one `sendmsg`, in the order they finish.
//!
//! The reactor (`reactor`) drives its connections (`conn`); both, and a lent connection's
//! exchange (`remote`), submit through `submit` (the user data that names a completion, the
//! round's submission queue); what other threads hand a reactor (an adopted connection, a
//! worker's finished request) is `inbox`'s. Imports run one way: `reactor` → `conn` →
//! `remote` → `submit`, and `reactor`/`conn` → `pool` → `inbox`.
//!
//! Invariants: everything a connection owns is touched by its reactor thread alone (workers
//! get a request's buffer by value and hand it back); a buffer stays alive and unmoved while
//! an operation of the ring reads or writes it, and a connection is dropped only when none of
//! its operations is in flight and none of its requests is at a worker; the limits of the
//! thread model hold here too (the budget permit before a payload or reply buffer exists, at
//! most `requests_in_flight_max` requests and `workers_per_connection` requests at workers per
//! connection, `request_timeout`, `reply_timeout`, `idle_close_after`, displacement and
//! eviction through the connection's `Activity` and its socket).
//!
//! Fault model: io_uring may be missing or forbidden (an old kernel,
//! `kernel.io_uring_disabled`, a seccomp filter): [`Rings::start`] probes it and fails, and
//! the server then serves through threads, logging why once. A reactor never blocks on a
//! device: a device read that hangs holds its request (and its connection's teardown) only.
//! (It may wait for the engine's state lock, as any request does: an absorbed write's index
//! insert, the index check of a read around the cache.)

mod conn;
mod inbox;
mod pool;
mod reactor;
mod remote;
mod submit;

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) use inbox::{Adopted, Outcome};
use inbox::{Handle, Msg};
pub(crate) use pool::Pool;

/// Entries of each reactor's submission queue.
const RING_ENTRIES: u32 = 512;

/// The reactors of a server and their worker pool.
pub(crate) struct Rings {
    handles: Vec<Arc<Handle>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    pool: Arc<Pool>,
}

impl Rings {
    /// Starts `count` reactors (at least one); fails if io_uring cannot be set up or lacks an
    /// operation the data path needs.
    pub(crate) fn start(
        count: usize,
        workers_max: usize,
        workers: Arc<AtomicUsize>,
    ) -> io::Result<Rings> {
        let pool = Pool::new(workers_max, workers);
        let mut rings = Rings {
            handles: Vec::new(),
            threads: Mutex::new(Vec::new()),
            pool,
        };
        for i in 0..count.max(1) {
            // SAFETY: eventfd returns a new descriptor we own, or -1 (checked).
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if fd < 0 {
                let err = io::Error::last_os_error();
                rings.stop(None);
                return Err(err);
            }
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            let wake = unsafe { OwnedFd::from_raw_fd(fd) };
            let handle = Arc::new(Handle {
                inbox: Mutex::new(Vec::new()),
                wake,
                connections: AtomicUsize::new(0),
            });
            // The ring is made on its reactor's thread (a single-issuer ring belongs to the
            // thread that made it), which reports whether that worked.
            let (ready_tx, ready) = std::sync::mpsc::channel();
            let started = std::thread::Builder::new()
                .name(format!("nbd-ring-{i}"))
                .spawn({
                    let handle = Arc::clone(&handle);
                    let pool = Arc::clone(&rings.pool);
                    move || match reactor::new_ring(RING_ENTRIES) {
                        Ok(ring) => {
                            let _ = ready_tx.send(Ok(()));
                            reactor::Reactor::new(ring, handle, pool).run();
                        }
                        Err(err) => {
                            let _ = ready_tx.send(Err(err));
                        }
                    }
                });
            let result = match started {
                Ok(t) => {
                    let ready = ready.recv().unwrap_or_else(|_| {
                        Err(io::Error::other(
                            "an io_uring event loop ended at its start",
                        ))
                    });
                    match ready {
                        Ok(()) => {
                            rings.handles.push(handle);
                            rings
                                .threads
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(t);
                            Ok(())
                        }
                        Err(err) => {
                            let _ = t.join();
                            Err(err)
                        }
                    }
                }
                Err(err) => Err(err),
            };
            if let Err(err) = result {
                rings.stop(None);
                return Err(err);
            }
        }
        Ok(rings)
    }

    /// Reactor threads.
    pub(crate) fn count(&self) -> usize {
        self.handles.len()
    }

    /// Serves `conn`'s transmission phase on the reactor with the fewest connections; the
    /// caller waits on its outcome.
    pub(crate) fn adopt(&self, conn: Adopted) {
        let handle = self
            .handles
            .iter()
            .min_by_key(|h| h.connections.load(Ordering::Relaxed))
            .expect("a started Rings has a reactor");
        handle.connections.fetch_add(1, Ordering::Relaxed);
        handle.send(Msg::Adopt(Box::new(conn)));
    }

    /// Stops the reactors and the pool once their connections are done: waits for them up to
    /// `deadline` (`None`: as long as it takes). A reactor still holding a connection then (a
    /// device that does not answer) is left running, detached: its ring's buffers must stay
    /// valid while the kernel may still write them.
    pub(crate) fn stop(&self, deadline: Option<Instant>) {
        for h in &self.handles {
            h.send(Msg::Stop);
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            while deadline.is_some_and(|d| Instant::now() < d) && !t.is_finished() {
                std::thread::sleep(Duration::from_millis(5));
            }
            if deadline.is_none() || t.is_finished() {
                let _ = t.join();
            }
        }
        self.pool.stop();
    }
}
