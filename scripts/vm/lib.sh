# Helpers for the guest's scenarios (sourced by /init before each one; scenarios run under
# sh -e, so any failing command fails the scenario). vda is the backing device, vdb the cache.
SOCK=/run/tiercache.sock
ADMIN=$SOCK.admin
BACKING=/dev/vda
CACHE=/dev/vdb
MNT=/mnt
SUMS=/tmp/sums

say() { echo "-- [$(cut -d" " -f1 /proc/uptime)] $*"; }
die() { echo "FAILED: $*"; exit 1; }

# tiercache's admin commands against the server of this scenario.
tc() { tiercache "$@" --admin "$ADMIN"; }

# Formats vda (backing, export "data") and vdb (cache); extra arguments go to make.
tc_make() { tiercache make --force --backing "$BACKING" --cache "$CACHE" --label data "$@" > /dev/null; }

# Starts tiercache serve in the background (pid in /tmp/serve.pid, log in /tmp/serve.log) and
# waits until its admin socket answers. Extra arguments go to serve.
tc_serve() {
    tiercache serve --cache "$CACHE" --backing "$BACKING" --socket "$SOCK" --metrics 9563 "$@" \
        >> /tmp/serve.log 2>&1 &
    echo $! > /tmp/serve.pid
    i=0
    until tiercache status --admin "$ADMIN" > /dev/null 2>&1; do
        i=$((i + 1))
        [ $i -lt 600 ] || { cat /tmp/serve.log; die "serve did not start"; }
        kill -0 "$(cat /tmp/serve.pid)" 2> /dev/null || { cat /tmp/serve.log; die "serve exited"; }
        sleep 0.2
    done
}

# Stops the server cleanly (SIGTERM) and waits for it; fails if it does not exit 0. A hang
# guard kills it after 300 s (a shutdown is bounded by --shutdown-timeout, 30 s by default,
# twice: the requests in flight, then the save).
tc_stop() {
    pid=$(cat /tmp/serve.pid)
    kill -TERM "$pid"
    ( sleep 300; kill -9 "$pid" 2> /dev/null && echo "tc_stop: serve hung after SIGTERM, killed" ) &
    guard=$!
    rc=0; wait "$pid" || rc=$?
    kill "$guard" 2> /dev/null || true
    [ $rc = 0 ] || { tail -20 /tmp/serve.log; die "serve exited $rc after SIGTERM"; }
    rm -f /tmp/serve.pid
}

# unit_config: the configuration tiercache.service reads (contrib/systemd/tiercache.toml's keys
# for this guest's disks, and ublk), at /etc/tiercache/tiercache.toml.
unit_config() {
    mkdir -p /etc/tiercache
    cat > /etc/tiercache/tiercache.toml << EOF
cache = "$CACHE"
backing = ["$BACKING"]
socket = "/run/tiercache/tiercache.sock"
ublk = true
EOF
    ADMIN=/run/tiercache/tiercache.sock.admin
}

# unit_start: starts the server as systemd starts tiercache.service (the unit's ExecStart with
# its RuntimeDirectory, a notify socket) and returns when it sent READY=1, the moment units
# ordered after it start; pid and log as tc_serve's.
unit_start() {
    cmd=$(sed -n 's/^ExecStart=//p' /unit/tiercache.service)
    [ -n "$cmd" ] || die "no ExecStart in tiercache.service"
    mkdir -p /run/tiercache
    rm -f /run/notify /tmp/notify.out
    socat -u UNIX-RECV:/run/notify OPEN:/tmp/notify.out,creat,append &
    notify=$!
    i=0
    until [ -S /run/notify ]; do i=$((i + 1)); [ $i -lt 100 ] || die "socat did not listen"; sleep 0.1; done
    # shellcheck disable=SC2086
    NOTIFY_SOCKET=/run/notify ${cmd#/usr/local/bin/} >> /tmp/serve.log 2>&1 &
    echo $! > /tmp/serve.pid
    i=0
    until grep -q READY=1 /tmp/notify.out 2> /dev/null; do
        i=$((i + 1))
        [ $i -lt 600 ] || { cat /tmp/serve.log; die "tiercache.service never became ready"; }
        kill -0 "$(cat /tmp/serve.pid)" 2> /dev/null || { cat /tmp/serve.log; die "serve exited"; }
        sleep 0.1
    done
    kill $notify 2> /dev/null || true
    [ -b /dev/ublkb0 ] || die "tiercache.service is ready but /dev/ublkb0 is not there"
    say "tiercache.service ready, /dev/ublkb0 there"
}

# kill -9 of the server, reaped.
tc_kill9() {
    pid=$(cat /tmp/serve.pid)
    kill -9 "$pid"
    wait "$pid" 2> /dev/null || true
    rm -f /tmp/serve.pid
}

# nbd_up [nbd-client options]: connects /dev/nbd0 to export "data" and waits for its size.
nbd_up() {
    nbd-client -unix "$SOCK" /dev/nbd0 -name data "$@"
    i=0
    until [ "$(cat /sys/block/nbd0/size)" != 0 ]; do
        i=$((i + 1)); [ $i -lt 100 ] || die "/dev/nbd0 has no size"; sleep 0.1
    done
}
nbd_down() { nbd-client -d /dev/nbd0 > /dev/null; }

# metric NAME_PREFIX LABEL_FILTER: the sum of the matching Prometheus samples of the server.
metric() {
    wget -qO- http://127.0.0.1:9563/metrics | grep "^$1" | grep -- "$2" \
        | awk '{s += $NF} END {printf "%d\n", s}'
}

fs_mkfs() {
    case "$1" in
        ext4) mkfs.ext4 -q -F "$2" ;;
        xfs) mkfs.xfs -q -f "$2" ;;
        *) die "unknown filesystem $1" ;;
    esac
}

