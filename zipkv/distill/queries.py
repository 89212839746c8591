"""Training queries for KVSculpt (paper §3.3, ablation §5.3).

The distillation loss (§3.2) needs queries that stand in for the future decode queries. For one
KV head that serves ``g`` query heads the training set is, per query head,

* the ``m`` real **retain queries**: the captured post-RoPE queries at positions N−m … N−1, and
* ``n_s`` **synthetic future queries**: content vectors ``q_c = RoPE⁻¹(q, p)`` picked from the whole
  context by a sampling strategy (``"uniform"`` in the paper), rotated again to the future positions
  N, N+1, …, N+n_s−1.

So ``Q`` is ``[g, m + n_s, head_dim]`` (the paper's ``Q ∈ R^{g × n_q × d}``).

The strategies of the §5.3 ablation are selectable by name: ``uniform`` (evenly spread indices),
``bootstrap`` (resampled with replacement from the last 128 tokens), ``random`` (uniform random
indices), ``kmeans`` (k-means centroids of the content vectors) and ``farthest`` (farthest-point
sampling). The PCA-extrapolation variants the paper mentions are not implemented.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

BOOTSTRAP_WINDOW = 128
"""How many of the most recent tokens ``bootstrap`` resamples from (§5.3: "last 128")."""


class RopeLike(Protocol):
    """What :mod:`zipkv.models`' ``Rope`` provides: rotate ``x`` [..., T, head_dim] to ``positions`` [T] or back."""

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def invert(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


# --- sampling strategies: content [g, T, d] -> synthetic content [g, n_s, d] ------------------------------

def _gather(content: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return content[:, index.to(content.device)]


def _uniform(content: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Evenly spread indices over the whole context, oldest first (the paper's choice)."""
    T = content.shape[1]
    index = torch.linspace(0, T - 1, n, dtype=torch.float64).round().long()
    return _gather(content, index)


def _bootstrap(content: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Resample with replacement from the last ``BOOTSTRAP_WINDOW`` tokens."""
    T = content.shape[1]
    lo = max(0, T - BOOTSTRAP_WINDOW)
    index = torch.randint(lo, T, (n,), generator=generator)
    return _gather(content, index)


def _random(content: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Uniformly random indices, without replacement when ``n ≤ T``."""
    T = content.shape[1]
    if n <= T:
        index = torch.randperm(T, generator=generator)[:n]
    else:
        index = torch.randint(0, T, (n,), generator=generator)
    return _gather(content, index)


def _kmeans(content: torch.Tensor, n: int, generator: torch.Generator, iterations: int = 25) -> torch.Tensor:
    """``n`` k-means centroids per query head (Lloyd's algorithm from a random subset of the points)."""
    g, T, d = content.shape
    x = content.double()
    out = torch.empty(g, n, d, dtype=torch.float64, device=content.device)
    for h in range(g):
        points = x[h]
        if n >= T:  # as many centroids as points: every point is its own centroid (pad by resampling)
            extra = torch.randint(0, T, (n - T,), generator=generator).to(points.device)
            out[h] = torch.cat([points, points[extra]])
            continue
        centroids = points[torch.randperm(T, generator=generator)[:n].to(points.device)].clone()
        for _ in range(iterations):
            assign = torch.cdist(points, centroids).argmin(dim=1)  # [T]
            sums = torch.zeros_like(centroids).index_add_(0, assign, points)
            counts = torch.bincount(assign, minlength=n).to(points.dtype)
            empty = counts == 0
            centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
        out[h] = centroids
    return out.to(content.dtype)


def _farthest(content: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """Farthest-point sampling per query head, from a random first point."""
    g, T, d = content.shape
    out = torch.empty(g, n, d, dtype=content.dtype, device=content.device)
    for h in range(g):
        points = content[h].double()
        chosen = [int(torch.randint(0, T, (1,), generator=generator))]
        dist = (points - points[chosen[0]]).norm(dim=1)
        for _ in range(n - 1):
            nxt = int(dist.argmax())
            chosen.append(nxt)
            dist = torch.minimum(dist, (points - points[nxt]).norm(dim=1))
        out[h] = content[h, torch.tensor(chosen, device=content.device)]
    return out


STRATEGIES: dict[str, Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]] = {
    "uniform": _uniform,
    "bootstrap": _bootstrap,
    "random": _random,
    "kmeans": _kmeans,
    "farthest": _farthest,
}
"""Synthetic-query sampling strategies of §5.3, by name."""


def check_strategy(strategy: str) -> None:
    """Raise ``ValueError`` naming the valid strategies when ``strategy`` is not one of them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not a query sampling strategy: expected one of "
                         f"{sorted(STRATEGIES)}")


def synthetic_queries(queries: torch.Tensor, positions: torch.Tensor, rope: RopeLike, n_synthetic: int, *,
                      strategy: str = "uniform", seed: int = 0) -> torch.Tensor:
    """Synthetic future queries (§3.3): de-RoPE, sample content vectors, re-RoPE at N … N+n_s−1.

    Args:
        queries: ``[g, T, head_dim]`` post-RoPE queries of the query heads of one KV head.
        positions: ``[T]`` their positions; the future starts at ``N = positions[-1] + 1``.
        rope: undoes and re-applies the model's rotary embedding (:class:`zipkv.models.Rope`).
        n_synthetic: ``n_s``, the number of synthetic queries per query head.
        strategy: a key of :data:`STRATEGIES`.
        seed: for the random strategies.

    Returns:
        ``[g, n_s, head_dim]`` float32 queries at positions N … N+n_s−1.
    """
    check_strategy(strategy)
    if queries.ndim != 3:
        raise ValueError(f"queries has shape {tuple(queries.shape)}: expected [g, T, head_dim]")
    T = queries.shape[1]
    if positions.ndim != 1 or positions.shape[0] != T:
        raise ValueError(f"positions has shape {tuple(positions.shape)}: expected [T] with T={T}")
    if n_synthetic < 0:
        raise ValueError(f"n_synthetic={n_synthetic}: expected ≥ 0")
    q = queries.float()
    if n_synthetic == 0:
        return q[:, :0]
    generator = torch.Generator().manual_seed(seed)
    content = rope.invert(q, positions)  # [g, T, d] position-free content vectors
    picked = STRATEGIES[strategy](content, n_synthetic, generator)  # [g, n_s, d]
    start = int(positions[-1]) + 1
    future = torch.arange(start, start + n_synthetic, dtype=torch.long)
    return rope.apply(picked, future)


def training_queries(queries: torch.Tensor, positions: torch.Tensor, rope: RopeLike, m: int,
                     n_synthetic: int, *, strategy: str = "uniform", seed: int = 0) -> torch.Tensor:
    """The training queries of one KV head (§3.3, "Final training set").

    Args:
        queries: ``[g, N, head_dim]`` post-RoPE captured queries of the head's ``g`` query heads
            (query head ``h`` uses KV head ``h // g``, as in Hugging Face Llama).
        positions: ``[N]`` their positions.
        rope: the model's rotary embedding (:class:`zipkv.models.Rope`).
        m: retain-zone size; the last ``m`` real queries are kept at their own positions.
        n_synthetic: number of synthetic future queries per query head (paper: 128).
        strategy: synthetic sampling strategy, a key of :data:`STRATEGIES` (paper: ``"uniform"``).
        seed: for the random strategies.

    Returns:
        ``[g, m + n_synthetic, head_dim]`` float32: retain queries, then synthetic ones.
    """
    check_strategy(strategy)
    if queries.ndim != 3:
        raise ValueError(f"queries has shape {tuple(queries.shape)}: expected [g, N, head_dim]")
    N = queries.shape[1]
    if not 0 <= m <= N:
        raise ValueError(f"m={m}: expected 0 ≤ m ≤ N={N}")
    retain = queries[:, N - m:].float()
    synth = synthetic_queries(queries, positions, rope, n_synthetic, strategy=strategy, seed=seed)
    return torch.cat([retain, synth.to(retain.device)], dim=1)
