//! Hosts for the hand-over tests (`handover.rs`, `ceph.rs`): a "host" is a `tiercache serve`
//! process with a cache device file of its own, serving a backing device it shares with other
//! hosts (an NBD URI: nbdkit over a file, or qemu-nbd over an RBD image) beside a local disk of
//! its own; plus seeded data to write and compare through a host's export, and a backing
//! header read with `tiercache show`.
//!
//! Invariant: a `Host` dropped while its server runs kills it (no stray server after a failed
//! test); every data check compares whole byte ranges, so a wrong byte fails it.

use super::*;
use rand::{RngCore, SeedableRng};
use serde_json::Value;

/// The shared disk's export name (its backing label) on every host.
pub const SHARED: &str = "data";

pub struct Host {
    pub name: String,
    pub dir: PathBuf,
    /// The shared backing device (an NBD URI).
    pub backing: String,
    pub server: Option<Child>,
}

impl Host {
    /// A host named `name` in `dir`: a cache file of `cache_mib` and a local disk of 16 MiB
    /// formatted together by `make`. The shared disk is not touched.
    pub fn new(dir: &Path, name: &str, cache_mib: u64, backing: &str) -> Host {
        let h = Host {
            name: name.into(),
            dir: dir.to_path_buf(),
            backing: backing.into(),
            server: None,
        };
        for (f, mib) in [(h.cache(), cache_mib), (h.local(), 16)] {
            std::fs::File::create(&f)
                .unwrap()
                .set_len(mib << 20)
                .unwrap();
        }
        run(tc()
            .args([
                "make",
                "--label",
                &format!("{name}-local"),
                "--bucket-size",
                "256k",
            ])
            .arg("--cache")
            .arg(h.cache())
            .arg("--backing")
            .arg(h.local()));
        h
    }

    pub fn cache(&self) -> PathBuf {
        self.dir.join(format!("{}-cache.img", self.name))
    }

    pub fn local(&self) -> PathBuf {
        self.dir.join(format!("{}-local.img", self.name))
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join(format!("{}.sock", self.name))
    }

    pub fn admin(&self) -> String {
        format!("{}.admin", self.socket().display())
    }

