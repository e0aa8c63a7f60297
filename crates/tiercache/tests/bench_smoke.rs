//! Smoke test of `tiercache bench --scale tiny`: the harness runs end to end and its outputs
//! are well formed (results.json parses and has a row for every configuration × workload that
//! ran, including W2's sequential steps, W3 on ext4 when root, the three W4 steps (the O_DSYNC
//! one with a flush per write), W6's warm-up and steady rows, the `+nonrot` variants with
//! ratios against `hdd+nonrot`, and the `+memlimit` variants when root; results.md has the
//! tables; the charts `w1.svg` (bars), `w4.svg` and `w6.svg` (time series) exist, are SVG with a
//! legend entry per configuration, and are embedded in results.md; no mount or loop device is
//! left behind), that `--workloads hits` fills its tables (cached reads from a fully cached
//! region, writeback writes absorbed as dirty data, passthrough over a local file and over
//! NBD), and that bad options fail with a clear message. It asserts no timing.
//!
//! Needs fio; W3 needs root, nbdfuse, losetup, mkfs.ext4, mount and fusermount3; the
//! `+memlimit` run uses nbdkit, the hits run nbdkit and qemu-nbd. Under `CI=true` (which runs
//! as root) anything missing fails the test; otherwise the test prints SKIP for what it cannot
//! run.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// Whether `tool` is on the PATH, quietly: the callers decide (and say) what a missing one
/// means.
fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

use test_support::is_root;

/// Runs `tiercache bench --scale tiny ARGS --out OUT`; returns results.json and results.md.
fn bench(out: &Path, args: &[&str]) -> (Value, String) {
    let status = Command::new(env!("CARGO_BIN_EXE_tiercache"))
        .args(["bench", "--scale", "tiny"])
        .args(args)
        .arg("--out")
        .arg(out)
        .status()
        .expect("running tiercache bench");
    assert!(status.success(), "tiercache bench {args:?} failed");
    let json = serde_json::from_str(
        &std::fs::read_to_string(out.join("results.json")).expect("results.json"),
    )
    .expect("results.json parses");
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    (json, md)
}

fn has_row(json: &Value, w: &str, c: &str, step: Option<&str>) -> bool {
    json["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .any(|r| r["workload"] == w && r["config"] == c && step.is_none_or(|s| r["step"] == s))
}

fn notices(json: &Value) -> String {
    json["notices"].to_string()
}

/// Nothing mounted and no loop device over anything under `dir`.
fn assert_nothing_left(dir: &Path) {
    let dir = std::fs::canonicalize(dir).expect("out dir");
    let dir = dir.to_string_lossy();
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    assert!(!mounts.contains(dir.as_ref()), "mount left under {dir}");
    if let Ok(o) = Command::new("losetup").arg("-a").output() {
        let loops = String::from_utf8_lossy(&o.stdout);
        assert!(!loops.contains(dir.as_ref()), "loop device left: {loops}");
    }
}

#[test]
fn bench_rejects_bad_options() {
    for (args, msg) in [
        (
            &["--configs", "tiercache-fastest"][..],
            "unknown configuration",
        ),
        (&["--workloads", "W9"][..], "unknown workload"),
        (&["--configs", "ssd+nonrot"][..], "no emulated disk"),
        (&["--workloads", "hits,W1"][..], "runs alone"),
        (&["--mem-limit", "8"][..], "--mem-limit 8"),
        (
            &["--mem-limit", "0", "--configs", "nbdkit-cache+memlimit"][..],
            "--mem-limit 0",
        ),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_tiercache"))
            .args([
                "bench",
                "--scale",
                "tiny",
                "--out",
                "/nonexistent/never-made",
            ])
            .args(args)
            .output()
            .expect("running tiercache bench");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(msg), "{args:?}: {err}");
    }
}

