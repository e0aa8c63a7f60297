//! A [`Sample`] as Prometheus text, in the format the scraper asked for: OpenMetrics 1.0.0
//! (encoded with `prometheus-client`) or the classic text format 0.0.4 (derived from the
//! OpenMetrics text by `to_classic`). Every metric is listed in docs/metrics.md; a test fails
//! when one is missing there, or when the engine grows a counter this file has no description
//! for.
//!
//! Names follow Prometheus' conventions: `tiercache_` prefix, base units (bytes, seconds) as
//! a suffix, `_total` on counters (added by the encoder), ratios as 0..1 `_ratio` gauges.
//! Per-volume series carry a `volume` label (the export name); per-device series `role`
//! (`cache` or `backing`) and `device` (as named on the command line).
//!
//! Invariants: both formats carry the same sample lines, byte for byte (names, labels,
//! values); they differ only in comments: the classic format names a counter family by its
//! `_total` samples, turns an info family into a gauge named `..._info` (whose samples are
//! already `..._info{...} 1`), and has no `# UNIT` and no `# EOF`. No exemplars and no
//! `_created` samples are encoded, so nothing else needs translating. Help texts contain no
//! `\`, `"` or newline, the characters the two formats escape differently (a test checks).
//! [`Format::negotiate`] picks the format from the request's `Accept` header as Prometheus'
//! Go client library does; anything it does not recognise gets the classic format.

use super::hist::BOUNDS_US;
use super::sample::{Sample, VolumeSample, VOLUME_STATES, WRITEBACK_STATES};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::collections::HashMap;
use std::fmt::Error;

/// The engine's counters (`engine::stats::Snapshot` fields): metric name (without unit and
/// `_total`), whether it counts bytes, and what it means.
pub const ENGINE_COUNTERS: [(&str, &str, bool, &str); 26] = [
    ("cache_hits", "cache_hits", false, "Reads served entirely from the cache (bcache's cache_hits; bypassed reads not counted)."),
    ("cache_misses", "cache_misses", false, "Reads that needed the backing device and were not bypassed (bcache's cache_misses)."),
    ("cache_bypass_hits", "cache_bypass_hits", false, "Reads that bypassed the cache (sequential past the cutoff) and were entirely cached anyway."),
    ("cache_bypass_misses", "cache_bypass_misses", false, "Reads that bypassed the cache and were not cached."),
    ("cache_miss_collisions", "cache_miss_collisions", false, "Misses whose fill of the cache was abandoned because a write to the same blocks raced it."),
    ("bypassed", "bypassed", true, "Bytes of reads and writes that bypassed the cache (bcache's bypassed)."),
    ("cache_read_bytes", "cache_read", true, "Bytes read from the cache device for client reads."),
    ("cache_written_bytes", "cache_written", true, "Bytes written to the cache device (client writes and miss fills)."),
    ("backing_read_bytes", "backing_read", true, "Bytes read from the backing device for client requests (misses, bypasses, readahead)."),
    ("backing_written_bytes", "backing_written", true, "Bytes written to the backing device by client requests (writethrough, bypass)."),
    ("writeback_bytes", "writeback", true, "Bytes of dirty data written back to the backing device."),
    ("checksum_repairs", "checksum_repairs", false, "Clean cached blocks that failed their checksum: dropped, and the read served from the backing device."),
    ("io_errors", "io_errors", false, "Client requests and writeback passes that failed (I/O errors, and checksum mismatches on dirty data)."),
    ("cache_io_errors", "cache_io_errors", false, "Cache-device failures met by requests and served from the backing device instead."),
    ("congested", "congested", false, "Requests sent to the backing device because the cache device was slow (congested)."),
    ("degraded_bytes", "degraded", true, "Bytes served by the backing device alone while the cache set was degraded."),
    ("bypassed_sequential", "bypassed_sequential", true, "Bytes that bypassed the cache as part of a sequential stream past sequential_cutoff."),
    ("bypassed_mode", "bypassed_mode", true, "Bytes that bypassed the cache because of the cache mode (writes in writearound and none, reads in none)."),
    ("bypassed_dirty_limit", "bypassed_dirty_limit", true, "Bytes of writeback writes sent around the cache because dirty data filled dirty_max_pct of it."),
    ("bypassed_full", "bypassed_full", true, "Bytes of writes sent around the cache because it had no room for them."),
    ("bypassed_congested", "bypassed_congested", true, "Bytes sent around the cache because the cache device was slower than its congestion threshold and than the backing device."),
    ("bypassed_partial", "bypassed_partial", true, "Bytes of writes covering part of an uncached block, sent around the cache."),
    ("bypassed_detaching", "bypassed_detaching", true, "Bytes sent around the cache while the volume was being detached."),
    ("bypassed_zeroes", "bypassed_zeroes", true, "Bytes of write-zeroes requests (always sent to the backing device as a zeroing command)."),
    ("bypassed_admission", "bypassed_admission", true, "Bytes of read misses the admission filter kept out of a full cache (their blocks had not missed recently)."),
    ("gc_moved_bytes", "gc_moved", true, "Bytes of cached data that copying GC moved to other buckets to make room (written to the cache device again)."),
];

