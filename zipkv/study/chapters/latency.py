"""Chapter "Decode attention latency" (ZipFusion Fig. 4): speedup over FlashInfer per context × batch,
the anchor point's verdict, the Gluon kernel against its bytes over shares of compressed blocks
(:func:`zipkv.bench.mix_sweep`), and the CPU correctness check used where no GPU can time anything."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from zipkv import format as fmt
from zipkv.study import paper_values as pv
from zipkv.study import report
from zipkv.models import EMBEDDED_SHAPE, PAPER_MODELS
from zipkv.study.settings import PAPER_CARD, PROJECT_TARGETS, ZIPFUSION_PAPER

METHOD_LABELS = {"zipkv_compressed": "zipkv (compressed)", "zipkv_uncompressed": "zipkv (uncompressed)",
                 "flashinfer_tc": "FlashInfer TC", "flashinfer_cuda": "FlashInfer CUDA-core",
                 "flashinfer_fp8": "FlashInfer FP8 (e4m3, lossy)", "sdpa": "torch SDPA"}
SHAPE = "llama3.1-8b"
FEW_REQUESTS = {("zipkv_compressed", "measured mix"): "ZipFusion, real-KV mix",
                ("zipkv_compressed", "all compressible"): "ZipFusion, all compressible",
                ("flashinfer_fp8", "any"): "FlashInfer FP8 (e4m3, lossy)",
                ("zipkv_uncompressed", "all compressible"): "our kernel, uncompressed",
                ("flashinfer_cuda", "any"): "FlashInfer CUDA-core", ("sdpa", "any"): "torch SDPA"}
"""The few-requests panel's methods (method, KV data) and their labels, in the panel's order; ours: the Gluon kernel."""


def cpu_check(seed: int = 0) -> pd.DataFrame:
    """The Triton kernel (interpreter on a CPU) against the fp32 reference on three small caches:
    all blocks compressible, half, none. Columns: shape, lengths, mode, rel_rms_error, max_abs_error."""
    import torch

    from zipkv.kernels.decode_attention import build_paged_cache, decode_attention
    from zipkv.kernels.reference import decode_attention_reference

    rows, gen = [], torch.Generator().manual_seed(seed)
    for q_heads, kv_heads, d, lens, mode in [(9, 3, 64, [40, 17], "eligible"), (8, 2, 128, [33, 1], 0.5),
                                             (4, 4, 64, [16, 30], "none")]:
        k, v = (torch.randn(len(lens), kv_heads, max(lens), d, generator=gen).to(torch.bfloat16) for _ in range(2))
        q = torch.randn(len(lens), q_heads, d, generator=gen).to(torch.bfloat16)
        cache, indptr, indices, last = build_paged_cache(k, v, lens, compress=mode)
        out = decode_attention(q, cache, indptr, indices, last).float()
        ref = decode_attention_reference(q, cache, indptr, indices, last).float()
        rows.append(dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=d, seq_lens=str(lens), compress=str(mode),
                         rel_rms_error=float((out - ref).norm() / ref.norm()), max_abs_error=float((out - ref).abs().max())))
    return pd.DataFrame(rows)


CPU_TOLERANCE = 1e-2
"""Relative RMS error of the Triton kernel (interpreter) against the fp32 reference that :func:`cpu_check` allows."""


def cpu_check_text(check: pd.DataFrame, has_results: bool) -> tuple[str, bool]:
    """``(markdown, ok)``: what :func:`cpu_check`'s table says, and whether every cache is within
    :data:`CPU_TOLERANCE`; ``has_results``: committed GPU results are shown below."""
    ok = bool((check.rel_rms_error < CPU_TOLERANCE).all())
    return (f"No GPU: no timings. The Triton kernel (interpreter) matches the fp32 reference on {len(check)} caches to "
            f"a relative RMS error of at most {check.rel_rms_error.max():.1e} ({'within' if ok else 'OUTSIDE'} the "
            f"{CPU_TOLERANCE:g} tolerance)" + ("; below, the committed GPU results." if has_results
                                               else "; no GPU results are committed."), ok)


def speedups(table: pd.DataFrame) -> pd.DataFrame:
    """Speedup of our compressed kernels over FlashInfer TC at each paper point (Llama-3.1-8B shape):
    rows (ctx, batch), columns per KV data and kernel."""
    t = table[(table["shape"] == SHAPE) & (table.method == "zipkv_compressed")]
    t = t[t.ctx.isin(ZIPFUSION_PAPER.contexts) & t.batch.isin(ZIPFUSION_PAPER.batches)]
    grid = t.pivot_table(index=["ctx", "batch"], columns=["kv_data", "kernel"], values="speedup_vs_flashinfer_tc")
    grid.columns = [f"{kv}, {kernel}" for kv, kernel in grid.columns]
    return grid


def speedup_figure(table: pd.DataFrame):
    """Grouped bars: speedup over FlashInfer TC per context × batch, for each KV data and kernel,
    against the paper's 1.23–1.25× band (H100) and parity."""
    import matplotlib.pyplot as plt

    grid = speedups(table)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    x = np.arange(len(grid))
    width = 0.8 / len(grid.columns)
    for i, column in enumerate(grid.columns):
        ax.bar(x + (i - (len(grid.columns) - 1) / 2) * width, grid[column], width, label=column)
    lo, hi = pv.ZIPFUSION_SPEEDUP_RANGE
    ax.axhspan(lo, hi, color="tab:green", alpha=0.25, label=f"paper, {pv.ZIPFUSION_GPU}: {lo}–{hi}×")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{ctx} tokens\nbatch {b}" for ctx, b in grid.index])
    ax.set_ylabel("speedup over FlashInfer TC (×)")
    ax.set_xlabel("context length × batch (Llama-3.1-8B attention shape)")
    ax.set_ylim(0, max(1.5, float(grid.max().max()) + 0.25))  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    return fig


def verdict(table: pd.DataFrame, card: pd.DataFrame | None = None) -> tuple[str, str]:
    """(verdict text, admonition kind) for the chapter, from its table; ``card``: the same benchmark's table on the
    paper's H100 (chapter "On the paper's card"), whose measured-mix range closes the text when given."""
    grid = speedups(table)
    lo, hi = pv.ZIPFUSION_SPEEDUP_RANGE
    best = grid.filter(like="all compressible").max(axis=1)
    mix = grid.filter(like="measured mix").max(axis=1)
    real = table[(table.kv_data == "measured mix") & (table.method == "zipkv_compressed")]
    fk, fv = float(real.frac_compressed_k.mean()), float(real.frac_compressed_v.mean())
    relation = ("slower than" if mix.max() < 1 else "faster than" if mix.min() > 1
                else f"on par with (within {max(1 - mix.min(), mix.max() - 1):.0%} of)")
    text = (f"With every block compressible, our Gluon kernel is **{best.min():.2f}–{best.max():.2f}×** faster than "
            f"FlashInfer TC over the paper's {len(best)} points (paper, {pv.ZIPFUSION_GPU}: {lo}–{hi}×). "
            f"On the measured real-KV mix ({fk:.1%} of key and {fv:.1%} of value blocks compressible) our fastest kernel "
            f"is **{mix.min():.2f}–{mix.max():.2f}×**: {relation} FlashInfer. The paper's speedup counts as reproduced "
            f"on real KV when every point reaches its lower end less 2 % ({lo / 1.02:.3f}×); our slowest point reaches "
            f"{mix.min():.3f}×, so it is **{'not reproduced' if mix.min() < lo / 1.02 else 'reproduced'}**.")
    if card is not None:
        on_card = speedups(card).filter(like="measured mix").max(axis=1)
        text += (f" On the paper's own card, an {pv.ZIPFUSION_GPU} (chapter \"On the paper's card\"), the measured mix gives "
                 f"{on_card.min():.3f}–{on_card.max():.3f}×: "
                 f"**{'not reproduced' if on_card.min() < lo / 1.02 else 'reproduced'}** there.")
    return text, "warning" if mix.min() < lo / 1.02 else "tip"


def runs(shapes, contexts, batches, few_requests: dict | None = None) -> list[tuple]:
    """The chapter's benchmark runs ``[(shape, contexts, batches)]``: the paper's grid at each shape, then the
    few-requests panel's (Llama-3.1-8B shape; ``few_requests``: ``{"contexts": [...], "batches": [...]}``, empty
    lists or None: no panel)."""
    out = [(shape, list(contexts), list(batches)) for shape in shapes]
    if few_requests and few_requests.get("contexts") and few_requests.get("batches"):
        out.append((SHAPE, list(few_requests["contexts"]), list(few_requests["batches"])))
    return out


def show_few_requests(table: pd.DataFrame | None, engine: pd.DataFrame | None = None) -> None:
    """The few-requests panel's text and figure (:func:`few_requests`), or a line saying that no run has it yet; then
    the same case in the engine (``engine``: :func:`zipkv.study.experiments.throughput.few_requests`'s table)."""
    grid = few_requests(table) if table is not None and "speedup_vs_flashinfer_tc" in table else None
    if grid is None or grid.empty:
        report.markdown("No committed GPU run has timed these points yet.")
    else:
        report.markdown(few_requests_text(grid, str(table.device.iloc[0])))
        report.figure(few_requests_figure(grid), "Speedup over FlashInfer's tensor-core decode with few requests and long "
                      "contexts (Llama-3.1-8B attention shape, median of the timed calls, L2 cleared before each): ours on "
                      "the real-KV mix and all compressible, FlashInfer's lossy FP8 cache, FlashInfer's CUDA-core path, "
                      "torch SDPA and our kernel on raw pages; a black tick marks the speedup the real-KV mix's bytes "
                      "allow at FlashInfer's read rate.", name="fig-latency-few-requests")
    tokens = engine_few_requests(engine)
    if tokens is None:
        report.markdown("No committed GPU run has decoded these points in the engine yet.")
        return
    from IPython.display import display

    report.markdown(engine_few_requests_text(tokens, str(engine.device.iloc[0])))
    display(tokens.style.format({"uncompressed": "{:,.0f}", "ZipFusion": "{:,.0f}", "ZipFusion / uncompressed": "{:.2f}×"},
                                na_rep="–").set_caption("Decode tokens per second of the whole model (every layer, "
                                                         "the engine's decode step), one and four long requests"))


ENGINE_METHODS = {"uncompressed": "uncompressed", "zipfusion": "ZipFusion"}


