//! Serves a [`server::Export`] as a Linux block device, `/dev/ublkbN`, through the kernel's
//! ublk driver (Linux 6.5+ for the ioctl-encoded commands used here): the driver hands each
//! block request to this process as the completion of an `IORING_OP_URING_CMD`, and takes the
//! result back with the next command on the same tag. No socket and no protocol sit between
//! the block layer and the export.
//!
//! Layout: [`Device::start`] adds (or, after a crash of the previous server, recovers) the
//! device through `/dev/ublk-control`, starts one thread per hardware queue, each with its
//! own io_uring, its `depth` tags and one buffer per tag (the driver copies request data into
//! and out of these buffers), then starts the device. A queue thread only talks to the driver
//! (the driver takes a queue's commands from one thread only): it hands each request to the
//! queue's workers (up to 16 threads, fewer if the depth is smaller), which execute it on the
//! export, and sends their results back (a lone request while none is with the workers it
//! executes itself, sparing a queue-depth-1 load two hand-overs); so up to that many requests of one queue are in flight
//! at once, and the queues (spread over CPUs by the block layer) multiply that. A worker wakes
//! the queue thread, waiting in its ring, through an eventfd read on the same ring.
//!
//! Devices are added with `UBLK_F_USER_RECOVERY | UBLK_F_USER_RECOVERY_REISSUE`: when the
//! server dies, the driver quiesces the device instead of removing it (requests wait), and the
//! next [`Device::start`] with the same id takes it over and has the driver re-issue the
//! requests that were in flight. [`Device::stop`] stops the device and ends its queues, and
//! [`Stopped::delete`] deletes it (the clean shutdown, in two steps because the driver answers
//! the delete only once no filesystem is mounted on the device any more). A dead device of the
//! number [`Device::start`] wants (stopped, not quiesced) is deleted first, waiting at most
//! [`DEAD_DELETE_WAIT`]: one still held open (a filesystem left mounted on it) fails the start
//! saying so, instead of waiting for the unmount.
//!
//! Invariants: a request's result reaches the driver only after the export returned for it;
//! a tag's buffer has one user at a time (the driver while the tag's command is with it, then
//! the one worker its request went to), and the workers end before the buffers are freed;
//! and every write is made durable before it is acknowledged (the device is advertised without
//! a volatile write cache, and writes run as FUA). A device that outlives a crash of its
//! server must: the filesystem on it stays mounted across the recovery and is never told that
//! the server restarted, so a write acknowledged before the crash but lost with it (one that
//! only a later flush would have made durable) would be silently missing under a filesystem
//! that believes it written — found by the VM's kill -9 scenario, whose fsync'd files came
//! back different when writes were acknowledged before they were durable.

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use server::{Export, LossWatch};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

// ---- the driver's interface (include/uapi/linux/ublk_cmd.h) ----------------------------

const CMD_GET_DEV_INFO: u32 = 0x02;
const CMD_ADD_DEV: u32 = 0x04;
const CMD_DEL_DEV: u32 = 0x05;
const CMD_START_DEV: u32 = 0x06;
const CMD_STOP_DEV: u32 = 0x07;
const CMD_SET_PARAMS: u32 = 0x08;
const CMD_START_USER_RECOVERY: u32 = 0x10;
const CMD_END_USER_RECOVERY: u32 = 0x11;
const IO_FETCH_REQ: u32 = 0x20;
const IO_COMMIT_AND_FETCH_REQ: u32 = 0x21;

const F_USER_RECOVERY: u64 = 1 << 3;
const F_USER_RECOVERY_REISSUE: u64 = 1 << 4;

const S_DEV_LIVE: u16 = 1;
const S_DEV_QUIESCED: u16 = 2;

const IO_OP_READ: u32 = 0;
const IO_OP_WRITE: u32 = 1;
const IO_OP_FLUSH: u32 = 2;
const IO_OP_DISCARD: u32 = 3;
const IO_OP_WRITE_ZEROES: u32 = 5;
const IO_F_NOUNMAP: u32 = 1 << 15;

