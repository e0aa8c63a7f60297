//! The commands the documentation shows, run: every command in a ```sh block of README.md, and
//! those of docs/*.md that run on file-backed devices, in order, in a scratch directory, with
//! the real binary on PATH. Device and socket paths are replaced by files in the scratch
//! directory (`SUBSTITUTIONS`); `tiercache serve` runs in the background until the next
//! `serve` or `stop`; an optional part in brackets (`stats [--bytes]`) is left out, except
//! where the bare form needs a terminal (`top [--once]`). Every command must succeed.
//!
//! Commands that cannot run here are listed in `SKIP` with why (root, real devices, other
//! hosts, minutes of building); a command that is neither run nor listed fails the test, so a
//! new command in the docs is either shown to work or its reason is written down here.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Commands as the docs show them (comments dropped) that are not run, and why.
/// A pattern is a prefix, or with a leading '=' the whole command.
const SKIP: [(&str, &str); 35] = [
    ("cargo run --release -p tiercache -- demo", "serves until Ctrl-C; the demo has its own tests (tests/daytoday.rs, tests/interop.rs)"),
    ("bash scripts/test.sh", "runs this test among all the others"),
    ("qemu-system-x86_64", "boots a VM; its '...' stands for the rest of a VM's options"),
    ("sudo ", "needs root (and, for nbd-client, the nbd kernel module)"),
    ("tiercache serve --cache fast.img --backing slow.img --tcp 0.0.0.0:10809", "needs the operator's certificates; TLS is tested with made ones in tests/tls.rs"),
    ("nbdinfo 'nbds://server:10809", "another host, named server"),
    ("qemu-img info --object tls-creds-x509", "another host, named server"),
    ("tiercache make --backing 'nbd://fileserver", "another host, named fileserver"),
    ("tiercache serve --cache fast.img --backing 'nbd://fileserver", "another host, named fileserver"),
    ("cargo install", "builds the release binary for minutes and writes /usr/local"),
    ("install -Dm", "writes /etc (root)"),
    ("systemctl ", "needs systemd and root"),
    ("curl -s http://127.0.0.1:9563/metrics", "needs a server started with --metrics 9563, a fixed port; the endpoint is tested in tests/metrics.rs"),
    ("cargo build --release", "builds for minutes; the test runs the binary cargo test built"),
    ("target/release/tiercache bench --workloads", "the scale, hits and non-rotational runs take minutes to hours; tests/bench_smoke.rs and tests/scale_smoke.rs run them small"),
    ("target/release/tiercache bench --scale quick", "takes minutes; tests/bench_smoke.rs runs the tiny scale"),
    ("modprobe ", "needs root and a kernel with the module; scripts/vm/run.sh runs the block-device commands in a Linux 6.12 guest (CI)"),
    ("tiercache serve --cache /dev/nvme0n1p3 --backing /dev/sdb --ublk", "needs root and the ublk driver, which this kernel lacks; the VM scenarios run it (scripts/vm/scenarios/ublk-*.sh)"),
    ("mkfs.xfs /dev/", "formats a block device (root, /dev/ublkb0 or /dev/nbd0); the VM scenarios do"),
    ("fstrim /srv", "needs a mounted filesystem on the block device; the VM scenarios run fstrim"),
    ("nbd-client ", "needs root and the nbd module; the VM scenarios run nbd-client (scripts/vm/scenarios/nbd-*.sh)"),
    ("umount /srv", "needs the mounted block device above"),
    ("=tiercache top --admin /run/tiercache.sock.admin", "needs a terminal"),
    ("ceph auth get-or-create ", "needs a Ceph cluster with cephx (the tests' cluster runs without it)"),
    ("rbd create ", "needs a Ceph cluster; tests/ceph.rs runs these steps on the one scripts/ceph/fixture.sh starts"),
    ("qemu-nbd ", "exports an RBD image (a Ceph cluster); tests/ceph.rs does, through scripts/ceph/fixture.sh"),
    ("tiercache make --backing 'nbd+unix:///?socket=/run/rbd/", "an RBD image behind qemu-nbd; tests/ceph.rs makes one"),
    ("tiercache make --cache /dev/nvme0n1p3 --backing 'nbd+unix:///?socket=/run/rbd/", "an RBD image behind qemu-nbd; tests/ceph.rs makes one"),
    ("tiercache detach vm1", "docs/deploy.md's hand-over between two hosts; tests/handover.rs and tests/ceph.rs run it"),
    ("tiercache attach 'nbd+unix:///?socket=/run/rbd/", "docs/deploy.md's hand-over between two hosts; tests/handover.rs and tests/ceph.rs run it"),
    ("tiercache attach --take-over 'nbd+unix:///?socket=/run/rbd/", "docs/deploy.md's take-over of a dead host's disk; tests/handover.rs and tests/ceph.rs run it"),
    ("cargo build --profile test -p tiercache --bin tiercache", "builds the binary the test already runs (cargo test built it)"),
    ("bash scripts/ceph/", "starts a Ceph cluster and measures for minutes; tests/ceph.rs uses the same fixture"),
    ("BENCH_SECS=5 bash scripts/vm/compare.sh", "boots Linux in qemu five times and measures for minutes; the VM suite (scripts/vm/run.sh, CI) runs the same guest and the block-device setups"),
    ("tiercache top --admin /run/tiercache.sock.admin --once", "no server runs at this point of the README (the Live control block stopped it); `tiercache top --once` ran there"),
];

