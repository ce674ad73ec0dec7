#!/usr/bin/env bash
# CLI tests for `dsv4 logits` and `dsv4 switches` on a tiny synth checkpoint.
# Prints PASS/FAIL lines; needs $DSV4_BIN (tests/run.sh exports it).
set -u
BIN=${DSV4_BIN:-build/dsv4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "PASS $1"; }
bad() { echo "FAIL $1${2:+: $2}"; }

"$BIN" synth --config tiny --seed 3 --out "$tmp/m" >/dev/null 2>&1 || { bad logits_synth "synth failed"; exit 1; }
V=$(python3 -c "import json;print(json.load(open('$tmp/m/config.json'))['vocab_size'])" 2>/dev/null || echo 129280)

out=$("$BIN" logits --model "$tmp/m" --tokens 5,17,42 --out "$tmp/a.f32" 2>&1)
if [ $? -eq 0 ] && [ "$(stat -c %s "$tmp/a.f32")" -eq $((3 * V * 4)) ] && echo "$out" | grep -q "T=3 vocab=$V" \
   && echo "$out" | grep -q "argmax_last="; then ok logits_basic; else bad logits_basic "$out"; fi

if DSV4_DEFAULT_MODEL="$tmp/m" "$BIN" logits --tokens 5,17,42 --out "$tmp/dm.f32" >/dev/null 2>&1 \
   && cmp -s "$tmp/a.f32" "$tmp/dm.f32"; then
  ok logits_default_model; else bad logits_default_model; fi
msg=$(DSV4_DEFAULT_MODEL="$tmp/none" "$BIN" logits --tokens 5 --out "$tmp/dm.f32" 2>&1)
if echo "$msg" | grep -q "DSV4_DEFAULT_MODEL=$tmp/none has no config.json"; then ok logits_default_model_missing
else bad logits_default_model_missing "$msg"; fi

printf ' 5\n17 ,\t42\n' > "$tmp/toks.txt"
if "$BIN" logits --model "$tmp/m" --tokens-file "$tmp/toks.txt" --out "$tmp/b.f32" >/dev/null 2>&1 \
   && cmp -s "$tmp/a.f32" "$tmp/b.f32"; then ok logits_tokens_file; else bad logits_tokens_file; fi

seq -s, 100 249 > "$tmp/long.txt"   # 150 tokens: crosses window, compression boundaries, topk
"$BIN" logits --model "$tmp/m" --tokens-file "$tmp/long.txt" --out "$tmp/c.f32" >/dev/null 2>&1
"$BIN" logits --model "$tmp/m" --tokens-file "$tmp/long.txt" --chunk 1 --out "$tmp/d.f32" >/dev/null 2>&1
"$BIN" logits --model "$tmp/m" --tokens-file "$tmp/long.txt" --chunk 13 --out "$tmp/e.f32" >/dev/null 2>&1
if cmp -s "$tmp/c.f32" "$tmp/d.f32" && cmp -s "$tmp/c.f32" "$tmp/e.f32"; then ok logits_chunked_equals_prefill
else bad logits_chunked_equals_prefill; fi

if "$BIN" logits --model "$tmp/m" --tokens 5,17,42 --numerics reference --out "$tmp/r.f32" >/dev/null 2>&1 \
   && ! cmp -s "$tmp/a.f32" "$tmp/r.f32" \
   && "$BIN" logits --model "$tmp/m" --tokens 5,17,42 --set kv.sim=fp8 --set hc.state=bf16 --backend cpu \
        --out "$tmp/s.f32" >/dev/null 2>&1; then ok logits_numerics; else bad logits_numerics; fi

"$BIN" logits --model "$tmp/m" --tokens-file "$tmp/long.txt" --out "$tmp/t.f32" --trace "$tmp/tr.jsonl" >/dev/null 2>&1
n=$(wc -l < "$tmp/tr.jsonl" 2>/dev/null || echo 0)
if [ "$n" -eq $((150 * 5)) ] && grep -q '"picks":\[' "$tmp/tr.jsonl" && grep -q '"hash":true' "$tmp/tr.jsonl" \
   && awk -F'"weight_sum":' '{split($2,a,/[,}]/); d=a[1]-1.5; if (d<0) d=-d; if (d>1e-5) bad=1} END{exit bad}' \
        "$tmp/tr.jsonl"; then ok logits_trace
else bad logits_trace "lines $n"; fi

check_err() { # name, expected substring, args...
  local name=$1 want=$2; shift 2
  local msg; msg=$("$BIN" logits "$@" 2>&1); local rc=$?
  if [ $rc -ne 0 ] && echo "$msg" | grep -q -- "$want"; then ok "$name"; else bad "$name" "rc=$rc msg=$msg"; fi
}
check_err logits_err_token "outside the vocabulary" --model "$tmp/m" --tokens "5,$V" --out "$tmp/x.f32"
check_err logits_err_parse "not a non-negative integer" --model "$tmp/m" --tokens "5,abc" --out "$tmp/x.f32"
check_err logits_err_set "unknown switch 'foo'" --model "$tmp/m" --tokens 5 --set foo=1 --out "$tmp/x.f32"
check_err logits_err_value "accepted: none|fp8" --model "$tmp/m" --tokens 5 --set kv.sim=x --out "$tmp/x.f32"
check_err logits_err_profile "unknown numerics profile" --model "$tmp/m" --tokens 5 --numerics fast --out "$tmp/x.f32"
check_err logits_err_out "--out FILE is required" --model "$tmp/m" --tokens 5
check_err logits_err_model "nonexistent" --model "$tmp/nonexistent" --tokens 5 --out "$tmp/x.f32"
check_err logits_err_backend "built without CUDA" --model "$tmp/m" --tokens 5 --backend cuda --out "$tmp/x.f32"
check_err logits_err_backend_name "unknown backend 'tpu'" --model "$tmp/m" --tokens 5 --backend tpu --out "$tmp/x.f32"
check_err logits_err_empty "no token ids" --model "$tmp/m" --tokens " , " --out "$tmp/x.f32"
check_err logits_err_both "exactly one of" --model "$tmp/m" --tokens 5 --tokens-file "$tmp/toks.txt" --out "$tmp/x.f32"

sw=$("$BIN" switches 2>&1)
if echo "$sw" | grep -q "^kv.sim" && echo "$sw" | grep -q "moe.route_scale" && [ "$(echo "$sw" | grep -c '\[§')" -ge 11 ]
then ok switches_list; else bad switches_list; fi
m=$("$BIN" switches --measure --model "$tmp/m" --tokens 20 2>&1)
if echo "$m" | grep -q "kv.sim=fp8" && echo "$m" | grep -q "moe.route_scale=both"; then ok switches_measure
else bad switches_measure "$m"; fi