const ATTR_ROTATIONAL: u32 = 1 << 1;
const PARAM_TYPE_BASIC: u32 = 1 << 0;
const PARAM_TYPE_DISCARD: u32 = 1 << 1;

/// The driver's largest queue depth; the descriptor areas of the queues are this far apart.
const MAX_QUEUE_DEPTH: usize = 4096;

/// `_IOWR('u', nr, size)`: the ioctl-encoded form of a ublk command.
const fn iowr(nr: u32, size: usize) -> u32 {
    (3 << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}

#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CtrlCmd {
    dev_id: u32,
    queue_id: u16,
    len: u16,
    addr: u64,
    data: [u64; 1],
    dev_path_len: u16,
    pad: u16,
    reserved: u32,
}

/// `struct ublksrv_ctrl_dev_info`.
#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct DevInfo {
    nr_hw_queues: u16,
    queue_depth: u16,
    state: u16,
    pad0: u16,
    max_io_buf_bytes: u32,
    dev_id: u32,
    ublksrv_pid: i32,
    pad1: u32,
    flags: u64,
    ublksrv_flags: u64,
    owner_uid: u32,
    owner_gid: u32,
    reserved1: u64,
    reserved2: u64,
}

#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ParamBasic {
    attrs: u32,
    logical_bs_shift: u8,
    physical_bs_shift: u8,
    io_opt_shift: u8,
    io_min_shift: u8,
    max_sectors: u32,
    chunk_sectors: u32,
    dev_sectors: u64,
    virt_boundary_mask: u64,
}

#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct ParamDiscard {
    discard_alignment: u32,
    discard_granularity: u32,
    max_discard_sectors: u32,
    max_write_zeroes_sectors: u32,
    max_discard_segments: u16,
    reserved0: u16,
}

#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Params {
    len: u32,
    types: u32,
    basic: ParamBasic,
    discard: ParamDiscard,
}

/// `struct ublksrv_io_desc`: one per tag, in the queue's shared (read-only) area.
#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Clone, Copy)]
struct IoDesc {
    op_flags: u32,
    nr_sectors: u32,
    start_sector: u64,
    addr: u64,
}

/// `struct ublksrv_io_cmd`.
#[allow(dead_code)] // the driver's layout; not every field is read here
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct IoCmd {
    q_id: u16,
    tag: u16,
    result: i32,
    addr: u64,
}

fn bytes_of<T: Copy, const N: usize>(v: &T) -> [u8; N] {
    assert!(std::mem::size_of::<T>() <= N);
    let mut out = [0u8; N];
    // SAFETY: T is a plain repr(C) struct of integers; its bytes fit in `out`.
    unsafe {
        std::ptr::copy_nonoverlapping(
            v as *const T as *const u8,
            out.as_mut_ptr(),
            std::mem::size_of::<T>(),
        )
    };
    out
}

// ---- the control device -----------------------------------------------------------------

/// `/dev/ublk-control` with a small ring for its commands (they need 128-byte entries).
struct Control {
    file: File,
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
}

