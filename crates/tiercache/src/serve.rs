//! `tiercache serve`: opens a cache set and its backing devices, serves every attached volume
//! as an NBD export (named by its label, or uuid), runs the admin socket, tells systemd it is
//! ready (`notify`, under `Type=notify`), and shuts down cleanly on SIGINT/SIGTERM or
//! `tiercache stop`.
//!
//! Invariants: exports always mirror the set's attached volumes (attach/detach/label changes
//! re-sync them), and under `--ublk` the `/dev/ublkbN` devices mirror the exports; shutdown
//! order is stop accepting → finish in-flight requests (sockets and ublk devices together,
//! within `shutdown_timeout`) → close the cache set (journal + checkpoint durable, within it
//! again) → exit 0, so a restart finds the cache warm; TCP
//! binds to 127.0.0.1 unless an address is given. TLS (`tls_cert`, ...) applies to the TCP
//! listener only; the unix socket serves in clear, guarded by its permissions. With a
//! certificate and no `tls` mode, TLS is required; TLS settings that cannot take effect (a key
//! without a certificate, a CA without `tls_verify_peer`, TLS without `tcp`) stop the start. The server owns its devices for as long as
//! it has them open (exclusive locks, see `devices`): the cache and backing devices must be
//! distinct devices, and another server, `make`, `check` or `attach` of them is refused.
//! The cache set's failure and congestion limits (`io_error_limit`, `io_error_halflife`,
//! `cache_io_timeout_ms`, `congested_*_threshold_us`) are checked before any device is opened.
//! Every device is handed to the engine inside a timing wrapper and every export counts its
//! requests (`metrics`); with `metrics` set, `/metrics` is served over HTTP (loopback unless
//! an address is given), bound before the admin socket appears.
//!
//! Without the cache device: only with `without_cache_if_missing`, and only when the cache
//! device cannot be opened or its metadata cannot be loaded (never when another process owns
//! it), every backing device is served directly instead (see `without_cache` for what makes
//! that safe); admin commands that need the cache set then fail with a message saying why.

