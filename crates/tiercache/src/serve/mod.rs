//! `tiercache serve`: opens a cache set and its backing devices, serves every attached volume
//! as an NBD export (named by its label, or uuid), runs the admin socket, tells systemd it is
//! ready (`notify`, under `Type=notify`), and shuts down cleanly on SIGINT/SIGTERM or
//! `tiercache stop`. Its settings, their merging and their checks are `config`'s; this module
//! starts and runs the server (it uses `config`, never the other way round).
//!
//! Invariants: the settings are checked (`ServeConfig::check`) before any device is opened;
//! exports always mirror the set's attached volumes (attach/detach/label changes re-sync
//! them), and under `--ublk` the `/dev/ublkbN` devices mirror the exports; shutdown
//! order is stop accepting → finish in-flight requests (sockets and ublk devices together,
//! within `shutdown_timeout`) → close the cache set (journal + checkpoint durable, within it
//! again) → exit 0, so a restart finds the cache warm. TLS applies to the TCP listener only;
//! the unix socket serves in clear, guarded by its permissions. The server owns its devices
//! for as long as it has them open (exclusive locks, see `devices`): the cache and backing
//! devices must be distinct devices, and another server, `make`, `check` or `attach` of them
//! is refused.
//! Every device is handed to the engine inside a timing wrapper and every export counts its
//! requests (`metrics`); with `metrics` set, `/metrics` is served over HTTP (loopback unless
//! an address is given), bound before the admin socket appears.
//!
//! Without the cache device: only with `without_cache_if_missing`, and only when the cache
//! device cannot be opened or its metadata cannot be loaded (never when another process owns
//! it), every backing device is served directly instead (see `without_cache` for what makes
//! that safe); admin commands that need the cache set then fail with a message saying why.

mod config;

use config::parse_volume_knobs;
pub use config::{parse_duration, parse_tcp, ServeConfig, TlsMode, DEFAULT_SOCKET};

use crate::admin::{self, Control, Pending};
use crate::devices::Access;
use crate::export::VolumeExport;
use crate::metrics::{http::MetricsServer, Metrics};
use crate::without_cache::WithoutCache;
use anyhow::{Context, Result};
use blockdev::BlockDevice;
use engine::{CacheSet, Config};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Applies the config file's `[volumes.NAME]` knobs. Everything is parsed and validated
/// before the first knob is applied, so a bad value stops the start without a half-applied
/// configuration; names that match no attached volume are an error, not a silent no-op.
fn apply_volume_knobs(set: &CacheSet, volumes: &BTreeMap<String, toml::Table>) -> Result<()> {
    let mut changes = Vec::new();
    for (name, knobs) in parse_volume_knobs(volumes)? {
        let vol = set
            .volumes()
            .into_iter()
            .find(|v| v.name() == name || v.uuid().to_string() == name)
            .with_context(|| {
                format!("config [volumes.{name}]: no attached backing device has that name or uuid")
            })?;
        changes.extend(knobs.into_iter().map(|k| (vol.clone(), k)));
    }
    for (vol, knob) in changes {
        let what = format!("{} {}", vol.name(), knob.name());
        vol.set_knob(knob)
            .with_context(|| format!("applying config knob {what}"))?;
    }
    Ok(())
}

