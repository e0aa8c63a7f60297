# Measurements for scripts/vm/compare.sh (not run in CI): raw-cache.
bench raw-cache
