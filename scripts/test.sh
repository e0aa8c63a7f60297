#!/usr/bin/env bash
# The test command from the README: every unit, property, crash-simulation and interop test.
# TIERCACHE_CRASH_POINTS (default 10000) sets how many crash points the crash test checks.
set -euo pipefail
cd "$(dirname "$0")/.."
export TIERCACHE_CRASH_POINTS="${TIERCACHE_CRASH_POINTS:-10000}"
cargo test --workspace --locked -- --test-threads=2
