"""Chapter "The model, the data and the KV cache": the model beside the papers', the PG19 windows,
BF16 exponents per layer and which 512-value blocks ZipFusion's format can compress."""
from __future__ import annotations

import pandas as pd

from zipkv import models


def shapes_table(shape) -> pd.DataFrame:
    """The attention shapes of ``shape`` (this study's model) and the papers' models: heads, group size, KV bytes per
    token in BF16, and which study uses each."""
    shapes = [shape, *models.PAPER_MODELS.values()]
    table = pd.DataFrame(shapes)
    table["group size"] = table.q_heads // table.kv_heads
    table["KV bytes / token (BF16)"] = [s.kv_bytes_per_token for s in shapes]
    table["used in"] = ["this study"] + ["KVSculpt", "ZipFusion", "ZipFusion"]
    return table.rename(columns={"name": "model", "q_heads": "query heads", "kv_heads": "KV heads",
                                 "rope_theta": "RoPE base"})


def windows_table(windows) -> pd.DataFrame:
    """One row per PG19 window: its book, title, character offset, tokens and distinct tokens."""
    return pd.DataFrame([{"PG19 book": w.pg_id, "title": w.title[:48], "char offset": w.char_offset,
                          "tokens": len(w.input_ids), "distinct tokens": len(set(w.input_ids.tolist()))} for w in windows])


def exponent_figure(hist: dict):
    """Heat maps (layer × exponent) of the log10 fraction of each layer's keys and values per BF16 exponent;
    returns ``(fig, sentence)``."""
    import matplotlib.pyplot as plt
    import torch

    both = hist["K"].sum(0) + hist["V"].sum(0)
    zero_fraction = both[0].item() / both.sum().item()  # exponent field 0: zeros and subnormals
    used = (both[1:] >= 1e-6 * both.sum()).nonzero().flatten() + 1  # normal exponents seen at least once per million
    lo, hi = int(used.min()), int(used.max())
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, name in zip(axes, ("K", "V")):
        frac = hist[name][:, lo:hi + 1].double()
        frac = frac / frac.sum(1, keepdim=True)
        im = ax.imshow(torch.log10(frac.clamp_min(1e-7)), aspect="auto", origin="lower", cmap="viridis",
                       extent=(lo - 127 - 0.5, hi - 127 + 0.5, -0.5, frac.shape[0] - 0.5), vmin=-7, vmax=0)
        ax.set(xlabel="unbiased exponent e (value ≈ ±2^e)", title="keys" if name == "K" else "values")
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes, label="log10 fraction of the layer's values")
    return fig, (f"Exponents from 2^{lo - 127} to 2^{hi - 127} each hold at least one value in a million; "
                 f"{100 * zero_fraction:.4f} % of values are zeros or subnormals (exponent field 0).")


def eligibility_figure(table: pd.DataFrame):
    """Compressible blocks (%) per layer, for K and V in both block layouts."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    for column, style in zip(table.columns, ("-o", "--o", "-s", "--s")):
        ax.plot(table.index, 100 * table[column], style, label=column.replace("_", ", ") + "-major", ms=4)
    ax.set(xlabel="layer", ylabel="compressible 512-value blocks (%)", ylim=(-2, 102))
    ax.legend(title="tensor, block layout")
    ax.grid(alpha=0.3)
    return fig


def eligibility_verdict(table: pd.DataFrame, n_windows: int) -> str:
    """Per tensor: the share of compressible blocks per layout (layers weigh equally: same block count)."""
    parts = []
    for t, name in (("K", "keys"), ("V", "values")):
        token, channel = table[f"{t}_token"], table[f"{t}_channel"]
        parts.append(f"{name} **{100 * token.mean():.1f} %** token-major ({100 * channel.mean():.1f} % channel-major; "
                     f"weakest layer {int(token.idxmin())} at {100 * token.min():.1f} %)")
    return (f"Over {n_windows} PG19 windows and all {len(table)} layers, ZipFusion's format can compress "
            + " and ".join(parts) + " of the 512-value blocks; the token-major fractions are the *measured mix* "
            "that the attention benchmark draws its real-KV data from.")
