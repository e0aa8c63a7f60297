#!/usr/bin/env bash
# Writes around the cache against the device alone: QD1 4 KiB random writes in
# `writearound` through fio's nbd engine, for each tiercache binary given (interleave builds
# to compare them in one run), after fio psync O_DIRECT on the same backing file. A figure,
# not a test. With CACHED=1 the written region is first read once through the cache (64 KiB
# random reads), so the writes land on blocks the cache holds clean copies of.
#
#   [CACHED=1] scripts/writearound-ab.sh BINARY [BINARY ...]
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,9p' "$0"; exit 2; }
d="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$d"' EXIT
truncate -s 256M "$d/cache.img"
truncate -s 1G "$d/back.img"
"$1" make --backing "$d/back.img" --cache "$d/cache.img" --label data >/dev/null
lat() {
    python3 -c "
import json,sys;j=json.load(sys.stdin)['jobs'][0]['write']
print('iops %.0f mean %.1f us p50 %.1f us'%(j['iops'],j['lat_ns']['mean']/1000,j['clat_ns']['percentile']['50.000000']/1000), end='')"
}
fio_json() { fio "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$p'; }
echo "device alone (load $(cut -d' ' -f1 /proc/loadavg)): $(fio_json --name=w --filename="$d/back.img" --offset=1M \
    --direct=1 --ioengine=psync --rw=randwrite --bs=4k --size=256M --runtime=4 --time_based | lat)"
for bin in "$@"; do
    "$bin" serve --cache "$d/cache.img" --backing "$d/back.img" --socket "$d/s.sock" --admin "$d/s.admin" \
        --congested-read-threshold-us 0 --congested-write-threshold-us 0 >"$d/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do [ -S "$d/s.admin" ] && break; sleep 0.1; done
    "$bin" set --admin "$d/s.admin" data cache_mode writearound >/dev/null
    if [ "${CACHED:-}" = 1 ]; then
        fio --name=warm --ioengine=nbd --uri="nbd+unix:///data?socket=$d/s.sock" --rw=randread \
            --bs=64k --size=200M --iodepth=8 >/dev/null 2>&1
    fi
    t0=$(awk '{print $14+$15}' "/proc/$pid/stat")
    r=$(fio_json --name=w --ioengine=nbd --uri="nbd+unix:///data?socket=$d/s.sock" --rw=randwrite \
        --bs=4k --size="$( [ "${CACHED:-}" = 1 ] && echo 200M || echo 256M)" --runtime=4 --time_based)
    t1=$(awk '{print $14+$15}' "/proc/$pid/stat")
    n=$(echo "$r" | python3 -c "import json,sys;print(json.load(sys.stdin)['jobs'][0]['write']['total_ios'])")
    cpu=$(python3 -c "print('%.1f' % (($t1 - $t0) * 1e6 / $(getconf CLK_TCK) / $n))")
    echo "$bin (load $(cut -d' ' -f1 /proc/loadavg)): $(echo "$r" | lat), server CPU $cpu us per write"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
done
