"""The chapter "On the paper's card": ZipFusion's Fig. 4 points and Fig. 5 setting timed on an H100, the GPU of
ZipFusion's paper (§IV-A), beside the paper's numbers and the H200 chapters' ("Decode attention latency", "Decode
throughput under a memory budget"). The claims it judges are the findings page's rows of this chapter
(:data:`zipkv.study.settings.PAPER_CARD`), so that both judge alike."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from zipkv.study import findings
from zipkv.study import paper_values as pv
from zipkv.study.chapters.throughput import card_rows
from zipkv.study.settings import PAPER_CARD, THROUGHPUT_MMA_BASELINE_MODEL, THROUGHPUT_PAPER_MODEL, ZIPFUSION_PAPER

CARD = "H100"
"""What the GPU's name must hold for this chapter to measure (the paper's card)."""
STEM = PAPER_CARD
THROUGHPUT_SIDE = f"{STEM}_throughput"
TUNING_SIDE = f"{STEM}_tuning"
PAIRS = [("decode attention over FlashInfer (TC), real-KV mix", "decode attention over FlashInfer TC, real-KV mix",
          "zipfusion_attention_latency", "decode attention over FlashInfer (TC), real-KV mix"),
         ("ZipFusion's decode attention at 8192 tokens", "ZipFusion's attention at 8192 × 64",
          "zipfusion_attention_latency", "decode attention at 8192 tokens"),
         ("tokens/s at each method's largest batch", "tokens/s gain at the largest batches",
          "zipfusion_throughput", "tokens/s at each method's largest batch over uncompressed (gain)"),
         ("tokens/s at batch 32", "tokens/s gain at batch 32", "zipfusion_throughput",
          "tokens/s at batch 32 over uncompressed")]
"""Each of this chapter's findings claims (the start of its text), a short name, and the H200 chapter and claim it
repeats."""


def on_card() -> bool:
    """Whether this machine's GPU is the paper's card (:data:`CARD`), where :func:`measure` runs."""
    import torch

    return torch.cuda.is_available() and CARD in torch.cuda.get_device_name()


def measure(real_kv_csv, out_dir, *, reps: int = 30, device_name: str | None = None) -> None:
    """On an H100: Fig. 4's Llama-3.1-8B-shape points (:func:`zipkv.bench.attention_benchmark`, the measured mix and
    every block compressible, beside FlashInfer and SDPA; ``reps`` cold-L2 calls per point) into
    ``out_dir/zipfusion_paper_card.csv``, and Fig. 5's setting (:func:`zipkv.study.experiments.throughput.figure5` with the tokens/s
    bar's two methods, 3 alternating runs at the largest batch, step profiles and the mma-layout engine; the restore
    baselines' buffers do not fit the card's 80 GB beside the budget at their largest batch) into
    ``out_dir/zipfusion_paper_card_throughput.csv``, both with the run's device, commit and date. Another GPU is an
    error before anything runs: this chapter's numbers are the H100's."""
    import torch

    from zipkv import bench
    from zipkv.provenance import provenance
    from zipkv.study.experiments.throughput import REPEATED, figure5

    name = device_name or (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU")
    if CARD not in name:
        raise RuntimeError(f"the chapter on the paper's card measures on an {CARD}; this machine has {name!r} "
                           f"(render the committed run with from_results=True)")
    out_dir = Path(out_dir)
    run = provenance("bench")
    stamp = dict(commit=run["commit"], date=run["date"])            # the latency table names its device itself
    fraction = bench.measured_compressible_fraction(real_kv_csv)
    latency = bench.attention_benchmark("llama3.1-8b", ZIPFUSION_PAPER.contexts, ZIPFUSION_PAPER.batches, fraction,
                                        reps=reps, progress=False)
    latency.assign(**stamp).to_csv(out_dir / f"{STEM}.csv", index=False)
    side = out_dir / f"{THROUGHPUT_SIDE}.csv"
    fig5 = figure5(methods=REPEATED, repeats=3, profile=True, mma_baseline=True, progress_csv=side, capacity=False)
    fig5["table"].assign(device=run["device"], **stamp).to_csv(side, index=False)


def read(folder) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The committed H100 run in ``folder``: ``(latency, throughput)`` (Fig. 4's points, Fig. 5's rows)."""
    folder = Path(folder)
    return pd.read_csv(folder / f"{STEM}.csv"), pd.read_csv(folder / f"{THROUGHPUT_SIDE}.csv")