/// Paths in the docs and what they become in the scratch directory (`{}`).
const SUBSTITUTIONS: [(&str, &str); 8] = [
    ("/dev/nvme0n1p3", "{}/fast.img"),
    ("/dev/sdb", "{}/slow.img"),
    ("/dev/sdd", "{}/new.img"),
    ("/run/tiercache.sock", "{}/t.sock"),
    ("/usr/local/share/man/man1", "{}/man1"),
    ("/etc/bash_completion.d/tiercache", "{}/tiercache.bash"),
    ("target/release/tiercache", "tiercache"),
    ("/tmp/b", "{}/bench"),
];

/// The commands of the ```sh blocks of a Markdown file: continuation lines joined, comments
/// dropped.
fn commands(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        if line.starts_with("```") {
            in_sh = !in_sh && (line == "```sh" || line == "```bash");
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = match line.find(" #") {
            Some(i) => &line[..i],
            None if line.trim_start().starts_with('#') => "",
            None => line,
        };
        let code = code.trim_end();
        if let Some(start) = code.strip_suffix('\\') {
            pending.push_str(start);
            continue;
        }
        pending.push_str(code);
        let c = pending.split_whitespace().collect::<Vec<_>>().join(" ");
        if !c.is_empty() {
            out.push(c);
        }
        pending.clear();
    }
    out
}

/// `[X]` left out, or kept when the bare form needs a terminal (`tiercache top`).
fn without_options(c: &str) -> String {
    let bare: String = c
        .split(" [")
        .enumerate()
        .map(|(i, part)| {
            if i == 0 {
                part.to_string()
            } else {
                part.split_once(']')
                    .map_or(String::new(), |(_, rest)| rest.to_string())
            }
        })
        .collect();
    if bare.trim() == "tiercache top" {
        c.replace(['[', ']'], "")
    } else {
        bare.trim().to_string()
    }
}

#[test]
fn every_command_in_the_readme_and_docs_runs() {
    if !(have("nbdinfo") && have("fio") && have("nbdkit")) {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let scratch = dir.path().display().to_string();
    for (name, mib) in [("slow.img", 64), ("fast.img", 32), ("new.img", 32)] {
        std::fs::File::create(dir.path().join(name))
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
    }
    std::fs::create_dir(dir.path().join("man1")).unwrap();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tiercache")).parent().unwrap();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap());
    let admin = format!("{scratch}/t.sock.admin");
    let mut docs = vec![root.join("README.md")];
    let mut more: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    let mut server: Option<std::process::Child> = None;
    let mut ran = Vec::new();
    for doc in &docs {
        for shown in commands(&std::fs::read_to_string(doc).unwrap()) {
            let skipped = SKIP.iter().find(|(p, _)| match p.strip_prefix('=') {
                Some(whole) => shown == whole,
                None => shown.starts_with(p),
            });
            if let Some((_, why)) = skipped {
                println!("SKIP {shown}\n     ({why})");
                continue;
            }
            let mut c = without_options(&shown);
            for (from, to) in SUBSTITUTIONS {
                c = c.replace(from, &to.replace("{}", &scratch));
            }
            println!("RUN  {c}");
            let mut cmd = Command::new("sh");
            cmd.arg("-c")
                .arg(&c)
                .current_dir(dir.path())
                .env("PATH", &path)
                .env("TIERCACHE_ADMIN", &admin)
                .env("RUST_LOG", "warn");
            if c.starts_with("tiercache serve") {
                if let Some(mut s) = server.take() {
                    let _ = s.kill();
                    let _ = s.wait();
                }
                let _ = std::fs::remove_file(&admin);
                server = Some(cmd.stderr(Stdio::inherit()).spawn().unwrap());
                let t = std::time::Instant::now();
                while !Path::new(&admin).exists() {
                    assert!(t.elapsed() < Duration::from_secs(30), "{c}: no server");
                    std::thread::sleep(Duration::from_millis(50));
                }
                ran.push(c);
                continue;
            }
            let o = output_within(&mut cmd, Duration::from_secs(600))
                .unwrap_or_else(|| panic!("{c} hangs"));
            assert!(
                o.status.success(),
                "{} shows `{shown}`; as `{c}` it fails: {}{}",
                doc.display(),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            if c.starts_with("tiercache stop") {
                if let Some(mut s) = server.take() {
                    assert!(s.wait().unwrap().success());
                }
            }
            ran.push(c);
        }
    }
    if let Some(mut s) = server.take() {
        let _ = s.kill();
        let _ = s.wait();
    }
    // What the README promises about the steps above came true.
    assert!(dir.path().join("man1/tiercache-set.1").exists());
    assert!(std::fs::read_to_string(dir.path().join("tiercache.bash"))
        .unwrap()
        .contains("sequential_cutoff"));
    // The parsing found the commands (24 run as the docs stand).
    assert!(ran.len() >= 20, "{ran:#?}");
}

#[test]
fn the_docs_agree_with_each_other_and_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    // The quick bench's duration, in the README, docs/benchmarks.md and `bench --help`.
    let help = stdout(&run(tc().args(["bench", "--help"])));
    for (what, text) in [
        ("README.md", read("README.md")),
        ("docs/benchmarks.md", read("docs/benchmarks.md")),
        ("bench --help", help),
    ] {
        let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            flat.to_lowercase().contains("about 11 minutes on 2 cores"),
            "{what} does not give the quick bench's duration as the others do"
        );
    }
    // The systemd example config does not deny what serve does.
    let toml = read("contrib/systemd/tiercache.toml");
    assert!(!toml.contains("no TLS"), "contrib/systemd/tiercache.toml");
    for key in ["tls_cert", "tls_key", "tls_verify_peer", "tls_ca"] {
        assert!(toml.contains(&format!("# {key} = ")), "{key}");
    }
    // README documents installing with the lock file.
    assert!(read("README.md").contains("cargo install --locked"));
}
