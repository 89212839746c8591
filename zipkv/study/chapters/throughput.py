"""Chapter "Decode throughput under a memory budget" (ZipFusion Fig. 5, §IV-C): the verdict against the bars, the
figure beside the paper's bars, what the bars would need, the power draw, where a decode step goes, the memory
timeline and the end-to-end paragraph, computed from the rows of :func:`zipkv.study.experiments.throughput.figure5`."""
from __future__ import annotations

import json
import math
import statistics

from zipkv import format as fmt
from zipkv.study.settings import (PAPER_CARD, PROJECT_TARGETS, THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL)
from zipkv.study.experiments.throughput import LLAMA_8B, REPEATED, RESTORE


STEP_PARTS = {"attention_ms": "attention kernels", "gemm_ms": "matrix products", "restore_ms": "restore kernels",
              "kv_write_ms": "KV writes", "other_ms": "other kernels", "host_ms": "host not hidden (step minus replay)"}
"""The parts of a decode step in :func:`step_table` (GPU kernel time by kind, then the host's share; the
table adds ``gaps_ms``, the GPU's idle time between kernels of the replayed graph)."""


def step_table(big, profile_csv=None):
    """``(table, note)``: where each Llama-8B-shape decode step goes (ms per step by :data:`STEP_PARTS`, the
    attention kernels' microseconds per request and layer) from ``big``'s profiled rows, else -- a run without
    ``profile`` -- from the separate run ``profile_csv`` (note says which)."""
    from pathlib import Path

    import pandas as pd
    src, note = big, ""
    if "replay_ms" not in big.columns or big.replay_ms.isna().all():
        if profile_csv is None or not Path(profile_csv).exists():
            return pd.DataFrame(), "No decode-step breakdown: this run was not profiled and no profile CSV is committed."
        src = pd.read_csv(profile_csv)
        r = src.iloc[0]
        note = (f"Step breakdown from a separate, shorter run (`{profile_csv}`: {r.device}, commit {r.commit}, {r.date}; "
                f"{int(r.timed_steps)} timed steps per row): its step times differ a little from the table's.")
    layers = LLAMA_8B["num_hidden_layers"]
    cols = ["method", "batch", "step_ms", "replay_ms"] + [c for c in STEP_PARTS if c in src.columns]
    t = src[cols].copy()
    if "step_ms_each" in src.columns:                 # the decode steps after the warm-up: median and slowest
        each = [json.loads(x)[1:] for x in src.step_ms_each]
        t.insert(3, "step_ms_median", [statistics.median(e) for e in each])
        t.insert(4, "step_ms_max", [max(e) for e in each])
        t.insert(5, "slowest_step", [1 + max(range(len(e)), key=e.__getitem__) for e in each])
    kernels = [c for c in STEP_PARTS if c in t.columns and c != "host_ms"]
    t.insert(len(t.columns) - 1, "gaps_ms", t.replay_ms - t[kernels].sum(axis=1))   # GPU idle inside the graph
    extra = ["launch_ms", "num_splits", "stored_bits_per_value", "timed_steps"]   # launch, splits, bytes read
    for c in [c for c in src.columns if c.startswith("gap_before_")] + extra:      # where that idle time sits
        if c in src.columns:
            t[c] = src[c].values
    if "overlap" in src.columns:
        t["overlap"] = src.overlap.astype(bool).values
    t["attention_us_per_request_layer"] = 1e3 * t.attention_ms / (t.batch * layers)
    return t.reset_index(drop=True), note


def overlapped_rows(steps):
    """The rows of :func:`step_table` that ran with the engine's default scheduler (``overlap=True``; a table without
    the column is one scheduler's: all its rows)."""
    return steps[steps.overlap] if "overlap" in steps.columns else steps


def step_row(steps, method: str, largest: bool = True):
    """``method``'s row of :func:`step_table` rows ``steps`` at its largest batch (else its smallest)."""
    rows = steps[steps.method == method].sort_values("batch")
    return rows.iloc[-1 if largest else 0]


def _trend(u_from: float, u_to: float, z_from: float, z_to: float) -> str:
    """How a cost moves from the fixed batch to the largest, for both methods: grows, shrinks or (mixed) changes."""
    if u_to > u_from and z_to > z_from:
        return "grows"
    if u_to < u_from and z_to < z_from:
        return "shrinks"
    if u_to == u_from and z_to == z_from:
        return "stays"
    return "changes"


def _moves(ratio: float) -> str:
    """A ratio of a later cost over an earlier one, in words: "grows 1.10×", "shrinks to 0.97×", "stays (1.00×)"."""
    return f"grows {ratio:.2f}×" if ratio >= 1.005 else f"shrinks to {ratio:.2f}×" if ratio <= 0.995 else \
        f"stays ({ratio:.2f}×)"


def step_text(steps, context: int = 8192) -> str:
    """Why the tokens/s ratio at the largest batches is what it is, from :func:`step_table`'s rows (``context``:
    tokens per request before the first decode step)."""
    both = steps
    steps = overlapped_rows(steps)
    u, z = step_row(steps, "uncompressed"), step_row(steps, "zipfusion")
    u32, z32 = step_row(steps, "uncompressed", largest=False), step_row(steps, "zipfusion", largest=False)
    rest = lambda r: r.step_ms - r.attention_ms                                               # noqa: E731
    per = lambda r: r.attention_us_per_request_layer                                          # noqa: E731
    host = lambda r: max(r.host_ms, 0.0)          # a step shorter than its graph's replay: no host time shows  # noqa: E731
    return (f"At the largest batches ({u.batch} uncompressed, {z.batch} ZipFusion) the attention kernels take "
            f"{per(u):.2f} vs {per(z):.2f} µs per request and layer ({per(u) / per(z):.2f}×), while the rest of the step -- "
            f"matrix products {z.gemm_ms:.1f} ms, other kernels {z.other_ms + z.kv_write_ms:.1f} ms, the GPU idle between "
            f"kernels {z.gaps_ms:.1f} ms, "
            + (f"host {z.host_ms:.1f} ms" if z.host_ms > 0 else "the host's work hidden behind the GPU's")
            + f" for ZipFusion, {rest(z):.1f} ms in all; {rest(u):.1f} ms for uncompressed -- is paid once per step by every "
            "method. "
            f"Tokens/s at the largest batches is the batch ratio times the step-time ratio: {z.batch / u.batch:.3f} × "
            f"{u.step_ms:.1f}/{z.step_ms:.1f} = {z.batch / u.batch * u.step_ms / z.step_ms:.3f}×, so above the batch ratio "
            "only if ZipFusion's larger batch takes a shorter step.\n\nAt batch "
            f"{u32.batch} the attention kernels take {per(u32):.2f} (uncompressed) and {per(z32):.2f} µs (ZipFusion) per request "
            f"and layer: from batch {u32.batch} to {u.batch} the uncompressed kernel's per-request time "
            f"{_moves(per(u) / per(u32))}, and ZipFusion's from {z32.batch} to {z.batch} {_moves(per(z) / per(z32))}. "
            + (f"Outside the kernels, the host's time beyond the graph's replay (0 where hidden) "
               f"{_trend(host(u32), host(u), host(z32), host(z))} with the batch ({host(u32):.1f} → {host(u):.1f} ms "
               f"uncompressed, {host(z32):.1f} → {host(z):.1f} ms ZipFusion), and "
               if max(r.host_ms for r in (u, z, u32, z32)) > 0 else
               "The host's work is hidden (a mean step is no longer than a timed replay of its graph); outside the "
               "kernels, ")
            + f"the GPU's idle time between the graph's kernels {_trend(u32.gaps_ms, u.gaps_ms, z32.gaps_ms, z.gaps_ms)} "
            f"with the batch (replay minus kernel time: {u32.gaps_ms:.2f} → {u.gaps_ms:.2f} ms uncompressed, "
            f"{z32.gaps_ms:.2f} → {z.gaps_ms:.2f} ms ZipFusion)."
            + ("\n\n" + _read_rates(u, z, context).lstrip() if "stored_bits_per_value" in steps else "")
            + (_slow_steps(u, context) if "step_ms_median" in steps else "")
            + (_gap_places(u, z) if "gap_before_attention_ms" in steps else "")
            + (_sequential(u, z, both[~both.overlap]) if "overlap" in both and (~both.overlap).any() else ""))


def _sequential(u, z, seq) -> str:
    """What the overlapped steps save: the largest-batch rows ``u``, ``z`` beside the same methods' largest-batch rows
    run with ``overlap=False`` (``seq``)."""
    su, sz = step_row(seq, "uncompressed"), step_row(seq, "zipfusion")
    return (f" Without the overlapped steps (the host prepares and launches each step after reading "
            f"the last one's tokens) the largest-batch step takes {su.step_ms:.1f} ms uncompressed and {sz.step_ms:.1f} ms "
            f"ZipFusion ({sz.batch / su.batch * su.step_ms / sz.step_ms:.3f}× tokens/s), against {u.step_ms:.1f} and "
            f"{z.step_ms:.1f} ms with them ({z.batch / u.batch * u.step_ms / z.step_ms:.3f}×).")


