#!/usr/bin/env bash
# CLI tests for `dsv4 diff` and `dsv4 fidelity` (issue 7) on the default model,
# with tests/fake_endpoint.py standing in for an OpenAI-compatible server.
# Prints PASS/FAIL lines; needs $DSV4_BIN (tests/run.sh exports it).
set -u
BIN=${DSV4_BIN:-build/dsv4}
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=$(dirname "$BIN")/default-model
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$tmp"; }
trap cleanup EXIT
ok() { echo "PASS $1"; }
bad() { echo "FAIL $1${2:+: $(echo "$2" | tail -5)}"; }
[ -f "$MODEL/config.json" ] || { bad fidelity_model "no default model at $MODEL (make default-model)"; exit 1; }
# first compressed-sparse (ratio 4) layer of the model
R4=$(python3 -c "import json;print(json.load(open('$MODEL/config.json'))['compress_ratios'].index(4))")

# ----- dsv4 diff -----
out=$("$BIN" diff --random 96 --a exact --b exact 2>&1)
if [ $? -eq 0 ] && [ "$(echo "$out" | tail -1)" = "no divergence above 1e-05" ] && ! echo "$out" | grep -q '  <$'
then ok diff_identical_specs; else bad diff_identical_specs "$out"; fi

out=$("$BIN" diff --random 96 --a exact --b exact,mhc.gemm=bf16 --json "$tmp/d.json" 2>&1)
if [ "$(echo "$out" | tail -1)" = "first divergence: layer 0 attn.hc_pre" ] \
   && python3 -c "import json,sys;d=json.load(open('$tmp/d.json'));sys.exit(d['first_divergence']!={'layer':0,'op':'attn.hc_pre'})"
then ok diff_mhc_gemm_layer0_hc_pre; else bad diff_mhc_gemm_layer0_hc_pre "$out"; fi

# touches one op of one layer type: the stored indexer keys of ratio-4 layers
out=$("$BIN" diff --random 96 --a exact --b exact,indexer.keys=fp8 2>&1)
if [ "$(echo "$out" | tail -1)" = "first divergence: layer $R4 indexer.keys" ] \
   && echo "$out" | grep -qE "^$R4 +indexer.picks .*  <$"
then ok diff_indexer_keys_first_ratio4_layer; else bad diff_indexer_keys_first_ratio4_layer "$out"; fi

out=$("$BIN" diff --random 48 --a exact --b exact,moe.route_scale=both --quiet 2>&1)
if [ "$(echo "$out" | tail -1)" = "first divergence: layer 0 moe.route" ]; then ok diff_route_scale_layer0_route
else bad diff_route_scale_layer0_route "$out"; fi

out=$("$BIN" diff --tokens 1,2,3 --a exact --b exact,nope=1 2>&1); rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -q "unknown switch 'nope'"; then ok diff_unknown_switch; else bad diff_unknown_switch "$out"; fi
out=$("$BIN" diff --tokens 1,2,3 --a mhc.gemm=bf16 --b exact 2>&1); rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -q "must start with a profile name"; then ok diff_malformed_spec
else bad diff_malformed_spec "$out"; fi
out=$("$BIN" diff --tokens 1,2,3 --a exact --b exact,backend=cuda 2>&1); rc=$?
if [ $rc -ne 0 ] && echo "$out" | grep -q "backend cuda not built"; then ok diff_backend_cuda_message
else bad diff_backend_cuda_message "$out"; fi
out=$("$BIN" diff --tokens 1,x,3 --a exact --b exact 2>&1); rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -q "'x' is not a non-negative integer id"; then ok diff_bad_tokens
else bad diff_bad_tokens "$out"; fi

# ----- dsv4 fidelity ab / indexer-recall -----
out=$("$BIN" fidelity ab --random 64 --every 16 --switches mhc.gemm=bf16,moe.route_scale=both --json "$tmp/ab.json" 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -qE "^mhc.gemm=bf16 .* ok \(sum = 1.5\)" \
   && echo "$out" | grep -qE "^moe.route_scale=both .* FLAGGED" && echo "$out" | grep -q "routing invariant violated" \
   && python3 -c "import json,sys;d=json.load(open('$tmp/ab.json'));sys.exit([r['routing_ok'] for r in d['rows']]!=[True,False])"
then ok fidelity_ab_flags_double_scaling; else bad fidelity_ab_flags_double_scaling "$out"; fi

out=$("$BIN" fidelity indexer-recall --lengths 96,160 --window 32 --json "$tmp/ir.json" --svg "$tmp/ir.svg" 2>&1)
if [ $? -eq 0 ] && python3 -c "
import json,sys,xml.dom.minidom as m
d=json.load(open('$tmp/ir.json')); m.parse('$tmp/ir.svg')
r=[x for l in d['layers'] for x in l['recall']]
sys.exit(not (d['layers'][0]['layer']==$R4 and all(x is not None and 0<=x<=1 for x in r)))"
then ok fidelity_indexer_recall; else bad fidelity_indexer_recall "$out"; fi

# ----- needle / multiturn against fake endpoints -----
start_fake() { # start_fake NAME MODE [ARGS]: sets PORT
  local f="$tmp/$1.port"; shift
  python3 "$HERE/fake_endpoint.py" "$@" >"$f" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do grep -q '^PORT' "$f" && break; sleep 0.1; done
  PORT=$(awk '/^PORT/{print $2}' "$f")
}
start_fake good correct; GOOD=$PORT
start_fake wrong wrong; WRONG=$PORT
start_fake garbage garbage; GARBAGE=$PORT
start_fake dying correct --fail-after 2; DYING=$PORT
start_fake slow slow; SLOW=$PORT

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$GOOD" --model fake --lengths 200,800 --depths 0,50,100 \
      --json "$tmp/n.json" --html "$tmp/n.html" 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "needle score: 6/6 (100.0%)" \
   && python3 -c "import json,sys;d=json.load(open('$tmp/n.json'));sys.exit(not(d['score']==1 and not d['incomplete'] and not d['meaningless']))"
then ok needle_fake_correct_100; else bad needle_fake_correct_100 "$out"; fi

if python3 - "$tmp/n.html" <<'PY'
import sys
from html.parser import HTMLParser
VOID = {"meta", "br", "img", "input", "link", "hr", "rect", "line", "polyline"}
class P(HTMLParser):
    def __init__(s):
        super().__init__(); s.stack = []; s.bad = []; s.rects = 0; s.svg = 0
    def handle_starttag(s, t, a):
        if t == "svg": s.svg += 1
        if t == "rect": s.rects += 1
        if t not in VOID: s.stack.append(t)
    def handle_startendtag(s, t, a):
        if t == "rect": s.rects += 1
    def handle_endtag(s, t):
        if t in VOID: return
        if not s.stack or s.stack[-1] != t: s.bad.append(t); return
        s.stack.pop()
p = P(); p.feed(open(sys.argv[1]).read()); p.close()
sys.exit(0 if not p.bad and not p.stack and p.svg == 1 and p.rects >= 6 else 1)
PY
then ok needle_html_wellformed_heatmap; else bad needle_html_wellformed_heatmap "$(head -c 300 "$tmp/n.html")"; fi

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$WRONG" --model fake --lengths 200 --depths 0,100 \
      --json "$tmp/w.json" 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "needle score: 0/2 (0.0%) of 2 planned$" \
   && python3 -c "import json,sys;d=json.load(open('$tmp/w.json'));sys.exit(not(d['score']==0 and d['answered']==2))"
then ok needle_fake_wrong_0; else bad needle_fake_wrong_0 "$out"; fi

out=$("$BIN" fidelity multiturn --endpoint "http://127.0.0.1:$GOOD/v1" --model fake --turns 1,4 --conversations 2 \
      --tool-tokens 400 --json "$tmp/m.json" --html "$tmp/m.html" 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "multiturn score: 4/4 (100.0%)" && grep -q "<table>" "$tmp/m.html"
then ok multiturn_fake_correct_100; else bad multiturn_fake_correct_100 "$out"; fi

out=$("$BIN" fidelity multiturn --endpoint "http://127.0.0.1:$WRONG" --model fake --turns 2 --conversations 2 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "multiturn score: 0/2 (0.0%) of 2 planned$"; then ok multiturn_fake_wrong_0
else bad multiturn_fake_wrong_0 "$out"; fi

# dead port: bind-and-release gives a port nobody listens on
DEAD=$(python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$DEAD" --model fake --lengths 100 --depths 50 2>&1); rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q "http://127.0.0.1:$DEAD/v1/chat/completions: cannot reach the endpoint"
then ok endpoint_unreachable_error; else bad endpoint_unreachable_error "$out"; fi

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$GARBAGE" --model fake --lengths 100 --depths 50 2>&1); rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q "response is not JSON"; then ok endpoint_garbage_error
else bad endpoint_garbage_error "$out"; fi

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$SLOW" --model fake --lengths 100 --depths 50 \
      --request-timeout 1 2>&1); rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q "no complete answer within 1 s (timed out)"; then ok endpoint_timeout_error
else bad endpoint_timeout_error "$out"; fi

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$DYING" --model fake --lengths 100,200 --depths 0,100 \
      --json "$tmp/p.json" --html "$tmp/p.html" 2>&1); rc=$?
if [ $rc -eq 1 ] && echo "$out" | grep -q "HTTP 500" && grep -q "Incomplete run" "$tmp/p.html" \
   && python3 -c "import json,sys;d=json.load(open('$tmp/p.json'));sys.exit(not(d['incomplete'] and d['answered']==2 and d['passed']==2 and d['requests']==3))"
then ok endpoint_fails_midrun_partial_kept; else bad endpoint_fails_midrun_partial_kept "$out"; fi

out=$("$BIN" fidelity needle --endpoint "http://127.0.0.1:$GOOD" --model fake --lengths 100,200 --depths 0,50,100 \
      --max-requests 4 --json "$tmp/b.json" 2>&1)
if [ $? -eq 0 ] && python3 -c "import json,sys;d=json.load(open('$tmp/b.json'));sys.exit(not(d['incomplete'] and d['requests']==4 and 'max-requests' in d['stop_reason']))"
then ok needle_max_requests_bound; else bad needle_max_requests_bound "$out"; fi

out=$("$BIN" fidelity needle --endpoint "ftp://x" --model fake 2>&1); rc=$?
if [ $rc -ne 0 ] && echo "$out" | grep -q "expected an http:// or https:// URL"; then ok endpoint_bad_url
else bad endpoint_bad_url "$out"; fi

# the local model: one tiny request; the report must say the scores are meaningless
out=$("$BIN" fidelity needle --model "$MODEL" --lengths 32 --depths 50 --max-tokens 4 --html "$tmp/l.html" 2>&1)
if [ $? -eq 0 ] && echo "$out" | grep -q "scores are meaningless" && grep -q 'id="meaningless"' "$tmp/l.html"
then ok needle_local_meaningless_note; else bad needle_local_meaningless_note "$out"; fi