use crate::admin::{self, Control, Pending};
use crate::devices::Access;
use crate::export::VolumeExport;
use crate::metrics::{http::MetricsServer, Metrics};
use crate::without_cache::WithoutCache;
use anyhow::{Context, Result};
use blockdev::BlockDevice;
use engine::{CacheSet, Config};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `serve` settings, from the command line or a TOML file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Cache device (file or block device); empty: not given.
    #[serde(default)]
    pub cache: PathBuf,
    /// Backing devices: paths (files or block devices) or NBD URIs.
    #[serde(default)]
    pub backing: Vec<String>,
    /// The config file `backing` came from (`None`: from `--backing`), for messages that tell
    /// the operator where to name a device.
    #[serde(skip)]
    pub backing_file: Option<PathBuf>,
    /// Unix socket for NBD clients.
    pub socket: Option<PathBuf>,
    /// TCP address for NBD clients ("127.0.0.1:10809", or a port alone for 127.0.0.1).
    pub tcp: Option<String>,
    /// Admin socket (default: the NBD socket path with ".admin" appended).
    pub admin: Option<PathBuf>,
    /// Knobs per volume (by export name or uuid), applied and persisted at every start, e.g.
    /// `[volumes.data]` with `cache_mode = "writeback"`, `sequential_cutoff = "8M"`,
    /// `writeback_percent = 10`, `writeback_delay = 30`, `writeback_running = true`,
    /// `label = "data"`.
    #[serde(default)]
    pub volumes: BTreeMap<String, toml::Table>,
    /// Mode of the NBD socket, octal (default 0660, whatever the umask).
    pub socket_mode: Option<String>,
    /// Owner of the NBD socket: user name or uid (default: the server's user).
    pub socket_owner: Option<String>,
    /// Group of the NBD socket: group name or gid (default: the server's group).
    pub socket_group: Option<String>,
    /// Time without a request after which an NBD connection may be closed to make room for
    /// a new client when the server is full (default 30s). Durations are "30s", "5m", "1h
    /// 30m" (see [`parse_duration`]), or a number of seconds.
    #[serde(default, deserialize_with = "duration")]
    pub idle_timeout: Option<Duration>,
    /// Time after which an idle NBD connection is closed even when there is room (default:
    /// never; NBD clients such as the kernel's and qemu's keep idle connections for hours).
    #[serde(default, deserialize_with = "duration")]
    pub idle_close_after: Option<Duration>,
    /// NBD connections served at once, per listening socket (default 256; lowered to fit the
    /// descriptor limit).
    pub max_connections: Option<usize>,
    /// NBD connections one client may hold (default 32): a client is a user id on the unix
    /// socket, an IP address on TCP.
    pub max_connections_per_client: Option<usize>,
    /// Memory for the request and reply buffers of all NBD connections together (default
    /// 256M).
    pub request_memory: Option<String>,
    /// When the cache device cannot be opened (missing, an open or read error, metadata that
    /// does not load; not when another process owns it), serve every backing device directly
    /// instead of refusing to start — if every backing header says clean. The cache's copies
    /// are marked stale first and dropped when it is back (default false).
    #[serde(default)]
    pub without_cache_if_missing: bool,
    /// With `without_cache_if_missing`: also serve backing devices whose newest data is dirty
    /// in the missing cache, giving that data up (it is dropped when the cache is back; the
    /// volume returns the older data on the backing device meanwhile) (default false).
    #[serde(default)]
    pub without_cache_discard_dirty: bool,
    /// Start although the cache set holds dirty data of a backing device not named in
    /// `backing` (default false: such a start is refused, naming the device). The device is
    /// then listed as missing by `status` and the metrics until it is attached.
    #[serde(default)]
    pub allow_missing: bool,
    /// How long a shutdown waits for requests in flight, and then again for the cache set to
    /// be saved (default 30s; 1s to 1h). A request still running then (stuck in a hung
    /// device) has its connection closed without a reply; a save still running then is given
    /// up, and the next start recovers as after a crash.
    #[serde(default, deserialize_with = "duration")]
    pub shutdown_timeout: Option<Duration>,
    /// How plain (non-TLS) NBD connections are served: "uring" (io_uring event loops),
    /// "threads" (threads per connection) or "auto" (io_uring where the kernel allows it,
    /// else threads; default).
    pub data_path: Option<String>,
    /// Event-loop threads of the io_uring data path (default: one per CPU).
    pub ring_threads: Option<usize>,
    /// Cache-device failures (I/O errors, timeouts, checksum mismatches; decayed by
    /// `io_error_halflife`) at which the cache set is degraded: every volume is then served
    /// from its backing device (default 8, bcache's `io_error_limit`; 0: the first failure).
    pub io_error_limit: Option<u32>,
    /// Cache-device I/Os after which the failure count halves (default 100000; 0: never).
    pub io_error_halflife: Option<u64>,
    /// A cache-device I/O slower than this (ms) counts as failed, and one still in flight
    /// after it degrades the set (default 30000; 0: no limit; else 100 to 3600000).
    pub cache_io_timeout_ms: Option<u64>,
    /// Clean reads go to the backing device while the cache device's reads take longer than
    /// this on average (µs; default 2000; 0: never; at most 10000000).
    pub congested_read_threshold_us: Option<u64>,
    /// Writes that need not go to the cache device (all but writeback) go to the backing
    /// device alone while the cache device's writes take longer than this on average (µs;
    /// default 20000; 0: never; at most 10000000).
    pub congested_write_threshold_us: Option<u64>,
    /// Which read misses a full cache admits: "ghost" (blocks that missed recently too;
    /// default) or "all" (bcache's rule).
    pub admission: Option<String>,
    /// Which clean data a full cache gives up, by bucket: "lru" (default), "fifo" or "random".
    pub replacement: Option<String>,
    /// TLS for TCP clients (NBD_OPT_STARTTLS): "off", "on" (clients choose) or "require"
    /// (clients that do not start TLS are refused). Default: "require" with `tls_cert`, else
    /// "off".
    pub tls: Option<TlsMode>,
    /// The server's certificate (PEM, leaf first), for TLS on the TCP listener.
    pub tls_cert: Option<PathBuf>,
    /// The private key of `tls_cert` (PEM).
    pub tls_key: Option<PathBuf>,
    /// Admit only TLS clients whose certificate is issued by `tls_ca` (default false).
    #[serde(default)]
    pub tls_verify_peer: bool,
    /// CA certificate(s) (PEM) that client certificates must chain to, with `tls_verify_peer`.
    pub tls_ca: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at `/metrics` on this address ("127.0.0.1:9563",
    /// or a port alone for 127.0.0.1; default: none). See docs/metrics.md.
    pub metrics: Option<String>,
    /// Also serve each volume as a block device of this host, `/dev/ublkbN` (the kernel's
    /// ublk driver; N counts the volumes in name order from `ublk_first_id`), recovering the
    /// devices a server that died left (default false).
    #[serde(default)]
    pub ublk: bool,
    /// Hardware queues of each ublk device, one thread each (default 2; 1 to 32).
    pub ublk_queues: Option<u16>,
    /// The N of the first volume's `/dev/ublkbN` (default 0).
    pub ublk_first_id: Option<u32>,
    /// Take over backing devices whose header names another cache set, when it says that set
    /// holds no dirty data for them (`serve --take-over`; see docs/deploy.md). Command line
    /// only, never a config key: a take-over is decided once, for one start.
    #[serde(skip)]
    pub take_over: bool,
    /// With `take_over`: also when that set holds dirty data, which is given up
    /// (`--discard-dirty`). Command line only.
    #[serde(skip)]
    pub discard_dirty: bool,
}

