#!/usr/bin/env bash
# Runs on the device machine (see docs/CUDA.md): the CUDA op tests, the end-to-end
# comparisons against the CPU backend, and `dsv4 bench` figures.  Needs the bundle
# from `tools/device/bundle.sh build-cuda carry` plus the test binaries in carry/bin.
# usage: bench/cuda_device.sh STAGE...   stages: ops e2e flash2 bench20 hf
# Logs go to $OUT (or /tmp/cuda-out); a summary is printed last.
set -u
OUT=${OUT:-/tmp/cuda-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/carry/lib:${LD_LIBRARY_PATH:-}"
export DSV4_BIN="$PWD/carry/bin/dsv4"
bin=carry/bin
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
note "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
for stage in "$@"; do
  case $stage in
  ops)
    timeout 300 $bin/test_cuda_ops >"$OUT/ops.log" 2>&1; note "ops rc=$? $(tail -1 "$OUT/ops.log")"
    grep -E "FAIL|rel|differ|error|identical" "$OUT/ops.log" | head -60 >>"$summary" ;;
  e2e)
    timeout 300 $bin/test_cuda_e2e >"$OUT/e2e.log" 2>&1; note "e2e rc=$? $(tail -1 "$OUT/e2e.log")"
    grep -vE "^PASS" "$OUT/e2e.log" | head -20 >>"$summary" ;;
  flash2)
    t0=$(date +%s)
    timeout 400 $bin/dsv4 synth --config flash --layers 2 --mtp 0 --seed 1 --out /dev/shm/flash2 >"$OUT/synth2.log" 2>&1
    note "synth flash2 rc=$? in $(( $(date +%s) - t0 )) s"
    DSV4_CUDA_FLASH2=/dev/shm/flash2 timeout 400 $bin/test_cuda_e2e test_flash2 >"$OUT/e2e_flash2.log" 2>&1
    note "e2e flash2 rc=$? $(tail -1 "$OUT/e2e_flash2.log")"
    grep -vE "^PASS" "$OUT/e2e_flash2.log" | head -20 >>"$summary"
    timeout 300 $bin/dsv4 bench --model /dev/shm/flash2 --backend cuda --prompt 2048 --gen 16 >"$OUT/bench_flash2.log" 2>&1
    note "bench flash2 rc=$?"; cat "$OUT/bench_flash2.log" >>"$summary" ;;
  *) note "unknown stage $stage" ;;
  esac
done
cat "$summary"