/// Starts the NBD listeners (unix socket, optional TCP) and the admin socket (0600 from the
/// moment it exists). A socket path a live server listens on is refused, never taken over.
fn listen_all(
    cfg: &ServeConfig,
    running: &Arc<Running>,
) -> Result<(
    Vec<server::ServerHandle>,
    server::UnixSocketFile,
    Option<MetricsServer>,
)> {
    let server_cfg = cfg.server_config()?;
    let tls = cfg.tls_config()?;
    let mut binds = vec![server::BindAddr::Unix(cfg.socket())];
    if let Some(t) = &cfg.tcp {
        binds.push(server::BindAddr::Tcp(parse_tcp(t)?));
    }
    let mut handles = Vec::new();
    for b in &binds {
        let mut bind_cfg = server_cfg.clone();
        let what = match b {
            server::BindAddr::Unix(p) => p.display().to_string(),
            server::BindAddr::Tcp(a) => {
                bind_cfg.tls = tls.clone();
                format!("tcp {a}")
            }
        };
        match server::start(b, running.exports.clone(), bind_cfg) {
            Ok(h) => handles.push(h),
            Err(e) => {
                handles.into_iter().for_each(server::ServerHandle::shutdown);
                return Err(anyhow::Error::new(e).context(format!("listening on {what}")));
            }
        }
    }
    running.metrics.set_listeners(
        handles
            .iter()
            .map(|h| {
                (
                    crate::metrics::listener_name(h.local_addr()),
                    h.stats_view(),
                )
            })
            .collect(),
    );
    // Before the admin socket appears, so the address is known once it does.
    let sampled = running.clone();
    let metrics_http = match crate::metrics::start_http(
        cfg.metrics.as_deref(),
        &running.metrics,
        Arc::new(move || sampled.sample()),
    ) {
        Ok(m) => m,
        Err(e) => {
            handles.into_iter().for_each(server::ServerHandle::shutdown);
            return Err(e);
        }
    };
    let admin_perms = server::UnixSocketPerms {
        mode: 0o600,
        uid: None,
        gid: None,
    };
    match server::bind_unix(&cfg.admin(), &admin_perms) {
        Ok((listener, file)) => {
            admin::listen(listener, running.clone() as Arc<dyn Control>)?;
            Ok((handles, file, metrics_http))
        }
        Err(e) => {
            handles.into_iter().for_each(server::ServerHandle::shutdown);
            if let Some(m) = metrics_http {
                m.shutdown();
            }
            Err(anyhow::Error::new(e).context("binding the admin socket"))
        }
    }
}

/// What a running server serves from: its cache set, or its backing devices directly.
enum Source {
    Set(Arc<CacheSet>),
    WithoutCache(WithoutCache),
}

/// A running server: the cache set (or the volumes served without it), its exports, the
/// admin socket.
pub struct Running {
    source: Source,
    pub exports: server::ExportRegistry,
    stop: AtomicBool,
    /// Request, device and connection metrics (`serve --metrics`, `tiercache top`).
    pub metrics: Arc<Metrics>,
    /// Backing devices named at start that have not answered yet.
    pending: std::sync::Mutex<Vec<Pending>>,
    /// How they are attached when they answer (`--take-over`).
    attach: engine::AttachOptions,
    /// The `/dev/ublkbN` devices (`serve --ublk`), following the exports; `None` without
    /// `--ublk` and once the shutdown took them.
    ublk: std::sync::Mutex<Option<crate::ublk::Devices>>,
}

impl Running {
    /// The cache set; `None` when serving without the cache device.
    pub fn set(&self) -> Option<&Arc<CacheSet>> {
        match &self.source {
            Source::Set(set) => Some(set),
            Source::WithoutCache(_) => None,
        }
    }

    /// Makes the exports match the attached volumes (without the cache device: the volumes
    /// served directly, fixed at start).
    pub fn sync_exports(&self) {
        let set = match &self.source {
            Source::Set(set) => set,
            Source::WithoutCache(w) => {
                for v in &w.volumes {
                    if !self.exports.names().contains(&v.name) {
                        if let Err(e) = self.exports.add(v.export.clone()) {
                            log::error!("cannot export a volume: {e}");
                        }
                    }
                }
                return;
            }
        };
        let vols = set.volumes();
        let names: Vec<String> = vols.iter().map(|v| v.name()).collect();
        for name in self.exports.names() {
            if !names.contains(&name) {
                // Its clients are disconnected after their in-flight requests finish.
                drop(self.exports.remove(&name));
            }
        }
        for v in vols {
            if !self.exports.names().contains(&v.name()) {
                let m = self.metrics.volume(v.uuid());
                if let Err(e) = self.exports.add(Arc::new(VolumeExport::new(v, m))) {
                    log::error!("cannot export a volume: {e}");
                }
            }
        }
        self.sync_ublk();
    }

