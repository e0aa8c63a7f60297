//! ext4, XFS and Btrfs on top of `tiercache serve` in writeback mode, through a kill -9.
//!
//! One table-driven test per filesystem: the server's export is exposed as a file by nbdfuse,
//! attached to a loop device, formatted and mounted; a seeded tree of a few hundred files (empty
//! to a few MiB, random contents so a misplaced block shows) is copied in and `sync`ed, and the
//! server is killed with SIGKILL while the filesystem is mounted. The mount, loop device and
//! nbdfuse are then torn down (lazy unmount, the loop device detached and waited for, nbdfuse
//! unmounted), the server restarted on the same devices, the export exposed and mounted again,
//! and every file compared with the source. After a clean unmount the filesystem's own checker
//! (`fsck.ext4 -fn`, `xfs_repair -n`, `btrfs check --readonly`) must find nothing. Last, the
//! device is detached from the cache (writing back every dirty block) and the backing file
//! alone, past tiercache's 8 KiB header, must pass the checker and hold the same files.
//!
//! Before the kill a quarter of the files are deleted, some rewritten or appended to, new ones
//! written, and `fstrim` run, so the cache also sees overwrites and discards of dirty data.
//! The sequential cutoff is 0 so the large files go through the cache too, and the writeback
//! delay a day, so the cache holds dirty data at the kill (at least about the writeback target,
//! 10 % of the cache; the amount is printed and must be more than nothing before and after).
//!
//! The seed is printed; `TIERCACHE_SEED=N` replays the tree. nbdfuse 1.14 may abort with an
//! assertion (`completion->thread->in_flight >= 1`) when the server dies under it; that is
//! expected. Needs root (loop devices, mount), nbdfuse, losetup, fusermount3, fstrim, the
//! filesystem's mkfs and checker, and the filesystem in the kernel: a missing one is a failure
//! under CI=true and a printed skip otherwise.

mod common;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// One row of the table: how to make and check a filesystem.
struct Fs {
    /// The name `mount -t` and /proc/filesystems use.
    name: &'static str,
    mkfs: &'static [&'static str],
    /// Read-only check of an unmounted device; exit status 0 means no errors.
    check: &'static [&'static str],
}

const EXT4: Fs = Fs {
    name: "ext4",
    mkfs: &["mkfs.ext4", "-q", "-F"],
    check: &["fsck.ext4", "-f", "-n"],
};
const XFS: Fs = Fs {
    name: "xfs",
    mkfs: &["mkfs.xfs", "-q", "-f"],
    check: &["xfs_repair", "-n"],
};
const BTRFS: Fs = Fs {
    name: "btrfs",
    mkfs: &["mkfs.btrfs", "-q", "-f"],
    check: &["btrfs", "check", "--readonly"],
};

/// Backing device size: XFS wants at least 300 MiB, Btrfs about 110 MiB.
const BACKING_MIB: u64 = 512;
const CACHE_MIB: u64 = 256;
/// tiercache's superblock at the start of the backing device; the export starts after it.
const BACKING_HEADER_BYTES: u64 = 8192;
const FILE_COUNT: usize = 300;
/// Generous hang guard for one external command (mkfs, cp, a checker).
const COMMAND_LIMIT: Duration = Duration::from_secs(300);
/// How many times a clean unmount is tried, a second apart, before the test fails.
const UMOUNT_ATTEMPTS: u32 = 10;
/// Hang guard for a loop device to be released after its detach was requested.
const RELEASE_LIMIT: Duration = Duration::from_secs(60);

#[test]
fn ext4_survives_kill_9_in_writeback() {
    survives_kill_9(&EXT4);
}

#[test]
fn xfs_survives_kill_9_in_writeback() {
    survives_kill_9(&XFS);
}

#[test]
fn btrfs_survives_kill_9_in_writeback() {
    survives_kill_9(&BTRFS);
}

fn survives_kill_9(fs: &Fs) {
    if !can_run(fs) {
        return;
    }
    let started = Instant::now();
    let seed = engine::test_seed(&format!("filesystems::{}", fs.name));
    let src = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let (files, bytes) = make_tree(src.path(), &mut rng);
    println!(
        "{}: seed {seed}: {files} files, {} MiB",
        fs.name,
        bytes >> 20
    );

    // Declared first, dropped last: every mount below is gone before its directory is removed.
    let mut f = Fixture::new(BACKING_MIB, CACHE_MIB, true);
    f.start();
    f.tc_admin(&["set", "data", "sequential_cutoff", "0"]);
    // Below the writeback target (10 % of the cache) dirty data stays until the kill.
    f.tc_admin(&["set", "data", "writeback_delay", "86400"]);
    let status = stdout(&f.tc_admin(&["status"]));
    assert!(status.contains("writeback"), "{status}");
    let mnt = f.path("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let tree = mnt.join("tree");

    let mut e = Exposed::up(&f.uri(), &f.path("fuse"), &mnt);
    run_within(Command::new(fs.mkfs[0]).args(&fs.mkfs[1..]).arg(&e.lo));
    e.mount(fs, &[]);
    run_within(Command::new("cp").arg("-a").arg(src.path()).arg(&tree));
    run_within(&mut Command::new("sync"));
    churn(src.path(), &tree, &mut rng);
    let trimmed = run_within(Command::new("fstrim").arg("-v").arg(&mnt));
    print!("{}: {}", fs.name, stdout(&trimmed));
    run_within(&mut Command::new("sync"));
    let dirty = dirty_bytes(&f);
    assert!(
        dirty > 0,
        "{}: nothing dirty in the cache at the kill",
        fs.name
    );
    println!(
        "{}: copied, changed, trimmed and synced at {:?}; {} MiB dirty in the cache; kill -9",
        fs.name,
        started.elapsed(),
        dirty >> 20
    );

    // Power cut with the filesystem mounted, then take the dead stack apart.
    f.kill9();
    e.teardown()
        .unwrap_or_else(|err| panic!("{}: {err}", fs.name));
    f.start();
    // Can be more than at the kill: blocks written back but not yet recorded clean are dirty
    // again after recovery (and written back again).
    let after = dirty_bytes(&f);
    assert!(
        after > 0,
        "{}: the dirty data did not survive the kill",
        fs.name
    );
    println!(
        "{}: restarted; {} MiB dirty after recovery",
        fs.name,
        after >> 20
    );
    let mut e = Exposed::up(&f.uri(), &f.path("fuse"), &mnt);
    e.mount(fs, &[]);
    compare_trees(src.path(), &tree, fs, seed);
    e.umount();
    check(fs, &e.lo, "through the server after the kill", seed);
    e.teardown()
        .unwrap_or_else(|err| panic!("{}: {err}", fs.name));

    // Write every dirty block back; the backing device alone must then hold the filesystem.
    run_within(&mut f.admin_cmd(&["detach", "data"]));
    f.stop();
    let mut raw = Exposed::over(
        &f.path("slow.img"),
        &[
            "--offset",
            &BACKING_HEADER_BYTES.to_string(),
            "--sizelimit",
            &((BACKING_MIB << 20) - BACKING_HEADER_BYTES).to_string(),
        ],
        &mnt,
    );
    check(fs, &raw.lo, "on the backing device after detach", seed);
    raw.mount(fs, &["-o", "ro"]);
    compare_trees(src.path(), &tree, fs, seed);
    raw.umount();
    raw.teardown()
        .unwrap_or_else(|err| panic!("{}: {err}", fs.name));
    println!("{}: passed in {:?}", fs.name, started.elapsed());
}

/// Root, the tools and the filesystem in the kernel; false (a printed skip) when something is
/// missing outside CI, a panic under CI=true.
fn can_run(fs: &Fs) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| stdout(&o).trim() == "0")
        .unwrap_or(false);
    if !root {
        assert!(!ci(), "CI runs as root; the {} test must run", fs.name);
        eprintln!(
            "SKIP: the {} test needs root (loop devices, mount)",
            fs.name
        );
        return false;
    }
    let tools = [
        "nbdfuse",
        "losetup",
        "mount",
        "umount",
        "fusermount3",
        "cp",
        "fstrim",
    ];
    let tools = tools.iter().chain([&fs.mkfs[0], &fs.check[0]]);
    if !tools.into_iter().all(|t| have(t)) {
        return false;
    }
    if !kernel_has(fs.name) {
        // The module may just not be loaded yet; modprobe may not exist (a container).
        let _ = Command::new("modprobe").arg(fs.name).output();
    }
    if !kernel_has(fs.name) {
        return test_support::unavailable(&format!(
            "{} in /proc/filesystems (modprobe did not help)",
            fs.name
        ));
    }
    true
}

fn kernel_has(fs: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().last() == Some(fs))
}

/// Writes a seeded tree of `FILE_COUNT` files in nested directories under `root`: empty files,
/// sizes around 4 KiB boundaries, small and medium files, and one in ten of 1-3 MiB (plus an odd
/// tail). Contents are random so a block in the wrong place or file does not compare equal.
/// Returns the number of files and bytes.
fn make_tree(root: &Path, rng: &mut StdRng) -> (usize, u64) {
    let mut total = 0u64;
    for i in 0..FILE_COUNT {
        let depth = rng.gen_range(0..4);
        let mut dir = root.to_path_buf();
        for _ in 0..depth {
            dir.push(format!("d{}", rng.gen_range(0..6)));
        }
        std::fs::create_dir_all(&dir).unwrap();
        let len: usize = match i % 10 {
            0 => [0, 1, 511, 4095, 4096, 4097, 65536][rng.gen_range(0..7)],
            1 => rng.gen_range(1..=3usize << 20) + rng.gen_range(1..4096),
            2..=4 => rng.gen_range(1..8192),
            _ => rng.gen_range(1..256 << 10),
        };
        std::fs::write(dir.join(format!("f{i}.bin")), random_bytes(rng, len)).unwrap();
        total += len as u64;
    }
    (FILE_COUNT, total)
}

fn random_bytes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rng.fill(&mut data[..]);
    data
}

/// The same seeded changes to the source tree and to its copy on the mounted filesystem, after
/// the copy was synced: a quarter of the files deleted (their blocks are then trimmed), some
/// rewritten with a new size, some appended to, and a new directory of files.
fn churn(src: &Path, copy: &Path, rng: &mut StdRng) {
    let files = list(src).into_iter().filter(|(_, is_dir)| !is_dir);
    for (rel, _) in files {
        match rng.gen_range(0..12) {
            0..=2 => {
                std::fs::remove_file(src.join(&rel)).unwrap();
                std::fs::remove_file(copy.join(&rel)).unwrap();
            }
            3 | 4 => {
                let len = rng.gen_range(0..512 << 10);
                let data = random_bytes(rng, len);
                std::fs::write(src.join(&rel), &data).unwrap();
                std::fs::write(copy.join(&rel), &data).unwrap();
            }
            5 => {
                let len = rng.gen_range(1..64 << 10);
                let data = random_bytes(rng, len);
                for root in [src, copy] {
                    let mut file = std::fs::OpenOptions::new()
                        .append(true)
                        .open(root.join(&rel))
                        .unwrap();
                    std::io::Write::write_all(&mut file, &data).unwrap();
                }
            }
            _ => {}
        }
    }
    for root in [src, copy] {
        std::fs::create_dir_all(root.join("new")).unwrap();
    }
    for i in 0..20 {
        let len = rng.gen_range(0..1 << 20);
        let data = random_bytes(rng, len);
        for root in [src, copy] {
            std::fs::write(root.join(format!("new/g{i}.bin")), &data).unwrap();
        }
    }
}

