#!/usr/bin/env bash
# tests/cli_server.sh: `dsv4 serve` on loopback, driven by curl (and by the
# official openai npm client when tests/node/node_modules exists).  Starts the
# server on a free port on the default model, runs every case, prints PASS/FAIL
# lines, and always stops the server (trap).  JSON is read with node, which CI
# installs for the npm client anyway.
set -u
BIN=${DSV4_BIN:-build/dsv4}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TMP=$(mktemp -d)
KEY=test-key-123
H="Authorization: Bearer $KEY"
SRV_PID=""
BG_PIDS=()
cleanup() {
  for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null; done
  [ -n "$SRV_PID" ] && kill -9 "$SRV_PID" 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

pass() { echo "PASS $1"; if [ -n "${DSV4_TIMING:-}" ]; then echo "  (${SECONDS}s)"; fi; }
fail() { echo "FAIL $1${2:+: $2}"; }
check() { # check NAME CONDITION-COMMAND...
  local n=$1; shift
  if "$@"; then pass "$n"; else fail "$n"; fi
}

# js FILE EXPR: evaluates EXPR with j = the JSON in FILE
js() { node -e 'const j=JSON.parse(require("fs").readFileSync(process.argv[1],"utf8")); const v=eval(process.argv[2]); console.log(typeof v==="object"?JSON.stringify(v):v)' "$1" "$2" 2>/dev/null; }
# sse_check FILE: every event is data: JSON or [DONE], [DONE] last; prints the content text
sse_text() { node -e '
const s=require("fs").readFileSync(process.argv[1],"utf8"); let out="", done=false, bad=0;
for (const ev of s.split("\n\n")) { if (!ev.trim()) continue;
  if (!ev.startsWith("data: ")) { bad++; continue; } const d=ev.slice(6);
  if (d==="[DONE]") { done=true; continue; } if (done) bad++;
  try { const j=JSON.parse(d); const c=j.choices&&j.choices[0]; if (c&&c.delta&&c.delta.content) out+=c.delta.content; if (c&&typeof c.text==="string") out+=c.text; } catch(e) { bad++; } }
if (!done||bad) { console.log("BAD SSE done="+done+" bad="+bad); process.exit(1); } process.stdout.write(out);' "$1"; }

metric() { curl -s "http://127.0.0.1:$PORT/metrics" | awk -v m="$1" '$1==m {print $2}'; }
wait_metric() { # wait_metric NAME VALUE SECONDS
  local i; for ((i = 0; i < $3 * 10; i++)); do [ "$(metric "$1")" = "$2" ] && return 0; sleep 0.1; done; return 1
}

post() { # post PATH BODY OUTFILE -> prints the HTTP status
  curl -s -o "$3" -w '%{http_code}' -H "$H" -H 'Content-Type: application/json' --data-binary "$2" "http://127.0.0.1:$PORT$1"
}

# ----- start -----
"$BIN" serve --port 0 --ctx 1024 --max-seqs 3 --queue 2 --api-key "$KEY" --max-body 65536 --grace 2 --test-hooks \
  >"$TMP/server.log" 2>&1 &
SRV_PID=$!
PORT=""
for ((i = 0; i < 300; i++)); do
  PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/server.log" | sed 's/.*://')
  [ -n "$PORT" ] && break
  kill -0 "$SRV_PID" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$PORT" ] || ! curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then
  fail server_start "$(tail -5 "$TMP/server.log")"
  exit 1
fi
pass server_start

# ----- happy paths -----
U='{"role":"user","content":"Hello there"}'
code=$(post /v1/chat/completions "{\"messages\":[$U],\"max_tokens\":4,\"temperature\":0}" "$TMP/chat.json")
check chat_nonstream [ "$code" = 200 -a "$(js "$TMP/chat.json" 'j.object+":"+j.choices[0].message.role+":"+j.usage.completion_tokens+":"+typeof j.choices[0].message.content')" = "chat.completion:assistant:4:string" ]

code=$(post /v1/chat/completions "{\"messages\":[$U],\"max_tokens\":4,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" "$TMP/chat.sse")
streamed=$(sse_text "$TMP/chat.sse"); sse_ok=$?
check chat_stream_done [ "$code" = 200 -a $sse_ok = 0 ]
check chat_stream_same_text_as_nonstream [ "$streamed" = "$(js "$TMP/chat.json" 'j.choices[0].message.content')" ]
check chat_stream_include_usage grep -q '"choices":\[\],"usage":{"prompt_tokens":[0-9]*,"completion_tokens":4' "$TMP/chat.sse"
check chat_stream_role_first [ "$(grep -m1 -o '"delta":{"role":"assistant"' "$TMP/chat.sse")" != "" ]
check chat_usage_cached_tokens [ "$(grep -o '"cached_tokens":[0-9]*' "$TMP/chat.sse" | head -1 | cut -d: -f2)" -gt 0 ]

code=$(post /v1/chat/completions "{\"model\":\"deepseek-reasoner\",\"messages\":[$U],\"max_tokens\":3,\"seed\":5,\"logprobs\":true,\"top_logprobs\":2}" "$TMP/think.json")
check chat_logprobs [ "$code" = 200 -a "$(js "$TMP/think.json" 'j.choices[0].logprobs.content.length+":"+j.choices[0].logprobs.content[0].top_logprobs.length')" = "3:2" ]
check chat_thinking_reasoning_content [ "$(js "$TMP/think.json" 'typeof (j.choices[0].message.reasoning_content ?? j.choices[0].message.content)')" = string ]

code=$(post /v1/completions '{"prompt":"Once upon a time","max_tokens":3,"temperature":0}' "$TMP/cmpl.json")
check completions_text [ "$code" = 200 -a "$(js "$TMP/cmpl.json" 'j.object+":"+j.usage.completion_tokens')" = "text_completion:3" ]
code=$(post /v1/completions '{"prompt":[1,2,3],"max_tokens":2,"temperature":0,"stream":true}' "$TMP/cmpl.sse")
sse_text "$TMP/cmpl.sse" >/dev/null; sse_ok=$?
check completions_ids_stream [ "$code" = 200 -a $sse_ok = 0 ]

code=$(curl -s -o "$TMP/models.json" -w '%{http_code}' -H "$H" "http://127.0.0.1:$PORT/v1/models")
check models [ "$code" = 200 -a "$(js "$TMP/models.json" 'j.object+":"+j.data[0].object')" = "list:model" ]
check health [ "$(curl -s "http://127.0.0.1:$PORT/health")" = '{"status":"ok"}' ]
curl -s "http://127.0.0.1:$PORT/metrics" >"$TMP/metrics.txt"
ok=1
for m in 'dsv4_http_requests_total{status="200"}' dsv4_prompt_tokens_total dsv4_generation_tokens_total \
  dsv4_time_to_first_token_seconds_bucket dsv4_inter_token_latency_seconds_count dsv4_queue_depth \
  dsv4_running_sequences dsv4_state_memory_bytes dsv4_prefix_cache_hit_tokens_total; do
  grep -qF "$m" "$TMP/metrics.txt" || { echo "  missing $m"; ok=0; }
done
check metrics_content [ $ok = 1 ]

# ----- errors: status and OpenAI error JSON -----
err_case() { # err_case NAME STATUS PATH BODY MESSAGE-SUBSTRING [curl args...]
  local n=$1 want=$2 path=$3 body=$4 sub=$5; shift 5
  local code; code=$(curl -s -o "$TMP/err.json" -w '%{http_code}' "$@" --data-binary "$body" "http://127.0.0.1:$PORT$path")
  local msg; msg=$(js "$TMP/err.json" '("type" in j.error && "param" in j.error && "code" in j.error ? "ok " : "fields missing ") + j.error.message')
  if [ "$code" = "$want" ] && [[ "$msg" == "ok "*"$sub"* ]]; then
    pass "$n"; else fail "$n" "status $code message '$msg'"; fi
}
CH=(-H "$H" -H 'Content-Type: application/json')
err_case err_malformed_json 400 /v1/chat/completions '{"messages": [' "malformed JSON" "${CH[@]}"
err_case err_wrong_type 400 /v1/chat/completions "{\"messages\":[$U],\"temperature\":\"hot\"}" "temperature: must be a number" "${CH[@]}"
err_case err_empty_messages 400 /v1/chat/completions '{"messages":[]}' "must not be empty" "${CH[@]}"
err_case err_unknown_role 400 /v1/chat/completions '{"messages":[{"role":"wizard","content":"x"}]}' 'unknown role "wizard"' "${CH[@]}"
long=$(printf 'word%d ' $(seq 1 1200))
err_case err_prompt_too_long 400 /v1/chat/completions "{\"messages\":[{\"role\":\"user\",\"content\":\"$long\"}]}" "the context is 1024 tokens" "${CH[@]}"
err_case err_max_tokens_over_ctx 400 /v1/chat/completions "{\"messages\":[$U],\"max_tokens\":5000}" "exceeds the context of 1024" "${CH[@]}"
head -c 70000 /dev/zero | tr '\0' 'a' >"$TMP/big.txt"
code=$(curl -s -o "$TMP/err.json" -w '%{http_code}' "${CH[@]}" --data-binary @"$TMP/big.txt" "http://127.0.0.1:$PORT/v1/chat/completions")
check err_body_too_large_413 [ "$code" = 413 -a "$(js "$TMP/err.json" 'j.error.code')" = request_too_large ]
printf '{"messages":[{"role":"user","content":"caf\xc3\x28"}]}' >"$TMP/bad.json"
code=$(curl -s -o "$TMP/err.json" -w '%{http_code}' "${CH[@]}" --data-binary @"$TMP/bad.json" "http://127.0.0.1:$PORT/v1/chat/completions")
check err_invalid_utf8 [ "$code" = 400 -a -n "$(js "$TMP/err.json" 'j.error.message.includes("invalid UTF-8") || ""')" ]
err_case err_tool_schema 400 /v1/chat/completions "{\"messages\":[$U],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":\"x\"}}]}" "must be a JSON Schema object" "${CH[@]}"
err_case err_no_api_key 401 /v1/chat/completions "{\"messages\":[$U]}" "API key" -H 'Content-Type: application/json'
err_case err_bad_api_key 401 /v1/models "" "API key" -H "Authorization: Bearer wrong" -G
err_case err_unknown_route 404 /v1/nothing "" "no route" -H "$H" -G
err_case err_wrong_method 405 /v1/chat/completions "" "not allowed" -H "$H" -G
check err_n_2_ignored_unknown_fields [ "$(post /v1/chat/completions "{\"messages\":[$U],\"max_tokens\":1,\"some_future_field\":{\"a\":[1]}}" "$TMP/unk.json")" = 200 ]

# ----- N concurrent greedy streams == the same requests one at a time -----
N=3
for i in $(seq 1 $N); do
  echo "{\"messages\":[{\"role\":\"user\",\"content\":\"Question number $i: what is $i plus $i?\"}],\"max_tokens\":5,\"temperature\":0,\"stream\":true}" >"$TMP/req$i.json"
done
for i in $(seq 1 $N); do post /v1/chat/completions @"$TMP/req$i.json" "$TMP/seq$i.sse" >/dev/null; done
pids=()
for i in $(seq 1 $N); do post /v1/chat/completions @"$TMP/req$i.json" "$TMP/par$i.sse" >/dev/null & pids+=($!); done
wait "${pids[@]}"
ok=1
for i in $(seq 1 $N); do
  a=$(sse_text "$TMP/seq$i.sse") || ok=0; b=$(sse_text "$TMP/par$i.sse") || ok=0
  [ "$a" = "$b" ] && [ -n "$a" ] || { ok=0; echo "  request $i: one at a time '$a' vs concurrent '$b'"; }
done
check concurrent_equals_sequential [ $ok = 1 ]

# ----- queue full: 3 running + 2 waiting, the next gets 429 + Retry-After -----
LONG="{\"messages\":[$U],\"max_tokens\":200,\"temperature\":0,\"stream\":true}"
BG_PIDS=()
for i in 1 2 3 4 5; do
  curl -s -N -o /dev/null -H "$H" --data-binary "$LONG" "http://127.0.0.1:$PORT/v1/chat/completions" & BG_PIDS+=($!)
  sleep 0.2
done
if wait_metric dsv4_queue_depth 2 20; then
  code=$(curl -s -D "$TMP/h429" -o "$TMP/err.json" -w '%{http_code}' "${CH[@]}" --data-binary "$LONG" "http://127.0.0.1:$PORT/v1/chat/completions")
  check queue_full_429 [ "$code" = 429 -a -n "$(grep -i '^retry-after: [0-9]' "$TMP/h429")" ]
else
  fail queue_full_429 "queue never reached 2 (running $(metric dsv4_running_sequences), queued $(metric dsv4_queue_depth))"
fi
# ----- client disconnect mid-stream: their sequences are cancelled and freed -----
for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null; done
BG_PIDS=()
if wait_metric dsv4_running_sequences 0 20 && wait_metric dsv4_queue_depth 0 5; then pass disconnect_frees_sequences
else fail disconnect_frees_sequences "running $(metric dsv4_running_sequences) queued $(metric dsv4_queue_depth)"; fi
check disconnects_counted [ "$(metric dsv4_client_disconnects_total)" -ge 1 ]
check cancelled_counted [ "$(metric 'dsv4_requests_finished_total{reason="cancelled"}')" -ge 1 ]

# ----- the official openai npm client -----
if [ -d "$ROOT/tests/node/node_modules/openai" ]; then
  for t in "$ROOT"/tests/node/*.mjs; do
    DSV4_BASE_URL="http://127.0.0.1:$PORT/v1" DSV4_API_KEY="$KEY" node "$t" 2>&1
  done
else
  echo "(tests/node/node_modules missing: run 'npm ci' in tests/node to include the openai client tests)"
fi

# ----- SIGTERM with a request in flight: answered or cancelled, exit 0 within seconds -----
curl -s -N -o "$TMP/inflight.sse" -H "$H" --data-binary "$LONG" "http://127.0.0.1:$PORT/v1/chat/completions" &
CURL_PID=$!
sleep 1
t0=$(date +%s%N)
kill -TERM "$SRV_PID"
rc=124
for ((i = 0; i < 150; i++)); do
  if ! kill -0 "$SRV_PID" 2>/dev/null; then wait "$SRV_PID"; rc=$?; break; fi
  sleep 0.1
done
t1=$(date +%s%N)
wait "$CURL_PID" 2>/dev/null
check sigterm_exit_0 [ "$rc" = 0 ]
check sigterm_within_seconds [ $(((t1 - t0) / 1000000)) -lt 10000 ]
check sigterm_stream_ended_cleanly grep -q 'data: \[DONE\]' "$TMP/inflight.sse"
[ "$rc" = 0 ] && SRV_PID=""
check log_line_per_request grep -q 'POST /v1/chat/completions status=200 in=[0-9]* out=[0-9]* cached=[0-9]* ttft=' "$TMP/server.log"
grep -E 'ERROR|AddressSanitizer|runtime error' "$TMP/server.log" && fail server_log_clean || pass server_log_clean
