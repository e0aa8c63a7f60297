//! What the workspace's tests share. The one rule: a test that needs something the machine
//! lacks (an external tool, root) fails under `CI=true` — CI installs everything, so a missing
//! tool there is a broken CI script, not a reason to pass — and is a printed `SKIP` otherwise,
//! so a developer without the tool can still run the rest.
//!
//! Invariant: every function here that answers "no" has already printed why, or panicked
//! under CI.

use std::process::Command;

/// Whether this is a CI run (`CI=true`).
pub fn ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Says that `what` is unavailable: panics under CI, else prints a skip. Returns false, for
/// `if !x { return unavailable(..) }`-style guards.
pub fn unavailable(what: &str) -> bool {
    if ci() {
        panic!("{what} is required in CI but is not available");
    }
    eprintln!("SKIP: {what} is not available");
    false
}

/// Whether `tool` is on the PATH (see [`unavailable`] when it is not).
pub fn have(tool: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success());
    found || unavailable(tool)
}

/// Whether `program` runs and succeeds with `probe_args` (an installed tool that also has the
/// feature the test needs, say a plugin); see [`unavailable`] when it does not.
pub fn runs(program: &str, probe_args: &[&str]) -> bool {
    let ok = Command::new(program)
        .args(probe_args)
        .output()
        .is_ok_and(|o| o.status.success());
    ok || unavailable(&format!("{program} {}", probe_args.join(" ")))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether this process runs as root (see [`unavailable`] when it does not: loop devices and
/// mounts need it, and CI runs as root).
pub fn have_root(why: &str) -> bool {
    is_root() || unavailable(&format!("root ({why})"))
}