#[test]
fn bench_tiny_writes_well_formed_results() {
    let ci = test_support::ci();
    let root = is_root();
    assert!(root || !ci, "CI runs as root; W3 and +memlimit must run");
    let fs_tools = ["nbdfuse", "losetup", "mkfs.ext4", "mount", "fusermount3"];
    for tool in ["fio", "nbdkit"].iter().chain(&fs_tools) {
        if !have(tool) {
            assert!(!ci, "{tool} is required under CI=true");
            println!("SKIP (part): {tool} is not installed");
        }
    }
    if !have("fio") {
        println!("SKIP: fio is not installed");
        return;
    }
    let w3_runs = root && fs_tools.iter().all(|t| have(t));
    let out = tempfile::tempdir().expect("tempdir");

    // The workloads with their own code paths on the disk alone and one tiercache mode (W1 for
    // its bar chart); W5 shares W1's path and stays out to keep this short.
    let (json, md) = bench(
        out.path(),
        &[
            "--workloads",
            "W1,W2,W3,W4,W6,W7",
            "--configs",
            "hdd,tiercache-writeback",
        ],
    );
    assert_nothing_left(out.path());
    for c in ["hdd", "tiercache-writeback"] {
        for step in ["write 8k", "read 8k", "randread 8k", "randwrite 8k"] {
            assert!(has_row(&json, "W2", c, Some(step)), "no W2 {step} on {c}");
        }
        for step in [
            "sync randwrite 4k to 70 % of cache",
            "64k write 1 % random",
            "64k write 1 % random O_DSYNC",
            "zipf:1.2 randrw 70/30 (warm-up)",
            "zipf:1.2 randrw 70/30 (steady)",
        ] {
            let w = if step.starts_with("zipf") { "W6" } else { "W4" };
            assert!(has_row(&json, w, c, Some(step)), "no {w} {step} on {c}");
            assert!(md.contains(step), "results.md lacks {step}");
        }
        let row = |w: &str, step: &str| {
            json["rows"]
                .as_array()
                .expect("rows")
                .iter()
                .find(|r| r["workload"] == w && r["config"] == c && r["step"] == step)
                .cloned()
                .expect("row")
        };
        // One flush per write (fio's syncs; a job's last write may end before its flush).
        let dsync = row("W4", "64k write 1 % random O_DSYNC");
        assert!(
            dsync["flushes_per_write"]
                .as_f64()
                .is_some_and(|f| f > 0.5 && f <= 1.0),
            "{dsync}"
        );
        assert!(row("W4", "64k write 1 % random")["flushes_per_write"].is_null());
        let warm = row("W6", "zipf:1.2 randrw 70/30 (warm-up)");
        let steady = row("W6", "zipf:1.2 randrw 70/30 (steady)");
        assert_eq!(warm["phase"], "warm-up");
        assert!(warm["seconds"].as_f64().is_some_and(|s| s > 0.0), "{warm}");
        assert!(
            warm["ratio_hdd"].is_null(),
            "warm-up rows get no ratio: {warm}"
        );
        assert!(["steady", "not-steady"].contains(&steady["phase"].as_str().unwrap_or("")));
        assert!(steady["ratio_hdd"].is_number(), "{steady}");
        assert!(has_row(&json, "W7", c, None), "no W7 row for {c}");
        if w3_runs {
            assert!(
                has_row(&json, "W3", c, Some("randwrite 4k on ext4")),
                "no W3 row for {c}"
            );
        }
    }
    if w3_runs {
        assert!(md.contains("## W3"), "results.md lacks W3");
    } else {
        assert!(notices(&json).contains("W3 skipped"), "no W3 notice");
    }
    for r in json["rows"].as_array().expect("rows") {
        assert!(r["iops"].as_f64().is_some_and(|v| v >= 0.0), "bad row {r}");
        if r["config"] == "tiercache-writeback" && r["workload"] != "W7" {
            assert!(r["cache_written_mib"].is_number(), "no cache column: {r}");
        }
    }
    for heading in ["## W2", "## W4", "## W6", "## W7", "|---|"] {
        assert!(md.contains(heading), "results.md lacks {heading}");
    }
    let plots: Vec<&str> = json["plots"]
        .as_array()
        .expect("plots")
        .iter()
        .map(|p| p.as_str().expect("plot name"))
        .collect();
    assert_eq!(
        plots,
        ["w1.svg", "w4.svg", "w6.svg"],
        "one chart per plotted workload"
    );
    for p in plots {
        let svg = std::fs::read_to_string(out.path().join(p)).expect("plot file");
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{p} is not an SVG"
        );
        for c in ["hdd", "tiercache-writeback"] {
            assert!(
                svg.contains(&format!(">\n{c}\n</text>")),
                "{p} has no legend entry for {c}"
            );
        }
        assert!(
            md.contains(&format!("]({p})")),
            "results.md does not show {p}"
        );
    }

    // The non-rotational disk and the memory-limited variants (one short step each).
    let out = tempfile::tempdir().expect("tempdir");
    let mut configs = vec!["hdd+nonrot", "tiercache-writeback+nonrot"];
    let memlimit = ["tiercache-writeback+memlimit", "nbdkit-cache+memlimit"];
    if have("nbdkit") {
        configs.extend(memlimit);
    }
    let (json, md) = bench(
        out.path(),
        &["--workloads", "W5", "--configs", &configs.join(",")],
    );
    for r in json["rows"].as_array().expect("rows") {
        if r["config"] == "tiercache-writeback+nonrot" {
            assert_eq!(r["disk"], "non-rotational", "{r}");
            assert!(
                r["ratio_hdd"].is_number(),
                "no ratio against hdd+nonrot: {r}"
            );
        }
    }
    assert!(
        md.contains("| disk |") && md.contains("non-rotational"),
        "{md}"
    );
    for c in &configs[..2] {
        assert!(has_row(&json, "W5", c, None), "no W5 row for {c}");
    }
    if have("nbdkit") {
        for c in memlimit {
            if root {
                assert!(has_row(&json, "W5", c, None), "no W5 row for {c}");
            }
        }
        if root {
            assert!(md.contains("+memlimit"), "results.md lacks +memlimit");
        } else {
            assert!(
                notices(&json).contains("+memlimit configurations skipped"),
                "no +memlimit notice"
            );
        }
    }
}

