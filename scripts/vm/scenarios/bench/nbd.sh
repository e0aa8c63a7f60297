# Measurements for scripts/vm/compare.sh (not run in CI): nbd.
bench nbd