impl Control {
    fn open() -> io::Result<Control> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/ublk-control")
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("/dev/ublk-control: {e} (is the ublk_drv module loaded?)"),
                )
            })?;
        let ring = IoUring::builder().build(4)?;
        Ok(Control { file, ring })
    }

    fn cmd(&mut self, nr: u32, cmd: CtrlCmd) -> io::Result<i32> {
        let sqe = opcode::UringCmd80::new(
            types::Fd(self.file.as_raw_fd()),
            iowr(nr, std::mem::size_of::<CtrlCmd>()),
        )
        .cmd(bytes_of::<CtrlCmd, 80>(&cmd))
        .build()
        .user_data(u64::from(nr));
        // SAFETY: the buffers `cmd.addr` points at outlive the wait below.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("ublk control ring full"))?;
        self.ring.submit_and_wait(1)?;
        let cqe = self
            .ring
            .completion()
            .next()
            .ok_or_else(|| io::Error::other("ublk control command without a completion"))?;
        if cqe.result() < 0 {
            Err(io::Error::from_raw_os_error(-cqe.result()))
        } else {
            Ok(cqe.result())
        }
    }

    fn header(dev_id: u32) -> CtrlCmd {
        CtrlCmd {
            dev_id,
            queue_id: u16::MAX,
            ..CtrlCmd::default()
        }
    }

    fn get_info(&mut self, dev_id: u32) -> io::Result<DevInfo> {
        let mut info = DevInfo::default();
        let mut c = Control::header(dev_id);
        c.addr = &mut info as *mut DevInfo as u64;
        c.len = std::mem::size_of::<DevInfo>() as u16;
        self.cmd(CMD_GET_DEV_INFO, c)?;
        Ok(info)
    }

    fn add(&mut self, info: &mut DevInfo) -> io::Result<()> {
        let mut c = Control::header(info.dev_id);
        c.addr = info as *mut DevInfo as u64;
        c.len = std::mem::size_of::<DevInfo>() as u16;
        self.cmd(CMD_ADD_DEV, c).map(drop)
    }

    fn set_params(&mut self, dev_id: u32, params: &mut Params) -> io::Result<()> {
        let mut c = Control::header(dev_id);
        c.addr = params as *mut Params as u64;
        c.len = std::mem::size_of::<Params>() as u16;
        self.cmd(CMD_SET_PARAMS, c).map(drop)
    }

    fn simple(&mut self, nr: u32, dev_id: u32, data: u64) -> io::Result<()> {
        let mut c = Control::header(dev_id);
        c.data[0] = data;
        self.cmd(nr, c).map(drop)
    }
}

/// Longest [`Device::start`] waits for the driver to delete a dead device of the number it
/// wants: the driver answers only once nothing holds the device open (a filesystem still
/// mounted on it after its server died holds it until unmounted).
pub const DEAD_DELETE_WAIT: Duration = Duration::from_secs(10);

/// Deletes device `id`, waiting at most `limit`. The delete is sent from a thread of its own
/// with its own control handle: past the limit it is left waiting there (the driver's wait is
/// interruptible, so it ends with the process at the latest, or succeeds once the holder lets
/// go) and the caller gets `ResourceBusy` naming what to do.
fn delete_within(id: u32, limit: Duration) -> io::Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("ublk{id}-delete"))
        .spawn(move || {
            let r = Control::open().and_then(|mut c| c.simple(CMD_DEL_DEV, id, 0));
            let _ = tx.send(r);
        })?;
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!(
                "/dev/ublkb{id} is left by a server that ended and is still held open (a \
                 filesystem mounted on it?): the driver deletes it only once it is let go; \
                 unmount it (umount -l if its files are gone anyway) and start again, or serve \
                 from another number (--ublk-first-id)"
            ),
        )),
    }
}

// ---- a device ---------------------------------------------------------------------------

/// How a device is set up.
#[derive(Debug, Clone)]
pub struct Options {
    /// The device number: `/dev/ublkbN`. A quiesced device of that number (left by a server
    /// that died) is recovered, a dead one replaced; a live one is refused.
    pub dev_id: u32,
    /// Hardware queues, each served by a thread of its own (1–32).
    pub queues: u16,
    /// Requests each queue takes at once (1–4096).
    pub depth: u16,
    /// The largest request in bytes (a multiple of 4096).
    pub max_io_bytes: u32,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            dev_id: 0,
            queues: 2,
            depth: 64,
            max_io_bytes: 512 << 10,
        }
    }
}

/// A served `/dev/ublkbN`.
pub struct Device {
    dev_id: u32,
    recovered: bool,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    ctrl: Control,
    /// `/dev/ublkcN`, open while the queues are served.
    chardev: Option<Arc<File>>,
}

