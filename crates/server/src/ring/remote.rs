//! A direct request's NBD exchange on a connection of a remote backing device lent to it
//! ([`RemoteIo`]): the request sent (with a write's payload), the reply header read and
//! checked, a read's data read into the request's buffer. Each step is one operation on the
//! reactor's ring, continued where it stopped when it ends short; nothing waits on a thread.
//!
//! Invariants: one operation of an exchange is in flight at a time, on memory that does not
//! move while it is: the exchange's own (boxed: its iovecs, message header and reply header)
//! and the request's buffer; the exchange ends at its last step or at the first operation
//! that fails or sees the stream end, and the lent connection is told which ([`RemoteIo`]'s
//! `done` or `failed`), so a connection whose stream is no longer framed is never reused.

use super::submit::Sq;
use crate::RemoteIo;
use io_uring::{opcode, types};
use nbd_proto::{Request, SimpleReplyHeader};
use std::io;

/// Where an exchange is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Sending the header and a write's payload.
    Send,
    /// Reading the reply header.
    Head,
    /// Reading a read's data.
    Data,
}

pub(super) struct Exchange {
    phase: Phase,
    /// Bytes of the phase already done.
    done: usize,
    /// The request's header (copied from the lease when sending starts).
    request: [u8; Request::HEADER_BYTES],
    /// The payload's length (a write's), sent after the header.
    payload: usize,
    head: [u8; SimpleReplyHeader::BYTES],
    /// Data bytes the reply announced.
    data: usize,
    iov: [libc::iovec; 2],
    msg: libc::msghdr,
}

// SAFETY: the raw pointers in `iov` and `msg` point into the exchange itself and the request's
// buffer, which move with it to no other thread while an operation is in flight (a reactor
// owns both); they are rebuilt before each operation.
unsafe impl Send for Exchange {}

impl Exchange {
    /// Starts the exchange: its first operation is submitted with `user_data`.
    /// `buf`: the request's buffer, a write's payload (`writes`) or a read's data.
    pub(super) fn start(
        remote: &mut dyn RemoteIo,
        fd: i32,
        buf: &mut [u8],
        writes: bool,
        user_data: u64,
        sq: &mut Sq<'_>,
    ) -> Box<Exchange> {
        let mut x = Box::new(Exchange {
            phase: Phase::Send,
            done: 0,
            request: remote
                .request()
                .try_into()
                .expect("an NBD request header is 28 bytes"),
            payload: if writes { buf.len() } else { 0 },
            head: [0; SimpleReplyHeader::BYTES],
            data: 0,
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2],
            // SAFETY: an all-zero msghdr is a valid empty one.
            msg: unsafe { std::mem::zeroed() },
        });
        x.submit(fd, buf, user_data, sq);
        x
    }

    /// Submits the rest of the current phase. `buf`: a write's payload when sending, a
    /// read's data buffer when reading data.
    fn submit(&mut self, fd: i32, buf: &mut [u8], user_data: u64, sq: &mut Sq<'_>) {
        let fd = types::Fd(fd);
        let sqe = match self.phase {
            Phase::Send => {
                let h = self.request.len();
                let mut n = 0;
                if self.done < h {
                    self.iov[0] = libc::iovec {
                        iov_base: self.request[self.done..].as_mut_ptr().cast(),
                        iov_len: h - self.done,
                    };
                    n = 1;
                }
                let sent_payload = self.done.saturating_sub(h);
                if self.payload > sent_payload {
                    self.iov[n] = libc::iovec {
                        iov_base: buf[sent_payload..self.payload].as_mut_ptr().cast(),
                        iov_len: self.payload - sent_payload,
                    };
                    n += 1;
                }
                self.msg.msg_iov = self.iov.as_mut_ptr();
                self.msg.msg_iovlen = n as _;
                opcode::SendMsg::new(fd, &self.msg)
                    .flags(libc::MSG_NOSIGNAL as u32)
                    .build()
            }
            Phase::Head => {
                // The header, and a read's data with it when it is there already (nothing
                // but this reply ever comes on the connection, so nothing else can be taken).
                let rest = &mut self.head[self.done..];
                self.iov[0] = libc::iovec {
                    iov_base: rest.as_mut_ptr().cast(),
                    iov_len: rest.len(),
                };
                self.iov[1] = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: if self.payload == 0 { buf.len() } else { 0 },
                };
                self.msg.msg_iov = self.iov.as_mut_ptr();
                self.msg.msg_iovlen = 2;
                opcode::RecvMsg::new(fd, &mut self.msg).build()
            }
            Phase::Data => {
                let rest = &mut buf[self.done..self.data];
                opcode::Recv::new(fd, rest.as_mut_ptr(), rest.len() as u32)
                    .flags(libc::MSG_WAITALL)
                    .build()
            }
        };
        sq.push(sqe.user_data(user_data));
    }

    /// The exchange's operation completed with `res`: `None` when the next one is
    /// submitted, or the request's result once the exchange ended.
    pub(super) fn on_complete(
        &mut self,
        remote: &mut dyn RemoteIo,
        fd: i32,
        buf: &mut [u8],
        res: i32,
        user_data: u64,
        sq: &mut Sq<'_>,
    ) -> Option<io::Result<()>> {
        if res <= 0 {
            return Some(Err(remote.failed(res)));
        }
        self.done += res as usize;
        let want = match self.phase {
            Phase::Send => self.request.len() + self.payload,
            Phase::Head => self.head.len(),
            Phase::Data => self.data,
        };
        if self.done < want {
            self.submit(fd, buf, user_data, sq);
            return None;
        }
        match self.phase {
            Phase::Send => {
                self.phase = Phase::Head;
                self.done = 0;
            }
            Phase::Head => {
                // Data bytes that came with the header.
                let extra = self.done - self.head.len();
                match remote.reply(&self.head) {
                    Ok(n) if n == extra => {
                        remote.done();
                        return Some(Ok(()));
                    }
                    Ok(n) if n == buf.len() && extra < n => {
                        self.data = n;
                        self.phase = Phase::Data;
                        self.done = extra;
                    }
                    // A protocol violation: the connection is no longer framed.
                    Ok(n) => {
                        let e = remote.failed(-libc::EPROTO);
                        return Some(Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "{e}: a reply with {n} bytes of data for a request of {} \
                                 ({extra} came with it)",
                                buf.len()
                            ),
                        )));
                    }
                    Err(e) if extra > 0 => {
                        let broken = remote.failed(-libc::EPROTO);
                        return Some(Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{broken}: data after an error reply ({e})"),
                        )));
                    }
                    Err(e) => return Some(Err(e)),
                }
            }
            Phase::Data => {
                remote.done();
                return Some(Ok(()));
            }
        }
        self.submit(fd, buf, user_data, sq);
        None
    }
}
