#!/usr/bin/env bash
# Runs every built unit-test binary and every tests/cli_*.sh script, adds up the
# per-test PASS/FAIL lines and ends with "N passed, N failed".  Exit status is
# non-zero if anything failed or a binary crashed.
set -u
BUILD=${BUILD:-build}
# OpenMP threads sleep instead of spinning when idle: on a shared 2-core machine
# spinning makes every parallel region 5-15x slower (measured by the forward tests).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
export DSV4_BIN="$PWD/$BUILD/dsv4" DSV4_BUILD="$PWD/$BUILD"
passed=0; failed=0
log=$(mktemp)
for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  case "$t" in *.d) continue;; esac
  echo "== $t"
  "$t" >"$log" 2>&1; rc=$?
  cat "$log"
  p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log")
  if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then
    echo "FAIL $(basename "$t") (exited $rc without reporting a failure: crash?)"; f=$((f+1))
  fi
  passed=$((passed+p)); failed=$((failed+f))
done
for s in tests/cli_*.sh; do
  [ -f "$s" ] || continue
  echo "== $s"
  bash "$s" >"$log" 2>&1; rc=$?
  cat "$log"
  p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log")
  if [ $rc -ne 0 ] && [ "$f" -eq 0 ]; then echo "FAIL $s (exited $rc)"; f=$((f+1)); fi
  passed=$((passed+p)); failed=$((failed+f))
done
rm -f "$log"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
