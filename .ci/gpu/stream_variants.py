"""Stream-rate probe of issue 13's all-compressible bar (>= 1.35x FlashInfer TC, Llama-3.1-8B shape, 8192 x 64):
variants of the Gluon kernel's all-compressed path at that one point, timed in the same interleaved rounds beside
the committed kernel and FlashInfer TC. Each changes one thing that decides how fast the path streams its pages, in a
copy of :mod:`zipkv.kernels.decode_mma` rewritten at run time (``descriptor_ceiling.probe_kernel``):

* ``slots``: ring slots (shared-memory pipeline depth; the tuned options give 3);
* ``splits``: split-KV count (the plan's is 2: one wave of 1024 one-warp programs);
* ``one_load``: the per-token scales from the descriptors the copies already loaded (no second load per unit);
* ``l2``: the page copies with a PTX L2 prefetch hint, ``.L2::128B`` or ``.L2::256B`` (Triton emits none; patched
  into the PTX);
* ``no_descriptors``: no descriptor load at all (wrong numbers: a ceiling for any metadata layout).

Tried on two H100s at 921a1f7 (the rows of that commit in the table): the value ring swizzles and the 5-instruction
rebuild now committed, and the variants above, all within 0.6 % of the committed kernel but one (a value ring whose
fills conflict, +16.5 %). Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/stream_variants.py OUT.csv`` (about a minute; :file:`kernel.sh` runs it on the H200 and appends
the run to ``results/paper/zipfusion_kernel_stream_ab.csv``).
"""
import contextlib
import math
import os
import statistics
import sys

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import NO_DESCRIPTORS, ONE_LOAD, interleaved, probe_kernel, provenance  # noqa: E402

from zipkv.bench.attention import ATTENTION_SHAPES, attention_inputs  # noqa: E402
from zipkv.bench.baselines import FlashInferDecode, error_vs_reference, paged_table, reference_attention  # noqa: E402
from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402

SHAPE, CTX, BATCH, PAGE, ROUNDS = "llama3.1-8b", 8192, 64, 16, 7


@contextlib.contextmanager
def l2_prefetch_hint(size):
    """While open, every PTX Triton makes has ``cp.async.cg.shared.global.L2::<size>``."""
    from triton.backends.nvidia.compiler import CUDABackend
    make_ptx = CUDABackend.make_ptx

    def patched(self, *args, **kwargs):
        return make_ptx(self, *args, **kwargs).replace("cp.async.cg.shared.global ",
                                                        f"cp.async.cg.shared.global.L2::{size} ")
    CUDABackend.make_ptx = patched
    try:
        yield
    finally:
        CUDABackend.make_ptx = make_ptx


VARIANTS = [dict(slots=2), dict(slots=4), dict(splits=1), dict(splits=4), dict(one_load=True), dict(l2="256B"),
            dict(one_load=True, l2="256B"), dict(no_descriptors=True)]
"""The variants timed beside the committed kernel (keywords of :func:`variant_fn`)."""


def variant_fn(q, paged_cache, slots=None, splits=None, one_load=False, l2="", no_descriptors=False):
    """(launch function, its plan) of one variant over ``paged_cache`` (:func:`zipkv.paged.build_paged_cache`'s
    4-tuple): a copy of the kernel, rewritten as the keywords say and compiled here (under the L2 hint's PTX patch if
    ``l2``)."""
    cache, indptr, indices, last = paged_cache
    p = plan(indptr, indices, last, cache, ATTENTION_SHAPES[SHAPE].q_heads, num_splits=splits)
    rewrite = (NO_DESCRIPTORS if no_descriptors else []) + (ONE_LOAD if one_load else [])
    name = f"mma_v{int(one_load)}{l2}{int(no_descriptors)}"
    # a distinct kernel source per variant: Triton's caches are keyed by the source, not by the PTX patch
    mod = probe_kernel(rewrite + [("    b = gl.program_id(0)\n", f"    b = gl.program_id(0)  # {name}\n")], name)
    qk, out = p.softmax_scale * math.log2(math.e), torch.empty_like(q)
    stages = slots or p.configs[0]["stages"]

    def fn():
        return mod.launch(q, p.cache, p.indptr, p.indices, p.last_page_len, p._launches, p.num_splits, qk, out, p._ws,
                          stages, p.configs[0].get("maxnreg") or 0)
    with l2_prefetch_hint(l2) if l2 else contextlib.nullcontext():
        fn()                                                     # compiles it
    return fn, p


def main(out_csv):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    model = ATTENTION_SHAPES[SHAPE]
    k, v, q = attention_inputs(SHAPE, CTX, BATCH, gen)
    ref = reference_attention(q, k, v)
    paged_cache = cache, indptr, indices, last = build_paged_cache(k, v, compress="eligible", k_layout="k_mma",
                                                                   v_layout="v_mma")
    p0 = plan(indptr, indices, last, cache, model.q_heads)
    out0 = torch.empty_like(q)
    fns = {"committed": (lambda: p0.run(q, out0), p0)}
    for kw in VARIANTS:
        fns[" ".join(f"{key}={val}" for key, val in kw.items())] = variant_fn(q, paged_cache, **kw)
    ip, ind, lp, kp, vp = paged_table(k, v)
    fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
    fns["flashinfer_tc"] = (lambda: fi(q, kp, vp), None)
    base = fns["committed"][0]().clone()
    same = {}
    for name, (fn, _) in fns.items():
        got = fn().clone()
        if "no_descriptors" not in name and error_vs_reference(got, ref)[0] > 2e-2:
            raise AssertionError(f"{name} disagrees with fp32 attention")
        same[name] = torch.equal(got, base)                      # bit for bit the committed kernel's
    times = interleaved({name: fn for name, (fn, _) in fns.items()}, ROUNDS, timer)
    fi_us = statistics.median(times["flashinfer_tc"])
    rows = []
    for name, (_, p) in fns.items():
        us = statistics.median(times[name])
        rows.append(dict(variant=name, latency_us=us, speedup_vs_flashinfer_tc=fi_us / us, same_as_committed=same[name],
                         rounds_us=" ".join(f"{t:.1f}" for t in times[name]), num_splits=p.num_splits if p else None))
        print(f"{name:32s} {us:8.1f} us  FI TC / this {fi_us / us:.3f}  bit-exact {same[name]}", flush=True)
    board = f"GPU-{str(torch.cuda.get_device_properties(0).uuid)[:8]}"
    stamp = provenance()
    pd.DataFrame(rows).assign(shape=SHAPE, ctx=CTX, batch=BATCH, device=stamp.pop("device"), board=board,
                              **stamp).to_csv(out_csv, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
