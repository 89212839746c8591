"""Distillation speed: zipkv.compress's seconds per context at model shapes and context lengths beside the
same run's prefill (:func:`compress_speed`); KVSculpt's reference against its batched solver on the same problems.

:func:`bench_distill` times both solvers on one context's problems; :func:`speed_sweep` runs it over
context lengths and ratios on PG19 windows (the chapter "Distillation in seconds" and
``python -m zipkv bench distill``), on the embedded model's own problems and on problems of
Qwen2.5-1.5B's attention shape built from its captured cache (:func:`qwen_shaped_problems`).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

import torch

from zipkv.distill.batched import solve as batched_solve
from zipkv.distill.kvsculpt import budget_for_ratio, build_problems
from zipkv.distill.kvsculpt import solve as reference_solve
from zipkv.distill.problem import Problem, SculptConfig, Solution, Solver
from zipkv.distill.queries import training_queries
from zipkv.models import PAPER_MODELS, rope_of


def sync(device) -> None:
    """Wait for the device's queued work (CUDA), so a wall-clock interval covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- problems of Qwen2.5-1.5B's shape from the embedded model ---------------------------------------------

QWEN = PAPER_MODELS["Qwen2.5-1.5B-Instruct"]
"""Qwen2.5-1.5B's attention shape (28 layers × 2 KV heads × head_dim 128, 6 query heads per KV head)."""


