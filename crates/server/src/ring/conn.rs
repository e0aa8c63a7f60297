//! One connection on a reactor: receiving and decoding requests, starting each (a direct read
//! on the ring, anything else at a worker), and sending replies in batches.
//!
//! Invariants: at most one `recv` and one `sendmsg` of a connection are in flight, so bytes
//! are received and replies sent in order; replies go out whole and never interleave (a
//! partly sent batch is continued from where it stopped before anything else is sent); a
//! request holds its budget permit from before its buffer exists until its reply has been
//! sent or dropped, and its place in flight (`InFlight`) until then too; once the client has
//! gone (a failed send, a hung-up socket) nothing more is started and replies are dropped;
//! the connection is finished only when nothing of it is in flight anywhere.

use super::inbox::{Adopted, Handle};
use super::pool::{Answer, Finished, Job, Pool, Work};
use super::remote::Exchange;
use super::submit::{user_data, Kind, Sq, PIECES_MAX, REQUESTS_MAX};
use crate::budget::{Account, Permit};
use crate::execute::{admit, error_reply, permit_bytes, refusal, PAYLOAD_BYTES_MAX};
use crate::iobuf::{IoBuf, Spares};
use crate::table::InFlight;
use crate::{DirectIo, Finished as ReadFinished, Start};
use io_uring::{opcode, types};
use nbd_proto::{Decoded, NbdErrno, Request, ValidRequest};
use slab::Slab;
use std::collections::VecDeque;
use std::io;
use std::net::Shutdown;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Bytes received from the socket at once.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Most replies sent with one `sendmsg` (two iovecs each, under `IOV_MAX`).
const BATCH_REPLIES_MAX: usize = 256;

/// A request received whole (header and payload) and not yet answered.
struct Req {
    cookie: u64,
    permit: Permit,
    in_flight: InFlight,
    buf: IoBuf,
    state: ReqState,
}

enum ReqState {
    /// Its device I/O in flight on the ring.
    Direct {
        direct: Box<dyn DirectIo>,
        answer: Answer,
        /// Pieces not yet read whole, and bytes of each already read.
        left: usize,
        done: smallvec::SmallVec<[usize; 4]>,
        result: io::Result<()>,
        /// The exchange on a lent connection, instead of the pieces (`DirectIo::remote`).
        remote: Option<Box<Exchange>>,
    },
    /// At a worker, or waiting for a worker place of this connection.
    AtWorker,
}

/// A request whose header has been decoded and whose payload is still arriving (or waits
/// for its permit).
struct Partial {
    request: Request,
    in_flight: InFlight,
    permit: Option<(Permit, IoBuf)>,
    got: usize,
}

/// A reply ready to send.
struct Reply {
    head: Vec<u8>,
    buf: IoBuf,
    data_len: usize,
    /// Dropped after the reply went out (or was dropped), in this order.
    permit: Option<Permit>,
    in_flight: Option<InFlight>,
}

/// The `sendmsg` of a connection: its iovecs and header, kept (and reused) by the connection
/// and read by the kernel while a send is in flight, when neither is touched.
struct Sending {
    iov: Vec<libc::iovec>,
    msg: Box<libc::msghdr>,
    in_flight: bool,
}

/// What a completion's handler uses of its reactor for the round: the submission queue, the
/// reactor's handle (workers answer through it), the worker pool, the spare buffers.
pub(super) struct Round<'a, 'q> {
    pub(super) sq: &'a mut Sq<'q>,
    pub(super) handle: &'a Arc<Handle>,
    pub(super) pool: &'a Arc<Pool>,
    pub(super) spares: &'a mut Spares,
}

