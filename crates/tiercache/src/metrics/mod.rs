//! What a running server measures about itself, for Prometheus (`serve --metrics`, see
//! `http` and `prom`) and `tiercache top` (the admin request `metrics`).
//!
//! Owns: the instrumentation `serve` puts around the engine — [`device::TimedDevice`] around
//! the cache and backing devices, [`volume::VolumeMetrics`] in each export — and the taking
//! of a [`Sample`] (its data types are [`sample`]'s), one consistent-enough reading of
//! everything at one moment: the engine's
//! counters and state (`CacheSet::occupancy/health/volumes`, `Volume::status`), the
//! instrumentation's counters and histograms, and the NBD listeners' connection counts.
//! Prometheus text and the admin JSON are both made from a `Sample`, so they always agree.
//!
//! Invariants: instrumentation is always on (whether or not `--metrics` is given: `top` reads
//! it through the admin socket) and costs a few relaxed atomics and clock reads per request
//! and per device I/O; a volume's request metrics are keyed by its uuid, so they survive a
//! label change (the `volume` label follows the new name) and a re-export; memory is fixed
//! per volume and per device (`SERIES` and `DEVICE_OPS` histograms of `hist::BUCKETS`
//! words), and a detached volume's or dropped device's metrics go at the next sample. Taking
//! a sample locks the engine's state briefly, like `status` does.

pub mod device;
pub mod hist;
pub mod http;
pub mod prom;
pub mod sample;
pub mod volume;

pub use sample::{ListenerSample, Sample, SetSample, VolumeSample, WritebackSample};

use blockdev::BlockDevice;
use device::{DeviceMetrics, DeviceSample, Role, TimedDevice};
use engine::policy::WritebackRate;
use engine::CacheSet;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;
use uuid::Uuid;
use volume::VolumeMetrics;

/// Serves `/metrics` on `addr` (`serve --metrics`; none without it) from the samples
/// `sample` takes, and records in `metrics` where, for the admin request `metrics`.
pub fn start_http(
    addr: Option<&str>,
    metrics: &Metrics,
    sample: Arc<dyn Fn() -> Sample + Send + Sync>,
) -> anyhow::Result<Option<http::MetricsServer>> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let srv = http::MetricsServer::start(
        http::parse_addr(addr)?,
        Arc::new(move |format| prom::render(&sample(), format)),
    )?;
    metrics.set_http_addr(srv.addr());
    log::info!("metrics at http://{}/metrics", srv.addr());
    Ok(Some(srv))
}

/// How a listener is named in metrics: `unix:PATH` or `tcp:ADDRESS:PORT`.
pub fn listener_name(addr: &server::LocalAddr) -> String {
    match addr {
        server::LocalAddr::Unix(p) => format!("unix:{}", p.display()),
        server::LocalAddr::Tcp(a) => format!("tcp:{a}"),
    }
}

/// The instrumentation of one server.
pub struct Metrics {
    started: Instant,
    volumes: Mutex<BTreeMap<Uuid, Arc<VolumeMetrics>>>,
    /// Held by the devices' wrappers: a device the engine dropped (detached, or an attach
    /// that failed) leaves the list at the next sample.
    devices: Mutex<Vec<Weak<DeviceMetrics>>>,
    /// Backing device spec of each volume uuid (from the device's header at open).
    backing_names: Mutex<BTreeMap<Uuid, String>>,
    /// Where the cache device's data area starts (`u64::MAX` until the set is open).
    cache_data_offset: Arc<AtomicU64>,
    listeners: Mutex<Vec<(String, server::StatsView)>>,
    /// Where `/metrics` is served, once it is.
    http_addr: Mutex<Option<std::net::SocketAddr>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            started: Instant::now(),
            volumes: Mutex::default(),
            devices: Mutex::default(),
            backing_names: Mutex::default(),
            cache_data_offset: Arc::new(AtomicU64::new(u64::MAX)),
            listeners: Mutex::default(),
            http_addr: Mutex::default(),
        }
    }
}

impl Metrics {
    fn wrap(&self, dev: Arc<dyn BlockDevice>, role: Role, name: &str) -> Arc<dyn BlockDevice> {
        let m = Arc::new(DeviceMetrics {
            role,
            device: name.to_string(),
            ops: Default::default(),
            remote: dev.nbd_links().map(|_| Arc::downgrade(&dev)),
        });
        lock(&self.devices).push(Arc::downgrade(&m));
        let data_offset = match role {
            Role::Cache => self.cache_data_offset.clone(),
            Role::Backing => Arc::new(AtomicU64::new(0)),
        };
        Arc::new(TimedDevice::new(dev, m, data_offset))
    }

