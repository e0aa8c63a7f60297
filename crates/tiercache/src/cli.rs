//! The command line: every subcommand, option and help text of `tiercache` (the clap
//! definitions), and how it is parsed ([`parse_args`]).
//!
//! Owns: the names, defaults and wording users see in `--help`, the man pages and the shell
//! completions (`generate` renders them from [`Cli`]), and the one-line form of a command
//! line mistake.
//!
//! Invariants: definitions only — no device is opened and nothing is run here; `main`
//! dispatches each [`Cmd`] to the module that does it. A default stated in a help text is the
//! engine's (the test at the end checks the knob table and the health defaults against it).

use crate::units::parse_size;
use crate::{bench, client, serve};
use anyhow::Result;
use clap::{CommandFactory, Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "tiercache",
    version = env!("TIERCACHE_VERSION"),
    about = "A crash-safe userspace block cache: a fast device caching slow ones, served over NBD",
    long_about = "tiercache keeps the hot blocks of slow backing devices (HDDs, disk images) on a fast \
cache device (an SSD, or a file on one), like Linux bcache but in userspace, with checksums on \
all cached data and metadata and a journal that survives crashes.\n\n\
Try it with `tiercache demo`. For your own devices: `tiercache make --backing SLOW --cache \
FAST --label NAME`, then `tiercache serve --cache FAST --backing SLOW` and connect any NBD \
client to nbd+unix:///NAME?socket=/tmp/tiercache.sock; watch and tune it with `tiercache \
status`, `tiercache get` and `tiercache set`.\n\n\
Commands that talk to a running server find its admin socket from --admin, else --config \
FILE (the `serve` configuration), else $TIERCACHE_ADMIN, else /etc/tiercache/tiercache.toml \
if it exists, else /tmp/tiercache.sock.admin. Every command that reports something takes \
--json."
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Who may connect to `serve` and how much one client may take.
#[derive(clap::Args)]
pub struct ServeLimits {
    /// Permissions of the NBD socket, octal, set before the socket appears whatever the umask
    /// [default: 0660].
    #[arg(long)]
    pub socket_mode: Option<String>,
    /// Owner of the NBD socket (user name or uid) [default: the server's user].
    #[arg(long)]
    pub socket_owner: Option<String>,
    /// Group of the NBD socket (group name or gid) [default: the server's group].
    #[arg(long)]
    pub socket_group: Option<String>,
    /// Time without a request after which an NBD connection may be closed to make room for a
    /// new client when the server is full [default: 30s]. Durations here and in the config
    /// file: 30s, 5m, 1h 30m, 500ms (a plain number is seconds).
    #[arg(long, value_name = "DURATION", value_parser = serve::parse_duration)]
    pub idle_timeout: Option<Duration>,
    /// Close an idle NBD connection after this long even when there is room (a duration:
    /// 10m, 2h) [default: never].
    #[arg(long, value_name = "DURATION", value_parser = serve::parse_duration)]
    pub idle_close_after: Option<Duration>,
    /// NBD connections served at once, per listening socket (lowered to fit the descriptor
    /// limit) [default: 256].
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// NBD connections one client may hold (a user id on the unix socket, an IP address on
    /// TCP) [default: 32].
    #[arg(long)]
    pub max_connections_per_client: Option<usize>,
    /// Memory for the request and reply buffers of all NBD connections together [default:
    /// 256M].
    #[arg(long)]
    pub request_memory: Option<String>,
    /// How long a shutdown (SIGTERM, `tiercache stop`) waits for requests in flight, and then
    /// again for the cache to be saved: a duration, 1s to 1h (30s, 2m; a plain number is
    /// seconds) [default: 30s]. A request still running then (stuck in a hung device) has its
    /// connection closed without a reply; a save still running then is given up and the next
    /// start recovers as after a crash.
    #[arg(long, value_name = "DURATION", value_parser = serve::parse_duration)]
    pub shutdown_timeout: Option<Duration>,
    /// How plain (non-TLS) NBD connections are served: `uring` (io_uring event loops; cache
    /// hits are read with no thread hand-over), `threads` (threads per connection), or `auto`
    /// (io_uring where the kernel allows it, else threads, logged once) [default: auto].
    #[arg(long, env = "TIERCACHE_DATA_PATH")]
    pub data_path: Option<String>,
    /// Event-loop threads of the io_uring data path, connections spread over them [default:
    /// one per CPU].
    #[arg(long)]
    pub ring_threads: Option<usize>,
}

/// When the cache device counts as failing or slow (bcache's names and defaults). A failing
/// cache device degrades the cache set: every volume is then served from its backing device,
/// except ranges whose only current copy is dirty data on the cache device (those fail with
/// EIO) until `tiercache readmit` puts the repaired device back in service.
#[derive(clap::Args)]
pub struct ServeHealth {
    /// Cache-device failures (I/O errors, timeouts, checksum mismatches), decayed by
    /// --io-error-halflife, at which the cache set is degraded (0: the first failure).
    /// Below it, a failed cache read of clean data is served from the backing device and a
    /// failed cache write in writethrough or writearound goes on without the cache.
    /// [default: 8]
    #[arg(long)]
    pub io_error_limit: Option<u32>,
    /// Cache-device I/Os after which the failure count halves (0: it never decays) [default:
    /// 100000].
    #[arg(long)]
    pub io_error_halflife: Option<u64>,
    /// Milliseconds after which a cache-device I/O counts as failed; one still in flight after
    /// this degrades the cache set (a hung device). 0: no limit; else 100 to 3600000
    /// [default: 30000].
    #[arg(long)]
    pub cache_io_timeout_ms: Option<u64>,
    /// While the cache device's reads take longer than this on average (microseconds), clean
    /// reads are served by the backing device instead (dirty data is still read from the
    /// cache). 0: never; at most 10000000 [default: 2000].
    #[arg(long)]
    pub congested_read_threshold_us: Option<u64>,
    /// While the cache device's writes take longer than this on average (microseconds),
    /// writes in writethrough and writearound go to the backing device alone (writeback writes
    /// still go to the cache). 0: never; at most 10000000 [default: 20000].
    #[arg(long)]
    pub congested_write_threshold_us: Option<u64>,
    /// Which read misses a full cache admits: ghost (only blocks that also missed recently,
    /// so one-time reads and scans do not evict what is used again) or all (every miss,
    /// bcache's rule). While the cache has room every miss is admitted, and so are misses of
    /// sequential streams and of devices whose miss fills are measured to be read soon
    /// [default: ghost].
    #[arg(long, value_parser = ["ghost", "all"])]
    pub admission: Option<String>,
    /// Which clean data a full cache gives up, by bucket: lru (least recently read or
    /// written), fifo (written longest ago) or random (bcache's cache_replacement_policy)
    /// [default: lru].
    #[arg(long, value_parser = ["lru", "fifo", "random"])]
    pub replacement: Option<String>,
}

/// TLS for TCP clients (NBD's STARTTLS). The unix socket always serves in clear.
#[derive(clap::Args)]
pub struct ServeTls {
    /// TLS for TCP clients: off; on (clients that ask get TLS, others are served in clear);
    /// require (clients that do not start TLS are refused with NBD_REP_ERR_TLS_REQD)
    /// [default: require with --tls-cert, else off].
    #[arg(long, value_enum, value_name = "MODE")]
    pub tls: Option<serve::TlsMode>,
    /// The server's certificate for TLS (PEM, leaf first; needs --tcp).
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Admit only TLS clients with a certificate issued by --tls-ca.
    #[arg(long)]
    pub tls_verify_peer: bool,
    /// CA certificate(s) (PEM) that client certificates must chain to (with
    /// --tls-verify-peer).
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
}

/// Where a running server's admin socket is, and how to print its answer.
#[derive(clap::Args)]
pub struct AdminArgs {
    /// Admin socket of the running `tiercache serve`. Without it: from --config, else
    /// $TIERCACHE_ADMIN, else from /etc/tiercache/tiercache.toml if it exists, else
    /// /tmp/tiercache.sock.admin (serve's default).
    #[arg(long)]
    pub admin: Option<PathBuf>,
    /// The `serve` configuration file whose admin socket (`admin`, or `socket` + ".admin")
    /// to use.
    #[arg(long, conflicts_with = "admin")]
    pub config: Option<PathBuf>,
    /// Print the server's reply as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl AdminArgs {
    pub fn target(&self) -> Result<client::Admin> {
        Ok(client::Admin {
            socket: client::admin_socket(
                self.admin.as_deref(),
                self.config.as_deref(),
                std::env::var_os(client::ADMIN_ENV),
                Path::new(client::SYSTEM_CONFIG),
            )?,
            json: self.json,
        })
    }
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Serve every attached backing device as an NBD export (named by its label or uuid).
    ///
    /// SIGINT or SIGTERM (`systemctl stop`) stops it cleanly: in-flight requests finish, the
    /// cache is saved, exit status 0. Under systemd (`Type=notify`, $NOTIFY_SOCKET) it reports
    /// READY=1 once every socket listens. See contrib/systemd for a unit and a config.
    Serve {
        /// Cache device (as formatted by `make`); required unless --config names one.
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Backing device(s) to attach and serve.
        #[arg(long)]
        backing: Vec<String>,
        /// Unix socket for NBD clients [default: /tmp/tiercache.sock].
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Also listen on TCP: a port (bound to 127.0.0.1) or ADDRESS:PORT.
        #[arg(long)]
        tcp: Option<String>,
        /// Admin socket for `tiercache status/set/...` (default: SOCKET.admin); always 0600.
        #[arg(long)]
        admin: Option<PathBuf>,
        /// Serve Prometheus metrics at http://ADDRESS:PORT/metrics: a port (bound to
        /// 127.0.0.1) or ADDRESS:PORT (see docs/metrics.md).
        #[arg(long)]
        metrics: Option<String>,
        /// Also serve each volume as a block device of this host, /dev/ublkbN (Linux's ublk
        /// driver, 6.5+; root): N counts the volumes in name order from --ublk-first-id. A
        /// device left by a server that died is taken over (user recovery).
        #[arg(long)]
        ublk: bool,
        /// Hardware queues of each ublk device, one thread each (1 to 32) [default: 2].
        #[arg(long, requires = "ublk")]
        ublk_queues: Option<u16>,
        /// The N of the first volume's /dev/ublkbN [default: 0].
        #[arg(long, requires = "ublk")]
        ublk_first_id: Option<u32>,
        #[command(flatten)]
        limits: ServeLimits,
        #[command(flatten)]
        health: Box<ServeHealth>,
        #[command(flatten)]
        tls: Box<ServeTls>,
        /// If the cache device cannot be opened (missing, an open or read error, metadata that
        /// does not load; not when another process holds it), serve every backing device
        /// directly instead of refusing to start, under the same export names. Only backing
        /// devices whose header says clean are served (see --without-cache-discard-dirty).
        /// Before anything is written, each header records that the cache's copies are stale,
        /// so when the cache device is back, `serve` drops them and reads return the data
        /// written meanwhile. `status` shows the volumes as served without cache; `set`,
        /// `attach`, `detach` and `stats` need the cache and fail.
        #[arg(long)]
        without_cache_if_missing: bool,
        /// With --without-cache-if-missing: also serve backing devices marked dirty, whose
        /// newest data is in the missing cache device. That data is given up: the volume
        /// returns the older data on the backing device, and when the cache device is back its
        /// dirty copies are dropped. Without this option such a device stops the start, unless
        /// its dirty data was given up at an earlier start (its header records that).
        #[arg(long, requires = "without_cache_if_missing")]
        without_cache_discard_dirty: bool,
        /// Start although the cache set holds dirty data of a backing device not named by
        /// --backing (attached earlier, then left out). Without it such a start is refused,
        /// naming the device: its newest data is only in the cache. With it the device is
        /// listed as missing by `status` (and the metrics) until it is attached again
        /// (`tiercache attach`); its data stays in the cache meanwhile.
        #[arg(long)]
        allow_missing: bool,
        /// Take over a --backing device whose header names another cache set (its host is
        /// gone for good: you guarantee it is stopped), if that header says the set holds no
        /// dirty data for it; else the start is refused, naming the set and the amount. The
        /// other set's cache is never read. Not a config key. See docs/deploy.md.
        #[arg(long)]
        take_over: bool,
        /// With --take-over: also take a device whose other set holds dirty data for it, giving
        /// that data up (the device serves what it holds, older data where that cache had
        /// newer). Not a config key.
        #[arg(long, requires = "take_over")]
        discard_dirty: bool,
        /// Read settings from a TOML file: the keys are the long options above with '_' for
        /// '-' (cache, backing = [...], socket, tcp, admin, socket_mode, ..., request_memory,
        /// io_error_limit, ..., congested_write_threshold_us, admission = "ghost",
        /// replacement = "lru", tls = "require", tls_cert, tls_key, tls_verify_peer = true,
        /// tls_ca, metrics, without_cache_if_missing = true, without_cache_discard_dirty =
        /// true, allow_missing = true, ublk = true, ublk_queues, ublk_first_id), plus per-volume knobs in [volumes.NAME] tables (see
        /// README). An option also given on the command line overrides the file's key
        /// (--backing replaces the file's whole list; a switch such as --allow-missing turns
        /// the key on), so an operator can change one setting for one start without editing
        /// the file.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Quickstart: make slow and fast file-backed devices, serve them, show the cache working.
    Demo {
        /// Directory for the demo's device files and sockets.
        #[arg(long, default_value = "tiercache-demo")]
        dir: PathBuf,
        /// Size of the slow (emulated HDD) device.
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// Exit after the workload instead of serving until Ctrl-C.
        #[arg(long)]
        no_serve: bool,
    },
    /// Benchmark hdd, ssd, tiercache (writethrough/writeback/writearound) and nbdkit-cache on
    /// an emulated disk with the field's workloads (see docs/benchmarks.md).
    Bench(bench::BenchArgs),
    /// Serve a file over NBD through a latency model of a slow disk (hdd) or flash (ssd).
    Emulate {
        #[arg(value_enum)]
        kind: EmulateKind,
        /// Backing file (created with --size if it does not exist).
        #[arg(long)]
        file: PathBuf,
        /// Size of the file to create.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Unix socket to serve on.
        #[arg(long)]
        socket: PathBuf,
        /// Export name.
        #[arg(long, default_value = "disk")]
        name: String,
        /// HDD: seek time between adjacent tracks (ms).
        #[arg(long, default_value_t = 0.5)]
        track_to_track_ms: f64,
        /// HDD: seek time across the whole disk (ms).
        #[arg(long, default_value_t = 15.0)]
        full_stroke_ms: f64,
        /// HDD: spindle speed; rotational delay is uniform in one revolution.
        #[arg(long, default_value_t = 7200.0)]
        rpm: f64,
        /// Sequential transfer rate (MB/s); default 180 for hdd, 1500 for ssd.
        #[arg(long)]
        transfer_mb_s: Option<f64>,
        /// SSD: fixed latency per request (microseconds).
        #[arg(long, default_value_t = 80.0)]
        latency_us: f64,
        /// Seed of the HDD model's rotational delays.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The ROTATIONAL flag the export reports (default: true for hdd, false for ssd);
        /// `--rotational false` gives a seek-bound disk that does not say so.
        #[arg(long)]
        rotational: Option<bool>,
    },
    /// A running server's cache device, health and volumes (or, when it serves without its
    /// cache device, why, and the volumes it serves directly).
    ///
    /// The cache device's size is split into dirty + clean + unused + metadata, which add up
    /// to it; `in_use` beside them is bcache's bucket count (buckets not on the free list,
    /// also partly filled or stale ones), so it can be high while little is cached. Each
    /// volume shows its size, mode, state, dirty and cached data, hit ratio, its knobs, and
    /// writeback as `paused` (writeback_running off), `failing` (writes to the backing
    /// device keep failing), `idle` (nothing dirty), `delayed` (dirty data waiting out
    /// writeback_delay) or the rate it writes back at, in MB/s over the last 5 s.
    Status {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// A live view of a running server in 80x24, refreshed every second (q quits).
    ///
    /// Per volume: reads per second as `stats` counts them (R hit: cache_hits, R miss:
    /// cache_misses, R byp: cache_bypass_hits + cache_bypass_misses), writes per second by
    /// where they went (W wb: the cache alone, W wt: both devices, W byp: the backing device
    /// alone), their MiB/s, the hit ratio over the interval (HIT%, as `stats` computes it),
    /// latency percentiles; dirty data, its change per second over the interval and a
    /// sparkline of the last refreshes; writeback as `status` names it (idle: nothing dirty)
    /// with the bytes written back per second; cached data and the volume's state. Above
    /// them the cache device's occupancy and health. Sizes are in KiB/MiB/GiB (K, M, G).
    Top {
        #[command(flatten)]
        admin: AdminArgs,
        /// Print the view once, from two samples an interval apart, and exit (with --json:
        /// the counts over the interval as well as the rates).
        #[arg(long)]
        once: bool,
        /// Seconds between samples (0.1 to 60).
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Statistics (bcache's names) for total, five_minute, hour and day: sizes in KiB, MiB,
    /// GiB (--bytes: raw byte counts).
    Stats {
        #[command(flatten)]
        admin: AdminArgs,
        /// Print every value as a raw number (bytes, counts) instead of in human units.
        #[arg(long)]
        bytes: bool,
    },
    /// Print the knobs of a device (all of them, or the value of one, as `set` accepts it).
    #[command(after_long_help = KNOB_TABLE)]
    Get {
        #[command(flatten)]
        admin: AdminArgs,
        /// The volume: its export name (label) or uuid, as `status` lists it.
        #[arg(value_name = "VOLUME")]
        device: String,
        /// The knob to print (all of them without it).
        #[arg(value_parser = engine::Knob::NAMES)]
        knob: Option<String>,
    },
    /// Change a knob of a device live; it is checked, applied and saved in the backing
    /// device's header at once (see the table below).
    #[command(after_long_help = KNOB_TABLE)]
    Set {
        #[command(flatten)]
        admin: AdminArgs,
        /// The volume: its export name (label) or uuid, as `status` lists it.
        #[arg(value_name = "VOLUME")]
        device: String,
        /// The knob to change: cache_mode, sequential_cutoff, writeback_percent,
        /// writeback_delay, writeback_running or label (values and defaults below).
        #[arg(value_parser = engine::Knob::NAMES)]
        knob: String,
        /// The new value (sizes take suffixes: 8M; booleans 1/0, on/off, true/false).
        #[arg(allow_hyphen_values = true)]
        value: String,
    },
    /// Reset a volume's statistics (bcache's clear_stats): `stats` and `status` count from
    /// now on, in every window (total, five_minute, hour, day). The Prometheus counters of
    /// `serve --metrics` are not reset (counters only grow; rates from them are unaffected).
    ClearStats {
        #[command(flatten)]
        admin: AdminArgs,
        /// The volume: its export name (label) or uuid, as `status` lists it.
        #[arg(value_name = "VOLUME")]
        device: String,
    },
    /// Write back all dirty data of a device, then remove it from the cache set (its
    /// backing device then holds all its data and can be used alone or attached again).
    Detach {
        #[command(flatten)]
        admin: AdminArgs,
        /// The volume: its export name (label) or uuid, as `status` lists it.
        #[arg(value_name = "VOLUME")]
        device: String,
    },
    /// Attach a formatted backing device to the running cache set and export it.
    ///
    /// The device is one formatted by `make` (alone, without --cache, or with this set's
    /// cache device), one detached from this set, or one this set lists as missing. A device
    /// whose header names another cache set is refused, unless --take-over. Name it in `serve
    /// --backing` (or the config file) too, so that it is served after a restart.
    Attach {
        #[command(flatten)]
        admin: AdminArgs,
        /// Take over a device whose header names another cache set (its host is gone for
        /// good: you guarantee it is stopped), if that header says the set holds no dirty data
        /// for it; else refused, naming the set and the amount. See docs/deploy.md.
        #[arg(long)]
        take_over: bool,
        /// With --take-over: also when the other set holds dirty data for it, giving that data
        /// up.
        #[arg(long, requires = "take_over")]
        discard_dirty: bool,
        /// The backing device: a block device, an image file or an NBD URI, as `make
        /// --backing` took it (a relative path is taken from the current directory).
        #[arg(value_name = "BACKING", value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
    },
    /// Take in a backing device that grew (a bigger image file, an extended LV): its header
    /// records the new size, and clients that connect from then on see it (connected clients
    /// keep the size they negotiated). A device never shrinks. A restart takes in a device
    /// that grew while it was not served, too.
    Resize {
        #[command(flatten)]
        admin: AdminArgs,
        /// Export name or uuid.
        device: String,
    },
    /// Put a repaired cache device back in service after the cache set was degraded (by
    /// failures or `degrade`): its clean copies are dropped as stale, what the set holds is
    /// checkpointed, and volumes are served through the cache again. Fails, and the set stays
    /// degraded, if the cache device still fails.
    Readmit {
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Take the cache device out of service (one you distrust, or before replacing it): the
    /// cache set is degraded and serves every volume from its backing device, except ranges
    /// whose only current copy is dirty data on the cache device (those fail with EIO until
    /// `readmit`). It lasts until `readmit`, or a restart of the server, which uses the cache
    /// device again.
    Degrade {
        #[command(flatten)]
        admin: AdminArgs,
        /// Why, for `status` and the log.
        #[arg(long)]
        reason: String,
    },
    /// Stop the server gracefully (in-flight requests finish, the cache is saved) and wait
    /// until its process has exited.
    Stop {
        #[command(flatten)]
        admin: AdminArgs,
        /// Return as soon as the server has accepted the request, without waiting for it to
        /// exit.
        #[arg(long)]
        no_wait: bool,
    },
    /// Format a cache device and backing device(s) and attach them (like make-bcache).
    ///
    /// Without --cache, only the backing device(s) are formatted (like `make-bcache -B`):
    /// they belong to no cache set yet, and `tiercache attach PATH` takes each into a running
    /// server's set (after which `serve --backing PATH` names it at every start).
    Make {
        /// Slow device, image or NBD URI to cache (repeat for several backing devices).
        #[arg(long, required = true)]
        backing: Vec<PathBuf>,
        /// Fast device or file that holds the cache. Without it the backing device(s) are
        /// formatted alone, for `tiercache attach` to a running set.
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Bucket size: the unit of allocation and reclaim on the cache device.
        #[arg(long, default_value = "512k", value_parser = parse_size)]
        bucket_size: u64,
        /// Block size: the smallest unit the cache stores and checksums.
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        block_size: u64,
        /// Start in writeback mode (default: writethrough).
        #[arg(long)]
        writeback: bool,
        /// Label of the backing device(s); also the NBD export name. With several backing
        /// devices, "-N" is appended.
        #[arg(long, default_value = "")]
        label: String,
        /// Overwrite devices that already hold a tiercache, bcache, filesystem or partition
        /// table signature.
        #[arg(long)]
        force: bool,
        /// Print what was made as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the superblock of a cache device or the header of a backing device (without
    /// locking it: it works beside a running server).
    Show {
        /// A cache or backing device: a block device, an image file or an NBD URI.
        #[arg(value_name = "DEVICE", value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Verify all metadata of a device (and with --data, every cached block's checksum).
    /// Exit status: 0 healthy, 1 damaged but usable, 2 unusable.
    Check {
        /// A cache or backing device not in use by a server (it is locked while checked): a
        /// block device, an image file or an NBD URI.
        #[arg(value_name = "DEVICE", value_hint = clap::ValueHint::AnyPath)]
        path: PathBuf,
        /// Also read every cached block and verify its checksum.
        #[arg(long)]
        data: bool,
        /// Print the findings as JSON (the exit status is the same).
        #[arg(long)]
        json: bool,
    },
    /// Shell completions and man pages, generated from this binary's command line (for
    /// packagers; see README).
    Generate {
        #[command(subcommand)]
        what: GenerateCmd,
    },
}

/// The knobs `get` prints and `set` changes, for their long help and man pages.
const KNOB_TABLE: &str = "\
Knobs (bcache's names; the config file's [volumes.NAME] tables set them at every start):

  KNOB               VALUES                                      DEFAULT
  cache_mode         writethrough, writeback, writearound, none  writethrough (make
                     (none: the cache is not used)               --writeback: writeback)
  sequential_cutoff  a size, 0 to 1G: sequential streams past    4M
                     it bypass the cache (0: never)
  writeback_percent  0 to 100: the dirty data writeback aims     10
                     for, in percent of the cache device
  writeback_delay    seconds, 0 to 86400: how long new dirty     30
                     data waits before it is written back
  writeback_running  1/0, on/off, true/false, yes/no: off        on
                     pauses writeback (detach still writes back)
  label              the export name: 1 to 64 bytes of           as `make --label` set it
                     A-Z a-z 0-9 . _ -, not a uuid               (empty: the uuid)

Sizes take suffixes (8M, 512k). A value out of range is refused and changes nothing.";

#[derive(Subcommand)]
pub enum GenerateCmd {
    /// Print the completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write tiercache.1 and a tiercache-COMMAND.1 per command to DIR (which must exist).
    Man { dir: PathBuf },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum EmulateKind {
    Hdd,
    Ssd,
}

/// The command line, or exit: help and version as clap prints them, a mistake in one line
/// (clap's usage block and "try --help" trailer dropped; a negative number reaches its
/// option's parser, which says what is wrong, instead of being taken for an option).
pub fn parse_args() -> Cli {
    fn negative_numbers(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| {
            let takes_values = a.get_action().takes_values();
            a.allow_negative_numbers(takes_values)
        })
        .mut_subcommands(negative_numbers)
    }
    let matches = negative_numbers(Cli::command()).try_get_matches();
    let parsed =
        matches.and_then(|mut m| <Cli as clap::FromArgMatches>::from_arg_matches_mut(&mut m));
    match parsed {
        Ok(cli) => cli,
        Err(e)
            if !e.use_stderr()
                || e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand =>
        {
            e.exit()
        }
        Err(e) => {
            eprintln!("{}", one_line(&e.render().to_string()));
            std::process::exit(2);
        }
    }
}

/// A clap error on one line: its own lines, without the usage block and the help hint.
fn one_line(rendered: &str) -> String {
    rendered
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The knob table and the defaults in `--help` say what the engine does.
    #[test]
    fn the_help_states_the_engines_defaults() {
        for k in engine::Knob::NAMES {
            assert!(KNOB_TABLE.contains(&format!("\n  {k} ")), "{k} missing");
        }
        let row = |k: &str| {
            KNOB_TABLE
                .lines()
                .find(|l| l.starts_with(&format!("  {k} ")))
                .unwrap()
                .to_string()
        };
        let d = engine::knobs::Tunables::default();
        assert!(row("sequential_cutoff").ends_with(&format!(" {}M", d.sequential_cutoff >> 20)));
        assert!(row("writeback_percent").ends_with(&format!(" {}", d.writeback_percent)));
        assert!(row("writeback_delay").ends_with(&format!(" {}", d.writeback_delay_secs)));
        assert!(row("writeback_running").ends_with(if d.writeback_running {
            " on"
        } else {
            " off"
        }));
        assert!(KNOB_TABLE.contains(&format!("1 to {} bytes", engine::format::LABEL_BYTES)));
        let mut serve = Cli::command();
        let help = serve
            .find_subcommand_mut("serve")
            .unwrap()
            .render_long_help()
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for (opt, default) in [
            ("io-error-limit", engine::DEFAULT_IO_ERROR_LIMIT.to_string()),
            (
                "io-error-halflife",
                engine::DEFAULT_IO_ERROR_HALFLIFE.to_string(),
            ),
            (
                "cache-io-timeout-ms",
                engine::DEFAULT_CACHE_IO_TIMEOUT_MS.to_string(),
            ),
            (
                "congested-read-threshold-us",
                engine::DEFAULT_CONGESTED_READ_US.to_string(),
            ),
            (
                "congested-write-threshold-us",
                engine::DEFAULT_CONGESTED_WRITE_US.to_string(),
            ),
        ] {
            // The first default after the option's heading is its own.
            let at = help.find(&format!("--{opt} <")).unwrap();
            let d = at + help[at..].find("[default: ").unwrap();
            assert!(
                help[d..].starts_with(&format!("[default: {default}]")),
                "{opt}: {}",
                &help[at..d + 20]
            );
        }
    }
}
