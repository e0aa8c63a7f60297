//! `MemDevice`: a device held in memory.
//!
//! Owns: one byte vector (the device contents) behind one RwLock (tests and benchmarks, not
//! production data).
//!
//! Invariants: contents are exactly what was last written (flush is a no-op, nothing is ever
//! lost); discard and write-zeroes zero the range; requests are checked with `check_range`.
//!
//! Fault model: none — the only error is `InvalidInput` for a misaligned or out-of-range
//! request. Use `fault::SimDevice` to model crashes and EIO.

use crate::{check_range, BlockDevice, SECTOR_SIZE};
use parking_lot::RwLock;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug)]
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    rotational: AtomicBool,
}

impl MemDevice {
    /// A zero-filled device; `size_bytes` must be a multiple of 512.
    pub fn new(size_bytes: u64) -> MemDevice {
        MemDevice::from_image(vec![0; size_bytes as usize])
    }

    pub fn from_image(image: Vec<u8>) -> MemDevice {
        assert!(
            (image.len() as u64).is_multiple_of(SECTOR_SIZE),
            "memory device size must be a multiple of 512"
        );
        MemDevice {
            data: RwLock::new(image),
            rotational: AtomicBool::new(false),
        }
    }

    /// A copy of the contents.
    pub fn image(&self) -> Vec<u8> {
        self.data.read().clone()
    }

    pub fn set_rotational(&self, on: bool) {
        self.rotational.store(on, Ordering::Relaxed);
    }
}

impl BlockDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.data.read().len() as u64
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let d = self.data.read();
        check_range(d.len() as u64, offset, buf.len() as u64)?;
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut d = self.data.write();
        check_range(d.len() as u64, offset, buf.len() as u64)?;
        d[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut d = self.data.write();
        check_range(d.len() as u64, offset, len)?;
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }

    fn is_rotational(&self) -> bool {
        self.rotational.load(Ordering::Relaxed)
    }

    fn describe(&self) -> String {
        format!("memory {} bytes", self.size_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_zeroes_and_bounds() {
        let d = MemDevice::new(8192);
        d.write_at(&[5; 1024], 512).unwrap();
        let mut b = [0u8; 1024];
        d.read_at(&mut b, 512).unwrap();
        assert_eq!(b, [5; 1024]);
        d.write_zeroes(1024, 512).unwrap();
        d.read_at(&mut b, 512).unwrap();
        assert_eq!(&b[512..], &[0; 512]);
        assert_eq!(
            d.read_at(&mut b, 8192 - 512).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.write_at(&b[..3], 0).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            d.discard(u64::MAX - 511, 512).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn image_round_trips_and_threads_share_the_device() {
        let d = std::sync::Arc::new(MemDevice::from_image(vec![1; 4 * 4096]));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        d.write_at(&[t + 2; 4096], u64::from(t) * 4096).unwrap();
                        let mut b = [0u8; 4096];
                        d.read_at(&mut b, u64::from(t) * 4096).unwrap();
                        assert_eq!(b, [t + 2; 4096]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let img = d.image();
        for (t, chunk) in img.chunks(4096).enumerate() {
            assert!(chunk.iter().all(|&b| usize::from(b) == t + 2));
        }
        d.set_rotational(true);
        assert!(d.is_rotational());
        assert_eq!(d.describe(), "memory 16384 bytes");
    }
}
