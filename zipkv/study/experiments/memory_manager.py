"""The memory manager at work (ZipFusion §II-C, §III-D): requests arriving over time under one KV budget, the
manager's parts ablated, and serving curves (throughput and p99 TTFT against the request rate).

One trace (:func:`zipkv.serving.poisson_trace`: PG19 prompts, Poisson arrivals) is served by the engine
(:func:`zipkv.serving.serve`) four ways under the same budget (:data:`VARIANTS`); the shared pool's run is the
timeline. The serving curves serve the same requests at each rate of ``rates``, uncompressed and ZipFusion.

Two settings: the embedded model end to end (``shape=None``: SmolLM2-135M, the CPU's reference attention, the
simulated clock of :class:`zipkv.serving.StepCost` by default) and ``shape="llama3.1-8b"`` (a GPU: Llama-3.1-8B's shapes
with random weights, each request a real-KV prefix of its prompt length, :func:`zipkv.study.experiments.throughput.real_prefix`,
plus one token, as the throughput chapter builds them; the wall clock by default).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import torch

from zipkv import serving
from zipkv.engine import Engine, kv_budget_for

VARIANTS = {
    "uncompressed": dict(compress="none"),
    "per-layer pools": dict(compress="all", pool="per_layer"),
    "shared pool": dict(compress="all"),
    "shared pool, admission at raw size": dict(compress="all", admission="uncompressed"),
}
"""The ablation (issue's (a)-(d)): engine keywords of each variant. ZipFusion's manager is ``"shared pool"``."""

CURVE_METHODS = {"uncompressed": "uncompressed", "zipfusion": "shared pool"}
"""The serving curves' methods and the variant each serves as."""


def _setting(device, shape, seed, kv_windows):
    """``(model, tokenizer, blocks)``: the embedded model (``shape=None``), or a random model of ``shape`` with the
    embedded model's real-KV blocks for its prefixes."""
    from zipkv import data, models
    small, tok = models.load_model(dtype=torch.bfloat16)
    if shape is None:
        return small.to(device), tok, None
    from zipkv.study.experiments.throughput import real_kv_blocks
    small = small.to(device)
    blocks = real_kv_blocks(small, tok, data.load_books(), windows=kv_windows, seed=seed + 1)
    del small
    return models.random_model(shape, device=device), tok, blocks


def _prefixed(trace, model, blocks, seed):
    """For a model of another shape: each request a real-KV prefix of its prompt length less one and one random
    prompt token (the throughput chapter's requests), arrivals and output lengths unchanged."""
    from zipkv.study.experiments.throughput import real_prefix
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(model.config.vocab_size, (len(trace),), generator=gen).tolist()
    prefixes = [real_prefix(blocks, model.config, len(p) - 1, seed + i) if len(p) > 1 else None
                for i, p in enumerate(trace.prompts)]
    return serving.Trace(trace.arrivals, [[t] for t in tokens], trace.max_new_tokens, trace.rate, trace.seed,
                         trace.prompt_lengths, trace.output_lengths), prefixes


def run(*, device="cpu", shape=None, requests=12, prompt_lengths=(64, 192), output_lengths=(16, 48), rate=None,
        rates=(), budget_requests=3, pages_per_chunk=4, reserve_ratio=0.5, clock=None, ttft_limit_s=None, seed=0,
        kv_windows=2, variants=None, progress_csv=None) -> dict:
    """The chapter's runs. requests, prompt_lengths, output_lengths, seed: the trace (:func:`zipkv.serving.poisson_trace`);
    rate: its requests per second for the timeline and the ablation; rates: the serving curves' (empty: none).
    budget_requests: the KV budget holds that many requests of the mean prompt + output length uncompressed
    (:func:`zipkv.engine.kv_budget_for`). pages_per_chunk, reserve_ratio: the memory manager's
    (:class:`zipkv.memory.KVMemory`). clock: ``"simulated"`` or ``"wall"`` (default: simulated on the CPU, wall on a
    GPU). ttft_limit_s: the p99 TTFT under which a rate counts as sustained. progress_csv: each ablation and curve
    row is written there as soon as it is measured (a GPU run cut short keeps what it measured), with a ``table``
    column (``ablation`` or ``curve``) and the setting's columns.

    Returns ``dict(timeline=ServeResult, ablation=DataFrame, curve=DataFrame, setting=dict)``: one ablation row per
    variant (:data:`VARIANTS`, :func:`zipkv.serving.summarize`'s columns), one curve row per method and rate."""
    if rate is None or not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"rate must be a number > 0 (requests per second), got {rate!r}")
    clock = clock or ("wall" if torch.device(device).type == "cuda" else "simulated")
    model, tok, blocks = _setting(device, shape, seed, kv_windows)
    mean_tokens = (sum(prompt_lengths) + sum(output_lengths)) // 2
    budget = kv_budget_for(model.config, budget_requests, mean_tokens, pages_per_chunk=pages_per_chunk)

    def one(variant, r):
        trace = serving.poisson_trace(r, requests, prompt_lengths, output_lengths, seed, tokenizer=tok)
        prefixes = None
        if blocks is not None:
            trace, prefixes = _prefixed(trace, model, blocks, seed)
        eng = Engine(model, budget, pages_per_chunk=pages_per_chunk, reserve_ratio=reserve_ratio, eos_token_id=None,
                     **VARIANTS[variant])
        res = serving.serve(eng, trace, clock=clock, prefixes=prefixes)
        del eng
        return res

    from zipkv import format as fmt
    cfg = model.config
    page = 2 * cfg.num_key_value_heads * fmt.page_bytes(getattr(cfg, "head_dim", None)
                                                        or cfg.hidden_size // cfg.num_attention_heads)
    from zipkv.provenance import provenance
    run_info = provenance("bench")
    setting = dict(model=shape or "SmolLM2-135M",
                   device=run_info["device"] if torch.device(device).type == "cuda" else str(device),
                   commit=run_info["commit"], date=run_info["date"], clock=clock, requests=requests,
                   prompt_lengths=tuple(prompt_lengths), output_lengths=tuple(output_lengths), rate=rate,
                   budget_requests=budget_requests, kv_budget_bytes=budget, pages_per_chunk=pages_per_chunk,
                   reserve_ratio=reserve_ratio, ttft_limit_s=ttft_limit_s, seed=seed,
                   num_layers=cfg.num_hidden_layers, chunks=budget // (pages_per_chunk * page))
    flat = {}
    for k, v in setting.items():
        if isinstance(v, tuple):
            flat[f"{k}_min"], flat[f"{k}_max"] = v
        else:
            flat[k] = v
    measured = []

    def keep(table, row):
        measured.append(dict(table=table, **row, **{k: v for k, v in flat.items() if k not in row}))
        if progress_csv is not None:       # rewritten whole: ablation and curve rows have different columns
            pd.DataFrame(measured).to_csv(progress_csv, index=False)
        return row

    runs, rows = {}, []
    for variant in variants or VARIANTS:
        runs[variant] = one(variant, rate)
        rows.append(keep("ablation", dict(variant=variant, rate=rate, **runs[variant].summary())))
    curve = []
    for method, variant in CURVE_METHODS.items():
        for r in rates:
            res = runs[variant] if r == rate and variant in runs else one(variant, r)
            curve.append(keep("curve", dict(method=method, rate=r, **res.summary())))
    ablation = pd.DataFrame(rows)
    for k, v in flat.items():
        if k not in ablation:
            ablation[k] = v
    return dict(timeline=runs.get("shared pool"), ablation=ablation, curve=pd.DataFrame(curve), setting=setting)


def steps_table(result) -> pd.DataFrame:
    """A served trace's decode steps (:class:`zipkv.serving.ServeResult`), one row each: ``time`` (s), ``batch``,
    ``waiting``, ``chunks_free``, ``chunks_held``, ``reassigned`` and ``retracted`` (so far), and the KV bytes in
    use of each layer ``l`` as ``used_bytes_<l>``."""
    rows = []
    for s in result.steps:
        row = {k: s[k] for k in ("time", "batch", "waiting", "chunks_free", "chunks_held", "reassigned", "retracted")}
        row.update({f"used_bytes_{l}": b for l, b in enumerate(s["used_bytes"])})
        rows.append(row)
    return pd.DataFrame(rows)


def save(result: dict, results_csv) -> dict:
    """Write :func:`run`'s tables: the ablation as ``results_csv``, the shared pool's steps beside it
    (``<stem>_steps.csv``, :func:`steps_table`) and the serving curves where there are any (``<stem>_curve.csv``).
    Returns ``dict(ablation=..., steps=..., curve=...)``, the tables as written."""
    path = Path(results_csv)
    tables = dict(ablation=result["ablation"], steps=steps_table(result["timeline"]), curve=result["curve"])
    tables["ablation"].to_csv(path, index=False)
    tables["steps"].to_csv(path.with_name(f"{path.stem}_steps.csv"), index=False)
    if len(tables["curve"]):
        tables["curve"].to_csv(path.with_name(f"{path.stem}_curve.csv"), index=False)
    return tables


def sustained_rate(curve: pd.DataFrame, method: str, ttft_limit_s: float) -> float:
    """The highest rate of ``curve`` at which ``method``'s p99 TTFT is within ``ttft_limit_s`` (NaN where none is)."""
    ok = curve[(curve["method"] == method) & (curve["ttft_p99_s"] <= ttft_limit_s)]
    return float(ok["rate"].max()) if len(ok) else math.nan
