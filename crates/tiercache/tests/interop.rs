//! End-to-end tests of `tiercache serve` with real NBD clients: nbdinfo, qemu-io, qemu-img,
//! nbdcopy, fio (nbd engine, verify), nbdfuse + losetup + mkfs.ext4 + mount + fsck, the admin
//! commands, graceful stop and warm restart, kill -9 and recovery.
//!
//! A missing tool is a failure under CI=true and a printed skip otherwise.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod common;

use common::*;

#[test]
fn real_clients_and_admin_and_warm_restart() {
    if !(have("nbdinfo") && have("qemu-io") && have("qemu-img") && have("nbdcopy")) {
        return;
    }
    let mut f = Fixture::new(64, 32, false);
    f.start();
    let info = stdout(&run(Command::new("nbdinfo").arg("--json").arg(f.uri())));
    let v: serde_json::Value = serde_json::from_str(&info).unwrap();
    let export = &v["exports"][0];
    assert_eq!(export["export-size"], (64u64 << 20) - 8192, "{info}");
    assert_eq!(export["export-name"], "data");
    assert_eq!(export["block_size_minimum"], 512);
    assert_eq!(export["can_flush"], true, "{info}");
    assert_eq!(export["can_fua"], true);
    assert_eq!(export["can_trim"], true);
    assert_eq!(export["can_multi_conn"], true);
    // qemu-io patterns, including unaligned-to-4k offsets.
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0xab 4608 1M",
        "-c",
        "flush",
        &f.uri(),
    ]));
    let o = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0xab 4608 1M",
        "-c",
        "read -P 0 0 4608",
        &f.uri(),
    ]));
    assert!(
        !stdout(&o).contains("Pattern verification failed"),
        "{}",
        stdout(&o)
    );
    // qemu-img convert in and out, then compare.
    let src = f.path("src.raw");
    let mut data = vec![0u8; 8 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    std::fs::write(&src, &data).unwrap();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(f.uri()));
    let out = f.path("out.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(f.uri())
        .arg(&out));
    assert_eq!(&std::fs::read(&out).unwrap()[..data.len()], &data[..]);
    // nbdcopy round trip.
    let back = f.path("back.raw");
    run(Command::new("nbdcopy").arg(f.uri()).arg(&back));
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&out).unwrap());
    // Admin: status, stats, set, bad knobs.
    let s = stdout(&f.tc_admin(&["status"]));
    assert!(s.contains("data") && s.contains("writethrough"), "{s}");
    let row = s
        .lines()
        .find(|l| l.starts_with("data"))
        .expect("a row for the export");
    assert!(
        s.contains("WRITEBACK") && row.ends_with(" idle"),
        "a clean device's writeback is idle: {s}"
    );
    // A reader that has gone away (`tiercache stats | head -1`) ends the command quietly.
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "(sleep 0.2; {} stats --admin {}) | true",
            env!("CARGO_BIN_EXE_tiercache"),
            f.admin()
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "stats into a closed pipe: {err}");
    f.tc_admin(&["set", "data", "cache_mode", "writeback"]);
    f.tc_admin(&["set", "data", "sequential_cutoff", "1M"]);
    let j: serde_json::Value =
        serde_json::from_str(&stdout(&f.tc_admin(&["stats", "--json"]))).unwrap();
    let d = &j["devices"][0];
    assert_eq!(d["cache_mode"], "writeback");
    assert_eq!(d["sequential_cutoff"], 1 << 20);
    assert!(d["stats_total"]["cache_hits"].as_u64().unwrap() > 0, "{j}");
    let mut bad = tc();
    bad.args([
        "set",
        "--admin",
        &f.admin(),
        "data",
        "cache_mode",
        "fastest",
    ]);
    let o = bad.output().unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("unknown cache mode")
    );
    let mut bad = tc();
    bad.args(["set", "--admin", &f.admin(), "data", "colour", "blue"]);
    let o = bad.output().unwrap();
    // Refused on the command line, with the knobs there are.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("invalid value 'colour'")
            && err.contains("possible values: cache_mode"),
        "{err}"
    );
    // Graceful stop, restart: the cache is warm.
    f.stop();
    f.start();
    let j: serde_json::Value =
        serde_json::from_str(&stdout(&f.tc_admin(&["stats", "--json"]))).unwrap();
    assert!(
        j["devices"][0]["cached_bytes"].as_u64().unwrap() > 0,
        "warm restart lost the cache: {j}"
    );
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&out)
        .arg(f.uri()));
    f.stop();
}

