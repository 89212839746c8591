"""The "Beyond the paper" comparison (issue 17): every method on the same windows, KL and seconds.

:func:`compare` captures each window once (context + continuation in one pass), teacher-forces the full
cache once, and compresses the context at every ratio with every method of :data:`METHODS`:

* ``attention_score``, ``select_fit``, ``kvsculpt`` — KVSculpt §4's baselines and KVSculpt itself, with
  the paper's training queries (``m`` retain + ``n_synthetic`` synthetic, §3.3) through
  :func:`zipkv.distill.compress`;
* ``select_fit_dense`` — Select+Fit with ``n_synthetic = N`` synthetic queries (every position's content);
* ``select_fit_future`` — Select+Fit on zipkv's training queries
  (:func:`~zipkv.distill.generalise.future_queries`), so the best Select+Fit is chosen among three query sets;
* ``attention_matching`` — :mod:`zipkv.distill.attention_matching` on zipkv's training queries;
* ``zipkv`` — :mod:`zipkv.distill.generalise` with the probe budget (the model's own sampled continuation,
  drawn once per window; its sampling time is added to every ratio's seconds) and the cascade-aware fit.

KL is measured by :func:`zipkv.distill.bias.evaluate` for every method (β = 0 for the methods without
bias, where it equals :func:`zipkv.distill.evaluate.evaluate`). :func:`compare` also returns each cache's
objective on the paper's training queries and on the continuation's real queries (held out from all).
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from . import attention_matching, bias, generalise

METHODS = ("attention_score", "select_fit", "select_fit_dense", "select_fit_future", "kvsculpt",
           "attention_matching", "zipkv")
"""Method names of :func:`compare`."""

SELECT_FIT_VARIANTS = ("select_fit", "select_fit_dense", "select_fit_future")
"""Select+Fit with the paper's, ``N`` synthetic and zipkv's training queries: "best Select+Fit" is their best."""

LABELS = {"attention_score": "Attention Score", "select_fit": "Select+Fit (paper's queries)",
          "select_fit_dense": "Select+Fit (n_s = N)", "select_fit_future": "Select+Fit (zipkv's queries)",
          "kvsculpt": "KVSculpt (paper)", "attention_matching": "Attention Matching", "zipkv": "zipkv"}


def _future_problems(capture, m: int, horizon: int, validation_every: int):
    """One :class:`~zipkv.distill.Problem` per (layer, KV head) whose queries are zipkv's training split."""
    from . import Problem

    problems = []
    for layer, lc in enumerate(capture.layers):
        H, N, d = lc.keys.shape
        train, _ = generalise.future_queries(lc.queries.view(H, -1, N, d), capture.positions, capture.rope, m,
                                             horizon=horizon, validation_every=validation_every)
        problems += [Problem(keys=lc.keys[h], values=lc.values[h], queries=train[h], m=m, k=1, layer=layer, head=h)
                     for h in range(H)]
    return problems


def objective_on(capture, cache: bias.BiasedCache, m: int, queries: Sequence[torch.Tensor]) -> float:
    """Mean over layers and heads of KVSculpt's §3.2 objective of ``cache`` on ``queries[l]`` ``[H, n, d]``
    (post-RoPE), against the full cache of ``capture`` (the context)."""
    total, count = 0.0, 0
    for layer, (lc, q) in enumerate(zip(capture.layers, queries)):
        H, N, d = lc.keys.shape
        t = generalise.HeadTargets.of(q.float(), lc.keys.float(), lc.values.float(), m, 1.0 / math.sqrt(d))
        k = cache.keys[layer][0].shape[0] - m
        if any(x.shape[0] - m != k for x in cache.keys[layer]):  # ragged budget: head by head
            for h in range(H):
                kh = cache.keys[layer][h].shape[0] - m
                sub = generalise.HeadTargets(t.q[h:h + 1], t.s_old[h:h + 1], t.s_ret[h:h + 1], t.lse[h:h + 1], t.y[h:h + 1])
                total += float(sum(generalise.objective(
                    sub, cache.keys[layer][h][None, :kh].float(), cache.values[layer][h][None, :kh].float(),
                    cache.bias[layer][h][None, :kh].float(), lc.values[h:h + 1, N - m:].float())))
        else:
            keys = torch.stack([x[:k] for x in cache.keys[layer]]).float()
            values = torch.stack([x[:k] for x in cache.values[layer]]).float()
            b = torch.stack([x[:k] for x in cache.bias[layer]]).float()
            total += float(sum(generalise.objective(t, keys, values, b, lc.values[:, N - m:].float())).sum())
        count += H
    return total / count


