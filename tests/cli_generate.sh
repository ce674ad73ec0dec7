#!/usr/bin/env bash
# CLI tests for `dsv4 generate` and `dsv4 chat` on the default model: output
# and exit codes, seeded reproducibility, a multi-turn chat driven through stdin
# (with /think, /reset, /quit and prefix reuse), bad flags, and, when tmux is
# installed, an interactive session with Ctrl-C interrupting an answer.
# Prints PASS/FAIL lines.  Needs $DSV4_BIN (tests/run.sh sets it) and the default
# model next to it (`make default-model`).
set -u
BIN=${DSV4_BIN:-build/dsv4}
T=$(mktemp -d)
SOCK="dsv4-cli-gen-$$"
cleanup() {
  command -v tmux >/dev/null && tmux -L "$SOCK" kill-server 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
pass() { echo "PASS $1"; }
fail() { echo "FAIL $1"; shift; for f in "$@"; do [ -f "$f" ] && grep -v '^$' "$f" | sed 's/^/    /' | tail -20; done; }
G="--threads 1"  # the CI machine is small and shared

# ----- generate -----
"$BIN" generate -p "Hello, world" -n 6 --seed 5 $G >"$T/g1.out" 2>"$T/g1.err"; rc=$?
if [ $rc -eq 0 ] && [ -s "$T/g1.out" ] && grep -q 'tok/s' "$T/g1.err" && grep -q '\[6 tokens' "$T/g1.err" \
   && grep -q 'seed 5' "$T/g1.err"; then pass generate_raw; else fail generate_raw "$T/g1.out" "$T/g1.err"; fi

"$BIN" generate -p "Hello, world" -n 6 --seed 5 $G >"$T/g2.out" 2>/dev/null
if cmp -s "$T/g1.out" "$T/g2.out"; then pass generate_seeded_repeatable; else fail generate_seeded_repeatable "$T/g1.out" "$T/g2.out"; fi

"$BIN" generate -p "Why?" --chat --thinking -n 5 --temperature 0 $G >"$T/g3.out" 2>"$T/g3.err"; rc=$?
if [ $rc -eq 0 ] && grep -q '<think>' "$T/g3.out" && grep -q 'prompt [0-9]* tokens' "$T/g3.err"; then
  pass generate_chat_thinking; else fail generate_chat_thinking "$T/g3.out" "$T/g3.err"; fi

"$BIN" generate -p "Hi" --chat --system "Be brief." -n 3 --top-k 5 --top-p 0.9 --temperature 0.7 $G >/dev/null 2>"$T/g4.err"
if [ $? -eq 0 ] && grep -q '\[3 tokens' "$T/g4.err"; then pass generate_sampling_flags; else fail generate_sampling_flags "$T/g4.err"; fi

# ----- chat through stdin -----
printf 'hello there\nhow are you\n/think\nwhy\n/reset\nagain\n/bogus\n/quit\nnever read\n' |
  "$BIN" chat -n 3 --temperature 0 $G >"$T/c.out" 2>"$T/c.err"; rc=$?
turns=$(grep -c 'tok/s' "$T/c.err")
if [ $rc -eq 0 ] && [ "$turns" -eq 4 ] && grep -q '(thinking on)' "$T/c.err" && grep -q '(conversation reset)' "$T/c.err" \
   && grep -q 'unknown command /bogus' "$T/c.err"; then pass chat_stdin_turns; else fail chat_stdin_turns "$T/c.out" "$T/c.err"; fi
# turn 2 continues turn 1: its prompt must come (mostly) from the prefix cache
cached2=$(grep 'tok/s' "$T/c.err" | sed -n 2p | sed -n 's/.*(\([0-9]*\) cached).*/\1/p')
prompt1=$(grep 'tok/s' "$T/c.err" | sed -n 1p | sed -n 's/.*prompt \([0-9]*\) tokens.*/\1/p')
if [ -n "$cached2" ] && [ -n "$prompt1" ] && [ "$cached2" -ge "$prompt1" ]; then pass chat_prefix_reuse
else echo "    turn 1 prompt '$prompt1', turn 2 cached '$cached2'"; fail chat_prefix_reuse "$T/c.err"; fi
if grep -q '<think>' "$T/c.out"; then pass chat_think_toggle; else fail chat_think_toggle "$T/c.out"; fi

printf 'hi\n' | "$BIN" chat -n 2 $G >/dev/null 2>"$T/c2.err"
if [ $? -eq 0 ] && [ "$(grep -c 'tok/s' "$T/c2.err")" -eq 1 ]; then pass chat_eof_exits; else fail chat_eof_exits "$T/c2.err"; fi

# ----- bad flags -----
bad() {  # name, expected exit code, expected message fragment, command...
  local name=$1 code=$2 msg=$3; shift 3
  "$@" >"$T/b.out" 2>"$T/b.err"; local rc=$?
  if [ $rc -eq "$code" ] && grep -qF -- "$msg" "$T/b.err"; then pass "$name"
  else echo "    exit $rc (want $code), want message '$msg'"; fail "$name" "$T/b.err"; fi
}
bad generate_needs_prompt 2 "-p TEXT is required" "$BIN" generate -n 3
bad generate_unknown_flag 2 "unknown option '--bogus'" "$BIN" generate -p x --bogus
bad generate_bad_temperature 2 "--temperature expects a number" "$BIN" generate -p x --temperature hot
bad generate_bad_top_p 2 "--top-p expects a number in [0, 1]" "$BIN" generate -p x --top-p 1.5
bad generate_bad_n 2 "-n expects a number" "$BIN" generate -p x -n 0
bad generate_fractional_n 2 "-n expects a whole number, got '2.5'" "$BIN" generate -p x -n 2.5
bad generate_invalid_utf8 1 "prompt: input is not valid UTF-8" "$BIN" generate -p $'ab\xffc' -n 2 $G
bad generate_missing_value 2 "--seed needs a value" "$BIN" generate -p x --seed
bad generate_bad_seed 2 "--seed expects a non-negative integer" "$BIN" generate -p x --seed -4
bad generate_thinking_needs_chat 2 "--thinking needs --chat" "$BIN" generate -p x --thinking
bad generate_bad_model 1 "/nonexistent/model" "$BIN" generate -p x --model /nonexistent/model
bad generate_bad_numerics 1 "nosuch" "$BIN" generate -p x --numerics nosuch $G
bad generate_context_limit 1 "exceeds the context limit of 8 tokens" "$BIN" generate -p "one two three" -n 100 --ctx 8 $G
bad chat_no_prompt_flag 2 "unknown option '-p'" "$BIN" chat -p x
"$BIN" generate --help >"$T/h.out" 2>&1 && grep -q -- '--temperature' "$T/h.out" && pass generate_help || fail generate_help "$T/h.out"
"$BIN" chat --help >"$T/h.out" 2>&1 && grep -q -- '/reset' "$T/h.out" && pass chat_help || fail chat_help "$T/h.out"

# ----- interactive, in tmux -----
if command -v tmux >/dev/null; then
  wait_for() {  # pattern, seconds
    local i=0
    while [ $i -lt $(($2 * 10)) ]; do
      tmux -L "$SOCK" capture-pane -p -t gen >"$T/pane" 2>/dev/null
      grep -qF -- "$1" "$T/pane" && return 0
      sleep 0.1; i=$((i + 1))
    done
    return 1
  }
  tmux -L "$SOCK" new-session -d -s gen -x 200 -y 50 "'$BIN' chat -n 4000 --temperature 0 $G; echo CHAT-EXITED \$?; sleep 30"
  ok=1
  wait_for 'thinking, /reset' 60 || { ok=0; echo "    no banner"; }
  tmux -L "$SOCK" send-keys -t gen 'tell me a story' Enter
  sleep 2
  tmux -L "$SOCK" send-keys -t gen C-c
  wait_for '(interrupted)' 30 || { ok=0; echo "    Ctrl-C did not interrupt the answer"; }
  wait_for 'cancelled]' 10 || { ok=0; echo "    no stats line after the interrupt"; }
  tmux -L "$SOCK" send-keys -t gen '/quit' Enter
  wait_for 'CHAT-EXITED 0' 20 || { ok=0; echo "    /quit did not exit 0"; }
  [ $ok -eq 1 ] && pass chat_tmux_interrupt || fail chat_tmux_interrupt "$T/pane"
  tmux -L "$SOCK" kill-session -t gen 2>/dev/null

  tmux -L "$SOCK" new-session -d -s gen -x 200 -y 50 "'$BIN' chat -n 2 $G; echo CHAT-EXITED \$?; sleep 30"
  ok=1
  wait_for 'thinking, /reset' 60 || ok=0
  tmux -L "$SOCK" send-keys -t gen C-c
  wait_for 'Ctrl-C again' 10 || { ok=0; echo "    no hint after one Ctrl-C"; }
  tmux -L "$SOCK" send-keys -t gen C-c
  wait_for 'CHAT-EXITED 0' 10 || { ok=0; echo "    a second Ctrl-C did not exit"; }
  [ $ok -eq 1 ] && pass chat_tmux_double_ctrl_c || fail chat_tmux_double_ctrl_c "$T/pane"
  tmux -L "$SOCK" kill-session -t gen 2>/dev/null
else
  echo "(tmux not installed: interactive tests skipped)"
fi
