"""The per-head distillation problem, its objective, and the eviction baselines (KVSculpt §3.1–3.4, §4).

One :class:`Problem` is one layer and KV head: the full post-RoPE cache ``K, V`` ``[N, d]``, its
training queries ``Q`` ``[n_q, d]`` (the ``g`` query heads' queries stacked, §3.3), the retain-zone
size ``m`` and the budget ``k``. Every method maps a batch of problems to one :class:`Solution`
each: ``k`` key/value pairs that replace the compress zone (the oldest ``N − m`` pairs), so the
compressed cache is ``[K_c; K_ret]`` of length ``k + m``.

The objective (§3.2, Eq. loss) compares the full cache with the compressed one on the training
queries, attending to *all* cached keys (no causal mask, as the paper's ``Y = softmax(Q K_fullᵀ/√d) V_full``):

    L = mean((Ŷ − Y)²) + mean((ℓ̂ − ℓ)²)

with ``Y``, ``ℓ`` the full cache's attention output ``[n_q, d]`` and log-sum-exp ``[n_q]``. Both terms
are means (over ``n_q·d`` and ``n_q`` entries), the paper's "normalized by the number of queries".

The V-step (§3.4) is ridge regression with fixed attention weights
``A = softmax(Q K_catᵀ/√d) = [A_c, A_r]``:

    V_c = argmin ‖A_c V_c + A_r V_ret − Y‖²_F + λ‖V_c‖²_F = (A_cᵀA_c + λI)⁻¹ A_cᵀ (Y − A_r V_ret)

Baselines (§4): ``random`` (k random old positions), ``attention_score`` (H2O-style: the top-k old
positions by attention accumulated over the training queries), ``select_fit`` (attention-score
selection + ridge values; KVSculpt's starting point) and ``joint_opt`` (Hard Concrete gates over
the old positions trained jointly with values, then the top-k gates kept).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

RIDGE = 1e-3
"""λ of the V-step ridge regression (§3.4, §4)."""


@dataclass
class Problem:
    """One layer + KV head distillation problem (§3.1).

    Attributes:
        keys: ``[N, d]`` post-RoPE keys of the full cache (oldest first).
        values: ``[N, d]`` values.
        queries: ``[n_q, d]`` training queries, or ``[g, n_q, d]`` (stacked to ``[g·n_q, d]``).
        m: retain-zone size: the last ``m`` pairs are kept unchanged.
        k: number of pairs that replace the compress zone, ``0 ≤ k ≤ N − m``.
        scale: score scale, ``1/√d`` when ``None``.
        layer, head: where the problem comes from (bookkeeping only).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    m: int
    k: int
    scale: float | None = None
    layer: int = 0
    head: int = 0

    def __post_init__(self):
        if self.keys.ndim != 2:
            raise ValueError(f"keys has shape {tuple(self.keys.shape)}: expected [N, head_dim]")
        if self.values.shape != self.keys.shape:
            raise ValueError(f"values has shape {tuple(self.values.shape)}: expected the keys' shape "
                             f"{tuple(self.keys.shape)} ([N, head_dim])")
        if self.queries.ndim == 3:
            self.queries = self.queries.reshape(-1, self.queries.shape[-1])
        if self.queries.ndim != 2 or self.queries.shape[-1] != self.keys.shape[-1]:
            raise ValueError(f"queries has shape {tuple(self.queries.shape)}: expected [n_q, {self.keys.shape[-1]}] "
                             f"or [g, n_q, {self.keys.shape[-1]}] (head_dim of the keys)")
        N = self.keys.shape[0]
        if not 0 <= self.m < N:
            raise ValueError(f"m={self.m}: expected 0 ≤ m < N={N}")
        if not 0 <= self.k <= N - self.m:
            raise ValueError(f"k={self.k}: expected 0 ≤ k ≤ N − m = {N - self.m} (layer {self.layer}, head {self.head})")

    @property
    def n(self) -> int:
        """Context length ``N``."""
        return self.keys.shape[0]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[1]


@dataclass
class Solution:
    """What a method returns for one problem.

    Attributes:
        keys, values: ``[k, d]`` pairs replacing the compress zone.
        loss: objective of the returned pairs on the training queries.
        initial_loss: objective at the method's starting point (KVSculpt: Select+Fit's solution);
            equal to ``loss`` for one-shot methods.
        indices: ``[k]`` original positions kept (selection methods), else ``None``.
        output_mse, lse_mse: the two terms of ``loss``.
        seconds: wall time spent on this problem.
        history: objective after each outer step (iterative methods).
    """

    keys: torch.Tensor
    values: torch.Tensor
    loss: float
    initial_loss: float
    indices: torch.Tensor | None = None
    output_mse: float = float("nan")
    lse_mse: float = float("nan")
    seconds: float = 0.0
    history: list[float] = field(default_factory=list)


