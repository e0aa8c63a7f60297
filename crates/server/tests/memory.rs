//! Memory under clients that never read their replies (finding 6), measured on a server in a
//! process of its own (this test binary run again as `child_server`): connections pipeline
//! 32 MiB reads and never read a byte; the server's resident memory stays within the request
//! budget plus a stated fixed overhead, and once the clients close, their queued requests are
//! dropped rather than executed and the memory goes back. No timing assertions: waits have
//! generous safety deadlines that only turn a hang into a failure.

mod support;

use server::{BindAddr, Export, ExportRegistry, ServerConfig};
use std::io::{self, BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{read_request, RawClient};

const MIB: usize = 1024 * 1024;
/// The child server's request budget.
const BUDGET: usize = 128 * MIB;
/// Resident memory allowed beyond the budget and the idle process: per connection its 256 KiB
/// read buffer and up to 16 workers' kept buffers of 256 KiB (4.25 MiB), for 8 connections,
/// plus 16 MiB for thread stacks, allocator slack and the test client's own buffers.
const OVERHEAD: usize = 8 * (MIB / 4 + 16 * MIB / 4) + 16 * MIB;
const CONNECTIONS: usize = 8;
const READS: u64 = 64;
const READ_BYTES: u32 = 32 << 20;
const HUNG: Duration = Duration::from_secs(120);
const CHILD_ENV: &str = "SERVER_MEMORY_TEST_SOCKET";

/// A 1 TiB export that stores nothing: a read fills the buffer (so its pages become resident,
/// as with a real read) and is counted.
struct Counting {
    reads: AtomicU64,
}

impl Export for Counting {
    fn name(&self) -> String {
        "big".into()
    }
    fn description(&self) -> String {
        String::new()
    }
    fn size_bytes(&self) -> u64 {
        1 << 40
    }
    fn is_rotational(&self) -> bool {
        false
    }
    fn read_only(&self) -> bool {
        true
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        buf.fill(offset as u8 ^ 0x5a);
        self.reads.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn write(&self, _: u64, _: &[u8], _: bool) -> io::Result<()> {
        Err(io::ErrorKind::PermissionDenied.into())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, _: u64, _: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> io::Result<()> {
        Err(io::ErrorKind::PermissionDenied.into())
    }
    fn cache(&self, _: u64, _: u64) -> io::Result<()> {
        Ok(())
    }
    fn block_status(&self, _: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        Ok(vec![(len, 0)])
    }
}

/// The server process: serves on the socket named by [`CHILD_ENV`] and answers each line on
/// stdin with `reads CONNECTIONS BYTES_IN_FLIGHT` (reads executed so far); exits at stdin EOF.
/// Without the variable (a normal test run) it does nothing.
#[test]
fn child_server() {
    let Ok(socket) = std::env::var(CHILD_ENV) else {
        return;
    };
    let export = Arc::new(Counting {
        reads: AtomicU64::new(0),
    });
    let registry = ExportRegistry::new();
    registry
        .add(Arc::clone(&export) as Arc<dyn Export>)
        .unwrap();
    let config = ServerConfig {
        bytes_in_flight_max: BUDGET,
        ..ServerConfig::default()
    };
    let handle = server::start(&BindAddr::Unix(PathBuf::from(socket)), registry, config).unwrap();
    let stdout = io::stdout();
    for line in io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
        let stats = handle.stats();
        let mut out = stdout.lock();
        writeln!(
            out,
            "reads {} {} {}",
            export.reads.load(Ordering::SeqCst),
            stats.connections,
            stats.bytes_in_flight
        )
        .unwrap();
        out.flush().unwrap();
    }
    handle.shutdown();
}

struct ChildServer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

#[derive(Debug, Clone, Copy)]
struct Report {
    reads: u64,
    connections: usize,
    bytes_in_flight: usize,
}

impl ChildServer {
    fn start(socket: &std::path::Path) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_server",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_ENV, socket)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let deadline = Instant::now() + HUNG;
        while !socket.exists() {
            assert!(Instant::now() < deadline, "the child server did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        ChildServer {
            child,
            stdin,
            stdout,
        }
    }

    fn report(&mut self) -> Report {
        writeln!(self.stdin).unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "child gone");
            // The test harness prints its own lines too, and "test child_server ... " without
            // a line end.
            if let Some(rest) = line.find("reads ").map(|at| &line[at + "reads ".len()..]) {
                let v: Vec<usize> = rest
                    .split_whitespace()
                    .map(|x| x.parse().unwrap())
                    .collect();
                return Report {
                    reads: v[0] as u64,
                    connections: v[1],
                    bytes_in_flight: v[2],
                };
            }
        }
    }

    /// A line of /proc/PID/status, in bytes.
    fn status(&self, key: &str) -> usize {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib: usize = status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kib * 1024
    }

    fn wait_until(&mut self, what: &str, mut done: impl FnMut(Report) -> bool) -> Report {
        let deadline = Instant::now() + HUNG;
        loop {
            let report = self.report();
            if done(report) {
                return report;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}: {report:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn never_reading_clients_stay_within_the_budget_and_their_work_stops_when_they_go() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nbd.sock");
    let mut srv = ChildServer::start(&socket);
    let idle_rss = srv.status("VmRSS");
    let clients: Vec<RawClient> = (0..CONNECTIONS)
        .map(|c| {
            let mut client = RawClient::connect_unix(&socket, "big", true).unwrap();
            let mut out = Vec::new();
            for i in 0..READS {
                read_request(i, (c as u64 * READS + i) << 25, READ_BYTES, &mut out);
            }
            client.stream.write_all(&out).unwrap();
            client
        })
        .collect();
    // The budget's pool fills up with replies nobody reads (the fair-share rule lets one
    // 32 MiB read at a time hold half of this budget's pool).
    srv.wait_until("the budget is taken", |r| {
        r.bytes_in_flight >= READ_BYTES as usize && r.reads >= 1
    });
    let mut rss_max = 0;
    for _ in 0..50 {
        rss_max = rss_max.max(srv.status("VmRSS"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let hwm = srv.status("VmHWM");
    let at_close = srv.report();
    eprintln!(
        "idle RSS {} MiB; under {CONNECTIONS} never-reading clients: RSS max sampled {} MiB, \
         VmHWM {} MiB (budget {} MiB, overhead allowed {} MiB); {at_close:?}",
        idle_rss / MIB,
        rss_max / MIB,
        hwm / MIB,
        BUDGET / MIB,
        OVERHEAD / MIB
    );
    assert!(
        hwm <= idle_rss + BUDGET + OVERHEAD,
        "peak RSS {} MiB over the budget {} MiB + overhead {} MiB + idle {} MiB",
        hwm / MIB,
        BUDGET / MIB,
        OVERHEAD / MIB,
        idle_rss / MIB
    );
    drop(clients);
    let closed = Instant::now();
    let gone = srv.wait_until("the connections are gone", |r| r.connections == 0);
    eprintln!(
        "connections gone {:?} after the clients closed",
        closed.elapsed()
    );
    // Requests holding a budget permit when the clients closed may still have run (at most
    // BUDGET / READ_BYTES of them, plus one per connection in the export at that moment);
    // the rest, queued on the sockets and in the workers, were dropped.
    let executed_after = gone.reads - at_close.reads;
    let queued = CONNECTIONS as u64 * READS - at_close.reads;
    eprintln!("after the clients closed: {executed_after} more reads executed of {queued} queued");
    let allowed = (BUDGET / READ_BYTES as usize + CONNECTIONS) as u64;
    assert!(
        executed_after <= allowed,
        "{executed_after} reads executed after the clients closed (at most {allowed} expected)"
    );
    assert_eq!(
        srv.report().reads,
        gone.reads,
        "work goes on with no connection left"
    );
    let rss_after = srv.status("VmRSS");
    eprintln!("RSS once they are gone: {} MiB", rss_after / MIB);
    assert!(
        rss_after <= idle_rss + OVERHEAD,
        "RSS {} MiB after the clients left (idle {} MiB)",
        rss_after / MIB,
        idle_rss / MIB
    );
}
