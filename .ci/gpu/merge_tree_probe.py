"""A two-level merge of the fused kernel's splits, beside the committed one-level merge (few requests, long contexts).

A record: it rewrites the fused kernel as it was before the two-level merge (commit 55b3dff and earlier;
``git show 55b3dff:zipkv/kernels/decode_mma.py``) and refuses today's, whose merge it no longer matches.

With one request and 8 KV heads the plan splits each head's pages over ~130 one-warp programs; the last program of a
(request, KV head) to finish then merges every split's partial output alone, reading ``splits x head_dim x columns``
fp32 values in one warp after everything else has ended. The copy here groups the splits by ``ceil(sqrt(splits))``:
the last of each group merges its group into a group slot, and the last group merges the groups into the output --
two short serial merges instead of one long one, the same single launch, no host sync, deterministic (a fixed slot
order), and one level (today's arithmetic, bit for bit) wherever the splits fit one group.

For each point, page kind and split count: the committed kernel and the copy in interleaved cold-L2 rounds, FlashInfer
TC on the same page table, the copy's relative error against fp32 attention, and whether its outputs over packed and
raw pages are equal bit for bit. ``python3 .ci/gpu/merge_tree_probe.py OUT.csv`` (env POINTS, SPLITS as in
``small_batch_probe.py``).
"""
import importlib.util
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from descriptor_ceiling import interleaved, provenance  # noqa: E402

from zipkv.bench.attention import (ATTENTION_SHAPES, attention_inputs, measured_compressible_fraction,  # noqa: E402
                                   mix_mask)
from zipkv.bench.baselines import FlashInferDecode, error_vs_reference, paged_table, reference_attention  # noqa: E402
from zipkv.bench.timing import ColdTimer  # noqa: E402
from zipkv.kernels import decode_mma  # noqa: E402
from zipkv.kernels.decode_attention import plan  # noqa: E402
from zipkv.paged import build_paged_cache  # noqa: E402

SHAPE, PAGE, ROUNDS = "llama3.1-8b", 16, 3
MIX = measured_compressible_fraction(Path(__file__).resolve().parents[2] / "results/paper/model_data_kv_cache.csv")
POINTS = [(int(c), int(b)) for c, b in (p.split("x") for p in
                                         os.environ.get("POINTS", "32768x1 32768x4 131072x1 131072x4 32768x16").split())]
SPLITS = [int(s) for s in os.environ.get("SPLITS", "0").split()]       # 0: the plan's choice