def _read_rates(u, z, context: int) -> str:
    """How fast each largest-batch row's attention reads its KV: bytes per request and layer at the profiled replay
    (the step graph after the timed steps: ``context`` + ``timed_steps`` + 1 cached tokens; ZipFusion's first
    ``context`` of them -- the packed prefix and the prompt token -- stored at ``stored_bits_per_value``, the
    decoded ones raw) over the attention time."""
    token_bytes = 2 * LLAMA_8B["num_key_value_heads"] * LLAMA_8B["head_dim"] * 2            # K and V, bf16
    bu = (context + u.timed_steps + 1) * token_bytes
    bz = (context * z.stored_bits_per_value / 16 + z.timed_steps + 1) * token_bytes
    tu, tz = u.attention_us_per_request_layer, z.attention_us_per_request_layer
    return (f" Per request and layer the uncompressed kernel reads {bu / 1e6:.1f} MB at {bu / tu / 1e6:.2f} TB/s and "
            f"ZipFusion's {bz / 1e6:.1f} MB at {bz / tz / 1e6:.2f} TB/s: the fused kernel reads {1 - bz / bu:.0%} fewer "
            f"bytes in {tz / tu:.0%} of the raw kernel's time (\"Decode attention latency\" times it on this mix of "
            "compressed and raw blocks).")


def _gap_places(u, z) -> str:
    """Which kernels the GPU waits before, from two profiled rows' ``gap_before_<kind>_ms`` (the profiled replays'
    gaps between kernels), and how much of the row's ``gaps_ms`` (timed replay minus kernel time) they account for."""
    gaps = {r.method: {c[len("gap_before_"):-3].replace("_", " "): r[c] for c in r.index
                       if str(c).startswith("gap_before_")} for r in (u, z)}

    def parts(r):
        top = sorted(gaps[r.method].items(), key=lambda kv: -kv[1])[:2]
        return (", ".join(f"{ms:.2f} ms before {kind} kernels" for kind, ms in top)
                + f" ({sum(gaps[r.method].values()):.2f} ms between kernels in all)")
    unexplained = "; ".join(f"{r.method} {r.gaps_ms - sum(gaps[r.method].values()):.2f} ms" for r in (u, z)
                            if r.gaps_ms - sum(gaps[r.method].values()) > 0.1)
    launch = ("" if "launch_ms" not in u.index else
              f"; the host takes {u.launch_ms:.2f} ms (uncompressed) and {z.launch_ms:.2f} ms (ZipFusion) to launch each "
              "timed replay (`CUDAGraph.replay()` returning), time inside it in which the graph's first kernel cannot "
              "have started yet")
    return (f" Where the idle time sits (the kernel the GPU waits before, in the profiled replays): uncompressed at batch "
            f"{u.batch} {parts(u)}; ZipFusion at batch {z.batch} {parts(z)}."
            + (f" The timed replays take longer than the profiled kernels and the gaps between them ({unexplained})"
               + (launch or ": time this breakdown does not place") + "." if unexplained else ""))


def _slow_steps(r, context: int) -> str:
    """One sentence on a profiled row's slowest decode step against its median step (``context``: tokens cached
    before the first decode step, so that step ``s`` writes token ``context + s``)."""
    at = int(r.slowest_step)
    why = (f", one of the steps where every request's new token opens a page: token {context + at} = "
           f"{(context + at) // fmt.PAGE_TOKENS} × {fmt.PAGE_TOKENS}" if (context + at) % fmt.PAGE_TOKENS == 0 else "")
    return (f" The mean step hides slow ones: {r.method} at batch {r.batch} has a median step of {r.step_ms_median:.1f} ms "
            f"and a slowest of {r.step_ms_max:.1f} ms (decode step {at}{why}).")


def step_section(big, profile_csv=None, context: int = 8192) -> list:
    """The chapter's "where a decode step goes" displayables: a paragraph (:func:`step_text`, the source) and the
    :func:`step_table`; one line saying why there is none when neither ``big`` nor ``profile_csv`` has a breakdown."""
    from IPython.display import Markdown
    steps, note = step_table(big, profile_csv)
    if steps.empty:
        return [Markdown(note)]
    return [Markdown(f"**Where a decode step goes.** {step_text(steps, context)} {note}"), readable_steps(steps)]


def readable_steps(steps):
    """:func:`step_table` as a reader reads it (a pandas Styler): methods by name, columns in words, ms and µs."""
    names = {"method": "method", "batch": "batch", "step_ms": "step (ms)", "step_ms_median": "median step (ms)",
             "step_ms_max": "slowest step (ms)", "slowest_step": "slowest step (#)", "replay_ms": "graph replay (ms)",
             **{k: f"{v} (ms)" for k, v in STEP_PARTS.items()}, "gaps_ms": "GPU idle between kernels (ms)",
             "launch_ms": "launch (ms)", "num_splits": "splits", "stored_bits_per_value": "bits per value",
             "timed_steps": "timed steps", "overlap": "overlapped",
             "attention_us_per_request_layer": "attention per request and layer (µs)"}
    t = steps[[c for c in steps.columns if c in names]].rename(columns=names)
    t["method"] = t["method"].map(lambda m: METHOD_LABELS.get(m, m))
    return t.style.format(precision=2, na_rep="–").hide(axis="index")


def plot_throughput(df, paper: dict, fixed_batch: int = 32):
    """Fig. 5 beside the paper: tokens/s per method at the fixed batch and at each method's largest batch
    (``df``: the chapter's table for one model), paper's bars hatched. Returns the figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, (title, rows) in zip(axes, (("fixed batch", df[df.batch == fixed_batch].drop_duplicates("method")),
                                        ("largest batch under the budget", df[df.batch == df.max_batch].drop_duplicates("method")))):
        methods = list(rows.method)
        x = range(len(methods))
        spread = None
        if "tokens_per_s_runs" in rows.columns and rows.tokens_per_s_runs.notna().any():   # repeated runs: min-max
            runs = [json.loads(r) if isinstance(r, str) else [t] for r, t in zip(rows.tokens_per_s_runs, rows.tokens_per_s)]
            spread = [[t - min(r) for r, t in zip(runs, rows.tokens_per_s)],
                      [max(r) - t for r, t in zip(runs, rows.tokens_per_s)]]
        ax.bar([i - 0.2 for i in x], rows.tokens_per_s, 0.4, yerr=spread, capsize=3, label="ours (H200)")
        ref = [paper.get((title.split()[0], m), float("nan")) for m in methods]
        ax.bar([i + 0.2 for i in x], ref, 0.4, hatch="//", alpha=0.6, label="paper (H100)")
        ax.set_xticks(list(x), [f"{m}\nbatch {b}" for m, b in zip(methods, rows.batch)])
        ax.set_ylabel("decode tokens/s")
        ax.set_title(title)
    from zipkv.study import paper_values as pv
    mb = pv.ZIPFUSION_MAX_BATCH['Llama-3.1-8B']
    axes[1].text(0.02, 0.97, f"paper (H100, SGLang): largest batch {mb['uncompressed']} → {mb['zipfusion']},\n"
                 f"tokens/s +{pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH['Llama-3.1-8B']:.1%} (no absolute tokens/s printed)",
                 transform=axes[1].transAxes, va="top", fontsize=8)
    axes[1].set_ylim(0, axes[1].get_ylim()[1] * 1.2)
    axes[0].legend()
    fig.tight_layout()
    return fig


def plot_memory_timeline(stats):
    """Pages and chunks over a real run (``stats`` of :meth:`zipkv.engine.Engine.generate`): KV bytes in
    use per layer (first and last layer, and the range over all layers), running requests, free chunks
    and chunks reassigned between layers, per decode step."""
    import matplotlib.pyplot as plt
    import numpy as np
    steps = stats["steps"]
    used = np.array([s["used_bytes"] for s in steps]) / 2**20                 # [steps, layers] MiB
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.4))
    t = np.arange(len(steps))
    ax.fill_between(t, used.min(1), used.max(1), alpha=0.25, label="range over layers")
    for l in (0, used.shape[1] - 1):
        ax.plot(t, used[:, l], label=f"layer {l}")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV bytes in use (MiB)")
    ax.legend()
    bx.plot(t, [s["batch"] for s in steps], label="running requests")
    bx.plot(t, [s["chunks_free"] for s in steps], label="free chunks")
    bx.plot(t, [s["reassigned"] for s in steps], label="chunks reassigned (cumulative)")
    bx.set_xlabel("decode step")
    bx.set_ylabel("count")
    bx.legend()
    fig.tight_layout()
    return fig


BARS = dict(max_batch=PROJECT_TARGETS.max_batch_vs_uncompressed, tokens_per_s=PROJECT_TARGETS.tokens_per_s_vs_uncompressed,
            vs_restore=PROJECT_TARGETS.tokens_per_s_vs_best_restore)
"""This project's bars for the chapter (issue 15, :data:`~zipkv.study.settings.PROJECT_TARGETS`), on the H200: ZipFusion's
largest batch and its decode tokens/s at that batch over uncompressed's, and over the best restore baseline's --
targets set here, not the paper's claims (the paper reports 57/46 = 1.24x, +26.3 %, 2.76x)."""