def claims(folder) -> pd.DataFrame:
    """This chapter's claims as the findings page judges them (from the tables in ``folder``), each beside the H200
    chapter's value of the same claim: columns ``claim``, ``paper``, ``ours, H100``, ``verdict``, ``ours, H200``,
    ``short`` (a short name) and ``held`` (reproduced or exceeded)."""
    table = findings.findings(folder)
    rows = []
    for row in table[table.chapter == STEM].itertuples():
        short, chapter, start = next((b, c, d) for a, b, c, d in PAIRS if row.claim.startswith(a))
        h200 = table[(table.chapter == chapter) & table.claim.str.startswith(start)]
        rows.append({"claim": f"{row.item}: {row.claim.split(', on the paper')[0]}", "paper": row.paper_value,
                     "ours, H100": row.our_value, "verdict": row.verdict + (f" ({row.tolerance})" if row.tolerance else ""),
                     "ours, H200": f"{h200.our_value.iloc[0]} [{h200.verdict.iloc[0]}]" if len(h200) else "–",
                     "short": short, "held": row.verdict in ("reproduced", "exceeded")})
    return pd.DataFrame(rows)


def verdict(table: pd.DataFrame) -> tuple[str, str]:
    """(verdict text, admonition kind) from :func:`claims`' table: how many of the claims hold on the card, each
    with ours and the paper's, and the same claims' values on the H200."""
    done = table[~table.verdict.str.startswith("not yet run")]
    value = lambda text: text.split(" (")[0].split(" [")[0]                                      # noqa: E731
    text = (f"On an {CARD}, the GPU of ZipFusion's paper, **{int(done.held.sum())} of {len(done)}** of the paper's speed "
            "claims that this chapter times reproduce within the findings page's tolerances: " + "; ".join(
                f"{r.short} **{value(r['ours, H100'])}** (paper {r.paper}: {r.verdict.split(' (')[0]})"
                for _, r in done.iterrows())
            + ". On the H200 of the other chapters the same claims read " + "; ".join(
                f"{value(r['ours, H200'])}" for _, r in done.iterrows()) + ".")
    return text, "tip" if done.held.all() else "warning"


def speedup_points(latency: pd.DataFrame) -> pd.DataFrame:
    """Our fastest compressed kernel's speedup over FlashInfer TC per (ctx, batch) of the paper's points, one column
    per kind of KV data (Llama-3.1-8B shape)."""
    t = latency[(latency["shape"] == "llama3.1-8b") & (latency.method == "zipkv_compressed")
                & latency.ctx.isin(ZIPFUSION_PAPER.contexts) & latency.batch.isin(ZIPFUSION_PAPER.batches)]
    return (t.groupby(["ctx", "batch", "kv_data"]).speedup_vs_flashinfer_tc.max().unstack("kv_data")
            .rename_axis(index=["context", "batch"], columns="KV data"))


def speedup_figure(card: pd.DataFrame, h200: pd.DataFrame):
    """Our speedup over FlashInfer TC per context × batch on the H100 (``card``) and on the H200 (``h200``), the
    measured mix filled and every block compressible hollow, against the paper's band and parity."""
    import matplotlib.pyplot as plt

    index = speedup_points(card).index
    fig, ax = plt.subplots(figsize=(10, 3.8))
    x = np.arange(len(index))
    for i, (gpu, table, color) in enumerate(((CARD, card, "tab:blue"), ("H200", h200, "tab:orange"))):
        points = speedup_points(table).reindex(index)
        for kv, face in (("measured mix", color), ("all compressible", "white")):
            ax.plot(x + (i - 0.5) * 0.2, points[kv], "o", ms=8, color=color, markerfacecolor=face, label=f"{gpu}, {kv}")
    lo, hi = pv.ZIPFUSION_SPEEDUP_RANGE
    ax.axhspan(lo, hi, color="tab:green", alpha=0.25, label=f"paper, {pv.ZIPFUSION_GPU}: {lo}–{hi}×")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(x, [f"{ctx} tokens\nbatch {b}" for ctx, b in index])
    ax.set_xlabel("context length × batch (Llama-3.1-8B attention shape)")
    ax.set_ylabel("speedup over FlashInfer TC (×)")
    ax.set_ylim(0.98, 1.46)
    ax.legend(fontsize=8, loc="upper center", ncol=5)
    ax.grid(axis="y", alpha=0.3)
    return fig


