//! `tiercache generate`: shell completions and man pages, generated from the command-line
//! definition itself (clap_complete, clap_mangen), so they always match the binary that
//! prints them.
//!
//! Why a subcommand and not build.rs: the pages and scripts then come from the
//! installed binary, whoever built it (`cargo install` installs no build outputs but the
//! binary), a packager needs no second build step, and the CLI definition stays in one place
//! instead of being shared with a build script.
//!
//! Invariant: output goes only where asked (stdout, or the named directory, which must
//! exist); nothing else is touched.

use anyhow::{Context, Result};
use std::path::Path;

/// Writes the completion script for `shell` to stdout.
pub fn completions(mut cmd: clap::Command, shell: clap_complete::Shell) {
    let name = cmd.get_name().to_string();
    clap_complete::generate(shell, &mut cmd, name, &mut std::io::stdout());
}

/// Writes `tiercache.1` and one `tiercache-SUBCOMMAND.1` per visible subcommand to `dir`.
pub fn man(cmd: clap::Command, dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        anyhow::bail!("{} is not a directory", dir.display());
    }
    clap_mangen::generate_to(cmd, dir).with_context(|| format!("writing to {}", dir.display()))
}
