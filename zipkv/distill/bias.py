"""Caches whose keys carry a per-key additive logit bias β, and their kernel-free KL evaluation.

Attention Matching (Zweiger et al. 2026, arXiv 2602.16284) and zipkv's own distiller
(:mod:`zipkv.distill.generalise`) store, besides ``k`` key/value pairs per layer and KV head, one scalar
``β_j`` per key that is added to its logit: ``s_j = q·k_j/√d + β_j``. A key with ``β_j = log c`` weighs
exactly as much as ``c`` copies of itself, so one key can stand for the attention mass of many.

:class:`BiasedCache` holds such a cache (``β = 0`` on unchanged pairs). :func:`teacher_force` puts it into a
Hugging Face Llama-family model through an attention function registered under :data:`ATTENTION_NAME`,
which adds ``β`` to the cached keys' scores (``−inf`` on per-head padding) and is otherwise eager causal
attention, and feeds the continuation at positions N … N+C−1. :func:`evaluate` returns KL(full ‖ biased)
per token; the reference is the uncompressed cache through the same path, so it gives KL exactly 0.

This is the smallest evaluation the bias needs while :mod:`zipkv.distill.evaluate` has none; with
``β = 0`` it computes what :func:`zipkv.distill.evaluate.teacher_force` computes (the tests check both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence
import torch

ATTENTION_NAME = "zipkv_biased"
"""Name under which the biased attention is registered in transformers' ``AttentionInterface``."""

_bias: dict[int, torch.Tensor] = {}  # layer_idx -> [H, P] additive logit of the cached pairs (−inf on padding)


@dataclass
class BiasedCache:
    """Per layer and KV head: post-RoPE pairs and one additive logit bias per key.

    Attributes:
        keys, values: ``keys[layer][head]`` ``[n_lh, head_dim]``.
        bias: ``bias[layer][head]`` ``[n_lh]`` (0 where a pair is an original one).
        n_context: ``N``: the continuation starts at position ``N``.
        method, ratio: how it was made.
        budget: ``[L, H]`` compressed pairs per head (``None`` for an uncompressed cache).
        seconds: compression wall time for the whole cache.
        info: method-specific diagnostics (e.g. per-head training and validation objectives).
    """

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    bias: list[list[torch.Tensor]]
    n_context: int
    method: str = "full"
    ratio: float = 1.0
    budget: torch.Tensor | None = None
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if not (len(self.keys) == len(self.values) == len(self.bias)) or not self.keys:
            raise ValueError(f"keys, values and bias have {len(self.keys)}, {len(self.values)} and {len(self.bias)} "
                             "layers: expected the same number, at least one")
        H = len(self.keys[0])
        for layer, (ks, vs, bs) in enumerate(zip(self.keys, self.values, self.bias)):
            if not len(ks) == len(vs) == len(bs) == H:
                raise ValueError(f"layer {layer}: {len(ks)} key, {len(vs)} value and {len(bs)} bias heads, expected {H}")
            for head, (k, v, b) in enumerate(zip(ks, vs, bs)):
                if k.ndim != 2 or v.shape != k.shape or tuple(b.shape) != (k.shape[0],):
                    raise ValueError(f"layer {layer} head {head}: keys {tuple(k.shape)}, values {tuple(v.shape)}, "
                                     f"bias {tuple(b.shape)}; expected [n, head_dim] twice and [n]")

    @classmethod
    def from_capture(cls, capture) -> "BiasedCache":
        """The uncompressed cache of a :class:`zipkv.models.Capture`, ``β = 0`` (the KL reference)."""
        keys = [list(layer.keys.unbind(0)) for layer in capture.layers]
        values = [list(layer.values.unbind(0)) for layer in capture.layers]
        bias = [[torch.zeros(k.shape[0], dtype=torch.float32, device=k.device) for k in ks] for ks in keys]
        return cls(keys, values, bias, n_context=int(capture.positions[-1]) + 1)

    @classmethod
    def from_compressed(cls, cache) -> "BiasedCache":
        """A :class:`zipkv.distill.kvsculpt.CompressedCache` (no bias) as a biased cache with ``β = 0``."""
        bias = [[torch.zeros(k.shape[0], dtype=torch.float32, device=k.device) for k in ks] for ks in cache.keys]
        return cls(cache.keys, cache.values, bias, n_context=cache.n_context, method=cache.method, ratio=cache.ratio,
                   budget=cache.budget, seconds=float(cache.seconds.sum()) if cache.seconds is not None else 0.0)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_heads(self) -> int:
        return len(self.keys[0])

    @property
    def memory_ratio(self) -> float:
        """Cached pairs over the full cache's ``L·H·N`` (the bias, one scalar per key, not counted)."""
        pairs = sum(k.shape[0] for ks in self.keys for k in ks)
        return pairs / (self.num_layers * self.num_heads * self.n_context)

    def padded(self, layer: int, dtype=None, device=None, length: int | None = None):
        """One layer padded to its longest head (or to ``length``): ``(keys, values, bias)`` ``[H, n_max, d]``
        twice and ``[H, n_max]`` float32 bias, ``−inf`` on padding (zero attention)."""
        ks, vs, bs = self.keys[layer], self.values[layer], self.bias[layer]
        dtype = dtype or ks[0].dtype
        device = device or ks[0].device
        H, d = len(ks), ks[0].shape[1]
        n_max = length or max(k.shape[0] for k in ks)
        keys = torch.zeros(H, n_max, d, dtype=dtype, device=device)
        values = torch.zeros(H, n_max, d, dtype=dtype, device=device)
        bias = torch.full((H, n_max), float("-inf"), dtype=torch.float32, device=device)
        for h, (k, v, b) in enumerate(zip(ks, vs, bs)):
            n = k.shape[0]
            keys[h, :n], values[h, :n] = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
            bias[h, :n] = b.to(device=device, dtype=torch.float32)
        return keys, values, bias