    /// Makes the ublk devices (if any) match the exports.
    fn sync_ublk(&self) {
        if let Some(devices) = lock(&self.ublk).as_mut() {
            if let Err(e) = devices.sync(&self.exports) {
                log::error!("{e:#}");
            }
        }
    }

    /// Everything the metrics report, now.
    pub fn sample(&self) -> crate::metrics::Sample {
        let without = self.without_cache().map(|w| w.reason.clone());
        self.metrics.sample(self.set().map(|s| &**s), without)
    }

    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Closes the cache set (journal and checkpoint durable), or flushes the backing devices
    /// served without it.
    fn close(&self) -> Result<()> {
        match &self.source {
            Source::Set(set) => set.close().context("closing the cache set"),
            Source::WithoutCache(w) => w.close(),
        }
    }
}

impl Control for Running {
    fn set(&self, what: &str) -> Result<&CacheSet> {
        match &self.source {
            Source::Set(set) => Ok(set),
            Source::WithoutCache(w) => Err(w.no_set_error(what)),
        }
    }
    fn without_cache(&self) -> Option<&WithoutCache> {
        match &self.source {
            Source::Set(_) => None,
            Source::WithoutCache(w) => Some(w),
        }
    }
    fn volumes_changed(&self) {
        self.sync_exports();
    }
    fn pending(&self) -> Vec<Pending> {
        lock(&self.pending).clone()
    }
    fn stop(&self) {
        self.request_stop();
    }
    /// Exclusive: a device this server already has open (its cache, an attached backing
    /// device) or another process owns is refused.
    fn open_backing(&self, path: &Path) -> Result<Arc<dyn BlockDevice>> {
        let spec = path.to_string_lossy();
        let dev = crate::devices::open_spec(&spec, Access::Write)?;
        Ok(self.metrics.wrap_backing(dev, &spec))
    }
    fn metrics(&self) -> Result<serde_json::Value> {
        Ok(serde_json::to_value(self.sample())?)
    }
}

/// Opens the set and serves until stopped (without the cache device if it cannot be used and
/// `without_cache_if_missing` says so). `on_ready` runs once everything listens (the demo
/// uses it to drive its workload); it may call `request_stop`.
pub fn serve(cfg: &ServeConfig, on_ready: impl FnOnce(&Arc<Running>) + Send) -> Result<()> {
    cfg.check()?;
    if cfg.ublk {
        // Before any thread starts: they inherit the mark.
        if let Err(e) = crate::ublk::become_io_flusher() {
            log::warn!(
                "not marked an I/O flusher (PR_SET_IO_FLUSHER: {e}): under memory pressure a \
                 filesystem on /dev/ublkbN can wait on this server's own allocations; give it \
                 CAP_SYS_RESOURCE"
            );
        }
    }
    crate::devices::ensure_distinct(&cfg.cache, &cfg.backing)?;
    let metrics = Arc::new(Metrics::default());
    let cache = crate::devices::open_path(&cfg.cache, Access::Write)
        .map(|d| metrics.wrap_cache(d, &cfg.cache.to_string_lossy()));
    if let Err(e) = &cache {
        if !may_serve_without(cfg, e) {
            return cache.map(drop);
        }
    }
    let (backings, pending) = open_backings(cfg, &metrics)?;
    let check =
        |known: &[engine::MissingVolume]| refuse_missing_dirty(cfg, known, &backings, &pending);
    match cache.and_then(|c| open_set(c, cfg.engine_config()?, check)) {
        Ok(set) => run(
            cfg,
            with_set(cfg, set, backings, pending, metrics)?,
            on_ready,
        ),
        Err(e) if may_serve_without(cfg, &e) => {
            if let Some(p) = pending.first() {
                anyhow::bail!(
                    "serving without the cache device needs every backing device: {}: {}",
                    p.spec,
                    p.error
                );
            }
            let named = backings;
            let without = crate::without_cache::prepare(
                cfg.cache.clone(),
                format!("{e:#}"),
                named,
                cfg.without_cache_discard_dirty,
            )?;
            if !cfg.volumes.is_empty() {
                log::warn!(
                    "the [volumes] knobs of the configuration are not applied while serving \
                     without the cache device (they are applied at the next start with it)"
                );
            }
            run(
                cfg,
                running(
                    Source::WithoutCache(without),
                    metrics,
                    Vec::new(),
                    Default::default(),
                ),
                on_ready,
            )
        }
        Err(e) => Err(e),
    }
}

