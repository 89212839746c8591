"""Probe: the hardware block scheduler as the work queue for the launch's tail (issue 13's all-compressible bar).

A record: it rewrites the fused kernel as it was before the two-level merge (commit 55b3dff and earlier;
``git show 55b3dff:zipkv/kernels/decode_mma.py``) and refuses today's, whose merge it no longer matches.

The static split's programs end their page loops up to 8.6-11 us (H200) after the median one; the balanced schedule
(``balanced_probe.py``: programs claiming chunks from an atomic queue once their own part is done) lost more to its
serial claims and pipeline restarts than it won. Here the claims are the hardware's: in a copy of
:mod:`zipkv.kernels.decode_mma` rewritten at run time, each split keeps all but its last ``N * T`` units in one long
program, and its last units become ``N`` short programs of ``T`` units each, launched after every long program (one
1-D grid, dispatched in order). With the SM's residency held to ``R`` programs (shared memory padded; 8: every long
program starts at once, the short ones wait), an SM whose long programs end early takes the short ones that are
left: the balance comes from the block scheduler, with no claim, no restart inside a program, and fixed ranges, each
with its own partial slot merged in a fixed order (deterministic, and bit for bit the same over packed and raw pages).
Checked here: against the committed kernel at variable lengths, fp32 attention, packed against raw, two runs against
each other; then timed beside the committed kernel and FlashInfer TC in interleaved rounds at 8192 x 64
(Llama-3.1-8B shape), all compressed.

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/tail_blocks_probe.py OUT.csv`` (about a minute). Its run (an H100) is
``results/paper/zipfusion_kernel_short_programs_ab.csv``: every variant with short programs slower than the static
split (the latency chapter, "Where the launch's time goes").
"""
import math
import os
import sys

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import (against_committed, anchor, lossless, probe_kernel, provenance,  # noqa: E402
                                variant_rows)

from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels import decode_mma, occupancy  # noqa: E402

SHAPE, CTX, BATCH, ROUNDS = "llama3.1-8b", 8192, 64, 7
SHARED_PER_SM, SHARED_PER_BLOCK_RESERVED = 233472, 1024
VARIANTS = [(0, 0, 8), (1, 8, 8), (1, 16, 8), (1, 32, 8), (2, 8, 8), (2, 16, 8), (4, 4, 8), (4, 8, 8), (1, 16, 0)]
"""(N short programs per split, T units each, R programs per SM; R = 0: the kernel's own residency) timed."""

TAIL = [
    ("\ndef workspace(batch: int,", '''
PAD_REGS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32], warps_per_cta=[1], order=[0]))


@gluon.jit
def _pad(W: gl.constexpr, x):
    """W int32 words of shared memory, written (the kernel reads them back at its end, so that they stay allocated
    beside the ring: Triton reuses the memory of a buffer whose life has ended)."""
    pad = gl.allocate_shared_memory(gl.int32, [W], SCALES)
    pad.store(gl.arange(0, W, layout=PAD_REGS) + x)
    return pad


@gluon.jit
def _unpad(pad, x):
    """0 from a buffer of :func:`_pad`."""
    return gl.min(pad.load(PAD_REGS), axis=0) - x


@gluon.jit
def _tail_kernel(q_ptr, pool_ptr, desc_ptr, indptr_ptr, indices_ptr, last_ptr, part_ptr, lse_ptr, out_ptr, cnt_ptr,
                 qk_scale, B, T, HKV: gl.constexpr, G: gl.constexpr, KIND: gl.constexpr, SLOTS: gl.constexpr,
                 HD: gl.constexpr, NQ: gl.constexpr, N: gl.constexpr, PAD1: gl.constexpr, PAD2: gl.constexpr,
                 PAD3: gl.constexpr):
    """1-D grid: 2 B HKV long programs (b fastest, then h, then the half), then N rounds of 2 B HKV short ones.
    PAD1-3: int32 words of shared memory that only hold the SM's residency down (0: none)."""
    pid = gl.program_id(0)
    if PAD1 > 0:
        pad1 = _pad(PAD1, pid)
    if PAD2 > 0:
        pad2 = _pad(PAD2, pid)
    if PAD3 > 0:
        pad3 = _pad(PAD3, pid)
    NB = B * HKV * 2
    is_long = pid < NB
    t = gl.where(is_long, pid, pid - NB)
    r = t % NB
    j = t // NB
    half = r // (B * HKV)
    b = r % B
    h = (r // B) % HKV
    p_start, npages, units, lo, hi, qk0, qk1, m_i, l_i, acc = _prologue(q_ptr, indptr_ptr, b, h, half, HKV, G, 2,
                                                                        HD, NQ)
    cut = gl.maximum(lo, hi - N * T)
    rlo = gl.where(is_long, lo, gl.minimum(cut + j * T, hi))
    rhi = gl.where(is_long, cut, gl.minimum(cut + (j + 1) * T, hi))
    slot = gl.where(is_long, half * (1 + N), half * (1 + N) + 1 + j)
    rhi = gl.where(slot == 2 * (1 + N) - 1, units, rhi)        # the last slot takes the request's last unit
    if rhi > rlo:
        m_i, l_i, acc = _pipelined(qk0, qk1, m_i, l_i, acc, pool_ptr, desc_ptr, indices_ptr, p_start, npages, rlo,
                                   rhi, gl.load(last_ptr + b), h, qk_scale, HKV, KIND, SLOTS, HD, NQ)
    if PAD1 > 0:
        slot += _unpad(pad1, pid)
    if PAD2 > 0:
        slot += _unpad(pad2, pid)
    if PAD3 > 0:
        slot += _unpad(pad3, pid)
    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, slot, HKV, G, 2 * (1 + N), NQ, HD)


def workspace(batch: int,'''),
]