/// This host's name (`gethostname`), cut to what a backing header records; empty if unknown.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that much.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let mut name = String::from_utf8_lossy(&buf[..end]).into_owned();
    while name.len() > engine::format::LABEL_BYTES {
        name.pop();
    }
    name
}

/// Whether the TCP listener offers TLS: the NBD spec's NOTLS, SELECTIVETLS and FORCEDTLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// No TLS.
    Off,
    /// TLS for clients that ask for it; others are served in clear.
    On,
    /// TLS before anything else; clients that do not start it are refused.
    Require,
}

impl std::fmt::Display for TlsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

impl ServeConfig {
    pub fn from_file(path: &Path) -> Result<ServeConfig> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let cfg: ServeConfig = toml::from_str(&text).map_err(|e| toml_error(path, &text, &e))?;
        Ok(ServeConfig {
            backing_file: Some(path.to_path_buf()),
            ..cfg
        })
    }

    /// Where the backing devices were named, as "not ..." completes it: "given with
    /// --backing", or "in the `backing` list of FILE".
    fn backing_named(&self) -> String {
        match &self.backing_file {
            None => "given with --backing".into(),
            Some(f) => format!("in the `backing` list of {}", f.display()),
        }
    }

    /// This configuration (from a file) with every setting `flags` gives (from the command
    /// line) in place of its own: a path, address or number given replaces the file's; a
    /// list given (`backing`) replaces the whole list; a switch given (true) turns the
    /// setting on. `volumes` come only from the file.
    pub fn overridden_by(self, flags: ServeConfig) -> ServeConfig {
        fn pick<T>(flag: Option<T>, file: Option<T>) -> Option<T> {
            flag.or(file)
        }
        ServeConfig {
            cache: if flags.cache.as_os_str().is_empty() {
                self.cache
            } else {
                flags.cache
            },
            backing_file: if flags.backing.is_empty() {
                self.backing_file
            } else {
                None
            },
            backing: if flags.backing.is_empty() {
                self.backing
            } else {
                flags.backing
            },
            socket: pick(flags.socket, self.socket),
            tcp: pick(flags.tcp, self.tcp),
            admin: pick(flags.admin, self.admin),
            volumes: self.volumes,
            socket_mode: pick(flags.socket_mode, self.socket_mode),
            socket_owner: pick(flags.socket_owner, self.socket_owner),
            socket_group: pick(flags.socket_group, self.socket_group),
            idle_timeout: pick(flags.idle_timeout, self.idle_timeout),
            idle_close_after: pick(flags.idle_close_after, self.idle_close_after),
            max_connections: pick(flags.max_connections, self.max_connections),
            max_connections_per_client: pick(
                flags.max_connections_per_client,
                self.max_connections_per_client,
            ),
            request_memory: pick(flags.request_memory, self.request_memory),
            without_cache_if_missing: flags.without_cache_if_missing
                || self.without_cache_if_missing,
            without_cache_discard_dirty: flags.without_cache_discard_dirty
                || self.without_cache_discard_dirty,
            allow_missing: flags.allow_missing || self.allow_missing,
            shutdown_timeout: pick(flags.shutdown_timeout, self.shutdown_timeout),
            data_path: pick(flags.data_path, self.data_path),
            ring_threads: pick(flags.ring_threads, self.ring_threads),
            io_error_limit: pick(flags.io_error_limit, self.io_error_limit),
            io_error_halflife: pick(flags.io_error_halflife, self.io_error_halflife),
            cache_io_timeout_ms: pick(flags.cache_io_timeout_ms, self.cache_io_timeout_ms),
            congested_read_threshold_us: pick(
                flags.congested_read_threshold_us,
                self.congested_read_threshold_us,
            ),
            congested_write_threshold_us: pick(
                flags.congested_write_threshold_us,
                self.congested_write_threshold_us,
            ),
            admission: pick(flags.admission, self.admission),
            replacement: pick(flags.replacement, self.replacement),
            tls: pick(flags.tls, self.tls),
            tls_cert: pick(flags.tls_cert, self.tls_cert),
            tls_key: pick(flags.tls_key, self.tls_key),
            tls_verify_peer: flags.tls_verify_peer || self.tls_verify_peer,
            tls_ca: pick(flags.tls_ca, self.tls_ca),
            metrics: pick(flags.metrics, self.metrics),
            ublk: flags.ublk || self.ublk,
            ublk_queues: pick(flags.ublk_queues, self.ublk_queues),
            ublk_first_id: pick(flags.ublk_first_id, self.ublk_first_id),
            take_over: flags.take_over,
            discard_dirty: flags.discard_dirty,
        }
    }

    /// The NBD server's limits and socket permissions: the defaults of
    /// `server::ServerConfig`, with what this configuration sets.
    pub fn server_config(&self) -> Result<server::ServerConfig> {
        let mut c = server::ServerConfig::default();
        if let Some(m) = &self.socket_mode {
            c.socket_perms.mode = crate::access::parse_mode(m)?;
        }
        if let Some(u) = &self.socket_owner {
            c.socket_perms.uid = Some(crate::access::parse_user(u)?);
        }
        if let Some(g) = &self.socket_group {
            c.socket_perms.gid = Some(crate::access::parse_group(g)?);
        }
        let positive = |what: &str, v: u64| {
            if v == 0 {
                anyhow::bail!("{what} must be at least 1")
            }
            Ok(v)
        };
        let longer_than_0 = |what: &str, t: Duration| {
            if t.is_zero() {
                anyhow::bail!("{what} must be longer than 0")
            }
            Ok(t)
        };
        if let Some(p) = &self.data_path {
            c.data_path = p
                .parse()
                .map_err(|e: String| anyhow::anyhow!("data_path: {e}"))?;
        }
        if let Some(n) = self.ring_threads {
            c.ring_threads = positive("ring_threads", n as u64)? as usize;
            if n > RING_THREADS_MAX {
                anyhow::bail!("ring_threads {n} is more than {RING_THREADS_MAX}");
            }
        }
        if let Some(t) = self.idle_timeout {
            c.idle_timeout = longer_than_0("idle_timeout", t)?;
        }
        if let Some(t) = self.idle_close_after {
            c.idle_close_after = Some(longer_than_0("idle_close_after", t)?);
        }
        if let Some(n) = self.max_connections {
            c.connections_max = positive("max_connections", n as u64)? as usize;
        }
        if let Some(n) = self.max_connections_per_client {
            c.connections_per_client_max =
                positive("max_connections_per_client", n as u64)? as usize;
        }
        if let Some(m) = &self.request_memory {
            let bytes = crate::units::parse_size(m).map_err(|e| anyhow::anyhow!(e))?;
            if bytes < REQUEST_MEMORY_MIN {
                anyhow::bail!(
                    "request_memory {m} is too small (at least {} for one largest request)",
                    crate::units::human(REQUEST_MEMORY_MIN)
                );
            }
            let physical = physical_memory();
            if bytes > physical {
                anyhow::bail!(
                    "request_memory {m} is more than this machine's memory ({}): it is what \
                     requests in flight may hold",
                    crate::units::human(physical)
                );
            }
            c.bytes_in_flight_max = usize::try_from(bytes).context("request_memory")?;
            c.connection_bytes_in_flight_max = c
                .connection_bytes_in_flight_max
                .min(c.bytes_in_flight_max / 2);
        }
        Ok(c)
    }

    pub fn socket(&self) -> PathBuf {
        self.socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET))
    }

    pub fn admin(&self) -> PathBuf {
        self.admin
            .clone()
            .unwrap_or_else(|| admin_for(&self.socket()))
    }

    /// How `serve` treats backing devices another cache set owns.
    pub fn attach_options(&self) -> engine::AttachOptions {
        engine::AttachOptions {
            take_over: self.take_over,
            discard_dirty: self.take_over && self.discard_dirty,
        }
    }

    /// The cache set's settings: the engine's defaults, with the failure and congestion
    /// limits this configuration sets (checked against the ranges `--help` gives), and this
    /// host's name (recorded in the backing headers the set owns).
    pub fn engine_config(&self) -> Result<Config> {
        let mut c = Config {
            host_name: host_name(),
            ..Config::default()
        };
        let at_most = |what: &str, v: u64, max: u64| {
            if v > max {
                anyhow::bail!("{what} {v} is too large (at most {max})")
            }
            Ok(v)
        };
        if let Some(n) = self.io_error_limit {
            c.io_error_limit = at_most("io_error_limit", n.into(), IO_ERROR_LIMIT_MAX)? as u32;
        }
        if let Some(n) = self.io_error_halflife {
            c.io_error_halflife = n;
        }
        if let Some(ms) = self.cache_io_timeout_ms {
            if ms != 0 && ms < CACHE_IO_TIMEOUT_MIN_MS {
                anyhow::bail!(
                    "cache_io_timeout_ms {ms} is too short (0 for no limit, else at least \
                     {CACHE_IO_TIMEOUT_MIN_MS}: a busy device would count as failing)"
                );
            }
            c.cache_io_timeout_ms = at_most("cache_io_timeout_ms", ms, CACHE_IO_TIMEOUT_MAX_MS)?;
        }
        if let Some(us) = self.congested_read_threshold_us {
            c.congested_read_threshold_us = at_most(
                "congested_read_threshold_us",
                us,
                CONGESTED_THRESHOLD_MAX_US,
            )?;
        }
        if let Some(a) = &self.admission {
            c.admission = engine::policy::Admission::parse(a).ok_or_else(|| {
                anyhow::anyhow!("admission {a:?} is not one of \"ghost\", \"all\"")
            })?;
        }
        if let Some(r) = &self.replacement {
            c.replacement = engine::policy::Replacement::parse(r).ok_or_else(|| {
                anyhow::anyhow!("replacement {r:?} is not one of \"lru\", \"fifo\", \"random\"")
            })?;
        }
        if let Some(us) = self.congested_write_threshold_us {
            c.congested_write_threshold_us = at_most(
                "congested_write_threshold_us",
                us,
                CONGESTED_THRESHOLD_MAX_US,
            )?;
        }
        Ok(c)
    }

    /// How long a shutdown waits for requests in flight, and then for the save.
    pub fn shutdown_timeout(&self) -> Result<Duration> {
        let t = self.shutdown_timeout.unwrap_or(SHUTDOWN_TIMEOUT_DEFAULT);
        if !(SHUTDOWN_TIMEOUT_MIN..=SHUTDOWN_TIMEOUT_MAX).contains(&t) {
            anyhow::bail!(
                "shutdown_timeout {} is out of range ({} to {})",
                humantime::format_duration(t),
                humantime::format_duration(SHUTDOWN_TIMEOUT_MIN),
                humantime::format_duration(SHUTDOWN_TIMEOUT_MAX)
            );
        }
        Ok(t)
    }

    fn check(&self) -> Result<()> {
        self.shutdown_timeout()?;
        if self.without_cache_discard_dirty && !self.without_cache_if_missing {
            anyhow::bail!(
                "without_cache_discard_dirty applies only with without_cache_if_missing \
                 (--without-cache-discard-dirty needs --without-cache-if-missing)"
            );
        }
        self.engine_config()?;
        self.server_config()?;
        // The TLS files are read (and their key checked against the certificate) now.
        self.tls_config()?;
        if let Some(t) = &self.tcp {
            let addr = parse_tcp(t)?;
            probe_bind(addr).with_context(|| format!("cannot listen on tcp {addr}"))?;
        }
        if let Some(m) = &self.metrics {
            let addr = crate::metrics::http::parse_addr(m)?;
            probe_bind(addr).with_context(|| format!("cannot serve metrics on {addr}"))?;
        }
        for (what, path) in [
            ("NBD socket", self.socket()),
            ("admin socket", self.admin()),
        ] {
            server::check_unix_path(&path).with_context(|| format!("the {what}"))?;
        }
        parse_volume_knobs(&self.volumes)?;
        Ok(())
    }

    /// The TLS mode in force: the one given, else `require` with a certificate, else `off`.
    pub fn tls_mode(&self) -> TlsMode {
        self.tls.unwrap_or(if self.tls_cert.is_some() {
            TlsMode::Require
        } else {
            TlsMode::Off
        })
    }

    /// TLS settings that cannot take effect as written are an error, not ignored.
    fn check_tls(&self) -> Result<()> {
        let mode = self.tls_mode();
        if self.tls_verify_peer != self.tls_ca.is_some() {
            anyhow::bail!(
                "tls_verify_peer and tls_ca go together: the CA is the one client certificates \
                 must chain to (--tls-verify-peer --tls-ca FILE)"
            );
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) | (None, Some(_)) => {
                anyhow::bail!("tls_cert and tls_key go together (--tls-cert FILE --tls-key FILE)")
            }
            (None, None) if mode != TlsMode::Off => anyhow::bail!(
                "tls = \"{mode}\" needs the server's certificate and key (--tls-cert FILE \
                 --tls-key FILE)"
            ),
            _ => {}
        }
        if mode == TlsMode::Off && self.tls_verify_peer {
            anyhow::bail!("tls_verify_peer applies only with TLS on or required");
        }
        if mode != TlsMode::Off && self.tcp.is_none() {
            anyhow::bail!(
                "TLS is for TCP clients and needs tcp (--tcp PORT); the unix socket serves in \
                 clear, guarded by its permissions"
            );
        }
        Ok(())
    }

    /// The TCP listener's TLS, its files read (`None` when TLS is off).
    pub fn tls_config(&self) -> Result<Option<server::TlsConfig>> {
        self.check_tls()?;
        let mode = self.tls_mode();
        let (Some(cert), Some(key), false) = (&self.tls_cert, &self.tls_key, mode == TlsMode::Off)
        else {
            return Ok(None);
        };
        let credentials = server::ServerTls::load(cert, key, self.tls_ca.as_deref())
            .context("loading the TLS certificate")?;
        Ok(Some(server::TlsConfig {
            credentials,
            required: mode == TlsMode::Require,
        }))
    }
}

