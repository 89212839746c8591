"""zipkv's distiller: a compressed cache fitted to queries like the future ones (issue 17).

KVSculpt (§3.3) fits ``k`` free pairs per KV head to ``g·(m + n_s)`` training queries (1,152 for SmolLM2):
its objective on them falls ~180× below Select+Fit's, but not on the continuation's real queries, and its
KL does not improve. zipkv's method fits fewer free parameters to many more queries and checks every choice
on queries it never trained on:

* **Queries** (:func:`future_queries`): every context position's content vector ``RoPE⁻¹(q_p, p)``
  re-rotated to a future position ``N + o_p`` (offsets ``o_p`` spread over ``[0, horizon)``), plus the
  retain zone's real queries at their own positions: ``g·(N + m)`` per KV head (6,912 at N = 2048).
  Every ``validation_every``-th position is held out as the **validation set**.
* **Keys**: the top-``k`` old positions by attention over the training queries, kept as they are.
* **Bias** ``β`` (Attention Matching's, :mod:`zipkv.distill.bias`): per kept key, ``w_j = e^{β_j} ≥ 0`` by
  ridge-regularised least squares so that the kept keys carry the attention mass of the whole compress
  zone for every training query (``Σ_j w_j a_qj ≈ Σ_{i old} a_qi``, attention weights of the full cache),
  shrunk toward ``w = 1`` and kept in ``[e^{-3}, e^{3}]``.
* **Values**: ridge regression toward the kept keys' *original* values (not toward zero as KVSculpt's
  V-step): ``V_c = argmin ‖A_c V − R‖² + λ‖V − V_sel‖²``, ``λ = λ₀·tr(A_cᵀA_c)/k``, with ``λ₀`` chosen per
  head from :attr:`ZipkvConfig.value_ridges` (``∞``: the original values) by the validation objective.

* **Budget** (``budget="probe"``, :func:`sample_probe`, :func:`head_sensitivity`): the model samples its
  own continuation of the context (no access to the real one); the KL on it when only head ``(l, h)`` holds
  its compressed pairs is the signal that splits the same total of pairs over layers, then heads
  (KVSculpt §3.5's two-level allocation, ``alpha =`` :data:`PROBE_ALPHA`). On the development windows a few heads carry
  most of the KL, and the per-head objective (KVSculpt's pilot signal) does not find them; this does.
* **Cascade-aware** (:func:`compress_cascade`, optional): layer ``ℓ`` is fitted with the probe tokens'
  queries as the model whose layers ``< ℓ`` are already compressed produces them.

With ``k = N − m`` every old key is kept, the mass is matched exactly by ``w = 1`` and the values' residual
is exactly the original values', so the cache is the full one (to float rounding; a test checks it).

All heads of a layer are solved as one batch (``[H, ·, ·]`` matmuls and one batched Cholesky per ridge
value), with no iterative optimiser: its cost is a few matmuls of the ``[H, n_q, N]`` score matrix.
"""
from __future__ import annotations

import math
import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from zipkv.models import cache_keyword, model_shape, rope_of

from .keywords import suggest_keywords
from .bias import BiasedCache
from .problem import check_solver_device

INF = math.inf


@dataclass
class ZipkvConfig:
    """Settings of zipkv's distiller (issue 17; chosen on development windows of ``shared/data/pg19``).

    Attributes:
        horizon: content vectors are re-rotated to positions ``N … N + horizon − 1``.
        validation_every: every this many-th query position is held out for validation.
        selection: key score: ``"mean"`` attention over the training queries, or ``"max"``.
        bias: fit the per-key bias β (else β = 0).
        mass_ridge: ridge of the mass fit, relative to ``tr(GᵀG)/k``, shrinking ``w = e^β`` toward 1.
        bias_bound: ``|β| ≤ bias_bound``.
        value_ridges: candidate ``λ₀`` for the values (``math.inf``: keep the original values).
        max_scores: at most this many scores per KV head in the fit's ``[queries, N]`` score matrix: the training
            queries (``g·(N + m)`` from :func:`future_queries`) are thinned, evenly spaced, to ``max_scores / N`` and
            the validation queries to a quarter of that. Without a cap the matrix grows as ``N²`` (at N = 32,768 on
            Llama-3.1-8B's shape, 118 GB in float32); the default binds only above N = 2**13.5 ≈ 11,600 for
            Llama-3.1-8B's shape (4,096 queries at N = 32,768) and never at N = 2048, where the book measures the
            method. None: no cap.
        dtype: solve dtype (the ridge systems are solved in float64).
        device: where to solve (default: the capture's device).
    """

    horizon: int = 256
    validation_every: int = 8
    selection: str = "mean"
    bias: bool = True
    mass_ridge: float = 1e-3
    bias_bound: float = 3.0
    value_ridges: tuple = (1e-3, 1e-2, 1e-1, 1.0, INF)
    max_scores: int | None = 2**27
    dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None

    def __post_init__(self):
        check_config(self, ints=(("horizon", 1), ("validation_every", 2)),
                     reals=(("mass_ridge", True), ("bias_bound", False)))
        if self.selection not in ("mean", "max"):
            raise ValueError(f"ZipkvConfig(selection={self.selection!r}): expected 'mean' or 'max'")
        if not isinstance(self.bias, bool):
            raise TypeError(f"ZipkvConfig(bias={self.bias!r}): expected True (fit the per-key bias) or False")
        ridges = self.value_ridges
        if (not isinstance(ridges, (tuple, list)) or not ridges
                or any(isinstance(r, bool) or not isinstance(r, numbers.Real) or not r >= 0 for r in ridges)):
            raise ValueError(f"ZipkvConfig(value_ridges={ridges!r}): expected a non-empty tuple of numbers ≥ 0 (math.inf: "
                             "keep the original values)")
        if self.max_scores is not None and (isinstance(self.max_scores, bool)
                                            or not isinstance(self.max_scores, numbers.Integral) or self.max_scores < 1):
            raise ValueError(f"ZipkvConfig(max_scores={self.max_scores!r}): expected an int ≥ 1 or None (no cap)")


