# Measurements for scripts/vm/compare.sh (not run in CI): raw-backing.
bench raw-backing
