"""One-problem-at-a-time references of the batched baselines in :mod:`.baselines` (KVSculpt §4).

Each loops over problems with small torch ops, as the method's description reads; the tests check
that the batched baselines give the same positions and, to rounding, the same values, losses and
(Joint Optimization) loss histories, as :mod:`zipkv.kernels.reference` does for the kernels.
"""
from __future__ import annotations

import math
import time
from typing import Sequence

import torch
from tqdm import tqdm

from .baselines import JointConfig
from .problem import RIDGE, Prepared, Problem, Solution, objective


def _selection(prep: Prepared, index: torch.Tensor, values: torch.Tensor | None, started: float) -> Solution:
    index = index.to(prep.k_old.device)
    keys = prep.k_old[index]
    vals = prep.v_old[index] if values is None else values
    return prep.solution(keys, vals, indices=index.cpu(), seconds=time.perf_counter() - started)


def random_selection_reference(problems: Sequence[Problem], *, seed: int = 0, dtype=torch.float32,
                               device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`~zipkv.distill.baselines.random_selection`. Random (§4): keep ``k`` uniformly random old positions with their original keys and values."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        index = torch.randperm(p.n - p.m, generator=generator)[: p.k].sort().values
        out.append(_selection(prep, index, None, started))
    return out


def attention_score_reference(problems: Sequence[Problem], *, dtype=torch.float32, device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`~zipkv.distill.baselines.attention_score`. Attention Score (§4, H2O-style): the top-``k`` old positions by attention accumulated over the
    training queries (softmax over the full cache, summed over all queries and query heads)."""
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        out.append(_selection(prep, prep.top_attention(p.k), None, started))
    return out


def select_fit_reference(problems: Sequence[Problem], *, ridge: float = RIDGE, dtype=torch.float32,
                         device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`~zipkv.distill.baselines.select_fit`. Select+Fit (§4): attention-score selection, then ridge-regression values (λ = ``ridge``)."""
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        index = prep.top_attention(p.k)
        out.append(_selection(prep, index, prep.ridge(prep.k_old[index], ridge), started))
    return out


def _hard_concrete(log_alpha: torch.Tensor, cfg: JointConfig, generator: torch.Generator | None) -> torch.Tensor:
    if generator is None:  # deterministic gate: the distribution's median
        s = torch.sigmoid(log_alpha)
    else:
        u = torch.rand(log_alpha.shape, generator=generator, dtype=torch.float64).to(log_alpha)
        u = u.clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / cfg.beta)
    return (s * (cfg.zeta - cfg.gamma) + cfg.gamma).clamp(0.0, 1.0)


def _gated_loss(prep: Prepared, z: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    # exp(score + log z) = z·exp(score): a key with z = 0 vanishes exactly. The full cache's
    # log-sum-exp (≥ every score) is the stabiliser, so no exp overflows.
    w_old = z[None, :] * torch.exp(prep.s_old - prep.lse[:, None])
    w_ret = torch.exp(prep.s_ret - prep.lse[:, None])
    total = w_old.sum(dim=1) + w_ret.sum(dim=1)
    y_hat = (w_old @ v_old + w_ret @ prep.v_ret) / total[:, None]
    lse_hat = prep.lse + torch.log(total.clamp_min(torch.finfo(total.dtype).tiny))
    out, lse = objective(y_hat, lse_hat, prep.y, prep.lse)
    return out + lse


def joint_opt_reference(problems: Sequence[Problem], config: JointConfig | None = None, *, seed: int = 0,
                        dtype=torch.float32, device=None, progress: bool = True) -> list[Solution]:
    """Reference (one problem at a time, ``torch.optim.Adam`` per problem) of :func:`~zipkv.distill.baselines.joint_opt`. Joint Optimization (§4): Hard Concrete gates over the old positions, trained jointly with their
    values, then the top-``k`` gates kept (see :class:`JointConfig`)."""
    cfg = config or JointConfig()
    generator = torch.Generator().manual_seed(seed)
    out = []
    for p in tqdm(problems, desc="joint_opt", disable=not progress, leave=False):
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        n_old = p.n - p.m
        if p.k == 0 or p.k == n_old:
            index = torch.arange(p.k)  # nothing to choose: none or all of the old positions
            vals = prep.ridge(prep.k_old[index], cfg.ridge) if cfg.refit else None
            out.append(_selection(prep, index, vals, started))
            continue
        # Start from the attention-score ranking: the top-k gates open (log α ≥ 0), the rest closed.
        log_score = torch.log(prep.attention_old.clamp_min(1e-30))
        threshold = torch.topk(log_score, p.k).values[-1]
        log_alpha = (log_score - threshold).clamp(-6.0, 6.0).detach().clone().requires_grad_(True)
        v_old = prep.v_old.detach().clone().requires_grad_(True)
        opt = torch.optim.Adam([{"params": [log_alpha], "lr": cfg.lr}, {"params": [v_old], "lr": cfg.value_lr}])
        shift = cfg.beta * math.log(-cfg.gamma / cfg.zeta)
        history = []
        for _ in range(cfg.steps):
            opt.zero_grad()
            z = _hard_concrete(log_alpha, cfg, generator)
            expected_open = torch.sigmoid(log_alpha - shift).sum()
            loss = _gated_loss(prep, z, v_old) + cfg.budget_weight * ((expected_open - p.k) / n_old) ** 2
            loss.backward()
            opt.step()
            history.append(loss.item())
        index = torch.topk(log_alpha.detach(), p.k).indices.sort().values
        vals = prep.ridge(prep.k_old[index], cfg.ridge) if cfg.refit else v_old.detach()[index]
        sol = _selection(prep, index, vals, started)
        sol.history = history
        out.append(sol)
    return out