def check_config(config, *, ints=(), reals=()) -> None:
    """A distiller's settings (``config``, a dataclass with ``dtype`` and ``device``): ``ints`` ``(field, least)`` ints,
    ``reals`` ``(field, finite)`` numbers ≥ 0, ``dtype`` float32 or float64, ``device`` None or a device this machine
    has. A ``ValueError``/``TypeError`` naming the field, when the config is made (not in the middle of a solve)."""
    name = type(config).__name__
    for field, least in ints:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"{name}({field}={value!r}): expected an int ≥ {least}")
        setattr(config, field, int(value))
    for field, finite in reals:
        value = getattr(config, field)
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0
                or (finite and not math.isfinite(value))):
            raise ValueError(f"{name}({field}={value!r}): expected a {'finite ' if finite else ''}number ≥ 0")
    check_solver_device(config)


def future_queries(queries: torch.Tensor, positions: torch.Tensor, rope, m: int, *, horizon: int = 256,
                   validation_every: int = 8, max_train: int | None = None,
                   max_validation: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and validation queries of the KV heads of one layer.

    Args:
        queries: ``[H, g, N, d]`` post-RoPE captured queries (query head ``h·g + i`` reads KV head ``h``).
        positions: ``[N]`` their positions; the future starts at ``N = positions[-1] + 1``.
        rope: the model's :class:`zipkv.models.Rope`.
        m: retain zone: the last ``m`` real queries are also kept at their own positions.
        horizon: re-rotation offsets ``o_p = (61·p) mod horizon``, so every offset in ``[0, horizon)`` occurs.
        validation_every: positions ``p`` with ``p mod validation_every = validation_every − 1`` go to validation.
        max_train, max_validation: keep at most this many of each, evenly spaced (None: all).

    Returns:
        ``(train, validation)``: ``[H, n_t, d]`` and ``[H, n_v, d]`` float32, the ``g`` query heads stacked.
    """
    if queries.ndim != 4:
        raise ValueError(f"queries has shape {tuple(queries.shape)}: expected [kv_heads, g, N, head_dim]")
    H, g, N, d = queries.shape
    if tuple(positions.shape) != (N,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}: expected [{N}]")
    if not 0 <= m < N or horizon < 1 or validation_every < 2:
        raise ValueError(f"m={m}, horizon={horizon}, validation_every={validation_every}: expected 0 ≤ m < N={N}, "
                         "horizon ≥ 1, validation_every ≥ 2")
    q = queries.float()
    start = int(positions[-1]) + 1
    offsets = (61 * torch.arange(N)) % horizon
    content = q.new_empty(q.shape)
    for h in range(H):  # per KV head to keep the rotation's temporaries small
        content[h] = rope.apply(rope.invert(q[h], positions), start + offsets)
    held = (torch.arange(N) % validation_every) == validation_every - 1
    retain_held = held[N - m:]
    retain = q[:, :, N - m:]
    train = torch.cat([content[:, :, ~held], retain[:, :, ~retain_held]], dim=2).reshape(H, -1, d)
    validation = torch.cat([content[:, :, held], retain[:, :, retain_held]], dim=2).reshape(H, -1, d)
    return _evenly(train, max_train), _evenly(validation, max_validation)


def _evenly(queries: torch.Tensor, most: int | None) -> torch.Tensor:
    """At most ``most`` of ``queries`` ``[H, n, d]`` along ``n``, evenly spaced, first and last kept."""
    n = queries.shape[1]
    if most is None or n <= most:
        return queries
    if isinstance(most, bool) or not isinstance(most, int) or most < 2:
        raise ValueError(f"a query cap of {most!r}: expected an int ≥ 2 or None")
    index = torch.linspace(0, n - 1, most, device=queries.device).round().long()
    return queries[:, index]


@dataclass
class HeadTargets:
    """Full-cache attention of ``P`` heads on a query set: ``lse`` ``[P, n]``, ``y`` ``[P, n, d]`` and the
    old zone's and retain zone's scores ``s_old`` ``[P, n, N − m]``, ``s_ret`` ``[P, n, m]`` (scaled)."""

    q: torch.Tensor
    s_old: torch.Tensor
    s_ret: torch.Tensor
    lse: torch.Tensor
    y: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, m: int, scale: float) -> "HeadTargets":
        q = q * scale
        s = torch.bmm(q, keys.transpose(1, 2))
        lse = torch.logsumexp(s, dim=-1)
        y = torch.bmm(torch.exp(s - lse[..., None]), values)
        cut = keys.shape[1] - m
        return cls(q=q, s_old=s[..., :cut], s_ret=s[..., cut:], lse=lse, y=y)


def compressed_attention(t: HeadTargets, keys_c: torch.Tensor, bias_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[P, n, k + m]`` over ``[K_c (+β); K_ret]`` and their log-sum-exp ``[P, n]``."""
    s = torch.cat([torch.baddbmm(bias_c[:, None, :], t.q, keys_c.transpose(1, 2)), t.s_ret], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]), lse


def objective(t: HeadTargets, keys_c, values_c, bias_c, v_ret) -> tuple[torch.Tensor, torch.Tensor]:
    """KVSculpt's §3.2 terms on the query set ``t``: ``[P]`` output MSE and ``[P]`` LSE MSE."""
    a, lse = compressed_attention(t, keys_c, bias_c)
    k = keys_c.shape[1]
    y_hat = torch.bmm(a[..., :k], values_c) + torch.bmm(a[..., k:], v_ret)
    return (y_hat - t.y).square().mean(dim=(1, 2)), (lse - t.lse).square().mean(dim=1)


