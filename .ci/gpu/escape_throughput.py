"""On the GPU (.ci/gpu/job.sh): decode tokens/s under Fig. 5's budget with escape-format pages beside ZipFusion's
format and the uncompressed engine, in the throughput chapter's Llama-3.1-8B-shape setting (random bf16 weights, the
budget of 46 uncompressed requests of 8,192 + 256 tokens, real-KV prefixes; ``zipkv.study.experiments.throughput``).
The real KV is ``.gpu/escape_kv/blocks.pt`` (``.ci/gpu/escape_kv.py``: runs of consecutive blocks of every layer of
two PG19 windows of the embedded model, the machine has no model), each method at its largest batch, ``--steps``
decode steps timed after the first token. Appends its rows to OUT.csv; commit them as
``results/paper/escape_format_throughput.csv`` (the chapter "Beyond the format" reads it).

    PYTHONPATH=/tmp/site:$PWD ZIPKV_COMMIT=<commit> python3 .ci/gpu/escape_throughput.py OUT.csv [--steps 24]
"""
import argparse
import os
import time

import pandas as pd
import torch

from zipkv.study.experiments import throughput as tp

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--blocks", default=".gpu/escape_kv/blocks.pt")
parser.add_argument("--device", default="cuda")
parser.add_argument("--layers", type=int, default=None, help="fewer layers (a dry run on the CPU)")
parser.add_argument("--batch", type=int, default=46, help="uncompressed requests the budget holds")
parser.add_argument("--context", type=int, default=8192)
parser.add_argument("--new-tokens", type=int, default=256)
args = parser.parse_args()
saved = torch.load(args.blocks)
blocks = (saved["k"].to(args.device), saved["v"].to(args.device))
model = tp.random_llama(args.device, **({"num_hidden_layers": args.layers} if args.layers else {}))
budget = tp.largest_batch_budget(model.config, args.batch, args.context + args.new_tokens - 1, pages_per_chunk=16)
rows = []
for method, block_format in (("uncompressed", None), ("zipfusion", "zipfusion"), ("zipfusion", "escape")):
    extra = {} if block_format is None else {"block_format": block_format}
    r = tp.decode_throughput(model, method, kv_budget_bytes=budget, blocks=blocks, context=args.context,
                             new_tokens=args.new_tokens, timed_steps=args.steps, pages_per_chunk=16, **extra)
    r.pop("stats")
    rows.append(dict(r, block_format=block_format or "raw"))
    print({k: rows[-1][k] for k in ("method", "block_format", "batch", "tokens_per_s", "stored_bits_per_value") if k in rows[-1]},
          flush=True)
t = pd.DataFrame(rows)
t["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
t["commit"] = os.environ.get("ZIPKV_COMMIT", "")
t["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
t.to_csv(args.out, index=False)