impl Device {
    /// Serves `export` as `/dev/ublkb{opts.dev_id}`; returns once the block device is live.
    pub fn start(export: Arc<dyn Export>, opts: &Options) -> io::Result<Device> {
        if !(1..=32).contains(&opts.queues)
            || !(1..=MAX_QUEUE_DEPTH as u16).contains(&opts.depth)
            || opts.max_io_bytes == 0
            || !opts.max_io_bytes.is_multiple_of(4096)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ublk options out of range: {opts:?}"),
            ));
        }
        let size = export.size_bytes();
        let mut ctrl = Control::open()?;
        let id = opts.dev_id;
        let mut info = match ctrl.get_info(id) {
            Ok(info) => Some(info),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => None,
            Err(e) => return Err(e),
        };
        if let Some(old) = info {
            match old.state {
                S_DEV_LIVE => {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("/dev/ublkb{id} is live, served by pid {}", old.ublksrv_pid),
                    ))
                }
                S_DEV_QUIESCED if old.flags & F_USER_RECOVERY != 0 => {}
                _ => {
                    // Stopped (or not recoverable): replace it.
                    log::info!(
                        "ublk: deleting the dead /dev/ublkc{id} (state {})",
                        old.state
                    );
                    let _ = ctrl.simple(CMD_STOP_DEV, id, 0);
                    delete_within(id, DEAD_DELETE_WAIT)?;
                    info = None;
                }
            }
        }
        let recovered = info.is_some();
        let info = match info {
            Some(old) => {
                log::info!(
                    "ublk: recovering /dev/ublkb{id} (left by pid {}, {} queues of {})",
                    old.ublksrv_pid,
                    old.nr_hw_queues,
                    old.queue_depth
                );
                ctrl.simple(CMD_START_USER_RECOVERY, id, 0)?;
                old
            }
            None => {
                let mut info = DevInfo {
                    nr_hw_queues: opts.queues,
                    queue_depth: opts.depth,
                    max_io_buf_bytes: opts.max_io_bytes,
                    dev_id: id,
                    ublksrv_pid: std::process::id() as i32,
                    flags: F_USER_RECOVERY | F_USER_RECOVERY_REISSUE,
                    ..DevInfo::default()
                };
                ctrl.add(&mut info)?;
                let mut params = Params {
                    len: std::mem::size_of::<Params>() as u32,
                    types: PARAM_TYPE_BASIC | PARAM_TYPE_DISCARD,
                    basic: ParamBasic {
                        // No volatile cache: writes are durable when acknowledged (see the
                        // module comment), so the block layer sends no flushes.
                        attrs: if export.is_rotational() {
                            ATTR_ROTATIONAL
                        } else {
                            0
                        },
                        logical_bs_shift: 12,
                        physical_bs_shift: 12,
                        io_opt_shift: 12,
                        io_min_shift: 12,
                        max_sectors: opts.max_io_bytes >> 9,
                        chunk_sectors: 0,
                        dev_sectors: size >> 9,
                        virt_boundary_mask: 0,
                    },
                    discard: ParamDiscard {
                        discard_alignment: 0,
                        discard_granularity: 4096,
                        max_discard_sectors: 1 << 21,
                        max_write_zeroes_sectors: 1 << 21,
                        max_discard_segments: 1,
                        reserved0: 0,
                    },
                };
                if let Err(e) = ctrl.set_params(id, &mut params) {
                    let _ = ctrl.simple(CMD_DEL_DEV, id, 0);
                    return Err(e);
                }
                info
            }
        };
        let mut dev = Device {
            dev_id: id,
            recovered,
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
            ctrl,
            chardev: None,
        };
        if let Err(e) = dev.serve_queues(export, &info) {
            dev.abandon();
            return Err(e);
        }
        let pid = u64::from(std::process::id());
        let started = if recovered {
            dev.ctrl.simple(CMD_END_USER_RECOVERY, id, pid)
        } else {
            dev.ctrl.simple(CMD_START_DEV, id, pid)
        };
        if let Err(e) = started {
            dev.abandon();
            return Err(e);
        }
        Ok(dev)
    }

    /// Opens `/dev/ublkcN` and starts a thread per queue; returns once every queue has
    /// handed the driver a fetch command for each of its tags.
    fn serve_queues(&mut self, export: Arc<dyn Export>, info: &DevInfo) -> io::Result<()> {
        let path = format!("/dev/ublkc{}", self.dev_id);
        let deadline = Instant::now() + Duration::from_secs(10);
        let file = loop {
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(f) => break f,
                // devtmpfs (or udev) may create the node a moment after ADD_DEV.
                Err(e) if Instant::now() < deadline && e.kind() == io::ErrorKind::NotFound => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io::Error::new(e.kind(), format!("{path}: {e}"))),
            }
        };
        let file = Arc::new(file);
        self.chardev = Some(file.clone());
        let (ready_tx, ready_rx) = mpsc::channel();
        // One device, one client: told of a loss below the export once, on any queue.
        let watch = Arc::new(LossWatch::new(export.clone()));
        for q in 0..info.nr_hw_queues {
            let queue = Queue {
                q_id: q,
                depth: info.queue_depth,
                buf_bytes: info.max_io_buf_bytes as usize,
                chardev: file.clone(),
                export: export.clone(),
                watch: watch.clone(),
                stop: self.stop.clone(),
            };
            let tx = ready_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("ublk{}q{q}", self.dev_id))
                .spawn(move || queue.run(tx))?;
            self.threads.push(t);
        }
        drop(ready_tx);
        for _ in 0..info.nr_hw_queues {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(io::Error::other("a ublk queue thread ended at start")),
            }
        }
        Ok(())
    }

    /// Stops the queue threads and closes the character device, leaving the device to the
    /// driver (quiesced, for a later recovery).
    fn abandon(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.chardev = None;
    }

    /// The device number N of `/dev/ublkbN`.
    pub fn id(&self) -> u32 {
        self.dev_id
    }

    /// The block device's path.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/ublkb{}", self.dev_id))
    }

    /// Whether this start took over a device left by a server that died.
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// The clean shutdown, first half: the driver stops the device (the block device goes
    /// away once its requests in flight are done, which the queues still serve; a filesystem
    /// still mounted on it gets errors from then on), then the queues end, dropping the
    /// export. What is left is the device's number, which [`Stopped::delete`] gives back.
    pub fn stop(mut self) -> io::Result<Stopped> {
        let id = self.dev_id;
        let stopped = self.ctrl.simple(CMD_STOP_DEV, id, 0);
        self.abandon();
        stopped?;
        Ok(Stopped {
            dev_id: id,
            ctrl: self.ctrl,
        })
    }
}

