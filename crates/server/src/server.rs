//! The listener, the accept loop, and graceful shutdown.
//!
//! Owns: the set of live connections and their threads.
//!
//! Invariants: after [`ServerHandle::shutdown`] returns, no connection thread is running, every
//! request that was read has been answered (or its client had gone), and a unix socket file we
//! bound has been removed. At most `connections_max` connections are served at once; further
//! ones are closed immediately.
//!
//! Fault model: accept errors (e.g. out of file descriptors) are logged and the loop goes on
//! after a short pause; a connection's failure is confined to that connection.

use crate::connection;
use crate::export::ExportRegistry;
use crate::net::{self, BindAddr, Listener, LocalAddr, Stream};
use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Limits and timeouts of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Most threads serving one connection (each reads, executes and answers one request at a
    /// time; started as needed, the connection's own thread being the first), so also the most
    /// requests one connection has in flight.
    pub workers_per_connection: usize,
    /// Requests read but not yet answered, per connection.
    pub requests_in_flight_max: usize,
    /// Request and reply buffers held at once, per connection.
    pub bytes_in_flight_max: usize,
    /// Connections served at once.
    pub connections_max: usize,
    /// Longest silence from a client during the handshake.
    pub handshake_timeout: Duration,
    /// Longest a reply may take to be written (a client that stops reading is dropped).
    pub reply_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers_per_connection: 16,
            requests_in_flight_max: 64,
            bytes_in_flight_max: 128 * 1024 * 1024,
            connections_max: 256,
            handshake_timeout: Duration::from_secs(30),
            reply_timeout: Duration::from_secs(60),
        }
    }
}

struct Shared {
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Connection id → (socket clone to kick it, its thread).
    connections: Mutex<HashMap<u64, (Stream, JoinHandle<()>)>>,
}

impl Shared {
    fn connections(&self) -> MutexGuard<'_, HashMap<u64, (Stream, JoinHandle<()>)>> {
        self.connections.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running server.
pub struct ServerHandle {
    local: LocalAddr,
    registry: ExportRegistry,
    shared: Arc<Shared>,
    accept_thread: JoinHandle<()>,
}

/// Binds `bind` and serves the exports of `registry` (which may change at any time).
pub fn start(
    bind: &BindAddr,
    registry: ExportRegistry,
    config: ServerConfig,
) -> io::Result<ServerHandle> {
    assert!(
        config.workers_per_connection > 0 && config.connections_max > 0,
        "server limits must be positive"
    );
    let (listener, local) = Listener::bind(bind)?;
    let shared = Arc::new(Shared {
        stopping: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
        connections: Mutex::new(HashMap::new()),
    });
    let accept_thread = {
        let shared = Arc::clone(&shared);
        let registry = registry.clone();
        thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&listener, &shared, &registry, &config))?
    };
    Ok(ServerHandle {
        local,
        registry,
        shared,
        accept_thread,
    })
}

fn accept_loop(
    listener: &Listener,
    shared: &Arc<Shared>,
    registry: &ExportRegistry,
    config: &ServerConfig,
) {
    loop {
        let stream = match listener.accept() {
            Ok(stream) => stream,
            Err(err) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                log::warn!("accept failed: {err}");
                thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        if let Err(err) = spawn_connection(stream, shared, registry, config) {
            log::warn!("could not start a connection: {err}");
        }
    }
}

fn spawn_connection(
    stream: Stream,
    shared: &Arc<Shared>,
    registry: &ExportRegistry,
    config: &ServerConfig,
) -> io::Result<()> {
    let mut connections = shared.connections();
    if connections.len() >= config.connections_max {
        log::warn!("connection limit {} reached", config.connections_max);
        return Ok(());
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let kicker = stream.try_clone()?;
    let thread = {
        let shared = Arc::clone(shared);
        let registry = registry.clone();
        let config = config.clone();
        thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                connection::serve(stream, id, &registry, &config);
                // Reap ourselves; at shutdown the entry was already taken and joined.
                shared.connections().remove(&id);
            })?
    };
    connections.insert(id, (kicker, thread));
    Ok(())
}

impl ServerHandle {
    /// Where the server listens.
    pub fn local_addr(&self) -> &LocalAddr {
        &self.local
    }

    /// The live export catalog; add or remove exports through it at any time.
    pub fn registry(&self) -> &ExportRegistry {
        &self.registry
    }

    /// Connections currently open.
    pub fn connection_count(&self) -> usize {
        self.shared.connections().len()
    }

    /// Stops accepting, stops reading new requests, answers every request already read, closes
    /// all connections and returns. Clients that stop reading their replies are cut off by the
    /// reply timeout.
    pub fn shutdown(self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept; failure means the listener is already unusable.
        drop(net::connect(&self.local));
        if self.accept_thread.join().is_err() {
            log::error!("accept thread panicked");
        }
        let connections: Vec<_> = self.shared.connections().drain().collect();
        for (_, (stream, _)) in &connections {
            stream.shutdown(Shutdown::Read);
        }
        for (id, (_, thread)) in connections {
            if thread.join().is_err() {
                log::error!("connection {id} thread panicked");
            }
        }
        if let LocalAddr::Unix(path) = &self.local {
            if let Err(err) = std::fs::remove_file(path) {
                log::warn!("could not remove {}: {err}", path.display());
            }
        }
    }
}