/// A TOML error on one line: file, line and column, and what is wrong (the toml crate's own
/// rendering draws the line over five).
fn toml_error(path: &Path, text: &str, e: &toml::de::Error) -> anyhow::Error {
    let message =
        unknown_key(e.message().trim()).unwrap_or_else(|| e.message().trim().replace('\n', "; "));
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            anyhow::anyhow!("{}:{line}:{column}: {message}", path.display())
        }
        None => anyhow::anyhow!("{}: {message}", path.display()),
    }
}

/// serde's "unknown field `x`, expected one of `a`, `b`, ..." (every key there is) as
/// "unknown key `x`; did you mean `a`?", naming the nearest key only, or where the keys are
/// listed when none is near; `None` for any other message.
fn unknown_key(message: &str) -> Option<String> {
    let (key, rest) = message.strip_prefix("unknown field `")?.split_once('`')?;
    // "one of `a`, `b`" or "`a` or `b`": the names are every other piece between backticks.
    let keys = rest
        .strip_prefix(", expected ")?
        .split('`')
        .skip(1)
        .step_by(2);
    let nearest = keys
        .map(|k| (strsim::jaro(key, k), k))
        .filter(|(score, _)| *score > 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    Some(match nearest {
        Some((_, k)) => format!("unknown key `{key}`; did you mean `{k}`?"),
        None => format!(
            "unknown key `{key}` (the keys are the long options of `tiercache serve --help` \
             with '_' for '-', and [volumes.NAME] tables)"
        ),
    })
}

/// Most event-loop threads of the io_uring data path.
const RING_THREADS_MAX: usize = 256;

/// `shutdown_timeout` unless set, and its range.
const SHUTDOWN_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
const SHUTDOWN_TIMEOUT_MIN: Duration = Duration::from_secs(1);
const SHUTDOWN_TIMEOUT_MAX: Duration = Duration::from_secs(3600);

/// A duration as `serve` takes one (`idle_timeout`, `idle_close_after`, `shutdown_timeout`,
/// on the command line and in the config file): humantime's form ("30s", "5m", "1h 30m",
/// "500ms"), or a plain number, which is seconds (as these settings were first given).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(t).map_err(|e| {
        format!("'{s}' is not a duration ({e}): give one like 30s, 5m or 1h 30m, or seconds")
    })
}

