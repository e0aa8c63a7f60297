//! Running fio (its `nbd` engine against an export, or `psync` on files in a mounted
//! filesystem) and reading its JSON output (parsed, not scraped), plus its per-second IOPS logs.
//!
//! Invariant: a fio failure is an error with fio's own message; the numbers come only from
//! fio's JSON (`jobs[*].read/write`), summed over jobs (group reporting).

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
    pub p99_lat_us: f64,
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

fn parse(v: &Value) -> Result<Measured> {
    let jobs = v["jobs"].as_array().context("fio JSON has no jobs")?;
    let mut m = Measured::default();
    let mut lat_weighted = 0.0;
    let mut ios = 0.0;
    for job in jobs {
        for dir in ["read", "write"] {
            let d = &job[dir];
            let n = d["total_ios"].as_f64().unwrap_or(0.0);
            if n == 0.0 {
                continue;
            }
            m.ios += n as u64;
            m.iops += d["iops"].as_f64().unwrap_or(0.0);
            m.bw_mib_s += d["bw_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64;
            lat_weighted += d["lat_ns"]["mean"].as_f64().unwrap_or(0.0) * n;
            ios += n;
            let p99 = d["clat_ns"]["percentile"]["99.000000"]
                .as_f64()
                .unwrap_or(0.0)
                / 1000.0;
            m.p99_lat_us = m.p99_lat_us.max(p99);
        }
        m.runtime_s = m
            .runtime_s
            .max(job["job_runtime"].as_f64().unwrap_or(0.0) / 1000.0);
    }
    if ios == 0.0 {
        bail!("fio completed no I/O");
    }
    m.mean_lat_us = lat_weighted / ios / 1000.0;
    Ok(m)
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
              "read":{"total_ios":100,"iops":50.0,"bw_bytes":204800,"lat_ns":{"mean":2000.0},"clat_ns":{"percentile":{"99.000000":9000}}},
              "write":{"total_ios":100,"iops":50.0,"bw_bytes":204800,"lat_ns":{"mean":4000.0},"clat_ns":{"percentile":{"99.000000":12000}}}}]}"#,
        )
        .unwrap();
        let m = parse(&v).unwrap();
        assert_eq!(m.iops, 100.0);
        assert_eq!(m.ios, 200);
        assert_eq!(m.mean_lat_us, 3.0);
        assert_eq!(m.p99_lat_us, 12.0);
        assert_eq!(m.runtime_s, 2.0);
        assert!(parse(&serde_json::json!({"jobs": []})).is_err());
    }
}
