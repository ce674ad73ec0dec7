#!/usr/bin/env bash
# CLI tests for `dsv4 tokenize` / `dsv4 detokenize`.  Prints PASS/FAIL lines.
# Uses $DSV4_BIN (set by tests/run.sh) or build/dsv4; run from the repo root.
set -u
BIN=${DSV4_BIN:-build/dsv4}
TOK=data/tokenizer/tokenizer.json
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

check() { # name, condition (a shell expression, evaluated)
  if eval "$2"; then echo "PASS $1"; else echo "FAIL $1"; fi
}

if [ ! -x "$BIN" ]; then echo "FAIL cli_tokenize_binary ($BIN missing)"; exit 1; fi

# published vector (test_vectors.json)
out=$(printf 'Hello, world! 123\nsecond line' | "$BIN" tokenize --tokenizer "$TOK")
check cli_tokenize_vector '[ "$out" = "19923,14,2058,3,223,6895,201,10930,2562" ]'

# a model directory works too, and the default tokenizer is found next to the binary
out2=$(printf 'Hello, world! 123\nsecond line' | "$BIN" tokenize --model data/tokenizer)
out3=$(printf 'Hello, world! 123\nsecond line' | env -u DSV4_TOKENIZER "$BIN" tokenize)
check cli_tokenize_model_and_default '[ "$out2" = "$out" ] && [ "$out3" = "$out" ]'

# specials match by default, not with --no-special
sp=$(printf '<｜User｜>hi' | "$BIN" tokenize --tokenizer "$TOK")
nsp=$(printf '<｜User｜>hi' | "$BIN" tokenize --tokenizer "$TOK" --no-special)
check cli_tokenize_special '[ "${sp%%,*}" = "128803" ] && [ "${nsp%%,*}" != "128803" ]'

# round trip through detokenize, bytes exact (tabs, CRLF, CJK, emoji, trailing newline)
printf 'tabs\tand CRLF\r\nlines\n中文 🎸🎶 e\xcc\x81\n\n' >"$tmp/in.txt"
"$BIN" tokenize --tokenizer "$TOK" <"$tmp/in.txt" | "$BIN" detokenize --tokenizer "$TOK" >"$tmp/back.txt"
check cli_roundtrip 'cmp -s "$tmp/in.txt" "$tmp/back.txt"'

# --lines: one output line per input line; the "\r" of CRLF stays in the line
printf 'a b\r\nc\n\nd' | "$BIN" tokenize --tokenizer "$TOK" --lines >"$tmp/lines.txt"
n=$(wc -l <"$tmp/lines.txt")
l3=$(sed -n 3p "$tmp/lines.txt")
cr=$(printf 'a b\r' | "$BIN" tokenize --tokenizer "$TOK")
check cli_tokenize_lines '[ "$n" -eq 4 ] && [ -z "$l3" ] && [ "$(sed -n 1p "$tmp/lines.txt")" = "$cr" ]'
"$BIN" detokenize --tokenizer "$TOK" --lines <"$tmp/lines.txt" >"$tmp/lines_back.txt"
check cli_detokenize_lines 'cmp -s "$tmp/lines_back.txt" <(printf '\''a b\r\nc\n\nd\n'\'')'

# ids separated by spaces, newlines, brackets
t=$(printf '[19923, 14\n2058 3]' | "$BIN" detokenize --tokenizer "$TOK")
check cli_detokenize_separators '[ "$t" = "Hello, world!" ]'

# errors: out-of-range id, junk, invalid UTF-8 (and --lossy), bad option, bad file
"$BIN" detokenize --tokenizer "$TOK" <<<"1,999999" >/dev/null 2>"$tmp/err1"; rc1=$?
check cli_detokenize_out_of_range '[ $rc1 -ne 0 ] && grep -q "out of range" "$tmp/err1" && grep -q 999999 "$tmp/err1"'
"$BIN" detokenize --tokenizer "$TOK" <<<"1,abc" >/dev/null 2>"$tmp/err2"; rc2=$?
check cli_detokenize_junk '[ $rc2 -ne 0 ] && grep -q "'\''abc'\'' is not a token id" "$tmp/err2"'
printf 'ok\xffno' | "$BIN" tokenize --tokenizer "$TOK" >/dev/null 2>"$tmp/err3"; rc3=$?
check cli_tokenize_invalid_utf8 '[ $rc3 -ne 0 ] && grep -q "byte offset 2" "$tmp/err3"'
lossy=$(printf 'ok\xffno' | "$BIN" tokenize --tokenizer "$TOK" --lossy)
repl=$(printf 'ok\xef\xbf\xbdno' | "$BIN" tokenize --tokenizer "$TOK")
check cli_tokenize_lossy '[ -n "$lossy" ] && [ "$lossy" = "$repl" ]'
"$BIN" tokenize --bogus </dev/null >/dev/null 2>"$tmp/err4"; rc4=$?
check cli_tokenize_bad_option '[ $rc4 -eq 2 ] && grep -q "unknown or incomplete option '\''--bogus'\''" "$tmp/err4"'
printf '{"model": 1' >"$tmp/bad.json"
echo hi | "$BIN" tokenize --tokenizer "$tmp/bad.json" >/dev/null 2>"$tmp/err5"; rc5=$?
check cli_tokenize_bad_file '[ $rc5 -ne 0 ] && grep -q "not valid JSON" "$tmp/err5"'

# empty input: an empty line of ids, and back to nothing
e=$(printf '' | "$BIN" tokenize --tokenizer "$TOK")
eb=$(printf '' | "$BIN" detokenize --tokenizer "$TOK" | wc -c)
check cli_empty '[ -z "$e" ] && [ "$eb" -eq 0 ]'

# --help answers on stdout with status 0
"$BIN" tokenize --help >"$tmp/h1" && "$BIN" detokenize --help >"$tmp/h2"
check cli_help 'grep -q "usage: dsv4 tokenize" "$tmp/h1"'

# --bench prints a rate
head -c 200000 docs/TOKENIZER.md >"$tmp/bench.txt" 2>/dev/null || printf 'some english text %.0s' $(seq 1 2000) >"$tmp/bench.txt"
"$BIN" tokenize --tokenizer "$TOK" --bench "$tmp/bench.txt" --repeat 1 >"$tmp/b.txt"
check cli_tokenize_bench 'grep -q "MB/s" "$tmp/b.txt"'