/// A row of a table of metrics: name, help, and how to read the value.
type Row<T, V> = (&'static str, &'static str, fn(&T) -> V);

/// The registry's single collector: encodes the sample it holds.
#[derive(Debug)]
struct SampleCollector(Sample);

/// The text formats a scrape can be answered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 (`application/openmetrics-text`), ending in `# EOF`.
    OpenMetrics,
    /// Prometheus' classic text format 0.0.4 (`text/plain`), which every scraper reads.
    Classic,
}

impl Format {
    /// The `Content-Type` of a reply in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Classic => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format for a request's `Accept` header (its values joined by commas; empty
    /// without one), chosen as Prometheus' Go client library chooses: the acceptable media
    /// range with the highest `q` wins, the first listed on a tie. OpenMetrics is acceptable
    /// as `application/openmetrics-text` without a version or with version 1.0.0; the
    /// classic format as `text/plain` without a version or with version 0.0.4, `text/*` and
    /// `*/*`. With nothing acceptable (no header, `q=0`, other types or versions): classic.
    pub fn negotiate(accept: &str) -> Format {
        let mut best: Option<(f64, Format)> = None;
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let (mut q, mut version) = (1.0, None);
            for p in parts {
                let Some((k, v)) = p.split_once('=') else {
                    continue;
                };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    // Unparsable: not acceptable (as Go's client reads it).
                    "q" => q = v.parse::<f64>().unwrap_or(0.0),
                    "version" => version = Some(v.to_string()),
                    _ => {}
                }
            }
            let version = version.as_deref();
            let format = match media.as_str() {
                "application/openmetrics-text" if matches!(version, None | Some("1.0.0")) => {
                    Format::OpenMetrics
                }
                "text/plain" if matches!(version, None | Some("0.0.4")) => Format::Classic,
                "text/*" | "*/*" => Format::Classic,
                _ => continue,
            };
            if q > 0.0 && !matches!(best, Some((b, _)) if b >= q) {
                best = Some((q, format));
            }
        }
        best.map_or(Format::Classic, |(_, f)| f)
    }
}

/// Renders a sample in `format`.
pub fn render(sample: &Sample, format: Format) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(SampleCollector(sample.clone())));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    match format {
        Format::OpenMetrics => out,
        Format::Classic => to_classic(&out),
    }
}

