"""Budget allocation across layers and KV heads (KVSculpt §3.5, §5.4–5.5, Appendix B).

A fixed total ``B = k·L·H`` compressed pairs (``k`` per head on average, ``L`` layers, ``H`` KV heads)
is split into per-(layer, head) budgets ``k_lh`` ``[L, H]``. Every policy here returns integers
that sum exactly to ``B``, give every head at least ``k_min = 1`` pair and never more than its
compress zone ``k_max = N − m``:

* :func:`uniform` — ``k`` everywhere (the paper's reference);
* :func:`static` — per layer proportional to a static signal raised to ``alpha`` (the paper's
  ``‖V‖^α``, :func:`value_norm_signal`), evenly within a layer;
* :func:`pilot` — per layer proportional to the mean pilot MSE of the layer's heads raised to
  ``alpha`` (60-step pilot at uniform allocation), then optionally per head within the layer
  proportional to each head's pilot MSE^alpha (``per_head=True``, the paper's 30-step per-head pilot).

:func:`allocate` is the two-level rule all three use; :func:`split` the integer water-filling
under it. :func:`pilot_signal` reads a pilot's per-head loss off a longer run's loss history: a
``s``-step pilot at uniform allocation is exactly the first ``s`` outer steps of the uniform run
(same start, same optimizer state), so its best loss is ``min(history[:s + 1])``.
"""
from __future__ import annotations

from typing import Sequence

import torch

_BISECTIONS = 200


def _check_bounds(total: int, n: int, lo: int, hi: int) -> None:
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
        raise ValueError(f"bounds [k_min, k_max] = [{lo}, {hi}]: expected integers with 0 ≤ k_min ≤ k_max")
    if not n * lo <= total <= n * hi:
        raise ValueError(f"total={total}: cannot split over {n} entries within [{lo}, {hi}] each "
                         f"(expected {n * lo} ≤ total ≤ {n * hi})")


