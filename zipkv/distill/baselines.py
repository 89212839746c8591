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

The four baselines run batched: all problems of one shape (a context's layers × heads) go through
one set of batched kernels (:class:`PreparedBatch`, ragged ``k`` padded and masked; Joint
Optimization as one Adam over every problem's gates and values), with one host sync per batch.
The one-problem-at-a-time originals stay as ``*_reference`` and the tests check that both give the
same positions and, to rounding, the same values, losses and (Joint Optimization) loss histories.
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


def ridge_solve(a_c: torch.Tensor, residual: torch.Tensor, lam: float,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The V-step's least squares (§3.4) for a batch of problems, in the inputs' dtype (float64 here).

    ``a_c`` ``[P, n_q, k]`` attention weights of the compressed keys, ``residual`` ``[P, n_q, d]`` what they
    must produce; returns values ``[P, k, d]`` minimising ``‖a_c V − residual‖² + λ‖V‖²`` and ``[P]`` True
    where the system was finite. ``mask`` ``[P, k]`` marks real keys: padded rows and columns of ``AᵀA`` are
    zero, so with 1 instead of λ on their diagonal the padded block is the identity with a zero right-hand
    side and the real block is exactly the problem's own system. A non-finite system (keys that overflow)
    is solved as the identity, zero values, so one problem cannot make the batched solve fail for all.

    ``AᵀA + λI`` is symmetric positive definite (λ > 0), so the batch is solved by Cholesky. Not by
    ``torch.linalg.solve``: torch 2.13's CPU build returns garbage LU pivots for a batch of large systems
    when it runs on more than one thread (``lu_solve`` then raises, or MKL prints ``DLASWP`` errors).
    A system whose Cholesky fails (not positive definite to rounding) is solved alone by LU.
    """
    k = a_c.shape[-1]
    lam_t = torch.full((k,), lam, dtype=a_c.dtype, device=a_c.device)
    diag = lam_t.expand(a_c.shape[0], k) if mask is None else torch.where(mask, lam_t, torch.ones_like(lam_t))
    gram = torch.bmm(a_c.transpose(1, 2), a_c) + torch.diag_embed(diag)
    rhs = torch.bmm(a_c.transpose(1, 2), residual)
    ok = torch.isfinite(gram).all(dim=(1, 2)) & torch.isfinite(rhs).all(dim=(1, 2))
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    gram, rhs = torch.where(ok[:, None, None], gram, eye), torch.where(ok[:, None, None], rhs, 0.0)
    factor, info = torch.linalg.cholesky_ex(gram)
    v = torch.cholesky_solve(rhs, factor)
    for i in (info != 0).nonzero().flatten().tolist():
        v[i] = torch.linalg.solve(gram[i], rhs[i])
    return (v if mask is None else v * mask[..., None]), ok


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
            v, _ = ridge_solve(a_c[None], residual[None], lam)
        return v[0].to(k_c.dtype)

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


def random_selection_reference(problems: Sequence[Problem], *, seed: int = 0, dtype=torch.float32,
                               device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`random_selection`. Random (§4): keep ``k`` uniformly random old positions with their original keys and values."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        index = torch.randperm(p.n - p.m, generator=generator)[: p.k].sort().values
        out.append(_selection(prep, index, None, started))
    return out


def attention_score_reference(problems: Sequence[Problem], *, dtype=torch.float32, device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`attention_score`. Attention Score (§4, H2O-style): the top-``k`` old positions by attention accumulated over the
    training queries (softmax over the full cache, summed over all queries and query heads)."""
    out = []
    for p in problems:
        started = time.perf_counter()
        prep = Prepared(p, dtype, device)
        out.append(_selection(prep, prep.top_attention(p.k), None, started))
    return out


def select_fit_reference(problems: Sequence[Problem], *, ridge: float = RIDGE, dtype=torch.float32,
                         device=None) -> list[Solution]:
    """Reference (one problem at a time) of :func:`select_fit`. Select+Fit (§4): attention-score selection, then ridge-regression values (λ = ``ridge``)."""
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


def joint_opt_reference(problems: Sequence[Problem], config: JointConfig | None = None, *, seed: int = 0,
                        dtype=torch.float32, device=None, progress: bool = True) -> list[Solution]:
    """Reference (one problem at a time, ``torch.optim.Adam`` per problem) of :func:`joint_opt`. Joint Optimization (§4): Hard Concrete gates over the old positions, trained jointly with their
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


# --- batched: every problem of a shape at once ------------------------------------------------------------
#
# The functions above loop over problems with small torch ops (and a host sync or three per problem);
# on a GPU that is launch- and sync-bound. The ones below run the same computations on all problems
# of one shape (N, m, n_q, head_dim) at once — a layer × head batch is one set of batched kernels —
# with ragged k padded to the largest k (padded keys get −inf scores, so zero weight; padded ridge
# rows are the identity with a zero right-hand side) and one host sync per batch. They equal the
# per-problem references to rounding (batched vs. single matmuls), which the tests check.

CHUNK_ELEMENTS = {"cuda": 1 << 28, "cpu": 1 << 22}
"""Largest ``problems × n_q × N`` score tensor one batch holds, per device type: on a GPU 1 GiB in float32
(a whole 30 × 3-head context at N = 2048 in one batch); on the CPU 16 MiB (one problem at N = 2048, a whole
context at N = 256: the CPU is compute-bound at large sizes and gains nothing from larger batches, while
allocations above glibc's 32 MiB mmap threshold page-fault afresh every time). Bigger sets are split."""


def chunk_for(problems: Sequence[Problem], device=None, chunk_elements: int | None = None) -> int:
    """``chunk_elements`` if given, else :data:`CHUNK_ELEMENTS` for the device the problems run on."""
    if chunk_elements is not None:
        return chunk_elements
    dev = torch.device(device) if device is not None else (problems[0].keys.device if problems else torch.device("cpu"))
    return CHUNK_ELEMENTS.get(dev.type, CHUNK_ELEMENTS["cuda"])


def problem_groups(problems: Sequence[Problem], chunk_elements: int | None = None) -> list[list[int]]:
    """Indices of ``problems`` grouped by shape ``(N, m, n_q, head_dim)`` (first-seen order), each group
    split into chunks of at most ``chunk_elements // (n_q·N)`` problems (``None``: no split)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault((p.n, p.m, p.queries.shape[0], p.head_dim), []).append(i)
    out = []
    for (n, _, n_q, _), idx in groups.items():
        size = len(idx) if chunk_elements is None else max(1, chunk_elements // max(n_q * n, 1))
        out.extend(idx[s:s + size] for s in range(0, len(idx), size))
    return out


class PreparedBatch:
    """:class:`Prepared` for ``P`` problems of one shape at once (each with its own ``k`` and scale).

    Attributes (batched versions of :class:`Prepared`'s):
        q: ``[P, n_q, d]``; k_old, v_old: ``[P, N − m, d]``; v_ret: ``[P, m, d]``;
        s_old, s_ret: ``[P, n_q, N − m]``, ``[P, n_q, m]``; y: ``[P, n_q, d]``; lse: ``[P, n_q]``;
        attention_old: ``[P, N − m]``; ks: ``[P]`` int64 budgets (on the device).
    """

    def __init__(self, problems: Sequence[Problem], dtype: torch.dtype = torch.float32, device=None):
        if not problems:
            raise ValueError("PreparedBatch needs at least one problem")
        p0 = problems[0]
        shape = (p0.n, p0.m, p0.queries.shape[0], p0.head_dim)
        for p in problems:
            if (p.n, p.m, p.queries.shape[0], p.head_dim) != shape:
                raise ValueError(f"problem (layer {p.layer}, head {p.head}) has shape (N, m, n_q, d) = "
                                 f"{(p.n, p.m, p.queries.shape[0], p.head_dim)}, expected {shape}")
        device = p0.keys.device if device is None else torch.device(device)
        self.problems = list(problems)
        self.dtype, self.device = dtype, device
        scales = [p.scale if p.scale is not None else p.head_dim ** -0.5 for p in problems]
        keys = torch.stack([p.keys for p in problems]).to(device=device, dtype=dtype)
        values = torch.stack([p.values for p in problems]).to(device=device, dtype=dtype)
        q = torch.stack([p.queries for p in problems]).to(device=device, dtype=dtype)
        if len(set(scales)) == 1:
            self.q = q * scales[0]
        else:
            self.q = q * torch.tensor(scales, dtype=dtype, device=device)[:, None, None]
        cut = p0.n - p0.m
        self.cut = cut
        self.k_old, self.v_old = keys[:, :cut], values[:, :cut]
        self.v_ret = values[:, cut:]
        scores = torch.bmm(self.q, keys.transpose(1, 2))  # [P, n_q, N]
        self.lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - self.lse[..., None])
        self.y = torch.bmm(probs, values)
        self.attention_old = probs[..., :cut].sum(dim=1)
        del probs
        self.s_old, self.s_ret = scores[..., :cut], scores[..., cut:]
        self.ks_list = [p.k for p in problems]
        self.kmax = max(self.ks_list)
        self.ks = torch.tensor(self.ks_list, dtype=torch.long, device=device)
        self.mask = torch.arange(self.kmax, device=device)[None] < self.ks[:, None]  # [P, k_max]

    def __len__(self) -> int:
        return len(self.problems)

    def prepared(self, i: int) -> Prepared:
        """Problem ``i`` as a :class:`Prepared` (views into this batch's tensors)."""
        prep = object.__new__(Prepared)
        prep.problem = self.problems[i]
        for name in ("q", "k_old", "v_old", "v_ret", "lse", "y", "attention_old", "s_old", "s_ret"):
            setattr(prep, name, getattr(self, name)[i])
        return prep

    def top_attention(self) -> torch.Tensor:
        """``[P, k_max]`` each problem's top-``k`` old positions by accumulated attention, in position
        order (then zeros on padding): :meth:`Prepared.top_attention` per row."""
        index = torch.zeros(len(self), self.kmax, dtype=torch.long, device=self.device)
        for k in sorted(set(self.ks_list)):
            rows = [i for i, kk in enumerate(self.ks_list) if kk == k]
            if k == 0:
                continue
            if len(rows) == len(self):
                index[:, :k] = torch.topk(self.attention_old, k, dim=1).indices.sort(dim=1).values
            else:
                r = torch.tensor(rows, device=self.device)
                index[r, :k] = torch.topk(self.attention_old[r], k, dim=1).indices.sort(dim=1).values
        return index

    def gather_old(self, index: torch.Tensor, values: bool = False) -> torch.Tensor:
        """``[P, k_max, d]`` old keys (or values) at ``index`` ``[P, k_max]``, zero on padding."""
        src = self.v_old if values else self.k_old
        out = src.gather(1, index[..., None].expand(-1, -1, src.shape[-1]))
        return out * self.mask[..., None].to(out.dtype)

    def weights(self, k_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P, n_q, k_max + m]`` attention weights over ``[K_c; K_ret]`` (0 on padded keys) and ``[P, n_q]``
        log-sum-exp: :meth:`Prepared.weights` per problem."""
        s_c = torch.bmm(self.q, k_c.transpose(1, 2)).masked_fill(~self.mask[:, None, :], -math.inf)
        scores = torch.cat([s_c, self.s_ret], dim=-1)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse[..., None]), lse

    def terms(self, k_c: torch.Tensor, v_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P]`` output MSE and ``[P]`` LSE MSE for padded compressed pairs ``[P, k_max, d]``."""
        a, lse = self.weights(k_c)
        k = self.kmax
        y_hat = torch.bmm(a[..., :k], v_c) + torch.bmm(a[..., k:], self.v_ret)
        return torch.mean((y_hat - self.y) ** 2, dim=(1, 2)), torch.mean((lse - self.lse) ** 2, dim=1)

    def loss(self, k_c: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
        out, lse = self.terms(k_c, v_c)
        return out + lse

    def ridge(self, k_c: torch.Tensor, lam: float = RIDGE) -> torch.Tensor:
        """V-step for all problems: ``[P, k_max, d]`` ridge values (float64 solve), zero on padding."""
        with torch.no_grad():
            a, _ = self.weights(k_c)
            k = self.kmax
            a = a.double()
            a_c, a_r = a[..., :k], a[..., k:]
            residual = self.y.double() - torch.bmm(a_r, self.v_ret.double())
            v, _ = ridge_solve(a_c, residual, lam, self.mask)
        return v.to(k_c.dtype)

    def solutions(self, k_c: torch.Tensor, v_c: torch.Tensor, *, initial_loss: Sequence[float] | None = None,
                  indices: torch.Tensor | None = None, seconds: float = 0.0,
                  histories: Sequence[list] | None = None) -> list[Solution]:
        """One :class:`Solution` per problem from padded pairs ``[P, k_max, d]`` (one host sync)."""
        with torch.no_grad():
            out, lse = self.terms(k_c, v_c)
            loss = out + lse
        stats = torch.stack([loss, out, lse]).tolist()
        idx = indices.cpu() if indices is not None else None
        sols = []
        for i, k in enumerate(self.ks_list):
            ell = stats[0][i]
            sols.append(Solution(keys=k_c[i, :k].detach(), values=v_c[i, :k].detach(), loss=ell,
                                 initial_loss=ell if initial_loss is None else float(initial_loss[i]),
                                 indices=None if idx is None else idx[i, :k], output_mse=stats[1][i],
                                 lse_mse=stats[2][i], seconds=seconds,
                                 history=list(histories[i]) if histories is not None else []))
        return sols


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
    (exactly :func:`random_selection_reference`'s draws); the rest runs batched."""
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
    (:func:`joint_opt_reference`'s), to the rounding of batched matmuls. The gate noise is the
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
    n_q, d = batch.q.shape[1], batch.q.shape[2]
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
        loss = (torch.mean((y_hat - batch.y) ** 2, dim=(1, 2)) + torch.mean((lse_hat - batch.lse) ** 2, dim=1)
                + cfg.budget_weight * ((expected_open - ks) / n_old) ** 2)
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