def _spd_solve(gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``gram⁻¹ rhs`` for a batch of symmetric positive definite systems (float64 Cholesky)."""
    chol, info = torch.linalg.cholesky_ex(gram)
    if bool((info != 0).any()):  # not positive definite to rounding: a little more diagonal
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        chol = torch.linalg.cholesky(gram + 1e-9 * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * eye)
    # two triangular solves: cholesky_solve fails on CUDA for large batched systems (k = 9,830 at N = 32,768)
    y = torch.linalg.solve_triangular(chol, rhs, upper=False)
    return torch.linalg.solve_triangular(chol.transpose(-2, -1), y, upper=True)


def mass_bias(t: HeadTargets, index: torch.Tensor, ridge: float, bound: float) -> torch.Tensor:
    """``β`` ``[P, k]``: the kept keys' weights ``w = e^β`` matched to the whole old zone's attention mass.

    ``min_w ‖G w − t‖² + ρ‖w − 1‖²`` with ``G_qj = exp(s_qj − ℓ_q)`` (the kept keys' full-cache attention
    weights), ``t_q = Σ_{i old} exp(s_qi − ℓ_q)``, ``ρ = ridge·tr(GᵀG)/k``; ``w`` clipped to ``[e^{−b}, e^{b}]``.
    """
    a_old = torch.exp(t.s_old.double() - t.lse.double()[..., None])  # [P, n, N − m]
    target = a_old.sum(dim=-1, keepdim=True)  # [P, n, 1]
    g = a_old.gather(2, index[:, None, :].expand(-1, a_old.shape[1], -1))  # [P, n, k]
    del a_old
    n, k = g.shape[1], index.shape[1]
    if n < k:  # fewer queries than kept keys: the same solution from an n × n system
        rho = ridge * g.square().sum(dim=(1, 2)) / k  # [P]
        ones = g.new_ones(g.shape[0], k, 1)
        w = (ones + _ridge_in_query_space(g, target - torch.bmm(g, ones), rho))[..., 0]
        return torch.log(w.clamp(math.exp(-bound), math.exp(bound))).to(t.q.dtype)
    gram = torch.bmm(g.transpose(1, 2), g)
    rho = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / k  # [P]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    rhs = torch.bmm(g.transpose(1, 2), target) + rho[:, None, None]
    w = _spd_solve(gram + rho[:, None, None] * eye, rhs)[..., 0]
    return torch.log(w.clamp(math.exp(-bound), math.exp(bound))).to(t.q.dtype)


def _ridge_in_query_space(a: torch.Tensor, r: torch.Tensor, lam: torch.Tensor,
                          outer: torch.Tensor | None = None) -> torch.Tensor:
    """``argmin_x ‖a x − r‖² + λ‖x‖²`` for ``a`` ``[P, n, k]`` with ``n < k``, ``r`` ``[P, n, c]``, ``λ`` ``[P]``, as
    ``aᵀ (a aᵀ + λI)⁻¹ r`` (Woodbury: an ``n × n`` system instead of ``k × k``): ``[P, k, c]``. ``outer``: ``a aᵀ``
    ``[P, n, n]`` when the caller solves several ``λ`` for one ``a`` (computed here otherwise)."""
    outer = torch.bmm(a, a.transpose(1, 2)) if outer is None else outer
    eye = torch.eye(a.shape[1], dtype=a.dtype, device=a.device)
    return torch.bmm(a.transpose(1, 2), _spd_solve(outer + lam[:, None, None] * eye, r))


def anchored_values(t: HeadTargets, keys_c, bias_c, v_sel, v_ret, ridges) -> list[torch.Tensor]:
    """Values ``[P, k, d]`` for each ``λ₀`` in ``ridges``: ``argmin ‖A_c V − R‖² + λ‖V − V_sel‖²`` with
    ``λ = λ₀·tr(A_cᵀA_c)/k`` (float64; ``λ₀ = ∞`` gives ``V_sel``)."""
    a, _ = compressed_attention(t, keys_c, bias_c)
    k = keys_c.shape[1]
    a = a.double()
    a_c = a[..., :k]
    residual = t.y.double() - torch.bmm(a[..., k:], v_ret.double())
    if a_c.shape[1] < k:  # fewer queries than kept keys: each λ's solution from an n × n system (Woodbury)
        scale = a_c.square().sum(dim=(1, 2)) / k  # [P]
        off = residual - torch.bmm(a_c, v_sel.double())
        outer = torch.bmm(a_c, a_c.transpose(1, 2))  # [P, n, n], shared by every λ
        return [v_sel if math.isinf(lam) else
                (v_sel.double() + _ridge_in_query_space(a_c, off, lam * scale, outer)).to(v_sel.dtype)
                for lam in ridges]
    gram = torch.bmm(a_c.transpose(1, 2), a_c)
    rhs = torch.bmm(a_c.transpose(1, 2), residual)
    scale = gram.diagonal(dim1=-2, dim2=-1).sum(-1) / k  # [P]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    out = []
    for lam in ridges:
        if math.isinf(lam):
            out.append(v_sel)
            continue
        lam_p = (lam * scale)[:, None, None]
        out.append(_spd_solve(gram + lam_p * eye, rhs + lam_p * v_sel.double()).to(v_sel.dtype))
    return out


def layer_targets(keys: torch.Tensor, values: torch.Tensor, train: torch.Tensor, m: int, k: int,
                  scale: float | None, dtype, device):
    """The inputs every per-layer fit starts from: ``keys``, ``values`` ``[P, N, d]`` on ``device`` in ``dtype``,
    the full cache's targets on ``train`` (:class:`HeadTargets`), ``a_old`` ``[P, Q, N − m]`` (each training
    query's attention to the old keys) and the score scale (``1/√d`` when ``None``). Checks 1 ≤ k ≤ N − m."""
    P, N, d = keys.shape
    if not 1 <= k <= N - m:
        raise ValueError(f"k={k}: expected 1 ≤ k ≤ N − m = {N - m}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dev = device or keys.device
    keys, values = keys.to(dev, dtype), values.to(dev, dtype)
    t = HeadTargets.of(train.to(dev, dtype), keys, values, m, scale)
    return keys, values, t, torch.exp(t.s_old - t.lse[..., None]), scale


def distil_layer(keys: torch.Tensor, values: torch.Tensor, train: torch.Tensor, validation: torch.Tensor,
                 m: int, k: int, config: ZipkvConfig | None = None, scale: float | None = None) -> dict:
    """zipkv's distiller on the ``P`` KV heads of one layer (see the module docstring).

    Args:
        keys, values: ``[P, N, d]`` the full cache; the last ``m`` pairs are kept.
        train, validation: ``[P, n_t, d]``, ``[P, n_v, d]`` queries (:func:`future_queries`).
        m, k: retain zone and compressed pairs per head (``1 ≤ k ≤ N − m``).
        scale: score scale (``1/√d`` when ``None``).

    Returns:
        dict with ``keys``, ``values`` ``[P, k, d]``, ``bias`` ``[P, k]``, ``index`` ``[P, k]`` (kept old
        positions), ``ridge`` ``[P]`` (the chosen ``λ₀``), ``train``/``validation`` ``[P]`` objectives.
    """
    cfg = config or ZipkvConfig()
    if cfg.selection not in ("mean", "max"):
        raise ValueError(f"selection={cfg.selection!r}: expected 'mean' or 'max'")
    keys, values, t, a_old, scale = layer_targets(keys, values, train, m, k, scale, cfg.dtype, cfg.device)
    P, N, d = keys.shape
    dev = keys.device
    v_ret = values[:, N - m:]
    importance = a_old.mean(dim=1) if cfg.selection == "mean" else a_old.amax(dim=1)
    del a_old
    index = torch.topk(importance, k, dim=1).indices.sort(dim=1).values  # [P, k]
    gather = index[..., None].expand(-1, -1, d)
    keys_c, v_sel = keys.gather(1, gather), values.gather(1, gather)
    bias_c = mass_bias(t, index, cfg.mass_ridge, cfg.bias_bound) if cfg.bias else keys.new_zeros(P, k)
    candidates = anchored_values(t, keys_c, bias_c, v_sel, v_ret, cfg.value_ridges)
    v = HeadTargets.of(validation.to(dev, cfg.dtype), keys, values, m, scale)
    scores = torch.stack([sum(objective(v, keys_c, vc, bias_c, v_ret)) for vc in candidates])  # [R, P]
    best = scores.argmin(dim=0)
    values_c = torch.stack(candidates)[best, torch.arange(P, device=dev)]
    train_obj = sum(objective(t, keys_c, values_c, bias_c, v_ret))
    return dict(keys=keys_c, values=values_c, bias=bias_c, index=index,
                ridge=torch.tensor([cfg.value_ridges[int(i)] for i in best]),
                train=train_obj, validation=scores.min(dim=0).values)


@dataclass
class Probe:
    """The model's own continuation of the context, sampled at compression time (no access to the real one).

    Attributes:
        ids: ``[P]`` sampled token ids (positions N … N+P−1).
        reference: the full cache's teacher-forced logits on them (:func:`zipkv.distill.bias.teacher_force`).
    """

    ids: torch.Tensor
    reference: object


@torch.no_grad()
def sample_probe(model, capture, context_ids: torch.Tensor, tokens: int = 64, *, seed: int = 0) -> Probe:
    """Sample ``tokens`` continuation tokens (temperature 1) from the model after the captured context.

    ``context_ids`` ``[N]``: the context the capture was made of (its last token is re-fed at ``N − 1`` on the
    cache of the first ``N − 1`` positions, which gives the first sampled token's distribution).
    """
    from transformers import DynamicCache

    from .bias import BiasedCache, teacher_force

    param = next(model.parameters())
    full = BiasedCache.from_capture(capture)
    N = full.n_context
    context_ids = torch.as_tensor(context_ids).flatten()
    if context_ids.shape[0] != N:
        raise ValueError(f"context_ids has {context_ids.shape[0]} tokens, the capture N={N}")
    past = DynamicCache([(torch.stack(ks)[None, :, :N - 1].to(param), torch.stack(vs)[None, :, :N - 1].to(param))
                         for ks, vs in zip(full.keys, full.values)], config=model.config)
    generator = torch.Generator(device=param.device).manual_seed(seed)
    token = context_ids[-1].to(param.device)
    ids = []
    for step in range(tokens):
        out = model(input_ids=token.view(1, 1), position_ids=torch.tensor([[N - 1 + step]], device=param.device),
                    use_cache=True, **{cache_keyword(model): past})
        token = torch.multinomial(torch.softmax(out.logits[0, -1].float(), dim=-1), 1, generator=generator)[0]
        ids.append(int(token))
    ids = torch.tensor(ids)
    return Probe(ids=ids, reference=teacher_force(model, full, ids))


@torch.no_grad()
def forced_probe(model, capture, ids: torch.Tensor) -> Probe:
    """A probe of given token ids ``[P]`` teacher-forced after the captured context at positions N … N+P−1 (e.g. a
    repeat-the-context prompt and the context, KVzip's reconstruction queries): the full cache's logits on them."""
    from .bias import BiasedCache, teacher_force

    ids = torch.as_tensor(ids).flatten().long()
    return Probe(ids=ids, reference=teacher_force(model, BiasedCache.from_capture(capture), ids))


SENSITIVITY_MEMORY = {"cuda": 8 * 2**30, "cpu": 2**30}
"""Bytes, by device type, that :func:`head_sensitivity`'s default ``batch`` lets one forward's variants hold."""


def _variant_bytes(model, n_pairs: int, tokens: int, layers: int | None = None) -> int:
    """Memory one variant of :func:`head_sensitivity` holds in its forward: its cache of the ``layers`` layers it
    computes (default all) after the probe tokens are appended, ``2·layers·H·(P + T)·d``, its logits ``T·vocab``,
    one layer's keys and values repeated over the query heads for SDPA (``repeat_kv``: with a mask there is no GQA
    kernel), ``2·Hq·(P + T)·d`` (the model's dtype), and one layer's float32 mask with two temporaries,
    ``3·Hq·T·(P + T)``."""
    shape = model_shape(model)
    item = next(model.parameters()).element_size()
    layers = shape.layers if layers is None else layers
    cache = 2 * layers * shape.kv_heads * (n_pairs + tokens) * shape.head_dim * item
    repeated = 2 * shape.q_heads * (n_pairs + tokens) * shape.head_dim * item
    return cache + repeated + tokens * model.config.vocab_size * item + 3 * shape.q_heads * tokens * (n_pairs + tokens) * 4


def _head_variants(base: list, compressed: BiasedCache, chunk: list, n_context: int):
    """A :class:`zipkv.cache.DistilledCache` whose sequence ``b`` is the cache ``base`` (per layer ``(keys, values,
    valid, bias)``, ``[H, P, d]`` twice and ``[H, P]`` twice) with head ``chunk[b] = (l, h)`` taken from
    ``compressed`` (its pairs first, padding after, as :meth:`~zipkv.distill.kvsculpt.CompressedCache.padded`
    lays out a layer): per-sequence ``[B, H, P, …]`` layers where the chunk edits, ``base``'s tensors elsewhere."""
    from zipkv.cache import DistilledCache, DistilledLayer

    B = len(chunk)
    edits: dict = {}  # layer -> [(row, head)]
    for row, (layer, h) in enumerate(chunk):
        edits.setdefault(layer, []).append((row, h))
    layers = []
    for layer, (keys, values, valid, bias) in enumerate(base):
        if layer not in edits:
            layers.append(DistilledLayer(keys, values, valid, bias))
            continue
        keys, values = keys.repeat(B, 1, 1, 1), values.repeat(B, 1, 1, 1)
        valid, bias = valid.repeat(B, 1, 1), bias.repeat(B, 1, 1)
        P = keys.shape[2]
        for row, h in edits[layer]:
            n = compressed.keys[layer][h].shape[0]
            keys[row, h, :n] = compressed.keys[layer][h].to(keys)
            values[row, h, :n] = compressed.values[layer][h].to(values)
            bias[row, h, :n] = compressed.bias[layer][h].to(bias)
            keys[row, h, n:], values[row, h, n:], bias[row, h, n:] = 0, 0, 0
            valid[row, h] = torch.arange(P, device=valid.device) < n
        layers.append(DistilledLayer(keys, values, valid, bias))
    return DistilledCache(layers, n_context)


def head_sensitivity(model, full: BiasedCache, compressed: BiasedCache, probe: Probe,
                     layers: list[int] | None = None, *, batch: int | None = None) -> torch.Tensor:
    """``[L, H]`` KL on the probe continuation when only head ``(l, h)`` holds its compressed pairs, for the heads
    of ``layers`` (default all; 0 on the other layers).

    The ``(l, h)`` variants run ``batch`` at a time as the rows of one teacher-forced forward of the probe over a
    :class:`zipkv.cache.DistilledCache` with per-sequence pairs on the layers the chunk edits (the others share the
    full cache's tensors): the model's own attention with zipkv's mask, so row ``b``'s KL is
    :func:`zipkv.distill.bias.evaluate`'s for that variant alone (a test checks it against one forward per head).
    On a GPU one forward per head is launch-bound; a batched forward costs about one of them. A forward holds the
    heads of one layer ``l`` only, and computes layers ``l`` … ``L−1`` alone: below ``l`` every variant's cache is
    the full one, so those layers replay the outputs of one forward of the probe over the full cache
    (:func:`_replayed_layers`), which halves the layers computed on average.

    Memory: one variant holds its own cache of every layer with the ``T`` probe tokens appended,
    ``2·L·H·(N + T)·d`` values, its logits ``T·vocab`` and one layer's attention temporaries
    (:func:`_variant_bytes`): ~134 MB for SmolLM2-135M in float32 at N = 2048, T = 64, 4.3 GB for Llama-3.1-8B's
    shape in bf16 at N = 32,768 (for a head of layer ``l``, the layers from ``l`` on). ``batch=None`` takes as many
    of a layer's heads as fit in :data:`SENSITIVITY_MEMORY` (1 GiB on the CPU; on CUDA 8 GiB or half the free
    memory, whichever is more), spread evenly over the forwards that layer needs; an int ``batch`` caps every
    forward at that many.
    """
    from .evaluate import kl_divergence, teacher_force_batch

    L, H = full.num_layers, full.num_heads
    kl = torch.zeros(L, H, dtype=torch.float64)
    layers = list(range(L) if layers is None else layers)
    if (compressed.num_layers, compressed.num_heads) != (L, H) or not all(0 <= layer < L for layer in layers):
        raise ValueError(f"compressed has {compressed.num_layers} × {compressed.num_heads} heads, full {L} × {H}, "
                         f"layers={layers}: expected equal shapes and layers in [0, {L})")
    longer = [(l, h) for l in layers for h in range(H) if compressed.keys[l][h].shape[0] > full.keys[l][h].shape[0]]
    if longer:
        raise ValueError(f"compressed heads (layer, head) {longer[:4]} hold more pairs than the full cache's")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch={batch!r}: expected a positive int (variants per forward) or None")
    variants = [(layer, h) for layer in layers for h in range(H)]
    if not variants:
        return kl
    param = next(model.parameters())
    base = [full.padded(layer, dtype=param.dtype, device=param.device) + (full.padded_bias(layer, device=param.device),)
            for layer in range(L)]
    memory = SENSITIVITY_MEMORY.get(param.device.type, SENSITIVITY_MEMORY["cpu"])
    if batch is None and param.device.type == "cuda":  # a larger GPU's free memory takes more variants per forward
        memory = max(memory, torch.cuda.mem_get_info(param.device)[0] // 2)
    outputs = _layer_outputs(model, full, probe.ids)
    P = max(k.shape[1] for k, *_ in base)
    for layer in sorted({layer for layer, _ in variants}):
        heads = [v for v in variants if v[0] == layer]
        size = batch or max(1, memory // _variant_bytes(model, P, probe.ids.shape[0], layers=L - layer))
        size = -(-len(heads) // -(-len(heads) // size))  # the layer's heads spread evenly over its forwards
        for start in range(0, len(heads), size):
            chunk = heads[start:start + size]
            with _replayed_layers(model, outputs, layer, len(chunk)):
                logits = teacher_force_batch(model, _head_variants(base, compressed, chunk, full.n_context), probe.ids)
            for row, (_, h) in enumerate(chunk):
                kl[layer, h] = float(kl_divergence(probe.reference.logits, logits[row].float()).mean())
    return kl


@torch.no_grad()
def _layer_outputs(model, full: BiasedCache, ids: torch.Tensor) -> list:
    """What each decoder layer returns in one teacher-forced forward of ``ids`` over the ``full`` cache (batch 1)."""
    from .bias import teacher_force
    from .evaluate import _decoder_layers

    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(out))
             for layer in _decoder_layers(model)]
    try:
        teacher_force(model, full, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


@contextmanager
def _replayed_layers(model, outputs: list, upto: int, rows: int):
    """Inside the block, decoder layers ``0 … upto−1`` do not compute: each returns layer ``upto − 1``'s entry of
    ``outputs`` (:func:`_layer_outputs`) with the batch dimension repeated to ``rows`` sequences -- the only output
    a computed layer reads. The replayed layers append nothing to the cache, which nothing reads again."""
    from .evaluate import _decoder_layers

    def repeated(out):
        if isinstance(out, torch.Tensor):
            return out.repeat(rows, *([1] * (out.ndim - 1)))
        return type(out)(repeated(x) if isinstance(x, torch.Tensor) else x for x in out)

    layers = _decoder_layers(model)
    replaced = []  # (layer, its own instance forward or None): accelerate's hooks, for one, set one
    out = repeated(outputs[upto - 1]) if upto else None   # what the first computed layer reads; the others' is unread
    try:
        for j in range(upto):
            replaced.append((layers[j], layers[j].__dict__.get("forward")))
            layers[j].forward = lambda *args, **kwargs: out
        yield
    finally:
        for layer, own in replaced:
            if own is None:
                del layer.forward
            else:
                layer.forward = own


PROBE_ALPHA = 0.25
"""Dampening exponent of the probe allocation, chosen on one development window (PG19 book 41607, not an
evaluation window; r = 0.3): 0 (uniform), 0.25, 0.35, 0.5 and 1.0 were measured, 0.25 had the lowest KL,
1.0 (proportional) a higher KL than uniform; KVSculpt's pilot uses 0.5."""

BUDGETS = ("uniform", "pilot", "probe")
"""``uniform``: ``k`` per head. ``pilot``: the uniform run's validation objective; ``probe``: the KL on the
model's own sampled continuation (:func:`sample_probe`) when only that head is compressed. Either signal,
raised to ``alpha``, splits the same total over layers, then heads (KVSculpt §3.5's two-level allocation,
:func:`zipkv.distill.budget.allocate`)."""


def _query_caps(max_scores: int | None, n_context: int) -> dict:
    """:func:`future_queries`' ``max_train`` and ``max_validation`` for :attr:`ZipkvConfig.max_scores`."""
    if max_scores is None:
        return {}
    train = max(2, max_scores // n_context)
    return dict(max_train=train, max_validation=max(2, train // 4))


def _layer_inputs(capture, layer: int, m: int, cfg: ZipkvConfig):
    lc = capture.layers[layer]
    H, N, d = lc.keys.shape
    g = lc.queries.shape[0] // H
    train, validation = future_queries(lc.queries.view(H, g, N, d), capture.positions, rope_of(capture, layer), m,
                                       horizon=cfg.horizon, validation_every=cfg.validation_every,
                                       **_query_caps(getattr(cfg, "max_scores", None), N))
    return lc, train, validation


def _compressed_inputs(capture, m: int, cfg) -> list:
    """Per layer, :func:`_layer_inputs` for the layers a distiller compresses, ``None`` for the others
    (:func:`zipkv.distill.kvsculpt.compressed_layers`: Gemma 3's sliding-window layers keep their window)."""
    from .kvsculpt import compressed_layers

    kept = set(compressed_layers(capture))
    return [_layer_inputs(capture, layer, m, cfg) if layer in kept else None for layer in range(len(capture.layers))]


def _assemble(capture, inputs, solved, ks, m, ratio, seconds) -> BiasedCache:
    L = len(inputs)
    H, N, _ = capture.layers[0].keys.shape
    keys, values, bias = [], [], []
    first = next(out for out in solved if out is not None)
    info = {name: torch.zeros(L, H, dtype=torch.float64) for name in ("train", "validation", "ridge") if name in first}
    for layer, (inp, out) in enumerate(zip(inputs, solved)):
        if inp is None:  # not compressed: the layer's window, β = 0
            window_keys, window_values = capture.kept_pairs(layer)
            keys.append(list(window_keys.unbind(0)))
            values.append(list(window_values.unbind(0)))
            bias.append([torch.zeros(window_keys.shape[1], device=window_keys.device) for _ in range(H)])
            continue
        lc = inp[0]
        keys.append([torch.cat([out["keys"][h].to(lc.keys), lc.keys[h, N - m:]]) for h in range(H)])
        values.append([torch.cat([out["values"][h].to(lc.values), lc.values[h, N - m:]]) for h in range(H)])
        bias.append([torch.cat([out["bias"][h].float().cpu(), torch.zeros(m)]).to(lc.keys.device) for h in range(H)])
        for name in info:
            info[name][layer] = torch.as_tensor([float(out[name][h]) for h in range(H)], dtype=torch.float64)
    return BiasedCache(keys, values, bias, n_context=int(capture.positions[-1]) + 1, method="zipkv", ratio=ratio,
                       budget=ks.clone(), seconds=seconds, info=info)


@suggest_keywords
def compress(capture, ratio: float, *, m: int = 256, config: ZipkvConfig | None = None, budget: str = "uniform",
             alpha: float = PROBE_ALPHA, model=None, probe: Probe | None = None, cascade: bool = False,
             progress: bool = False) -> BiasedCache:
    """Compress a captured context at ``r = (k + m)/N`` with zipkv's distiller (module docstring).

    Args:
        capture: a :class:`zipkv.models.Capture` of the ``N``-token context.
        ratio: ``m/N < r ≤ 1``; ``k = round(r·N) − m`` pairs per head on average replace the old zone.
        m: retain zone (kept unchanged).
        config: :class:`ZipkvConfig`.
        budget: one of :data:`BUDGETS`.
        alpha: dampening exponent of the allocation.
        model, probe: the model and its sampled continuation, for ``budget="probe"`` and ``cascade``.
        cascade: after the allocation, distil with :func:`compress_cascade` (on-policy probe queries) instead
            of the future queries alone.

    Returns:
        A :class:`~zipkv.distill.bias.BiasedCache` with ``k_lh + m`` pairs per head (β on the first ``k_lh``; a
        sliding-window layer keeps its window, ``k_lh = 0``, :func:`zipkv.distill.kvsculpt.compressed_layers`);
        ``info`` holds ``[L, H]`` tensors ``train``, ``validation`` (objectives), ``ridge`` (chosen ``λ₀``)
        and, with a non-uniform budget, ``signal``; ``info["phase_seconds"]`` the wall seconds of each phase that
        ran (after ``torch.cuda.synchronize()`` where CUDA is in use): ``distil`` (future queries, the uniform fit),
        ``head_sensitivity`` (the probe signal), ``allocation``, then ``cascade`` or ``refit`` (each head at its
        budget); ``seconds`` is their total.
    """
    from tqdm.auto import tqdm

    from .budget import allocate
    from .kvsculpt import budget_for_ratio, check_capture

    check_capture(capture)

    cfg = config or ZipkvConfig()
    if budget not in BUDGETS:
        raise ValueError(f"budget={budget!r}: expected one of {list(BUDGETS)}")
    if (budget == "probe" or cascade) and (model is None or probe is None):
        raise ValueError("budget='probe' and cascade=True need model= and probe= (zipkv.distill.generalise.sample_probe)")
    phases = {}
    clock = [synchronized_time()]

    def phase(name):
        clock.append(synchronized_time())
        phases[name] = clock[-1] - clock[-2]

    L = len(capture.layers)
    H, N, d = capture.layers[0].keys.shape
    k = budget_for_ratio(ratio, N, m)
    inputs = _compressed_inputs(capture, m, cfg)
    kept = [layer for layer, inp in enumerate(inputs) if inp is not None]
    ks = torch.zeros(L, H, dtype=torch.long)
    ks[kept] = k
    signal = None
    allocated = budget != "uniform" and k < N - m
    if allocated or not cascade:  # the uniform fit: the cache itself, or the signal's starting point
        solved = [None if inp is None else distil_layer(inp[0].keys, inp[0].values, inp[1], inp[2], m, k, cfg)
                  for inp in tqdm(inputs, desc="zipkv", disable=not progress, leave=False)]
        phase("distil")
    if allocated:
        if budget == "pilot":
            signal = torch.stack([torch.zeros(H, dtype=torch.float64) if out is None
                                  else out["validation"].double().cpu() for out in solved])
        else:
            uniform = _assemble(capture, inputs, solved, ks, m, ratio, 0.0)
            signal = head_sensitivity(model, BiasedCache.from_capture(capture), uniform, probe, layers=kept)
            phase("head_sensitivity")
        ks = torch.zeros(L, H, dtype=torch.long)
        ks[kept] = allocate(signal[kept].clamp_min(1e-12), k * len(kept) * H, alpha=alpha, per_head=True, k_min=1,
                            k_max=N - m)
        phase("allocation")
    if cascade:
        cache = compress_cascade(model, capture, ratio, probe, m=m, config=cfg, budget=ks)
        phase("cascade")
    else:
        if signal is not None:  # each head again at its own budget
            for layer in kept:
                lc, tr, va = inputs[layer]
                heads = [distil_layer(lc.keys[h:h + 1], lc.values[h:h + 1], tr[h:h + 1], va[h:h + 1], m,
                                      int(ks[layer, h]), cfg) for h in range(H)]
                solved[layer] = {name: [out[name][0] for out in heads] for name in heads[0]}
            phase("refit")
        cache = _assemble(capture, inputs, solved, ks, m, ratio, 0.0)
    cache.seconds = synchronized_time() - clock[0]
    if signal is not None:
        cache.info["signal"] = signal
    cache.info["phase_seconds"] = phases
    return cache


def synchronized_time() -> float:
    """``time.perf_counter()`` once the queued CUDA work has run (kernels are asynchronous): phase timings."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


CASCADE_ATTENTION = "zipkv_cascade"
"""Attention function name under which :func:`compress_cascade` distils each layer inside the probe's forward."""

_cascade: dict = {}  # state of the running compress_cascade forward


def _cascade_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Distil layer ``ℓ`` from the probe tokens' queries as they arrive (layers < ℓ already compressed), then
    attend (transformers' SDPA with :class:`zipkv.cache.DistilledLayer`'s mask) over ``[compressed layer ℓ (+β);
    probe tokens]`` so that layer ℓ + 1 sees the compressed model."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zipkv.cache import DistilledLayer

    state = _cascade
    layer = module.layer_idx
    if state["inputs"][layer] is None:  # a layer that is not compressed attends as the model does
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    lc, tr, va = state["inputs"][layer]
    H, N, d = lc.keys.shape
    m = state["m"]
    Hq, P = query.shape[1], query.shape[2]
    g = Hq // H
    on_policy = query[0].float().reshape(H, g * P, d)
    train = torch.cat([tr, on_policy.to(tr)], dim=1)
    out = state["fit"](lc.keys, lc.values, train, va, m, state["ks"][layer])
    state["solved"][layer] = out
    n_max = max(int(state["ks"][layer].max()) + m, 1)
    keys = key.new_zeros(H, n_max, d)
    values = value.new_zeros(H, n_max, d)
    valid = torch.zeros(H, n_max, dtype=torch.bool, device=key.device)
    bias = torch.zeros(H, n_max, dtype=torch.float32, device=key.device)
    for h in range(H):
        k = out["keys"][h].shape[0]
        keys[h, :k + m] = torch.cat([out["keys"][h].to(key), lc.keys[h, N - m:].to(key)])
        values[h, :k + m] = torch.cat([out["values"][h].to(value), lc.values[h, N - m:].to(value)])
        valid[h, :k + m] = True
        bias[h, :k] = out["bias"][h].float().to(key.device)
    # the DistilledCache's mask: β on the cached pairs, −inf on padding, the probe tokens causal
    mask = DistilledLayer(keys, values, valid, bias).additive_mask(P, g, query.dtype)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, torch.cat([keys[None], key[:, :, N:]], dim=2),
                                           torch.cat([values[None], value[:, :, N:]], dim=2), mask, dropout=dropout,
                                           scaling=scaling)  # dropout: kvpress's patch of these functions needs it


def per_head_fit(config: ZipkvConfig):
    """zipkv's per-layer fit for :func:`compress_cascade`: :func:`distil_layer` head by head (``ks`` ``[H]`` may
    differ per head); returns per-head lists."""
    def fit(keys, values, train, validation, m, ks):
        heads = [distil_layer(keys[h:h + 1], values[h:h + 1], train[h:h + 1], validation[h:h + 1], m, int(ks[h]),
                              config) for h in range(keys.shape[0])]
        return {name: [o[name][0] for o in heads] for name in heads[0]}
    return fit


@torch.no_grad()
@suggest_keywords
def compress_cascade(model, capture, ratio: float, probe: Probe, *, m: int = 256, config: ZipkvConfig | None = None,
                     budget: torch.Tensor | None = None, fit=None, method: str = "zipkv_cascade") -> BiasedCache:
    """Cascade-aware (on-policy) zipkv: layer ``ℓ`` is distilled with, besides its future queries, the probe
    continuation's queries *as the model whose layers < ℓ are already compressed produces them* (KVSculpt
    §6–§7's "next step"; Attention Matching's on-policy queries). One forward pass of the probe tokens at
    N … N+P−1 over the full cache distils each layer on arrival and attends over the result.

    Args:
        model: the model the capture came from.
        capture, ratio, m, config: as :func:`compress`.
        probe: :func:`sample_probe` of this context.
        budget: ``[L, H]`` pairs per head (e.g. a probe-budget cache's ``budget``), summing to ``k·H`` times
            the number of compressed layers; default uniform ``k``. Layers that are not compressed (Gemma 3's sliding-window
            layers, :func:`zipkv.distill.kvsculpt.compressed_layers`) have ``0``, keep their window and attend as
            the model does.
        fit: ``fit(keys, values, train, validation, m, ks)`` → the layer's fitted pairs (``keys``, ``values``,
            ``bias`` indexable per head, plus per-head ``train``/``validation`` objectives); default
            :func:`per_head_fit` of ``config`` (Attention Matching passes its own, same queries).
        method: the returned cache's ``method``.

    An uncompressed budget (``k = N − m``) keeps every pair and changes nothing (the tests check KL 0).
    """
    from transformers import DynamicCache

    from zipkv.models import register_attention

    from .kvsculpt import budget_for_ratio, compressed_layers

    cfg = config or ZipkvConfig()
    started = time.perf_counter()
    L = len(capture.layers)
    H, N, d = capture.layers[0].keys.shape
    k = budget_for_ratio(ratio, N, m)
    kept = compressed_layers(capture)
    if budget is None:
        ks = torch.zeros(L, H, dtype=torch.long)
        ks[kept] = k
    else:
        ks = torch.as_tensor(budget)
    if tuple(ks.shape) != (L, H) or int(ks.sum()) != k * len(kept) * H:
        raise ValueError(f"budget has shape {tuple(ks.shape)} and total {int(ks.sum())}: expected [{L}, {H}] summing "
                         f"to k·L·H = {k * len(kept) * H} over the {len(kept)} compressed layers")
    inputs = _compressed_inputs(capture, m, cfg)
    param = next(model.parameters())
    past = DynamicCache([(lc.keys[None].to(param), lc.values[None].to(param)) for lc in capture.layers],
                        config=model.config)
    _cascade.update(inputs=inputs, m=m, ks=ks, solved=[None] * L, fit=fit or per_head_fit(cfg))
    register_attention(CASCADE_ATTENTION, _cascade_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CASCADE_ATTENTION)
    try:
        positions = torch.arange(N, N + probe.ids.shape[0], device=param.device)
        model(input_ids=probe.ids[None].to(param.device), position_ids=positions[None], use_cache=True,
              logits_to_keep=1, **{cache_keyword(model): past})
        solved = _cascade["solved"]
    finally:
        model.set_attn_implementation(previous)
        _cascade.clear()
    cache = _assemble(capture, inputs, solved, ks, m, ratio, time.perf_counter() - started)
    cache.method = method
    return cache