/// Every directory and file under `src` is under `copy` with the same contents, and nothing
/// else is.
fn compare_trees(src: &Path, copy: &Path, fs: &Fs, seed: u64) {
    let (want, got) = (list(src), list(copy));
    if want != got {
        let first = |a: &[(PathBuf, bool)], b: &[(PathBuf, bool)]| -> Vec<PathBuf> {
            let a = a.iter().filter(|e| !b.contains(e)).map(|e| e.0.clone());
            a.take(10).collect()
        };
        panic!(
            "{}: seed {seed}: the tree's entries differ: {} expected, {} found; missing (first \
             10) {:?}, unexpected {:?}",
            fs.name,
            want.len(),
            got.len(),
            first(&want, &got),
            first(&got, &want)
        );
    }
    for (rel, is_dir) in &want {
        if *is_dir {
            continue;
        }
        let a = std::fs::read(src.join(rel)).unwrap();
        let b = std::fs::read(copy.join(rel))
            .unwrap_or_else(|e| panic!("{}: seed {seed}: reading {rel:?}: {e}", fs.name));
        if a != b {
            let at = a.iter().zip(&b).position(|(x, y)| x != y);
            panic!(
                "{}: seed {seed}: {rel:?} differs: {} bytes written, {} read, first difference at {at:?}",
                fs.name,
                a.len(),
                b.len()
            );
        }
    }
}

