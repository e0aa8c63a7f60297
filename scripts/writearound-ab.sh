#!/usr/bin/env bash
# Requests around the cache against the device alone: QD1 4 KiB random writes in
# `writearound` (or, with READS=1, random reads in `none`) through fio's nbd engine, for each
# tiercache binary given (interleave builds to compare them in one run), each after fio on the
# same backing device alone. A figure, not a test.
# - CACHED=1: the region is first read once through the cache (64 KiB random reads), so the
#   writes land on blocks the cache holds clean copies of;
# - REMOTE=1: the backing device is the file served by `nbdkit file cache=none` on a Unix
#   socket (a remote NBD backing device); the device alone is fio's nbd engine on that
#   export, else fio psync O_DIRECT on the file.
#
#   [CACHED=1] [REMOTE=1] [READS=1] scripts/writearound-ab.sh BINARY [BINARY ...]
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,12p' "$0"; exit 2; }
d="$(mktemp -d)"
pid=""
kit=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; [ -n "$kit" ] && kill "$kit" 2>/dev/null; rm -rf "$d"' EXIT
truncate -s 256M "$d/cache.img"
truncate -s 1G "$d/back.img"
backing="$d/back.img"
if [ "${REMOTE:-}" = 1 ]; then
    nbdkit -f -U "$d/kit.sock" -P "$d/kit.pid" file "$d/back.img" cache=none fadvise=random &
    kit=$!
    for _ in $(seq 50); do [ -s "$d/kit.pid" ] && break; sleep 0.1; done
    backing="nbd+unix:///?socket=$d/kit.sock"
fi
"$1" make --backing "$backing" --cache "$d/cache.img" --label data >/dev/null
if [ "${READS:-}" = 1 ]; then rw=randread mode=none side=read; else rw=randwrite mode=writearound side=write; fi
lat() {
    python3 -c "
import json,sys;j=json.load(sys.stdin)['jobs'][0]['$side']
print('iops %.0f mean %.1f us p50 %.1f us'%(j['iops'],j['lat_ns']['mean']/1000,j['clat_ns']['percentile']['50.000000']/1000), end='')"
}
fio_json() { fio "$@" --output-format=json 2>/dev/null | sed -n '/^{/,$p'; }
# The device alone, past the region tiercache uses (and its header).
if [ "${REMOTE:-}" = 1 ]; then
    alone=(--ioengine=nbd --uri="$backing" --offset=512M)
else
    alone=(--filename="$d/back.img" --offset=512M --direct=1 --ioengine=psync)
fi
for bin in "$@"; do
    echo "device alone (load $(cut -d' ' -f1 /proc/loadavg)): $(fio_json --name=a "${alone[@]}" \
        --rw=$rw --bs=4k --size=256M --runtime=4 --time_based | lat)"
    "$bin" serve --cache "$d/cache.img" --backing "$backing" --socket "$d/s.sock" --admin "$d/s.admin" \
        --congested-read-threshold-us 0 --congested-write-threshold-us 0 >"$d/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do [ -S "$d/s.admin" ] && break; sleep 0.1; done
    "$bin" set --admin "$d/s.admin" data cache_mode $mode >/dev/null
    "$bin" set --admin "$d/s.admin" data sequential_cutoff 0 >/dev/null
    if [ "${CACHED:-}" = 1 ]; then
        fio --name=warm --ioengine=nbd --uri="nbd+unix:///data?socket=$d/s.sock" --rw=randread \
            --bs=64k --size=200M --iodepth=8 >/dev/null 2>&1
    fi
    t0=$(awk '{print $14+$15}' "/proc/$pid/stat")
    r=$(fio_json --name=w --ioengine=nbd --uri="nbd+unix:///data?socket=$d/s.sock" --rw=$rw \
        --bs=4k --size="$( [ "${CACHED:-}" = 1 ] && echo 200M || echo 256M)" --runtime=4 --time_based)
    t1=$(awk '{print $14+$15}' "/proc/$pid/stat")
    n=$(echo "$r" | python3 -c "import json,sys;print(json.load(sys.stdin)['jobs'][0]['$side']['total_ios'])")
    cpu=$(python3 -c "print('%.1f' % (($t1 - $t0) * 1e6 / $(getconf CLK_TCK) / $n))")
    echo "$bin (load $(cut -d' ' -f1 /proc/loadavg)): $(echo "$r" | lat), server CPU $cpu us per $side"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=""
done
