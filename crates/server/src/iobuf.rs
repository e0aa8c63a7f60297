//! [`IoBuf`]: a request's data buffer, aligned for O_DIRECT, reused between small requests
//! and mapped on its own for large ones (so freed memory goes back to the system).
//!
//! Invariants: the data part of every buffer handed out starts at an [`IO_ALIGN`]-aligned
//! address; a buffer kept between requests is at most [`REUSE_BYTES_MAX`] (plus alignment);
//! a larger one is an anonymous mapping of exactly the request's pages, unmapped by
//! [`IoBuf::shrink`] or on drop.
//!
//! [`Spares`]: the buffers and reply headers an io_uring reactor keeps between its requests
//! (so that a hit allocates neither), bounded in bytes and count; a buffer is shrunk (a
//! mapping unmapped) before it is kept, so a spare is always a heap buffer of at most
//! [`REUSE_BYTES_MAX`] plus alignment.

use std::io;

/// Alignment of the data part of every buffer (a page: enough for O_DIRECT).
pub(crate) const IO_ALIGN: usize = 4096;
/// A buffer is kept between requests only up to this size.
pub(crate) const REUSE_BYTES_MAX: usize = 256 * 1024;

/// A worker's I/O buffer whose data part starts at an [`IO_ALIGN`]-aligned address: a heap
/// buffer of at most [`REUSE_BYTES_MAX`], kept between requests, for small requests; a private
/// anonymous mapping of exactly the request's pages for larger ones, unmapped by
/// [`IoBuf::shrink`] once the reply is written. Large buffers bypass the allocator so that
/// their memory goes back to the system when they are freed: glibc raises its mmap threshold
/// after such a free and then serves later large allocations from per-thread arenas that it
/// rarely returns, so freed request buffers stayed resident.
#[derive(Default)]
pub(crate) struct IoBuf {
    small: Vec<u8>,
    large: Option<Mapping>,
    /// Whether the last [`IoBuf::slice`] was handed out from `large`.
    in_large: bool,
}

impl IoBuf {
    fn start(&self) -> usize {
        let misalignment = self.small.as_ptr() as usize % IO_ALIGN;
        (IO_ALIGN - misalignment) % IO_ALIGN
    }

    /// `len` aligned bytes to fill; their contents are unspecified.
    pub(crate) fn slice(&mut self, len: usize) -> &mut [u8] {
        self.in_large = false;
        if len == 0 {
            return &mut [];
        }
        if len > REUSE_BYTES_MAX {
            if self.large.as_ref().is_some_and(|m| m.len >= len) {
                self.in_large = true;
            } else {
                self.large = None;
                self.large = Mapping::new(len);
                self.in_large = self.large.is_some();
            }
            // Out of mappings: fall back to the heap (freed again by `shrink`).
        }
        if !self.in_large && self.small.len() < len + IO_ALIGN {
            // Replace rather than grow: the old contents need not be kept.
            self.small = vec![0; len + IO_ALIGN];
        }
        let start = self.start();
        match &mut self.large {
            Some(mapping) if self.in_large => &mut mapping.as_mut_slice()[..len],
            _ => &mut self.small[start..start + len],
        }
    }

    /// The first `len` bytes last handed out by [`IoBuf::slice`].
    pub(crate) fn data(&self, len: usize) -> &[u8] {
        if len == 0 {
            return &[];
        }
        if self.in_large {
            if let Some(mapping) = &self.large {
                return &mapping.as_slice()[..len];
            }
        }
        let start = self.start();
        &self.small[start..start + len]
    }

    /// The first `len` bytes last handed out by [`IoBuf::slice`], to fill again (no
    /// reallocation: the data stays where it is).
    pub(crate) fn data_mut(&mut self, len: usize) -> &mut [u8] {
        if len == 0 {
            return &mut [];
        }
        let start = self.start();
        match &mut self.large {
            Some(mapping) if self.in_large => &mut mapping.as_mut_slice()[..len],
            _ => &mut self.small[start..start + len],
        }
    }

    /// Bytes the buffer holds on the heap (its mappings not counted).
    fn heap_bytes(&self) -> usize {
        self.small.len()
    }

    /// Frees a buffer too large to keep between requests (a mapping is unmapped at once).
    pub(crate) fn shrink(&mut self) {
        self.large = None;
        self.in_large = false;
        if self.small.len() > REUSE_BYTES_MAX + IO_ALIGN {
            self.small = Vec::new();
        }
    }
}

/// Most bytes of spare buffers one reactor keeps.
const SPARE_BYTES_MAX: usize = 4 << 20;
/// Most spare reply headers one reactor keeps, and the largest kept.
const SPARE_HEADS_MAX: usize = 1024;
const SPARE_HEAD_BYTES_MAX: usize = 256;