def pad_words(kind, slots, R):
    """(PAD1, PAD2, PAD3): powers of two of int32 words (or 0) whose shared memory holds an SM to R programs (zeros:
    R = 0)."""
    if not R:
        return 0, 0, 0
    base = decode_mma.shared_bytes(kind, slots) + 80 + SHARED_PER_BLOCK_RESERVED
    lo, hi = SHARED_PER_SM // (R + 1) - base, SHARED_PER_SM // R - base        # pad bytes in (lo, hi]
    parts = []
    while sum(parts) <= lo:                     # the largest power of two that still fits, until past lo
        parts.append(1 << ((hi - sum(parts)).bit_length() - 1))
    if len(parts) > 3 or (parts and parts[-1] < 128):
        raise ValueError(f"no three powers of two pad {base} bytes to {R} programs per SM")
    return tuple(w // 4 for w in parts + [0] * (3 - len(parts)))


def tail(mod, q, p, N, T, R):
    """Launch function of the tail copy ``mod`` over plan ``p``'s cache (its ring slots; two halves per KV head)."""
    (kind, _), = p._launches
    B, HQ, D = q.shape
    HKV, NP, stages = p.cache.kv_heads, 2 * (1 + N), p.configs[0]["stages"]
    ws = dict(part=torch.empty(B, HQ, NP, D, dtype=torch.float32, device=q.device),
              lse=torch.empty(B, HQ, NP, dtype=torch.float32, device=q.device),
              counters=torch.zeros(B * HKV, dtype=torch.int32, device=q.device))
    out, qk = torch.empty_like(q), p.softmax_scale * math.log2(math.e)
    pads = pad_words(kind, stages, R)

    def fn():
        fn.compiled = mod._tail_kernel[(B * HKV * 2 * (1 + N),)](
            q, p.cache.pool, p.cache.desc, p.indptr, p.indices, p.last_page_len, ws["part"], ws["lse"], out,
            ws["counters"], qk, B, T, HKV=HKV, G=HQ // HKV, KIND=kind, SLOTS=stages, HD=p.cache.head_dim,
            NQ=mod.query_columns(HQ // HKV), N=N, PAD1=pads[0], PAD2=pads[1], PAD3=pads[2],
            num_warps=1)
        return out
    return fn


def resident(compiled):
    """Programs per SM of a compiled launch (its registers and shared memory, the H200's / H100's SM)."""
    return occupancy.programs_per_sm(compiled.n_regs, 1, compiled.metadata.shared, occupancy.H200_SM)


def main(out_csv):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    mod = probe_kernel(TAIL, "mma_tail_blocks")
    launch = lambda q, p, ntr: tail(mod, q, p, *ntr)                                # noqa: E731
    against_committed(gen, launch, VARIANTS)
    q, ref, plans, flashinfer = anchor(gen, CTX, BATCH)
    p0, out0 = plans["eligible"], torch.empty_like(q)
    fns = {"committed": lambda: p0.run(q, out0)}
    for N, T, R in VARIANTS:
        name = f"tail N={N} T={T} R={R}"
        fns[name] = lossless(name, launch(q, p0, (N, T, R)), launch(q, plans["none"], (N, T, R)), ref)
        print(f"   {fns[name].compiled.n_regs} registers, {fns[name].compiled.metadata.shared} bytes of shared "
              f"memory: {resident(fns[name].compiled)} programs per SM", flush=True)
    fns["flashinfer_tc"] = flashinfer

    def columns(name):
        ntr = dict(zip(("short_per_split", "short_units", "programs_per_sm"),
                       map(int, name.replace("=", " ").split()[2::2]))) if "N=" in name else {}
        return dict(stages=p0.configs[0]["stages"], **ntr)
    rows = variant_rows(fns, ROUNDS, timer, columns)
    pd.DataFrame(rows).assign(shape=SHAPE, ctx=CTX, batch=BATCH, **provenance()).to_csv(out_csv, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
