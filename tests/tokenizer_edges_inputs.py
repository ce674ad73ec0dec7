#!/usr/bin/env python3
"""Edge-case inputs for the tokenizer, where PCRE2 and Oniguruma could disagree.

Writes JSONL lines {"cat": ..., "b64": ...} (the input format of
tools/tokenizer_vectors/encode_hf.py).  On the device machine (HF tokenizers):
    python3 tests/tokenizer_edges_inputs.py > /tmp/edges_in.jsonl
    python3 tools/tokenizer_vectors/encode_hf.py data/tokenizer/tokenizer.json \
        /tmp/edges_in.jsonl tests/data/tokenizer_edges.jsonl
tests/test_tokenizer.c checks every line of tests/data/tokenizer_edges.jsonl
when the file is present.
"""
import base64, json, random

# characters whose class differs between engines or Unicode versions
SPACES = ["\u0085", "\u180e", "\u1680", "\u2028", "\u2029", "\u000b", "\u000c", "\u001c", "\u001f",
          "\u00a0", "\u2000", "\u200a", "\u200b", "\u202f", "\u205f", "\u3000", "\ufeff", "\t", "\r", "\n", " "]
OTHERS = ["a", "Z", "é", "中", "ヿ", "龥", "龦", "\u3400", "ー", "々", "1", "٣", "①", "½", "Ⅻ", ".", ",", "!", "'",
          "\u0301", "\u20dd", "$", "+", "€", "😀", "\u1e030", "\U0001e030", "\U0001e4d0", "\U00011f00",
          "\u0c5d", "\U0001f6dc", "_", "-", "(", "[", "\\", "\u2066", "\u00ad", "\U000e0041"]

def main():
    rng = random.Random(5)
    out = []
    for s in SPACES:  # each space alone, in runs, before and after words and newlines
        for t in [s, s * 3, "a" + s + "b", "a" + s, s + "a", "a " + s + " b", s + "\n", "\n" + s, s + "\r\n" + s,
                  "x" + s + s + "y", "1" + s + "2", "." + s + "!", "中" + s + "文"]:
            out.append(("edge_space", t))
    for o in OTHERS:
        for t in [o, o * 4, " " + o, "a" + o + "b", o + "\n", "1" + o + "1", "中" + o, o + "'s"]:
            out.append(("edge_char", t))
    alphabet = SPACES + OTHERS
    for _ in range(2000):
        out.append(("edge_mix", "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))))
    for cat, t in out:
        print(json.dumps({"cat": cat, "b64": base64.b64encode(t.encode("utf-8")).decode()}))

main()