/// A device whose queues have ended ([`Device::stop`]), not yet deleted.
pub struct Stopped {
    dev_id: u32,
    ctrl: Control,
}

impl Stopped {
    /// The device number N of `/dev/ublkbN`.
    pub fn id(&self) -> u32 {
        self.dev_id
    }

    /// Deletes the device, giving its number back. The driver answers only once the last
    /// user of the block device let it go: this waits for as long as a filesystem stays
    /// mounted on it.
    pub fn delete(mut self) -> io::Result<()> {
        self.ctrl.simple(CMD_DEL_DEV, self.dev_id, 0)
    }
}

// ---- a queue ----------------------------------------------------------------------------

struct Queue {
    q_id: u16,
    depth: u16,
    buf_bytes: usize,
    chardev: Arc<File>,
    export: Arc<dyn Export>,
    /// What the device was told of losses below the export (`server::LossWatch`).
    watch: Arc<LossWatch>,
    stop: Arc<AtomicBool>,
}

/// A page-aligned buffer the driver copies one request's data into or out of.
struct IoBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl IoBuf {
    fn new(len: usize) -> io::Result<IoBuf> {
        let layout = std::alloc::Layout::from_size_align(len, 4096)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size (checked by Device::start).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::new(io::ErrorKind::OutOfMemory, "ublk buffer"));
        }
        Ok(IoBuf { ptr, layout })
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// The queue's descriptor area, mapped read-only from `/dev/ublkcN`.
struct Descs {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Descs {
    fn map(fd: RawFd, q_id: u16, depth: u16) -> io::Result<Descs> {
        let page = 4096usize;
        let desc = std::mem::size_of::<IoDesc>();
        let stride = (MAX_QUEUE_DEPTH * desc).div_ceil(page) * page;
        let len = (usize::from(depth) * desc).div_ceil(page) * page;
        // SAFETY: a shared read-only mapping of the driver's area for this queue.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                (usize::from(q_id) * stride) as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Descs { ptr, len })
    }
    fn get(&self, tag: u16) -> IoDesc {
        // SAFETY: tag < depth, inside the mapping; the driver wrote it before completing the
        // tag's fetch command.
        unsafe { std::ptr::read_volatile((self.ptr as *const IoDesc).add(usize::from(tag))) }
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

impl Queue {
    fn run(self, ready: mpsc::Sender<io::Result<()>>) {
        let mut ready = Some(ready);
        if let Err(e) = self.serve(&mut ready) {
            match ready.take() {
                Some(tx) => {
                    let _ = tx.send(Err(e));
                }
                None => log::error!("ublk queue {}: {e}", self.q_id),
            }
        }
    }

    fn io_cmd(&self, op: u32, tag: u16, result: i32, buf: &IoBuf) -> squeue::Entry {
        let cmd = IoCmd {
            q_id: self.q_id,
            tag,
            result,
            addr: buf.ptr as u64,
        };
        opcode::UringCmd16::new(
            types::Fd(self.chardev.as_raw_fd()),
            iowr(op, std::mem::size_of::<IoCmd>()),
        )
        .cmd(bytes_of::<IoCmd, 16>(&cmd))
        .build()
        .user_data(u64::from(tag))
    }

    /// Queues the result of `tag`'s request for the driver, with the fetch of its next one.
    fn commit(&self, ring: &mut IoUring, tag: u16, result: i32, buf: &IoBuf) -> io::Result<()> {
        let sqe = self.io_cmd(IO_COMMIT_AND_FETCH_REQ, tag, result, buf);
        // SAFETY: the buffer lives as long as the ring; the ring has room for every tag and
        // the wake-up read.
        unsafe { ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("ublk queue ring full"))
    }

    fn serve(&self, ready: &mut Option<mpsc::Sender<io::Result<()>>>) -> io::Result<()> {
        let depth = self.depth;
        let descs = Descs::map(self.chardev.as_raw_fd(), self.q_id, depth)?;
        let bufs = (0..depth)
            .map(|_| IoBuf::new(self.buf_bytes))
            .collect::<io::Result<Vec<_>>>()?;
        let wake = Arc::new(EventFd::new()?);
        // The tags' commands and the wake-up read.
        let mut ring: IoUring =
            IoUring::builder().build((u32::from(depth) + 1).next_power_of_two())?;
        for tag in 0..depth {
            let sqe = self.io_cmd(IO_FETCH_REQ, tag, 0, &bufs[usize::from(tag)]);
            // SAFETY: the buffer lives as long as the ring (both dropped at the end).
            unsafe { ring.submission().push(&sqe) }
                .map_err(|_| io::Error::other("ublk queue ring full"))?;
        }
        ring.submit()?;
        let pool = Workers::start(
            self.q_id,
            usize::from(depth).min(WORKERS_PER_QUEUE),
            &self.export,
            &self.watch,
            &wake,
            &self.stop,
        )?;
        if let Some(tx) = ready.take() {
            let _ = tx.send(Ok(()));
        }
        let served = self.serve_tags(&mut ring, &descs, &bufs, wake.0, &pool);
        // The workers may be using buffers: they end before the buffers are freed.
        pool.finish();
        served
    }

    /// Hands each request the driver completes to the workers and each result they send back
    /// to the driver, until every tag's command was aborted (the device stops) or `stop`.
    fn serve_tags(
        &self,
        ring: &mut IoUring,
        descs: &Descs,
        bufs: &[IoBuf],
        wake: RawFd,
        pool: &Workers,
    ) -> io::Result<()> {
        let depth = self.depth;
        let mut live = usize::from(depth);
        let mut wake_armed = false;
        // Leaked (8 bytes a queue): a wake-up read still armed when the ring goes may complete
        // late, and must never write into freed memory.
        let wake_buf: &'static mut u64 = Box::leak(Box::new(0u64));
        let ts = types::Timespec::new().nsec(100_000_000);
        let args = types::SubmitArgs::new().timespec(&ts);
        let mut done = Vec::with_capacity(usize::from(depth) + 1);
        let mut arrived = Vec::with_capacity(usize::from(depth));
        // Requests with the workers.
        let mut in_flight = 0usize;
        while live > 0 && !self.stop.load(Ordering::SeqCst) {
            if !wake_armed {
                let sqe =
                    opcode::Read::new(types::Fd(wake), &mut *wake_buf as *mut u64 as *mut u8, 8)
                        .build()
                        .user_data(WAKE);
                // SAFETY: `wake_buf` is never freed; the eventfd is closed only after the ring.
                unsafe { ring.submission().push(&sqe) }
                    .map_err(|_| io::Error::other("ublk queue ring full"))?;
                wake_armed = true;
            }
            match ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
                Err(e) => return Err(e),
            }
            done.clear();
            done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
            for &(data, res) in &done {
                if data == WAKE {
                    wake_armed = false;
                    continue;
                }
                let tag = data as u16;
                if res < 0 {
                    // UBLK_IO_RES_ABORT (-ENODEV): the device is going away.
                    if res != -libc::ENODEV {
                        log::warn!(
                            "ublk queue {} tag {tag}: {}",
                            self.q_id,
                            io::Error::from_raw_os_error(-res)
                        );
                    }
                    live -= 1;
                    continue;
                }
                arrived.push(tag);
            }
            // A lone request with none in flight runs here, saving the hand-over to a worker
            // and back (its latency at queue depth 1); any more go to the workers.
            if arrived.len() == 1 && in_flight == 0 {
                let tag = arrived[0];
                let buf = &bufs[usize::from(tag)];
                // SAFETY: see `Job`: the request is with this thread, the buffer's only user.
                let data = unsafe { std::slice::from_raw_parts_mut(buf.ptr, buf.layout.size()) };
                let result = execute(&*self.export, &self.watch, descs.get(tag), data);
                self.commit(ring, tag, result, buf)?;
            } else {
                for &tag in &arrived {
                    let buf = &bufs[usize::from(tag)];
                    pool.submit(Job {
                        tag,
                        desc: descs.get(tag),
                        buf: buf.ptr,
                        cap: buf.layout.size(),
                    });
                    in_flight += 1;
                }
            }
            arrived.clear();
            while let Ok((tag, result)) = pool.results.try_recv() {
                in_flight -= 1;
                self.commit(ring, tag, result, &bufs[usize::from(tag)])?;
            }
        }
        Ok(())
    }
}

/// Most threads executing one queue's requests at once (the NBD server's default per
/// connection).
const WORKERS_PER_QUEUE: usize = 16;

/// `user_data` of the wake-up read on the queue's eventfd (tags are below 4096).
const WAKE: u64 = u64::MAX;

/// An eventfd the workers write after sending a result, so that the queue thread, waiting
/// in its ring, wakes up for it.
struct EventFd(RawFd);

impl EventFd {
    fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd has no memory-safety preconditions.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(EventFd(fd))
    }
    fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our own descriptor.
        unsafe { libc::write(self.0, &one as *const u64 as *const libc::c_void, 8) };
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: our descriptor, closed once.
        unsafe { libc::close(self.0) };
    }
}