    /// The cache device, timed; `name` as given by the operator.
    pub fn wrap_cache(&self, dev: Arc<dyn BlockDevice>, name: &str) -> Arc<dyn BlockDevice> {
        self.wrap(dev, Role::Cache, name)
    }

    /// A backing device, timed; its header (if it has one) says which volume it will be.
    pub fn wrap_backing(&self, dev: Arc<dyn BlockDevice>, name: &str) -> Arc<dyn BlockDevice> {
        if let Ok((h, _)) = engine::format::BackingHeader::read(&*dev) {
            lock(&self.backing_names).insert(h.dev_uuid, name.to_string());
        }
        self.wrap(dev, Role::Backing, name)
    }

    /// The cache set is open: from now on I/O in its data area counts as cached data.
    pub fn set_opened(&self, set: &CacheSet) {
        self.cache_data_offset
            .store(set.layout().data_off, std::sync::atomic::Ordering::Relaxed);
    }

    /// The request metrics of a volume (created at its first export).
    pub fn volume(&self, uuid: Uuid) -> Arc<VolumeMetrics> {
        lock(&self.volumes).entry(uuid).or_default().clone()
    }

    /// The NBD listeners whose connections are reported, by address.
    pub fn set_listeners(&self, listeners: Vec<(String, server::StatsView)>) {
        *lock(&self.listeners) = listeners;
    }

    pub fn set_http_addr(&self, addr: std::net::SocketAddr) {
        *lock(&self.http_addr) = Some(addr);
    }

    /// Everything at this moment; `set` is `None` while serving without the cache device
    /// (`without_cache`: why).
    pub fn sample(&self, set: Option<&CacheSet>, without_cache: Option<String>) -> Sample {
        let (cache_set, volumes) = match set {
            Some(set) => (Some(set_sample(set)), self.volume_samples(set)),
            None => (None, Vec::new()),
        };
        Sample {
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            bucket_bounds_us: hist::BOUNDS_US.to_vec(),
            cache_set,
            without_cache,
            volumes,
            devices: self.device_samples(),
            listeners: lock(&self.listeners)
                .iter()
                .map(|(name, view)| ListenerSample::of(name, &view.stats()))
                .collect(),
            metrics_address: lock(&self.http_addr).map(|a| a.to_string()),
        }
    }

    fn device_samples(&self) -> Vec<DeviceSample> {
        let mut devices = lock(&self.devices);
        devices.retain(|d| d.strong_count() > 0);
        devices
            .iter()
            .filter_map(|d| Some(d.upgrade()?.sample()))
            .collect()
    }

    fn volume_samples(&self, set: &CacheSet) -> Vec<VolumeSample> {
        let names = lock(&self.backing_names).clone();
        let vols = set.volumes();
        // Detached volumes' request metrics go (an export still serving holds its own).
        lock(&self.volumes).retain(|uuid, _| vols.iter().any(|v| v.uuid() == *uuid));
        vols.iter()
            .map(|v| {
                let s = v.status();
                let (rate, share) = match s.writeback {
                    WritebackRate::Idle => ("idle".to_string(), 0.0),
                    WritebackRate::Share(p) => (format!("{p}%"), f64::from(p) / 100.0),
                    WritebackRate::Full => ("full".to_string(), 1.0),
                };
                VolumeSample {
                    name: v.name(),
                    uuid: s.uuid.to_string(),
                    backing_device: names.get(&s.uuid).cloned(),
                    size_bytes: s.size_bytes,
                    state: s.state.to_string(),
                    cache_mode: s.knobs.cache_mode.name().to_string(),
                    dirty_bytes: s.dirty_bytes,
                    cached_bytes: s.cached_bytes,
                    writeback: WritebackSample {
                        running: s.knobs.writeback_running,
                        rate,
                        share,
                        error: s.writeback_error.as_ref().map(|e| e.error.clone()),
                        failures: s.writeback_error.as_ref().map_or(0, |e| e.failures),
                        status: crate::writeback_meter::state(&s).to_string(),
                    },
                    counters: counters(&s.stats.total),
                    requests: self.volume(s.uuid).sample(),
                }
            })
            .collect()
    }
}

