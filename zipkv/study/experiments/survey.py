"""What the KV cache of a real model looks like in BF16: exponent distributions and how many
512-value blocks fit ZipFusion's [b, b+15] exponent window (§III-B), per layer, for K and V
and for the two block arrangements of a 16-token page.
"""
from __future__ import annotations

import pandas as pd
import torch

from zipkv import format as kvformat
from zipkv.models import Capture

LAYOUTS = ("token", "channel")


def bf16_exponents(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit biased exponent field of each BF16 value of ``x`` (any shape), as int64."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x has dtype {x.dtype}: expected torch.bfloat16 (capture the cache from a BF16 model)")
    return ((x.contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF).to(torch.int64)


def exponent_histograms(captures: list[Capture]) -> dict[str, torch.Tensor]:
    """Counts of each exponent value, per layer: ``{"K": [layers, 256], "V": [layers, 256]}``."""
    layers = len(captures[0].layers)
    hist = {"K": torch.zeros(layers, 256, dtype=torch.int64), "V": torch.zeros(layers, 256, dtype=torch.int64)}
    for cap in captures:
        for i, layer in enumerate(cap.layers):
            hist["K"][i] += torch.bincount(bf16_exponents(layer.keys).flatten(), minlength=256).cpu()
            hist["V"][i] += torch.bincount(bf16_exponents(layer.values).flatten(), minlength=256).cpu()
    return hist


def block_eligibility(captures: list[Capture]) -> pd.DataFrame:
    """Fraction of compressible 512-value blocks per layer, tensor (K/V) and layout.

    Returns one row per (layer, tensor, layout) with ``blocks`` and ``eligible_fraction``;
    blocks are counted over full 16-token pages of every KV head of every captured window.
    """
    rows = []
    layers = len(captures[0].layers)
    for i in range(layers):
        for tensor in ("K", "V"):
            for layout in LAYOUTS:
                eligible = total = 0
                for cap in captures:
                    layer = cap.layers[i]
                    pages = kvformat.to_pages(layer.keys if tensor == "K" else layer.values)
                    mask = kvformat.eligible(pages, layout)
                    eligible += int(mask.sum())
                    total += mask.numel()
                rows.append({"layer": i, "tensor": tensor, "layout": layout, "blocks": total,
                             "eligible_fraction": eligible / total if total else float("nan")})
    return pd.DataFrame(rows)
