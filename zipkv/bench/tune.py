"""Launch tuning of the decode kernels (``python -m zipkv bench tune [--kernel gluon] [--write]``): every launch
configuration of each specialisation timed at one shape, the best stored per GPU model (and, for the Gluon
kernel, per head_dim) in :data:`zipkv.kernels.tuning.TUNING_FILE`."""
from __future__ import annotations

import math
import statistics

import torch

from zipkv.bench.attention import ATTENTION_SHAPES, KERNEL_LAYOUTS, attention_inputs, mix_mask
from zipkv.bench.baselines import error_vs_reference, reference_attention
from zipkv.bench.timing import ColdTimer

__all__ = ["tune_decode_attention", "choose_best", "write_tuning", "TUNE_GRID", "TUNE_PROGRAMS_PER_SM", "GLUON_TUNE_GRID",
           "GLUON_TUNE_PROGRAMS_PER_SM"]

TUNE_GRID = dict(pages_per_tile=(2, 4, 8), num_warps=(4, 8), stages=(3, 4), maxnreg=(0, 168))
"""Launch options swept per kernel specialisation by :func:`tune_decode_attention` (``maxnreg`` 0: no
cap); the best of them is then tried at every ``programs_per_sm`` in :data:`TUNE_PROGRAMS_PER_SM`."""
TUNE_PROGRAMS_PER_SM = (2, 4, 8)
GLUON_TUNE_GRID = dict(maxnreg=(0,), stages=(2, 3))
"""The Gluon kernel's options (one warp per program): a register cap (0: none; offline, sm_90a, its
specialisations take 109-128 registers without spills at up to 8 query heads per KV head,
:func:`zipkv.kernels.kernel_info.decode_mma_info`, so 13-16 programs fit on an SM at two ring slots) and the ring
slots; then its
split-KV target."""
GLUON_TUNE_PROGRAMS_PER_SM = (4, 5, 6, 7, 8, 10, 12, 16)


