#!/usr/bin/env bash
# Runs every fuzz target for a few seconds: the nbd-proto targets FUZZ_SECONDS each (default
# 10), the engine's on-disk decoder targets ENGINE_FUZZ_SECONDS each (default 5). Uses
# cargo-fuzz (libFuzzer, coverage-guided) when it works on this toolchain, through
# RUSTC_BOOTSTRAP=1 on stable; otherwise, or with FUZZ_FALLBACK=1, the stable fallback runner
# that feeds random inputs to the same entry points. Exits non-zero on any crash.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${FUZZ_SECONDS:-10}"
engine_seconds="${ENGINE_FUZZ_SECONDS:-5}"
targets=(server_handshake client_handshake request_decoder reply_decoder
    engine_superblock engine_backing_header engine_checkpoint engine_journal engine_recovery)
# Seconds and max input length of a target.
budget() { if [[ $1 == engine_* ]]; then echo "$engine_seconds"; else echo "$seconds"; fi; }
max_len() { if [[ $1 == engine_* ]]; then echo 16384; else echo 4096; fi; }

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
        echo "== cargo fuzz run $t ($(budget "$t")s)"
        mkdir -p "corpus/$t"
        # New inputs go to corpus/ (not tracked); seeds/ holds the tracked starting points.
        dirs=("corpus/$t")
        [[ -d "seeds/$t" ]] && dirs+=("seeds/$t")
        RUSTC_BOOTSTRAP=1 cargo fuzz run -O "$t" "${dirs[@]}" -- \
            -max_total_time="$(budget "$t")" -max_len="$(max_len "$t")" -print_final_stats=1 2>&1 | tail -n 5
    done
else
    cargo build --locked --release --bin fallback
    for t in "${targets[@]}"; do
        echo "== fallback $t ($(budget "$t")s)"
        ./target/release/fallback "$t" "$(budget "$t")"
    done
fi
echo "fuzz smoke: all targets ran without a crash"
