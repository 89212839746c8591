"""Chapters "Distillation in seconds" and "Do the two solvers agree?": the batched solver's seconds
per context against the one-at-a-time reference and the paper's 170 s, and its quality against the
reference's, as tables, figures (log axes) and verdicts."""
from __future__ import annotations

import numpy as np
import pandas as pd

from zipkv.study import paper_values as pv
from zipkv.study import report
from zipkv.study.findings import verdict_for
from zipkv.study.settings import KVSCULPT_PAPER, PROJECT_TARGETS


def _qwen(timings: pd.DataFrame, solver: str, ctx: int) -> pd.DataFrame:
    return timings[timings.problem_shape.str.startswith("Qwen") & (timings.solver == solver) & (timings.ctx == ctx)
                   & (timings.ratio == 0.3)]


def speed_verdict(timings: pd.DataFrame, qwen_context: int, at_paper_setting: bool) -> tuple[str, str]:
    """The speed chapter's verdict and kind from its ``timings``: the batched solver's seconds at the Qwen2.5-1.5B
    shape (``qwen_context`` tokens) against the paper's, and the paper's claim judged by the one-at-a-time reference
    as the findings page judges it; a note where the run is not the paper's setting."""
    point = _qwen(timings, "batched", qwen_context)
    if not len(point):
        return "The Qwen2.5-1.5B-shaped context was not timed in this run.", "note"
    s = float(point.seconds.iloc[0])
    paper = pv.KVSCULPT_SECONDS_PER_CONTEXT
    if not at_paper_setting:
        return (f"The Qwen2.5-1.5B-shaped context takes {s:.2f} s at N = {qwen_context}: not the paper's setting, so not "
                f"comparable with its {paper:.0f} s (run the paper profile).", "note")
    goal = PROJECT_TARGETS.distill_seconds_per_context
    text = (f"The batched solver (this project's, beyond the paper) compresses a Qwen2.5-1.5B-shaped 2048-token context "
            f"(r = 0.3, 100 steps) in **{s:.1f} s**, {paper / s:.0f}× less than the paper's {paper:.0f} s on an A100; "
            f"this project's own target, ≤ {goal:g} s, is {'met' if s <= goal else 'missed'}. ")
    ref = _qwen(timings, "reference", qwen_context)
    if not len(ref):
        return text + "The one-problem-at-a-time reference was not timed in this run.", "note"
    r = float(ref.seconds.iloc[0])
    judged = verdict_for("distill_speed", "seconds to compress", r)  # as the findings page judges it
    return (text + f"The paper's solver takes one problem at a time, as our reference does: that takes **{r:.0f} s** on "
            f"the device in the provenance box, so the paper's {paper:.0f} s is **{judged}** here.",
            "tip" if judged in ("reproduced", "exceeded") else "warning")


