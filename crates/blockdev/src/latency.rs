//! Latency models that make a fast device behave like a slow one, for the demo, benchmarks and
//! tests: [`LatencyDevice`] wraps any device and delays each request by its model's service
//! time.
//!
//! The HDD model (the emulated disk of the benchmark method in `docs/benchmarks.md`): one
//! actuator, so requests are serviced one at a time in arrival order; service time = seek +
//! rotation + transfer. Seek is 0 when a request starts where the previous one ended, otherwise
//! track-to-track plus (full stroke − track-to-track) × sqrt(distance / device size).
//! Rotation is uniform in [0, one revolution] from a seeded RNG (0 for a continuing request).
//! Transfer is length / rate. Flush costs one revolution (the drive writes its cache out).
//! The SSD model: a fixed per-request latency plus transfer, requests in parallel.
//!
//! Invariants: the model never changes data, only timing; every parameter is public and has
//! the documented default; same seed, same delays for the same request sequence.

use crate::BlockDevice;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::io;
use std::time::{Duration, Instant};

/// Parameters of the rotating-disk model.
#[derive(Clone, Debug, PartialEq)]
pub struct HddModel {
    pub track_to_track_ms: f64,
    pub full_stroke_ms: f64,
    pub rpm: f64,
    pub transfer_mb_per_s: f64,
    pub seed: u64,
}

impl Default for HddModel {
    fn default() -> Self {
        HddModel {
            track_to_track_ms: 0.5,
            full_stroke_ms: 15.0,
            rpm: 7200.0,
            transfer_mb_per_s: 180.0,
            seed: 1,
        }
    }
}

/// Parameters of the flash model.
#[derive(Clone, Debug, PartialEq)]
pub struct SsdModel {
    pub latency_us: f64,
    pub transfer_mb_per_s: f64,
}

impl Default for SsdModel {
    fn default() -> Self {
        SsdModel {
            latency_us: 80.0,
            transfer_mb_per_s: 1500.0,
        }
    }
}

#[derive(Clone, Debug)]
pub enum Model {
    Hdd(HddModel),
    Ssd(SsdModel),
}

#[derive(Debug)]
struct Head {
    /// Where the last request ended (bytes).
    position: u64,
    rng: ChaCha8Rng,
    /// When the actuator becomes free.
    busy_until: Instant,
}

/// A device that takes as long as its model says.
#[derive(Debug)]
pub struct LatencyDevice<D: BlockDevice> {
    inner: D,
    model: Model,
    head: Mutex<Head>,
    /// What the device reports as its ROTATIONAL flag (default: true for the HDD model).
    rotational: bool,
}

impl<D: BlockDevice> LatencyDevice<D> {
    pub fn new(inner: D, model: Model) -> Self {
        let seed = match &model {
            Model::Hdd(h) => h.seed,
            Model::Ssd(_) => 0,
        };
        LatencyDevice {
            inner,
            rotational: matches!(model, Model::Hdd(_)),
            model,
            head: Mutex::new(Head {
                position: 0,
                rng: ChaCha8Rng::seed_from_u64(seed),
                busy_until: Instant::now(),
            }),
        }
    }