#[test]
fn fio_verify_in_every_mode_with_live_switching() {
    if !have("fio") {
        return;
    }
    let mut f = Fixture::new(96, 16, false);
    f.start();
    let switcher = {
        let admin = f.admin();
        std::thread::spawn(move || {
            for i in 0..40 {
                let mode = ["writeback", "writearound", "none", "writethrough"][i % 4];
                let _ = tc()
                    .args(["set", "--admin", &admin, "data", "cache_mode", mode])
                    .output();
                std::thread::sleep(Duration::from_millis(150));
            }
        })
    };
    for rw in ["randwrite", "write"] {
        let o = Command::new("fio")
            .args([
                "--name=verify",
                "--ioengine=nbd",
                &format!("--uri={}", f.uri()),
                &format!("--rw={rw}"),
                "--bs=4k",
                "--size=16m",
                "--offset_increment=20m",
                "--numjobs=4",
                "--iodepth=16",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
                "--group_reporting",
                "--verify_state_save=0",
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "fio {rw} failed: {}\n{}",
            stdout(&o),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!stdout(&o).contains("verify failed"), "{}", stdout(&o));
    }
    switcher.join().unwrap();
    f.stop();
}

#[test]
fn ext4_over_nbdfuse_survives_kill_9() {
    if !test_support::have_root("loop devices and mount for the filesystem test") {
        return;
    }
    if !(have("nbdfuse") && have("losetup") && have("mkfs.ext4") && have("fsck.ext4")) {
        return;
    }
    let mut f = Fixture::new(128, 32, true);
    f.start();
    let fuse_dir = f.path("fuse");
    let mnt = f.path("mnt");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let mount_fs = |f: &Fixture, mkfs: bool| -> (Child, String) {
        let fuse = Command::new("nbdfuse")
            .arg(&fuse_dir)
            .arg(f.uri())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !fuse_dir.join("nbd").exists() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "nbdfuse did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let lo = stdout(&run(Command::new("losetup")
            .args(["-f", "--show"])
            .arg(fuse_dir.join("nbd"))))
        .trim()
        .to_string();
        if mkfs {
            run(Command::new("mkfs.ext4").args(["-q", "-F", &lo]));
        }
        run(Command::new("mount").arg(&lo).arg(&mnt));
        (fuse, lo)
    };
    let unmount_fs = |fuse: Child, lo: &str| {
        let _ = Command::new("umount").arg(&mnt).status();
        let _ = Command::new("losetup").args(["-d", lo]).status();
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&fuse_dir)
            .status();
        let _ = Command::new("fusermount").arg("-u").arg(&fuse_dir).status();
        let mut fuse = fuse;
        let _ = fuse.kill();
        let _ = fuse.wait();
    };
    let (fuse, lo) = mount_fs(&f, true);
    for d in 0..8 {
        let sub = mnt.join(format!("dir{d}"));
        std::fs::create_dir_all(&sub).unwrap();
        for i in 0..20 {
            std::fs::write(
                sub.join(format!("f{i}")),
                format!("file {d}/{i} ").repeat(100 + i * 37),
            )
            .unwrap();
        }
    }
    run(&mut Command::new("sync"));
    unmount_fs(fuse, &lo);
    // fsck through a fresh connection.
    let (fuse, lo) = mount_fs(&f, false);
    run(Command::new("umount").arg(&mnt));
    let o = Command::new("fsck.ext4")
        .args(["-n", "-f", &lo])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "fsck: {}{}",
        stdout(&o),
        String::from_utf8_lossy(&o.stderr)
    );
    run(Command::new("mount").arg(&lo).arg(&mnt));
    std::fs::write(mnt.join("after-fsck"), "synced before the crash").unwrap();
    run(&mut Command::new("sync"));
    // Power cut: kill -9 the server (writeback mode: the data is dirty in the cache).
    f.kill9();
    unmount_fs(fuse, &lo);
    f.start();
    let (fuse, lo) = mount_fs(&f, false);
    assert_eq!(
        std::fs::read_to_string(mnt.join("after-fsck")).unwrap(),
        "synced before the crash"
    );
    for d in 0..8 {
        for i in 0..20 {
            let got = std::fs::read_to_string(mnt.join(format!("dir{d}/f{i}"))).unwrap();
            assert_eq!(got, format!("file {d}/{i} ").repeat(100 + i * 37));
        }
    }
    unmount_fs(fuse, &lo);
    f.stop();
}

