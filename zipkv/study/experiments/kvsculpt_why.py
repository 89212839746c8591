"""Why KVSculpt does not reproduce here: the two experiments the KVSculpt chapters left out (the page's evidence,
tables and sentences are :mod:`zipkv.study.chapters.kvsculpt_why`).

:func:`measure` runs both on the same windows:

* **n_s = N** — Select+Fit and KVSculpt trained on the paper's queries (retain zone + ``n_synthetic`` synthetic
  ones, §3.3) and on ``N`` synthetic ones (every context position's content vector re-rotated to a future
  position), with Random and Attention Score beside them; each cache's §3.2 objective on its training queries and
  on the continuation's real queries (held out from every fit);
* **the metric** — each compressed run's KL under every reading of §4's sentence that the text leaves open
  (:data:`zipkv.distill.kl_definitions.KL_DEFINITIONS`), from the same pair of teacher-forced runs.
"""
from __future__ import annotations

import time

import pandas as pd

from zipkv import models
from zipkv.distill import evaluate, kvsculpt
from zipkv.distill.kl_definitions import kl_table
from zipkv.distill.problem import SculptConfig

QUERY_SETS = ("paper", "dense")
"""``paper``: the retain zone's queries and ``n_synthetic`` synthetic ones; ``dense``: the retain zone's and ``N``."""
METHODS = (("random", "paper"), ("attention_score", "paper"), ("select_fit", "paper"), ("kvsculpt", "paper"),
           ("select_fit", "dense"), ("kvsculpt", "dense"))
"""(method, query set) pairs :func:`measure` runs, cheapest first."""
LABELS = {("random", "paper"): "Random", ("attention_score", "paper"): "Attention Score",
          ("select_fit", "paper"): "Select+Fit, paper's queries", ("kvsculpt", "paper"): "KVSculpt, paper's queries",
          ("select_fit", "dense"): "Select+Fit, n_s = N", ("kvsculpt", "dense"): "KVSculpt, n_s = N"}


def _objective(whole, n_context: int, caches: dict, m: int) -> dict:
    """Mean over layers and KV heads of each cache's §3.2 objective on the continuation's real queries."""
    held = evaluate.heldout_objective(whole, n_context, caches, m)
    return held.groupby("method").heldout.mean().to_dict()


def measure(model, windows, ratios, *, m: int, n_synthetic: int, steps: int, solver: str = "batched",
            seed: int = 0, methods=METHODS, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both experiments on ``windows`` (:class:`zipkv.data.Window`) at every ratio, for each of ``methods``
    ((method, query set) pairs of :data:`METHODS`, or ``"method/queries"`` names).

    Returns ``(table, definitions)``. ``table``: one row per (window, ratio, method, queries) with ``n_synthetic``,
    ``kl`` (this project's reading: KL(full ‖ compressed), nats, mean over the continuation's tokens), ``train``
    and ``heldout`` (mean §3.2 objective on the training queries and on the continuation's queries) and
    ``seconds`` (compression). ``definitions``: one row per (window, ratio, method, queries, definition) with ``kl``.
    """
    methods = [tuple(x.split("/")) if isinstance(x, str) else tuple(x) for x in methods]
    unknown = [x for x in methods if x not in LABELS]
    if unknown:
        raise ValueError(f"methods {unknown}: expected (method, query set) pairs or 'method/queries' names from "
                         f"{list(LABELS)}")
    if not len(windows) or not len(ratios):
        raise ValueError(f"windows ({len(windows)}) and ratios ({len(ratios)}): expected at least one of each")
    config = SculptConfig(steps=steps, progress=False)
    rows, definition_rows = [], []
    for w, window in enumerate(windows):
        N = window.context
        whole = models.capture(model, window.input_ids)  # one pass: the context's cache and the continuation's queries
        cap = whole.prefix(N)
        reference = evaluate.teacher_force(model, kvsculpt.CompressedCache.from_capture(cap), window.continuation_ids)
        n_s = {"paper": n_synthetic, "dense": N}
        problems = {q: kvsculpt.build_problems(cap, 1, m=m, n_synthetic=n_s[q], seed=seed)
                    for q in {q for _, q in methods}}
        for ratio in ratios:
            caches, measured = {}, []
            for method, queries in methods:
                started = time.perf_counter()
                cache = kvsculpt.compress(cap, ratio, method, m=m, n_synthetic=n_s[queries], config=config,
                                          seed=seed, solver=solver, problems=problems[queries])
                seconds = time.perf_counter() - started
                kls = kl_table(reference.logits, evaluate.teacher_force(model, cache, window.continuation_ids).logits)
                caches[f"{method}/{queries}"] = cache
                measured.append(dict(window=w, ratio=ratio, method=method, queries=queries, n_synthetic=n_s[queries],
                                     kl=kls["ours"], train=float(cache.loss.mean()), seconds=seconds))
                definition_rows += [dict(window=w, ratio=ratio, method=method, queries=queries, definition=name,
                                         kl=value) for name, value in kls.items()]
                if progress:
                    print(f"window {w} r={ratio} {LABELS[method, queries]:28s} KL={kls['ours']:.4g} "
                          f"({seconds:.1f} s)", flush=True)
            held = _objective(whole, N, caches, m)
            rows += [dict(row, heldout=held[f"{row['method']}/{row['queries']}"]) for row in measured]
    return pd.DataFrame(rows), pd.DataFrame(definition_rows)