/// Relative paths under `root`, sorted, each with whether it is a directory.
fn list(root: &Path) -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let is_dir = entry.file_type().unwrap().is_dir();
            let path = entry.path();
            out.push((path.strip_prefix(root).unwrap().to_path_buf(), is_dir));
            if is_dir {
                todo.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Runs the filesystem's checker on an unmounted device; it must report no errors.
fn check(fs: &Fs, dev: &str, when: &str, seed: u64) {
    let o = output_within(
        Command::new(fs.check[0]).args(&fs.check[1..]).arg(dev),
        COMMAND_LIMIT,
    )
    .unwrap_or_else(|| panic!("{}: {:?} hung", fs.name, fs.check));
    assert!(
        o.status.success(),
        "{}: seed {seed}: {} {when} found errors ({}):\n{}",
        fs.name,
        fs.check.join(" "),
        o.status,
        text(&o)
    );
    println!("{}: {} {when}: clean", fs.name, fs.check.join(" "));
}

fn dirty_bytes(f: &Fixture) -> u64 {
    let j: serde_json::Value =
        serde_json::from_str(&stdout(&f.tc_admin(&["stats", "--json"]))).unwrap();
    j["devices"][0]["dirty_bytes"]
        .as_u64()
        .expect("dirty_bytes")
}

fn text(o: &Output) -> String {
    format!("{}{}", stdout(o), String::from_utf8_lossy(&o.stderr))
}

/// Runs a command that must succeed within `COMMAND_LIMIT`.
fn run_within(cmd: &mut Command) -> Output {
    let o = output_within(cmd, COMMAND_LIMIT)
        .unwrap_or_else(|| panic!("{cmd:?} did not finish within {COMMAND_LIMIT:?}"));
    assert!(o.status.success(), "{cmd:?} failed: {}", text(&o));
    o
}

/// A loop device, over the export as a file (nbdfuse) or over a plain file, and a mount point.
/// Dropped (a test that panicked), it tears itself down so no mount or loop device is left.
struct Exposed {
    fuse: Option<Child>,
    fuse_dir: Option<PathBuf>,
    /// The file under the loop device.
    file: PathBuf,
    lo: String,
    mnt: PathBuf,
    mounted: bool,
}

impl Exposed {
    /// nbdfuse serving `uri` as `fuse_dir/nbd`, and a loop device over that file.
    fn up(uri: &str, fuse_dir: &Path, mnt: &Path) -> Exposed {
        std::fs::create_dir_all(fuse_dir).unwrap();
        let mut fuse = Command::new("nbdfuse")
            .arg(fuse_dir)
            .arg(uri)
            .spawn()
            .expect("starting nbdfuse");
        let t = Instant::now();
        while !fuse_dir.join("nbd").exists() {
            if t.elapsed() > Duration::from_secs(30) {
                let _ = fuse.kill();
                let _ = fuse.wait();
                panic!("nbdfuse did not come up");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Owned by `e` before losetup can fail, so a failure still unmounts nbdfuse.
        let mut e = Exposed {
            fuse: Some(fuse),
            fuse_dir: Some(fuse_dir.to_path_buf()),
            file: fuse_dir.join("nbd"),
            lo: String::new(),
            mnt: mnt.to_path_buf(),
            mounted: false,
        };
        e.lo = losetup(&e.file, &[]);
        e
    }

    /// A loop device over `file`, with extra `losetup` arguments.
    fn over(file: &Path, losetup_args: &[&str], mnt: &Path) -> Exposed {
        Exposed {
            fuse: None,
            fuse_dir: None,
            file: file.to_path_buf(),
            lo: losetup(file, losetup_args),
            mnt: mnt.to_path_buf(),
            mounted: false,
        }
    }

    fn mount(&mut self, fs: &Fs, opts: &[&str]) {
        run_within(
            Command::new("mount")
                .args(["-t", fs.name])
                .args(opts)
                .arg(&self.lo)
                .arg(&self.mnt),
        );
        self.mounted = true;
    }

    /// A clean unmount, which must succeed (the server is up).
    fn umount(&mut self) {
        // A process outside the test (a scan of /tmp) may hold the mount for a moment.
        for attempt in 1..=UMOUNT_ATTEMPTS {
            let o = output_within(Command::new("umount").arg(&self.mnt), COMMAND_LIMIT)
                .expect("umount hung");
            if o.status.success() {
                self.mounted = false;
                return;
            }
            let msg = format!(
                "umount {:?} failed (attempt {attempt}): {}holders: [{}]",
                self.mnt,
                text(&o),
                holders(&self.mnt)
            );
            assert!(attempt < UMOUNT_ATTEMPTS, "{msg}");
            eprintln!("{msg}; retrying");
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Takes the stack apart even when the server under it is dead: a lazy unmount, the loop
    /// device detached and waited for until the filesystem let go of it (so no superblock of
    /// this filesystem is left to meet the next mount of the same UUID), then nbdfuse
    /// unmounted and reaped. Idempotent.
    fn teardown(&mut self) -> Result<(), String> {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).output();
            self.mounted = false;
        }
        let mut result = Ok(());
        if !self.lo.is_empty() {
            let _ = Command::new("losetup").args(["-d", &self.lo]).output();
            let name = self.lo.trim_start_matches("/dev/");
            let backing = format!("/sys/block/{name}/loop/backing_file");
            let ours = |s: String| Path::new(s.trim()) == self.file;
            let t = Instant::now();
            while std::fs::read_to_string(&backing).is_ok_and(ours) {
                if t.elapsed() > RELEASE_LIMIT {
                    result = Err(format!("{} was not released", self.lo));
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            self.lo.clear();
        }
        if let Some(dir) = self.fuse_dir.take() {
            let o = Command::new("fusermount3").arg("-u").arg(&dir).output();
            if !o.is_ok_and(|o| o.status.success()) {
                let _ = Command::new("fusermount3").arg("-uz").arg(&dir).output();
            }
        }
        if let Some(mut fuse) = self.fuse.take() {
            if wait_for(&mut fuse, Duration::from_secs(10)).is_none() {
                let _ = fuse.kill();
                let _ = fuse.wait();
            }
        }
        result
    }
}

/// The processes with a file, directory or mapping under `dir` open (for a failed unmount).
fn holders(dir: &Path) -> String {
    let mut out = Vec::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = p.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let mut links: Vec<PathBuf> = ["cwd", "root", "exe"]
            .iter()
            .filter_map(|l| std::fs::read_link(p.path().join(l)).ok())
            .collect();
        for fd in std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            links.extend(std::fs::read_link(fd.path()).ok());
        }
        if links.iter().any(|l| l.starts_with(dir)) {
            let cmd = std::fs::read_to_string(p.path().join("cmdline")).unwrap_or_default();
            out.push(format!("{pid} {}", cmd.replace('\0', " ")));
        }
    }
    out.join("; ")
}

/// Attaches `file` to a free loop device; returns its path.
fn losetup(file: &Path, args: &[&str]) -> String {
    let o = run(Command::new("losetup")
        .args(["-f", "--show"])
        .args(args)
        .arg(file));
    stdout(&o).trim().to_string()
}

impl Drop for Exposed {
    fn drop(&mut self) {
        let _ = self.teardown();
    }
}
