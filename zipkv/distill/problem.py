"""The per-head distillation problem: its data, objective, V-step and solver interface (KVSculpt §3.1–3.4).

One :class:`Problem` is one layer and KV head: the full post-RoPE cache ``K, V`` ``[N, d]``, its
training queries ``Q`` ``[n_q, d]`` (the ``g`` query heads' queries stacked, §3.3), the retain-zone
size ``m`` and the budget ``k``. Every method maps a batch of problems to one :class:`Solution`
each (a :data:`Solver`, configured by :class:`SculptConfig` for KVSculpt): ``k`` key/value pairs that
replace the compress zone (the oldest ``N − m`` pairs), so the compressed cache is ``[K_c; K_ret]``
of length ``k + m``.

The objective (§3.2, Eq. loss; :func:`objective`, the one place it is written) compares the full cache
with the compressed one on the training queries, attending to *all* cached keys (no causal mask, as
the paper's ``Y = softmax(Q K_fullᵀ/√d) V_full``):

    L = mean((Ŷ − Y)²) + mean((ℓ̂ − ℓ)²)

with ``Y``, ``ℓ`` the full cache's attention output ``[n_q, d]`` and log-sum-exp ``[n_q]``. Both terms
are means (over ``n_q·d`` and ``n_q`` entries), the paper's "normalized by the number of queries".

The V-step (§3.4) is ridge regression with fixed attention weights
``A = softmax(Q K_catᵀ/√d) = [A_c, A_r]``:

    V_c = argmin ‖A_c V_c + A_r V_ret − Y‖²_F + λ‖V_c‖²_F = (A_cᵀA_c + λI)⁻¹ A_cᵀ (Y − A_r V_ret)

:class:`Prepared` holds one problem's fixed tensors in the solver dtype, :class:`PreparedBatch` those
of many problems of one shape at once.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

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
        if self.queries.shape[0] == 0:
            raise ValueError("queries is empty: the objective needs at least one training query (m + n_synthetic ≥ 1)")
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


@dataclass
class SculptConfig:
    """KVSculpt solver settings; defaults are the paper's (§4 "KVSculpt configuration").

    Attributes:
        steps: outer L-BFGS steps (paper: 100; the quick profile uses fewer; 0: Select+Fit's start).
        lr: L-BFGS learning rate.
        inner_iterations: L-BFGS ``max_iter`` per outer step.
        value_every: V-step (ridge) every this many outer steps.
        ridge: λ of the V-step.
        history_size: L-BFGS memory.
        reset_history: restart L-BFGS after each V-step (not the paper's; see :mod:`.kvsculpt`).
        dtype: solver dtype.
        device: where to solve (default: the problem tensors' device).
        progress: a tqdm bar over problems.
    """

    steps: int = 100
    lr: float = 0.5
    inner_iterations: int = 10
    value_every: int = 5
    ridge: float = RIDGE
    history_size: int = 100
    reset_history: bool = False
    dtype: torch.dtype = torch.float32
    device: str | torch.device | None = None
    progress: bool = True

    def __post_init__(self):
        for name, low in (("steps", 0), ("inner_iterations", 1), ("value_every", 1), ("history_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"SculptConfig({name}={value!r}): expected an integer ≥ {low}")
            setattr(self, name, int(value))                  # a NumPy integer as the int the solvers expect
        for name, positive in (("lr", True), ("ridge", False)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or value < 0 or (positive and value == 0)):
                raise ValueError(f"SculptConfig({name}={value!r}): expected a finite number {'>' if positive else '≥'} 0")
        check_solver_device(self)


Solver = Callable[[Sequence[Problem], SculptConfig], list[Solution]]
"""A batch solver: problems (each with its own ``k``) and settings → one solution per problem."""


def objective(y_hat: torch.Tensor, lse_hat: torch.Tensor, y: torch.Tensor,
              lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The §3.2 objective's two terms, output MSE and LSE MSE, per problem.

    ``y_hat``, ``y`` ``[..., n_q, d]`` the compressed and full caches' attention outputs; ``lse_hat``,
    ``lse`` ``[..., n_q]`` their log-sum-exps. Returns ``[...]`` twice; the loss is their sum.
    """
    return (y_hat - y).square().mean(dim=(-2, -1)), (lse_hat - lse).square().mean(dim=-1)


def objective_grad(y_hat: torch.Tensor, lse_hat: torch.Tensor, y: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of :func:`objective`'s sum in ``y_hat`` ``[..., n_q, d]`` and ``lse_hat`` ``[..., n_q]``."""
    n_q, d = y.shape[-2], y.shape[-1]
    return (y_hat - y).mul_(2.0 / (n_q * d)), (lse_hat - lse).mul_(2.0 / n_q)


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


class _Objective:
    """The objective (§3.2) from a subclass's ``terms``: output MSE + LSE MSE (0-d, or ``[P]`` batched)."""

    def loss(self, k_c: torch.Tensor, v_c: torch.Tensor) -> torch.Tensor:
        out, lse = self.terms(k_c, v_c)
        return out + lse


class Prepared(_Objective):
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
        return objective(y_hat, lse, self.y, self.lse)

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


# --- batched: every problem of a shape at once ------------------------------------------------------------
#
# Problems of one shape (N, m, n_q, head_dim) — a context's layers × heads — as one set of batched
# kernels, with ragged k padded to the largest k (padded keys get −inf scores, so zero weight; padded
# ridge rows are the identity with a zero right-hand side) and one host sync per batch.

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


class PreparedBatch(_Objective):
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
        return objective(y_hat, lse, self.y, self.lse)

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


def check_solver_device(config) -> None:
    """A distiller's config's ``dtype`` (float32 or float64: the value solves' triangular solves need one of these)
    and ``device`` (None, or a device this machine has): a ``TypeError``/``ValueError`` naming the config's field."""
    name = type(config).__name__
    if config.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{name}(dtype={config.dtype!r}): expected torch.float32 or torch.float64")
    if config.device is not None:
        try:
            device = torch.device(config.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{name}(device={config.device!r}): expected a torch device such as 'cpu' or 'cuda'") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{name}(device={config.device!r}): this machine has no CUDA GPU")