#[test]
fn bench_hits_tiny_fills_its_tables() {
    let ci = test_support::ci();
    for tool in ["fio", "nbdkit", "qemu-nbd"] {
        if !have(tool) {
            assert!(!ci, "{tool} is required under CI=true");
            println!("SKIP: {tool} is not installed");
            return;
        }
    }
    let out = tempfile::tempdir().expect("tempdir");
    let status = Command::new(env!("CARGO_BIN_EXE_tiercache"))
        .args(["bench", "--scale", "tiny", "--workloads", "hits", "--out"])
        .arg(out.path())
        .status()
        .expect("running tiercache bench");
    assert!(status.success(), "tiercache bench --workloads hits failed");
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(out.path().join("hits.json")).expect("hits.json"),
    )
    .expect("hits.json parses");
    let md = std::fs::read_to_string(out.path().join("hits.md")).expect("hits.md");
    // tiercache (threads) is a column only when `serve` has --data-path.
    let threads = json["columns"]
        .as_array()
        .expect("columns")
        .iter()
        .any(|c| c["key"] == "tiercache_threads");
    let mut tiercaches = vec!["tiercache"];
    tiercaches.extend(threads.then_some("tiercache_threads"));
    let reads = json["reads"].as_array().expect("reads");
    assert_eq!(reads.len(), 6, "{json}");
    assert_eq!(reads[5]["bs"], "128k");
    // QD32 is run again with the CPUs fixed: on two (where the machine has two) and on one.
    let places: Vec<&str> = reads.iter().filter_map(|r| r["place"].as_str()).collect();
    assert_eq!(
        places,
        [
            "scheduler",
            "scheduler",
            "apart",
            "together",
            "scheduler",
            "scheduler"
        ],
        "{json}"
    );
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    for r in reads {
        if r["place"] == "apart" && r["points"] == serde_json::json!({}) {
            assert!(cpus < 2, "not run on {cpus} CPUs: {r}");
            continue;
        }
        if r["place"] != "scheduler" {
            // fio was pinned: its command says where.
            assert!(r["points"]["raw"]["command"]
                .as_str()
                .is_some_and(|c| c.contains("--cpus_allowed=")));
        }
        let points = &r["points"];
        for server in ["nbdkit_file", "qemu_nbd", "nbdkit_memory", "raw"]
            .iter()
            .chain(&tiercaches)
        {
            assert!(
                points[server]["iops"].as_f64().is_some_and(|v| v > 0.0),
                "{r}"
            );
            assert!(points[server]["command"]
                .as_str()
                .is_some_and(|c| c.starts_with("fio ")));
        }
        // The region was verified cached before the runs, and every read of it hit.
        for t in &tiercaches {
            assert_eq!(r["misses"][t], 0, "{r}");
            assert_eq!(r["hit_pct"][t].as_f64(), Some(100.0), "{r}");
            assert!(points[t]["server_cpu_us_per_io"].is_number(), "{r}");
        }
        assert!(points["raw"]["server_cpu_us_per_io"].is_null(), "{r}");
        for k in ["raw", "nbdkit_memory", "qemu_nbd", "nbdkit_file"] {
            assert!(r["tiercache_over"][k].is_number(), "{r}");
        }
    }
    let writes = json["writes"].as_array().expect("writes");
    assert_eq!(writes.len(), 3 + usize::from(threads), "{json}");
    for w in writes {
        assert!(w["point"]["iops"].as_f64().is_some_and(|v| v > 0.0), "{w}");
        assert!(w["over_raw"].is_number(), "{w}");
        // Writeback absorbed every write: the dirty bytes cover what fio wrote.
        if tiercaches.contains(&w["key"].as_str().unwrap_or_default()) {
            let written = w["point"]["writes"].as_u64().unwrap_or(0) * 4096;
            assert!(w["dirty_after_bytes"].as_u64() >= Some(written), "{w}");
        }
    }
    let pass = json["passthrough"].as_array().expect("passthrough");
    assert_eq!(pass.len(), 4, "{json}");
    for r in pass {
        for side in ["alone", "tiercache"] {
            assert!(
                r[side]["mean_lat_us"].as_f64().is_some_and(|v| v > 0.0),
                "{r}"
            );
        }
        assert!(
            r["added_mean_us"].is_number() && r["added_p50_us"].is_number(),
            "{r}"
        );
    }
    let peers = json["passthrough_peers"].as_array().expect("peers");
    assert_eq!(peers.len(), 2, "{json}");
    for w in peers {
        assert!(w["tiercache_minus_us"].is_number(), "{w}");
    }
    for heading in [
        "### 4 KiB random reads",
        "### Sequential reads",
        "## Writeback",
        "## Passthrough",
        "--workloads W4",
    ] {
        assert!(md.contains(heading), "hits.md lacks {heading}");
    }
    assert!(
        !out.path().join("hits-scratch").exists(),
        "scratch left behind"
    );
}