pub(super) struct Conn {
    a: Adopted,
    fd: types::Fd,
    account: Arc<Account>,
    rbuf: Box<[u8]>,
    /// Received bytes not yet decoded: `rbuf[rpos..rlen]`.
    rpos: usize,
    rlen: usize,
    recv_armed: bool,
    /// False once reading has ended.
    reading: bool,
    /// Why reading ended (`Ok`: a clean end).
    result: io::Result<()>,
    /// The client has gone: nothing more is started or sent.
    gone: bool,
    /// The request being received, from its first byte: its place in flight before its
    /// header is whole, then the decoded rest.
    starting: Option<InFlight>,
    partial: Option<Partial>,
    /// When the request being received started (or its permit was granted).
    receiving_since: Option<Instant>,
    reqs: Slab<Req>,
    /// Requests at workers, and those waiting for one of this connection's places there.
    at_workers: usize,
    waiting: VecDeque<Job>,
    outq: VecDeque<Reply>,
    /// Bytes of `outq`'s first reply already sent.
    sent_front: usize,
    /// When sending `outq`'s first reply began: it must be sent whole within
    /// `reply_timeout` (however slowly the client takes the bytes).
    front_since: Option<Instant>,
    sending: Sending,
    /// Waiting for a budget permit.
    pub(super) wants_permit: bool,
    /// Direct requests whose exchange on a lent connection is under way.
    remote_in_flight: usize,
}

impl Conn {
    pub(super) fn new(a: Adopted) -> Conn {
        log::debug!("connection {}: served by an io_uring event loop", a.id);
        let account = a.shared.budget.account();
        let mut rbuf = vec![0u8; READ_BUFFER_BYTES.max(a.leftover.len())].into_boxed_slice();
        rbuf[..a.leftover.len()].copy_from_slice(&a.leftover);
        let rlen = a.leftover.len();
        Conn {
            fd: types::Fd(a.stream.as_raw_fd()),
            a,
            account,
            rbuf,
            rpos: 0,
            rlen,
            recv_armed: false,
            reading: true,
            result: Ok(()),
            gone: false,
            starting: None,
            partial: None,
            receiving_since: None,
            reqs: Slab::new(),
            at_workers: 0,
            waiting: VecDeque::new(),
            outq: VecDeque::new(),
            sent_front: 0,
            front_since: None,
            sending: Sending {
                iov: Vec::new(),
                // SAFETY: an all-zero msghdr is a valid empty one.
                msg: Box::new(unsafe { std::mem::zeroed() }),
                in_flight: false,
            },
            wants_permit: false,
            remote_in_flight: 0,
        }
    }

    /// Nothing of the connection is in flight and nothing more will happen: it can go.
    pub(super) fn finished(&self) -> bool {
        !self.reading
            && !self.recv_armed
            && self.reqs.is_empty()
            && self.at_workers == 0
            && !self.sending.in_flight
            && (self.outq.is_empty() || self.gone)
    }

    /// Ends the connection: its outcome to the connection thread.
    pub(super) fn close(self, handle: &Handle) {
        handle.connections.fetch_sub(1, Ordering::Relaxed);
        let Conn {
            a, result, outq, ..
        } = self;
        drop(outq);
        a.outcome.finish(result);
    }

    /// Stops reading (`why`: `Ok` for a clean end); a `recv` in flight is ended by shutting
    /// the socket's reading side.
    fn stop_reading(&mut self, why: io::Result<()>) {
        if !self.reading {
            return;
        }
        self.reading = false;
        if self.result.is_ok() {
            self.result = why;
        }
        self.starting = None;
        self.partial = None;
        self.receiving_since = None;
        self.wants_permit = false;
        if self.recv_armed {
            self.a.stream.shutdown(Shutdown::Read);
        }
    }

    /// The client has gone: drop what was not started and every reply.
    fn client_gone(&mut self) {
        self.gone = true;
        self.stop_reading(Ok(()));
        self.at_workers -= self.waiting.len();
        for job in self.waiting.drain(..) {
            self.reqs.remove(job.req);
        }
        if !self.sending.in_flight {
            self.outq.clear();
        }
    }

