//! One reactor: an io_uring and the connections it serves, in a loop that submits what the
//! connections need, waits for completions, and hands each to its connection.
//!
//! Invariants: every operation submitted carries its connection's key (and, for a device
//! read, its request and piece) in its user data (`submit`), and a connection is removed only
//! when it has none in flight (`Conn::finished`), so a completion always finds its connection;
//! the
//! eventfd read and the timer are always armed while the reactor runs; all submissions of one
//! round go to the kernel in one `io_uring_enter`, which also waits for the next completion.

use super::conn::{Conn, Round};
use super::inbox::{Handle, Msg};
use super::pool::Pool;
use super::submit::{decode, user_data, Kind, Sq};
use crate::iobuf::Spares;
use io_uring::{opcode, types, IoUring};
use slab::Slab;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often deadlines are looked at, at most (and while a connection waits for budget).
const TICK_MAX: Duration = Duration::from_millis(100);
const TICK_WAITING: Duration = Duration::from_millis(2);

/// Sets up a ring, on the thread that will use it, and checks that it has every operation
/// the data path uses. Completions are run when the reactor asks for them (single issuer,
/// deferred task work: no interruption of the reactor per completion) where the kernel has it
/// (6.1), else cooperatively (5.19), else the kernel's default.
pub(super) fn new_ring(entries: u32) -> io::Result<IoUring> {
    let ring = IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::builder().setup_coop_taskrun().build(entries))
        .or_else(|_| IoUring::builder().build(entries))?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    for (code, name) in [
        (opcode::Read::CODE, "read"),
        (opcode::Write::CODE, "write"),
        (opcode::Recv::CODE, "recv"),
        (opcode::SendMsg::CODE, "sendmsg"),
        (opcode::RecvMsg::CODE, "recvmsg"),
        (opcode::Timeout::CODE, "timeout"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring lacks the {name} operation"),
            ));
        }
    }
    Ok(ring)
}

pub(super) struct Reactor {
    ring: IoUring,
    handle: Arc<Handle>,
    pool: Arc<Pool>,
    conns: Slab<Conn>,
    /// Buffers and reply headers of finished requests, for the next ones.
    spares: Spares,
    wake_buf: Box<u64>,
    timer: Box<types::Timespec>,
    timer_armed: bool,
    wake_armed: bool,
    stopping: bool,
}

impl Reactor {
    pub(super) fn new(ring: IoUring, handle: Arc<Handle>, pool: Arc<Pool>) -> Reactor {
        Reactor {
            ring,
            handle,
            pool,
            conns: Slab::new(),
            spares: Spares::default(),
            wake_buf: Box::new(0),
            timer: Box::new(types::Timespec::new()),
            timer_armed: false,
            wake_armed: false,
            stopping: false,
        }
    }

    pub(super) fn run(mut self) {
        let mut completions: Vec<(u64, i32)> = Vec::with_capacity(256);
        let mut last_tick = Instant::now();
        loop {
            for msg in self.handle.take() {
                match msg {
                    Msg::Adopt(a) => {
                        let key = self.conns.insert(Conn::new(*a));
                        debug_assert!(key < 1 << 32);
                    }
                    Msg::Done(f) => {
                        let conn = &mut self.conns[f.conn];
                        conn.on_done(f, &self.pool);
                    }
                    Msg::Stop => self.stopping = true,
                }
            }
            for (user_data, res) in completions.drain(..) {
                self.complete(user_data, res);
            }
            let now = Instant::now();
            let waiting = self.conns.iter().any(|(_, c)| c.wants_permit);
            if now.saturating_duration_since(last_tick) >= TICK_WAITING {
                last_tick = now;
                for (_, c) in self.conns.iter_mut() {
                    c.tick(now);
                }
            }
            {
                // SAFETY: only this thread uses the ring's submission queue.
                let mut sq = unsafe { Sq::new(&self.ring) };
                let mut round = Round {
                    sq: &mut sq,
                    handle: &self.handle,
                    pool: &self.pool,
                    spares: &mut self.spares,
                };
                for (key, c) in self.conns.iter_mut() {
                    c.poll(key, &mut round);
                }
                if !self.wake_armed {
                    let sqe = opcode::Read::new(
                        types::Fd(self.handle.wake.as_raw_fd()),
                        (&mut *self.wake_buf as *mut u64).cast(),
                        8,
                    )
                    .build()
                    .user_data(user_data(Kind::Wake, 0, 0, 0));
                    sq.push(sqe);
                    self.wake_armed = true;
                }
                if !self.timer_armed {
                    let tick = if waiting { TICK_WAITING } else { TICK_MAX };
                    *self.timer = types::Timespec::new()
                        .sec(tick.as_secs())
                        .nsec(tick.subsec_nanos());
                    let sqe = opcode::Timeout::new(&*self.timer)
                        .build()
                        .user_data(user_data(Kind::Timer, 0, 0, 0));
                    sq.push(sqe);
                    self.timer_armed = true;
                }
                sq.sync();
            }
            // Allocates only in the round a connection ends.
            if self.conns.iter().any(|(_, c)| c.finished()) {
                let finished: Vec<usize> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| c.finished())
                    .map(|(k, _)| k)
                    .collect();
                for key in finished {
                    self.conns.remove(key).close(&self.handle);
                }
            }
            if self.stopping && self.conns.is_empty() {
                // The eventfd read and the timer may still be in flight: their buffers are
                // the reactor's, so it waits for them before the ring goes.
                self.drain_own();
                return;
            }
            if let Err(err) = self.ring.submit_and_wait(1) {
                if err.raw_os_error() != Some(libc::EINTR) {
                    log::error!("io_uring wait: {err}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            // SAFETY: only this thread uses the ring's completion queue.
            let cq = unsafe { self.ring.completion_shared() };
            completions.extend(cq.map(|c| (c.user_data(), c.result())));
        }
    }

    fn complete(&mut self, user_data: u64, res: i32) {
        let (kind, conn, req, piece) = decode(user_data);
        match kind {
            k if k == Kind::Wake as u64 => self.wake_armed = false,
            k if k == Kind::Timer as u64 => self.timer_armed = false,
            k if k == Kind::Recv as u64 => self.conns[conn].on_recv(res),
            k if k == Kind::Send as u64 => self.conns[conn].on_send(res, &mut self.spares),
            k if k == Kind::Device as u64 || k == Kind::Remote as u64 => {
                // SAFETY: only this thread uses the ring's submission queue.
                let mut sq = unsafe { Sq::new(&self.ring) };
                let c = &mut self.conns[conn];
                let mut round = Round {
                    sq: &mut sq,
                    handle: &self.handle,
                    pool: &self.pool,
                    spares: &mut self.spares,
                };
                if k == Kind::Device as u64 {
                    c.on_device((conn, req, piece), res, &mut round);
                } else {
                    c.on_remote(conn, req, res, &mut round);
                }
                sq.sync();
            }
            other => log::error!("io_uring completion of unknown kind {other}"),
        }
    }

    /// Waits for the reactor's own eventfd read and timer before its buffers go: the read
    /// ends by a write to the eventfd, the timer by itself.
    fn drain_own(&mut self) {
        if self.wake_armed {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to our own eventfd.
            unsafe { libc::write(self.handle.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        while self.wake_armed || self.timer_armed {
            if self.ring.submit_and_wait(1).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: only this thread uses the ring's completion queue.
            let done: Vec<(u64, i32)> = unsafe { self.ring.completion_shared() }
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user_data, res) in done {
                self.complete(user_data, res);
            }
        }
    }
}