def latency_text(latency: pd.DataFrame) -> str:
    """Fig. 4's printed point on the card: every method's µs and read rate at 8192 × 64, and the copy bandwidth
    measured in the same run."""
    t = latency[(latency["shape"] == "llama3.1-8b") & (latency.ctx == ZIPFUSION_PAPER.anchor_context)
                & (latency.batch == ZIPFUSION_PAPER.anchor_batch)]
    paper = pv.ZIPFUSION_ATTENTION_8192x64["Llama-3.1-8B"]

    def one(method, kv_data=None):
        r = t[(t.method == method) & ((t.kv_data == kv_data) if kv_data else True)].sort_values("latency_us").iloc[0]
        return f"{r.latency_us:.1f} µs ({r.tbps:.2f} TB/s" + (f", {r.kernel} kernel)" if isinstance(r.kernel, str) else ")")
    return (f"**At 8192 tokens × batch 64** ({t.device.iloc[0]}; copy bandwidth measured in the run "
            f"{t.copy_bw_tbps.iloc[0]:.2f} TB/s): FlashInfer TC {one('flashinfer_tc')} against the paper's "
            f"{paper['flashinfer']} µs; ours on the measured mix {one('zipkv_compressed', 'measured mix')} against the "
            f"paper's {paper['zipfusion']} µs; every block compressible {one('zipkv_compressed', 'all compressible')}; "
            f"FlashInfer CUDA-core {one('flashinfer_cuda')}, torch SDPA {one('sdpa')}. The paper names neither its "
            "FlashInfer version nor its H100's variant.")


def throughput_text(throughput: pd.DataFrame) -> str:
    """Why the tokens/s gain at the largest batches is what it is on the card, from its Fig. 5 rows: each
    configuration's step time and attention time per step, the batch ratio and the clocks."""
    z, u, m = card_rows(throughput)
    rest = lambda r: r.step_ms - r.attention_ms                                              # noqa: E731
    paper_mb, paper_gain = pv.ZIPFUSION_MAX_BATCH["Llama-3.1-8B"], pv.ZIPFUSION_THROUGHPUT_GAIN_AT_MAX_BATCH["Llama-3.1-8B"]
    return (f"**Why the gain at the largest batches is the batch ratio.** Under one budget ZipFusion holds {z.batch} "
            f"requests where uncompressed holds {u.batch} ({z.batch / u.batch:.3f}×), and its attention reads about the "
            f"bytes that fill the budget either way: a decode step's attention takes {z.attention_ms:.2f} ms for "
            f"ZipFusion's {z.batch} requests and {m.attention_ms:.2f} ms for the mma-layout engine's {m.batch} "
            f"(Gluon kernel, raw path), with {rest(z):.2f} and {rest(m):.2f} ms of matrix products, other kernels and "
            f"host around it; the steps take {z.step_ms:.2f} and {m.step_ms:.2f} ms, so tokens/s gains "
            f"{z.batch / m.batch:.3f} × {m.step_ms / z.step_ms:.3f} = {z.tokens_per_s / m.tokens_per_s:.3f}×. The "
            f"token-layout engine (Triton kernel, the H200 chapter's baseline) spends {u.attention_ms:.2f} ms on "
            f"attention at batch {u.batch} ({u.step_ms:.2f} ms a step) on this card, so over it the gain is "
            f"{z.tokens_per_s / u.tokens_per_s:.3f}×: a gain above the batch ratio, like the paper's "
            f"+{paper_gain:.1%} over {paper_mb['uncompressed']} → {paper_mb['zipfusion']} requests "
            f"({paper_mb['zipfusion'] / paper_mb['uncompressed']:.3f}×), needs an uncompressed step slower per byte than "
            "ZipFusion's. The "
            f"SM clock stayed at {z.sm_clock_mhz:.0f} MHz (ZipFusion) and {m.sm_clock_mhz:.0f} MHz (mma layouts), "
            f"the power cap lowering it in {z.frac_power_capped:.0%} and {m.frac_power_capped:.0%} of the samples "
            f"(median {z.power_w:.0f} and {m.power_w:.0f} W): unlike the H200's runs, no power cap enters here.")