/// One request for a worker: the tag, its descriptor, and the tag's buffer.
struct Job {
    tag: u16,
    desc: IoDesc,
    buf: *mut u8,
    cap: usize,
}

// SAFETY: a tag's buffer is used by one party at a time: the driver while the tag's command
// is with it, then the one worker its job went to until it sent the result back; and the
// buffers outlive the workers (`Workers::finish` before they are freed).
unsafe impl Send for Job {}

/// The threads of one queue that execute its requests on the export, so that up to
/// `WORKERS_PER_QUEUE` of the queue's tags are in flight at once.
struct Workers {
    jobs: Option<mpsc::Sender<Job>>,
    results: mpsc::Receiver<(u16, i32)>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    fn start(
        q_id: u16,
        n: usize,
        export: &Arc<dyn Export>,
        watch: &Arc<LossWatch>,
        wake: &Arc<EventFd>,
        stop: &Arc<AtomicBool>,
    ) -> io::Result<Workers> {
        let (jobs, job_rx) = mpsc::channel::<Job>();
        let job_rx = Arc::new(std::sync::Mutex::new(job_rx));
        let (result_tx, results) = mpsc::channel();
        let mut pool = Workers {
            jobs: Some(jobs),
            results,
            threads: Vec::with_capacity(n),
        };
        for w in 0..n {
            let (job_rx, result_tx) = (job_rx.clone(), result_tx.clone());
            let (export, stop, wake) = (export.clone(), stop.clone(), wake.clone());
            let watch = watch.clone();
            let t = std::thread::Builder::new()
                .name(format!("ublkq{q_id}w{w}"))
                .spawn(move || loop {
                    let job = match job_rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    if stop.load(Ordering::SeqCst) {
                        continue;
                    }
                    // SAFETY: see `Job`: this worker is the buffer's only user until it sends
                    // the result.
                    let buf = unsafe { std::slice::from_raw_parts_mut(job.buf, job.cap) };
                    let result = execute(&*export, &watch, job.desc, buf);
                    if result_tx.send((job.tag, result)).is_err() {
                        return;
                    }
                    wake.signal();
                });
            match t {
                Ok(t) => pool.threads.push(t),
                Err(e) => {
                    pool.finish();
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }

    fn submit(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            // The workers end only when `jobs` is dropped.
            let _ = jobs.send(job);
        }
    }

    /// Ends the workers once the jobs they have are done (jobs not started are dropped when
    /// the queue is stopping) and waits for them.
    fn finish(mut self) {
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Executes one request on the export; the result for the driver: bytes done, or -errno.
fn execute(export: &dyn Export, watch: &LossWatch, d: IoDesc, buf: &mut [u8]) -> i32 {
    let op = d.op_flags & 0xff;
    let flags = d.op_flags;
    let offset = d.start_sector << 9;
    let len = (u64::from(d.nr_sectors) << 9) as usize;
    // The driver never sends more than max_io_buf_bytes, the buffer's size.
    let data = len.min(buf.len());
    let r = match op {
        IO_OP_READ => export.read(offset, &mut buf[..data]),
        // Durable before acknowledged, FUA or not (see the module comment).
        // A durable write is told of a loss below the export, as a flush is.
        IO_OP_WRITE => watch.check(export.write(offset, &buf[..data], true)),
        IO_OP_FLUSH => watch.check(export.flush()),
        IO_OP_DISCARD => export.trim(offset, len as u64),
        IO_OP_WRITE_ZEROES => {
            watch.check(export.write_zeroes(offset, len as u64, true, flags & IO_F_NOUNMAP != 0))
        }
        _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
    };
    match r {
        Ok(()) => len as i32,
        Err(e) => {
            log::debug!("ublk: op {op} at {offset} (+{len}): {e}");
            -e.raw_os_error().unwrap_or(libc::EIO)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_have_the_drivers_layout() {
        assert_eq!(std::mem::size_of::<CtrlCmd>(), 32);
        assert_eq!(std::mem::size_of::<DevInfo>(), 64);
        assert_eq!(std::mem::size_of::<ParamBasic>(), 32);
        assert_eq!(std::mem::size_of::<ParamDiscard>(), 20);
        assert_eq!(std::mem::size_of::<IoDesc>(), 24);
        assert_eq!(std::mem::size_of::<IoCmd>(), 16);
        // UBLK_U_CMD_ADD_DEV and UBLK_U_IO_FETCH_REQ as the kernel header spells them.
        assert_eq!(iowr(CMD_ADD_DEV, 32), 0xc020_7504);
        assert_eq!(iowr(IO_FETCH_REQ, 16), 0xc010_7520);
    }
}