def _biased_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention over ``[cache; new tokens]``: ``β`` (``_bias[layer]`` ``[B, H, P]``) added to the cached
    keys' scores, the new tokens causal. ``query`` ``[B, Hq, C, d]``, ``key``/``value`` ``[B, H, P + C, d]``."""
    bias = _bias[module.layer_idx]
    B, Hq, C, _ = query.shape
    _, H, P = bias.shape
    if key.shape[1] != H or key.shape[2] != P + C or bias.shape[0] != B:
        raise RuntimeError(f"layer {module.layer_idx}: keys {tuple(key.shape)}, expected [{B}, {H}, {P + C}, d]")
    group = Hq // H
    key = key.repeat_interleave(group, dim=1)  # query head h reads KV head h // group (HF repeat_kv)
    value = value.repeat_interleave(group, dim=1)
    causal = torch.zeros(C, C, dtype=torch.float32, device=query.device).masked_fill(
        ~torch.ones(C, C, dtype=torch.bool, device=query.device).tril(), float("-inf"))
    additive = torch.cat([bias.repeat_interleave(group, dim=1)[:, :, None, :].expand(B, Hq, C, P),
                          causal.expand(B, Hq, C, C)], dim=-1)  # [B, Hq, C, P + C]
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling + additive
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


@dataclass
class Forced:
    """One teacher-forced continuation: ``logits`` ``[C, vocab]`` float32 at positions N … N+C−1."""

    logits: torch.Tensor


@torch.no_grad()
def teacher_force(model, cache: BiasedCache, continuation_ids: torch.Tensor) -> Forced:
    """Feed ``continuation_ids`` ``[C]`` after ``cache`` at positions N … N+C−1 with the bias in the scores."""
    return teacher_force_many(model, [cache], continuation_ids)[0]


@torch.no_grad()
def teacher_force_many(model, caches: Sequence[BiasedCache], continuation_ids: torch.Tensor) -> list[Forced]:
    """:func:`teacher_force` for several caches of one context at once, as one batch (each layer padded to
    the longest head of any cache; padding gets ``β = −inf``)."""
    from transformers import AttentionInterface, DynamicCache

    ids = torch.as_tensor(continuation_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"continuation_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}: expected integer "
                         "token ids [C], C ≥ 1")
    if not caches or len({(c.num_layers, c.num_heads, c.n_context) for c in caches}) != 1:
        raise ValueError("caches: expected at least one, all with the same layers, heads and n_context")
    layers = getattr(getattr(model, "model", model), "layers", None)
    L = caches[0].num_layers
    if layers is None or len(layers) != L:
        raise ValueError(f"cache has {L} layers, the model {'none' if layers is None else len(layers)} "
                         "(expected a Llama-family causal LM)")
    param = next(model.parameters())
    data = []
    _bias.clear()
    for layer in range(L):
        n_max = max(k.shape[0] for c in caches for k in c.keys[layer])
        padded = [c.padded(layer, dtype=param.dtype, device=param.device, length=n_max) for c in caches]
        data.append((torch.stack([p[0] for p in padded]), torch.stack([p[1] for p in padded])))
        _bias[layer] = torch.stack([p[2] for p in padded])
    past = DynamicCache(data, config=model.config)
    AttentionInterface.register(ATTENTION_NAME, _biased_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    B, n = len(caches), caches[0].n_context
    try:
        positions = torch.arange(n, n + ids.shape[0], device=param.device)
        out = model(input_ids=ids[None].expand(B, -1).to(param.device).long(), position_ids=positions[None].expand(B, -1),
                    past_key_values=past, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
        _bias.clear()
    return [Forced(logits=out.logits[i].float()) for i in range(B)]


def kl_per_token(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``[C]`` KL(p_ref ‖ p) in nats per row of ``[C, vocab]`` logits (float64 inside)."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def evaluate(model, cache: BiasedCache, continuation_ids: torch.Tensor, reference: Forced | BiasedCache) -> float:
    """Mean KL(full ‖ ``cache``) over the continuation tokens (KVSculpt §4's metric), in nats.

    ``reference``: the uncompressed :class:`BiasedCache` (:meth:`BiasedCache.from_capture`) or its
    :func:`teacher_force` result, computed once per window."""
    if isinstance(reference, BiasedCache):
        reference = teacher_force(model, reference, continuation_ids)
    run = teacher_force(model, cache, continuation_ids)
    return float(kl_per_token(reference.logits, run.logits).mean())


def as_biased(cache) -> BiasedCache:
    """``cache`` as a :class:`BiasedCache` (a :class:`~zipkv.distill.kvsculpt.CompressedCache` gets ``β = 0``)."""
    return cache if isinstance(cache, BiasedCache) else BiasedCache.from_compressed(cache)