/// Buffers and reply headers freed by one thread's requests, handed out again to its next
/// ones (see the module header). Their contents are unspecified.
#[derive(Default)]
pub(crate) struct Spares {
    bufs: Vec<IoBuf>,
    bytes: usize,
    heads: Vec<Vec<u8>>,
}

impl Spares {
    /// A buffer (the most recently freed: its memory is likely in the CPU's cache).
    pub(crate) fn buf(&mut self) -> IoBuf {
        match self.bufs.pop() {
            Some(b) => {
                self.bytes -= b.heap_bytes();
                b
            }
            None => IoBuf::default(),
        }
    }

    /// Keeps `buf` for a later request if there is room (it is shrunk first).
    pub(crate) fn keep_buf(&mut self, mut buf: IoBuf) {
        buf.shrink();
        let bytes = buf.heap_bytes();
        if bytes > 0 && self.bytes + bytes <= SPARE_BYTES_MAX {
            self.bytes += bytes;
            self.bufs.push(buf);
        }
    }

    /// An empty reply header.
    pub(crate) fn head(&mut self) -> Vec<u8> {
        self.heads.pop().unwrap_or_default()
    }

    /// Keeps `head` for a later reply if there is room and it is small.
    pub(crate) fn keep_head(&mut self, mut head: Vec<u8>) {
        if self.heads.len() < SPARE_HEADS_MAX
            && (1..=SPARE_HEAD_BYTES_MAX).contains(&head.capacity())
        {
            head.clear();
            self.heads.push(head);
        }
    }
}

/// A private anonymous memory mapping, page-aligned; unmapped on drop. Its pages count in the
/// process's memory only once written.
struct Mapping {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: a `Mapping` owns its pages exclusively (nobody else has the address), like a
// `Box<[u8]>`; moving it to another thread moves that ownership.
unsafe impl Send for Mapping {}

impl Mapping {
    /// `len` zeroed bytes (rounded up to whole pages), or `None` if the system refuses.
    fn new(len: usize) -> Option<Mapping> {
        let len = len.div_ceil(IO_ALIGN) * IO_ALIGN;
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches
        // no existing memory; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            log::debug!(
                "could not map a {len}-byte buffer: {}",
                io::Error::last_os_error()
            );
            return None;
        }
        std::ptr::NonNull::new(ptr.cast::<u8>()).map(|ptr| Mapping { ptr, len })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live mapping of `len` readable bytes owned by `self`; the borrow
        // of `self` keeps it mapped and unaliased by `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the exclusive borrow of `self` makes this the only
        // reference into the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are exactly what `mmap` returned and no slice of the mapping
        // outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_are_handed_out_again_bounded_and_never_mapped() {
        let mut spares = Spares::default();
        let mut buf = spares.buf();
        let first = buf.slice(4096).as_ptr();
        spares.keep_buf(buf);
        let mut buf = spares.buf();
        assert_eq!(
            buf.slice(4096).as_ptr(),
            first,
            "the freed buffer is reused"
        );
        // A large request's mapping goes at once; its heap part is kept.
        assert_eq!(buf.slice(2 * REUSE_BYTES_MAX).len(), 2 * REUSE_BYTES_MAX);
        assert!(buf.large.is_some());
        spares.keep_buf(buf);
        assert!(spares.bufs.iter().all(|b| b.large.is_none()));
        assert_eq!(spares.bufs.len(), 1);
        for _ in 0..2 * SPARE_BYTES_MAX / (64 << 10) {
            let mut buf = IoBuf::default();
            buf.slice(64 << 10);
            spares.keep_buf(buf);
        }
        let kept: usize = spares.bufs.iter().map(IoBuf::heap_bytes).sum();
        assert_eq!(kept, spares.bytes);
        assert!(spares.bytes <= SPARE_BYTES_MAX && spares.bytes > SPARE_BYTES_MAX / 2);
        while !spares.bufs.is_empty() {
            spares.buf();
        }
        assert_eq!(spares.bytes, 0);
        // Reply headers: small ones only, up to a count, handed out empty.
        for _ in 0..2 * SPARE_HEADS_MAX {
            let mut head = spares.head();
            head.extend_from_slice(&[1; 16]);
            spares.keep_head(head);
            spares.keep_head(vec![2; 16]);
        }
        spares.keep_head(Vec::with_capacity(4 * SPARE_HEAD_BYTES_MAX));
        assert_eq!(spares.heads.len(), SPARE_HEADS_MAX);
        assert!(spares.heads.iter().all(|h| h.is_empty()));
        assert!(spares.head().capacity() <= SPARE_HEAD_BYTES_MAX);
    }
}