def engine_few_requests(engine: pd.DataFrame | None) -> pd.DataFrame | None:
    """Tokens/s per (model, context, batch) of the engine's few-requests run, uncompressed and ZipFusion side by side
    with their ratio (> 1: ZipFusion faster); None without a run. Points that did not fit the GPU are left out."""
    if engine is None or "tokens_per_s" not in engine:
        return None
    t = engine[engine.tokens_per_s.notna() & engine.method.isin(ENGINE_METHODS)]
    if t.empty:
        return None
    grid = t.assign(method=t.method.map(ENGINE_METHODS)).pivot_table(
        index=["model", "context", "batch"], columns="method", values="tokens_per_s", sort=False)
    grid = grid[[m for m in ENGINE_METHODS.values() if m in grid]]
    if "ZipFusion" in grid and "uncompressed" in grid:
        grid["ZipFusion / uncompressed"] = grid["ZipFusion"] / grid["uncompressed"]
    return grid


def engine_few_requests_text(tokens: pd.DataFrame, device: str) -> str:
    """What the engine's few-requests table shows (``device``: the run's GPU)."""
    if "ZipFusion / uncompressed" not in tokens:
        return f"The engine's run ({device}) has only one of the two methods."
    ratio = tokens["ZipFusion / uncompressed"]
    worst, best = ratio.idxmin(), ratio.idxmax()
    return (f"In our engine ({device}: every layer, the whole decode step), one to "
            f"{tokens.index.get_level_values('batch').max()} long requests decode at "
            f"**{ratio.min():.2f}–{ratio.max():.2f}×** the uncompressed engine's tokens per second (lowest at "
            f"{worst[1]:,} tokens × {worst[2]} on {worst[0]}, highest at {best[1]:,} × {best[2]} on {best[0]}).")


FEW_REQUESTS_CARD = ("zipfusion_few_requests_h100.csv", "zipfusion_few_requests_engine_h100.csv")
"""The few-requests points' committed run on the paper's card (an H100; kernel timings, then the engine's), shown where
the chapter's own run has none of them."""


def few_requests_source(table: pd.DataFrame | None, engine: pd.DataFrame | None, folder):
    """``(table, engine)`` for the few-requests panel: the chapter's run where it has the points, else the committed
    run on the paper's card (:data:`FEW_REQUESTS_CARD` in ``folder``, None where that is missing too)."""
    from pathlib import Path

    def read(name):
        path = Path(folder) / name
        return pd.read_csv(path) if path.is_file() else None
    if table is None or "speedup_vs_flashinfer_tc" not in table or few_requests(table).empty:
        table = read(FEW_REQUESTS_CARD[0])
    if engine is None:
        engine = read(FEW_REQUESTS_CARD[1])
    return table, engine


def few_requests(table: pd.DataFrame, max_batch: int = 16) -> pd.DataFrame:
    """The few-requests panel (Llama-3.1-8B shape, batch <= ``max_batch``): rows (ctx, batch), one column per method
    of :data:`FEW_REQUESTS` with its speedup over FlashInfer TC from the same run (> 1: faster), and ``bytes bound``:
    FlashInfer TC's bytes over ours on the measured mix -- the speedup the bytes allow at FlashInfer's read rate."""
    t = table[(table["shape"] == SHAPE) & (table.batch <= max_batch)]
    t = t[~t.method.str.startswith("zipkv") | (t.kernel == "gluon")]
    t = t.assign(label=[FEW_REQUESTS.get((m, k)) for m, k in zip(t.method, t.kv_data)]).dropna(subset=["label"])
    grid = t.pivot_table(index=["ctx", "batch"], columns="label", values="speedup_vs_flashinfer_tc")
    grid = grid[[label for label in FEW_REQUESTS.values() if label in grid.columns]]
    fi = table[(table["shape"] == SHAPE) & (table.method == "flashinfer_tc")].groupby(["ctx", "batch"]).bytes_read.first()
    mix = t[t.label == FEW_REQUESTS[("zipkv_compressed", "measured mix")]].groupby(["ctx", "batch"]).bytes_read.first()
    grid["bytes bound"] = (fi / mix).reindex(grid.index)
    return grid


