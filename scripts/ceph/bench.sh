#!/usr/bin/env bash
# The field's job (workload W1 of `tiercache bench`: 4 KiB, QD1 sequential and random reads
# and writes, a cold pass then a warm one) and cached random reads at QD8, on an RBD image of
# the single-node cluster of fixture.sh, through three stacks:
#   tiercache    tiercache serve (writethrough, cache file on local disk) -> qemu-nbd (cache=none) -> librbd
#   qemu-nbd     qemu-nbd (cache=none: librbd's cache off) -> librbd
#   rbd_cache    qemu-nbd (cache=writeback: librbd's cache on, rbd_cache=true) -> librbd
# and, in the same run, three ceilings:
#   librbd       fio's rbd engine on the image: the store alone, no NBD (the least a miss or
#                a write-through write can cost)
#   memory       nbdkit memory: RAM behind the same NBD transport, no device (what NBD and
#                fio's nbd client carry)
#   raw          fio libaio O_DIRECT on a file beside the cache file, written in full first:
#                the cache's own disk (the least a hit can cost)
# Prints a Markdown table of IOPS per step and stack with the ratios (what docs/benchmarks.md
# shows). One run; fio's nbd engine for the NBD stacks; every stack reads data written first
# (an RBD object never written reads as zeroes without touching the OSD's disk).
#
#   bash scripts/ceph/bench.sh [TIERCACHE_BINARY] [SECONDS_PER_STEP] [SPAN_MIB]
#   (defaults: target/release/tiercache, 10 s, 256 MiB: more than the OSD's BlueStore cache of
#   64 MiB and librbd's of 32 MiB, less than tiercache's cache of 512 MiB)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="$(realpath "${1:-target/release/tiercache}")"
secs="${2:-10}"
fixture="$PWD/scripts/ceph/fixture.sh"
work="$(mktemp -d /tmp/tiercache-ceph-bench.XXXXXX)"
span=$((${3:-256} << 20))
size=$((span + (8 << 20)))
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    bash "$fixture" stop "$work/ceph" || true
    rm -rf "$work"
}
trap cleanup EXIT

bash "$fixture" start "$work/ceph" 1G >"$work/env"
conf="$work/ceph/ceph.conf"
export CEPH_CONF="$conf"
plain="nbd+unix:///?socket=$work/ceph/nbd.sock"

# Data everywhere the jobs read (the span and the header area before it).
fio --name=fill --ioengine=nbd --uri="$plain" --rw=write --bs=1M --size=$size \
    --iodepth=4 --refill_buffers --output=/dev/null

# librbd's cache on: a second qemu-nbd on the same image.
qemu-nbd -t -e 16 -f raw --cache=writeback -k "$work/rbdcache.sock" "rbd:rbd/img:conf=$conf" \
    >"$work/rbdcache.log" 2>&1 &
pids+=($!)

# tiercache: a 512 MiB cache file, in writethrough (the default).
truncate -s 512M "$work/fast.img"
"$bin" make --cache "$work/fast.img" --backing "$plain" --label vol >/dev/null
RUST_LOG=warn "$bin" serve --cache "$work/fast.img" --backing "$plain" \
    --socket "$work/tc.sock" >"$work/tc.log" 2>&1 &
pids+=($!)

# The ceilings: RAM behind NBD, and a file on the cache's disk written in full.
nbdkit -f -U "$work/mem.sock" memory "$size" >"$work/memory.log" 2>&1 &
pids+=($!)
fio --name=rawfill --ioengine=libaio --direct=1 --filename="$work/raw.img" --rw=write --bs=1M \
    --size=$size --iodepth=4 --refill_buffers --output=/dev/null

for s in "$work/rbdcache.sock" "$work/tc.sock" "$work/mem.sock"; do
    for _ in $(seq 300); do [ -S "$s" ] && break; sleep 0.1; done
done

# step name, fio options (W1's, with the bench's size and time)
steps=(
    "read-seq|--rw=read --iodepth=1"
    "read-random|--rw=randread --iodepth=1"
    "write-seq|--rw=write --iodepth=1"
    "write-random|--rw=randwrite --iodepth=1"
)
run_step() { # engine options, name, options -> IOPS
    local engine="$1" name="$2" opts="$3"
    # shellcheck disable=SC2086
    fio --name="$name" $engine --bs=4k --size=$span $opts \
        --time_based --runtime="$secs" --output-format=json --output="$work/fio.json" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))' "$work/fio.json"
}

declare -A iops
stacks=(tiercache qemu-nbd rbd_cache librbd memory raw)
declare -A engines=(
    [tiercache]="--ioengine=nbd --uri=nbd+unix:///vol?socket=$work/tc.sock"
    [qemu-nbd]="--ioengine=nbd --uri=$plain"
    [rbd_cache]="--ioengine=nbd --uri=nbd+unix:///?socket=$work/rbdcache.sock"
    [librbd]="--ioengine=rbd --clientname=admin --pool=rbd --rbdname=img"
    [memory]="--ioengine=nbd --uri=nbd+unix:///?socket=$work/mem.sock"
    [raw]="--ioengine=libaio --direct=1 --filename=$work/raw.img"
)
rows=()
for stack in "${stacks[@]}"; do
    for pass in cold warm; do
        for s in "${steps[@]}"; do
            name="${s%%|*} ($pass)"
            iops["$stack/$name"]="$(run_step "${engines[$stack]}" "$name" "${s#*|}")"
            echo "bench: $stack $name: ${iops[$stack/$name]} IOPS" >&2
        done
    done
    name="cached read-random QD8"
    iops["$stack/$name"]="$(run_step "${engines[$stack]}" "$name" "--rw=randread --iodepth=8")"
    echo "bench: $stack $name: ${iops[$stack/$name]} IOPS" >&2
done
rss="$(bash "$fixture" rss "$work/ceph" | awk '/^total/ {print $2}')"

for pass in cold warm; do
    for s in "${steps[@]}"; do rows+=("${s%%|*} ($pass)"); done
done
rows+=("cached read-random QD8")
echo "| step (4 KiB over $((span >> 20)) MiB, ${secs} s each) | tiercache | qemu-nbd | rbd_cache | librbd, no NBD | nbdkit memory | raw cache disk | tiercache / qemu-nbd | tiercache / rbd_cache | tiercache / librbd | tiercache / raw |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for r in "${rows[@]}"; do
    python3 -c 'import sys; t,q,c,l,m,w=map(int,sys.argv[2:]); f=lambda a,b: f"{a/b:.2f}x" if b else "-"; print(f"| {sys.argv[1]} | {t} | {q} | {c} | {l} | {m} | {w} | {f(t,q)} | {f(t,c)} | {f(t,l)} | {f(t,w)} |")' \
        "$r" "${iops[tiercache/$r]}" "${iops[qemu-nbd/$r]}" "${iops[rbd_cache/$r]}" \
        "${iops[librbd/$r]}" "${iops[memory/$r]}" "${iops[raw/$r]}"
done
echo
echo "Cluster (mon + osd + the fixture's qemu-nbd) RSS at the end: $((rss / 1024)) MiB."
