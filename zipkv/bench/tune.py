"""Launch tuning of the Triton decode kernel (``python -m zipkv bench tune [--write]``): every launch
configuration of each specialisation timed at one shape, the best stored per GPU model in
:data:`zipkv.kernels.decode_triton.TUNING_FILE`."""
from __future__ import annotations

import torch

from zipkv.bench.attention import ATTENTION_SHAPES, attention_inputs, mix_mask
from zipkv.bench.baselines import error_vs_reference, reference_attention
from zipkv.bench.timing import ColdTimer

__all__ = ["tune_decode_attention", "write_tuning", "TUNE_GRID", "TUNE_PROGRAMS_PER_SM"]

TUNE_GRID = dict(pages_per_tile=(2, 4, 8), num_warps=(4, 8), stages=(3, 4), maxnreg=(0, 168))
"""Launch options swept per kernel specialisation by :func:`tune_decode_attention` (``maxnreg`` 0: no
cap); the best of them is then tried at every ``programs_per_sm`` in :data:`TUNE_PROGRAMS_PER_SM`."""
TUNE_PROGRAMS_PER_SM = (2, 4, 8)


def tune_decode_attention(shape: str = "llama3.1-8b", ctx: int = 8192, batch: int = 64,
                          real_fraction: dict[str, float] | None = None, grid: dict | None = None,
                          programs_per_sm=TUNE_PROGRAMS_PER_SM, reps: int = 10, seed: int = 0,
                          progress: bool = True):
    """Time every launch configuration of each decode-attention specialisation at one shape.

    Specialisations and their data: ``compressed`` on K/V whose blocks are all compressible, ``raw`` on
    the same data uncompressed, ``mixed`` (forced, ``path="mixed"``) on the measured mix of compressed
    blocks when ``real_fraction`` is given. Every configuration is checked against fp32 attention before
    it is timed (cold L2, median of ``reps``); one that fails to compile or disagrees is recorded with its
    error and no latency.

    Returns a DataFrame: ``path``, the launch options (:data:`zipkv.kernels.decode_triton.LAUNCH_KEYS`),
    ``latency_us``, ``rel_rms_error``, ``error``, ``best`` (the fastest configuration of its path) and
    ``device``; :func:`write_tuning` stores the best ones.
    """
    import itertools

    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.kernels.decode_attention import plan
    from zipkv.kernels.decode_triton import DEFAULT_LAUNCH
    from zipkv.paged import build_paged_cache

    model = ATTENTION_SHAPES[shape]
    kv_heads, head_dim = model.kv_heads, model.head_dim
    grid = grid or TUNE_GRID
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, v, q = attention_inputs(shape, ctx, batch, gen)
    ref = reference_attention(q, k, v)
    data = [("compressed", "eligible", "auto"), ("raw", "none", "auto")]
    if real_fraction is not None:
        data.append(("mixed", mix_mask(batch, kv_heads, ctx, head_dim, real_fraction, seed), "mixed"))
    timer = ColdTimer()
    rows = []
    names = list(grid)
    for path, compress, route in data:
        cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, seed=seed)

        def trial(launch):
            row = dict(path=path, **{**DEFAULT_LAUNCH, **launch}, latency_us=float("nan"),
                       rel_rms_error=float("nan"), error="")
            try:
                run = plan(indptr, indices, last, cache, q.shape[1], validate=False, path=route, launch=launch).run
                fn = lambda: run(q)
                row["rel_rms_error"] = error_vs_reference(fn(), ref)[0]
                if row["rel_rms_error"] > 2e-2:
                    row["error"] = "disagrees with fp32 attention"
                else:
                    row["latency_us"] = timer(fn, reps=reps)
            except Exception as err:  # a configuration that does not compile (e.g. shared memory)
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            rows.append(row)
            return row

        combos = list(itertools.product(*(grid[n] for n in names)))
        for values in tqdm(combos, desc=f"tune {path}", disable=not progress):
            trial(dict(zip(names, values)))
        mine = pd.DataFrame([r for r in rows if r["path"] == path]).dropna(subset=["latency_us"])
        if len(mine):
            best = mine.sort_values("latency_us").iloc[0]
            for pps in programs_per_sm:
                if pps != best["programs_per_sm"]:
                    trial({n: _plain(best[n]) for n in names} | dict(programs_per_sm=pps))
        del cache
        torch.cuda.empty_cache()
    table = pd.DataFrame(rows)
    fastest = table.dropna(subset=["latency_us"]).groupby("path")["latency_us"].idxmin()
    table["best"] = table.index.isin(fastest.values)
    table["device"] = torch.cuda.get_device_name()
    table["shape"], table["ctx"], table["batch"] = shape, ctx, batch
    return table


def _plain(x):
    return x.item() if hasattr(x, "item") else x


def write_tuning(table, path=None) -> dict:
    """Store the best configuration of each specialisation in ``table`` (from
    :func:`tune_decode_attention`) for its device in the decode kernel's tuning file; returns the entry."""
    import json

    from zipkv.kernels import decode_triton

    path = path or decode_triton.TUNING_FILE
    stored = json.loads(path.read_text()) if path.exists() else {}
    best = table[table["best"]]
    entry = {row["path"]: {key: _plain(row[key]) for key in decode_triton.LAUNCH_KEYS} for _, row in best.iterrows()}
    stored[str(table["device"].iloc[0])] = entry
    path.write_text(json.dumps(stored, indent=2, sort_keys=True) + "\n")
    return entry
