//! A remote device's spare connections ([`Spares`]): the idle ones, a clone of every one's
//! socket (idle or lent), and the state of opening another. The data only; lending them and
//! opening them is [`direct`](super::direct)'s.
//!
//! Invariants: every idle connection is also in `all`; `all` holds a lent connection's socket
//! until its lease ends, so `shutdown_all` reaches every spare connection at close; at most
//! one is being opened (`opening`), none before `retry_at` after one failed.

use super::link::{disc_request, Sock};
use std::collections::HashMap;
use std::io::Write;
use std::time::Instant;

/// The device's spare connections.
#[derive(Debug, Default)]
pub(super) struct Spares {
    pub(super) idle: Vec<(u64, Sock)>,
    /// A clone of every spare connection's socket, idle or lent, by id: shut down at close.
    pub(super) all: HashMap<u64, Sock>,
    pub(super) next_id: u64,
    pub(super) next_cookie: u64,
    pub(super) opening: bool,
    /// No connection is opened before this, after one failed.
    pub(super) retry_at: Option<Instant>,
}

impl Spares {
    /// Spare connections open (as far as this side knows), and of those lent now.
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.all.len(), self.all.len() - self.idle.len())
    }

    /// Shuts every spare connection down (the device closes).
    pub(super) fn shutdown_all(&mut self) {
        for sock in self.all.values() {
            sock.shutdown();
        }
        self.idle.clear();
    }

    /// The server said it is shutting down (`NBD_ESHUTDOWN` on a shared connection): every
    /// idle spare connection is to it, so each is left (`NBD_CMD_DISC`, then closed) and the
    /// server need not wait for them; lent ones learn it from their own reply.
    pub(super) fn leave_idle(&mut self) {
        for (id, mut sock) in self.idle.drain(..) {
            let _ = sock.write_all(&disc_request());
            sock.shutdown();
            self.all.remove(&id);
        }
    }
}
