#!/usr/bin/env python3
"""Builds the tokenizer test corpus inputs (deterministic, seed 20261129).

Run here (no third-party packages): writes tools/tokenizer_vectors/inputs.jsonl,
one {"b64": base64(raw bytes)} per line.  encode_hf.py (run on the device
machine, where Hugging Face `tokenizers` is installed) adds the reference ids.

Categories (counts printed at the end): English prose from Python's own
docstrings, CJK/Japanese/Korean prose, other scripts, source code in several
languages from files on this machine, digit runs, emoji with ZWJ/skin tones/
flags and combining marks, whitespace runs with tabs/CR/LF/CRLF, the
tokenizer's special and added tokens inside text, and invalid UTF-8.
"""
import base64
import glob
import json
import os
import pydoc
import random
import sys

rng = random.Random(20261129)
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.abspath(os.path.join(here, "..", ".."))

def english_sentences():
    import builtins, collections, json as j, os as o, re, string, textwrap, itertools, functools, pathlib
    sents = []
    for mod in [builtins, collections, j, o, re, string, textwrap, itertools, functools, pathlib, random, base64]:
        for name in dir(mod):
            doc = getattr(getattr(mod, name, None), "__doc__", None)
            if isinstance(doc, str):
                for para in doc.split("\n\n"):
                    p = " ".join(para.split())
                    if 20 < len(p) < 600:
                        sents.append(p)
    for path in glob.glob(os.path.join(root, "docs", "*.md")) + [os.path.join(root, "README.md")]:
        if os.path.exists(path):
            for para in open(path, encoding="utf-8").read().split("\n\n"):
                if 20 < len(para) < 800:
                    sents.append(para)
    return sorted(set(sents))

def code_chunks():
    files = sorted(glob.glob("/usr/lib/python3*/json/*.py") + glob.glob("/usr/lib/python3*/asyncio/*.py")[:20]
                   + glob.glob("/usr/include/*.h")[:80] + glob.glob(os.path.join(root, "src", "**", "*.[ch]"), recursive=True)
                   + glob.glob("/usr/share/doc/*/examples/*")[:20] + glob.glob("/etc/*.conf")[:20])
    chunks = []
    for f in files:
        try:
            lines = open(f, encoding="utf-8").read().split("\n")
        except Exception:
            continue
        for _ in range(12):
            if len(lines) < 2:
                break
            a = rng.randrange(len(lines))
            chunks.append("\n".join(lines[a:a + rng.randint(1, 15)]))
    snippets = [
        'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}',
        'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("héllo, 世界")\n}',
        'const f = async (x) => { await fetch(`/api/${x}`); return x ?? 0; };',
        'SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;',
        '#include <stdio.h>\nint main(void){printf("%d\\n",42);return 0;}',
        'def f(x):\r\n\treturn x**2  # squared\r\n',
        '<div class="a">&nbsp;<span>x &lt; y</span></div>',
        '{"key": [1, 2.5e-3, null, true], "nested": {"k": "v"}}',
        'public static void main(String[] args) { System.out.println(args.length); }',
        '$ ls -la | grep "^d" && echo done >> /tmp/log.txt 2>&1',
    ]
    return chunks + snippets

def cjk_text():
    out = []
    for _ in range(rng.randint(3, 80)):
        r = rng.random()
        if r < 0.55:
            out.append(chr(rng.randint(0x4E00, 0x9FA5)))
        elif r < 0.65:
            out.append(chr(rng.randint(0x3041, 0x3096)))
        elif r < 0.72:
            out.append(chr(rng.randint(0x30A1, 0x30FA)))
        elif r < 0.8:
            out.append(chr(rng.randint(0xAC00, 0xD7A3)))
        elif r < 0.9:
            out.append(rng.choice("。，、！？「」（）：；《》 ー・〜１２３ＡＢ"))
        else:
            out.append(rng.choice([" ", "abc", "AI", "2026年", "GPU", "\n"]))
    return "".join(out)

SCRIPTS = [(0x0400, 0x044F), (0x0391, 0x03C9), (0x0600, 0x06FF), (0x0900, 0x097F), (0x0E00, 0x0E5B),
           (0x05D0, 0x05EA), (0x10A0, 0x10FF), (0x0531, 0x0587), (0x1F00, 0x1FFF)]

