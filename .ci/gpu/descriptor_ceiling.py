"""Ceiling probe of issue 13's all-compressible bar (>= 1.35x FlashInfer TC, Llama-3.1-8B shape, 8192 x 64).

Times, in the same rounds and over a context sweep at batch 64: the Gluon kernel's all-compressed path as committed
(``plan(...).run``, the latency chapter's fixed slots), the same path with its descriptor loads removed (a copy of
:mod:`zipkv.kernels.decode_mma` rewritten here at run time: block addresses computed from the page id, base 128,
scale 1 -- its numbers are wrong, its time is a ceiling for any metadata layout), the same path loading each
descriptor once (the per-token scales from the registers that hold it, not a second load), the committed kernel on
compact slots (the memory manager's placement), the uncompressed cache, FlashInfer TC, torch SDPA on a contiguous cache and
an empty launch (a one-element add: the floor of what the cold-L2 timer measures for any kernel).

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/descriptor_ceiling.py OUT.csv`` (about a minute). The latency chapter reads the committed table
``results/paper/zipfusion_descriptor_ceiling.csv`` (:func:`zipkv.study.chapters.latency.ceiling_text`).
"""
import datetime
import importlib.util
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from zipkv.bench.attention import ATTENTION_SHAPES, attention_inputs
from zipkv.bench.baselines import (FlashInferDecode, error_vs_reference, paged_table, reference_attention,
                                   sdpa_decode)
from zipkv.bench.timing import ColdTimer, copy_bandwidth
from zipkv.kernels import decode_mma
from zipkv.kernels.decode_attention import plan
from zipkv.paged import build_paged_cache

SHAPE = "llama3.1-8b"
PAGE = 16
# decode_mma's source -> the probe kernel: (old, new) pairs, each of which must occur
NO_DESCRIPTORS = [
    ("\n@gluon.jit\ndef _pipelined(", '''
@gluon.jit
def _no_descs(pa, h, HKV: gl.constexpr):
    """Fixed-slot descriptors of a head_dim-128 unit computed from its page id, base 128: no load."""
    kt = gl.arange(0, 16, layout=K_ROWS)
    vb = gl.arange(0, 4, layout=V_ROWS)
    return (((((pa * 2) * HKV + h) * 4096 + (kt // 4) * 768) << 8) | 0xC0,
            ((((pa * 2 + 1) * HKV + h) * 4096 + vb * 768) << 8) | 0xC0)


@gluon.jit
def _pipelined('''),
    ("kd, vd = _descs(desc_ptr, pa, pb, h, HKV, HD)", "kd, vd = _no_descs(pa, h, HKV)"),
    ("kdn, vdn = _descs(desc_ptr, paa, pba, h, HKV, HD)", "kdn, vdn = _no_descs(paa, h, HKV)"),
    ("kdn, vdn = _descs(desc_ptr, pan, pbn, h, HKV, HD)", "kdn, vdn = _no_descs(pan, h, HKV)"),
    ("ks, vs = _scales(desc_ptr, pa, pb, h, qk_scale, HKV, KIND, HD)",
     "ks, vs = gl.full([16], qk_scale, gl.float32, layout=TOKS), gl.full([16], 1.0, gl.float32, layout=TOKS)"),
    ("ks, vs = _scales(desc_ptr, paa, pba, h, qk_scale, HKV, KIND, HD)",
     "ks, vs = gl.full([16], qk_scale, gl.float32, layout=TOKS), gl.full([16], 1.0, gl.float32, layout=TOKS)"),
]


# ... -> a probe kernel that loads each descriptor once: the per-token scales of the all-compressed path from the
# descriptors the copies already loaded (registers) instead of a second load per unit
ONE_LOAD = [
    ("\n@gluon.jit\ndef _pipelined(", '''
SCALE_ROWS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32, 1], warps_per_cta=[1, 1],
                                           order=[1, 0]))


@gluon.jit
def _scales_of(kd, vd, qk_scale):
    """All-compressed unit: the scales of :func:`_scales` from its descriptors ``kd`` [16 rows], ``vd`` [4 blocks]."""
    ks = gl.convert_layout(_pow2(kd & 0x7F), TOKS) * qk_scale
    vb = gl.convert_layout(_pow2(vd & 0x7F), gl.SliceLayout(0, SCALE_ROWS))
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, SCALE_ROWS))
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, SCALE_ROWS))
    vs = gl.sum(gl.where(((r >> 1) % 4)[:, None] == j[None, :], vb[None, :], 0.0), axis=1)
    return ks, gl.convert_layout(vs, TOKS)


@gluon.jit
def _pipelined('''),
    ("ks, vs = _scales(desc_ptr, pa, pb, h, qk_scale, HKV, KIND, HD)", "ks, vs = _scales_of(kd, vd, qk_scale)"),
    ("ks, vs = _scales(desc_ptr, paa, pba, h, qk_scale, HKV, KIND, HD)", "ks, vs = _scales_of(kdn, vdn, qk_scale)"),
]


