#!/usr/bin/env bash
# The kill -9 durability test (crates/tiercache/tests/kill9.rs) for many rounds, on demand:
# each round a libnbd writer writes with FUA, flushes and several requests in flight, the
# server gets SIGKILL at a random moment and is restarted on the same devices, and every block
# must read back its last durable write or a later one. CI runs the default 20 rounds.
#
#   bash scripts/kill9-loop.sh [ROUNDS]          # default 100
#   TIERCACHE_KILL9_SEED=N bash scripts/kill9-loop.sh 100   # replay a printed seed
#
# Needs python3 with the libnbd bindings (python3-libnbd). On failure the round, seed, block,
# expected and found data are printed and the devices and logs are kept in the printed dir.
set -euo pipefail
cd "$(dirname "$0")/.."
TIERCACHE_KILL9_ROUNDS=${1:-100} cargo test --release -p tiercache --test kill9 -- --nocapture