# fs_check FS DEV: the filesystem's own checker, read-only; fails on any problem.
fs_check() {
    case "$1" in
        ext4) e2fsck -fn "$2" ;;
        xfs) xfs_repair -n "$2" ;;
    esac || die "$1 checker found problems on $2"
}

# make_files DIR N TAG: N files of 4 KiB to 1 MiB of random data, each fsync'd; their
# sha256 sums are appended to $SUMS (relative to $MNT) once the fsync returned. It stops early
# once /tmp/stop-writer exists.
make_files() {
    mkdir -p "$1"
    n=0
    while [ $n -lt "$2" ] && [ ! -e /tmp/stop-writer ]; do
        kib=$(( ($(od -An -N2 -tu2 /dev/urandom) % 256 + 1) * 4 ))
        f="$1/$3-$n"
        dd if=/dev/urandom of="$f" bs=1024 count=$kib conv=fsync 2> /dev/null
        (cd "$MNT" && sha256sum "${f#$MNT/}") >> "$SUMS"
        n=$((n + 1))
    done
}

verify_files() {
    (cd "$MNT" && sha256sum -c -s "$SUMS") || die "files differ from what was written"
    say "$(wc -l < "$SUMS") files intact"
}

# fio_verify DIR [extra fio options]: random writes at queue depth 16 through O_DIRECT on files,
# fsync'd, then every block read back and checked.
fio_verify() {
    dir="$1"; shift
    fio --name=verify --directory="$dir" --rw=randwrite --bs=4k --size=16m --numjobs=2 \
        --ioengine=libaio --iodepth=16 --direct=1 --fsync=64 --end_fsync=1 \
        --verify=crc32c --verify_fatal=1 --do_verify=1 --group_reporting "$@" \
        --output-format=terse > /tmp/fio.out || { cat /tmp/fio.out; die "fio verify failed"; }
}

# Everything a scenario may have left: a mount, an NBD connection, a server.
cleanup() {
    umount "$MNT" 2> /dev/null || true
    [ -e /sys/block/nbd0/pid ] && nbd-client -d /dev/nbd0 > /dev/null 2>&1
    if [ -f /tmp/serve.pid ]; then kill -9 "$(cat /tmp/serve.pid)" 2> /dev/null; rm -f /tmp/serve.pid; fi
    [ -e /dev/mapper/tccache ] && DM_DISABLE_UDEV=1 dmsetup remove --force tccache 2> /dev/null
    rm -f "$SUMS" /tmp/serve.log "$SOCK" "$ADMIN" /tmp/stop-writer
    sleep 0.2
    true
}

# fs_roundtrip FS DEV: mkfs, mount, fio with verify, a tree of fsync'd files, unmount, the
# checker, mount again and read every file back.
fs_roundtrip() {
    say "$1 on $2: mkfs, mount, fio verify"
    fs_mkfs "$1" "$2"
    mount "$2" "$MNT"
    fio_verify "$MNT"
    say "$1: fsync'd files"
    make_files "$MNT/tree" 40 a
    rm -f "$MNT"/verify.*
    umount "$MNT"
    say "$1: checker after unmount"
    fs_check "$1" "$2"
    mount "$2" "$MNT"
    verify_files
    umount "$MNT"
}