def tuning_text(folder) -> str:
    """The launch options tuned on the card (``<STEM>_tuning.csv``, ``bench tune --write``) in one sentence."""
    path = Path(folder) / f"{TUNING_SIDE}.csv"
    if not path.is_file():
        return "No launch options were tuned on this card: the kernels ran with their defaults."
    t = pd.read_csv(path)
    best = t[t.best]
    parts = [f"{r.kernel} {r.path}: {int(r.programs_per_sm)} programs per SM, {int(r.stages)} stages"
             + (f", {int(r.pages_per_tile)} pages per tile" if r.kernel == "triton" else "")
             for r in best.itertuples()]
    return (f"Both kernels' launch options were tuned on this card before the run (`python -m zipkv bench tune "
            f"[--kernel gluon] --write`, 8192 × 64, {t.device.iloc[0]}, commit {t.commit.iloc[0]}), as the H200's "
            "were: " + "; ".join(parts) + ".")


def throughput_table(throughput: pd.DataFrame) -> pd.DataFrame:
    """The card's Fig. 5 rows (the Llama-3.1-8B-shape engines; not the embedded model's end-to-end check), one per
    engine and batch: tokens/s (every run where it ran three times), step and attention time, SM clock."""
    t = throughput[throughput.model.isin([THROUGHPUT_PAPER_MODEL, THROUGHPUT_MMA_BASELINE_MODEL])].copy()
    t["engine"] = np.where(t.model == THROUGHPUT_MMA_BASELINE_MODEL, "uncompressed, mma layouts",
                           np.where(t.method == "uncompressed", "uncompressed, token layouts", t.method))
    cols = {"engine": "engine", "batch": "batch", "max_batch": "largest batch", "tokens_per_s": "tokens/s",
            "tokens_per_s_runs": "tokens/s of each run", "step_ms": "step (ms)", "attention_ms": "attention (ms/step)",
            "sm_clock_mhz": "SM clock (MHz)"}
    t["tokens_per_s_runs"] = t.tokens_per_s_runs.map(_runs)
    return (t[list(cols)].rename(columns=cols).fillna({"tokens/s of each run": "one run"})
            .style.format({"tokens/s": "{:,.0f}", "step (ms)": "{:.2f}", "attention (ms/step)": "{:.2f}",
                           "SM clock (MHz)": "{:.0f}"}).hide(axis="index"))


def _runs(value):
    """A run list as the CSV holds it (``"[1686.0, 1741.6, 1742.0]"``) in words: ``"1,686 · 1,742 · 1,742"``."""
    if not isinstance(value, str):
        return value
    numbers = [float(v) for v in value.strip("[]").split(",") if v.strip()]
    return " · ".join(f"{v:,.0f}" for v in numbers)


def landing_figure(results_dir):
    """The landing page's figure: :func:`speedup_figure` of the H100 run (this chapter's) beside the latency chapter's
    H200 run, and its caption; None without both runs committed in ``results_dir``."""
    res = findings.Results(Path(results_dir))
    if not (res.has(PAPER_CARD) and res.has("zipfusion_attention_latency")):
        return None
    fig = speedup_figure(res[PAPER_CARD], res["zipfusion_attention_latency"])
    lo, hi = pv.ZIPFUSION_SPEEDUP_RANGE
    caption = (f"ZipFusion's decode attention over FlashInfer at each of the paper's points (context × batch, "
               f"Llama-3.1-8B attention shape), on the H100 and on the H200; filled: the real-KV mix, hollow: every "
               f"block compressible; green band: the paper's {lo}–{hi}× on an {pv.ZIPFUSION_GPU}.")
    return fig, caption
