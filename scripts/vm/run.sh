#!/usr/bin/env bash
# Boots Debian's Linux 6.12 under qemu (TCG, no KVM) with a small initramfs holding tiercache,
# nbd-client, mkfs/fsck for ext4 and XFS, fio, dmsetup and the kernel modules (nbd, ublk_drv,
# ext4, xfs, bcache, dm-mod, loop, virtio_blk), runs scenarios inside on two virtio disks
# (backing and cache), and reports their results. Exit status 0 only when every scenario
# printed PASS.
#
#   scripts/vm/run.sh [--bin PATH] [SCENARIO...]
#
# SCENARIO names a file in scripts/vm/scenarios/ (without .sh); default: all of them (not those
# of its subdirectories, named DIR/NAME: bench/ holds the measurements of scripts/vm/compare.sh).
# --bin: the tiercache binary to put in the guest (default: cargo build --release).
# Environment: TIERCACHE_VM_CACHE (kernel, qemu and base initramfs cache; default
# /var/cache/tiercache-vm), TIERCACHE_VM_KERNEL (a linux-image-... package version to use
# instead of the newest 6.12), VM_MEM (MiB, 1536), VM_CPUS (2), VM_TIMEOUT (seconds for the
# whole boot, 1500), VM_LOG (where to keep the serial console; default a temporary file),
# VM_BACKING_OPTS (extra qemu -drive options of the backing disk, e.g. throttling.iops-total=150
# for a disk with a disk's speed), VM_GDB (set: the binary keeps its symbols and gdb goes into
# the guest, so a scenario that sees a hang can print every thread's stack).
#
# It installs what it needs with apt-get when run as root (idempotent). Without the tools and
# without root it exits 77 (skipped) unless CI=true, where a missing tool is a failure.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cache="${TIERCACHE_VM_CACHE:-/var/cache/tiercache-vm}"
bin=""
scenarios=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin="$2"; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) scenarios+=("$1"); shift ;;
    esac