# No client request of the server failed.
no_errors() {
    e=$(metric tiercache_volume_requests_total 'result="error"')
    [ "$e" = 0 ] || die "$e requests failed"
}

# ublk_wait N: waits for /dev/ublkbN.
ublk_wait() {
    i=0
    until [ -b "/dev/ublkb$1" ]; do
        i=$((i + 1)); [ $i -lt 100 ] || { tail -20 /tmp/serve.log; die "/dev/ublkb$1 did not appear"; }
        sleep 0.1
    done
}

# kernel_io_errors: how many I/O errors the kernel logged so far.
kernel_io_errors() { dmesg | grep -c -i 'I/O error' || true; }

# serve_dev KIND [serve options]: starts the server and its block device, /dev/ublkb0 (KIND
# ublk) or /dev/nbd0 (KIND nbd); $dev names it.
serve_dev() {
    kind="$1"; shift
    case "$kind" in
        ublk) tc_serve --ublk "$@"; ublk_wait 0; dev=/dev/ublkb0 ;;
        nbd) tc_serve "$@"; nbd_up; dev=/dev/nbd0 ;;
        *) die "unknown block device kind $kind (ublk or nbd)" ;;
    esac
}

# dev_io_errors DEV: how many I/O errors the kernel logged so far on DEV (a name like nbd0),
# and errors of a filesystem on it.
dev_io_errors() { dmesg | grep -i -e 'I/O error' -e 'EXT4-fs error' | grep -c "$1" || true; }