    /// Moves the connection on: decodes what was received, arms `recv`, sends replies.
    pub(super) fn poll(&mut self, key: usize, round: &mut Round<'_, '_>) {
        if self.reading && !self.gone {
            self.decode(key, round);
        }
        if self.reading && !self.recv_armed && !self.wants_permit {
            if self.rpos > 0 {
                self.rbuf.copy_within(self.rpos..self.rlen, 0);
                self.rlen -= self.rpos;
                self.rpos = 0;
            }
            if self.rlen < self.rbuf.len() {
                let free = &mut self.rbuf[self.rlen..];
                let sqe = opcode::Recv::new(self.fd, free.as_mut_ptr(), free.len() as u32)
                    .build()
                    .user_data(user_data(Kind::Recv, key, 0, 0));
                round.sq.push(sqe);
                self.recv_armed = true;
            }
        }
        if !self.sending.in_flight && !self.outq.is_empty() && !self.gone {
            self.send(key, round.sq);
        }
    }

    /// Decodes and starts every request received whole.
    fn decode(&mut self, key: usize, round: &mut Round<'_, '_>) {
        self.wants_permit = false;
        while self.reading {
            if self.partial.is_none() {
                let avail = self.rlen - self.rpos;
                if avail == 0 {
                    return;
                }
                if self.starting.is_none() {
                    if self.reqs.len() >= REQUESTS_MAX {
                        return;
                    }
                    let Some(in_flight) = self.a.activity.begin_request() else {
                        // Closed as idle to make room for another connection.
                        self.stop_reading(Ok(()));
                        return;
                    };
                    self.starting = Some(in_flight);
                }
                if avail < Request::HEADER_BYTES {
                    self.receiving_since.get_or_insert_with(Instant::now);
                    return;
                }
                let header = &self.rbuf[self.rpos..self.rpos + Request::HEADER_BYTES];
                let request = match Request::decode(header) {
                    Ok(Decoded::Done { value, .. }) => value,
                    Ok(Decoded::Needed(_)) => unreachable!("a full header was given"),
                    Err(err) => {
                        self.stop_reading(Err(io::Error::from(err)));
                        return;
                    }
                };
                self.rpos += Request::HEADER_BYTES;
                let payload = request.payload_bytes();
                if payload > PAYLOAD_BYTES_MAX {
                    self.stop_reading(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("write payload of {payload} bytes exceeds the maximum"),
                    )));
                    return;
                }
                let in_flight = self.starting.take().expect("set above");
                self.partial = Some(Partial {
                    request,
                    in_flight,
                    permit: None,
                    got: 0,
                });
            }
            let partial = self.partial.as_mut().expect("set above");
            if partial.permit.is_none() {
                let bytes = permit_bytes(&*self.a.export, &partial.request);
                let Some(permit) = self.account.try_acquire(bytes) else {
                    self.wants_permit = true;
                    return;
                };
                let mut buf = round.spares.buf();
                buf.slice(partial.request.payload_bytes() as usize);
                partial.permit = Some((permit, buf));
                // Waiting for the permit is not receiving: the time starts again.
                self.receiving_since = None;
            }
            let payload = partial.request.payload_bytes() as usize;
            let take = (payload - partial.got).min(self.rlen - self.rpos);
            if take > 0 {
                let (_, buf) = partial.permit.as_mut().expect("set above");
                buf.data_mut(payload)[partial.got..partial.got + take]
                    .copy_from_slice(&self.rbuf[self.rpos..self.rpos + take]);
                partial.got += take;
                self.rpos += take;
            }
            if partial.got < payload {
                self.receiving_since.get_or_insert_with(Instant::now);
                return;
            }
            let Partial {
                request,
                in_flight,
                permit,
                ..
            } = self.partial.take().expect("set above");
            self.receiving_since = None;
            let (permit, buf) = permit.expect("set above");
            if !in_flight.received() {
                // Displaced while it arrived: it is answered, nothing more is read.
                self.stop_reading(Ok(()));
            }
            let action = match admit(&self.a.ctx, &request, &self.a.removed) {
                Ok(ValidRequest::Disconnect) => {
                    self.stop_reading(Ok(()));
                    return;
                }
                other => other,
            };
            self.start(key, request.cookie, action, (permit, in_flight, buf), round);
        }
    }

    /// Starts one request received whole.
    fn start(
        &mut self,
        key: usize,
        cookie: u64,
        action: Result<ValidRequest, NbdErrno>,
        (permit, in_flight, mut buf): (Permit, InFlight, IoBuf),
        round: &mut Round<'_, '_>,
    ) {
        let request = match action {
            Ok(r) => r,
            Err(errno) => {
                let mut head = round.spares.head();
                error_reply(&self.a.ctx, cookie, errno, refusal(errno), &mut head);
                self.reply(head, buf, 0, Some(permit), Some(in_flight));
                return;
            }
        };
        let export = &self.a.export;
        let (answer, started) = match request {
            ValidRequest::Read { offset, length, .. } => {
                buf.slice(length as usize);
                let started = catch_unwind(AssertUnwindSafe(|| {
                    export.start_read(offset, length as usize)
                }));
                (Answer::Read { offset, length }, started)
            }
            ValidRequest::Write {
                offset,
                length,
                fua,
            } => {
                let started = catch_unwind(AssertUnwindSafe(|| {
                    export.start_write(offset, length as usize, fua)
                }));
                (Answer::Write { length, fua }, started)
            }
            other => {
                let work = Work::Execute(other);
                self.send_to_pool((key, cookie), (permit, in_flight, buf), work, None, round);
                return;
            }
        };
        let started = started.unwrap_or_else(|_| {
            log::error!("the export panicked starting request {cookie:#x}");
            Start::Failed(io::Error::other("internal error"))
        });
        let work = match started {
            Start::Direct(direct) if (1..=PIECES_MAX).contains(&direct.pieces().len()) => {
                self.direct(
                    key, cookie, answer, direct, permit, in_flight, buf, round.sq,
                );
                return;
            }
            Start::Direct(direct) => Work::Direct(direct),
            Start::Rest(rest) => Work::Rest(rest),
            Start::Whole => Work::Execute(request),
            Start::Failed(err) => {
                let mut head = round.spares.head();
                let n = answer.reply(&self.a.watch, &self.a.ctx, cookie, Err(err), &mut head);
                self.reply(head, buf, n, Some(permit), Some(in_flight));
                return;
            }
        };
        let held = (permit, in_flight, buf);
        self.send_to_pool((key, cookie), held, work, Some(answer), round);
    }

    /// Hands a request (its permit, place in flight and buffer) to the worker pool.
    fn send_to_pool(
        &mut self,
        (key, cookie): (usize, u64),
        (permit, in_flight, buf): (Permit, InFlight, IoBuf),
        work: Work,
        answer: Option<Answer>,
        round: &Round<'_, '_>,
    ) {
        let req = self.reqs.insert(Req {
            cookie,
            permit,
            in_flight,
            buf: IoBuf::default(),
            state: ReqState::AtWorker,
        });
        let answer = answer.unwrap_or(Answer::Write {
            length: 0,
            fua: false,
        });
        let (handle, pool) = (round.handle, round.pool);
        self.hand_to_worker((key, req, cookie), answer, work, buf, handle, pool);
    }

    /// Submits a direct request's device I/O to the ring.
    #[allow(clippy::too_many_arguments)]
    fn direct(
        &mut self,
        key: usize,
        cookie: u64,
        answer: Answer,
        direct: Box<dyn DirectIo>,
        permit: Permit,
        in_flight: InFlight,
        buf: IoBuf,
        sq: &mut Sq<'_>,
    ) {
        let n = direct.pieces().len();
        let req = self.reqs.insert(Req {
            cookie,
            permit,
            in_flight,
            buf,
            state: ReqState::Direct {
                direct,
                answer,
                left: n,
                done: smallvec::smallvec![0; n],
                result: Ok(()),
                remote: None,
            },
        });
        let r = &mut self.reqs[req];
        let ReqState::Direct {
            direct,
            remote,
            answer,
            ..
        } = &mut r.state
        else {
            unreachable!("inserted as direct");
        };
        let (fd, writes) = (direct.fd(), direct.writes());
        if let Some(lent) = direct.remote() {
            let data = r.buf.data_mut(answer.len());
            let user_data = user_data(Kind::Remote, key, req, 0);
            *remote = Some(Exchange::start(lent, fd, data, writes, user_data, sq));
            self.remote_in_flight += 1;
            return;
        }
        for piece in 0..n {
            self.submit_piece(key, req, piece, sq);
        }
    }

    /// An operation of direct request `req`'s exchange on its lent connection completed.
    pub(super) fn on_remote(
        &mut self,
        key: usize,
        req: usize,
        res: i32,
        round: &mut Round<'_, '_>,
    ) {
        let r = &mut self.reqs[req];
        let ReqState::Direct {
            direct,
            answer,
            remote: Some(exchange),
            result,
            left,
            ..
        } = &mut r.state
        else {
            unreachable!("remote operations belong to remote direct requests");
        };
        let fd = direct.fd();
        let lent = direct.remote().expect("a remote direct request");
        let data = r.buf.data_mut(answer.len());
        let user_data = user_data(Kind::Remote, key, req, 0);
        if let Some(ended) = exchange.on_complete(lent, fd, data, res, user_data, round.sq) {
            *result = ended;
            *left = 0;
            self.remote_in_flight -= 1;
            self.direct_finished(key, req, round);
        }
    }

    /// Submits (the rest of) piece `piece` of direct request `req`.
    fn submit_piece(&mut self, key: usize, req: usize, piece: usize, sq: &mut Sq<'_>) {
        let r = &mut self.reqs[req];
        let ReqState::Direct {
            direct,
            answer,
            done,
            ..
        } = &r.state
        else {
            unreachable!("pieces belong to direct requests");
        };
        let d = direct.pieces()[piece];
        let fd = types::Fd(direct.fd());
        let done = done[piece];
        let data = r.buf.data_mut(answer.len());
        let target = &mut data[d.buf_offset + done..d.buf_offset + d.len];
        let at = d.offset + done as u64;
        let user_data = user_data(Kind::Device, key, req, piece);
        let sqe = if direct.writes() {
            opcode::Write::new(fd, target.as_ptr(), target.len() as u32)
                .offset(at)
                .build()
        } else {
            opcode::Read::new(fd, target.as_mut_ptr(), target.len() as u32)
                .offset(at)
                .build()
        };
        sq.push(sqe.user_data(user_data));
    }

    /// Device I/O `piece` of direct request `req` completed with `res`.
    pub(super) fn on_device(
        &mut self,
        (key, req, piece): (usize, usize, usize),
        res: i32,
        round: &mut Round<'_, '_>,
    ) {
        let ReqState::Direct {
            direct,
            left,
            done,
            result,
            ..
        } = &mut self.reqs[req].state
        else {
            unreachable!("pieces belong to direct requests");
        };
        let want = direct.pieces()[piece].len;
        match res {
            n if n > 0 => {
                done[piece] += n as usize;
                if done[piece] < want {
                    // A short transfer: the rest of the piece.
                    self.submit_piece(key, req, piece, round.sq);
                    return;
                }
            }
            0 => {
                if result.is_ok() {
                    *result = Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "device I/O past its end",
                    ));
                }
            }
            err => {
                if result.is_ok() {
                    *result = Err(io::Error::from_raw_os_error(-err));
                }
            }
        }
        *left -= 1;
        if *left == 0 {
            self.direct_finished(key, req, round);
        }
    }

    /// Every device I/O of direct request `req` ended: finish it and answer (or hand its rest
    /// to a worker).
    fn direct_finished(&mut self, key: usize, req: usize, round: &mut Round<'_, '_>) {
        let (handle, pool) = (round.handle, round.pool);
        let state = std::mem::replace(&mut self.reqs[req].state, ReqState::AtWorker);
        let ReqState::Direct {
            direct,
            answer,
            result,
            ..
        } = state
        else {
            unreachable!("checked by the caller");
        };
        let reads = !direct.writes();
        let r = &mut self.reqs[req];
        let cookie = r.cookie;
        let data = r.buf.data_mut(answer.len());
        let io_ok = result.is_ok();
        let finished = catch_unwind(AssertUnwindSafe(|| direct.finish(data, result)))
            .unwrap_or_else(|_| {
                log::error!("the export panicked finishing request {cookie:#x}");
                ReadFinished::Done(Err(io::Error::other("internal error")))
            });
        // Counted: a read answered from its direct reads; a write whose direct writes put
        // it in the cache, also when a worker then flushes it (FUA) or commits the journal.
        let counter = match (&finished, reads) {
            (ReadFinished::Done(Ok(())), true) => Some(&self.a.shared.direct_reads),
            (ReadFinished::Done(Ok(())), false) => Some(&self.a.shared.direct_writes),
            (ReadFinished::Again(_), false) if io_ok => Some(&self.a.shared.direct_writes),
            _ => None,
        };
        if let Some(counter) = counter {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        match finished {
            ReadFinished::Done(result) => {
                let r = self.reqs.remove(req);
                let mut head = round.spares.head();
                let n = answer.reply(&self.a.watch, &self.a.ctx, cookie, result, &mut head);
                self.reply(head, r.buf, n, Some(r.permit), Some(r.in_flight));
            }
            ReadFinished::Again(rest) => {
                let buf = std::mem::take(&mut self.reqs[req].buf);
                let work = Work::Rest(rest);
                self.hand_to_worker((key, req, cookie), answer, work, buf, handle, pool);
            }
        }
    }

    /// Hands request `req` (of connection `key`, with its cookie) to the pool as a job, or
    /// queues it while the connection has `workers_per_connection` requests there.
    fn hand_to_worker(
        &mut self,
        (key, req, cookie): (usize, usize, u64),
        answer: Answer,
        work: Work,
        buf: IoBuf,
        handle: &Arc<Handle>,
        pool: &Arc<Pool>,
    ) {
        let job = Job {
            handle: Arc::clone(handle),
            conn: key,
            req,
            export: Arc::clone(&self.a.export),
            watch: Arc::clone(&self.a.watch),
            ctx: self.a.ctx,
            cookie,
            answer,
            work,
            buf,
        };
        self.at_workers += 1;
        if self.at_workers - self.waiting.len() <= self.a.shared.config.workers_per_connection {
            pool.submit(job);
        } else {
            self.waiting.push_back(job);
        }
    }

    /// A request came back from a worker.
    pub(super) fn on_done(&mut self, f: Finished, pool: &Arc<Pool>) {
        self.at_workers -= 1;
        if let Some(job) = self.waiting.pop_front() {
            pool.submit(job);
        }
        let r = self.reqs.remove(f.req);
        if self.gone {
            return;
        }
        self.reply(f.head, f.buf, f.data_len, Some(r.permit), Some(r.in_flight));
    }

    fn reply(
        &mut self,
        head: Vec<u8>,
        buf: IoBuf,
        data_len: usize,
        permit: Option<Permit>,
        in_flight: Option<InFlight>,
    ) {
        if self.gone {
            return;
        }
        self.outq.push_back(Reply {
            head,
            buf,
            data_len,
            permit,
            in_flight,
        });
    }

    /// Sends the replies ready, many at once.
    fn send(&mut self, key: usize, sq: &mut Sq<'_>) {
        let iov = &mut self.sending.iov;
        iov.clear();
        let mut skip = self.sent_front;
        for r in self.outq.iter().take(BATCH_REPLIES_MAX) {
            for part in [&r.head[..], r.buf.data(r.data_len)] {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                let part = &part[skip..];
                skip = 0;
                iov.push(libc::iovec {
                    iov_base: part.as_ptr() as *mut libc::c_void,
                    iov_len: part.len(),
                });
            }
        }
        let msg = &mut *self.sending.msg;
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        let sqe = opcode::SendMsg::new(self.fd, msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data(Kind::Send, key, 0, 0));
        sq.push(sqe);
        self.front_since.get_or_insert_with(Instant::now);
        self.sending.in_flight = true;
    }

    /// The `sendmsg` in flight completed with `res`.
    pub(super) fn on_send(&mut self, res: i32, spares: &mut Spares) {
        debug_assert!(self.sending.in_flight, "a send was in flight");
        self.sending.in_flight = false;
        if res <= 0 {
            let err = if res == 0 {
                io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes")
            } else {
                io::Error::from_raw_os_error(-res)
            };
            if self.result.is_ok() {
                self.result = Err(err);
            }
            self.a.stream.shutdown(Shutdown::Both);
            self.client_gone();
            self.outq.clear();
            return;
        }
        let mut sent = res as usize + self.sent_front;
        while let Some(front) = self.outq.front() {
            let len = front.head.len() + front.data_len;
            if sent < len {
                break;
            }
            sent -= len;
            let mut r = self.outq.pop_front().expect("checked");
            // The buffer first, then the budget, then (last) the place in flight: an idle
            // connection holds no permit.
            spares.keep_buf(std::mem::take(&mut r.buf));
            spares.keep_head(std::mem::take(&mut r.head));
            drop(r.permit.take());
            drop(r.in_flight.take());
            self.front_since = None;
        }
        self.sent_front = sent;
        if self.gone {
            self.outq.clear();
        }
    }

    /// `recv` completed with `res`.
    pub(super) fn on_recv(&mut self, res: i32) {
        self.recv_armed = false;
        if !self.reading {
            return;
        }
        match res {
            n if n > 0 => {
                self.rlen += n as usize;
            }
            0 => {
                let mid_request = self.starting.is_some() || self.partial.is_some();
                if self.a.stream.hung_up() {
                    self.client_gone();
                }
                self.stop_reading(if mid_request {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client closed the connection in the middle of a request",
                    ))
                } else {
                    Ok(())
                });
            }
            err if err == -libc::EINTR || err == -libc::EAGAIN => {}
            err => {
                if self.a.stream.hung_up() {
                    self.client_gone();
                }
                self.stop_reading(Err(io::Error::from_raw_os_error(-err)));
            }
        }
    }

    /// Deadlines: a request not received in time, a reply not taken in time, idleness, a
    /// lent connection's request not answered in time (its connection is shut down, which
    /// ends its operation in flight).
    pub(super) fn tick(&mut self, now: Instant) {
        if self.remote_in_flight > 0 {
            for (_, r) in self.reqs.iter_mut() {
                if let ReqState::Direct {
                    direct,
                    remote: Some(_),
                    ..
                } = &mut r.state
                {
                    let lent = direct.remote().expect("a remote direct request");
                    if now >= lent.deadline() {
                        lent.abort();
                    }
                }
            }
        }
        let shared = Arc::clone(&self.a.shared);
        let config = &shared.config;
        if let Some(since) = self.receiving_since {
            if now.saturating_duration_since(since) > config.request_timeout && !self.wants_permit {
                self.stop_reading(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "receiving a request took longer than {:?}",
                        config.request_timeout
                    ),
                )));
            }
        }
        if let (true, Some(since)) = (self.sending.in_flight, self.front_since) {
            if now.saturating_duration_since(since) > config.reply_timeout {
                if self.result.is_ok() {
                    self.result = Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "writing a reply took longer than {:?}",
                            config.reply_timeout
                        ),
                    ));
                }
                // The send in flight fails once the socket is shut down.
                self.a.stream.shutdown(Shutdown::Both);
                self.client_gone();
            }
        }
        if let Some(after) = config.idle_close_after {
            if self.reading
                && self.starting.is_none()
                && self.partial.is_none()
                && self.a.activity.close_if_idle(after, now)
            {
                let counters = &self.a.shared.table.counters;
                counters.idle_closed.fetch_add(1, Ordering::Relaxed);
                log::debug!("closing a connection idle for {after:?}");
                self.stop_reading(Ok(()));
            }
        }
    }
}
