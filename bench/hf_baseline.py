#!/usr/bin/env python3
"""Outside baseline for `dsv4 bench`: transformers' DeepseekV4ForCausalLM, bf16, eager attention.

    python3 bench/hf_baseline.py --config DIR [--layers 2] [--prompt 2048] [--gen 16] [--batch 1]

DIR holds a config.json written by `dsv4 synth --config flash` (the real shapes).  The
model is built from it with --layers trunk layers and random weights: the timing of the
eager path does not depend on the values (routing spreads tokens over experts the same
way a trained router would, roughly uniformly), and a 43-layer bf16 copy would not fit
one GPU anyway (~13 GB of bf16 experts per layer).  Prints prefill tok/s, decode ms per
step and per layer, measured with torch.cuda.synchronize around the timed region after
one warm-up step.  Runs on the device machine (torch 2.11, transformers 5.17).
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config.from_pretrained(args.config)
    cfg._attn_implementation = "eager"
    cfg.num_hidden_layers = args.layers
    for key in ("layer_types", "compress_rates", "mlp_layer_types"):
        v = getattr(cfg, key, None)
        if isinstance(v, (list, tuple)) and len(v) > args.layers:
            setattr(cfg, key, list(v)[: args.layers])
    if hasattr(cfg, "num_nextn_predict_layers"):
        cfg.num_nextn_predict_layers = 0
    dev = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(dev):
        model = DeepseekV4ForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.cuda.synchronize()
    print(f"hf: built {args.layers} layers in {time.time() - t0:.1f} s; "
          f"{torch.cuda.memory_allocated() / 1e9:.1f} GB on the GPU; transformers "
          f"{__import__('transformers').__version__}, torch {torch.__version__}", flush=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt + args.gen + 1), generator=g).to(dev)
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.time()
        out = model(input_ids=ids[:, : args.prompt], use_cache=True)
        torch.cuda.synchronize()
        tp = time.time() - t0
        past = out.past_key_values
        out = model(input_ids=ids[:, args.prompt: args.prompt + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        torch.cuda.synchronize()
        t0 = time.time()
        for i in range(args.gen):
            p = args.prompt + 1 + i
            out = model(input_ids=ids[:, p: p + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
        torch.cuda.synchronize()
        td = time.time() - t0
    step = td / args.gen * 1e3
    print(f"hf: prefill {args.prompt} x {args.batch} tokens in {tp:.3f} s = {args.prompt * args.batch / tp:.1f} tok/s",
          flush=True)
    print(f"hf: decode batch {args.batch} at context {args.prompt}: {step:.2f} ms/step, "
          f"{step / args.layers:.2f} ms per layer per step (head included in the step), "
          f"{args.batch * 1e3 / step:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
