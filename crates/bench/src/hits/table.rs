//! The report of the hits workload: `hits.md` (the tables) and `hits.json` (every figure and
//! fio command line).
//!
//! Invariant: every number written comes from [`Measured`], measured in this run; a figure
//! that was not measured is written "n/a".

use super::rows::{
    Column, Measured, Params, Point, BUCKET, KIT_FILE, KIT_MEM, QEMU, RAW, TC, TC_THREADS,
    WRITE_ROW,
};
use crate::fio;
use crate::report::{self, opt};
use crate::Scale;
use anyhow::Result;
use std::fmt::Write as _;
use std::path::Path;
use tiercache_units::human;

fn cpu(p: Option<&Point>) -> String {
    opt(p.and_then(|p| p.server_cpu_us_per_io), 1)
}

fn us(p: Option<&Point>, f: fn(&fio::Measured) -> f64) -> String {
    opt(p.map(|p| f(&p.fio)), 1)
}

/// A Markdown table head.
fn head(md: &mut String, cells: &[String]) -> Result<()> {
    writeln!(
        md,
        "| {} |\n|{}",
        cells.join(" | "),
        "---|".repeat(cells.len())
    )?;
    Ok(())
}

/// The read rows of one kind (IOPS for 4 KiB, MiB/s otherwise) with every column, the ratios
/// of tiercache to raw, nbdkit memory, qemu-nbd and nbdkit file, and tiercache's hit %.
fn read_table(md: &mut String, m: &Measured, small: bool) -> Result<()> {
    let refs = [RAW, KIT_MEM, QEMU, KIT_FILE];
    let name = |k: &str| {
        m.columns
            .iter()
            .find(|c| c.key == k)
            .map_or(k.to_string(), |c| c.name.clone())
    };
    let mut h = vec!["row".to_string()];
    h.extend(m.columns.iter().map(|c| c.name.clone()));
    h.extend(refs.iter().map(|k| format!("tiercache / {}", name(k))));
    h.extend(
        m.columns
            .iter()
            .filter(|c| c.key.starts_with(TC))
            .map(|c| format!("{} hit %", c.name)),
    );
    head(md, &h)?;
    for r in m.reads.iter().filter(|r| r.shape.small() == small) {
        let value = |p: &Point| if small { p.fio.iops } else { p.fio.bw_mib_s };
        let mut cells = vec![r.shape.row.to_string()];
        cells.extend(
            m.columns
                .iter()
                .map(|c| opt(r.points.get(c.key).map(value), 0)),
        );
        cells.extend(
            refs.iter()
                .map(|k| opt(r.tiercache_over.get(k).copied(), 2)),
        );
        cells.extend(
            m.columns
                .iter()
                .filter(|c| c.key.starts_with(TC))
                .map(|c| opt(r.hit_pct.get(c.key).copied(), 1)),
        );
        writeln!(md, "| {} |", cells.join(" | "))?;
    }
    Ok(())
}

/// Writes hits.md and hits.json; returns the Markdown.
pub(super) fn write(
    out: &Path,
    scale: Scale,
    p: &Params,
    m: &Measured,
    notices: &[String],
) -> Result<String> {
    let (date, machine) = (report::date(), report::machine());
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let step_s = p.step_ms as f64 / 1000.0;
    let mut md = String::new();
    intro(&mut md, out, scale, p, &date, &machine, &command, notices)?;
    cached_reads(&mut md, p, m)?;
    writeback(&mut md, p, m, step_s)?;
    passthrough(&mut md, p, m)?;
    writearound_peers(&mut md, m)?;
    writeln!(
        md,
        "\nThe fio command of every cell is in hits.json (`command`).\n\n\
         W4's 4 KiB sync random writes (writeback against the fast file alone) are not repeated \
         here: `tiercache bench --scale {} --workloads W4 --configs ssd,tiercache-writeback`, \
         row `sync randwrite 4k to 70 % of cache`.",
        format!("{scale:?}").to_lowercase()
    )?;
    std::fs::write(out.join("hits.md"), &md)?;
    let json = serde_json::json!({
        "date": date,
        "machine": machine,
        "command": command,
        "scale": scale,
        "params": p,
        "notices": notices,
        "cached_after_warm_bytes": m.cached_after_warm,
        "cpus": m.cpus,
        "columns": m.columns,
        "reads": m.reads,
        "writes": m.writes,
        "passthrough": m.passthrough,
        "passthrough_peers": m.peers,
    });
    std::fs::write(out.join("hits.json"), serde_json::to_string_pretty(&json)?)?;
    Ok(md)
}

