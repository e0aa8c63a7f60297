//! `serve`'s settings: the command line's flags and the TOML config file (`--config`), how
//! the two merge (`overridden_by`: a setting given on the command line replaces the file's),
//! and the checks that run before anything is opened.
//!
//! Invariants: every setting is checked (`check`) before any device is opened: ranges and
//! combinations, the `[volumes.NAME]` knobs (parsed and validated, not applied), and the TCP
//! and metrics addresses (bound once and let go). TCP binds to 127.0.0.1 unless an address is
//! given. TLS (`tls_cert`, ...) applies to the TCP listener only; with a certificate and no
//! `tls` mode, TLS is required; TLS settings that cannot take effect (a key without a
//! certificate, a CA without `tls_verify_peer`, TLS without `tcp`) stop the start. The cache
//! set's failure and congestion limits (`io_error_limit`, `io_error_halflife`,
//! `cache_io_timeout_ms`, `congested_*_threshold_us`) are among those checks. A config file
//! error names the file, line and column, and an unknown key the nearest known one. This
//! module only reads and checks settings: it starts nothing (see the parent module).

use crate::admin::{self, admin_for};
use anyhow::{Context, Result};
use engine::Config;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
    pub(crate) fn backing_named(&self) -> String {
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

    pub(crate) fn check(&self) -> Result<()> {
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

/// Parses a TCP listen address; a bare port means 127.0.0.1.
pub fn parse_tcp(s: &str) -> Result<std::net::SocketAddr> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse()
        .with_context(|| format!("'{s}' is not an address like 127.0.0.1:10809"))
}

/// The config file's `[volumes.NAME]` knobs, parsed and validated (by volume name).
pub(crate) fn parse_volume_knobs(
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
