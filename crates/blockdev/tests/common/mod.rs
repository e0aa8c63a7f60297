//! Helpers shared by the blockdev tests that run real NBD servers. Invariant: a missing
//! external tool fails the test under `CI=true` and is a printed skip otherwise.

use std::process::Command;

/// Whether nbdkit is installed (panics under `CI=true` when it is not).
pub fn have_nbdkit() -> bool {
    let found = Command::new("sh")
        .args(["-c", "command -v nbdkit"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "nbdkit is required in CI but is not installed"
        );
        eprintln!("SKIP: nbdkit is not installed");
    }
    found
}
