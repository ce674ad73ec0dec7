#!/usr/bin/env bash
# tools/device/ktrace_report.py on a made-up trace (the device's CUPTI CSV format, times in ns): --layers cuts each
# step at every N-th launch of the boundary kernel, counted from the step's start, groups the layers by their kernel
# sequence and prints each kernel's median start and end from the end of the layer's first boundary launch, with
# the median end's lead over the row before; a bad argument is an error.  Prints PASS/FAIL lines.
set -u
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "PASS $1"; }
bad() { echo "FAIL $1${2:+: $2}"; }
R=tools/device/ktrace_report.py
# k NAME START_US END_US (step base B): one kernel record
k() { echo "K,$(( (B + $2) * 1000 )),$(( (B + $3) * 1000 )),0,13,1x1x1,32x1x1,$1"; }
for s in 0 1; do
  B=$((s * 1000 + 5000))
  k k_embed 0 1
  k k_hc 2 5                          # layer A starts (its t0: 5)
  if [ $s = 0 ]; then k k_w 4 15; else k k_w 4 17; fi   # ends at t0 + 10, then t0 + 12: median 11
  k k_hc 14 20
  k k_m 19 35
  k k_hc 34 40                        # layer B starts; it closes at the next step's first k_hc (the last is cut)
  k k_x 39 45
  k k_hc 44 50
  k k_head 50 60
done >"$tmp/t.csv"
out=$(python3 $R "$tmp/t.csv" --steps 2 --top 0 --layers k_hc 2 2>&1)
rc=$?
row() { echo "$out" | grep -Eq "^    $1 +start +$2 +end +$3 +\\$4\$"; }
if [ $rc = 0 ] && echo "$out" | grep -q "cut every 2 launches of k_hc; 3 layers in 2 steps, 2 kinds" \
   && echo "$out" | grep -q "2 layers (1.0 a step), 4 kernels" && row k_w -1.0 11.0 +11.0 && row k_hc 9.0 15.0 +4.0 \
   && row k_m 14.0 30.0 +15.0 && row "k_hc #2" 29.0 35.0 +5.0 \
   && echo "$out" | grep -q "1 layers (0.5 a step), 5 kernels" && row k_x -1.0 5.0 +5.0 \
   && row k_head 10.0 20.0 +10.0; then
  ok ktrace_layers; else bad ktrace_layers "rc=$rc $out"; fi
# the per-kernel table of the same trace: k_hc 4 calls a step
out=$(python3 $R "$tmp/t.csv" --steps 2 2>&1)
if [ $? = 0 ] && echo "$out" | grep -Eq "^k_hc +4\.0 "; then ok ktrace_table; else bad ktrace_table "$out"; fi
out=$(python3 $R "$tmp/t.csv" --layer k_hc 2 2>&1)
if [ $? != 0 ] && echo "$out" | grep -q "unknown argument --layer"; then ok ktrace_bad_arg
else bad ktrace_bad_arg "$out"; fi
for args in "--layers k_hc" "--layers k_hc 0" "--layers k_hc two"; do
  out=$(python3 $R "$tmp/t.csv" $args 2>&1)
  if [ $? != 0 ] && echo "$out" | grep -q "^--layers needs a kernel name pattern and a count N >= 1"; then
    ok "ktrace_bad_layers ($args)"; else bad "ktrace_bad_layers ($args)" "$out"; fi
done
out=$(python3 $R "$tmp/t.csv" --steps 3 2>&1)
if [ $? != 0 ] && echo "$out" | grep -q "only 2 passes start with k_embed"; then ok ktrace_few_steps
else bad ktrace_few_steps "$out"; fi
