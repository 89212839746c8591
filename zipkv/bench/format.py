"""Speed of the plain-torch format reference (:mod:`zipkv.format`) on a captured-cache-sized input.

``eligible`` (which blocks compress, ZipFusion §III-B) scans every value of a cache, e.g. the first
chapter's survey of millions of values; ``pack``/``unpack`` are the reference codecs. Each is timed
beside the anchor measured in the same run: one reduction over the same bytes (``amax`` of the int16
view), the least work any scan of the cache does. ``python -m zipkv bench format`` prints the table.
"""
from __future__ import annotations

import statistics
import time

import torch

from zipkv import format as kvformat


def _median_seconds(fn, reps: int, device: torch.device) -> float:
    fn()                                                  # warm-up (allocator, index caches)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_benchmark(head_dim: int = 64, n_values: int = 12 << 20, device: str = "cpu", reps: int = 5,
                     seed: int = 0):
    """Median seconds of ``eligible`` (every layout of ``head_dim``), ``pack`` and ``unpack`` (token
    layout) on ``n_values`` random bf16 values ``[pages, 16, head_dim]``, each with its throughput in
    GB/s of input and the ratio to a plain ``amax`` over the same bytes timed in the same run.

    Returns a ``pandas.DataFrame`` with one row per operation.
    """
    import pandas as pd

    dev = torch.device(device)
    pages = n_values // (kvformat.PAGE_TOKENS * head_dim)
    if pages < 1:
        raise ValueError(f"n_values={n_values}: expected at least one page of {kvformat.PAGE_TOKENS * head_dim} values")
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(pages, kvformat.PAGE_TOKENS, head_dim, generator=gen, device=dev).to(torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    anchor = _median_seconds(lambda: x.view(torch.int16).amax(), reps, dev)
    ops = {f"eligible ({layout})": (lambda layout=layout: kvformat.eligible(x, layout))
           for layout in kvformat.layouts_for(head_dim)}
    payload, meta = kvformat.pack(x)
    ops["pack (token)"] = lambda: kvformat.pack(x)
    ops["unpack (token)"] = lambda: kvformat.unpack(payload, meta)
    rows = [dict(op="amax over the same bytes (anchor)", seconds=anchor, gb_per_s=nbytes / anchor / 1e9,
                 time_vs_anchor=1.0)]
    for name, fn in ops.items():
        seconds = _median_seconds(fn, reps, dev)
        rows.append(dict(op=name, seconds=seconds, gb_per_s=nbytes / seconds / 1e9, time_vs_anchor=seconds / anchor))
    table = pd.DataFrame(rows)
    table.insert(0, "device", str(dev))
    table.insert(1, "values", x.numel())
    table.insert(2, "head_dim", head_dim)
    return table
