#!/usr/bin/env bash
# A single-node Ceph cluster on loopback, for tests and for trying tiercache in front of RBD:
# one monitor, one OSD (BlueStore on a file, pool size 1, no cephx), a pool and an RBD image,
# exported over NBD on a unix socket by qemu-nbd (Debian's qemu-block-extra has its rbd
# driver). Everything lives in one scratch directory; nothing is installed or left running
# outside it. Needs ceph-mon, ceph-osd, ceph-common, qemu-utils and qemu-block-extra.
#
#   fixture.sh start DIR [IMAGE_SIZE]   start the cluster, create rbd/img (default 256M),
#                                       export it at DIR/nbd.sock; prints the env lines
#   fixture.sh env DIR                  CEPH_CONF=..., NBD_SOCKET=..., NBD_URI=... (one a line)
#   fixture.sh stop DIR                 stop everything started in DIR (also after a failure)
#   fixture.sh osd-stop|osd-kill|osd-start DIR    stop (SIGTERM), kill -9 or start the OSD
#   fixture.sh nbd-stop|nbd-kill|nbd-start DIR    the same for the qemu-nbd export
#   fixture.sh rss DIR                  resident memory of mon, osd and qemu-nbd (KiB, and total)
#   fixture.sh diag DIR                 what the cluster is doing: health, the OSD map, which
#                                       daemons run, the ends of their logs (for a test that hangs)
#
# `start` stops whatever it started if any step fails, so a failed start leaves no daemon.
# Every daemon's pid is in DIR/pids/NAME; `stop` ends exactly those (never by name).
set -eEuo pipefail

cmd="${1:-}"
dir="${2:-}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
conf="$dir/ceph.conf"
pids="$dir/pids"
sock="$dir/nbd.sock"
image="rbd/img"

log() { echo "fixture: $*" >&2; }

