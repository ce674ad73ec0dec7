#!/usr/bin/env python3
"""Golden logits from Hugging Face transformers' DeepseekV4ForCausalLM (fp32, full sequence, no cache).

Runs on the device machine (python3 there has torch + transformers 5.17):

    golden.py --model DIR --name NAME --T 320 --seed 7 --out OUTDIR [--columns 2048] [--device cuda]

DIR is a checkpoint written by `dsv4 synth` (official names, dtypes and layout).
This script reads the safetensors files itself, dequantizes every weight with its
own code (FP8 e4m3 x 128x128 e8m0/f32 block scales, MXFP4 e2m1 x e8m0/32,
NVFP4 e2m1 x e4m3/16 x scale2, BF16, F32), maps the official tensor names onto
transformers' module names, loads them into a float32 model built from the
checkpoint's config.json, and runs one forward pass over the whole token sequence
with use_cache=False (transformers' incremental path has shown divergences).

Outputs in OUTDIR (small enough to commit):
  NAME.tokens        comma-separated token ids (T of them, random with --seed)
  NAME.json          {T, vocab, scale (max |logit| over all rows), columns: [ids],
                      argmax: [T ids], argmax_logit: [T], synth: how DIR was made}
  NAME.cols.f32      float32 LE, T x len(columns): logits of the sampled columns
The C test (tests/test_golden.c) recomputes the logits with `dsv4` in the exact
profile and compares the columns, the argmax and its logit.
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch

# ----- safetensors, read by hand (no dependency on the safetensors package's dtype support) -----
ST_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4), "F8_E4M3": (np.uint8, 1),
             "F8_E8M0": (np.uint8, 1), "I8": (np.uint8, 1), "U8": (np.uint8, 1), "I32": (np.int32, 4),
             "I64": (np.int64, 8)}


def open_checkpoint(d):
    files = []
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    tensors = {}
    for f in files:
        path = os.path.join(d, f)
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            npdt, _ = ST_DTYPES[info["dtype"]]
            b, e = info["data_offsets"]
            raw = mm[base + b: base + e]
            tensors[name] = (info["dtype"], info["shape"], raw.view(npdt).reshape(info["shape"]))
    return tensors


# ----- decoders, written from the format definitions (spec §2.0, §4) -----
def e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e = (c >> 3) & 0xF
        m = c & 0x7
        if e == 0xF and m == 0x7:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m * 2.0 ** -9
        else:
            t[c] = s * (1 + m / 8.0) * 2.0 ** (e - 7)
    return torch.tensor(t, dtype=torch.float32)


E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def e8m0(codes):
    c = codes.to(torch.int32)
    v = torch.exp2((c - 127).to(torch.float32))
    return torch.where(c == 255, torch.full_like(v, float("nan")), v)


class Dequant:
    def __init__(self, tensors, dev):
        self.t, self.dev, self.e4m3 = tensors, dev, e4m3_table().to(dev)

    def raw(self, name):
        dt, shape, arr = self.t[name]
        return dt, shape, torch.from_numpy(np.ascontiguousarray(arr)).to(self.dev)

    def has(self, name):
        return name in self.t

    def plain(self, name):
        dt, shape, arr = self.t[name]
        if dt == "BF16":  # bf16 bits are the high half of an f32
            f = (np.asarray(arr).astype(np.uint32) << 16).view(np.float32)
            return torch.from_numpy(f).to(self.dev)
        dt, shape, a = self.raw(name)
        if dt == "F32":
            return a.float()
        if dt == "F16":
            return a.float()
        if dt in ("I32", "I64"):
            return a.long()
        raise ValueError(f"{name}: unexpected dtype {dt}")

    def weight(self, prefix):
        """Dequantized [out, in] float32 of a linear `prefix` (prefix.weight + scales)."""
        dt, shape, w = self.raw(prefix + ".weight")
        if dt == "BF16" or dt == "F32":
            return self.plain(prefix + ".weight")
        if dt == "F8_E4M3":
            v = self.e4m3[w.long()]
            sdt, sshape, s = self.raw(prefix + ".scale")
            s = e8m0(s) if sdt == "F8_E8M0" else s.float()
            rows, cols = shape
            br, bc = math.ceil(rows / sshape[0]), math.ceil(cols / sshape[1])
            assert br == 128 or sshape[0] == 1, (prefix, shape, sshape)
            full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            return v * full
        if dt in ("I8", "U8"):
            rows, half = shape
            b = w.to(torch.int32) & 0xFF
            lo, hi = E2M1.to(self.dev)[b & 0xF], E2M1.to(self.dev)[b >> 4]
            v = torch.stack([lo, hi], dim=-1).reshape(rows, half * 2)
            if self.has(prefix + ".weight_scale"):  # NVFP4
                _, _, s = self.raw(prefix + ".weight_scale")
                s2 = self.plain(prefix + ".weight_scale_2").reshape(())
                return v * self.e4m3[s.long()].repeat_interleave(16, 1) * s2
            _, _, s = self.raw(prefix + ".scale")
            return v * e8m0(s).repeat_interleave(32, 1)
        raise ValueError(f"{prefix}: unsupported weight dtype {dt}")


# ----- name mapping: transformers parameter -> official tensor(s) -----
def build_state(model, dq, cfg):
    sd = model.state_dict()
    done = set()

    def put(hf, value):
        tgt = sd[hf]
        if tuple(tgt.shape) != tuple(value.shape):
            raise ValueError(f"{hf}: shape {tuple(tgt.shape)} but checkpoint gives {tuple(value.shape)}")
        with torch.no_grad():
            tgt.copy_(value.to(tgt.dtype))
        done.add(hf)

    put("model.embed_tokens.weight", dq.weight("embed"))
    put("lm_head.weight", dq.weight("head"))
    put("model.norm.weight", dq.plain("norm.weight"))
    put("model.hc_head.hc_fn", dq.plain("hc_head_fn"))
    put("model.hc_head.hc_base", dq.plain("hc_head_base"))
    put("model.hc_head.hc_scale", dq.plain("hc_head_scale"))
    for L in range(cfg.num_hidden_layers):
        o, h = f"layers.{L}.", f"model.layers.{L}."
        put(h + "input_layernorm.weight", dq.plain(o + "attn_norm.weight"))
        put(h + "post_attention_layernorm.weight", dq.plain(o + "ffn_norm.weight"))
        for site in ("attn", "ffn"):
            put(h + f"{site}_hc.fn", dq.plain(o + f"hc_{site}_fn"))
            put(h + f"{site}_hc.base", dq.plain(o + f"hc_{site}_base"))
            put(h + f"{site}_hc.scale", dq.plain(o + f"hc_{site}_scale"))
        a, ha = o + "attn.", h + "self_attn."
        put(ha + "q_a_proj.weight", dq.weight(a + "wq_a"))
        put(ha + "q_a_norm.weight", dq.plain(a + "q_norm.weight"))
        put(ha + "q_b_proj.weight", dq.weight(a + "wq_b"))
        put(ha + "kv_proj.weight", dq.weight(a + "wkv"))
        put(ha + "kv_norm.weight", dq.plain(a + "kv_norm.weight"))
        put(ha + "o_a_proj.weight", dq.weight(a + "wo_a"))
        put(ha + "o_b_proj.weight", dq.weight(a + "wo_b"))
        put(ha + "sinks", dq.plain(a + "attn_sink"))
        if dq.has(a + "compressor.wkv.weight"):
            c, hc = a + "compressor.", ha + "compressor."
            put(hc + "kv_proj.weight", dq.weight(c + "wkv"))
            put(hc + "gate_proj.weight", dq.weight(c + "wgate"))
            put(hc + "position_bias", dq.plain(c + "ape"))
            put(hc + "kv_norm.weight", dq.plain(c + "norm.weight"))
        if dq.has(a + "indexer.wq_b.weight"):
            i, hi = a + "indexer.", ha + "compressor.indexer."
            put(hi + "q_b_proj.weight", dq.weight(i + "wq_b"))
            put(hi + "scorer.weights_proj.weight", dq.weight(i + "weights_proj"))
            put(hi + "kv_proj.weight", dq.weight(i + "compressor.wkv"))
            put(hi + "gate_proj.weight", dq.weight(i + "compressor.wgate"))
            put(hi + "position_bias", dq.plain(i + "compressor.ape"))
            put(hi + "kv_norm.weight", dq.plain(i + "compressor.norm.weight"))
        f, hf = o + "ffn.", h + "mlp."
        put(hf + "gate.weight", dq.weight(f + "gate"))
        if dq.has(f + "gate.tid2eid"):
            put(hf + "gate.tid2eid", dq.plain(f + "gate.tid2eid"))
        else:
            put(hf + "gate.e_score_correction_bias", dq.plain(f + "gate.bias"))
        gu, dn = sd[hf + "experts.gate_up_proj"], sd[hf + "experts.down_proj"]
        inter = gu.shape[1] // 2
        with torch.no_grad():
            for e in range(gu.shape[0]):
                gu[e, :inter].copy_(dq.weight(f + f"experts.{e}.w1"))
                gu[e, inter:].copy_(dq.weight(f + f"experts.{e}.w3"))
                dn[e].copy_(dq.weight(f + f"experts.{e}.w2"))
        done.update({hf + "experts.gate_up_proj", hf + "experts.down_proj"})
        put(hf + "shared_experts.gate_proj.weight", dq.weight(f + "shared_experts.w1"))
        put(hf + "shared_experts.up_proj.weight", dq.weight(f + "shared_experts.w3"))
        put(hf + "shared_experts.down_proj.weight", dq.weight(f + "shared_experts.w2"))
    missing = [k for k in sd if k not in done]
    if missing:
        raise ValueError(f"transformers parameters not filled from the checkpoint: {missing[:20]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--T", type=int, required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    ap.add_argument("--columns", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--synth", default="", help="the dsv4 synth command that made --model (recorded)")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_pretrained(args.model)
    cfg._attn_implementation = "eager"
    print("config:", {k: getattr(cfg, k) for k in ("layer_types", "compress_rates", "mlp_layer_types",
                                                    "rope_parameters", "sliding_window", "index_topk")}, flush=True)
    dev = torch.device(args.device)
    with torch.device(dev):
        model = DeepseekV4ForCausalLM(cfg).float().eval()
    build_state(model, Dequant(open_checkpoint(args.model), dev), cfg)

    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(3, cfg.vocab_size, size=args.T).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens[None], device=dev), use_cache=False)
    logits = out.logits[0].float().cpu().numpy()
    assert logits.shape == (args.T, cfg.vocab_size), logits.shape
    assert np.isfinite(logits).all(), "non-finite logits"

    cols = np.sort(np.random.default_rng(args.seed + 1).choice(cfg.vocab_size, size=min(args.columns, cfg.vocab_size),
                                                              replace=False)).astype(np.int64)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.name)
    open(base + ".tokens", "w").write(",".join(str(int(t)) for t in tokens) + "\n")
    logits[:, cols].astype("<f4").tofile(base + ".cols.f32")
    am = logits.argmax(axis=1)
    srt = np.sort(logits, axis=1)
    meta = {"T": args.T, "vocab": int(cfg.vocab_size), "scale": float(np.abs(logits).max()),
            "columns": [int(c) for c in cols], "argmax": [int(a) for a in am],
            "argmax_logit": [float(logits[t, am[t]]) for t in range(args.T)],
            "top2_gap": [float(srt[t, -1] - srt[t, -2]) for t in range(args.T)],
            "synth": args.synth, "transformers": __import__("transformers").__version__,
            "torch": torch.__version__, "device": str(dev)}
    json.dump(meta, open(base + ".json", "w"))
    print(f"{args.name}: T={args.T} vocab={cfg.vocab_size} scale={meta['scale']:.4f} "
          f"min top2 gap={min(meta['top2_gap']):.3g}", flush=True)


if __name__ == "__main__":
    main()