def few_requests_figure(grid: pd.DataFrame):
    """Grouped bars of :func:`few_requests`: speedup over FlashInfer TC per context x batch for each method, the
    bytes bound of ours on the real-KV mix as a tick over its bar, parity as a black line."""
    import matplotlib.pyplot as plt

    methods = [c for c in grid.columns if c != "bytes bound"]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    x = np.arange(len(grid))
    width = 0.8 / len(methods)
    for i, column in enumerate(methods):
        offset = (i - (len(methods) - 1) / 2) * width
        ax.bar(x + offset, grid[column], width, label=column)
        if column == FEW_REQUESTS[("zipkv_compressed", "measured mix")]:
            ax.scatter(x + offset, grid["bytes bound"], marker="_", s=120, color="black", zorder=3,
                       label="bytes bound, real-KV mix")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{ctx // 1024}K tokens\nbatch {b}" for ctx, b in grid.index])
    ax.set_ylabel("speedup over FlashInfer TC (×)")
    ax.set_xlabel("context length × batch (Llama-3.1-8B attention shape)")
    ax.set_ylim(0, max(1.6, float(grid.max().max()) + 0.3))
    ax.legend(fontsize=8, loc="upper center", ncol=4)
    ax.grid(axis="y", alpha=0.3)
    return fig


def few_requests_text(grid: pd.DataFrame, device: str) -> str:
    """What the few-requests panel shows, from :func:`few_requests` (``device``: the GPU of the run)."""
    mix = grid[FEW_REQUESTS[("zipkv_compressed", "measured mix")]]
    fp8 = grid.get(FEW_REQUESTS[("flashinfer_fp8", "any")])
    worst, best = mix.idxmin(), mix.idxmax()
    text = (f"With one to {grid.index.get_level_values('batch').max()} requests ({device}), ZipFusion on the real-KV mix "
            f"runs at **{mix.min():.2f}–{mix.max():.2f}×** FlashInfer TC's speed: slowest at "
            f"{worst[0] // 1024}K tokens × {worst[1]} ({mix[worst]:.2f}×, its bytes allow {grid['bytes bound'][worst]:.2f}×), "
            f"fastest at {best[0] // 1024}K × {best[1]}.")
    if fp8 is not None and fp8.notna().any():
        text += (f" FlashInfer's FP8 cache, which halves the bytes but rounds every value (its error: chapter \"Lossless "
                 f"12-bit against lossy 8-bit\"), runs at {fp8.min():.2f}–{fp8.max():.2f}× over the same points.")
    return text


def read_card(folder) -> pd.DataFrame | None:
    """The same benchmark on the paper's H100 (``<folder>/zipfusion_paper_card.csv``, chapter "On the paper's card"),
    None where it has not run."""
    path = Path(folder) / f"{PAPER_CARD}.csv"
    return pd.read_csv(path) if path.is_file() else None


def anchor_text(table: pd.DataFrame, pack: pd.DataFrame | None) -> str:
    """The anchor point (8192 × 64) against the paper's latencies and this project's own targets."""
    t = table[(table["shape"] == SHAPE) & (table.ctx == ZIPFUSION_PAPER.anchor_context)
              & (table.batch == ZIPFUSION_PAPER.anchor_batch)]

    def row(method, kernel, kv_data="all compressible"):
        sel = (t.method == method) & (t.kv_data == kv_data) & (t.kernel.fillna("–") == kernel)
        return t[sel].iloc[0]

    ours, fi = row("zipkv_compressed", "gluon"), row("flashinfer_tc", "–", "any")
    mix = row("zipkv_compressed", "gluon", "measured mix")
    unc, unc_triton = row("zipkv_uncompressed", "gluon"), row("zipkv_uncompressed", "triton")
    paper = pv.ZIPFUSION_ATTENTION_8192x64["Llama-3.1-8B"]
    roofline = ours.bytes_read / (ours.copy_bw_tbps * 1e12) * 1e6
    goal = PROJECT_TARGETS
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    text = (f"**At {ZIPFUSION_PAPER.anchor_context} tokens × batch {ZIPFUSION_PAPER.anchor_batch}** (all blocks "
            f"compressible, Gluon kernel): ours {ours.latency_us:.1f} µs, FlashInfer TC {fi.latency_us:.1f} µs, "
            f"{fi.latency_us / ours.latency_us:.3f}× (paper, {pv.ZIPFUSION_GPU}: {paper['flashinfer']} → {paper['zipfusion']} µs, "
            f"{paper['flashinfer'] / paper['zipfusion']:.2f}×). Ours reads {ours.bytes_read / 1e9:.3f} GB, "
            f"{100 * roofline / ours.latency_us:.0f} % of the compressed-bytes roofline at the measured copy bandwidth "
            f"({ours.copy_bw_tbps:.2f} TB/s). Uncompressed, the same kernel: {ours_pct(unc, fi)}; the Triton kernel: "
            f"{ours_pct(unc_triton, fi)}. *This project's own targets* (not the paper's): speedup ≥ "
            f"{goal.speedup_vs_flashinfer_tc:.2f}× {met(fi.latency_us / ours.latency_us >= goal.speedup_vs_flashinfer_tc)}, "
            f"measured mix ≥ {goal.mix_speedup_vs_flashinfer_tc:.2f}× {met(fi.latency_us / mix.latency_us >= goal.mix_speedup_vs_flashinfer_tc)} "
            f"({fi.latency_us / mix.latency_us:.3f}×), "
            f"≥ {100 * goal.roofline_fraction:.0f} % of the roofline {met(roofline / ours.latency_us >= goal.roofline_fraction)}, "
            f"uncompressed (Triton kernel) within {100 * goal.uncompressed_within:.0f} % of FlashInfer "
            f"{met(abs(unc_triton.latency_us / fi.latency_us - 1) <= goal.uncompressed_within)}")
    if pack is not None:
        text += (f", pack kernel ≥ {goal.pack_input_tbps:g} TB/s of input "
                 f"{met(pack.input_tbps.min() >= goal.pack_input_tbps)} ({pack.input_tbps.min():.2f} TB/s, slowest head_dim)")
    return text + "."


def anchor_targets(table: pd.DataFrame, pack: pd.DataFrame | None) -> pd.DataFrame:
    """This project's own targets at the anchor point (8192 x 64, Llama-3.1-8B shape, Gluon kernel), one row each:
    ``target`` (what), ``goal`` and ``ours`` (as text), ``met`` (bool) and ``margin`` (ours over the goal, >= 1 when
    met; for the uncompressed path (1 + allowed) / (1 + |difference|)); :func:`anchor_text` says each in prose."""
    t = table[(table["shape"] == SHAPE) & (table.ctx == ZIPFUSION_PAPER.anchor_context)
              & (table.batch == ZIPFUSION_PAPER.anchor_batch)]

    def row(method, kernel, kv_data="all compressible"):
        return t[(t.method == method) & (t.kv_data == kv_data) & (t.kernel.fillna("–") == kernel)].iloc[0]
    ours, fi = row("zipkv_compressed", "gluon"), row("flashinfer_tc", "–", "any")
    mix, unc = row("zipkv_compressed", "gluon", "measured mix"), row("zipkv_uncompressed", "triton")
    goal = PROJECT_TARGETS
    best, real = fi.latency_us / ours.latency_us, fi.latency_us / mix.latency_us
    roofline = ours.bytes_read / (ours.copy_bw_tbps * 1e12) * 1e6 / ours.latency_us
    off = unc.latency_us / fi.latency_us - 1
    rows = [("speedup over FlashInfer TC, every block compressible", f"≥ {goal.speedup_vs_flashinfer_tc:.2f}×",
             f"{best:.3f}×", best >= goal.speedup_vs_flashinfer_tc, best / goal.speedup_vs_flashinfer_tc),
            ("speedup over FlashInfer TC, measured mix", f"≥ {goal.mix_speedup_vs_flashinfer_tc:.2f}×", f"{real:.3f}×",
             real >= goal.mix_speedup_vs_flashinfer_tc, real / goal.mix_speedup_vs_flashinfer_tc),
            ("share of the compressed-bytes roofline", f"≥ {goal.roofline_fraction:.0%}", f"{roofline:.0%}",
             roofline >= goal.roofline_fraction, roofline / goal.roofline_fraction),
            ("uncompressed (Triton kernel) against FlashInfer TC", f"within {goal.uncompressed_within:.0%}",
             f"{off:+.1%}", abs(off) <= goal.uncompressed_within, (1 + goal.uncompressed_within) / (1 + abs(off)))]
    if pack is not None:
        tbps = float(pack.input_tbps.min())
        rows.append(("pack kernel, input read (slowest head size)", f"≥ {goal.pack_input_tbps:g} TB/s",
                     f"{tbps:.2f} TB/s", tbps >= goal.pack_input_tbps, tbps / goal.pack_input_tbps))
    return pd.DataFrame(rows, columns=["target", "goal", "ours", "met", "margin"])


def targets_figure(targets: pd.DataFrame):
    """Horizontal bars: each of this project's targets (:func:`anchor_targets`) as its ``margin``, ours over its goal
    (1 = the goal; right of it: met)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(targets) + 0.9))
    y = np.arange(len(targets))[::-1]
    margins = targets.margin.tolist()
    ax.barh(y, margins, color=["tab:green" if m else "tab:orange" for m in targets.met])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(y, targets.target)
    ax.set_xlabel("ours ÷ goal (≥ 1: met)")
    ax.set_xlim(min(0.8, min(margins) - 0.05), max(1.2, max(margins) + 0.05))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def targets_table(targets: pd.DataFrame):
    """:func:`anchor_targets` formatted (a Styler): met or missed in words."""
    view = targets.drop(columns="margin").assign(met=targets.met.map({True: "met", False: "missed"}))
    return view.rename(columns={"target": "this project's target", "goal": "goal", "ours": "ours", "met": ""}) \
        .style.hide(axis="index")


def anchor_verdict(table: pd.DataFrame, pack: pd.DataFrame | None) -> str:
    """The appendix's verdict: how many of this project's own targets were met at the anchor point (the table of
    :func:`anchor_targets` below it says which)."""
    targets = anchor_targets(table, pack)
    device = str(table.device.iloc[0]) if "device" in table else "the GPU"
    met = int(targets.met.sum())
    return (f"At {ZIPFUSION_PAPER.anchor_context} tokens × {ZIPFUSION_PAPER.anchor_batch} requests (Llama-3.1-8B "
            f"shape, {device}) this project met {met} of its own {len(targets)} targets for the fused kernel (not the "
            f"paper's claims: those are judged in the chapter \"Decode attention latency\"); why each missed one "
            f"falls short is below.")


BASELINES = ("flashinfer_tc", "flashinfer_cuda", "sdpa")


def _anchor(table: pd.DataFrame, shape: str) -> pd.DataFrame:
    return table[(table["shape"] == shape) & (table.ctx == ZIPFUSION_PAPER.anchor_context)
                 & (table.batch == ZIPFUSION_PAPER.anchor_batch)]


def _best(t: pd.DataFrame, kv_data: str):
    """zipkv's fastest compressed kernel row on ``kv_data`` at one point (None if it was not run)."""
    rows = t[(t.method == "zipkv_compressed") & (t.kv_data == kv_data)]
    return rows.loc[rows.latency_us.idxmin()] if len(rows) else None


def _bar(ratio: float, bar: float) -> str:
    return f"**{ratio:.3f}×** (target ≥ {bar:.2f}×: " + ("met)" if ratio >= bar else f"missed by {bar - ratio:.3f}×)")


def read_ncu(folder):
    """The committed Nsight Compute report in ``folder`` (``zipfusion_decode_ncu.txt``, ``python -m zipkv bench
    ncu``) parsed (:func:`zipkv.study.nsight_report.parse`), or None where there is none."""
    from zipkv.study import nsight_report
    from zipkv.bench import nsight

    path = Path(folder) / "zipfusion_decode_ncu.txt"
    if not path.is_file():
        return None
    return nsight_report.parse(path.read_text(), nsight.NCU_TARGETS, nsight.NCU_KERNELS, nsight.NCU_STALLS)


def _small_shape_why(ncu, small_row, big_row, small_fi, big_fi, fit=None) -> str:
    """Why the SmolLM2-shape kernel reads slower than the Llama-shape one, from the Nsight Compute report ``ncu``
    (:func:`read_ncu`; empty where it has no SmolLM2-shape kernels), the two shapes' all-compressible rows of
    the latency table (their split counts), FlashInfer TC's rows at both shapes and, where given, the context
    sweep's fit (:func:`context_fit`), which sets the fixed cost apart from the read rate."""
    small, big = "SmolLM2 decode all compressed", "decode all compressed"
    if ncu is None or small not in ncu.metrics.columns:
        return ""
    v = ncu.value

    def units(row, shape):                     # units (pages; head_dim 64: page pairs) each program streams
        pages = row.ctx // fmt.PAGE_TOKENS
        return (pages if shape.head_dim == 128 else pages // 2) / row.num_splits
    n_small, n_big = units(small_row, EMBEDDED_SHAPE), units(big_row, PAPER_MODELS["Llama-3.1-8B-Instruct"])
    return (f" Why, from Nsight Compute (section \"Inside the kernels\"): at this shape "
            f"DRAM is {v('DRAM Throughput', small):.0f} % busy under the all-compressed kernel and "
            f"{v('DRAM Throughput', 'SmolLM2 decode uncompressed'):.0f} % under the uncompressed one, against "
            f"{v('DRAM Throughput', big):.0f} % and {v('DRAM Throughput', 'decode uncompressed'):.0f} % at the Llama "
            "shape: the loss comes with the shape, not with the rebuild. Both shapes' programs fill about the same "
            f"share of the warp slots ({v('Achieved Occupancy', small):.0f} % and {v('Achieved Occupancy', big):.0f} %), "
            f"but here each streams {n_small:.0f} units (a unit: a page pair) against {n_big:.0f} (a page) at the Llama "
            f"shape, so a program's start (its first loads in flight) and the launch's end weigh {n_big / n_small:.0f} "
            "times as much" + _fixed_cost_clause(fit) + ". FlashInfer's paged kernel loses at this shape too "
            f"({small_fi.tbps:.2f} TB/s against {big_fi.tbps:.2f} at the Llama shape); SDPA, the baseline here, reads a "
            "contiguous cache without a page table.")


def _fixed_cost_clause(fit) -> str:
    """The SmolLM2 shape's fixed cost and read rate against its baseline from the context sweep's fit, as a
    clause ("" without a fit)."""
    pair = None if fit is None else fit_pair(fit, "smollm2-135m")
    if pair is None:
        return " -- the likely cause, not isolated here"
    o, b = pair
    return (f"; the context sweep (section \"Fixed and per-token cost\") separates the fixed cost from the read "
            "rate: each launch costs "
            f"{_more_or_less(o.fixed_us - b.fixed_us)} than {METHOD_LABELS[b.method]}'s, and per token ours reads at "
            f"{o.stream_tbps / b.stream_tbps:.0%} of its rate ({b.us_per_1k / o.us_per_1k:.3f}× faster per token, "
            f"the bytes allow {b.mb_per_1k / o.mb_per_1k:.3f}×)")


def targets_text(table: pd.DataFrame, ncu=None, fit=None, ceiling=None, timeline=None) -> str:
    """Issue 13's bars at the anchor point, each with the measured ratio, by how much it is missed and why,
    from the run's own bytes and bandwidths (Llama-3.1-8B shape; SmolLM2 shape against its fastest baseline, and
    where ``ncu`` (:func:`read_ncu`) profiled that shape, its DRAM and occupancy), where ``fit``
    (:func:`context_fit`) is given, the gain per token that no context can exceed, where ``ceiling``
    (:func:`read_ceiling`) holds a run on the table's GPU, what removing every descriptor load gives, and where
    ``timeline`` (:func:`read_timeline`) does, the static split's tail."""
    goal = PROJECT_TARGETS
    t = _anchor(table, SHAPE)
    fi = t[t.method == "flashinfer_tc"].iloc[0]
    comp, mix = _best(t, "all compressible"), _best(t, "measured mix")
    copy = float(fi.copy_bw_tbps)
    r_comp, r_mix = fi.latency_us / comp.latency_us, fi.latency_us / mix.latency_us
    need = goal.speedup_vs_flashinfer_tc * comp.bytes_read / (fi.latency_us * 1e-6) / 1e12
    lines = [f"- **Llama-3.1-8B shape, all blocks compressible** ({comp.kernel} kernel): {_bar(r_comp, goal.speedup_vs_flashinfer_tc)}. "
             f"It reads {comp.bytes_read / 1e9:.3f} GB at {comp.tbps:.2f} TB/s ({comp.frac_copy_bw:.0%} of the copy bandwidth "
             f"measured in the run, {copy:.2f} TB/s), FlashInfer TC {fi.bytes_read / 1e9:.3f} GB at {fi.tbps:.2f} TB/s: at "
             f"equal bandwidth the bytes allow {fi.bytes_read / comp.bytes_read:.3f}×, and the target would need "
             f"{need:.2f} TB/s ({need / copy:.0%} of the copy bandwidth; {_fastest_clause(t, 'tbps', need)})."
             + _per_token_clause(fit) + _ceiling_clause(ceiling, fi.device) + _tail_clause(timeline, fi.device)]
    others = speedups(table).filter(like="measured mix").max(axis=1).drop(
        (ZIPFUSION_PAPER.anchor_context, ZIPFUSION_PAPER.anchor_batch), errors="ignore")
    mix_bw = mix.bytes_read / (fi.latency_us / goal.mix_speedup_vs_flashinfer_tc * 1e-6) / 1e12
    lines.append(
        f"- **Llama-3.1-8B shape, measured mix** ({mix.kernel} kernel; {mix.frac_mixed_pages_k:.0%} of key and "
        f"{mix.frac_mixed_pages_v:.0%} of value page-heads hold both compressed and raw blocks): "
        f"{_bar(r_mix, goal.mix_speedup_vs_flashinfer_tc)}; the bytes allow {fi.bytes_read / mix.bytes_read:.3f}× at equal "
        f"bandwidth. It reads {mix.bytes_read / 1e9:.3f} GB at {mix.tbps:.2f} TB/s, {mix.tbps / comp.tbps:.0%} of the "
        f"all-compressible kernel's {comp.tbps:.2f} TB/s (the target needs {mix_bw:.2f} TB/s)"
        + (": the per-page work of pages holding both kinds, not their bytes, sets its time. " if mix.tbps < 0.97 * comp.tbps
           else ". ") + "At the other points: "
        + (f"{others.min():.2f}–{others.max():.2f}× (target ≥ {goal.mix_speedup_other_points:.2f}×: "
           + ("met)." if others.min() >= goal.mix_speedup_other_points else
              f"missed at {(others < goal.mix_speedup_other_points).sum()} of {len(others)}: "
              + ", ".join(f"{c} × {b}" for c, b in others[others < goal.mix_speedup_other_points].index) + ").")
           if len(others) else "not run.")
        + (_wave_text(table, *others.idxmin()) if len(others) else ""))
    s = _anchor(table, "smollm2-135m")
    if len(s):
        base = s[s.method.isin(BASELINES)]
        fastest = base.loc[base.latency_us.idxmin()]
        sc, sm = _best(s, "all compressible"), _best(s, "measured mix")
        lines.append(
            f"- **SmolLM2 shape** ({EMBEDDED_SHAPE.q_heads} query / {EMBEDDED_SHAPE.kv_heads} KV heads, head_dim "
            f"{EMBEDDED_SHAPE.head_dim}): the fastest baseline is "
            f"{METHOD_LABELS[fastest.method]} ({fastest.latency_us:.1f} µs, {fastest.tbps:.2f} TB/s). All blocks compressible "
            f"({sc.kernel} kernel, {sc.latency_us:.1f} µs, {sc.tbps:.2f} TB/s): "
            f"{_bar(fastest.latency_us / sc.latency_us, goal.smollm2_speedup_vs_fastest)}; measured mix ({sm.kernel} kernel, "
            f"{sm.latency_us:.1f} µs, {sm.tbps:.2f} TB/s): {_bar(fastest.latency_us / sm.latency_us, goal.smollm2_mix_speedup_vs_fastest)}. "
            f"The bytes allow {fastest.bytes_read / sc.bytes_read:.3f}× and {fastest.bytes_read / sm.bytes_read:.3f}× at the "
            f"baseline's bandwidth.")
        why = _small_shape_why(ncu, sc, comp, s[s.method == "flashinfer_tc"].iloc[0], fi, fit)
        if why:                                              # a sub-item: the shape's reason, from the profiles
            lines.append("  -" + why)
    return "\n".join(lines)


def targets_section(table: pd.DataFrame, folder) -> str:
    """:func:`targets_text` under its heading, with the Nsight report and the context sweep's fit committed in
    ``folder`` (``results/paper``; each left out where absent)."""
    return ("**This project's targets at the anchor point, met and missed (why, from measurements):**\n\n"
            + targets_text(table, read_ncu(folder), read_context_fit(folder), read_ceiling(folder),
                           read_timeline(folder)))


def _fastest_clause(rows: pd.DataFrame, rate: str, need_tbps: float) -> str:
    """``need_tbps`` against the fastest read rate (column ``rate``, TB/s) of any method among ``rows`` (one point of a
    run, or one shape's context fit), as a clause."""
    top = rows.loc[rows[rate].idxmax()]
    text = (f"{need_tbps / top[rate]:.0%} of the fastest rate any kernel reached in the same run, "
            f"{METHOD_LABELS[top.method]}'s {top[rate]:.2f} TB/s" + (" on a contiguous cache" if top.method == "sdpa" else ""))
    return text + (": the target asks the compressed pages to be read faster than anything else reads its bytes"
                   if need_tbps > top[rate] else "")


def _ceiling_clause(ceiling, device: str) -> str:
    """The ceiling probe's run on ``device`` (the latest; section "The all-compressible target's ceiling") at the anchor
    point as a sentence: the kernel with no descriptor loads against FlashInfer TC, and what the fitted lines give it
    at an empty launch's fixed cost ("" without such a run)."""
    runs = None if ceiling is None else ceiling[ceiling.device.str.startswith(device.split(" (")[0])]
    if runs is None or not len(runs):
        return ""
    at, _, ideal = ceiling_run(runs[runs.date == runs.date.max()])
    return (f" With every descriptor load removed (a probe, section \"The all-compressible target's ceiling\") the kernel "
            f"gives {at['zipkv_compressed_no_descriptors']:.3f}× ({at['zipkv_compressed']:.3f}× as committed, same run); "
            f"with no descriptor bytes and an empty launch's fixed cost the fitted lines give {ideal:.3f}×.")


def _tail_clause(timeline, device: str) -> str:
    """The timeline probe's latest run on ``device`` (section "Where the launch's time goes") at the anchor point as a
    sentence: the static split's tail and what the launch would give without it ("" without such a run, or without
    FlashInfer TC timed in it)."""
    at = None if timeline is None else tail_at(timeline, device)
    if at is None or at[2] is None:
        return ""
    comp, _, fi, balanced = at
    bar = PROJECT_TARGETS.speedup_vs_flashinfer_tc
    return (f" The launch's tail (section \"Where the launch's time goes\"): the slowest program ends its page loop "
            f"{comp.loop_end_max_us - comp.loop_end_p50_us:.1f} µs after the median one; with every loop ending at the "
            f"median, the timeline run's launch would be {fi / balanced:.3f}× (as it ran, {fi / comp.committed_us:.3f}×)"
            + (": the static split's tail alone keeps the kernel under the target." if fi / balanced >= bar else
               ", still under the target.") + _tail_attempts(timeline))


def _tail_attempts(timeline: dict) -> str:
    """The committed attempts at the tail (the balanced schedule, the L2 assist) that gained nothing in any run, as a
    sentence ("" if none, or if one of them was faster somewhere)."""
    def cards(frame):
        return ", ".join(sorted({name.split(" ")[1] if name.startswith("NVIDIA ") else name for name in frame.device}))

    failed = []
    runs = timeline["balanced"].groupby(["device", "commit", "date"])
    if len(runs) and all((run.dropna(subset=["chunks"]).latency_us
                          > run[run.variant == "committed"].latency_us.iloc[0]).all() for _, run in runs):
        failed.append(f"a balanced schedule ({cards(timeline['balanced'])})")
    if len(timeline["assist"]) and _assist_closing(timeline["assist"]):
        failed.append(f"L2 prefetches for the later split ({cards(timeline['assist'])})")
    if len(timeline["short"]) and _short_closing(timeline["short"]):
        failed.append(f"short programs left to the block scheduler ({cards(timeline['short'])})")
    listed = ", ".join(failed[:-1]) + (" and " if len(failed) > 1 else "") + (failed[-1] if failed else "")
    return f" Tried against it, {listed} gained nothing (same section)." if failed else ""


def _per_token_clause(fit) -> str:
    """At the Llama-3.1-8B shape, the all-compressed kernel's gain per token over FlashInfer TC from the context
    sweep's fit, against the all-compressible bar ("" without a fit)."""
    pair = None if fit is None else fit_pair(fit, SHAPE)
    if pair is None:
        return ""
    o, b = pair
    per_token, bar = b.us_per_1k / o.us_per_1k, PROJECT_TARGETS.speedup_vs_flashinfer_tc
    text = (f" Per token, with each launch's fixed cost set apart (section \"Fixed and per-token cost\"), ours is "
            f"{per_token:.3f}× faster")
    if per_token >= bar:
        return text + "."
    if o.fixed_us <= b.fixed_us:    # the ratio falls toward the per-token gain: short contexts may pass the bar
        return text + f", and as contexts grow the ratio falls toward that (ours has the smaller fixed cost), below {bar:.2f}×."
    return text + f", and the ratio rises toward that as contexts grow: no context reaches {bar:.2f}×."


def _wave_text(table: pd.DataFrame, ctx: int, batch: int) -> str:
    """Why the Gluon kernel is slow on the measured mix at (ctx, batch), from residency: the programs its plan
    launched against those the H200 holds at once (:func:`zipkv.kernels.decode_mma.resident_per_sm` of its mixed
    specialisation), in waves, its read rate, and the split count the plan takes there now
    (:func:`zipkv.kernels.decode_attention.gluon_split_count`) where that is not what ran."""
    from zipkv import paged
    from zipkv.kernels import decode_mma, occupancy
    from zipkv.kernels.decode_attention import gluon_split_count

    rows = table[(table["shape"] == SHAPE) & (table.ctx == ctx) & (table.batch == batch) & (table.kernel == "gluon")
                 & (table.method == "zipkv_compressed") & (table.kv_data == "measured mix")]
    if not len(rows):
        return ""
    row = rows.iloc[0]
    kv_heads = PAPER_MODELS["Llama-3.1-8B-Instruct"].kv_heads
    sms, splits = occupancy.H200_SM["sms"], int(row.num_splits)
    resident = decode_mma.resident_per_sm(paged.MIXED, int(row.stages)) * sms
    programs = batch * kv_heads * splits
    now = gluon_split_count(paged.MIXED, 128, batch * kv_heads, ctx // 16, row.device, sms)
    return (f" The slowest, {ctx} × {batch} ({row.speedup_vs_flashinfer_tc:.2f}×), ran {splits} split"
            f"{'s' if splits > 1 else ''}: {programs:,} one-warp programs of {ctx // 16 // splits} pages each on the "
            f"{resident:,} the H200 holds at once (\"Inside the kernels\"), {programs / resident:.2f} waves, reading "
            f"at {row.tbps:.2f} TB/s; with equal work per program, one split leaves slots empty and more splits add a "
            f"part-filled wave (the other counts: \"Split count and ring depth\" below)."
            + (f" The plan now takes {now} split{'s' if now > 1 else ''} there; not yet timed." if now != splits else ""))


def ours_pct(row, reference) -> str:
    """A timing ``row`` in µs and its difference from the ``reference`` row (FlashInfer TC) in per cent."""
    return f"{row.latency_us:.1f} µs ({100 * (row.latency_us / reference.latency_us - 1):+.1f} % against FlashInfer TC)"


COLUMN_WORDS = {"ctx": "context (tokens)", "kv_data": "KV data", "latency_us": "latency (µs)", "bytes_read": "bytes read",
                "tbps": "TB/s", "frac_copy_bw": "of copy bandwidth", "speedup_vs_flashinfer_tc": "speedup over FlashInfer TC",
                "plan_vs_fastest": "plan's split count over the fastest", "num_splits": "splits", "stages": "ring depth",
                "frac_compressed_k": "key blocks compressed", "frac_compressed_v": "value blocks compressed",
                "fixed_us": "fixed cost (µs)", "us_per_1k": "µs per 1K tokens", "mb_per_1k": "MB per 1K tokens",
                "stream_tbps": "streams at (TB/s)", "bytes_bound_us": "bytes bound (µs)", "max_resid_us": "largest residual (µs)",
                "n_contexts": "contexts fitted", "cost_per_byte": "time per byte over FlashInfer TC's",
                "three_vs_two_slots": "three ring slots over two"}
"""Column names of the appendix's tables as a reader reads them (others: underscores as spaces)."""


def _in_words(name):
    return COLUMN_WORDS.get(name, name.replace("_", " ")) if isinstance(name, str) else name


def readable(styler):
    """A table's Styler with its column headers and index names in words (:data:`COLUMN_WORDS`)."""
    styler.data.index.names = [_in_words(n) for n in styler.data.index.names]
    return styler.format_index(_in_words, axis=1)


def full_table(table: pd.DataFrame):
    """Every timing with its bytes and bandwidth, formatted (a Styler)."""
    view = table.assign(method=table.method.map(METHOD_LABELS), kernel=table.kernel.fillna("–"))
    view = view[["shape", "ctx", "batch", "kv_data", "method", "kernel", "latency_us", "bytes_read", "tbps",
                 "frac_copy_bw", "speedup_vs_flashinfer_tc"]]
    return view.style.format({"latency_us": "{:.1f}", "bytes_read": "{:.3e}", "tbps": "{:.2f}", "frac_copy_bw": "{:.0%}",
                              "speedup_vs_flashinfer_tc": "{:.2f}×"}, na_rep="–").hide(axis="index").pipe(readable)


def _sweep_rows(sweep: pd.DataFrame) -> pd.DataFrame:
    """The zipkv rows of a :func:`zipkv.bench.mix_sweep` table, with ``cost_per_byte`` = latency over the bytes bound
    (1: FlashInfer TC's read rate)."""
    z = sweep[sweep.method == "zipkv_compressed"].copy()
    z["cost_per_byte"] = z.latency_us / z.bytes_bound_us
    return z


def mix_figure(sweep: pd.DataFrame):
    """Latency against bytes read for each share of compressed blocks (filled: the plan's routing, open: every
    page through the mixed path), FlashInfer TC's point, and the line of FlashInfer TC's read rate."""
    import matplotlib.pyplot as plt

    z = _sweep_rows(sweep)
    fi = sweep[sweep.method == "flashinfer_tc"].iloc[0]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    mb = np.linspace(0, 1.05 * fi.bytes_read, 50)
    ax.plot(mb / 1e6, mb / fi.bytes_read * fi.latency_us, color="gray", lw=1, label="FlashInfer TC's read rate")
    ax.scatter([fi.bytes_read / 1e6], [fi.latency_us], color="black", marker="s", label="FlashInfer TC (raw cache)")
    for routing, style, label in (("auto", dict(color="tab:blue"), "the plan's routing"),
                                  ("device", dict(facecolors="none", edgecolors="tab:red"),
                                   "every page through the mixed path")):
        rows = z[z.routing == routing]
        ax.scatter(rows.bytes_read / 1e6, rows.latency_us, label=f"zipkv Gluon, {label}", **style)
    auto = z[z.routing == "auto"].sort_values("bytes_read")
    for i, r in enumerate(auto.itertuples()):      # numbered, the key in a box: shares with equal bytes sit together
        ax.annotate(str(i + 1), (r.bytes_read / 1e6, r.latency_us), fontsize=7, textcoords="offset points",
                    xytext=((5, 3), (5, -10), (-12, 3), (-12, -10))[i % 4])
    ax.text(0.98, 0.03, "\n".join(f"{i + 1}: {kv}" for i, kv in enumerate(auto.kv_data)), transform=ax.transAxes,
            ha="right", va="bottom", fontsize=7, bbox=dict(facecolor="white", edgecolor="lightgray"))
    ax.set_xlim(0.6 * z.bytes_read.min() / 1e6, 1.08 * fi.bytes_read / 1e6)
    ax.set_ylim(0.6 * z.latency_us.min(), 1.15 * max(z.latency_us.max(), fi.latency_us))
    ax.set_xlabel("bytes read per call (MB)")
    ax.set_ylabel("latency (µs, median)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def mix_text(sweep: pd.DataFrame | None) -> str:
    """What the sweep shows: each share's latency against its bytes at FlashInfer TC's read rate, and the commit
    and date it ran at (a sweep is committed on its own and may predate the chapter's main table); without a
    sweep (None), that one needs a GPU."""
    if sweep is None:
        return "The compressed-share sweep needs a GPU and none is committed yet."
    z = _sweep_rows(sweep)
    auto, dev = z[z.routing == "auto"].set_index("kv_data"), z[z.routing == "device"].set_index("kv_data")
    fi = sweep[sweep.method == "flashinfer_tc"].iloc[0]
    first = sweep.iloc[0]
    parts = [f"{d}: {r.latency_us:.0f} µs, {r.cost_per_byte:.3f}× its bytes' time at FlashInfer's rate"
             + (f" ({dev.loc[d].latency_us:.0f} µs through the mixed path)" if d in dev.index else "")
             for d, r in auto.iterrows()]
    worst, best = auto.cost_per_byte.idxmax(), auto.cost_per_byte.idxmin()
    slow = auto[auto.cost_per_byte > 1].index.tolist()
    ran = (f"Measured on the {first.device} at commit {first.commit} ({first.date}). "
           if {"commit", "date"} <= set(sweep.columns) else "")
    return (ran + f"At {first.ctx} tokens × batch {first.batch} ({first['shape']} shape; FlashInfer TC "
            f"{fi.latency_us:.0f} µs, {fi.tbps:.2f} TB/s, same run) -- " + "; ".join(parts) + ". "
            f"Per byte the kernel is dearest at {worst} ({auto.loc[worst].cost_per_byte:.3f}×) and cheapest at {best} "
            f"({auto.loc[best].cost_per_byte:.3f}×); "
            + (f"where it is above 1 ({', '.join(slow)}) it gives back part of what the smaller pages save."
               if slow else "it reads its bytes at least as fast as FlashInfer reads raw ones at every share."))


def mix_table(sweep: pd.DataFrame):
    """The sweep's zipkv rows, formatted (a Styler)."""
    z = _sweep_rows(sweep)[["kv_data", "routing", "frac_compressed_k", "frac_compressed_v", "latency_us",
                            "bytes_read", "tbps", "bytes_bound_us", "cost_per_byte", "speedup_vs_flashinfer_tc"]]
    return z.style.format({"frac_compressed_k": "{:.1%}", "frac_compressed_v": "{:.1%}", "latency_us": "{:.1f}",
                           "bytes_read": "{:.3e}", "tbps": "{:.2f}", "bytes_bound_us": "{:.1f}",
                           "cost_per_byte": "{:.2f}×", "speedup_vs_flashinfer_tc": "{:.2f}×"}).hide(axis="index").pipe(readable)


SWEEPS = ("zipfusion_split_sweep.csv",)
"""The committed H200 sweep of the Gluon kernel's split count and ring depth (``bench attention --splits ...
--stages 2 3``) that :func:`split_sweep` reads."""
CONTEXT_SWEEP = "zipfusion_latency_context_sweep.csv"
"""The committed context sweep (``bench attention --contexts 1024 ... 16384 --batches 64 --kernels gluon``, both
shapes) that :func:`context_fit` reads."""


def read_sweeps(folder) -> list[pd.DataFrame]:
    """:data:`SWEEPS` from ``folder`` (``results/paper``)."""
    return [pd.read_csv(Path(folder) / name) for name in SWEEPS]


def split_sweep(sweeps: list[pd.DataFrame]) -> pd.DataFrame:
    """The Gluon kernel's split counts and ring depths against the plan's choice, from committed sweeps
    (``bench attention --splits ... --stages 2 3``, each with its ``commit``): one row per run and point (shape,
    ctx, batch, kv_data, method), ``stages`` (the ring depth the committed tuned options launch that point's
    specialisation with), columns ``"<s> splits"`` (µs at that depth), ``fastest`` (split count), ``plan`` (what
    :func:`zipkv.kernels.decode_attention.gluon_split_count` takes now with the committed tuned options on the
    run's GPU), ``plan_vs_fastest`` (latency ratio; NaN where the plan's count was not timed) and, where both
    depths were timed, ``three_vs_two_slots`` (each depth's fastest split, 3 slots over 2)."""
    from zipkv import paged
    from zipkv.bench.attention import ATTENTION_SHAPES
    from zipkv.kernels import decode_mma, occupancy
    from zipkv.kernels.decode_attention import gluon_split_count

    rows = []
    z = pd.concat(sweeps)
    z = z[z.method.str.startswith("zipkv") & (z.kernel == "gluon")]
    keys = ["commit", "shape", "ctx", "batch", "kv_data", "method"]
    for key, g in z.groupby(keys, sort=False):
        point = dict(zip(keys, key))
        shape = ATTENTION_SHAPES[point["shape"]]
        kind = (paged.RAW if point["method"] == "zipkv_uncompressed"
                else paged.COMPRESSED if point["kv_data"] == "all compressible" else paged.MIXED)
        gpu = g.device.iloc[0]
        depth = decode_mma.launch_config(paged.PAGE_KINDS[kind], gpu, shape.head_dim)["stages"]
        timed = g[g.stages == depth].groupby("num_splits").latency_us.min()
        planned = gluon_split_count(kind, shape.head_dim, point["batch"] * shape.kv_heads, point["ctx"] // 16,
                                    gpu, occupancy.H200_SM["sms"], group=shape.q_heads // shape.kv_heads)
        row = {**point, "stages": depth, **{f"{int(s)} splits": us for s, us in timed.items()},
               "fastest": int(timed.idxmin()), "plan": planned,
               "plan_vs_fastest": timed.get(planned, float("nan")) / timed.min()}
        if {2, 3} <= set(g.stages):
            row["three_vs_two_slots"] = g[g.stages == 3].latency_us.min() / g[g.stages == 2].latency_us.min()
        rows.append(row)
    out = pd.DataFrame(rows)
    splits = sorted((c for c in out.columns if c.endswith(" splits")), key=lambda c: int(c.split()[0]))
    return out[keys + ["stages"] + splits
               + [c for c in ("fastest", "plan", "plan_vs_fastest", "three_vs_two_slots") if c in out]]


def split_text(table: pd.DataFrame) -> str:
    """What :func:`split_sweep`'s table shows: how often the plan's split count is the fastest timed, by how much
    it loses elsewhere, and whether three ring slots ever beat two."""
    timed = table.dropna(subset=["plan_vs_fastest"])
    worst = timed.loc[timed.plan_vs_fastest.idxmax()]
    name = lambda r: f"{r['shape']} {r.ctx} × {r.batch}, {r.kv_data}"      # noqa: E731
    splits = table[[c for c in table.columns if c.endswith(" splits")]]
    spread = splits.max(axis=1) / splits.min(axis=1)
    widest = table.loc[spread.idxmax()]
    text = (f"The split count alone moves latency by up to {spread.max():.2f}× (slowest over fastest count timed, "
            f"{name(widest)}). ")
    text += (f"At {int((timed.plan == timed.fastest).sum())} of the {len(timed)} timed points the plan's split count is "
            f"the fastest one timed; the most it loses is {worst.plan_vs_fastest - 1:.1%} ({name(worst)}: "
            f"{worst.plan} splits against {worst.fastest}).")
    if len(table) > len(timed):
        text += f" At {len(table) - len(timed)} point(s) the plan's count was not among those timed."
    if "three_vs_two_slots" in table and table.three_vs_two_slots.notna().any():
        slots = table.dropna(subset=["three_vs_two_slots"])
        best, worst = (slots.loc[slots.three_vs_two_slots.idxmin()], slots.loc[slots.three_vs_two_slots.idxmax()])
        wins = int((slots.three_vs_two_slots < 1).sum())
        text += (f" Each at its fastest split, three ring slots take {best.three_vs_two_slots:.3f}–"
                 f"{worst.three_vs_two_slots:.3f}× two slots' time: faster at {wins} of {len(slots)} points "
                 f"(most at {name(best)}), slower at the others (most at {name(worst)}).")
    return text


def split_table(table: pd.DataFrame):
    """:func:`split_sweep`'s table, formatted (a Styler)."""
    splits = [c for c in table.columns if c.endswith(" splits")]
    view = table.assign(method=table.method.map(METHOD_LABELS))
    return view.style.format({**{c: "{:.1f}" for c in splits}, "plan_vs_fastest": "{:.3f}×",
                              "three_vs_two_slots": "{:.3f}×"}, na_rep="–").hide(axis="index").pipe(readable)


def read_context_fit(folder):
    """:func:`context_fit` of :data:`CONTEXT_SWEEP` in ``folder`` (``results/paper``), or None where there is none."""
    path = Path(folder) / CONTEXT_SWEEP
    return context_fit(pd.read_csv(path)) if path.is_file() else None


def context_fit(sweep: pd.DataFrame) -> pd.DataFrame:
    """Each method's latency over a context sweep at one batch (:data:`CONTEXT_SWEEP`) fitted by least squares as
    ``fixed_us + us_per_1k * ctx / 1024``, and its bytes alike: one row per (shape, kv_data, method) with
    ``fixed_us`` (what a launch costs beyond its reads: start, merge, tail), ``us_per_1k`` (µs per 1024 tokens of
    every request), ``mb_per_1k`` (MB read per 1024 tokens), ``stream_tbps`` (the two slopes' ratio: the read rate
    once the fixed cost is set apart), ``max_resid_us`` (largest distance of a measured point from the line) and
    the run's ``batch``, ``contexts`` (their range), ``n_contexts``, ``commit``."""
    rows = []
    for (shape, data, method), g in sweep.groupby(["shape", "kv_data", "method"], sort=False):
        x = g.ctx.to_numpy() / 1024
        us_per_1k, fixed_us = np.polyfit(x, g.latency_us.to_numpy(), 1)
        mb_per_1k = np.polyfit(x, g.bytes_read.to_numpy() / 1e6, 1)[0]
        rows.append(dict(shape=shape, kv_data=data, method=method, batch=int(g.batch.iloc[0]),
                         contexts=f"{g.ctx.min()}–{g.ctx.max()}", n_contexts=len(g), fixed_us=fixed_us,
                         us_per_1k=us_per_1k, mb_per_1k=mb_per_1k, stream_tbps=mb_per_1k / us_per_1k,
                         max_resid_us=float(np.abs(g.latency_us - fixed_us - us_per_1k * x).max()),
                         commit=g.commit.iloc[0]))
    return pd.DataFrame(rows)


def line_at(row, ctx: int) -> float:
    """A :func:`context_fit` row's fitted latency (µs) at ``ctx`` tokens: ``fixed_us + us_per_1k * ctx / 1024``."""
    return row.fixed_us + row.us_per_1k * ctx / 1024


def _more_or_less(us: float) -> str:
    return f"{abs(us):.1f} µs {'more' if us > 0 else 'less'}"


def fit_pair(fit: pd.DataFrame, shape: str, anchor_ctx: int = ZIPFUSION_PAPER.anchor_context):
    """The all-compressed kernel's and its baseline's rows of :func:`context_fit` at ``shape`` (the baseline of
    issue 13's bars: FlashInfer TC at the Llama-3.1-8B shape, elsewhere the fastest baseline at ``anchor_ctx``),
    or None where the sweep lacks either."""
    f = fit[fit["shape"] == shape]
    ours, base = f[f.method == "zipkv_compressed"], f[f.method.isin(BASELINES)]
    if not len(ours) or not len(base):
        return None
    at = line_at(base, anchor_ctx)
    return ours.iloc[0], (base[base.method == "flashinfer_tc"].iloc[0] if shape == SHAPE else base.loc[at.idxmin()])


def context_text(fit: pd.DataFrame, anchor_ctx: int = ZIPFUSION_PAPER.anchor_context) -> str:
    """What :func:`context_fit` says of the all-compressed kernel against each shape's baseline
    (:func:`fit_pair`): its gain per token against the bytes' ratio, its fixed cost, what the two give at
    ``anchor_ctx``, and at the Llama shape whether any context could reach the all-compressible bar."""
    parts = []
    for shape in fit["shape"].unique():
        pair = fit_pair(fit, shape, anchor_ctx)
        if pair is None:
            continue
        o, b = pair
        per_token = b.us_per_1k / o.us_per_1k
        label = "Llama-3.1-8B" if shape == SHAPE else "SmolLM2" if shape == "smollm2-135m" else shape
        text = (f"**{label} shape**: the all-compressed kernel costs {o.fixed_us:.1f} µs + {o.us_per_1k:.2f} µs per 1K "
                f"tokens, {METHOD_LABELS[b.method]} {b.fixed_us:.1f} + {b.us_per_1k:.2f}; per token ours is "
                f"**{per_token:.3f}×** faster (the bytes allow {b.mb_per_1k / o.mb_per_1k:.3f}×: it streams at "
                f"{o.stream_tbps:.2f} TB/s, {o.stream_tbps / b.stream_tbps:.0%} of the baseline's {b.stream_tbps:.2f}), "
                f"and a launch costs {_more_or_less(o.fixed_us - b.fixed_us)} than the baseline's: at {anchor_ctx} tokens "
                f"the lines give {line_at(b, anchor_ctx) / line_at(o, anchor_ctx):.3f}×.")
        if shape == SHAPE:
            bar = PROJECT_TARGETS.speedup_vs_flashinfer_tc
            need = o.mb_per_1k / (b.us_per_1k / bar)
            text += (f" The all-compressible target ({bar:.2f}×) is {'below' if per_token >= bar else 'above'} the gain "
                     "per token" + (f", which long contexts approach: per token it needs ours to stream at {need:.2f} TB/s, "
                                    f"{_fastest_clause(fit[fit['shape'] == shape], 'stream_tbps', need)}."
                                    if per_token < bar else "."))
        parts.append(text)
    return (f"Fitted over {fit.n_contexts.iloc[0]} contexts, {fit.contexts.iloc[0]} tokens, at batch "
            f"{fit.batch.iloc[0]} (commit {', '.join(sorted(set(fit.commit)))}; the largest distance of a point from its line is "
            f"{fit.max_resid_us.max():.1f} µs):\n\n" + "\n".join(f"- {p}" for p in parts))


CEILING = "zipfusion_descriptor_ceiling.csv"
"""The committed ceiling probe of the all-compressible bar (``.ci/gpu/descriptor_ceiling.py``: the all-compressed
kernel as committed, with its descriptor loads removed, on compact slots and -- in runs from 1d281d5 on -- loading each
descriptor once, beside FlashInfer TC, SDPA and an empty launch, over a context sweep at batch 64; one run per GPU)
that :func:`ceiling_text` reads."""
CEILING_LABELS = {"zipkv_compressed_no_descriptors": "zipkv (compressed, no descriptor loads)",
                  "zipkv_compressed_one_descriptor_load": "zipkv (compressed, each descriptor loaded once)",
                  "zipkv_compressed_compact": "zipkv (compressed, compact slots)", "empty_launch": "empty launch"}


def read_ceiling(folder) -> pd.DataFrame | None:
    """:data:`CEILING` in ``folder`` (``results/paper``), or None where there is none."""
    path = Path(folder) / CEILING
    return pd.read_csv(path) if path.is_file() else None


def ceiling_run(run: pd.DataFrame, ctx: int = ZIPFUSION_PAPER.anchor_context,
                batch: int = ZIPFUSION_PAPER.anchor_batch):
    """One run of the ceiling probe: each method's speedup over FlashInfer TC at (ctx, batch) (a Series by method),
    :func:`context_fit` of its methods (by method) and what the fitted lines give at (ctx, batch) for the kernel
    without descriptor loads at the run's empty-launch time as its fixed cost."""
    at = run[(run.ctx == ctx) & (run.batch == batch)].set_index("method").speedup_vs_flashinfer_tc
    fit = context_fit(run[run.method != "empty_launch"]).set_index("method")
    fi, bare = fit.loc["flashinfer_tc"], fit.loc["zipkv_compressed_no_descriptors"]
    empty = run[run.method == "empty_launch"].latency_us.median()
    return at, fit, line_at(fi, ctx) / (empty + bare.us_per_1k * ctx / 1024)


def ceiling_text(table: pd.DataFrame | None, ctx: int = ZIPFUSION_PAPER.anchor_context,
                 batch: int = ZIPFUSION_PAPER.anchor_batch) -> str:
    """What the ceiling probe (:data:`CEILING`) says of the all-compressible bar, one item per run (GPU, commit,
    date): the all-compressed variants against FlashInfer TC at (ctx, batch), their gain per token from
    :func:`context_fit` against what the bytes allow, the fixed costs beside an empty launch's, and what the fitted
    lines give at (ctx, batch) for the kernel without descriptor loads at an empty launch's fixed cost (the most any
    metadata layout and launch could give), against the bar; and where the uncompressed path streams faster than the
    compressed one, the fixed cost the bar would leave at that rate. Without a probe run (None), that one needs a GPU."""
    if table is None:
        return "The ceiling probe needs a GPU and no run of it is committed yet."
    bar = PROJECT_TARGETS.speedup_vs_flashinfer_tc
    items = []
    for (device, commit, date), run in table.groupby(["device", "commit", "date"], sort=False):
        at, fit, ideal = ceiling_run(run, ctx, batch)
        fi, ours, bare = (fit.loc[m] for m in ("flashinfer_tc", "zipkv_compressed", "zipkv_compressed_no_descriptors"))
        empty = run[run.method == "empty_launch"].latency_us.median()
        per_token = fi.us_per_1k / bare.us_per_1k
        text = (f"**{device}** (commit {commit}, {date}): at {ctx} × {batch} the all-compressed kernel is "
                f"{at['zipkv_compressed']:.3f}× FlashInfer TC, with no descriptor loads at all "
                f"{at['zipkv_compressed_no_descriptors']:.3f}×, "
                + (f"loading each descriptor once (no second load for the per-token scales) "
                   f"{at['zipkv_compressed_one_descriptor_load']:.3f}×, " if "zipkv_compressed_one_descriptor_load" in at else "")
                + f"on compact slots {at['zipkv_compressed_compact']:.3f}×. "
                f"Per token (fitted over {fit.contexts.iloc[0]} tokens) ours is {fi.us_per_1k / ours.us_per_1k:.3f}× "
                f"faster, without descriptor loads {per_token:.3f}× (its bytes allow {fi.mb_per_1k / bare.mb_per_1k:.3f}× "
                f"at FlashInfer TC's rate); a launch's fixed cost is {ours.fixed_us:.1f} µs for ours, "
                f"{fi.fixed_us:.1f} µs for FlashInfer TC, and an empty launch measures {empty:.1f} µs under the same timer.")
        allowed = line_at(fi, ctx) / bar - bare.us_per_1k * ctx / 1024          # fixed cost left to the bare kernel
        text += (f" On the fitted lines, a kernel with no descriptor bytes and an empty launch's fixed cost would be "
                 f"{ideal:.3f}× at {ctx} × {batch}: ")
        text += (f"the {bar:.2f}× target is out of reach on this card at the rate its pages stream, whatever the metadata "
                 "layout and the fixed cost."
                 if ideal < bar else
                 f"the {bar:.2f}× target needs both, no descriptor bytes and a fixed cost of at most {allowed:.1f} µs "
                 f"({allowed - empty:.1f} µs above an empty launch; ours {ours.fixed_us:.1f} µs).")
        raw = fit.loc["zipkv_uncompressed"]
        if raw.stream_tbps > bare.stream_tbps:
            fast = line_at(fi, ctx) / bar - bare.mb_per_1k / raw.stream_tbps * ctx / 1024
            text += (f" Our uncompressed path streams its pages at {raw.stream_tbps:.2f} TB/s, the compressed one at "
                     f"{bare.stream_tbps:.2f} without descriptor loads: at the uncompressed rate, a kernel with no "
                     f"descriptor bytes would meet the target with a fixed cost of up to {fast:.1f} µs (ours "
                     f"{ours.fixed_us:.1f} µs).")
        items.append(text)
    return "\n".join(f"- {t}" for t in items)


def ceiling_table(table: pd.DataFrame | None):
    """The ceiling probe's latencies, one column per context (a Styler; None without a probe run)."""
    if table is None:
        return None
    labels = {**METHOD_LABELS, **CEILING_LABELS}
    view = table.assign(method=table.method.map(labels)).pivot_table(
        index=["device", "method"], columns="ctx", values="latency_us", sort=False)
    view.columns = [f"{c} tokens (µs)" for c in view.columns]
    return view.style.format("{:.1f}").pipe(readable)


def context_table(fit: pd.DataFrame):
    """:func:`context_fit`'s table, formatted (a Styler)."""
    view = fit.assign(method=fit.method.map(METHOD_LABELS))
    return view.style.format({"fixed_us": "{:.1f}", "us_per_1k": "{:.2f}", "mb_per_1k": "{:.1f}",
                              "stream_tbps": "{:.2f}", "max_resid_us": "{:.1f}"}).hide(axis="index").pipe(readable)


TIMELINE = "zipfusion_kernel_timeline.csv"
"""The committed runs of the timeline probe (``.ci/gpu/timeline_probe.py``, Llama-3.1-8B shape, batch 64): per launch of
the Gluon kernel over all-compressed and raw pages, when its programs start, end their page loops and end their merges
(``%globaltimer``, µs after the first program's start), beside the committed kernel's time; with it
``..._programs.csv`` (every program's records at 8192 tokens: b, h, split, SM) and ``..._fits.csv`` (the same run's
timings of the kernels, FlashInfer TC and SDPA over contexts)."""


BALANCED = "zipfusion_kernel_balanced_ab.csv"
"""The committed runs of the balanced-schedule probe (``.ci/gpu/balanced_probe.py``): the all-compressed path with the
first ``chunks`` x ``chunk_units`` units of each split handed out as fixed chunks from a queue, beside the committed
kernel and FlashInfer TC in the same rounds (8192 x 64, Llama-3.1-8B shape)."""

L2_ASSIST = "zipfusion_kernel_l2_assist_ab.csv"
"""The committed runs of the L2-assist probe (``.ci/gpu/l2_assist_probe.py``): the committed kernel's programs unchanged,
except that one whose page loop has ended before its sibling split's prefetches the sibling's last ``N`` units into L2,
beside the committed kernel and FlashInfer TC in the same rounds (all-compressed and raw pages, 8192 x 64, Llama-3.1-8B
shape)."""


SHORT_PROGRAMS = "zipfusion_kernel_short_programs_ab.csv"
"""The committed runs of the short-programs probe (``.ci/gpu/tail_blocks_probe.py``): each split's last
``short_per_split`` x ``short_units`` units as short programs launched after every long one, with the SM's residency
held to ``programs_per_sm`` (0: the kernel's own), beside the committed kernel and FlashInfer TC in the same rounds
(all compressed, 8192 x 64, Llama-3.1-8B shape)."""


def read_timeline(folder) -> dict | None:
    """:data:`TIMELINE`, its two companions, :data:`BALANCED`, :data:`L2_ASSIST` and :data:`SHORT_PROGRAMS` in
    ``folder`` (``results/paper``) as ``{"launches", "programs", "fits", "balanced", "assist", "short"}`` (one absent: an
    empty frame), or None where no timeline run is committed."""
    path = Path(folder) / TIMELINE
    if not path.is_file():
        return None
    parts = {"launches": path, "programs": path.with_name(path.stem + "_programs.csv"),
             "fits": path.with_name(path.stem + "_fits.csv"), "balanced": path.with_name(BALANCED),
             "assist": path.with_name(L2_ASSIST), "short": path.with_name(SHORT_PROGRAMS)}
    empty = pd.DataFrame(columns=["device", "commit", "date"])
    return {key: pd.read_csv(p) if p.is_file() else empty for key, p in parts.items()}


def tail_at(timeline: dict, device: str, ctx: int = ZIPFUSION_PAPER.anchor_context, date: str | None = None):
    """The timeline run on ``device`` at ``ctx`` of ``date`` (default its latest): (its all-compressed launch row, its
    raw launch row, FlashInfer TC's µs in the same run or None, the all-compressed launch's µs with every program's
    loop ending at the median one's: the committed kernel's time less the tail), or None without such a run."""
    runs = timeline["launches"]
    runs = runs[runs.device.str.startswith(device.split(" (")[0]) & (runs.ctx == ctx)]
    if not len(runs):
        return None
    run = runs[runs.date == (date or runs.date.max())].set_index("kind")
    comp, raw = run.loc["compressed"], run.loc["raw"]
    fits = timeline["fits"]
    fi = fits[(fits.device == comp.device) & (fits.date == comp.date) & (fits.method == "flashinfer_tc")
              & (fits.ctx == ctx)] if len(fits) else fits
    balanced = comp.committed_us - (comp.loop_end_max_us - comp.loop_end_p50_us)
    return comp, raw, (float(fi.latency_us.iloc[0]) if len(fi) else None), balanced


def timeline_text(timeline: dict | None, ctx: int = ZIPFUSION_PAPER.anchor_context) -> str:
    """What the timeline probe (:func:`read_timeline`) says, one item per GPU run at ``ctx`` tokens: when the
    all-compressed launch's programs start, how far their page loops' ends spread (the static split's tail), what
    the merge adds, the raw pages' tail, and, against FlashInfer TC in the same run, what the launch would give with
    every loop ending at the median one's; where the run kept every program's records, how the SMs' mean loop ends
    differ (the share of bandwidth each SM gets). Then the balanced schedule's runs (:data:`BALANCED`), the L2
    assist's (:data:`L2_ASSIST`) and the short programs' (:data:`SHORT_PROGRAMS`), if any."""
    if timeline is None:
        return "The timeline probe needs a GPU and no run of it is committed yet."
    items = []
    for (device, date), _ in timeline["launches"].groupby(["device", "date"], sort=False):
        at = tail_at(timeline, device, ctx, date)
        if at is None:
            continue
        comp, raw, fi, balanced = at
        tail, raw_tail = comp.loop_end_max_us - comp.loop_end_p50_us, raw.loop_end_max_us - raw.loop_end_p50_us
        text = (f"**{device}** (commit {comp.commit}, {comp.date}), all compressed, {ctx} tokens: the programs "
                f"({comp.splits} splits, {comp.programs_per_sm_min}–{comp.programs_per_sm_max} per SM on "
                f"{comp.sms_used} SMs) start within {comp.start_max_us:.2f} µs of each other; their page loops end "
                f"between {comp.loop_end_min_us:.1f} and {comp.loop_end_max_us:.1f} µs (median "
                f"{comp.loop_end_p50_us:.1f}, 90 % by {comp.loop_end_p90_us:.1f}), and a merge takes at most "
                f"{comp.finish_max_us:.1f} µs. The slowest loop ends **{tail:.1f} µs** "
                f"({tail / comp.committed_us:.1%} of the launch) after the median one; over raw pages {raw_tail:.1f} µs "
                f"({raw_tail / raw.committed_us:.1%}).")
        if fi is not None:
            text += (f" With every loop ending at the median one's, the launch would take about {balanced:.1f} µs: "
                     f"**{fi / balanced:.3f}×** FlashInfer TC's {fi:.1f} µs in the same run (as it runs, "
                     f"{comp.committed_us:.1f} µs: {fi / comp.committed_us:.3f}×).")
        progs = timeline["programs"]
        progs = progs[(progs.device == device) & (progs.date == date) & (progs.ctx == ctx)]
        if len(progs):
            by_sm = {kind: progs[(progs.kind == kind) & progs["shuffle"]].groupby("sm").loop_end_ns.mean() / 1e3
                     for kind in ("compressed", "raw")}
            unequal = max(m.max() / m.min() for m in by_sm.values()) > 1.01
            text += (f" Per SM, the mean loop end runs from {by_sm['compressed'].min():.1f} to "
                     f"{by_sm['compressed'].max():.1f} µs (raw pages: {by_sm['raw'].min():.1f} to "
                     f"{by_sm['raw'].max():.1f})" + (": the SMs do not get equal shares of the bandwidth, so equal static "
                                                     "splits cannot end together." if unequal else "."))
        items.append(text)
    tried = (("balanced", _balanced_run, lambda runs: "",
              "**A balanced schedule, tried** (a GPU probe): each split hands the first K × C units of its "
              "range out as K fixed chunks of C units, which any program claims from one queue once its own part is "
              "done; each chunk is merged as its own partial, so the output stays the same from run to run and bit for "
              "bit the same over packed and raw pages. "),
             ("assist", _assist_run, _assist_closing,
              "**Warming L2 for the later sibling, tried** (a GPU probe): a program whose page loop "
              "has ended before its sibling split's prefetches the sibling's last N units into L2 "
              "(`cp.async.bulk.prefetch.L2`, one per block) and computes nothing differently: its output is the "
              "committed kernel's bit for bit. "),
             ("short", _short_run, _short_closing,
              "**Short programs left to the block scheduler, tried** (a GPU probe): each split keeps "
              "all but its last N × T units in one long program, and its last units become N short programs of T units "
              "each, launched after every long one; with the SM's residency held to 8 programs (shared memory padded), "
              "every long program starts at once and an SM whose long programs end early takes the short ones that are "
              "left, with no claim and no restart inside a program. Each range has its own partial, merged in a fixed "
              "order: the output is the same from run to run and bit for bit the same over packed and raw pages. "))
    for key, sentence, closing, heading in tried:
        runs = [sentence(run, device, commit, date)
                for (device, commit, date), run in timeline[key].groupby(["device", "commit", "date"], sort=False)]
        if runs:
            items.append(heading + " ".join(runs) + closing(timeline[key]))
    return "\n".join(f"- {t}" for t in items)


def _balanced_run(run: pd.DataFrame, device: str, commit: str, date: str) -> str:
    """One run of the balanced-schedule probe as a sentence: the static split, the fastest and slowest balanced copy
    and FlashInfer TC, and what a chunk costs where every copy is slower."""
    ours = run[run.variant == "committed"].latency_us.iloc[0]
    tried = run.dropna(subset=["chunks"])
    per_chunk = (tried.latency_us - ours) / tried.chunks
    best, worst = tried.loc[tried.latency_us.idxmin()], tried.loc[tried.latency_us.idxmax()]
    return (f"On the {device} (commit {commit}, {date}) the static split took {ours:.1f} µs, the balanced copies "
            f"{best.latency_us:.1f} µs (K = {best.chunks:.0f}, C = {best.chunk_units:.0f}) to {worst.latency_us:.1f} µs "
            f"(K = {worst.chunks:.0f}, C = {worst.chunk_units:.0f}), FlashInfer TC "
            f"{run[run.variant == 'flashinfer_tc'].latency_us.iloc[0]:.1f} µs: "
            + (f"every copy slower, by {per_chunk.min():.1f}–{per_chunk.max():.1f} µs per chunk a program runs (a chunk "
               "starts the program's pipeline afresh, and the programs reach their chunks at about the same time)."
               if (per_chunk > 0).all() else f"the fastest {ours / best.latency_us:.3f}× the static split's speed."))


def _short_variants(run: pd.DataFrame):
    """One short-programs run: (the committed kernel's µs, the control's µs or None -- no short programs, residency
    held to 8 --, the variants with short programs and a held residency, those with the kernel's own residency)."""
    ours = run[run.variant == "committed"].latency_us.iloc[0]
    tried = run.dropna(subset=["short_per_split"])
    control = tried[tried.short_per_split == 0]
    short = tried[tried.short_per_split > 0]
    return (ours, float(control.latency_us.iloc[0]) if len(control) else None, short[short.programs_per_sm > 0],
            short[short.programs_per_sm == 0])


def _short_run(run: pd.DataFrame, device: str, commit: str, date: str) -> str:
    """One run of the short-programs probe as a sentence: the committed kernel, the control, each held-residency
    variant and what one short program per split costs the launch, the kernel's own residency, FlashInfer TC."""
    ours, control, held, own = _short_variants(run)
    base = ours if control is None else control
    cost = (held.latency_us - base) / held.short_per_split
    text = (f"On the {device} (commit {commit}, {date}; FlashInfer TC "
            f"{run[run.variant == 'flashinfer_tc'].latency_us.iloc[0]:.1f} µs) the committed kernel took {ours:.1f} µs"
            + (f", the rewritten copy without short programs at 8 programs per SM (the control) {control:.1f} µs"
               if control is not None else "") + "; with N short programs of T units per split: "
            + ", ".join(f"N = {r.short_per_split:.0f}, T = {r.short_units:.0f}: {r.latency_us:.1f}"
                        for r in held.itertuples()) + " µs")
    if len(held) and (cost > 0).all():
        text += f", every one slower, by {cost.min():.1f}–{cost.max():.1f} µs per short program a split has"
    if len(own):
        r = own.iloc[0]
        text += (f"; at the kernel's own residency, where the short programs start beside the long ones, N = "
                 f"{r.short_per_split:.0f}, T = {r.short_units:.0f} took {r.latency_us:.1f} µs")
    return text + "."


def _short_closing(runs: pd.DataFrame) -> str:
    """What the short-programs runs say together, where every variant with short programs is slower than the control
    (else the committed kernel) in every run: the cost is in each extra range, not in claiming it; else nothing."""
    for _, run in runs.groupby(["device", "commit", "date"]):
        ours, control, held, own = _short_variants(run)
        if not len(held) or (held.latency_us <= (ours if control is None else control)).any():
            return ""
        if len(own) and (own.latency_us <= ours).any():
            return ""
    return (" Each extra range costs the launch more than the balance wins back, though here nothing is claimed and no "
            "program restarts: the cost is in the range, not in claiming it.")


def _assist_curves(run: pd.DataFrame):
    """Per kind of pages of one L2-assist run: (kind, the committed kernel's µs, the prefetching copies' rows by N with
    column ``n``; N = 0, the rewritten copy's control, left out)."""
    for data, g in run[run.kv_data != "any"].groupby("kv_data", sort=False):
        tried = g[g.variant.str.startswith("assist N=") & (g.variant != "assist N=0")]
        yield (data, g[g.variant == "committed"].latency_us.iloc[0],
               tried.assign(n=tried.variant.str.split("=").str[1].astype(int)).sort_values("n"))


def _assist_run(run: pd.DataFrame, device: str, commit: str, date: str) -> str:
    """One run of the L2-assist probe as a sentence: per kind of pages, the committed kernel against the prefetching
    copies, and whether any N is faster."""
    parts, helped, growing = [], False, True
    for data, ours, tried in _assist_curves(run):
        helped |= bool(tried.latency_us.min() < ours)
        growing &= bool(tried.latency_us.is_monotonic_increasing)
        parts.append(f"{data} pages: the committed kernel {ours:.1f} µs, N = "
                     + ", ".join(f"{r.n}: {r.latency_us:.1f}" for r in tried.itertuples()) + " µs")
    fi = run[run.variant == "flashinfer_tc"].latency_us.iloc[0]
    verdict = "." if helped else (": no N is faster" + (", and the larger N the slower" if growing else "") + ".")
    return f"On the {device} (commit {commit}, {date}; FlashInfer TC {fi:.1f} µs), " + "; ".join(parts) + verdict


def _assist_closing(runs: pd.DataFrame) -> str:
    """What the L2-assist runs say together: where no N is faster in any run, the later programs do not wait on their
    last units' data (and prefetches of units the sibling has already read cost bandwidth); else nothing."""
    if any(tried.latency_us.min() < ours for _, run in runs.groupby(["device", "commit", "date"])
           for _, ours, tried in _assist_curves(run)):
        return ""
    return (" The later programs do not wait on their last units' data, so where it comes from does not shorten the "
            "tail; a large N costs the bandwidth of prefetching units the sibling has already read.")


def timeline_figure(timeline: dict, ctx: int = ZIPFUSION_PAPER.anchor_context):
    """Share of programs whose page loop has ended against the time from the median program's loop end, per committed
    run that kept every program's records (all-compressed pages in random and logical page order, raw pages)."""
    import matplotlib.pyplot as plt

    progs = timeline["programs"]
    progs = progs[progs.ctx == ctx]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = {("compressed", True): "tab:blue", ("compressed", False): "tab:orange", ("raw", True): "tab:green"}
    runs = list(progs.groupby(["device", "date"], sort=False).groups)
    for (device, date, kind, shuffle), g in progs.groupby(["device", "date", "kind", "shuffle"], sort=False):
        ends = np.sort(g.loop_end_ns.to_numpy()) / 1e3
        label = (f"{kind} pages, {'random' if shuffle else 'logical'} page order ({device.split(' ')[1]}, "
                 f"{date[:10]}, commit {g.commit.iloc[0]})")
        ax.plot(ends - np.median(ends), np.arange(1, len(ends) + 1) / len(ends), label=label,
                color=colors.get((kind, bool(shuffle))), ls=("-", "--", ":", "-.")[runs.index((device, date)) % 4])
    ax.set_xlabel(f"page loop's end, from the median program's (µs; {ctx} tokens × batch 64)")
    ax.set_ylabel("programs whose loop has ended")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:.0%}"))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return fig


def show_timeline(folder) -> None:
    """The section "Where the launch's time goes": :func:`timeline_figure` where a committed run kept every program's
    records, then :func:`timeline_text` (from :func:`read_timeline` of ``folder``, ``results/paper``)."""
    timeline = read_timeline(folder)
    if timeline is not None and len(timeline["programs"]):
        report.figure(timeline_figure(timeline), "Share of a launch's programs whose page loop has ended, against the "
                      "time from the median program's loop end (Llama-3.1-8B shape, all-compressed pages in the page "
                      "pool's random and in logical order, raw pages; the GPU run in the legend).", name="fig-latency-tail")
    report.markdown(timeline_text(timeline))


def show_mix(sweep: pd.DataFrame | None) -> None:
    """The section "Mixed pages against their bytes": :func:`mix_figure` where a sweep was run, then :func:`mix_text`."""
    if sweep is not None:
        report.figure(mix_figure(sweep), "Latency of the Gluon kernel against the bytes it reads, per share of "
                      "compressed K / V blocks (8192 tokens × batch 64, Llama-3.1-8B shape, H200), with the plan's routing "
                      "(filled) and every page through the mixed path (open), beside FlashInfer TC on the raw cache and "
                      "the line of FlashInfer TC's read rate.", name="fig-latency-mix")
    report.markdown(mix_text(sweep))

