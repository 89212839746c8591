"""Where the fused kernel's time goes with few requests and long contexts (one to sixteen requests, 32K-128K tokens).

For each (context, batch) point and page kind (all compressed, raw), the committed kernel is launched at a sweep of
split counts (the plan's own choice among them) beside FlashInfer TC on the same page table, in interleaved cold-L2
rounds; an instrumented copy of the kernel (``timeline_probe.TIMELINE``: per program ``%globaltimer`` at its start,
at the end of its unit loop and after its merge) says, per launch, when the last program started, when the last loop
ended and how long the merge of the last-arriving split took.

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/small_batch_probe.py OUT.csv`` (a row per point, kind and split count).
"""
import math
import os
import statistics
import sys

from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import interleaved, probe_kernel, provenance  # noqa: E402
from timeline_probe import TIMELINE  # noqa: E402

from zipkv.bench.attention import (ATTENTION_SHAPES, attention_inputs, measured_compressible_fraction,  # noqa: E402
                                   mix_mask)
from zipkv.bench.baselines import FlashInferDecode, paged_table  # noqa: E402
from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402

SHAPE, PAGE, ROUNDS = "llama3.1-8b", 16, 3
MIX = measured_compressible_fraction(Path(__file__).resolve().parents[2] / "results/paper/model_data_kv_cache.csv")
POINTS = [(int(c), int(b)) for c, b in (p.split("x") for p in
                                         os.environ.get("POINTS", "32768x1 32768x4 131072x1 131072x4 32768x16").split())]
SPLITS = [int(s) for s in os.environ.get("SPLITS", "4 8 16 32 64 128 256").split()]


def main(path):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    model = ATTENTION_SHAPES[SHAPE]
    mod = probe_kernel(TIMELINE, "mma_timeline_small")
    rows = []
    for ctx, batch in POINTS:
        k, v, q = attention_inputs(SHAPE, ctx, batch, gen)
        ip, ind, lp, kp, vp = paged_table(k, v)
        fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
        fns, plans = {"flashinfer_tc": lambda: fi(q, kp, vp)}, {}
        mix = mix_mask(batch, model.kv_heads, ctx, model.head_dim, MIX, 0)
        for kind, compress in (("compressed", "eligible"), ("measured mix", mix), ("raw", "none")):
            cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma",
                                                             v_layout="v_mma")
            default = plan(indptr, indices, last, cache, model.q_heads).num_splits
            for s in sorted(set(SPLITS) | {default}):
                if s > indices.numel() // batch:
                    continue
                p = plan(indptr, indices, last, cache, model.q_heads, num_splits=s)
                out = torch.empty_like(q)
                plans[(kind, s)] = (p, s == default)
                fns[f"{kind} {s}"] = lambda p=p, out=out: p.run(q, out)
        times = interleaved(fns, ROUNDS, timer, reps=20)
        fi_us = statistics.median(times["flashinfer_tc"])
        print(f"{ctx} x {batch}: flashinfer_tc {fi_us:.1f} us", flush=True)
        for (kind, s), (p, is_default) in plans.items():
            us = statistics.median(times[f"{kind} {s}"])
            qk, out = p.softmax_scale * math.log2(math.e), torch.empty_like(q)
            mod.TIMES[0] = torch.zeros(batch * model.kv_heads * s, 4, dtype=torch.int64, device="cuda")

            def fn():
                return mod.launch(q, p.cache, p.indptr, p.indices, p.last_page_len, p._launches, p.num_splits, qk,
                                  out, p._ws, p.configs[0]["stages"], p.configs[0].get("maxnreg") or 0)
            timer(fn, reps=5)
            t = mod.TIMES[0].cpu().double()
            base = t[:, 0].min()
            t0, t1, t2 = ((t[:, i] - base) / 1e3 for i in range(3))
            row = dict(ctx=ctx, batch=batch, kind=kind, splits=s, plan_default=is_default, latency_us=us,
                       flashinfer_tc_us=fi_us, ratio=fi_us / us, programs=len(t), start_max_us=float(t0.max()),
                       loop_p50_us=float((t1 - t0).median()), loop_end_max_us=float(t1.max()),
                       merge_max_us=float((t2 - t1).max()), span_us=float(t2.max()))
            rows.append(row)
            print({key: (round(val, 2) if isinstance(val, float) else val) for key, val in row.items()}, flush=True)
        del fns, plans, k, v, q, kp, vp, fi
        torch.cuda.empty_cache()
    pd.DataFrame(rows).assign(**provenance()).to_csv(path, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
