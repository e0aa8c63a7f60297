//! Build script: the version `tiercache --version` prints, with the git commit it was built
//! from: "0.2.0 (commit 3c1bd33abcde)".
//!
//! The commit comes from `$TIERCACHE_COMMIT` if set (for packagers building from a tarball),
//! else from `git rev-parse` in the source tree. Outside a git checkout, or without git, the
//! version is printed alone: the build never fails for want of git. Cargo re-runs this script
//! when HEAD or the branch it points to moves, so the commit is never stale.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Hex digits of the commit shown (fixed, so tests and bug reports can compare it).
const COMMIT_DIGITS: usize = 12;

/// Runs git in the crate's directory; `None` if git is missing or fails.
fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let s = String::from_utf8(o.stdout).ok()?.trim().to_string();
    (o.status.success() && !s.is_empty()).then_some(s)
}

/// A path git names (relative to the crate's directory), made absolute.
fn git_path(name: &str) -> Option<PathBuf> {
    let p = PathBuf::from(git(&["rev-parse", "--git-path", name])?);
    Some(Path::new(env!("CARGO_MANIFEST_DIR")).join(p))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=TIERCACHE_COMMIT");
    let version = std::env::var("CARGO_PKG_VERSION").expect("cargo sets CARGO_PKG_VERSION");
    let commit = match std::env::var("TIERCACHE_COMMIT") {
        Ok(c) if !c.trim().is_empty() => Some(c.trim().to_string()),
        _ => git(&[
            "rev-parse",
            &format!("--short={COMMIT_DIGITS}"),
            "--verify",
            "HEAD",
        ]),
    };
    // Re-run when HEAD moves: HEAD itself (a checkout), the branch it names (a commit) and
    // packed-refs (a branch packed by gc). Only paths that exist: a missing one would make
    // cargo re-run the script on every build.
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for name in watched {
        if let Some(p) = git_path(&name).filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    let full = match commit {
        Some(c) => format!("{version} (commit {c})"),
        None => version,
    };
    println!("cargo:rustc-env=TIERCACHE_VERSION={full}");
}
