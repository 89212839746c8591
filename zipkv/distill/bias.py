"""Caches whose keys carry a per-key additive logit bias β, and their KL: a thin layer over the project's evaluation.

Attention Matching (Zweiger et al. 2026, arXiv 2602.16284) and zipkv's own distiller
(:mod:`zipkv.distill.generalise`) store, besides ``k`` key/value pairs per layer and KV head, one scalar
``β_j`` per key that is added to its logit: ``s_j = q·k_j/√d + β_j``. A key with ``β_j = log c`` weighs
exactly as much as ``c`` copies of itself, so one key can stand for the attention mass of many.

:class:`BiasedCache` is a :class:`~zipkv.distill.kvsculpt.CompressedCache` whose ``bias`` is always given
(``β = 0`` on unchanged pairs), plus the compressor's diagnostics. Everything that runs it goes through
:mod:`zipkv.distill.evaluate` and :class:`zipkv.cache.DistilledCache`, the cache users generate from: ``β``
is added to the cached keys' scores by the per-head additive mask (``−inf`` on per-head padding, a
``−inf`` β removes its pair) inside the model's own attention, and the continuation runs at positions
N … N+C−1. :func:`evaluate` returns KL(full ‖ biased); the reference is the uncompressed cache through the
same path, so it gives KL exactly 0.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .evaluate import TeacherForced, kl_divergence, teacher_force
from .evaluate import evaluate as evaluate_cache
from .kvsculpt import CompressedCache

__all__ = ["BiasedCache", "Forced", "as_biased", "evaluate", "kl_per_token", "teacher_force", "teacher_force_many"]

Forced = TeacherForced
"""One teacher-forced continuation (``logits`` ``[C, vocab]``, ``hidden`` ``[L, C, hidden]``)."""

kl_per_token = kl_divergence
"""``[C]`` KL(p_ref ‖ p) in nats per row of ``[C, vocab]`` logits (float64 inside)."""


class BiasedCache(CompressedCache):
    """A :class:`~zipkv.distill.kvsculpt.CompressedCache` with a per-key logit bias on every pair.

    Attributes (besides :class:`CompressedCache`'s, whose ``loss``/``initial_loss`` stay ``None``):
        keys, values: ``keys[layer][head]`` ``[n_lh, head_dim]`` post-RoPE.
        bias: ``bias[layer][head]`` ``[n_lh]`` (0 where a pair is an original one).
        n_context: ``N``: the continuation starts at position ``N``.
        budget: ``[L, H]`` compressed pairs per head (``None`` for an uncompressed cache).
        seconds: compression wall time for the whole cache, a float (a :class:`CompressedCache` made by
            :func:`zipkv.distill.compress` holds ``[L, H]`` per-problem times instead).
        info: method-specific diagnostics (e.g. per-head training and validation objectives).
    """

    def __init__(self, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]],
                 bias: list[list[torch.Tensor]], n_context: int, method: str = "full", ratio: float = 1.0,
                 budget: torch.Tensor | None = None, seconds: float = 0.0, info: dict | None = None):
        if not keys or bias is None:
            raise ValueError(f"keys has {len(keys)} layers and bias is {'None' if bias is None else 'given'}: "
                             "expected at least one layer and one bias per cached pair")
        super().__init__(keys, values, n_context, method=method, ratio=ratio, budget=budget, bias=bias)
        self.seconds = seconds
        self.info = {} if info is None else info

    @classmethod
    def from_capture(cls, capture) -> "BiasedCache":
        """The uncompressed cache of a :class:`zipkv.models.Capture`, ``β = 0`` (the KL reference)."""
        return cls.from_compressed(CompressedCache.from_capture(capture))

    @classmethod
    def from_compressed(cls, cache: CompressedCache) -> "BiasedCache":
        """A :class:`~zipkv.distill.kvsculpt.CompressedCache` as a biased cache (its bias, or ``β = 0``)."""
        bias = cache.bias or [[torch.zeros(k.shape[0], dtype=torch.float32, device=k.device) for k in ks]
                              for ks in cache.keys]
        seconds = cache.seconds
        if isinstance(seconds, torch.Tensor):  # NaN on layers that were not compressed
            seconds = float(seconds.nansum())
        return cls(cache.keys, cache.values, bias, n_context=cache.n_context, method=cache.method, ratio=cache.ratio,
                   budget=cache.budget, seconds=seconds or 0.0)


def teacher_force_many(model, caches: Sequence[CompressedCache], continuation_ids: torch.Tensor) -> list[Forced]:
    """:func:`teacher_force` of each cache in turn (one forward each, every layer's hidden states kept; for the
    logits alone, :func:`zipkv.distill.evaluate.teacher_force_batch` runs caches of one padded shape as the rows of
    one forward)."""
    return [teacher_force(model, cache, continuation_ids) for cache in caches]


def evaluate(model, cache: CompressedCache, continuation_ids: torch.Tensor,
             reference: Forced | CompressedCache) -> float:
    """Mean KL(full ‖ ``cache``) over the continuation tokens (KVSculpt §4's metric), in nats:
    :func:`zipkv.distill.evaluate.evaluate`'s ``kl``.

    ``reference``: the uncompressed cache (:meth:`BiasedCache.from_capture`) or its :func:`teacher_force`
    result, computed once per window."""
    return evaluate_cache(model, cache, continuation_ids, reference).kl


def as_biased(cache: CompressedCache) -> BiasedCache:
    """``cache`` as a :class:`BiasedCache` (a :class:`~zipkv.distill.kvsculpt.CompressedCache` keeps its bias or
    gets ``β = 0``)."""
    return cache if isinstance(cache, BiasedCache) else BiasedCache.from_compressed(cache)
