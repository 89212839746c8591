"""Chapter "zipkv among kvpress's presses": what the chapter shows from the KL table
(:func:`zipkv.study.experiments.kvpress_presses.measure_kl`) and the task table
(:func:`zipkv.study.experiments.kvpress_presses.measure_task`): the verdict, the headline figure (KL against the kept
fraction), the per-fraction comparison with the best press, seconds to compress, task accuracy.

Nothing here imports kvpress or torch: the chapter renders its committed tables in any environment.
"""
from __future__ import annotations

import math

import pandas as pd

from zipkv.study import paper_values as pv
from zipkv.study import report

PRESS_LABELS = {"kvzip": "KVzip", "expected_attention": "ExpectedAttention", "snapkv": "SnapKV", "tova": "TOVA",
                "keydiff": "KeyDiff", "compactor": "Compactor", "streaming_llm": "StreamingLLM", "knorm": "Knorm"}
ZIPKV_LABELS = {"zipkv": "zipkv's distiller", "zipkv_reconstruction": "zipkv's distiller, re-reading probe",
                "zipkv_press": "zipkv's distiller without bias (as a kvpress press)",
                "attention_matching": "Attention Matching", "kvsculpt": "KVSculpt",
                "select_fit": "Select+Fit (the paper's queries)", "select_fit_dense": "Select+Fit (N queries)",
                "best_select_fit": "best Select+Fit", "none": "uncompressed"}
MODEL_LABELS = {"gemma-3-270m-q4_k_m": "Gemma-3-270M", "gemma-3-270m": "Gemma-3-270M"}
KIND_LABELS = {"niah_single": "one needle", "niah_multikey": "one needle among four keys",
               "niah_multivalue": "four values of one key", "variable_tracking": "variable tracking"}
OURS = ("zipkv", "zipkv_reconstruction", "zipkv_press", "attention_matching", "kvsculpt", "select_fit",
        "select_fit_dense")
"""The methods written in zipkv (the rest of the table is kvpress's presses)."""
ATTENTION_MATCHING_MAX_COMPACTION = 50.0
"""Attention Matching (Zweiger, Fu, Guo & Kim 2026, arXiv 2602.16284), abstract: "achieving up to 50x compaction in
seconds on some datasets with little quality loss" (cited for context, not re-plotted)."""


def label(method: str) -> str:
    """A method's name for the page (AdaKV around a press: "AdaKV + <press>")."""
    if method.startswith("adakv_"):
        return "AdaKV + " + PRESS_LABELS.get(method[6:], method[6:])
    return PRESS_LABELS.get(method) or ZIPKV_LABELS.get(method, method)


def named(table: pd.DataFrame | None) -> pd.DataFrame | None:
    """``table`` with the page's model names (the embedded Gemma's file name becomes "Gemma-3-270M")."""
    if table is None or "model" not in table:
        return table
    return table.assign(model=table.model.map(lambda m: MODEL_LABELS.get(m, m)))


def is_press(method: str) -> bool:
    return method not in OURS and method not in ("best_select_fit", "none")


def stats(table: pd.DataFrame) -> pd.DataFrame:
    """Per model, kept fraction and method: mean KL (nats per token), windows, mean seconds to compress, the kept
    fraction measured; a ``best_select_fit`` row per (model, fraction): the Select+Fit variant with the lower mean."""
    ok = named(table).dropna(subset=["kl"])
    s = (ok.groupby(["model", "kept_fraction", "method"])
         .agg(mean_kl=("kl", "mean"), windows=("window", "nunique"), seconds=("seconds", "mean"),
              kept=("kept", "mean")).reset_index())
    sf = s[s.method.isin(["select_fit", "select_fit_dense"])]
    if len(sf):
        best = sf.loc[sf.groupby(["model", "kept_fraction"]).mean_kl.idxmin()].assign(method="best_select_fit")
        s = pd.concat([s, best], ignore_index=True)
    return s


