#!/usr/bin/env bash
# The test command from the README: every unit, property, crash-simulation and interop test.
# TIERCACHE_CRASH_POINTS (default 10000) sets how many crash points the crash test checks.
# Under CI=true (or TIERCACHE_VM=1) it also boots Linux in qemu for the block-device scenarios
# of scripts/vm/ (the 15 scenarios take about 230 s on 2 cores with the host lightly loaded
# (2026-11-27), and up to about three times that per scenario under load; plus installing qemu
# and fetching the kernel package once).
set -euo pipefail
cd "$(dirname "$0")/.."
export TIERCACHE_CRASH_POINTS="${TIERCACHE_CRASH_POINTS:-10000}"
cargo test --workspace --locked -- --test-threads=2

# The NBD interop suites once more on the thread model: the run above served plain
# connections through io_uring (`--data-path auto`, the default where the kernel allows it;
# tests that need io_uring ask for `uring` and fail under CI=true without it).
TIERCACHE_DATA_PATH=threads cargo test --locked -p server -p tiercache \
    --test interop --test concurrency --test limits --test robustness --test nbdsh \
    --test memory --test admission --test ring \
    --test filesystems --test hostile --test faults --test kill9 --test operating \
    -- --test-threads=2

# The Linux guest (scripts/vm/run.sh): /dev/nbd0 with ext4 and XFS under a real kernel, in
# qemu. Under CI=true always (a missing tool fails); elsewhere with TIERCACHE_VM=1.
if [ "${CI:-}" = true ] || [ "${TIERCACHE_VM:-}" = 1 ]; then
    cargo build --profile test --locked -q -p tiercache --bin tiercache
    bash scripts/vm/run.sh --bin "${CARGO_TARGET_DIR:-target}/debug/tiercache"
fi
