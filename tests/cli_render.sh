#!/usr/bin/env bash
# CLI tests for `dsv4 render`: DeepSeek's four official encoding cases must come
# out byte for byte (cases 1-3 in thinking mode, 4 in chat mode, as DeepSeek's
# own test script renders them); --ids must map the special tokens to single ids;
# bad input must fail with a message that names the problem.
set -u
BIN=${DSV4_BIN:-build/dsv4}
DATA=tests/data/chat
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; }

for i in 1 2 3 4; do
  flags=--thinking
  [ "$i" = 4 ] && flags=
  if "$BIN" render --messages "$DATA/test_input_$i.json" $flags >"$TMP/out$i" 2>"$TMP/err$i" &&
     cmp -s "$TMP/out$i" "$DATA/test_output_$i.txt"; then
    pass "render_official_$i"
  else
    fail "render_official_$i" "$(cat "$TMP/err$i"; cmp "$TMP/out$i" "$DATA/test_output_$i.txt" 2>&1)"
  fi
done

# the same conversation given as a plain list plus a separate --tools file renders as case 1
if "$BIN" render --messages "$DATA/case1_messages.json" --tools "$DATA/case1_tools.json" --thinking >"$TMP/o1b" &&
   cmp -s "$TMP/o1b" "$DATA/test_output_1.txt"; then
  pass render_tools_flag
else
  fail render_tools_flag "separate --tools file did not reproduce case 1"
fi

# --ids: BOS 0, <｜User｜> 128803, <｜Assistant｜> 128804, </think> 128822, EOS 1
printf '[{"role":"user","content":"Hi"},{"role":"assistant","content":"Yo"}]' >"$TMP/hi.json"
ids=$("$BIN" render --messages "$TMP/hi.json" --ids 2>"$TMP/ids.err")
case "$ids" in
  0,128803,*,128804,128822,*,1) pass render_ids ;;
  *) fail render_ids "got '$ids' $(cat "$TMP/ids.err")" ;;
esac
if "$BIN" render --messages "$TMP/hi.json" --no-bos | cmp -s - <(printf '<｜User｜>Hi<｜Assistant｜></think>Yo<｜end▁of▁sentence｜>'); then
  pass render_no_bos
else
  fail render_no_bos "unexpected output"
fi

# errors: each must exit non-zero and name the problem
check_err() { # name, expected substring, args...
  local name=$1 want=$2; shift 2
  if "$BIN" render "$@" >"$TMP/o" 2>"$TMP/e"; then
    fail "$name" "succeeded"
  elif grep -qF -- "$want" "$TMP/e"; then
    pass "$name"
  else
    fail "$name" "stderr: $(cat "$TMP/e")"
  fi
}
printf '[{"role":"wizard","content":"x"}]' >"$TMP/bad_role.json"
printf '[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"type":"function","function":{"name":"f","arguments":"{nope"}}]}]' >"$TMP/bad_args.json"
printf '[{"role":"user"' >"$TMP/bad_json.json"
printf '{"type":"function"}' >"$TMP/bad_tools.json"
check_err render_err_role 'messages[0].role: unknown role "wizard"' --messages "$TMP/bad_role.json"
check_err render_err_args 'messages[1].tool_calls[0].function.arguments: not valid JSON' --messages "$TMP/bad_args.json"
check_err render_err_json "bad_json.json:1:" --messages "$TMP/bad_json.json"
check_err render_err_tools 'tools: must be a list' --messages "$TMP/hi.json" --tools "$TMP/bad_tools.json"
check_err render_err_effort 'medium' --messages "$TMP/hi.json" --effort medium
check_err render_err_missing 'No such file' --messages "$TMP/nope.json"
check_err render_err_noarg '--messages FILE is required'
exit 0