def paper_rows(table, committed_csv=None, model: str = THROUGHPUT_PAPER_MODEL):
    """``(rows, note)``: the Fig. 5-setting rows of ``table`` (``model``: :data:`~zipkv.study.settings.THROUGHPUT_PAPER_MODEL`,
    :data:`~zipkv.study.settings.THROUGHPUT_UNFUSED_MODEL` for the runs with the modules' step kernels, or
    :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL`), else -- a run
    without them, e.g. the CPU profile -- those of the committed GPU table ``committed_csv``, with a note saying so."""
    from pathlib import Path

    import pandas as pd

    rows = table[table.model == model]
    if rows.empty and committed_csv is not None and Path(committed_csv).exists():
        committed = pd.read_csv(committed_csv)
        return (committed[committed.model == model],
                f"Llama-8B-shape rows: the committed GPU run (`{committed_csv}`).")
    return rows, ""


def setting_rows(table, committed_csv=None):
    """``(big, modules_rows, mma_rows, note)``: :func:`paper_rows` of the Fig. 5 setting, of its run with the
    modules' step kernels and of the uncompressed engine in the mma layouts (each falling back to the committed GPU
    table ``committed_csv``), and the note saying where the Fig. 5 rows come from."""
    big, note = paper_rows(table, committed_csv)
    modules_rows, _ = paper_rows(table, committed_csv, THROUGHPUT_UNFUSED_MODEL)
    mma_rows, _ = paper_rows(table, committed_csv, THROUGHPUT_MMA_BASELINE_MODEL)
    return big, modules_rows, mma_rows, note


def e2e_verdict(table, same: dict) -> str:
    """The verdict of a run without Llama-8B-shape rows run or committed: the end-to-end largest batches per method
    under one budget and how far each method's tokens agree with uncompressed's (:func:`agreement_text`)."""
    e2e = e2e_rows(table).set_index("method")
    return (f"No Llama-8B-shape GPU run here or committed. End to end on the CPU (embedded model, reference attention): "
            f"largest batch {e2e.batch['uncompressed']} (uncompressed) → {e2e.batch['zipfusion']} (ZipFusion), "
            f"{e2e.batch['splitzip']} (SplitZip), {e2e.batch['huffman']} (Huffman) under the same budget; "
            f"{agreement_text(same)}.")


def e2e_rows(table):
    """The end-to-end rows of the chapter's ``table``: the embedded model's, outside the Fig. 5 setting (none of
    :data:`~zipkv.study.settings.THROUGHPUT_PAPER_MODEL`, :data:`~zipkv.study.settings.THROUGHPUT_UNFUSED_MODEL`,
    :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL`)."""
    return table[~table.model.isin([THROUGHPUT_PAPER_MODEL, THROUGHPUT_UNFUSED_MODEL, THROUGHPUT_MMA_BASELINE_MODEL])]


def e2e_text(table, same: dict, *, requests: int, context: int, new_tokens: int) -> str:
    """The end-to-end paragraph: the embedded model's run (``table``'s rows outside the Fig. 5 setting) and how
    far each method's greedy tokens agree with uncompressed's (:func:`agreement_text`)."""
    e2e = e2e_rows(table)
    return (f"End to end ({e2e.model.iloc[0]}, {requests} PG19 windows of {context} tokens, {new_tokens} new tokens, "
            f"budget {e2e.kv_budget_bytes.iloc[0] / 2**20:.1f} MiB), {agreement_text(same)}. The stored KV is "
            "bit-exact for every method; on a GPU each method reads it through another attention kernel (another "
            "summation order), so near-ties in a bf16 model's logits may break differently. Through the same kernel "
            "and split count, ZipFusion's packed pages give the raw pages' attention output bit for bit, and the "
            "same tokens (\"The lossless format\").")


def e2e_speed_text(table, copy_tbps: float | None = None) -> str:
    """The end-to-end run's tokens/s per method beside uncompressed's (the embedded model's rows of ``table``), and
    what reading the whole KV budget once would take at ``copy_tbps`` (a copy bandwidth measured on the same GPU
    model) against the step."""
    e2e = e2e_rows(table).set_index("method")
    base = e2e.tokens_per_s["uncompressed"]
    parts = [f"{m} {e2e.tokens_per_s[m]:,.0f} ({e2e.tokens_per_s[m] / base:.2f}×)" for m in e2e.index if m != "uncompressed"]
    text = (f"Its decode tokens/s at batch {int(e2e.batch['uncompressed'])}: uncompressed {base:,.0f}, " + ", ".join(parts)
            + f"; a step takes {e2e.step_ms['uncompressed']:.2f} ms uncompressed.")
    if copy_tbps:
        read_us = e2e.kv_budget_bytes["uncompressed"] / (copy_tbps * 1e6)
        text += (f" Reading the whole KV budget ({e2e.kv_budget_bytes['uncompressed'] / 2**20:.1f} MiB) once takes about "
                 f"{read_us:.0f} µs at {copy_tbps:.2f} TB/s (the copy bandwidth measured in \"Decode attention latency\" "
                 f"at its {E2E_COPY_SHAPE} shape, median over its runs): "
                 f"{read_us / 10 / e2e.step_ms['uncompressed']:.1f} % of the step, so fewer bytes cannot speed this step up,"
                 " and each method's extra launches and fixed costs show instead (not broken down here).")
    return text + " This run checks the engine end to end and shows its memory; the Llama-3.1-8B-shape rows measure speed."


E2E_COPY_SHAPE = "smollm2-135m"
"""The latency chapter's shape whose copy bandwidth the end-to-end paragraph uses: the embedded model's, whose KV
sizes are nearest the end-to-end run's budget (the copy bandwidth depends on the bytes copied)."""


def measured_copy_bandwidth(latency_csv, shape: str = E2E_COPY_SHAPE) -> float | None:
    """Median copy bandwidth (TB/s) of the latency chapter's runs at ``shape`` (its ``copy_bw_tbps`` column), or
    None without it."""
    from pathlib import Path

    import pandas as pd

    if latency_csv is None or not Path(latency_csv).is_file():
        return None
    t = pd.read_csv(latency_csv)
    if "copy_bw_tbps" not in t:
        return None
    bw = t[t["shape"] == shape].copy_bw_tbps.dropna()
    return float(bw.median()) if len(bw) else None


def compact_table(table):
    """The chapter's table as a reader compares it (a pandas Styler): per model, method and batch, tokens/s and its ratio to
    uncompressed at the same batch kind (the fixed batch, or each method's largest), the step, the stored bits and
    the compressed shares, and the paper's largest batch and tokens/s where it prints them. The full table
    (per-step times, profiles) is the results CSV."""
    from zipkv.study import paper_values as pv

    t = table.copy()
    t["batch kind"] = ["largest" if b == mb else "fixed" for b, mb in zip(t.batch, t.max_batch)]
    base = t[t.method == "uncompressed"].set_index(["model", "batch kind"]).tokens_per_s
    t["vs uncompressed"] = [tps / base.get((mdl, kind), float("nan"))
                            for tps, mdl, kind in zip(t.tokens_per_s, t.model, t["batch kind"])]
    bars = paper_bars()
    paper = pv.ZIPFUSION_MAX_BATCH["Llama-3.1-8B"]
    in_paper = t.model == THROUGHPUT_PAPER_MODEL
    t["paper max batch"] = [paper.get(m) if p else None for m, p in zip(t.method, in_paper)]
    t["paper tokens/s"] = [bars.get((k, m)) if p else None for m, k, p in zip(t.method, t["batch kind"], in_paper)]
    cols = {"model": "model", "method": "method", "batch": "batch", "max_batch": "max batch", "tokens_per_s": "tokens/s",
            "vs uncompressed": "vs uncompressed", "step_ms": "step (ms)", "stored_bits_per_value": "bits per value",
            "frac_compressed_k": "K compressed", "frac_compressed_v": "V compressed", "paper max batch": "paper max batch",
            "paper tokens/s": "paper tokens/s"}
    out = t[[c for c in cols if c in t]].rename(columns=cols).reset_index(drop=True)
    out["method"] = out["method"].map(lambda m: METHOD_LABELS.get(m, m))
    return out.style.format({"tokens/s": "{:,.0f}", "vs uncompressed": "{:.3f}×", "step (ms)": "{:.2f}",
                             "bits per value": "{:.2f}", "K compressed": "{:.1%}", "V compressed": "{:.1%}",
                             "paper max batch": "{:.0f}", "paper tokens/s": "{:,.0f}"}, na_rep="–").hide(axis="index")


