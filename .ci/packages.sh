#!/usr/bin/env bash
# The Debian packages the tests need, installed in one apt-get call that works on a machine
# nobody touched. Sourced by .ci/run (install) and .ci/check-install.sh (a dry run against a
# fresh image's package state); both use ci_install_args so there is one list.
#
# Why qemu-utils is pinned: the project's machine image ships Debian's *backported* qemu-utils
# (10.x, ~bpo12) from a source that is not configured on the machine, while qemu-block-extra
# only exists in bookworm's own version (7.2), which depends on qemu-utils of exactly that
# version. A plain `apt-get install qemu-utils qemu-block-extra` keeps the installed 10.x,
# cannot satisfy qemu-block-extra's `qemu-utils (= 7.2...)` and exits 100 ("held broken
# packages"). Asking for both at qemu-block-extra's candidate version, with
# --allow-downgrades, is the one combination apt can install on such a machine and a no-op
# where 7.2 is already there.

CI_PACKAGES=(libnbd-bin python3-libnbd nbdkit nbdfuse fio ceph-mon ceph-osd ceph-common
    e2fsprogs xfsprogs btrfs-progs fuse3 util-linux systemd prometheus
    python3-prometheus-client openssl gdb)

# Prints the arguments of the install (after `apt-get install`), one per line. Needs the
# package lists (apt-get update) to find the archive's qemu version. Extra apt options (such
# as -o Dir::State::status=FILE) are passed through to apt-cache.
ci_install_args() {
    local qemu
    qemu=$(apt-cache "$@" policy qemu-block-extra | awk '/Candidate:/ {print $2}')
    if [ -z "$qemu" ] || [ "$qemu" = "(none)" ]; then
        echo "apt-cache knows no qemu-block-extra: run apt-get update first" >&2
        return 1
    fi
    printf '%s\n' --allow-downgrades "${CI_PACKAGES[@]}" "qemu-utils=$qemu" "qemu-block-extra=$qemu"
}
