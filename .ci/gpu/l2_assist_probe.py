"""Probe: the first split of a KV head to finish warms L2 for its sibling's last pages (issue 13's all-compressible bar).

A record: it rewrites the fused kernel as it was before the two-level merge (commit 55b3dff and earlier;
``git show 55b3dff:zipkv/kernels/decode_mma.py``) and refuses today's, whose merge it no longer matches.

The timeline probe shows the static split's tail: at 8192 x 64 the programs' page loops end up to 8.6-11 us (H200) and
14 us (H100) after the median one, and the balanced schedule (``balanced_probe.py``) lost more to pipeline restarts
than it won. Here nothing about the schedule changes: in a copy of :mod:`zipkv.kernels.decode_mma` rewritten at run
time, a program whose page loop has ended while its sibling split (the next split of the same request and KV head)
has not yet arrived reads the sibling's last ``N`` units' page ids and descriptors and issues one
``cp.async.bulk.prefetch.L2`` per block (768 bytes compressed, 1024 raw), then writes its partial as before. Every
program computes exactly what the committed kernel computes, so the output must equal the committed kernel's bit for
bit; the sibling's last units then come from L2 instead of HBM. Checked here: bit-for-bit equality with the committed
kernel (packed and raw pages, variable lengths, the 8192 x 64 point); then timed beside the committed kernel and
FlashInfer TC in interleaved rounds at 8192 x 64 (Llama-3.1-8B shape), all compressed and raw.

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/l2_assist_probe.py OUT.csv`` (about 3 minutes, mostly compiling).
"""
import math
import os
import statistics
import sys

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import interleaved, probe_kernel, provenance, variable_lengths  # noqa: E402

from zipkv.bench.attention import ATTENTION_SHAPES, attention_inputs  # noqa: E402
from zipkv.bench.baselines import FlashInferDecode, paged_table  # noqa: E402
from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402

SHAPE, CTX, BATCH, PAGE, ROUNDS = "llama3.1-8b", 8192, 64, 16, 7
ASSISTS = (0, 2, 4, 8, 16, 32)
"""Units of the sibling's range prefetched (0: the rewritten copy with the assist compiled out, a control)."""

ASSIST = [
    ("KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr, NQ: gl.constexpr):\n    \"\"\"Grid (batch",
     "KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr, NQ: gl.constexpr,\n"
     "                      ASSIST: gl.constexpr = 0):\n    \"\"\"Grid (batch"),
    ("    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD)\n",
     """    if ASSIST > 0:
        if SPLITS > 1:
            if gl.load(cnt_ptr + b * HKV + h, volatile=True) == 0:      # the sibling has not arrived yet
                _assist(pool_ptr, desc_ptr, indices_ptr, p_start, units, (s + 1) % SPLITS, h, HKV, SPLITS, ASSIST)
    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD)
"""),
    ("\n@gluon.jit\ndef _pipelined_kernel(", '''
PREFETCH = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                         order=[1, 0]))


@gluon.jit
def _assist(pool_ptr, desc_ptr, indices_ptr, p_start, units, s2, h, HKV: gl.constexpr, SPLITS: gl.constexpr,
            N: gl.constexpr):
    """L2 prefetch of the last N units of split s2's range (head_dim 128: a unit is a page; 8 blocks, K then V)."""
    per = gl.cdiv(units - 1, SPLITS)
    lo = gl.minimum(s2 * per, units - 1)
    hi = gl.minimum(lo + per, units - 1)
    if s2 == SPLITS - 1:
        hi = units
    u = hi - N + gl.arange(0, N, layout=gl.SliceLayout(1, PREFETCH))[:, None]
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, PREFETCH))[None, :]
    ok = (u >= lo) & (j >= 0)
    page = gl.load(indices_ptr + p_start + gl.maximum(u, 0), mask=ok, other=0).to(gl.int64)
    d = gl.load(desc_ptr + ((page * 2 + j // 4) * HKV + h) * 4 + j % 4, mask=ok, other=0)
    size = gl.where(((d >> 7) & 1) != 0, 768, 1024)
    addr = pool_ptr.to(gl.int64) + (d >> 8)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [addr, size, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pipelined_kernel('''),
]


def assisted(mod, q, p, n):
    """Launch function of the rewritten copy ``mod`` over plan ``p`` (its split count, ring depth and workspace)."""
    (kind, _), = p._launches
    B, HQ, _ = q.shape
    HKV = p.cache.kv_heads
    ws = mod.workspace(B, HQ, HKV, p.num_splits, q.device)
    part, lse, counters = (ws.get(name, q) for name in ("part", "lse", "counters"))
    out, qk = torch.empty_like(q), p.softmax_scale * math.log2(math.e)

    def fn():
        mod._pipelined_kernel[(B, HKV, p.num_splits)](
            q, p.cache.pool, p.cache.desc, p.indptr, p.indices, p.last_page_len, part, lse, out, counters, qk,
            HKV=HKV, G=HQ // HKV, SPLITS=p.num_splits, KIND=kind, SLOTS=p.configs[0]["stages"], HD=p.cache.head_dim,
            NQ=mod.query_columns(HQ // HKV), ASSIST=n, num_warps=1)
        return out
    return fn


def same_as_committed(mod, q, p, label):
    """Every N's output over plan ``p`` must be the committed kernel's, bit for bit (the copy computes nothing else)."""
    ref = p.run(q).clone()
    for n in ASSISTS:
        got = assisted(mod, q, p, n)().clone()
        if not torch.equal(got, ref):
            raise AssertionError(f"{label}, N={n}: output differs from the committed kernel's")


def main(out_csv):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    mod = probe_kernel(ASSIST, "mma_l2_assist")
    q, plans = variable_lengths(gen)
    for compress, p in plans.items():
        same_as_committed(mod, q, p, f"lengths 1-700, {compress}")
    model = ATTENTION_SHAPES[SHAPE]
    k, v, q = attention_inputs(SHAPE, CTX, BATCH, gen)
    fns = {}
    for compress in ("eligible", "none"):
        cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma", v_layout="v_mma")
        p = plan(indptr, indices, last, cache, model.q_heads)
        same_as_committed(mod, q, p, f"{CTX} x {BATCH}, {compress}")
        out = torch.empty_like(q)
        data = "all compressed" if compress == "eligible" else "raw"
        fns[(data, "committed")] = lambda p=p, out=out: p.run(q, out)
        for n in ASSISTS:
            fns[(data, f"assist N={n}")] = assisted(mod, q, p, n)
    print(f"every variant equals the committed kernel bit for bit (splits {p.num_splits})", flush=True)
    ip, ind, lp, kp, vp = paged_table(k, v)
    fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
    fns[("any", "flashinfer_tc")] = lambda: fi(q, kp, vp)
    times = interleaved(fns, ROUNDS, timer)
    fi_us = statistics.median(times[("any", "flashinfer_tc")])
    rows = []
    for (data, name), ts in times.items():
        us = statistics.median(ts)
        rows.append(dict(kv_data=data, variant=name, latency_us=us, speedup_vs_flashinfer_tc=fi_us / us,
                         rounds_us=" ".join(f"{t:.1f}" for t in ts)))
        print(f"{data:15s} {name:15s} {us:8.1f} us  FI TC / this {fi_us / us:.3f}", flush=True)
    pd.DataFrame(rows).assign(shape=SHAPE, ctx=CTX, batch=BATCH, **provenance()).to_csv(out_csv, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