#[test]
fn kill_9_after_flush_loses_nothing() {
    if !have("qemu-io") {
        return;
    }
    let mut f = Fixture::new(32, 16, true);
    f.start();
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5c 0 2M",
        "-c",
        "flush",
        &f.uri(),
    ]));
    f.kill9();
    f.start();
    let o = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x5c 0 2M", &f.uri()]));
    assert!(
        !stdout(&o).contains("Pattern verification failed"),
        "{}",
        stdout(&o)
    );
    let s = stdout(&f.tc_admin(&["status"]));
    assert!(
        s.contains("dirty"),
        "writeback data should still be dirty after the crash: {s}"
    );
    // Detach writes it all back, with progress.
    let mut c = tc();
    c.args(["detach", "--admin", &f.admin(), "data"]);
    let o = run(&mut c);
    assert!(String::from_utf8_lossy(&o.stderr).contains("writing back"));
    f.stop();
    let raw = std::fs::read(f.path("slow.img")).unwrap();
    assert!(raw[8192..8192 + (2 << 20)].iter().all(|&b| b == 0x5c));
}

#[test]
fn remote_backing_device_over_nbd_from_emulate() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let hdd_sock = dir.path().join("hdd.sock");
    let mut emu = tc()
        .args(["emulate", "hdd", "--size", "32M", "--file"])
        .arg(dir.path().join("disk.img"))
        .arg("--socket")
        .arg(&hdd_sock)
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !hdd_sock.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "emulate did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let remote = format!("nbd+unix:///disk?socket={}", hdd_sock.display());
    let fast = dir.path().join("fast.img");
    std::fs::File::create(&fast)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    run(tc()
        .args(["make", "--label", "net", "--backing", &remote, "--cache"])
        .arg(&fast));
    let sock = dir.path().join("tc.sock");
    let mut server = tc()
        .arg("serve")
        .arg("--cache")
        .arg(&fast)
        .args(["--backing", &remote, "--socket"])
        .arg(&sock)
        .spawn()
        .unwrap();
    let admin = format!("{}.admin", sock.display());
    while !Path::new(&admin).exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///net?socket={}", sock.display());
    run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x42 4096 256k",
        "-c",
        "flush",
        &uri,
    ]));
    let o = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x42 4096 256k", &uri]));
    assert!(!stdout(&o).contains("Pattern verification failed"));
    run(tc().args(["stop", "--admin", &admin]));
    assert!(server.wait().unwrap().success());
    // The data reached the emulated disk itself (writethrough), past the 8 KiB header.
    let o =
        run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x42 12288 256k", &remote]));
    assert!(
        !stdout(&o).contains("Pattern verification failed"),
        "{}",
        stdout(&o)
    );
    stop_child(&mut emu);
}

