"""The chapter "The memory manager at work": its verdict, timeline figure, ablation table, serving curves and the
paper's claims beside ours, from :func:`zipkv.study.experiments.memory_manager.run`'s results."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from zipkv.study.experiments.memory_manager import sustained_rate

RATE_BAR = 1.15
"""This project's bar (not the paper's): ZipFusion's highest sustained request rate over uncompressed's, at the stated
p99 TTFT limit (the paper's capacity gain in Fig. 5 is 57 / 46 = 1.24x)."""

PAPER_CLAIMS = [
    ("§II-C, §III-D", "An empty chunk released in one layer is reassigned to another layer once outstanding reads "
                      "finish (a shared pool).", "reassigned"),
    ("§III-D", "Capacity for new requests is counted at the uncompressed page size and grows as compression releases "
               "memory.", "growth"),
    ("§III-D", "The allocator reserves space for the pages running requests still need.", "reserve"),
]


METHOD_LABELS = {"uncompressed": "uncompressed", "zipfusion": "ZipFusion"}
"""How the serving curves' methods are named in figures."""


def _ms(x):
    return 1e3 * x


def _used(steps: pd.DataFrame) -> np.ndarray:
    """KV bytes in use per step and layer, ``[steps, layers]``."""
    cols = sorted((c for c in steps if c.startswith("used_bytes_")), key=lambda c: int(c.rsplit("_", 1)[1]))
    return steps[cols].to_numpy(dtype=float)


def plot_timeline(steps: pd.DataFrame, clock: str):
    """Four panels over a served trace's time (the steps table of
    :func:`zipkv.study.experiments.memory_manager.steps_table`): running batch and waiting queue; KV bytes in use per
    layer (range over layers, first and last layer); free chunks and chunks reassigned between layers (cumulative,
    each reassignment marked); retractions (cumulative)."""
    import matplotlib.pyplot as plt
    t = _ms(steps["time"].to_numpy())
    used = _used(steps) / 2**20
    fig, ax = plt.subplots(2, 2, figsize=(10, 5.6), sharex=True)
    a = ax[0, 0]
    a.step(t, steps["batch"], where="post", label="running batch")
    a.step(t, steps["waiting"], where="post", label="waiting requests")
    a.set_ylabel("requests")
    a.legend(fontsize=8)
    a = ax[0, 1]
    a.fill_between(t, used.min(1), used.max(1), alpha=0.25, step="post", label="range over layers")
    for l in (0, used.shape[1] - 1):
        a.step(t, used[:, l], where="post", lw=0.8, label=f"layer {l}")
    a.set_ylabel("KV bytes in use per layer (MiB)")
    a.legend(fontsize=8)
    a = ax[1, 0]
    a.step(t, steps["chunks_free"], where="post", label="free chunks")
    a.step(t, steps["reassigned"], where="post", label="chunks reassigned between layers (cumulative)")
    moved = np.flatnonzero(np.diff(steps["reassigned"].to_numpy(), prepend=0) > 0)
    if len(moved):
        a.plot(t[moved], steps["reassigned"].to_numpy()[moved], "|", color="tab:orange", ms=10)
    a.set_ylabel("chunks")
    a.legend(fontsize=8)
    a = ax[1, 1]
    a.step(t, steps["retracted"], where="post", color="tab:red")
    a.set_ylabel("retractions (cumulative)")
    for a in ax[1]:
        a.set_xlabel(f"time (ms, {clock} clock)")
    fig.tight_layout()
    return fig


TABLE_COLUMNS = {"variant": "memory manager", "max_batch": "largest batch", "tokens_per_s": "output tokens/s",
                 "queue_median_s": "queueing median (ms)", "queue_p99_s": "queueing p99 (ms)",
                 "ttft_median_s": "TTFT median (ms)", "ttft_p99_s": "TTFT p99 (ms)", "tpot_median_s": "TPOT median (ms)",
                 "tpot_p99_s": "TPOT p99 (ms)", "retractions": "retractions", "chunks_reassigned": "chunks reassigned"}


def ablation_table(ablation: pd.DataFrame) -> pd.DataFrame:
    """The ablation rows for the reader: times in ms, readable column names."""
    t = ablation[list(TABLE_COLUMNS)].copy()
    for c in TABLE_COLUMNS:
        if c.endswith("_s") and not c.endswith("per_s"):          # times (s -> ms), not rates
            t[c] = _ms(t[c])
    return t.rename(columns=TABLE_COLUMNS).round(2)


def plot_curves(curve: pd.DataFrame, ttft_limit_s: float, clock: str):
    """Output tokens/s and p99 TTFT against the request rate, per method, the p99 TTFT limit drawn."""
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for method, g in curve.groupby("method", sort=False):
        label = METHOD_LABELS.get(method, method)
        a.plot(g["rate"], g["tokens_per_s"], "o-", label=label)
        b.plot(g["rate"], _ms(g["ttft_p99_s"]), "o-", label=label)
    b.axhline(_ms(ttft_limit_s), color="grey", ls="--", label="p99 TTFT limit")
    a.set_xlabel("request rate (requests/s)")
    a.set_ylabel(f"output tokens/s ({clock} clock)")
    b.set_xlabel("request rate (requests/s)")
    b.set_ylabel("p99 TTFT (ms)")
    b.set_yscale("log")
    a.legend()
    b.legend()
    fig.tight_layout()
    return fig


def _row(ablation, variant):
    return ablation[ablation["variant"] == variant].iloc[0]


def layer_spread(steps: pd.DataFrame) -> float:
    """The largest over the run's steps of (most - least KV bytes in use over layers) / most: how unequal the layers'
    footprints were (0: every layer the same)."""
    used = _used(steps)
    top = used.max(1)
    keep = top > 0
    return float(((top - used.min(1))[keep] / top[keep]).max()) if keep.any() else 0.0


def reassignment_facts(steps: pd.DataFrame, setting: dict) -> dict:
    """When the shared pool's run reassigned chunks: ``reassigned`` (chunks), ``first_ms`` (time of the first, NaN
    without), ``steps_with`` (decode steps in which some were), ``least_free`` (fewest free chunks at a step),
    ``chunks`` (in the budget), ``steps`` (decode steps)."""
    r = steps["reassigned"].to_numpy()
    moved = np.flatnonzero(np.diff(r, prepend=0) > 0)
    return dict(reassigned=int(r[-1]) if len(r) else 0,
                first_ms=_ms(float(steps["time"].iloc[moved[0]])) if len(moved) else math.nan,
                steps_with=int(len(moved)), least_free=int(steps["chunks_free"].min()) if len(r) else 0,
                chunks=int(setting["chunks"]), steps=len(r))


def verdict(ablation: pd.DataFrame, curve: pd.DataFrame, steps: pd.DataFrame, ttft_limit_s=None,
            gpu: pd.DataFrame | None = None) -> tuple[str, str]:
    """``(text, kind)``: chunks reassigned in the shared pool's run, the shared pool against per-layer pools and
    against admission at raw size, and the sustained rates: with ``gpu`` (:func:`read_table`) the GPU run's
    (:func:`gpu_sustained`), else this run's curves' (:func:`curve_text`); below :data:`RATE_BAR` a warning."""
    sh, pl, raw, un = (_row(ablation, v) for v in ("shared pool", "per-layer pools", "shared pool, admission at raw size",
                                                   "uncompressed"))
    f = reassignment_facts(steps, dict(chunks=sh.chunks))
    if f["reassigned"]:
        parts = [f"Chunks moved between layers: **{f['reassigned']}** chunks emptied by one layer were taken by "
                 f"another, in {f['steps_with']} of {f['steps']} decode steps, the first at {f['first_ms']:.1f} ms."]
    else:
        parts = ["No chunk moved between layers on this trace: a layer takes a chunk it emptied itself, then one no "
                 "layer has used, before another layer's, and "
                 + (f"the pool's {f['chunks']} chunks never all came into use (at least {f['least_free']} stayed free)."
                    if f["least_free"] > 0 else
                    f"although the pool's free chunks ran out, no layer later needed more chunks than it had held "
                    f"before (over {f['steps']} decode steps).")]
    parts.append(f"The shared pool ran a largest batch of **{sh.max_batch}** at **{sh.tokens_per_s:.0f}** output "
                 f"tokens/s, per-layer pools **{pl.max_batch}** at **{pl.tokens_per_s:.0f}**, uncompressed "
                 f"**{un.max_batch}** at **{un.tokens_per_s:.0f}**.")
    if sh.max_batch == pl.max_batch and abs(sh.tokens_per_s - pl.tokens_per_s) <= 0.05 * pl.tokens_per_s:
        parts.append(f"Sharing the pool gained little over fixed per-layer shares: the layers' bytes in use differed "
                     f"by at most {100 * layer_spread(steps):.0f} % at any step, so each layer's own share had about the "
                     f"room it needed.")
    parts.append(f"Admission at the raw size (compression still on) reached a largest batch of **{raw.max_batch}**: "
                 + ("the room compression frees is what admits the extra requests." if raw.max_batch < sh.max_batch
                    else "on this trace the room compression frees admitted no extra request."))
    kind = "tip" if sh.max_batch >= pl.max_batch and sh.tokens_per_s >= pl.tokens_per_s and f["reassigned"] > 0 \
        else "warning"
    if gpu is None and len(curve) and ttft_limit_s:
        parts.append(curve_text(curve, ttft_limit_s))
        if not _sustained(curve, ttft_limit_s)["ratio"] >= RATE_BAR:
            kind = "warning"
    elif gpu is not None:
        g = gpu_sustained(gpu)
        parts.append(f"**On a GPU** (p99 TTFT ≤ {g['limit']:g} s) uncompressed serving sustains {g['uncompressed']}, "
                     f"ZipFusion {g['zipfusion']}: its time per output token is {g['tpot_ratio']:.1f}× higher.")
        if not g["ratio"] >= RATE_BAR:
            kind = "warning"
    return " ".join(parts), kind


def _sustained(curve: pd.DataFrame, ttft_limit_s: float) -> dict:
    """Each method's highest rate of ``curve`` under the p99 TTFT limit (NaN: none), the ``rates`` tried, and
    ``ratio`` = ZipFusion's over uncompressed's (NaN where uncompressed sustains none; 0 where only ZipFusion does)."""
    r = {m: sustained_rate(curve, m, ttft_limit_s) for m in ("uncompressed", "zipfusion")}
    z, u = r["zipfusion"], r["uncompressed"]
    return dict(r, rates=sorted(curve["rate"].unique()),
                ratio=math.nan if math.isnan(u) else 0.0 if math.isnan(z) else z / u)


def curve_text(curve: pd.DataFrame, ttft_limit_s: float) -> str:
    """One sentence on a run's serving curves: the highest rate each method sustains under the p99 TTFT limit."""
    r = _sustained(curve, ttft_limit_s)

    def words(x):
        return "none of the rates tried" if math.isnan(x) else f"{x:g} requests/s"

    ratio = f" ({r['ratio']:.2f}× uncompressed's)" if r["ratio"] > 0 else ""
    return (f"Of the rates tried ({', '.join(f'{x:g}' for x in r['rates'])} requests/s), with p99 TTFT at most "
            f"{_ms(ttft_limit_s):.0f} ms, ZipFusion sustains {words(r['zipfusion'])}{ratio} and uncompressed serving "
            f"{words(r['uncompressed'])}.")


def gpu_sustained(gpu: pd.DataFrame) -> dict:
    """From :func:`read_table`'s GPU table: each method's highest rate under the p99 TTFT limit, as words (``uncompressed``,
    ``zipfusion``), their ``ratio`` (NaN where uncompressed sustains none; 0 where only ZipFusion sustains none),
    ``limit`` (s) and ``tpot_ratio`` (ZipFusion's median time per output token over uncompressed's at the lowest
    rate)."""
    curve = gpu_curve(gpu)
    limit = float(curve["ttft_limit_s"].iloc[0])
    r = _sustained(curve, limit)
    rates = r["rates"]
    low = {m: curve[(curve["method"] == m) & (curve["rate"] == rates[0])].iloc[0] for m in ("uncompressed", "zipfusion")}

    def words(x):
        return ("none of the rates tried" if math.isnan(x) else
                f"every rate tried (up to {x:g} requests/s)" if x == rates[-1] else f"rates up to {x:g} requests/s")

    return dict(uncompressed=words(r["uncompressed"]), zipfusion=words(r["zipfusion"]), limit=limit, rates=rates,
                low=low, ratio=r["ratio"],
                tpot_ratio=float(low["zipfusion"].tpot_median_s / low["uncompressed"].tpot_median_s))


def claims_table(ablation: pd.DataFrame) -> pd.DataFrame:
    """The paper's claims on the memory manager (it prints no number for them) beside what this run shows."""
    sh, raw = _row(ablation, "shared pool"), _row(ablation, "shared pool, admission at raw size")
    ours = {"reassigned": f"{sh.chunks_reassigned} chunks reassigned between layers in the shared pool's run; "
                          f"per-layer pools: {_row(ablation, 'per-layer pools').chunks_reassigned}",
            "growth": f"largest batch {sh.max_batch} counting the room compression frees, {raw.max_batch} without",
            "reserve": f"reservations of {ablation['reserve_ratio'].iloc[0]:g} of each request's remaining pages; "
                       f"{sh.retractions} retractions when a step found no page"}
    return pd.DataFrame([dict(section=s, paper=c, ours=ours[k]) for s, c, k in PAPER_CLAIMS])


def reading(ablation: pd.DataFrame, steps: pd.DataFrame) -> str:
    """The paragraph under the timeline, its numbers from the run: how far the free chunks fell, the spread of the
    layers' footprints, retractions and requests that finished while others waited."""
    sh = _row(ablation, "shared pool")
    f = reassignment_facts(steps, dict(chunks=sh.chunks))
    waited = int((steps["waiting"] > 0).sum())
    return (f"In this run the free chunks fell to **{f['least_free']}** of the budget's {f['chunks']}, requests waited "
            f"in the queue during {waited} of the {f['steps']} decode steps, and the shared pool retracted "
            f"**{int(sh.retractions)}** request(s) when a step found no page. The layers' bytes in use differed by at "
            f"most **{100 * layer_spread(steps):.0f} %** at any step: the embedded model's keys and values compress "
            f"about equally well in every layer, so what one layer gives up and another takes is small, and most of "
            f"what a finished request frees goes back to the same layers when the next one is admitted.")


def setting_caption(setting: dict) -> str:
    """One sentence on the run: model, requests and their lengths, budget, chunk size, reservations, clock."""
    s = setting
    where = ("Llama-3.1-8B shapes with random weights, each request a real-KV prefix" if s["model"] != "SmolLM2-135M"
             else "SmolLM2-135M end to end on PG19 prompts")
    clock = ("simulated clock (a GPU's cost per decode step and per prefilled token; the tokens are the model's)"
             if s["clock"] == "simulated" else "wall clock")
    return (f"{where}, {s['device']}; {s['requests']} requests of {s['prompt_lengths'][0]}-{s['prompt_lengths'][1]} "
            f"prompt and {s['output_lengths'][0]}-{s['output_lengths'][1]} output tokens arriving at {s['rate']:g} "
            f"requests/s (Poisson); a KV budget of {s['kv_budget_bytes'] / 2**20:.1f} MiB ({s['budget_requests']} "
            f"mean-length requests uncompressed) in chunks of {s['pages_per_chunk']} pages; reservations of "
            f"{s['reserve_ratio']:g} of each request's remaining pages; {clock}.")


def read_table(path) -> pd.DataFrame | None:
    """A committed table, or None where there is none: the GPU runs (``results/paper/memory_manager_gpu.csv``:
    ``run`` ``saturated`` -- the ablation of one overloaded trace -- and ``curve`` -- the serving curves), or the
    latency chapter's engine table of few long requests."""
    from pathlib import Path
    return pd.read_csv(path) if Path(path).is_file() else None


def _gpu_rows(gpu: pd.DataFrame, table: str, run: str) -> pd.DataFrame:
    """Rows of ``table`` (``curve`` or ``ablation``); where the GPU table holds several runs (a ``run`` column), of ``run``."""
    keep = gpu["table"] == table
    if "run" in gpu:
        keep &= gpu["run"] == run
    return gpu[keep].reset_index(drop=True)


def gpu_curve(gpu: pd.DataFrame) -> pd.DataFrame:
    """The serving-curve rows of :func:`read_table`'s GPU table, in :func:`plot_curves`' form."""
    return _gpu_rows(gpu, "curve", "curve")


def engine_steps(engine: pd.DataFrame | None) -> dict:
    """From the latency chapter's engine table of few long requests (``zipfusion_few_requests_engine_*.csv``):
    per (context, batch) at Llama-3.1-8B's shape, ``(zipfusion step ms, uncompressed step ms)``, points both ran."""
    if engine is None:
        return {}
    e = engine[engine["model"].str.startswith("Llama") & engine["step_ms"].notna()]
    steps = e.pivot_table(index=["context", "batch"], columns="method", values="step_ms")
    steps = steps.dropna(subset=[c for c in ("zipfusion", "uncompressed") if c in steps])
    if not {"zipfusion", "uncompressed"} <= set(steps.columns):
        return {}
    return {key: (float(row["zipfusion"]), float(row["uncompressed"])) for key, row in steps.iterrows()}


def gpu_text(gpu: pd.DataFrame, engine: pd.DataFrame | None = None) -> str:
    """The GPU section's paragraph: the highest rate each method sustains under the stated p99 TTFT limit, time per
    output token at the lowest rate, and the overloaded trace's ablation, with the run's device and commit; with
    ``engine`` (the latency chapter's few-requests engine table, same card) the decode step with prompts already
    compressed, set beside the serving run's time per token."""
    curve, sat = gpu_curve(gpu), _gpu_rows(gpu, "ablation", "saturated")
    g = gpu_sustained(gpu)
    limit, rates, low = g["limit"], g["rates"], g["low"]

    c = curve.iloc[0]
    text = (f"On an {c['device'].split(' (')[0]} (commit {c['commit']}), Llama-3.1-8B's shapes with random weights and "
            f"real-KV prefixes, {int(c['requests'])} requests of {int(c['prompt_lengths_min']):,}–"
            f"{int(c['prompt_lengths_max']):,} prompt and {int(c['output_lengths_min'])}–{int(c['output_lengths_max'])} "
            f"output tokens arriving at {', '.join(f'{r:g}' for r in rates)} requests/s, under a budget that holds "
            f"{int(c['budget_requests'])} mean-length requests uncompressed: with p99 TTFT at most {_ms(limit):.0f} ms, "
            f"uncompressed serving sustains {g['uncompressed']} and ZipFusion {g['zipfusion']} "
            f"(p99 TTFT {low['zipfusion'].ttft_p99_s:.1f} s already at {rates[0]:g} request/s). Its decode steps are "
            f"slower: at {rates[0]:g} request/s ZipFusion's median time per output token is "
            f"**{_ms(low['zipfusion'].tpot_median_s):.1f} ms** against uncompressed's "
            f"**{_ms(low['uncompressed'].tpot_median_s):.1f} ms** "
            f"({g['tpot_ratio']:.1f}×), with at most {int(low['zipfusion'].max_batch)} long requests running; requests "
            f"then queue behind the slower steps before the room compression frees is ever needed.")
    steps = engine_steps(engine)
    if steps:
        shown = "; ".join(f"{b} request{'s' if b > 1 else ''} of {n // 1024}K tokens {z:.1f} ms per step compressed "
                          f"against {u:.1f} ms uncompressed" for (n, b), (z, u) in sorted(steps.items()))
        text += (f" The decode step over prompts already compressed is not slower: on the same card the engine "
                 f"decodes {shown} ({{doc}}`the latency chapter <zipfusion_attention_latency>`). What differs is what "
                 f"serving adds: each admitted request's prompt KV of up to {int(c['prompt_lengths_max']):,} tokens is "
                 f"packed and placed while the running requests wait, and pages are packed as they fill; this run "
                 f"does not yet split the time per token between them.")
    else:
        text += " This run does not yet split the step time between decoding, admission and packing."
    if len(sat):
        s = {v: sat[sat["variant"] == v].iloc[0] for v in sat["variant"]}
        n = int(sat["requests"].iloc[0])
        text += (f" An overloaded trace ({n} requests arriving at {sat['rate'].iloc[0]:g}/s, same run) shows the "
                 f"capacity side: largest batch " + ", ".join(f"{v} **{int(r.max_batch)}**" for v, r in s.items())
                 + "; output tokens/s " + ", ".join(f"{v} {r.tokens_per_s:.0f}" for v, r in s.items())
                 + f"; chunks reassigned between layers in the shared pool: {int(s['shared pool'].chunks_reassigned)}.")
    return text