/// The title, the machine and command, the files and settings, and the run's notices.
#[allow(clippy::too_many_arguments)]
fn intro(
    md: &mut String,
    out: &Path,
    scale: Scale,
    p: &Params,
    date: &str,
    machine: &str,
    command: &str,
    notices: &[String],
) -> Result<()> {
    let step_s = p.step_ms as f64 / 1000.0;
    writeln!(
        md,
        "# tiercache bench: hits ({scale:?} scale, {date})\n\nMachine: {machine}. Command: `{command}`.\n\
         Files on the filesystem of `{}`: cache file {}, backing file {}, both written in full \
         (no holes), `tiercache make --writeback`, buckets of {}, `sequential_cutoff 0`, \
         writeback paused (`writeback_running 0`). {step_s} s per time-based fio run. \
         Server CPU: utime + stime of the server process (all threads) over the fio run, per I/O.\n",
        out.display(),
        human(p.cache_bytes),
        human(p.backing_bytes),
        human(BUCKET),
    )?;
    for n in notices {
        writeln!(md, "> {n}\n")?;
    }
    Ok(())
}

/// Cached reads: random IOPS and sequential MiB/s per row and column, and server CPU per I/O.
fn cached_reads(md: &mut String, p: &Params, m: &Measured) -> Result<()> {
    let threads = m.columns.iter().any(|c| c.key == TC_THREADS);
    writeln!(
        md,
        "## Cached reads\n\n\
         tiercache: the first {} of its export, after one random 64 KiB read pass left {} \
         cached; hit % from its stats over each run. The others over the whole cache file: \
         `nbdkit -r file CACHE cache=none fadvise=random`; `qemu-nbd -r --cache=none --aio=… \
         -f raw CACHE`; `nbdkit memory` of the same size (RAM, no device: the NBD transport's \
         ceiling); raw: fio `--ioengine=libaio --direct=1` on the cache file (no NBD: the \
         device's ceiling). Per row the columns run in turn{}. Ratios: tiercache's figure over \
         the column's, of this run. Rows \"on two CPUs\": every thread of the server on CPU \
         {server} (raw's fio there too), fio on CPU {client}; \"on one CPU\": all on CPU \
         {server}, where fio on the cache file alone ran faster (QD32 4 KiB random reads: \
         {probe}).\n\n### 4 KiB random reads, IOPS\n",
        human(p.region_bytes),
        human(m.cached_after_warm),
        if threads {
            "; tiercache (threads), `serve --data-path threads`, after the others' rows, \
             restarted on the same cache (the tiercache column has serve's default data path)"
        } else {
            ""
        },
        server = m.cpus.server,
        client = m
            .cpus
            .client
            .map_or("n/a (one CPU)".into(), |c| c.to_string()),
        probe = m
            .cpus
            .probe
            .iter()
            .map(|(c, iops)| format!("CPU {c} {iops:.0} IOPS"))
            .collect::<Vec<_>>()
            .join(", "),
    )?;
    read_table(md, m, true)?;
    writeln!(md, "\n### Sequential reads, MiB/s\n")?;
    read_table(md, m, false)?;
    writeln!(md, "\n### Server CPU µs per I/O (reads)\n")?;
    let servers: Vec<&Column> = m.columns.iter().filter(|c| c.key != RAW).collect();
    let mut h = vec!["row".to_string()];
    h.extend(servers.iter().map(|c| c.name.clone()));
    head(md, &h)?;
    for r in &m.reads {
        let mut cells = vec![r.shape.row.to_string()];
        cells.extend(servers.iter().map(|c| cpu(r.points.get(c.key))));
        writeln!(md, "| {} |", cells.join(" | "))?;
    }
    Ok(())
}

/// Writeback: each server's random 4 KiB writes, and the dirty data they left.
fn writeback(md: &mut String, p: &Params, m: &Measured, step_s: f64) -> Result<()> {
    writeln!(
        md,
        "\n## Writeback: {}\n\n\
         tiercache in writeback writes each 4 KiB block of the {} at offset {} of its export \
         once, in random order (capped at {step_s} s); with writeback paused the cache device \
         absorbs them as dirty data (its dirty bytes after the run are shown). `nbdkit memory` \
         and raw (fio on the cache file, after tiercache is stopped) write as many blocks at \
         offset 0. × raw: IOPS over raw's.\n",
        WRITE_ROW.row,
        human(p.write_bytes),
        human(2 * p.region_bytes),
    )?;
    head(
        md,
        &[
            "server",
            "IOPS",
            "mean µs",
            "p50 µs",
            "p99 µs",
            "server CPU µs/IO",
            "× raw",
            "dirty after",
        ]
        .map(String::from),
    )?;
    for w in &m.writes {
        let pt = w.point.as_ref();
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            w.server,
            opt(pt.map(|p| p.fio.iops), 0),
            us(pt, |f| f.mean_lat_us),
            us(pt, |f| f.p50_lat_us),
            us(pt, |f| f.p99_lat_us),
            cpu(pt),
            opt(w.over_raw, 2),
            w.dirty_after_bytes.map_or("n/a".into(), human),
        )?;
    }
    Ok(())
}

