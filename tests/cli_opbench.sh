#!/usr/bin/env bash
# CLI tests for `dsv4 opbench` on a tiny synth checkpoint (CPU backend): one line per op of
# the chosen layer with its figures, the layer choice, and errors for bad options.
# Prints PASS/FAIL lines; needs $DSV4_BIN (tests/run.sh exports it).
set -u
BIN=${DSV4_BIN:-build/dsv4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "PASS $1"; }
bad() { echo "FAIL $1${2:+: $2}"; }

"$BIN" synth --config tiny --seed 2 --out "$tmp/m" >/dev/null 2>&1 || { bad opbench_synth "synth failed"; exit 1; }

# default layer: the first with an indexer (ratio 4); every op of it once, figures numeric
out=$("$BIN" opbench --model "$tmp/m" --backend cpu --reps 2 --copy-mb 2 2>&1)
rc=$?
num='[0-9]+\.[0-9]+'
n=0
for op in "copy" "hc_pre attn" "rmsnorm attn" "matmul wq_a" "matmul wq_b" "rope q" "matmul wkv" \
          "matmul comp.wkv" "matmul comp.wgate" "matmul idx.comp.wkv" "matmul idx.comp.wgate" "matmul idx.wq_b" \
          "matmul idx.weights_proj" "matmul_grouped wo_a" "matmul wo_b" "hc_post" "matmul gate" "moe" \
          "hc_head" "matmul head"; do
  c=$(echo "$out" | grep -Ec "^$op +.* $num +$num +$num +$num +$num%$")
  [ "$c" = 1 ] && n=$((n+1))
done
if [ $rc -eq 0 ] && [ $n = 20 ] && echo "$out" | grep -Eq "layer [0-9]+ \(compress ratio 4\), rows 1, 2 calls per op" \
   && echo "$out" | grep -Eq "^copy +2 MB, read \+ written .* 100\.0%$"; then
  ok opbench_cpu_ops; else bad opbench_cpu_ops "rc=$rc ops=$n $out"; fi

# a ratio-0 layer has no compressor or indexer ops; 3 rows
out=$("$BIN" opbench --model "$tmp/m" --backend cpu --layer 0 --rows 3 --reps 1 --copy-mb 1 2>&1)
rc=$?
if [ $rc -eq 0 ] && echo "$out" | grep -q "layer 0 (compress ratio 0), rows 3" && ! echo "$out" | grep -q "idx\." \
   && [ "$(echo "$out" | grep -Ec " $num%$")" = 14 ]; then
  ok opbench_layer0; else bad opbench_layer0 "rc=$rc $out"; fi

out=$("$BIN" opbench --model "$tmp/m" --backend cpu --layer 120 --reps 1 2>&1)
if [ $? -eq 1 ] && echo "$out" | grep -Eq "layer 120: the model has [0-9]+ layers"; then ok opbench_no_such_layer
else bad opbench_no_such_layer "$out"; fi

out=$("$BIN" opbench --model "$tmp/m" --rows 0 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "rows: '0' is not a whole number"; then ok opbench_bad_rows
else bad opbench_bad_rows "$out"; fi

out=$("$BIN" opbench --model "$tmp/m" --reps x 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "reps: 'x' is not a whole number"; then ok opbench_bad_reps
else bad opbench_bad_reps "$out"; fi

out=$("$BIN" opbench --model "$tmp/m" --backend tpu 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "unknown backend 'tpu'"; then ok opbench_bad_backend
else bad opbench_bad_backend "$out"; fi

out=$("$BIN" opbench --model "$tmp/m" --frobnicate 1 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "unknown option --frobnicate"; then ok opbench_unknown_option
else bad opbench_unknown_option "$out"; fi

out=$("$BIN" opbench 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "model DIR is required"; then ok opbench_no_model
else bad opbench_no_model "$out"; fi

out=$("$BIN" opbench --model "$tmp/none" --backend cpu 2>&1)
if [ $? -eq 1 ] && echo "$out" | grep -q "$tmp/none"; then ok opbench_missing_model; else bad opbench_missing_model "$out"; fi
