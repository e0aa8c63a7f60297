//! Smoke test of `tiercache bench --workloads scale` at tiny sizes: the whole measurement
//! (make, start, fill, kill -9 and restart, fill to a full cache and a CPU window for two
//! bucket sizes) runs end to end, scale.json is well formed with every field of every row
//! present and measured, scale.md has both tables, and the scratch devices are gone
//! afterwards; bad options fail with a clear message. It asserts no timing.
//!
//! Needs fio (with its nbd engine); under `CI=true` a missing fio fails the test, otherwise the
//! test prints SKIP.

mod common;

use common::{have, tc};
use serde_json::Value;

const SIZE_FIELDS: [&str; 16] = [
    "cache_bytes",
    "backing_bytes",
    "bucket_bytes",
    "make_s",
    "start_s",
    "start_peak_rss_bytes",
    "serving_rss_bytes",
    "fill_s",
    "fill_written_bytes",
    "fill_iops",
    "cached_bytes",
    "filled_rss_bytes",
    "rss_growth_per_cached_block",
    "restart_s",
    "restart_peak_rss_bytes",
    "restart_cached_bytes",
];

const CPU_FIELDS: [&str; 12] = [
    "cache_bytes",
    "backing_bytes",
    "bucket_bytes",
    "to_full_written_bytes",
    "to_full_s",
    "in_use_pct_before",
    "in_use_pct_after",
    "window_s",
    "writes",
    "iops",
    "server_cpu_s",
    "server_cpu_us_per_write",
];

fn rows<'a>(json: &'a Value, key: &str) -> &'a Vec<Value> {
    json[key]
        .as_array()
        .unwrap_or_else(|| panic!("scale.json has no '{key}' array: {json}"))
}

#[test]
fn scale_tiny_writes_well_formed_results() {
    if !have("fio") {
        return;
    }
    let out = tempfile::tempdir().expect("tempdir");
    let o = tc()
        .args([
            "bench",
            "--workloads",
            "scale",
            "--scale-caches",
            "64M",
            "--scale-fill",
            "8M",
            "--scale-cpu-cache",
            "64M",
            "--scale-cpu-window",
            "1",
            "--out",
        ])
        .arg(out.path())
        .output()
        .expect("running tiercache bench");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "bench --workloads scale failed: {stderr}"
    );

    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("scale.json")).expect("scale.json"),
    )
    .expect("scale.json parses");
    for key in ["date", "machine", "command"] {
        assert!(json[key].is_string(), "no {key}: {json}");
    }
    assert_eq!(json["params"]["fill_bytes"], 8 << 20);
    let sizes = rows(&json, "sizes");
    assert_eq!(sizes.len(), 1, "one row per cache size");
    let cpu = rows(&json, "cpu");
    assert_eq!(cpu.len(), 2, "one CPU row per bucket size (64k, 512k)");
    for (list, fields) in [(sizes, &SIZE_FIELDS[..]), (cpu, &CPU_FIELDS[..])] {
        for r in list {
            for f in fields {
                assert!(
                    r[*f].as_f64().is_some_and(|v| v >= 0.0),
                    "field {f} missing or not measured: {r}"
                );
            }
            assert_eq!(r["notes"], serde_json::json!([]), "unexpected notes: {r}");
        }
    }
    let s = &sizes[0];
    assert_eq!(s["cache_bytes"], 64 << 20);
    assert_eq!(s["backing_bytes"], 16u64 << 30);
    assert_eq!(s["fill_written_bytes"], 8 << 20);
    assert!(s["cached_bytes"].as_u64() > Some(0), "nothing cached: {s}");
    assert_eq!(cpu[0]["bucket_bytes"], 64 << 10);
    assert_eq!(cpu[1]["bucket_bytes"], 512 << 10);
    for r in cpu {
        assert!(r["in_use_pct_before"].as_u64() >= Some(95), "not full: {r}");
        assert!(r["writes"].as_u64() > Some(0), "no writes measured: {r}");
    }

    let md = std::fs::read_to_string(out.path().join("scale.md")).expect("scale.md");
    for text in ["| cache | backing | make s", "| cache | bucket |", "|---|"] {
        assert!(md.contains(text), "scale.md lacks {text}: {md}");
    }
    assert!(
        !out.path().join("scale-scratch").exists(),
        "scratch devices left behind"
    );
}

#[test]
fn scale_rejects_bad_options() {
    for (args, msg) in [
        (&["--workloads", "scale,W1"][..], "runs alone"),
        (
            &["--workloads", "scale", "--configs", "hdd"][..],
            "runs alone",
        ),
        (
            &["--workloads", "scale", "--scale-fill", "1000"][..],
            "multiple of 4 KiB",
        ),
        (
            &["--workloads", "scale", "--scale-cpu-window", "0"][..],
            "at least 1 second",
        ),
        (
            &["--workloads", "scale", "--scale-caches", "4X"][..],
            "unknown size suffix",
        ),
    ] {
        let o = tc()
            .args(["bench", "--out", "/nonexistent/never-made"])
            .args(args)
            .output()
            .expect("running tiercache bench");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(msg), "{args:?}: {err}");
    }
}