/// Passthrough: QD1 I/O around the cache against the backing device alone.
fn passthrough(md: &mut String, p: &Params, m: &Measured) -> Result<()> {
    writeln!(
        md,
        "\n## Passthrough: QD1 4 KiB I/O around the cache, added latency\n\n\
         The second {} of the export, which the cache holds none of: reads with `cache_mode \
         none`, writes with `writearound`. The device alone is fio on the backing device \
         itself: `--ioengine=libaio --direct=1` on the local file (tiercache opens it \
         O_DIRECT), and fio's nbd engine on the NBD export (`nbdkit file BACKING cache=none \
         fadvise=random` on a Unix socket) that a second tiercache, with a {} cache file, \
         was made on. Added: tiercache minus the device alone, of this run (mean is fio's \
         `lat`, p50 its `clat`).\n",
        human(p.region_bytes),
        human(p.remote_cache_bytes),
    )?;
    head(
        md,
        &[
            "backing device",
            "I/O",
            "tiercache mode",
            "device mean µs",
            "device p50 µs",
            "tiercache mean µs",
            "tiercache p50 µs",
            "added mean µs",
            "added p50 µs",
            "tiercache CPU µs/IO",
        ]
        .map(String::from),
    )?;
    for r in &m.passthrough {
        let (a, t) = (r.alone.as_ref(), r.tiercache.as_ref());
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.backing,
            r.shape.row,
            r.tiercache_mode,
            us(a, |f| f.mean_lat_us),
            us(a, |f| f.p50_lat_us),
            us(t, |f| f.mean_lat_us),
            us(t, |f| f.p50_lat_us),
            opt(r.added_mean_us, 1),
            opt(r.added_p50_us, 1),
            cpu(t),
        )?;
    }
    Ok(())
}

/// The local writearound write against `nbdkit file` serving the same backing file.
fn writearound_peers(md: &mut String, m: &Measured) -> Result<()> {
    let tc_write = m
        .passthrough
        .iter()
        .find(|r| r.backing == "local file" && r.shape.rw == "randwrite")
        .and_then(|r| r.tiercache.as_ref());
    writeln!(
        md,
        "\n### The local writearound write against nbdkit file\n\n\
         `nbdkit file BACKING` serves the backing file once tiercache is stopped: with \
         `cache=none` (each write goes through the page cache, is waited for with \
         `sync_file_range` and its pages dropped: no device flush, the closest to O_DIRECT), \
         and with its default page cache (the write returns once in RAM).\n"
    )?;
    head(
        md,
        &[
            "server",
            "IOPS",
            "mean µs",
            "p50 µs",
            "p99 µs",
            "server CPU µs/IO",
            "tiercache − this (mean), µs",
        ]
        .map(String::from),
    )?;
    let peer = |md: &mut String, name: &str, pt: Option<&Point>, minus: Option<f64>| {
        writeln!(
            md,
            "| {name} | {} | {} | {} | {} | {} | {} |",
            opt(pt.map(|p| p.fio.iops), 0),
            us(pt, |f| f.mean_lat_us),
            us(pt, |f| f.p50_lat_us),
            us(pt, |f| f.p99_lat_us),
            cpu(pt),
            opt(minus, 1),
        )
    };
    peer(md, "tiercache writearound", tc_write, None)?;
    for r in &m.peers {
        peer(md, &r.server, Some(&r.point), Some(r.tiercache_minus_us))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hits::tests::point;
    use crate::hits::{ReadRow, READ_ROWS};
    use std::collections::BTreeMap;

    #[test]
    fn read_tables_show_missing_columns_as_na() {
        let mut points = BTreeMap::new();
        points.insert(TC, point(3000.0, 1.0, 1.0));
        points.insert(RAW, point(6000.0, 1.0, 1.0));
        let rows = READ_ROWS.map(|shape| ReadRow {
            shape,
            points: points.clone(),
            hit_pct: [(TC, 100.0)].into(),
            misses: [(TC, 0)].into(),
            tiercache_over: [(RAW, 0.5)].into(),
        });
        let m = Measured {
            cached_after_warm: 0,
            cpus: crate::hits::Cpus {
                server: 1,
                client: Some(0),
                probe: vec![(0, 60000.0), (1, 90000.0)],
            },
            columns: [TC, KIT_FILE, QEMU, KIT_MEM, RAW]
                .map(|key| Column {
                    key,
                    name: key.into(),
                })
                .to_vec(),
            reads: rows.to_vec(),
            writes: Vec::new(),
            passthrough: Vec::new(),
            peers: Vec::new(),
        };
        let mut md = String::new();
        read_table(&mut md, &m, true).unwrap();
        assert!(md.starts_with("| row | tiercache | nbdkit_file | qemu_nbd | nbdkit_memory | raw | tiercache / raw |"), "{md}");
        assert!(
            md.contains("| QD1, 1 connection | 3000 | n/a | n/a | n/a | 6000 | 0.50 | n/a | n/a | n/a | 100.0 |"),
            "{md}"
        );
        assert_eq!(md.lines().count(), 7, "{md}");
        let mut seq = String::new();
        read_table(&mut seq, &m, false).unwrap();
        assert!(
            seq.contains("| 128 KiB sequential, QD8, 1 connection | 12 | n/a"),
            "{seq}"
        );
    }
}
