#!/usr/bin/env python3
"""Device probe: what the installed transformers' DeepseekV4 looks like.

Copies the installed deepseek_v4 modeling/configuration sources to $OUT (to
read the exact reference we compare against) and prints the default config
and the parameter names/shapes of a tiny instance.
"""
import os, shutil, sys, json
import torch, transformers
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M, configuration_deepseek_v4 as C
out = os.environ.get("OUT", "/tmp")
for mod in (M, C):
    shutil.copy(mod.__file__, os.path.join(out, os.path.basename(mod.__file__)))
print("transformers", transformers.__version__, "torch", torch.__version__)
cfg = C.DeepseekV4Config()
print(json.dumps(cfg.to_dict(), indent=1, default=str)[:6000])