/// Deserializes an optional duration of the config file: a string [`parse_duration`] takes,
/// or an integer (seconds).
fn duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    struct Visitor;
    impl serde::de::Visitor<'_> for Visitor {
        type Value = Duration;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a duration such as \"30s\" or \"5m\", or a number of seconds")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_secs(v))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_secs)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Duration, E> {
            parse_duration(v).map_err(E::custom)
        }
    }
    d.deserialize_any(Visitor).map(Some)
}

/// Largest `io_error_limit`.
const IO_ERROR_LIMIT_MAX: u64 = 1_000_000;
/// Shortest `cache_io_timeout_ms` other than 0 (no limit), and the longest.
const CACHE_IO_TIMEOUT_MIN_MS: u64 = 100;
const CACHE_IO_TIMEOUT_MAX_MS: u64 = 3_600_000;
/// Largest congestion threshold (10 s).
const CONGESTED_THRESHOLD_MAX_US: u64 = 10_000_000;

pub const DEFAULT_SOCKET: &str = "/tmp/tiercache.sock";

/// Smallest `request_memory`: room for two of the largest NBD requests (32 MiB each).
const REQUEST_MEMORY_MIN: u64 = 64 << 20;

/// Bytes of physical memory (`u64::MAX` when the system does not say).
fn physical_memory() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || page <= 0 {
        return u64::MAX;
    }
    (pages as u64).saturating_mul(page as u64)
}

