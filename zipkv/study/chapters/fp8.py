"""Chapter "Lossless 12-bit against lossy 8-bit": what FlashInfer's FP8 KV cache costs the embedded model's
next-token distributions (:func:`zipkv.bench.kv_fp8.fp8_cache_kl`), beside ZipFusion's format, and -- where the
committed GPU run holds them -- the two formats' decode latencies from the same run."""
from __future__ import annotations

import pandas as pd

from zipkv.study import report

LABELS = {"zipfusion": "ZipFusion 12-bit (lossless)", "fp8_e4m3 unit": "FP8 e4m3, scale 1",
          "fp8_e4m3 per_layer": "FP8 e4m3, per-layer scale"}


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per format: mean, median and largest per-window KL (nats per token), mean top-1 agreement, the stored values'
    relative error (keys, values) and the windows measured."""
    g = table.groupby("format", sort=False)
    out = pd.DataFrame({"mean KL (nats/token)": g.kl.mean(), "median KL": g.kl.median(), "largest KL": g.kl.max(),
                        "top-1 agreement": g.top1_agreement.mean(), "key error (rel. L2)": g.rel_error_k.mean(),
                        "value error (rel. L2)": g.rel_error_v.mean(), "windows": g.window.nunique()})
    out.index = [LABELS.get(f, f) for f in out.index]
    return out


def summary_table(table: pd.DataFrame):
    """:func:`summary` as the page shows it: KL and errors to three significant digits, agreement in %, no padded
    floats."""
    return (summary(table).style
            .format({"mean KL (nats/token)": "{:.3g}", "median KL": "{:.3g}", "largest KL": "{:.3g}",
                     "top-1 agreement": "{:.1%}", "key error (rel. L2)": "{:.3g}", "value error (rel. L2)": "{:.3g}",
                     "windows": "{:d}"}))


def verdict(table: pd.DataFrame) -> tuple[str, str]:
    """``(text, admonition kind)``: the formats' KL side by side, computed from ``table``."""
    s = summary(table)
    ours, unit = s.loc[LABELS["zipfusion"]], s.loc[LABELS["fp8_e4m3 unit"]]
    windows, context = int(unit["windows"]), int(table.n_context.iloc[0])
    lossless = ours["largest KL"] == 0
    text = (f"Over {report.count(windows, 'PG19 window')} of {context} tokens, storing the cache in FP8 (e4m3, scale 1) shifts the "
            f"next-token distribution by a mean KL of **{unit['mean KL (nats/token)']:.2g} nats per token** "
            f"(largest window {unit['largest KL']:.2g}; the most likely token changes at "
            f"{100 * (1 - unit['top-1 agreement']):.1f} % of positions). ZipFusion's 12-bit format reads back "
            + ("the same bits: KL exactly 0 on every window." if lossless else
               f"values with a mean KL of {ours['mean KL (nats/token)']:.2g}: it is not lossless here."))
    if LABELS["fp8_e4m3 per_layer"] in s.index:
        text += (f" A per-layer scale (calibrated on the context itself) gives "
                 f"{s.loc[LABELS['fp8_e4m3 per_layer'], 'mean KL (nats/token)']:.2g}.")
    return text, ("tip" if lossless else "warning")


def figure(table: pd.DataFrame):
    """Per-window KL of each format (points) and its mean (bar), nats per token."""
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(table.format))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, f in enumerate(formats):
        kl = table.loc[table.format == f, "kl"]
        ax.bar(i, kl.mean(), color="#cfd8e3", width=0.6)
        ax.scatter([i] * len(kl), kl, color="#1f4e79", s=14, zorder=3)
    ax.set_xticks(range(len(formats)), [LABELS.get(f, f) for f in formats])
    ax.set_ylabel("KL vs. the BF16 cache (nats/token)")
    ax.set_xlabel("how the cache is stored")
    fig.tight_layout()
    return fig


def latency_side_by_side(latency: pd.DataFrame | None) -> pd.DataFrame | None:
    """From the latency chapter's committed table: per (context, batch) where FlashInfer's FP8 decode was timed,
    its latency beside FlashInfer BF16 (tensor cores) and ours (measured mix, all compressible), µs; None where the
    table has no FP8 rows."""
    if latency is None or "method" not in latency or not (latency.method == "flashinfer_fp8").any():
        return None
    t = latency[latency["shape"] == "llama3.1-8b"]
    pick = {"FlashInfer FP8 (lossy)": t.method == "flashinfer_fp8",
            "FlashInfer BF16": t.method == "flashinfer_tc",
            "ours, measured mix": (t.method == "zipkv_compressed") & (t.kv_data == "measured mix")
            & (t.get("kernel", "gluon") == "gluon"),
            "ours, all compressible": (t.method == "zipkv_compressed") & (t.kv_data == "all compressible")
            & (t.get("kernel", "gluon") == "gluon")}
    cols = {name: t[mask].groupby(["ctx", "batch"]).latency_us.min() for name, mask in pick.items()}
    out = pd.DataFrame(cols).dropna(subset=["FlashInfer FP8 (lossy)"])
    out.index.names = ["context", "batch"]
    return out.round(1)
