//! Interoperability with real NBD clients: nbdinfo, qemu-io, qemu-img, nbdcopy and fio, all
//! against the server running in-process on a temporary unix socket.

mod support;

use std::process::Command;
use std::sync::Arc;
use support::{pattern, require, run_ok, MemExport, TestServer};

const MIB: u64 = 1024 * 1024;

#[test]
fn nbdinfo_reports_size_block_sizes_flags_list_and_map() {
    if !require("nbdinfo", &["--version"]) {
        return;
    }
    let disk = MemExport::new("disk0", 8 * MIB);
    disk.fill(&pattern(64 * 1024, 1));
    let ro = MemExport::with_mode("ro", MIB, true);
    let srv = TestServer::start(vec![disk, ro]);

    let out = run_ok(Command::new("nbdinfo").arg("--size").arg(srv.uri("disk0")));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (8 * MIB).to_string()
    );

    let out = run_ok(Command::new("nbdinfo").arg("--json").arg(srv.uri("disk0")));
    let json = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "\"block_size_minimum\": 512",
        "\"block_size_preferred\": 4096",
        "\"block_size_maximum\": 33554432",
        "\"can_flush\": true",
        "\"can_fua\": true",
        "\"can_trim\": true",
        "\"can_zero\": true",
        "\"can_fast_zero\": true",
        "\"can_cache\": true",
        "\"can_multi_conn\": true",
        "\"can_df\": true",
        "\"is_read_only\": false",
        "\"is_rotational\": false",
        "\"export-size\": 8388608",
        "base:allocation",
        "in-memory test export disk0",
    ] {
        assert!(json.contains(needle), "missing {needle} in:\n{json}");
    }
    let out = run_ok(Command::new("nbdinfo").arg("--json").arg(srv.uri("ro")));
    let json = String::from_utf8_lossy(&out.stdout);
    assert!(json.contains("\"is_read_only\": true"), "{json}");
    assert!(json.contains("\"can_trim\": false"), "{json}");

    let out = run_ok(Command::new("nbdinfo").arg("--list").arg(srv.uri("")));
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("export=\"disk0\"") && list.contains("export=\"ro\""),
        "{list}"
    );

    let out = run_ok(Command::new("nbdinfo").arg("--map").arg(srv.uri("disk0")));
    let map = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0][..3], ["0", "65536", "0"], "{map}");
    assert_eq!(lines[1][..3], ["65536", "8323072", "3"], "{map}");
}

#[test]
fn nbdinfo_unknown_export_fails_cleanly() {
    if !require("nbdinfo", &["--version"]) {
        return;
    }
    let srv = TestServer::start(vec![MemExport::new("disk0", MIB)]);
    let out = Command::new("nbdinfo")
        .arg(srv.uri("nope"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    // The server is still fine.
    run_ok(Command::new("nbdinfo").arg("--size").arg(srv.uri("disk0")));
}

#[test]
fn qemu_io_write_read_patterns() {
    if !require("qemu-io", &["--version"]) {
        return;
    }
    let disk = MemExport::new("disk0", 16 * MIB);
    let srv = TestServer::start(vec![disk.clone()]);
    let uri = srv.uri("disk0");
    let script = [
        "write -P 0xab 0 1M",
        "write -P 0xcd 1M 64k",
        "write -z 2M 1M",
        "write -z -u 3M 512k",
        "discard 4M 1M",
        "write -P 0x11 -f 5M 4k",
        "flush",
        "read -P 0xab 0 1M",
        "read -P 0xcd 1M 64k",
        "read -P 0 2M 1M",
        "read -P 0 4M 1M",
        "read -P 0x11 5M 4k",
        "aio_write -P 0x22 6M 128k",
        "aio_write -P 0x33 7M 128k",
        "aio_flush",
        "read -P 0x22 6M 128k",
        "read -P 0x33 7M 128k",
    ];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for s in script {
        cmd.args(["-c", s]);
    }
    let out = run_ok(cmd.arg(&uri));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("Pattern verification failed"), "{stdout}");
    let contents = disk.contents();
    assert!(contents[..MIB as usize].iter().all(|&b| b == 0xab));
    assert!(
        contents[(6 * MIB) as usize..(6 * MIB + 128 * 1024) as usize]
            .iter()
            .all(|&b| b == 0x22)
    );
    // A mismatching pattern must be detected (the test can fail).
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x99 0 4k", &uri])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"));
}

#[test]
fn qemu_img_convert_in_and_out_then_compare() {
    if !require("qemu-img", &["--version"]) {
        return;
    }
    let disk = MemExport::new("disk0", 8 * MIB);
    let srv = TestServer::start(vec![disk.clone()]);
    let src = srv.dir.path().join("src.img");
    let back = srv.dir.path().join("back.img");
    let mut image = pattern((8 * MIB) as usize, 7);
    image[(2 * MIB) as usize..(3 * MIB) as usize].fill(0);
    std::fs::write(&src, &image).unwrap();
    let uri = srv.uri("disk0");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    assert!(
        disk.contents() == image,
        "image written through NBD differs"
    );
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(&uri)
            .arg(&back),
    );
    assert!(std::fs::read(&back).unwrap() == image);
    run_ok(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(&src)
            .arg(&uri),
    );
    // And a difference is noticed.
    disk.fill(&[1, 2, 3]);
    let out = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&uri)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

#[test]
fn nbdcopy_round_trip_of_random_image() {
    if !require("nbdcopy", &["--version"]) {
        return;
    }
    let disk = MemExport::new("disk0", 16 * MIB);
    let srv = TestServer::start(vec![disk.clone()]);
    let src = srv.dir.path().join("src.img");
    let back = srv.dir.path().join("back.img");
    let image = pattern((16 * MIB) as usize, 99);
    std::fs::write(&src, &image).unwrap();
    let uri = srv.uri("disk0");
    run_ok(
        Command::new("nbdcopy")
            .args(["--connections=4", "--requests=16"])
            .arg(&src)
            .arg(&uri),
    );
    assert!(disk.contents() == image);
    run_ok(
        Command::new("nbdcopy")
            .args(["--connections=4"])
            .arg(&uri)
            .arg(&back),
    );
    assert!(std::fs::read(&back).unwrap() == image);
}

#[test]
fn fio_randwrite_and_randrw_verify_crc32c() {
    if !require("fio", &["--version"]) {
        return;
    }
    let disk = MemExport::new("disk0", 64 * MIB);
    let srv = TestServer::start(vec![disk as Arc<dyn server::Export>]);
    for (rw, extra) in [("randwrite", vec![]), ("randrw", vec!["--rwmixread=50"])] {
        let mut cmd = Command::new("fio");
        cmd.args([
            "--name=nbd",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("disk0")),
            &format!("--rw={rw}"),
            "--bs=4k",
            "--bsrange=4k-64k",
            "--numjobs=4",
            "--iodepth=16",
            "--size=8m",
            "--offset_increment=16m",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
            "--group_reporting",
            "--verify_state_save=0",
        ]);
        cmd.args(extra);
        let out = run_ok(&mut cmd);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("err= 0"), "{stdout}");
        assert!(!stdout.contains("verify: bad"), "{stdout}");
        assert!(stdout.contains("READ: bw="), "no verify reads: {stdout}");
    }
}
