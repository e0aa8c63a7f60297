# Measurements for scripts/vm/compare.sh (not run in CI): bcache.
bench bcache
