//! `NbdDevice` against real servers (nbdkit with its memory and file plugins and the log,
//! delay, pause and multi-conn filters) and a fake one: many requests in flight on one
//! connection, multi-conn, timeouts with late replies, reconnection after a server restart
//! with the reconnect rule for unflushed writes, a server that shuts down (`NBD_ESHUTDOWN`),
//! a server that accepts no connection (its queue full),
//! closing with a dead server, and connections lent whole for one request (`direct_nbd`).
//!
//! A missing nbdkit fails the tests under CI=true and is a printed skip otherwise. Randomized
//! tests print their seed; `TIERCACHE_SEED=N` replays one.

mod common;
use blockdev::{BlockDevice, NbdDevice, NbdDirect, NbdOptions};
use common::have_nbdkit;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Hang guard: anything a test waits for must come well within this.
const HANG_GUARD: Duration = Duration::from_secs(30);

fn seed() -> u64 {
    let seed = std::env::var("TIERCACHE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::thread_rng().gen());
    println!("seed {seed} (TIERCACHE_SEED={seed} replays it)");
    seed
}

/// An nbdkit process serving on a unix socket in a temporary directory.
struct Nbdkit {
    dir: tempfile::TempDir,
    args: Vec<String>,
    child: Option<Child>,
    starts: usize,
}

impl Nbdkit {
    /// `nbdkit -f -U SOCK ARGS...`; `{dir}` in an argument is the temporary directory and
    /// `{n}` the number of this start (for a log file per start).
    fn start(args: &[&str]) -> Nbdkit {
        let mut k = Nbdkit::new(args);
        k.restart();
        k
    }

    /// Not started yet (to prepare files in its directory first).
    fn new(args: &[&str]) -> Nbdkit {
        Nbdkit {
            dir: tempfile::tempdir().unwrap(),
            args: args.iter().map(|s| s.to_string()).collect(),
            child: None,
            starts: 0,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn socket(&self) -> PathBuf {
        self.path("nbd.sock")
    }

    fn uri(&self, query: &str) -> String {
        let q = if query.is_empty() {
            String::new()
        } else {
            format!("&{query}")
        };
        format!("nbd+unix:///?socket={}{q}", self.socket().display())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path(&format!("log{}.txt", self.starts))).unwrap_or_default()
    }

    /// Starts nbdkit again on the same socket (a killed one leaves the socket file behind,
    /// which nbdkit refuses to replace) and waits until it accepts connections.
    fn restart(&mut self) {
        assert!(self.child.is_none());
        let _ = std::fs::remove_file(self.socket());
        self.starts += 1;
        let dir = self.dir.path().display().to_string();
        let n = self.starts.to_string();
        let args: Vec<String> = self
            .args
            .iter()
            .map(|a| a.replace("{dir}", &dir).replace("{n}", &n))
            .collect();
        let pidfile = self.path("nbdkit.pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-P"])
            .arg(&pidfile)
            .arg("-U")
            .arg(self.socket())
            .args(&args)
            .stdout(Stdio::null())
            .spawn()
            .expect("starting nbdkit");
        self.child = Some(child);
        let t = Instant::now();
        // nbdkit writes its pid file once it accepts connections.
        while std::fs::metadata(&pidfile).map_or(true, |m| m.len() == 0) {
            assert!(t.elapsed() < HANG_GUARD, "nbdkit did not start: {args:?}");
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("nbdkit {args:?} exited: {status}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Asks nbdkit to shut down (SIGTERM) and hands its process back: it answers
    /// `NBD_ESHUTDOWN` to the requests it still gets and exits once its clients have left.
    fn terminate(&mut self) -> Child {
        let c = self.child.take().expect("nbdkit is running");
        // SAFETY: kill(2) on the pid of our own child, which we have not waited for.
        assert_eq!(unsafe { libc::kill(c.id() as i32, libc::SIGTERM) }, 0);
        c
    }

    fn kill9(&mut self) {
        let mut c = self.child.take().expect("nbdkit is running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// Sends a command to the pause filter's control socket and waits for its answer.
    fn pause_control(&self, command: u8) {
        let mut s = UnixStream::connect(self.path("pause.ctl")).unwrap();
        s.write_all(&[command]).unwrap();
        let mut answer = [0u8];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], command.to_ascii_uppercase());
    }

    /// How many requests of `kind` ("Read", "Write", ...) this run of nbdkit has received so far.
    fn received(&self, kind: &str) -> usize {
        request_lines(&self.log(), kind)
    }

    /// Waits until this run of nbdkit has received `count` requests of `kind` in all (count
    /// from [`Nbdkit::received`]: a request resent after a restart is in the new run's log too).
    fn wait_for_requests(&self, kind: &str, count: usize) {
        let t = Instant::now();
        while request_lines(&self.log(), kind) < count {
            assert!(t.elapsed() < HANG_GUARD, "no {kind} reached nbdkit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The log filter writes `connection=N Read id=I ...` when a request arrives and
/// `connection=N ...Read id=I return=0` when it is answered.
fn request_lines(log: &str, kind: &str) -> usize {
    log.lines()
        .filter(|l| l.contains(&format!(" {kind} id=")))
        .count()
}

/// The most requests in flight at once on one connection, by connection.
fn max_in_flight(log: &str) -> HashMap<u64, usize> {
    let mut now: HashMap<u64, usize> = HashMap::new();
    let mut max: HashMap<u64, usize> = HashMap::new();
    for line in log.lines() {
        let Some(rest) = line.split("connection=").nth(1) else {
            continue;
        };
        let Some((conn, what)) = rest.split_once(' ') else {
            continue;
        };
        let conn: u64 = conn.parse().unwrap();
        let kind = what.split_whitespace().next().unwrap_or("");
        let is_request = ["Read", "Write", "Flush", "Trim", "Zero"].contains(&kind);
        let n = now.entry(conn).or_default();
        if is_request {
            *n += 1;
            let m = max.entry(conn).or_default();
            *m = (*m).max(*n);
        } else if kind.starts_with("...") && kind != "...Preconnect" {
            *n = n.saturating_sub(1);
        }
    }
    max
}

/// Runs `f` on a thread and fails the test if it does not finish within the hang guard.
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HANG_GUARD)
        .unwrap_or_else(|_| panic!("{what} did not finish within {HANG_GUARD:?}"))
}

/// The error of a call that must fail (without printing a read's data if it did not).
fn failed<T>(r: io::Result<T>, what: &str) -> io::Error {
    match r {
        Ok(_) => panic!("{what} succeeded"),
        Err(e) => e,
    }
}

fn pattern(byte: u8, len: usize) -> Vec<u8> {
    vec![byte; len]
}

fn read(dev: &NbdDevice, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    dev.read_at(&mut buf, offset)?;
    Ok(buf)
}

/// Threads doing random writes and reads with verification, each in its own region (so the
/// expected contents are exact), through `dev`.
fn random_io(dev: &Arc<NbdDevice>, seed: u64, threads: u64, ops: usize) {
    let region = 4u64 << 20;
    assert!(dev.size_bytes() >= region * threads);
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (t << 32));
                let base = t * region;
                let mut model = vec![0u8; region as usize];
                let mut written = vec![false; (region / 512) as usize];
                for op in 0..ops {
                    let sectors = rng.gen_range(1..=128u64);
                    let start = rng.gen_range(0..region / 512 - sectors);
                    let (at, len) = ((start * 512) as usize, (sectors * 512) as usize);
                    if rng.gen_bool(0.5) {
                        rng.fill_bytes(&mut model[at..at + len]);
                        dev.write_at(&model[at..at + len], base + at as u64)
                            .unwrap_or_else(|e| panic!("thread {t} op {op}: write: {e}"));
                        written[start as usize..(start + sectors) as usize].fill(true);
                    } else {
                        let got = read(&dev, base + at as u64, len)
                            .unwrap_or_else(|e| panic!("thread {t} op {op}: read: {e}"));
                        for s in start..start + sectors {
                            if !written[s as usize] {
                                continue; // never written here: whatever the export held
                            }
                            let r = (s * 512) as usize;
                            assert!(
                                got[r - at..r - at + 512] == model[r..r + 512],
                                "thread {t} op {op}: sector {s} of the region reads back wrong"
                            );
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a worker failed");
    }
}

#[test]
fn many_requests_in_flight_on_one_connection_return_the_right_data() {
    if !have_nbdkit() {
        return;
    }
    // The delay keeps requests in the server long enough to overlap.
    let k = Nbdkit::start(&[
        "--filter=log",
        "--filter=delay",
        "memory",
        "64M",
        "logfile={dir}/log{n}.txt",
        "rdelay=2ms",
        "wdelay=2ms",
    ]);
    let dev = Arc::new(NbdDevice::connect(&k.uri("connections=1")).unwrap());
    assert_eq!(dev.connections(), 1);
    let seed = seed();
    within("random I/O", {
        let dev = dev.clone();
        move || random_io(&dev, seed, 8, 150)
    });
    dev.flush().unwrap();
    let log = k.log();
    let max = max_in_flight(&log);
    assert_eq!(max.len(), 1, "one connection: {max:?}");
    let most = *max.values().next().unwrap();
    assert!(
        most > 1,
        "requests were never in flight together (at most {most})"
    );
    println!("at most {most} requests were in flight on the connection");
}

#[test]
fn multi_conn_spreads_requests_over_the_connections() {
    if !have_nbdkit() {
        return;
    }
    let k = Nbdkit::start(&["--filter=log", "memory", "64M", "logfile={dir}/log{n}.txt"]);
    let dev = Arc::new(NbdDevice::connect(&k.uri("")).unwrap());
    assert_eq!(dev.connections(), 4, "nbdkit memory advertises multi-conn");
    let seed = seed();
    within("random I/O", {
        let dev = dev.clone();
        move || random_io(&dev, seed, 8, 100)
    });
    dev.flush().unwrap();
    let log = k.log();
    let mut writes_by_conn: HashMap<&str, usize> = HashMap::new();
    for line in log.lines().filter(|l| l.contains(" Write id=")) {
        let conn = line.split("connection=").nth(1).unwrap();
        *writes_by_conn
            .entry(conn.split(' ').next().unwrap())
            .or_default() += 1;
    }
    assert_eq!(
        writes_by_conn.len(),
        4,
        "writes on every connection: {writes_by_conn:?}"
    );
    // What one device wrote over four connections, another reads over four.
    let a = pattern(0x5a, 1 << 20);
    dev.write_at(&a, 40 << 20).unwrap();
    dev.flush().unwrap();
    let other = NbdDevice::connect(&k.uri("connections=3")).unwrap();
    assert_eq!(other.connections(), 3);
    assert_eq!(read(&other, 40 << 20, a.len()).unwrap(), a);

    // A server without multi-conn gets one connection whatever is asked.
    let single = Nbdkit::start(&[
        "--filter=multi-conn",
        "memory",
        "1M",
        "multi-conn-mode=disable",
    ]);
    let dev = NbdDevice::connect(&single.uri("connections=8")).unwrap();
    assert_eq!(dev.connections(), 1);
    dev.write_at(&pattern(1, 4096), 0).unwrap();
    assert_eq!(read(&dev, 0, 4096).unwrap(), pattern(1, 4096));
    // Nor does it lend connections (their writes would not be covered by its flush).
    for _ in 0..20 {
        assert!(dev.direct_nbd(false, 0, 4096).is_none());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A connection lent by `dev` for one request, waited for: the device opens its spare
/// connections in the background, so the first asks get none.
fn lend(dev: &NbdDevice, write: bool, offset: u64, len: usize) -> NbdDirect {
    let t = Instant::now();
    loop {
        if let Some(l) = dev.direct_nbd(write, offset, len) {
            return l;
        }
        assert!(t.elapsed() < HANG_GUARD, "no connection was lent");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The socket of a lent connection, for blocking calls (not closed when dropped).
fn lent_socket(l: &NbdDirect) -> std::mem::ManuallyDrop<UnixStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: the lease keeps the descriptor open while the caller uses it; ManuallyDrop
    // never closes it.
    std::mem::ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(l.fd()) })
}

/// Sends a lent connection's request and `payload`.
fn send_lent(l: &mut NbdDirect, payload: &[u8]) {
    let request = l.request().to_vec();
    let mut s = lent_socket(l);
    s.write_all(&request).unwrap();
    s.write_all(payload).unwrap();
}

/// One whole exchange on a lent connection, with blocking calls: a write's `payload`, a
/// read's data into `data`.
fn exchange(l: &mut NbdDirect, payload: &[u8], data: &mut [u8]) -> io::Result<()> {
    send_lent(l, payload);
    let mut s = lent_socket(l);
    let mut head = [0u8; NbdDirect::REPLY_HEADER_BYTES];
    s.read_exact(&mut head)?;
    let n = l.reply(&head)?;
    assert_eq!(n, data.len(), "the data announced");
    s.read_exact(&mut data[..n])?;
    l.done();
    Ok(())
}

/// Lent connections (the io_uring data path's way to a remote device) carry reads and writes
/// that the shared connections see, and one whose exchange ended whole is lent again at once.
#[test]
fn lent_connections_carry_requests_the_shared_ones_see() {
    if !have_nbdkit() {
        return;
    }
    let k = Nbdkit::start(&["memory", "16M"]);
    let dev = NbdDevice::connect(&k.uri("")).unwrap();
    let a = pattern(0xa1, 8192);
    let mut l = lend(&dev, true, 4096, a.len());
    exchange(&mut l, &a, &mut []).unwrap();
    drop(l);
    assert_eq!(
        read(&dev, 4096, a.len()).unwrap(),
        a,
        "a lent write, read shared"
    );
    let b = pattern(0xb2, 4096);
    dev.write_at(&b, 1 << 20).unwrap();
    let mut l = dev
        .direct_nbd(false, 1 << 20, b.len())
        .expect("the connection came back after its whole exchange");
    let mut got = vec![0u8; b.len()];
    exchange(&mut l, &[], &mut got).unwrap();
    assert_eq!(got, b, "a shared write, read lent");
    drop(l);
    dev.flush().unwrap();
    // At most `spare-connections` are lent at once (one here), and none with 0.
    let one = NbdDevice::connect(&k.uri("spare-connections=1")).unwrap();
    let held = lend(&one, false, 0, 4096);
    for _ in 0..20 {
        assert!(
            one.direct_nbd(false, 0, 4096).is_none(),
            "a second was lent"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(held);
    assert!(
        one.direct_nbd(false, 0, 4096).is_some(),
        "the one came back"
    );
    let none = NbdDevice::connect(&k.uri("spare-connections=0")).unwrap();
    for _ in 0..20 {
        assert!(none.direct_nbd(false, 0, 4096).is_none());
        std::thread::sleep(Duration::from_millis(5));
    }
    // Requests the server refuses are not lent: past the end, unaligned, or not a read or
    // write of data.
    assert!(dev.direct_nbd(false, 16 << 20, 4096).is_none());
    assert!(dev.direct_nbd(false, 100, 4096).is_none());
    assert!(dev.direct_nbd(false, 0, 0).is_none());
}

/// A spare connection the server closed while it was idle (a restart) is not lent again:
/// the first request lent after the restart is carried whole.
#[test]
fn a_spare_connection_closed_while_idle_is_not_lent() {
    if !have_nbdkit() {
        return;
    }
    let mut k = Nbdkit::start(&["memory", "16M"]);
    let dev = NbdDevice::connect(&k.uri("")).unwrap();
    let mut l = lend(&dev, false, 0, 4096);
    exchange(&mut l, &[], &mut [0u8; 4096]).unwrap();
    drop(l);
    k.kill9();
    k.restart();
    let b = pattern(3, 4096);
    dev.write_at(&b, 8192).unwrap();
    dev.flush().expect("nothing was written before the restart");
    let mut l = lend(&dev, false, 8192, 4096);
    let mut got = vec![0u8; 4096];
    exchange(&mut l, &[], &mut got).expect("a connection the server had closed was lent");
    assert_eq!(got, b);
}

/// A lent read whose connection breaks before its reply (the server killed) may be sent
/// again elsewhere when no write is unflushed, and not when one is (the shared connections'
/// rule for a request in flight on a connection that breaks).
#[test]
fn a_lent_read_that_breaks_may_be_resent_only_with_nothing_at_stake() {
    if !have_nbdkit() {
        return;
    }
    let mut k = Nbdkit::start(&["memory", "16M"]);
    let dev = NbdDevice::connect(&k.uri("")).unwrap();
    // A read lent, then the server killed before it is sent; its connection ends.
    let broken_read = |k: &mut Nbdkit| {
        let mut l = lend(&dev, false, 0, 4096);
        k.kill9();
        let request = l.request().to_vec();
        let mut s = lent_socket(&l);
        let _ = s.write_all(&request);
        let mut head = [0u8; NbdDirect::REPLY_HEADER_BYTES];
        let res = match s.read(&mut head) {
            Ok(n) => n as i32,
            Err(e) => -e.raw_os_error().unwrap_or(5), // EIO without an errno
        };
        assert!(res <= 0, "a killed server answered");
        let err = l.failed(res);
        assert_ne!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        k.restart();
        l
    };
    let l = broken_read(&mut k);
    assert!(l.may_resend(), "nothing was at stake");
    drop(l);
    dev.write_at(&pattern(9, 4096), 0).unwrap();
    let l = broken_read(&mut k);
    assert!(!l.may_resend(), "a write was not flushed");
}

/// A lent write whose reply never came (its connection given up) counts as lost: the next
/// flush fails, once, as when a shared connection breaks with writes unflushed. A reply to
/// another request is refused and nothing is at stake (the flush after succeeds).
#[test]
fn a_lent_write_left_unanswered_fails_the_next_flush_and_a_stray_reply_is_refused() {
    if !have_nbdkit() {
        return;
    }
    let k = Nbdkit::start(&["memory", "16M"]);
    let dev = NbdDevice::connect(&k.uri("")).unwrap();
    let mut l = lend(&dev, true, 0, 4096);
    send_lent(&mut l, &pattern(7, 4096));
    drop(l);
    let err = dev
        .flush()
        .expect_err("a write never answered was taken as flushed");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    dev.flush().expect("the loss is reported once");

    let mut l = lend(&dev, false, 0, 4096);
    send_lent(&mut l, &[]);
    let mut head = [0u8; NbdDirect::REPLY_HEADER_BYTES];
    lent_socket(&l).read_exact(&mut head).unwrap();
    head[15] ^= 1; // another cookie
    let err = l
        .reply(&head)
        .expect_err("a reply to another request was taken");
    assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
    drop(l);
    dev.flush().expect("no write was at stake");
}

#[test]
fn a_request_without_a_reply_times_out_and_its_late_reply_is_dropped() {
    if !have_nbdkit() {
        return;
    }
    let k = Nbdkit::start(&[
        "--filter=pause",
        "memory",
        "16M",
        "pause-control={dir}/pause.ctl",
    ]);
    let options = NbdOptions {
        connections: 1,
        timeout: Duration::from_secs(1),
        ..NbdOptions::default()
    };
    let dev = Arc::new(NbdDevice::connect_with(&k.uri(""), options).unwrap());
    let (a, b) = (pattern(0xaa, 64 << 10), pattern(0xbb, 64 << 10));
    dev.write_at(&a, 0).unwrap();
    dev.write_at(&b, 64 << 10).unwrap();
    for round in 0..3 {
        k.pause_control(b'p');
        let d = dev.clone();
        let (err, waited) = within("a read from a paused server", move || {
            let t = Instant::now();
            (failed(read(&d, 0, 64 << 10), "read"), t.elapsed())
        });
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "round {round}: {err}");
        assert!(
            waited >= Duration::from_secs(1),
            "gave up early: {waited:?}"
        );
        k.pause_control(b'r');
        // The late reply (A's data) comes first on the connection; B's read must get B.
        assert_eq!(read(&dev, 64 << 10, b.len()).unwrap(), b, "round {round}");
    }
    dev.write_at(&pattern(0xcc, 4096), 0).unwrap();
    dev.flush().unwrap();
    assert_eq!(read(&dev, 0, 4096).unwrap(), pattern(0xcc, 4096));
}

#[test]
fn a_server_that_never_answers_the_handshake_is_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let accepted = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
    let uri = format!("nbd+unix:///x?socket={}&timeout=1", sock.display());
    let err = within("connecting to a silent server", move || {
        failed(NbdDevice::connect(&uri), "connect")
    });
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    drop(accepted.join().unwrap());
}

#[test]
fn a_server_that_accepts_no_connection_is_a_timeout() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("full.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    // Never accepting, with room for one connection in its queue (backlog 0), taken: the
    // next blocking connect would wait until the server accepts, for ever.
    // SAFETY: the listener's own descriptor.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let _queued = UnixStream::connect(&sock).unwrap();
    let uri = format!("nbd+unix:///x?socket={}&timeout=1", sock.display());
    let t = Instant::now();
    let err = within("connecting to a server that accepts nothing", move || {
        failed(NbdDevice::connect(&uri), "connect")
    });
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    assert!(err.to_string().contains("accepted no connection"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(listener);
}

/// nbdkit started with `args` on a 16 MiB `{dir}/disk.img`, and a device on it with a 10 s
/// timeout (4 connections: nbdkit file advertises multi-conn).
fn file_server(args: &[&str]) -> (Nbdkit, Arc<NbdDevice>) {
    let mut k = Nbdkit::new(args);
    std::fs::File::create(k.path("disk.img"))
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    k.restart();
    let options = NbdOptions {
        timeout: Duration::from_secs(10),
        ..NbdOptions::default()
    };
    let dev = Arc::new(NbdDevice::connect_with(&k.uri(""), options).unwrap());
    assert_eq!(dev.connections(), 4, "nbdkit file advertises multi-conn");
    (k, dev)
}

#[test]
fn a_server_restart_is_survived_and_unflushed_writes_fail_the_next_flush() {
    if !have_nbdkit() {
        return;
    }
    let (mut k, dev) = file_server(&[
        "--filter=log",
        "--filter=pause",
        "file",
        "{dir}/disk.img",
        "logfile={dir}/log{n}.txt",
        "pause-control={dir}/pause.ctl",
    ]);
    let p1 = pattern(0x11, 1 << 20);
    dev.write_at(&p1, 0).unwrap();
    dev.flush().unwrap();

    // Everything flushed: a restart is invisible, even to a read in flight across it.
    k.kill9();
    k.restart();
    assert_eq!(read(&dev, 0, p1.len()).unwrap(), p1);
    k.pause_control(b'p');
    let reads = k.received("Read");
    let d = dev.clone();
    let in_flight = std::thread::spawn(move || read(&d, 0, 4096));
    k.wait_for_requests("Read", reads + 1);
    k.kill9();
    k.restart();
    let got = within("the read in flight", move || in_flight.join().unwrap());
    assert_eq!(
        got.unwrap(),
        pattern(0x11, 4096),
        "sent again after the restart"
    );
    dev.flush().unwrap();

    // A write not yet flushed when the connection breaks: the request in flight fails, and
    // so does the next flush, once.
    dev.write_at(&pattern(0x22, 4096), 1 << 20).unwrap();
    k.pause_control(b'p');
    let reads = k.received("Read");
    let d = dev.clone();
    let in_flight = std::thread::spawn(move || read(&d, 0, 4096));
    k.wait_for_requests("Read", reads + 1);
    k.kill9();
    k.restart();
    let err = failed(
        within("the read in flight", move || in_flight.join().unwrap()),
        "the read in flight with a write not flushed",
    );
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    let err = failed(dev.flush(), "the flush after the restart");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    let p3 = pattern(0x33, 64 << 10);
    dev.write_at(&p3, 2 << 20).unwrap();
    dev.flush().unwrap();
    assert_eq!(read(&dev, 2 << 20, p3.len()).unwrap(), p3);

    // The same without a request in flight: write, restart, flush fails; write, flush works.
    dev.write_at(&pattern(0x44, 4096), 3 << 20).unwrap();
    k.kill9();
    k.restart();
    let err = failed(dev.flush(), "the flush after the restart");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    dev.write_at(&pattern(0x55, 4096), 3 << 20).unwrap();
    dev.flush().unwrap();
    dev.flush().unwrap();
    assert_eq!(read(&dev, 3 << 20, 4096).unwrap(), pattern(0x55, 4096));
    assert_eq!(read(&dev, 0, p1.len()).unwrap(), p1);
}

/// A server shutting down answers `NBD_ESHUTDOWN` and waits for its clients to leave (nbdkit
/// on SIGTERM). The client leaves it (`NBD_CMD_DISC`), so it can exit, and reconnects to the
/// server started in its place; requests are sent again there under the reconnect rule (a
/// write not flushed fails the next flush, once). Before, every request failed with ESHUTDOWN
/// for as long as the old server waited, and it waited for ever.
#[test]
fn a_server_that_shuts_down_is_left_and_its_successor_serves() {
    if !have_nbdkit() {
        return;
    }
    let (mut k, dev) = file_server(&["file", "{dir}/disk.img"]);
    let p1 = pattern(0x61, 256 << 10);
    dev.write_at(&p1, 0).unwrap();
    dev.flush().unwrap();
    // Reads (checked against `expect`) until the old server has exited: it exits once every
    // connection to it was left, and a connection learns of the shutdown from a reply (nbdkit
    // answers normally until its signal handler ran).
    let reads_until_exit = |mut old: Child, expect: Option<&[u8]>| {
        let t = Instant::now();
        while old.try_wait().unwrap().is_none() {
            assert!(t.elapsed() < HANG_GUARD, "the old server did not exit");
            let got = read(&dev, 0, 4096);
            if let Some(want) = expect {
                assert_eq!(got.unwrap(), want);
            }
        }
    };

    // An idle spare connection (a lent read answered whole) is left with the shared ones.
    let mut l = lend(&dev, false, 0, 4096);
    let mut data = vec![0u8; 4096];
    exchange(&mut l, &[], &mut data).unwrap();
    drop(l);
    assert_eq!(dev.links().spare_open, 1);

    // Everything flushed: every read is answered, by the old server or the new one.
    let old = k.terminate();
    k.restart();
    reads_until_exit(old, Some(&p1[..4096]));
    assert_eq!(dev.links().spare_open, 0, "the idle spare was left");
    dev.flush().unwrap();
    assert_eq!(read(&dev, 0, p1.len()).unwrap(), p1);

    // A write not flushed when the server goes: the next flush fails once, then all is well.
    dev.write_at(&pattern(0x62, 4096), 1 << 20).unwrap();
    let old = k.terminate();
    k.restart();
    reads_until_exit(old, None);
    let err = failed(dev.flush(), "the flush after the server went");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    dev.write_at(&pattern(0x63, 4096), 1 << 20).unwrap();
    dev.flush().unwrap();
    assert_eq!(read(&dev, 1 << 20, 4096).unwrap(), pattern(0x63, 4096));

    // On lent connections: a read answered NBD_ESHUTDOWN may be sent again elsewhere (it was
    // not carried out); a write so answered counts as lost, and fails the next flush.
    for (write, resend) in [(false, true), (true, false)] {
        // A spare connection opened and idle first: a server shutting down takes no new one.
        let mut l = lend(&dev, false, 0, 4096);
        exchange(&mut l, &[], &mut vec![0u8; 4096]).unwrap();
        drop(l);
        let old = k.terminate();
        let t = Instant::now();
        let (l, err) = loop {
            assert!(
                t.elapsed() < HANG_GUARD,
                "no NBD_ESHUTDOWN on a lent connection"
            );
            let mut l = lend(&dev, write, 2 << 20, 4096);
            let (payload, mut data) = if write {
                (pattern(0x64, 4096), vec![])
            } else {
                (vec![], vec![0u8; 4096])
            };
            if let Err(e) = exchange(&mut l, &payload, &mut data) {
                break (l, e);
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
        assert!(err.to_string().contains("NBD_ESHUTDOWN"), "{err}");
        assert_eq!(l.may_resend(), resend, "write {write}: {err}");
        drop(l);
        k.restart();
        reads_until_exit(old, None);
    }
    let err = failed(dev.flush(), "the flush after a lent write was refused");
    assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted, "{err}");
    dev.flush().unwrap();
}

#[test]
fn requests_and_close_with_a_dead_server_end_within_bounds() {
    if !have_nbdkit() {
        return;
    }
    let mut k = Nbdkit::start(&["memory", "16M"]);
    let options = NbdOptions {
        connections: 4,
        timeout: Duration::from_secs(1),
        ..NbdOptions::default()
    };
    let dev = NbdDevice::connect_with(&k.uri(""), options).unwrap();
    dev.write_at(&pattern(7, 4096), 0).unwrap();
    dev.flush().unwrap();
    k.kill9(); // the socket file stays: every reconnection attempt is refused
    let dev = within("requests to a dead server", move || {
        for _ in 0..2 {
            let err = failed(read(&dev, 0, 4096), "a read");
            assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
            let err = failed(dev.write_at(&pattern(8, 4096), 0), "a write");
            assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        }
        dev
    });
    within("close", move || dev.close()).expect("every connection thread exited");

    // A server that holds every request (paused, connections open): close does not wait
    // for it either.
    let k = Nbdkit::start(&[
        "--filter=pause",
        "memory",
        "16M",
        "pause-control={dir}/pause.ctl",
    ]);
    let dev = Arc::new(NbdDevice::connect_with(&k.uri(""), options).unwrap());
    k.pause_control(b'p');
    let d = dev.clone();
    let err = within("a read from a paused server", move || {
        failed(read(&d, 0, 4096), "a read")
    });
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
    let dev = Arc::into_inner(dev).unwrap();
    within("close", move || dev.close()).expect("every connection thread exited");
    k.pause_control(b'r');
}
