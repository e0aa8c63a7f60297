//! The worker pool of the io_uring data path: threads that carry out the requests a reactor
//! must not wait for (misses, writes, flushes, trims, block status) and hand each back to its
//! reactor as a finished reply.
//!
//! Invariants: a job's buffer and reply travel by value (the reactor keeps nothing a worker
//! touches); every job taken is answered with exactly one `Msg::Done` to its reactor, also
//! when the export panics (an EIO reply); threads are started when a job finds none idle, up
//! to `workers_max`, and all exit once the pool is stopped and its queue is empty.

pub(crate) use super::inbox::Finished;
use super::inbox::{Handle, Msg};
use crate::execute::{error_reply, execute, read_reply, simple_reply};
use crate::iobuf::IoBuf;
use crate::{DirectIo, Export, Finished as DirectFinished, LossWatch, Rest};
use nbd_proto::{NbdErrno, TransmissionContext, ValidRequest};
use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};

/// What a worker does.
pub(crate) enum Work {
    /// A whole request through the export's blocking calls.
    Execute(ValidRequest),
    /// The rest of a read or write the export started (`Export::start_read`,
    /// `Export::start_write`).
    Rest(Rest),
    /// A direct request whose device I/O is done here with `pread`/`pwrite` (too many pieces
    /// for the ring), then finished.
    Direct(Box<dyn DirectIo>),
}

/// How a started request is answered.
#[derive(Clone, Copy)]
pub(crate) enum Answer {
    /// A read of `length` bytes at `offset`: the data reply.
    Read { offset: u64, length: u32 },
    /// A write of `length` bytes: a simple reply (with `fua`, after the loss check: see
    /// `LossWatch`).
    Write { length: u32, fua: bool },
}

impl Answer {
    pub(crate) fn len(self) -> usize {
        match self {
            Answer::Read { length, .. } | Answer::Write { length, .. } => length as usize,
        }
    }

    /// The reply to the request ending with `result`; returns the data bytes after `head`.
    pub(crate) fn reply(
        self,
        watch: &LossWatch,
        ctx: &TransmissionContext,
        cookie: u64,
        result: io::Result<()>,
        head: &mut Vec<u8>,
    ) -> usize {
        match self {
            Answer::Read { offset, length } => {
                read_reply(ctx, cookie, offset, length, result, head)
            }
            Answer::Write { fua, .. } => {
                let result = watch.check_if(fua, result);
                simple_reply(ctx, cookie, result, head);
                0
            }
        }
    }
}

pub(crate) struct Job {
    pub(crate) handle: Arc<Handle>,
    /// The connection's and the request's keys on their reactor.
    pub(crate) conn: usize,
    pub(crate) req: usize,
    pub(crate) export: Arc<dyn Export>,
    pub(crate) watch: Arc<LossWatch>,
    pub(crate) ctx: TransmissionContext,
    pub(crate) cookie: u64,
    /// How a started request (`Rest`, `Direct`) is answered (`Execute` answers itself).
    pub(crate) answer: Answer,
    pub(crate) work: Work,
    /// The write payload, or the read's reply buffer (already sized).
    pub(crate) buf: IoBuf,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    threads: usize,
    idle: usize,
    stopping: bool,
}

pub(crate) struct Pool {
    state: Mutex<State>,
    work: Condvar,
    max: usize,
    /// Threads now, for the server's statistics.
    gauge: Arc<std::sync::atomic::AtomicUsize>,
}

