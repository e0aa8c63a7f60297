//! `FileDevice`: a regular file or a block device, with O_DIRECT where the filesystem allows.
//!
//! Owns: one open file (two descriptors on it: O_DIRECT when the filesystem allows it, and a
//! buffered one for requests the direct one cannot take), its size and its alignment rules.
//!
//! Invariants: requests are checked with `check_range` first; with O_DIRECT, every request
//! reaching the kernel has its offset and length aligned to the direct-I/O offset alignment and
//! its buffer to the memory alignment (from `statx(STATX_DIOALIGN)`, else probed) — unaligned
//! buffers go through an aligned bounce buffer, unaligned offsets/lengths through the buffered
//! descriptor; `flush` is `fdatasync` either way (it also flushes the drive's write cache).
//! Short reads and writes are retried; EINTR is retried; bytes past the end of a regular file
//! that shrank after opening read as zeroes.
//!
//! Ownership: an open takes the lock of its [`LockMode`] (default exclusive: `flock` on the
//! descriptor, plus `O_EXCL` for block devices — see [`crate::owner`]) before anything is
//! read or written, and holds it until the device is dropped; a conflicting open fails with a
//! [`DeviceBusy`](crate::DeviceBusy) naming the holder. `create` truncates only after it holds
//! the lock, so it never clobbers a file another owner has open.
//!
//! Fault model: every error from the kernel is returned as-is; a failed write leaves any
//! subset of its sectors written. `discard` on a regular file punches a hole (zeroes); where
//! that is unsupported it writes zeroes; on a block device it is a hint (unsupported ⇒ `Ok`).

use crate::owner::{self, DeviceId, LockMode};
use crate::{check_range, BlockDevice, SECTOR_SIZE};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// How to open a [`FileDevice`].
#[derive(Clone, Debug)]
pub struct FileDeviceOptions {
    /// Try O_DIRECT (falls back to buffered I/O where the filesystem refuses it).
    pub direct: bool,
    pub read_only: bool,
    /// When the path does not exist, create a sparse regular file of this size (rounded down
    /// to a multiple of 512) instead of failing.
    pub create_size_bytes: Option<u64>,
    /// How the open claims the device (default: exclusively).
    pub lock: LockMode,
}

impl Default for FileDeviceOptions {
    fn default() -> Self {
        FileDeviceOptions {
            direct: true,
            read_only: false,
            create_size_bytes: None,
            lock: LockMode::Exclusive,
        }
    }
}

#[derive(Debug)]
pub struct FileDevice {
    path: PathBuf,
    /// O_DIRECT descriptor when direct I/O works, else the buffered one.
    direct: Option<File>,
    buffered: File,
    /// Direct I/O: offsets and lengths must be multiples of this.
    dio_offset_align: usize,
    /// Direct I/O: buffers must start at a multiple of this.
    dio_mem_align: usize,
    /// Bytes, a multiple of the sector size; grows when `refresh_size` finds the file or
    /// device larger.
    size: AtomicU64,
    rotational: bool,
    block_device: bool,
    identity: DeviceId,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;
const BOUNCE_ALIGN: usize = 4096;
const PUNCH_HOLE: libc::c_int = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

/// A heap buffer aligned for O_DIRECT.
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout =
            Layout::from_size_align(len.max(BOUNCE_ALIGN), BOUNCE_ALIGN).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(
            !ptr.is_null(),
            "out of memory allocating a {len}-byte I/O buffer"
        );
        Aligned { ptr, layout }
    }
    fn slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.layout.size());
        // SAFETY: ptr is valid for layout.size() bytes, zero-initialised, and exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: ptr came from alloc_zeroed with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

fn rotational_of(meta: &std::fs::Metadata) -> bool {
    let rdev = meta.rdev();
    let (maj, min) = (libc::major(rdev), libc::minor(rdev));
    let base = format!("/sys/dev/block/{maj}:{min}");
    for p in [
        format!("{base}/queue/rotational"),
        format!("{base}/../queue/rotational"),
    ] {
        if let Ok(s) = std::fs::read_to_string(p) {
            return s.trim() == "1";
        }
    }
    false
}

