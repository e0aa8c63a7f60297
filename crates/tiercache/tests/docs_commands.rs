//! The commands the documentation shows, run: every command in a ```sh block of README.md, and
//! those of docs/*.md that run on file-backed devices, in order, in a scratch directory, with
//! the real binary on PATH, as a reader pasting them into one shell would. Device and socket
//! paths are replaced by files in the scratch directory (`SUBSTITUTIONS`); `tiercache serve`
//! runs in the background until the next `serve` or `stop`, and so does a command ending in
//! `&` (nbdfuse: the next command waits for its file); `export NAME=VALUE` sets NAME for the
//! commands after it, and nothing else does (no `TIERCACHE_ADMIN` the reader would not have);
//! an optional part in brackets (`stats [--bytes]`) is left out, except where the bare form
//! needs a terminal (`top [--once]`). Commands with `sudo` run as root without it: where the
//! test is not root they are a printed skip, and under CI=true (as root) a failure. Every
//! command must succeed. The same goes for the commands `tiercache demo` prints while it
//! serves: each one is run, in order, against a running demo.
//!
//! Commands that cannot run here are listed in `SKIP` (and `DEMO_SKIP`) with why (real
//! devices, the nbd module, other hosts, a Ceph cluster, minutes of building); a command that
//! is neither run nor listed fails the test, so a new command in the docs is either shown to
//! work or its reason is written down here. Whatever a test mounted under its scratch
//! directory is unmounted (lazily) when it ends, passed or failed.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Commands as the docs show them (comments dropped) that are not run, and why.
/// A pattern is a prefix, with a leading '=' the whole command, with a leading '*' a part.
const SKIP: [(&str, &str); 37] = [
    ("cargo run --release -p tiercache -- demo", "serves until Ctrl-C; the demo has its own tests (tests/daytoday.rs, tests/interop.rs)"),
    ("bash scripts/test.sh", "runs this test among all the others"),
    ("qemu-system-x86_64", "boots a VM; its '...' stands for the rest of a VM's options"),
    ("sudo nbd-client ", "needs the nbd kernel module; the VM scenarios run nbd-client (scripts/vm/scenarios/nbd-*.sh)"),
    ("sudo target/release/tiercache bench --scale quick", "takes minutes; tests/bench_smoke.rs runs the tiny scale"),
    ("*/tmp/ceph-try", "docs/deploy.md's try on one machine starts a Ceph cluster (scripts/ceph/fixture.sh); tests/ceph.rs runs the same steps on it"),
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
    ("bash scripts/ceph/bench.sh", "starts a Ceph cluster and measures for minutes; tests/ceph.rs uses the same fixture"),
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

/// Whether `shown` is listed in `skip`, and why.
fn skipped<'a>(skip: &[(&str, &'a str)], shown: &str) -> Option<&'a str> {
    skip.iter()
        .find(|(p, _)| {
            if let Some(whole) = p.strip_prefix('=') {
                shown == whole
            } else if let Some(part) = p.strip_prefix('*') {
                shown.contains(part)
            } else {
                shown.starts_with(p)
            }
        })
        .map(|(_, why)| *why)
}

/// Whether this test can mount a filesystem the way the docs show (root, /dev/fuse, nbdfuse,
/// mkfs.ext4): a printed skip, or a failure under CI=true, when it cannot.
fn can_mount(why: &str) -> bool {
    test_support::have_root(why)
        && have("nbdfuse")
        && have("fusermount3")
        && have("mkfs.ext4")
        && (Path::new("/dev/fuse").exists() || unavailable("/dev/fuse"))
}

/// A shell the shown commands run in: a working directory, PATH with the binary first, the
/// variables `export` set, the `tiercache serve` running, and the other commands left running
/// in the background (`... &`). Dropped, it unmounts (lazily) whatever is mounted under its
/// directory, deepest first, then ends the server and what else still runs in the
/// background: a failed step leaves no mount and no process, and a tempdir removal never
/// descends into a mount.
struct Shell {
    dir: PathBuf,
    path: String,
    exports: BTreeMap<String, String>,
    server: Option<Child>,
    background: Vec<(String, Child)>,
}