def qwen_shaped_problems(capture, ratio: float = 0.3, *, m: int = 256, n_synthetic: int = 128,
                         layers: int = QWEN.layers, kv_heads: int = QWEN.kv_heads, group: int = QWEN.group_size,
                         strategy: str = "uniform",
                         seed: int = 0, k: int | None = None) -> list[Problem]:
    """Problems of Qwen2.5-1.5B's attention shape built from a real captured cache.

    The embedded SmolLM2-135M has 30 layers × 3 KV heads × head_dim 64 with 3 query heads per KV
    head. A 128-d head is two 64-d heads of the same layer side by side:

    * layer ``l`` of the result is the capture's layer ``l`` (layers 0 … 27; the last two are unused);
    * its KV head ``j`` concatenates the capture's KV heads ``a = 2j mod H`` and ``b = 2j+1 mod H``
      along head_dim: keys ``[K_a | K_b]``, values ``[V_a | V_b]`` (``N × 128``); with ``H = 3`` the two
      heads are ``[h0 | h1]`` and ``[h2 | h0]``;
    * its ``group`` query heads are ``[q_{a,i} | q_{b,(i+s) mod g}]`` for ``s = 0, 1, …`` and
      ``i = 0 … g−1`` (first ``group`` of them; with ``g = 3``: (0,0), (1,1), (2,2), (0,1), (1,2), (2,0)),
      each half a real post-RoPE query of its own head at the same position; training queries
      (retain + synthetic, §3.3) are built per 64-d half with the model's RoPE and the same
      strategy and seed, so both halves sample the same positions, then concatenated.

    So every logit is ``q_a·k_a + q_b·k_b``, the sum of two real heads' logits, scaled by ``1/√128``
    (Qwen's), i.e. ``(s_a + s_b)/√2`` in the 64-d heads' ``1/√64`` units: the shape (and the cost)
    is Qwen's, the attention statistics are a real model's.

    Args:
        capture: a :class:`zipkv.models.Capture` with ≥ ``layers`` layers and ≥ 2 KV heads.
        ratio: ``r = (k + m)/N``; ``k`` overrides it with a fixed budget.
        m, n_synthetic, strategy, seed: training queries, as :func:`~zipkv.distill.kvsculpt.build_problems`.
        layers, kv_heads, group: the target shape (default Qwen2.5-1.5B's).
    """
    if len(capture.layers) < layers:
        raise ValueError(f"capture has {len(capture.layers)} layers: expected at least layers={layers}")
    H, N, d = capture.layers[0].keys.shape
    if H < 2:
        raise ValueError(f"capture has {H} KV heads: expected at least 2 to concatenate")
    budget = budget_for_ratio(ratio, N, m) if k is None else int(k)
    problems = []
    for layer in range(layers):
        lc = capture.layers[layer]
        g = lc.queries.shape[0] // H
        pairs = [(i, (i + s) % g) for s in range(-(-group // g)) for i in range(g)][:group]
        for j in range(kv_heads):
            a, b = (2 * j) % H, (2 * j + 1) % H
            halves = [training_queries(lc.queries[h * g:(h + 1) * g], capture.positions, rope_of(capture, layer), m,
                                       n_synthetic, strategy=strategy, seed=seed + 7919 * layer + j)
                      for h in (a, b)]  # [g, m + n_s, d] each, same sampled positions
            queries = torch.stack([torch.cat([halves[0][i], halves[1][i2]], dim=-1) for i, i2 in pairs])
            keys = torch.cat([lc.keys[a], lc.keys[b]], dim=-1)
            values = torch.cat([lc.values[a], lc.values[b]], dim=-1)
            problems.append(Problem(keys=keys, values=values, queries=queries, m=m, k=budget, layer=layer, head=j))
    return problems


def context_problems(capture, ratio: float, shape: str = "embedded", *, m: int = 256, n_synthetic: int = 128,
                     seed: int = 0) -> list[Problem]:
    """All problems of one captured context: ``"embedded"`` (the model's own heads) or ``"qwen"``."""
    if shape == "embedded":
        N = capture.layers[0].keys.shape[1]
        return build_problems(capture, budget_for_ratio(ratio, N, m), m=m, n_synthetic=n_synthetic, seed=seed)
    if shape == "qwen":
        return qwen_shaped_problems(capture, ratio, m=m, n_synthetic=n_synthetic, seed=seed)
    raise ValueError(f"shape={shape!r}: expected 'embedded' or 'qwen'")


# --- benchmark --------------------------------------------------------------------------------------------

def _timed(fn, device):
    sync(device)
    started = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - started


def bench_distill(problems: Sequence[Problem], *, problem_shape: str, ratio: float | None = None,
                  config: SculptConfig | None = None, solver: Solver | None = None,
                  reference: bool = True, reference_limit: int | None = None, warmup: bool = True):
    """Time the reference solver and the batched solver on the same problems, in the same run.

    Args:
        problems: one context's problems (all layers × KV heads).
        problem_shape: label, e.g. ``"SmolLM2-135M 30×3×64"`` or ``"Qwen2.5-1.5B 28×2×128"``.
        ratio: label (default: ``(mean k + m)/N`` of the problems).
        config: solver settings (``device`` where both run; default the paper's 100 steps).
        solver: the fast solver (default :func:`zipkv.distill.batched.solve`).
        reference: also time the reference solver.
        reference_limit: time the reference on this many problems only (evenly spread), and scale
            its seconds to the whole context (the ``reference_problems`` column says how many ran).
        warmup: a one-step batched run first (CUDA context, cuBLAS handles, allocator).

    Returns:
        ``(timings, losses)``. ``timings``: one row per solver with ``problem_shape, ctx, ratio, solver,
        seconds`` (per context), ``speedup`` (reference seconds / this solver's seconds),
        ``problems, reference_problems``. ``losses``: one row per problem with ``layer, head, k,
        select_fit`` (the common starting loss), ``batched``, ``reference`` (NaN where not run) and
        ``rel_diff = (batched − reference)/reference``.
    """
    import pandas as pd

    cfg = replace(config or SculptConfig(), progress=False)
    fast = solver or batched_solve
    device = cfg.device or problems[0].keys.device
    ctx = problems[0].n
    if ratio is None:
        ratio = (sum(p.k for p in problems) / len(problems) + problems[0].m) / ctx
    if warmup:
        fast(problems, replace(cfg, steps=1))
    batched, t_fast = _timed(lambda: fast(problems, cfg), device)
    rows = [dict(problem_shape=problem_shape, ctx=ctx, ratio=ratio, solver="batched", seconds=t_fast,
                 problems=len(problems), reference_problems=0)]
    ref_index: list[int] = []
    ref_solutions: list[Solution] = []
    if reference:
        count = len(problems) if reference_limit is None else max(1, min(reference_limit, len(problems)))
        ref_index = sorted({round(i * (len(problems) - 1) / max(count - 1, 1)) for i in range(count)})
        ref_solutions, t_ref = _timed(lambda: reference_solve([problems[i] for i in ref_index], cfg), device)
        seconds = t_ref * len(problems) / len(ref_index)
        rows.insert(0, dict(problem_shape=problem_shape, ctx=ctx, ratio=ratio, solver="reference", seconds=seconds,
                            problems=len(problems), reference_problems=len(ref_index)))
        for row in rows:
            row["speedup"] = seconds / row["seconds"]
    timings = pd.DataFrame(rows)
    ref_loss = {i: s.loss for i, s in zip(ref_index, ref_solutions)}
    losses = pd.DataFrame([dict(problem_shape=problem_shape, ctx=ctx, ratio=ratio, layer=p.layer, head=p.head,
                                k=p.k, select_fit=s.initial_loss, batched=s.loss, reference=ref_loss.get(i, math.nan))
                           for i, (p, s) in enumerate(zip(problems, batched))])
    losses["rel_diff"] = (losses["batched"] - losses["reference"]) / losses["reference"]
    return timings, losses


def speed_sweep(model, tokenizer, books, *, contexts=(1024, 2048, 4096, 8192), ratios=(0.3,),
                ratio_sweep_context: int = 2048, sweep_ratios=(0.1, 0.3, 0.5, 0.7), m: int = 256,
                n_synthetic: int = 128, config: SculptConfig | None = None, qwen_context: int | None = 2048,
                reference_at=((2048, 0.3),),
                reference_limit: int | None = 8, seed: int = 0, progress: bool = True):
    """Seconds per context of the batched solver against context length and ratio (issue: "Distillation
    in seconds"), on the embedded model's own problems and on Qwen2.5-1.5B-shaped ones.

    One PG19 window per context length is captured once. The embedded shape is timed at every
    ``contexts × ratios`` and at ``ratio_sweep_context × sweep_ratios``; the Qwen shape at
    ``(qwen_context, 0.3)`` (skipped when ``None`` or when the model is too small to build it). The reference solver runs in the same process at the ``reference_at`` points
    (on ``reference_limit`` evenly spread problems, scaled to the context).

    Returns ``(timings, losses)`` as :func:`bench_distill`, concatenated.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from zipkv.data import windows as make_windows
    from zipkv.models import capture as capture_fn, model_shape

    shape = model_shape(model)
    embedded_label = f"{shape.name} {shape.layers}×{shape.kv_heads}×{shape.head_dim}"
    qwen_label = f"Qwen2.5-1.5B-shaped {QWEN.layers}×{QWEN.kv_heads}×{QWEN.head_dim}"
    points = [("embedded", c, r) for c in contexts for r in ratios]
    points += [("embedded", ratio_sweep_context, r) for r in sweep_ratios if ("embedded", ratio_sweep_context, r) not in points]
    if qwen_context and shape.layers >= QWEN.layers and shape.kv_heads >= 2:
        points.append(("qwen", qwen_context, 0.3))
    for _, ctx, ratio in points:                   # every point's settings, before the first capture
        budget_for_ratio(ratio, ctx, m)
    captures = {}
    timings, losses = [], []
    for kind, ctx, ratio in tqdm(points, desc="distill speed", disable=not progress):
        if ctx not in captures:
            (window,) = make_windows(tokenizer, books, 1, context=ctx, continuation=0, seed=seed + ctx)
            captures[ctx] = capture_fn(model, window.context_ids)
        problems = context_problems(captures[ctx], ratio, kind, m=m, n_synthetic=n_synthetic, seed=seed)
        timing, loss = bench_distill(problems, problem_shape=embedded_label if kind == "embedded" else qwen_label,
                                     ratio=ratio, config=config, reference=(ctx, ratio) in reference_at,
                                     reference_limit=reference_limit)
        timings.append(timing)
        losses.append(loss.assign(problem_shape=timing.problem_shape.iloc[0], ctx=ctx, ratio=ratio))
    return pd.concat(timings, ignore_index=True), pd.concat(losses, ignore_index=True)


# --- zipkv.compress at model shapes ------------------------------------------------------------------------

def compress_speed(shapes: Sequence[str] = ("smollm2-135m", "qwen2.5-1.5b", "llama3.1-8b"),
                   contexts: Sequence[int] = (2048, 8192, 32768), *, kept_fraction: float = 0.3, device="cuda",
                   seed: int = 0, progress: bool = True, out=None, **settings):
    """Seconds of :func:`zipkv.compress` (its defaults, ``settings`` applied) per context of each length at each
    model shape (:data:`zipkv.models.MODEL_SHAPES`, random bf16 weights: only time is measured), beside the same
    model's prefill of the context (one forward, ``logits_to_keep=1``, after a warm-up) in the same run.

    Returns a ``pandas.DataFrame``, one row per (shape, context): ``shape``, ``context``, ``prefill_s``,
    ``compress_s`` (probe included), one ``<phase>_s`` column per phase (capture, probe, the distiller's phases),
    ``peak_gib`` (the device's peak allocation during the compression) and ``error`` (empty, or why a point could
    not run, e.g. out of memory), with the run's device, commit and date. ``out``: a CSV path rewritten after every point (a long sweep
    that is stopped keeps the points it finished).
    """
    import gc

    import pandas as pd
    from tqdm.auto import tqdm

    import zipkv
    from zipkv.models import random_model
    rows = []
    points = [(s, n) for s in shapes for n in contexts]
    for shape in shapes:
        model = random_model(shape, device=device, seed=seed)
        model.set_attn_implementation("sdpa")
        generator = torch.Generator().manual_seed(seed)
        for n in contexts:
            if progress:
                tqdm.write(f"compress_speed: {shape} at {n} tokens")
            ids = torch.randint(0, model.config.vocab_size, (n,), generator=generator)
            row = dict(shape=shape, context=n, kept_fraction=kept_fraction, error="")
            try:
                with torch.no_grad():
                    model(input_ids=ids[None, :256].to(device), logits_to_keep=1)      # warm-up
                    sync(device)
                    t0 = time.perf_counter()
                    model(input_ids=ids[None].to(device), logits_to_keep=1)
                    sync(device)
                row["prefill_s"] = time.perf_counter() - t0
                if torch.device(device).type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                cache = zipkv.compress(model, ids, kept_fraction, **settings)
                sync(device)
                row["compress_s"] = time.perf_counter() - t0
                for phase, s in cache.compressed.info.get("phase_seconds", {}).items():
                    row[f"{phase}_s"] = s
                if torch.device(device).type == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                del cache
            except torch.cuda.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err).splitlines()[0]}"
            rows.append(row)
            if out is not None:
                pd.DataFrame(rows).assign(**_stamp()).to_csv(out, index=False)
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            if progress:
                done = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
                tqdm.write(f"  {done}  ({len(rows)}/{len(points)})")
        del model
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows).assign(**_stamp())


def _stamp() -> dict:
    """The run's device, commit and date (:func:`zipkv.provenance.provenance`), for each saved row."""
    from zipkv.provenance import provenance

    run = provenance("bench")
    return dict(device=run["device"], commit=run["commit"], date=run["date"])