FINISH = '''@gluon.jit
def _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, first, count, TOT: gl.constexpr,
           N: gl.constexpr, G: gl.constexpr, NQ: gl.constexpr, HD: gl.constexpr, TO_OUT: gl.constexpr, slot):
    """Merge slots first .. first + count - 1 (at most N) of each row; into ``out`` (bf16) or into slot ``slot``."""
    m = gl.full([NQ], float("-inf"), gl.float32, layout=QCOLS)
    for j in gl.static_range(N):
        ok = (g1 < G) & (j < count)
        m = gl.maximum(m, gl.load(lse_ptr + rows1 * TOT + first + j, mask=ok, other=float("-inf"),
                                  cache_modifier=".cg"))
    top = gl.where(m > float("-inf"), m, 0.0)
    num = gl.zeros([HD, NQ], gl.float32, layout=MMA)
    wsum = gl.zeros([NQ], gl.float32, layout=QCOLS)
    for j in gl.static_range(N):
        ok = (g1 < G) & (j < count)
        w = gl.exp2(gl.load(lse_ptr + rows1 * TOT + first + j, mask=ok, other=float("-inf"),
                            cache_modifier=".cg") - top)
        o = gl.load(part_ptr + (rows * TOT + first + j) * HD + do, mask=(go < G) & (do >= 0) & (j < count),
                    other=0.0, cache_modifier=".cg")
        num += o * w[None, :]
        wsum += w
    den = gl.where(wsum > 0, wsum, 1.0)
    gm = (go < G) & (do >= 0)
    if TO_OUT:
        gl.store(out_ptr + rows * HD + do, (num / den[None, :]).to(gl.bfloat16), mask=gm)
    else:
        gl.store(part_ptr + (rows * TOT + slot) * HD + do, num / den[None, :], mask=gm)
        gl.store(lse_ptr + rows1 * TOT + slot, gl.where(wsum > 0, top + gl.log2(den), float("-inf")), mask=g1 < G)


@gluon.jit
def _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV: gl.constexpr, G: gl.constexpr,
            SPLITS: gl.constexpr, NQ: gl.constexpr, HD: gl.constexpr, GS: gl.constexpr, NG: gl.constexpr):
    """Two-level merge: the last split of group s // GS to arrive merges its group (into out when NG == 1, else
    into group slot SPLITS + g); the last group to arrive merges the NG group slots into out."""
    g1 = gl.arange(0, NQ, layout=QCOLS)
    go = g1[None, :]
    do = gl.arange(0, HD, layout=gl.SliceLayout(1, MMA))[:, None]
    rows = b * (HKV * G) + h * G + go
    rows1 = b * (HKV * G) + h * G + g1
    gm = (go < G) & (do >= 0)
    den = gl.where(l_i > 0, l_i, 1.0)
    TOT = SPLITS + NG
    if SPLITS == 1:
        gl.store(out_ptr + rows * HD + do, (acc / den[None, :]).to(gl.bfloat16), mask=gm)
    else:
        gl.store(part_ptr + (rows * TOT + s) * HD + do, acc / den[None, :], mask=gm)
        gl.store(lse_ptr + rows1 * TOT + s, gl.where(l_i > 0, m_i + gl.log2(den), float("-inf")), mask=g1 < G)
        gl.thread_barrier()
        g = s // GS
        size = gl.minimum(GS, SPLITS - g * GS)
        cnt = cnt_ptr + (b * HKV + h) * (NG + 1)
        arrived = gl.atomic_add(cnt + g, 1, sem="acq_rel", scope="gpu")
        if arrived == size - 1:
            gl.store(cnt + g, 0)
            if NG == 1:
                _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, g * GS, size, TOT, GS, G, NQ, HD, True, 0)
            else:
                _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, g * GS, size, TOT, GS, G, NQ, HD, False,
                       SPLITS + g)
                gl.thread_barrier()
                done = gl.atomic_add(cnt + NG, 1, sem="acq_rel", scope="gpu")
                if done == NG - 1:
                    gl.store(cnt + NG, 0)
                    _merge(part_ptr, lse_ptr, out_ptr, rows, rows1, go, do, g1, SPLITS, NG, TOT, NG, G, NQ, HD, True,
                           0)


'''

REWRITES = [
    ("cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr,",
     "cnt_ptr, qk_scale, HKV: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr, GS: gl.constexpr, NG: gl.constexpr,"),
    ("    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD)\n",
     "    _finish(part_ptr, lse_ptr, out_ptr, cnt_ptr, m_i, l_i, acc, b, h, s, HKV, G, SPLITS, NQ, HD, GS, NG)\n"),
    ("HKV=HKV, G=HQ // HKV, SPLITS=num_splits, KIND=kind,",
     "HKV=HKV, G=HQ // HKV, SPLITS=num_splits, GS=groups(num_splits)[0], NG=groups(num_splits)[1], KIND=kind,"),
]


def groups(splits: int) -> tuple[int, int]:
    """(splits per group, groups): one group up to 16 splits, else groups of ceil(sqrt(splits))."""
    if splits <= 16:
        return splits, 1
    size = math.ceil(math.sqrt(splits))
    return size, math.ceil(splits / size)


