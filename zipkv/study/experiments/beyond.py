"""The "Beyond the paper" comparison (issue 17): every method on the same windows, KL and seconds.

:func:`compare` captures each window once (context + continuation in one pass), teacher-forces the full
cache once, and compresses the context at every ratio with every method of :data:`METHODS`:

* ``attention_score``, ``select_fit``, ``kvsculpt`` — KVSculpt §4's baselines and KVSculpt itself, with
  the paper's training queries (``m`` retain + ``n_synthetic`` synthetic, §3.3) through
  :func:`zipkv.distill.compress`;
* ``select_fit_dense`` — Select+Fit with ``n_synthetic = N`` synthetic queries (every position's content);
* ``select_fit_future`` — Select+Fit on zipkv's training queries
  (:func:`~zipkv.distill.generalise.future_queries`), so the best Select+Fit is chosen among three query sets;
* ``am_highest``, ``am_omp``, ``am_lbfgs`` — :mod:`zipkv.distill.attention_matching`'s three key
  constructions on zipkv's training queries plus the probe's on-policy queries (the same queries zipkv's
  distiller trains on); ``attention_matching`` — per window and ratio the one of the three with the lowest
  objective on the validation queries (never on the KL), its seconds those of all three fits;
* ``zipkv`` — :mod:`zipkv.distill.generalise` with the probe budget (the model's own sampled continuation,
  drawn once per window; its sampling time is added to the seconds of every method that uses it) and the
  cascade-aware fit.

KL is measured by :func:`zipkv.distill.bias.evaluate` for every method (β = 0 for the methods without
bias, where it equals :func:`zipkv.distill.evaluate.evaluate`). :func:`compare` also returns each cache's
objective on the paper's training queries and on the continuation's real queries (held out from all).
"""
from __future__ import annotations

import math
import numbers
import time
from typing import Sequence

import torch

from zipkv.models import rope_of

from zipkv.distill import attention_matching, bias, generalise

METHODS = ("attention_score", "select_fit", "select_fit_dense", "select_fit_future", "kvsculpt",
           "am_highest", "am_omp", "am_lbfgs", "attention_matching", "zipkv")
"""Method names of :func:`compare`."""

SELECT_FIT_VARIANTS = ("select_fit", "select_fit_dense", "select_fit_future")
"""Select+Fit with the paper's, ``N`` synthetic and zipkv's training queries: "best Select+Fit" is their best."""

AM_VARIANTS = ("am_highest", "am_omp", "am_lbfgs")
"""Attention Matching's key constructions (:data:`zipkv.distill.attention_matching.KEY_METHODS`); the method
``attention_matching`` is, per window and ratio, the one with the lowest validation objective."""

LABELS = {"attention_score": "Attention Score", "select_fit": "Select+Fit (paper's queries)",
          "select_fit_dense": "Select+Fit (n_s = N)", "select_fit_future": "Select+Fit (zipkv's queries)",
          "kvsculpt": "KVSculpt (paper)", "am_highest": "AM, highest-attention keys", "am_omp": "AM, OMP keys",
          "am_lbfgs": "AM, L-BFGS keys", "attention_matching": "Attention Matching (picked on validation)",
          "zipkv": "zipkv"}


def _future_problems(capture, m: int, horizon: int, validation_every: int):
    """One :class:`~zipkv.distill.Problem` per (layer, KV head) whose queries are zipkv's training split."""
    from zipkv.distill import Problem

    problems = []
    for layer, lc in enumerate(capture.layers):
        H, N, d = lc.keys.shape
        train, _ = generalise.future_queries(lc.queries.view(H, -1, N, d), capture.positions,
                                             rope_of(capture, layer), m,
                                             horizon=horizon, validation_every=validation_every)
        problems += [Problem(keys=lc.keys[h], values=lc.values[h], queries=train[h], m=m, k=1, layer=layer, head=h)
                     for h in range(H)]
    return problems


def objective_on(capture, cache: bias.BiasedCache, m: int, queries: Sequence[torch.Tensor]) -> float:
    """Mean over the compressed layers' heads of KVSculpt's §3.2 objective of ``cache`` on ``queries[l]``
    ``[H, n, d]`` (post-RoPE), against the full cache of ``capture`` (the context)."""
    total, count = 0.0, 0
    for layer, (lc, q) in enumerate(zip(capture.layers, queries)):
        if getattr(lc, "window", None) is not None:
            continue  # a sliding-window layer is not compressed (zipkv.models.Capture.compressed_layers)
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