/// A remote backing device that stops answering (SIGSTOP) and then dies (SIGKILL): a client
/// read that misses the cache fails within the backing device's timeout instead of hanging,
/// and `tiercache stop` still ends the server within a bound (the NBD client's requests are
/// bounded by its timeout, `?timeout=1` here, and its threads stop at close).
#[test]
fn serve_stops_within_bounds_when_its_nbd_backing_dies() {
    if !(have("nbdkit") && have("qemu-io")) {
        return;
    }
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let (kit_sock, pidfile) = (dir.path().join("kit.sock"), dir.path().join("kit.pid"));
    let mut kit = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-P"])
        .arg(&pidfile)
        .arg("-U")
        .arg(&kit_sock)
        .args(["memory", "32M"])
        .spawn()
        .unwrap();
    let t = Instant::now();
    wait_for_nbdkit(&pidfile);
    let remote = format!("nbd+unix:///?socket={}", kit_sock.display());
    let fast = dir.path().join("fast.img");
    std::fs::File::create(&fast)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    run(tc()
        .args(["make", "--label", "net", "--backing", &remote, "--cache"])
        .arg(&fast));
    let sock = dir.path().join("tc.sock");
    let mut server = tc()
        .arg("serve")
        .arg("--cache")
        .arg(&fast)
        .args(["--backing", &format!("{remote}&timeout=1"), "--socket"])
        .arg(&sock)
        .spawn()
        .unwrap();
    let admin = format!("{}.admin", sock.display());
    while !Path::new(&admin).exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "serve did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///net?socket={}", sock.display());
    let qemu_io = |cmd: &str| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw", "-c", cmd, &uri]);
        c
    };
    run(&mut qemu_io("write -P 0x42 0 64k"));
    // A hung backing server: the miss fails within the timeout (and a few retries of it).
    run(Command::new("kill").args(["-STOP", &kit.id().to_string()]));
    let o = output_within(&mut qemu_io("read 4M 4k"), Duration::from_secs(60))
        .expect("a read of a hung backing device did not end");
    let out = stdout(&o) + &String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() || out.contains("failed"),
        "the read of a hung backing device succeeded: {out}"
    );
    // A dead one (the socket file stays, connections are refused), with a read in flight.
    kit.kill().unwrap();
    kit.wait().unwrap();
    let mut reader = qemu_io("read 8M 4k").spawn().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    run(tc().args(["stop", "--admin", &admin]));
    let status = wait_for(&mut server, Duration::from_secs(60));
    let _ = reader.kill();
    let _ = reader.wait();
    if status.is_none() {
        stop_child(&mut server);
    }
    let status = status.expect("tiercache serve did not exit after stop with a dead backing");
    println!("serve exited with {status} (its backing device is gone)");
}

fn stop_child(c: &mut Child) {
    let _ = c.kill();
    let _ = c.wait();
}

#[test]
fn serve_from_a_toml_config_file() {
    if !have("nbdinfo") {
        return;
    }
    let mut f = Fixture::new(16, 8, false);
    let cfg = f.path("tiercache.toml");
    std::fs::write(
        &cfg,
        format!(
            "cache = \"{}\"\nbacking = [\"{}\"]\nsocket = \"{}\"\n",
            f.path("fast.img").display(),
            f.path("slow.img").display(),
            f.socket().display()
        ),
    )
    .unwrap();
    f.server = Some(tc().arg("serve").arg("--config").arg(&cfg).spawn().unwrap());
    let t = Instant::now();
    while !Path::new(&f.admin()).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = run(Command::new("nbdinfo").arg("--size").arg(f.uri()));
    assert_eq!(stdout(&o).trim(), ((16u64 << 20) - 8192).to_string());
    f.stop();
    // A config with an unknown key is refused with a clear message.
    std::fs::write(&cfg, "cache = \"x\"\ncolour = \"blue\"\n").unwrap();
    let o = tc()
        .arg("serve")
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unknown key `colour`"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn demo_runs_end_to_end_and_the_cache_warms_up() {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let o = run(tc()
        .args(["demo", "--no-serve", "--size", "64M", "--dir"])
        .arg(dir.path().join("demo")));
    let out = stdout(&o);
    let ratios: Vec<u64> = out
        .lines()
        .filter(|l| l.trim_end().ends_with('%'))
        .map(|l| {
            l.split_whitespace()
                .last()
                .unwrap()
                .trim_end_matches('%')
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(ratios.len(), 5, "{out}");
    assert!(
        ratios[4] > ratios[0] + 30,
        "hit ratio should climb pass by pass: {ratios:?}"
    );
}