def agreement_text(same: dict) -> str:
    """One sentence from :func:`zipkv.study.experiments.throughput.figure5`'s ``e2e_same_tokens``: per method, requests whose greedy tokens equal uncompressed's."""
    parts = []
    for method, a in same.items():
        part = f"{method} {a['identical']} of {a['requests']}"
        if a["first_difference"]:
            part += f" (the others first differ at new token {', '.join(map(str, sorted(a['first_difference'])))}"
            if a.get("logit_gap"):
                part += (f", where the model's own forward puts the two tokens' logits {min(a['logit_gap']):.3g} to "
                         f"{max(a['logit_gap']):.3g} apart")
            part += ")"
        parts.append(part)
    return "requests whose greedy tokens equal the uncompressed engine's: " + "; ".join(parts)


MEMORY_TIMELINE_CAPTION = (
    "Left: KV bytes held by pages per layer over the decode steps of the embedded model's ZipFusion run (first and "
    "last layer, and the range over all layers): layers compress differently, so they hold different bytes for the "
    "same pages. Right: running requests, chunks free in the shared pool, and chunks reassigned from one layer to "
    "another (cumulative). One run.")
"""The caption of :func:`plot_memory_timeline`'s figure in the chapter."""


def runs_text(big) -> str:
    """How the largest-batch rows of :data:`zipkv.study.experiments.throughput.REPEATED` were measured (their ``tokens_per_s_runs``): the runs, the
    tokens/s ratio of each round (the methods' i-th runs) and their spread; one run where there are no repeats."""
    import pandas as pd
    rows = {m: largest_batch_rows(big, m).iloc[0] for m in REPEATED}
    if "tokens_per_s_runs" not in big.columns or any(pd.isna(r.get("tokens_per_s_runs")) for r in rows.values()):
        return "One run per method and batch, no spread."
    runs = {m: json.loads(r.tokens_per_s_runs) for m, r in rows.items()}
    u, z = runs["uncompressed"], runs["zipfusion"]
    ratios = [b / a for a, b in zip(u, z)]
    return (f"At the largest batches each of the two ran {len(u)} times, in rounds alternating the methods; each row is "
            f"its median run: uncompressed {', '.join(f'{x:,.0f}' for x in u)} tokens/s, ZipFusion "
            f"{', '.join(f'{x:,.0f}' for x in z)}; per round ZipFusion/uncompressed "
            f"{', '.join(f'{x:.3f}' for x in ratios)}× (spread {min(ratios):.3f}–{max(ratios):.3f}×). The other rows: "
            "one run each.")


def runs_caption(big) -> str:
    """The figure caption's last sentence: what a bar is (a median run where :func:`runs_text` has repeats)."""
    if "tokens_per_s_runs" not in big.columns or not big.tokens_per_s_runs.notna().any():
        return "One run, no spread."
    n = len(json.loads(big.tokens_per_s_runs.dropna().iloc[0]))
    return (f"At the largest batch, uncompressed and ZipFusion: the median of {n} runs, whiskers from the slowest to the "
            "fastest; the other bars one run each.")


def paper_bars() -> dict:
    """The paper's tokens/s where it prints them, keyed like :func:`plot_throughput` reads them: ZipFusion at
    batch 32, and uncompressed and SplitZip at batch 32 derived from ZipFusion's 2044 tokens/s, +15.3 % and
    2.51x (§IV-C)."""
    from zipkv.study import paper_values as pv
    ours = pv.ZIPFUSION_TOKENS_PER_S_BATCH32['Llama-3.1-8B']
    return {("fixed", "zipfusion"): ours,
            ("fixed", "uncompressed"): ours / (1 + pv.ZIPFUSION_GAIN_BATCH32['Llama-3.1-8B']),
            ("fixed", "splitzip"): ours / pv.ZIPFUSION_VS_SPLITZIP_BATCH32['Llama-3.1-8B']}