impl Pool {
    pub(crate) fn new(max: usize, gauge: Arc<std::sync::atomic::AtomicUsize>) -> Arc<Pool> {
        Arc::new(Pool {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            max: max.max(1),
            gauge,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn submit(self: &Arc<Self>, job: Job) {
        let mut st = self.lock();
        st.jobs.push_back(job);
        if st.idle >= st.jobs.len() || st.threads >= self.max {
            let idle = st.idle > 0;
            drop(st);
            if idle {
                self.work.notify_one();
            }
            return;
        }
        st.threads += 1;
        self.gauge
            .store(st.threads, std::sync::atomic::Ordering::Relaxed);
        drop(st);
        let pool = Arc::clone(self);
        let started = std::thread::Builder::new()
            .name("nbd-worker".into())
            .spawn(move || pool.work());
        if let Err(err) = started {
            log::warn!("could not start a worker: {err}");
            let mut st = self.lock();
            st.threads -= 1;
            self.gauge
                .store(st.threads, std::sync::atomic::Ordering::Relaxed);
            if st.threads == 0 {
                // Nobody could run the queue: answer its jobs with errors.
                let jobs: Vec<Job> = st.jobs.drain(..).collect();
                drop(st);
                for job in jobs {
                    fail(job, "no worker thread");
                }
            }
        }
    }

    fn work(&self) {
        let mut st = self.lock();
        loop {
            if let Some(job) = st.jobs.pop_front() {
                drop(st);
                run(job);
                st = self.lock();
                continue;
            }
            if st.stopping {
                st.threads -= 1;
                self.gauge
                    .store(st.threads, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            st.idle += 1;
            st = self.work.wait(st).unwrap_or_else(|p| p.into_inner());
            st.idle -= 1;
        }
    }

    /// Lets the workers exit once the queue is empty.
    pub(crate) fn stop(&self) {
        self.lock().stopping = true;
        self.work.notify_all();
    }
}

fn fail(job: Job, why: &str) {
    let mut head = Vec::new();
    error_reply(&job.ctx, job.cookie, NbdErrno::Eio, why, &mut head);
    job.handle.send(Msg::Done(Finished {
        conn: job.conn,
        req: job.req,
        head,
        buf: job.buf,
        data_len: 0,
    }));
}

fn run(job: Job) {
    let Job {
        handle,
        conn,
        req,
        export,
        watch,
        ctx,
        cookie,
        answer,
        work,
        mut buf,
    } = job;
    let mut head = Vec::with_capacity(64);
    let outcome = catch_unwind(AssertUnwindSafe(|| match work {
        Work::Execute(request) => {
            execute(&*export, &watch, &ctx, cookie, request, &mut buf, &mut head)
        }
        Work::Rest(rest) => {
            let result = rest(buf.data_mut(answer.len()));
            answer.reply(&watch, &ctx, cookie, result, &mut head)
        }
        Work::Direct(direct) => {
            let data = buf.data_mut(answer.len());
            let (fd, write) = (direct.fd(), direct.writes());
            let io = direct.pieces().iter().try_for_each(|r| {
                let part = &mut data[r.buf_offset..][..r.len];
                if write {
                    pwrite_full(fd, part, r.offset)
                } else {
                    pread_full(fd, part, r.offset)
                }
            });
            let result = match direct.finish(data, io) {
                DirectFinished::Done(r) => r,
                DirectFinished::Again(rest) => rest(data),
            };
            answer.reply(&watch, &ctx, cookie, result, &mut head)
        }
    }));
    let data_len = outcome.unwrap_or_else(|_| {
        log::error!("the export panicked serving request {cookie:#x}");
        head.clear();
        error_reply(&ctx, cookie, NbdErrno::Eio, "internal error", &mut head);
        0
    });
    handle.send(Msg::Done(Finished {
        conn,
        req,
        head,
        buf,
        data_len,
    }));
}

/// Reads `buf.len()` bytes at `offset` of `fd` (retrying short reads and interruptions).
fn pread_full(fd: std::os::fd::RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    transfer_full(buf.len(), |done| {
        // SAFETY: reads into the live, writable rest of `buf`; `fd` is kept open by the
        // DirectIo that named it.
        unsafe {
            libc::pread(
                fd,
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                (offset + done as u64) as libc::off_t,
            )
        }
    })
}

/// Writes `buf` at `offset` of `fd` (retrying short writes and interruptions).
fn pwrite_full(fd: std::os::fd::RawFd, buf: &[u8], offset: u64) -> io::Result<()> {
    transfer_full(buf.len(), |done| {
        // SAFETY: writes from the live rest of `buf`; `fd` is kept open by the DirectIo that
        // named it.
        unsafe {
            libc::pwrite(
                fd,
                buf[done..].as_ptr().cast(),
                buf.len() - done,
                (offset + done as u64) as libc::off_t,
            )
        }
    })
}

/// Repeats `io(bytes done so far)` until `len` bytes are done.
fn transfer_full(len: usize, mut io: impl FnMut(usize) -> isize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        let n = io(done);
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n > 0 => done += n as usize,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
    Ok(())
}
