#!/usr/bin/env bash
# Runs every nbd-proto fuzz target for a few seconds (default 10; FUZZ_SECONDS overrides).
# Uses cargo-fuzz (libFuzzer, coverage-guided) when it works on this toolchain, through
# RUSTC_BOOTSTRAP=1 on stable; otherwise, or with FUZZ_FALLBACK=1, the stable fallback runner
# that feeds random inputs to the same entry points. Exits non-zero on any crash.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${FUZZ_SECONDS:-10}"
targets=(server_handshake client_handshake request_decoder reply_decoder)

# The tracked Cargo.lock is used as it is, never rewritten: a stale one fails here, by name.
cargo metadata --locked --format-version 1 >/dev/null

use_cargo_fuzz=0
if [[ "${FUZZ_FALLBACK:-0}" != 1 ]] && cargo fuzz --version >/dev/null 2>&1; then
    if RUSTC_BOOTSTRAP=1 cargo fuzz build -O "${targets[0]}" >/tmp/nbd-fuzz-build.log 2>&1; then
        use_cargo_fuzz=1
    else
        echo "cargo fuzz build failed (see /tmp/nbd-fuzz-build.log); using the fallback runner"
    fi
else
    echo "cargo-fuzz not used; using the fallback runner"
fi

if [[ $use_cargo_fuzz == 1 ]]; then
    for t in "${targets[@]}"; do
        echo "== cargo fuzz run $t (${seconds}s)"
        mkdir -p "corpus/$t"
        RUSTC_BOOTSTRAP=1 cargo fuzz run -O "$t" "corpus/$t" -- \
            -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 2>&1 | tail -n 5
    done
else
    cargo build --locked --release --bin fallback
    for t in "${targets[@]}"; do
        echo "== fallback $t (${seconds}s)"
        ./target/release/fallback "$t" "$seconds"
    done
fi
echo "fuzz smoke: all targets ran without a crash"
