"""Where the all-compressed path's fixed cost goes (issue 13's all-compressible bar, Llama-3.1-8B shape, batch 64).

Two parts, on whatever GPU it runs:

* **Timings over contexts** (``OUT_fits.csv``). The committed kernel over all-compressed and raw pages, FlashInfer TC
  over the same page table and torch SDPA on a contiguous cache at 2048-16384 tokens, in interleaved rounds, also with
  the pages in logical order (no shuffle) to see what the page pool's random order costs; the latency chapter sets the
  timeline's tail against FlashInfer TC's time here.
* **Timeline.** A copy of :mod:`zipkv.kernels.decode_mma` rewritten to record, per program, ``%globaltimer`` at its
  start, at the end of its unit loop and after its merge, and its SM: when programs start, how their loop ends spread
  (the tail), what the merge adds, at 2048 and 8192 tokens (a row per launch); at 8192 tokens also every program's
  records (all-compressed pages in the pool's random order and in logical order, raw pages in random order).

Run on the GPU machine from the repository root with the wheels on PYTHONPATH:
``python3 .ci/gpu/timeline_probe.py OUT`` (about 1.5 minutes; writes ``OUT.csv``, ``OUT_programs.csv`` and
``OUT_fits.csv``; ``TIMELINE_ONLY=1``: the timeline part only, 20 s); :file:`kernel.sh` runs it on the H200 and appends
them to ``results/paper/zipfusion_kernel_timeline*.csv``, which the latency chapter reads
(:func:`zipkv.study.chapters.latency.timeline_text`).
"""
import math
import os
import statistics
import sys

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import interleaved, probe_kernel, provenance  # noqa: E402

from zipkv.bench.attention import ATTENTION_SHAPES, attention_inputs  # noqa: E402
from zipkv.bench.baselines import FlashInferDecode, paged_table, sdpa_decode  # noqa: E402
from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402

SHAPE, BATCH, PAGE, ROUNDS = "llama3.1-8b", 64, 16, 5
CTXS, ANCHOR = (2048, 4096, 8192, 16384), 8192

TIMELINE = [
    ("\n@gluon.jit\ndef _pipelined_kernel(", '''
TIMES = [None]


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _smid():
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pipelined_kernel('''),
    ("cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr", "cnt_ptr, t_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr"),
    ("    s = gl.program_id(2)\n    p_start", "    s = gl.program_id(2)\n    t0 = _now()\n    p_start"),
    ("    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD, GS, NG, TOT)\n",
     "    t1 = _now()\n"
     "    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD, GS, NG, TOT)\n"
     "    t2 = _now()\n"
     "    w = t_ptr + ((b * HKV + h) * SPLITS + s) * 4\n"
     "    gl.store(w, t0)\n    gl.store(w + 1, t1)\n    gl.store(w + 2, t2)\n"
     "    gl.store(w + 3, _smid().to(gl.int64))\n"),
    ("out, counters, qk_scale,", "out, counters, TIMES[0], qk_scale,"),
]


