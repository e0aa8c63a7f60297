//! Smoke test of `tiercache bench --scale tiny`: the harness runs end to end and its outputs
//! are well formed (results.json parses and covers every configuration × workload that ran,
//! results.md has the tables, every plot is a non-empty SVG). It asserts no timing.
//!
//! Needs fio (and uses nbdkit when present). Under `CI=true` a missing fio fails the test;
//! otherwise the test prints SKIP and returns.

use std::process::Command;

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").output().is_ok()
}

#[test]
fn bench_tiny_writes_well_formed_results() {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    for tool in ["fio", "nbdkit"] {
        if !have(tool) {
            assert!(!ci, "{tool} is required under CI=true");
            if tool == "fio" {
                println!("SKIP: {tool} is not installed");
                return;
            }
        }
    }
    let out = tempfile::tempdir().expect("tempdir");
    // A subset keeps the debug-build run short: one cold/warm workload, one plotted
    // workload and the drain, on the two references and one tiercache mode.
    let status = Command::new(env!("CARGO_BIN_EXE_tiercache"))
        .args(["bench", "--scale", "tiny", "--workloads", "W1,W6,W7"])
        .args(["--configs", "hdd,ssd,tiercache-writeback"])
        .arg("--out")
        .arg(out.path())
        .status()
        .expect("running tiercache bench");
    assert!(status.success(), "tiercache bench failed");

    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("results.json")).expect("results.json"),
    )
    .expect("results.json parses");
    let rows = json["rows"].as_array().expect("rows");
    for w in ["W1", "W6"] {
        for c in ["hdd", "ssd", "tiercache-writeback"] {
            assert!(
                rows.iter().any(|r| r["workload"] == w && r["config"] == c),
                "no row for {w} on {c}"
            );
        }
    }
    for c in ["hdd", "tiercache-writeback"] {
        assert!(
            rows.iter()
                .any(|r| r["workload"] == "W7" && r["config"] == c),
            "no W7 row for {c}"
        );
    }
    for r in rows {
        assert!(r["iops"].as_f64().is_some_and(|v| v >= 0.0), "bad row {r}");
    }
    assert!(
        rows.iter().any(
            |r| r["workload"] == "W1" && r["step"].as_str().is_some_and(|s| s.contains("warm"))
        ),
        "W1 has no warm run"
    );

    let md = std::fs::read_to_string(out.path().join("results.md")).expect("results.md");
    for heading in ["## W1", "## W6", "## W7", "|---|"] {
        assert!(md.contains(heading), "results.md lacks {heading}");
    }

    let plots = json["plots"].as_array().expect("plots");
    assert!(!plots.is_empty(), "no plots");
    for p in plots {
        let svg = std::fs::read_to_string(out.path().join(p.as_str().expect("plot name")))
            .expect("plot file");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{p} is not an SVG"
        );
    }
}