    /// Reports `rotational` as the device's ROTATIONAL flag whatever the model (a seek-bound
    /// disk that does not say so: network and virtual disks, RAID controllers).
    pub fn with_rotational(mut self, rotational: bool) -> Self {
        self.rotational = rotational;
        self
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Service time of a request at `offset` of `len` bytes, advancing the head.
    fn service(&self, head: &mut Head, offset: u64, len: u64, flush: bool) -> Duration {
        match &self.model {
            Model::Ssd(s) => Duration::from_secs_f64(
                s.latency_us / 1e6 + len as f64 / (s.transfer_mb_per_s * 1e6),
            ),
            Model::Hdd(h) => {
                let rev_ms = 60_000.0 / h.rpm;
                if flush {
                    return Duration::from_secs_f64(rev_ms / 1e3);
                }
                let size = self.inner.size_bytes().max(1) as f64;
                let (seek_ms, rot_ms) = if offset == head.position {
                    (0.0, 0.0)
                } else {
                    let dist = offset.abs_diff(head.position) as f64;
                    (
                        h.track_to_track_ms
                            + (h.full_stroke_ms - h.track_to_track_ms) * (dist / size).sqrt(),
                        head.rng.gen_range(0.0..rev_ms),
                    )
                };
                head.position = offset + len;
                let xfer_ms = len as f64 / (h.transfer_mb_per_s * 1e6) * 1e3;
                Duration::from_secs_f64((seek_ms + rot_ms + xfer_ms) / 1e3)
            }
        }
    }

    /// Runs the real I/O, then waits until the modelled service time has passed since it
    /// began (the real time counts toward the model's, so a fast real device adds nothing on
    /// top): HDD requests queue behind the one actuator. A remaining wait under
    /// `SLEEP_MIN` is skipped: the timer's slack would turn it into tens of microseconds.
    fn timed<T>(
        &self,
        offset: u64,
        len: u64,
        flush: bool,
        io: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let began = Instant::now();
        let r = io()?;
        let done_at = {
            let mut head = self.head.lock();
            let t = self.service(&mut head, offset, len, flush);
            match self.model {
                Model::Hdd(_) => {
                    let start = head.busy_until.max(began);
                    head.busy_until = start + t;
                    head.busy_until
                }
                Model::Ssd(_) => began + t,
            }
        };
        let now = Instant::now();
        if done_at > now + SLEEP_MIN {
            std::thread::sleep(done_at - now);
        }
        Ok(r)
    }
}

/// Shortest wait worth a sleep (see `LatencyDevice::timed`).
const SLEEP_MIN: Duration = Duration::from_micros(20);

impl<D: BlockDevice> BlockDevice for LatencyDevice<D> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = buf.len() as u64;
        self.timed(offset, len, false, || self.inner.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.timed(offset, buf.len() as u64, false, || {
            self.inner.write_at(buf, offset)
        })
    }
    fn flush(&self) -> io::Result<()> {
        self.timed(0, 0, true, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.timed(offset, len.min(1 << 20), false, || {
            self.inner.write_zeroes(offset, len)
        })
    }
    fn is_rotational(&self) -> bool {
        self.rotational
    }
    fn refresh_size(&self) -> io::Result<u64> {
        self.inner.refresh_size()
    }
    fn describe(&self) -> String {
        let m = match &self.model {
            Model::Hdd(h) => format!(
                "hdd model {} rpm {} MB/s{}",
                h.rpm,
                h.transfer_mb_per_s,
                if self.rotational {
                    ""
                } else {
                    ", not reported rotational"
                }
            ),
            Model::Ssd(s) => format!("ssd model {} us {} MB/s", s.latency_us, s.transfer_mb_per_s),
        };
        format!("{} ({m})", self.inner.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;

    fn model_time(dev: &LatencyDevice<MemDevice>, reqs: &[(u64, u64)]) -> Duration {
        let mut head = dev.head.lock();
        reqs.iter()
            .map(|&(o, l)| dev.service(&mut head, o, l, false))
            .sum()
    }

    #[test]
    fn sequential_is_transfer_bound_and_random_is_seek_bound() {
        let dev = LatencyDevice::new(MemDevice::new(1 << 30), Model::Hdd(HddModel::default()));
        let seq: Vec<(u64, u64)> = (0..100).map(|i| (i * 4096, 4096)).collect();
        let rand: Vec<(u64, u64)> = (0..100).map(|i| ((i * 7919 % 100) << 20, 4096)).collect();
        let t_seq = model_time(&dev, &seq);
        let t_rand = model_time(&dev, &rand);
        // 100 random 4 KiB reads: 100-200 IOPS territory; sequential: ~180 MB/s.
        assert!(
            t_rand > Duration::from_millis(300) && t_rand < Duration::from_millis(1500),
            "{t_rand:?}"
        );
        assert!(t_seq < Duration::from_millis(20), "{t_seq:?}");
        assert!(dev.is_rotational());
    }

    #[test]
    fn same_seed_same_timing_and_data_untouched() {
        let a = LatencyDevice::new(MemDevice::new(1 << 20), Model::Hdd(HddModel::default()));
        let b = LatencyDevice::new(MemDevice::new(1 << 20), Model::Hdd(HddModel::default()));
        let reqs = [(0, 512), (65536, 4096), (4096, 512)];
        assert_eq!(model_time(&a, &reqs), model_time(&b, &reqs));
        let d = LatencyDevice::new(MemDevice::new(1 << 20), Model::Ssd(SsdModel::default()));
        d.write_at(&[3; 512], 512).unwrap();
        let mut buf = [0u8; 512];
        d.read_at(&mut buf, 512).unwrap();
        assert_eq!(buf, [3; 512]);
        assert!(!d.is_rotational());
        let h = LatencyDevice::new(MemDevice::new(1 << 20), Model::Hdd(HddModel::default()));
        assert!(!h.with_rotational(false).is_rotational());
    }
}