def interleaved(fns: dict, rounds: int, timer, reps: int = 30) -> dict:
    """name -> the ``rounds`` cold-L2 times (µs, each the median of ``reps`` calls) of ``fns[name]``: every round times
    each function once, in turn, so that a drift of the card's clocks reaches every one of them alike."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(fn, reps=reps))
    return times


def provenance() -> dict:
    """The columns every probe's table carries: the card, the commit (``ZIPKV_COMMIT``, typed in where the run was
    started: the GPU machine's checkout may lag) and the date."""
    return dict(device=torch.cuda.get_device_name(), commit=os.environ.get("ZIPKV_COMMIT", "unknown"),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def variable_lengths(gen):
    """Batch 9 of 1-700 tokens (partial pages, one-page and odd requests) at the Llama-3.1-8B shape: ``(q, {compress:
    plan})`` over all-compressed (``"eligible"``) and raw (``"none"``) pages, to check a probe's copy against the
    committed kernel."""
    model = ATTENTION_SHAPES[SHAPE]
    k, v, q = attention_inputs(SHAPE, 704, 9, gen)
    lens = torch.tensor([1, 15, 16, 17, 100, 255, 256, 513, 700])
    plans = {}
    for compress in ("eligible", "none"):
        cache, indptr, indices, last = build_paged_cache(k, v, lens, compress=compress, k_layout="k_mma",
                                                         v_layout="v_mma")
        plans[compress] = plan(indptr, indices, last, cache, model.q_heads)
    return q, plans


def against_committed(gen, launch, variants) -> None:
    """Each variant of a probe's copy at :func:`variable_lengths`, within 1e-2 of the committed kernel over packed and
    raw pages: ``launch(q, plan, variant)`` is the copy's launch function over ``plan``'s cache."""
    q, plans = variable_lengths(gen)
    for compress, p in plans.items():
        ref = p.run(q).float()
        for variant in variants:
            got = launch(q, p, variant)().float()
            err = ((got - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                raise AssertionError(f"{variant} {compress}: relative error {err:.2e} against the committed kernel")
    print("variable lengths: every variant within 1e-2 of the committed kernel", flush=True)


def anchor(gen, ctx: int, batch: int):
    """The Llama-3.1-8B-shape point ``ctx`` x ``batch``: ``(q, its fp32 attention, {compress: plan} over packed
    ("eligible") and raw ("none") pages in the mma layouts, FlashInfer TC's launch over the same K/V)``."""
    model = ATTENTION_SHAPES[SHAPE]
    k, v, q = attention_inputs(SHAPE, ctx, batch, gen)
    plans = {}
    for compress in ("eligible", "none"):
        cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma", v_layout="v_mma")
        plans[compress] = plan(indptr, indices, last, cache, model.q_heads)
    ip, ind, lp, kp, vp = paged_table(k, v)
    fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
    return q, reference_attention(q, k, v), plans, lambda: fi(q, kp, vp)


def lossless(name: str, packed, raw, ref):
    """``packed`` (a copy's launch over packed pages) if it is within 2e-2 of fp32 attention ``ref``, gives the same
    output twice and the same as ``raw`` (the copy over raw pages) bit for bit; else an AssertionError naming it."""
    a, b, r = packed().clone(), packed().clone(), raw().clone()
    err = error_vs_reference(a, ref)[0]
    print(f"{name}: error {err:.2e}, deterministic {torch.equal(a, b)}, packed == raw {torch.equal(a, r)}", flush=True)
    if err > 2e-2 or not torch.equal(a, b) or not torch.equal(a, r):
        raise AssertionError(f"{name} is wrong, not deterministic or not lossless")
    return packed


def variant_rows(fns: dict, rounds: int, timer, columns) -> list:
    """``fns`` (with ``"flashinfer_tc"``) timed in :func:`interleaved` rounds: a row per name with its median µs, FlashInfer
    TC's over it, every round and ``columns(name)`` (a dict)."""
    times = interleaved(fns, rounds, timer)
    fi_us = statistics.median(times["flashinfer_tc"])
    rows = []
    for name in fns:
        us = statistics.median(times[name])
        rows.append(dict(variant=name, latency_us=us, speedup_vs_flashinfer_tc=fi_us / us,
                         rounds_us=" ".join(f"{t:.1f}" for t in times[name]), **columns(name)))
        print(f"{name:24s} {us:8.1f} us  FI TC / this {fi_us / us:.3f}", flush=True)
    return rows


def probe_kernel(rewrite=NO_DESCRIPTORS, name="mma_no_descriptors"):
    """decode_mma rewritten by ``rewrite`` (:data:`NO_DESCRIPTORS` or :data:`ONE_LOAD`), imported from a temporary
    file (Gluon reads the source)."""
    src = Path(decode_mma.__file__).read_text()
    for old, new in rewrite:
        if src.count(old) != 1:
            raise RuntimeError(f"decode_mma changed: {old!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def point(ctx, batch, rounds, probe, one_load, timer, gen):
    """The methods at one (ctx, batch), timed in ``rounds`` interleaved rounds: a row per method."""
    model = ATTENTION_SHAPES[SHAPE]
    k, v, q = attention_inputs(SHAPE, ctx, batch, gen)
    ref = reference_attention(q, k, v)
    io = 2 * q.numel() * q.element_size()
    fns = {}
    for compact in (False, True):
        cache, indptr, indices, last = build_paged_cache(k, v, compress="eligible", k_layout="k_mma", v_layout="v_mma",
                                                         compact=compact)
        nbytes = cache.stats()["used_bytes"] + cache.desc.numel() * 8 + indices.numel() * 4 + io
        p = plan(indptr, indices, last, cache, model.q_heads)
        out = torch.empty_like(q)
        name = "zipkv_compressed_compact" if compact else "zipkv_compressed"
        fns[name] = (lambda p=p, out=out: p.run(q, out), nbytes, True, p)
        if not compact:
            o2 = torch.empty_like(q)
            qk = p.softmax_scale * math.log2(math.e)          # as DecodePlan.run: scores in the log2 domain

            def probed(kernel, o, p=p, qk=qk):
                return lambda: kernel.launch(q, p.cache, p.indptr, p.indices, p.last_page_len, p._launches,
                                             p.num_splits, qk, o, p._ws, p.configs[0]["stages"],
                                             p.configs[0].get("maxnreg") or 0)
            fns["zipkv_compressed_no_descriptors"] = (probed(probe, o2), cache.stats()["used_bytes"]
                                                      + indices.numel() * 4 + io, False, p)
            fns["zipkv_compressed_one_descriptor_load"] = (probed(one_load, torch.empty_like(q)), nbytes, True, p)
    raw, indptr, indices, last = build_paged_cache(k, v, compress="none", k_layout="k_mma", v_layout="v_mma")
    pr = plan(indptr, indices, last, raw, model.q_heads)
    outr = torch.empty_like(q)
    fns["zipkv_uncompressed"] = (lambda: pr.run(q, outr), raw.stats()["used_bytes"] + raw.desc.numel() * 8
                                 + indices.numel() * 4 + io, True, pr)
    ip, ind, lp, kp, vp = paged_table(k, v)
    fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
    kv_bytes = 2 * k.numel() * k.element_size()
    fns["flashinfer_tc"] = (lambda: fi(q, kp, vp), kv_bytes + ind.numel() * 4 + io, True, None)
    fns["sdpa"] = (lambda: sdpa_decode(q, k, v), kv_bytes + io, True, None)
    one = torch.zeros(1, device="cuda")
    fns["empty_launch"] = (lambda: one.add_(1), 0, False, None)
    for name, (fn, _, check, _) in fns.items():
        got = fn()
        if check and error_vs_reference(got, ref)[0] > 2e-2:
            raise AssertionError(f"{name} disagrees with fp32 attention at ctx {ctx}")
    times = interleaved({name: fn for name, (fn, *_) in fns.items()}, rounds, timer)
    fi_us = statistics.median(times["flashinfer_tc"])
    rows = []
    for name, (_, nbytes, _, p) in fns.items():
        us = statistics.median(times[name])
        rows.append(dict(shape=SHAPE, ctx=ctx, batch=batch, kv_data="all compressible", method=name, latency_us=us,
                         bytes_read=nbytes, tbps=nbytes / us / 1e6, speedup_vs_flashinfer_tc=fi_us / us,
                         num_splits=p.num_splits if p else None, stages=p.configs[0]["stages"] if p else None,
                         rounds_us=" ".join(f"{t:.1f}" for t in times[name])))
        print(f"{ctx:6d} x {batch}  {name:34s} {us:8.1f} us  {rows[-1]['tbps']:5.2f} TB/s  "
              f"FI TC / this {fi_us / us:.3f}", flush=True)
    return rows


def main(out_csv):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    probe, one_load = probe_kernel(), probe_kernel(ONE_LOAD, "mma_one_descriptor_load")
    rows = []
    for ctx in (1024, 2048, 4096, 8192, 16384):
        rows += point(ctx, 64, 5 if ctx == 8192 else 3, probe, one_load, timer, gen)
        torch.cuda.empty_cache()
    pd.DataFrame(rows).assign(copy_bw_tbps=copy_bw / 1e12, **provenance()).to_csv(out_csv, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