class Prepared:
    """A problem's fixed tensors in the solver dtype: scaled queries, full-cache targets, retain scores.

    Attributes:
        q: ``[n_q, d]`` queries times the score scale.
        k_old, v_old: ``[N − m, d]`` the compress zone.
        v_ret: ``[m, d]`` retained values.
        s_old, s_ret: ``[n_q, N − m]`` and ``[n_q, m]`` full-cache scores.
        y: ``[n_q, d]`` full attention output; lse: ``[n_q]`` its log-sum-exp.
    """

    def __init__(self, problem: Problem, dtype: torch.dtype = torch.float32, device=None):
        device = problem.keys.device if device is None else torch.device(device)
        scale = problem.scale if problem.scale is not None else problem.head_dim ** -0.5
        keys = problem.keys.to(device=device, dtype=dtype)
        values = problem.values.to(device=device, dtype=dtype)
        self.problem = problem
        self.q = problem.queries.to(device=device, dtype=dtype) * scale
        cut = problem.n - problem.m
        self.k_old, self.v_old = keys[:cut], values[:cut]
        self.v_ret = values[cut:]
        scores = self.q @ keys.T  # [n_q, N]
        self.lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - self.lse[:, None])
        self.y = probs @ values
        self.attention_old = probs[:, :cut].sum(dim=0)  # [N − m] accumulated attention (importance)
        self.s_old, self.s_ret = scores[:, :cut], scores[:, cut:]

    def weights(self, k_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention weights ``A`` ``[n_q, k + m]`` over ``[K_c; K_ret]`` and their log-sum-exp ``[n_q]``."""
        scores = torch.cat([self.q @ k_c.T, self.s_ret], dim=1)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[:, None]), lse

    def terms(self, k_c: torch.Tensor, v_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's two terms (output MSE, LSE MSE) for compressed pairs ``[k, d]``."""
        a, lse = self.weights(k_c)
        k = k_c.shape[0]
        y_hat = a[:, :k] @ v_c + a[:, k:] @ self.v_ret
        return torch.mean((y_hat - self.y) ** 2), torch.mean((lse - self.lse) ** 2)

    def loss(self, k_c: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
        """Objective (§3.2): output MSE + LSE MSE, a 0-d tensor."""
        out, lse = self.terms(k_c, v_c)
        return out + lse

    def ridge(self, k_c: torch.Tensor, lam: float = RIDGE) -> torch.Tensor:
        """V-step (§3.4): ridge-regression values ``[k, d]`` for keys ``k_c`` ``[k, d]`` (solved in float64)."""
        with torch.no_grad():
            a, _ = self.weights(k_c)
            k = k_c.shape[0]
            a = a.double()
            a_c, a_r = a[:, :k], a[:, k:]
            residual = self.y.double() - a_r @ self.v_ret.double()
            gram = a_c.T @ a_c + lam * torch.eye(k, dtype=torch.float64, device=a.device)
            v = torch.linalg.solve(gram, a_c.T @ residual)
        return v.to(k_c.dtype)

    def top_attention(self, k: int) -> torch.Tensor:
        """``[k]`` old positions with the largest accumulated attention, in position order."""
        return torch.topk(self.attention_old, k).indices.sort().values

    def solution(self, keys, values, *, initial_loss=None, indices=None, seconds=0.0, history=None) -> Solution:
        with torch.no_grad():
            out, lse = self.terms(keys, values)
        loss = float(out + lse)
        return Solution(keys=keys.detach(), values=values.detach(), loss=loss,
                        initial_loss=loss if initial_loss is None else float(initial_loss),
                        indices=indices, output_mse=float(out), lse_mse=float(lse), seconds=seconds,
                        history=list(history or []))


def ridge_values(problem: Problem, keys: torch.Tensor, lam: float = RIDGE, dtype=torch.float64) -> torch.Tensor:
    """Ridge-regression values ``[k, d]`` for given compressed keys ``[k, d]`` (§3.4 V-step)."""
    return Prepared(problem, dtype=dtype).ridge(keys.to(dtype), lam)


def problem_loss(problem: Problem, keys: torch.Tensor, values: torch.Tensor, dtype=torch.float64) -> float:
    """The §3.2 objective of compressed pairs ``keys, values`` ``[k, d]`` on ``problem``."""
    return float(Prepared(problem, dtype=dtype).loss(keys.to(dtype), values.to(dtype)))


def _selection(prep: Prepared, index: torch.Tensor, values: torch.Tensor | None, started: float) -> Solution:
    index = index.to(prep.k_old.device)
    keys = prep.k_old[index]
    vals = prep.v_old[index] if values is None else values
    return prep.solution(keys, vals, indices=index.cpu(), seconds=time.perf_counter() - started)


def random_selection(problems: Sequence[Problem], *, seed: int = 0, dtype=torch.float32,
                     device=None) -> list[Solution]:
    """Random (§4): keep ``k`` uniformly random old positions with their original keys and values."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        index = torch.randperm(p.n - p.m, generator=generator)[: p.k].sort().values
        out.append(_selection(prep, index, None, started))
    return out


def attention_score(problems: Sequence[Problem], *, dtype=torch.float32, device=None) -> list[Solution]:
    """Attention Score (§4, H2O-style): the top-``k`` old positions by attention accumulated over the
    training queries (softmax over the full cache, summed over all queries and query heads)."""
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        out.append(_selection(prep, prep.top_attention(p.k), None, started))
    return out


def select_fit(problems: Sequence[Problem], *, ridge: float = RIDGE, dtype=torch.float32,
               device=None) -> list[Solution]:
    """Select+Fit (§4): attention-score selection, then ridge-regression values (λ = ``ridge``)."""
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        index = prep.top_attention(p.k)
        out.append(_selection(prep, index, prep.ridge(prep.k_old[index], ridge), started))
    return out


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
    return torch.mean((y_hat - prep.y) ** 2) + torch.mean((lse_hat - prep.lse) ** 2)


def joint_opt(problems: Sequence[Problem], config: JointConfig | None = None, *, seed: int = 0,
              dtype=torch.float32, device=None, progress: bool = True) -> list[Solution]:
    """Joint Optimization (§4): Hard Concrete gates over the old positions, trained jointly with their
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
