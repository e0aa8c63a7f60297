//! Running fio (its `nbd` engine against an export, or `psync` on files in a mounted
//! filesystem) and reading its JSON output (parsed, not scraped), plus its per-second IOPS logs;
//! or watching a run through its periodic JSON reports (`--status-interval`) and stopping it
//! (SIGINT) when the caller has seen enough.
//!
//! Invariant: a fio failure is an error with fio's own message; the numbers come only from
//! fio's JSON (`jobs[*].read/write/sync`), summed over jobs (group reporting); a watched fio is
//! always waited for, also on error.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What fio drives.
pub enum Target {
    /// An NBD export, through fio's `nbd` engine (asynchronous; `--iodepth` is the queue depth).
    Nbd(String),
    /// Files in a directory (a mounted filesystem), through the `psync` engine.
    Files(PathBuf),
    /// One file straight, no NBD: `libaio` with O_DIRECT (`--iodepth` is the queue depth).
    Raw(PathBuf),
}

impl Target {
    fn args(&self) -> Vec<String> {
        match self {
            Target::Nbd(uri) => vec!["--ioengine=nbd".into(), format!("--uri={uri}")],
            Target::Files(dir) => vec![
                "--ioengine=psync".into(),
                format!("--directory={}", dir.display()),
            ],
            Target::Raw(file) => vec![
                "--ioengine=libaio".into(),
                "--direct=1".into(),
                format!("--filename={}", file.display()),
            ],
        }
    }
}

/// What one fio run measured (reads and writes together).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Measured {
    /// I/Os completed (reads and writes).
    pub ios: u64,
    pub iops: f64,
    pub bw_mib_s: f64,
    pub mean_lat_us: f64,
    /// Completion latency (fio `clat_ns`) percentiles, the largest over the sides that ran.
    pub p50_lat_us: f64,
    pub p99_lat_us: f64,
    pub runtime_s: f64,
    /// Writes completed (of `ios`).
    pub writes: u64,
    /// Syncs completed: with the `nbd` engine, one NBD flush each (`--fsync=N`).
    pub syncs: u64,
}

/// Cumulative counts of one fio report (from the start of the run), for differences between
/// periodic reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    /// Reads and writes completed.
    pub ios: u64,
    pub bytes: u64,
    /// Sum of the completed I/Os' latencies (fio `lat_ns`), in ns.
    pub lat_ns: f64,
    /// The longest job's run time so far (fio `job_runtime`), in s.
    pub runtime_s: f64,
}

/// Runs fio against `target` with the job options `args` (`--rw=...` etc.); `iops_log` gets
/// the per-second IOPS log prefix when wanted.
pub fn run(target: &Target, args: &[String], iops_log: Option<&Path>) -> Result<Measured> {
    let mut c = Command::new("fio");
    c.args(argv(target, args));
    if let Some(p) = iops_log {
        c.arg(format!("--write_iops_log={}", p.display()))
            .arg("--log_avg_msec=1000");
    }
    let out = c.output().context("running fio (is it installed?)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio failed: {}{}",
            String::from_utf8_lossy(&out.stderr).trim(),
            stdout.trim()
        );
    }
    // fio prints "fio: connected to NBD server" before the JSON document.
    let start = stdout.find('{').context("fio printed no JSON")?;
    let v: Value = serde_json::from_str(&stdout[start..]).context("parsing fio's JSON output")?;
    parse(&v)
}

/// fio's arguments for `target` and the job options `args` (no IOPS log).
fn argv(target: &Target, args: &[String]) -> Vec<String> {
    let mut v = vec!["--name=bench".to_string()];
    v.extend(target.args());
    v.extend(["--group_reporting".into(), "--output-format=json".into()]);
    v.extend_from_slice(args);
    v
}

/// The command line [`run`] executes (without an IOPS log), for reports.
pub fn command_line(target: &Target, args: &[String]) -> String {
    format!("fio {}", argv(target, args).join(" "))
}

/// The sides ("read" or "write", and its figures) of every job in fio's JSON `v` that
/// completed I/O.
fn sides(v: &Value) -> Result<impl Iterator<Item = (&'static str, &Value)>> {
    let jobs = v["jobs"].as_array().context("fio JSON has no jobs")?;
    Ok(jobs.iter().flat_map(|job| {
        ["read", "write"]
            .into_iter()
            .map(move |dir| (dir, &job[dir]))
            .filter(|(_, d)| d["total_ios"].as_f64().unwrap_or(0.0) > 0.0)
    }))
}

