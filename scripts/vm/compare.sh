#!/usr/bin/env bash
# tiercache beside kernel bcache on Linux 6.12 (qemu TCG, scripts/vm/run.sh): one boot per
# configuration (the backing disk alone, the cache disk alone, /dev/bcache0, /dev/ublkb0,
# /dev/nbd0 with 4 connections), each measured cold and warm with fio (bench_fio in
# scripts/vm/lib.sh: 4 KiB random reads and writes at queue depth 1 and 32, 1 MiB sequential
# at depth 4, and the field's job, bench W1's: 4 KiB psync sequential and random reads and
# writes); prints a Markdown table of IOPS as ratios to the backing disk alone, and keeps the
# guests' logs (tiercache's counters after each job, `COUNTERS` lines) in the directory it
# names on stderr. Not run by CI (minutes, and its figures are not assertions).
#
#   scripts/vm/compare.sh [--bin PATH] [CONFIG...]
#
# The backing disk is throttled like a disk (VM_BACKING_OPTS, default 150 IOPS and 60 MB/s),
# the cache disk is not. Under TCG every figure carries the emulation's CPU cost, which weighs
# most on the userspace paths (ublk, nbd): read the ratios, not the absolute numbers.
# Environment: BENCH_SECS (seconds per job, 5), BENCH_REGION (the region measured, 64m), and
# those of run.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin=()
configs=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bin) bin=(--bin "$2"); shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) configs+=("$1"); shift ;;
    esac
done
[ ${#configs[@]} -gt 0 ] || configs=(raw-backing raw-cache bcache ublk nbd)
export VM_BACKING_OPTS="${VM_BACKING_OPTS:-throttling.iops-total=150,throttling.bps-total=60000000}"
out="$(mktemp -d "${TMPDIR:-/tmp}/tiercache-compare.XXXXXX")"
echo "compare: guest logs in $out" >&2
for c in "${configs[@]}"; do
    echo "compare: $c" >&2
    VM_LOG="$out/$c.log" bash "$here/run.sh" "${bin[@]}" "bench/$c" > "$out/$c.run" 2>&1 \
        || { tail -30 "$out/$c.run" >&2; echo "compare: $c failed" >&2; exit 1; }
    tr -d '\r' < "$out/$c.log" | grep '^BENCH ' >> "$out/bench.txt"
done
# Table: one row per pass and job, IOPS of each configuration, and its ratio to raw-backing.
awk -v configs="${configs[*]}" '
    { iops[$2 " " $3 " " $4] = $5; if (!(($3 " " $4) in seen)) { seen[$3 " " $4] = 1; rows[++n] = $3 " " $4 } }
    END {
        nc = split(configs, c, " ")
        printf "| pass | job |"; for (i = 1; i <= nc; i++) printf " %s |", c[i]; printf "\n"
        printf "|---|---|"; for (i = 1; i <= nc; i++) printf "---|"; printf "\n"
        for (r = 1; r <= n; r++) {
            split(rows[r], p, " ")
            printf "| %s | %s |", p[1], p[2]
            base = iops["raw-backing " rows[r]]
            for (i = 1; i <= nc; i++) {
                v = iops[c[i] " " rows[r]]
                if (v == "") { printf " - |"; continue }
                if (base > 0 && c[i] != "raw-backing") printf " %d (%.2fx) |", v, v / base
                else printf " %d |", v
            }
            printf "\n"
        }
    }' "$out/bench.txt"