impl FileDevice {
    /// Opens a regular file or block device (creating the file when `create_size_bytes` is set
    /// and the path does not exist), locked as `opts.lock` says.
    pub fn open(path: &Path, opts: FileDeviceOptions) -> io::Result<FileDevice> {
        FileDevice::open_and_resize(path, opts, None)
    }

    /// Creates (or truncates) a sparse regular file of `size_bytes` and opens it exclusively;
    /// an existing file is truncated only once the lock is held.
    pub fn create(path: &Path, size_bytes: u64) -> io::Result<FileDevice> {
        let opts = FileDeviceOptions {
            create_size_bytes: Some(size_bytes),
            ..FileDeviceOptions::default()
        };
        FileDevice::open_and_resize(path, opts, Some(size_bytes))
    }

    /// `open`; then, with `truncate_to`, empties the file and sets its size (under the lock).
    fn open_and_resize(
        path: &Path,
        opts: FileDeviceOptions,
        truncate_to: Option<u64>,
    ) -> io::Result<FileDevice> {
        if let Some(size_bytes) = opts.create_size_bytes {
            if !opts.read_only {
                match OpenOptions::new().write(true).create_new(true).open(path) {
                    Ok(f) => f.set_len(size_bytes / SECTOR_SIZE * SECTOR_SIZE)?,
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(e),
                }
            }
        }
        // The kernel's exclusive claim of a block device is taken at open time, so whether the
        // path is one must be known before opening it.
        let claim = owner::claims_block_device(opts.lock)
            && std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
        let mut o = OpenOptions::new();
        o.read(true).write(!opts.read_only);
        if claim {
            o.custom_flags(libc::O_EXCL);
        }
        let buffered = match o.open(path) {
            Err(e) if claim && e.raw_os_error() == Some(libc::EBUSY) => {
                return Err(owner::claim_refused(path))
            }
            r => r?,
        };
        let mut meta = buffered.metadata()?;
        let block_device = meta.file_type().is_block_device();
        if !block_device && !meta.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is neither a regular file nor a block device",
                    path.display()
                ),
            ));
        }
        owner::lock(&buffered, &meta, path, opts.lock)?;
        if let Some(size_bytes) = truncate_to {
            buffered.set_len(0)?;
            buffered.set_len(size_bytes / SECTOR_SIZE * SECTOR_SIZE)?;
            meta = buffered.metadata()?;
        }
        let size = current_size(&buffered, block_device, &meta)?;
        let mut dev = FileDevice {
            path: path.to_path_buf(),
            direct: None,
            buffered,
            dio_offset_align: 512,
            dio_mem_align: 512,
            size: AtomicU64::new(size),
            rotational: block_device && rotational_of(&meta),
            block_device,
            identity: DeviceId::of_metadata(&meta),
        };
        if opts.direct {
            dev.try_direct(opts.read_only);
        }
        Ok(dev)
    }

    /// Opens the O_DIRECT descriptor and learns its alignment; leaves the device buffered when
    /// the filesystem refuses direct I/O (e.g. tmpfs: EINVAL), no alignment works, or the path
    /// no longer names the device the (locked) buffered descriptor has open.
    fn try_direct(&mut self, read_only: bool) {
        let Ok(f) = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
        else {
            return;
        };
        if !f
            .metadata()
            .is_ok_and(|m| DeviceId::of_metadata(&m) == self.identity)
        {
            return;
        }
        match dio_align(&f) {
            // The kernel says direct I/O is unsupported for this file, or wants buffers aligned
            // beyond what our bounce buffers give.
            Some(None) => {}
            Some(Some((_, mem_align))) if mem_align > BOUNCE_ALIGN => {}
            Some(Some((offset_align, mem_align))) => {
                self.dio_offset_align = offset_align.max(SECTOR_SIZE as usize);
                self.dio_mem_align = mem_align.max(1);
                self.direct = Some(f);
            }
            None if self.size.load(Ordering::Relaxed) == 0 => self.direct = Some(f), // nothing can be read or written
            None => {
                // Probe: an aligned read at offset 0; 512 first, 4096 when that is EINVAL.
                for align in [512usize, BOUNCE_ALIGN] {
                    let mut buf = Aligned::new(align);
                    if f.read_at(buf.slice(align), 0).is_ok() {
                        self.dio_offset_align = align;
                        self.dio_mem_align = align;
                        self.direct = Some(f);
                        return;
                    }
                }
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Which device this is, whatever path opened it (see [`DeviceId`]).
    pub fn identity(&self) -> DeviceId {
        self.identity
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor for a request: direct only if offset and length are aligned for it.
    fn fd_for(&self, offset: u64, len: usize) -> (&File, bool) {
        match &self.direct {
            Some(d)
                if offset.is_multiple_of(self.dio_offset_align as u64)
                    && len.is_multiple_of(self.dio_offset_align) =>
            {
                (d, true)
            }
            _ => (&self.buffered, false),
        }
    }

    fn zero_fill(&self, offset: u64, len: u64) -> io::Result<()> {
        let chunk = (1u64 << 20).min(len) as usize;
        let mut buf = Aligned::new(chunk);
        let zeroes = buf.slice(chunk);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(chunk as u64) as usize;
            self.write_at(&zeroes[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: plain syscall on a descriptor we own.
        let r =
            unsafe { libc::fallocate(self.buffered.as_raw_fd(), mode, offset as i64, len as i64) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn range_ioctl(&self, req: libc::c_ulong, offset: u64, len: u64) -> io::Result<()> {
        let range = [offset, len];
        // SAFETY: BLKDISCARD/BLKZEROOUT read two u64s through the pointer.
        let r = unsafe { libc::ioctl(self.buffered.as_raw_fd(), req, range.as_ptr()) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// The direct-I/O alignment the kernel reports: `None` when `statx` cannot tell (old kernel
/// or filesystem), `Some(None)` when direct I/O is unsupported for this file, else
/// `Some(Some((offset_align, mem_align)))`.
fn dio_align(f: &File) -> Option<Option<(usize, usize)>> {
    // SAFETY: `statx` is plain old data; all-zero bytes are a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty C string with AT_EMPTY_PATH names the descriptor itself; the kernel
    // writes at most one `statx` through the pointer, which is valid and exclusively ours.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    if stx.stx_dio_offset_align == 0 {
        return Some(None);
    }
    Some(Some((
        stx.stx_dio_offset_align as usize,
        stx.stx_dio_mem_align as usize,
    )))
}

/// Reads all of `buf`, retrying short reads and EINTR; bytes past the end of a short file read
/// as zeroes.
fn read_full(fd: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match fd.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EINVAL)
    )
}

/// The usable size of an open file or block device, rounded down to whole sectors.
fn current_size(f: &File, block_device: bool, meta: &std::fs::Metadata) -> io::Result<u64> {
    let bytes = if block_device {
        let mut bytes: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer we pass.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        bytes
    } else {
        meta.len()
    };
    Ok(bytes / SECTOR_SIZE * SECTOR_SIZE)
}

impl BlockDevice for FileDevice {
    fn size_bytes(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    fn refresh_size(&self) -> io::Result<u64> {
        let meta = self.buffered.metadata()?;
        let size = current_size(&self.buffered, self.block_device, &meta)?;
        // Only growth is taken: a device that shrank under us keeps its old bounds, and
        // requests past the real end fail at the device.
        Ok(self.size.fetch_max(size, Ordering::Relaxed).max(size))
    }

    fn direct_fd(&self, offset: u64, len: usize) -> Option<std::os::fd::RawFd> {
        check_range(self.size.load(Ordering::Relaxed), offset, len as u64).ok()?;
        // Every fd_for alignment is at most 4 KiB, which callers' buffers meet.
        (self.dio_mem_align <= 4096).then(|| self.fd_for(offset, len).0.as_raw_fd())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        check_range(self.size.load(Ordering::Relaxed), offset, buf.len() as u64)?;
        let (fd, direct) = self.fd_for(offset, buf.len());
        if direct && !(buf.as_ptr() as usize).is_multiple_of(self.dio_mem_align) {
            let mut bounce = Aligned::new(buf.len());
            read_full(fd, bounce.slice(buf.len()), offset)?;
            buf.copy_from_slice(bounce.slice(buf.len()));
            Ok(())
        } else {
            read_full(fd, buf, offset)
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        check_range(self.size.load(Ordering::Relaxed), offset, buf.len() as u64)?;
        let (fd, direct) = self.fd_for(offset, buf.len());
        let mut bounce;
        let src: &[u8] = if direct && !(buf.as_ptr() as usize).is_multiple_of(self.dio_mem_align) {
            bounce = Aligned::new(buf.len());
            let s = bounce.slice(buf.len());
            s.copy_from_slice(buf);
            s
        } else {
            buf
        };
        let mut done = 0;
        while done < src.len() {
            match fd.write_at(&src[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "device accepted no bytes",
                    ))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.buffered.sync_data()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size.load(Ordering::Relaxed), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        if self.block_device {
            match self.range_ioctl(BLKDISCARD, offset, len) {
                Err(e) if unsupported(&e) => Ok(()), // discard is a hint
                r => r,
            }
        } else {
            match self.fallocate(PUNCH_HOLE, offset, len) {
                // Keep "discarded ranges of files read back zeroes" true everywhere.
                Err(e) if unsupported(&e) => self.zero_fill(offset, len),
                r => r,
            }
        }
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size.load(Ordering::Relaxed), offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let r = if self.block_device {
            self.range_ioctl(BLKZEROOUT, offset, len)
        } else {
            match self.fallocate(
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
                offset,
                len,
            ) {
                Err(e) if unsupported(&e) => self.fallocate(PUNCH_HOLE, offset, len),
                r => r,
            }
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if unsupported(&e) => self.zero_fill(offset, len),
            Err(e) => Err(e),
        }
    }

    fn is_rotational(&self) -> bool {
        self.rotational
    }

    fn describe(&self) -> String {
        match &self.direct {
            Some(_) => format!(
                "file {} (O_DIRECT, align {})",
                self.path.display(),
                self.dio_offset_align
            ),
            None => format!("file {} (buffered)", self.path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::owner::{Busy, Holder};
    use crate::DeviceBusy;

    fn round_trip(dir: &Path) {
        let p = dir.join(format!("tc-file-test-{}", std::process::id()));
        let d = FileDevice::create(&p, 1 << 20).unwrap();
        eprintln!("{}", d.describe());
        assert_eq!(d.describe().contains("O_DIRECT"), d.is_direct());
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        d.write_at(&data, 4096).unwrap();
        // Unaligned buffer and 512-byte granularity both work.
        let mut odd = vec![0u8; 513];
        d.read_at(&mut odd[1..], 4096).unwrap();
        assert_eq!(&odd[1..], &data[..512]);
        d.write_at(&data[..512], 512).unwrap();
        d.flush().unwrap();
        let mut back = vec![0u8; 8192];
        d.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, data);
        d.write_zeroes(4096, 4096).unwrap();
        d.read_at(&mut back[..4096], 4096).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0));
        d.discard(8192, 4096).unwrap();
        assert_eq!(
            d.read_at(&mut back, 1 << 20).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.write_at(&data[..100], 0).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.read_at(&mut back[..512], 100).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        drop(d);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn file_on_disk_round_trips() {
        round_trip(&std::env::temp_dir());
    }

    #[test]
    fn file_on_tmpfs_round_trips() {
        // tmpfs refuses O_DIRECT on older kernels (buffered fallback) and accepts it on newer
        // ones; either way the device must work.
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            round_trip(shm);
        }
    }

    #[test]
    fn buffered_mode_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        let opts = FileDeviceOptions {
            direct: false,
            create_size_bytes: Some(65536 + 100),
            ..FileDeviceOptions::default()
        };
        let d = FileDevice::open(&p, opts).unwrap();
        assert!(!d.is_direct());
        assert!(d.describe().contains("(buffered)"), "{}", d.describe());
        assert_eq!(d.size_bytes(), 65536, "size rounds down to whole sectors");
        d.write_at(&[3; 1536], 512).unwrap();
        d.flush().unwrap();
        let mut b = vec![0u8; 2048];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(&b[..512], &[0; 512]);
        assert_eq!(&b[512..], &[3; 1536]);
    }

    #[test]
    fn discard_punches_zeroes_and_write_zeroes_zeroes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        let d = FileDevice::create(&p, 1 << 20).unwrap();
        let data = vec![0xabu8; 1 << 20];
        d.write_at(&data, 0).unwrap();
        d.flush().unwrap();
        d.discard(65536, 65536).unwrap();
        d.discard(512, 512).unwrap(); // smaller than a filesystem block: partial zeroing
        d.write_zeroes(4096 * 40, 4096 + 512).unwrap();
        let mut back = vec![0u8; 1 << 20];
        d.read_at(&mut back, 0).unwrap();
        for (i, sector) in back.chunks(512).enumerate() {
            let off = i * 512;
            let zero = (65536..131072).contains(&off)
                || off == 512
                || (4096 * 40..4096 * 41 + 512).contains(&off);
            let want = if zero { 0 } else { 0xab };
            assert!(sector.iter().all(|&b| b == want), "sector at {off}");
        }
        assert_eq!(
            d.discard(0, 100).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.write_zeroes(1 << 20, 512).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn reads_past_end_of_a_shrunken_file_are_zeroes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        let d = FileDevice::create(&p, 65536).unwrap();
        d.write_at(&[9; 65536], 0).unwrap();
        d.flush().unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let mut b = vec![1u8; 8192];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(&b[..4096], &[9; 4096]);
        assert_eq!(&b[4096..], &[0; 4096]);
    }

    #[test]
    fn read_only_refuses_writes_and_create_keeps_existing_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        FileDevice::create(&p, 8192)
            .unwrap()
            .write_at(&[4; 512], 0)
            .unwrap();
        let opts = FileDeviceOptions {
            read_only: true,
            create_size_bytes: Some(1 << 20),
            ..FileDeviceOptions::default()
        };
        let d = open_within(&p, opts);
        assert_eq!(d.size_bytes(), 8192, "an existing file is not resized");
        assert!(d.write_at(&[0; 512], 0).is_err());
        let mut b = [0u8; 512];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [4; 512]);
    }

    fn busy_holder(e: &io::Error) -> Holder {
        match &DeviceBusy::of(e)
            .unwrap_or_else(|| panic!("not a DeviceBusy: {e}"))
            .busy
        {
            Busy::Locked(h) => h.clone(),
            Busy::Claimed => panic!("a file cannot be claimed: {e}"),
        }
    }

    fn with_lock(lock: LockMode, read_only: bool) -> FileDeviceOptions {
        FileDeviceOptions {
            lock,
            read_only,
            ..FileDeviceOptions::default()
        }
    }

    #[test]
    fn a_second_open_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        let first = FileDevice::create(&p, 65536).unwrap();
        first.write_at(&[7; 512], 0).unwrap();
        first.flush().unwrap();
        std::os::unix::fs::symlink(&p, dir.path().join("sym")).unwrap();
        std::fs::hard_link(&p, dir.path().join("hard")).unwrap();
        for name in ["dev", "sym", "hard"] {
            let q = dir.path().join(name);
            for opts in [
                FileDeviceOptions::default(),
                with_lock(LockMode::Exclusive, true),
                with_lock(LockMode::Shared, true),
            ] {
                let e = FileDevice::open(&q, opts.clone()).unwrap_err();
                assert_eq!(busy_holder(&e), Holder::ThisProcess, "{name} {opts:?}");
                assert_eq!(
                    e.to_string(),
                    format!("{} is already open in this process", q.display())
                );
            }
        }
        // `create` refuses as well, and truncates nothing.
        assert_eq!(
            busy_holder(&FileDevice::create(&p, 4096).unwrap_err()),
            Holder::ThisProcess
        );
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 65536);
        // An unlocked reader may look alongside.
        let peek = FileDevice::open(&p, with_lock(LockMode::None, true)).unwrap();
        let mut b = [0u8; 512];
        peek.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [7; 512]);
        // Dropping the owner releases the lock (the unlocked reader holds none). A child that
        // another test thread forks holds a copy of every descriptor until it execs (they are
        // close-on-exec), and with it our lock, for a moment: retry briefly.
        drop(first);
        let second = open_within(&p, FileDeviceOptions::default());
        second.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [7; 512]);
    }

    /// Opens `p`, retrying for up to a second while a lock is held in this process (see the
    /// caller: a forked child's copy of a descriptor we closed).
    fn open_within(p: &Path, opts: FileDeviceOptions) -> FileDevice {
        let t = std::time::Instant::now();
        loop {
            match FileDevice::open(p, opts.clone()) {
                Ok(d) => return d,
                Err(e) if t.elapsed() < std::time::Duration::from_secs(1) => {
                    // Ours, or already gone by the time /proc/locks was read (the child exec'd).
                    assert!(
                        matches!(busy_holder(&e), Holder::ThisProcess | Holder::Unknown),
                        "{e}"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => panic!(
                    "{}: still locked a second after its owner was dropped: {e}",
                    p.display()
                ),
            }
        }
    }

    #[test]
    fn shared_opens_coexist_and_exclude_exclusive_ones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        drop(FileDevice::create(&p, 8192).unwrap());
        let a = open_within(&p, with_lock(LockMode::Shared, true));
        let b = FileDevice::open(&p, with_lock(LockMode::Shared, true)).unwrap();
        let e = FileDevice::open(&p, FileDeviceOptions::default()).unwrap_err();
        assert_eq!(busy_holder(&e), Holder::ThisProcess);
        drop((a, b));
        let owner = open_within(&p, FileDeviceOptions::default());
        let e = FileDevice::open(&p, with_lock(LockMode::Shared, true)).unwrap_err();
        assert_eq!(busy_holder(&e), Holder::ThisProcess);
        drop(owner);
    }

    #[test]
    fn a_holder_in_another_process_is_named_and_released_when_it_dies() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        drop(FileDevice::create(&p, 8192).unwrap());
        let cpath = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("30");
        // SAFETY: between fork and exec the child only makes the async-signal-safe calls
        // open(2) and flock(2), on a string prepared before the fork; the descriptor (no
        // O_CLOEXEC) and its lock survive the exec, so `sleep` holds the lock.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(cpath.as_ptr(), libc::O_RDONLY);
                if fd < 0 || libc::flock(fd, libc::LOCK_EX) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        struct Reaped(std::process::Child);
        impl Drop for Reaped {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut child = Reaped(cmd.spawn().unwrap());
        let pid = child.0.id();
        // Wait until the child holds the lock and has become `sleep`.
        let start = std::time::Instant::now();
        let e = loop {
            match FileDevice::open(&p, FileDeviceOptions::default()) {
                Ok(d) => drop(d), // not locked yet
                Err(e) => match busy_holder(&e) {
                    Holder::Process { command, .. } if command != "sleep 30" => {}
                    _ => break e,
                },
            }
            assert!(start.elapsed().as_secs() < 10, "the child never locked");
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        assert_eq!(
            busy_holder(&e),
            Holder::Process {
                pid,
                command: "sleep 30".into()
            }
        );
        assert_eq!(
            e.to_string(),
            format!(
                "{} is in use by another process (pid {pid}, sleep 30); stop it first",
                p.display()
            )
        );
        // kill -9: the kernel releases the lock with the process's descriptors.
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        open_within(&p, FileDeviceOptions::default());
    }

    #[test]
    fn identity_is_the_file_not_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev");
        let d = FileDevice::create(&p, 8192).unwrap();
        std::os::unix::fs::symlink("dev", dir.path().join("sym")).unwrap();
        std::fs::hard_link(&p, dir.path().join("hard")).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for name in ["dev", "./dev", "sub/../dev", "sym", "hard"] {
            let q = dir.path().join(name);
            assert_eq!(DeviceId::of_path(&q).unwrap(), d.identity(), "{name}");
        }
        let other = FileDevice::create(&dir.path().join("other"), 8192).unwrap();
        assert_ne!(other.identity(), d.identity());
        assert!(matches!(d.identity(), DeviceId::File { .. }));
        assert!(DeviceId::of_path(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn missing_file_and_directories_are_errors() {
        assert!(
            FileDevice::open(Path::new("/nonexistent/x"), FileDeviceOptions::default()).is_err()
        );
        assert!(FileDevice::open(Path::new("/tmp"), FileDeviceOptions::default()).is_err());
    }
}