/// The longest job's run time in `v`, in s.
fn runtime_s(v: &Value) -> f64 {
    v["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|job| job["job_runtime"].as_f64().unwrap_or(0.0) / 1000.0)
        .fold(0.0, f64::max)
}

fn parse(v: &Value) -> Result<Measured> {
    let mut m = Measured::default();
    let mut lat_weighted = 0.0;
    for (dir, d) in sides(v)? {
        let n = d["total_ios"].as_f64().unwrap_or(0.0);
        m.ios += n as u64;
        if dir == "write" {
            m.writes += n as u64;
        }
        m.iops += d["iops"].as_f64().unwrap_or(0.0);
        m.bw_mib_s += d["bw_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64;
        lat_weighted += d["lat_ns"]["mean"].as_f64().unwrap_or(0.0) * n;
        let pct = |p: &str| d["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
        m.p50_lat_us = m.p50_lat_us.max(pct("50.000000"));
        m.p99_lat_us = m.p99_lat_us.max(pct("99.000000"));
    }
    if m.ios == 0 {
        bail!("fio completed no I/O");
    }
    m.syncs = v["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|job| job["sync"]["total_ios"].as_u64().unwrap_or(0))
        .sum();
    m.runtime_s = runtime_s(v);
    m.mean_lat_us = lat_weighted / m.ios as f64 / 1000.0;
    Ok(m)
}

/// The cumulative counts of one (periodic or final) report.
fn totals(v: &Value) -> Result<Totals> {
    let mut t = Totals {
        runtime_s: runtime_s(v),
        ..Totals::default()
    };
    for (_, d) in sides(v)? {
        let n = d["total_ios"].as_u64().unwrap_or(0);
        t.ios += n;
        t.bytes += d["io_bytes"].as_u64().unwrap_or(0);
        t.lat_ns += d["lat_ns"]["mean"].as_f64().unwrap_or(0.0) * n as f64;
    }
    Ok(t)
}

/// Runs fio against `target` with the job options `args` (which bound its run time) and
/// `--status-interval=every_s`, handing each report's cumulative counts to `go_on` as it
/// arrives; once `go_on` returns false, fio is stopped with SIGINT and later reports are not
/// handed over. Returns whether it was stopped that way.
pub fn run_watched(
    target: &Target,
    args: &[String],
    every_s: u64,
    mut go_on: impl FnMut(&Totals) -> Result<bool>,
) -> Result<bool> {
    use std::io::{BufRead, Read};
    use std::process::Stdio;
    let mut child = Command::new("fio")
        .args(argv(target, args))
        .arg(format!("--status-interval={every_s}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running fio (is it installed?)")?;
    let mut err_pipe = child.stderr.take().context("fio's stderr")?;
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let stdout = std::io::BufReader::new(child.stdout.take().context("fio's stdout")?);
    let mut stopped = false;
    // fio prints each report as a JSON document whose braces stand alone on their lines, with
    // its own messages ("fio: connected to NBD server") between them.
    let read = || -> Result<()> {
        let mut doc: Option<String> = None;
        for line in stdout.lines() {
            let line = line.context("reading fio's output")?;
            if doc.is_none() {
                if line != "{" {
                    continue;
                }
                doc = Some(String::new());
            }
            let d = doc.as_mut().expect("a document is open");
            d.push_str(&line);
            d.push('\n');
            if line != "}" {
                continue;
            }
            let text = doc.take().unwrap_or_default();
            if stopped {
                continue;
            }
            let v: Value = serde_json::from_str(&text).context("parsing fio's JSON report")?;
            if !go_on(&totals(&v)?)? {
                stopped = true;
                // SAFETY: kill(2) on our own child, not yet waited for; no memory is touched.
                unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
            }
        }
        Ok(())
    };
    let read = read();
    if read.is_err() {
        let _ = child.kill();
    }
    let status = child.wait().context("waiting for fio")?;
    let err = stderr.join().unwrap_or_default();
    read?;
    if !status.success() && !stopped {
        bail!("fio failed ({status}): {}", err.trim());
    }
    Ok(stopped)
}

/// Sums fio's per-job IOPS logs (`PREFIX_iops.N.log`, lines `msec, value, dir, ...`) into
/// one value per second.
pub fn iops_series(prefix: &Path) -> Vec<(f64, f64)> {
    let dir = prefix.parent().unwrap_or(Path::new("."));
    let stem = prefix
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut per_sec: std::collections::BTreeMap<u64, f64> = Default::default();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with(&format!("{stem}_iops")) && name.ends_with(".log")) {
            continue;
        }
        for line in std::fs::read_to_string(e.path())
            .unwrap_or_default()
            .lines()
        {
            let mut f = line.split(',').map(str::trim);
            if let (Some(Ok(ms)), Some(Ok(v))) = (
                f.next().map(str::parse::<u64>),
                f.next().map(str::parse::<f64>),
            ) {
                *per_sec.entry(ms.div_ceil(1000)).or_default() += v;
            }
        }
    }
    per_sec.into_iter().map(|(s, v)| (s as f64, v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_read_and_write_sides() {
        let v: Value = serde_json::from_str(
            r#"{"jobs":[{"job_runtime":2000,
              "read":{"total_ios":100,"iops":50.0,"bw_bytes":204800,"lat_ns":{"mean":2000.0},"clat_ns":{"percentile":{"50.000000":1500,"99.000000":9000}}},
              "write":{"total_ios":100,"iops":50.0,"bw_bytes":204800,"lat_ns":{"mean":4000.0},"clat_ns":{"percentile":{"50.000000":3500,"99.000000":12000}}}}]}"#,
        )
        .unwrap();
        let m = parse(&v).unwrap();
        assert_eq!(m.iops, 100.0);
        assert_eq!(m.ios, 200);
        assert_eq!(m.mean_lat_us, 3.0);
        assert_eq!(m.p99_lat_us, 12.0);
        assert_eq!(m.p50_lat_us, 3.5);
        assert_eq!(m.runtime_s, 2.0);
        assert_eq!((m.writes, m.syncs), (100, 0));
        assert!(parse(&serde_json::json!({"jobs": []})).is_err());
        let t = totals(&v).unwrap();
        assert_eq!(t.ios, 200);
        assert_eq!(t.lat_ns, 600_000.0);
        assert_eq!(t.runtime_s, 2.0);
    }
}