class _Window:
    """What every method of one window shares: the capture, the full cache's teacher-forced reference, the
    query sets of the Select+Fit variants, the model's sampled continuation (probe) and the objective queries."""

    def __init__(self, model, window, methods, m, n_synthetic, probe_tokens, zcfg, seed, w):
        from zipkv.models import capture as capture_fn

        from zipkv.distill import build_problems

        started = time.perf_counter()
        N = self.N = window.context
        whole = capture_fn(model, window.input_ids)
        self.cap = cap = whole.prefix(N)
        self.continuation = window.continuation_ids
        self.reference = bias.teacher_force(model, bias.BiasedCache.from_capture(cap), self.continuation)
        self.problems = {"paper": build_problems(cap, 1, m=m, n_synthetic=n_synthetic, seed=seed)}
        if "select_fit_dense" in methods:
            self.problems["dense"] = build_problems(cap, 1, m=m, n_synthetic=N, seed=seed)
        if "select_fit_future" in methods:
            self.problems["future"] = _future_problems(cap, m, zcfg.horizon, zcfg.validation_every)
        self.probe, self.probe_seconds = None, 0.0
        if any(x in methods for x in PROBE_METHODS):
            t0 = generalise.synchronized_time()
            self.probe = generalise.sample_probe(model, cap, window.context_ids, probe_tokens, seed=seed + w)
            self.probe_seconds = generalise.synchronized_time() - t0
        H = cap.layers[0].keys.shape[0]
        self.heldout_q = [lc.queries[:, N:].reshape(H, -1, lc.keys.shape[-1]) for lc in whole.layers]
        self.paper_q = [torch.stack([p.queries for p in self.problems["paper"][l * H:(l + 1) * H]])
                        for l in range(len(cap.layers))]
        self.seconds = time.perf_counter() - started


PROBE_METHODS = ("am_highest", "am_omp", "am_lbfgs", "attention_matching", "zipkv")
"""Methods that use the model's sampled continuation (zipkv's probe budget and every method's on-policy queries)."""