def fits(timer, gen):
    """The methods' latencies at :data:`CTXS` (a row per method and context)."""
    model = ATTENTION_SHAPES[SHAPE]
    rows = []
    for ctx in CTXS:
        k, v, q = attention_inputs(SHAPE, ctx, BATCH, gen)
        io = 2 * q.numel() * q.element_size()
        fns = {}
        for shuffle in (True, False):
            tag = "" if shuffle else " in order"
            for kind, compress in (("compressed", "eligible"), ("raw", "none")):
                cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma",
                                                                 v_layout="v_mma", shuffle=shuffle)
                p = plan(indptr, indices, last, cache, model.q_heads)
                nbytes = cache.stats()["used_bytes"] + cache.desc.numel() * 8 + indices.numel() * 4 + io
                out = torch.empty_like(q)
                fns["zipkv " + kind + tag] = (lambda p=p, out=out: p.run(q, out), nbytes)
            ip, ind, lp, kp, vp = paged_table(k, v, shuffle=shuffle)
            fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
            fns["flashinfer_tc" + tag] = (lambda fi=fi, kp=kp, vp=vp: fi(q, kp, vp),
                                          kp.numel() * 4 + ind.numel() * 4 + io)
        fns["sdpa"] = (lambda: sdpa_decode(q, k, v), k.numel() * 4 + io)
        times = interleaved({name: fn for name, (fn, _) in fns.items()}, ROUNDS, timer, reps=20)
        for name, (_, nbytes) in fns.items():
            us = statistics.median(times[name])
            rows.append(dict(method=name, ctx=ctx, latency_us=us, bytes_read=nbytes, tbps=nbytes / us / 1e6))
            print(f"{ctx:6d} {name:28s} {us:8.1f} us {nbytes / us / 1e6:.3f} TB/s", flush=True)
        del fns, k, v, q
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def timeline(timer, gen):
    """(a row per launch, a row per program at :data:`ANCHOR`) of the instrumented copy, which must give the committed
    kernel's output bit for bit; the records are the last timed call's."""
    model = ATTENTION_SHAPES[SHAPE]
    mod = probe_kernel(TIMELINE, "mma_timeline")
    rows, programs = [], []
    for ctx in (2048, ANCHOR):
        k, v, q = attention_inputs(SHAPE, ctx, BATCH, gen)
        for kind, compress in (("compressed", "eligible"), ("raw", "none")):
            cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma",
                                                             v_layout="v_mma")
            p = plan(indptr, indices, last, cache, model.q_heads)
            qk, out = p.softmax_scale * math.log2(math.e), torch.empty_like(q)
            mod.TIMES[0] = torch.zeros(BATCH * model.kv_heads * p.num_splits, 4, dtype=torch.int64, device="cuda")

            def fn():
                return mod.launch(q, p.cache, p.indptr, p.indices, p.last_page_len, p._launches, p.num_splits, qk,
                                  out, p._ws, p.configs[0]["stages"], p.configs[0].get("maxnreg") or 0)
            fn()
            if not torch.equal(fn(), p.run(q, torch.empty_like(q))):
                raise AssertionError("the timeline copy disagrees with the committed kernel")
            us_committed = timer(lambda: p.run(q, out), reps=20)
            us_probe = timer(fn, reps=20)              # the last timed call's records stay in TIMES
            t = mod.TIMES[0].cpu().numpy()
            t0, t1, t2, sm = t[:, 0], t[:, 1], t[:, 2], t[:, 3]
            base = t0.min()
            per_sm = np.bincount(sm, minlength=sm.max() + 1)
            loop = (t1 - t0) / 1e3
            row = dict(kind=kind, ctx=ctx, splits=p.num_splits, stages=p.configs[0]["stages"],
                       event_us=us_probe, committed_us=us_committed, span_us=(t2.max() - base) / 1e3,
                       start_max_us=(t0.max() - base) / 1e3, start_p50_us=np.median(t0 - base) / 1e3,
                       loop_end_min_us=(t1.min() - base) / 1e3, loop_end_p50_us=np.median(t1 - base) / 1e3,
                       loop_end_p90_us=np.percentile(t1 - base, 90) / 1e3, loop_end_max_us=(t1.max() - base) / 1e3,
                       finish_max_us=((t2 - t1).max()) / 1e3, last_finish_us=(t2.max() - t1.max()) / 1e3,
                       loop_min_us=loop.min(), loop_p50_us=np.median(loop), loop_max_us=loop.max(),
                       programs_per_sm_min=int(per_sm[per_sm > 0].min()), programs_per_sm_max=int(per_sm.max()),
                       sms_used=int((per_sm > 0).sum()))
            row["loop_by_sm_load"] = " ".join(
                f"{n}:{np.mean([loop[sm == i].mean() for i in range(len(per_sm)) if per_sm[i] == n]):.1f}"
                for n in sorted(set(per_sm[per_sm > 0])))
            rows.append(row)
            for shuffle in ((True, False) if kind == "compressed" else (True,)) if ctx == ANCHOR else ():
                if not shuffle:
                    c, ip, ix, lp = build_paged_cache(k, v, compress=compress, k_layout="k_mma", v_layout="v_mma",
                                                      shuffle=False)
                    p = plan(ip, ix, lp, c, model.q_heads)
                    timer(fn, reps=20)
                t = mod.TIMES[0].cpu().numpy()
                n = np.arange(len(t))
                programs.append(pd.DataFrame(dict(kind=kind, ctx=ctx, shuffle=shuffle, b=n // p.num_splits // model.kv_heads,
                                                  h=n // p.num_splits % model.kv_heads, s=n % p.num_splits,
                                                  start_ns=t[:, 0] - t[:, 0].min(), loop_end_ns=t[:, 1] - t[:, 0].min(),
                                                  end_ns=t[:, 2] - t[:, 0].min(), sm=t[:, 3])))
            print({key: (round(val, 2) if isinstance(val, float) else val) for key, val in row.items()}, flush=True)
        del k, v, q
        torch.cuda.empty_cache()
    return pd.DataFrame(rows), pd.concat(programs)


def main(prefix):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    stamp = provenance()
    tl, programs = timeline(timer, gen)
    tl.assign(**stamp).to_csv(prefix + ".csv", index=False)
    programs.assign(**stamp).to_csv(prefix + "_programs.csv", index=False)
    if os.environ.get("TIMELINE_ONLY"):
        return
    fits(timer, gen).assign(**stamp).to_csv(prefix + "_fits.csv", index=False)


if __name__ == "__main__":
    main(sys.argv[1])