# Is the process of pid file $1 alive?
alive() {
    local f="$pids/$1"
    [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# Starts "$@" in the background as daemon $name, logging to DIR/log/$name.out.
spawn() {
    local name="$1"
    shift
    mkdir -p "$pids" "$dir/log"
    # Only the log file: a daemon that kept a descriptor of ours (the caller's stdout, fd 3)
    # would keep a pipe open after this script exits, and whoever reads it to its end waits.
    "$@" >>"$dir/log/$name.out" 2>&1 3>&- </dev/null &
    echo $! >"$pids/$name"
}

# Ends daemon $1 with signal $2 (TERM, KILL) and waits up to 30 s for it to go.
end() {
    local name="$1" sig="$2" pid i
    [ -f "$pids/$name" ] || return 0
    pid="$(cat "$pids/$name")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -s "$sig" "$pid" 2>/dev/null || true
        for i in $(seq 300); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name (pid $pid) did not stop on SIG$sig; killing it"
            kill -9 "$pid" 2>/dev/null || true
            sleep 0.2
        fi
    fi
    rm -f "$pids/$name"
}

# A ceph command, bounded (60 s, or $ceph_wait): against a monitor that does not answer it
# would wait for ever.
ceph_() { timeout "${ceph_wait:-60}" ceph -c "$conf" "$@"; }

# A one-shot tool that should take seconds, bounded: a hang fails the start with its name.
bounded() { timeout 120 "$@"; }

# Polls "$@" until it succeeds, for at most `seconds` of wall time (each try may itself take
# up to ceph_'s 60 s when the cluster does not answer, so the deadline is the clock's, not a
# count of tries; it may be passed by one try).
wait_for() { # what, seconds, command...
    local what="$1" secs="$2" deadline
    shift 2
    deadline=$((SECONDS + secs))
    while [ "$SECONDS" -lt "$deadline" ]; do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    log "timed out after ${secs}s waiting for $what"
    return 1
}

# The OSD serves: its own admin socket says active (after a kill -9 the monitor may still
# list the dead one as up, so the map alone does not tell).
osd_up() {
    ceph_ daemon osd.0 status 2>/dev/null | grep -q '"state": "active"' &&
        ceph_ osd dump 2>/dev/null | grep -q '^osd.0 up'
}

osd_start() {
    alive osd && return 0
    spawn osd ceph-osd -f -i 0 -c "$conf"
    wait_for "the OSD to come up" 120 osd_up
}

nbd_start() {
    alive nbd && return 0
    rm -f "$sock"
    # cache=none: librbd's own cache off (qemu sets rbd_cache from it), so what tiercache
    # measures and tests is its own cache; -e 16: up to 16 connections at once (tiercache
    # opens several); -t: keeps serving after the last client leaves.
    spawn nbd qemu-nbd -t -e 16 -f raw --cache=none -k "$sock" \
        "rbd:$image:conf=$conf"
    wait_for "qemu-nbd's socket" 60 test -S "$sock"
}

# A free TCP port for the monitor, below the kernel's ephemeral range: a port the kernel hands
# out (bind to 0) may be taken as some connection's local port before the monitor binds it.
free_port() {
    timeout 10 python3 -c '
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    p = random.randrange(10000, max(low, 10001))
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    print(p)
    break
else:
    raise SystemExit("no free port below the ephemeral range")
'
}

print_env() {
    echo "CEPH_CONF=$conf"
    echo "NBD_SOCKET=$sock"
    echo "NBD_URI=nbd+unix:///?socket=$sock"
}

stop_all() {
    end nbd TERM
    end osd TERM
    end mon TERM
}

start() {
    local size="${1:-256M}" fsid port
    if alive mon || alive osd || alive nbd; then
        log "something from an earlier start still runs in $dir: stop it first"
        exit 1
    fi
    # fd 3: this script's stderr, also where a failing command's own output was redirected.
    exec 3>&2
    trap '{ log "start failed; what the cluster was doing:"; diag; log "stopping what it started (logs in $dir/log)"; } >&3 2>&3; stop_all' ERR
    local t0
    t0=$(date +%s.%N)
    rm -rf "$dir/mon" "$dir/osd" "$dir/run" "$dir/log" "$pids"
    mkdir -p "$dir/mon" "$dir/osd/ceph-0" "$dir/run" "$dir/log" "$pids"
    fsid="$(cat /proc/sys/kernel/random/uuid)"
    port="$(free_port)"
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
mon initial members = a
public network = 127.0.0.0/8
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
run dir = $dir/run
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
keyring = $dir/keyring
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
# No mgr: its absence is a health warning, not a failure.
mon warn on pool pg num not power of two = false
[mon]
mon data = $dir/mon/ceph-\$id
[osd]
osd data = $dir/osd/ceph-\$id
osd objectstore = bluestore
bluestore block path = $dir/osd/block-\$id
bluestore block create = true
bluestore block size = 2147483648
bluestore block db create = false
bluestore block wal create = false
bluestore fsck on mount = false
bluestore cache autotune = false
bluestore cache size = 67108864
osd memory target = 939524096
osd op num shards = 1
osd op num threads per shard = 2
osd crush update on start = true
osd max object name len = 256
osd max object namespace len = 64
osd heartbeat grace = 20
[client]
rbd cache = false
EOF
    bounded ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    bounded monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
    bounded ceph-mon --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring" -c "$conf"
    spawn mon ceph-mon -f -i a -c "$conf"
    wait_for "the monitor" 60 ceph_ mon stat
    local uuid
    uuid="$(cat /proc/sys/kernel/random/uuid)"
    ceph_ osd new "$uuid" 0 >/dev/null
    bounded ceph-osd -i 0 --mkfs --osd-uuid "$uuid" -c "$conf" >"$dir/log/osd-mkfs.out" 2>&1
    osd_start
    ceph_ osd pool create rbd 8 8 >/dev/null 2>&1
    ceph_ osd pool set rbd size 1 --yes-i-really-mean-it >/dev/null 2>&1
    timeout 60 rbd -c "$conf" pool init rbd
    timeout 60 rbd -c "$conf" create "$image" --size "$size" --image-feature layering
    nbd_start
    trap - ERR
    exec 3>&-
    log "started in $(timeout 10 python3 -c "print(round($(date +%s.%N) - $t0, 1))") s; rss: $(rss_total) KiB (mon+osd+qemu-nbd)"
    print_env
}

rss_of() { # pid -> KiB
    awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0
}

rss_total() {
    local t=0 n
    for n in mon osd nbd; do
        if alive "$n"; then t=$((t + $(rss_of "$(cat "$pids/$n")"))); fi
    done
    echo "$t"
}

# Every command bounded: the cluster may be the thing that hangs.
diag() {
    local n f ceph_wait=20
    for n in mon osd nbd; do
        if alive "$n"; then echo "$n: pid $(cat "$pids/$n") runs"; else echo "$n: not running"; fi
    done
    echo "--- ceph -s"
    ceph_ -s 2>&1 || echo "(ceph -s failed or timed out)"
    echo "--- ceph health detail"
    ceph_ health detail 2>&1 || true
    echo "--- ceph osd dump"
    ceph_ osd dump 2>&1 | grep -E '^(epoch|flags|osd\.|pool)' || true
    echo "--- the OSD's operations in flight"
    ceph_ daemon osd.0 dump_ops_in_flight 2>&1 | head -60 || true
    for f in "$dir"/log/*; do
        [ -f "$f" ] || continue
        echo "--- the last lines of $f"
        tail -n 25 "$f"
    done
}

case "$cmd" in
start) start "${3:-256M}" ;;
env) print_env ;;
stop) stop_all ;;
osd-stop) end osd TERM ;;
osd-kill) end osd KILL ;;
osd-start) osd_start ;;
nbd-stop) end nbd TERM ;;
nbd-kill) end nbd KILL ;;
nbd-start) nbd_start ;;
diag) diag ;;
rss)
    for n in mon osd nbd; do
        if alive "$n"; then echo "$n $(rss_of "$(cat "$pids/$n")")"; fi
    done
    echo "total $(rss_total)"
    ;;
*)
    log "unknown command $cmd"
    exit 2
    ;;
esac