def compare(model, windows: Sequence, ratios: Sequence[float], methods: Sequence[str] = METHODS, *, m: int = 256,
            n_synthetic: int = 128, steps: int = 100, solver: str = "batched", probe_tokens: int = 64,
            zipkv_config: generalise.ZipkvConfig | None = None, zipkv_budget: str = "probe",
            alpha: float = generalise.PROBE_ALPHA, cascade: bool = True,
            am_config: attention_matching.AttentionMatchingConfig | None = None,
            main_ratio: float = 0.3, kvsculpt_ratios: Sequence[float] | None = None,
            kvsculpt_windows: int | None = None, ratio_windows: int | None = None, time_budget_s: float | None = None,
            device=None, seed: int = 0, window_offset: int = 0, progress: bool = True):
    """KL and seconds of every method at every ratio on every window (module docstring).

    The work runs in order of what the chapter's bars need, so that a ``time_budget_s`` cuts the least needed:
    (1) ``main_ratio`` on every window, every method but KVSculpt; (2) the other ratios on the first
    ``ratio_windows`` windows (those above ``main_ratio`` first: the bars name them); (3) KVSculpt (paper
    setting, for the record) at ``kvsculpt_ratios`` on the first ``kvsculpt_windows`` windows that also ran there. Each pass stops before an item that, costed as the slowest item so far, would end
    past ``time_budget_s`` seconds from the start; the table says which windows each (method, ratio) got.

    Args:
        model: a Hugging Face Llama-family causal LM.
        windows: :class:`zipkv.data.Window` objects (context ``N`` + continuation).
        ratios: ``r = (k + m)/N``, each ``> m/N``; must hold ``main_ratio``.
        methods: names from :data:`METHODS` (``attention_matching`` needs the three ``am_*``).
        m, n_synthetic, steps, solver: the paper's setting for the KVSculpt-family methods.
        probe_tokens: tokens of the model's sampled continuation (zipkv's probe budget, on-policy queries).
        zipkv_config, zipkv_budget, alpha, cascade: zipkv's distiller settings (probe budget, cascade-aware fit).
        am_config: Attention Matching's settings (its ``keys`` is set per variant).
        main_ratio: the ratio of the bars, run on every window; the objectives are measured there.
        kvsculpt_ratios: the ratios KVSculpt runs at (default: all); its 100 L-BFGS steps dominate the run.
        kvsculpt_windows, ratio_windows: how many windows (the first ones) KVSculpt and the other ratios get
            (default: all).
        time_budget_s: wall-clock seconds within which the passes stop (default: none).
        device: solver device for every method.
        window_offset: the index of ``windows[0]`` among the study's windows: window ``i``'s probe is sampled with
            seed ``seed + window_offset + i`` and labelled ``window_offset + i``, so a run over the study's windows
            ``[j:]`` gives the rows that one run over all of them gives there.

    Returns:
        ``(table, objectives)``: ``table`` rows ``model, window, ratio, method, kl, seconds`` (and ``choice``, the
        construction Attention Matching's validation objective picked); ``objectives`` rows
        ``window, method, train, heldout`` (at ``main_ratio``).
    """
    import dataclasses

    import pandas as pd

    from zipkv.models import model_shape

    from zipkv.distill import SculptConfig, compress
    from zipkv.distill.kvsculpt import solver_named

    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods {unknown} are not compared here: expected names from {list(METHODS)}")
    if "attention_matching" in methods and not set(AM_VARIANTS) <= set(methods):
        raise ValueError(f"methods has attention_matching without all of {list(AM_VARIANTS)}: its pick needs the three")
    if (isinstance(ratios, (str, bytes)) or not hasattr(ratios, "__len__") or not len(ratios)
            or any(isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0 < r < 1 for r in ratios)):
        raise TypeError(f"ratios must be a non-empty list of numbers in (0, 1), got {ratios!r}")
    if not any(math.isclose(r, main_ratio) for r in ratios):
        raise ValueError(f"ratios={list(ratios)} lacks main_ratio={main_ratio}")
    zcfg = zipkv_config or generalise.ZipkvConfig(device=device)
    acfg = am_config or attention_matching.AttentionMatchingConfig(horizon=zcfg.horizon,
                                                                  validation_every=zcfg.validation_every, device=device)
    sculpt = SculptConfig(steps=steps, progress=False, device=device)
    name = model_shape(model).name
    started = time.perf_counter()
    rows, objective_rows, states = [], [], {}
    n_keep = max(len(windows) if x is None else min(x, len(windows)) for x in (kvsculpt_windows, ratio_windows))

    def state(w):
        if w not in states:
            st = _Window(model, windows[w], methods, m, n_synthetic, probe_tokens, zcfg, seed, w + window_offset)
            if progress:
                print(f"window {w + window_offset}: capture, reference, queries and probe ({st.seconds:.1f} s)", flush=True)
            if w < n_keep:
                states[w] = st
            return st
        return states[w]

    def run(w, st, ratio, method):
        t0 = time.perf_counter()
        if method in ("attention_score", "select_fit", "kvsculpt"):
            cache = bias.as_biased(compress(st.cap, ratio, method, m=m, n_synthetic=n_synthetic, config=sculpt,
                                            solver=solver_named(solver), seed=seed, problems=st.problems["paper"]))
        elif method in ("select_fit_dense", "select_fit_future"):
            key = "dense" if method == "select_fit_dense" else "future"
            cache = bias.as_biased(compress(st.cap, ratio, "select_fit", m=m, config=sculpt,
                                            n_synthetic=st.N if key == "dense" else n_synthetic,
                                            problems=st.problems[key]))
        elif method in AM_VARIANTS:
            cache = attention_matching.compress(st.cap, ratio, m=m, model=model, probe=st.probe,
                                                config=dataclasses.replace(acfg, keys=method[3:]))
        else:
            cache = generalise.compress(st.cap, ratio, m=m, config=zcfg, budget=zipkv_budget, alpha=alpha,
                                        model=model, probe=st.probe, cascade=cascade)
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0 + (st.probe_seconds if method in PROBE_METHODS else 0.0)
        kl = bias.evaluate(model, cache, st.continuation, st.reference)
        rows.append(dict(model=name, window=w, ratio=ratio, method=method, kl=kl, seconds=seconds, choice=""))
        if math.isclose(ratio, main_ratio):
            objective_rows.append(dict(window=w, method=method, train=objective_on(st.cap, cache, m, st.paper_q),
                                       heldout=objective_on(st.cap, cache, m, st.heldout_q)))
        if progress:
            phases = "".join(f", {name} {t:.2f} s" for name, t in cache.info.get("phase_seconds", {}).items())
            probe = f", probe {st.probe_seconds:.2f} s" if method in PROBE_METHODS else ""
            print(f"window {w + window_offset} r={ratio} {method:18s} KL={kl:.4g} ({seconds:.1f} s{probe}{phases})", flush=True)
        return cache

    def run_all(w, ratio, chosen):
        st = state(w)
        am = {}
        for method in chosen:
            if method == "attention_matching":
                continue
            cache = run(w, st, ratio, method)
            if method in AM_VARIANTS:
                am[method] = cache
        if "attention_matching" in chosen:  # the construction with the lowest validation objective, its KL
            pick = attention_matching.select_by_validation(am)
            row = dict(next(r for r in rows if r["window"] == w and r["ratio"] == ratio and r["method"] == pick))
            row.update(method="attention_matching", choice=pick, seconds=sum(
                r["seconds"] for r in rows if r["window"] == w and r["ratio"] == ratio and r["method"] in AM_VARIANTS)
                - (len(AM_VARIANTS) - 1) * st.probe_seconds)
            rows.append(row)
            if math.isclose(ratio, main_ratio):
                objective_rows.append(dict(next(r for r in objective_rows if r["window"] == w and r["method"] == pick),
                                           method="attention_matching"))

    slowest = [0.0]

    def timed(passes):
        """Run ``passes`` (window, ratio, methods) in order while the next one, costed as the slowest item run so
        far, still ends within ``time_budget_s``."""
        for w, ratio, chosen in passes:
            if not chosen:
                continue
            if time_budget_s is not None and time.perf_counter() - started + slowest[0] > time_budget_s:
                if progress:
                    print(f"time budget of {time_budget_s:g} s spent: stopped before window {w + window_offset}, "
                          f"r={ratio}", flush=True)
                return
            t0 = time.perf_counter()
            run_all(w, ratio, chosen)
            slowest[0] = max(slowest[0], time.perf_counter() - t0)

    def kvsculpt_at(w, ratio):
        return ("kvsculpt" in methods and (kvsculpt_windows is None or w < kvsculpt_windows)
                and (kvsculpt_ratios is None or any(math.isclose(ratio, r) for r in kvsculpt_ratios)))

    n_other = len(windows) if ratio_windows is None else min(ratio_windows, len(windows))
    others = sorted((r for r in ratios if not math.isclose(r, main_ratio)), key=lambda r: r < main_ratio)
    rest = [x for x in methods if x != "kvsculpt"]
    timed((w, main_ratio, rest) for w in range(len(windows)))  # 1: the bars
    timed((w, ratio, rest) for w in range(n_other) for ratio in others)  # 2: the other ratios
    timed((w, ratio, ["kvsculpt"]) for ratio in [main_ratio] + others for w in range(len(windows))  # 3: KVSculpt
          if kvsculpt_at(w, ratio) and (math.isclose(ratio, main_ratio) or w < n_other))
    table = pd.DataFrame(rows, columns=["model", "window", "ratio", "method", "kl", "seconds", "choice"])
    objectives = pd.DataFrame(objective_rows, columns=["window", "method", "train", "heldout"])
    table["window"] += window_offset
    objectives["window"] += window_offset
    return table.sort_values(["window", "ratio"], kind="stable").reset_index(drop=True), objectives


def layer_kl(model, window, ratio: float = 0.3, *, m: int = 256, probe_tokens: int = 64, device=None, seed: int = 0):
    """Where the KL sits: KL on the real continuation with only layer ``l`` compressed (all others full), for
    Select+Fit with ``n_s = N``, zipkv with a uniform budget and zipkv with the probe budget, plus the probe's
    per-layer signal (what zipkv sees instead of the real continuation).

    Returns a ``pandas.DataFrame`` with ``layer, method, kl`` (``method="probe_signal"``: the probe KL of the
    uniform zipkv cache with only that layer's heads compressed one at a time, summed over heads).
    """
    import pandas as pd

    from zipkv.models import capture as capture_fn

    from zipkv.distill import compress

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
