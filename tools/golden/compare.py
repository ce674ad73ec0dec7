#!/usr/bin/env python3
"""Compares dsv4 logits (T x vocab float32, from `dsv4 logits --out`) with a golden NAME.json/NAME.cols.f32.

usage: compare.py GOLDEN_PREFIX DSV4_LOGITS.f32
Prints max |diff| / scale over the sampled columns, argmax agreement and the
worst positions.  Exit status 1 if the exact-profile tolerance (1e-4 of scale)
or argmax agreement fails.  (The C test tests/test_golden.c applies the same rule.)
"""
import json, sys
import numpy as np
meta = json.load(open(sys.argv[1] + ".json"))
T, V, cols = meta["T"], meta["vocab"], np.array(meta["columns"])
gold = np.fromfile(sys.argv[1] + ".cols.f32", dtype="<f4").reshape(T, len(cols))
ours = np.fromfile(sys.argv[2], dtype="<f4").reshape(T, V)
d = np.abs(ours[:, cols] - gold)
rel = d.max() / meta["scale"]
am = ours.argmax(axis=1)
agree = (am == np.array(meta["argmax"])).mean()
am_err = np.abs(ours[np.arange(T), meta["argmax"]] - np.array(meta["argmax_logit"])).max() / meta["scale"]
worst = np.argsort(-d.max(axis=1))[:5]
print(f"{sys.argv[1]}: T={T} scale={meta['scale']:.4f} max|diff|/scale={rel:.3e} argmax-logit err/scale={am_err:.3e} "
      f"argmax agree={agree*100:.2f}% worst positions={[(int(t), float(d[t].max())) for t in worst]}")
sys.exit(0 if rel <= 1e-4 and am_err <= 1e-4 and agree == 1.0 else 1)
