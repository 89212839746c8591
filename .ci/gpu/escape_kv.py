"""Here, on the CPU, before .ci/gpu/escape.sh: the embedded model's real KV blocks for the escape kernel's timing on
the GPU (which has no model): ``zipkv.study.experiments.throughput.real_kv_blocks`` of two PG19 windows of 2048
tokens (every layer, post-RoPE bf16, 512-value token-layout blocks, as Fig. 5's real-KV prefixes use them), a run of
consecutive blocks from each layer kept (``--blocks`` per tensor in all), saved to ``.gpu/escape_kv/blocks.pt``
(ignored by git; carried to the GPU machine: 12 MB by default).

    python .ci/gpu/escape_kv.py [--blocks 6144]
"""
import argparse
import os

import torch

from zipkv import data, models
from zipkv.study.experiments.throughput import real_kv_blocks

parser = argparse.ArgumentParser()
parser.add_argument("--blocks", type=int, default=6144)
parser.add_argument("--out", default=".gpu/escape_kv/blocks.pt")
args = parser.parse_args()
small, tok = models.load_model(dtype=torch.bfloat16)
k, v = real_kv_blocks(small, tok, data.load_books(), windows=2, context=2048, seed=0)
layers = small.config.num_hidden_layers
per_layer = k.shape[0] // (2 * layers)                       # blocks of one layer in one window
take = args.blocks // (2 * layers)
idx = torch.cat([torch.arange(i * per_layer, i * per_layer + take) for i in range(2 * layers)])
os.makedirs(os.path.dirname(args.out), exist_ok=True)
torch.save({"k": k[idx].clone(), "v": v[idx].clone(), "run": take, "source": "real_kv_blocks(windows=2, context=2048, "
            "seed=0), SmolLM2-135M-Instruct, a run of consecutive blocks from each layer and window"}, args.out)
print(f"saved {idx.numel()} K and V blocks ({2 * idx.numel() * 1024 / 2**20:.1f} MB) to {args.out}")
