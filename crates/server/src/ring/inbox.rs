//! What crosses threads to a reactor: a connection handed over after its handshake
//! ([`Adopted`], its [`Outcome`] waited for by the connection's thread), and the reactor's
//! inbox ([`Handle`]: adopted connections, requests finished at a worker ([`Finished`]), the
//! stop), with the eventfd that wakes it.
//!
//! Invariants: a message sent is taken by the reactor's next round (the first message of an
//! empty inbox writes the eventfd; later ones ride on that wake-up); an outcome is set once,
//! by the reactor, and its waiter returns only then.

use crate::config::Shared;
use crate::iobuf::IoBuf;
use crate::net::Stream;
use crate::table::Activity;
use crate::Export;
use nbd_proto::TransmissionContext;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Condvar, Mutex};

/// A job's result, back on its reactor.
pub(crate) struct Finished {
    pub(crate) conn: usize,
    pub(crate) req: usize,
    pub(crate) head: Vec<u8>,
    pub(crate) buf: IoBuf,
    pub(crate) data_len: usize,
}

/// A connection handed to a reactor after its handshake.
pub(crate) struct Adopted {
    pub(crate) id: u64,
    pub(crate) stream: Arc<Stream>,
    /// Bytes received after the handshake's last option.
    pub(crate) leftover: Vec<u8>,
    pub(crate) export: Arc<dyn Export>,
    /// Set once the export is removed (see `execute::admit`).
    pub(crate) removed: Arc<std::sync::atomic::AtomicBool>,
    /// What this connection was told of losses below the export.
    pub(crate) watch: Arc<crate::LossWatch>,
    pub(crate) ctx: TransmissionContext,
    pub(crate) activity: Arc<Activity>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) outcome: Arc<Outcome>,
}

/// How a connection's transmission phase ended, set once by its reactor.
#[derive(Default)]
pub(crate) struct Outcome {
    result: Mutex<Option<io::Result<()>>>,
    set: Condvar,
}

impl Outcome {
    pub(super) fn finish(&self, result: io::Result<()>) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        self.set.notify_all();
    }

    /// Waits until the reactor is done with the connection.
    pub(crate) fn wait(&self) -> io::Result<()> {
        let mut r = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(result) = r.take() {
                return result;
            }
            r = self.set.wait(r).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What reaches a reactor from other threads.
pub(crate) enum Msg {
    Adopt(Box<Adopted>),
    /// A request finished at a worker.
    Done(Finished),
    Stop,
}

/// A reactor as other threads see it: its inbox and the eventfd that wakes it.
pub(crate) struct Handle {
    pub(super) inbox: Mutex<Vec<Msg>>,
    pub(super) wake: OwnedFd,
    /// Connections it serves now.
    pub(super) connections: AtomicUsize,
}

impl Handle {
    pub(crate) fn send(&self, msg: Msg) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.push(msg);
        let first = inbox.len() == 1;
        drop(inbox);
        if !first {
            // The reactor has been woken for the earlier messages and has not taken them
            // yet: it takes this one with them.
            return;
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our own eventfd; a failure (the counter
        // saturated) still leaves the reactor woken.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    pub(super) fn take(&self) -> Vec<Msg> {
        std::mem::take(&mut *self.inbox.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
