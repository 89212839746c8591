"""Why KVSculpt does not reproduce here: the evidence the KVSculpt chapters committed, and the two experiments
they left out.

:func:`evidence` reads the committed paper-profile tables (``results/paper``) and returns the numbers the page
assembles. :func:`measure` runs the two experiments on the same windows:

* **n_s = N** — Select+Fit and KVSculpt trained on the paper's queries (retain zone + ``n_synthetic`` synthetic
  ones, §3.3) and on ``N`` synthetic ones (every context position's content vector re-rotated to a future
  position), with Random and Attention Score beside them; each cache's §3.2 objective on its training queries and
  on the continuation's real queries (held out from every fit);
* **the metric** — each compressed run's KL under every reading of §4's sentence that the text leaves open
  (:data:`zipkv.distill.kl_definitions.KL_DEFINITIONS`), from the same pair of teacher-forced runs.
"""
from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from zipkv import models
from zipkv.distill import evaluate, kvsculpt
from zipkv.distill.kl_definitions import KL_DEFINITIONS, kl_table
from zipkv.distill.problem import SculptConfig
from zipkv.study import paper_values as pv

QUERY_SETS = ("paper", "dense")
"""``paper``: the retain zone's queries and ``n_synthetic`` synthetic ones; ``dense``: the retain zone's and ``N``."""
METHODS = (("random", "paper"), ("attention_score", "paper"), ("select_fit", "paper"), ("kvsculpt", "paper"),
           ("select_fit", "dense"), ("kvsculpt", "dense"))
"""(method, query set) pairs :func:`measure` runs, cheapest first."""
BASELINE = ("select_fit", "paper")
"""What every ratio on the page divides: Select+Fit on the paper's queries (the paper's strongest baseline)."""
LABELS = {("random", "paper"): "Random", ("attention_score", "paper"): "Attention Score",
          ("select_fit", "paper"): "Select+Fit, paper's queries", ("kvsculpt", "paper"): "KVSculpt, paper's queries",
          ("select_fit", "dense"): "Select+Fit, n_s = N", ("kvsculpt", "dense"): "KVSculpt, n_s = N"}


def _objective(whole, n_context: int, caches: dict, m: int) -> dict:
    """Mean over layers and KV heads of each cache's §3.2 objective on the continuation's real queries."""
    held = evaluate.heldout_objective(whole, n_context, caches, m)
    return held.groupby("method").heldout.mean().to_dict()


