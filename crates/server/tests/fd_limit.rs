//! The connection limit fits under the descriptor limit. Descriptor limits are process-wide,
//! so this file holds a single test and runs as its own process.

use server::{BindAddr, ExportRegistry, ServerConfig};

fn nofile() -> (u64, u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    (limit.rlim_cur, limit.rlim_max)
}

#[test]
fn start_raises_the_soft_limit_and_clamps_connections_under_it() {
    // Lower both limits (for this process only): soft 100, hard 200.
    let lowered = libc::rlimit {
        rlim_cur: 100,
        rlim_max: 200,
    };
    // SAFETY: `lowered` is a valid rlimit for the duration of the call.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
    let dir = tempfile::tempdir().unwrap();
    let handle = server::start(
        &BindAddr::Unix(dir.path().join("nbd.sock")),
        ExportRegistry::new(),
        ServerConfig::default(),
    )
    .unwrap();
    assert_eq!(nofile(), (200, 200), "soft limit raised to the hard one");
    // 200 - 64 reserved - 1, one descriptor per connection.
    assert_eq!(handle.stats().connections_max, 135);
    handle.shutdown();

    // A configured limit below what fits is kept.
    let config = ServerConfig {
        connections_max: 10,
        ..ServerConfig::default()
    };
    let handle = server::start(
        &BindAddr::Unix(dir.path().join("nbd.sock")),
        ExportRegistry::new(),
        config,
    )
    .unwrap();
    assert_eq!(handle.stats().connections_max, 10);
    handle.shutdown();
}
