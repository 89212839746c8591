"""On the GPU (.ci/gpu/escape.sh): decode latency of escape-format pages beside ZipFusion's format, the same pages raw
and FlashInfer's tensor-core decode, on real KV at Llama-3.1-8B's attention shape (32 q heads, 8 KV heads, d = 128,
the mma layouts), at 8192 x 64 and the few-requests points.

K and V are built from the embedded model's real KV blocks (``.gpu/escape_kv/blocks.pt``, ``.ci/gpu/escape_kv.py``)
as Fig. 5's real-KV prefixes are (``zipkv.study.experiments.throughput.real_prefix``: each (request, KV head) stream a
run of consecutive real blocks from a seeded random start), so which blocks fit ZipFusion's window and how many
values each escape-format block lists are what the real model produces. Every method is checked against fp32
attention before it is timed; the escape pages' output is compared bit for bit with the raw pages' at the same split
count (``equal_raw_bits``). Timings: median of ``--reps`` calls with L2 cleared (``zipkv.bench.timing.ColdTimer``), the
latency chapter's timing; the CSV is rewritten after every row (a run cut short keeps what it measured).

    PYTHONPATH=/tmp/site:$PWD python3 .ci/gpu/escape_probe.py OUT.csv [--points 8192x64 32768x1 ...] [--reps 30]
"""
import argparse
import os
import subprocess
import time

import pandas as pd
import torch

from zipkv import format as F
from zipkv.bench.baselines import FlashInferDecode, error_vs_reference, paged_table, reference_attention
from zipkv.bench.timing import ColdTimer, copy_bandwidth
from zipkv.kernels.decode_attention import plan
from zipkv.paged import build_paged_cache

Q_HEADS, KV_HEADS, D = 32, 8, 128

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--points", nargs="+", default=["8192x64", "32768x1", "131072x1", "32768x4", "131072x4",
                                                    "8192x4", "8192x1"], help="ctx x batch, in the order run")
parser.add_argument("--reps", type=int, default=30)
parser.add_argument("--blocks", default=".gpu/escape_kv/blocks.pt")
parser.add_argument("--maxnreg", type=int, nargs="+", default=[0, 168], help="register caps of the escape kernel "
                    "timed at the first point (0: none)")
parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting new points after this many seconds")
args = parser.parse_args()
t_start = time.time()
commit = os.environ.get("ZIPKV_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                          text=True).stdout.strip()
blocks = torch.load(args.blocks)
kb, vb = blocks["k"].cuda(), blocks["v"].cuda()
copy_bw = copy_bandwidth()
timer = ColdTimer()
rows = []


def save():
    t = pd.DataFrame(rows)
    t["device"] = torch.cuda.get_device_name()
    t["commit"] = commit
    t["copy_bw_tbps"] = copy_bw / 1e12
    t["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t_start))
    t.to_csv(args.out, index=False)


def real_kv(batch, ctx, seed):
    """K, V bf16 [batch, 8, ctx, 128] on the GPU: per (request, KV head) a run of consecutive real blocks."""
    per = ctx * D // F.BLOCK_VALUES
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(kb.shape[0], (batch, KV_HEADS), generator=g).cuda()
    idx = (starts[..., None] + torch.arange(per, device="cuda")) % kb.shape[0]
    return (x[idx].reshape(batch, KV_HEADS, ctx, D) for x in (kb, vb))


for n, point in enumerate(args.points):
    if time.time() - t_start > args.budget_s:
        print(f"time budget reached: points from {point} on skipped", flush=True)
        break
    ctx, batch = map(int, point.split("x"))
    k, v = real_kv(batch, ctx, seed=n)
    q = torch.randn(batch, Q_HEADS, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n)).bfloat16()
    ref = reference_attention(q, k, v)
    io = 2 * q.numel() * 2
    measured = {}

    def record(method, fn, kv_bytes, **extra):
        try:
            out = fn()
            rel, mx = error_vs_reference(out, ref)
        except Exception as err:                         # noqa: BLE001  (a failing method must not stop the others)
            rows.append(dict(ctx=ctx, batch=batch, method=method, failed=f"{type(err).__name__}: {err}"[:300], **extra))
            print(rows[-1], flush=True)
            return torch.full_like(q, float("nan"))
        if not rel <= 2e-2:
            rows.append(dict(ctx=ctx, batch=batch, method=method, rel_rms_error=rel, max_abs_error=mx,
                             failed=f"disagrees with fp32 attention: relative RMS error {rel:.3g}", **extra))
            print(rows[-1], flush=True)
            return out
        us = timer(fn, reps=args.reps)
        measured[method] = us
        rows.append(dict(ctx=ctx, batch=batch, method=method, latency_us=us, bytes_read=kv_bytes + io,
                         tbps=(kv_bytes + io) / us / 1e6, frac_copy_bw=(kv_bytes + io) / (us * 1e-6) / copy_bw,
                         rel_rms_error=rel, max_abs_error=mx, **extra))
        print({k: (round(x, 4) if isinstance(x, float) else x) for k, x in rows[-1].items()}, flush=True)
        return out

    caches = {}
    for name, kw in (("zipkv_raw", dict(compress="none")), ("zipkv_zipfusion", dict(compress="eligible")),
                     ("zipkv_escape", dict(block_format="escape"))):
        try:
            caches[name] = build_paged_cache(k, v, k_layout="k_mma", v_layout="v_mma", seed=n, **kw)
        except Exception as err:                         # noqa: BLE001
            rows.append(dict(ctx=ctx, batch=batch, method=name, failed=f"build: {type(err).__name__}: {err}"[:300]))
            print(rows[-1], flush=True)
    outs = {}
    for name, (cache, ip, idx, last) in caches.items():
        st = cache.stats()
        extra_desc = 0 if cache.escapes is None else cache.escapes.numel() * 8
        kv_bytes = st["used_bytes"] + cache.desc.numel() * 8 + extra_desc + idx.numel() * 4
        info = dict(frac_compressed_k=st["frac_k"], frac_compressed_v=st["frac_v"],
                    bits_per_value=8 * st["used_bytes"] / (st["raw_bytes"] / 2))
        if cache.escapes is not None:
            cnt = (cache.escapes & 0x7F).float()
            info.update(escapes_per_block_k=float(cnt[:, 0].mean()), escapes_per_block_v=float(cnt[:, 1].mean()),
                        zero_mode_k=float(((cache.escapes[:, 0] >> 7) & 1).float().mean()),
                        zero_mode_v=float(((cache.escapes[:, 1] >> 7) & 1).float().mean()))
        caps = args.maxnreg if (name == "zipkv_escape" and n == 0) else [None]
        for cap in caps:
            p = plan(ip, idx, last, cache, Q_HEADS, launch=None if cap is None else {"maxnreg": cap})
            out = torch.empty_like(q)
            label = name if cap in (None, 0) else f"{name}_maxnreg{cap}"
            got = record(label, lambda: p.run(q, out), kv_bytes, num_splits=p.num_splits,
                         maxnreg=p.configs[0].get("maxnreg") or 0, kind=cache.kind(), **info)
            outs[label] = (got.clone(), p.num_splits)
            del p
    # bit for bit: escape pages vs the same pages raw, at the escape plan's split count
    cache, ip, idx, last = caches["zipkv_raw"]
    for label, (got, splits) in outs.items():
        if not torch.isfinite(got.float()).all():
            continue
        if label.startswith("zipkv_escape") or label == "zipkv_zipfusion":
            want = plan(ip, idx, last, cache, Q_HEADS, num_splits=splits).run(q)
            for r in rows:
                if r["ctx"] == ctx and r["batch"] == batch and r["method"] == label:
                    r["equal_raw_bits"] = bool(torch.equal(got, want))
    del caches, outs
    torch.cuda.empty_cache()
    fi = paged_table(k, v, seed=n)
    indptr, indices, lastlen, kp, vp = fi
    runner = FlashInferDecode(indptr, indices, lastlen, Q_HEADS, KV_HEADS, D, F.PAGE_TOKENS, True)
    record("flashinfer_tc", lambda: runner(q, kp, vp), 2 * k.numel() * 2 + indices.numel() * 4)
    for r in rows:
        if r["ctx"] == ctx and r["batch"] == batch and "latency_us" in r:
            if "flashinfer_tc" in measured:
                r["speedup_vs_flashinfer_tc"] = measured["flashinfer_tc"] / r["latency_us"]
            if "zipkv_zipfusion" in measured:
                r["speedup_vs_zipfusion"] = measured["zipkv_zipfusion"] / r["latency_us"]
    del fi, kp, vp, runner, k, v, q, ref
    torch.cuda.empty_cache()
    save()
# the pack kernels (the issue's bar: >= 2 TB/s of input): the real KV of 8192 x 64's keys as raw slots, packed out of
# place by ZipFusion's pack kernel and the escape one, in the token and k_mma layouts (TB/s of input bytes)
if time.time() - t_start < args.budget_s + 15:
    from zipkv.kernels import pack as zpack, pack_escape
    k, _ = real_kv(64, 8192, seed=0)
    pages = k.reshape(-1, F.PAGE_TOKENS, D)
    n, pb = pages.shape[0], F.page_bytes(D)
    off = torch.arange(n, dtype=torch.int64, device="cuda") * pb
    dst = torch.empty(n * pb + pb, dtype=torch.uint8, device="cuda")
    for layout in ("token", "k_mma"):
        src = (F.to_raw(F.to_blocks(pages, layout), layout).contiguous().view(-1) if layout == "k_mma"
               else pages.reshape(-1))
        for name, fn in (("pack_zipfusion", lambda: zpack.pack_into(src, off, dst, off, D, layout, src_packed=True,
                                                                    validate=False)),
                         ("pack_escape", lambda: pack_escape.pack_into(src, off, dst, off, D, layout, src_packed=True,
                                                                       validate=False))):
            try:
                us = timer(fn, reps=args.reps)
            except Exception as err:                     # noqa: BLE001
                rows.append(dict(ctx=8192, batch=64, method=f"{name}_{layout}", failed=f"{type(err).__name__}: {err}"[:300]))
                continue
            rows.append(dict(ctx=8192, batch=64, method=f"{name}_{layout}", latency_us=us, bytes_read=n * pb,
                             tbps=n * pb / us / 1e6, frac_copy_bw=2 * n * pb / (us * 1e-6) / copy_bw))
            print(rows[-1], flush=True)
        del src
    del k, pages, dst
save()
cols = ["ctx", "batch", "method", "latency_us", "tbps", "speedup_vs_flashinfer_tc", "num_splits", "equal_raw_bits",
        "failed"]
print(pd.DataFrame(rows).reindex(columns=cols).to_string(), flush=True)
print(f"done in {time.time() - t_start:.0f} s")