done
if [ ${#scenarios[@]} -eq 0 ]; then
    for f in "$here"/scenarios/*.sh; do scenarios+=("$(basename "$f" .sh)"); done
fi
for s in "${scenarios[@]}"; do
    [ -f "$here/scenarios/$s.sh" ] || { echo "vm: no scenario $s in $here/scenarios" >&2; exit 2; }
done

missing() {
    echo "vm: $*" >&2
    if [ "${CI:-}" = true ]; then exit 1; fi
    echo "vm: skipped (run as root to install what is needed, or set CI=true to fail)" >&2
    exit 77
}

# ---- tools on the host ---------------------------------------------------------------
host_tools=(busybox nbd-client mkfs.ext4 e2fsck mkfs.xfs xfs_repair fio make-bcache dmsetup socat cpio depmod xz ldd strip)
qemu=""
find_qemu() {
    if command -v qemu-system-x86_64 >/dev/null; then qemu="$(command -v qemu-system-x86_64)"; return 0; fi
    if [ -x "$cache/qemu/usr/bin/qemu-system-x86_64" ]; then qemu="$cache/qemu/usr/bin/qemu-system-x86_64"; return 0; fi
    return 1
}
need_install=0
for t in "${host_tools[@]}"; do command -v "$t" >/dev/null || need_install=1; done
[ -f /bin/busybox ] || need_install=1
find_qemu || need_install=1
if [ "$need_install" = 1 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        missing "missing tools (${host_tools[*]} qemu-system-x86_64) and cannot install them"
    fi
    export DEBIAN_FRONTEND=noninteractive
    echo "vm: installing packages" >&2
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends busybox-static nbd-client e2fsprogs xfsprogs \
        fio bcache-tools dmsetup socat cpio kmod xz-utils binutils libc-bin >/dev/null
    if ! find_qemu; then
        # qemu-system-x86 and qemu-utils go in one command. When the machine has a newer
        # qemu-utils than this release's qemu-system-x86 can live with (a backport), apt would
        # remove it; then the emulator is unpacked into the cache instead and only its
        # libraries and firmware are installed.
        if apt-get install -s -qq --no-install-recommends qemu-system-x86 qemu-utils 2>/dev/null | grep -q '^Remv' \
            || ! apt-get install -y -qq --no-install-recommends qemu-system-x86 qemu-utils >/dev/null 2>&1; then
            echo "vm: unpacking qemu-system-x86 into $cache/qemu (keeps the installed qemu-utils)" >&2
            apt-get install -y -qq --no-install-recommends qemu-system-data seabios ipxe-qemu \
                libcapstone4 libfdt1 libpmem1 libvdeplug2 libslirp0 librdmacm1 libibverbs1 libbpf1 \
                libaio1 liburing2 libnuma1 libpixman-1-0 libjpeg62-turbo libpng16-16 libsasl2-2 \
                libseccomp2 libfuse3-3 libglib2.0-0 libgnutls30 libgmp10 libudev1 libzstd1 >/dev/null
            mkdir -p "$cache/qemu-deb"
            (cd "$cache/qemu-deb" && rm -f ./*.deb && apt-get download -qq qemu-system-x86 qemu-system-common 2>/dev/null)
            rm -rf "$cache/qemu"
            for deb in "$cache"/qemu-deb/*.deb; do dpkg-deb -x "$deb" "$cache/qemu"; done
        fi
        find_qemu || missing "qemu-system-x86_64 could not be installed"
    fi
    for t in "${host_tools[@]}"; do command -v "$t" >/dev/null || missing "$t missing after installing"; done
fi
if ldd "$qemu" | grep -q 'not found'; then missing "$qemu lacks libraries: $(ldd "$qemu" | grep 'not found' | tr -d '\t' | tr '\n' ' ')"; fi
# The unpacked emulator loads its accelerator modules from the cache.
case "$qemu" in "$cache"/*) export QEMU_MODULE_DIR="$cache/qemu/usr/lib/x86_64-linux-gnu/qemu" ;; esac
firmware=()
[ -d /usr/share/seabios ] && firmware+=(-L /usr/share/seabios)
[ -d /usr/share/qemu ] && firmware+=(-L /usr/share/qemu)
[ -d /usr/lib/ipxe/qemu ] && firmware+=(-L /usr/lib/ipxe/qemu)

# ---- the kernel ----------------------------------------------------------------------
mkdir -p "$cache"
if [ -n "${TIERCACHE_VM_KERNEL:-}" ]; then
    kpkg="$TIERCACHE_VM_KERNEL"
elif ls "$cache"/linux-image-6.12.*+deb12-amd64-unsigned_*.deb >/dev/null 2>&1; then
    kpkg="$(basename "$(ls "$cache"/linux-image-6.12.*+deb12-amd64-unsigned_*.deb | sort -V | tail -1)")"
    kpkg="${kpkg%%_*}"
else
    command -v apt-cache >/dev/null || missing "no kernel in $cache and no apt-cache to find one"
    kpkg="$(apt-cache search --names-only '^linux-image-6\.12\.[0-9]+\+deb12-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -1)"
    [ -n "$kpkg" ] || missing "apt-cache lists no linux-image-6.12.*+deb12-amd64-unsigned (run apt-get update)"
fi
kver="${kpkg#linux-image-}"; kver="${kver%-unsigned}"
kdir="$cache/kernel-$kver"
if [ ! -f "$kdir/boot/vmlinuz-$kver" ]; then
    if ! ls "$cache/${kpkg}"_*.deb >/dev/null 2>&1; then
        echo "vm: downloading $kpkg" >&2
        (cd "$cache" && apt-get download -qq "$kpkg" 2>/dev/null) || missing "cannot download $kpkg"
    fi
    rm -rf "$kdir.tmp" && mkdir -p "$kdir.tmp"
    dpkg-deb -x "$(ls "$cache/${kpkg}"_*.deb | tail -1)" "$kdir.tmp"
    mv "$kdir.tmp" "$kdir"
fi
moddir="$kdir/lib/modules/$kver"

# ---- the base initramfs (tools, libraries, modules), cached --------------------------
guest_tools=(nbd-client mkfs.ext4 e2fsck mkfs.xfs xfs_repair xfs_db fio make-bcache dmsetup socat)
guest_modules=(crc32c_generic crc32c-intel libcrc32c loop virtio_blk nbd ublk_drv ext4 xfs bcache dm-mod)
base_key="$(printf '%s\n' "$kver" "${guest_tools[@]}" "${guest_modules[@]}" | cat - "$here/run.sh" | sha256sum | cut -c1-16)"
base="$cache/base-$base_key.cpio"
if [ ! -f "$base" ]; then
    echo "vm: building the base initramfs ($base)" >&2
    stage="$(mktemp -d)"
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,proc,sys,dev,run,tmp,mnt,etc,root,var/tmp}
    cp /bin/busybox "$stage/bin/busybox"
    copy_with_libs() {
        local p="$1" d
        d="$stage$(dirname "$p")"; mkdir -p "$d"; cp -L "$p" "$d/"
        ldd "$p" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
            [ -e "$stage$lib" ] && continue
            mkdir -p "$stage$(dirname "$lib")"; cp -L "$lib" "$stage$lib"
        done
    }
    for t in "${guest_tools[@]}"; do copy_with_libs "$(command -v "$t")"; done
    ln -sf e2fsck "$stage/usr/sbin/fsck.ext4"
    # Modules, decompressed, each after what it depends on (the list in load order).
    depmod -b "$kdir" "$kver"
    order=()
    add_module() {
        local name="$1" line path deps d
        line="$(grep -E "/${name//-/[-_]}\.ko(\.xz)?:" "$moddir/modules.dep" | head -1)" || true
        [ -n "$line" ] || { echo "vm: module $name not found in $kver" >&2; exit 1; }
        path="${line%%:*}"; deps="${line#*:}"
        for p in "${order[@]}"; do [ "$p" = "$path" ] && return 0; done
        for d in $deps; do add_module "$(basename "$d" .ko.xz)"; done
        order+=("$path")
    }
    for m in "${guest_modules[@]}"; do add_module "$m"; done
    mkdir -p "$stage/lib/modules"
    for p in "${order[@]}"; do
        xz -dc "$moddir/$p" > "$stage/lib/modules/$(basename "$p" .xz)"
        basename "$p" .xz >> "$stage/etc/modules.order"
    done
    (cd "$stage" && find . | cpio -o -H newc --quiet) > "$base.tmp"
    mv "$base.tmp" "$base"
    rm -rf "$stage"; trap - EXIT
fi

# ---- the tiercache binary and the scenarios (per run) --------------------------------
if [ -z "$bin" ]; then
    (cd "$repo" && cargo build --release --locked -q -p tiercache)
    bin="$repo/target/release/tiercache"
fi
[ -x "$bin" ] || { echo "vm: $bin is not an executable" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/tiercache-vm.XXXXXX")"
trap 'rm -rf "$work"' EXIT
over="$work/overlay"
mkdir -p "$over/usr/bin" "$over/scenarios"
overlay_with_libs() {
    ldd "$1" | grep -o '/[^ ]*' | while read -r lib; do
        [ -e "$over$lib" ] && continue
        mkdir -p "$over$(dirname "$lib")"; cp -L "$lib" "$over$lib"
    done
}
if [ -n "${VM_GDB:-}" ]; then
    # For debugging a hang: the binary with its symbols, and gdb (`gdb -p PID -batch -ex
    # 'thread apply all bt'` in a scenario).
    cp "$bin" "$over/usr/bin/tiercache"
    cp -L "$(command -v gdb)" "$over/usr/bin/gdb"; overlay_with_libs "$(command -v gdb)"
else
    strip -o "$over/usr/bin/tiercache" "$bin"
fi
overlay_with_libs "$bin"
cp "$here/init" "$over/init"; chmod 755 "$over/init"
cp "$here/lib.sh" "$over/lib.sh"
# The systemd unit, whose ExecStart the boot scenario runs as systemd would.
mkdir -p "$over/unit"; cp "$here/../../contrib/systemd/tiercache.service" "$over/unit/"
for s in "${scenarios[@]}"; do
    mkdir -p "$over/scenarios/$(dirname "$s")"; cp "$here/scenarios/$s.sh" "$over/scenarios/$s.sh"
done
(cd "$over" && find . | cpio -o -H newc --quiet) > "$work/overlay.cpio"
cat "$base" "$work/overlay.cpio" > "$work/initrd"

# The guest's disks: vda the backing device, vdb the cache device, vdc and vdd spare (bcache).
truncate -s 1G "$work/backing.img"
truncate -s 256M "$work/cache.img"
truncate -s 1G "$work/spare1.img"
truncate -s 256M "$work/spare2.img"

log="${VM_LOG:-$work/console.log}"
list="$(IFS=,; echo "${scenarios[*]}")"
echo "vm: booting Linux $kver (TCG, ${VM_CPUS:-2} vCPUs, ${VM_MEM:-1536} MiB): $list" >&2
start=$(date +%s)
set +e
# A kernel that panics before the first scenario starts is booted once more: under TCG with
# two vCPUs the 6.12 kernel rarely dies at boot patching its own code (an `int3` oops in
# `sched_clock_cpu`, seen once in many boots), which says nothing about tiercache.
for boot in 1 2; do
timeout --foreground -k 10 "${VM_TIMEOUT:-1500}" "$qemu" "${firmware[@]}" \
    -accel tcg -machine pc -cpu max -smp "${VM_CPUS:-2}" -m "${VM_MEM:-1536}" \
    -nodefaults -no-reboot -display none -serial stdio -monitor none \
    -kernel "$kdir/boot/vmlinuz-$kver" -initrd "$work/initrd" \
    -append "console=ttyS0 rdinit=/init panic=-1 loglevel=4 tc.scenarios=$list" \
    -drive "file=$work/backing.img,if=virtio,format=raw,cache=unsafe${VM_BACKING_OPTS:+,$VM_BACKING_OPTS}" \
    -drive "file=$work/cache.img,if=virtio,format=raw,cache=unsafe" \
    -drive "file=$work/spare1.img,if=virtio,format=raw,cache=unsafe" \
    -drive "file=$work/spare2.img,if=virtio,format=raw,cache=unsafe" \
    < /dev/null 2>&1 | tee "$log"
qrc=${PIPESTATUS[0]}
if [ $boot = 1 ] && grep -q 'Kernel panic' "$log" && ! grep -q '^==== scenario' "$log"; then
    echo "vm: the kernel panicked before the first scenario (an emulation fault): booting again" >&2
    continue
fi
break
done
set -e
secs=$(( $(date +%s) - start ))

tr -d '\r' < "$log" > "$work/clean.log"
pass=$(grep -c '^VMTEST PASS ' "$work/clean.log" || true)
fail=$(grep -c '^VMTEST FAIL ' "$work/clean.log" || true)
echo "==== vm results (${secs}s, qemu exit $qrc)"
grep -E '^VMTEST (PASS|FAIL) ' "$work/clean.log" || true
rc=0
for s in "${scenarios[@]}"; do
    if ! grep -qE "^VMTEST (PASS|FAIL) $s( |:|$)" "$work/clean.log"; then
        echo "VMTEST FAIL $s: no result (the guest stopped or hung before it ended)"; rc=1
    fi
done
grep -q '^VMTEST DONE' "$work/clean.log" || { echo "vm: the guest did not finish (timeout ${VM_TIMEOUT:-1500}s or a crash)"; rc=1; }
[ "$fail" -eq 0 ] || rc=1
[ "$qrc" -eq 0 ] || { echo "vm: qemu exited with $qrc"; rc=1; }
echo "vm: $pass passed, $fail failed"
exit $rc
