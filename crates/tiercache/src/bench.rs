//! `tiercache bench`: the harness lives in the `tiercache-bench` crate; this hands it the
//! running binary and the admin client it drives servers with.
//!
//! Invariant: the harness gets no other access to tiercache than the binary and the admin
//! protocol, the same as an operator's scripts.

use anyhow::{Context, Result};
pub use tiercache_bench::BenchArgs;

pub fn run(args: &BenchArgs) -> Result<()> {
    let tc = tiercache_bench::Tiercache {
        exe: std::env::current_exe().context("finding the tiercache binary")?,
        admin_request: |admin, req| crate::admin::request(admin, req, &mut |_| {}),
        serve_args: Vec::new(),
        make_args: Vec::new(),
    };
    tiercache_bench::run(args, &tc)
}
