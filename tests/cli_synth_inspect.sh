#!/usr/bin/env bash
# CLI tests for `dsv4 synth` and `dsv4 inspect`: round trip, full-size shapes,
# the Flash figures, broken checkpoints.  Prints PASS/FAIL lines.
# Needs $DSV4_BIN (tests/run.sh sets it).  DSV4_SKIP_BIG=1 skips the ~9 GB test.
set -u
BIN=${DSV4_BIN:-build/dsv4}
T=$(mktemp -d /tmp/dsv4-cli-synth-XXXXXX)
trap 'rm -rf "$T"' EXIT

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1${2:+: $2}"; }
# jq-free JSON field read (numbers and strings at top level)
jget() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d'+sys.argv[2]))" "$1" "$2"; }

# ----- synth tiny, inspect round trip -----
if "$BIN" synth --config tiny --seed 3 --out "$T/tiny" >"$T/synth.out" 2>&1 &&
   "$BIN" inspect "$T/tiny" --json >"$T/dir.json" 2>"$T/dir.err" &&
   "$BIN" inspect --config tiny --json >"$T/cfg.json" 2>&1; then
  v=$(jget "$T/dir.json" "['verdict']"); a=$(jget "$T/dir.json" "['tensors']")
  b=$(jget "$T/cfg.json" "['tensors']"); bound=$(jget "$T/dir.json" "['tensors_bound']")
  if [ "$v" = OK ] && [ "$a" = "$b" ] && [ "$bound" = "$b" ] && [ "$b" = 508 ]; then pass synth_tiny_roundtrip
  else fail synth_tiny_roundtrip "verdict=$v tensors=$a/$b bound=$bound"; fi
else
  fail synth_tiny_roundtrip "$(cat "$T/synth.out" "$T/dir.err" 2>/dev/null | tail -3)"
fi
"$BIN" inspect "$T/tiny" >"$T/dir.txt" 2>&1
if grep -q '^verdict: OK (508 tensors bound' "$T/dir.txt" && grep -q '^  ratios: 0 4 8 4 8 | mtp 0' "$T/dir.txt"; then
  pass inspect_tiny_text
else fail inspect_tiny_text "$(grep -E 'verdict|ratios' "$T/dir.txt")"; fi

# ----- inspect --config flash: spec figures -----
"$BIN" inspect --config flash --json >"$T/flash.json" 2>&1
"$BIN" inspect --config flash >"$T/flash.txt" 2>&1
n=$(jget "$T/flash.json" "['tensors']"); by=$(jget "$T/flash.json" "['bytes']")
tot=$(jget "$T/flash.json" "['params_without_mtp']"); act=$(jget "$T/flash.json" "['params_active']")
kv=$(jget "$T/flash.json" "['kv_bytes_per_token']")
if [ "$n" = 69187 ] && [ "$by" = 159609485896 ] && [ $((tot / 1000000000)) = 284 ] && [ $((act / 1000000000)) = 13 ] &&
   [ "${kv%.0}" = 6880 ] && grep -q '284.3B without MTP' "$T/flash.txt" && grep -q 'active per token: 13.3B' "$T/flash.txt"; then
  pass inspect_flash_figures
else fail inspect_flash_figures "tensors=$n bytes=$by total=$tot active=$act kv=$kv"; fi
if grep -q 'layer r=0: 1565 x2, layer r=4: 1576 x21, layer r=128: 1569 x20, mtp r=0: 1575 x1, globals: 6' "$T/flash.txt" &&
   grep -q 'ratios: 0 0 (4 128)x20 4 | mtp 0' "$T/flash.txt"; then pass inspect_flash_layers
else fail inspect_flash_layers "$(grep -E 'tensors per layer|ratios' "$T/flash.txt")"; fi