def split(total: int, weights: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Split the integer ``total`` proportionally to ``weights`` ``[n]`` within ``[lo, hi]`` each.

    Water-filling: ``x_i = clamp(t·w_i, lo, hi)`` with the scale ``t`` found by bisection so that
    ``Σ x_i = total``, then rounded by largest remainder (never past ``hi``). Zero weights get a
    vanishing share (``1e-12`` of the largest weight), so a total above what the positive entries can
    hold still fits; all-zero weights split evenly. Returns ``[n]`` int64 summing exactly to ``total``.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    n = w.numel()
    if n == 0:
        raise ValueError("weights is empty: expected at least one entry")
    total = int(total)
    _check_bounds(total, n, lo, hi)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and ≥ 0, got {w.tolist()}")
    # normalised, with zero weights raised to a vanishing share (so a total above what the positive
    # entries can hold still fits); all-zero weights split evenly
    w = torch.ones_like(w) if float(w.max()) == 0.0 else (w / w.max()).clamp_min(1e-12)
    # Σ clamp(t·w, lo, hi) is continuous and non-decreasing in t: bisect log t between a scale that puts
    # every entry at lo (≤ total) and one that puts every entry at hi (≥ total)
    log_lo, log_hi = -70.0, float(torch.log(torch.tensor(hi + 1.0) / w.min()))
    for _ in range(_BISECTIONS):
        mid = (log_lo + log_hi) / 2
        if float((w * torch.exp(torch.tensor(mid, dtype=torch.float64))).clamp(lo, hi).sum()) < total:
            log_lo = mid
        else:
            log_hi = mid
    x = (w * torch.exp(torch.tensor(log_hi, dtype=torch.float64))).clamp(lo, hi)
    out = x.floor().long().clamp(lo, hi)
    left = total - int(out.sum())
    if left > 0:  # largest remainders first, never past hi
        remainder = (x - out).masked_fill(out >= hi, -1.0)
        out[torch.topk(remainder, left).indices] += 1
    elif left < 0:  # Σx overshot total by rounding: take from the entries furthest above lo
        surplus = (x - lo).masked_fill(out <= lo, -1.0)
        out[torch.topk(surplus, -left).indices] -= 1
    return out


def allocate(signal: torch.Tensor, total: int, *, alpha: float = 0.5, per_head: bool = True,
             k_min: int = 1, k_max: int) -> torch.Tensor:
    """Two-level budget allocation (§3.5): ``[L, H]`` budgets summing to ``total``.

    Args:
        signal: ``[L, H]`` per-(layer, KV head) difficulty (≥ 0): pilot loss, or a static signal.
        total: the total budget ``B`` (``k·L·H`` for a uniform-equivalent budget).
        alpha: dampening exponent (paper: 0.5; 1.0 over-allocates to outlier layers; 0 is uniform).
        per_head: also redistribute within each layer by the heads' own signal; else split evenly.
        k_min, k_max: bounds per head (``k_max = N − m``, the compress zone).

    Returns:
        ``[L, H]`` int64 budgets ``k_lh``.
    """
    signal = torch.as_tensor(signal, dtype=torch.float64)
    if signal.ndim != 2 or signal.numel() == 0:
        raise ValueError(f"signal has shape {tuple(signal.shape)}: expected [layers, kv_heads]")
    if not bool(torch.isfinite(signal).all()) or bool((signal < 0).any()):
        raise ValueError("signal must be finite and ≥ 0 (a loss or a norm per layer and head)")
    if not (isinstance(alpha, (int, float)) and 0 <= alpha < float("inf")):
        raise ValueError(f"alpha={alpha!r}: expected a finite exponent ≥ 0")
    L, H = signal.shape
    _check_bounds(int(total), L * H, k_min, k_max)
    layer_budget = split(total, signal.mean(dim=1) ** alpha, H * k_min, H * k_max)
    out = torch.empty(L, H, dtype=torch.long)
    for layer in range(L):
        w = signal[layer] ** alpha if per_head else torch.ones(H, dtype=torch.float64)
        out[layer] = split(int(layer_budget[layer]), w, k_min, k_max)
    return out


def uniform(layers: int, kv_heads: int, k: int, *, k_max: int | None = None) -> torch.Tensor:
    """``[L, H]`` int64 filled with ``k`` (the paper's uniform allocation)."""
    if not (isinstance(k, int) and k >= 1) or (k_max is not None and k > k_max):
        raise ValueError(f"k={k!r}: expected an integer 1 ≤ k ≤ k_max={k_max}")
    return torch.full((layers, kv_heads), k, dtype=torch.long)


def static(layer_signal: torch.Tensor, k: int, kv_heads: int, *, alpha: float = 0.5, k_max: int) -> torch.Tensor:
    """Per-layer allocation from a static signal ``[L]`` (the paper's ``‖V‖^α``), even within a layer (§5.4)."""
    layer_signal = torch.as_tensor(layer_signal, dtype=torch.float64)
    if layer_signal.ndim != 1:
        raise ValueError(f"layer_signal has shape {tuple(layer_signal.shape)}: expected [layers]")
    grid = layer_signal[:, None].expand(-1, kv_heads)
    return allocate(grid, k * grid.numel(), alpha=alpha, per_head=False, k_max=k_max)


def pilot(signal: torch.Tensor, k: int, *, alpha: float = 0.5, per_head: bool = False, k_max: int) -> torch.Tensor:
    """Pilot-MSE allocation (§3.5): per layer by the layer's mean pilot MSE^α, then (``per_head``) per
    head by its own pilot MSE^α, else evenly. ``signal`` ``[L, H]``; total ``k·L·H``."""
    signal = torch.as_tensor(signal, dtype=torch.float64)
    return allocate(signal, k * signal.numel(), alpha=alpha, per_head=per_head, k_max=k_max)


def value_norm_signal(values: Sequence[torch.Tensor], m: int) -> torch.Tensor:
    """``[L]`` mean L2 norm of the compress zone's value vectors per layer (the paper's ``‖V‖``).

    Args:
        values: per layer ``[H, N, d]`` values (e.g. ``[layer.values for layer in capture.layers]``).
        m: retain-zone size; the first ``N − m`` positions are the compress zone.
    """
    out = []
    for layer, v in enumerate(values):
        if v.ndim != 3 or not 0 <= m < v.shape[1]:
            raise ValueError(f"layer {layer}: values {tuple(v.shape)} with m={m}: expected [H, N, d] and 0 ≤ m < N")
        out.append(float(v[:, : v.shape[1] - m].double().norm(dim=-1).mean()))
    return torch.tensor(out, dtype=torch.float64)


def pilot_signal(histories: Sequence[Sequence[float]], steps: int) -> torch.Tensor:
    """``[P]`` best loss within the first ``steps`` outer steps of each problem's loss history.

    ``history[0]`` is the starting loss and ``history[s]`` the loss after step ``s`` (the solvers'
    ``Solution.history``); a pilot of ``steps`` steps at the same budget returns ``min(history[:steps + 1])``.
    A history shorter than that (a problem stopped early) gives its overall best.
    """
    if steps < 0:
        raise ValueError(f"steps={steps}: expected ≥ 0")
    out = []
    for i, h in enumerate(histories):
        if len(h) == 0:
            raise ValueError(f"history {i} is empty: expected the solver's per-step losses")
        out.append(min(h[: steps + 1]))
    return torch.tensor(out, dtype=torch.float64)


def layer_range(budget: torch.Tensor) -> tuple[float, float]:
    """Smallest and largest per-layer budget per head, ``(min_l, max_l)`` of ``budget.sum(1)/H``
    (Appendix B's ``k_min``, ``k_max``; both ``k`` for the uniform allocation)."""
    per_layer = torch.as_tensor(budget).double().mean(dim=1)
    return float(per_layer.min()), float(per_layer.max())
