//! The `tiercache` command on plain files: make, show, check, and clean one-line errors with a
//! non-zero exit for bad input (never a panic).

use std::path::Path;
use std::process::{Command, Output};

fn tc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tiercache"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("running tiercache")
}

fn file(dir: &Path, name: &str, size: u64) -> String {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(size).unwrap();
    p.to_str().unwrap().to_string()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_clean_failure(o: &Output, needle: &str) {
    assert!(!o.status.success(), "expected failure, got success");
    let e = stderr(o);
    assert!(e.contains(needle), "stderr lacks '{needle}': {e}");
    assert!(!e.contains("panicked"), "panic: {e}");
}

#[test]
fn make_show_check_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let slow = file(dir.path(), "slow.img", 64 << 20);
    let fast = file(dir.path(), "fast.img", 16 << 20);
    let o = tc(&[
        "make",
        "--backing",
        &slow,
        "--cache",
        &fast,
        "--label",
        "data",
        "--bucket-size",
        "256k",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("export 'data'"), "{out}");
    let o = tc(&["show", &fast]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success()
            && out.contains("cache device")
            && out.contains("bucket_size     262144"),
        "{out}"
    );
    let o = tc(&["show", &slow]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("backing device")
            && out.contains("dev.label       data")
            && out.contains("writethrough"),
        "{out}"
    );
    let o = tc(&["check", &fast, "--data"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("no problems"));
    let o = tc(&["check", &slow]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Formatting again is refused without --force, then allowed with it.
    let o = tc(&["make", "--backing", &slow, "--cache", &fast]);
    assert_clean_failure(&o, "--force");
    let o = tc(&[
        "make",
        "--backing",
        &slow,
        "--cache",
        &fast,
        "--force",
        "--writeback",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&tc(&["show", &slow]).stdout).contains("writeback"));
}

#[test]
fn check_reports_damage_precisely() {
    let dir = tempfile::tempdir().unwrap();
    let slow = file(dir.path(), "slow.img", 32 << 20);
    let fast = file(dir.path(), "fast.img", 16 << 20);
    assert!(tc(&["make", "--backing", &slow, "--cache", &fast])
        .status
        .success());
    // Damage superblock copy 0: recoverable (exit 1) and named.
    let mut img = std::fs::read(&fast).unwrap();
    img[4096 + 40] ^= 0xff;
    std::fs::write(&fast, &img).unwrap();
    let o = tc(&["check", &fast]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("superblock copy 0"), "{}", stderr(&o));
    // Damage the current checkpoint too: unusable (exit 2).
    let o = tc(&["show", &fast]);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let field = |prefix: &str, n: usize| -> usize {
        let line = out.lines().find(|l| l.starts_with(prefix)).unwrap();
        line.split_whitespace().nth(n).unwrap().parse().unwrap()
    };
    let slot = field("checkpoint ", 2);
    let off = field("checkpoints", 2 + slot);
    img[off + 40] ^= 0xff;
    std::fs::write(&fast, &img).unwrap();
    let o = tc(&["check", &fast]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("checkpoint"), "{}", stderr(&o));
}

#[test]
fn bad_input_gets_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let slow = file(dir.path(), "slow.img", 32 << 20);
    let fast = file(dir.path(), "fast.img", 16 << 20);
    let tiny = file(dir.path(), "tiny.img", 100 << 10);
    let missing = dir.path().join("missing.img").to_str().unwrap().to_string();
    assert_clean_failure(
        &tc(&["make", "--backing", &missing, "--cache", &fast]),
        "no such file",
    );
    assert_clean_failure(
        &tc(&["make", "--backing", &slow, "--cache", &tiny]),
        "too small",
    );
    // The size as given (not rounded to nothing), and the minimum for the geometry asked.
    let sector = file(dir.path(), "sector.img", 512);
    let o = tc(&["make", "--backing", &slow, "--cache", &sector]);
    assert_clean_failure(&o, "cache device of 512 bytes is too small");
    assert!(!stderr(&o).contains("invalid request"), "{}", stderr(&o));
    // 1 MiB with the default geometry: the minimum in MiB, for the block size asked.
    let mib = file(dir.path(), "mib.img", 1 << 20);
    for (block, said) in [("4k", "4096-byte blocks"), ("8k", "8192-byte blocks")] {
        let o = tc(&[
            "make",
            "--backing",
            &slow,
            "--cache",
            &mib,
            "--block-size",
            block,
        ]);
        assert_clean_failure(&o, "cache device of 1.0 MiB is too small");
        let err = stderr(&o);
        assert!(
            err.contains("8 buckets of 512.0 KiB")
                && err.contains(said)
                && err.contains("need at least ")
                && err.contains(" MiB (")
                && !err.contains("invalid request"),
            "{err}"
        );
    }
    let o = tc(&[
        "make",
        "--backing",
        &slow,
        "--cache",
        &sector,
        "--bucket-size",
        "64k",
    ]);
    let err = stderr(&o);
    assert!(
        err.contains("64.0 KiB with 4096-byte blocks") && err.contains(" MiB ("),
        "{err}"
    );
    assert_clean_failure(
        &tc(&[
            "make",
            "--backing",
            &tiny,
            "--cache",
            &fast,
            "--bucket-size",
            "12x",
        ]),
        "unknown size suffix",
    );
    assert_clean_failure(
        &tc(&[
            "make",
            "--backing",
            &slow,
            "--cache",
            &fast,
            "--block-size",
            "3000",
        ]),
        "block size",
    );
    assert_clean_failure(
        &tc(&[
            "make",
            "--backing",
            &slow,
            "--cache",
            &fast,
            "--bucket-size",
            "99999999999T",
        ]),
        "too large",
    );
    assert_clean_failure(
        &tc(&["make", "--backing", &slow, "--cache", &slow]),
        "different",
    );
    assert_clean_failure(&tc(&["show", &missing]), "no such file");
    assert_clean_failure(&tc(&["show", &slow]), "not a tiercache");
    assert_clean_failure(
        &tc(&["check", dir.path().to_str().unwrap()]),
        "neither a regular file",
    );
    let o = tc(&["check", &slow]);
    assert_eq!(o.status.code(), Some(2));
    // Nothing was written by the failed makes.
    assert!(std::fs::read(&slow).unwrap().iter().all(|&b| b == 0));
    assert!(std::fs::read(&fast).unwrap().iter().all(|&b| b == 0));
}

/// Durations take humantime's form (plain numbers are seconds), on the command line and in
/// the config file; a misspelt config key is answered with the nearest one. Every case here
/// fails before a device is opened, on a cache device that does not exist.
#[test]
fn durations_and_config_keys_read_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.img").to_str().unwrap().to_string();
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--cache", &missing];
        args.extend_from_slice(extra);
        tc(&args)
    };
    // Accepted: the start goes on to open the (missing) cache device.
    for ok in [
        ["--shutdown-timeout", "30s"],
        ["--shutdown-timeout", "45"],
        ["--idle-timeout", "1m 30s"],
        ["--idle-close-after", "2h"],
    ] {
        assert_clean_failure(&serve(&ok), "no such file");
    }
    assert_clean_failure(
        &serve(&["--idle-timeout", "30x"]),
        "'30x' is not a duration",
    );
    assert_clean_failure(
        &serve(&["--shutdown-timeout", "2h"]),
        "shutdown_timeout 2h is out of range (1s to 1h)",
    );
    assert_clean_failure(
        &serve(&["--idle-timeout", "0s"]),
        "idle_timeout must be longer than 0",
    );
    let config = dir.path().join("serve.toml");
    let with_config = |text: &str| {
        std::fs::write(&config, format!("cache = {missing:?}\n{text}")).unwrap();
        tc(&["serve", "--config", config.to_str().unwrap()])
    };
    assert_clean_failure(
        &with_config("idle_timeout = \"2m\"\nshutdown_timeout = 45\n"),
        "no such file",
    );
    assert_clean_failure(
        &with_config("shutdown_timeout = \"soon\"\n"),
        "'soon' is not a duration",
    );
    let o = with_config("idle_timout = 5\n");
    assert_clean_failure(
        &o,
        "serve.toml:2:1: unknown key `idle_timout`; did you mean `idle_timeout`?",
    );
    assert!(!stderr(&o).contains("socket_mode"), "{}", stderr(&o));
    assert_clean_failure(
        &with_config("colour = \"blue\"\n"),
        "unknown key `colour` (the keys are",
    );
    // `--help` says the form.
    let help = String::from_utf8_lossy(&tc(&["serve", "--help"]).stdout).into_owned();
    assert!(
        help.contains("--shutdown-timeout <DURATION>") && help.contains("1h 30m"),
        "{help}"
    );
}

/// `generate` (man pages, completions) is listed with the other commands.
#[test]
fn help_lists_every_command() {
    let o = tc(&["--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for cmd in ["serve", "make", "status", "generate"] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(cmd)),
            "{cmd} missing from --help:\n{help}"
        );
    }
}