def other_script():
    lo, hi = rng.choice(SCRIPTS)
    words = []
    for _ in range(rng.randint(1, 20)):
        words.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 9))))
    return rng.choice([" ", "  ", ", ", "\n"]).join(words)

def digits():
    parts = []
    for _ in range(rng.randint(1, 8)):
        n = rng.randint(1, 40)
        parts.append("".join(rng.choice("0123456789") for _ in range(n)))
        parts.append(rng.choice(["", " ", ".", ",", "-", "e", "x", "٣٤", "١٢٣", "²", "½", "Ⅻ", "①", "\n"]))
    return "".join(parts)

EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🏳️‍🌈", "❤️", "🤖", "✅", "🧪", "⚙️", "🫠", "👩🏿‍💻", "🐍", "☃", "©", "™"]
COMBINING = ["e\u0301", "a\u0308", "n\u0303", "\u0915\u094d\u0937", "o\u0302\u0323", "Z\u0335\u0336\u0337",
             "\u1100\u1161\u11a8", "i\u0307", "\u200b", "\u200d", "\ufeff", "\u00a0", "\u3000", "\u2028"]

def emoji_marks():
    return "".join(rng.choice(EMOJI + COMBINING + [" ", "x", "word", "\n"]) for _ in range(rng.randint(1, 25)))

def whitespace():
    return "".join(rng.choice([" ", "  ", "   ", "\t", "\t\t", "\n", "\r\n", "\r", "\n\n", "a", "b c", ".", "\u00a0",
                               "\v", "\f", "  \n  "]) for _ in range(rng.randint(1, 30)))

def specials(tok_json):
    added = [t["content"] for t in tok_json["added_tokens"]]
    pieces = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if r < 0.4:
            pieces.append(rng.choice(added))
        elif r < 0.5:
            s = rng.choice(added)
            pieces.append(s[: rng.randint(1, max(1, len(s) - 1))])  # truncated special: plain text
        else:
            pieces.append(rng.choice(["Hello", " world", "\n", "<think>", "</think>", " ", "｜", "▁", "<", ">", "x"]))
    return "".join(pieces)

def invalid_utf8():
    b = bytearray()
    for _ in range(rng.randint(1, 20)):
        r = rng.random()
        if r < 0.3:
            b += bytes([rng.randint(0x80, 0xFF)])
        elif r < 0.45:
            b += rng.choice(["é", "中", "😀"]).encode()[: rng.randint(1, 2)]  # truncated sequence
        elif r < 0.55:
            b += rng.choice([b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xff\xfe"])
        else:
            b += rng.choice(["abc", " ", "中文", "\n", "ok", "😀"]).encode()
    return bytes(b)

def code_sample(code):
    c = rng.choice(code)
    if len(c) > 40 and rng.random() < 0.5:  # a random slice keeps the category from running dry
        a = rng.randrange(len(c) - 20)
        c = c[a:a + rng.randint(20, 400)]
    return c

def mixed(eng, code):
    gens = [lambda: rng.choice(eng), cjk_text, other_script, digits, emoji_marks, whitespace, lambda: rng.choice(code)]
    return "".join(rng.choice(gens)() for _ in range(rng.randint(2, 5)))

def main():
    tok = json.load(open(os.path.join(root, "data", "tokenizer", "tokenizer.json"), encoding="utf-8"))
    eng, code = english_sentences(), code_chunks()
    plan = [("english", 2500, lambda: " ".join(rng.choice(eng) for _ in range(rng.randint(1, 3)))),
            ("cjk", 1500, cjk_text), ("scripts", 800, other_script), ("code", 1800, lambda: code_sample(code)),
            ("digits", 700, digits), ("emoji", 700, emoji_marks), ("whitespace", 700, whitespace),
            ("specials", 700, lambda: specials(tok)), ("mixed", 1000, lambda: mixed(eng, code)),
            ("invalid", 600, invalid_utf8)]
    out = open(os.path.join(here, "inputs.jsonl"), "w")
    seen = set()
    total = 0
    for cat, n, gen in plan:
        k = 0
        while k < n:
            s = gen()
            b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogatepass")
            if not b or b in seen:
                continue
            seen.add(b)
            out.write(json.dumps({"cat": cat, "b64": base64.b64encode(b).decode()}) + "\n")
            k += 1
        total += n
        print(f"{cat}: {n}", file=sys.stderr)
    print(f"total: {total} strings", file=sys.stderr)

main()
