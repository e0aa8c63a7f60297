#!/usr/bin/env bash
# Checks that .ci/run's package install succeeds on a fresh machine of this project's image,
# whatever this machine already has: apt-get's dry run (-s) against a copy of this machine's
# package state in which qemu-utils is the image's backport (fixtures/qemu-utils-bpo12.status,
# its dpkg status stanza as the image ships it). The same dry run of the unpinned install is
# expected to fail, so the check can tell the difference (it failed CI on a fresh image before
# the pin). Needs root only for nothing; needs apt's package lists (apt-get update).
set -euo pipefail
cd "$(dirname "$0")"
. ./packages.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# This machine's dpkg status without its own qemu-utils stanza, plus the image's.
awk 'BEGIN { RS = ""; ORS = "\n\n" } !/^Package: qemu-utils\n/' /var/lib/dpkg/status >"$work/status"
cat fixtures/qemu-utils-bpo12.status >>"$work/status"
opt=(-o "Dir::State::status=$work/status")

mapfile -t args < <(ci_install_args "${opt[@]}")
echo "== dry run of the pinned install on the image's package state"
if ! apt-get "${opt[@]}" install -s -y "${args[@]}" >"$work/pinned.log" 2>&1; then
    tail -20 "$work/pinned.log"
    echo "FAIL: .ci/run's install would fail on a fresh machine" >&2
    exit 1
fi
grep -E '^Inst qemu-(utils|block-extra) ' "$work/pinned.log"
if grep -q '^Remv ' "$work/pinned.log"; then
    grep '^Remv ' "$work/pinned.log"
    echo "FAIL: the install would remove packages" >&2
    exit 1
fi

echo "== dry run of the unpinned install (expected to fail: the check can tell)"
if apt-get "${opt[@]}" install -s -y "${CI_PACKAGES[@]}" qemu-utils qemu-block-extra >"$work/plain.log" 2>&1; then
    echo "FAIL: the unpinned install succeeds on the image's state: the fixture no longer" \
        "reproduces the image (is qemu-block-extra's backport in the lists now?)" >&2
    exit 1
fi
echo "ok: the pinned install succeeds where the plain one fails"