/// The admin socket that goes with an NBD socket.
pub fn admin_for(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".admin");
    PathBuf::from(s)
}

/// Parses a TCP listen address; a bare port means 127.0.0.1.
pub fn parse_tcp(s: &str) -> Result<std::net::SocketAddr> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse()
        .with_context(|| format!("'{s}' is not an address like 127.0.0.1:10809"))
}

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

/// The config file's `[volumes.NAME]` knobs, parsed and validated (by volume name).
fn parse_volume_knobs(
    volumes: &BTreeMap<String, toml::Table>,
) -> Result<Vec<(String, Vec<engine::Knob>)>> {
    let mut parsed = Vec::new();
    for (name, table) in volumes {
        let mut knobs = Vec::new();
        for (key, value) in table {
            let text = match value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => anyhow::bail!(
                    "config [volumes.{name}] {key}: expected a string, integer or boolean, got {}",
                    other.type_str()
                ),
            };
            let knob = admin::parse_knob(key, &text)
                .with_context(|| format!("config [volumes.{name}]"))?;
            knob.validate()
                .with_context(|| format!("config [volumes.{name}]"))?;
            knobs.push(knob);
        }
        parsed.push((name.clone(), knobs));
    }
    Ok(parsed)
}

/// Binds `addr` and lets it go: an address that is in use, not local or not allowed fails
/// now, before any device is opened, not after recovery.
fn probe_bind(addr: std::net::SocketAddr) -> Result<()> {
    std::net::TcpListener::bind(addr).map(drop)?;
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