    /// The shared disk as this host exports it.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///{SHARED}?socket={}", self.socket().display())
    }

    /// `serve` on the cache and the local disk, with the shared disk too when `shared`.
    pub fn serve_cmd(&self, shared: bool, extra: &[&str]) -> Command {
        let mut c = tc();
        c.arg("serve")
            .arg("--cache")
            .arg(self.cache())
            .arg("--backing")
            .arg(self.local());
        if shared {
            c.arg("--backing").arg(&self.backing);
        }
        c.arg("--socket").arg(self.socket()).args(extra);
        c
    }

    /// Starts `serve` (see `serve_cmd`) and waits until both sockets exist.
    pub fn start(&mut self, shared: bool, extra: &[&str]) {
        let _ = std::fs::remove_file(self.socket());
        let _ = std::fs::remove_file(self.admin());
        let mut cmd = self.serve_cmd(shared, extra);
        cmd.stderr(Stdio::inherit());
        self.server = Some(cmd.spawn().expect("starting tiercache serve"));
        let t = Instant::now();
        while !(self.socket().exists() && Path::new(&self.admin()).exists()) {
            if let Some(s) = self.server.as_mut().unwrap().try_wait().unwrap() {
                panic!("host {}: serve exited with {s}", self.name);
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "host {}: server did not start",
                self.name
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `serve` that must be refused (within a minute); what it said.
    pub fn start_refused(&self, shared: bool, extra: &[&str]) -> String {
        refused_within(&mut self.serve_cmd(shared, extra), Duration::from_secs(60))
    }

    pub fn admin_cmd(&self, args: &[&str]) -> Command {
        super::admin_cmd(&self.admin(), args)
    }

    pub fn tc_admin(&self, args: &[&str]) -> Output {
        run(&mut self.admin_cmd(args))
    }

    /// `tiercache attach [extra] BACKING` against this host's server.
    pub fn attach_cmd(&self, extra: &[&str]) -> Command {
        let mut c = self.admin_cmd(&["attach"]);
        c.args(extra).arg(&self.backing);
        c
    }

    /// Graceful stop; the server must exit 0.
    pub fn stop(&mut self) {
        self.tc_admin(&["stop"]);
        let status = self.server.take().unwrap().wait().unwrap();
        assert!(
            status.success(),
            "host {}: server exited with {status}",
            self.name
        );
    }

    /// The host is gone: kill -9, nothing saved.
    pub fn kill9(&mut self) {
        let mut c = self.server.take().unwrap();
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// The cache set's uuid, as `show` prints it.
    pub fn set_uuid(&self) -> String {
        let v: Value = serde_json::from_str(&stdout(&run(tc()
            .arg("show")
            .arg(self.cache())
            .arg("--json"))))
        .unwrap();
        v["cset_uuid"]
            .as_str()
            .unwrap_or_else(|| panic!("no set uuid in {v}"))
            .to_string()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(mut c) = self.server.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The backing header of `uri` as `tiercache show --json` prints it.
pub fn header(uri: &str) -> Value {
    serde_json::from_str(&stdout(&run(tc().args(["show", uri, "--json"])))).unwrap()
}

/// Polls `header(uri)` until `ok` holds, for at most `limit`; the last header.
pub fn header_until(uri: &str, limit: Duration, ok: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let h = header(uri);
        if ok(&h) {
            return h;
        }
        assert!(
            t.elapsed() < limit,
            "{uri}: header still {h} after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A python3 that can `import nbd`: $TIERCACHE_PYTHON, python3 on PATH, or /usr/bin/python3
/// (a python from pyenv or a venv on PATH may not see the distribution's python3-libnbd).
fn python_with_nbd() -> Option<String> {
    let mut candidates: Vec<String> = std::env::var("TIERCACHE_PYTHON").into_iter().collect();
    candidates.extend(["python3".to_string(), "/usr/bin/python3".to_string()]);
    candidates.into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import nbd"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Whether `nbdsh` runs here, with a python that has the libnbd bindings (see
/// [`unavailable`] when not).
pub fn have_nbdsh() -> bool {
    have("nbdsh")
        && (python_with_nbd().is_some()
            || unavailable("python3 with the libnbd bindings (python3-libnbd)"))
}

/// `nbdsh ARGS`, run as `nbdsh` runs itself (`python3 -m nbd`) by a python that has the
/// libnbd bindings.
pub fn nbdsh(args: &[&str]) -> Command {
    let py = python_with_nbd().expect("have_nbdsh() was checked");
    let mut c = Command::new(py);
    c.args(["-m", "nbd"]).args(args);
    c
}

/// `len` seeded bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Writes `data` at `offset` of the export `uri` (nbdsh, 1 MiB a request), then flushes: the
/// writes are acknowledged and durable as a client's fsync makes them.
pub fn write_at(dir: &Path, uri: &str, offset: u64, data: &[u8]) {
    let f = dir.join(format!("write-{offset}.bin"));
    std::fs::write(&f, data).unwrap();
    run(&mut nbdsh(&[
        "-u",
        uri,
        "-c",
        &format!(
            "d = open({:?}, 'rb').read()\n\
             for i in range(0, len(d), 1 << 20): h.pwrite(d[i:i + (1 << 20)], {offset} + i)\n\
             h.flush()",
            f.display()
        ),
    ]));
    let _ = std::fs::remove_file(f);
}

/// Reads `len` bytes at `offset` of the export `uri` (nbdsh), or what the read failed with.
pub fn read_at(uri: &str, offset: u64, len: usize) -> Result<Vec<u8>, String> {
    let o = nbdsh(&[
        "-u",
        uri,
        "-c",
        &format!(
            "import sys\n\
             for i in range(0, {len}, 1 << 20):\n    \
             sys.stdout.buffer.write(h.pread(min(1 << 20, {len} - i), {offset} + i))"
        ),
    ])
    .output()
    .expect("running nbdsh");
    if o.status.success() && o.stdout.len() == len {
        Ok(o.stdout)
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

/// Asserts that `uri` holds `want` at `offset`, naming the first byte that differs.
pub fn assert_holds(uri: &str, offset: u64, want: &[u8], what: &str) {
    let got = read_at(uri, offset, want.len()).unwrap_or_else(|e| panic!("{what}: {e}"));
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {} differs (got {:#04x}, want {:#04x})",
            offset + i as u64,
            got[i],
            want[i]
        );
    }
}