fn counters(s: &engine::stats::Snapshot) -> BTreeMap<String, u64> {
    s.fields()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

fn set_sample(set: &CacheSet) -> SetSample {
    let o = set.occupancy();
    let missing = set.missing();
    let h = set.health();
    SetSample {
        uuid: set.set_uuid().to_string(),
        total_bytes: o.total_bytes,
        unused_bytes: o.unused_bytes,
        clean_bytes: o.clean_bytes,
        dirty_bytes: o.dirty_bytes,
        metadata_bytes: o.metadata_bytes,
        in_use_pct: o.in_use_pct,
        degraded: h.degraded.as_ref().map(|d| d.reason.clone()),
        missing_volumes: missing.len() as u64,
        missing_dirty_bytes: missing.iter().map(|m| m.dirty_bytes).sum(),
        errors_total: h.errors_total,
        error_count: h.error_count,
        io_error_limit: h.io_error_limit,
        read_latency_us: h.read_latency_us,
        write_latency_us: h.write_latency_us,
        counters: counters(&set.totals()),
    }
}

/// Samples made up for tests (of `prom` and `top`).
#[cfg(test)]
pub mod test_samples {
    use super::hist::{HistSnapshot, BUCKETS};
    use super::volume::SeriesSample;
    use super::*;

    fn hist(n: u64, bucket: usize) -> HistSnapshot {
        let mut b = vec![0; BUCKETS];
        b[bucket] = n;
        HistSnapshot {
            buckets: b,
            sum_ns: 0,
        }
    }

    pub fn volume(name: &str, reads_hit: u64, dirty: u64, hits: u64) -> VolumeSample {
        let mut requests = Vec::new();
        for (op, result) in crate::metrics::volume::SERIES {
            let n = if (op.name(), result) == ("read", "hit") {
                reads_hit
            } else {
                0
            };
            requests.push(SeriesSample {
                op: op.name().into(),
                result: result.into(),
                bytes: n * 4096,
                latency: hist(n, 4),
            });
        }
        VolumeSample {
            name: name.into(),
            uuid: format!("uuid-{name}"),
            backing_device: None,
            size_bytes: 1 << 30,
            state: "dirty".into(),
            cache_mode: "writeback".into(),
            dirty_bytes: dirty,
            cached_bytes: 3 << 20,
            writeback: WritebackSample {
                running: true,
                rate: "2%".into(),
                share: 0.02,
                error: None,
                failures: 0,
                status: if dirty == 0 { "idle" } else { "running" }.into(),
            },
            counters: [("cache_hits".to_string(), hits), ("cache_misses".into(), 0)]
                .into_iter()
                .collect(),
            requests,
        }
    }

    pub fn sample(t: f64, vols: Vec<VolumeSample>) -> Sample {
        Sample {
            uptime_seconds: t,
            bucket_bounds_us: crate::metrics::hist::BOUNDS_US.to_vec(),
            cache_set: Some(SetSample {
                uuid: "set".into(),
                total_bytes: 64 << 20,
                unused_bytes: 40 << 20,
                clean_bytes: 10 << 20,
                dirty_bytes: 12 << 20,
                metadata_bytes: 2 << 20,
                in_use_pct: 37,
                degraded: None,
                missing_volumes: 0,
                missing_dirty_bytes: 0,
                errors_total: 0,
                error_count: 0.0,
                io_error_limit: 8,
                read_latency_us: 0,
                write_latency_us: 0,
                counters: BTreeMap::new(),
            }),
            without_cache: None,
            volumes: vols,
            devices: Vec::new(),
            listeners: Vec::new(),
            metrics_address: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_device_leaves_the_samples() {
        let m = Metrics::default();
        let mem = || Arc::new(blockdev::MemDevice::new(1 << 20)) as Arc<dyn BlockDevice>;
        let cache = m.wrap_cache(mem(), "fast");
        let backing = m.wrap_backing(mem(), "slow");
        let names =
            |s: &Sample| -> Vec<String> { s.devices.iter().map(|d| d.device.clone()).collect() };
        assert_eq!(
            names(&m.sample(None, Some("test".into()))),
            ["fast", "slow"]
        );
        drop(backing);
        let s = m.sample(None, Some("test".into()));
        assert_eq!(names(&s), ["fast"]);
        assert_eq!(s.without_cache.as_deref(), Some("test"));
        drop(cache);
        assert!(m.sample(None, None).devices.is_empty());
    }
}