# detach_in_use KIND MODE [serve options]: `tiercache detach` of the volume (KIND ublk or nbd,
# cache mode MODE, writethrough or writeback) while ext4 on its block device is mounted and
# written (fio with verify), then `attach` again. The contract is the socket's: detach writes
# everything back and ends the volume's block device (the filesystem on it gets errors from
# then on, as on a lost disk; over NBD every request is answered with an error and the
# connection closed once idle, so nothing waits for a reply that never comes); attach serves
# the volume again, as a new device. Checked: detach and attach complete while the filesystem
# stays mounted (a detach that has not returned in 90 s prints the server's threads: with
# VM_GDB set, their stacks), the writer on the old device ends by itself, the old device
# goes, the new one comes (ublk: numbered 1, as 0 stays with the dead device while a
# filesystem is mounted on it; nbd: connected as /dev/nbd1), every file fsync'd before the
# detach is intact, the checker is clean (after the journal replays) and the server stops
# cleanly.
detach_in_use() {
    kind="$1"; mode="$2"; shift 2
    case "$mode" in
        writeback) tc_make --writeback ;;
        writethrough) tc_make ;;
        *) die "detach_in_use: unknown mode $mode" ;;
    esac
    serve_dev "$kind" --shutdown-timeout 10 "$@"
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$MNT"
    make_files "$MNT/before" 20 b
    ( fio_verify "$MNT" --size=64m ) > /dev/null 2>&1 &
    fio=$!
    sleep 3
    kill -0 $fio 2> /dev/null || die "fio ended before the detach: nothing was in use"
    say "detach while fio runs ($(tc status --json | grep -o '"dirty_bytes": *[0-9]*' | head -1))"
    tc detach data > /tmp/detach.out 2>&1 &
    det=$!
    i=0
    while kill -0 $det 2> /dev/null; do
        i=$((i + 1))
        if [ $i -eq 900 ]; then
            say "detach has not returned in 90 s: its output, the status, the server's threads"
            tail -5 /tmp/detach.out; tc status --json | grep -e dirty -e '"mode"' | head -5
            for t in /proc/$(cat /tmp/serve.pid)/task/*; do echo "$(cat $t/comm) $(cat $t/wchan)"; done
            if command -v gdb > /dev/null; then
                gdb -p "$(cat /tmp/serve.pid)" -batch -ex 'thread apply all bt' 2>&1 | grep -e '^Thread' -e '^#' | head -400
            fi
            tail -20 /tmp/serve.log
            die "detach hangs"
        fi
        sleep 0.1
    done
    wait $det || { cat /tmp/detach.out; tail -20 /tmp/serve.log; die "detach failed"; }
    if tc status --json | grep -q '"name": *"data"'; then die "data is still attached after detach"; fi
    # The writer ends by itself: its requests fail (before the server answered them with
    # errors, the kernel's NBD client could wait forever for replies to requests it had sent
    # on the connection the detach closed, leaving fio and the journal blocked).
    i=0
    while kill -0 $fio 2> /dev/null; do
        i=$((i + 1)); [ $i -lt 600 ] || die "fio still runs 60 s after its device went"; sleep 0.1
    done
    if wait $fio; then say "fio finished before the device went"; else say "fio failed: its filesystem lost its device"; fi
    i=0
    case "$kind" in
        ublk) until [ ! -e /sys/block/ublkb0 ]; do
                  i=$((i + 1)); [ $i -lt 300 ] || die "/dev/ublkb0 is still there after the detach"; sleep 0.1
              done ;;
        nbd) until [ "$(metric "tiercache_connections{" unix)" = 0 ]; do
                 i=$((i + 1)); [ $i -lt 400 ] || die "the server still has the connection of /dev/nbd0 40 s after the detach"; sleep 0.1
             done ;;
    esac
    say "attach again, the old filesystem still mounted"
    tc attach "$BACKING" > /dev/null || { tail -20 /tmp/serve.log; die "attach failed"; }
    case "$kind" in
        # The number 0 stays with the dead device as long as a filesystem is mounted on it.
        ublk) ublk_wait 1; new=/dev/ublkb1 ;;
        nbd) new=/dev/nbd1; nbd-client -unix "$SOCK" "$new" -name data > /dev/null ;;
    esac
    umount "$MNT" 2> /dev/null || umount -l "$MNT"
    mount "$new" "$MNT"
    umount "$MNT"
    fs_check ext4 "$new"
    mount "$new" "$MNT"
    verify_files
    umount "$MNT"
    [ "$kind" = nbd ] && { nbd-client -d "$new" > /dev/null; nbd_down 2> /dev/null || true; }
    tail -5 /tmp/serve.log
    tc_stop
}

# cache_fails KIND (ublk or nbd): the cache device fails under a mounted, written filesystem
# in writethrough. The cache is a device-mapper target over vdb whose table is swapped for
# dm-error while fio with verify runs on ext4 over the volume's block device, after the files
# written before were read once (so the cache holds clean copies of them). Checked: the set
# degrades (the failure was real), fio verifies every block, the kernel logs no I/O error on
# the block device, no request of the server failed, every file reads back intact (from the
# backing device), the checker is clean; then the table is restored and `readmit` puts the
# cache back in service.
cache_fails() {
    sectors=$(blockdev --getsz /dev/vdb)
    DM_DISABLE_UDEV=1 dmsetup create tccache --table "0 $sectors linear /dev/vdb 0"
    CACHE=/dev/mapper/tccache
    tc_make
    serve_dev "$1"
    name=${dev#/dev/}
    errors0=$(dev_io_errors "$name")
    mkfs.ext4 -q -F "$dev"
    mount "$dev" "$MNT"
    make_files "$MNT/tree" 30 c
    echo 3 > /proc/sys/vm/drop_caches
    verify_files
    ( fio_verify "$MNT" --size=32m ) &
    fio=$!
    sleep 3
    kill -0 $fio 2> /dev/null || die "fio ended before the cache failed: nothing was in use"
    say "the cache device fails (dm-error)"
    DM_DISABLE_UDEV=1 dmsetup suspend tccache
    DM_DISABLE_UDEV=1 dmsetup load tccache --table "0 $sectors error"
    DM_DISABLE_UDEV=1 dmsetup resume tccache
    wait $fio || die "fio failed after the cache device failed"
    tc status | grep -q DEGRADED || { tc status; die "the set did not degrade: the cache did not fail?"; }
    echo 3 > /proc/sys/vm/drop_caches
    verify_files
    rm -f "$MNT"/verify.*
    umount "$MNT"
    fs_check ext4 "$dev"
    [ "$(dev_io_errors "$name")" = "$errors0" ] || { dmesg | tail -20; die "the kernel logged I/O errors on $dev"; }
    no_errors
    say "the cache device is repaired: readmit"
    DM_DISABLE_UDEV=1 dmsetup suspend tccache
    DM_DISABLE_UDEV=1 dmsetup load tccache --table "0 $sectors linear /dev/vdb 0"
    DM_DISABLE_UDEV=1 dmsetup resume tccache
    tc readmit > /dev/null
    if tc status | grep -q DEGRADED; then die "still degraded after readmit"; fi
    [ "$1" = nbd ] && nbd_down
    tc_stop
    DM_DISABLE_UDEV=1 dmsetup remove tccache
}

# bench_fio CONFIG DEV: the measurements of scripts/vm/compare.sh on DEV (O_DIRECT, libaio,
# BENCH_SECS seconds each, within the first BENCH_REGION of the device): 4 KiB random reads
# and writes at queue depth 1 and 32, 1 MiB sequential reads and writes at depth 4; a cold pass
# (first, on an empty cache; each job may hit what the ones before it cached), then one random
# read of the whole region in 64 KiB blocks (a warm-up a cache keeps), then the warm pass.
# Prints "BENCH CONFIG PASS JOB IOPS KIB/S" per job.
bench_fio() {
    secs=${BENCH_SECS:-5}; region=${BENCH_REGION:-64m}
    for pass in cold warm; do
        if [ $pass = warm ]; then
            fio --name=warmup --filename="$2" --rw=randread --bs=64k --size="$region" \
                --ioengine=libaio --iodepth=8 --direct=1 > /dev/null || die "fio warm-up failed"
        fi
        # RW:BS:QD with libaio over the region, then the field's job (bench W1: 4 KiB psync at
        # depth 1 over 100 MiB, sequential and random reads and writes, in that order).
        for job in randread:4k:1 randread:4k:32 read:1m:4 randwrite:4k:1 randwrite:4k:32 write:1m:4 \
            w1:read w1:randread w1:write w1:randwrite; do
            case $job in
                w1:*) rw=${job#w1:}; args="--bs=4k --iodepth=1 --size=100m --ioengine=psync"
                      name="W1-$(echo "$rw" | sed 's/^read$/read-seq/; s/^write$/write-seq/; s/^rand\(.*\)/\1-random/')" ;;
                *) rw=${job%%:*}; rest=${job#*:}; bs=${rest%%:*}; qd=${rest#*:}
                   args="--bs=$bs --iodepth=$qd --size=$region --ioengine=libaio"
                   name="$rw-$bs-qd$qd" ;;
            esac
            # shellcheck disable=SC2086
            fio --name=b --filename="$2" --rw="$rw" $args --direct=1 --time_based --runtime="$secs" \
                --output-format=terse --terse-version=3 > /tmp/bench.out || { cat /tmp/bench.out; die "fio $job failed"; }
            case $rw in
                *read) f=$(awk -F';' '{print $8, $7}' /tmp/bench.out) ;;
                *) f=$(awk -F';' '{print $49, $48}' /tmp/bench.out) ;;
            esac
            echo "BENCH $1 $pass $name $f"
            # tiercache's own account of the job (counters since the server started).
            if [ -f /tmp/serve.pid ] && kill -0 "$(cat /tmp/serve.pid)" 2> /dev/null; then
                c=""
                for m in cache_hits cache_misses cache_bypass_hits cache_bypass_misses congested \
                    bypassed_sequential_bytes backing_read_bytes; do
                    c="$c $m=$(metric "tiercache_volume_${m}_total{" data)"
                done
                echo "COUNTERS $1 $pass $name$c"
            fi
        done
    done
}

# bench CONFIG: sets the configuration up on a fresh boot and measures it (bench_fio):
# raw-backing and raw-cache (the disks alone), bcache (make-bcache, /dev/bcache0,
# writethrough), ublk (/dev/ublkb0) and nbd (/dev/nbd0, -C 4), tiercache in writethrough.
bench() {
    case "$1" in
        raw-backing) bench_fio "$1" "$BACKING" ;;
        raw-cache) bench_fio "$1" "$CACHE" ;;
        bcache)
            # 64 KiB buckets: the 256 MiB cache disk has too few of the default size for the kernel.
            make-bcache --wipe-bcache --bucket 64k -B "$BACKING" -C "$CACHE" > /dev/null
            echo "$BACKING" > /sys/fs/bcache/register || true
            echo "$CACHE" > /sys/fs/bcache/register || true
            i=0
            until [ -b /dev/bcache0 ] && [ "$(cat /sys/block/bcache0/bcache/state 2> /dev/null)" = clean ]; do
                i=$((i + 1)); [ $i -lt 100 ] || { ls /dev/bcache* /sys/fs/bcache; cat /sys/block/bcache0/bcache/state; dmesg | grep -i bcache | tail; die "/dev/bcache0 did not come up attached"; }
                sleep 0.1
            done
            say "bcache0: $(cat /sys/block/bcache0/bcache/cache_mode)"
            bench_fio "$1" /dev/bcache0 ;;
        ublk) tc_make; serve_dev ublk; bench_fio "$1" "$dev"; tc_stop ;;
        nbd) tc_make; tc_serve; nbd_up -C 4; bench_fio "$1" /dev/nbd0; nbd_down; tc_stop ;;
        *) die "bench: unknown configuration $1" ;;
    esac
}
