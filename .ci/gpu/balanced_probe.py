"""Probe: a deterministic balanced schedule for the Gluon kernel's launch tail (issue 13's all-compressible bar).

A record: it rewrites the fused kernel as it was before the two-level merge (commit 55b3dff and earlier;
``git show 55b3dff:zipkv/kernels/decode_mma.py``) and refuses today's, whose merge it no longer matches.

The timeline probe shows the static split's tail: at 8192 x 64 the programs' page loops end up to 11 us (H200) after the
median one. Here, in a copy of :mod:`zipkv.kernels.decode_mma` rewritten at run time, each split keeps the last part of
its range but hands its first ``K * C`` units out as K fixed chunks of C units, which any program claims from one
atomic queue once its own part is done. Every chunk has its own partial slot, merged in a fixed order with the splits'
by the last arrival, so the output does not depend on which program ran which chunk: deterministic from run to run and
bit for bit the same over packed and raw pages. Checked here: against fp32 attention, packed against raw, two runs
against each other, and variable sequence lengths against the committed kernel; then timed beside the committed kernel
and FlashInfer TC in the same rounds at 8192 x 64 (Llama-3.1-8B shape).

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/balanced_probe.py OUT.csv`` (about 5 minutes, mostly compiling). Its runs (an H100,
an H200) are ``results/paper/zipfusion_kernel_balanced_ab.csv``: every variant slower than the static split (the latency
chapter, "Where the launch's time goes").
"""
import math
import os
import re
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import (against_committed, anchor, lossless, probe_kernel, provenance,  # noqa: E402
                                variant_rows)

from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels import decode_mma  # noqa: E402

SHAPE, CTX, BATCH, ROUNDS = "llama3.1-8b", 8192, 64, 7
VARIANTS = [(2, 8), (4, 4), (4, 8), (8, 2), (8, 4)]
"""(K chunks per split, C units per chunk) timed."""

BALANCED = [
    ("def _pipelined(qk0, qk1, m_i, l_i, acc, pool_ptr,",
     "def _pipelined(kbuf, vbuf, ksbuf, vsbuf, kflags, vflags, qk0, qk1, m_i, l_i, acc, pool_ptr,"),
    ("""    kbuf, vbuf = _rings(KIND, SLOTS)
    ksbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    vsbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    kflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 16], SCALES)
    vflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 4], SCALES)
    last = hi - 1""", "    last = hi - 1"),
    ("\ndef workspace(batch: int,", '''
{finish_slot}


@gluon.jit
def _balanced_kernel(q_ptr, pool_ptr, desc_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, lse_ptr, out_ptr,
                     cnt_ptr, queue_ptr, qk_scale, B, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr,
                     KIND: gl.constexpr, SLOTS: gl.constexpr, HD: gl.constexpr, NQ: gl.constexpr, K: gl.constexpr,
                     C: gl.constexpr):
    b = gl.program_id(0)
    h = gl.program_id(1)
    s = gl.program_id(2)
    NP: gl.constexpr = SPLITS * (1 + K)
    kbuf, vbuf = _rings(KIND, SLOTS)
    ksbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    vsbuf = gl.allocate_shared_memory(gl.float32, [SLOTS, 16], SCALES)
    kflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 16], SCALES)
    vflags = gl.allocate_shared_memory(gl.int32, [SLOTS if KIND == MIXED else 1, 4], SCALES)
    p_start, npages, units, lo, hi, qk0, qk1, m_i, l_i, acc = _prologue(q_ptr, indptr_ptr, b, h, s, HKV, G, SPLITS,
                                                                        HD, NQ)
    if s == SPLITS - 1:
        hi = units
    hlo = gl.minimum(lo + K * C, hi)
    if hi > hlo:
        m_i, l_i, acc = _pipelined(kbuf, vbuf, ksbuf, vsbuf, kflags, vflags, qk0, qk1, m_i, l_i, acc, pool_ptr,
                                   desc_ptr, indices_ptr, p_start, npages, hlo, hi, gl.load(last_ptr + b), h, qk_scale,
                                   HKV, KIND, SLOTS, HD, NQ)
    _finish_slot(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, NP, NQ, HD)
    total = B * (HKV * SPLITS * K)
    t = gl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    while t < total:
        h2 = t % HKV
        b2 = (t // HKV) % B
        s2 = (t // (HKV * B)) % SPLITS
        j = t // (HKV * B * SPLITS)
        p2, n2, u2, lo2, hi2, qa, qb, m2, l2, acc2 = _prologue(q_ptr, indptr_ptr, b2, h2, s2, HKV, G, SPLITS, HD, NQ)
        if s2 == SPLITS - 1:
            hi2 = u2
        clo = gl.minimum(lo2 + j * C, hi2)
        chi = gl.minimum(clo + C, hi2)
        if chi > clo:
            m2, l2, acc2 = _pipelined(kbuf, vbuf, ksbuf, vsbuf, kflags, vflags, qa, qb, m2, l2, acc2, pool_ptr,
                                      desc_ptr, indices_ptr, p2, n2, clo, chi, gl.load(last_ptr + b2), h2, qk_scale,
                                      HKV, KIND, SLOTS, HD, NQ)
        _finish_slot(part_ptr, lse_ptr, out_ptr, cnt_ptr, m2, l2, acc2, b2, h2, SPLITS + s2 * K + j, HKV, G, NP, NQ,
                     HD)
        t = gl.atomic_add(queue_ptr, 1, sem="relaxed", scope="gpu")
    done = gl.atomic_add(queue_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == B * (HKV * SPLITS) - 1:                  # the last program out resets the queue for the next launch
        gl.store(queue_ptr, 0)
        gl.store(queue_ptr + 1, 0)


def workspace(batch: int,'''),
]