def tune_decode_attention(shape: str = "llama3.1-8b", ctx: int = 8192, batch: int = 64,
                          real_fraction: dict[str, float] | None = None, grid: dict | None = None,
                          programs_per_sm=None, reps: int = 10, seed: int = 0,
                          progress: bool = True, kernel: str = "triton", finalists: int = 3, rounds: int = 3):
    """Time every launch configuration of each decode-attention specialisation at one shape.

    Specialisations and their data: ``compressed`` on K/V whose blocks are all compressible, ``raw`` on
    the same data uncompressed, ``mixed`` (forced, ``path="mixed"``) on the measured mix of compressed
    blocks when ``real_fraction`` is given. Every configuration is checked against fp32 attention before
    it is timed (cold L2, median of ``reps``); one that fails to compile or disagrees is recorded with its
    error and no latency. The ``finalists`` fastest configurations of each specialisation are then timed again in
    ``rounds`` rounds that alternate them (``confirm_us``: the median of their rounds), and the best is the
    fastest of those (:func:`choose_best`): one sweep's medians differ by a few percent from run to run (on the
    H200, mixed pages at the SmolLM2 shape: 6 programs per SM 0.7 % ahead of 12 in one sweep, 5 % behind in the
    sweep before), as much as the configurations differ from each other.

    kernel: ``"triton"`` (token layouts; grid :data:`TUNE_GRID`, then :data:`TUNE_PROGRAMS_PER_SM`) or ``"gluon"``
    (the mma layouts; :data:`GLUON_TUNE_GRID`, then :data:`GLUON_TUNE_PROGRAMS_PER_SM`), unless ``grid`` /
    ``programs_per_sm`` are given.

    Returns a DataFrame: ``kernel``, ``path``, the launch options (:data:`zipkv.kernels.decode_triton.LAUNCH_KEYS`;
    the Gluon kernel reads ``programs_per_sm``, ``stages`` and ``maxnreg``), ``latency_us``, ``rel_rms_error``,
    ``error``, ``confirm_us`` (finalists only), ``best`` (:func:`choose_best`), ``head_dim`` and ``device``; :func:`write_tuning`
    stores the best ones.
    """
    import itertools

    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.kernels.decode_attention import plan
    from zipkv.kernels.decode_mma import MMA_LAUNCH
    from zipkv.kernels.decode_triton import DEFAULT_LAUNCH
    from zipkv.paged import build_paged_cache

    if kernel not in KERNEL_LAYOUTS:
        raise ValueError(f"kernel must be one of {sorted(KERNEL_LAYOUTS)}, got {kernel!r}")
    model = ATTENTION_SHAPES[shape]
    kv_heads, head_dim = model.kv_heads, model.head_dim
    gluon = kernel == "gluon"
    grid = grid or (GLUON_TUNE_GRID if gluon else TUNE_GRID)
    programs_per_sm = programs_per_sm or (GLUON_TUNE_PROGRAMS_PER_SM if gluon else TUNE_PROGRAMS_PER_SM)
    base = MMA_LAUNCH if gluon else DEFAULT_LAUNCH
    k_layout, v_layout = KERNEL_LAYOUTS[kernel]
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
        cache, indptr, indices, last = build_paged_cache(k, v, compress=compress, seed=seed,
                                                         k_layout=k_layout, v_layout=v_layout)

        def runner(launch):
            run = plan(indptr, indices, last, cache, q.shape[1], validate=False, path=route, launch=launch).run
            return lambda: run(q)

        def trial(launch):
            row = dict(kernel=kernel, path=path, **{**base, **launch}, latency_us=float("nan"),
                       rel_rms_error=float("nan"), error="", confirm_us=float("nan"))
            try:
                fn = runner(launch)
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
        timed = [r for r in rows if r["path"] == path and not math.isnan(r["latency_us"])]
        final = sorted(timed, key=lambda r: r["latency_us"])[:finalists]
        fns = [runner({n: _plain(r[n]) for n in (*names, "programs_per_sm")}) for r in final]
        times = [[] for _ in final]
        for _ in range(rounds):
            for fn, t in zip(fns, times):
                t.append(timer(fn, reps=reps))
        for r, t in zip(final, times):
            r["confirm_us"] = statistics.median(t)
        del cache, fns
        torch.cuda.empty_cache()
    table = choose_best(pd.DataFrame(rows))
    table["head_dim"] = head_dim
    table["device"] = torch.cuda.get_device_name()
    table["shape"], table["ctx"], table["batch"] = shape, ctx, batch
    return table


def choose_best(table):
    """``table`` with ``best`` set on each path's fastest row: by ``confirm_us`` (the finalists' rounds) where
    the path has it, else by ``latency_us``."""
    table = table.copy()
    best = []
    for _, rows in table.groupby("path"):
        col = "confirm_us" if "confirm_us" in rows and rows["confirm_us"].notna().any() else "latency_us"
        timed = rows[col].dropna()
        if len(timed):
            best.append(timed.idxmin())
    table["best"] = table.index.isin(best)
    return table


def _plain(x):
    return x.item() if hasattr(x, "item") else x


def write_tuning(table, path=None) -> dict:
    """Store the best configuration of each specialisation in ``table`` (from :func:`tune_decode_attention`) for
    its device -- and, for the Gluon kernel, its head_dim -- in the tuning file (:func:`zipkv.kernels.tuning.store`:
    every other entry is kept); returns the stored section."""
    from zipkv.kernels import decode_mma, decode_triton, tuning

    kernel = str(table["kernel"].iloc[0]) if "kernel" in table else "triton"
    keys = tuple(decode_mma.MMA_LAUNCH) if kernel == "gluon" else decode_triton.LAUNCH_KEYS
    best = table[table["best"]]
    entry = {row["path"]: {key: _plain(row[key]) for key in keys} for _, row in best.iterrows()}
    return tuning.store(str(table["device"].iloc[0]), entry, kernel=kernel,
                        head_dim=int(table["head_dim"].iloc[0]) if kernel == "gluon" else None, file=path)
