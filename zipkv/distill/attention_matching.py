"""Attention Matching (Zweiger, Fu, Guo & Kim 2026, arXiv 2602.16284) as a peer baseline (issue 17).

Attention Matching compacts a block of keys and values into ``k`` keys ``C_1``, one additive logit bias
``β`` per key and ``k`` values ``C_2``, chosen so that for reference queries the compact block reproduces
the block's attention *mass* (its partition function ``Σ_i exp(q·k_i/√d)``) and its attention *output*:

1. **Keys** (``selection="highest"``): the ``k`` old keys with the highest attention over the reference
   queries, scored by the root mean square of their full-cache attention weights (the paper's ``rms``
   score), kept as they are.
2. **Bias**: non-negative least squares for ``w = e^β``: ``min_{w ≥ 0} ‖M w − t‖²`` with
   ``M_qj = exp(s_qj − μ_q)`` the kept keys' shifted exponentials and ``t_q = Σ_{i old} exp(s_qi − μ_q)``
   (``μ_q`` the query's largest old-zone logit), started from the clamped unconstrained solution and
   refined by projected gradient steps, ``w`` kept in ``[e^{−3}, e^{3}]`` (the paper's bounds).
3. **Values**: least squares (a vanishing ridge, ``ridge``, for conditioning) of the whole cache's
   attention output with the retain zone fixed — the block's own output, since mass and output together
   determine its contribution to any later softmax.

Here the block is KVSculpt's compress zone (the oldest ``N − m`` pairs); the retain zone is kept, as for
every method in the KVSculpt chapters. Reference queries are the same as zipkv's distiller's
(:func:`zipkv.distill.generalise.future_queries`, training split), so the two methods differ only in how they
fit: with the same queries and budget a difference in KL is the method's. The paper's L-BFGS key
refinement on a log-sum-exp match, OMP selection and on-policy (layer-sequential) queries are not
implemented here.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .bias import BiasedCache
from .generalise import HeadTargets, _spd_solve, future_queries, layer_targets, objective


@dataclass
class AttentionMatchingConfig:
    """Attention Matching settings (the paper's HighestAttnKeys with NNLS β and least-squares values).

    Attributes:
        horizon, validation_every: the reference queries (as :class:`~zipkv.distill.generalise.ZipkvConfig`;
            the validation split is not used for fitting, only reported).
        nnls_iters: projected-gradient steps of the β fit.
        bias_bound: ``|β| ≤ bias_bound``.
        ridge: relative ridge of the value least squares (``ridge·tr(AᵀA)/k``).
        dtype, device: where and in what to solve.
    """

    horizon: int = 256
    validation_every: int = 8
    nnls_iters: int = 2
    bias_bound: float = 3.0
    ridge: float = 1e-6
    dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None


def nnls_bias(t: HeadTargets, index: torch.Tensor, iters: int, bound: float) -> torch.Tensor:
    """``β`` ``[P, k]`` from the bounded NNLS mass match of step 2 (module docstring)."""
    s_old = t.s_old.double()
    mu = s_old.amax(dim=-1, keepdim=True)
    e_old = torch.exp(s_old - mu)  # [P, n, N − m]
    target = e_old.sum(dim=-1, keepdim=True)  # [P, n, 1]
    M = e_old.gather(2, index[:, None, :].expand(-1, e_old.shape[1], -1))  # [P, n, k]
    gram = torch.bmm(M.transpose(1, 2), M)
    rhs = torch.bmm(M.transpose(1, 2), target)
    k = index.shape[1]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    tiny = 1e-10 * gram.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None]
    lo, hi = math.exp(-bound), math.exp(bound)
    w = _spd_solve(gram + tiny * eye, rhs).clamp(lo, hi)
    step = 1.0 / torch.linalg.matrix_norm(gram, ord=2)[:, None, None]  # 1/L for the quadratic's gradient
    for _ in range(iters):
        w = (w - step * (torch.bmm(gram, w) - rhs)).clamp(lo, hi)
    return torch.log(w[..., 0]).to(t.q.dtype)


def least_squares_values(t: HeadTargets, keys_c, bias_c, v_ret, ridge: float) -> torch.Tensor:
    """``[P, k, d]`` values minimising the whole cache's output error (float64, relative ridge ``ridge``)."""
    s = torch.cat([torch.baddbmm(bias_c[:, None, :], t.q, keys_c.transpose(1, 2)), t.s_ret], dim=-1).double()
    a = torch.softmax(s, dim=-1)
    k = keys_c.shape[1]
    a_c = a[..., :k]
    residual = t.y.double() - torch.bmm(a[..., k:], v_ret.double())
    gram = torch.bmm(a_c.transpose(1, 2), a_c)
    lam = (ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / k)[:, None, None]
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    return _spd_solve(gram + lam * eye, torch.bmm(a_c.transpose(1, 2), residual)).to(keys_c.dtype)


def compact_layer(keys: torch.Tensor, values: torch.Tensor, train: torch.Tensor, validation: torch.Tensor, m: int,
                  k: int, config: AttentionMatchingConfig | None = None, scale: float | None = None) -> dict:
    """Attention Matching on the ``P`` KV heads of one layer: ``keys``, ``values`` ``[P, N, d]`` → dict with
    ``keys``, ``values`` ``[P, k, d]``, ``bias`` ``[P, k]``, ``index`` and ``train``/``validation`` objectives."""
    cfg = config or AttentionMatchingConfig()
    keys, values, t, a_old, scale = layer_targets(keys, values, train, m, k, scale, cfg.dtype, cfg.device)
    P, N, d = keys.shape
    dev = keys.device
    v_ret = values[:, N - m:]
    importance = a_old.square().mean(dim=1).sqrt()  # rms attention per old key
    del a_old
    index = torch.topk(importance, k, dim=1).indices.sort(dim=1).values
    keys_c = keys.gather(1, index[..., None].expand(-1, -1, d))
    bias_c = nnls_bias(t, index, cfg.nnls_iters, cfg.bias_bound)
    values_c = least_squares_values(t, keys_c, bias_c, v_ret, cfg.ridge)
    v = HeadTargets.of(validation.to(dev, cfg.dtype), keys, values, m, scale)
    return dict(keys=keys_c, values=values_c, bias=bias_c, index=index,
                train=sum(objective(t, keys_c, values_c, bias_c, v_ret)),
                validation=sum(objective(v, keys_c, values_c, bias_c, v_ret)))


def compress(capture, ratio: float, *, m: int = 256, config: AttentionMatchingConfig | None = None) -> BiasedCache:
    """Compact a captured context's old zone at ``r = (k + m)/N`` with Attention Matching (module docstring).

    Returns a :class:`~zipkv.distill.bias.BiasedCache` (``k + m`` pairs per head, β on the first ``k``) whose
    ``info`` holds ``[L, H]`` ``train`` and ``validation`` objectives.
    """
    from .kvsculpt import budget_for_ratio

    cfg = config or AttentionMatchingConfig()
    started = time.perf_counter()
    L = len(capture.layers)
    H, N, d = capture.layers[0].keys.shape
    k = budget_for_ratio(ratio, N, m)
    keys, values, bias = [], [], []
    info = {name: torch.zeros(L, H, dtype=torch.float64) for name in ("train", "validation")}
    for layer, lc in enumerate(capture.layers):
        g = lc.queries.shape[0] // H
        train, validation = future_queries(lc.queries.view(H, g, N, d), capture.positions, capture.rope, m,
                                           horizon=cfg.horizon, validation_every=cfg.validation_every)
        out = compact_layer(lc.keys, lc.values, train, validation, m, k, cfg)
        keys.append([torch.cat([out["keys"][h].to(lc.keys), lc.keys[h, N - m:]]) for h in range(H)])
        values.append([torch.cat([out["values"][h].to(lc.values), lc.values[h, N - m:]]) for h in range(H)])
        bias.append([torch.cat([out["bias"][h].float().cpu(), torch.zeros(m)]).to(lc.keys.device) for h in range(H)])
        for name in info:
            info[name][layer] = out[name].double().cpu()
    return BiasedCache(keys, values, bias, n_context=int(capture.positions[-1]) + 1, method="attention_matching",
                       ratio=ratio, budget=torch.full((L, H), k), seconds=time.perf_counter() - started, info=info)