def speed_figure(timings: pd.DataFrame, embedded_name: str, ratio_sweep_context: int):
    """Left: seconds per context against context length (batched, both problem shapes; reference points).
    Right: batched seconds against the compression ratio at one context."""
    import matplotlib.pyplot as plt

    fast = timings[timings.solver == "batched"]
    emb = fast[fast.problem_shape.str.startswith(embedded_name)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    line = emb[emb.ratio == 0.3].sort_values("ctx")
    axes[0].plot(line.ctx, line.seconds, "-o", label="batched, embedded shape, r = 0.3")
    qwen = fast[fast.problem_shape.str.startswith("Qwen")]
    axes[0].scatter(qwen.ctx, qwen.seconds, marker="s", s=50, label="batched, Qwen2.5-1.5B shape")
    for shape_name, part in timings[timings.solver == "reference"].groupby("problem_shape"):
        axes[0].scatter(part.ctx, part.seconds, marker="x", s=60, label=f"reference, {shape_name}")
    axes[0].axhline(pv.KVSCULPT_SECONDS_PER_CONTEXT, color="grey", ls="--", lw=0.8,
                    label=f"paper: {pv.KVSCULPT_SECONDS_PER_CONTEXT:.0f} s (A100, N = {KVSCULPT_PAPER.context})")
    axes[0].set(xscale="log", yscale="log", xlabel="context length N (tokens)", ylabel="seconds per context")
    axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    sweep = emb[emb.ctx == ratio_sweep_context].sort_values("ratio")
    axes[1].plot(sweep.ratio, sweep.seconds, "-o")
    axes[1].set(xlabel=f"compression ratio r (N = {ratio_sweep_context}, embedded shape)",
                ylabel="seconds per context (batched)")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    return fig


def speed_table(timings: pd.DataFrame):
    """The timings, with the paper's seconds (§7: a 2048-token context of Qwen2.5-1.5B at r = 0.3, A100) beside the
    row it compares with."""
    table = timings[["problem_shape", "ctx", "ratio", "solver", "seconds", "speedup", "problems", "reference_problems"]]
    paper = table.problem_shape.str.startswith("Qwen") & (table.ctx == 2048) & (table.ratio == 0.3)
    table = table.assign(paper_seconds=[pv.KVSCULPT_SECONDS_PER_CONTEXT if p else None for p in paper])
    names = {"problem_shape": "problems of", "ctx": "context", "ratio": "r", "reference_problems": "problems timed (reference)",
             "paper_seconds": "paper: seconds"}
    return (table.rename(columns=names).style
            .format({"seconds": "{:.2f}", "speedup": "{:.1f}×", "r": "{:.1f}", "paper: seconds": "{:.0f}"}, na_rep="–")
            .hide(axis="index"))


def quality_summary(losses: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Batched against reference final loss on the problems the reference ran (a table and a sentence)."""
    ran = losses.dropna(subset=["reference"])
    summary = ran.groupby(["problem_shape", "ctx", "ratio"]).apply(
        lambda g: pd.Series({"problems": len(g), "median batched/reference loss": (g.batched / g.reference).median(),
                             "median reference/Select+Fit loss": (g.reference / g.select_fit).median()}),
        include_groups=False)
    median = float((ran.batched / ran.reference).median())
    goal = PROJECT_TARGETS.solver_loss_within
    return summary, (f"Median final-loss ratio batched / reference over the {len(ran)} problems the reference ran: "
                     f"{median:.3f} (this project's target: within {100 * goal:g} %, "
                     f"{'met' if abs(median - 1) <= goal else 'missed'}).")


def agreement_verdict(problems: pd.DataFrame, summary: pd.DataFrame | None) -> tuple[str, str]:
    """The solver-agreement chapter's verdict and kind: the batched solver's final loss over the reference's per
    problem against this project's target, and the KLs of both caches (``summary``) where measured."""
    ratio = problems.batched / problems.reference
    median = float(ratio.median())
    goal = PROJECT_TARGETS
    ok = abs(median - 1) <= goal.solver_loss_within
    text = (f"Over {len(problems)} problems the batched solver's final loss is a median **{median:.3f}×** the "
            f"reference's (quartiles {ratio.quantile(0.25):.2f}–{ratio.quantile(0.75):.2f}; lower on "
            f"{int((ratio < 1).sum())}); this project's target, within {100 * goal.solver_loss_within:g} %, is "
            f"{'met' if ok else 'missed'}.")
    if summary is not None:
        row = summary.set_index("solver")
        kl = float(row.loc["batched", "kl_ratio"])
        ok = ok and abs(kl - 1) <= goal.solver_kl_within
        text += (f" End-to-end KL: reference {row.loc['reference', 'kl']:.4g}, batched {row.loc['batched', 'kl']:.4g} "
                 f"({kl:.3f}×; target within {100 * goal.solver_kl_within:g} %: {'met' if abs(kl - 1) <= goal.solver_kl_within else 'missed'}).")
    return text, "tip" if ok else "warning"


def agreement_figure(problems: pd.DataFrame):
    """Left: per problem, batched against reference final loss. Right: the distributions of final loss."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    lo, hi = min(problems.reference.min(), problems.batched.min()), problems.select_fit.max()
    axes[0].loglog(problems.reference, problems.batched, "o", ms=3)
    axes[0].plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    axes[0].set(xlabel="reference solver: final loss", ylabel="batched solver: final loss")
    for name in ("select_fit", "reference", "batched"):
        values = np.sort(problems[name].to_numpy())
        axes[1].plot(values, np.arange(1, len(values) + 1) / len(values), label=name)
    axes[1].set(xscale="log", xlabel="final loss (objective on the training queries)", ylabel="fraction of problems")
    axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    return fig


COMPRESS_SIDE = "compress"
"""The side table of zipkv.compress's seconds per context at model shapes
(:func:`zipkv.bench.distill.compress_speed`), beside the chapter's main table."""

SHAPE_LABELS = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-1.5b": "Qwen2.5-1.5B", "llama3.1-8b": "Llama-3.1-8B"}


def compress_text(table: pd.DataFrame | None) -> str:
    """What ``zipkv.compress`` with its defaults costs per context, from :func:`zipkv.bench.distill.compress_speed`'s
    table: the largest context at the largest shape, against that model's own prefill of it, and what dominates."""
    if table is None or not len(table):
        return ("zipkv's own distiller (the library's default) has not been timed at the model shapes in the "
                "committed results.")
    ok = table[table.error.fillna("") == ""]
    if not len(ok):
        return f"No point of the timing at model shapes ran: {table.error.iloc[0]}."
    shapes = [s for s in SHAPE_LABELS if s in set(ok["shape"])]
    big = ok[ok["shape"] == shapes[-1]].sort_values("context").iloc[-1]
    phases = [c for c in ok.columns if c.endswith("_s") and c not in ("compress_s", "prefill_s")]
    slowest = max(phases, key=lambda c: big[c] if pd.notna(big[c]) else -1)
    device = str(ok.device.iloc[0])
    device = f"a CPU ({device[5:]})" if device.startswith("CPU: ") else f"an {device.split(' (')[0]}"
    text = (f"With every default (30 % of the pairs kept, a 64-token probe), the library's compression of a "
            f"{int(big.context):,}-token context at {SHAPE_LABELS[shapes[-1]]}'s shape takes **{big.compress_s:.1f} s** "
            f"on {device}, {big.compress_s / big.prefill_s:.0f}× the model's own prefill of that context "
            f"({big.prefill_s:.2f} s); its largest part is {slowest[:-2].replace('_', ' ')} "
            f"({big[slowest]:.1f} s).")
    if "commit" in ok:
        text += f" Measured at commit {ok.commit.iloc[0]}, {ok.date.iloc[0]}."
    failed = table[table.error.fillna("") != ""]
    if len(failed):
        text += " Not run: " + "; ".join(f"{SHAPE_LABELS.get(r['shape'], r['shape'])} at {int(r.context):,} tokens "
                                         f"({r.error.split(':')[0]})" for _, r in failed.iterrows()) + "."
    return text


def compress_figure(table: pd.DataFrame):
    """Seconds per context against context length, per model shape: zipkv.compress (solid) and the prefill (dashed)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ok = table[table.error.fillna("") == ""]
    for i, (shape, part) in enumerate(sorted(ok.groupby("shape"), key=lambda x: list(SHAPE_LABELS).index(x[0]))):
        part = part.sort_values("context")
        color = f"C{i}"
        ax.plot(part.context, part.compress_s, "-o", color=color, label=f"{SHAPE_LABELS[shape]}: compress")
        ax.plot(part.context, part.prefill_s, "--", color=color, label=f"{SHAPE_LABELS[shape]}: prefill")
    ax.set(xscale="log", yscale="log", xlabel="context length N (tokens)", ylabel="seconds per context")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def compress_table(table: pd.DataFrame):
    """The timing at model shapes: seconds by phase, peak memory, the prefill beside it."""
    phases = [c for c in table.columns if c.endswith("_s") and c not in ("compress_s", "prefill_s")]
    shown = table.assign(model=table["shape"].map(SHAPE_LABELS))
    columns = ["model", "context", "prefill_s", "compress_s", *phases] + (["peak_gib"] if "peak_gib" in table else [])
    names = {"prefill_s": "prefill (s)", "compress_s": "compress (s)", "peak_gib": "peak memory (GiB)",
             **{c: c[:-2].replace("_", " ") + " (s)" for c in phases}}
    return (shown[columns].rename(columns=names).style
            .format({names[c]: "{:.2f}" for c in columns if c in names}, na_rep="–").hide(axis="index"))


def show_quality(losses) -> None:
    """The solvers' final losses (:func:`quality_summary`) as a sentence and a table; without the per-problem losses
    (a page rendered from the committed table), where to find the comparison instead."""
    from IPython.display import display

    if losses is None:
        report.markdown("The per-problem losses are not part of the committed table, so this rendering does not "
                        "show them; the chapter \"Do the two solvers agree?\" compares the solvers on every problem "
                        "of a window.")
        return
    summary, sentence = quality_summary(losses)
    report.markdown(sentence)
    display(summary.rename_axis(index=["problems of", "context", "r"]))
