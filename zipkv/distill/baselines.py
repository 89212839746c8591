"""The eviction baselines of KVSculpt §4: Random, Attention Score, Select+Fit, Joint Optimization.

Baselines (§4): ``random`` (k random old positions), ``attention_score`` (H2O-style: the top-k old
positions by attention accumulated over the training queries), ``select_fit`` (attention-score
selection + ridge values; KVSculpt's starting point) and ``joint_opt`` (Hard Concrete gates over
the old positions trained jointly with values, then the top-k gates kept).

They run batched: all problems of one shape (a context's layers × heads) go through one set of
batched kernels (:class:`~zipkv.distill.problem.PreparedBatch`, ragged ``k`` padded and masked; Joint
Optimization as one Adam over every problem's gates and values), with one host sync per batch.
Their one-problem-at-a-time references are in :mod:`.reference`.

The problem, its objective and the solver types live in :mod:`.problem` (re-exported here).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from .problem import (CHUNK_ELEMENTS, RIDGE, Prepared, PreparedBatch, Problem, Solution, chunk_for, objective,
                      problem_groups, problem_loss, ridge_solve, ridge_values)

__all__ = ["CHUNK_ELEMENTS", "JointConfig", "Prepared", "PreparedBatch", "Problem", "RIDGE", "Solution",
           "attention_score", "chunk_for", "joint_opt", "problem_groups", "problem_loss", "random_selection",
           "ridge_solve", "ridge_values", "select_fit"]


# --- Joint Optimization: Hard Concrete gates (Louizos et al., 2018) ---------------------------------------

@dataclass
class JointConfig:
    """Joint Optimization settings (the paper gives none; these are ours).

    Gates ``z_i ∈ [0, 1]`` on the ``N − m`` old positions follow the Hard Concrete distribution
    (temperature ``beta``, stretch ``(gamma, zeta)``); a gated key contributes ``z_i·exp(score_i)`` to
    the softmax. Gate logits and the old values are trained with Adam on the §3.2 objective plus
    ``budget_weight · ((E‖z‖₀ − k)/(N − m))²``, which pulls the expected number of open gates to ``k``.
    The ``k`` positions with the largest gate logits are kept; with ``refit`` their values are
    re-solved by the ridge V-step, else the trained values are kept.
    """

    steps: int = 200
    lr: float = 0.05
    value_lr: float = 0.01
    beta: float = 2.0 / 3.0
    gamma: float = -0.1
    zeta: float = 1.1
    budget_weight: float = 10.0
    refit: bool = True
    ridge: float = RIDGE


def _run_grouped(problems: Sequence[Problem], body, dtype, device, chunk_elements) -> list[Solution]:
    """``body(PreparedBatch, member_indices) -> solutions`` over shape groups; solutions in input order."""
    out: list[Solution | None] = [None] * len(problems)
    for members in problem_groups(problems, chunk_for(problems, device, chunk_elements)):
        started = time.perf_counter()
        batch = PreparedBatch([problems[i] for i in members], dtype, device)
        sols = body(batch, members, started)
        for i, s in zip(members, sols):
            out[i] = s
    return out


def _selected(batch: PreparedBatch, index: torch.Tensor, refit: float | None, started: float) -> list[Solution]:
    keys = batch.gather_old(index)
    values = batch.gather_old(index, values=True) if refit is None else batch.ridge(keys, refit)
    sols = batch.solutions(keys, values, indices=index)
    seconds = (time.perf_counter() - started) / len(batch)
    for s in sols:
        s.seconds = seconds
    return sols


def random_selection(problems: Sequence[Problem], *, seed: int = 0, dtype=torch.float32, device=None,
                     chunk_elements: int | None = None) -> list[Solution]:
    """Random (§4): keep ``k`` uniformly random old positions with their original keys and values.

    The positions are drawn per problem in input order from one generator seeded with ``seed``
    (exactly :func:`~zipkv.distill.reference.random_selection_reference`'s draws); the rest runs batched."""
    generator = torch.Generator().manual_seed(seed)
    drawn = [torch.randperm(p.n - p.m, generator=generator)[: p.k].sort().values for p in problems]

    def body(batch, members, started):
        index = torch.zeros(len(members), batch.kmax, dtype=torch.long)
        for j, i in enumerate(members):
            index[j, : problems[i].k] = drawn[i]
        return _selected(batch, index.to(batch.device), None, started)

    return _run_grouped(problems, body, dtype, device, chunk_elements)


def attention_score(problems: Sequence[Problem], *, dtype=torch.float32, device=None,
                    chunk_elements: int | None = None) -> list[Solution]:
    """Attention Score (§4, H2O-style): the top-``k`` old positions by attention accumulated over the
    training queries (softmax over the full cache, summed over all queries and query heads)."""
    return _run_grouped(problems, lambda b, _, t: _selected(b, b.top_attention(), None, t), dtype, device,
                        chunk_elements)


def select_fit(problems: Sequence[Problem], *, ridge: float = RIDGE, dtype=torch.float32, device=None,
               chunk_elements: int | None = None) -> list[Solution]:
    """Select+Fit (§4): attention-score selection, then ridge-regression values (λ = ``ridge``)."""
    return _run_grouped(problems, lambda b, _, t: _selected(b, b.top_attention(), ridge, t), dtype, device,
                        chunk_elements)


def joint_opt(problems: Sequence[Problem], config: JointConfig | None = None, *, seed: int = 0,
              dtype=torch.float32, device=None, progress: bool = True,
              chunk_elements: int | None = None) -> list[Solution]:
    """Joint Optimization (§4): Hard Concrete gates over the old positions, trained jointly with their
    values, then the top-``k`` gates kept (see :class:`JointConfig`).

    All problems of a shape train together: one Adam over ``[P, N − m]`` gate logits and ``[P, N − m, d]``
    values on the sum of the per-problem objectives. Each problem's objective depends only on its own
    parameters and Adam is elementwise, so every problem follows exactly its own Adam trajectory
    (:func:`~zipkv.distill.reference.joint_opt_reference`'s), to the rounding of batched matmuls. The gate noise is the
    reference's: one generator seeded with ``seed``, drawn problem after problem (``steps·(N − m)``
    uniforms each, problems with nothing to choose draw none), so each problem sees the same noise.
    """
    cfg = config or JointConfig()
    generator = torch.Generator().manual_seed(seed)
    trains = [0 < p.k < p.n - p.m for p in problems]
    noise_u: list[torch.Tensor | None] = []
    for p, t in zip(problems, trains):  # the reference's stream, problem by problem, step by step
        if t and cfg.steps > 0:
            u = torch.rand(cfg.steps * (p.n - p.m), generator=generator, dtype=torch.float64)
            noise_u.append(u.to(dtype).view(cfg.steps, p.n - p.m))
        else:
            noise_u.append(None)
    out: list[Solution | None] = [None] * len(problems)
    plain = [i for i, t in enumerate(trains) if not t]
    if plain:  # nothing to choose: none or all of the old positions
        sols = select_fit([problems[i] for i in plain], ridge=cfg.ridge, dtype=dtype, device=device) if cfg.refit \
            else _keep_all([problems[i] for i in plain], dtype, device)
        for i, s in zip(plain, sols):
            if cfg.refit:
                s.indices = torch.arange(problems[i].k)
            out[i] = s
    train = [i for i, t in enumerate(trains) if t]
    sub = [problems[i] for i in train]
    chunks = problem_groups(sub, chunk_for(sub, device, chunk_elements))
    bar = tqdm(total=cfg.steps * len(chunks), desc="joint_opt", disable=not progress or not train, leave=False)
    for members in chunks:
        started = time.perf_counter()
        chunk = [sub[j] for j in members]
        batch = PreparedBatch(chunk, dtype, device)
        u = torch.stack([noise_u[train[j]] for j in members], dim=1) if cfg.steps > 0 else None  # [steps, P, n_old]
        sols = _joint_batch(batch, cfg, u, bar)
        seconds = (time.perf_counter() - started) / len(chunk)
        for j, s in zip(members, sols):
            s.seconds = seconds
            out[train[j]] = s
    bar.close()
    return out


def _keep_all(problems, dtype, device):
    """k ∈ {0, N − m} without refit: the old pairs themselves (positions 0 … k−1)."""
    def body(batch, members, started):
        index = torch.arange(batch.kmax, device=batch.device).expand(len(members), -1).clone()
        return _selected(batch, index, None, started)
    return _run_grouped(problems, body, dtype, device, None)


def _joint_batch(batch: PreparedBatch, cfg: JointConfig, u: torch.Tensor | None, bar) -> list[Solution]:
    """Joint Optimization on one batch of problems that all have ``0 < k < N − m`` (see :func:`joint_opt`)."""
    P, n_old = len(batch), batch.cut
    ks = batch.ks.to(batch.dtype)
    with torch.no_grad():
        # Start from the attention-score ranking: the top-k gates open (log α ≥ 0), the rest closed.
        log_score = torch.log(batch.attention_old.clamp_min(1e-30))
        top = torch.topk(log_score, batch.kmax, dim=1).values
        threshold = top.gather(1, (batch.ks - 1)[:, None])  # the k-th largest, per problem
        log_alpha0 = (log_score - threshold).clamp(-6.0, 6.0)
        # the reference's per-step constants: exp(s_old − ℓ) and the retain zone's weights
        e_old = torch.exp(batch.s_old - batch.lse[..., None])  # [P, n_q, n_old]
        w_ret = torch.exp(batch.s_ret - batch.lse[..., None])
        ret_total = w_ret.sum(dim=-1)
        ret_out = torch.bmm(w_ret, batch.v_ret)
        del w_ret
        noise = None
        if u is not None:  # log u − log(1 − u) of the clamped uniforms, as the reference computes them
            u = u.to(batch.device).clamp(1e-6, 1 - 1e-6)
            noise = torch.log(u) - torch.log1p(-u)
            del u
    tiny = torch.finfo(batch.dtype).tiny
    d = batch.q.shape[2]
    log_alpha = log_alpha0.detach().clone().requires_grad_(True)
    v_old = batch.v_old.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([{"params": [log_alpha], "lr": cfg.lr}, {"params": [v_old], "lr": cfg.value_lr}])
    shift = cfg.beta * math.log(-cfg.gamma / cfg.zeta)
    history = torch.empty(cfg.steps, P, dtype=batch.dtype, device=batch.device)
    for step in range(cfg.steps):
        opt.zero_grad()
        s = torch.sigmoid((noise[step] + log_alpha) / cfg.beta)
        z = (s * (cfg.zeta - cfg.gamma) + cfg.gamma).clamp(0.0, 1.0)
        expected_open = torch.sigmoid(log_alpha - shift).sum(dim=1)
        w_old = z[:, None, :] * e_old
        total = w_old.sum(dim=2) + ret_total
        y_hat = (torch.bmm(w_old, v_old) + ret_out) / total[..., None]
        lse_hat = batch.lse + torch.log(total.clamp_min(tiny))
        out, lse = objective(y_hat, lse_hat, batch.y, batch.lse)
        loss = out + lse + cfg.budget_weight * ((expected_open - ks) / n_old) ** 2
        loss.sum().backward()
        opt.step()
        history[step] = loss.detach()
        if bar is not None:
            bar.update(1)
    del e_old, noise
    with torch.no_grad():
        index = torch.zeros(P, batch.kmax, dtype=torch.long, device=batch.device)
        la = log_alpha.detach()
        for k in sorted(set(batch.ks_list)):
            rows = [i for i, kk in enumerate(batch.ks_list) if kk == k]
            r = torch.tensor(rows, device=batch.device)
            index[r, :k] = torch.topk(la[r], k, dim=1).indices.sort(dim=1).values
        keys = batch.gather_old(index)
        if cfg.refit:
            values = batch.ridge(keys, cfg.ridge)
        else:
            values = v_old.detach().gather(1, index[..., None].expand(-1, -1, d)) * batch.mask[..., None].to(batch.dtype)
    hist = history.T.tolist()
    return batch.solutions(keys, values, indices=index, histories=hist)
