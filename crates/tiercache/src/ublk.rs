//! `serve --ublk`: each volume also served as `/dev/ublkbN` (the `ublk` crate), beside the
//! NBD sockets. The devices serve the same `Export`s as the sockets (so the same statistics
//! and metrics); they are started before the sockets listen and stopped with them, within the
//! same deadline, before the cache set is saved.
//!
//! Invariants: a volume has a device exactly while it has an export ([`Devices::sync`] follows
//! the export registry as the sockets do: the device of a detached volume is stopped once its
//! requests in flight are done, as NBD clients are cut off, and a volume attached while the
//! server runs gets one). Numbers start at `first_id`: the volumes there at start take them in
//! name order, a volume attached later the lowest free one; a number whose device is still
//! being deleted (the driver waits for a mounted filesystem to let go of it) is not free.
//! Nothing here waits past its deadline: a device that does not stop in time (a request that
//! hangs on a device, a driver that does not answer) is logged and left to the driver, which
//! quiesces it once this process exits, for the next `serve --ublk` to recover.

use anyhow::{Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The ublk devices of a running server, one per export.
pub struct Devices {
    queues: u16,
    first_id: u32,
    /// How long a stop may take (the server's `shutdown_timeout`).
    limit: Duration,
    live: BTreeMap<String, ublk::Device>,
    /// Numbers of devices being stopped or deleted.
    retiring: Arc<Mutex<BTreeSet<u32>>>,
}

impl Devices {
    /// No device yet; [`Devices::sync`] starts them.
    pub fn new(queues: u16, first_id: u32, limit: Duration) -> Devices {
        Devices {
            queues,
            first_id,
            limit,
            live: BTreeMap::new(),
            retiring: Arc::default(),
        }
    }

    /// Stops the devices of exports that are gone (waiting until their requests in flight are
    /// done, at most the deadline; their deletes go on in the background) and starts one for
    /// every export that has none, in name order. Fails on the first device that cannot be
    /// started (those started before it stay).
    pub fn sync(&mut self, exports: &server::ExportRegistry) -> Result<()> {
        let mut names = exports.names();
        names.sort();
        let gone: Vec<String> = (self.live.keys())
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        let gone = gone
            .into_iter()
            .filter_map(|n| self.live.remove(&n).map(|d| (n, d)))
            .collect();
        retire(gone, &self.retiring, self.limit, Step::Stopped);
        for name in names {
            if self.live.contains_key(&name) {
                continue;
            }
            let Some(export) = exports.get(&name) else {
                continue;
            };
            let opts = ublk::Options {
                dev_id: self.free_id(),
                queues: self.queues,
                ..ublk::Options::default()
            };
            let d = ublk::Device::start(export, &opts)
                .with_context(|| format!("serving {name} as /dev/ublkb{}", opts.dev_id))?;
            log::info!(
                "{name} is {}{}",
                d.path().display(),
                if d.recovered() {
                    " (recovered: taken over from a server that died)"
                } else {
                    ""
                }
            );
            self.live.insert(name, d);
        }
        Ok(())
    }

    /// The lowest number from `first_id` that no device of this server has.
    fn free_id(&self) -> u32 {
        let retiring = lock(&self.retiring);
        let used = |id: &u32| retiring.contains(id) || self.live.values().any(|d| d.id() == *id);
        (self.first_id..)
            .find(|id| !used(id))
            .unwrap_or(self.first_id)
    }

    /// The shutdown: stops and deletes every device, all at once, giving up on those not
    /// deleted within the deadline (logged; see the module comment). Returns how many were
    /// given up.
    pub fn stop_all(self) -> usize {
        let all = self.live.into_iter().collect();
        retire(all, &self.retiring, self.limit, Step::Deleted).len()
    }
}

/// `prctl(PR_SET_IO_FLUSHER)`: marks the calling thread, and every thread it starts after
/// this, as serving block I/O, so the kernel does not make its memory allocations wait for
/// the writeback of dirty pages — pages that may belong to a filesystem on this server's own
/// `/dev/ublkbN`, which would wait for this server (a deadlock under memory pressure; see
/// prctl(2)). Called once, by `serve --ublk`, before it opens the cache set, so every engine,
/// worker and queue thread has it. Needs `CAP_SYS_RESOURCE` (fails with `EPERM` without it).
pub fn become_io_flusher() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only; it reads no memory of ours.
    let r = unsafe { libc::prctl(PR_SET_IO_FLUSHER, 1 as libc::c_ulong, 0, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `PR_SET_IO_FLUSHER` (linux/prctl.h, Linux 5.6).
const PR_SET_IO_FLUSHER: libc::c_int = 57;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What [`retire`] does to a device, in two steps (a fake stands in for the driver in tests).
trait Retiring: Send + 'static {
    type Stopped: Send + 'static;
    fn id(&self) -> u32;
    /// Stops the device once its requests in flight are done.
    fn stop(self) -> io::Result<Self::Stopped>;
    /// Deletes it; may wait for as long as a filesystem is mounted on it.
    fn delete(stopped: Self::Stopped) -> io::Result<()>;
}

impl Retiring for ublk::Device {
    type Stopped = ublk::Stopped;
    fn id(&self) -> u32 {
        ublk::Device::id(self)
    }
    fn stop(self) -> io::Result<ublk::Stopped> {
        ublk::Device::stop(self)
    }
    fn delete(stopped: ublk::Stopped) -> io::Result<()> {
        stopped.delete()
    }
}

/// How far [`retire`] waits for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Stopped,
    Deleted,
}

/// Stops and then deletes each device in a thread of its own (its number in `retiring` until
/// the delete returned or failed), and waits until every one of them reached `until`, for at
/// most `limit`. Returns the names of those that did not, each logged; their threads go on.
fn retire<D: Retiring>(
    devices: Vec<(String, D)>,
    retiring: &Arc<Mutex<BTreeSet<u32>>>,
    limit: Duration,
    until: Step,
) -> Vec<String> {
    let deadline = Instant::now() + limit;
    let (tx, rx) = mpsc::channel::<(String, Step)>();
    let mut waiting: BTreeMap<String, u32> = BTreeMap::new();
    for (name, d) in devices {
        let id = d.id();
        lock(retiring).insert(id);
        waiting.insert(name.clone(), id);
        let (tx, retiring) = (tx.clone(), retiring.clone());
        let work = move || {
            let path = format!("/dev/ublkb{id}");
            match d.stop() {
                Ok(stopped) => {
                    let _ = tx.send((name.clone(), Step::Stopped));
                    match D::delete(stopped) {
                        Ok(()) => log::info!("{path} ({name}) deleted"),
                        Err(e) => log::error!("deleting {path} ({name}): {e}"),
                    }
                }
                Err(e) => log::error!("stopping {path} ({name}): {e}"),
            }
            lock(&retiring).remove(&id);
            let _ = tx.send((name, Step::Deleted));
        };
        let spawned = std::thread::Builder::new()
            .name(format!("ublk{id}-stop"))
            .spawn(work);
        if let Err(e) = spawned {
            // Without a thread of its own it cannot be bounded; it cannot be served either.
            log::error!("cannot start a thread to stop /dev/ublkb{id}: {e}; left to the driver");
        }
    }
    drop(tx);
    while !waiting.is_empty() {
        let now = Instant::now();
        let Some(left) = deadline.checked_duration_since(now) else {
            break;
        };
        match rx.recv_timeout(left) {
            Ok((name, step)) if step >= until => {
                waiting.remove(&name);
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    for (name, id) in &waiting {
        log::error!(
            "/dev/ublkb{id} ({name}) was not {} within {limit:?} (a request that hangs, or a \
             filesystem still mounted on it); left to the driver: once this server exits it \
             waits, quiesced, for the next `serve --ublk` to take it over",
            match until {
                Step::Stopped => "stopped",
                Step::Deleted => "stopped and deleted",
            }
        );
    }
    waiting.into_keys().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `PR_GET_IO_FLUSHER`: whether the calling thread is marked (needs the capability too).
    fn is_io_flusher() -> io::Result<bool> {
        // SAFETY: prctl with integer arguments only.
        let r = unsafe { libc::prctl(58, 0, 0, 0, 0) };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r == 1)
        }
    }

    /// With `CAP_SYS_RESOURCE` the mark is set and the threads started after it have it;
    /// without, the call fails with EPERM (root in a container may lack it). Run on a thread
    /// of its own: the mark stays with the thread.
    #[test]
    fn the_io_flusher_mark_is_set_and_inherited_or_refused_without_the_capability() {
        const CAP_SYS_RESOURCE: u32 = 24;
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .map(|h| u64::from_str_radix(h.trim(), 16).unwrap())
            .expect("CapEff in /proc/self/status");
        let capable = eff & (1 << CAP_SYS_RESOURCE) != 0;
        std::thread::spawn(move || {
            if capable {
                assert!(!is_io_flusher().unwrap(), "marked before the call");
                become_io_flusher().unwrap();
                assert!(is_io_flusher().unwrap());
                let child = std::thread::spawn(|| is_io_flusher().unwrap());
                assert!(
                    child.join().unwrap(),
                    "a thread started after it is not marked"
                );
            } else {
                let e = become_io_flusher().expect_err("marked without CAP_SYS_RESOURCE");
                assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            }
        })
        .join()
        .unwrap();
    }

    /// A device whose stop and delete return what the test sends them, when it sends it.
    struct Fake {
        id: u32,
        stop: mpsc::Receiver<io::Result<()>>,
        delete: mpsc::Receiver<io::Result<()>>,
    }

    impl Retiring for Fake {
        type Stopped = mpsc::Receiver<io::Result<()>>;
        fn id(&self) -> u32 {
            self.id
        }
        fn stop(self) -> io::Result<Self::Stopped> {
            let r = self.stop.recv().unwrap_or(Ok(()));
            r.map(|()| self.delete)
        }
        fn delete(stopped: Self::Stopped) -> io::Result<()> {
            stopped.recv().unwrap_or(Ok(()))
        }
    }

    type Senders = (mpsc::Sender<io::Result<()>>, mpsc::Sender<io::Result<()>>);

    fn fake(id: u32) -> (Fake, Senders) {
        let (stop_tx, stop) = mpsc::channel();
        let (delete_tx, delete) = mpsc::channel();
        (Fake { id, stop, delete }, (stop_tx, delete_tx))
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Generous: these devices all answer at once, and `retire` returns as soon as they did.
    const AMPLE: Duration = Duration::from_secs(600);

    #[test]
    fn a_device_that_never_stops_is_given_up_at_the_deadline() {
        let retiring = Arc::default();
        let (hung, _held) = fake(3);
        let (ok, ok_tx) = fake(4);
        ok_tx.0.send(Ok(())).unwrap();
        ok_tx.1.send(Ok(())).unwrap();
        let late = retire(
            vec![("hung".into(), hung), ("ok".into(), ok)],
            &retiring,
            Duration::from_millis(300),
            Step::Deleted,
        );
        // "ok" may or may not have made it on a loaded machine; "hung" never can.
        assert!(late.contains(&"hung".to_string()), "{late:?}");
        assert!(
            lock(&retiring).contains(&3),
            "a hung device's number was given back"
        );
    }

    #[test]
    fn a_detach_waits_for_the_stop_and_leaves_the_delete_to_the_background() {
        let retiring = Arc::default();
        let (mounted, held) = fake(0);
        held.0.send(Ok(())).unwrap();
        let (failing, failing_tx) = fake(1);
        failing_tx
            .0
            .send(Err(io::Error::other("stop failed")))
            .unwrap();
        let late = retire(
            vec![("mounted".into(), mounted), ("failing".into(), failing)],
            &retiring,
            AMPLE,
            Step::Stopped,
        );
        assert!(late.is_empty(), "{late:?}");
        // The delete waits (a filesystem still mounted): its number is not free meanwhile.
        assert!(lock(&retiring).contains(&0));
        held.1.send(Ok(())).unwrap();
        // Hang guard only: the background delete gives the number back.
        while lock(&retiring).contains(&0) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_shutdown_waits_for_every_delete() {
        let retiring = Arc::default();
        let mut held = Vec::new();
        let mut devices = Vec::new();
        for id in 0..3 {
            let (d, tx) = fake(id);
            tx.0.send(Ok(())).unwrap();
            tx.1.send(Ok(())).unwrap();
            devices.push((format!("v{id}"), d));
            held.push(tx);
        }
        let late = retire(devices, &retiring, AMPLE, Step::Deleted);
        assert_eq!(late, names(&[]));
        assert!(lock(&retiring).is_empty());
    }

    #[test]
    fn numbers_being_retired_are_not_given_to_new_devices() {
        let d = Devices::new(2, 5, AMPLE);
        assert_eq!(d.free_id(), 5);
        lock(&d.retiring).extend([5, 6, 8]);
        assert_eq!(d.free_id(), 7);
    }
}
