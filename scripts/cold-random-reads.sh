#!/bin/bash
# Issue 12's miss-fill target, measured in one run: cold 4 KiB QD1 random reads over a 100 MB
# region for RT seconds (default 30, the field's job) on a seek-bound emulated disk that does
# NOT report itself rotational, for the disk alone (hdd), tiercache writethrough (tc) and
# nbdkit's cache filter (kit), each from fresh devices. Prints IOPS per configuration and the
# ratios; tiercache's miss/hit counters and cost model go to stderr.
# MEMLIMIT=MiB runs the tc and kit servers each in a memory cgroup of that size, page cache
# included (needs root and a cgroup memory controller), as the bench's `+memlimit` does:
# nbdkit's cache is a file, so without a limit it is served from RAM.
# Usage: [MEMLIMIT=64] scripts/cold-random-reads.sh [RT]   (needs a release build, fio, nbdkit)
set -euo pipefail
RT=${1:-30}
TC=$(realpath "${TC:-$(dirname "$0")/../target/release/tiercache}")
D=$(mktemp -d)
CGROUPS=()
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$D"; for c in "${CGROUPS[@]}"; do rmdir "$c" 2>/dev/null || true; done' EXIT
iops() {
    fio --name=j --ioengine=nbd --uri="$1" --rw=randread --bs=4k --iodepth=1 --size=100M \
        --time_based --runtime="$RT" --output-format=json 2>/dev/null |
        python3 -c 'import json,sys; s=sys.stdin.read(); print(round(json.loads(s[s.index("{"):])["jobs"][0]["read"]["iops"], 1))'
}
wait_sock() { for _ in $(seq 100); do [ -S "$1" ] && return; sleep 0.1; done; echo "no $1" >&2; exit 1; }
declare -A R
# newcg: makes a memory cgroup of MEMLIMIT MiB, page cache included (v2 or v1); prints its path.
newcg() {
    local cg
    if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        cg=/sys/fs/cgroup/cold-reads-$$-$RANDOM
        mkdir "$cg" && echo $((MEMLIMIT << 20)) >"$cg/memory.max"
    else
        cg=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)/cold-reads-$$-$RANDOM
        mkdir "$cg" && echo $((MEMLIMIT << 20)) >"$cg/memory.limit_in_bytes"
    fi
    echo "$cg"
}
# incg CGROUP CMD... &: runs CMD in CGROUP (as is when CGROUP is empty); only in background.
incg() {
    local cg=$1
    shift
    # exec: the background job is the server itself, so the EXIT trap's kill reaches it.
    if [ -z "$cg" ]; then exec "$@"; else exec sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg" "$@"; fi
}
for cfg in hdd tc kit; do
    mkdir "$D/$cfg"; cd "$D/$cfg"
    "$TC" emulate hdd --rotational false --size 1G --file disk.img --socket hdd.sock >emu.log 2>&1 &
    wait_sock hdd.sock
    HURI="nbd+unix:///disk?socket=$PWD/hdd.sock"
    CG=
    if [ -n "${MEMLIMIT:-}" ] && [ "$cfg" != hdd ]; then
        CG=$(newcg)
        CGROUPS+=("$CG")
    fi
    case $cfg in
    hdd) URI=$HURI ;;
    tc)
        head -c 128M /dev/zero >cache.img
        "$TC" make --force --label data --backing "$HURI" --cache cache.img >/dev/null
        incg "$CG" "$TC" serve --cache cache.img --backing "$HURI" --socket tc.sock --admin adm.sock >serve.log 2>&1 &
        wait_sock adm.sock
        URI="nbd+unix:///data?socket=$PWD/tc.sock" ;;
    kit)
        incg "$CG" nbdkit --foreground -U kit.sock --filter=cache nbd socket="$PWD/hdd.sock" export=disk \
            cache=writeback cache-on-read=true cache-max-size=128M &
        wait_sock kit.sock
        URI="nbd+unix:///?socket=$PWD/kit.sock" ;;
    esac
    R[$cfg]=$(iops "$URI")
    echo "$cfg ${R[$cfg]} IOPS"
    if [ "$cfg" = tc ]; then
        "$TC" stats --admin adm.sock --json >&2
        "$TC" status --admin adm.sock --json | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["devices"][0]["cost"]["read"]))' >&2
    fi
    kill $(jobs -p); wait 2>/dev/null || true
done
python3 -c "print('tiercache %.1fx the disk, %.2fx nbdkit-cache; nbdkit-cache %.1fx the disk' % (${R[tc]}/${R[hdd]}, ${R[tc]}/${R[kit]}, ${R[kit]}/${R[hdd]}))"