def measure(model, windows, ratios, *, m: int, n_synthetic: int, steps: int, solver: str = "batched",
            seed: int = 0, methods=METHODS, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both experiments on ``windows`` (:class:`zipkv.data.Window`) at every ratio.

    Returns ``(table, definitions)``. ``table``: one row per (window, ratio, method, queries) with ``n_synthetic``,
    ``kl`` (this project's reading: KL(full ‖ compressed), nats, mean over the continuation's tokens), ``train``
    and ``heldout`` (mean §3.2 objective on the training queries and on the continuation's queries) and
    ``seconds`` (compression). ``definitions``: one row per (window, ratio, method, queries, definition) with ``kl``.
    """
    unknown = [x for x in methods if x not in LABELS]
    if unknown:
        raise ValueError(f"methods {unknown}: expected (method, query set) pairs from {list(LABELS)}")
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


# --- what the page shows -----------------------------------------------------------------------------------

def gains(table: pd.DataFrame) -> pd.DataFrame:
    """Per ratio (rows) and method (columns, :data:`LABELS`): Select+Fit's (paper's queries) mean KL over the
    method's mean KL, means over windows (the paper's statistic): > 1 = the method is better."""
    kl = table.groupby(["ratio", "method", "queries"]).kl.mean()
    out = {LABELS[key]: kl.xs(BASELINE[0], level="method").xs(BASELINE[1], level="queries")
           / kl.xs(key[0], level="method").xs(key[1], level="queries")
           for key in LABELS if key != BASELINE and (key[0], key[1]) in set(zip(table.method, table.queries))}
    return pd.DataFrame(out)


def gains_figure(table: pd.DataFrame):
    """The headline: per ratio, Select+Fit's KL over each method's (log axis), beside the paper's KVSculpt."""
    import matplotlib.pyplot as plt

    g = gains(table)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, column in enumerate(c for c in g.columns if c != "Random"):
        ax.plot(g.index, g[column], "-o", color=f"C{i}", label=f"{column} (ours)")
    paper = pd.Series(pv.KVSCULPT_TABLE1_IMPROVEMENT).sort_index()
    ax.plot(paper.index, paper.values, "k--v", label=f"KVSculpt (paper, {pv.KVSCULPT_MODEL})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio r = (k + m) / N")
    ax.set_ylabel("Select+Fit KL / method KL (×)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return fig


def definitions_table(definitions: pd.DataFrame, ratio: float = 0.3) -> pd.DataFrame:
    """At ``ratio``: per reading of the metric (rows), each method's mean KL over windows and the factor by which the
    reading moves our KL (its mean over methods of reading / ours); and the paper's Table 1 over ours under that
    reading for the methods the paper reports."""
    at = definitions[definitions.ratio == ratio]
    if at.empty:
        raise ValueError(f"ratio={ratio}: no rows at this ratio (the run has {sorted(definitions.ratio.unique())})")
    kl = at.groupby(["definition", "method", "queries"]).kl.mean().unstack(["method", "queries"])
    kl = kl.reindex([d for d in KL_DEFINITIONS if d in kl.index])
    table = pd.DataFrame(index=[KL_DEFINITIONS[d].label for d in kl.index])
    paper = {key: pv.KVSCULPT_TABLE1[key[0]][ratio] for key in kl.columns
             if key[1] == "paper" and ratio in pv.KVSCULPT_TABLE1.get(key[0], {})}
    for key in kl.columns:
        table[LABELS[key]] = kl[key].values
    table["× ours"] = (kl / kl.loc["ours"]).mean(axis=1).values
    table["paper / ours (median)"] = [float(pd.Series({k: v / kl.loc[d, k] for k, v in paper.items()}).median())
                                      for d in kl.index]
    return table


def queries_per_head(n_context: int = 2048, m: int = 256, n_synthetic: int = 128,
                     ratios=(0.3, 0.5, 0.7)) -> pd.DataFrame:
    """The value fit's equations against its unknowns: per model (the paper's, this study's), training queries per
    KV head g·(m + n_s) with the paper's n_s and with n_s = N, and the compressed pairs k = r·N − m per ratio."""
    shapes = {pv.KVSCULPT_MODEL: models.PAPER_MODELS[pv.KVSCULPT_MODEL], models.EMBEDDED_NAME: models.EMBEDDED_SHAPE}
    rows = []
    for name, shape in shapes.items():
        g = shape.q_heads // shape.kv_heads
        row = {"model": name, "query heads per KV head": g,
               f"queries, n_s = {n_synthetic}": g * (m + n_synthetic), "queries, n_s = N": g * (m + n_context)}
        row |= {f"k at r = {r:g}": kvsculpt.budget_for_ratio(r, n_context, m) for r in ratios}
        rows.append(row)
    return pd.DataFrame(rows).set_index("model")


# --- the evidence already committed ------------------------------------------------------------------------

def evidence(results: str | Path) -> dict:
    """The numbers the KVSculpt chapters committed under ``results`` (``results/paper``), as the page cites them.

    Returns a dict: ``train_ratio``, ``heldout_ratio`` (median over layers of KVSculpt's objective over Select+Fit's
    on the training and the held-out queries), ``dense_gain`` (per ratio, Select+Fit's mean KL with the paper's
    queries over its mean KL with n_s = N, the beyond chapter's 20 windows), ``score_over_fit`` (per ratio, Table 1's
    Attention Score mean KL over Select+Fit's), ``main`` (Table 1's mean KL per method and ratio), ``paper_over_ours``
    (the paper's Table 1 over ours, per method at r = 0.3), ``gemma`` (the second model at r = 0.3: mean KL per
    method, windows) and ``appendix`` (the appendix chapter's 20-window means, per method and ratio)."""
    from zipkv.study.chapters.beyond import with_extra_rows
    from zipkv.study.experiments.kl_sources import per_layer

    results = Path(results)
    read = lambda stem: pd.read_csv(results / f"{stem}.csv")                                  # noqa: E731
    sources, held = read("kvsculpt_kl_sources"), read("kvsculpt_kl_sources_heldout")
    held = held.pivot_table(index="layer", columns="method", values="heldout")
    main = read("kvsculpt_main").groupby(["method", "ratio"]).kl.mean().unstack()
    beyond, _ = with_extra_rows(read("kvsculpt_beyond"), results / "kvsculpt_beyond_extra.csv")
    beyond = beyond.groupby(["method", "ratio"]).kl.mean().unstack()
    gemma = read("kvsculpt_beyond_gemma")
    gemma = gemma[gemma.ratio == 0.3]
    at = 0.3
    return {
        "train_ratio": float(per_layer(sources).objective_ratio.median()),
        "heldout_ratio": float((held.kvsculpt / held.select_fit).median()),
        "dense_gain": (beyond.loc["select_fit"] / beyond.loc["select_fit_dense"]).to_dict(),
        "score_over_fit": (main.loc["attention_score"] / main.loc["select_fit"]).to_dict(),
        "main": main,
        "paper_over_ours": {m: pv.KVSCULPT_TABLE1[m][at] / main.loc[m, at] for m in main.index
                            if at in pv.KVSCULPT_TABLE1.get(m, {})},
        "gemma": gemma.groupby("method").kl.mean().to_dict() | {"windows": int(gemma.window.nunique()),
                                                                 "model": str(gemma.model.iloc[0])},
        "appendix": read("kvsculpt_appendix").groupby(["method", "ratio"]).kl.mean().unstack(),
    }