def compare(model, windows: Sequence, ratios: Sequence[float], methods: Sequence[str] = METHODS, *, m: int = 256,
            n_synthetic: int = 128, steps: int = 100, solver: str = "batched", probe_tokens: int = 64,
            zipkv_config: generalise.ZipkvConfig | None = None, zipkv_budget: str = "probe",
            alpha: float = generalise.PROBE_ALPHA,
            cascade: bool = True,
            kvsculpt_ratios: Sequence[float] | None = None, objective_ratio: float | None = 0.3,
            device=None, seed: int = 0, progress: bool = True):
    """KL and seconds of every method at every ratio on every window (module docstring).

    Args:
        model: a Hugging Face Llama-family causal LM.
        windows: :class:`zipkv.data.Window` objects (context ``N`` + continuation).
        ratios: ``r = (k + m)/N``, each ``> m/N``.
        methods: names from :data:`METHODS`.
        m, n_synthetic, steps, solver: the paper's setting for the KVSculpt-family methods.
        probe_tokens: tokens of zipkv's sampled continuation.
        zipkv_config, zipkv_budget, alpha, cascade: zipkv's distiller settings (probe budget, cascade-aware fit).
        kvsculpt_ratios: the ratios KVSculpt runs at (default: all); its 100 L-BFGS steps dominate the run.
        objective_ratio: the ratio at which the objectives (paper's queries, held-out queries) are measured.
        device: solver device for every method.

    Returns:
        ``(table, objectives)``: ``table`` rows ``model, window, ratio, method, kl, seconds``;
        ``objectives`` rows ``window, method, train, heldout`` (at ``objective_ratio``).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn, model_shape

    from . import SculptConfig, build_problems, compress
    from .kvsculpt import solver_named

    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods {unknown} are not compared here: expected names from {list(METHODS)}")
    zcfg = zipkv_config or generalise.ZipkvConfig(device=device)
    acfg = attention_matching.AttentionMatchingConfig(horizon=zcfg.horizon, validation_every=zcfg.validation_every,
                                                      device=device)
    sculpt = SculptConfig(steps=steps, progress=False, device=device)
    name = model_shape(model).name
    rows, objective_rows = [], []
    for w, window in enumerate(windows):
        started = time.perf_counter()
        N = window.context
        whole = capture_fn(model, window.input_ids)
        cap = whole.prefix(N)
        continuation = window.continuation_ids
        reference = bias.teacher_force(model, bias.BiasedCache.from_capture(cap), continuation)
        problems = {"paper": build_problems(cap, 1, m=m, n_synthetic=n_synthetic, seed=seed)}
        if "select_fit_dense" in methods:
            problems["dense"] = build_problems(cap, 1, m=m, n_synthetic=N, seed=seed)
        if "select_fit_future" in methods:
            problems["future"] = _future_problems(cap, m, zcfg.horizon, zcfg.validation_every)
        probe, probe_seconds = None, 0.0
        if "zipkv" in methods and (zipkv_budget == "probe" or cascade):
            t0 = time.perf_counter()
            probe = generalise.sample_probe(model, cap, window.context_ids, probe_tokens, seed=seed + w)
            probe_seconds = time.perf_counter() - t0
        heldout_q = [lc.queries[:, N:].reshape(lc.keys.shape[0], -1, lc.keys.shape[-1]) for lc in whole.layers]
        paper_q = [torch.stack([p.queries for p in problems["paper"][l * cap.layers[0].keys.shape[0]:
                                                                       (l + 1) * cap.layers[0].keys.shape[0]]])
                   for l in range(len(cap.layers))]
        if progress:
            print(f"window {w}: capture, reference and queries ({time.perf_counter() - started:.1f} s)", flush=True)
        for ratio in ratios:
            for method in methods:
                if method == "kvsculpt" and kvsculpt_ratios is not None and ratio not in kvsculpt_ratios:
                    continue
                t0 = time.perf_counter()
                if method in ("attention_score", "select_fit", "kvsculpt"):
                    cache = bias.as_biased(compress(cap, ratio, method, m=m, n_synthetic=n_synthetic, config=sculpt,
                                                    solver=solver_named(solver), seed=seed, problems=problems["paper"]))
                elif method in ("select_fit_dense", "select_fit_future"):
                    key = "dense" if method == "select_fit_dense" else "future"
                    cache = bias.as_biased(compress(cap, ratio, "select_fit", m=m, config=sculpt,
                                                    n_synthetic=N if key == "dense" else n_synthetic,
                                                    problems=problems[key]))
                elif method == "attention_matching":
                    cache = attention_matching.compress(cap, ratio, m=m, config=acfg)
                else:
                    cache = generalise.compress(cap, ratio, m=m, config=zcfg, budget=zipkv_budget, alpha=alpha,
                                                model=model, probe=probe, cascade=cascade)
                if device is not None and torch.device(device).type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0 + (probe_seconds if method == "zipkv" else 0.0)
                kl = bias.evaluate(model, cache, continuation, reference)
                rows.append(dict(model=name, window=w, ratio=ratio, method=method, kl=kl, seconds=seconds))
                if objective_ratio is not None and math.isclose(ratio, objective_ratio):
                    objective_rows.append(dict(window=w, method=method, train=objective_on(cap, cache, m, paper_q),
                                               heldout=objective_on(cap, cache, m, heldout_q)))
                if progress:
                    print(f"window {w} r={ratio} {method:18s} KL={kl:.4g} ({seconds:.1f} s)", flush=True)
    return pd.DataFrame(rows), pd.DataFrame(objective_rows)


def layer_kl(model, window, ratio: float = 0.3, *, m: int = 256, probe_tokens: int = 64, device=None, seed: int = 0):
    """Where the KL sits: KL on the real continuation with only layer ``l`` compressed (all others full), for
    Select+Fit with ``n_s = N``, zipkv with a uniform budget and zipkv with the probe budget, plus the probe's
    per-layer signal (what zipkv sees instead of the real continuation).

    Returns a ``pandas.DataFrame`` with ``layer, method, kl`` (``method="probe_signal"``: the probe KL of the
    uniform zipkv cache with only that layer's heads compressed one at a time, summed over heads).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn

    from . import compress

    N = window.context
    cap = capture_fn(model, window.context_ids)
    full = bias.BiasedCache.from_capture(cap)
    reference = bias.teacher_force(model, full, window.continuation_ids)
    zcfg = generalise.ZipkvConfig(device=device)
    probe = generalise.sample_probe(model, cap, window.context_ids, probe_tokens, seed=seed)
    caches = {"select_fit_dense": bias.as_biased(compress(cap, ratio, "select_fit", m=m, n_synthetic=N)),
              "zipkv_uniform": generalise.compress(cap, ratio, m=m, config=zcfg),
              "zipkv": generalise.compress(cap, ratio, m=m, config=zcfg, budget="probe", model=model, probe=probe,
                                           cascade=True)}
    rows = [dict(layer=l, method=method, kl=bias.evaluate(model, full.with_layers(cache, [l]), window.continuation_ids,
                                                        reference))
            for method, cache in caches.items() for l in range(full.num_layers)]
    signal = caches["zipkv"].info["signal"].sum(dim=1)
    rows += [dict(layer=l, method="probe_signal", kl=float(s)) for l, s in enumerate(signal)]
    return pd.DataFrame(rows)