impl Shell {
    fn new(dir: &Path) -> Shell {
        let bin_dir = Path::new(env!("CARGO_BIN_EXE_tiercache")).parent().unwrap();
        Shell {
            dir: dir.canonicalize().unwrap(),
            path: format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap()),
            exports: BTreeMap::new(),
            server: None,
            background: Vec::new(),
        }
    }

    fn command(&self, c: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(c)
            .current_dir(&self.dir)
            .env("PATH", &self.path)
            .env_remove("TIERCACHE_ADMIN")
            .envs(&self.exports)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        cmd
    }

    /// `export NAME=VALUE` (VALUE as one word, quotes dropped): true if `c` was one.
    fn export(&mut self, c: &str) -> bool {
        let Some((name, value)) = c.strip_prefix("export ").and_then(|e| e.split_once('=')) else {
            return false;
        };
        let value = value.trim_matches(|q| q == '\'' || q == '"');
        self.exports.insert(name.into(), value.into());
        true
    }

    /// Starts `tiercache serve ... --socket S` (`c`, run with `exec`, so that ending it ends the
    /// server) in place of the one running, and waits for its admin socket `S.admin`.
    fn serve(&mut self, c: &str, what: &str) {
        self.kill_server();
        let words: Vec<&str> = c.split_whitespace().collect();
        let socket = words
            .iter()
            .position(|w| *w == "--socket")
            .map(|i| words[i + 1])
            .unwrap_or_else(|| panic!("{what}: `{c}`: serve without --socket"));
        let admin = self.dir.join(format!("{socket}.admin"));
        let _ = std::fs::remove_file(&admin);
        let mut cmd = self.command(&format!("exec {c}"));
        self.server = Some(cmd.stderr(Stdio::inherit()).spawn().unwrap());
        let t = Instant::now();
        while !admin.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{what}: `{c}`: no server"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill_server(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
    }

    /// Runs `c` to its end; it must succeed (`what` says where it was shown). After `tiercache
    /// stop`, the server must have exited 0.
    fn run(&mut self, c: &str, what: &str) {
        let o = output_within(&mut self.command(c), Duration::from_secs(600))
            .unwrap_or_else(|| panic!("{what}: `{c}` hangs"));
        assert!(
            o.status.success(),
            "{what}: `{c}` fails: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        if c.starts_with("tiercache stop") {
            if let Some(mut s) = self.server.take() {
                let status = s.wait().unwrap();
                assert!(
                    status.success(),
                    "{what}: `{c}`: the server exited with {status}"
                );
            }
        }
    }

    /// Starts `c` (shown with a trailing `&`) in the background and waits until it is
    /// ready: for `nbdfuse MOUNTPOINT URI`, until the export's file MOUNTPOINT/nbd is there
    /// (a MOUNTPOINT that is not a directory would put the file elsewhere: that fails here).
    fn spawn(&mut self, c: &str, what: &str) {
        let words: Vec<&str> = c.split_whitespace().collect();
        assert_eq!(
            words[0], "nbdfuse",
            "{what}: `{c} &`: the test knows how to wait for nbdfuse in the background only"
        );
        let file = self.dir.join(words[1]).join("nbd");
        let mut cmd = self.command(&format!("exec {c}"));
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::inherit()).spawn();
        self.background
            .push((c.to_string(), child.expect("starting a background command")));
        let t = Instant::now();
        while !file.exists() {
            let (_, child) = self.background.last_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "{what}: `{c} &` exited with {status} before {} was there",
                    file.display()
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "{what}: `{c} &` did not make {} within 30 s",
                file.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every background command has ended (the docs' last steps undo what they started).
    fn background_ended(&mut self, what: &str) {
        for (c, child) in &mut self.background {
            let status = wait_for(child, Duration::from_secs(60))
                .unwrap_or_else(|| panic!("{what}: `{c} &` still runs after the last step"));
            assert!(status.success(), "{what}: `{c} &` exited with {status}");
        }
        self.background.clear();
    }

    /// The mount points under the shell's directory, deepest first.
    fn mounts(&self) -> Vec<String> {
        let under = format!("{}/", self.dir.display());
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<String> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .map(|p| p.replace("\\040", " "))
            .filter(|p| p.starts_with(&under))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        points
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        for point in self.mounts() {
            let _ = Command::new("umount").arg("-l").arg(&point).status();
        }
        self.kill_server();
        for (_, child) in &mut self.background {
            let _ = child.kill();
            let _ = child.wait();
        }
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
    let mut docs = vec![root.join("README.md")];
    let mut more: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    // Declared after `dir`, dropped before it: nothing stays mounted in it.
    let mut sh = Shell::new(dir.path());
    let mut as_root: Option<bool> = None;
    let mut ran = Vec::new();
    for doc in &docs {
        let what = doc.strip_prefix(&root).unwrap_or(doc).display().to_string();
        for shown in commands(&std::fs::read_to_string(doc).unwrap()) {
            if let Some(why) = skipped(&SKIP, &shown) {
                println!("SKIP {shown}\n     ({why})");
                continue;
            }
            let mut c = without_options(&shown);
            for (from, to) in SUBSTITUTIONS {
                c = c.replace(from, &to.replace("{}", &scratch));
            }
            if c.contains("sudo ") {
                // Asked once: a missing tool or root is one printed skip (or CI failure).
                let can = *as_root.get_or_insert_with(|| {
                    can_mount("the docs mount ext4 over nbdfuse and a loop device")
                });
                if !can {
                    println!("SKIP {shown}\n     (needs root, /dev/fuse, nbdfuse, mkfs.ext4)");
                    continue;
                }
                c = c.replace("sudo ", "");
            }
            println!("RUN  {c}");
            if sh.export(&c) {
                ran.push(c);
                continue;
            }
            let background = c.strip_suffix('&').filter(|b| !b.ends_with('&'));
            if c.starts_with("tiercache serve") {
                sh.serve(background.unwrap_or(&c).trim_end(), &what);
            } else if let Some(b) = background {
                sh.spawn(b.trim_end(), &what);
            } else {
                sh.run(&c, &what);
            }
            ran.push(c);
        }
    }
    sh.kill_server();
    // nbdfuse ended once the README's last step unmounted it, and nothing stays mounted.
    sh.background_ended("README.md");
    assert_eq!(sh.mounts(), Vec::<String>::new(), "left mounted");
    // What the README promises about the steps above came true.
    assert!(dir.path().join("man1/tiercache-set.1").exists());
    assert!(std::fs::read_to_string(dir.path().join("tiercache.bash"))
        .unwrap()
        .contains("sequential_cutoff"));
    // The parsing found the commands (40 run as the docs stand, 35 without root).
    assert!(ran.len() >= 30, "{ran:#?}");
}

/// What `tiercache demo` prints to run that is not run here, and why (a prefix).
const DEMO_SKIP: [(&str, &str); 1] = [(
    "nbd-client ",
    "needs the nbd kernel module (and /dev/nbd0 is the host's); the VM scenarios run nbd-client (scripts/vm/scenarios/nbd-*.sh)",
)];

#[test]
fn every_command_the_demo_prints_runs() {
    if !(have("nbdinfo")
        && have("qemu-img")
        && can_mount("the demo's hints mount ext4 over nbdfuse and a loop device"))
    {
        return;
    }
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    // The demo, and the shell its hints run in (dropped after it: its mounts are undone).
    struct Demo(Child, Shell);
    impl Drop for Demo {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let demo = tc()
        .args(["demo", "--size", "64M", "--dir"])
        .arg(dir.path().join("demo"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut d = Demo(demo, Shell::new(dir.path()));
    let mut out = String::new();
    let mut r = BufReader::new(d.0.stdout.take().unwrap());
    while !out.contains("Press Ctrl-C") {
        let mut l = String::new();
        assert!(r.read_line(&mut l).unwrap() > 0, "demo ended early:\n{out}");
        out.push_str(&l);
    }
    println!("{out}");
    let hints: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("Still serving."))
        .filter_map(|l| l.strip_prefix("  "))
        .map(str::trim)
        .collect();
    let mut ran = Vec::new();
    for c in &hints {
        if let Some(why) = skipped(&DEMO_SKIP, c) {
            println!("SKIP {c}\n     ({why})");
            continue;
        }
        println!("RUN  {c}");
        match c.strip_suffix('&').filter(|b| !b.ends_with('&')) {
            Some(b) => d.1.spawn(b.trim_end(), "tiercache demo"),
            None => d.1.run(c, "tiercache demo"),
        }
        ran.push(*c);
    }
    d.1.background_ended("tiercache demo");
    assert_eq!(d.1.mounts(), Vec::<String>::new(), "left mounted");
    // Every kind of hint was there and ran: clients, the filesystem, the admin commands.
    for kind in ["nbdinfo ", "qemu-img ", "nbdfuse ", "mkfs.ext4 ", "umount "] {
        assert!(
            ran.iter().any(|c| c.starts_with(kind)),
            "no {kind}in {ran:#?}"
        );
    }
    for kind in [" status --admin ", " set --admin "] {
        assert!(ran.iter().any(|c| c.contains(kind)), "no{kind}in {ran:#?}");
    }
    // Ctrl-C, as the last line says: the demo stops cleanly.
    run(Command::new("kill").arg("-INT").arg(d.0.id().to_string()));
    let status = wait_for(&mut d.0, Duration::from_secs(60)).expect("demo ignores SIGINT");
    assert!(status.success(), "demo exited with {status}");
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
    // The README's list of what `.ci/run` installs is the list of .ci/packages.sh: the
    // CI_PACKAGES array and the pinned pair ("qemu-utils=$qemu" ...).
    let packages = read(".ci/packages.sh");
    let mut ci: Vec<&str> = packages
        .split_once("CI_PACKAGES=(")
        .and_then(|(_, rest)| rest.split_once(')'))
        .expect(".ci/packages.sh has no CI_PACKAGES=(...)")
        .0
        .split_whitespace()
        .chain(packages.split('"').filter_map(|w| w.strip_suffix("=$qemu")))
        .collect();
    let readme = read("README.md")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let mut listed: Vec<&str> = readme
        .split_once("installs the Debian packages ")
        .and_then(|(_, rest)| rest.split_once(" (the list of `.ci/packages.sh`"))
        .expect("README.md lists what .ci/run installs")
        .0
        .split(", ")
        .flat_map(|p| p.split(" and "))
        .collect();
    ci.sort_unstable();
    listed.sort_unstable();
    assert!(ci.len() > 10, "{ci:?}");
    assert_eq!(listed, ci, "README.md and .ci/packages.sh disagree");
    // The number of VM scenarios the README says plain `scripts/test.sh` leaves out.
    let scenarios = std::fs::read_dir(root.join("scripts/vm/scenarios"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "sh")
        })
        .count();
    let said: Vec<&str> = readme
        .split(" VM scenarios")
        .filter_map(|before| before.rsplit_once("the ").map(|(_, n)| n))
        .filter(|n| n.chars().all(|c| c.is_ascii_digit()))
        .collect();
    assert!(
        !said.is_empty(),
        "README.md does not count the VM scenarios"
    );
    for n in said {
        assert_eq!(
            n,
            scenarios.to_string(),
            "README.md's count of VM scenarios"
        );
    }
}