def by_fraction(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and kept fraction: zipkv's mean KL, the best press (lowest mean KL among kvpress's presses, AdaKV
    included) and its KL, zipkv's ratio to it, and the closest rival among the other methods (zipkv's own no-bias
    variant aside), each compared with zipkv on the windows that method ran (``rival_kl`` its mean there,
    ``zipkv_there`` zipkv's), ``lowest`` whether zipkv is below every one of them, and the windows."""
    s = stats(table)
    per = named(table).dropna(subset=["kl"]).pivot_table(index=["model", "kept_fraction", "window"],
                                                          columns="method", values="kl")
    rows = []
    for (model, fraction), g in s.groupby(["model", "kept_fraction"]):
        g = g.set_index("method")
        presses = g[[is_press(m) for m in g.index]]
        if "zipkv" not in g.index or presses.empty:
            continue
        best = presses.mean_kl.idxmin()
        w = per.loc[(model, fraction)]
        matched = {m: (w.loc[w[m].notna() & w.zipkv.notna(), "zipkv"].mean(), w[m][w.zipkv.notna()].mean())
                   for m in g.index if m not in ("zipkv", "zipkv_press", "best_select_fit") and m in w}
        rival = min(matched, key=lambda m: matched[m][1] / matched[m][0])
        rows.append(dict(model=model, kept_fraction=fraction, zipkv=g.mean_kl["zipkv"], best_press=best,
                         best_press_kl=presses.mean_kl[best], ratio=g.mean_kl["zipkv"] / presses.mean_kl[best],
                         lowest_other=rival, zipkv_there=matched[rival][0], lowest_other_kl=matched[rival][1],
                         lowest=all(z < o for z, o in matched.values()), windows=int(g.windows["zipkv"])))
    return pd.DataFrame(rows)


def compact_table(table: pd.DataFrame) -> pd.DataFrame:
    """The page's table: per model and kept fraction (compression ×), mean KL of zipkv's distiller, the best press
    (named), Attention Matching, KVSculpt, the best Select+Fit, and zipkv's KL over the best press's."""
    s = stats(table).set_index(["model", "kept_fraction", "method"]).mean_kl
    out = []
    for r in by_fraction(table).itertuples():
        get = lambda m: s.get((r.model, r.kept_fraction, m), math.nan)  # noqa: E731
        out.append({"model": r.model, "kept": f"{r.kept_fraction:g} ({1 / r.kept_fraction:.3g}×)",
                    "zipkv's distiller": get("zipkv"), "best press": f"{label(r.best_press)} {r.best_press_kl:.3g}",
                    "Attention Matching": get("attention_matching"), "KVSculpt": get("kvsculpt"),
                    "best Select+Fit": get("best_select_fit"), "zipkv / best press": r.ratio, "windows": r.windows})
    return pd.DataFrame(out).set_index(["model", "kept"]).dropna(axis=1, how="all")


def every_method(table: pd.DataFrame) -> pd.DataFrame:
    """Every method's mean KL per model (rows) and kept fraction (columns), and its ratio to the best press."""
    s = stats(table)
    s = s[s.method != "best_select_fit"]
    best = by_fraction(table).set_index(["model", "kept_fraction"]).best_press_kl
    s["ratio"] = [r.mean_kl / best.get((r.model, r.kept_fraction), math.nan) for r in s.itertuples()]
    s["method"] = s.method.map(label)
    wide = s.pivot_table(index=["model", "method"], columns="kept_fraction", values=["mean_kl", "ratio"])
    wide.columns = [f"{'KL' if a == 'mean_kl' else 'over best press'} at {b:g}" for a, b in wide.columns]
    return wide.sort_values(["model", wide.columns[0]])


def seconds(table: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds to compress one context (prefill included for the presses), per method and model."""
    s = named(table).dropna(subset=["kl"]).groupby(["method", "model"]).seconds.mean().unstack("model")
    s.index = [label(m) for m in s.index]
    return s.sort_values(s.columns[0])


def task_table(task: pd.DataFrame | None) -> pd.DataFrame | None:
    """Accuracy per setting (model, task, context tokens) and method × kept fraction, with the prompts each
    measured; the uncompressed model first."""
    if task is None or task.empty:
        return None
    t = named(task)
    order = {m: i for i, m in enumerate(["none", "zipkv", "zipkv_reconstruction", *PRESS_LABELS])}
    t = t.assign(_order=t.method.map(lambda m: order.get(m, len(order)))).sort_values("_order")
    t["method"] = t.method.map(label)
    t["kept"] = ["all" if m == "uncompressed" else f"{f:g} ({1 / f:.3g}×)" for m, f in zip(t.method, t.kept_fraction)]
    agree = t["agreement"] if "agreement" in t else pd.Series(math.nan, index=t.index)
    t["accuracy"] = [f"{a:.0%} ({c:.0f}/{n})" if pd.notna(a) else f"{g:.0%} agree ({n})"
                     for a, c, n, g in zip(t.accuracy, t.correct, t.prompts, agree)]
    t["kind"] = t.kind.map(lambda k: KIND_LABELS.get(k, k))
    t = t.rename(columns={"kind": "task", "length": "context tokens"})
    wide = t.pivot_table(index=["model", "task", "context tokens", "method"], columns="kept", values="accuracy",
                         aggfunc="first", sort=False)
    columns = sorted(wide.columns, key=lambda c: (c != "all", -float(c.split()[0]) if c != "all" else 0))
    return wide[columns].fillna("")


def task_gaps(task: pd.DataFrame | None) -> pd.DataFrame | None:
    """Per setting and kept fraction where zipkv was measured: zipkv's accuracy, the best press's (the press
    answering most), and zipkv's minus the best press's, in points."""
    if task is None or task.empty:
        return None
    rows = []
    task = named(task)
    for (model, kind, length, fraction), g in task[task.method != "none"].groupby(["model", "kind", "length",
                                                                                    "kept_fraction"]):
        g = g[g.accuracy.notna()].set_index("method")        # settings below the gate: agreement, not accuracy
        presses = g[[is_press(m) for m in g.index]]
        if "zipkv" not in g.index or presses.empty:
            continue
        best = presses.accuracy.idxmax()
        rows.append(dict(model=model, kind=kind, length=length, kept_fraction=fraction,
                         zipkv=g.accuracy["zipkv"], zipkv_prompts=int(g.prompts["zipkv"]), best_press=best,
                         best_press_accuracy=presses.accuracy[best], press_prompts=int(presses.prompts[best]),
                         gap=100 * (g.accuracy["zipkv"] - presses.accuracy[best])))
    return pd.DataFrame(rows)


def setting_line(table: pd.DataFrame) -> str:
    """Windows × context (+ continuation) per model, and the probe's length."""
    parts = []
    for model, g in named(table).groupby("model", sort=False):
        parts.append(f"{model}: {g.window.nunique()} PG19 windows × {int(g.N.iloc[0])} context tokens "
                     f"+ {int(g.C.iloc[0])} teacher-forced")
    probe = f"; zipkv's and Attention Matching's probe samples {int(table.probe_tokens.iloc[0])} tokens" \
        if "probe_tokens" in table else ""
    slow = table[table.method == "kvsculpt"]
    slow_text = (f"; KVSculpt (100 L-BFGS steps) on {slow.window.nunique()} window(s) per model, the rest on all"
                 if len(slow) and slow.window.nunique() < table.window.nunique() else "")
    if not len(slow):
        slow_text = ("; KVSculpt not run here (its 100 L-BFGS steps per layer take minutes per context on this CPU; "
                     "the chapter \"Beyond the paper\" sets it beside zipkv's distiller)")
    return "; ".join(parts) + probe + slow_text + "."


def verdict(table: pd.DataFrame, task: pd.DataFrame | None = None) -> tuple[str, str]:
    """``(text, admonition kind)``: is zipkv's distiller below the best press at every kept fraction ≤ 0.5 on every
    model, by how much, and on the task at 4× and 8×."""
    f = by_fraction(table)
    f = f[f.kept_fraction <= 0.5]
    if f.empty:
        return "No kept fraction of at most one half was measured with both zipkv's distiller and a press.", "warning"
    models = list(dict.fromkeys(f.model))
    lowest_all = bool(f.lowest.all())
    below_press = bool((f.ratio < 1).all())
    windows = f.windows.min()
    parts = []
    for model in models:
        g = f[f.model == model]
        low, high = f"{g.ratio.min():.2g}", f"{g.ratio.max():.2g}"
        parts.append(f"{model} {low}×" if low == high else f"{model} {low}–{high}×")
    span = (f" from {f.kept_fraction.max():g} to {f.kept_fraction.min():g}" if f.kept_fraction.nunique() > 1 else
            f" (kept {f.kept_fraction.iloc[0]:g})")
    text = (f"On {'both models' if len(models) == 2 else ', '.join(models)}, zipkv's distiller "
            + ("has the lowest mean KL of every other method at every kept fraction" if lowest_all else
               "is below the best kvpress press at every kept fraction" if below_press else
               "is not below the best kvpress press at every kept fraction")
            + span
            + f": its KL is {', '.join(parts)} the best press's (ratio of means; "
            + f"{'at least ' if f.windows.nunique() > 1 else ''}{report.count(windows, 'window')} per model). ")
    if not lowest_all:
        lost = f[~f.lowest]
        lost = lost.assign(share=lost.lowest_other_kl / lost.zipkv_there)
        text += "Lower on the same windows: " + "; ".join(
            f"{label(rival)} on {model} at kept {', '.join(f'{x:g}' for x in g.kept_fraction)} "
            f"({g.share.min():.2f}–{g.share.max():.2f}× zipkv's KL)".replace(
                f"({g.share.min():.2f}–{g.share.min():.2f}×", f"({g.share.min():.2f}×")
            for (model, rival), g in lost.groupby(["model", "lowest_other"], sort=False)) + ". "
    if windows < 20:
        text += f"Fewer than the 20 windows aimed at: a CPU run. "
    gaps = task_gaps(task)
    if gaps is not None and len(gaps):
        text += "Retrieval task (" + "; ".join(
            f"{model}, {g.length.iloc[0]} tokens) at kept " + " and ".join(f"{x:g}" for x in g.kept_fraction)
            + ": zipkv's distiller answers " + " and ".join(f"{x:.0%}" for x in g.zipkv)
            + f" ({g.zipkv_prompts.min()} prompts), the best press " + " and ".join(
                f"{x:.0%} ({label(b)})" for x, b in zip(g.best_press_accuracy, g.best_press))
            + f" ({g.press_prompts.min()} prompts)"
            for model, g in gaps.sort_values("kept_fraction", ascending=False).groupby("model", sort=False)) + "."
        if (gaps.gap < 0).any():
            low, high = f"{-gaps.gap.max():.0f}", f"{-gaps.gap.min():.0f}"
            text += (f" It misses the best press by {low if low == high else low + '–' + high} points; the section "
                     "on answers below shows where its answers go wrong.")
        rereading = task[task.method == "zipkv_reconstruction"].sort_values("kept_fraction", ascending=False)
        if len(rereading):
            held = held_out(rereading)
            text += (" Fitted instead on queries that re-read the context, the setting meant for questions about it, "
                     "it answers " + " and ".join(f"{r.accuracy:.0%} at kept {r.kept_fraction:g}"
                                                 for r in rereading.itertuples())
                     + f" ({rereading.prompts.min()} prompts{', held out' if held else ''}).")
    elif task is not None and len(task):
        text += "On the retrieval task no setting passed the uncompressed model's 80 % gate with zipkv measured."
    else:
        text += "The retrieval task was not run here."
    kind = "tip" if lowest_all and (gaps is None or len(gaps) == 0 or (gaps.gap >= 0).all()) else "warning"
    return text, kind


def figure(table: pd.DataFrame):
    """Mean KL against the kept fraction, one panel per model, log-log: every kvpress press (grey), the best press
    per fraction (black), zipkv's distiller, Attention Matching, KVSculpt, the best Select+Fit."""
    import matplotlib.pyplot as plt

    s = stats(table)
    models = list(dict.fromkeys(s.model))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), sharey=True, squeeze=False)
    styles = {"zipkv": ("C0", "o", 2.5), "attention_matching": ("C1", "s", 1.4), "kvsculpt": ("C2", "^", 1.4),
              "best_select_fit": ("C4", "v", 1.4)}
    for ax, model in zip(axes[0], models):
        g = s[s.model == model]
        for method, m in g[[is_press(x) for x in g.method]].groupby("method"):
            ax.plot(m.kept_fraction, m.mean_kl, color="0.8", lw=0.8, zorder=1)
        best = by_fraction(table)
        best = best[best.model == model].sort_values("kept_fraction")
        ax.plot(best.kept_fraction, best.best_press_kl, "k--", marker="x", lw=1.4, label="best kvpress press")
        for method, (color, marker, lw) in styles.items():
            m = g[g.method == method].sort_values("kept_fraction")
            if len(m):
                ax.plot(m.kept_fraction, m.mean_kl, color=color, marker=marker, lw=lw, ms=5, label=label(method))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(g.kept_fraction.unique()), [f"{x:g}" for x in sorted(g.kept_fraction.unique())])
        ax.minorticks_off()
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("fraction of the context's KV pairs kept (log scale)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("KL(full ‖ compressed), nats per token")
    axes[0][-1].plot([], [], color="0.8", label="each kvpress press")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def caption(table: pd.DataFrame) -> str:
    return ("Mean KL of the next-token distributions, full cache against compressed, over the teacher-forced "
            "continuation, against the fraction of the context's KV pairs kept (both axes log scale; left is more "
            "compression). Grey: each of kvpress's presses run by kvpress "
            f"{table.kvpress.dropna().iloc[0] if 'kvpress' in table and table.kvpress.notna().any() else ''}; "
            "dashed: the best of them at each fraction. " + setting_line(table))


def cited() -> str:
    """The papers' own reported numbers, for context (their models, contexts and metrics differ from ours)."""
    t1 = pv.KVSCULPT_TABLE1
    return (f"For context, not comparable point for point: the KVSculpt paper reports, on {pv.KVSCULPT_MODEL} with "
            f"2,048-token PG19 contexts, a mean KL of {t1['kvsculpt'][0.3]:.3g} for KVSculpt and "
            f"{t1['select_fit'][0.3]:.3g} for Select+Fit when 30 % of the pairs are kept (its Table 1). Attention "
            f"Matching's abstract reports up to {ATTENTION_MATCHING_MAX_COMPACTION:g}× compaction in seconds with "
            "little quality loss on some data sets, measured by downstream accuracy on its own long-context "
            "benchmarks. kvpress's public leaderboard scores its presses on RULER at 4,096 tokens with 8B models, "
            "far larger than the two models here.")


REREADING_CHOSEN_ON = 20
"""The re-reading setting (the probe and max-attention key selection, :func:`zipkv.pipeline.reconstruction_settings`)
was chosen on the task's first 20 seeded prompts; rows that start later (``first_prompt``) are held out."""


def held_out(rows: pd.DataFrame) -> bool:
    """Whether every one of the re-reading task ``rows`` starts after the prompts its setting was chosen on."""
    return "first_prompt" in rows and bool((rows.first_prompt.fillna(0) >= REREADING_CHOSEN_ON).all())


def task_text(task: pd.DataFrame | None) -> str:
    """The task section's sentences: the uncompressed model's accuracy per setting against the 80 % gate, then
    zipkv against the best press where both were measured."""
    if task is None or task.empty:
        return "The retrieval task was not run here."
    base = named(task)[task.method == "none"]
    scored = set() if "agreement" not in task else {
        (r.model, r.kind, r.length) for r in named(task)[task.agreement.notna()].itertuples()}
    text = "Uncompressed: " + "; ".join(
        f"{r.model}, {KIND_LABELS.get(r.kind, r.kind)} at {r.length} tokens, {r.accuracy:.0%} of {r.prompts} prompts"
        + ("" if r.accuracy >= 0.8 else " (below 80 %: scored by agreement instead)"
           if (r.model, r.kind, r.length) in scored else " (below 80 %: left out)")
        for r in base.itertuples()) + ". "
    gaps = task_gaps(task)
    if gaps is not None and len(gaps):
        text += " ".join(
            f"Kept {r.kept_fraction:g} ({1 / r.kept_fraction:.3g}×), {r.model}: zipkv's distiller answers "
            f"{r.zipkv:.0%} of {r.zipkv_prompts} prompts, the best press ({label(r.best_press)}) "
            f"{r.best_press_accuracy:.0%} of {r.press_prompts}; "
            + (f"{r.gap:+.0f} points." if r.gap else "the same.") for r in gaps.itertuples())
        fewer = gaps[gaps.zipkv_prompts < gaps.press_prompts]
        if len(fewer):
            text += (" zipkv's distiller answered fewer prompts than the presses: each of its compressions costs "
                     "tens of seconds on the CPU of this run (the first prompts of the same seeded set).")
    solved = task[task.accuracy.notna()]                 # agreement rows (below the gate) follow on their own
    rereading = named(solved)[solved.method == "zipkv_reconstruction"]
    if len(rereading):
        best = solved[solved.method.isin(PRESS_LABELS)]
        text += (" Fitted and budgeted instead on queries that re-read the context after a repeat instruction "
                 "(KVzip's probe, not the model's sampled continuation), keeping the old keys that some of those "
                 "queries attend most, the distiller answers " + "; ".join(
                     f"{int(r.correct)} of {r.prompts} at kept {r.kept_fraction:g} ({r.model}"
                     + (f"; the best press {best[best.kept_fraction == r.kept_fraction].accuracy.max():.0%})"
                        if (best.kept_fraction == r.kept_fraction).any() else ")")
                     for r in rereading.sort_values("kept_fraction", ascending=False).itertuples())
                 + ", at about " + f"{rereading.seconds.mean():.0f}" + " s a prompt on this CPU (the probe is the "
                 "whole context long). "
                 + (f"These prompts come after the first {REREADING_CHOSEN_ON} of the same seeded set, on which the "
                    "setting was chosen: a held-out measurement." if held_out(rereading) else
                    "This setting was first tried on some of these same prompts: not a held-out measurement."))
    return text + (" " + agreement_text(task) if agreement_text(task) else "")


def agreement_text(task: pd.DataFrame | None) -> str:
    """For each setting below the gate where methods were scored by greedy-token agreement: what that measures, and
    per kept fraction zipkv's distiller against the best press (the press agreeing longest)."""
    if task is None or "agreement" not in task or task.agreement.isna().all():
        return ""
    t = named(task)
    rows = t[t.agreement.notna()]
    parts = []
    for (model, kind, length), g in rows.groupby(["model", "kind", "length"], sort=False):
        base = t[(t.model == model) & (t.kind == kind) & (t.length == length) & (t.method == "none")]
        solved = f" ({base.accuracy.iloc[0]:.0%} of {int(base.prompts.iloc[0])} prompts uncompressed)" if len(base) else ""
        tokens = int(g.agreement_tokens.iloc[0])
        text = (f"{model} does not solve {KIND_LABELS.get(kind, kind)} at {length} tokens{solved}, so there each "
                f"method is scored by how much of the uncompressed model's greedy reply it reproduces: of the first "
                f"{tokens} reply tokens, the share equal before the first difference (mean over prompts). ")
        for fraction, f in g.groupby("kept_fraction", sort=False):
            f = f.set_index("method")
            presses = f[[is_press(m) for m in f.index]]
            shown = [f"{label(m)} {f.agreement[m]:.0%} ({int(f.prompts[m])} prompts)"
                     for m in ("zipkv", "zipkv_reconstruction") if m in f.index]
            if len(presses):
                best = presses.agreement.idxmax()
                shown.append(f"the best press ({label(best)}) {presses.agreement[best]:.0%} "
                             f"({int(presses.prompts[best])} prompts)")
            text += f"Kept {fraction:g} ({1 / fraction:.3g}×): " + ", ".join(shown) + ". "
        parts.append(text)
    return " ".join(parts)


def retention_text(retention: pd.DataFrame | None) -> str:
    """Why the answers differ, measured in the caches: per method and kept fraction, the median share of the model's
    KV heads that still hold each of the needle's digits and the median number of heads holding all of them (medians:
    a needle in the context's last tokens, which zipkv's distiller keeps verbatim, is held by every head)."""
    if retention is None or retention.empty:
        return ""
    r = named(retention)
    parts = []
    for fraction, g in r.groupby("kept_fraction", sort=False):
        per = g.groupby("method", sort=False).agg(digit=("digit_kept", "median"),
                                                  every=("heads_with_every_digit", "median"))
        parts.append(f"at kept {fraction:g}, " + ", ".join(
            f"{label(m)} {x.digit:.0%} ({x.every:g} with every digit)" for m, x in per.iterrows()))
    x = r.iloc[0]
    verbatim = r[(r.method == "zipkv") & (r.digit_kept >= 1)].prompt.nunique()
    return (f"Why, measured in the caches themselves ({r.prompt.nunique()} prompts, {x.model}, {int(x.heads)} KV "
            f"heads, a {int(x.digits)}-digit number one token a digit): the median share of heads that still hold "
            "each digit after compression, and of heads holding all of them, " + "; ".join(parts) + "."
            + (f" In {verbatim} of the prompts the number lay in the context's last tokens, which zipkv's distiller "
               "keeps verbatim in every head." if verbatim else "")
            + " zipkv's distiller keeps the pairs its training queries attend to, and neither the context's own "
            "queries nor the model's sampled continuation look at a number nobody has asked about; KVzip's "
            "re-reading queries look at every token once.")


def bias_text(table: pd.DataFrame) -> str:
    """What dropping the bias costs: zipkv's KL without it over its KL with it, per model, on the windows both ran."""
    both = named(table).dropna(subset=["kl"]).pivot_table(index=["model", "window", "kept_fraction"], columns="method",
                                                   values="kl")
    if not {"zipkv", "zipkv_press"} <= set(both.columns):
        return "The variant without the bias was not run here."
    both = both.dropna(subset=["zipkv", "zipkv_press"])
    parts = []
    for model, g in both.groupby(level="model", sort=False):
        ratio = g.groupby(level="kept_fraction").zipkv_press.mean() / g.groupby(level="kept_fraction").zipkv.mean()
        parts.append(f"{model}: " + ", ".join(f"{ratio[f]:.2f}× at {f:g}" for f in ratio.index)
                     + f" ({g.index.get_level_values('window').nunique()} window(s))")
    return ("Without the bias, the distiller's mean KL over its mean KL with it: " + "; ".join(parts) + ". Above 1 "
            "the bias helps; the press still keeps the distiller's choice of pairs and its refitted values.")


def replies_text(replies: pd.DataFrame | None) -> str:
    """Where wrong answers go wrong: per method, the share of prompts answered right and the mean number of leading
    digits of the expected number that the reply's first number gets right, with one example of zipkv's."""
    if replies is None or replies.empty:
        return ""
    r = named(replies)
    digits = int(r.expected.astype(str).str.len().median())
    parts = [f"{label(m)} {g.leading_digits.mean():.1f} of {digits} digits right on average, "
             f"{(g.leading_digits == g.expected.astype(str).str.len()).sum()} of {len(g)} numbers whole"
             for m, g in r.groupby("method", sort=False)]
    text = (f"Where the answers go wrong, on the first {r.prompt.nunique()} prompts at kept "
            f"{r.kept_fraction.iloc[0]:g} ({r.model.iloc[0]}): " + "; ".join(parts) + ".")
    wrong = r[(r.method == "zipkv") & (r.leading_digits > 0) & (r.number.astype(str) != r.expected.astype(str))]
    if len(wrong):
        x = wrong.iloc[0]
        text += (f" zipkv's distiller answers, for instance, {x.number} for {x.expected}: the number's first digits "
                 "survive the compression and the rest is lost.")
    return text
