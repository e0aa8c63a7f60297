//! `tiercache emulate hdd|ssd`: serves a file over NBD through a latency model, so benchmarks,
//! tests and users get an honest slow (or fast) disk without owning one. The model is the
//! `blockdev::latency` wrapper; this only parses options and serves it.
//!
//! Invariant: serves until SIGINT/SIGTERM, then finishes in-flight requests and exits 0.

use crate::export::DeviceExport;
use anyhow::{Context, Result};
use blockdev::latency::{HddModel, LatencyDevice, Model, SsdModel};
use blockdev::{BlockDevice, FileDevice, FileDeviceOptions};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Opens (or creates with `size`) the file and wraps it in the model.
/// `rotational`: the ROTATIONAL flag reported (`None`: the model's own, true for hdd).
pub fn device(
    file: &Path,
    size: Option<u64>,
    model: Model,
    rotational: Option<bool>,
) -> Result<Arc<dyn BlockDevice>> {
    let dev = if file.exists() {
        FileDevice::open(file, FileDeviceOptions::default())
    } else {
        let size = size.with_context(|| {
            format!(
                "{} does not exist; give --size to create it",
                file.display()
            )
        })?;
        FileDevice::create(file, size)
    }
    .with_context(|| format!("opening {}", file.display()))?;
    let dev = LatencyDevice::new(dev, model);
    Ok(Arc::new(match rotational {
        Some(r) => dev.with_rotational(r),
        None => dev,
    }))
}

pub fn run(dev: Arc<dyn BlockDevice>, socket: &Path, name: &str) -> Result<()> {
    let registry = server::ExportRegistry::new();
    registry.add(Arc::new(DeviceExport::new(dev.clone(), name.to_string())))?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let handle = server::start(
        &server::BindAddr::Unix(socket.to_path_buf()),
        registry,
        server::ServerConfig::default(),
    )
    .with_context(|| format!("listening on {}", socket.display()))?;
    // The URI names the socket by its absolute path, so it can be used from any directory
    // (the socket itself is bound as given: a unix socket path has a length limit).
    let at = match std::path::absolute(socket) {
        Ok(abs) => server::LocalAddr::Unix(abs).uri(name),
        Err(_) => handle.local_addr().uri(name),
    };
    log::info!("emulating {} at {at}", dev.describe());
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
    handle.shutdown();
    Ok(())
}

pub fn hdd_model(
    track_to_track_ms: f64,
    full_stroke_ms: f64,
    rpm: f64,
    transfer_mb_per_s: f64,
    seed: u64,
) -> Model {
    Model::Hdd(HddModel {
        track_to_track_ms,
        full_stroke_ms,
        rpm,
        transfer_mb_per_s,
        seed,
    })
}

pub fn ssd_model(latency_us: f64, transfer_mb_per_s: f64) -> Model {
    Model::Ssd(SsdModel {
        latency_us,
        transfer_mb_per_s,
    })
}