def bar_checks(big, fixed_batch: int, context: int = 8192, new_tokens: int = 256) -> dict:
    """The chapter's numbers from the Llama-8B-shape rows ``big`` (requests of ``context`` input and ``new_tokens``
    output tokens): per bar of :data:`BARS` the measured ratio, and what explains a shortfall (step times, stored
    bits, the capacity bound and the bits per prefix value the batch bar needs)."""
    at_max = lambda m: largest_batch_rows(big, m).iloc[0]                                   # noqa: E731
    at_fixed = lambda m: big[(big.method == m) & (big.batch == fixed_batch)].iloc[0]       # noqa: E731
    z, u = at_max("zipfusion"), at_max("uncompressed")
    token_bytes = 2 * 2 * LLAMA_8B["num_hidden_layers"] * LLAMA_8B["num_key_value_heads"] * LLAMA_8B["head_dim"]
    # stored_bits_per_value is measured at the first decode step: the full prompt pages packed, the rest of the
    # context + 1 cached tokens in raw pages; every raw slot of a request's last page counts from the start
    P = fmt.PAGE_TOKENS
    prefix = P * (context // P)
    raw_then = P * math.ceil((context + 1 - prefix) / P)
    prefix_bits = (z.stored_bits_per_value * (context + 1) - 16 * raw_then) / prefix
    out_tokens = P * math.ceil((context + new_tokens - 1 - prefix) / P)           # raw slots to the end of the output
    needed = math.ceil(BARS["max_batch"] * u.batch)
    restores = [m for m in RESTORE if (big.method == m).any()]
    best = max(restores, key=lambda m: at_max(m).tokens_per_s) if restores else None
    out = dict(z=z, u=u, best=best, best_row=at_max(best) if best else None,
               max_batch=z.batch / u.batch, tokens_per_s=z.tokens_per_s / u.tokens_per_s,
               fixed=at_fixed("zipfusion").tokens_per_s / at_fixed("uncompressed").tokens_per_s,
               fixed_vs_splitzip=(at_fixed("zipfusion").tokens_per_s / at_fixed("splitzip").tokens_per_s
                                  if ((big.method == "splitzip") & (big.batch == fixed_batch)).any() else float("nan")),
               vs_restore=z.tokens_per_s / at_max(best).tokens_per_s if best else float("nan"),
               # the most requests the budget holds with the prefix at the measured bits per value and the output's
               # pages raw (new KV stays uncompressed, §IV-A), and the bits per prefix value the batch bar needs
               prefix_bits=prefix_bits,
               capacity_bound=u.kv_budget_bytes / (token_bytes * (prefix * prefix_bits / 16 + out_tokens)),
               bits_needed=16 * (u.kv_budget_bytes / (needed * token_bytes) - out_tokens) / prefix,
               batch_needed=needed,
               # the budget at which the measured bits give that batch, and the budgets at which the uncompressed
               # engine still holds its batch: from this one (the smallest) up to one more request's raw pages
               budget_needed=needed * token_bytes * (prefix * prefix_bits / 16 + out_tokens),
               budget_top=(u.batch + 1) * token_bytes * P * math.ceil((context + new_tokens - 1) / P),
               # ZipFusion's KV at its largest batch in uncompressed requests' worth of bytes, and the step time
               # at that batch that the tokens/s bar needs
               kv_requests=z.batch * z.stored_bits_per_value / u.stored_bits_per_value,
               step_needed_ms=u.step_ms * z.batch / (u.batch * BARS["tokens_per_s"]))
    return out


def verdict(big, fixed_batch: int, context: int = 8192, new_tokens: int = 256, mma_rows=None, runs=None):
    """The chapter's verdict from the Llama-8B-shape rows ``big``: ``(markdown, kind)``; with ``mma_rows`` (rows of
    :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL`) also ZipFusion's tokens/s over that uncompressed engine's,
    with ``runs`` (:func:`gpu_runs`, two or more) the tokens/s ratio's range over the chapter's GPU runs."""
    from zipkv.study import paper_values as pv
    c = bar_checks(big, fixed_batch, context, new_tokens)
    z, u, b = c["z"], c["u"], c["best_row"]
    ok = all(c[k] >= BARS[k] for k in BARS)

    def mark(k):
        if math.isnan(c[k]):
            return "**not measured**"
        gap = BARS[k] - c[k]
        if gap <= 0:
            return "met"
        # a miss that rounds to 0.000 is still a miss: say it at the digit where it shows
        return f"**missed by {gap:.3f}**" if gap >= 5e-4 else f"**missed by {gap:.4f}** ({c[k]:.4f}×)"
    mb = pv.ZIPFUSION_MAX_BATCH['Llama-3.1-8B']
    text = (f"Under one KV budget of {u.kv_budget_bytes / 2**30:.2f} GiB (the uncompressed engine's largest batch: "
            f"{u.batch}), ZipFusion's largest batch is **{z.batch}** ({c['max_batch']:.3f}×; paper "
            f"{mb['uncompressed']} → {mb['zipfusion']}, {mb['zipfusion'] / mb['uncompressed']:.3f}×) and its decode "
            f"throughput there is **{c['tokens_per_s']:.3f}×** uncompressed's (paper "
            f"+{pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH['Llama-3.1-8B']:.1%}); at batch {fixed_batch} it is "
            f"{c['fixed']:.3f}× uncompressed's (paper +{pv.ZIPFUSION_GAIN_BATCH32['Llama-3.1-8B']:.1%})"
            + ("" if math.isnan(c["fixed_vs_splitzip"]) else f" and {c['fixed_vs_splitzip']:.2f}× SplitZip-style's (paper "
               f"{pv.ZIPFUSION_VS_SPLITZIP_BATCH32['Llama-3.1-8B']}×)") + ". ")
    if b is None:
        text += "The restore-before-attention baselines have no Llama-8B-shape rows here. "
    else:
        text += (f"Against the best restore-before-attention baseline at its largest batch ({c['best']}, batch "
                 f"{b.batch}, {b.tokens_per_s:.0f} tokens/s, {b.step_ms:.1f} ms per step): **{c['vs_restore']:.2f}×** "
                 f"(paper {pv.ZIPFUSION_VS_BEST_LOSSLESS_BASELINE['Llama-3.1-8B']}×). ")
    if (vs := vs_mma_baseline(big, mma_rows)) is not None:
        ratio, _, m = vs
        text += (f"Against the engine's own uncompressed default on a GPU (the mma layouts, the Gluon kernel's raw path; "
                 f"batch {m.batch}): **{ratio:.3f}×** tokens/s. ")
    if runs is not None and len(runs) > 1:
        r = runs.tokens_per_s_ratio
        text += (f"Over this chapter's {len(runs)} GPU runs the tokens/s ratio ranges {r.min():.3f}–{r.max():.3f}× "
                 "(\"From run to run\", below). ")
    text += (f"*This project's own targets* (not the paper's): largest batch ≥ {BARS['max_batch']}× {mark('max_batch')}, "
             f"tokens/s ≥ {BARS['tokens_per_s']}× {mark('tokens_per_s')}, ≥ {BARS['vs_restore']}× the best restore "
             f"baseline {mark('vs_restore')}. ")
    return text + "What the two targets would need: below the figure.", ("tip" if ok else "warning")


def vs_mma_baseline(big, mma_rows):
    """``(ratio, zipfusion_row, mma_row)``: ZipFusion's tokens/s at its largest batch (Llama-8B-shape rows ``big``)
    over the uncompressed engine's in the mma layouts (``mma_rows``, rows of
    :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL`); None where either is missing."""
    z = largest_batch_rows(big, "zipfusion")
    if mma_rows is None or mma_rows.empty or z.empty:
        return None
    z, m = z.iloc[0], mma_rows.iloc[0]
    return z.tokens_per_s / m.tokens_per_s, z, m


def mma_baseline_text(big, mma_rows) -> str:
    """ZipFusion's tokens/s at its largest batch (Llama-8B-shape rows ``big``) over the uncompressed engine's in the
    mma layouts (``mma_rows``, rows of :data:`~zipkv.study.settings.THROUGHPUT_MMA_BASELINE_MODEL`), beside the ratio over
    the chapter's uncompressed baseline (:data:`zipkv.study.experiments.throughput.BASELINE_LAYOUTS`); where ``mma_rows`` is empty,
    that the run did not time it."""
    u, z = (largest_batch_rows(big, m).iloc[0] for m in ("uncompressed", "zipfusion"))
    text = ("**Against the engine's own uncompressed default.** On a GPU the engine without compression stores raw "
            "pages in the tensor-core (mma) layouts, read by the Gluon kernel's all-raw path, which \"Decode attention "
            "latency\" times as fast as the Triton kernel's or faster; the chapter's uncompressed rows are the token "
            "layouts and the Triton kernel, the stand-in for SGLang's FlashInfer decode. ")
    if (vs := vs_mma_baseline(big, mma_rows)) is None:
        return text + "This run did not time the engine in the tensor-core layouts."
    ratio, z, m = vs
    runs = json.loads(m.tokens_per_s_runs) if isinstance(m.get("tokens_per_s_runs"), str) else [m.tokens_per_s]
    how = "one run" if len(runs) == 1 else (f"the median of {len(runs)} runs: "
                                             f"{', '.join(f'{x:,.0f}' for x in runs)} tokens/s")
    return text + (f"At its largest batch ({m.batch}; {how}) it takes {m.step_ms:.2f} ms per step against "
                   f"{u.step_ms:.2f} ms in the token layouts (batch {u.batch}), so ZipFusion's {z.tokens_per_s:,.0f} "
                   f"tokens/s at batch {z.batch} are **{ratio:.3f}×** its {m.tokens_per_s:,.0f} (over the token layouts: "
                   f"{z.tokens_per_s / u.tokens_per_s:.3f}×); against it the {BARS['tokens_per_s']}× tokens/s target is "
                   + ("met." if ratio >= BARS["tokens_per_s"] else f"missed by {BARS['tokens_per_s'] - ratio:.3f}."))


def bars_need_text(big, fixed_batch: int, context: int = 8192, new_tokens: int = 256, capacity=None) -> str:
    """How the largest-batch rows were measured (:func:`runs_text`) and what the batch and tokens/s bars would need,
    from the Llama-8B-shape rows ``big`` (:func:`bar_checks`): the bits per prefix value for one more request, what
    the memory manager admits per block arrangement (``capacity``, the :data:`CAPACITY_SIDE` table:
    :func:`capacity_text`, where there is one), the decode step time at ZipFusion's largest batch."""
    c = bar_checks(big, fixed_batch, context, new_tokens)
    z, u = c["z"], c["u"]
    return (runs_text(big) + f"\n\n**What the batch target needs.** ZipFusion stores {z.stored_bits_per_value:.2f} bits "
            f"per cached value at the first decode step, {c['prefix_bits']:.3f} per value of the packed prefix "
            f"({z.frac_compressed_k:.1%} of K and {z.frac_compressed_v:.1%} of V blocks compressed). With the output's "
            f"pages raw, the budget holds at most {c['capacity_bound']:.2f} such requests (before the room lost at the "
            f"ends of chunks). {c['batch_needed']} requests ({BARS['max_batch']}×) would need ≤ {c['bits_needed']:.3f} "
            f"bits per prefix value, or, at the measured bits, a budget {c['budget_needed'] / u.kv_budget_bytes - 1:+.2%} "
            f"larger. This chapter takes the smallest budget that holds {u.batch} uncompressed requests; budgets up to "
            f"{c['budget_top'] / u.kv_budget_bytes - 1:+.2%} larger hold {u.batch} too, so where in that range a budget "
            f"lies decides whether request {c['batch_needed']} fits."
            + (f"\n\n{capacity_text(capacity, big)}\n\n{capacity_markdown(capacity)}" if capacity is not None else "")
            + f"\n\n**What the tokens/s target needs.** At batch {z.batch} ZipFusion holds {c['kv_requests']:.1f} "
            f"uncompressed requests' worth of KV bytes (uncompressed: {u.batch}), so {BARS['tokens_per_s']}× tokens/s "
            f"needs a decode step ≤ {c['step_needed_ms']:.1f} ms there: measured {z.step_ms:.1f} ms, uncompressed "
            f"{u.step_ms:.1f} ms at batch {u.batch}. " + scheduler_text(big))


CAPACITY_SIDE = "capacity"
"""The chapter's side table of :func:`zipkv.study.experiments.throughput.packed_capacity` (columns ``device``, ``commit``, ``date``
added): the memory manager's largest batch on the chapter's real-KV prefixes and budget per block arrangement."""


def capacity_text(capacity, big) -> str:
    """What the memory manager admits on the chapter's real-KV prefixes per block arrangement (``capacity``, the
    :data:`CAPACITY_SIDE` table) against the batch target over the uncompressed largest
    batch of the Llama-8B-shape rows ``big``: ZipFusion's arrangement, and whether any arrangement reaches the target."""
    needed = math.ceil(BARS["max_batch"] * largest_batch_rows(big, "uncompressed").iloc[0].batch)
    capacity = capacity.assign(k_layout=capacity.k_layout.map(lambda x: LAYOUT_LABELS.get(x, x)),
                               v_layout=capacity.v_layout.map(lambda x: LAYOUT_LABELS.get(x, x)))
    eng = capacity[(capacity.k_layout == LAYOUT_LABELS["k_mma"]) & (capacity.v_layout == LAYOUT_LABELS["v_mma"])].iloc[0]
    best = capacity.sort_values(["max_batch", "chunks_short"], ascending=[False, True]).iloc[0]
    reach = capacity[capacity.max_batch >= needed]
    text = (f"**Placed by the memory manager.** Admitted packed, in order, under the same budget "
            f"(the same real-KV prefixes, only their blocks' sizes placed; run on "
            f"{eng.device}, commit {eng.commit}, {eng.date}), ZipFusion's arrangement (keys and values in the mma "
            f"layouts, {eng.bits_per_value:.3f} bits per prefix value) holds {eng.max_batch} requests, and request "
            f"{eng.max_batch + 1} lacks {eng.chunks_short:.0f} of the budget's chunks ({eng.frac_budget_short:.2%} of it). ")
    if reach.empty:
        return text + (f"No arrangement of the format's blocks in the table below reaches {needed}: the closest, keys "
                       f"{best.k_layout} and values {best.v_layout} ({best.bits_per_value:.3f} bits per value), holds "
                       f"{best.max_batch} and lacks {best.chunks_short:.0f} chunks ({best.frac_budget_short:.2%}) for the "
                       f"next: on this KV and under this budget, regrouping the format's blocks closes "
                       f"{eng.chunks_short - best.chunks_short:.0f} of the {eng.chunks_short:.0f} chunks.")
    return text + ", ".join(f"keys {r.k_layout} and values {r.v_layout}" for r in reach.itertuples()) + (
        f" reach {needed} requests.")


def capacity_table(capacity, results_csv=None, committed_csv=None):
    """The :data:`CAPACITY_SIDE` table the chapter shows: this run's (``capacity``, :func:`zipkv.study.experiments.throughput.figure5`'s),
    saved beside ``results_csv``; for a run without the Llama-shape rows, the one committed beside ``committed_csv``
    (None where there is none)."""
    from zipkv.study import committed
    if capacity is None:
        return committed.read_committed_side(committed_csv, CAPACITY_SIDE) if committed_csv else None
    if results_csv:
        capacity.to_csv(committed.side_table(results_csv, CAPACITY_SIDE), index=False)
    return capacity


LAYOUT_LABELS = {"k_mma": "tensor-core (mma)", "v_mma": "tensor-core (mma)", "token": "token", "channel": "channel"}
"""Block arrangements as a reader reads them: the kernel's tensor-core operand order, the token order, per channel."""


def capacity_markdown(capacity) -> str:
    """The :data:`CAPACITY_SIDE` table as a Markdown table (a row per block arrangement)."""
    capacity = capacity.assign(k_layout=capacity.k_layout.map(lambda x: LAYOUT_LABELS.get(x, x)),
                               v_layout=capacity.v_layout.map(lambda x: LAYOUT_LABELS.get(x, x)))
    head = ("| keys | values | K compressed | V compressed | bits per value | requests | next request lacks (chunks) "
            "| of the budget |\n|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r.k_layout} | {r.v_layout} | {r.frac_compressed_k:.2%} | {r.frac_compressed_v:.2%} | {r.bits_per_value:.3f} "
        f"| {r.max_batch} | {r.chunks_short:.0f} | {r.frac_budget_short:.2%} |" for r in capacity.itertuples())


def card_text(committed_csv) -> str:
    """The same setting on the paper's card, from the chapter "On the paper's card"'s committed Fig. 5 rows
    (``<PAPER_CARD>_throughput.csv`` beside ``committed_csv``): ZipFusion's tokens/s at its largest batch over the
    mma-layout engine's, its step against that engine's and the clock, where no power cap lowered it; "" before that
    chapter has run."""
    from pathlib import Path

    import pandas as pd

    path = Path(committed_csv).with_name(f"{PAPER_CARD}_throughput.csv")
    if not path.is_file():
        return ""
    z, _, m = card_rows(pd.read_csv(path))
    return (f"\n\n**On the paper's card** (an H100, chapter \"On the paper's card\", {z.date}), with the SM clock at "
            f"{z.sm_clock_mhz:.0f} MHz for ZipFusion and {m.sm_clock_mhz:.0f} MHz for the mma-layout engine (the power cap "
            f"lowering it in {z.frac_power_capped:.0%} and {m.frac_power_capped:.0%} of the samples), ZipFusion's "
            f"{z.batch} requests take a {z.step_ms:.2f} ms step against {m.step_ms:.2f} ms for {m.batch} uncompressed "
            f"ones: {z.tokens_per_s / m.tokens_per_s:.3f}× the tokens/s, against a batch ratio of {z.batch / m.batch:.3f}×. "
            "Where neither engine is throttled and both read at the copy bandwidth, the same budget's bytes take the "
            "same time, and the gain is the batch ratio.")


def card_rows(table):
    """``(zipfusion, uncompressed, mma)``: the rows of a Fig. 5 table (the paper's card's, or this chapter's) at the
    largest batches -- ZipFusion's and the token-layout engine's -- and the mma-layout engine's run."""
    big = table[table.model == THROUGHPUT_PAPER_MODEL]
    z, u = (largest_batch_rows(big, m).iloc[0] for m in ("zipfusion", "uncompressed"))
    return z, u, table[(table.model == THROUGHPUT_MMA_BASELINE_MODEL) & (table.method == "uncompressed")].iloc[0]


def largest_batch_rows(rows, method: str):
    """The rows of ``method`` in ``rows`` (the chapter's table) run at that method's largest batch."""
    return rows[(rows.method == method) & (rows.batch == rows.max_batch)]


def power_text(big, unfused=None) -> str:
    """The GPU's power and SM clock over the largest-batch decode steps of uncompressed and ZipFusion (rows ``big``,
    columns of :class:`zipkv.bench.power.GpuMonitor`), and -- given ``unfused``, the same two methods run with the
    model's own modules for the step's norms, rotary embedding and MLP product -- their step times and tokens/s ratio
    beside the fused ones'. Empty for rows without power columns."""
    if "power_w" not in big.columns:
        return ""
    at = largest_batch_rows
    z, u = at(big, "zipfusion"), at(big, "uncompressed")
    if z.empty or u.empty or z.power_w.isna().iloc[0]:
        return ""
    z, u = z.iloc[0], u.iloc[0]

    def steady(r):
        """Whether a run's median draw is a decode draw: at least half its largest sample (a median far below it means
        most samples fell where the GPU was idle, outside the decode steps)."""
        return r.power_w >= 0.5 * r.power_w_max

    def gpu(r):
        return (f"{r.power_w:.0f} W (largest sample {r.power_w_max:.0f} W), SM clock {r.sm_clock_mhz:.0f} MHz, the power "
                f"cap lowering the clock in {r.frac_power_capped:.0%} of the samples"
                + ("" if steady(r) else " -- a median below half the largest sample: most samples fell outside the decode "
                   "steps, so it is no decode draw"))
    text = (f"**Power.** Over the decode steps at the largest batches the GPU drew a median {gpu(z)} for ZipFusion, and "
            f"{gpu(u)} for uncompressed.")
    if unfused is not None and not at(unfused, "zipfusion").empty and not at(unfused, "uncompressed").empty:
        zm, um = at(unfused, "zipfusion").iloc[0], at(unfused, "uncompressed").iloc[0]
        text += (f" With the model's own modules for the step's norms, rotary embedding and MLP product instead of the "
                 f"fused kernels (same budget, same batches), the steps take {um.step_ms:.2f} ms (uncompressed) and "
                 f"{zm.step_ms:.2f} ms (ZipFusion), against {u.step_ms:.2f} and {z.step_ms:.2f} ms fused. The tokens/s "
                 f"ratio is then {zm.tokens_per_s / um.tokens_per_s:.3f}×, against {z.tokens_per_s / u.tokens_per_s:.3f}× "
                 f"fused: the fused kernels make both engines faster ({u.tokens_per_s / um.tokens_per_s:.2f}× and "
                 f"{z.tokens_per_s / zm.tokens_per_s:.2f}× the tokens/s). Unfused, ZipFusion's GPU draws {gpu(zm)}")
        if steady(z) and steady(zm) and z.frac_power_capped > zm.frac_power_capped and z.power_w > zm.power_w:
            text += (". ZipFusion's shorter fused step, whose attention rebuilds every value, reaches the power cap, "
                     "which lowers the clock that rebuilding depends on")
        text += "."
    return text


def scheduler_text(big) -> str:
    """Which of the engine's schedulers timed the rows ``big`` (column ``overlap``; a table from before the column
    is the sequential one's)."""
    if "overlap" not in big.columns or not big.overlap.notna().any():
        return ("These steps ran sequentially (the table predates the overlapped scheduler: the host prepared and "
                "launched each step after reading the tokens of the one before).")
    on = big.overlap.dropna().astype(bool)
    if on.all():
        return ("Every method ran with the overlapped scheduler (SGLang's overlap scheduling): "
                "the host prepares and launches each step while the GPU computes the one before.")
    return f"{int(on.sum())} of {len(on)} rows ran with the overlapped scheduler, the others sequentially."


RUNS_SIDE = "runs"
"""The chapter's side table of its GPU runs (:func:`zipkv.study.committed.side_table` of the main table): one row per run
of the Fig. 5 setting (:func:`gpu_run_row`), appended by each GPU run, so that the spread from run to run and from
board to board (power cap, SM clock) stays beside the one run the chapter shows."""


def gpu_run_row(big, mma_rows, record: dict, fixed_batch: int, context: int = 8192, new_tokens: int = 256) -> dict:
    """One row of :data:`RUNS_SIDE` from a run's Llama-8B-shape rows ``big`` and ``mma_rows`` and its provenance
    ``record`` (``date``, ``commit``, ``device``; ``gpu_uuid`` where known): the largest batches, the bars' ratios
    (:func:`bar_checks`, :func:`vs_mma_baseline`), the step times and each method's SM clock and power-capped share."""
    c = bar_checks(big, fixed_batch, context, new_tokens)
    z, u = c["z"], c["u"]
    vs = vs_mma_baseline(big, mma_rows)
    return {"date": record["date"], "commit": record["commit"], "device": record["device"],
            "gpu_uuid": record.get("gpu_uuid", "unrecorded"),
            "uncompressed_max_batch": int(u.batch), "zipfusion_max_batch": int(z.batch),
            "max_batch_ratio": c["max_batch"], "tokens_per_s_ratio": c["tokens_per_s"],
            "tokens_per_s_ratio_mma_baseline": vs[0] if vs else float("nan"),
            "uncompressed_step_ms": u.step_ms, "zipfusion_step_ms": z.step_ms,
            **{f"{m}_{col}": r.get(col, float("nan")) for m, r in (("uncompressed", u), ("zipfusion", z))
               for col in ("sm_clock_mhz", "frac_power_capped")}}


def append_gpu_run(results_csv, big, mma_rows, fixed_batch: int, context: int = 8192, new_tokens: int = 256,
                   record: dict | None = None) -> None:
    """Append this GPU run's row (:func:`gpu_run_row` of ``big`` and ``mma_rows``; ``record``: its provenance, by default
    :func:`zipkv.study.experiments.throughput.gpu_run_record`) to the :data:`RUNS_SIDE` table beside ``results_csv``."""
    import pandas as pd
    from zipkv.study.committed import side_table
    from zipkv.study.experiments.throughput import gpu_run_record
    row = gpu_run_row(big, mma_rows, record or gpu_run_record(), fixed_batch, context, new_tokens)
    path = side_table(results_csv, RUNS_SIDE)
    runs = pd.read_csv(path) if path.exists() else pd.DataFrame()
    pd.concat([runs, pd.DataFrame([row])], ignore_index=True).to_csv(path, index=False)


def gpu_runs(results_csv=None, committed_csv=None, append: tuple | None = None):
    """The :data:`RUNS_SIDE` table beside ``results_csv`` (this run's results folder), else beside ``committed_csv``;
    an empty frame where neither has one. ``append``: this GPU run's ``(big, mma_rows, fixed_batch, context,
    new_tokens)``, whose row (:func:`append_gpu_run`) joins the table beside ``results_csv`` first."""
    import pandas as pd
    from zipkv.study.committed import side_table
    if append is not None and results_csv is not None:
        append_gpu_run(results_csv, *append)
    for main in (results_csv, committed_csv):
        if main is not None and side_table(main, RUNS_SIDE).exists():
            return pd.read_csv(side_table(main, RUNS_SIDE))
    return pd.DataFrame()


def gpu_runs_text(runs) -> str:
    """One paragraph over the chapter's GPU runs ``runs`` (:func:`gpu_runs`): how many, on how many boards, and the
    range of the tokens/s ratio and of ZipFusion's SM clock; empty for fewer than two runs."""
    if len(runs) < 2:
        return ""
    boards = runs.gpu_uuid[runs.gpu_uuid != "unrecorded"].nunique()
    unknown = int((runs.gpu_uuid == "unrecorded").sum())
    r, clock = runs.tokens_per_s_ratio, runs.zipfusion_sm_clock_mhz
    which = ([f"{boards} board{'s' if boards != 1 else ''} identified"] if boards else []) + (
        [f"{unknown} run{'s' if unknown != 1 else ''} from before the board was recorded"] if unknown else [])
    return (f"**From run to run.** This chapter's {len(runs)} GPU runs of this setting (table below; {', '.join(which)}), "
            f"{runs.date.min()} to {runs.date.max()}, put ZipFusion/uncompressed tokens/s at the largest batches "
            f"between {r.min():.3f}× and {r.max():.3f}× and ZipFusion's median SM clock between {clock.min():.0f} and "
            f"{clock.max():.0f} MHz: the tokens/s target is met in {int((r >= BARS['tokens_per_s']).sum())} of them. The "
            "chapter shows the latest run; each row names the commit that ran.")


def gpu_runs_section(runs) -> list:
    """What the page shows of the chapter's GPU runs ``runs``: :func:`gpu_runs_text` and :func:`gpu_runs_table`, for
    display; nothing for fewer than two runs."""
    from IPython.display import Markdown
    return [Markdown(gpu_runs_text(runs)), gpu_runs_table(runs)] if len(runs) > 1 else []


def gpu_runs_table(runs):
    """The :data:`RUNS_SIDE` table as a reader compares the runs (a pandas Styler)."""
    cols = {"date": "date", "commit": "commit", "gpu_uuid": "GPU", "zipfusion_max_batch": "ZipFusion batch",
            "uncompressed_max_batch": "uncompressed batch", "tokens_per_s_ratio": "tokens/s ratio",
            "tokens_per_s_ratio_mma_baseline": "vs mma-layout baseline", "zipfusion_step_ms": "ZipFusion step (ms)",
            "uncompressed_step_ms": "uncompressed step (ms)", "zipfusion_sm_clock_mhz": "ZipFusion SM clock (MHz)",
            "zipfusion_frac_power_capped": "ZipFusion power-capped", "uncompressed_frac_power_capped":
            "uncompressed power-capped"}
    t = runs[list(cols)].rename(columns=cols).assign(GPU=lambda d: d.GPU.str.slice(0, 13))
    return t.style.format({"tokens/s ratio": "{:.3f}×", "vs mma-layout baseline": "{:.3f}×",
                           "ZipFusion step (ms)": "{:.2f}", "uncompressed step (ms)": "{:.2f}",
                           "ZipFusion SM clock (MHz)": "{:.0f}", "ZipFusion power-capped": "{:.0%}",
                           "uncompressed power-capped": "{:.0%}"}, na_rep="–").hide(axis="index")


# ---------------------------------------------------------------- the chapter (the result) and its appendix page

METHOD_LABELS = {"uncompressed": "uncompressed", "zipfusion": "ZipFusion", "splitzip": "SplitZip-style",
                 "huffman": "Huffman-style"}
"""What a reader sees for each method of the chapter's table."""


def read_rows(committed_csv, from_results: bool = True):
    """``(table, big, modules_rows, mma_rows, capacity, runs)`` of the chapter's committed GPU run: its table
    (``committed_csv``; as committed at ``HEAD`` with ``from_results``, else the file as it is -- a copy of the project
    without git), the Fig. 5 setting's rows, the rows of its two side runs, and its side tables (block arrangements,
    GPU runs; None and empty where none is committed)."""
    import pandas as pd

    from zipkv.study import committed

    if from_results:
        table, capacity = committed.read_committed_csv(committed_csv), capacity_table(None, None, committed_csv)
    else:
        table = pd.read_csv(committed_csv)
        path = committed.side_table(committed_csv, CAPACITY_SIDE)
        capacity = pd.read_csv(path) if path.is_file() else None
    big, modules_rows, mma_rows, _ = setting_rows(table, committed_csv)
    return table, big, modules_rows, mma_rows, capacity, gpu_runs(None, committed_csv)


def card_gain(committed_csv) -> float | None:
    """On the paper's card (the chapter "On the paper's card", its committed Fig. 5 rows beside ``committed_csv``):
    ZipFusion's tokens/s at its largest batch over the faster of the two uncompressed engines'; None before it ran."""
    from pathlib import Path

    import pandas as pd

    path = Path(committed_csv).with_name(f"{PAPER_CARD}_throughput.csv")
    if not path.is_file():
        return None
    z, u, m = card_rows(pd.read_csv(path))
    return z.tokens_per_s / max(u.tokens_per_s, m.tokens_per_s)


def chapter_verdict(big, fixed_batch: int, runs=None, card=None, *, judge):
    """The chapter's verdict: ``(markdown, kind)``. ZipFusion's largest batch and tokens/s against the paper's, each
    judged by ``judge`` (the findings page's :func:`zipkv.study.findings.verdict_for`, passed in: the findings page
    reads this module's tables), the run-to-run range over ``runs`` and the gain on the paper's card (``card``,
    :func:`card_gain`)."""
    from zipkv.study import paper_values as pv

    c = bar_checks(big, fixed_batch)
    z, u = c["z"], c["u"]
    llama = "Llama-3.1-8B"
    mb = pv.ZIPFUSION_MAX_BATCH[llama]
    gain = pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH[llama]
    judged = {"batch": judge("zipfusion_throughput", "largest supported batch", c["max_batch"]),
              "gain": judge("zipfusion_throughput", "tokens/s at each method's largest batch over uncompressed (gain)",
                                           c["tokens_per_s"] - 1),
              "fixed": judge("zipfusion_throughput", "tokens/s at batch 32 over uncompressed", c["fixed"] - 1),
              "splitzip": judge("zipfusion_throughput", "tokens/s at batch 32 over SplitZip",
                                               c["fixed_vs_splitzip"]),
              "restore": judge("zipfusion_throughput", "tokens/s at the largest batch over the best",
                                              c["vs_restore"])}
    text = (f"Under one KV budget that holds {u.batch} uncompressed requests of 8192 + 256 tokens (Llama-3.1-8B shapes, "
            f"H200), ZipFusion's largest batch is **{z.batch}**, {c['max_batch']:.2f}× (paper {mb['uncompressed']} → "
            f"{mb['zipfusion']}: **{judged['batch']}**). Its decode tokens/s there is {c['tokens_per_s'] - 1:+.1%} over "
            f"uncompressed's (paper +{gain:.1%}: **{judged['gain']}**); at batch {fixed_batch}, "
            f"{c['fixed'] - 1:+.1%} (paper +{pv.ZIPFUSION_GAIN_BATCH32[llama]:.1%}: **{judged['fixed']}**) and "
            f"{c['fixed_vs_splitzip']:.2f}× SplitZip-style's (paper {pv.ZIPFUSION_VS_SPLITZIP_BATCH32[llama]}×: "
            f"**{judged['splitzip']}**); over the best restore-before-attention baseline at its largest batch, "
            f"{c['vs_restore']:.2f}× (paper {pv.ZIPFUSION_VS_BEST_LOSSLESS_BASELINE[llama]}×: **{judged['restore']}**).")
    if runs is not None and len(runs) > 1:
        r = runs.tokens_per_s_ratio
        text += f" Over {len(runs)} GPU runs the gain at the largest batch ranged {r.min() - 1:+.1%} to {r.max() - 1:+.1%}."
    if card is not None:
        text += (f" On the paper's card, an H100, it is {card - 1:+.1%} ({{doc}}`On the paper's card "
                 f"<zipfusion_paper_card>`).")
    ok = all(v in ("reproduced", "exceeded") for v in judged.values())
    return text, ("tip" if ok else "warning")


FIGURE_CAPTION = ("Decode tokens/s of all running requests over the timed steps after the first token; left at batch "
                  "{fixed_batch}, right at each method's largest batch under the budget. Ours: H200, Llama-3.1-8B shapes "
                  "(random weights, real-KV prefixes); hatched: the paper's H100 SGLang numbers where it prints them "
                  "(uncompressed and SplitZip at batch {fixed_batch} derived from its printed ratios). ")
"""The chapter's figure caption (:func:`plot_throughput`), before :func:`runs_caption`."""


def chapter_table(big, mma_rows=None):
    """The chapter's one table (a pandas Styler): per method and batch of the Fig. 5 setting (and the uncompressed
    engine in the tensor-core layout, where it ran), tokens/s, its ratio to uncompressed at the same batch kind, the
    step, the stored bits and the paper's largest batch and tokens/s where it prints them."""
    import pandas as pd

    from zipkv.study import paper_values as pv

    t = pd.concat([big, mma_rows]) if mma_rows is not None and len(mma_rows) else big.copy()
    t = t.assign(kind=["largest" if b == mb else f"fixed" for b, mb in zip(t.batch, t.max_batch)])
    base = big[big.method == "uncompressed"].assign(
        kind=lambda d: ["largest" if b == mb else "fixed" for b, mb in zip(d.batch, d.max_batch)]).set_index("kind")
    paper_tps, paper_mb = paper_bars(), pv.ZIPFUSION_MAX_BATCH["Llama-3.1-8B"]
    mma = t.model == THROUGHPUT_MMA_BASELINE_MODEL
    out = pd.DataFrame({
        "method": [METHOD_LABELS.get(m, m) + (", tensor-core layout" if x else "") for m, x in zip(t.method, mma)],
        "batch": t.batch.astype(int), "largest batch": t.max_batch.astype(int),
        "tokens/s": t.tokens_per_s,
        "vs uncompressed": [tps / base.tokens_per_s[k] for tps, k in zip(t.tokens_per_s, t.kind)],
        "step (ms)": t.step_ms, "bits per value": t.stored_bits_per_value,
        "paper largest batch": [paper_mb.get(m) if not x else None for m, x in zip(t.method, mma)],
        "paper tokens/s": [paper_tps.get((k, m)) if not x else None for m, k, x in zip(t.method, t.kind, mma)]})
    return out.style.format({"tokens/s": "{:,.0f}", "vs uncompressed": "{:.3f}×", "step (ms)": "{:.2f}",
                             "bits per value": "{:.2f}", "paper largest batch": "{:.0f}", "paper tokens/s": "{:,.0f}"},
                            na_rep="–").hide(axis="index")


def step_figure(steps):
    """Where a decode step goes at each method's largest batch (``steps``: :func:`step_table`): ms per step by
    :data:`STEP_PARTS` and the GPU's idle time inside the graph, stacked, uncompressed beside ZipFusion."""
    import matplotlib.pyplot as plt

    rows = overlapped_rows(steps)
    rows = rows[rows.method.isin(["uncompressed", "zipfusion"])]
    rows = rows.loc[rows.groupby("method").batch.idxmax()]
    parts = [c for c in STEP_PARTS if c in rows.columns and c != "host_ms"] + ["gaps_ms"]
    names = {**STEP_PARTS, "gaps_ms": "GPU idle between kernels"}
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = [0.0] * len(rows)
    labels = [f"{METHOD_LABELS[m]}, batch {b}" for m, b in zip(rows.method, rows.batch)]
    for part in parts:
        values = rows[part].fillna(0).clip(lower=0).tolist()
        ax.barh(labels, values, left=left, label=names[part])
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("ms per decode step (profiled replay)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    return fig


def engineering_verdict(big, fixed_batch: int, mma_rows=None, runs=None) -> tuple[str, str]:
    """The appendix page's verdict: the Fig. 5 run against this project's own targets (:data:`BARS`), not the
    paper's claims (those are the chapter's verdict)."""
    c = bar_checks(big, fixed_batch)

    def mark(k):
        gap = BARS[k] - c[k]
        return "met" if gap <= 0 else f"**missed by {gap:.3f}**" if gap >= 5e-4 else f"**missed by {gap:.4f}**"
    text = (f"This project's own targets for the throughput run (not the paper's claims): ZipFusion's largest batch ≥ "
            f"{BARS['max_batch']}× uncompressed's, {c['max_batch']:.3f}×: {mark('max_batch')}; its tokens/s there ≥ "
            f"{BARS['tokens_per_s']}×, {c['tokens_per_s']:.3f}×: {mark('tokens_per_s')}; ≥ {BARS['vs_restore']}× the best "
            f"restore baseline's, {c['vs_restore']:.2f}×: {mark('vs_restore')}.")
    if (vs := vs_mma_baseline(big, mma_rows)) is not None:
        text += f" Over the uncompressed engine in the tensor-core layout: {vs[0]:.3f}× tokens/s."
    if runs is not None and len(runs) > 1:
        r = runs.tokens_per_s_ratio
        text += (f" Over {len(runs)} GPU runs the tokens/s ratio ranged {r.min():.3f}–{r.max():.3f}×, the target held "
                 f"in {int((r >= BARS['tokens_per_s']).sum())}.")
    return text, ("tip" if all(c[k] >= BARS[k] for k in BARS) else "warning")
