#!/usr/bin/env python3
"""RoPE frequency tables: dsv4's against the two references, bit for bit (needs torch; run where the
golden tools run, e.g. the device machine).

dsv4 (src/model/forward.c rope_table) forms f_i = 1 / base^(2i/d) and the YaRN blend in double and
rounds to fp32 once (the kernels multiply (float)pos by (float)f).  DeepSeek's inference/model.py
(precompute_freqs_cis, as spec §2.4 transcribes it) forms the same in fp32 torch:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    smooth = 1 - linear_ramp_factor(low, high, dim // 2)      # fp32 arange, clamp(0, 1)
    freqs = freqs / factor * (1 - smooth) + freqs * smooth
and transformers builds its own buffers (inv_freq) in its rope utilities.  A one-ulp difference in
f_i moves the angle p * f_i in proportion to the position p, so at long context it is not a rounding
detail.  This prints, per table, how many of the frequencies differ and the largest angle difference
at positions 2^16, 2^20 (1M).  --model DIR (a checkpoint's config.json, e.g. a `dsv4 synth --config
flash` directory) also reads transformers' inv_freq buffers from a small DeepseekV4 model built from
that config (fewer layers and experts, the same rope settings), where its API allows.
"""
import argparse
import math

import numpy as np
import torch


def corr(nrot, dim, base, orig):
    return dim * math.log(orig / (nrot * 2 * math.pi)) / (2 * math.log(base))


def low_high(dim, base, orig, beta_fast, beta_slow):
    low = max(math.floor(corr(beta_fast, dim, base, orig)), 0)
    high = min(math.ceil(corr(beta_slow, dim, base, orig)), dim - 1)
    return low, high


def dsv4_table(dim, base, yarn):
    """forward.c rope_table: double, one rounding to fp32 at the end"""
    f = np.array([1.0 / math.pow(base, (2.0 * i) / dim) for i in range(dim // 2)], dtype=np.float64)
    if yarn:
        factor, orig, bf, bs = yarn
        low, high = low_high(dim, base, orig, bf, bs)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        f = f / factor * ramp + f * (1.0 - ramp)
    return f.astype(np.float32)


def deepseek_table(dim, base, yarn):
    """model.py's fp32 torch form"""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn:
        factor, orig, bf, bs = yarn
        low, high = low_high(dim, base, orig, bf, bs)
        mn, mx = float(low), float(high)
        if mn == mx:
            mx += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - mn) / (mx - mn), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs.numpy().astype(np.float32)


def compare(name, ours, ref):
    d = ours != ref
    out = [f"{name}: {int(d.sum())} of {len(ours)} frequencies differ"]
    for p in (1 << 16, 1 << 20):
        ang = np.abs(np.float64(p) * (ours.astype(np.float64) - ref.astype(np.float64))).max()
        out.append(f"largest angle difference at position {p}: {ang:.3g} rad")
    print("; ".join(out))
    for i in np.nonzero(d)[0][:8]:
        print(f"    pair {i}: dsv4 {float(ours[i]).hex()} reference {float(ref[i]).hex()}")


def transformers_tables(model_dir):
    """inv_freq buffers of a small DeepseekV4 model with the checkpoint's rope settings (best effort)"""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_pretrained(model_dir)
    # the layer count stays the checkpoint's: its per-layer lists (compress ratios) have that many entries
    # (2026-12-05 on the device: num_hidden_layers 3 over flash-2's config raised IndexError)
    for k, v in (("n_routed_experts", 8), ("num_experts_per_tok", 2),
                 ("vocab_size", 256), ("moe_intermediate_size", 64)):
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    print("transformers rope_parameters:", getattr(cfg, "rope_parameters", None))
    model = DeepseekV4ForCausalLM(cfg).float()
    found = {}
    for mod_name, mod in model.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if "inv_freq" in buf_name and buf.ndim == 1:
                found[f"{mod_name}.{buf_name}"] = buf.detach().cpu().numpy().astype(np.float32)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="checkpoint directory for transformers' own buffers")
    args = ap.parse_args()
    dim = 64
    tables = {
        "base 10000, no YaRN (ratio-0 layers)": (10000.0, None),
        "base 160000, YaRN 16 / 65536 / 32 / 1 (compressed layers)": (160000.0, (16.0, 65536.0, 32.0, 1.0)),
    }
    for name, (base, yarn) in tables.items():
        compare("dsv4 vs DeepSeek model.py, " + name, dsv4_table(dim, base, yarn), deepseek_table(dim, base, yarn))
    if args.model:
        try:
            found = transformers_tables(args.model)
        except Exception as e:  # the API of this transformers version: report, do not guess
            print("transformers tables: not read:", repr(e))
            return
        for key, tab in found.items():
            for name, (base, yarn) in tables.items():
                ours = dsv4_table(dim, base, yarn)
                if len(tab) == len(ours) and np.allclose(tab, ours, rtol=1e-5, atol=0):
                    compare(f"dsv4 vs transformers {key} ({name})", ours, tab)
                    break
            else:
                print(f"transformers {key}: {len(tab)} values, matches neither table within 1e-5")


if __name__ == "__main__":
    main()
