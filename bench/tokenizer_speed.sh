#!/usr/bin/env bash
# Tokenizer encode speed on English-like text, one core.
#   bench/tokenizer_speed.sh [MB]      (default 4 MB; needs python3 and build/dsv4 or $DSV4_BIN)
# The text is generated deterministically: sentences of words drawn with a
# Zipf-like law from the lower-case "Ġword" entries of the tokenizer's own
# vocabulary (about 18,000 words), with capitals, commas, numbers and
# paragraphs, so that the piece cache sees common and rare words as in prose.
# Prints the `dsv4 tokenize --bench` line: first (cold cache) run, best of 5,
# wall and CPU time (CPU time is the honest figure on a shared machine).
set -eu
MB=${1:-4}
BIN=${DSV4_BIN:-build/dsv4}
TOK=${DSV4_TOKENIZER:-data/tokenizer/tokenizer.json}
out=$(mktemp /tmp/dsv4_tokbench.XXXXXX)
trap 'rm -f "$out"' EXIT
python3 - "$TOK" "$MB" "$out" <<'PY'
import json, random, sys
tok, mb, path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
vocab = json.load(open(tok, encoding="utf-8"))["model"]["vocab"]
words = [w[1:] for w, i in sorted(vocab.items(), key=lambda kv: kv[1])
         if w.startswith("\u0120") and w[1:].isascii() and w[1:].isalpha() and w[1:].islower() and len(w) > 2]
rng = random.Random(1)
weights = [1.0 / (r + 10) for r in range(len(words))]  # Zipf-like by id (lower id ~ more frequent)
target, parts, size = int(mb * 1e6), [], 0
while size < target:
    n = rng.randint(6, 24)
    ws = rng.choices(words, weights, k=n)
    ws[0] = ws[0].capitalize()
    if rng.random() < 0.3: ws.insert(rng.randint(1, n - 1), str(rng.randint(1, 2024)))
    if rng.random() < 0.3: ws[rng.randint(0, n - 2)] += ","
    s = " ".join(ws) + rng.choice([".", ".", ".", "?", "!"]) + ("\n\n" if rng.random() < 0.15 else " ")
    parts.append(s)
    size += len(s)
open(path, "w").write("".join(parts))
print(f"generated {size} bytes from {len(words)} words", file=sys.stderr)
PY
"$BIN" tokenize --tokenizer "$TOK" --bench "$out" --repeat 5
[ -n "${KEEP:-}" ] && cp "$out" "$KEEP"; true