def tree_kernel():
    """decode_mma with :data:`FINISH` in place of its ``_finish`` and the launch passing the grouping."""
    src = Path(decode_mma.__file__).read_text()
    start, end = src.index("@gluon.jit\ndef _finish("), src.index("@gluon.jit\ndef _pipelined_kernel(")
    src = src[:start] + FINISH + src[end:]
    for old, new in REWRITES:
        if src.count(old) != 1:
            raise RuntimeError(f"decode_mma changed: {old!r} occurs {src.count(old)} times")
        src = src.replace(old, new)
    src += '''

def groups(splits):
    import math
    if splits <= 16:
        return splits, 1
    size = math.ceil(math.sqrt(splits))
    return size, math.ceil(splits / size)
'''
    path = Path(tempfile.mkdtemp()) / "mma_tree_merge.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("mma_tree_merge", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree_workspace(batch, q_heads, kv_heads, splits, device, head_dim):
    """The copy's buffers: split slots then group slots, and NG + 1 counters per (request, KV head)."""
    if splits == 1:
        return {}
    _, ng = groups(splits)
    return dict(part=torch.empty(batch, q_heads, splits + ng, head_dim, dtype=torch.float32, device=device),
                lse=torch.empty(batch, q_heads, splits + ng, dtype=torch.float32, device=device),
                counters=torch.zeros(batch * kv_heads * (ng + 1), dtype=torch.int32, device=device))


def main(path):
    timer, gen = ColdTimer(), torch.Generator(device="cuda").manual_seed(0)
    model = ATTENTION_SHAPES[SHAPE]
    mod = tree_kernel()
    rows = []
    for ctx, batch in POINTS:
        k, v, q = attention_inputs(SHAPE, ctx, batch, gen)
        ref = reference_attention(q, k, v)
        ip, ind, lp, kp, vp = paged_table(k, v)
        fi = FlashInferDecode(ip, ind, lp, model.q_heads, model.kv_heads, model.head_dim, PAGE, True)
        fns, meta, outs = {"flashinfer_tc": lambda: fi(q, kp, vp)}, {}, {}
        mix = mix_mask(batch, model.kv_heads, ctx, model.head_dim, MIX, 0)
        for kind, compress in (("compressed", "eligible"), ("measured mix", mix), ("raw", "none")):
            cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, k_layout="k_mma",
                                                             v_layout="v_mma")
            for requested in SPLITS:
                p = plan(indptr, indices, last, cache, model.q_heads, num_splits=requested or None)
                s, qk = p.num_splits, p.softmax_scale * math.log2(math.e)
                ws = tree_workspace(batch, model.q_heads, model.kv_heads, s, q.device, model.head_dim)
                out_c, out_t = torch.empty_like(q), torch.empty_like(q)

                def tree(p=p, ws=ws, out=out_t, qk=qk):
                    return mod.launch(q, p.cache, p.indptr, p.indices, p.last_page_len, p._launches, p.num_splits, qk,
                                      out, ws, p.configs[0]["stages"], p.configs[0].get("maxnreg") or 0)
                outs[(kind, s)] = tree().clone()
                tree()                                              # counters back at 0 after every launch
                assert torch.equal(tree(), outs[(kind, s)]), "the tree merge is not deterministic"
                fns[f"committed {kind} {s}"] = lambda p=p, out=out_c: p.run(q, out)
                fns[f"tree {kind} {s}"] = tree
                meta[(kind, s)] = (requested == 0, error_vs_reference(outs[(kind, s)], ref)[0])
        times = interleaved(fns, ROUNDS, timer, reps=20)
        fi_us = statistics.median(times["flashinfer_tc"])
        for (kind, s), (default, err) in meta.items():
            committed, tree = (statistics.median(times[f"{name} {kind} {s}"]) for name in ("committed", "tree"))
            row = dict(ctx=ctx, batch=batch, kind=kind, splits=s, groups=groups(s)[1], plan_default=default,
                       committed_us=committed, tree_us=tree, flashinfer_tc_us=fi_us, committed_ratio=fi_us / committed,
                       tree_ratio=fi_us / tree, tree_rel_error=err,
                       packed_equals_raw=bool(torch.equal(outs[(kind, s)], outs[("raw", s)]))
                       if ("raw", s) in outs and kind != "raw" else None)
            rows.append(row)
            print({key: (round(val, 3) if isinstance(val, float) else val) for key, val in row.items()}, flush=True)
        del fns, k, v, q, kp, vp, fi, ref, outs
        torch.cuda.empty_cache()
    pd.DataFrame(rows).assign(**provenance()).to_csv(path, index=False)


if __name__ == "__main__":
    main(sys.argv[1])
