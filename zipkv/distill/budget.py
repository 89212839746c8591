"""Adaptive budget allocation across layers and KV heads from a pilot signal (KVSculpt §3.5, §5.4–5.5).

A short pilot compression at uniform budget gives each (layer, head) a loss ("pilot MSE").
The total budget ``B = k·L·H`` is then split in two levels, each proportional to the signal
raised to the dampening exponent ``alpha`` (0.5 in the paper):

1. per layer, by the mean signal over the layer's heads;
2. per head within the layer, by the head's own signal (or evenly, ``per_head=False``).

Budgets are integers within ``[k_min, k_max]`` per head and sum exactly to ``B``.
"""
from __future__ import annotations

import torch


def split(total: int, weights: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Split the integer ``total`` proportionally to ``weights`` ``[n]`` within ``[lo, hi]`` each.

    Entries that would leave the bounds are clamped and the rest re-split among the others;
    rounding is by largest remainder. Returns ``[n]`` int64 summing to ``total``.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    n = w.numel()
    if not n * lo <= total <= n * hi:
        raise ValueError(f"total={total}: cannot split over {n} entries within [{lo}, {hi}] each")
    if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be finite and ≥ 0, got {w.tolist()}")
    w = w + 1e-12 * float(w.max().clamp_min(1.0))  # all-zero or zero entries still get a share
    x = torch.zeros(n, dtype=torch.float64)
    fixed = torch.zeros(n, dtype=torch.bool)
    while True:
        free = ~fixed
        x[free] = (total - x[fixed].sum()) * w[free] / w[free].sum()
        over, under = free & (x > hi), free & (x < lo)
        if over.any():
            x[over], fixed = float(hi), fixed | over
        elif under.any():
            x[under], fixed = float(lo), fixed | under
        else:
            break
    out = x.floor().long()
    left = int(total - out.sum())
    remainder = (x - out).masked_fill(out >= hi, -1.0)
    out[torch.topk(remainder, left).indices] += 1
    return out


def allocate(signal: torch.Tensor, total: int, *, alpha: float = 0.5, per_head: bool = True,
             k_min: int = 1, k_max: int) -> torch.Tensor:
    """Two-level budget allocation (§3.5): ``[L, H]`` budgets summing to ``total``.

    Args:
        signal: ``[L, H]`` per-(layer, KV head) pilot loss (≥ 0).
        total: the total budget ``B`` (``k·L·H`` for a uniform-equivalent budget).
        alpha: dampening exponent (paper: 0.5; 1.0 over-allocates to outlier layers).
        per_head: also redistribute within each layer by the heads' own signal; else split evenly.
        k_min, k_max: bounds per head (``k_max = N − m``).

    Returns:
        ``[L, H]`` int64 budgets ``k_lh``.
    """
    signal = torch.as_tensor(signal, dtype=torch.float64)
    if signal.ndim != 2:
        raise ValueError(f"signal has shape {tuple(signal.shape)}: expected [layers, kv_heads]")
    L, H = signal.shape
    layer_budget = split(total, signal.mean(dim=1).clamp_min(0) ** alpha, H * k_min, H * k_max)
    out = torch.empty(L, H, dtype=torch.long)
    for layer in range(L):
        w = signal[layer].clamp_min(0) ** alpha if per_head else torch.ones(H, dtype=torch.float64)
        out[layer] = split(int(layer_budget[layer]), w, k_min, k_max)
    return out
