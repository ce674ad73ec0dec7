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
# a path that URL-decodes to a newline must not forge a line in the server's log (checked below)
curl -s -o /dev/null -H "$H" "http://127.0.0.1:$PORT/v1/%0aFORGED%20status=200%20line"
err_case err_wrong_method 405 /v1/chat/completions "" "not allowed" -H "$H" -G
check err_n_2_ignored_unknown_fields [ "$(post /v1/chat/completions "{\"messages\":[$U],\"max_tokens\":1,\"some_future_field\":{\"a\":[1]}}" "$TMP/unk.json")" = 200 ]

# ----- Anthropic's POST /v1/messages -----
AH=(-H "x-api-key: $KEY" -H 'anthropic-version: 2023-06-01' -H 'Content-Type: application/json')
apost() { curl -s -o "$2" -w '%{http_code}' "${AH[@]}" --data-binary "$1" "http://127.0.0.1:$PORT/v1/messages"; }
AM='{"role":"user","content":"Hello there"}'
code=$(apost "{\"model\":\"deepseek-chat\",\"max_tokens\":4,\"temperature\":0,\"system\":\"Be brief.\",\"messages\":[$AM]}" "$TMP/msg.json")
check messages_nonstream [ "$code" = 200 -a "$(js "$TMP/msg.json" 'j.type+":"+j.role+":"+j.id.startsWith("msg_")+":"+j.content[0].type+":"+typeof j.content[0].text+":"+j.stop_reason+":"+j.usage.output_tokens+":"+(j.usage.input_tokens+j.usage.cache_read_input_tokens>0)')" = "message:assistant:true:text:string:max_tokens:4:true" ]
code=$(apost "{\"model\":\"deepseek-chat\",\"max_tokens\":4,\"temperature\":0,\"system\":[{\"type\":\"text\",\"text\":\"Be brief.\"}],\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello there\"}]}],\"stream\":true}" "$TMP/msg.sse")
# event order: message_start, then per block start/delta*/stop, message_delta, message_stop;
# every data line is JSON whose type equals its event name; the text equals the non-streaming one
anth_sse() { node -e '
const s=require("fs").readFileSync(process.argv[1],"utf8"); const ev=[]; let text="", bad=0, open=-1, stop="", toolin="";
for (const blk of s.split("\n\n")) { if (!blk.trim()) continue; const m=/^event: (\S+)\ndata: (.*)$/s.exec(blk);
  if (!m) { bad++; continue; } let j; try { j=JSON.parse(m[2]); } catch(e) { bad++; continue; }
  if (j.type!==m[1]) bad++; ev.push(m[1]);
  if (m[1]==="content_block_start") { if (open>=0) bad++; open=j.index; }
  if (m[1]==="content_block_delta") { if (j.index!==open) bad++; if (j.delta.type==="text_delta") text+=j.delta.text; if (j.delta.type==="input_json_delta") toolin+=j.delta.partial_json; }
  if (m[1]==="content_block_stop") { if (j.index!==open) bad++; open=-1; }
  if (m[1]==="message_delta") stop=j.delta.stop_reason+":"+j.usage.output_tokens; }
const order=ev.join(",").replace(/content_block_start,(content_block_delta,)*content_block_stop/g,"B");
if (bad || !/^message_start,(B,)*message_delta,message_stop$/.test(order)) { console.log("BAD "+bad+" "+order); process.exit(1); }
console.log(process.argv[2]==="tool"?stop+"|"+JSON.stringify(JSON.parse(toolin||"null")):process.argv[2]==="stop"?stop:text);' "$1" "${2:-text}"; }
streamed=$(anth_sse "$TMP/msg.sse"); sse_ok=$?
check messages_stream_event_order [ "$code" = 200 -a $sse_ok = 0 ]
check messages_stream_same_text [ "$streamed" = "$(js "$TMP/msg.json" 'j.content[0].text')" ]
check messages_stream_stop_reason [ "$(anth_sse "$TMP/msg.sse" stop)" = "max_tokens:4" ]
# tool_use round trip: the forced DSML call comes back as a tool_use block; its result is sent back
DSML=$'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>'
DSML_J=$(node -e 'console.log(JSON.stringify(process.argv[1]))' "$DSML")
ATOOLS='"tools":[{"name":"get_weather","description":"Weather of a city","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}]'
code=$(apost "{\"model\":\"m\",\"max_tokens\":100,$ATOOLS,\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"dsv4_forced_output\":$DSML_J}" "$TMP/tool.json")
check messages_tool_use [ "$code" = 200 -a "$(js "$TMP/tool.json" 'j.stop_reason+":"+j.content.filter(c=>c.type==="tool_use").map(c=>c.name+JSON.stringify(c.input)).join()')" = 'tool_use:get_weather{"city":"Paris"}' ]
code=$(apost "{\"model\":\"m\",\"max_tokens\":100,$ATOOLS,\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"dsv4_forced_output\":$DSML_J,\"stream\":true}" "$TMP/tool.sse")
got_tool=$(anth_sse "$TMP/tool.sse" tool); want_tool="tool_use:$(js "$TMP/tool.json" 'j.usage.output_tokens')|{\"city\":\"Paris\"}"
if [ "$code" = 200 -a "$got_tool" = "$want_tool" ]; then pass messages_tool_use_stream; else fail messages_tool_use_stream "got '$got_tool' want '$want_tool'"; fi
TID=$(js "$TMP/tool.json" 'j.content.find(c=>c.type==="tool_use").id')
ASST=$(js "$TMP/tool.json" 'j.content')
code=$(apost "{\"model\":\"m\",\"max_tokens\":3,$ATOOLS,\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"},{\"role\":\"assistant\",\"content\":$ASST},{\"role\":\"user\",\"content\":[{\"type\":\"tool_result\",\"tool_use_id\":\"$TID\",\"content\":\"18 C, sunny\"},{\"type\":\"text\",\"text\":\"And tomorrow?\"}]}]}" "$TMP/tool2.json")
check messages_tool_result_round_trip [ "$code" = 200 -a "$(js "$TMP/tool2.json" 'j.type+":"+j.usage.output_tokens')" = "message:3" ]
# thinking: budget_tokens turns thinking mode on; the forced reasoning comes back as a thinking block
code=$(apost "{\"model\":\"m\",\"max_tokens\":30,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":2048},\"messages\":[$AM],\"dsv4_forced_output\":\"Add them.</think>4<｜end▁of▁sentence｜>\"}" "$TMP/think2.json")
check messages_thinking_block [ "$code" = 200 -a "$(js "$TMP/think2.json" 'j.content.map(c=>c.type+"="+(c.thinking??c.text)).join("|")+":"+j.stop_reason')" = "thinking=Add them.|text=4:end_turn" ]
code=$(apost "{\"model\":\"m\",\"max_tokens\":30,\"thinking\":{\"type\":\"enabled\",\"budget_tokens\":2048},\"messages\":[$AM],\"dsv4_forced_output\":\"Add them.</think>4<｜end▁of▁sentence｜>\",\"stream\":true}" "$TMP/think2.sse")
check messages_thinking_stream [ "$code" = 200 -a -n "$(grep -F '"thinking_delta"' "$TMP/think2.sse")" -a "$(anth_sse "$TMP/think2.sse")" = 4 ]
# stop_sequences: reported as stop_sequence with the string that matched
code=$(apost "{\"model\":\"m\",\"max_tokens\":30,\"stop_sequences\":[\"zzz\",\"STOP\"],\"messages\":[$AM],\"dsv4_forced_output\":\"one two STOP three\"}" "$TMP/stopseq.json")
check messages_stop_sequence [ "$code" = 200 -a "$(js "$TMP/stopseq.json" 'j.stop_reason+":"+j.stop_sequence+":"+j.content[0].text')" = "stop_sequence:STOP:one two " ]
# errors: Anthropic's shape and status
aerr() { # aerr NAME STATUS TYPE BODY MESSAGE-SUBSTRING [curl args...]
  local n=$1 want=$2 type=$3 body=$4 sub=$5; shift 5
  local code; code=$(curl -s -o "$TMP/aerr.json" -w '%{http_code}' "$@" --data-binary "$body" "http://127.0.0.1:$PORT/v1/messages")
  local got; got=$(js "$TMP/aerr.json" 'j.type+":"+j.error.type+":"+j.error.message')
  if [ "$code" = "$want" ] && [[ "$got" == "error:$type:"*"$sub"* ]]; then pass "$n"; else fail "$n" "status $code '$got'"; fi
}
aerr messages_err_no_max_tokens 400 invalid_request_error "{\"model\":\"m\",\"messages\":[$AM]}" "max_tokens: required" "${AH[@]}"
aerr messages_err_bad_role 400 invalid_request_error "{\"model\":\"m\",\"max_tokens\":2,\"messages\":[{\"role\":\"system\",\"content\":\"x\"}]}" 'unknown role "system"' "${AH[@]}"
aerr messages_err_temperature 400 invalid_request_error "{\"model\":\"m\",\"max_tokens\":2,\"temperature\":1.5,\"messages\":[$AM]}" "out of range [0, 1]" "${AH[@]}"
aerr messages_err_image 400 invalid_request_error "{\"model\":\"m\",\"max_tokens\":2,\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image\",\"source\":{}}]}]}" "not supported" "${AH[@]}"
aerr messages_err_malformed 400 invalid_request_error '{"model":' "malformed JSON" "${AH[@]}"
aerr messages_err_context 400 invalid_request_error "{\"model\":\"m\",\"max_tokens\":5000,\"messages\":[$AM]}" "exceeds the context" "${AH[@]}"
aerr messages_err_no_key 401 authentication_error "{\"model\":\"m\",\"max_tokens\":2,\"messages\":[$AM]}" "API key" -H 'Content-Type: application/json'
aerr messages_err_wrong_method 405 invalid_request_error "" "not allowed" "${AH[@]}" -G
code=$(curl -s -o "$TMP/aerr.json" -w '%{http_code}' "${AH[@]}" --data-binary @"$TMP/big.txt" "http://127.0.0.1:$PORT/v1/messages")
check messages_err_too_large_413 [ "$code" = 413 -a "$(js "$TMP/aerr.json" 'j.error.type')" = request_too_large ]
code=$(curl -s -o "$TMP/msgb.json" -w '%{http_code}' -H "$H" -H 'Content-Type: application/json' --data-binary "{\"model\":\"m\",\"max_tokens\":1,\"messages\":[$AM]}" "http://127.0.0.1:$PORT/v1/messages")
check messages_bearer_accepted [ "$code" = 200 ]

# ----- N concurrent greedy streams == the same requests one at a time -----
N=3
for i in $(seq 1 $N); do
  echo "{\"messages\":[{\"role\":\"user\",\"content\":\"Question number $i: what is $i plus $i?\"}],\"max_tokens\":5,\"temperature\":0,\"stream\":true}" >"$TMP/req$i.json"
done
for i in $(seq 1 $N); do post /v1/chat/completions @"$TMP/req$i.json" "$TMP/seq$i.sse" >/dev/null; done
pids=()
for i in $(seq 1 $N); do post /v1/chat/completions @"$TMP/req$i.json" "$TMP/par$i.sse" >"$TMP/par$i.code" & pids+=($!); done
wait "${pids[@]}"
ok=1
for i in $(seq 1 $N); do
  a=$(sse_text "$TMP/seq$i.sse") || ok=0; b=$(sse_text "$TMP/par$i.sse") || ok=0
  [ "$a" = "$b" ] && [ -n "$a" ] || {
    ok=0; echo "  request $i: one at a time '$a' vs concurrent '$b' (HTTP $(cat "$TMP/par$i.code"))"
    echo "  concurrent body, first 400 bytes: $(head -c 400 "$TMP/par$i.sse" | tr '\n' '|')"
    echo "  server log, last 5 lines:"; tail -5 "$TMP/server.log" | sed 's/^/    /'
  }
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
check log_no_forged_line [ -z "$(grep '^FORGED' "$TMP/server.log")" -a -n "$(grep -F 'GET /v1/\nFORGED status=200 line status=404' "$TMP/server.log")" ]
grep -E 'ERROR|AddressSanitizer|runtime error' "$TMP/server.log" && fail server_log_clean || pass server_log_clean

# ----- bounded load leaves nothing behind -----
# A second server with the prefix cache off (so every state byte belongs to a
# live sequence), warmed up once; then 40 requests (streaming and not) at
# concurrency 8, 6 of them cut off mid-stream by killing curl.  Afterwards
# nothing may be running or queued, the state bytes must be back at the
# baseline exactly, and RSS may grow by at most DSV4_LEAK_RSS_MB (default 64).
# (Set DSV4_LEAK_RSS_MB=0 to see the RSS check fail on ordinary allocator noise.)
"$BIN" serve --port 0 --ctx 1024 --max-seqs 8 --queue 64 --api-key "$KEY" --no-prefix-cache --grace 1 \
  >"$TMP/server2.log" 2>&1 &
SRV_PID=$!
PORT=""
for ((i = 0; i < 300; i++)); do
  PORT=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$TMP/server2.log" | sed 's/.*://')
  [ -n "$PORT" ] && break
  kill -0 "$SRV_PID" 2>/dev/null || break
  sleep 0.1
done
rss_kb() { awk '/^VmRSS:/ {print $2}' "/proc/$SRV_PID/status"; }
load_one() { # load_one I: request I of the load (every 7th is cut off mid-stream)
  local i=$1 stream=false mt=$((3 + $1 % 6))
  ((i % 2)) && stream=true
  local body="{\"messages\":[{\"role\":\"user\",\"content\":\"Load request $i: tell me about the number $i.\"}],\"max_tokens\":$mt,\"stream\":$stream}"
  if ((i % 7 == 3)); then
    curl -s -N -o /dev/null -H "$H" --data-binary "{\"messages\":[{\"role\":\"user\",\"content\":\"long $i\"}],\"max_tokens\":400,\"stream\":true}" \
      "http://127.0.0.1:$PORT/v1/chat/completions" & local cp=$!
    sleep 0.3; kill "$cp" 2>/dev/null; wait "$cp" 2>/dev/null
    echo cut
  else
    curl -s -o /dev/null -w '%{http_code}\n' -H "$H" --data-binary "$body" "http://127.0.0.1:$PORT/v1/chat/completions"
  fi
}
if [ -z "$PORT" ]; then
  fail load_server_start "$(tail -5 "$TMP/server2.log")"
else
  pids=()
  for i in $(seq 1 8); do load_one $((i * 2)) >/dev/null & pids+=($!); done
  wait "${pids[@]}" # warm-up: threads, arenas, buffers
  wait_metric dsv4_running_sequences 0 10
  base_state=$(metric dsv4_state_memory_bytes); base_rss=$(rss_kb)
  t0=$SECONDS
  export -f load_one; export H PORT
  seq 1 40 | xargs -P 8 -I{} bash -c 'load_one {}' >"$TMP/load.txt"
  load_s=$((SECONDS - t0))
  n200=$(grep -c '^200$' "$TMP/load.txt"); ncut=$(grep -c '^cut$' "$TMP/load.txt")
  check load_all_answered [ "$n200" = $((40 - ncut)) -a "$ncut" -ge 5 ]
  check load_within_60s [ "$load_s" -le 60 ] # ~4 s optimized, ~25 s under sanitizers
  if wait_metric dsv4_running_sequences 0 10 && wait_metric dsv4_queue_depth 0 5; then pass load_nothing_running_or_queued
  else fail load_nothing_running_or_queued "running $(metric dsv4_running_sequences) queued $(metric dsv4_queue_depth)"; fi
  st=$(metric dsv4_state_memory_bytes)
  check load_state_bytes_back_to_baseline [ -n "$st" -a "$st" = "$base_state" -a "$(metric dsv4_prefix_cache_bytes)" = 0 ]
  [ "$st" = "$base_state" ] || echo "  state bytes: baseline $base_state, after $st"
  rss=$(rss_kb); bound=$((${DSV4_LEAK_RSS_MB:-64} * 1024))
  echo "  load: ${load_s}s, $ncut cut off; RSS ${base_rss} kB -> ${rss} kB (+$(((rss - base_rss) / 1024)) MB, bound $((bound / 1024)) MB)"
  check load_rss_growth_bounded [ $((rss - base_rss)) -le "$bound" ]
  check load_disconnects_counted [ "$(metric dsv4_client_disconnects_total)" -ge "$ncut" ]
  kill -TERM "$SRV_PID"; wait "$SRV_PID"; rc=$?
  check load_server_exit_0 [ "$rc" = 0 ]
  SRV_PID=""
  grep -E 'ERROR|AddressSanitizer|LeakSanitizer|runtime error' "$TMP/server2.log" && fail load_server_log_clean || pass load_server_log_clean
fi