def _finish_slot_source() -> str:
    """decode_mma's ``_finish`` as ``_finish_slot``: split ``s`` of ``SPLITS`` read as partial slot ``slot`` of ``NP``
    (a head's split or one of its chunks; NP > 1, so always the merging branch)."""
    src = Path(decode_mma.__file__).read_text()
    start = src.index("@gluon.jit\ndef _finish(")
    body = re.sub(r'""".*?"""', "", src[start:src.index("\n\n\n", start)], count=1, flags=re.S)
    return re.sub(r"(?<!')\bs\b", "slot", re.sub(r"\bSPLITS\b", "NP", body)).replace("def _finish(", "def _finish_slot(")


BALANCED = [(old, new.replace("{finish_slot}", _finish_slot_source())) for old, new in BALANCED]


def balanced(mod, q, p, K, C, stages):
    """Launch function of the balanced copy ``mod`` over plan ``p``'s cache (its split count), with its workspace."""
    (kind, _), = p._launches
    B, HQ, D = q.shape
    HKV, NP = p.cache.kv_heads, p.num_splits * (1 + K)
    ws = dict(part=torch.empty(B, HQ, NP, D, dtype=torch.float32, device=q.device),
              lse=torch.empty(B, HQ, NP, dtype=torch.float32, device=q.device),
              counters=torch.zeros(B * HKV, dtype=torch.int32, device=q.device),
              queue=torch.zeros(2, dtype=torch.int32, device=q.device))
    out, qk = torch.empty_like(q), p.softmax_scale * math.log2(math.e)

    def fn():
        mod._balanced_kernel[(B, HKV, p.num_splits)](
            q, p.cache.pool, p.cache.desc, p.indptr, p.indices, p.last_page_len, ws["part"], ws["lse"], out,
            ws["counters"], ws["queue"], qk, B, HKV=HKV, G=HQ // HKV, SPLITS=p.num_splits, KIND=kind, SLOTS=stages,
            HD=p.cache.head_dim, NQ=mod.query_columns(HQ // HKV), K=K, C=C, num_warps=1)
        return out
    return fn


def main(out_csv):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    mod = probe_kernel(BALANCED, "mma_balanced")
    launch = lambda q, p, kc: balanced(mod, q, p, *kc, p.configs[0]["stages"])     # noqa: E731
    against_committed(gen, launch, VARIANTS)
    q, ref, plans, flashinfer = anchor(gen, CTX, BATCH)
    p0, out0 = plans["eligible"], torch.empty_like(q)
    fns = {"committed": lambda: p0.run(q, out0)}
    for K, C in VARIANTS:
        name = f"balanced K={K} C={C}"
        fns[name] = lossless(name, launch(q, p0, (K, C)), launch(q, plans["none"], (K, C)), ref)
    fns["flashinfer_tc"] = flashinfer

    def columns(name):
        return dict(zip(("chunks", "chunk_units"), map(int, name.replace("=", " ").split()[2::2]))) if "K=" in name else {}
    rows = variant_rows(fns, ROUNDS, timer, columns)
    pd.DataFrame(rows).assign(shape=SHAPE, ctx=CTX, batch=BATCH, **provenance()).to_csv(out_csv, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