/// Opens the backing devices named in `cfg`, as `(spec, device)`. A remote (NBD) device that
/// does not answer is left pending, to be attached when it does; any other failure stops the
/// start.
fn open_backings(cfg: &ServeConfig, metrics: &Metrics) -> Result<(Vec<Named>, Vec<Pending>)> {
    // Remote devices are tried at once, so one that does not answer delays the start by one
    // connection timeout, not one per device.
    let opened: Vec<(String, Result<Arc<dyn BlockDevice>>)> = std::thread::scope(|s| {
        let tries: Vec<_> = (cfg.backing.iter())
            .map(|b| (b, s.spawn(|| crate::devices::open_spec(b, Access::Write))))
            .collect();
        tries
            .into_iter()
            .map(|(b, t)| {
                let r = t
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("opening {b} panicked")));
                (b.clone(), r)
            })
            .collect()
    });
    let mut devices = Vec::new();
    let mut pending = Vec::new();
    for (spec, r) in opened {
        match r {
            Ok(d) => devices.push((spec.clone(), metrics.wrap_backing(d, &spec))),
            Err(e) if blockdev::is_nbd_uri(&spec) => {
                log::warn!(
                    "backing device {spec} does not answer ({e:#}); the other volumes start \
                     now, this one as soon as it answers"
                );
                pending.push(Pending::new(spec, format!("{e:#}")));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((devices, pending))
}

/// A backing device as named for `serve`, opened.
type Named = (String, Arc<dyn BlockDevice>);

/// Longest wait between two tries of a pending backing device.
const PENDING_RETRY_MAX: Duration = Duration::from_secs(30);

/// Tries each pending backing device until it answers, then attaches and exports it.
fn retry_pending(running: &Arc<Running>) {
    let specs: Vec<String> = lock(&running.pending)
        .iter()
        .map(|p| p.spec.clone())
        .collect();
    for spec in specs {
        let running = running.clone();
        let spawned = std::thread::Builder::new()
            .name("pending-backing".into())
            .spawn(move || retry_one(&running, &spec));
        if let Err(e) = spawned {
            log::error!("cannot start a thread to retry a backing device: {e}");
        }
    }
}

fn retry_one(running: &Arc<Running>, spec: &str) {
    let mut wait = Duration::from_secs(1);
    let forget = |running: &Running| lock(&running.pending).retain(|p| p.spec != spec);
    loop {
        // Sleep in small steps, so a stop is not held up.
        let until = std::time::Instant::now() + wait;
        while std::time::Instant::now() < until {
            if running.stop.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        wait = (wait * 2).min(PENDING_RETRY_MAX);
        let Some(set) = running.set() else { return };
        let dev = match crate::devices::open_spec(spec, Access::Write) {
            Ok(d) => running.metrics.wrap_backing(d, spec),
            Err(e) => {
                if let Some(p) = lock(&running.pending).iter_mut().find(|p| p.spec == spec) {
                    p.error = format!("{e:#}");
                }
                continue;
            }
        };
        match set.attach_with(dev, running.attach) {
            Ok(v) => {
                forget(running);
                log::info!(
                    "backing device {spec} answers: export '{}' ({} bytes, mode {}) is served",
                    v.name(),
                    v.size_bytes(),
                    v.mode()
                );
                running.sync_exports();
            }
            Err(e) => {
                // Reachable, but the set will not take it: retrying cannot help.
                log::error!("backing device {spec} answers, but cannot be attached: {e}");
                if let Some(p) = lock(&running.pending).iter_mut().find(|p| p.spec == spec) {
                    p.error = format!("cannot be attached (not retried): {e}");
                }
            }
        }
        return;
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a failure to open the cache device (or its set) allows serving without it: only
/// when asked, and never when another process owns the device.
fn may_serve_without(cfg: &ServeConfig, e: &anyhow::Error) -> bool {
    cfg.without_cache_if_missing && !crate::devices::is_busy(e)
}

/// Like `serve`, with devices already opened (the demo wraps its slow device in a model).
pub fn serve_devices(
    cfg: &ServeConfig,
    cache: Arc<dyn BlockDevice>,
    backings: Vec<Arc<dyn BlockDevice>>,
    on_ready: impl FnOnce(&Arc<Running>) + Send,
) -> Result<()> {
    let metrics = Arc::new(Metrics::default());
    let cache = metrics.wrap_cache(cache, &cfg.cache.to_string_lossy());
    let backings: Vec<Named> = (backings.into_iter().zip(&cfg.backing))
        .map(|(d, name)| (name.clone(), metrics.wrap_backing(d, name)))
        .collect();
    let check = |known: &[engine::MissingVolume]| refuse_missing_dirty(cfg, known, &backings, &[]);
    let set = open_set(cache, cfg.engine_config()?, check)?;
    run(
        cfg,
        with_set(cfg, set, backings, Vec::new(), metrics)?,
        on_ready,
    )
}

/// Opens (recovers) the cache set on its device, unless `check` refuses it first (before
/// anything is written: see `CacheSet::open_checked`).
fn open_set(
    cache: Arc<dyn BlockDevice>,
    config: Config,
    check: impl FnOnce(&[engine::MissingVolume]) -> Result<()>,
) -> Result<CacheSet> {
    let mut refused = None;
    let opened = CacheSet::open_checked(cache, config, |known| {
        check(known).map_err(|e| {
            let why = format!("{e:#}");
            refused = Some(e);
            engine::Error::State(why)
        })
    });
    if let Some(e) = refused {
        return Err(e);
    }
    let (set, report) = opened.context("opening the cache set")?;
    for n in &report.notes {
        log::warn!("{n}");
    }
    log::info!(
        "recovered in {} ms: {} cached blocks ({} dirty), {} journal records replayed",
        report.duration_ms,
        report.cached_blocks,
        report.dirty_blocks,
        report.records_replayed
    );
    Ok(set)
}

fn running(
    source: Source,
    metrics: Arc<Metrics>,
    pending: Vec<Pending>,
    attach: engine::AttachOptions,
) -> Arc<Running> {
    if let Source::Set(set) = &source {
        metrics.set_opened(set);
    }
    Arc::new(Running {
        source,
        exports: server::ExportRegistry::default(),
        stop: AtomicBool::new(false),
        metrics,
        pending: std::sync::Mutex::new(pending),
        attach,
        ublk: std::sync::Mutex::new(None),
    })
}

/// Attaches the backing devices to the set and applies the configured knobs. A device the
/// set holds dirty data of that was not named stops the start (unless `allow_missing`);
/// every device it knows but does not have is logged.
fn with_set(
    cfg: &ServeConfig,
    set: CacheSet,
    backings: Vec<Named>,
    pending: Vec<Pending>,
    metrics: Arc<Metrics>,
) -> Result<Arc<Running>> {
    let opts = cfg.attach_options();
    let attached = (|| {
        // Every device is checked before any is attached: a start refused for one device
        // (another set's, say) has taken none over. With --allow-missing, a device another
        // set took over from this one is left out (listed as missing) instead.
        let mut given = Vec::with_capacity(backings.len());
        for (spec, b) in backings {
            match set.check_attach(&*b, opts) {
                Ok(()) => given.push((spec, b)),
                Err(e) if cfg.allow_missing && set.taken_from_us(&*b) => {
                    log::error!("leaving backing device {spec} out (--allow-missing): {e}");
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("attaching backing device {spec}"))
                }
            }
        }
        for (spec, b) in given {
            let v = set
                .attach_with(b, opts)
                .with_context(|| format!("attaching backing device {spec}"))?;
            log::info!(
                "export '{}': {} bytes, mode {}",
                v.name(),
                v.size_bytes(),
                v.mode()
            );
        }
        check_missing(cfg, &set, &pending)?;
        apply_volume_knobs(&set, &cfg.volumes)
    })();
    if let Err(e) = attached {
        // Nothing was served: close the set cleanly so the next start needs no recovery.
        if let Err(close) = set.close() {
            log::error!("closing the cache set: {close:#}");
        }
        return Err(e);
    }
    Ok(running(Source::Set(Arc::new(set)), metrics, pending, opts))
}

/// Refuses, before the set is opened (so a refused start writes nothing), a start without a
/// device the set holds dirty data of: `known` is every device it holds data of, and those
/// `backings` are not (by the uuid in their headers) are missing. See `refuse_dirty`.
fn refuse_missing_dirty(
    cfg: &ServeConfig,
    known: &[engine::MissingVolume],
    backings: &[Named],
    pending: &[Pending],
) -> Result<()> {
    let given: Vec<uuid::Uuid> = backings
        .iter()
        .filter_map(|(_, b)| engine::format::BackingHeader::read(&**b).ok())
        .map(|(h, _)| h.dev_uuid)
        .collect();
    let missing: Vec<engine::MissingVolume> = known
        .iter()
        .filter(|m| !given.contains(&m.uuid))
        .cloned()
        .collect();
    refuse_dirty(cfg, &missing, pending)
}

/// The refusal of a start without a device whose newest data is only in the cache (dirty
/// data among `missing`), unless `allow_missing`, or a named device that has not answered
/// yet may be it.
fn refuse_dirty(
    cfg: &ServeConfig,
    missing: &[engine::MissingVolume],
    pending: &[Pending],
) -> Result<()> {
    let dirty: Vec<_> = missing.iter().filter(|m| m.dirty_bytes > 0).collect();
    if dirty.is_empty() || !pending.is_empty() || cfg.allow_missing {
        return Ok(());
    }
    let list: Vec<String> = dirty
        .iter()
        .map(|m| format!("{} ({} dirty)", m.uuid, crate::units::human(m.dirty_bytes)))
        .collect();
    let name_them = match &cfg.backing_file {
        None => "Name them with --backing (or in the config's `backing` list)".to_string(),
        Some(f) => format!("Add them to the `backing` list of {}", f.display()),
    };
    anyhow::bail!(
        "the cache set holds dirty data of backing device(s) not {}: {}; their newest data \
         is only in this cache. {name_them}, or start with --allow-missing (allow_missing = \
         true) to serve the others meanwhile (`tiercache attach` brings them back)",
        cfg.backing_named(),
        list.join(", ")
    )
}

/// Says loudly which backing devices the set knows but does not have, and refuses to start
/// without one that holds dirty data (its newest data is only in the cache) unless
/// `allow_missing` — or unless a named device that has not answered yet may be it.
fn check_missing(cfg: &ServeConfig, set: &CacheSet, pending: &[Pending]) -> Result<()> {
    let missing = set.missing();
    refuse_dirty(cfg, &missing, pending)?;
    for m in &missing {
        let why = if pending.is_empty() {
            format!("not {}", cfg.backing_named())
        } else {
            "not attached (a named device that has not answered yet may be it)".to_string()
        };
        if m.dirty_bytes > 0 {
            log::error!(
                "backing device {} is {why}: it holds {} of dirty data in this cache (its newest \
                 data, only here) and {} cached in all; `tiercache status` lists it as missing \
                 until it is attached",
                m.uuid,
                crate::units::human(m.dirty_bytes),
                crate::units::human(m.cached_bytes)
            );
        } else {
            log::warn!(
                "backing device {} is {why}: {} of clean copies stay cached for it until it is \
                 attached or the space is needed",
                m.uuid,
                crate::units::human(m.cached_bytes)
            );
        }
    }
    Ok(())
}

/// Serves `running` until stopped, then shuts down.
fn run(
    cfg: &ServeConfig,
    running: Arc<Running>,
    on_ready: impl FnOnce(&Arc<Running>) + Send,
) -> Result<()> {
    running.sync_exports();
    let signals = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, signals.clone()).context("installing signal handlers")?;
    }
    let limit = cfg.shutdown_timeout()?;
    if cfg.ublk {
        let mut devices = crate::ublk::Devices::new(
            cfg.ublk_queues.unwrap_or(2),
            cfg.ublk_first_id.unwrap_or(0),
            limit,
        );
        if let Err(e) = devices.sync(&running.exports) {
            devices.stop_all();
            if let Err(close) = running.close() {
                log::error!("{close:#}");
            }
            return Err(e);
        }
        *lock(&running.ublk) = Some(devices);
    }
    let (handles, admin_file, metrics_http) = match listen_all(cfg, &running) {
        Ok(l) => l,
        Err(e) => {
            // Nothing was served: close the set cleanly so the next start needs no recovery.
            if let Some(devices) = lock(&running.ublk).take() {
                devices.stop_all();
            }
            if let Err(close) = running.close() {
                log::error!("{close:#}");
            }
            return Err(e);
        }
    };
    retry_pending(&running);
    log::info!(
        "serving on {} (admin socket {}){}",
        cfg.socket().display(),
        cfg.admin().display(),
        cfg.tcp
            .as_ref()
            .map(|t| format!(", tcp {t} (TLS {})", cfg.tls_mode()))
            .unwrap_or_default()
    );
    // systemd's Type=notify: ready once the NBD and admin sockets all listen.
    crate::notify::notify(&format!(
        "READY=1\nSTATUS=serving on {}",
        cfg.socket().display()
    ));
    std::thread::scope(|s| {
        s.spawn(|| on_ready(&running));
        while !signals.load(Ordering::SeqCst) && !running.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    crate::notify::notify("STOPPING=1\nSTATUS=finishing in-flight requests, saving the cache");
    log::info!("shutting down: finishing in-flight requests");
    // One deadline for all listeners and ublk devices: they stop taking requests at once,
    // then their requests get `limit` together.
    let ublk = lock(&running.ublk).take();
    let (abandoned, ublk_abandoned) = std::thread::scope(|s| {
        let devices = s.spawn(move || ublk.map_or(0, crate::ublk::Devices::stop_all));
        let stopping: Vec<_> = handles
            .into_iter()
            .map(|h| s.spawn(move || h.shutdown_within(Some(limit))))
            .collect();
        let sockets: usize = stopping.into_iter().map(|t| t.join().unwrap_or(0)).sum();
        (sockets, devices.join().unwrap_or(0))
    });
    if abandoned > 0 {
        log::warn!(
            "{abandoned} connection(s) still had a request running after {limit:?}; they were \
             closed without a reply"
        );
    }
    if ublk_abandoned > 0 {
        log::warn!("{ublk_abandoned} ublk device(s) left to the driver (see above)");
    }
    if let Some(m) = metrics_http {
        m.shutdown();
    }
    if let Err(e) = admin_file.remove_if_ours() {
        log::warn!("could not remove {}: {e}", cfg.admin().display());
    }
    let closed = close_within(&running, limit);
    admin::stopped();
    closed?;
    log::info!("closed cleanly");
    Ok(())
}

/// Closes the set (journal and checkpoint durable), giving up after `limit`: a device that
/// hangs the save must not hang the shutdown. Given up, the cache set is as after a crash,
/// which the next start recovers (nothing acknowledged as flushed is lost).
fn close_within(running: &Arc<Running>, limit: Duration) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let closer = running.clone();
    std::thread::Builder::new()
        .name("close".into())
        .spawn(move || {
            let _ = tx.send(closer.close());
        })
        .context("starting the thread that saves the cache set")?;
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => anyhow::bail!(
            "saving the cache set did not finish within {limit:?} (a hung device?); exiting \
             without it: the next start recovers from the journal, as after a crash"
        ),
    }
}
