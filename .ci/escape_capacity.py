"""Fig. 5's largest batch under the budget for ZipFusion's format and the escape format, on the CPU (host work only:
``zipkv.study.experiments.throughput.packed_capacity`` places the blocks' sizes on the meta device): Llama-3.1-8B shape,
the budget of 46 uncompressed requests of 8192 + 256 tokens, real-KV prefixes from the embedded model (two PG19
windows of 2048 tokens), the mma layouts. About 37 minutes on 2 cores (both formats).

    flock /tmp/zipkv-heavy.lock python .ci/escape_capacity.py results/paper/escape_format_capacity.csv
"""
import sys, time
import torch
from zipkv import data, models
from zipkv.study.experiments import throughput as tp

t0 = time.time()
small, tok = models.load_model(dtype=torch.bfloat16)
blocks = tp.real_kv_blocks(small, tok, data.load_books(), windows=2, context=2048, seed=0)
print("blocks", blocks[0].shape, f"{time.time() - t0:.0f}s", flush=True)
from transformers import LlamaConfig
cfg = LlamaConfig(**tp.LLAMA_8B)
budget = tp.largest_batch_budget(cfg, 46, 8192 + 256 - 1, pages_per_chunk=16)
print("budget", budget, flush=True)
t = tp.packed_capacity(blocks, cfg, budget, layouts=(("k_mma", "v_mma"),), block_formats=("zipfusion", "escape"),
                       progress=True)
print(t.to_string(), flush=True)
import platform, subprocess
t["device"] = f"CPU ({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores)"
t["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
t["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
t.to_csv(sys.argv[1] if len(sys.argv) > 1 else "escape_capacity.csv", index=False)
print(f"done {time.time() - t0:.0f}s")
