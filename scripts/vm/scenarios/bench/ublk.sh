# Measurements for scripts/vm/compare.sh (not run in CI): ublk.
bench ublk
