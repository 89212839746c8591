"""Chapter "A distilled prefix in ZipFusion pages": its verdict, figure and table from
:func:`zipkv.study.experiments.compose.serve_distilled`'s rows."""
from __future__ import annotations

import pandas as pd

from zipkv.study import report

__all__ = ["summary", "verdict", "figure"]


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per cache (``method``, in the table's order): the mean over windows of the pairs kept, the compressible K / V
    blocks, the bits per stored value and the stored bytes per raw context byte; the windows whose packed pages gave
    the raw pages' tokens; the mean first greedy difference from the full context."""
    g = table.groupby("method", sort=False)
    return pd.DataFrame(dict(
        ratio=g.ratio.first(), pairs=g.pairs.mean(), frac_compressed_k=g.frac_compressed_k.mean(),
        frac_compressed_v=g.frac_compressed_v.mean(), bits_per_value=g.bits_per_value.mean(),
        memory_vs_raw_context=g.memory_vs_raw_context.mean(), lossless_windows=g.lossless.sum(),
        windows=g.size(), first_difference=g.first_difference.mean(), new_tokens=g.new_tokens.first()))


SHOWN_COLUMNS = {"method": "cache", "ratio": "r", "pg_id": "PG19 book", "n_context": "context tokens",
                 "pairs": "pairs per KV head", "frac_compressed_k": "compressible K blocks",
                 "frac_compressed_v": "compressible V blocks", "bits_per_value": "bits per value",
                 "memory_vs_raw_context": "bytes / raw context", "lossless_windows": "windows: packed = raw tokens",
                 "lossless": "packed = raw tokens", "first_difference": "first differing token",
                 "new_tokens": "tokens generated"}
"""The table's columns as a reader reads them."""
_FORMATS = {"r": "{:g}", "pairs per KV head": "{:.0f}", "compressible K blocks": "{:.1%}",
            "compressible V blocks": "{:.1%}", "bits per value": "{:.2f}", "bytes / raw context": "{:.1%}",
            "first differing token": "{:.1f}"}


def _cache_label(method: str) -> str:
    """``"kvsculpt r=0.3"`` as ``"KVSculpt, r = 0.3"``; other caches as they are named."""
    return f"KVSculpt, r = {method.split('=')[1]}" if method.startswith("kvsculpt r=") else method


def summary_shown(table: pd.DataFrame):
    """:func:`summary` as the page shows it: caches and columns in words, shares in %."""
    s = summary(table)
    s.index = [_cache_label(m) for m in s.index]
    s = s.rename_axis("cache").rename(columns=SHOWN_COLUMNS)
    return s.style.format({c: f for c, f in _FORMATS.items() if c in s})


def windows_shown(table: pd.DataFrame):
    """The per-window table as the page shows it."""
    t = table.assign(method=table.method.map(_cache_label)).rename(columns=SHOWN_COLUMNS)
    return t.style.format({c: f for c, f in _FORMATS.items() if c in t and c != "first differing token"}).hide(axis="index")


def verdict(table: pd.DataFrame) -> tuple[str, str]:
    """``(markdown, kind)``: do the two papers compose on this table's windows?"""
    s = summary(table)
    full = s.loc["full context"]
    distilled = s.drop(index="full context")
    lossless = int(s.lossless_windows.sum()) == int(s.windows.sum())
    parts = []
    for method, row in distilled.iterrows():
        parts.append(f"at r = {row.ratio:g} ({row.pairs:.0f} pairs per KV head) K {row.frac_compressed_k:.0%} / "
                     f"V {row.frac_compressed_v:.0%} of blocks fit, {row.bits_per_value:.2f} bits per value, and the "
                     f"prefix takes **{row.memory_vs_raw_context:.1%}** of the raw context's bytes (KVSculpt alone "
                     f"{row.pairs / table.n_context.iloc[0]:.1%}, ZipFusion alone {full.memory_vs_raw_context:.1%})")
    text = (f"KVSculpt's distilled pairs stay compressible in ZipFusion's format (the model's own KV: K "
            f"{full.frac_compressed_k:.0%} / V {full.frac_compressed_v:.0%} of blocks, {full.bits_per_value:.2f} bits "
            f"per value): " + "; ".join(parts) + ". ")
    text += (f"Packed pages gave the raw pages' greedy tokens in {int(s.lossless_windows.sum())} of "
             f"{int(s.windows.sum())} runs" + (" (lossless)" if lossless else ": **not lossless**") + ". ")
    follow = " and ".join(f"{row.first_difference:.1f} (r = {row.ratio:g})" for _, row in distilled.iterrows())
    text += (f"The engine's greedy tokens from the distilled prefix follow the full context's for the first "
             f"{follow} of {int(full.new_tokens)} tokens, on average over "
             f"{report.count(table.window.nunique(), 'window')}.")
    return text, ("tip" if lossless else "warning")


def figure(table: pd.DataFrame):
    """Two panels per cache: stored bytes per raw context byte (ZipFusion's format on KVSculpt's pairs, beside each
    alone), and the share of compressible K and V blocks; a dot per window, a bar for the mean."""
    import matplotlib.pyplot as plt

    s = summary(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(s))
    left.bar(x, s.memory_vs_raw_context, color="tab:blue", alpha=0.7, label="stored in ZipFusion's format")
    left.scatter(x, s.pairs / table.n_context.iloc[0], marker="_", s=600, color="black", label="the pairs raw (KVSculpt alone)")
    for i, (_, d) in enumerate(table.groupby("method", sort=False)):
        left.scatter([i] * len(d), d.memory_vs_raw_context, color="black", s=10, zorder=3)
    left.set(xticks=list(x), ylabel="stored bytes / raw BF16 context bytes", ylim=(0, 1.05),
             title="Memory of the prefix")
    left.set_xticklabels(s.index, rotation=15)
    left.legend(fontsize=8)
    width = 0.38
    right.bar([i - width / 2 for i in x], s.frac_compressed_k, width, label="keys")
    right.bar([i + width / 2 for i in x], s.frac_compressed_v, width, label="values")
    right.set(xticks=list(x), ylabel="blocks that fit [b, b+15] (share)", ylim=(0, 1.05), title="Compressible blocks")
    right.set_xticklabels(s.index, rotation=15)
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig
