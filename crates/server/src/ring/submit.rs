//! What a reactor and its connections share to submit operations to their ring: the user
//! data that names what a completion is about ([`Kind`], connection, request, piece), and the
//! submission queue of one round ([`Sq`]). Its own module so that the reactor (which reads
//! completions), a connection (which submits its requests' operations) and a lent
//! connection's exchange (`remote`) each depend on it, and on nothing of each other's but
//! the reactor on the connections it drives.
//!
//! Invariants: user data packs kind (4 bits), piece (12), request (16) and connection (32),
//! so a connection submits at most [`PIECES_MAX`] pieces of a request and has at most
//! [`REQUESTS_MAX`] requests on its reactor; an entry is pushed only while the buffers it
//! names stay alive and unmoved until its completion is handled (the ring's invariants, see
//! `ring`); a full queue is submitted to make room, never dropped.

use io_uring::{squeue, IoUring};
use std::time::Duration;

/// Most pieces of a direct request submitted to the ring (the user data has 12 bits for
/// them); more go to a worker.
pub(super) const PIECES_MAX: usize = 4095;
/// Most requests of a connection in flight on a reactor (the user data has 16 bits for them).
pub(super) const REQUESTS_MAX: usize = 65_535;

/// What a completion is about (the low 4 bits of its user data).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Wake = 1,
    Timer = 2,
    Recv = 3,
    Send = 4,
    /// A direct request's device read or write.
    Device = 5,
    /// An operation of a direct request's exchange on a lent connection (`remote`).
    Remote = 6,
}

/// User data: kind (4 bits), piece (12), request (16), connection (32).
pub(super) fn user_data(kind: Kind, conn: usize, req: usize, piece: usize) -> u64 {
    debug_assert!(piece < 1 << 12 && req < 1 << 16 && conn < 1 << 32);
    kind as u64 | (piece as u64) << 4 | (req as u64) << 16 | (conn as u64) << 32
}

/// The kind, connection, request and piece that `user_data` names.
pub(super) fn decode(user_data: u64) -> (u64, usize, usize, usize) {
    (
        user_data & 0xf,
        (user_data >> 32) as usize,
        (user_data >> 16 & 0xffff) as usize,
        (user_data >> 4 & 0xfff) as usize,
    )
}

/// The submission side of a ring for one round: pushes, submitting first when it is full.
pub(super) struct Sq<'a> {
    ring: &'a IoUring,
    sq: squeue::SubmissionQueue<'a>,
}

impl<'a> Sq<'a> {
    /// The submission side of `ring` for one round.
    ///
    /// # Safety
    /// Only the calling thread uses the ring's submission queue while it lives.
    pub(super) unsafe fn new(ring: &'a IoUring) -> Sq<'a> {
        Sq {
            ring,
            // SAFETY: the caller's promise.
            sq: unsafe { ring.submission_shared() },
        }
    }

    /// Makes what was pushed visible to the kernel (the next `io_uring_enter` submits it).
    pub(super) fn sync(&mut self) {
        self.sq.sync();
    }

    pub(super) fn push(&mut self, entry: squeue::Entry) {
        loop {
            // SAFETY: every entry's buffers are owned by a connection (or the reactor) and
            // stay alive and unmoved until its completion is handled (the module invariants).
            if unsafe { self.sq.push(&entry) }.is_ok() {
                return;
            }
            self.sq.sync();
            if let Err(err) = self.ring.submit() {
                log::warn!("io_uring submit: {err}");
                std::thread::sleep(Duration::from_millis(1));
            }
            self.sq.sync();
        }
    }
}