# ----- a config.json that contradicts the tensors -----
cp -r "$T/tiny" "$T/badcfg"
python3 - "$T/badcfg/config.json" <<'EOF'
import json, sys
p = sys.argv[1]; d = json.load(open(p)); d["hidden_size"] = 256; json.dump(d, open(p, "w"), indent=1)
EOF
"$BIN" inspect "$T/badcfg" >"$T/bad.out" 2>"$T/bad.err"; rc=$?
if [ $rc = 1 ] && grep -q '^verdict: BROKEN' "$T/bad.out" && grep -q 'config.json disagrees with the tensors: hidden_size = 256' "$T/bad.err"; then
  pass inspect_config_contradiction
else fail inspect_config_contradiction "rc=$rc $(head -c 300 "$T/bad.err")"; fi

# ----- a truncated shard -----
"$BIN" synth --config tiny --out "$T/sharded" --shard-bytes 20M >/dev/null 2>&1
last=$(ls "$T/sharded"/model-*.safetensors | tail -1)
truncate -s -1000 "$last"
"$BIN" inspect "$T/sharded" >"$T/trunc.out" 2>"$T/trunc.err"; rc=$?
if [ $rc = 1 ] && grep -q '^verdict: BROKEN' "$T/trunc.out" && grep -q "$(basename "$last")" "$T/trunc.err"; then
  pass inspect_truncated_shard
else fail inspect_truncated_shard "rc=$rc $(head -c 300 "$T/trunc.err")"; fi

# ----- a missing tensor (sharded index still lists it) and bad arguments -----
"$BIN" inspect "$T/nonexistent" >/dev/null 2>"$T/ne.err"; rc1=$?
"$BIN" synth --config nosuch --out "$T/x" >/dev/null 2>"$T/ns.err"; rc2=$?
"$BIN" synth --config tiny --out "$T/x" --experts int3 >/dev/null 2>"$T/ex.err"; rc3=$?
"$BIN" synth --config tiny --out "$T/x" --layers 99 >/dev/null 2>"$T/ly.err"; rc4=$?
"$BIN" inspect --config tiny --bogus >/dev/null 2>&1; rc5=$?
if [ $rc1 != 0 ] && [ $rc1 -lt 128 ] && [ $rc2 != 0 ] && [ $rc2 -lt 128 ] && [ $rc3 != 0 ] && [ $rc3 -lt 128 ] &&
   [ $rc4 != 0 ] && [ $rc4 -lt 128 ] && [ $rc5 != 0 ] && [ $rc5 -lt 128 ] &&
   grep -q 'nosuch' "$T/ns.err" && grep -q 'int3' "$T/ex.err" && grep -q 'layers' "$T/ly.err"; then
  pass cli_bad_arguments
else fail cli_bad_arguments "rc=$rc1 $rc2 $rc3 $rc4 $rc5"; fi

# ----- full-size shapes: Flash, 2 layers, no MTP (~9 GB, deleted right after) -----
if [ "${DSV4_SKIP_BIG:-0}" = 1 ]; then
  echo "skip synth_flash_full_size (DSV4_SKIP_BIG=1)"
else
  t0=$(date +%s)
  if "$BIN" synth --config flash --layers 2 --mtp 0 --out "$T/flash2" >"$T/f2.out" 2>&1 &&
     "$BIN" inspect "$T/flash2" --json >"$T/f2.json" 2>"$T/f2.err"; then
    t1=$(date +%s)
    v=$(jget "$T/f2.json" "['verdict']"); n=$(jget "$T/f2.json" "['tensors_bound']")
    lt=$(jget "$T/f2.json" "['layer_tensors'][0]['tensors']"); ll=$(jget "$T/f2.json" "['layer_tensors'][0]['layers']")
    # 2 ratio-0 layers of 1,565 (spec §4.1) + 6 globals
    if [ "$v" = OK ] && [ "$n" = 3136 ] && [ "$lt" = 1565 ] && [ "$ll" = 2 ]; then
      pass "synth_flash_full_size ($((t1 - t0)) s; $(tail -1 "$T/f2.out"))"
    else fail synth_flash_full_size "verdict=$v bound=$n per-layer=$lt x$ll"; fi
  else
    fail synth_flash_full_size "$(tail -2 "$T/f2.out" "$T/f2.err" 2>/dev/null)"
  fi
  rm -rf "$T/flash2"
fi