/// The classic text format 0.0.4 of OpenMetrics text as this file encodes it (see the
/// module header): the sample lines unchanged; `# HELP` and `# TYPE` renamed to the
/// samples' names (counters `_total`, infos `_info`), info typed as gauge; `# UNIT` and
/// `# EOF` left out.
fn to_classic(om: &str) -> String {
    let types: HashMap<&str, &str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let name = |family: &str| match types.get(family).copied() {
        Some("counter") => format!("{family}_total"),
        Some("info") => format!("{family}_info"),
        _ => family.to_string(),
    };
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (family, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!("# HELP {} {help}\n", name(family)));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let kind = match kind {
                "info" => "gauge",
                "unknown" => "untyped",
                k => k,
            };
            out.push_str(&format!("# TYPE {} {kind}\n", name(family)));
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A sample's value: counts and bytes stay integers (exact past 2^53), the rest floats.
#[derive(Clone, Copy)]
enum Num {
    U(u64),
    F(f64),
}
use Num::{F, U};

fn histogram(m: &mut MetricEncoder, h: &super::hist::HistSnapshot) -> Result<(), Error> {
    let buckets: Vec<(f64, u64)> = BOUNDS_US
        .iter()
        .map(|&b| b as f64 / 1e6)
        .chain([f64::INFINITY])
        .zip(h.buckets.iter().copied())
        .collect();
    m.encode_histogram::<NoLabelSet>(h.sum_seconds(), h.count(), &buckets, None)
}

fn encode_num(m: &mut MetricEncoder, kind: MetricType, v: Num) -> Result<(), Error> {
    match (kind, v) {
        (MetricType::Counter, U(v)) => m.encode_counter::<NoLabelSet, u64, u64>(&v, None),
        (MetricType::Counter, F(v)) => m.encode_counter::<NoLabelSet, f64, u64>(&v, None),
        (_, U(v)) => m.encode_gauge(&v),
        (_, F(v)) => m.encode_gauge(&v),
    }
}

/// Encodes a metric without labels.
fn single(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    v: Num,
) -> Result<(), Error> {
    let mut m = enc.encode_descriptor(name, help, unit, kind)?;
    encode_num(&mut m, kind, v)
}

/// Encodes one metric family: a descriptor, then one sample per item with its labels.
fn family<T, L: prometheus_client::encoding::EncodeLabelSet>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    items: impl IntoIterator<Item = T>,
    mut each: impl FnMut(&T) -> (L, Num),
) -> Result<(), Error> {
    let items: Vec<T> = items.into_iter().collect();
    if items.is_empty() {
        return Ok(());
    }
    let mut m = enc.encode_descriptor(name, help, unit, kind)?;
    for item in &items {
        let (labels, v) = each(item);
        encode_num(&mut m.encode_family(&labels)?, kind, v)?;
    }
    Ok(())
}

impl Collector for SampleCollector {
    /// Families in a fixed order: volumes, the cache set, devices, NBD listeners, uptime.
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), Error> {
        let s = &self.0;
        volume_info_and_counters(&mut enc, s)?;
        volume_requests(&mut enc, s)?;
        volume_gauges(&mut enc, s)?;
        cache_set(&mut enc, s)?;
        devices(&mut enc, s)?;
        listeners(&mut enc, s)?;
        single(
            &mut enc,
            "tiercache_uptime",
            "Seconds since the server started.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
            F(s.uptime_seconds),
        )
    }
}

