#!/usr/bin/env bash
# CLI tests for `dsv4 bench` on a tiny synth checkpoint (CPU backend): the figures it
# must print, batched decode over cloned sequences, and its errors for bad options.
# Prints PASS/FAIL lines; needs $DSV4_BIN (tests/run.sh exports it).
set -u
BIN=${DSV4_BIN:-build/dsv4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "PASS $1"; }
bad() { echo "FAIL $1${2:+: $2}"; }

"$BIN" synth --config tiny --seed 2 --out "$tmp/m" >/dev/null 2>&1 || { bad bench_synth "synth failed"; exit 1; }

out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 40 --gen 3 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "prefill 40 tokens in" \
   && echo "$out" | grep -Eq "decode batch 1 at context 40: 3 steps in [0-9.]+ s = [0-9.]+ ms/step"; then
  ok bench_cpu_batch1; else bad bench_cpu_batch1 "$out"; fi

out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 20 --gen 2 --batch 3 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "batch 3 = 3 clones of the sequence prefilled above" \
   && echo "$out" | grep -Eq "decode batch 3 at context 20: 2 steps"; then
  ok bench_cpu_batch3_clones; else bad bench_cpu_batch3_clones "$out"; fi

# per-step spread: min <= median <= max, all above zero, after the asked warm-up steps
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 16 --gen 4 --warmup 2 2>&1)
line=$(echo "$out" | grep "^bench: decode step times (each step's wall time, after 2 warm-up steps)")
if [ -n "$line" ] && echo "$line" | awk '{for (i = 1; i <= NF; i++) if ($i == "min") a = $(i + 1); else if ($i == "median") b = $(i + 1);
    else if ($i == "max") c = $(i + 1)} END {exit !(a > 0 && a <= b && b <= c)}'; then
  ok bench_step_spread; else bad bench_step_spread "$out"; fi

# greedy at batch 1 (dsv4_seq_greedy against the host-picking loop, the same tokens) unless --greedy 0;
# not at batch 3
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 24 --gen 5 --warmup 2 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -Eq "^bench: greedy decode batch 1 at context 24 \(device picks, dsv4_seq_greedy\): 5 steps in [0-9.]+ s = [0-9.]+ ms/step" \
   && echo "$out" | grep -Eq "^bench: greedy decode with host picks .*: [0-9.]+ ms/step; tokens of the two identical over 7 steps"; then
  ok bench_greedy; else bad bench_greedy "$out"; fi
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 24 --gen 2 --greedy 0 2>&1)
if [ $? -eq 0 ] && ! echo "$out" | grep -q "greedy" && echo "$out" | grep -q "^bench: decode batch 1 at context 24"; then
  ok bench_greedy_off; else bad bench_greedy_off "$out"; fi
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 24 --gen 2 --batch 3 2>&1)
if [ $? -eq 0 ] && ! echo "$out" | grep -q "greedy" && echo "$out" | grep -q "^bench: decode batch 3 at context 24"; then
  ok bench_greedy_not_batched; else bad bench_greedy_not_batched "$out"; fi
out=$("$BIN" bench --model "$tmp/m" --backend cpu --greedy 2 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "greedy: '2' is not a whole number in range"; then ok bench_bad_greedy
else bad bench_bad_greedy "$out"; fi

out=$("$BIN" bench --model "$tmp/m" --backend cpu --warmup x 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "warmup: 'x' is not a whole number in range"; then ok bench_bad_warmup
else bad bench_bad_warmup "$out"; fi

# lists: every prompt length x every batch size, one load
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 12,30 --batch 1,2 --gen 1 2>&1)
rc=$?
n=$(echo "$out" | grep -c "^bench: decode batch")
if [ $rc -eq 0 ] && [ "$n" = 4 ] && [ "$(echo "$out" | grep -c "^bench: opened")" = 1 ] \
   && echo "$out" | grep -q "prefill 30 tokens" && echo "$out" | grep -q "decode batch 2 at context 30"; then
  ok bench_lists; else bad bench_lists "$out"; fi
out=$("$BIN" bench --model "$tmp/m" --backend cpu --batch 1,,2 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "batch: '1,,2' is not a whole number in range (or a comma list"; then
  ok bench_bad_list; else bad bench_bad_list "$out"; fi

out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 0 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "prompt: '0' is not a whole number in range"; then ok bench_bad_prompt
else bad bench_bad_prompt "$out"; fi

# --set: numerics switches over the profile, named in the header line; a bad one names what is accepted
out=$("$BIN" bench --model "$tmp/m" --backend cpu --prompt 8 --gen 1 --op-profile 0 --set moe.dot=mma --set kv.sim=fp8 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "numerics exact.*kv.sim=fp8" && echo "$out" | grep -q "numerics exact.*moe.dot=mma"; then
  ok bench_set; else bad bench_set "$out"; fi
out=$("$BIN" bench --model "$tmp/m" --backend cpu --set moe.dot=bad 2>&1)
if [ $? -ne 0 ] && echo "$out" | grep -q "switch 'moe.dot' has no value 'bad' (accepted: f32|mma|e4m3)"; then ok bench_bad_set
else bad bench_bad_set "$out"; fi

out=$("$BIN" bench --model "$tmp/m" --frobnicate 1 2>&1)
if [ $? -eq 2 ] && echo "$out" | grep -q "unknown option --frobnicate"; then ok bench_unknown_option
else bad bench_unknown_option "$out"; fi

out=$("$BIN" bench --model "$tmp/none" --backend cpu 2>&1)
if [ $? -ne 0 ] && echo "$out" | grep -q "$tmp/none"; then ok bench_missing_model; else bad bench_missing_model "$out"; fi
