#!/usr/bin/env bash
# Writes that spill for want of room (issue: space GC has not made usable is refused to
# writes): a 256 MiB cache in writeback in front of a 1 GiB file, fio randrw 4 KiB QD16 over
# a 512 MiB region for RUNTIME seconds through NBD, then the bypass counters and the cache's
# split. A figure, not a test: compare builds in the same run.
#
#   scripts/gc-randrw.sh [TIERCACHE_BINARY] [RUNTIME]
set -euo pipefail
bin="${1:-target/release/tiercache}"
runtime="${2:-30}"
bin="$(cd "$(dirname "$bin")" && pwd)/$(basename "$bin")"
dir="$(mktemp -d)"
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
cd "$dir"
truncate -s 256M cache.img
truncate -s 1G back.img
"$bin" make --backing back.img --cache cache.img --label data --writeback >/dev/null
"$bin" serve --cache cache.img --backing back.img --socket "$dir/s.sock" >serve.log 2>&1 &
pid=$!
for _ in $(seq 50); do [ -S "$dir/s.sock" ] && break; sleep 0.1; done
fio --name=rw --ioengine=nbd --uri="nbd+unix:///data?socket=$dir/s.sock" --rw=randrw \
    --bs=4k --size=512M --iodepth=16 --time_based --runtime="$runtime" --group_reporting \
    | grep -E "IOPS"
"$bin" stats --admin "$dir/s.sock.admin" | grep -E "^ *(bypassed|bypassed_full|bypassed_dirty_limit|bypassed_admission|bypassed_congested|cache_written_bytes) " \
    | awk '{print $1, $2, $3}'
"$bin" status --admin "$dir/s.sock.admin" | sed -n 2,6p
