//! Socket permissions do not follow the umask. The umask is process-wide, so this file holds a
//! single test and runs as its own process.

use server::{bind_unix, BindAddr, ExportRegistry, ServerConfig, UnixSocketPerms};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

fn mode_of(path: &Path) -> u32 {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(meta.file_type().is_socket());
    meta.mode() & 0o7777
}

#[test]
fn socket_modes_ignore_a_permissive_umask() {
    // SAFETY: umask only changes this process's file creation mask; it cannot fail.
    unsafe { libc::umask(0) };
    let dir = tempfile::tempdir().unwrap();

    // The server's default: 0660, not the 0777 a plain bind gives under umask 000.
    let path = dir.path().join("nbd.sock");
    let handle = server::start(
        &BindAddr::Unix(path.clone()),
        ExportRegistry::new(),
        ServerConfig::default(),
    )
    .unwrap();
    assert_eq!(mode_of(&path), 0o660);
    // Whatever is in the directory next to it is only the socket (no private directory left).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    handle.shutdown();

    // A configured mode, through the server.
    let config = ServerConfig {
        socket_perms: UnixSocketPerms {
            mode: 0o600,
            ..UnixSocketPerms::default()
        },
        ..ServerConfig::default()
    };
    let handle =
        server::start(&BindAddr::Unix(path.clone()), ExportRegistry::new(), config).unwrap();
    assert_eq!(mode_of(&path), 0o600);
    handle.shutdown();

    // Directly, with an owner and group (our own: allowed without privilege).
    // SAFETY: getuid and getgid cannot fail and touch no memory.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let admin = dir.path().join("admin.sock");
    let perms = UnixSocketPerms {
        mode: 0o640,
        uid: Some(uid),
        gid: Some(gid),
    };
    let (listener, file) = bind_unix(&admin, &perms).unwrap();
    assert_eq!(mode_of(&admin), 0o640);
    let meta = std::fs::metadata(&admin).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (uid, gid));
    assert!(file.remove_if_ours().unwrap());
    assert!(!admin.exists());
    drop(listener);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