/// A volume's labels: its export name.
fn vol(v: &VolumeSample) -> [(&'static str, String); 1] {
    [("volume", v.name.clone())]
}

/// Volumes: the info family (one sample per served volume; info metrics carry their labels
/// instead of a value, so it is encoded by hand), then the engine's counters per volume.
fn volume_info_and_counters(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let bytes = Unit::Bytes;
    let vols = &s.volumes;
    if !vols.is_empty() {
        let mut m = enc.encode_descriptor(
            "tiercache_volume",
            "A served volume (value 1): export name, uuid, backing device, cache mode.",
            None,
            MetricType::Info,
        )?;
        for v in vols {
            m.encode_info(&[
                ("volume", v.name.clone()),
                ("uuid", v.uuid.clone()),
                (
                    "backing_device",
                    v.backing_device.clone().unwrap_or_default(),
                ),
                ("cache_mode", v.cache_mode.clone()),
            ])?;
        }
    }
    for (field, name, is_bytes, help) in ENGINE_COUNTERS {
        family(
            enc,
            &format!("tiercache_volume_{name}"),
            help,
            is_bytes.then_some(&bytes),
            MetricType::Counter,
            vols,
            |v| (vol(v), U(v.counters.get(field).copied().unwrap_or(0))),
        )?;
    }
    Ok(())
}

/// Volumes' client requests by operation and result: counts, bytes, latency histograms.
fn volume_requests(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let bytes = Unit::Bytes;
    let seconds = Unit::Seconds;
    let vols = &s.volumes;
    let series = || {
        vols.iter()
            .flat_map(|v| v.requests.iter().map(move |r| (v, r)))
    };
    family(
        enc,
        "tiercache_volume_requests",
        "Client requests by operation and result (read: hit, miss, bypass; write: \
         writeback, writethrough, bypass; others: done; any: error).",
        None,
        MetricType::Counter,
        series(),
        |(v, r)| {
            (
                [
                    ("volume", v.name.clone()),
                    ("op", r.op.clone()),
                    ("result", r.result.clone()),
                ],
                U(r.latency.count()),
            )
        },
    )?;
    family(
        enc,
        "tiercache_volume_request",
        "Bytes client requests asked for, by operation and result.",
        Some(&bytes),
        MetricType::Counter,
        series().filter(|(_, r)| r.op != "flush"),
        |(v, r)| {
            (
                [
                    ("volume", v.name.clone()),
                    ("op", r.op.clone()),
                    ("result", r.result.clone()),
                ],
                U(r.bytes),
            )
        },
    )?;
    if !vols.is_empty() {
        let mut m = enc.encode_descriptor(
            "tiercache_volume_request_duration",
            "Time from a client request reaching the cache to its completion, by \
             operation and result.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        for (v, r) in series() {
            let labels = [
                ("volume", v.name.clone()),
                ("op", r.op.clone()),
                ("result", r.result.clone()),
            ];
            histogram(&mut m.encode_family(&labels)?, &r.latency)?;
        }
    }
    Ok(())
}

/// Volumes' gauges: sizes, writeback's rate, knob, failures and state, the volume state.
fn volume_gauges(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let bytes = Unit::Bytes;
    let vols = &s.volumes;
    let byte_gauges: [Row<super::sample::VolumeSample, u64>; 3] = [
        ("tiercache_volume_size", "Size of the volume.", |v| {
            v.size_bytes
        }),
        (
            "tiercache_volume_dirty",
            "Dirty data of the volume in the cache (not yet on the backing device).",
            |v| v.dirty_bytes,
        ),
        (
            "tiercache_volume_cached",
            "Data of the volume held in the cache (clean and dirty).",
            |v| v.cached_bytes,
        ),
    ];
    for (name, help, get) in byte_gauges {
        family(
            enc,
            name,
            help,
            Some(&bytes),
            MetricType::Gauge,
            vols,
            |v| (vol(v), U(get(v))),
        )?;
    }
    family(
        enc,
        "tiercache_volume_writeback_rate_ratio",
        "Writeback's share of a busy backing device's time: 0 idle, 1 full speed (bcache's \
         writeback_rate as a fraction; bytes written back are \
         tiercache_volume_writeback_bytes_total).",
        None,
        MetricType::Gauge,
        vols,
        |v| (vol(v), F(v.writeback.share)),
    )?;
    family(
        enc,
        "tiercache_volume_writeback_running",
        "The writeback_running knob: 1 writeback allowed, 0 paused.",
        None,
        MetricType::Gauge,
        vols,
        |v| (vol(v), U(u64::from(v.writeback.running))),
    )?;
    family(
        enc,
        "tiercache_volume_writeback_failures",
        "Writeback passes that failed in a row (0 while writeback works).",
        None,
        MetricType::Gauge,
        vols,
        |v| (vol(v), U(u64::from(v.writeback.failures))),
    )?;
    family(
        enc,
        "tiercache_volume_writeback_state",
        "Writeback state, one series per state, 1 for the current one: idle, active \
         (a share of a busy disk), full, paused (writeback_running off), failing.",
        None,
        MetricType::Gauge,
        vols.iter()
            .flat_map(|v| WRITEBACK_STATES.iter().map(move |st| (v, *st))),
        |(v, st)| {
            (
                [("volume", v.name.clone()), ("state", st.to_string())],
                U(u64::from(v.writeback.state() == *st)),
            )
        },
    )?;
    family(
        enc,
        "tiercache_volume_state",
        "Volume state, one series per state, 1 for the current one: clean, dirty, \
         detaching, degraded.",
        None,
        MetricType::Gauge,
        vols.iter()
            .flat_map(|v| VOLUME_STATES.iter().map(move |st| (v, *st))),
        |(v, st)| {
            (
                [("volume", v.name.clone()), ("state", st.to_string())],
                U(u64::from(v.state == *st)),
            )
        },
    )?;
    Ok(())
}

/// The cache set: whether the server runs without it, then (when it has one) its info,
/// counters summed over the volumes, occupancy, health and latency estimates.
fn cache_set(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let bytes = Unit::Bytes;
    single(
        enc,
        "tiercache_without_cache",
        "1 while the server serves its volumes without the cache device (see the log and \
         `tiercache status` for why), else 0.",
        None,
        MetricType::Gauge,
        U(u64::from(s.without_cache.is_some())),
    )?;
    if let Some(c) = &s.cache_set {
        let mut m = enc.encode_descriptor(
            "tiercache_cache_set",
            "The cache set (value 1): its uuid.",
            None,
            MetricType::Info,
        )?;
        m.encode_info(&[("cache_set", c.uuid.clone())])?;
        for (field, name, is_bytes, help) in ENGINE_COUNTERS {
            single(
                enc,
                &format!("tiercache_cache_set_{name}"),
                &format!("{help} Summed over the volumes attached now."),
                is_bytes.then_some(&bytes),
                MetricType::Counter,
                U(c.counters.get(field).copied().unwrap_or(0)),
            )?;
        }
        single(
            enc,
            "tiercache_cache_set_size",
            "Size of the cache device.",
            Some(&bytes),
            MetricType::Gauge,
            U(c.total_bytes),
        )?;
        family(
            enc,
            "tiercache_cache_set_occupancy",
            "The cache device by use (bcache's priority_stats): unused, clean, dirty, \
             metadata; they add up to tiercache_cache_set_size_bytes.",
            Some(&bytes),
            MetricType::Gauge,
            [
                ("unused", c.unused_bytes),
                ("clean", c.clean_bytes),
                ("dirty", c.dirty_bytes),
                ("metadata", c.metadata_bytes),
            ],
            |(kind, b)| ([("kind", kind.to_string())], U(*b)),
        )?;
        let gauges: [(&str, &str, Num); 8] = [
            ("tiercache_cache_set_missing_volumes", "Backing devices the cache set holds data for that are not attached (left out of serve, or not reachable yet); `tiercache status` names them.", U(c.missing_volumes)),
            ("tiercache_cache_set_missing_dirty_bytes", "Dirty data of those devices: their newest data, held only in the cache until they are attached.", U(c.missing_dirty_bytes)),
            ("tiercache_cache_set_in_use_ratio", "Fraction of the data buckets holding something (bcache's in_use, as 0..1).", F(f64::from(c.in_use_pct) / 100.0)),
            ("tiercache_cache_set_degraded", "1 while the cache set is degraded (every volume served from its backing device), else 0.", U(u64::from(c.degraded.is_some()))),
            ("tiercache_cache_set_decayed_errors", "Cache-device failures, decayed by io_error_halflife; the set degrades when it reaches tiercache_cache_set_io_error_limit.", F(c.error_count)),
            ("tiercache_cache_set_io_error_limit", "The io_error_limit setting.", U(u64::from(c.io_error_limit))),
            ("tiercache_cache_set_read_latency_estimate_seconds", "The engine's recent average cache-device read latency (0: no recent read), compared with congested_read_threshold_us.", F(c.read_latency_us as f64 / 1e6)),
            ("tiercache_cache_set_write_latency_estimate_seconds", "The engine's recent average cache-device write latency (0: no recent write), compared with congested_write_threshold_us.", F(c.write_latency_us as f64 / 1e6)),
        ];
        for (name, help, v) in gauges {
            single(enc, name, help, None, MetricType::Gauge, v)?;
        }
        single(
            enc,
            "tiercache_cache_set_errors",
            "Cache-device failures since the server started (I/O errors, timeouts, \
             checksum mismatches; health's errors_total).",
            None,
            MetricType::Counter,
            U(c.errors_total),
        )?;
    }
    Ok(())
}

/// Devices (cache and backing): I/O latency, bytes and errors; remote devices' NBD
/// connections by state.
fn devices(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let bytes = Unit::Bytes;
    let seconds = Unit::Seconds;
    let dev_ops = || {
        s.devices
            .iter()
            .flat_map(|d| d.ops.iter().map(move |o| (d, o)))
    };
    let dev_labels = |d: &super::device::DeviceSample, op: &str| {
        [
            ("role", d.role.name().to_string()),
            ("device", d.device.clone()),
            ("op", op.to_string()),
        ]
    };
    if !s.devices.is_empty() {
        let mut m = enc.encode_descriptor(
            "tiercache_device_io_duration",
            "Time of each I/O the cache handed to a device, by device and operation.",
            Some(&seconds),
            MetricType::Histogram,
        )?;
        for (d, o) in dev_ops() {
            histogram(&mut m.encode_family(&dev_labels(d, &o.op))?, &o.latency)?;
        }
    }
    family(
        enc,
        "tiercache_device_io",
        "Bytes moved by successful device I/O (discard and write_zeroes: their length).",
        Some(&bytes),
        MetricType::Counter,
        dev_ops().filter(|(_, o)| o.op != "flush"),
        |(d, o)| (dev_labels(d, &o.op), U(o.bytes)),
    )?;
    family(
        enc,
        "tiercache_device_io_errors",
        "Device I/Os that failed, by device and operation.",
        None,
        MetricType::Counter,
        dev_ops(),
        |(d, o)| (dev_labels(d, &o.op), U(o.errors)),
    )?;

    let links = s.devices.iter().filter_map(|d| d.nbd.map(|n| (d, n)));
    family(
        enc,
        "tiercache_device_nbd_connections",
        "A remote (NBD) device's connections now, by state: shared_up, shared_down (being \
         reconnected), spare_idle, spare_lent (carrying a request around the cache).",
        None,
        MetricType::Gauge,
        links.flat_map(|(d, n)| {
            [
                ("shared_up", n.shared_up),
                ("shared_down", n.shared - n.shared_up),
                ("spare_idle", n.spare_open - n.spare_lent),
                ("spare_lent", n.spare_lent),
            ]
            .map(|(state, v)| (d, state, v))
        }),
        |(d, state, v)| {
            (
                [
                    ("role", d.role.name().to_string()),
                    ("device", d.device.clone()),
                    ("state", state.to_string()),
                ],
                U(*v as u64),
            )
        },
    )?;
    Ok(())
}

/// NBD listeners: connection, memory and thread gauges, then connection and direct-I/O counters.
fn listeners(enc: &mut DescriptorEncoder, s: &Sample) -> Result<(), Error> {
    let l = &s.listeners;
    let lis = |name: &String| [("listener", name.clone())];
    let listener_gauges: [Row<super::sample::ListenerSample, u64>; 5] = [
        ("tiercache_connections", "NBD connections open now (including handshakes).", |l| l.connections),
        ("tiercache_connections_max", "The connection limit in effect (max_connections, lowered to fit the descriptor limit).", |l| l.connections_max),
        ("tiercache_request_memory_in_use_bytes", "Bytes of request and reply buffers held now (bounded by request_memory).", |l| l.bytes_in_flight),
        ("tiercache_extra_workers", "Worker threads running now beyond each connection's first (io_uring data path: its worker pool).", |l| l.workers_extra),
        ("tiercache_io_uring_event_loops", "Event-loop threads of the io_uring data path (0: threads serve every connection).", |l| l.ring_threads),
    ];
    for (name, help, get) in listener_gauges {
        family(enc, name, help, None, MetricType::Gauge, l, |x| {
            (lis(&x.listener), U(get(x)))
        })?;
    }
    let listener_counters: [Row<super::sample::ListenerSample, u64>; 6] = [
        (
            "tiercache_connections_refused",
            "Connections closed on arrival (no room, or no thread).",
            |l| l.refused,
        ),
        (
            "tiercache_connections_evicted",
            "Idle connections closed to make room for new ones.",
            |l| l.evicted,
        ),
        (
            "tiercache_connections_displaced",
            "Connections (not idle) closed, or drained, to make room for a client holding at least two fewer, when the server was full.",
            |l| l.displaced,
        ),
        (
            "tiercache_connections_idle_closed",
            "Connections closed for being idle longer than idle_close_after.",
            |l| l.idle_closed,
        ),
        (
            "tiercache_direct_reads",
            "Reads served by the io_uring data path's own cache-device reads (hits with no thread hand-over).",
            |l| l.direct_reads,
        ),
        (
            "tiercache_direct_writes",
            "Writes the cache absorbed through the io_uring data path's own cache-device writes (no thread hand-over).",
            |l| l.direct_writes,
        ),
    ];
    for (name, help, get) in listener_counters {
        family(enc, name, help, None, MetricType::Counter, l, |x| {
            (lis(&x.listener), U(get(x)))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::device::{DeviceMetrics, Role};
    use crate::metrics::test_samples::{sample, volume};
    use crate::metrics::ListenerSample;

    /// A sample with something of every kind: a volume, the cache set, a device, a listener.
    fn full_sample() -> Sample {
        let mut s = sample(12.5, vec![volume("data", 3, 4096, 3)]);
        let dev = DeviceMetrics {
            role: Role::Backing,
            device: "/dev/\"odd\" name".into(),
            ops: Default::default(),
            remote: None,
        };
        dev.ops[0]
            .latency
            .observe(std::time::Duration::from_micros(70));
        let mut d = dev.sample();
        d.nbd = Some(blockdev::NbdLinks {
            shared: 4,
            shared_up: 3,
            spare_open: 2,
            spare_lent: 1,
        });
        s.devices.push(d);
        s.listeners.push(ListenerSample {
            listener: "unix:/tmp/x.sock".into(),
            connections: 2,
            connections_max: 256,
            refused: 0,
            evicted: 0,
            displaced: 0,
            idle_closed: 0,
            bytes_in_flight: 0,
            workers_extra: 0,
            ring_threads: 2,
            direct_reads: 0,
            direct_writes: 0,
        });
        s
    }

    /// `(name as scraped, type)` of every family: counters end in `_total`, infos in `_info`.
    fn families(text: &str) -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').unwrap();
                let shown = match kind {
                    "counter" => format!("{name}_total"),
                    "info" => format!("{name}_info"),
                    _ => name.to_string(),
                };
                (shown, kind.to_string())
            })
            .collect()
    }

    #[test]
    fn every_engine_counter_has_a_description() {
        let fields: Vec<&str> = engine::stats::Snapshot::default()
            .fields()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let described: Vec<&str> = ENGINE_COUNTERS.iter().map(|c| c.0).collect();
        assert_eq!(
            fields, described,
            "the engine's counters changed: describe them in ENGINE_COUNTERS and docs/metrics.md"
        );
    }

    #[test]
    fn every_metric_is_documented_and_well_formed() {
        let text = render(&full_sample(), Format::OpenMetrics);
        assert!(text.ends_with("# EOF\n"), "{text}");
        let docs = include_str!("../../../../docs/metrics.md");
        let fams = families(&text);
        assert!(fams.len() > 40, "{fams:?}");
        for (name, kind) in &fams {
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} ({kind}) is not in docs/metrics.md"
            );
            assert!(name.starts_with("tiercache_"), "{name}");
            // Suffixes Prometheus reserves (promtool's lint): `_total` for counters, `_count`,
            // `_sum` and `_bucket` for histograms' series.
            assert_eq!(name.ends_with("_total"), kind == "counter", "{name}");
            assert!(
                !["_count", "_sum", "_bucket"]
                    .iter()
                    .any(|s| name.ends_with(s)),
                "{name}"
            );
            assert!(
                name.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{name}"
            );
        }
        // And nothing documented that is not exported (a renamed metric left behind).
        for line in docs.lines().filter(|l| l.starts_with("| `tiercache_")) {
            let name = line.split('`').nth(1).unwrap();
            assert!(
                fams.iter().any(|(n, _)| n == name),
                "docs/metrics.md lists {name}, which is not exported"
            );
        }
        // Label values are escaped.
        assert!(text.contains(r#"device="/dev/\"odd\" name""#), "{text}");
        // A histogram: cumulative buckets ending in +Inf, with sum and count.
        let b: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tiercache_device_io_duration_seconds_bucket{"))
            .filter(|l| l.contains("role=\"backing\"") && l.contains("op=\"read\""))
            .collect();
        assert_eq!(b.len(), BOUNDS_US.len() + 1);
        assert!(b[3].contains("le=\"0.00005\""), "{}", b[3]);
        assert!(b[3].ends_with(" 0") && b[4].ends_with(" 1") && b[20].ends_with(" 1"));
        assert!(b[20].contains("le=\"+Inf\""));
    }

    #[test]
    fn the_classic_format_has_the_same_samples_under_classic_names() {
        let om = render(&full_sample(), Format::OpenMetrics);
        let classic = render(&full_sample(), Format::Classic);
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(String::from)
                .collect()
        };
        assert_eq!(samples(&om), samples(&classic));
        // Families are named as their samples are, which the OpenMetrics names imply.
        let typed: Vec<(String, String)> = classic
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (n, k) = l.split_once(' ').unwrap();
                (n.to_string(), k.to_string())
            })
            .collect();
        let expected: Vec<(String, String)> = families(&om)
            .into_iter()
            .map(|(n, k)| (n, if k == "info" { "gauge".into() } else { k }))
            .collect();
        assert_eq!(typed, expected);
        assert!(classic.contains("# TYPE tiercache_volume_info gauge\n"));
        assert!(classic.contains("# TYPE tiercache_volume_requests_total counter\n"));
        assert!(classic.contains("# HELP tiercache_device_io_bytes_total Bytes moved"));
        assert!(!classic.contains("# EOF") && !classic.contains("# UNIT"));
        // Every sample belongs to the family declared last, HELP and TYPE name it alike.
        let mut family = ("", "");
        let mut help = "";
        for l in classic.lines() {
            if let Some(h) = l.strip_prefix("# HELP ") {
                help = h.split(' ').next().unwrap();
            } else if let Some(t) = l.strip_prefix("# TYPE ") {
                let (n, k) = t.split_once(' ').unwrap();
                assert_eq!(n, help, "{l}");
                family = (n, k);
            } else {
                let name = l.split(['{', ' ']).next().unwrap();
                let ok = match family.1 {
                    "histogram" => ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name == format!("{}{s}", family.0)),
                    _ => name == family.0,
                };
                assert!(ok, "{l} under {family:?}");
            }
        }
        // Help texts need no escaping, which the two formats do differently.
        for l in om.lines().filter(|l| l.starts_with("# HELP ")) {
            assert!(!l.contains(['\\', '"']), "{l}");
        }
    }

    #[test]
    fn the_format_is_negotiated_as_prometheus_go_client_does() {
        let om = |accept: &str| Format::negotiate(accept) == Format::OpenMetrics;
        // Prometheus 2 and 3 scrape requests.
        assert!(om(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(om(
            "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,\
                    application/openmetrics-text;version=0.0.1;q=0.5,text/plain;\
                    version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,\
                    */*;q=0.2"
        ));
        assert!(om("application/openmetrics-text"));
        assert!(om("Application/OpenMetrics-Text; Version=\"1.0.0\""));
        assert!(om("text/plain;q=0.5, application/openmetrics-text"));
        // Classic: nothing said, any type, the classic one preferred or listed first, or
        // OpenMetrics refused or in a version not served.
        for classic in [
            "",
            "*/*",
            "text/plain",
            "text/plain;version=0.0.4",
            "application/json",
            "text/plain, application/openmetrics-text",
            "application/openmetrics-text;q=0.5, text/plain",
            "application/openmetrics-text;q=0",
            "application/openmetrics-text;q=x",
            "application/openmetrics-text;version=0.0.1",
        ] {
            assert!(!om(classic), "{classic}");
        }
        assert_eq!(
            Format::Classic.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }
}
